"""What the GPU servers (vLLM, SGLang, TensorRT-LLM) share: a GPU check, the served model name, HF-dir artifacts."""

from __future__ import annotations

import sys
from pathlib import Path

from qbuild.plugins import Server

SERVED_NAME = "model"   # every GPU server is told to answer to this name (--served-model-name)


class GPUServer(Server):
    needs_gpu = True
    program: tuple[str, ...] = ()     # how the server is started, before the model ({python}: this interpreter)
    model_flag: str | None = None     # None: the model path is positional
    batch_flag: str | None = None     # the flag a serving config's batch_size maps onto (None: refused)

    def unavailable(self) -> str:
        from qbuild.plugins import hardware

        if hardware.gpu() is None:
            return f"{self.name} needs an NVIDIA GPU"
        return super().unavailable()

    def common_refusal(self, config, kv_types: dict[str, str]) -> str | None:
        if config.kv_cache_dtype is not None and config.kv_cache_dtype not in kv_types:
            return (f"{self.engine} has no {config.kv_cache_dtype} KV cache (it keeps the model's dtype, or takes "
                    f"{', '.join(kv_types)})")
        if config.flash_attn is not None:
            return f"flash_attn is a llama.cpp setting; {self.engine} picks its attention backend itself"
        llama_only = [f for f in ("threads", "ubatch_size") if getattr(config, f) is not None]
        if llama_only:
            return f"{', '.join(llama_only)} map onto llama-server's flags only; {self.engine} sizes these itself"
        if config.draft is not None:
            return (f"speculative drafts are served through llama-server only so far ({self.engine}'s own speculative "
                    "config is not mapped)")
        if config.batch_size is not None and not self.batch_flag:
            return f"batch_size has no {self.engine} flag qbuild maps"
        return None

    def launch(self, model: Path, config, *, threads: int, slots: int, context: int, workdir: Path, log=print,
               draft: Path | None = None):
        from qbuild.plugin_services import PORT, ServerLaunch

        written = self.write_files(config, workdir, slots=slots, context=context)
        where = (self.model_flag, str(model)) if self.model_flag else (str(model),)
        args = [str(workdir / a) if a in written else a
                for a in self.args(config, threads=threads, slots=slots, context=context)]
        program = [sys.executable if a == "{python}" else a for a in self.program]
        cmd = (*program, *where, "--port", PORT, *args)
        return ServerLaunch(cmd, engine=self.engine, model_name=SERVED_NAME, ready_path="/health", ignore_eos=True,
                            stop_timeout_s=30.0)

    def write_files(self, config, workdir: Path, *, slots: int, context: int) -> list[str]:
        """Write the files the command reads (TensorRT-LLM's options YAML) into workdir; their names (args naming
        them become absolute paths). None by default."""
        return []
