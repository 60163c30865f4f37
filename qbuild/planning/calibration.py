"""Plan-time side of datasets: resolve each source's identity cheaply and create the tokenize steps."""

from __future__ import annotations

import platform
from pathlib import Path

from qbuild.base.errors import RecipeError
from qbuild.base.fingerprint import dir_fingerprint
from qbuild.contract.formats import Format
from qbuild.contract.step import HF_PRELOAD, Step
from qbuild.planning.models import resolve_path

TOKENIZE_TOOLS = ("transformers", "tokenizers")


def source_identity(source, base: Path, field: str) -> tuple[dict, dict]:
    """(hashed identity, runtime args) of one source. Content, not location, identifies local files."""
    data = source.canonical()
    runtime: dict = {}
    if source.type == "pydocs":
        data["python"] = platform.python_version()  # the corpus is this Python's stdlib
    elif source.type == "file":
        path = resolve_path(source.path, base, f"{field}.path")
        if path.suffix not in (".txt", ".jsonl", ".parquet") and source.format == "auto":
            raise RecipeError(f"{field}.path", f"{source.path!r}: unknown extension; use .txt, .jsonl, .parquet or set format")
        data["sha256"] = dir_fingerprint(path)
        runtime["path"] = str(path)
    elif source.type == "hf" and source.data_files:
        files = [source.data_files] if isinstance(source.data_files, str) else source.data_files
        paths = [resolve_path(f, base, f"{field}.data_files") for f in files]
        data["data_files_sha256"] = [dir_fingerprint(p) for p in paths]
        runtime["data_files"] = [str(p) for p in paths]
    return data, runtime


def _dataset_sources(dataset, ctx, field: str) -> tuple[list[dict], list[dict], tuple[str, ...]]:
    identities, runtimes, tools = [], [], set(TOKENIZE_TOOLS)
    for i, src in enumerate(dataset.sources):
        ident, rt = source_identity(src, ctx.recipe_dir, f"{field}.sources[{i}]")
        identities.append(ident)
        runtimes.append(rt)
        if src.type == "hf":
            tools.add("datasets")
        if src.type == "file" and (src.format == "parquet" or src.path.endswith(".parquet")):
            tools.add("pyarrow")
    return identities, runtimes, tuple(sorted(tools))


def calibration_step(calibration, model: Step, ctx) -> Step:
    identities, runtimes, tools = _dataset_sources(calibration, ctx, "calibration")
    params = calibration.canonical()
    params["sources"] = identities
    return Step("calibrate", "calibrate", params, "qbuild.calibration.build:run", inputs={"tokenizer": model},
                tools=tools, threads=ctx.threads, preload=HF_PRELOAD, format=Format.CALIBRATION,
                runtime_args={"sources": runtimes, **_overlap_arg(ctx)})


def eval_data_step(perplexity, model: Step, ctx) -> Step:
    identities, runtimes, tools = _dataset_sources(perplexity.dataset, ctx, "evaluation.perplexity.dataset")
    params = {
        "dataset": {**perplexity.dataset.canonical(), "sources": identities},
        "context_length": perplexity.context_length,
        "max_windows": perplexity.max_windows,
        "add_bos": perplexity.add_bos,
        "join": "\\n\\n",
    }
    return Step("eval-data", "eval-data", params, "qbuild.evaluate.data:run", inputs={"tokenizer": model},
                tools=tools, threads=ctx.threads, preload=HF_PRELOAD, format=Format.TOKENS,
                runtime_args={"sources": runtimes, **_overlap_arg(ctx)})


def _overlap_arg(ctx) -> dict:
    # the plan-time measure, recorded in the data step's manifest; not hashed: it follows from the texts (whose
    # identities are hashed) and the other side's text, which the record names
    overlap = getattr(ctx, "overlap", None)
    return {"overlap": overlap} if overlap else {}


def check_overlap(recipe, base: Path) -> dict | None:
    """The calibration/evaluation text overlap record (qbuild.calibration.overlap), or None when the recipe has not
    both texts or turns the check off. Above evaluation.overlap.max_pct: RecipeError (exit 2), one line naming both
    texts and the overlap. A text that cannot be read here (a hub dataset offline) is a warning, not an error."""
    ev = recipe.evaluation
    if recipe.calibration is None or ev.perplexity is None or ev.overlap is None:
        return None
    from qbuild.calibration.overlap import measure

    cal = [source_identity(s, base, f"calibration.sources[{i}]") for i, s in enumerate(recipe.calibration.sources)]
    evl = [source_identity(s, base, f"evaluation.perplexity.dataset.sources[{i}]")
           for i, s in enumerate(ev.perplexity.dataset.sources)]
    try:
        record = measure(cal, evl, ev.overlap.ngram)
    except Exception as exc:  # a library's own error while reading a text: the plan goes on, unmeasured
        return {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:300]}
    record = {**record, "max_pct": ev.overlap.max_pct}
    if record["overlap_pct"] > ev.overlap.max_pct:
        raise RecipeError("evaluation.perplexity.dataset",
                          f"calibration text ({record['calibration']}) and evaluation text ({record['evaluation']}) "
                          f"overlap {record['overlap_pct']:.1f} % ({record['shared_ngrams']} of "
                          f"{record['evaluation_ngrams']} evaluation {record['n']}-grams, {_short(record)}"
                          f"{record['documents_flagged']} of {record['evaluation_documents']} documents), above "
                          f"evaluation.overlap.max_pct {ev.overlap.max_pct:g} %: evaluate on held-out text")
    return record


def _short(record: dict) -> str:
    """The overlap's short documents (compared whole), when the evaluation text has any."""
    if not record.get("short_documents"):
        return ""
    return (f"{record['short_documents_shared']} of {record['short_documents']} documents under {record['n']} words "
            f"compared whole, ")


def overlapping_sources(calibration, perplexity, base: Path) -> list[str]:
    """Evaluation sources that are also calibration sources: scores on them flatter the calibrated methods."""
    if calibration is None or perplexity is None:
        return []

    def ident(src, field):
        data, _ = source_identity(src, base, field)
        data.pop("weight", None)
        return data

    cal = [ident(s, f"calibration.sources[{i}]") for i, s in enumerate(calibration.sources)]
    out = []
    for i, src in enumerate(perplexity.dataset.sources):
        if ident(src, f"evaluation.perplexity.dataset.sources[{i}]") in cal:
            out.append(f"evaluation.perplexity.dataset.sources[{i}] is also a calibration source: "
                       "perplexity on calibration text flatters calibrated methods (use held-out text)")
    return out
