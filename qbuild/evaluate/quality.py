"""Perplexity, KLD and reference log-probability step runners, generic over runtimes.

One forward pass per model: the baseline's pass (`reference`) gives its perplexity and stores its
log-probabilities at every scored position as an object of its own; a variant's pass
(`perplexity`, with a `reference` input when KLD is asked for) gives its perplexity, KLD and top-1
agreement from the same logits.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np

from qbuild.contract.plugin import open_session
from qbuild.contract.protocol import score_rows, summarize, windows
from qbuild.contract.step import StepContext
from qbuild.evaluate import reference_encoding
from qbuild.evaluate.data import load_tokens
from qbuild.evaluate.llamacpp_kld import llamacpp_kld, read_kld_base

LOGPROBS = "logprobs.npy"        # float16 [scored positions × vocab], windows in order, rows in position order
TOP1 = "top1.npy"                # int32 [scored positions]: each row's argmax, from the float32 log-probs
REFERENCE = "reference.json"     # what the log-probs are: protocol, runtime, per-window row offsets, format
MEASURED = ("ppl", "tokens_scored", "kld", "top1")   # a perplexity step's metrics
REFERENCE_FORMAT = {
    "name": "qbuild-logprobs-v2",
    "dtype": "float16",
    "content": "log-softmax of the baseline's logits at every scored position (row i predicts scored token i), "
               "rounded to float16; each row's float32 argmax in top1.npy; rows are renormalized on read",
    "error_bound": "per entry |error| <= 2^-11 |log p| (float16 rounding); top-1 exact; per-position KLD error "
                   "bounded by qbuild.evaluate.reference_encoding.kld_error_bound",
}


def _windows(ctx: StepContext):
    p = ctx.params
    ids, info = load_tokens(ctx.inputs["data"])
    if "kld_base" in ctx.inputs:  # a llama-perplexity base file: its tokens are the text
        ids = read_kld_base(ctx.inputs["kld_base"]).tokens
        info = {**info, "sources": [{"kld_base": ctx.input_manifests.get("kld_base", {}).get("key")
                                     or Path(ctx.inputs["kld_base"]).name}]}
    wins = windows(ids, p["protocol"], p["context_length"], p["add_bos"], info["bos_token_id"], p["max_windows"],
                   p.get("stride"))
    if not wins:
        raise ValueError(f"evaluation text ({len(ids)} tokens) is shorter than one {p['context_length']}-token window")
    return wins, info


def protocol_record(p: dict, info: dict) -> dict:
    """Everything that makes a number comparable: recorded with every result."""
    keys = ("protocol", "context_length", "stride", "max_windows", "add_bos")
    record = {k: p.get(k) for k in keys} | {"join": info["join"], "sources": info["sources"],
                                             "bos_token_id": info["bos_token_id"]}
    if p.get("flash_attn"):
        record["flash_attn"] = True
    if p.get("kv_cache_dtype"):
        record["kv_cache_dtype"] = p["kv_cache_dtype"]
    return record


def scored_rows(rt, wins, ctx: StepContext):
    """Each window's logit rows that predict its scored tokens. A session with `scored_logits(tokens,
    first_scored)` computes only those rows (llama.cpp); otherwise they are cut from `window_logits`.
    Before each window the session takes the step's current thread allowance (elastic steps)."""
    threads = ctx.threads

    def follow_allowance():
        nonlocal threads
        now = ctx.threads_now()
        if now != threads:
            rt.set_threads(now)
            threads = now

    if rt.scores_rows:
        for w in wins:
            follow_allowance()
            yield rt.scored_logits(w.tokens, w.first_scored)
    else:
        follow_allowance()
        for w, logits in zip(wins, rt.window_logits(wins), strict=True):
            yield logits[w.first_scored - 1: len(w.tokens) - 1]
            follow_allowance()   # window_logits is lazy: this takes effect from its next forward pass


def _write_perplexity(ctx: StepContext, nlls: list, record: dict) -> dict:
    result = summarize(nlls) | record
    (ctx.out / "perplexity.json").write_text(json.dumps(result, indent=2))
    return result


def reference(ctx: StepContext) -> dict:
    """The baseline's one pass: its perplexity, and its scored log-probs stored for every variant's KLD."""
    p = ctx.params
    wins, info = _windows(ctx)
    t0 = time.perf_counter()
    rt = open_session(p["runtime"], ctx.inputs["model"], ctx, p["context_length"])
    n_rows = sum(len(w.tokens) - w.first_scored for w in wins)
    offsets, nlls, top1, row = [], [], [], 0
    with open(ctx.out / LOGPROBS, "wb") as f:
        for i, (w, rows) in enumerate(zip(wins, scored_rows(rt, wins, ctx), strict=True)):
            scored = score_rows(rows, w, logprobs=True)
            nlls.append((scored["nll"], scored["count"]))
            lp = scored["logprobs"]
            if i == 0:
                np.lib.format.write_array_header_1_0(
                    f, {"descr": reference_encoding.DTYPE, "fortran_order": False, "shape": (n_rows, lp.shape[1])})
            reference_encoding.encode(lp).tofile(f)
            top1.append(reference_encoding.top1(lp))
            offsets.append([row, len(lp)])
            row += len(lp)
            ctx.progress(i + 1, len(wins), "windows")
    np.save(ctx.out / TOP1, np.concatenate(top1))
    # no timing in the object's files: a rebuild of the step gives the same bytes (the seconds go to the manifest)
    record = {"protocol": protocol_record(p, info), "runtime": rt.info()}
    seconds = round(time.perf_counter() - t0, 3)
    result = _write_perplexity(ctx, nlls, record)
    ref = {"format": REFERENCE_FORMAT, "rows": n_rows, "vocab": int(lp.shape[1]), "windows": offsets, **record}
    (ctx.out / REFERENCE).write_text(json.dumps(ref, indent=2))
    return {"format": "logprobs", "metrics": {"ppl": result["ppl"], "tokens_scored": result["tokens_scored"]},
            "info": {"logprobs": REFERENCE_FORMAT | {"rows": n_rows, "vocab": int(lp.shape[1])}, "seconds": seconds}}


def reference_from_kld_base(ctx: StepContext) -> dict:
    """The baseline's PPL read off a llama-perplexity base file (its stored log-prob of each next token)."""
    p = ctx.params
    wins, info = _windows(ctx)
    base = read_kld_base(ctx.inputs["kld_base"])
    nlls = []
    for i, w in enumerate(wins):
        lp = base.logprobs(i)
        target = np.asarray(w.tokens[w.first_scored:])
        nlls.append((float(-lp[np.arange(len(target)), target].astype(np.float64).sum()), len(target)))
    record = {"protocol": protocol_record(p, info),
              "runtime": {"name": "llama-perplexity --kl-divergence-base", "n_ctx": base.n_ctx, "n_chunk": base.n_chunk}}
    result = _write_perplexity(ctx, nlls, record)
    return {"format": "logprobs", "metrics": {"ppl": result["ppl"], "tokens_scored": result["tokens_scored"]},
            "info": {"logprobs": {"name": "llama-perplexity-kld-base", "dtype": "uint16",
                                  "error_bound": "scale/2 per entry, at most 16/131070 nats"}}}


class ReferenceReader:
    """A reference object's log-probs, read one window at a time (no memory map: RSS stays one window)."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self.info = json.loads((self.path / REFERENCE).read_text())
        with open(self.path / LOGPROBS, "rb") as f:
            np.lib.format.read_magic(f)
            shape, _, dtype = np.lib.format.read_array_header_1_0(f)
            self.data_offset = f.tell()
        self.vocab, self.dtype = shape[1], dtype
        self.top1_rows = np.load(self.path / TOP1) if (self.path / TOP1).is_file() else None

    def __len__(self) -> int:
        return len(self.info["windows"])

    def window(self, i: int) -> np.ndarray:
        """Window i's log-probs, float32 [rows × vocab], each row summing to 1 in probability."""
        start, n = self.info["windows"][i]
        with open(self.path / LOGPROBS, "rb") as f:
            f.seek(self.data_offset + start * self.vocab * self.dtype.itemsize)
            stored = np.fromfile(f, dtype=self.dtype, count=n * self.vocab).reshape(n, self.vocab)
        return stored if self.dtype == np.float32 else reference_encoding.decode(stored)

    def row(self, i: int, r: int) -> np.ndarray:
        """Row r of window i alone (float32 [vocab], renormalized): a probe reads two rows, not the whole window."""
        start, n = self.info["windows"][i]
        if not 0 <= r < n:
            raise IndexError(f"window {i} has {n} rows, not {r + 1}")
        with open(self.path / LOGPROBS, "rb") as f:
            f.seek(self.data_offset + (start + r) * self.vocab * self.dtype.itemsize)
            stored = np.fromfile(f, dtype=self.dtype, count=self.vocab).reshape(1, self.vocab)
        return (stored if self.dtype == np.float32 else reference_encoding.decode(stored))[0]

    def rows_in(self, i: int) -> int:
        return self.info["windows"][i][1]

    def top1(self, i: int) -> np.ndarray | None:
        """Window i's argmax per row, as the float32 log-probs had it (None: a float32 reference, read it off them)."""
        start, n = self.info["windows"][i]
        return None if self.top1_rows is None else self.top1_rows[start: start + n]


def perplexity(ctx: StepContext) -> dict:
    """A model's one pass: perplexity, and with a `reference` input KLD + top-1 agreement on the same logits."""
    return measure(ctx, ctx.inputs["model"])


def measure(ctx: StepContext, model: Path) -> dict:
    """The `perplexity` step's pass over the model at `model` (the step's input, or a file a search's probe made in its
    scratch: qbuild.quantize.gguf.probe): writes perplexity.json (and divergence.json) into ctx.out, returns the
    step result."""
    p = ctx.params
    wins, info = _windows(ctx)
    file_base = read_kld_base(ctx.inputs["kld_base"]) if "kld_base" in ctx.inputs else None
    ref = None if file_base else ReferenceReader(ctx.inputs["reference"]) if "reference" in ctx.inputs else None
    if ref is not None and len(ref) != len(wins):
        raise RuntimeError(f"the reference has {len(ref)} windows, the evaluation data {len(wins)}")
    t0 = time.perf_counter()
    rt = open_session(p["runtime"], model, ctx, p["context_length"])
    nlls, klds, top1 = [], [], []
    for i, (w, rows) in enumerate(zip(wins, scored_rows(rt, wins, ctx), strict=True)):
        d = score_rows(rows, w, ref.window(i) if ref is not None else None,
                       reference_top1=ref.top1(i) if ref is not None else None)
        nlls.append((d["nll"], d["count"]))
        if file_base is not None:
            d |= llamacpp_kld(file_base.logprobs(i), rows)
        if ref is not None or file_base is not None:
            klds.append(d["kld"])
            top1.append(d["top1"])
        ctx.progress(i + 1, len(wins), "windows")
    record = {"protocol": protocol_record(p, info), "runtime": rt.info()}
    seconds = round(time.perf_counter() - t0, 3)
    result = _write_perplexity(ctx, nlls, record)
    metrics = {"ppl": result["ppl"], "tokens_scored": result["tokens_scored"]}
    if ref is not None or file_base is not None:
        runtime = record["runtime"]
        base_runtime = ({"name": "llama-perplexity --kl-divergence-base", "kld": "llama.cpp (base entries > -16 nats)",
                         "n_ctx": file_base.n_ctx, "n_chunk": file_base.n_chunk} if file_base else
                        {k: v for k, v in ref.info["runtime"].items() if k != "seconds"})   # older references
        metrics |= write_divergence(ctx, klds, top1, {"protocol": record["protocol"], "runtime": runtime,
                                                      "baseline_runtime": base_runtime})["metrics"]
    return {"format": "metrics", "metrics": metrics, "info": {"seconds": seconds}}


def perplexity_of_a_measured_file(ctx: StepContext) -> dict:
    """A `perplexity` step of an artifact that is, byte for byte, one of its measured candidates (a search's chosen
    finalist; qbuild.planning.evaluation.measured_candidates): that candidate's measurement, same params and inputs, is
    this step's result, so its files and metrics are copied instead of running the model again. Which candidate it is
    is decided by content: the one whose files all appear in the artifact with the same sha256 (a stored candidate's
    files, or the files a probe measured in its scratch and recorded, `info.probed_files`); none is an error (the
    planner paired an artifact that is not one of its candidates)."""
    import shutil

    own = {(f["path"], f["sha256"]) for f in ctx.input_manifests["model"].get("files", [])}
    for measured in sorted(r for r in ctx.inputs if r.startswith("measured:")):
        role = measured.removeprefix("measured:")
        src, manifest = Path(ctx.inputs[measured]), ctx.input_manifests[measured]
        candidate = ctx.input_manifests.get(f"candidate:{role}")
        listed = candidate.get("files", []) if candidate is not None else manifest.get("info", {}).get("probed_files", [])
        files = {(f["path"], f["sha256"]) for f in listed}
        if not files or not files <= own:
            continue
        for f in manifest.get("files", []):
            shutil.copyfile(src / f["path"], ctx.out / f["path"])
        metrics = {k: v for k, v in manifest.get("metrics", {}).items() if k in MEASURED}   # a probe's size is not one
        return {"format": "metrics", "metrics": metrics,
                "info": {"seconds": 0.0, "measurement_of": role, "measurement_key": manifest.get("key")}}
    raise RuntimeError(f"{ctx.step_name}: the artifact's files are none of its measured candidates' (sha256 differs); "
                       "its measurements cannot stand for it")


def write_divergence(ctx: StepContext, klds: list, top1: list, record: dict) -> dict:
    """Summarize per-position KLD / top-1 agreement, write divergence.json, return the step result."""
    kld, same = np.concatenate(klds), np.concatenate(top1)
    result = {
        "kld_mean": float(kld.mean()), "kld_p99": float(np.quantile(kld, 0.99)), "kld_max": float(kld.max()),
        "top1_agreement": float(same.mean()), "tokens_scored": int(len(kld)), **record,
    }
    (ctx.out / "divergence.json").write_text(json.dumps(result, indent=2))
    return {"format": "metrics", "metrics": {"kld": result["kld_mean"], "top1": result["top1_agreement"]}}
