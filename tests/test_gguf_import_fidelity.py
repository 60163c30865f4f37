"""A GGUF import keeps its source's tokenizer and math, and one that does not is refused before anything is built.

Real tiny models, made here: a random Llama / Gemma-2 (hidden 64, 2 layers) with a SentencePiece vocabulary trained
with the `sentencepiece` package, and a Llama with a byte-level BPE vocabulary trained with `tokenizers`, both on
Python's stdlib docstrings; written as HF directories and converted to F16 GGUFs by llama.cpp's own converter.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import qbuild, write_recipe

pytest.importorskip("llama_cpp")
pytest.importorskip("sentencepiece")
pytest.importorskip("gguf")

EVAL = {"sources": [{"type": "pydocs", "split": "test"}], "chat_template": False}
CTX = 128
GEMMA_TEMPLATE = "{% for m in messages %}<start_of_turn>{{ m['role'] }}\n{{ m['content'] }}<end_of_turn>\n{% endfor %}"

# llama.cpp's converter, with the BPE pre-tokenizer named: it recognizes a BPE vocabulary by hashing how it splits a
# fixed text, which no vocabulary trained here matches
CONVERT = """
import runpy, sys
conv, pre = sys.argv[1], sys.argv[2]
sys.path[:0] = [conv, conv + "/gguf-py"]
if pre:
    import conversion.base
    conversion.base.TextModel.get_vocab_base_pre = lambda self, tokenizer: pre
sys.argv = ["convert_hf_to_gguf.py", *sys.argv[3:]]
runpy.run_path(conv + "/convert_hf_to_gguf.py", run_name="__main__")
"""


def _converter() -> Path:
    from qbuild.models.llamacpp_toolchain import converter_dir

    try:
        return converter_dir(log=lambda *_: None)
    except Exception as exc:   # not extracted and no network: nothing to convert with
        pytest.skip(f"llama.cpp's converter is not available: {exc}")


def convert(hf_dir: Path, out: Path, pre: str = "") -> Path:
    env = {k: v for k, v in os.environ.items() if k != "NO_LOCAL_GGUF"} | {"OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-c", CONVERT, str(_converter()), pre, str(hf_dir), "--outfile", str(out),
                           "--outtype", "f16"], capture_output=True, text=True, env=env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return out


def eval_text() -> str:
    from qbuild.calibration.corpus import pydocs_documents

    return "\n\n".join(pydocs_documents("test"))


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    from qbuild.calibration.corpus import pydocs_documents

    path = tmp_path_factory.mktemp("corpus") / "train.txt"
    path.write_text("\n".join(pydocs_documents("train")), encoding="utf-8")
    return path


def _train_spm(corpus: Path, prefix: Path, gemma: bool) -> Path:
    import sentencepiece as spm

    ids = dict(pad_id=0, eos_id=1, bos_id=2, unk_id=3, pad_piece="<pad>", eos_piece="<eos>", bos_piece="<bos>") \
        if gemma else dict(unk_id=0, bos_id=1, eos_id=2, pad_id=-1)
    spm.SentencePieceTrainer.train(
        input=str(corpus), model_prefix=str(prefix), vocab_size=600, model_type="bpe", byte_fallback=True,
        character_coverage=1.0, num_threads=1, minloglevel=2, max_sentence_length=100000,
        normalization_rule_name="identity", remove_extra_whitespaces=False, add_dummy_prefix=not gemma,
        split_digits=True, allow_whitespace_only_pieces=True,
        user_defined_symbols=["<start_of_turn>", "<end_of_turn>"] if gemma else [], **ids)
    return prefix.with_suffix(".model")


def _random_model(kind: str, out: Path, vocab: int, bos: int, eos: int, pad: int | None) -> None:
    import torch
    from transformers import Gemma2Config, Gemma2ForCausalLM, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    dims = dict(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                max_position_embeddings=1024, bos_token_id=bos, eos_token_id=eos, pad_token_id=pad)
    if kind == "gemma2":
        Gemma2ForCausalLM(Gemma2Config(num_key_value_heads=1, head_dim=16, **dims)).save_pretrained(out)
    else:
        LlamaForCausalLM(LlamaConfig(num_key_value_heads=2, tie_word_embeddings=False, **dims)).save_pretrained(out)


@pytest.fixture(scope="module")
def sources(tmp_path_factory, corpus) -> dict[str, Path]:
    """family → an F16 GGUF written by llama.cpp's converter from a tiny HF directory made here."""
    import shutil

    from transformers import GemmaTokenizer, LlamaTokenizer

    root = tmp_path_factory.mktemp("sources")
    found = {}
    for family in ("llama", "gemma2"):
        gemma = family == "gemma2"
        hf = root / family
        hf.mkdir()
        model = _train_spm(corpus, root / f"{family}-spm", gemma)
        shutil.copy(model, hf / "tokenizer.model")
        if gemma:
            tok = GemmaTokenizer.from_pretrained(str(hf), mask_token=None, chat_template=GEMMA_TEMPLATE)
        else:
            tok = LlamaTokenizer.from_pretrained(str(hf), legacy=False, add_prefix_space=True)
        tok.save_pretrained(hf)
        shutil.copy(model, hf / "tokenizer.model")   # transformers 5 does not write it back
        _random_model(family, hf, 600, tok.bos_token_id, tok.eos_token_id, tok.pad_token_id)
        found[family] = convert(hf, root / f"{family}-f16.gguf")
    found["bpe"] = convert(_bpe_dir(root / "bpe", corpus), root / "bpe-f16.gguf", pre="gpt-2")
    return found


def _bpe_dir(hf: Path, corpus: Path) -> Path:
    """A GPT-2-style byte-level BPE vocabulary trained with `tokenizers`, on a tiny random Llama."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    tok.train([str(corpus)], trainers.BpeTrainer(vocab_size=700, special_tokens=["<|endoftext|>", "<|im_start|>",
                                                                               "<|im_end|>"],
                                               initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                               show_progress=False))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|im_start|>", eos_token="<|im_end|>",
                                   unk_token="<|endoftext|>", pad_token="<|im_end|>")
    hf.mkdir()
    fast.save_pretrained(hf)
    _random_model("llama", hf, tok.get_vocab_size(), 1, 2, 2)
    return hf


def import_gguf(gguf: Path, out: Path) -> dict:
    from qbuild.contract.step import StepContext
    from qbuild.models.gguf_import import run

    out.mkdir(parents=True)
    return run(StepContext(params={"dtype": "float32"}, inputs={}, input_manifests={}, out=out, threads=1,
                           device="cpu", step_name="import-gguf", runtime_args={"gguf_path": str(gguf)}))


@pytest.fixture(scope="module")
def imported(sources, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("imported")
    for family, gguf in sources.items():
        import_gguf(gguf, root / family)
    return {family: root / family for family in sources}


def llama_tokens(gguf: Path, text: str) -> list[int]:
    from llama_cpp import Llama

    return Llama(model_path=str(gguf), vocab_only=True, verbose=False).tokenize(text.encode(), add_bos=False,
                                                                                 special=True)


def hf_tokens(model_dir: Path, text: str) -> list[int]:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir))(text, add_special_tokens=False)["input_ids"]


def gguf_tokenizer(path: Path) -> dict:
    from gguf import GGUFReader

    fields = GGUFReader(str(path)).fields
    return {k: fields[k].contents() for k in fields if k.startswith("tokenizer.")}


def run_check(model_dir: Path, gguf: Path, work: Path, windows: int = 2) -> dict:
    """The eval-data step on the imported tokenizer, then the import-check step: its result (or its exception)."""
    from qbuild.contract.step import StepContext
    from qbuild.evaluate import data
    from qbuild.models import import_check

    (work / "data").mkdir(parents=True)
    (work / "check").mkdir()
    data.run(StepContext(params={"dataset": EVAL, "context_length": CTX, "max_windows": 8, "add_bos": True,
                                 "join": "\\n\\n"}, inputs={"tokenizer": model_dir}, input_manifests={},
                         out=work / "data", threads=1, device="cpu", step_name="eval-data",
                         runtime_args={"sources": [{}]}))
    params = {"protocol": "fixed-window", "context_length": CTX, "stride": None, "add_bos": True,
              "windows": windows, "dataset": EVAL, "dtype": "float32"}
    return import_check.run(StepContext(params=params, inputs={"model": model_dir, "data": work / "data"},
                                        input_manifests={}, out=work / "check", threads=1, device="cpu",
                                        step_name="import-check",
                                        runtime_args={"gguf_path": str(gguf), "sources": [{}]}))


# --- the defect, and its refusal --------------------------------------------------------------------------------

def test_transformers_gguf_tokenizer_mangles_gemma2_and_the_check_refuses_it(sources, imported, tmp_path):
    """What the import wrote before (transformers' own GGUF tokenizer) splits a Gemma-2 SentencePiece vocabulary into
    single characters; the import check refuses that baseline in one line naming the first differing token."""
    import shutil

    from transformers import AutoTokenizer

    from qbuild.models.import_check import ImportMismatch

    gguf = sources["gemma2"]
    mangled = tmp_path / "mangled"
    shutil.copytree(imported["gemma2"], mangled)
    for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model"):
        (mangled / f).unlink()
    AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name).save_pretrained(mangled)   # the old import
    old = AutoTokenizer.from_pretrained(str(mangled))
    text = "The capital of France"
    assert old.tokenize(text)[:3] == ["T", "h", "e"]                       # the issue's symptom
    assert len(old(text, add_special_tokens=False)["input_ids"]) > len(llama_tokens(gguf, text))
    with pytest.raises(ImportMismatch) as err:
        run_check(mangled, gguf, tmp_path / "check")
    message = str(err.value)
    assert "\n" not in message
    assert re.search(r"unlike llama.cpp on gemma2-f16.gguf: tokens at position \d+ of \d+: ours '.+' \(id \d+\) vs "
                     r"llama.cpp's '.+' \(id \d+\)$", message), message


def test_a_distribution_over_the_bound_is_refused(sources, imported, tmp_path):
    """An import whose weights are not the source's (one projection scaled): KLD over the F16 bound, one line."""
    import shutil

    import torch
    from transformers import AutoModelForCausalLM

    from qbuild.models.import_check import ImportMismatch

    wrong = tmp_path / "wrong"
    shutil.copytree(imported["llama"], wrong)
    model = AutoModelForCausalLM.from_pretrained(str(wrong), dtype=torch.float32)
    with torch.no_grad():
        model.lm_head.weight.mul_(3.0)
    model.save_pretrained(wrong)
    with pytest.raises(ImportMismatch, match=r"KLD \S+ over the bound 0.001 for a MOSTLY_F16 source on the first 2 "
                                             r"evaluation windows") as err:
        run_check(wrong, sources["llama"], tmp_path / "check")
    assert "\n" not in str(err.value)


# --- the fix ------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("family", ["llama", "gemma2"])
def test_sentencepiece_gguf_imports_as_sentencepiece(family, sources, imported, tmp_path):
    import sentencepiece as spm

    gguf, out = sources[family], imported[family]
    meta = gguf_tokenizer(gguf)
    assert meta["tokenizer.ggml.model"] == "llama"
    proc = spm.SentencePieceProcessor(model_file=str(out / "tokenizer.model"))   # a real SentencePiece model
    assert [proc.id_to_piece(i) for i in range(proc.get_piece_size())] == meta["tokenizer.ggml.tokens"]
    text = eval_text()
    ours = hf_tokens(out, text)
    assert ours == llama_tokens(gguf, text)                     # the whole evaluation text, token for token
    assert proc.encode(text) == ours                            # and sentencepiece itself agrees
    config = json.loads((out / "tokenizer_config.json").read_text())
    # a fast tokenizer as written: Llama/GemmaTokenizer rebuild their own normalizer on load, unlike llama.cpp
    assert config["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert "vocab_file" not in config                           # no path of the step's scratch
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(out))
    for kind, key in (("bos", "bos_token_id"), ("eos", "eos_token_id"), ("unk", "unknown_token_id"),
                      ("pad", "padding_token_id")):
        assert getattr(tok, f"{kind}_token_id") == meta.get(f"tokenizer.ggml.{key}"), kind
    adds_bos = tok("x")["input_ids"][0] == meta["tokenizer.ggml.bos_token_id"]
    assert adds_bos == meta.get("tokenizer.ggml.add_bos_token", True)       # as llama.cpp (SentencePiece: BOS)
    if family == "gemma2":
        assert tok.chat_template == GEMMA_TEMPLATE
    result = run_check(out, gguf, tmp_path / "check")
    assert result["metrics"]["kld"] < 1e-4 and result["metrics"]["top1"] > 0.9   # F16 source: close
    assert json.loads((tmp_path / "check" / "check" / "check.json").read_text())["tokens_identical"] is True


def test_byte_level_bpe_imports_with_its_pre_tokenizer(sources, imported, tmp_path):
    gguf, out = sources["bpe"], imported["bpe"]
    assert gguf_tokenizer(gguf)["tokenizer.ggml.model"] == "gpt2"
    data = json.loads((out / "tokenizer.json").read_text())
    assert data["model"]["type"] == "BPE" and not data["model"]["byte_fallback"]
    assert data["pre_tokenizer"]["type"] == "ByteLevel" and data["decoder"]["type"] == "ByteLevel"
    text = eval_text()
    assert hf_tokens(out, text) == llama_tokens(gguf, text)
    assert json.loads((out / "tokenizer_config.json").read_text())["tokenizer_class"] == "PreTrainedTokenizerFast"
    result = run_check(out, gguf, tmp_path / "check")
    assert result["metrics"]["kld"] < 1e-4


@pytest.mark.parametrize("family", ["llama", "gemma2", "bpe"])
def test_imported_directory_converts_back_to_the_same_gguf_vocabulary(family, sources, imported, tmp_path):
    """llama.cpp's converter reads the imported directory (SentencePiece through tokenizer.model): the GGUF it writes
    has the source's vocabulary, special tokens and chat template, and llama.cpp tokenizes with it as with the
    source."""
    back = convert(imported[family], tmp_path / "back.gguf", pre="gpt-2" if family == "bpe" else "")
    source, again = gguf_tokenizer(sources[family]), gguf_tokenizer(back)
    for key in ("tokenizer.ggml.model", "tokenizer.ggml.tokens", "tokenizer.ggml.scores", "tokenizer.ggml.token_type",
                "tokenizer.ggml.merges", "tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id",
                "tokenizer.ggml.unknown_token_id", "tokenizer.ggml.padding_token_id", "tokenizer.chat_template"):
        assert again.get(key) == source.get(key), key
    for key, default in (("add_space_prefix", True), ("add_bos_token", family != "bpe"), ("add_eos_token", False)):
        key = f"tokenizer.ggml.{key}"   # where a file leaves it out, llama.cpp's default for the vocabulary type
        assert again.get(key, default) == source.get(key, default), key
    text = eval_text()[:20000]
    assert llama_tokens(back, text) == llama_tokens(sources[family], text)


# --- a run refuses before any variant is built -------------------------------------------------------------------

def _renamed_pre(gguf: Path, out: Path, pre: str) -> Path:
    """A copy of a GGUF whose BPE pre-tokenizer is `pre` (llama.cpp splits text its way; qbuild does not know it)."""
    from gguf import GGUFReader, GGUFValueType, GGUFWriter

    reader = GGUFReader(str(gguf))
    arch = reader.fields["general.architecture"].contents()
    writer = GGUFWriter(str(out), arch)
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        value = pre if name == "tokenizer.ggml.pre" else field.contents()
        kind = field.types[0]
        sub = field.types[-1] if kind == GGUFValueType.ARRAY else None
        writer.add_key_value(name, value, kind, sub_type=sub)
    for t in reader.tensors:
        writer.add_tensor(t.name, t.data, raw_shape=list(reversed(t.shape.tolist())), raw_dtype=t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def _recipe(tmp: Path, gguf: Path) -> Path:
    return write_recipe(tmp / "r.yaml", {
        "name": "imported", "model": {"source": "gguf", "path": str(gguf)},
        "variants": [{"name": "q8", "method": "gguf", "type": "Q8_0"}],
        "evaluation": {"baseline": True, "perplexity": {"context_length": CTX, "max_windows": 2}, "kld": True}})


def test_a_vocabulary_qbuild_does_not_rebuild_is_refused_at_plan_time(sources, tmp_path):
    """A BPE GGUF whose pre-tokenizer qbuild does not rebuild: its text would be tokenized unlike llama.cpp, so the
    plan refuses the import in one line naming tokenizer.ggml.pre, before anything is built (an import that is
    built and still differs is failed by import-check: test_transformers_gguf_tokenizer_mangles_gemma2_and_the_check
    _refuses_it, above)."""
    gguf = _renamed_pre(sources["bpe"], tmp_path / "unknown.gguf", "no-such-pre-tokenizer")
    res = qbuild("plan", _recipe(tmp_path, gguf), "--store", tmp_path / "store")
    assert res.returncode == 2, res.stderr[-3000:]
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and "model.path" in lines[0] and "tokenizer.ggml.pre 'no-such-pre-tokenizer'" in lines[0]
    assert not (tmp_path / "store" / "objects").exists()


def test_a_faithful_import_passes_the_check_once(sources, tmp_path):
    """The Gemma-2 SentencePiece GGUF: the check passes, the variant is built and evaluated; a second run reads the
    stored check (it costs once)."""
    recipe = _recipe(tmp_path, sources["gemma2"])
    first = qbuild("run", recipe, "--store", tmp_path / "store", "--json", "--threads", "1")
    assert first.returncode == 0, first.stderr[-3000:]
    steps = {s["name"]: s for s in json.loads(first.stdout)["steps"]}
    assert steps["import-check"]["status"] == "built" and steps["quantize[q8]"]["status"] == "built"
    again = qbuild("plan", recipe, "--store", tmp_path / "store", "--json")
    planned = {s["step"]: s for s in json.loads(again.stdout)["steps"]}
    assert planned["import-check"]["status"] == "hit" and json.loads(again.stdout)["to_build"] == 0


def test_every_step_that_reads_the_baseline_waits_for_the_check(sources, tmp_path):
    """Planning: the check reads the import and the evaluation text; every other step reading the baseline waits for
    it, and waiting leaves its key as it was (`after` is not hashed)."""
    from dataclasses import replace

    from qbuild.pipeline.plan import build_steps
    from qbuild.planning.recipe import load_recipe

    recipe_path = _recipe(tmp_path, sources["llama"])
    ctx = build_steps(load_recipe(recipe_path), tmp_path)
    by_name = {s.name: s for s in ctx.steps}
    check, model = by_name["import-check"], by_name["model"]
    assert check.inputs == {"model": model, "data": by_name["eval-data"]}
    readers = [s for s in ctx.steps if model in s.inputs.values() and s.name not in ("eval-data", "import-check")]
    assert readers and all(s.after == (check,) for s in readers)
    assert all(replace(s, after=()).key == s.key for s in readers)
