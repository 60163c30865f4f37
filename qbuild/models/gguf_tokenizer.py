"""A GGUF file's tokenizer written as the Hugging Face files its family ships, read off the GGUF's own metadata.

transformers' GGUF loader picks its tokenizer converter by model architecture, not by the vocabulary's type: a
Gemma-2 GGUF's SentencePiece vocabulary becomes a Unigram model that splits text into single characters, a Llama
one gets BOS as its EOS, and neither gets the `tokenizer.model` llama.cpp's converter needs (without it,
convert_hf_to_gguf.py falls back to its BPE path and stops: "BPE pre-tokenizer was not recognized"). So the
tokenizer is rebuilt here from `tokenizer.ggml.*`, by vocabulary type:

- `llama` (SentencePiece): a real `tokenizer.model` (sentencepiece's own ModelProto: the GGUF's pieces, scores and
  token types, a BPE model as llama.cpp's SPM tokenizer merges by score), loaded by transformers' Llama/Gemma
  tokenizer class, which writes the matching tokenizer.json;
- `gpt2` (byte-level BPE): the GGUF's tokens and merges, and the pre-tokenizer llama.cpp runs for the GGUF's
  `tokenizer.ggml.pre` (llama-vocab.cpp's regexes, as the family's tokenizer.json writes them);

with the special tokens (bos/eos/unk/pad and the control tokens), add_bos/add_eos and the chat template.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

# GGUF token types (gguf.TokenType) — the same numbers as sentencepiece's ModelProto.SentencePiece.Type
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

_GPT2_REGEX = None   # ByteLevel's own (use_regex=True) is GPT-2's
_LLAMA3_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
                 r"\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
                r"\s*[\r\n]+|\s+(?!\S)|\s+")
# tokenizer.ggml.pre → how llama.cpp (llama-vocab.cpp, llm_tokenizer_bpe) splits text before BPE:
# (a regex split before the byte-level step or None, digits split one by one first, ignore_merges)
BPE_PRE = {
    **{name: (_GPT2_REGEX, False, False) for name in
       ("gpt-2", "phi-2", "mpt", "olmo", "jais", "roberta-bpe", "exaone4", "trillion")},
    **{name: (_GPT2_REGEX, True, False) for name in
       ("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva-7b")},
    **{name: (_LLAMA3_REGEX, False, True) for name in
       ("llama3", "llama-v3", "llama-bpe", "falcon3", "pixtral", "dbrx", "smaug-bpe")},
    **{name: (_QWEN2_REGEX, False, False) for name in ("qwen2", "deepseek-r1-qwen", "stablelm2", "megrez")},
}


def llama_cpp_adds_bos(model: str, pre: str | None) -> bool:
    """Whether llama.cpp starts a sequence with BOS for a GGUF that does not say (llama-vocab.cpp's default by
    vocabulary): SentencePiece and Llama-3-style BPE do, other BPE vocabularies do not."""
    return model == "llama" or (pre in BPE_PRE and BPE_PRE[pre][0] is _LLAMA3_REGEX)


@dataclass
class GGUFVocab:
    """A GGUF's `tokenizer.*` metadata."""

    model: str                          # tokenizer.ggml.model: llama (SentencePiece), gpt2 (byte-level BPE), ...
    pre: str | None
    tokens: list[str]
    types: list[int]
    scores: list[float] | None
    merges: list[str] | None
    special: dict[str, int] = field(default_factory=dict)    # bos/eos/unk/pad → id
    add_bos: bool = False                # as llama.cpp reads the GGUF (its default where the GGUF says nothing)
    add_eos: bool = False
    add_space_prefix: bool | None = None
    chat_template: str | None = None
    architecture: str = ""

    def token(self, kind: str) -> str | None:
        i = self.special.get(kind)
        return self.tokens[i] if i is not None and 0 <= i < len(self.tokens) else None


def read_vocab(path: Path) -> GGUFVocab:
    from gguf import GGUFReader

    fields = GGUFReader(str(path)).fields

    def value(name):
        f = fields.get(name)
        return None if f is None else f.contents()

    special = {kind: int(v) for kind, key in (("bos", "bos_token_id"), ("eos", "eos_token_id"),
                                              ("unk", "unknown_token_id"), ("pad", "padding_token_id"))
               if (v := value(f"tokenizer.ggml.{key}")) is not None}
    tokens = value("tokenizer.ggml.tokens")
    if not tokens:
        raise ValueError(f"{path.name} has no tokenizer.ggml.tokens: no vocabulary to import")
    types = value("tokenizer.ggml.token_type") or [NORMAL] * len(tokens)
    model, pre = value("tokenizer.ggml.model") or "", value("tokenizer.ggml.pre")
    default_bos = llama_cpp_adds_bos(model, pre)
    add_bos, add_eos = value("tokenizer.ggml.add_bos_token"), value("tokenizer.ggml.add_eos_token")
    return GGUFVocab(model=model, pre=pre, tokens=list(tokens),
                     types=[int(t) for t in types], scores=value("tokenizer.ggml.scores"),
                     merges=value("tokenizer.ggml.merges"), special=special,
                     add_bos=default_bos if add_bos is None else bool(add_bos),
                     add_eos=False if add_eos is None else bool(add_eos),
                     add_space_prefix=value("tokenizer.ggml.add_space_prefix"),
                     chat_template=value("tokenizer.chat_template"),
                     architecture=value("general.architecture") or "")


def write_tokenizer(gguf_path: Path, out: Path) -> str | None:
    """Write `out`'s tokenizer files from the GGUF's vocabulary; what was written, or None where qbuild does not
    rebuild this vocabulary type (transformers' own conversion stays, and the import check judges it)."""
    vocab = read_vocab(gguf_path)
    if vocab.model == "llama":
        write_sentencepiece(vocab, out)
        return "SentencePiece (tokenizer.model from the GGUF's pieces, scores and types)"
    if vocab.model == "gpt2":
        return write_byte_level_bpe(vocab, out)
    return None


def sentencepiece_proto(vocab: GGUFVocab):
    """sentencepiece's ModelProto of a GGUF `llama` vocabulary: a BPE model (llama.cpp's SPM tokenizer merges the
    pair whose merged piece scores highest, which is SentencePiece's BPE), with byte fallback when the vocabulary
    has byte pieces, no normalization, and the dummy prefix the GGUF declares (Gemma: none)."""
    from sentencepiece import sentencepiece_model_pb2 as pb

    if vocab.scores is None:
        raise ValueError("the GGUF's SentencePiece vocabulary has no tokenizer.ggml.scores")
    proto = pb.ModelProto()
    for piece, score, kind in zip(vocab.tokens, vocab.scores, vocab.types, strict=True):
        p = proto.pieces.add()
        p.piece, p.score = piece, float(score)
        p.type = kind if kind in (NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE) else NORMAL
    spec = proto.trainer_spec
    spec.model_type = pb.TrainerSpec.BPE
    spec.vocab_size = len(vocab.tokens)
    spec.byte_fallback = BYTE in vocab.types
    unk = vocab.special.get("unk", next((i for i, t in enumerate(vocab.types) if t == UNKNOWN), None))
    if unk is None:
        raise ValueError("the GGUF's SentencePiece vocabulary has no unknown token (sentencepiece needs one)")
    proto.pieces[unk].type = UNKNOWN
    for kind in ("unk", "bos", "eos", "pad"):
        i = unk if kind == "unk" else vocab.special.get(kind, -1)
        setattr(spec, f"{kind}_id", i)
        if i >= 0:
            setattr(spec, f"{kind}_piece", vocab.tokens[i])
    if spec.pad_id in (spec.bos_id, spec.eos_id, spec.unk_id):   # sentencepiece wants distinct ids: pad shares one
        spec.pad_id = -1
    norm = proto.normalizer_spec
    norm.name = "identity"
    norm.add_dummy_prefix = True if vocab.add_space_prefix is None else bool(vocab.add_space_prefix)
    norm.remove_extra_whitespaces = False
    norm.escape_whitespaces = True
    return proto


def _special_kwargs(vocab: GGUFVocab) -> dict:
    kwargs = {f"{kind}_token": vocab.token(kind) for kind in ("bos", "eos", "unk", "pad") if vocab.token(kind)}
    kwargs["add_bos_token"], kwargs["add_eos_token"] = vocab.add_bos, vocab.add_eos
    if vocab.chat_template:
        kwargs["chat_template"] = vocab.chat_template
    return kwargs


def _added_tokens(vocab: GGUFVocab) -> list:
    """Control tokens as special added tokens, user-defined ones as plain added tokens: matched whole in text, as
    llama.cpp's tokenizer matches them."""
    from tokenizers import AddedToken

    return [AddedToken(tok, special=kind == CONTROL, normalized=False)
            for tok, kind in zip(vocab.tokens, vocab.types, strict=True) if kind in (CONTROL, USER_DEFINED)]


def write_sentencepiece(vocab: GGUFVocab, out: Path) -> None:
    from transformers import GemmaTokenizer, LlamaTokenizer

    proto = sentencepiece_proto(vocab)
    (out / "tokenizer.model").write_bytes(proto.SerializeToString())
    no_prefix = not proto.normalizer_spec.add_dummy_prefix
    cls = GemmaTokenizer if vocab.architecture.startswith("gemma") and no_prefix else LlamaTokenizer
    # Gemma's class would add a "<mask>" the vocabulary may not have
    extra = {"mask_token": None} if cls is GemmaTokenizer else {"add_prefix_space": not no_prefix, "legacy": False}
    specials = _special_kwargs(vocab)
    tok = cls.from_pretrained(str(out), **extra, **specials)   # converts tokenizer.model (SentencePieceExtractor)
    tok.add_tokens(_added_tokens(vocab))
    tok.save_pretrained(str(out))
    # where it was read from (this step's scratch) is not a setting; add_bos/add_eos are written out even where they
    # are the class's default, for readers (llama.cpp's converter) that do not know the default
    _edit_config(out, vocab_file=None, **_bos_eos(vocab))
    if not (out / "tokenizer.model").is_file():   # llama.cpp's converter and sentencepiece readers need it
        (out / "tokenizer.model").write_bytes(proto.SerializeToString())


def write_byte_level_bpe(vocab: GGUFVocab, out: Path) -> str:
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    if vocab.merges is None:
        raise ValueError("the GGUF's byte-level BPE vocabulary has no tokenizer.ggml.merges")
    known = BPE_PRE.get(vocab.pre or "")
    regex, digits, ignore_merges = known or (_GPT2_REGEX, False, False)
    merges = [tuple(m.split(" ", 1)) for m in vocab.merges]
    bpe = models.BPE(vocab={t: i for i, t in enumerate(vocab.tokens)}, merges=merges, ignore_merges=ignore_merges)
    tokenizer = Tokenizer(bpe)
    steps = [pre_tokenizers.Digits(individual_digits=True)] if digits else []
    if regex is None:
        steps.append(pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True))
    else:
        steps += [pre_tokenizers.Split(Regex(regex), behavior="isolated", invert=False),
                  pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=False)]
    tokenizer.pre_tokenizer = steps[0] if len(steps) == 1 else pre_tokenizers.Sequence(steps)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, **_special_kwargs(vocab))
    fast.add_tokens(_added_tokens(vocab))
    fast.save_pretrained(str(out))
    # transformers 5 writes `TokenizersBackend`, a class transformers 4 (in serving engines) does not have; the
    # generic fast class reads tokenizer.json in both
    _edit_config(out, tokenizer_class="PreTrainedTokenizerFast", **_bos_eos(vocab))
    how = f"byte-level BPE, pre-tokenizer {vocab.pre!r}"
    return how if known else how + " (not one qbuild knows: GPT-2's split used; the import check compares)"


def _bos_eos(vocab: GGUFVocab) -> dict:
    return {"add_bos_token": vocab.add_bos, "add_eos_token": vocab.add_eos}


def _edit_config(out: Path, **changes) -> None:
    """Set (None: remove) keys of out/tokenizer_config.json."""
    path = out / "tokenizer_config.json"
    config = json.loads(path.read_text(encoding="utf-8"))
    for key, value in changes.items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    path.write_text(json.dumps(config, indent=2, ensure_ascii=False), encoding="utf-8")
