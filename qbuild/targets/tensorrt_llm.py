"""`type: tensorrt-llm`: a TensorRT-LLM engine built by `trtllm-build` (TensorRT-LLM 1.2.x) on a GPU.

Input: a TensorRT-LLM checkpoint (method: modelopt, export: trtllm-checkpoint; scheme none for an
unquantized FP16/BF16 engine). Output: the engine dir (config.json + rank<N>.engine), the tokenizer,
and qbuild-engine.json recording what the engine's own config.json does not: the GPU (name, SM,
driver) and the TensorRT / TensorRT-LLM / CUDA versions it was built with.

The engine key = checkpoint (input step key) + build settings + TensorRT-LLM, TensorRT and CUDA
versions + GPU compute capability (SM) + GPU model name + CPU architecture. TensorRT engines are not
portable across GPU models (H100, H200 and GH200 are all SM 9.0, with different SM counts and memory)
or platforms (x86_64 vs aarch64 hosts), so all of these enter the key and the pull-time match; the
driver does not. A fact that cannot be read (no GPU, a TensorRT-LLM whose TensorRT or CUDA version is
not in its package metadata) never enters a key as a placeholder that another machine could match:
the step is not available here ("needs-gpu", with the reason) unless `expect:` pins it.
TensorRT-LLM is never imported in qbuild's process: it is found with importlib.util.find_spec or in a
configured interpreter (targets[i].python or QBUILD_TRTLLM_PYTHON), and the build runs there. Those probes and the
facts they give are the TensorRT-LLM environment, a service (qbuild/envs/tensorrt_llm.py, `trtllm_env` in
qbuild.plugin_services) shared with the `tensorrt-llm` runtime (qbuild/runtimes/tensorrt_llm.py), which evaluates
engines.
"""

from __future__ import annotations

import json
import re
import shutil
import sys
import time
from pathlib import Path
from typing import Literal

from pydantic import Field, model_validator

from qbuild.plugin_services import QUANT_ALGO
from qbuild.plugins import (
    FormatSpec,
    OnUnavailable,
    PullOption,
    RecipeError,
    Step,
    StepContext,
    StrictModel,
    Target,
    TargetOptions,
    UserError,
    dir_size,
    register_format,
    run_tool,
    targets,
)
from qbuild.targets.trtllm_select import ENGINE_KIND

ENGINE_LINE = (1, 2)                 # the last TensorRT-LLM line with the TensorRT engine builder
BUILD_INFO = "qbuild-engine.json"
NOT_FOUND = "not-found"   # an unreadable fact of a step that is unavailable here; never built, never matched
FP8_CONTEXT_FMHA_ALGOS = ("FP8", "W4A8_AWQ", "NVFP4")   # builder.py applies use_fp8_context_fmha to these only
# TensorRT-LLM 1.2.x builder.py build(): for 100 <= SM < 120 it raises on INT8/INT4 weight-only (QuantMode
# is_int8_weight_only / is_int4_weight_only, and QuantMode.from_quant_algo maps W4A16_AWQ and W4A8_AWQ to
# use_weight_only(use_int4_weights=True, per_group=True)) and on SmoothQuant (has_act_and_weight_quant)
SM100_REFUSED = {"int8-sq": "SmoothQuant", "int4-awq": "INT4 weight-only (W4A16_AWQ)",
                 "w4a8-awq": "INT4 weight-only (W4A8_AWQ is an INT4 weight-only QuantMode)"}
NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_-]*$"
# what this target builds: a TensorRT engine dir, which loads on the SM and TensorRT-LLM version it was built for
ENGINE_FORMAT = register_format(FormatSpec(
    "trtllm-engine", "TensorRT-LLM engine (TensorRT backend, 1.2.x)", evaluated_by=("tensorrt-llm",),
    loads_in=("tensorrt-llm",),
    load_commands=(("tensorrt-llm", "`trtllm-serve {dir} --tokenizer BASE_MODEL`"),))).name


class Plugins(StrictModel):
    gemm: Literal["auto", "float16", "bfloat16", "float32", "fp8", "disable"] = Field(
        "auto", description="trtllm-build --gemm_plugin.")
    gpt_attention: Literal["auto", "float16", "bfloat16", "float32", "disable"] = Field(
        "auto", description="trtllm-build --gpt_attention_plugin.")


class Expect(StrictModel):
    """Pin the engine's environment: plan keys for it (e.g. on a machine without a GPU) and refuse
    to build anywhere else."""

    sm: str | None = Field(None, pattern=r"^\d+\.\d+$", description="GPU compute capability, e.g. '9.0'.")
    gpu_name: str | None = Field(None, description="GPU model as nvidia-smi names it, e.g. 'NVIDIA H100 80GB HBM3'.")
    arch: str | None = Field(None, description="CPU architecture of the build host (platform.machine()), e.g. x86_64.")
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
        False, description="Build the engine so it can return context logits (trtllm-build --gather_context_logits, "
        "with --logits_dtype float32): needed for engine perplexity/KLD; costs GPU memory (max_num_tokens x vocab "
        "float32 logits).")
    use_fp8_context_fmha: bool = Field(
        False, description="FP8 context attention (trtllm-build --use_fp8_context_fmha) for fp8, w4a8-awq and nvfp4 "
        "checkpoints; always passed explicitly (TensorRT-LLM 1.2 turns it on by default). Off by default: an "
        "FP8-attention accuracy regression was reported against 1.2.0.")
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
    With context logits, `--logits_dtype float32` (build.py's "Logits arguments"; it overrides the
    checkpoint's logits_dtype, which ModelOpt writes as float16 even for bf16 models): perplexity and
    KLD need more than fp16 logits. `--use_fp8_context_fmha` (plugin/plugin.py, enable|disable) is
    always explicit: its 1.2.x default is on, and builder.py ignores it for non-FP8 checkpoints.
    """
    p = settings
    logits = ["--gather_context_logits", "--logits_dtype", "float32"] if p.get("gather_context_logits") else []
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
        "--use_fp8_context_fmha", _onoff(p.get("use_fp8_context_fmha", False)),
    ] + logits


def build_config(settings: dict) -> dict:
    """The same settings as an LLM-API `BuildConfig.from_dict(...)` dict (tensorrt_llm.builder, 1.2.x).

    logits_dtype is not a BuildConfig field (trtllm-build sets it on the model config): see trtllm_build_args."""
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
            "use_fp8_context_fmha": p.get("use_fp8_context_fmha", False),
        },
    }


# --- the engine step ---------------------------------------------------------------------------------
def version_line(version: str) -> tuple[int, int] | None:
    m = re.match(r"(\d+)\.(\d+)", version or "")
    return (int(m.group(1)), int(m.group(2))) if m else None


def resolve_environment(target: EngineTarget, gpu, env) -> tuple[dict, list[str]]:
    """(facts that enter the key, reasons this machine cannot build it). Pins win over probes."""
    from qbuild.plugin_services import trtllm_env

    probed = trtllm_env.probed_facts(gpu, env)
    e = target.expect
    pinned = {"gpu.sm": e.sm, "gpu.name": e.gpu_name, "host.arch": e.arch, "tensorrt_llm": e.tensorrt_llm,
              "tensorrt": e.tensorrt, "cuda": e.cuda}
    facts = {k: pinned[k] or probed[k] or NOT_FOUND for k in trtllm_env.ENV_KEYS}
    reasons = []
    if gpu is None:
        reasons.append("needs GPU: no NVIDIA GPU found (nvidia-smi)")
    else:
        for k, label in (("gpu.sm", "SM"), ("gpu.name", "GPU")):
            if pinned[k] and pinned[k] != probed[k]:
                reasons.append(f"needs {label} {pinned[k]}; this machine has {gpu.name} (SM {gpu.sm})")
    if not probed["host.arch"]:
        reasons.append("needs a known CPU architecture: platform.machine() is empty here")
    elif pinned["host.arch"] and pinned["host.arch"] != probed["host.arch"]:
        reasons.append(f"needs a {pinned['host.arch']} host; this machine is {probed['host.arch']}")
    if env is None:
        reasons.append("needs TensorRT-LLM 1.2.x: tensorrt_llm is not installed here; set the target's "
                       f"python: or ${trtllm_env.ENV_PYTHON} to an interpreter that has it (NVIDIA's release container)")
    else:
        unreadable = [k for k in ("tensorrt_llm", "tensorrt", "cuda") if not probed[k]]
        if unreadable:   # an engine keyed without them could be handed to another TensorRT: not built at all
            reasons.append(f"needs TensorRT-LLM 1.2.x with known versions: the {', '.join(unreadable)} version of the "
                           f"TensorRT-LLM environment ({env.python or sys.executable}) cannot be read from its package "
                           "metadata, and an engine is keyed by them")
        line = version_line(env.tensorrt_llm or "")
        if env.tensorrt_llm and line != ENGINE_LINE:
            newer = line is not None and line > ENGINE_LINE
            reasons.append(f"TensorRT-LLM {env.tensorrt_llm} " + (
                "has no TensorRT engine builder (removed after 1.3.0rc20); use type: trtllm-pytorch, "
                "or a TensorRT-LLM 1.2.x environment" if newer else "is older than the supported 1.2.x line"))
        for k in ("tensorrt_llm", "tensorrt", "cuda"):
            if pinned[k] and probed[k] and pinned[k] != probed[k]:
                reasons.append(f"expect.{k} is {pinned[k]} but the TensorRT-LLM environment has {probed[k]}")
    return facts, reasons


def is_sm100_family(sm: str | None) -> bool:
    """SM 10.x and 11.x, where TensorRT-LLM 1.2.x's builder refuses INT8/INT4 weight-only and SmoothQuant
    (builder.py: `get_sm_version() >= 100 and get_sm_version() < 120`; SM 12.x is not refused)."""
    line = version_line(sm or "")
    return line is not None and 10 <= line[0] < 12


def sm100_refusal(sm: str, variant: str | None, scheme: str) -> str:
    return (f"TensorRT-LLM 1.2.x cannot build {SM100_REFUSED[scheme]} engines for SM {sm} (its builder refuses "
            f"INT8/INT4 weight-only and SmoothQuant on SM 10.x-11.x); variant {variant!r} is {scheme}: use scheme fp8 "
            "(or nvfp4 with export: hf and type: trtllm-pytorch)")


@targets.register
class TensorRTLLMEngine(Target):
    name = "tensorrt-llm"
    options = EngineTarget
    extra = "tensorrt-llm"               # never required in qbuild's own environment: see `python:`
    accepts = {"trtllm-checkpoint": None}   # the modelopt method's export: trtllm-checkpoint
    purpose = "be built into a TensorRT-LLM engine"
    hints = {"hf-modelopt": "trtllm-build needs a TensorRT-LLM checkpoint: set export: trtllm-checkpoint on it"}
    default_hint = ("trtllm-build needs a TensorRT-LLM checkpoint: quantize it with method: modelopt "
                    "(fp8, int8-sq, int4-awq, w4a8-awq, or scheme: none for FP16/BF16)")
    # an engine loads only on the GPU model, CPU architecture and TensorRT version it was built with
    machine_bound_kind = ENGINE_KIND
    pull_options = (PullOption("tensorrt-llm", "tensorrt_llm", "Select engines built with this TensorRT-LLM version."),
                    PullOption("tensorrt", "tensorrt", "Select engines built with this TensorRT version."))

    def machine_needs(self, chosen: dict[str, str | None]) -> dict:
        from qbuild.targets.trtllm_select import local_needs

        return local_needs(chosen.get("gpu.sm"), chosen.get("tensorrt_llm"), chosen.get("tensorrt"),
                           gpu_name=chosen.get("gpu.name"), arch=chosen.get("host.arch"))

    def select_build(self, builds: list[dict], need: dict, ref: str) -> dict:
        from qbuild.targets.trtllm_select import select_engine

        return select_engine(builds, need, ref)

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
        tc = output.env_toolchain
        return f"engine, {tc.get('gpu.name', '?')} (SM {tc.get('gpu.sm', '?')}), {tc.get('host.arch', '?')}"

    def check_quantization(self, target: EngineTarget, artifact: Step, field: str) -> None:
        """Settings the builder would silently ignore for this checkpoint: refused here, naming the field."""
        scheme = artifact.params.get("scheme", artifact.scheme)
        algo = QUANT_ALGO.get(scheme)
        if target.use_fp8_context_fmha and algo not in FP8_CONTEXT_FMHA_ALGOS:
            raise RecipeError(f"{field}.use_fp8_context_fmha", f"applies to fp8, w4a8-awq and nvfp4 checkpoints; "
                              f"variant {artifact.variant!r} is {scheme} (TensorRT-LLM would turn it off)")
        if is_sm100_family(target.expect.sm) and scheme in SM100_REFUSED:
            raise RecipeError(f"{field}.expect.sm", sm100_refusal(target.expect.sm, artifact.variant, scheme))

    def plan(self, target: EngineTarget, artifact: Step, ctx, field: str) -> Step:
        from qbuild.plugin_services import trtllm_env

        self.check_parallelism(target, artifact, field)
        self.check_quantization(target, artifact, field)
        python = trtllm_env.configured_python(target.python)
        gpu, env = trtllm_env.gpu(), trtllm_env.trtllm(python)
        facts, reasons = resolve_environment(target, gpu, env)
        scheme = artifact.params.get("scheme", artifact.scheme)
        if is_sm100_family(facts["gpu.sm"]) and scheme in SM100_REFUSED:   # this GPU cannot build it; another can
            reasons.append(sm100_refusal(facts["gpu.sm"], artifact.variant, scheme))
        ref_name = f"{artifact.variant}.{target.name}"
        settings = build_settings(target)
        # the command is a pure function of the hashed settings: shown by `qbuild plan --json`, not hashed again
        command = trtllm_build_args(settings, "<checkpoint>", "<engine>")
        return ctx.add(Step(ENGINE_KIND, f"engine[{ref_name}]", settings,
                            "qbuild.targets.tensorrt_llm:run_build", inputs={"checkpoint": artifact}, threads=ctx.threads,
                            variant=ref_name, format=ENGINE_FORMAT, scheme=artifact.scheme,
                            env_toolchain=facts, requires_gpu=True, unavailable="; ".join(reasons),
                            on_unavailable=OnUnavailable(target.on_missing_gpu),
                            runtime_args={"python": env.python if env else python, "expected": facts,
                                          "command": command}))


# Runs `trtllm-build` with the given argv inside the TensorRT-LLM interpreter.
BUILD_SHIM = "import sys; sys.argv[0] = 'trtllm-build'; from tensorrt_llm.commands.build import main; sys.exit(main())"


def run_build(ctx: StepContext) -> dict:
    from qbuild.plugin_services import trtllm_env

    p = ctx.params
    ckpt = Path(ctx.inputs["checkpoint"])
    gpu, env = trtllm_env.current_environment(ctx.runtime_args)
    cfg = json.loads((ckpt / "config.json").read_text())
    mapping = cfg.get("mapping", {})
    if (mapping.get("tp_size", 1), mapping.get("pp_size", 1)) != (p["tp_size"], p["pp_size"]):
        raise RuntimeError(f"checkpoint mapping {mapping} does not match tp_size={p['tp_size']} pp_size={p['pp_size']}")
    if gpu.count < mapping.get("world_size", 1):
        raise RuntimeError(f"the checkpoint has {mapping.get('world_size')} ranks but this machine has {gpu.count} GPU(s)")
    args = trtllm_build_args(p, ckpt, ctx.out)
    cmd = [*trtllm_env.interpreter(env.python), "-c", BUILD_SHIM, *args[1:]]
    ctx.log("running: " + " ".join(args))
    ctx.progress(0, 1, "trtllm-build")
    t0 = time.perf_counter()
    run_tool(cmd, "trtllm-build")
    seconds = time.perf_counter() - t0
    for f in ckpt.iterdir():  # tokenizer files make the engine dir loadable by LLM(model=engine_dir)
        if f.is_file() and f.name != "config.json" and not f.name.endswith(".safetensors") and not (ctx.out / f.name).exists():
            shutil.copyfile(f, ctx.out / f.name)
    info = {"gpu": gpu.as_dict(), "gpu_sm": gpu.sm, "host_arch": trtllm_env.host_arch(),
            "tensorrt_llm": env.tensorrt_llm, "tensorrt": env.tensorrt,
            "cuda": env.cuda, "trtllm_build": args[:1] + [a if a not in (str(ckpt), str(ctx.out)) else
                                                          ("<checkpoint>" if a == str(ckpt) else "<engine>") for a in args[1:]],
            "build_config": build_config(p), "checkpoint_quantization": cfg.get("quantization")}
    (ctx.out / BUILD_INFO).write_text(json.dumps(info, indent=2, sort_keys=True))
    ctx.progress(1, 1, "built")
    size = dir_size(ctx.out)
    return {"format": ENGINE_FORMAT, "metrics": {"size_bytes": size, "build_seconds": round(seconds, 2)}, "info": info}


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
        "gpu_sm": None, "tensorrt": None, "gpu": None, "host_arch": None, "recorded_by_qbuild": False,
    }
    info_file = path / BUILD_INFO
    if info_file.is_file():
        info = json.loads(info_file.read_text())
        out.update({"gpu_sm": info.get("gpu_sm"), "tensorrt": info.get("tensorrt"), "cuda": info.get("cuda"),
                    "gpu": info.get("gpu"), "host_arch": info.get("host_arch"), "recorded_by_qbuild": True})
        if info.get("tensorrt_llm") and out["tensorrt_llm"] and info["tensorrt_llm"] != out["tensorrt_llm"]:
            raise UserError(f"{path}: config.json says TensorRT-LLM {out['tensorrt_llm']}, "
                            f"{BUILD_INFO} says {info['tensorrt_llm']}")
    return out
