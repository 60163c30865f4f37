"""Inference runtimes behind one small interface: feed token ids, get logits; generate with timings.

A runtime is chosen by the artifact's format. Everything protocol-related lives in protocol.py, so
the same protocol gives the same number through any runtime.
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np

from qbuild.evaluate.plan import RUNTIMES


def open_runtime(fmt: str, path: Path, n_ctx: int, threads: int, device: str):
    import importlib

    module, _, cls = RUNTIMES[fmt][0].partition(":")
    return getattr(importlib.import_module(module), cls)(Path(path), n_ctx, threads, device)


class TransformersRuntime:
    name = "transformers"

    def __init__(self, path: Path, n_ctx: int, threads: int, device: str):
        import torch
        from transformers import AutoModelForCausalLM

        self.torch = torch
        self.device = ("cuda" if torch.cuda.is_available() else "cpu") if device == "auto" else device
        dtype = "auto" if self.device == "cuda" else torch.float32
        self.model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype).to(self.device).eval()

    def logits(self, tokens: list[int]) -> np.ndarray:
        with self.torch.inference_mode():
            out = self.model(self.torch.tensor([tokens], device=self.device)).logits[0]
        return out.float().cpu().numpy()

    def generate_timed(self, prompts: list[list[int]], n_out: int) -> dict:
        """Greedy decode of a batch; returns prefill seconds and per-token decode latencies."""
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

    def info(self) -> dict:
        import transformers

        info = {"name": self.name, "transformers": transformers.__version__, "torch": self.torch.__version__,
                "device": self.device}
        if self.device == "cuda":
            info["gpu"] = self.torch.cuda.get_device_name()
            info["sm"] = ".".join(map(str, self.torch.cuda.get_device_capability()))
        return info


class LlamaCppRuntime:
    name = "llama.cpp"

    def __init__(self, path: Path, n_ctx: int, threads: int, device: str):
        from llama_cpp import Llama

        files = sorted(Path(path).glob("*.gguf")) if Path(path).is_dir() else [Path(path)]
        if len(files) != 1:
            raise ValueError(f"expected one .gguf file in {path}, found {len(files)}")
        self.threads = threads
        self.llm = Llama(model_path=str(files[0]), n_ctx=n_ctx, n_batch=n_ctx, n_ubatch=n_ctx, logits_all=True,
                         n_threads=threads, n_threads_batch=threads, verbose=False)

    def logits(self, tokens: list[int]) -> np.ndarray:
        self.llm.reset()
        self.llm.eval(tokens)
        return np.array(self.llm.scores[: len(tokens)], dtype=np.float32)

    def generate_timed(self, prompts: list[list[int]], n_out: int) -> dict:
        if len(prompts) != 1:
            raise ValueError("the llama.cpp runtime measures batch size 1 only")
        llm = self.llm
        llm.reset()
        t0 = time.perf_counter()
        llm.eval(prompts[0])
        prefill = time.perf_counter() - t0
        steps = []
        for _ in range(n_out - 1):
            tok = int(np.argmax(llm.scores[llm.n_tokens - 1]))
            t1 = time.perf_counter()
            llm.eval([tok])
            steps.append(time.perf_counter() - t1)
        return {"prefill_s": prefill, "decode_s": steps}

    def info(self) -> dict:
        import llama_cpp

        return {"name": self.name, "llama_cpp_python": llama_cpp.__version__, "threads": self.threads}
