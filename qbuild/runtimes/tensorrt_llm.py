"""The `tensorrt-llm` runtime: evaluates TensorRT-LLM engines (perplexity, KLD, throughput/latency).

It runs in qbuild's worker but never imports tensorrt_llm: TensorRT-LLM code runs in the configured
TensorRT-LLM interpreter (the target's `python:` / $QBUILD_TRTLLM_PYTHON, as for the build).

- logits: qbuild cuts the windows (protocol.windows) and writes them to a JSON request in the
  step's private dir inside the store; _trtllm_shim.py, run there, loads the engine with the LLM API and
  saves each window's context logits; the generic runners (qbuild/evaluate/quality.py) score them
  exactly as they score every other runtime's.
- throughput: `trtllm-bench throughput --backend tensorrt --streaming` per batch size (the command
  trtllm_bench_args generates, on a synthetic dataset: bench_dataset), its --report_json mapped to throughput.py's
  metric names.

Plan side: an engine evaluation is keyed like the engine (TensorRT-LLM, TensorRT, CUDA, GPU SM and model,
CPU architecture; the whole host too for timings), available exactly where the engine is (needs-gpu, on_missing_gpu), and
reads the source model's tokenizer/config (the engine dir has neither). The TensorRT-LLM environment it runs in (the
interpreter, and the check that it is still the one the engine's key names) is the service qbuild/envs/tensorrt_llm.py
(`trtllm_env` in qbuild.plugin_services), which the target that builds the engines asks too.
"""

from __future__ import annotations

import json
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from qbuild.plugins import EvalStepFields, RecipeError, Runtime, RuntimeSession, StepContext, cpu_model, run_tool, runtimes

SHIM = Path(__file__).with_name("_trtllm_shim.py")


def source_vocab(model_dir: Path) -> int:
    """The source model's vocabulary: engine logits are sliced to it. The engine's own vocab_size can be larger
    (ModelOpt pads AWQ checkpoints to a multiple of 64, TensorRT-LLM pads the lm_head to a multiple of tp_size),
    and the padded columns are zero-weight rows whose logit 0 would take probability mass."""
    from qbuild.plugin_services import source_facts

    return source_facts(json.loads((Path(model_dir) / "config.json").read_text()))["vocab_size"]


def _run(ctx: StepContext, cmd: list[str], what: str) -> float:
    """Run a TensorRT-LLM command, its output into the step's log; seconds taken."""
    ctx.log("running: " + " ".join(cmd))
    t0 = time.perf_counter()
    run_tool(cmd, what)
    return time.perf_counter() - t0


def _workdir(ctx: StepContext):
    # private to this step, inside the store (ctx.out's parent is removed after publishing), never in the object
    return tempfile.TemporaryDirectory(dir=ctx.out.parent, prefix="trtllm-")


class EngineSession(RuntimeSession):
    def __init__(self, engine: Path, ctx: StepContext):
        from qbuild.plugin_services import trtllm_env

        self.engine, self.ctx = engine, ctx
        self.gpu, self.env = trtllm_env.current_environment(ctx.runtime_args)
        self._info: dict = {"name": EngineRuntime.name}

    def window_logits(self, windows) -> Iterator:
        """Run the shim over every window in the TensorRT-LLM interpreter, then hand out each window's logits."""
        import numpy as np

        from qbuild.plugin_services import protocol, trtllm_env

        ctx = self.ctx
        with _workdir(ctx) as work:
            work = Path(work)
            # the shim and protocol.py travel with the request: only the store must be visible to the interpreter
            shutil.copyfile(SHIM, work / SHIM.name)
            shutil.copyfile(protocol.__file__, work / "protocol.py")
            logits_dir = work / "logits"
            logits_dir.mkdir()
            request = {"engine": str(self.engine), "tokenizer": str(ctx.inputs["tokenizer"]),
                       "protocol": str(work / "protocol.py"),
                       "windows": [{"tokens": [int(t) for t in w.tokens], "first_scored": w.first_scored}
                                   for w in windows],
                       "vocab_size": source_vocab(ctx.inputs["tokenizer"]), "batch": 1,
                       "logits_dir": str(logits_dir)}
            (work / "request.json").write_text(json.dumps(request))
            _run(ctx, [*trtllm_env.interpreter(self.env.python), str(work / SHIM.name), str(work / "request.json"),
                       str(work / "result.json")], "the TensorRT-LLM logits shim")
            try:
                result = json.loads((work / "result.json").read_text())
            except (OSError, ValueError) as exc:
                raise RuntimeError(f"the TensorRT-LLM logits shim wrote no result ({exc})") from None
            if len(result.get("nll", ())) != len(windows):
                raise RuntimeError(f"the shim scored {len(result.get('nll', ()))} windows, expected {len(windows)}")
            self._info = {**result.get("runtime", {}), "name": EngineRuntime.name, "engine": str(self.engine),
                          "gpu": self.gpu.as_dict(), "tensorrt_llm": self.env.tensorrt_llm,
                          "tensorrt": self.env.tensorrt, "cuda": self.env.cuda, "seconds": result.get("seconds")}
            for i in range(len(windows)):
                path = logits_dir / f"{i}.npy"
                logits = np.load(path)
                path.unlink()  # full-vocabulary logits are large: one window on disk at a time
                yield logits

    own_throughput = True

    def throughput(self, ctx: StepContext, params: dict) -> dict:
        return bench_throughput(self, ctx, params)

    def info(self) -> dict:
        return self._info


@runtimes.register
class EngineRuntime(Runtime):
    name = "tensorrt-llm"
    extra = "tensorrt-llm"   # runs in the TensorRT-LLM interpreter, never imported here

    def plan_fields(self, label: str, artifact, ctx, measure: str) -> EvalStepFields:
        env = dict(artifact.env_toolchain)   # the engine's facts, GPU model and CPU architecture included
        # the source model's HF config + tokenizer: the LLM API and trtllm-bench read them, the engine has neither
        return EvalStepFields(extra_inputs={"tokenizer": ctx.model()}, env_toolchain=env, requires_gpu=True,
                              unavailable=artifact.unavailable, on_unavailable=artifact.on_unavailable,
                              runtime_args=dict(artifact.runtime_args))

    def cannot_measure(self, label: str, artifact, evaluation) -> dict[str, str]:
        """Evaluation settings the engine cannot serve: RecipeError. Returns what to leave out, with why."""
        s, skipped = artifact.params, {}
        if evaluation.perplexity:
            if not s.get("gather_context_logits"):
                why = (f"engine {label!r} is built without gather_context_logits (set gather_context_logits: true on "
                       "the target to measure perplexity/KLD; it changes the engine key)")
                skipped = {"perplexity": why, "kld": why}
            else:
                n = evaluation.perplexity.context_length
                if n > s["max_input_len"] or n + 1 > s["max_seq_len"] or n > s["max_num_tokens"]:
                    raise RecipeError("evaluation.perplexity.context_length",
                                      f"{n} does not fit engine {label!r} (max_input_len {s['max_input_len']}, "
                                      f"max_seq_len {s['max_seq_len']} ≥ context_length + 1, max_num_tokens "
                                      f"{s['max_num_tokens']})")
        if evaluation.throughput:
            t = evaluation.throughput
            if t.input_len > s["max_input_len"] or t.input_len + t.output_len > s["max_seq_len"]:
                raise RecipeError("evaluation.throughput.input_len",
                                  f"input_len {t.input_len} + output_len {t.output_len} does not fit engine {label!r} "
                                  f"(max_input_len {s['max_input_len']}, max_seq_len {s['max_seq_len']})")
            if max(t.batch_sizes) > s["max_batch_size"]:
                raise RecipeError("evaluation.throughput.batch_sizes",
                                  f"{t.batch_sizes} exceeds engine {label!r}'s max_batch_size {s['max_batch_size']}")
        return skipped

    def open(self, model: Path, ctx: StepContext, n_ctx: int) -> EngineSession:
        return EngineSession(Path(model), ctx)


# --- throughput through trtllm-bench -------------------------------------------------------------------
# Runs `trtllm-bench` (a click group) with the given argv inside the TensorRT-LLM interpreter.
BENCH_SHIM = "import sys; sys.argv[0] = 'trtllm-bench'; from tensorrt_llm.commands.bench import main; sys.exit(main())"


def trtllm_bench_args(model: str, tokenizer_dir: str | Path, engine_dir: str | Path, dataset: str | Path,
                      report_json: str | Path, *, num_requests: int = 0, warmup: int = 2,
                      concurrency: int | None = None, max_batch_size: int | None = None,
                      streaming: bool = False) -> list[str]:
    """`trtllm-bench ... throughput --backend tensorrt` (tensorrt_llm/bench/benchmark/throughput.py, 1.2.x).

    The dataset is JSON lines {"task_id", "input_ids", "output_tokens"}: see bench_dataset().
    max_seq_len is not passed: for the tensorrt backend it comes from the engine. `model_path` must be
    a Hugging Face model dir (trtllm-bench reads its config.json with AutoConfig and its tokenizer), not
    the engine dir, whose config.json is TensorRT-LLM's. `--streaming` adds TTFT/TPOT percentiles
    ("streaming_metrics") to the report.
    """
    args = ["trtllm-bench", "--model", model, "--model_path", str(tokenizer_dir), "throughput",
            "--backend", "tensorrt", "--engine_dir", str(engine_dir), "--dataset", str(dataset),
            "--num_requests", str(num_requests), "--warmup", str(warmup), "--report_json", str(report_json)]
    if concurrency is not None:
        args += ["--concurrency", str(concurrency)]
    if max_batch_size is not None:
        args += ["--max_batch_size", str(max_batch_size)]
    if streaming:
        args += ["--streaming"]
    return args


def bench_dataset(n: int, input_len: int, output_len: int, vocab_size: int, seed: int = 0) -> str:
    """A synthetic fixed-length trtllm-bench dataset (no tokenizer download, reproducible)."""
    import random

    rng = random.Random(seed)
    lines = [json.dumps({"task_id": i, "input_ids": [rng.randrange(100, vocab_size) for _ in range(input_len)],
                         "output_tokens": output_len}) for i in range(n)]
    return "\n".join(lines) + "\n"


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


def bench_throughput(session: EngineSession, ctx: StepContext, p: dict) -> dict:
    from qbuild.plugin_services import trtllm_env

    gpu, env = session.gpu, session.env
    engine, hf_dir = session.engine, Path(ctx.inputs["tokenizer"])
    vocab = source_vocab(hf_dir)
    results, commands, machine = [], [], None
    with _workdir(ctx) as work:
        work = Path(work)
        for i, bs in enumerate(p["batch_sizes"]):
            n = bs * p["repetitions"]
            dataset, report = work / f"dataset-bs{bs}.jsonl", work / f"report-bs{bs}.json"
            dataset.write_text(bench_dataset(n, p["input_len"], p["output_len"], vocab))
            args = trtllm_bench_args("qbuild-model", hf_dir, engine, dataset, report, num_requests=n,
                                         warmup=p["warmup"] * bs, concurrency=bs, max_batch_size=bs, streaming=True)
            ctx.progress(i, len(p["batch_sizes"]), f"trtllm-bench batch {bs}")
            _run(ctx, [*trtllm_env.interpreter(env.python), "-c", BENCH_SHIM, *args[1:]], "trtllm-bench")
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
    runtime = {"name": EngineRuntime.name, "tool": "trtllm-bench throughput --backend tensorrt", "tensorrt_llm": env.tensorrt_llm,
               "tensorrt": env.tensorrt, "cuda": env.cuda}
    out = {"results": results, "settings": settings, "runtime": runtime, "hardware": hardware}
    (ctx.out / "throughput.json").write_text(json.dumps(out, indent=2))
    first = results[0]
    metrics = {k: first[k] for k in ("decode_tok_s", "prefill_tok_s", "ttft_ms", "token_latency_ms_p95")}
    return {"format": "metrics", "metrics": {k: v for k, v in metrics.items() if v is not None},
            "info": {"hardware": hardware}}

