"""Calibration/evaluation text overlap: 13-gram decontamination, measured at plan time and cached.

What is measured. Both texts are normalized the way the decontamination analyses of GPT-3 (Brown et al. 2020,
appendix C) and the LLaMA/PaLM papers do it: lowercase, punctuation dropped, split into words. Every run of
`n` consecutive words (n = 13 by default, GPT-3's choice: long enough that a shared 13-gram is copied text,
not a common phrase) of the evaluation text is looked up in the set of the calibration text's 13-grams.

Evaluation documents shorter than `n` words have no n-gram; each is compared whole instead, as one unit: with
at least MIN_WORDS (8) words, it is shared when its whole run of words occurs anywhere in the calibration text
(GPT-3's floor: shorter runs collide by chance); with fewer, when it equals a whole calibration document.

- `overlap_pct`: the share of the evaluation text's units (13-gram occurrences, and short documents) that also
  occur in the calibration text. 0 % means no 13 words in a row of evaluation text (and no short evaluation
  document) were seen in calibration; 100 % means the evaluation text is (a copy of) calibration text. This is
  the number the threshold applies to.
- `evaluation_ngrams` / `shared_ngrams`: the 13-gram counts; `short_documents` / `short_documents_shared`: the
  documents under n words, compared whole.
- `documents_flagged`: evaluation documents with at least one shared unit (GPT-3's "dirty" examples).

Why it matters: a method calibrated on the text it is evaluated on (GPTQ, AWQ, imatrix) is flattered by
perplexity on that text (exllamav3 #108). The check reads texts only (no tokenizer, no torch) and is cached
by the identities of both texts (their sources' content digests, or the Python version for pydocs), so a
re-plan reads one small JSON file.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

from qbuild.base.hashing import canonical_json, sha256_text

NGRAM = 13
MIN_WORDS = 8   # a shorter evaluation document is shared only as a whole calibration document
METHOD = "word-13gram-v2"   # bump when the normalization or the measure changes: cached results are then stale
# v2: documents under n words are compared whole (v1 gave them no n-gram: a copy of short documents read 0 %)
_WORD = re.compile(r"[^\W_]+")  # letters and digits; punctuation and underscores split words


def words(text: str) -> list[str]:
    return _WORD.findall(text.lower())


def _text(doc) -> str:
    if isinstance(doc, list):  # a chat: the messages' contents
        return "\n".join(str(m.get("content", "")) if isinstance(m, dict) else str(m) for m in doc)
    return str(doc)


def _hashes(ws: list[str], n: int):
    # 64-bit hashes of the joined words: a set of ints is ~10x smaller and faster than a set of tuples
    return (hash(" ".join(ws[i: i + n])) for i in range(len(ws) - n + 1))


def ngram_overlap(calibration_docs, evaluation_docs, n: int = NGRAM) -> dict:
    """How much of the evaluation text's n-grams (and short documents) occur in the calibration text (see the
    module docstring)."""
    evaluation = [words(_text(doc)) for doc in evaluation_docs]
    # the short documents' runs of words, looked for while the calibration text is read (once)
    runs: dict[int, set[int]] = {}
    for ws in evaluation:
        if MIN_WORDS <= len(ws) < n:
            runs.setdefault(len(ws), set()).add(hash(" ".join(ws)))
    seen: set[int] = set()
    whole: set[int] = set()   # calibration documents under MIN_WORDS words
    found: set[int] = set()   # short documents' runs found in the calibration text
    for doc in calibration_docs:
        ws = words(_text(doc))
        seen.update(_hashes(ws, n))
        if len(ws) < MIN_WORDS:
            whole.add(hash(" ".join(ws)))
        for k, wanted in runs.items():
            found.update(h for h in _hashes(ws, k) if h in wanted)
    total = shared = flagged = short = short_shared = 0
    for ws in evaluation:
        if len(ws) >= n:
            hits = [h in seen for h in _hashes(ws, n)]
            total += len(hits)
            k = sum(hits)
            shared += k
        elif ws:
            short += 1
            k = hash(" ".join(ws)) in (found if len(ws) >= MIN_WORDS else whole)
            short_shared += k
        else:
            k = 0
        flagged += k > 0
    units = total + short
    return {"method": METHOD, "n": n, "evaluation_ngrams": total, "shared_ngrams": shared,
            "short_documents": short, "short_documents_shared": short_shared,
            "overlap_pct": round(100 * (shared + short_shared) / units, 4) if units else 0.0,
            "evaluation_documents": len(evaluation), "documents_flagged": flagged}


def describe(identity: dict) -> str:
    """A source as one short phrase: pydocs:test, file:eval.txt, hf:wikitext/wikitext-2-raw-v1:test."""
    kind = identity.get("type")
    if kind == "pydocs":
        return f"pydocs:{identity.get('split')}"
    if kind == "file":
        return f"file:{Path(str(identity.get('path', ''))).name}"
    if kind == "hf":
        return f"hf:{identity.get('name')}{'/' + identity['config'] if identity.get('config') else ''}:{identity.get('split')}"
    return str(kind)


def _cache_file(key: str) -> Path:
    from qbuild.base.fingerprint import cache_dir

    return cache_dir() / "overlap" / f"{key}.json"


def measure(calibration: list[tuple[dict, dict]], evaluation: list[tuple[dict, dict]], n: int = NGRAM) -> dict:
    """The overlap record of two texts, each a list of (source identity, runtime args) as planning resolves them.

    Cached per user (QBUILD_CACHE) by the identities of both texts: identities hold content digests, so an
    edited file is a new entry and a re-plan of the same recipe costs one file read."""
    def strip(ident: dict) -> dict:
        return {k: v for k, v in ident.items() if k != "weight"}   # weights pick samples, not text

    cal_ids = [strip(i) for i, _ in calibration]
    eval_ids = [strip(i) for i, _ in evaluation]
    key = sha256_text(canonical_json({"method": METHOD, "n": n, "calibration": cal_ids, "evaluation": eval_ids}))
    path = _cache_file(key)
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        pass
    from qbuild.calibration.sources import read_source

    def docs(sources):
        for ident, rt in sources:
            yield from read_source(ident, rt)

    record = ngram_overlap(docs(calibration), docs(evaluation), n)
    record |= {"calibration": " + ".join(describe(i) for i in cal_ids),
               "evaluation": " + ".join(describe(i) for i in eval_ids), "key": key}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(record, indent=2))
        os.replace(tmp, path)
    except OSError:
        pass   # a read-only home: measured again next time, never an error
    return record
