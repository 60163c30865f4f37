"""vLLM's OpenAI-compatible server, `vllm serve MODEL` (docs.vllm.ai, "vllm serve" CLI reference).

Only how to start it lives here: the vLLM *quality* runtime (logits for perplexity/KLD) is a `Runtime` of its own in
qbuild/runtimes/; both name the engine "vllm", so an artifact vLLM loads is served here and scored there."""

from __future__ import annotations

from qbuild.contract.plugin import servers
from qbuild.serving.engines._gpu import SERVED_NAME, GPUServer


@servers.register
class VLLMServer(GPUServer):
    name = "vllm"
    engine = "vllm"
    tools = ("vllm",)
    extra = "vllm"
    requires = ("vllm",)
    program = ("vllm", "serve")

    def refusal(self, config) -> str | None:
        return self.common_refusal(config, {"fp8": "fp8"})

    def args(self, config, *, threads: int, slots: int, context: int) -> list[str]:
        args = ["--host", "127.0.0.1", "--served-model-name", SERVED_NAME, "--max-num-seqs", str(config.parallel or slots),
                "--max-model-len", str(context), "--disable-log-requests"]
        if config.kv_cache_dtype:
            args += ["--kv-cache-dtype", "fp8"]
        if config.prefix_caching is not None:
            args.append("--enable-prefix-caching" if config.prefix_caching else "--no-enable-prefix-caching")
        return args
