"""llama.cpp's `llama-server`: continuous batching over `--parallel` slots, built from the vendored llama.cpp source of
the installed llama-cpp-python (qbuild/models/llamacpp_toolchain.py), so it is the same llama.cpp qbuild evaluates with."""

from __future__ import annotations

import math
import shutil
from pathlib import Path

from qbuild.plugins import Server, servers

# llama.cpp KV-cache element types (--cache-type-k/-v) for the recipe's kv_cache_dtype
KV_TYPES = {"f16": "f16", "bf16": "bf16", "q8_0": "q8_0", "q4_0": "q4_0"}
QUANTIZED_KV = ("q8_0", "q4_0")
DRAFT = "{draft}"   # in a config's flags (its key), where launch puts the draft artifact's file
SPEC_COUNTERS = {"llamacpp:spec_decode_num_draft_tokens_total": "draft_tokens",
                 "llamacpp:spec_decode_num_accepted_tokens_total": "accepted"}
BYTES_PER_ELEMENT = {"f16": 2.0, "bf16": 2.0, "q8_0": 34 / 32, "q4_0": 18 / 32}   # ggml block size / elements


@servers.register
class LlamaServer(Server):
    name = "llama-server"
    engine = "llama.cpp"
    tools = ("llama-cpp-python",)
    extra = "gguf"
    requires = ("llama_cpp",)

    def unavailable(self) -> str:
        from qbuild.plugin_services import cached_bin_dir

        why = super().unavailable()
        if why or cached_bin_dir() is not None:
            return why
        if not (shutil.which("cmake") and (shutil.which("c++") or shutil.which("g++"))):
            return "llama-server is built from llama.cpp's source on first use, which needs cmake and a C++ compiler"
        return ""

    def environment(self) -> dict[str, str]:
        from qbuild.plugin_services import build_id
        from qbuild.plugins import package_version

        return {"llama-server": build_id(package_version("llama-cpp-python"))}

    def refusal(self, config) -> str | None:
        kv = config.kv_cache_dtype
        if kv is not None and kv not in KV_TYPES:
            return f"llama.cpp has no {kv} KV cache (it has {', '.join(KV_TYPES)})"
        if kv in QUANTIZED_KV and config.flash_attn is False:
            return f"llama.cpp quantizes the V cache ({kv}) only with flash attention; drop flash_attn: false"
        return None

    def args(self, config, *, threads: int, slots: int, context: int) -> list[str]:
        """The flags (everything but the binary, model and port): these enter the step's key."""
        threads = config.threads or threads
        args = ["--host", "127.0.0.1", "--threads", str(threads), "--threads-batch", str(threads),
                "--parallel", str(config.parallel or slots), "--ctx-size", str((config.parallel or slots) * context),
                "--cont-batching", "--no-webui"]
        if config.kv_cache_dtype:
            args += ["--cache-type-k", KV_TYPES[config.kv_cache_dtype], "--cache-type-v", KV_TYPES[config.kv_cache_dtype]]
        flash = config.flash_attn if config.flash_attn is not None else (True if config.kv_cache_dtype in QUANTIZED_KV
                                                                          else None)
        if flash is not None:
            args += ["--flash-attn", "on" if flash else "off"]
        if config.prefix_caching:
            args += ["--cache-reuse", "256"]
        elif config.prefix_caching is False:   # neither a slot's nor the host-RAM prompt cache
            args += ["--no-cache-prompt", "--cache-ram", "0"]
        if config.batch_size is not None:
            args += ["--batch-size", str(config.batch_size)]
        if config.ubatch_size is not None:
            args += ["--ubatch-size", str(config.ubatch_size)]
        if config.draft is not None:   # the draft's file is put in at launch; /metrics counts what it drafted
            # a plain draft model must be named as such: llama.cpp infers only MTP/DFlash drafts from the file
            args += ["--spec-type", "draft-simple", "--spec-draft-model", DRAFT, "--metrics"]
            if config.draft_max is not None:
                args += ["--spec-draft-n-max", str(config.draft_max)]
            if config.draft_min is not None:
                args += ["--spec-draft-n-min", str(config.draft_min)]
        return args

    def launch(self, model: Path, config, *, threads: int, slots: int, context: int, workdir: Path, log=print,
               draft: Path | None = None):
        from qbuild.plugin_services import PORT, ServerLaunch, tool

        model_file = _one_gguf(model)
        args = self.args(config, threads=threads, slots=slots, context=context)
        if DRAFT in args:
            if draft is None:
                raise ValueError(f"serving config {config.name!r} drafts with {config.draft!r}, whose artifact was not "
                                 "given to the server")
            args[args.index(DRAFT)] = str(_one_gguf(draft))
        binary = tool("llama-server", log=log)
        cmd = (str(binary), "--model", str(model_file), "--port", PORT, *args)
        return ServerLaunch(cmd, engine=self.engine, model_name=model_file.stem, ready_path="/health", ignore_eos=True)

    def speculative_stats(self, url: str, timeout_s: float) -> dict | None:
        """llama-server's Prometheus counters (`--metrics`) of drafted and accepted tokens since it started."""
        from qbuild.plugin_services import get_text

        counters = {}
        for line in get_text(f"{url}/metrics", timeout_s).splitlines():
            name, _, value = line.partition(" ")
            if name in SPEC_COUNTERS:
                try:
                    counters[SPEC_COUNTERS[name]] = float(value)
                except ValueError:
                    return None
        if "draft_tokens" not in counters or "accepted" not in counters:
            return None
        drafted, accepted = counters["draft_tokens"], counters["accepted"]
        if not (math.isfinite(drafted) and 0 <= accepted <= drafted):   # a reply no server's counters give
            return None
        return {"draft_tokens": int(drafted), "accepted": int(accepted),
                "acceptance_rate": round(accepted / drafted, 4) if drafted > 0 else None}

    def next_token_logprobs(self, url: str, model_name: str, prompt: list[int], k: int, timeout_s: float
                            ) -> dict[int, float]:
        """The served check's question (qbuild.serving.served_check): llama-server's own `/completion` gives the top-k
        as token ids, from the logits before sampling (`post_sampling_probs` off)."""
        from qbuild.plugin_services import post_json

        answer = post_json(f"{url}/completion", {"prompt": prompt, "n_predict": 1, "n_probs": k, "temperature": 0.0,
                                             "post_sampling_probs": False}, timeout_s)
        try:
            top = answer["completion_probabilities"][0]["top_logprobs"]
            return {int(t["id"]): float(t["logprob"]) for t in top}
        except (KeyError, IndexError, TypeError, ValueError) as exc:
            raise RuntimeError(f"llama-server's /completion answer has no top log-probs ({exc!r})") from None

    def kv_bytes_per_token(self, model: Path, config, log_text: str) -> float | None:
        """K and V of every layer for one token: layers × KV heads × (key + value head size) × the cache type's
        bytes per element (q8_0: 34 bytes per block of 32), from the GGUF's metadata. It is what llama.cpp allocates
        per token of context (its `llama_kv_cache: size = ...` line, logged at -lv 4, which the tests compare with;
        not parsed here because -lv 4 also logs every batch)."""
        from qbuild.plugin_services import gguf_metadata_values as metadata_values

        files = sorted(Path(model).glob("*.gguf")) if Path(model).is_dir() else [Path(model)]
        names = ("block_count", "attention.head_count", "embedding_length", "attention.head_count_kv",
                 "attention.key_length", "attention.value_length")
        values = metadata_values(files[0], arch_keys=names)
        arch = values.get("general.architecture")

        def field(key):
            return values.get(key)

        layers, heads, embd = (field(f"{arch}.{k}") for k in ("block_count", "attention.head_count",
                                                               "embedding_length"))
        kv_heads = field(f"{arch}.attention.head_count_kv") or heads
        if not (layers and heads and embd) or isinstance(kv_heads, list) or isinstance(heads, list):
            return None   # per-layer head counts (some hybrid models): not worked out here
        k_len = field(f"{arch}.attention.key_length") or embd // heads
        v_len = field(f"{arch}.attention.value_length") or embd // heads
        size = BYTES_PER_ELEMENT[config.kv_cache_dtype or "f16"]
        return float(layers * kv_heads * (k_len + v_len) * size)


def _one_gguf(path: Path) -> Path:
    files = sorted(Path(path).glob("*.gguf")) if Path(path).is_dir() else [Path(path)]
    if len(files) != 1:
        raise ValueError(f"expected one .gguf file in {path}, found {len(files)}")
    return files[0]
