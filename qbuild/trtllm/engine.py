"""`type: tensorrt-llm`: a TensorRT-LLM engine built by `trtllm-build` (TensorRT-LLM 1.2.x) on a GPU.

Input: a TensorRT-LLM checkpoint (method: modelopt, export: trtllm-checkpoint; scheme none for an
unquantized FP16/BF16 engine). Output: the engine dir (config.json + rank<N>.engine), the tokenizer,
and qbuild-engine.json recording what the engine's own config.json does not: the GPU (name, SM,
driver) and the TensorRT / TensorRT-LLM / CUDA versions it was built with.

The engine key = checkpoint (input step key) + build settings + TensorRT-LLM, TensorRT and CUDA
versions + GPU compute capability (SM). Nothing else about the machine enters it, so two identical
GPUs share engines. TensorRT-LLM is never imported in qbuild's process: it is found with
importlib.util.find_spec or in a configured interpreter (targets[i].python or QBUILD_TRTLLM_PYTHON),
and the build runs there. Without a usable GPU + TensorRT-LLM 1.2.x the step plans as "needs-gpu".
Engines are evaluated by the `tensorrt-llm` runtime (qbuild/trtllm/runtime.py).
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Literal

from pydantic import Field, model_validator

from qbuild.errors import RecipeError, UserError
from qbuild.formats import Format
from qbuild.plugins import Target, TargetOptions, targets
from qbuild.schema_base import StrictModel
from qbuild.step import OnUnavailable, Step, StepContext
from qbuild.trtllm import env as trtllm_env

ENGINE_LINE = (1, 2)                 # the last TensorRT-LLM line with the TensorRT engine builder
ENGINE_KIND = "trtllm-engine"
BUILD_INFO = "qbuild-engine.json"
ENV_KEYS = ("gpu.sm", "tensorrt_llm", "tensorrt", "cuda")   # what enters the key besides settings
NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_-]*$"


class Plugins(StrictModel):
    gemm: Literal["auto", "float16", "bfloat16", "float32", "fp8", "disable"] = Field(
        "auto", description="trtllm-build --gemm_plugin.")
    gpt_attention: Literal["auto", "float16", "bfloat16", "float32", "disable"] = Field(
        "auto", description="trtllm-build --gpt_attention_plugin.")


class Expect(StrictModel):
    """Pin the engine's environment: plan keys for it (e.g. on a machine without a GPU) and refuse
    to build anywhere else."""

    sm: str | None = Field(None, pattern=r"^\d+\.\d+$", description="GPU compute capability, e.g. '9.0'.")
    tensorrt_llm: str | None = None
    tensorrt: str | None = None
    cuda: str | None = None


class EngineTarget(TargetOptions):
    """A TensorRT-LLM engine (TensorRT backend, TensorRT-LLM 1.2.x), built on a GPU."""

    type: Literal["tensorrt-llm"]
    name: str = Field("trtllm", pattern=NAME_PATTERN, description="Suffix of the engine's ref: recipe/<variant>.<name>.")
    max_batch_size: int = Field(8, ge=1)
    max_input_len: int = Field(1024, ge=1)
    max_seq_len: int = Field(2048, ge=1, description="Prompt + output tokens of one request.")
    max_num_tokens: int = Field(8192, ge=1, description="Batched tokens per engine step (after padding removal).")
    plugins: Plugins = Field(default_factory=Plugins)
    kv_cache_type: Literal["paged", "continuous", "disabled"] = "paged"
    use_paged_context_fmha: bool = True
    gather_context_logits: bool = Field(
        False, description="Build the engine so it can return context logits (trtllm-build --gather_context_logits): "
        "needed for engine perplexity/KLD; costs GPU memory (max_num_tokens x vocab logits).")
    tp_size: int = Field(1, ge=1, description="Must match the checkpoint's tensor-parallel ranks.")
    pp_size: int = Field(1, ge=1, description="Must match the checkpoint's pipeline-parallel ranks.")
    on_missing_gpu: Literal["fail", "skip"] = Field(
        "fail", description="No GPU / TensorRT-LLM here: fail (exit 2 before any work) or skip the engine steps.")
    python: str | None = Field(
        None, description="Interpreter (or wrapper command) with tensorrt_llm 1.2.x installed; default: "
        "$QBUILD_TRTLLM_PYTHON, else qbuild's own Python if it has tensorrt_llm.")
    expect: Expect = Field(default_factory=Expect)

    @model_validator(mode="after")
    def _consistent(self):
        if self.max_input_len > self.max_seq_len:
            raise ValueError(f"max_input_len ({self.max_input_len}) must not exceed max_seq_len ({self.max_seq_len})")
        if self.use_paged_context_fmha and self.kv_cache_type != "paged":
            raise ValueError("use_paged_context_fmha needs kv_cache_type: paged")
        if self.use_paged_context_fmha and self.plugins.gpt_attention == "disable":
            raise ValueError("use_paged_context_fmha needs the gpt_attention plugin")
        return self


def build_settings(target: EngineTarget) -> dict:
    """The hashed part of the target: everything that changes the engine, nothing that does not."""
    data = target.canonical()
    for k in ("variants", "name", "on_missing_gpu", "python", "expect"):
        data.pop(k, None)
    return data


# --- commands and configs (golden-tested against TensorRT-LLM 1.2.x) ------------------------------
def _onoff(flag: bool) -> str:
    return "enable" if flag else "disable"


def trtllm_build_args(settings: dict, checkpoint_dir: str | Path, output_dir: str | Path) -> list[str]:
    """The `trtllm-build` command line (tensorrt_llm/commands/build.py + plugin arguments, 1.2.x).

    Tensor/pipeline parallelism is not a flag: trtllm-build takes it from the checkpoint's mapping.
    """
    p = settings
    return [
        "trtllm-build",
        "--checkpoint_dir", str(checkpoint_dir),
        "--output_dir", str(output_dir),
        "--max_batch_size", str(p["max_batch_size"]),
        "--max_input_len", str(p["max_input_len"]),
        "--max_seq_len", str(p["max_seq_len"]),
        "--max_num_tokens", str(p["max_num_tokens"]),
        "--kv_cache_type", p["kv_cache_type"],
        "--gemm_plugin", p["plugins"]["gemm"],
        "--gpt_attention_plugin", p["plugins"]["gpt_attention"],
        "--use_paged_context_fmha", _onoff(p["use_paged_context_fmha"]),
    ] + (["--gather_context_logits"] if p.get("gather_context_logits") else [])


def build_config(settings: dict) -> dict:
    """The same settings as an LLM-API `BuildConfig.from_dict(...)` dict (tensorrt_llm.builder, 1.2.x)."""
    p = settings
    extra = {"gather_context_logits": True} if p.get("gather_context_logits") else {}
    return extra | {
        "max_batch_size": p["max_batch_size"],
        "max_input_len": p["max_input_len"],
        "max_seq_len": p["max_seq_len"],
        "max_num_tokens": p["max_num_tokens"],
        "kv_cache_type": p["kv_cache_type"],
        "plugin_config": {
            "gemm_plugin": p["plugins"]["gemm"],
            "gpt_attention_plugin": p["plugins"]["gpt_attention"],
            "use_paged_context_fmha": p["use_paged_context_fmha"],
        },
    }


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


# --- the engine step ---------------------------------------------------------------------------------
def version_line(version: str) -> tuple[int, int] | None:
    m = re.match(r"(\d+)\.(\d+)", version or "")
    return (int(m.group(1)), int(m.group(2))) if m else None


def resolve_environment(target: EngineTarget, gpu, env) -> tuple[dict, list[str]]:
    """(facts that enter the key, reasons this machine cannot build it). Pins win over probes."""
    probed = {"gpu.sm": gpu.sm if gpu else None,
              "tensorrt_llm": env.tensorrt_llm if env else None,
              "tensorrt": env.tensorrt if env else None,
              "cuda": env.cuda if env else None}
    pinned = {"gpu.sm": target.expect.sm, "tensorrt_llm": target.expect.tensorrt_llm,
              "tensorrt": target.expect.tensorrt, "cuda": target.expect.cuda}
    facts = {k: pinned[k] or probed[k] or "unknown" for k in ENV_KEYS}
    reasons = []
    if gpu is None:
        reasons.append("needs GPU: no NVIDIA GPU found (nvidia-smi)")
    elif pinned["gpu.sm"] and pinned["gpu.sm"] != gpu.sm:
        reasons.append(f"needs a GPU with SM {pinned['gpu.sm']}; this machine has {gpu.name} (SM {gpu.sm})")
    if env is None:
        reasons.append("needs TensorRT-LLM 1.2.x: tensorrt_llm is not installed here; set the target's "
                       f"python: or ${trtllm_env.ENV_PYTHON} to an interpreter that has it (NVIDIA's release container)")
    else:
        line = version_line(env.tensorrt_llm)
        if line != ENGINE_LINE:
            newer = line is not None and line > ENGINE_LINE
            reasons.append(f"TensorRT-LLM {env.tensorrt_llm} " + (
                "has no TensorRT engine builder (removed after 1.3.0rc20); use type: trtllm-pytorch, "
                "or a TensorRT-LLM 1.2.x environment" if newer else "is older than the supported 1.2.x line"))
        for k in ("tensorrt_llm", "tensorrt", "cuda"):
            if pinned[k] and probed[k] and pinned[k] != probed[k]:
                reasons.append(f"expect.{k} is {pinned[k]} but the TensorRT-LLM environment has {probed[k]}")
    return facts, reasons


@targets.register
class TensorRTLLMEngine(Target):
    name = "tensorrt-llm"
    options = EngineTarget
    extra = "tensorrt-llm"               # never required in qbuild's own environment: see `python:`
    accepts = {Format.TRTLLM_CHECKPOINT: None}
    purpose = "be built into a TensorRT-LLM engine"
    hints = {Format.HF_MODELOPT: "trtllm-build needs a TensorRT-LLM checkpoint: set export: trtllm-checkpoint on it"}
    default_hint = ("trtllm-build needs a TensorRT-LLM checkpoint: quantize it with method: modelopt "
                    "(fp8, int8-sq, int4-awq, w4a8-awq, or scheme: none for FP16/BF16)")

    def refusal(self, artifact: Step) -> str | None:
        why = super().refusal(artifact)
        if why and artifact.format not in self.hints:
            why += f"; {self.default_hint}"
        return why

    def check_parallelism(self, target: EngineTarget, artifact: Step, field: str) -> None:
        for k in ("tp_size", "pp_size"):
            have = artifact.params.get(k, 1)
            if have != getattr(target, k):
                raise RecipeError(f"{field}.{k}", f"{getattr(target, k)} does not match variant {artifact.variant!r}'s "
                                  f"checkpoint ({k}: {have}); trtllm-build takes parallelism from the checkpoint")

    def describe(self, output: Step) -> str:
        return f"engine, SM {output.env_toolchain.get('gpu.sm', '?')}"

    def plan(self, target: EngineTarget, artifact: Step, ctx, field: str) -> Step:
        self.check_parallelism(target, artifact, field)
        python = trtllm_env.configured_python(target.python)
        gpu, env = trtllm_env.gpu(), trtllm_env.trtllm(python)
        facts, reasons = resolve_environment(target, gpu, env)
        ref_name = f"{artifact.variant}.{target.name}"
        return ctx.add(Step(ENGINE_KIND, f"engine[{ref_name}]", build_settings(target),
                            "qbuild.trtllm.engine:run_build", inputs={"checkpoint": artifact}, threads=ctx.threads,
                            variant=ref_name, format=Format.TRTLLM_ENGINE, scheme=artifact.scheme,
                            env_toolchain=facts, requires_gpu=True, unavailable="; ".join(reasons),
                            on_unavailable=OnUnavailable(target.on_missing_gpu),
                            runtime_args={"python": env.python if env else python, "expected": facts}))


def interpreter(python: str | None) -> list[str]:
    if not python:
        return [sys.executable]
    return python.split()


# Runs `trtllm-build` with the given argv inside the TensorRT-LLM interpreter.
BUILD_SHIM = "import sys; sys.argv[0] = 'trtllm-build'; from tensorrt_llm.commands.build import main; sys.exit(main())"
# Runs `trtllm-bench` (a click group) with the given argv inside the TensorRT-LLM interpreter.
BENCH_SHIM = "import sys; sys.argv[0] = 'trtllm-bench'; from tensorrt_llm.commands.bench import main; sys.exit(main())"


def current_environment(runtime_args: dict) -> tuple:
    """(GPU, TensorRT-LLM env) of this machine; refuses to run where they differ from the planned key."""
    gpu, env = trtllm_env.gpu(), trtllm_env.trtllm(runtime_args.get("python"))
    now = {"gpu.sm": gpu.sm if gpu else None, "tensorrt_llm": env.tensorrt_llm if env else None,
           "tensorrt": env.tensorrt if env else None, "cuda": env.cuda if env else None}
    expected = runtime_args["expected"]
    changed = [f"{k}: planned {expected[k]}, found {now[k]}" for k in ENV_KEYS if now[k] != expected[k]]
    if changed:
        raise RuntimeError("the TensorRT-LLM environment is not the one the key was computed for: " + "; ".join(changed))
    return gpu, env


def run_build(ctx: StepContext) -> dict:
    p = ctx.params
    ckpt = Path(ctx.inputs["checkpoint"])
    gpu, env = current_environment(ctx.runtime_args)
    cfg = json.loads((ckpt / "config.json").read_text())
    mapping = cfg.get("mapping", {})
    if (mapping.get("tp_size", 1), mapping.get("pp_size", 1)) != (p["tp_size"], p["pp_size"]):
        raise RuntimeError(f"checkpoint mapping {mapping} does not match tp_size={p['tp_size']} pp_size={p['pp_size']}")
    if gpu.count < mapping.get("world_size", 1):
        raise RuntimeError(f"the checkpoint has {mapping.get('world_size')} ranks but this machine has {gpu.count} GPU(s)")
    args = trtllm_build_args(p, ckpt, ctx.out)
    cmd = [*interpreter(env.python), "-c", BUILD_SHIM, *args[1:]]
    ctx.log("running: " + " ".join(args))
    ctx.progress(0, 1, "trtllm-build")
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, stdout=sys.stdout, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    if proc.returncode != 0:
        raise RuntimeError(f"trtllm-build exited with code {proc.returncode}")
    seconds = time.perf_counter() - t0
    for f in ckpt.iterdir():  # tokenizer files make the engine dir loadable by LLM(model=engine_dir)
        if f.is_file() and f.name != "config.json" and not f.name.endswith(".safetensors") and not (ctx.out / f.name).exists():
            shutil.copyfile(f, ctx.out / f.name)
    info = {"gpu": gpu.as_dict(), "gpu_sm": gpu.sm, "tensorrt_llm": env.tensorrt_llm, "tensorrt": env.tensorrt,
            "cuda": env.cuda, "trtllm_build": args[:1] + [a if a not in (str(ckpt), str(ctx.out)) else
                                                          ("<checkpoint>" if a == str(ckpt) else "<engine>") for a in args[1:]],
            "build_config": build_config(p), "checkpoint_quantization": cfg.get("quantization")}
    (ctx.out / BUILD_INFO).write_text(json.dumps(info, indent=2, sort_keys=True))
    ctx.progress(1, 1, "built")
    size = sum(f.stat().st_size for f in ctx.out.rglob("*") if f.is_file())
    return {"format": Format.TRTLLM_ENGINE, "metrics": {"size_bytes": size, "build_seconds": round(seconds, 2)}, "info": info}


# --- reading engines back ----------------------------------------------------------------------------
def parse_engine_dir(path: Path) -> dict:
    """What an engine dir says about itself: TensorRT-LLM's config.json plus qbuild's build record.

    TensorRT-LLM's config.json records its own version and the build config, but not the GPU SM
    or the TensorRT version, which decide whether the engine loads; those come from BUILD_INFO.
    """
    path = Path(path)
    try:
        cfg = json.loads((path / "config.json").read_text())
    except (OSError, ValueError) as exc:
        raise UserError(f"{path} is not a TensorRT-LLM engine dir (config.json: {exc})") from None
    pre, bc = cfg.get("pretrained_config", {}), cfg.get("build_config", {})
    mapping = pre.get("mapping", {})
    world = mapping.get("world_size", 1)
    out = {
        "tensorrt_llm": cfg.get("version"),
        "architecture": pre.get("architecture"),
        "dtype": pre.get("dtype"),
        "quant_algo": (pre.get("quantization") or {}).get("quant_algo"),
        "tp_size": mapping.get("tp_size", 1), "pp_size": mapping.get("pp_size", 1),
        "max_batch_size": bc.get("max_batch_size"), "max_input_len": bc.get("max_input_len"),
        "max_seq_len": bc.get("max_seq_len"), "max_num_tokens": bc.get("max_num_tokens"),
        "engines": sorted(p.name for p in path.glob("rank*.engine")),
        "complete": all((path / f"rank{r}.engine").is_file() for r in range(world)),
        "gpu_sm": None, "tensorrt": None, "gpu": None, "recorded_by_qbuild": False,
    }
    info_file = path / BUILD_INFO
    if info_file.is_file():
        info = json.loads(info_file.read_text())
        out.update({"gpu_sm": info.get("gpu_sm"), "tensorrt": info.get("tensorrt"), "cuda": info.get("cuda"),
                    "gpu": info.get("gpu"), "recorded_by_qbuild": True})
        if info.get("tensorrt_llm") and out["tensorrt_llm"] and info["tensorrt_llm"] != out["tensorrt_llm"]:
            raise UserError(f"{path}: config.json says TensorRT-LLM {out['tensorrt_llm']}, "
                            f"{BUILD_INFO} says {info['tensorrt_llm']}")
    return out
