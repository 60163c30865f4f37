"""Step runners that evaluate a TensorRT-LLM engine: perplexity, KLD and throughput/latency.

They run in qbuild's worker but never import tensorrt_llm: TensorRT-LLM code runs in the configured
TensorRT-LLM interpreter (the target's `python:` / $QBUILD_TRTLLM_PYTHON, as for the build).

- perplexity: qbuild cuts the windows (protocol.windows), writes them to a JSON request in the step's
  private dir inside the store, and runs trtllm_shim.py there; the shim loads the engine with the
  LLM API, gets context logits and scores each window with protocol.py's window_nll; qbuild sums
  with summarize() and records the protocol exactly as quality.py does.
- divergence: the same, with the shim saving each window's logits; qbuild compares them with the
  baseline's (transformers/llama.cpp runtime) through protocol.window_divergence.
- throughput: `trtllm-bench throughput --backend tensorrt --streaming` per batch size (the command
  tensorrt_llm.trtllm_bench_args generates), its --report_json mapped to throughput.py's metric names.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from qbuild.build import tensorrt_llm as trt
from qbuild.evaluate import protocol
from qbuild.evaluate.quality import _windows, protocol_record, write_divergence
from qbuild.fingerprint import cpu_model
from qbuild.step import StepContext

SHIM = Path(__file__).with_name("trtllm_shim.py")
RUNTIME = "tensorrt-llm"


def _engine_vocab(engine: Path) -> int | None:
    try:
        return json.loads((engine / "config.json").read_text())["pretrained_config"]["vocab_size"]
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _run(ctx: StepContext, cmd: list[str], what: str) -> float:
    """Run a TensorRT-LLM command, its output into the step's log; seconds taken."""
    ctx.log("running: " + " ".join(cmd))
    t0 = time.perf_counter()
    sys.stdout.flush()
    proc = subprocess.run(cmd, stdout=sys.stdout, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    if proc.returncode != 0:
        raise RuntimeError(f"{what} exited with code {proc.returncode} (see the step log)")
    return time.perf_counter() - t0


def engine_logits(ctx: StepContext, wins: list[protocol.Window], work: Path, save_logits: bool) -> dict:
    """Run the shim on `wins` in the TensorRT-LLM interpreter; its result ({"nll", "runtime", "seconds"})."""
    gpu, env = trt.current_environment(ctx.runtime_args)
    engine = Path(ctx.inputs["model"])
    # the shim and protocol.py travel with the request: only the store must be visible to the interpreter
    shutil.copyfile(SHIM, work / SHIM.name)
    shutil.copyfile(protocol.__file__, work / "protocol.py")
    logits_dir = work / "logits"
    if save_logits:
        logits_dir.mkdir()
    request = {"engine": str(engine), "tokenizer": str(ctx.inputs["tokenizer"]), "protocol": str(work / "protocol.py"),
               "windows": [{"tokens": [int(t) for t in w.tokens], "first_scored": w.first_scored} for w in wins],
               "vocab_size": _engine_vocab(engine), "batch": 1,
               "logits_dir": str(logits_dir) if save_logits else None}
    (work / "request.json").write_text(json.dumps(request))
    ctx.progress(0, len(wins), "windows (TensorRT-LLM)")
    _run(ctx, [*trt.interpreter(env.python), str(work / SHIM.name), str(work / "request.json"), str(work / "result.json")],
         "the TensorRT-LLM perplexity shim")
    try:
        result = json.loads((work / "result.json").read_text())
    except (OSError, ValueError) as exc:
        raise RuntimeError(f"the TensorRT-LLM perplexity shim wrote no result ({exc})") from None
    if len(result.get("nll", ())) != len(wins):
        raise RuntimeError(f"the shim scored {len(result.get('nll', ()))} windows, expected {len(wins)}")
    ctx.progress(len(wins), len(wins), "windows (TensorRT-LLM)")
    result["runtime"] = {**result.get("runtime", {}), "name": RUNTIME, "engine": str(engine), "gpu": gpu.as_dict(),
                         "tensorrt_llm": env.tensorrt_llm, "tensorrt": env.tensorrt, "cuda": env.cuda}
    return result


def _workdir(ctx: StepContext):
    # private to this step, inside the store (ctx.out's parent is removed after publishing), never in the object
    return tempfile.TemporaryDirectory(dir=ctx.out.parent, prefix="trtllm-")


def perplexity(ctx: StepContext) -> dict:
    p = ctx.params
    wins, info = _windows(ctx)
    with _workdir(ctx) as work:
        res = engine_logits(ctx, wins, Path(work), save_logits=False)
    nlls = [(float(s), int(c)) for s, c in res["nll"]]
    result = protocol.summarize(nlls) | {"protocol": protocol_record(p, info),
                                         "runtime": res["runtime"] | {"seconds": res.get("seconds")}}
    (ctx.out / "perplexity.json").write_text(json.dumps(result, indent=2))
    return {"format": "metrics", "metrics": {"ppl": result["ppl"], "tokens_scored": result["tokens_scored"]},
            "info": {"runtime": result["runtime"]}}


def divergence(ctx: StepContext) -> dict:
    """KL(baseline ‖ engine) and top-1 agreement, on the same windows as perplexity."""
    from qbuild.evaluate.runtimes import open_runtime

    p = ctx.params
    wins, info = _windows(ctx)
    with _workdir(ctx) as work:
        res = engine_logits(ctx, wins, Path(work), save_logits=True)
        base = open_runtime(p["baseline_runtime"], ctx.inputs["baseline"], p["context_length"], ctx.threads, ctx.device)
        klds, top1 = [], []
        for i, w in enumerate(wins):
            eng = np.load(Path(work) / "logits" / f"{i}.npy")
            ref = base.logits(w.tokens)
            if eng.shape != ref.shape:
                raise RuntimeError(f"window {i}: engine logits {eng.shape} vs baseline {ref.shape}")
            d = protocol.window_divergence(ref, eng, w)
            klds.append(d["kld"])
            top1.append(d["top1"])
            ctx.progress(i + 1, len(wins), "windows (baseline)")
    return write_divergence(ctx, klds, top1, {"protocol": protocol_record(p, info), "runtime": res["runtime"],
                                              "baseline_runtime": base.info()})


# --- throughput through trtllm-bench -------------------------------------------------------------------
def parse_bench_report(report: dict, batch_size: int, input_len: int) -> dict:
    """trtllm-bench (1.2.x) --report_json → throughput.py's metric names, plus the raw headline numbers.

    decode_tok_s = batch size × per-user generation speed (streaming_metrics.token_output_speed_tok_s,
    which excludes the first token), the analogue of throughput.py's batch-size × decode steps/s;
    ttft_ms = p50 time to first token; token_latency_ms_p50/p95 = percentiles over requests of the
    per-request mean time per output token (TPOT); prefill_tok_s = batch size × input_len / TTFT p50
    (derived: TTFT includes scheduling). Without streaming metrics, decode_tok_s falls back to the
    system output throughput (all output tokens / end-to-end time) and the latency fields are None.
    """
    perf = report.get("performance") or {}
    stream = report.get("streaming_metrics") or {}
    ttft, tpot = stream.get("ttft_percentiles") or {}, stream.get("tpot_percentiles") or {}
    per_user = stream.get("token_output_speed_tok_s")
    system = perf.get("system_output_throughput_tok_s", perf.get("output_throughput_tok_s"))
    ttft_ms = ttft.get("p50", stream.get("avg_ttft_ms"))
    return {
        "batch_size": batch_size,
        "decode_tok_s": batch_size * per_user if per_user else system,
        "decode_tok_s_source": "batch_size x streaming token_output_speed_tok_s" if per_user
        else "performance.system_output_throughput_tok_s",
        "prefill_tok_s": batch_size * input_len / (ttft_ms / 1000) if ttft_ms else None,
        "ttft_ms": ttft_ms,
        "token_latency_ms_p50": tpot.get("p50"), "token_latency_ms_p95": tpot.get("p95"),
        "system_output_tok_s": system,
        "request_throughput_req_s": perf.get("request_throughput_req_s"),
        "request_latency_ms_p50": (perf.get("request_latency_percentiles_ms") or {}).get("p50"),
        "num_requests": (report.get("request_info") or {}).get("num_requests"),
    }


def throughput(ctx: StepContext) -> dict:
    p = ctx.params
    gpu, env = trt.current_environment(ctx.runtime_args)
    engine, hf_dir = Path(ctx.inputs["model"]), Path(ctx.inputs["tokenizer"])
    vocab = _engine_vocab(engine) or 32000
    results, commands, machine = [], [], None
    with _workdir(ctx) as work:
        work = Path(work)
        for i, bs in enumerate(p["batch_sizes"]):
            n = bs * p["repetitions"]
            dataset, report = work / f"dataset-bs{bs}.jsonl", work / f"report-bs{bs}.json"
            dataset.write_text(trt.bench_dataset(n, p["input_len"], p["output_len"], vocab))
            args = trt.trtllm_bench_args("qbuild-model", hf_dir, engine, dataset, report, num_requests=n,
                                         warmup=p["warmup"] * bs, concurrency=bs, max_batch_size=bs, streaming=True)
            ctx.progress(i, len(p["batch_sizes"]), f"trtllm-bench batch {bs}")
            _run(ctx, [*trt.interpreter(env.python), "-c", trt.BENCH_SHIM, *args[1:]], "trtllm-bench")
            try:
                rep = json.loads(report.read_text())
            except (OSError, ValueError) as exc:
                raise RuntimeError(f"trtllm-bench wrote no report ({exc})") from None
            (ctx.out / report.name).write_text(json.dumps(rep, indent=2))  # the raw report, kept with the result
            machine = rep.get("machine") or machine
            results.append(parse_bench_report(rep, bs, p["input_len"]))
            commands.append(["trtllm-bench"] + [{str(engine): "<engine>", str(hf_dir): "<model>", str(dataset): "<dataset>",
                                                 str(report): "<report>"}.get(a, a) for a in args[1:]])
    ctx.progress(len(p["batch_sizes"]), len(p["batch_sizes"]), "done")
    hardware = {"gpu": gpu.as_dict(), "gpu_bench": machine, "cpu": cpu_model()}
    settings = {k: p[k] for k in ("input_len", "output_len", "warmup", "repetitions", "batch_sizes")} | {
        "requests_per_batch_size": "batch_size x repetitions", "warmup_requests": "batch_size x warmup",
        "concurrency": "batch_size", "streaming": True, "eos": "disabled (fixed output length)",
        "trtllm_bench": commands}
    runtime = {"name": RUNTIME, "tool": "trtllm-bench throughput --backend tensorrt", "tensorrt_llm": env.tensorrt_llm,
               "tensorrt": env.tensorrt, "cuda": env.cuda}
    out = {"results": results, "settings": settings, "runtime": runtime, "hardware": hardware}
    (ctx.out / "throughput.json").write_text(json.dumps(out, indent=2))
    first = results[0]
    metrics = {k: first[k] for k in ("decode_tok_s", "prefill_tok_s", "ttft_ms", "token_latency_ms_p95")}
    return {"format": "metrics", "metrics": {k: v for k, v in metrics.items() if v is not None},
            "info": {"hardware": hardware}}

