"""Runtime `int8-dequant`: evaluates `int8-safetensors` by dequantizing into a transformers model.

It reuses qbuild's transformers session for logits and timed generation; only loading differs.
"""

from __future__ import annotations

from pathlib import Path

from qbuild.core.step import StepContext
from qbuild.plugins import Runtime
from qbuild.runtimes.transformers import TransformersSession
from qbuild_example import FORMAT, WEIGHTS


class Int8Session(TransformersSession):
    def __init__(self, path: Path):
        import torch
        from safetensors.numpy import load_file
        from transformers import AutoConfig, AutoModelForCausalLM

        data = load_file(str(path / WEIGHTS))
        state = {}
        for name, t in data.items():
            if name.endswith(".scale"):
                continue
            scale = data.get(name + ".scale")
            state[name] = torch.from_numpy(t.astype("float32") * scale if scale is not None else t.astype("float32"))
        config = AutoConfig.from_pretrained(str(path))
        self.torch, self.device = torch, "cpu"
        self.model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        self.model.load_state_dict(state, strict=False)   # tied lm_head comes from the embedding
        self.model.tie_weights()
        self.model.eval()

    def info(self) -> dict:
        return {**super().info(), "name": Int8Dequant.name}


class Int8Dequant(Runtime):
    name = "int8-dequant"
    formats = (FORMAT,)
    tools = ("torch", "transformers", "qbuild-plugin-example")
    extra = "qbuild-plugin-example"
    requires = ("torch", "transformers")

    def open(self, model: Path, ctx: StepContext, n_ctx: int) -> Int8Session:
        return Int8Session(Path(model))
