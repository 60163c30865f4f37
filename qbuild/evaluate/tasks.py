"""Task accuracy through lm-eval, over qbuild's own runtime sessions: the same scoring for HF, GGUF, compressed-tensors,
GPTQ/AWQ and engines.

Plan side (torch-free, qbuild/planning/tasks.py): one `task:<name>[<artifact>]` step per task and model artifact. A
variant's step reads the baseline's step (`reference`) and counts the documents whose answer flipped (Dutta et al.
2024, "Accuracy is not all you need": flips show damage that equal accuracy hides).

Worker side (qbuild/evaluate/task_run.py): lm-eval runs the task over `SessionLM`, a qbuild RuntimeSession as an
lm-eval model. Per-document correctness is stored as samples.jsonl, which the flips of every variant are counted
from. This module holds what both sides and the run summary read, and stays light (no lm-eval, no numpy).
"""

from __future__ import annotations

import json
from pathlib import Path

SAMPLES = "samples.jsonl"    # one line per document: doc_id, correct (acc of that document), target, choice
RESULTS = "task.json"        # lm-eval's result row for the task, its config, versions, and the runtime
TOOLS = ("lm-eval", "datasets")
MAX_LENGTH = 2048            # lm-eval's hf default when the config names none; llama.cpp's context is this long


def summary_rows(outcomes) -> dict[str, list[dict]]:
    """artifact key → its task rows for `run --json` (variants[].tasks[]): task, acc, acc_stderr, flips."""
    rows: dict[str, list[dict]] = {}
    for o in outcomes:
        if o.step.kind != "task":
            continue
        m = o.metrics
        flips = None
        if "flips" in m:
            flips = {"right_to_wrong": m["flips_right_to_wrong"], "wrong_to_right": m["flips_wrong_to_right"],
                     "total": m["flips"], "pct": m["flips_pct"]}
        rows.setdefault(o.step.inputs["model"].key, []).append({
            "task": o.step.params["task"], "status": o.status, "acc": m.get("acc"), "acc_stderr": m.get("acc_stderr"),
            "documents": m.get("documents"), "flips": flips, "runtime": o.step.params.get("runtime"),
            "step": o.step.name, "error": o.error})
    return rows


def add_deltas(rows: list[dict]) -> None:
    """Per variant: the worst task's accuracy drop below the baseline (points) and share of flipped answers (%)."""
    base = next((r for r in rows if r["variant"] == "baseline"), None)
    base_acc = {t["task"]: t["acc"] for t in (base or {}).get("tasks") or []}
    for r in rows:
        if r is base or not r.get("tasks"):
            continue
        drops = [100 * (base_acc[t["task"]] - t["acc"]) for t in r["tasks"]
                 if t["acc"] is not None and base_acc.get(t["task"]) is not None]
        flips = [t["flips"]["pct"] for t in r["tasks"] if t["flips"]]
        if drops:
            r["acc_drop_pct"] = max(drops)
        if flips:
            r["flips_pct"] = max(flips)


def read_samples(path) -> dict[int, float]:
    with open(Path(path) / SAMPLES) as f:
        return {(d := json.loads(line))["doc_id"]: d["correct"] for line in f if line.strip()}


def flips(baseline: dict[int, float], variant: dict[int, float]) -> dict:
    """Documents whose answer changed against the baseline: right→wrong and wrong→right (a document is right when
    its metric is 1, e.g. acc), over the documents both scored."""
    common = sorted(set(baseline) & set(variant))
    r2w = sum(1 for d in common if baseline[d] >= 1 > variant[d])
    w2r = sum(1 for d in common if variant[d] >= 1 > baseline[d])
    return {"flips": r2w + w2r, "flips_right_to_wrong": r2w, "flips_wrong_to_right": w2r,
            "flips_pct": round(100 * (r2w + w2r) / len(common), 4) if common else 0.0}
