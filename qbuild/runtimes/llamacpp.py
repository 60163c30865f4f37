"""Runtime `llama.cpp`: GGUF files through llama-cpp-python, on CPU, or with its layers on the GPU where the
installed build offloads (llama_supports_gpu_offload) and the step's device is not cpu: every layer when the file
fits the GPU's free memory, else as many as fit (a 70B F16 file on an 80 GB card), the rest on the CPU."""

from __future__ import annotations

import time
from pathlib import Path

from qbuild.plugins import Runtime, RuntimeSession, StepContext, runtimes


class LlamaCppSession(RuntimeSession):
    def __init__(self, path: Path, n_ctx: int, threads: int, flash_attn: bool = False, kv_cache_dtype: str | None = None,
                 device: str = "cpu"):
        import llama_cpp
        from llama_cpp import Llama

        from qbuild.plugin_services import ggml_type_id

        files = sorted(Path(path).glob("*.gguf")) if Path(path).is_dir() else [Path(path)]
        if len(files) != 1:
            raise ValueError(f"expected one .gguf file in {path}, found {len(files)}")
        self.threads = threads
        self._batch, self._batch_size = None, 0
        # the KV-cache type a serving config runs with (type_k/type_v = llama-server's --cache-type-k/-v)
        kv = {} if not kv_cache_dtype else {"type_k": ggml_type_id(llama_cpp, kv_cache_dtype.upper()),
                                            "type_v": ggml_type_id(llama_cpp, kv_cache_dtype.upper())}
        # the layers that fit on the GPU where this llama.cpp build offloads (a CUDA/Metal build) and the step may use one
        self.gpu_layers = gpu_layers(files[0]) if device != "cpu" and llama_cpp.llama_supports_gpu_offload() \
            else 0
        self.llm = Llama(model_path=str(files[0]), n_ctx=n_ctx, n_batch=n_ctx, n_ubatch=n_ctx, logits_all=True,
                         n_threads=threads, n_threads_batch=threads, flash_attn=flash_attn, verbose=False,
                         n_gpu_layers=self.gpu_layers, **kv)
        self.flash_attn, self.kv_cache_dtype = flash_attn, kv_cache_dtype

    def logits(self, tokens: list[int]):
        import numpy as np

        self.llm.reset()
        self.llm.eval(tokens)
        return np.array(self.llm.scores[: len(tokens)], dtype=np.float32)

    scores_rows = True

    def scored_logits(self, tokens: list[int], first_scored: int):
        """Logit rows first_scored-1 .. len-2 (those that predict scored tokens), as llama-perplexity takes them:
        one llama_decode that outputs only those rows, read through a numpy view over llama.cpp's own logits
        buffer (no copy, no Python floats). The view is valid until the next call."""
        import llama_cpp
        import numpy as np
        from llama_cpp._internals import LlamaBatch

        llm, n = self.llm, len(tokens)
        if self._batch is None or self._batch_size < n:
            self._batch, self._batch_size = LlamaBatch(n_tokens=n, embd=0, n_seq_max=1, verbose=False), n
        b = self._batch.batch
        b.n_tokens = n
        lo, hi = first_scored - 1, n - 2
        for i, t in enumerate(tokens):
            b.token[i], b.pos[i], b.n_seq_id[i] = t, i, 1
            b.seq_id[i][0] = 0
            b.logits[i] = lo <= i <= hi
        llm.reset()
        llm._ctx.kv_cache_clear()
        llm._ctx.decode(self._batch)
        n_out = hi - lo + 1
        return np.ctypeslib.as_array(llama_cpp.llama_get_logits(llm._ctx.ctx), shape=(n_out, llm.n_vocab()))

    def set_threads(self, n: int) -> None:
        import llama_cpp

        llama_cpp.llama_set_n_threads(self.llm._ctx.ctx, n, n)

    def generate_timed(self, prompts: list[list[int]], n_out: int) -> dict:
        import numpy as np

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

    def generate(self, prompt_tokens: list[int], n: int) -> list[int]:
        """Greedy decode through llama.cpp's KV cache: the argmax of the last position's logits, fed back."""
        import numpy as np

        llm = self.llm
        llm.reset()
        llm.eval(list(prompt_tokens))
        generated = []
        for i in range(n):
            generated.append(int(np.argmax(llm.scores[llm.n_tokens - 1])))
            if i < n - 1:
                llm.eval([generated[-1]])
        return generated

    def info(self) -> dict:
        import llama_cpp

        return {"name": LlamaCppRuntime.name, "llama_cpp_python": llama_cpp.__version__, "threads": self.threads,
                "flash_attn": self.flash_attn, **({"kv_cache_dtype": self.kv_cache_dtype} if self.kv_cache_dtype else {}),
                **({"n_gpu_layers": "all" if self.gpu_layers < 0 else self.gpu_layers} if self.gpu_layers else {})}


GPU_RESERVE = 1.5 * (1 << 30)   # CUDA context, compute buffers and a KV cache of evaluation windows


def gpu_layers(gguf: Path, free: int | None = None) -> int:
    """n_gpu_layers for `gguf`: -1 (all) when the file fits the GPU's free memory with GPU_RESERVE to spare, else the
    number of repeating layers that fit (the output and embeddings count as one more); -1 when the free memory
    cannot be read (llama.cpp's own default on a GPU build)."""
    from qbuild.plugins import hardware

    free = hardware.gpu_free_bytes() if free is None else free
    size = gguf.stat().st_size
    if free is None or size + GPU_RESERVE <= free:
        return -1
    blocks = gguf_block_count(gguf) or 1
    return max(0, int((free - GPU_RESERVE) // (size / (blocks + 1))))


def gguf_block_count(gguf: Path) -> int | None:
    """The file's number of repeating layers (`<arch>.block_count`), read from its metadata without loading it."""
    from qbuild.plugin_services import gguf_metadata_values as metadata_values

    values = metadata_values(gguf, arch_keys=("block_count",))
    count = values.get(f"{values.get('general.architecture')}.block_count")
    return int(count) if isinstance(count, int) else None


@runtimes.register
class LlamaCppRuntime(Runtime):
    name = "llama.cpp"
    tools = ("llama-cpp-python",)
    extra = "gguf"
    requires = ("llama_cpp",)
    preload = ("llama_cpp",)
    max_batch_size = 1
    thread_invariant = True   # the same logits at 1 and 2 threads, bit for bit (checked: tests/test_rebuild_real.py)
    kv_cache_dtypes = ("f16", "bf16", "q8_0", "q4_0")   # type_k/type_v, as llama-server's --cache-type-k/-v

    def open(self, model: Path, ctx: StepContext, n_ctx: int) -> LlamaCppSession:
        # flash attention changes the logits in the 3rd digit: off unless the protocol asks (evaluation.perplexity)
        return LlamaCppSession(Path(model), n_ctx, ctx.threads, bool(ctx.params.get("flash_attn")),
                               ctx.params.get("kv_cache_dtype"), ctx.device)
