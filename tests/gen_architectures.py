"""Run the architecture matrix (tests/test_architectures.py) and write docs/architectures.md from it.

    python tests/gen_architectures.py                  # every cell, the slow ones too (~25 min on one core)
    python tests/gen_architectures.py --results DIR    # the page from the figures of an earlier run
                                                       #   (pytest ... with QBUILD_ARCH_RESULTS=DIR)

The status table is what the matrix code declares (tests/architecture_matrix.py, tests/model_families.py and
qbuild's own refusals, each method's `unsupported_families`); tests/test_architectures.py checks that the
committed page carries it. The measured table holds the figures the passing cells wrote.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import architecture_matrix as am
import model_families as mf

REPO = Path(__file__).resolve().parents[1]
PAGE = REPO / "docs" / "architectures.md"
MEASURED_CELLS = ("hf",) + am.GGUF_CELLS + ("gguf-import",) + am.CT_CELLS

HEAD = """# Architecture matrix

Which model families qbuild builds, by method, proven on tiny models: for each family, a 2-layer model with random
weights made from its transformers configuration class (no download), with a tokenizer of the family's kind trained
locally on Python's docstrings, goes through every cell below in CI (`tests/test_architectures.py`; the
llm-compressor cells and the GGUF round trip are marked `slow`). This page is generated:
`python tests/gen_architectures.py` runs the matrix and writes it, and a test checks that the status table is the
one the matrix code declares.

Cells: **HF import**, the model from a Hugging Face directory (`source: local`) and the baseline's evaluation;
**GGUF import**, the model from a GGUF made by llama.cpp's converter (`source: gguf`), whose checkpoint must
tokenize like the source and score its perplexity within 1 %; **GGUF F16 / Q8_0 / Q4_K_M**, converted by llama.cpp's
converter, quantized and evaluated by llama.cpp against the baseline (sanity bounds: F16 KLD < 1e-4, Q8_0 KLD <
0.01); **RTN, GPTQ, AWQ, FP8** through llm-compressor (W4A16 g128; FP8 dynamic), evaluated by transformers; and
**serving plan**, `qbuild plan` of the serving steps (llama-server for the GGUF, the HF-format server for the
compressed-tensors checkpoint).

✔: the cell is declared to pass (its test asserts it); ✘: it fails today (an xfail with the reason). The measured
table shows which cells the run that wrote this page covered: "—" there is a cell that run did not reach.
A (family, method) pair qbuild cannot build is refused when the recipe is validated
(`qbuild validate` and `qbuild plan` exit 2 with one line naming the variant's field and the reason), never found by a
failing step; the refusals are listed below the table.
"""

TOKENIZER_NOTE = """
## The tiny models' tokenizers

Byte-level BPE vocabularies (Llama 3, Qwen) are trained with the `tokenizers` library and the family's own
pre-tokenizer split pattern; SentencePiece models (Gemma, Phi-3, Mistral, Mixtral) with `sentencepiece` (BPE, byte
fallback), loaded by the family's transformers tokenizer class. llama.cpp's converter names a BPE vocabulary's
pre-tokenizer by hashing the token ids of a fixed test string, so it refuses any freshly trained vocabulary ("BPE
pre-tokenizer was not recognized"); llama.cpp's remedy for a new tokenizer is to register its hash
(`convert_hf_to_gguf_update.py`). The matrix does that in a copy of the installed converter
(`tests/model_families.py: registered_converter`), mapping each tiny vocabulary to the pre-tokenizer its family's
real models get (`llama-bpe`, `qwen2`), whose split pattern is the one the vocabulary was trained with, and points
qbuild at the copy with `QBUILD_LLAMA_CPP_DIR`. A real model of these families has a registered hash already.
"""


def _cell(family: str, cell: str) -> str:
    why = am.refusal(family, cell)
    if why:
        return "refused"
    known = am.KNOWN_FAILURES.get((family, cell))
    return f"✘ {known}" if known else "✔"


def status_table() -> str:
    """The declared status of every (family, cell), and qbuild's refusals: the part of the page the tests check."""
    head = "| family | model_type | tokenizer | " + " | ".join(am.CELL_TITLES[c] for c in am.CELLS) + " |"
    rule = "|" + "---|" * (3 + len(am.CELLS))
    rows = [f"| {f.title} | `{am.model_type(f.name)}` | {f.tokenizer_kind} | "
            + " | ".join(_cell(f.name, c) for c in am.CELLS) + " |" for f in mf.FAMILIES]
    from qbuild.contract.plugin import methods

    declared: dict = {}   # each rule once, with the methods that declare it (registry order)
    for method in methods.all():
        for family in method.unsupported_families:
            declared.setdefault(family, []).append(method.name)
    refusals = ["", "Refused at plan time (each method's `unsupported_families`, and one GGUF import):", ""]
    refusals += [f"- `{family.model_type}` × {', '.join(names)}"
                 + (f", when {family.condition}" if family.condition else "")
                 + (f", when {family.variant_condition}" if family.variant_condition else "") + f": {family.reason}"
                 for family, names in declared.items()]
    refusals += [f"- {f.title} × GGUF import (qbuild.models.gguf_import.unimportable): {am.refusal(f.name, 'gguf-import')}"
                 for f in mf.FAMILIES if am.refusal(f.name, "gguf-import")]
    return "\n".join([head, rule, *rows, *refusals]) + "\n"


def _number(value) -> str:
    if value is None:
        return "—"
    return f"{value:.2e}" if value < 0.001 else f"{value:.4f}"


def measured_table(results: dict[tuple[str, str], dict]) -> str:
    """KLD against the baseline per quantized cell (perplexity for the imports), and the seconds the family's cells
    took (their steps' own time, on one thread)."""
    titles = ["baseline PPL", "GGUF F16 KLD", "GGUF Q8_0 KLD", "GGUF Q4_K_M KLD", "round-trip PPL", "RTN KLD",
              "GPTQ KLD", "AWQ KLD", "FP8 KLD", "seconds"]
    lines = ["| family | " + " | ".join(titles) + " |", "|" + "---|" * (1 + len(titles))]
    for f in mf.FAMILIES:
        cells = []
        for cell in MEASURED_CELLS:
            data = results.get((f.name, cell))
            key = "ppl" if cell in ("hf", "gguf-import") else "kld"
            if data is None:
                cells.append("refused" if am.refusal(f.name, cell) else "—")
            else:
                cells.append(f"{data[key]:.1f}" if key == "ppl" else _number(data[key]))
        seconds = sum(d.get("seconds") or 0 for (name, _), d in results.items() if name == f.name)
        lines.append(f"| {f.title} | " + " | ".join(cells) + f" | {seconds:.0f} |")
    return "\n".join(lines) + "\n"


def checks_table(results: dict[tuple[str, str], dict]) -> str:
    """The fidelity checks every GGUF cell waited for: the F16 conversion against the HF checkpoint (convert-check),
    and the round trip's import against its GGUF (import-check)."""
    titles = ["conversion: tokens identical", "KLD", "top-1", "ΔPPL", "round-trip import: KLD", "ΔPPL"]
    lines = ["| family | " + " | ".join(titles) + " |", "|" + "---|" * (1 + len(titles))]

    def pct(value, spec):
        return "—" if value is None else format(value, spec)

    for f in mf.FAMILIES:
        conv, back = results.get((f.name, "hf"), {}), results.get((f.name, "gguf-import"), {})
        lines.append(f"| {f.title} | {conv.get('check_tokens', '—')} | {_number(conv.get('check_kld'))} | "
                     f"{pct(conv.get('check_top1'), '.1%')} | {pct(conv.get('check_ppl_pct'), '+.3f')} % | "
                     f"{_number(back.get('check_kld'))} | {pct(back.get('check_ppl_pct'), '+.3f')} % |")
    return "\n".join(lines) + "\n"


def page_klds(page: str, cell: str) -> dict[str, float]:
    """The measured KLD of `cell` per family title, read back from a page's measured table."""
    title = f"GGUF {cell} KLD" if cell in am.GGUF_CELLS else f"{cell.upper()} KLD"
    out = {}
    header = None
    for line in page.splitlines():
        if not line.startswith("|"):
            header = None
            continue
        cols = [c.strip() for c in line.strip("|").split("|")]
        if header is None:
            header = cols
            continue
        if title in header and re.match(r"^[-+]?\d[\d.eE+-]*$", cols[header.index(title)]):
            out[cols[0]] = float(cols[header.index(title)])
    return out


def render(results: dict[tuple[str, str], dict]) -> str:
    return (HEAD + "\n## Status\n\n" + status_table() + "\n## Measured\n\n"
            "On the tiny models (random weights: their perplexity is high and means nothing; the KLD says how far each "
            "artifact's next-token distribution is from the baseline's), from the run that wrote this page; — : not run "
            "by it.\n\n"
            + measured_table(results)
            + "\n## Fidelity checks\n\nEvery GGUF cell waits for the check of what it is built from "
            "(qbuild/models/import_check.py): the F16 conversion through llama.cpp against the HF checkpoint through "
            "transformers (`convert-check[f16]`: the evaluation text tokenized alike, token for token; KLD, top-1 "
            "agreement and perplexity on the first 2 windows), and, for the round trip, the import against its GGUF "
            "(`import-check`). A cell whose check fails is not built: the run stops with one line naming what "
            "differs.\n\n" + checks_table(results) + TOKENIZER_NOTE + tokenizer_section())


def tokenizer_section() -> str:
    """The GGUF tokenizer table (tests/test_gguf_vocab_vectors.py holds it to llama.cpp's vectors)."""
    from test_gguf_vocab_vectors import tokenizer_table

    return "\n" + GGUF_TOKENIZERS_HEAD + tokenizer_table()


GGUF_TOKENIZERS_HEAD = (
    "## GGUF tokenizers: llama.cpp's vocabulary test files\n"
    '\n'
    "A GGUF import (`source: gguf`) rebuilds the tokenizer from the file's `tokenizer.ggml.*` metadata\n"
    '(qbuild/models/gguf_tokenizer.py) as a `tokenizers` pipeline set up to split text as llama.cpp does. llama.cpp ships\n'
    'a vocabulary test file for each tokenizer family it supports (`models/ggml-vocab-*.gguf`, the vocabulary only), most\n'
    "with test strings (`.gguf.inp`) and llama.cpp's token ids for each (`.gguf.out`); qbuild extracts them from the\n"
    "llama-cpp-python sdist it takes the converter from. `tests/test_gguf_vocab_vectors.py` writes each vocabulary's\n"
    "tokenizer with the import's own writer, loads it with transformers' AutoTokenizer as the evaluation does, and\n"
    "requires every string's tokens to be the expected ids exactly (a file without vectors: llama.cpp itself, through\n"
    "llama-cpp-python, on the shared strings), and the same with the vocabulary's special tokens in the text and with\n"
    'BOS/EOS added. A vocabulary qbuild does not rebuild is refused at plan time in one line naming the metadata key (and\n'
    'by the import step, `TokenizerRefused: ...`) rather than imported with a tokenizer that splits text otherwise.\n'
    '\n'
)


def run_matrix(results: Path) -> int:
    env = {**os.environ, "QBUILD_ARCH_RESULTS": str(results)}
    cmd = [sys.executable, "-m", "pytest", "-q", "-m", "slow or not slow", str(REPO / "tests" / "test_architectures.py")]
    return subprocess.run(cmd, cwd=REPO, env=env).returncode


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--results", type=Path, help="figures of an earlier run (QBUILD_ARCH_RESULTS); no run")
    args = parser.parse_args(argv)
    if args.results is None:
        with tempfile.TemporaryDirectory() as tmp:
            rc = run_matrix(Path(tmp))
            if rc != 0:
                print(f"the matrix failed (pytest exit {rc}); docs/architectures.md not written", file=sys.stderr)
                return rc
            results = am.load_results(Path(tmp))
    else:
        results = am.load_results(args.results)
    PAGE.write_text(render(results), encoding="utf-8")
    print(f"wrote {PAGE.relative_to(REPO)} ({len(results)} cells measured)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
