"""TensorRT-LLM's OpenAI-compatible server, `trtllm-serve MODEL` (nvidia.github.io/TensorRT-LLM, "trtllm-serve").

The PyTorch backend (the default, and the only one after 1.2.x) serves an HF checkpoint or a `trtllm-pytorch`
artifact; the KV-cache settings go in the LLM-API options YAML (`kv_cache_config`), written next to the results."""

from __future__ import annotations

from pathlib import Path

from qbuild.plugins import servers
from qbuild.servers._gpu import SERVED_NAME, GPUServer

OPTIONS = "extra_llm_api_options.yaml"


@servers.register
class TrtllmServer(GPUServer):
    name = "trtllm-serve"
    engine = "trtllm-pytorch"
    tools = ("tensorrt-llm",)
    extra = "tensorrt-llm"
    requires = ("tensorrt_llm",)
    program = ("trtllm-serve",)

    batch_flag = "--max_num_tokens"

    def refusal(self, config) -> str | None:
        return self.common_refusal(config, {"fp8": "fp8"})

    def options(self, config) -> dict:
        kv: dict = {}
        if config.kv_cache_dtype:
            kv["dtype"] = "fp8"
        if config.prefix_caching is not None:
            kv["enable_block_reuse"] = bool(config.prefix_caching)
        return {"kv_cache_config": kv} if kv else {}

    def args(self, config, *, threads: int, slots: int, context: int) -> list[str]:
        args = ["--host", "127.0.0.1", "--backend", "pytorch", "--served_model_name", SERVED_NAME,
                "--max_batch_size", str(config.parallel or slots), "--max_seq_len", str(context)]
        if config.batch_size is not None:
            args += [self.batch_flag, str(config.batch_size)]
        if self.options(config):
            args += ["--extra_llm_api_options", OPTIONS]
        return args

    def write_files(self, config, workdir: Path, *, slots: int, context: int) -> list[str]:
        import yaml

        if not self.options(config):
            return []
        (workdir / OPTIONS).write_text(yaml.safe_dump(self.options(config), sort_keys=True))
        return [OPTIONS]
