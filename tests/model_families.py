"""Tiny random-weight models of each architecture family the matrix covers (tests/test_architectures.py).

Each family's model is made from its transformers configuration class (no download), with 2 layers and hidden
sizes that every method's groups divide (hidden 256, intermediate 512: GPTQ/AWQ/RTN groups of 64 or 128, llama.cpp
K-quant blocks of 256), seeded, saved as safetensors, with a real tokenizer of the family's kind trained here on
the `pydocs` text (Python's own docstrings):

- byte-level BPE (Llama 3, Qwen2.5, Qwen3, Qwen3-MoE): the `tokenizers` library, with the family's own
  pre-tokenizer split pattern, a 1,024-token vocabulary and the family's special tokens;
- SentencePiece (Gemma 2, Gemma 3, Phi-3, Mistral, Mixtral): a `sentencepiece` BPE model with byte fallback
  (`tokenizer.model`, which llama.cpp's converter reads itself), loaded by the family's transformers tokenizer
  class, which writes the `tokenizer.json` transformers and qbuild read.

llama.cpp's converter names a BPE vocabulary's pre-tokenizer by hashing the token ids of a fixed test string
(`get_vocab_base_pre`); no freshly trained vocabulary has a listed hash, so it stops with "BPE pre-tokenizer was
not recognized". llama.cpp's remedy for a new tokenizer is to register its hash (convert_hf_to_gguf_update.py).
`registered_converter` does that in a copy of the installed converter: for each BPE family it adds the hash of
its tiny vocabulary, mapped to the pre-tokenizer the family's real models get ("llama-bpe" for Llama 3, "qwen2"
for Qwen), whose split pattern is the one the vocabulary was trained with. The tests point qbuild at that copy
with QBUILD_LLAMA_CPP_DIR.
"""

from __future__ import annotations

import ast
import hashlib
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

HIDDEN, INTERMEDIATE, LAYERS, HEADS, KV_HEADS, HEAD_DIM = 256, 512, 2, 4, 2, 64
VOCAB = 1024
SEED = 0
BUILD_VERSION = 1   # bump when a family's model or tokenizer changes: the cached builds are then remade

# The families' own pre-tokenizer split patterns (their tokenizer.json), the ones llama.cpp implements as
# "llama-bpe" and "qwen2": Llama 3 groups digits by up to three, Qwen by one.
LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
               r"|\s*[\r\n]+|\s+(?!\S)|\s+")


@dataclass(frozen=True)
class BPE:
    """A byte-level BPE vocabulary: the split pattern, llama.cpp's name for it, the special tokens, and whether
    the tokenizer starts a sequence with BOS."""

    split: str
    llama_cpp_pre: str
    bos: str | None
    eos: str
    specials: tuple[str, ...]


@dataclass(frozen=True)
class SPM:
    """A SentencePiece BPE model: the ids of its control tokens, whether it adds a leading space (Llama/Mistral
    do, Gemma does not), and the transformers tokenizer class that loads it."""

    tokenizer_class: str
    pieces: tuple[str, str, str, str]   # unk, bos, eos, pad
    unk: int
    bos: int
    eos: int
    pad: int | None
    dummy_prefix: bool
    control: tuple[str, ...] = ()      # more control tokens, right after the ones above


LLAMA3_BPE = BPE(LLAMA3_SPLIT, "llama-bpe", "<|begin_of_text|>", "<|end_of_text|>",
                 ("<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>"))
QWEN_BPE = BPE(QWEN2_SPLIT, "qwen2", None, "<|endoftext|>", ("<|endoftext|>", "<|im_start|>", "<|im_end|>"))
LLAMA_SPM = SPM("LlamaTokenizer", ("<unk>", "<s>", "</s>", "<pad>"), unk=0, bos=1, eos=2, pad=None, dummy_prefix=True)
# Phi-3's chat tokens are in its vocabulary; llama.cpp relies on it (its vocabulary loader looks up <|endoftext|> by
# name for any model named phi3 and fails to load one without it)
PHI3_SPM = SPM("LlamaTokenizer", ("<unk>", "<s>", "</s>", "<pad>"), unk=0, bos=1, eos=2, pad=None, dummy_prefix=True,
               control=("<|endoftext|>", "<|assistant|>", "<|end|>", "<|user|>"))
GEMMA_SPM = SPM("GemmaTokenizer", ("<unk>", "<bos>", "<eos>", "<pad>"), unk=3, bos=2, eos=1, pad=0, dummy_prefix=False,
                control=("<mask>",))


def _dims(**extra) -> dict:
    base = dict(hidden_size=HIDDEN, intermediate_size=INTERMEDIATE, num_hidden_layers=LAYERS,
                num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, vocab_size=VOCAB,
                max_position_embeddings=2048, tie_word_embeddings=False)
    return base | extra


def _llama3():
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(**_dims(head_dim=HEAD_DIM, rope_theta=500000.0,
                              rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                            "high_freq_factor": 4.0, "original_max_position_embeddings": 1024}))
    return LlamaForCausalLM, cfg


def _qwen2():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    return Qwen2ForCausalLM, Qwen2Config(**_dims(rope_theta=1000000.0))


def _qwen3():
    from transformers import Qwen3Config, Qwen3ForCausalLM

    return Qwen3ForCausalLM, Qwen3Config(**_dims(head_dim=HEAD_DIM))


def _qwen3_moe():
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    return Qwen3MoeForCausalLM, Qwen3MoeConfig(**_dims(head_dim=HEAD_DIM, num_experts=4, num_experts_per_tok=2,
                                                       moe_intermediate_size=256, decoder_sparse_step=1,
                                                       norm_topk_prob=True))   # as the real Qwen3-MoE models


def _gemma2():
    from transformers import Gemma2Config, Gemma2ForCausalLM

    return Gemma2ForCausalLM, Gemma2Config(**_dims(head_dim=HEAD_DIM, tie_word_embeddings=True,
                                                   query_pre_attn_scalar=HEAD_DIM, sliding_window=64))


def _gemma3():
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    return Gemma3ForCausalLM, Gemma3TextConfig(**_dims(head_dim=HEAD_DIM, tie_word_embeddings=True,
                                                       query_pre_attn_scalar=HEAD_DIM, sliding_window=64))


def _phi3():
    from transformers import Phi3Config, Phi3ForCausalLM

    return Phi3ForCausalLM, Phi3Config(**_dims(pad_token_id=0, bos_token_id=1, eos_token_id=2))


def _mistral():
    from transformers import MistralConfig, MistralForCausalLM

    return MistralForCausalLM, MistralConfig(**_dims(head_dim=HEAD_DIM, sliding_window=None))


def _mixtral():
    from transformers import MixtralConfig, MixtralForCausalLM

    return MixtralForCausalLM, MixtralConfig(**_dims(head_dim=HEAD_DIM, num_local_experts=4, num_experts_per_tok=2,
                                                     sliding_window=None))


@dataclass(frozen=True)
class Family:
    name: str                 # the id in test names and docs/architectures.md
    title: str
    make: Callable            # () -> (model class, config)
    tokenizer: BPE | SPM
    version: int = 1          # bump when this family's model or tokenizer changes: its cached build is remade

    @property
    def tokenizer_kind(self) -> str:
        return "byte-level BPE" if isinstance(self.tokenizer, BPE) else "SentencePiece"


FAMILIES = (
    Family("llama3", "Llama 3", _llama3, LLAMA3_BPE),
    Family("qwen2.5", "Qwen2.5", _qwen2, QWEN_BPE),
    Family("qwen3", "Qwen3", _qwen3, QWEN_BPE),
    Family("qwen3-moe", "Qwen3-MoE", _qwen3_moe, QWEN_BPE),
    Family("gemma2", "Gemma 2", _gemma2, GEMMA_SPM),
    Family("gemma3", "Gemma 3", _gemma3, GEMMA_SPM),
    Family("phi3", "Phi-3", _phi3, PHI3_SPM, version=2),
    Family("mistral", "Mistral", _mistral, LLAMA_SPM),
    Family("mixtral", "Mixtral", _mixtral, LLAMA_SPM),
)
BY_NAME = {f.name: f for f in FAMILIES}


# --- tokenizers ----------------------------------------------------------------------------------------------
def training_text() -> list[str]:
    from qbuild.calibration.corpus import pydocs_documents

    return pydocs_documents("train")


def train_bpe(spec: BPE, out: Path) -> None:
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(spec.split), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=list(spec.specials), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(training_text(), trainer)
    if spec.bos:
        bos_id = tok.token_to_id(spec.bos)
        tok.post_processor = processors.Sequence([
            processors.ByteLevel(trim_offsets=False),
            processors.TemplateProcessing(single=f"{spec.bos}:0 $A:0", pair=f"{spec.bos}:0 $A:0 {spec.bos}:1 $B:1",
                                          special_tokens=[(spec.bos, bos_id)])])
    else:
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=spec.bos, eos_token=spec.eos,
                                   pad_token=spec.eos, add_bos_token=bool(spec.bos))
    fast.save_pretrained(str(out))


def train_spm(spec: SPM, out: Path) -> None:
    import io

    import sentencepiece as spm
    import transformers

    model = io.BytesIO()
    ids = {"unk_id": spec.unk, "bos_id": spec.bos, "eos_id": spec.eos, "pad_id": -1 if spec.pad is None else spec.pad}
    ids |= dict(zip(("unk_piece", "bos_piece", "eos_piece", "pad_piece"), spec.pieces, strict=True))
    if spec.control:
        ids["control_symbols"] = list(spec.control)
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(line for doc in training_text() for line in doc.splitlines() if line.strip()),
        model_writer=model, vocab_size=VOCAB, model_type="bpe", byte_fallback=True, split_digits=True,
        character_coverage=1.0, add_dummy_prefix=spec.dummy_prefix, remove_extra_whitespaces=False,
        normalization_rule_name="identity", num_threads=1, minloglevel=2, **ids)
    (out / "tokenizer.model").write_bytes(model.getvalue())
    # from_pretrained on a directory holding only tokenizer.model converts it (sentencepiece) to tokenizer.json
    # (the family's tokenizer starts a sequence with BOS, as the real ones do)
    tok = getattr(transformers, spec.tokenizer_class).from_pretrained(str(out), add_bos_token=True)
    tok.save_pretrained(str(out))


# --- models --------------------------------------------------------------------------------------------------
def build(family: Family, out: Path) -> Path:
    """Write the family's tiny model (config, safetensors, tokenizer) into `out`."""
    import torch

    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(SEED)
    cls, cfg = family.make()
    model = cls(cfg).eval()
    with torch.no_grad():   # random init is N(0, 0.02): scale it so the logits are not flat
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.08)
    model.save_pretrained(str(out), safe_serialization=True)
    if isinstance(family.tokenizer, BPE):
        train_bpe(family.tokenizer, out)
    else:
        train_spm(family.tokenizer, out)
    return out


BUILD_SCRIPT = "import sys\nfrom pathlib import Path\nimport model_families as mf\n" \
               "mf.build(mf.BY_NAME[sys.argv[1]], Path(sys.argv[2]))\n"


def built(family: Family, cache: Path) -> Path:
    """The family's model under `cache`, built once (in a subprocess, one thread) and reused by later sessions."""
    target = cache / f"{family.name}-v{BUILD_VERSION}.{family.version}"
    if (target / "config.json").is_file():
        return target
    staging = target.with_name(target.name + f".tmp{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(
        filter(None, [str(Path(__file__).parent), os.environ.get("PYTHONPATH")]))}
    subprocess.run([sys.executable, "-c", BUILD_SCRIPT, family.name, str(staging)], check=True, env=env)
    try:
        os.rename(staging, target)
    except OSError:
        shutil.rmtree(staging, ignore_errors=True)
    return target


# --- llama.cpp's converter, with the tiny BPE vocabularies registered -----------------------------------------
def converter_test_text(converter: Path) -> str:
    """The string whose token ids the converter hashes (`chktxt` in get_vocab_base_pre), read from its source."""
    source = (converter / "conversion" / "base.py").read_text(encoding="utf-8")
    match = re.search(r"^\s*chktxt = (.+)$", source, re.M)
    return ast.literal_eval(match.group(1))


def vocab_hash(model_dir: Path, text: str) -> str:
    """The converter's hash of a vocabulary: sha256 of str(token ids of `text`), as get_vocab_base_pre does."""
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(str(model_dir)).encode(text)
    return hashlib.sha256(str(ids).encode()).hexdigest()


def registered_converter(models: dict[str, Path], target: Path) -> Path:
    """A copy of the installed llama.cpp converter in `target` whose get_vocab_base_pre also knows the tiny BPE
    vocabularies of `models` ({family name: model dir}); gguf-py is linked, not copied."""
    from qbuild.models.llamacpp_toolchain import converter_dir

    source = converter_dir()
    text = converter_test_text(source)
    lines = []
    for name, path in sorted(models.items()):
        spec = BY_NAME[name].tokenizer
        if isinstance(spec, BPE):
            lines.append(f'        if chkhsh == "{vocab_hash(path, text)}":\n'
                         f'            res = "{spec.llama_cpp_pre}"  # qbuild test matrix: tiny {name}\n')
    stamp = hashlib.sha256("".join(lines).encode()).hexdigest()[:12]
    out = target / f"converter-{stamp}"
    if (out / "convert_hf_to_gguf.py").is_file():
        return out
    staging = target / f"converter-{stamp}.tmp{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    shutil.copy2(source / "convert_hf_to_gguf.py", staging)
    shutil.copytree(source / "conversion", staging / "conversion")
    os.symlink(source / "gguf-py", staging / "gguf-py")
    base = staging / "conversion" / "base.py"
    code = base.read_text(encoding="utf-8")
    anchor = "        res = None\n"
    assert code.count(anchor) == 1, "get_vocab_base_pre changed: update registered_converter"
    base.write_text(code.replace(anchor, anchor + "".join(lines)), encoding="utf-8")
    try:
        os.rename(staging, out)
    except OSError:
        shutil.rmtree(staging, ignore_errors=True)
    return out
