"""SGLang's server, `python -m sglang.launch_server --model-path MODEL` (docs.sglang.io, "Server Arguments")."""

from __future__ import annotations

from qbuild.plugins import servers
from qbuild.servers._gpu import SERVED_NAME, GPUServer


@servers.register
class SGLangServer(GPUServer):
    name = "sglang"
    engine = "sglang"
    tools = ("sglang",)
    extra = "sglang"
    requires = ("sglang",)
    program = ("{python}", "-m", "sglang.launch_server")
    model_flag = "--model-path"

    def refusal(self, config) -> str | None:
        return self.common_refusal(config, {"fp8": "fp8_e4m3"})

    def args(self, config, *, threads: int, slots: int, context: int) -> list[str]:
        args = ["--host", "127.0.0.1", "--served-model-name", SERVED_NAME,
                "--max-running-requests", str(config.parallel or slots), "--context-length", str(context)]
        if config.kv_cache_dtype:
            args += ["--kv-cache-dtype", "fp8_e4m3"]
        if config.prefix_caching is False:   # the radix (prefix) cache is on by default
            args.append("--disable-radix-cache")
        return args
