"""Runtime `transformers`: HF checkpoints (plain, compressed-tensors, bitsandbytes, auto-round) on CPU or CUDA."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path

from qbuild.plugins import HF_PRELOAD, Runtime, RuntimeSession, StepContext, runtimes


class CheckpointNotLoaded(RuntimeError):
    """transformers left weights of the checkpoint unloaded (freshly initialized): its numbers would be noise."""


def check_loaded(path: Path, info: dict) -> None:
    """Refuse to evaluate a model some of whose weights transformers did not load from the checkpoint (it initializes
    them at random and says so only in a log table): a compressed-tensors Mixtral written with per-expert weights,
    which transformers 5 expects fused, evaluated at KLD 1.09 for every scheme before, FP8 included."""
    missing = sorted(set(info.get("missing_keys") or ()) | {str(k[0]) if isinstance(k, tuple) else str(k)
                                                             for k in info.get("mismatched_keys") or ()})
    if missing:
        raise CheckpointNotLoaded(f"transformers did not load {len(missing)} weight(s) of {Path(path).name} from "
                                  f"the checkpoint (it would evaluate them at random): {', '.join(missing[:3])}"
                                  f"{', ...' if len(missing) > 3 else ''}")


class TransformersSession(RuntimeSession):
    """An HF checkpoint in transformers. Evaluation windows of one length go through it layer-streamed
    (qbuild.runtimes.layer_stream: one decoder layer's weights in memory, the same logits); the rest (generation,
    windows of mixed lengths that fit) through the whole model, loaded on first use."""

    def __init__(self, path: Path, threads: int, device: str):
        import torch
        from transformers import AutoConfig

        self.torch, self.path = torch, Path(path)
        self.device = ("cuda" if torch.cuda.is_available() else "cpu") if device == "auto" else device
        self.dtype = "auto" if self.device == "cuda" else torch.float32
        self.config = AutoConfig.from_pretrained(str(path))
        from qbuild.runtimes.layer_stream import read_headers

        read_headers(self.path)   # a checkpoint that cannot load fails here, on open, as when it was loaded whole
        self._model = None
        self._streamed = None

    @property
    def model(self):
        """The whole model (loaded on first use; layer-streamed evaluation never loads it)."""
        if self._model is None:
            from transformers import AutoModelForCausalLM

            model, info = AutoModelForCausalLM.from_pretrained(str(self.path), dtype=self.dtype,
                                                               output_loading_info=True)
            check_loaded(self.path, info)
            self._model = model.to(self.device).eval()
        return self._model

    def streamed(self):
        """The layer-streamed model, or None where this checkpoint cannot be streamed (quantized, fused MoE
        experts) or the whole model is already loaded."""
        if self._streamed is None and self._model is None:
            from qbuild.runtimes.layer_stream import LayerStreamedModel, NotStreamable

            dtype = self.dtype
            if dtype == "auto":   # the checkpoint's own dtype, as from_pretrained(dtype="auto") takes it
                stored = getattr(self.config, "dtype", None) or "bfloat16"
                dtype = getattr(self.torch, stored) if isinstance(stored, str) else stored
            try:
                self._streamed = LayerStreamedModel(self.path, self.device, dtype)
            except NotStreamable:
                self._streamed = False
        return self._streamed or None

    def logits(self, tokens: list[int]):
        with self.torch.inference_mode():
            out = self.model(self.torch.tensor([tokens], device=self.device)).logits[0]
        return out.float().cpu().numpy()

    def set_threads(self, n: int) -> None:
        if self.device == "cpu":
            self.torch.set_num_threads(n)

    def batch_size(self, n_tokens: int) -> int:
        """Windows per forward pass: $QBUILD_EVAL_BATCH_SIZE, else 1 on CPU (one thread gains nothing from
        batching, and each window's logits cost n_tokens × vocab × 4 bytes), else what half the free GPU
        memory holds (logits in the model dtype and in fp32, plus activations), at most 64."""
        forced = os.environ.get("QBUILD_EVAL_BATCH_SIZE")
        if forced:
            return max(1, int(forced))
        if self.device != "cuda":
            return 1
        cfg = self.config.get_text_config()
        free, _ = self.torch.cuda.mem_get_info()
        per_window = n_tokens * (cfg.vocab_size * 8 + cfg.hidden_size * 4 * 16)
        return max(1, min(64, int(free * 0.5 // per_window)))

    def window_logits(self, windows) -> Iterator:
        """Logits of each window, in order. Windows of one length (perplexity, KLD, the reference) stream the model
        layer by layer on CPU, and on CUDA where the model would not fit the GPU; otherwise windows of equal length go
        through the whole model together."""
        if not windows:
            return
        lengths = {len(w.tokens) for w in windows}
        if (self.device == "cpu" and len(lengths) == 1) or not self._whole_fits():
            streamed = self.streamed()
            if streamed is not None:
                yield from streamed.window_logits([w.tokens for w in windows])
                return
        bs = self.batch_size(len(windows[0].tokens))
        i = 0
        while i < len(windows):
            n = len(windows[i].tokens)
            group = []
            for w in windows[i: i + bs]:
                if len(w.tokens) != n:
                    break
                group.append(w.tokens)
            with self.torch.inference_mode():
                out = self.model(self.torch.tensor(group, device=self.device)).logits
            for row in out:
                yield row.float().cpu().numpy()
            del out
            i += len(group)

    def _whole_fits(self) -> bool:
        """Whether the whole model, in the compute dtype, takes under half the memory free for it (host or GPU)."""
        if self._model is not None:
            return True
        from qbuild.runtimes.layer_stream import checkpoint_bytes

        need = checkpoint_bytes(self.path) * (2 if self.dtype is self.torch.float32 else 1)   # 16-bit files
        if self.device == "cuda":
            free, _ = self.torch.cuda.mem_get_info()
        else:
            import psutil

            free = psutil.virtual_memory().available
        return need < free / 2

    def generate_timed(self, prompts: list[list[int]], n_out: int) -> dict:
        torch = self.torch
        ids = torch.tensor(prompts, device=self.device)
        sync = torch.cuda.synchronize if self.device == "cuda" else (lambda: None)
        with torch.inference_mode():
            sync()
            t0 = time.perf_counter()
            out = self.model(ids, use_cache=True)
            past, nxt = out.past_key_values, out.logits[:, -1:].argmax(-1)
            sync()
            prefill = time.perf_counter() - t0
            steps = []
            for _ in range(n_out - 1):
                t1 = time.perf_counter()
                out = self.model(nxt, past_key_values=past, use_cache=True)
                past, nxt = out.past_key_values, out.logits[:, -1:].argmax(-1)
                sync()
                steps.append(time.perf_counter() - t1)
        return {"prefill_s": prefill, "decode_s": steps}

    def generate(self, prompt_tokens: list[int], n: int) -> list[int]:
        """Greedy decode with the KV cache (model.generate, do_sample=False). No end token stops it
        (eos_token_id=None), so it gives exactly what re-running the growing sequence would."""
        torch = self.torch
        ids = torch.tensor([prompt_tokens], device=self.device)
        with torch.inference_mode():
            out = self.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                                      eos_token_id=None)
        generated = out[0, len(prompt_tokens):].tolist()
        if len(generated) < n:   # a transformers version that still stopped early: finish the plain way
            generated += super().generate(list(prompt_tokens) + generated, n - len(generated))
        return generated

    def info(self) -> dict:
        import transformers

        info = {"name": TransformersRuntime.name, "transformers": transformers.__version__,
                "torch": self.torch.__version__, "device": self.device}
        qc = getattr(self.config, "quantization_config", None)
        if qc is not None:   # a quantized checkpoint: which loader and Linear kernel read it (e.g. gptqmodel's)
            method = qc.get("quant_method") if isinstance(qc, dict) else getattr(qc, "quant_method", "")
            info["quant_method"] = str(getattr(method, "value", method))   # transformers' QuantizationMethod enum
            # a streamed model's skeleton has the same module classes: naming one must not load the whole model
            model = self._streamed.model if self._streamed else self.model
            linear = next((m for n, m in model.named_modules() if n.endswith("q_proj")), None)
            if linear is not None:
                info["linear_class"] = f"{type(linear).__module__}.{type(linear).__qualname__}"
        if self.device == "cuda":
            info["gpu"] = self.torch.cuda.get_device_name()
            info["sm"] = ".".join(map(str, self.torch.cuda.get_device_capability()))
        return info


@runtimes.register
class TransformersRuntime(Runtime):
    name = "transformers"
    # GPTQ, AWQ: in the gptqmodel env; bitsandbytes and auto-round: in qbuild's own (their libraries are extras)
    tools = ("torch", "transformers")
    extra = "hf"
    requires = ("torch", "transformers")
    preload = HF_PRELOAD

    def memory(self, kind: str) -> str:
        # generation (throughput, load-check) runs the whole model; windows of one length stream it layer by layer
        return "whole-model" if kind in ("throughput", "load-check") else "layer-streamed"

    def open(self, model: Path, ctx: StepContext, n_ctx: int) -> TransformersSession:
        return TransformersSession(Path(model), ctx.threads, ctx.device)
