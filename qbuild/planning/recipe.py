"""The recipe: typed, validated, defaults filled in. YAML keys map 1:1 to these models."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated, Any, Literal, Union

from pydantic import ConfigDict, Field, PrivateAttr, ValidationError, field_validator, model_validator

from qbuild.artifacts.remote.config import RegisterSpec, RemoteSpec
from qbuild.base.errors import RecipeError, quoted
from qbuild.base.names import NAME_PATTERN
from qbuild.base.schema_base import StrictModel
from qbuild.base.yamlio import Loc, line_for, load_yaml_file
from qbuild.contract.data_sources import DataSource
from qbuild.serving.config import UNSET_LEFT_OUT

NAME_RE = NAME_PATTERN   # the one name grammar (qbuild/base/names.py)


# --- model sources -----------------------------------------------------------------------------
TRUST_REMOTE_CODE = ("Let the checkpoint's own Python code run (an `auto_map` in its configs, `*.py` beside its "
                     "weights): only for a model whose code you have read. Off, such a checkpoint is refused at plan "
                     "time and no tool qbuild starts runs it.")


class LocalModel(StrictModel):
    """A Hugging Face checkpoint directory on disk, fingerprinted by content."""

    source: Literal["local"]
    path: str
    trust_remote_code: bool = Field(False, description=TRUST_REMOTE_CODE)


class HubModel(StrictModel):
    """A hub repo pinned to a revision, resolved through the local HF cache (no download at run time)."""

    source: Literal["hub"]
    repo: str
    revision: str = Field("main", description="Branch, tag or commit; resolved to a commit sha through the local cache.")
    trust_remote_code: bool = Field(False, description=TRUST_REMOTE_CODE)


class GGUFModel(StrictModel):
    """A GGUF file dequantized into an HF checkpoint. `pkg://dist/file` names a file inside an installed package."""

    source: Literal["gguf"]
    path: str
    dtype: Literal["auto", "float32", "float16", "bfloat16"] = Field(
        "auto", description="The imported checkpoint's dtype. auto: the GGUF's own where its weight matrices are all "
        "F16 or all BF16, else float32, the exact dequantized values; a quantized variant built on a float32 import "
        "of a quantized GGUF writes the matrices it leaves untouched in float16 (auto only). Evaluation runs in "
        "float32 either way.")


ModelSource = Annotated[Union[LocalModel, HubModel, GGUFModel], Field(discriminator="source")]


# --- calibration ---------------------------------------------------------------------------------
class Dataset(StrictModel):
    sources: list[DataSource] = Field(min_length=1)
    chat_template: bool = Field(False, description="Render each sample with the tokenizer's chat template.")


class Calibration(Dataset):
    samples: int = Field(128, ge=1, le=100_000)
    seq_len: int = Field(512, ge=8, le=131_072)
    seed: int = 0
    sampling: Literal["random-window", "document"] = Field(
        "random-window",
        description="random-window: concatenate documents and cut seq_len windows at seeded random offsets; "
        "document: one sample per document, truncated to seq_len, shorter ones skipped.",
    )


# --- evaluation ----------------------------------------------------------------------------------
class Perplexity(StrictModel):
    dataset: Dataset = Field(default_factory=lambda: Dataset(sources=[{"type": "pydocs", "split": "test"}]))
    protocol: Literal["fixed-window", "sliding-window", "llama.cpp"] = Field(
        "fixed-window",
        description="fixed-window: concatenated text, non-overlapping windows (GPTQ/AWQ papers); sliding-window: "
        "windows every `stride` tokens, each token scored once (transformers guide); llama.cpp: second half of "
        "each window scored (matches llama-perplexity).",
    )
    context_length: int = Field(512, ge=8)
    stride: int | None = Field(None, ge=1, description="sliding-window only; default: half the window.")
    max_windows: int | None = Field(16, ge=1, description="Score at most this many windows (None: all).")
    add_bos: bool = Field(True, description="Start each window with BOS (BOS itself is never scored). Not set here: as "
                          "the model's own tokenizer does (a GGUF's tokenizer.ggml.add_bos_token, else llama.cpp's "
                          "default; tokenizer_config.json's add_bos_token, else tokenizer.json's post-processor), "
                          "as llama-perplexity and transformers do; true where the model does not say.")
    flash_attn: bool = Field(False, description="llama.cpp runtime: flash attention on. llama-perplexity's default is on, "
                             "qbuild's off; a kld_base file and qbuild must agree (numbers differ in the 3rd digit).")
    kv_cache_dtype: Literal["f16", "bf16", "q8_0", "q4_0"] | None = Field(
        None, description="llama.cpp runtime: KV-cache element type of each artifact's pass (llama-server's "
        "--cache-type-k/-v, a serving config's kv_cache_dtype), so its quality cost shows in PPL/KLD. The KLD "
        "reference (baseline) pass keeps f16. q8_0/q4_0 need flash_attn: true (llama.cpp quantizes V only with it).")

    def canonical(self) -> dict:
        data = super().canonical()
        for field in ("flash_attn", "kv_cache_dtype"):
            if not data.get(field):
                data.pop(field, None)   # defaults left out: keys made before these switches existed still hit
        return data

    @model_validator(mode="after")
    def _quantized_kv_needs_flash_attn(self):
        if self.kv_cache_dtype in ("q8_0", "q4_0") and not self.flash_attn:
            raise ValueError(f"kv_cache_dtype {self.kv_cache_dtype} needs flash_attn: true (llama.cpp quantizes the V "
                             "cache only with flash attention)")
        return self

    @model_validator(mode="after")
    def _stride_only_for_sliding(self):
        if self.stride is not None and self.protocol != "sliding-window":
            raise ValueError(f"stride applies to the sliding-window protocol only (protocol is {self.protocol})")
        if self.stride is not None and self.stride >= self.context_length:
            raise ValueError(f"stride ({self.stride}) must be smaller than context_length ({self.context_length})")
        return self


class Throughput(StrictModel):
    batch_sizes: list[int] = Field(default_factory=lambda: [1], min_length=1)
    input_len: int = Field(128, ge=1)
    output_len: int = Field(32, ge=2)
    warmup: int = Field(1, ge=0)
    repetitions: int = Field(3, ge=1)


class ServingConfig(StrictModel):
    """One way of serving an artifact, mapped onto each engine's own flags (refused at plan time where it has none)."""

    name: str = Field(pattern=NAME_RE, description="Its name in results and selection (default, kv8, prefix ...).")
    kv_cache_dtype: Literal["f16", "bf16", "q8_0", "q4_0", "fp8"] | None = Field(
        None, description="KV-cache element type: llama.cpp --cache-type-k/-v (f16, bf16, q8_0, q4_0), vLLM/SGLang "
        "--kv-cache-dtype fp8, TensorRT-LLM kv_cache_config.dtype fp8. None: the engine's default.")
    parallel: int | None = Field(
        None, ge=1, description="Requests the server decodes at once (llama.cpp --parallel, vLLM --max-num-seqs, "
        "SGLang --max-running-requests, trtllm-serve --max_batch_size); default: the sweep's largest concurrency.")
    prefix_caching: bool | None = Field(
        None, description="Reuse the KV cache of shared prompt prefixes (llama.cpp --cache-reuse, vLLM "
        "--enable-prefix-caching, SGLang radix cache). None: the engine's default.")
    flash_attn: bool | None = Field(None, description="llama.cpp --flash-attn on/off. None: the engine's default.")
    threads: int | None = Field(None, ge=1, le=1024, description="CPU threads of the server (llama.cpp --threads and "
                                "--threads-batch). None: the run's threads.")
    batch_size: int | None = Field(None, ge=1, le=1_048_576, description="Tokens per logical batch (llama.cpp "
                                   "--batch-size, vLLM --max-num-batched-tokens). None: the engine's default.")
    ubatch_size: int | None = Field(None, ge=1, le=1_048_576, description="Tokens per physical batch (llama.cpp "
                                    "--ubatch-size). None: the engine's default.")
    draft: str | None = Field(None, pattern=NAME_RE, description="Speculative decoding: another variant of the recipe "
                              "(a GGUF sharing the tokenizer) drafts tokens the served one verifies (llama.cpp "
                              "--spec-draft-model); its acceptance rate is measured.")
    draft_max: int | None = Field(None, ge=1, le=64, description="Tokens drafted per step at most (llama.cpp "
                                  "--spec-draft-n-max). None: the engine's default (16).")
    draft_min: int | None = Field(None, ge=0, le=64, description="Tokens drafted per step at least (llama.cpp "
                                  "--spec-draft-n-min). None: the engine's default.")

    def canonical(self) -> dict:
        data = super().canonical()
        for field in UNSET_LEFT_OUT:   # left out of the key while unset (qbuild.serving.config)
            if data.get(field) is None:
                data.pop(field, None)
        return data

    @model_validator(mode="after")
    def _draft_settings_need_a_draft(self):
        if self.draft is None and (self.draft_max is not None or self.draft_min is not None):
            raise ValueError("draft_max and draft_min set how a draft model drafts: give draft: <variant> too")
        if self.draft_max is not None and self.draft_min is not None and self.draft_min > self.draft_max:
            raise ValueError(f"draft_min ({self.draft_min}) is larger than draft_max ({self.draft_max})")
        return self


class LengthRange(StrictModel):
    """Token counts drawn per request, uniformly from min..max (seeded), as guidellm's `*_tokens_min/max` without a
    stdev. Requests that differ in length fall out of step, as real traffic does."""

    min: int = Field(ge=1)
    max: int = Field(ge=1)

    @model_validator(mode="after")
    def _ordered(self):
        if self.min > self.max:
            raise ValueError(f"min ({self.min}) is larger than max ({self.max})")
        return self


def longest(length: int | LengthRange) -> int:
    return length.max if isinstance(length, LengthRange) else length


class CapacitySLO(StrictModel):
    """The bounds a rate must meet for capacity (per-request latencies over a probe's requests, ms)."""

    ttft_p99_ms: float | None = Field(None, gt=0, description="Largest TTFT p99 (ms).")
    tpot_p50_ms: float | None = Field(None, gt=0, description="Largest TPOT p50 (ms per output token after the first).")
    itl_p99_ms: float | None = Field(None, gt=0, description="Largest inter-token latency p99 (ms).")
    e2e_p99_ms: float | None = Field(None, gt=0, description="Largest end-to-end latency p99 (ms).")

    @model_validator(mode="after")
    def _some_bound(self):
        if not self.bounds():
            raise ValueError("give at least one of ttft_p99_ms, tpot_p50_ms, itl_p99_ms, e2e_p99_ms")
        return self

    def bounds(self) -> dict[str, float]:
        return {k: v for k, v in self.model_dump().items() if v is not None}


class Capacity(StrictModel):
    """Search, per (artifact, serving config), the highest open-loop (Poisson) request rate meeting `slo` with at most
    `max_error_pct` % errors: bracket, then bisect a grid of rates 4.4 % apart (docs/serving.md, Capacity)."""

    slo: CapacitySLO
    max_minutes: float = Field(10.0, gt=0, le=1440, description="Time budget of one search; reaching it, the search "
                               "stops with the highest rate that met the SLOs so far (marked incomplete).")
    max_error_pct: float = Field(1.0, ge=0, le=100, description="Largest share of failed requests at a rate, in %.")
    start_rps: float | None = Field(None, gt=0, description="The first rate probed (snapped to the grid); the "
                                    "bracket doubles or halves from it. Unset: the rate at which the server completes "
                                    "requests sent one at a time (a few lone requests, measured before the first "
                                    "probe).")
    requests: int = Field(24, ge=2, le=100_000, description="Poisson arrivals measured per round of a probe.")
    rounds: int = Field(2, ge=1, le=100, description="Rounds per probe (each with its own warm-up, prompts and "
                        "arrivals): the probe's figures pool them, with 95 % bootstrap intervals from 2 rounds on. "
                        "A probe whose rate is within noise of the server's full-batch throughput runs up to twice as "
                        "many.")


class Conversation(StrictModel):
    """Multi-turn chat traffic: every conversation is `turns` requests, sent one after the other, each turn's prompt the
    conversation so far (the last turn's prompt and what the server generated for it) followed by input_len new
    tokens, as a chat client resends its history (docs/serving.md, Multi-turn conversations)."""

    turns: int = Field(..., ge=2, le=64, description="Requests per conversation. `requests` and `warmup` then count "
                       "conversations (a point measures requests × turns requests), and request_rates are new "
                       "conversations per second.")
    think_s: float = Field(0.0, ge=0, le=3600, description="Seconds a user waits after an answer before sending the "
                           "next turn (in closed loop too: a stream thinking sends nothing).")


class Serving(StrictModel):
    """Measure every artifact through the server that would serve it, under concurrent streaming load."""

    concurrency: list[int] = Field(default_factory=lambda: [1, 4], min_length=1,
                                   description="Closed-loop points: this many requests in flight at once.")
    request_rates: list[float] | None = Field(
        None, description="Open-loop points: Poisson arrivals at these requests/s (seeded), after the concurrency ones.")
    requests: int = Field(16, ge=1, le=100_000, description="Requests measured per point (after the warm-up).")
    rounds: int = Field(3, ge=1, le=100, description="Independent rounds per point (each its own warm-up and "
                        "prompts; round by round through the sweep): the point's figures pool them and carry 95 % "
                        "bootstrap intervals, which selection reads. 1: one sample, no intervals. Part of the key.")
    warmup: int = Field(2, ge=0, description="Requests sent first at each point and not counted; the measured ones "
                        "follow them without a pause (steady state).")
    rampup_s: float = Field(0.0, ge=0, description="Start the concurrent streams this many seconds apart in all "
                            "(stream k at k/C of it), as guidellm's rampup_duration. With fixed lengths, streams that "
                            "start together prefill together for the whole run; spread them to measure staggered "
                            "traffic (about one request's duration is enough).")
    input_len: int | LengthRange = Field(
        128, description="Prompt tokens per request (windows of the evaluation corpus), or {min, max}: drawn per "
        "request (seeded).")
    prefix_tokens: int = Field(0, ge=0, le=1_000_000, description="A shared prefix (a system prompt) of this many "
                               "tokens that every request's prompt starts with, before its own input_len tokens, as "
                               "guidellm's prefix_tokens: a server with prompt caching prefills it once.")
    output_len: int | LengthRange = Field(
        32, description="Tokens generated per request (ignore_eos where the engine has it), or {min, max}: drawn per "
        "request (seeded).")
    conversation: Conversation | None = Field(
        None, description="{turns, think_s}: send multi-turn conversations instead of independent requests; each turn "
        "resends the history (the prefix only opens a conversation). Off by default. Capacity probes send "
        "conversations too (their rate: new conversations per second); a trace stays single requests.")
    seed: int = Field(0, description="Which corpus windows become prompts, their lengths when drawn, and the Poisson "
                      "arrivals.")
    dataset: Dataset = Field(default_factory=lambda: Dataset(sources=[{"type": "pydocs", "split": "test"}]),
                             description="Where prompts come from (tokenized with the baseline's tokenizer).")
    timeout_s: float = Field(120.0, gt=0, description="Per-request limit: a slower request counts as an error.")
    ready_timeout_s: float = Field(300.0, gt=0, description="How long a server may take to load before the step fails.")
    engine: str | None = Field(None, description="Serve with this server only (qbuild plugins lists them); default: "
                               "the first installed server whose engine loads the artifact.")
    variants: list[str] | Literal["all"] = Field("all", description="Which artifacts to serve (baseline included).")
    configs: list[ServingConfig] = Field(default_factory=lambda: [ServingConfig(name="default")], min_length=1)
    trace: str | None = Field(None, description="A user's requests to replay (JSONL, relative to the recipe: "
                              "arrival_s, output_len, and input_len or prompt per line): one more point per config, "
                              "`trace`, with the requests sent at their arrival times (docs/serving.md).")
    capacity: Capacity | None = Field(None, description="{slo: {...}, max_minutes}: per (artifact, config), the highest "
                                      "request rate meeting the SLOs (a `capacity[...]` step each).")

    @field_validator("input_len", "output_len", mode="before")
    @classmethod
    def _range_in_order(cls, v):   # said here, or the error would be the int branch's "not a valid integer"
        if isinstance(v, dict) and isinstance(v.get("min"), int) and isinstance(v.get("max"), int) and v["min"] > v["max"]:
            raise ValueError(f"min ({v['min']}) is larger than max ({v['max']})")
        return v

    @field_validator("input_len", "output_len")
    @classmethod
    def _lengths(cls, v, info):
        least = 2 if info.field_name == "output_len" else 1   # TPOT needs two tokens
        if (v.min if isinstance(v, LengthRange) else v) < least:
            raise ValueError(f"must be at least {least}")
        return v

    @field_validator("configs")
    @classmethod
    def _unique_config_names(cls, configs):
        names = [c.name for c in configs]
        dup = next((n for n in names if names.count(n) > 1), None)
        if dup:
            raise ValueError(f"serving config name {dup!r} is used twice; names must be unique")
        return configs


# the fixed prompt of a load check: plain English any tokenizer handles, whose continuation a working model keeps on topic
LOAD_CHECK_PROMPT = "The three most important things to know about the Python programming language are"


class LoadCheck(StrictModel):
    """Load each artifact with the runtimes that read it and greedily continue a fixed prompt."""

    prompt: str = Field(LOAD_CHECK_PROMPT, min_length=1, description="The prompt, tokenized once with the baseline's "
                        "tokenizer (its special tokens, no chat template), so every artifact is fed the same ids.")
    tokens: int = Field(16, ge=1, le=256, description="How many tokens to generate greedily.")
    runtimes: list[str] | None = Field(
        None, min_length=1, description="Runtimes to load each artifact with (those of them that read its format); "
        "default: every installed runtime that reads it.")


class Gate(StrictModel):
    """A quality gate: a nightly job fails (exit 3) when a variant misses one of these bounds."""

    variants: list[str] | Literal["all"] = "all"
    max_delta_ppl: float | None = Field(None, description="Largest allowed PPL − baseline PPL.")
    max_delta_ppl_pct: float | None = Field(None, description="Largest allowed PPL increase, in % of the baseline.")
    max_kld: float | None = None
    min_top1: float | None = Field(None, ge=0, le=1)
    min_throughput_ratio: float | None = Field(None, description="Decode tok/s of the variant ÷ the baseline's.")
    max_size_mb: float | None = None
    max_acc_drop_pct: float | None = Field(None, description="Largest allowed task accuracy drop below the baseline, "
                                           "in percentage points (the worst task of evaluation.tasks).")
    max_flips_pct: float | None = Field(None, ge=0, description="Largest allowed share of a task's documents whose "
                                        "answer changed against the baseline (both directions), in %.")
    # compared with the previous successful run of the same recipe (the store's run records): a nightly job
    # fails when a variant got worse since the last good night, even where it still meets the absolute bounds
    max_regression_ppl_pct: float | None = Field(
        None, ge=0, description="Largest allowed PPL increase since the previous successful run, in %.")
    max_regression_decode_pct: float | None = Field(
        None, ge=0, description="Largest allowed decode tok/s drop since the previous successful run, in %.")


class TaskEval(StrictModel):
    """An lm-eval task (lm-eval's own names and task YAML), scored through qbuild's runtimes for every artifact."""

    task: str = Field(min_length=1, description="lm-eval task (or group) name, as `lm_eval --tasks` takes it.")
    include_path: str | None = Field(
        None, description="Directory of task YAML files and their local data files (lm-eval's --include_path); "
        "relative to the recipe. Its contents (every file under it) identify the task in the key.")
    num_fewshot: int | None = Field(None, ge=0, description="lm-eval's --num_fewshot (default: the task's own).")
    limit: int | None = Field(None, ge=1, description="Score at most this many documents (lm-eval's --limit).")


class OverlapCheck(StrictModel):
    """Calibration vs evaluation text: the share of evaluation n-grams also in calibration text (plan-time check)."""

    ngram: int = Field(13, ge=5, le=50, description="Words per n-gram (13: GPT-3's decontamination analysis).")
    max_pct: float = Field(5.0, ge=0, le=100, description="Plan fails (exit 2) above this share of the evaluation "
                           "text's n-grams found in calibration text, in %. Copied boilerplate gives a few %: the "
                           "demo's pydocs train/test split measures 2.9 % (docstrings copied between stdlib modules).")


class Evaluation(StrictModel):
    baseline: bool = Field(True, description="Also evaluate the unquantized model (needed for ΔPPL, KLD, ratios).")
    perplexity: Perplexity | None = Field(default_factory=Perplexity)
    kld: bool = Field(False, description="KL divergence + top-1 agreement against the baseline, on the perplexity tokens.")
    kld_base: str | None = Field(
        None, description="A `llama-perplexity --kl-divergence-base FILE --save-all-logits` file: KLD and top-1 against "
        "its stored log-probs, computed llama.cpp's way, on its tokens (needs kld: true, protocol llama.cpp and "
        "its context length); comparable with llama.cpp's published tables.")
    throughput: Throughput | None = None
    serving: Serving | None = Field(None, description="Serve each artifact with its real server and sweep concurrency "
                                    "(TTFT/TPOT/ITL percentiles, tok/s, goodput, memory) per serving config.")
    load_check: LoadCheck | None = Field(
        None, description="true or {prompt, tokens, runtimes}: load every artifact with each runtime that reads it and "
        "generate `tokens` tokens greedily, compared with the baseline's (the `load` column).",
        json_schema_extra=lambda schema: schema["anyOf"].insert(0, {"type": "boolean"}))   # `true` in editors too
    runtimes: list[str] | None = Field(
        None, min_length=1, description="Also score every artifact through these runtimes where they read it (e.g. "
        "[vllm]: the engine it is served with): PPL, and KLD/top-1 against the same baseline reference, on the same "
        "windows, beside the artifact's own numbers. The baseline's pass says how far the runtime is from the "
        "reference one.")
    gates: list[Gate] = Field(default_factory=list)
    tasks: list[TaskEval] = Field(
        default_factory=list, description="Task accuracy through lm-eval: per artifact acc ± stderr, and per variant "
        "the answers that flipped against the baseline (right→wrong, wrong→right).")
    overlap: OverlapCheck | None = Field(
        default_factory=OverlapCheck, description="Check that calibration and evaluation text do not overlap "
        "(13-gram overlap, measured at plan time, recorded in both data steps' manifests); null turns it off.")

    @field_validator("load_check", mode="before")
    @classmethod
    def _load_check_switch(cls, value):
        # `load_check: true` is the default check; false is the same as leaving it out
        if isinstance(value, bool):
            return LoadCheck() if value else None
        if not isinstance(value, (dict, LoadCheck, type(None))):
            raise ValueError(f"expected true, false or {{prompt, tokens, runtimes}}, got {value!r}")
        return value

    @model_validator(mode="after")
    def _needs(self):
        if self.runtimes and self.perplexity is None:
            raise ValueError("runtimes needs evaluation.perplexity (the windows each runtime scores)")
        if self.kld and (self.perplexity is None or not self.baseline):
            raise ValueError("kld needs perplexity (its tokens) and baseline: true")
        if self.kld_base and (not self.kld or self.perplexity is None or self.perplexity.protocol != "llama.cpp"):
            raise ValueError("kld_base needs kld: true and perplexity.protocol: llama.cpp (the file's scoring)")
        for g in self.gates:
            if (g.max_delta_ppl is not None or g.max_delta_ppl_pct is not None) and self.perplexity is None:
                raise ValueError("a ΔPPL gate needs evaluation.perplexity")
            if (g.max_kld is not None or g.min_top1 is not None) and not self.kld:
                raise ValueError("a KLD/top-1 gate needs evaluation.kld: true")
            if g.min_throughput_ratio is not None and (self.throughput is None or not self.baseline):
                raise ValueError("a throughput gate needs evaluation.throughput and baseline: true")
            if (g.max_acc_drop_pct is not None or g.max_flips_pct is not None) and not (self.tasks and self.baseline):
                raise ValueError("an accuracy/flips gate needs evaluation.tasks and baseline: true")
            if g.max_regression_ppl_pct is not None and self.perplexity is None:
                raise ValueError("max_regression_ppl_pct needs evaluation.perplexity (the PPL it compares)")
            if g.max_regression_decode_pct is not None and self.throughput is None:
                raise ValueError("max_regression_decode_pct needs evaluation.throughput (the decode speed it compares)")
        return self


class SLO(StrictModel):
    value: float = Field(gt=0)
    concurrency: int = Field(ge=1, description="The sweep point the bound applies to.")


SLOBound = Annotated[Union[float, SLO], Field(description="A number (at selection.concurrency) or {value, concurrency}.")]


class Selection(StrictModel):
    """Pick the (variant, serving config) to ship: every bound met, then the best by `objective`."""

    concurrency: int | None = Field(None, ge=1, description="Where latency/throughput SLOs given as plain numbers "
                                    "apply; default: the sweep's largest concurrency.")
    ttft_p99_ms: SLOBound | None = Field(None, description="Largest TTFT p99 (ms).")
    tpot_p50_ms: SLOBound | None = Field(None, description="Largest TPOT p50 (ms per output token after the first).")
    min_output_tok_s: SLOBound | None = Field(None, description="Smallest output tokens/s of the whole server.")
    max_kld: float | None = Field(None, ge=0, description="Largest KLD against the baseline (needs evaluation.kld).")
    max_delta_ppl_pct: float | None = Field(None, description="Largest PPL increase over the baseline, in %.")
    max_size_mb: float | None = Field(None, gt=0, description="Largest artifact size (MiB).")
    max_memory_mb: float | None = Field(None, gt=0, description="Largest server peak RSS (MiB) over the sweep.")
    max_error_pct: float = Field(0.0, ge=0, le=100, description="Largest share of failed requests at any serving point "
                                 "of a candidate's config, in %; applied whatever other bounds are given. Default 0: "
                                 "a server that failed a request is not shipped.")
    objective: Literal["max_throughput", "min_size", "min_kld", "max_capacity"] = Field(
        "max_throughput", description="Among those meeting every bound: most output tok/s at the selection's "
        "concurrency, smallest artifact, lowest KLD, or highest capacity (requests/s within "
        "evaluation.serving.capacity's SLOs).")
    target_rps: float | None = Field(None, gt=0, description="A traffic to serve (requests/s): each candidate's servers "
                                     "needed at its capacity, and the cheapest choice (needs evaluation.serving."
                                     "capacity).")
    include_baseline: bool = Field(False, description="Let the unquantized baseline be selected too.")
    on_uncertain: Literal["reject", "accept", "measure_more"] = Field(
        "reject", description="A latency/throughput bound whose 95 % interval straddles it (within noise, measured "
        "in rounds): reject the candidate (a miss), accept it (noted), or measure_more: add rounds to the candidates "
        "in doubt (and to tied ones) within measure_more_minutes, then reject what is still in doubt. Default "
        "reject: ship only what clearly meets the bounds.")
    measure_more_minutes: float = Field(10.0, gt=0, le=1440, description="on_uncertain: measure_more: the time "
                                        "budget for the added rounds (checked before each pass).")
    measure_more_rounds: int = Field(2, ge=1, le=100, description="on_uncertain: measure_more: rounds added to "
                                     "each candidate in doubt per pass.")
    tie_break: list[Literal["kld", "memory", "size"]] = Field(
        default_factory=lambda: ["kld", "memory", "size"], min_length=1,
        description="When the best candidates' objective intervals overlap (a tie within noise): the first of these "
        "that differs decides: lower KLD, smaller server peak RSS, smaller artifact.")


# --- runtime and store -------------------------------------------------------------------------------
class Runtime(StrictModel):
    threads: int | Literal["auto"] = Field(
        "auto", description="CPU threads per step; auto = half the cores (min 1), and an evaluation step also takes "
        "cores that would otherwise sit idle while it runs (its numbers do not depend on the thread count). "
        "A number is a fixed cap.")
    device: Literal["auto", "cpu", "cuda"] = "auto"
    rebuild_check: list[str] = Field(
        default_factory=list, description="Step kinds or step names (quantize, calibrate, perplexity[q4km], ...) to "
        "re-execute in scratch right after the run and compare with what was stored (`qbuild verify --rebuild`); "
        "a step that is not bit-identical fails the run like a gate (exit 3).")

    def resolved_threads(self) -> int:
        import os

        if self.threads == "auto":
            return max(1, (os.cpu_count() or 2) // 2)
        return max(1, int(self.threads))

    @property
    def elastic_threads(self) -> bool:
        """Whether steps whose result does not depend on the thread count may use idle cores (threads: auto)."""
        return self.threads == "auto"


class MLflowTracking(StrictModel):
    uri: str = Field(description="Tracking URI: http://host:port, sqlite:///path.db, or a file store path.")
    experiment: str | None = Field(None, description="Default: qbuild/<recipe name>.")


class Tracking(StrictModel):
    mlflow: MLflowTracking | None = None


class StoreConfig(StrictModel):
    model_config = ConfigDict(**StrictModel.model_config, hide_input_in_errors=True)  # a bad URL may hold a secret

    path: str = "./artifacts"
    tag: str | None = Field(None, pattern=NAME_RE, description="Extra ref tag set on every variant of a run.")
    remotes: list[RemoteSpec] = Field(
        default_factory=list, description="Remote tiers behind the local store (s3://, file://, oci://, ...): read "
        "through at plan time, written through after builds (see docs/remote-stores.md). A bare URL is allowed.")

    @model_validator(mode="before")
    @classmethod
    def _bare_urls(cls, data):
        if isinstance(data, dict) and isinstance(data.get("remotes"), list):
            data = {**data, "remotes": [{"url": r} if isinstance(r, str) else r for r in data["remotes"]]}
        return data


def _plugin_union(registry, discriminator: str):
    """The union of every registered plugin's options model (built-in and entry points), tagged by name."""
    models = tuple(p.options for p in registry.all())
    if not models:  # pydantic needs at least one member; a tag nothing declares never validates
        return Annotated[Literal["(none registered)"], Field(description=f"no {registry.what} is installed")]
    return Annotated[Union[models], Field(discriminator=discriminator)]  # type: ignore[valid-type]


class DeploySpace(StrictModel):
    """The levers the deployment search combines (every combination is one candidate; docs/serving.md, Deployment
    search). A list per lever; null in a list is the engine's default."""

    variants: list[str] | Literal["all"] = Field("all", description="The weights: variants of the recipe (the "
                                                 "baseline too, by name) served by evaluation.serving's engine.")
    kv_cache_dtype: list[Literal["f16", "bf16", "q8_0", "q4_0", "fp8"] | None] = Field(
        default_factory=lambda: [None], min_length=1, description="KV-cache types (each quantized one gets its own "
        "KLD against the baseline, through the perplexity pass under that cache).")
    parallel: list[int] = Field(default_factory=lambda: [1, 2, 4], min_length=1, description="Requests decoded at "
                                "once (llama.cpp --parallel, vLLM --max-num-seqs); context per slot follows the "
                                "workload.")
    threads: list[int | None] = Field(default_factory=lambda: [None], min_length=1, description="Server CPU threads "
                                      "(null: the run's threads).")
    batch_size: list[int | None] = Field(default_factory=lambda: [None], min_length=1)
    ubatch_size: list[int | None] = Field(default_factory=lambda: [None], min_length=1)
    prefix_caching: list[bool | None] = Field(default_factory=lambda: [None], min_length=1)
    draft: list[str | None] = Field(default_factory=lambda: [None], min_length=1, description="Speculative drafts: "
                                    "variants of the recipe (null: none); a variant is never its own draft.")
    draft_max: int | None = Field(None, ge=1, le=64, description="Tokens drafted per step at most, with a draft.")

    @field_validator("parallel")
    @classmethod
    def _positive(cls, v):
        if any(n < 1 for n in v):
            raise ValueError("parallel slots are at least 1")
        return v


class Deploy(StrictModel):
    """Find the deployment to ship: the candidate (weights × KV cache × server settings × draft) with the most capacity
    per replica at the SLOs, within a measured memory budget and quality bounds. Every candidate is screened by one
    short closed-loop point at its full batch (its throughput there bounds its capacity from above); then the
    capacity search (evaluation.serving.capacity's) runs on candidates in order of that bound, and a candidate whose
    bound cannot beat a measured one that is no larger and no worse is never searched (docs/serving.md)."""

    slo: CapacitySLO
    space: DeploySpace = Field(default_factory=DeploySpace)
    target_rps: float | None = Field(None, gt=0, description="Traffic to serve (requests/s): replicas needed.")
    max_memory_mb: float | None = Field(None, gt=0, description="Largest server peak RSS per replica (MiB), as "
                                        "measured while screening.")
    max_kld: float | None = Field(None, ge=0, description="Largest KLD against the baseline (needs evaluation.kld).")
    max_delta_ppl_pct: float | None = Field(None, description="Largest PPL increase over the baseline, in %.")
    screen_requests: int = Field(8, ge=2, le=10_000, description="Requests of a candidate's screening point (after "
                                 "one warm-up per slot).")
    strategy: Literal["challenge", "prune", "grid"] = Field(
        "challenge", description="challenge: search the most promising candidate's capacity (the leader), then "
        "challenge every candidate whose screen could come within one grid step of it at the leader's rates (one to "
        "three probes each: beats, ties or below; one that beats it is searched upward and leads); prune: search "
        "capacity in order of the screened bound and skip candidates one already searched beats; grid: search "
        "every candidate that meets the bounds (what the search is compared with: bench/bench_deploy.py), "
        "max_searched ignored. Each then searches the Pareto front with the budget left.")
    max_searched: int = Field(4, ge=1, le=1000, description="Capacity searches and challenges at most (the most "
                              "promising first).")
    front: bool = Field(True, description="After the choice, search other candidates for the Pareto front (capacity, "
                        "memory, KLD) with the budget left; false: stop once the choice is settled (the front is "
                        "then of the candidates searched for the choice).")
    max_minutes: float = Field(30.0, gt=0, le=1440, description="Time budget of the capacity searches together; "
                               "past it, the candidates not searched are reported as such.")
    requests: int = Field(24, ge=2, le=100_000, description="Poisson arrivals per round of a capacity probe.")
    rounds: int = Field(2, ge=1, le=100, description="Rounds per capacity probe.")
    max_error_pct: float = Field(1.0, ge=0, le=100, description="Largest share of failed requests at a rate, in %.")


def _variant_union():
    from qbuild.contract.plugin import methods

    return _plugin_union(methods, "method")


def _target_union():
    from qbuild.contract.plugin import targets

    return _plugin_union(targets, "type")


Variant = _variant_union()
Target = _target_union()


class Recipe(StrictModel):
    _lines: dict = PrivateAttr(default_factory=dict)
    _source: str | None = PrivateAttr(default=None)

    name: str = Field(pattern=NAME_RE, description="Recipe name: the first part of every ref (name/variant:tag).")
    model: ModelSource
    calibration: Calibration | None = None
    variants: list[Variant] = Field(min_length=1)  # type: ignore[valid-type]
    targets: list[Target] = Field(default_factory=list)  # type: ignore[valid-type]
    evaluation: Evaluation = Field(default_factory=Evaluation)
    runtime: Runtime = Field(default_factory=Runtime)
    store: StoreConfig = Field(default_factory=StoreConfig)
    tracking: Tracking = Field(default_factory=Tracking)
    deploy: Deploy | None = Field(None, description="{slo, space, ...}: search weights × KV cache × server settings "
                                  "× speculative draft for the deployment with the most capacity at the SLOs within "
                                  "memory and quality bounds (`qbuild deploy`; docs/serving.md).")
    selection: Selection | None = Field(None, description="SLOs, quality and budget bounds and an objective: which "
                                        "(variant, serving config) to ship (`qbuild select`).")
    model_registry: RegisterSpec | None = Field(
        None, alias="register", description="Register each variant in the MLflow model registry (alias set when every gate passes).")

    @field_validator("variants")
    @classmethod
    def _unique_variant_names(cls, variants):
        seen: set[str] = set()
        for v in variants:
            if v.name in seen:
                raise ValueError(f"variant name {v.name!r} is used twice; names must be unique")
            seen.add(v.name)
        return variants

    @model_validator(mode="after")
    def _gates_name_known_variants(self):
        names = {v.name for v in self.variants}
        for g in self.evaluation.gates:
            unknown = [] if g.variants == "all" else [n for n in g.variants if n not in names]
            if unknown:
                raise ValueError(f"evaluation.gates names unknown variant(s) {unknown}; variants are {sorted(names)}")
        return self

    @model_validator(mode="after")
    def _selection_needs_measures(self):
        sel, ev = self.selection, self.evaluation
        if ev.serving and ev.serving.variants != "all":
            known = {v.name for v in self.variants} | {"baseline"}
            unknown = [n for n in ev.serving.variants if n not in known]
            if unknown:
                raise ValueError(f"evaluation.serving.variants names unknown variant(s) {unknown}; "
                                 f"variants are {sorted(known)}")
        if sel is None:
            return self
        slos = [(n, getattr(sel, n)) for n in ("ttft_p99_ms", "tpot_p50_ms", "min_output_tok_s")]
        if any(b is not None for _, b in slos) or sel.max_memory_mb is not None or sel.objective == "max_throughput":
            if ev.serving is None:
                raise ValueError("selection's latency, throughput and memory bounds (and objective max_throughput) "
                                 "need evaluation.serving")
            for name, bound in slos:
                at = bound.concurrency if isinstance(bound, SLO) else sel.concurrency
                if at is not None and at not in ev.serving.concurrency:
                    raise ValueError(f"selection.{name} is at concurrency {at}, which evaluation.serving.concurrency "
                                     f"{ev.serving.concurrency} does not measure")
        if sel.on_uncertain == "measure_more" and ev.serving is None:
            raise ValueError("selection.on_uncertain: measure_more adds serving rounds: it needs evaluation.serving")
        if (sel.objective == "max_capacity" or sel.target_rps is not None) and (
                ev.serving is None or ev.serving.capacity is None):
            raise ValueError("selection's objective max_capacity and target_rps need evaluation.serving.capacity")
        if (sel.max_kld is not None or sel.objective == "min_kld") and not ev.kld:
            raise ValueError("selection.max_kld and objective min_kld need evaluation.kld: true")
        if sel.max_delta_ppl_pct is not None and (ev.perplexity is None or not ev.baseline):
            raise ValueError("selection.max_delta_ppl_pct needs evaluation.perplexity and baseline: true")
        return self

    @model_validator(mode="after")
    def _deploy_names_known_variants(self):
        known = {v.name for v in self.variants} | {"baseline"}
        ev = self.evaluation
        for i, c in enumerate(ev.serving.configs if ev.serving else []):
            if c.draft is not None and c.draft not in known:
                raise ValueError(f"evaluation.serving.configs[{i}].draft names unknown variant {c.draft!r}; "
                                 f"variants are {sorted(known)}")
        d = self.deploy
        if d is None:
            return self
        if ev.serving is None:
            raise ValueError("deploy: measures through evaluation.serving's server, prompts and lengths: add "
                             "evaluation.serving")
        named = ([] if d.space.variants == "all" else list(d.space.variants)) + [x for x in d.space.draft if x]
        unknown = sorted({n for n in named if n not in known})
        if unknown:
            raise ValueError(f"deploy.space names unknown variant(s) {unknown}; variants are {sorted(known)}")
        if d.max_kld is not None and not ev.kld:
            raise ValueError("deploy.max_kld needs evaluation.kld: true")
        if d.max_delta_ppl_pct is not None and (ev.perplexity is None or not ev.baseline):
            raise ValueError("deploy.max_delta_ppl_pct needs evaluation.perplexity and baseline: true")
        return self

    @model_validator(mode="after")
    def _targets_name_known_variants(self):
        names = {v.name for v in self.variants}
        for i, t in enumerate(self.targets):
            unknown = [] if t.variants == "all" else [n for n in t.variants if n not in names]
            if unknown:
                raise ValueError(f"targets[{i}].variants names unknown variant(s) {unknown}; variants are {sorted(names)}")
        return self

    @model_validator(mode="after")
    def _calibration_present_when_needed(self):
        for i, v in enumerate(self.variants):
            if v.needs_calibration() and self.calibration is None:
                raise ValueError(
                    f"variants[{i}] ({v.name}, method {v.method}) needs calibration data; add a 'calibration:' section"
                )
        return self


# --- loading with line-aware errors ------------------------------------------------------------------
def _field_path(loc: tuple, data: Any) -> tuple[str, Loc]:
    """pydantic loc → ('variants[2].bits', data path). Drops union tags pydantic inserts."""
    parts: list[str] = []
    real: list[str | int] = []
    node = data
    for item in loc:
        if isinstance(item, int) and isinstance(node, list):
            parts.append(f"[{item}]")
            real.append(item)
            node = node[item] if item < len(node) else None
        elif isinstance(node, dict) and item in node:
            parts.append(("." if parts else "") + str(item))
            real.append(item)
            node = node[item]
        elif isinstance(node, dict) and isinstance(item, str) and re.fullmatch(r"[\w-]+", item) and parts[-1:] != [item]:
            # either a union tag (skip) or a missing required field (keep, it names what to add)
            if _is_union_tag(node, item):
                continue
            parts.append(("." if parts else "") + item)
            real.append(item)
            node = None
        else:
            parts.append(("." if parts else "") + str(item))
            real.append(item)
            node = None
    return "".join(parts), tuple(real)


def _tag_field(err: dict) -> str | None:
    if err["type"] in ("union_tag_invalid", "union_tag_not_found"):
        return (err.get("ctx") or {}).get("discriminator", "").strip("'") or None
    return None


def _is_union_tag(node: dict, item: str) -> bool:
    return any(node.get(k) == item for k in ("method", "type", "source")) or item.startswith("function-")


def _describe(err: dict) -> str:
    kind = err["type"]
    value = err.get("input")
    ctx = err.get("ctx") or {}
    if kind == "extra_forbidden":
        return "unknown key (check spelling; see `qbuild schema`)"
    if kind == "missing":
        return "required field is missing"
    if kind == "literal_error":
        return f"{quoted(value)} is not allowed; expected {ctx.get('expected')}"
    if kind == "union_tag_invalid":
        kind_name = ctx.get("discriminator", "kind").strip(chr(39))
        return f"{quoted(ctx.get('tag'))} is not a known {kind_name}; expected one of {ctx.get('expected_tags')}"
    if kind == "union_tag_not_found":
        return f"missing the {ctx.get('discriminator', 'kind')} key that says which kind this is"
    msg = err["msg"]
    msg = msg.removeprefix("Value error, ")
    if isinstance(value, str | bytes | int | float) and repr(value) in msg:   # a validator quoted the value: cut it
        msg = msg.replace(repr(value), quoted(value))
    if value is not None and not isinstance(value, (dict, list)) and kind != "value_error":
        return f"{msg} (got {quoted(value)})"
    return msg


def parse_recipe(data: Any, lines: dict[Loc, int] | None = None, source: str = "recipe") -> Recipe:
    lines = lines or {}
    if not isinstance(data, dict):
        raise RecipeError("", "a recipe must be a YAML mapping (name:, model:, variants:, ...)", line=1, source=source)
    try:
        return Recipe.model_validate(data)
    except ValidationError as exc:
        err = exc.errors()[0]
        loc = err["loc"] + ((_tag_field(err),) if _tag_field(err) else ())
        field, real = _field_path(loc, data)
        raise RecipeError(field, _describe(err), line=line_for(lines, real), source=source) from None


def load_recipe(path: str | Path) -> Recipe:
    path = Path(path)
    data, lines = load_yaml_file(path)
    recipe = parse_recipe(data, lines, source=str(path))
    recipe._lines = lines
    recipe._source = str(path)
    return recipe


def locate(err: RecipeError, recipe: Recipe) -> RecipeError:
    """Give a plan-time error (raised with only a field path) its file and line."""
    if err.line is None and recipe._lines:
        loc: list[str | int] = []
        for name, index in re.findall(r"([^.\[\]]+)|\[(\d+)\]", err.field):
            loc.append(int(index) if index else name)
        err.line = line_for(recipe._lines, tuple(loc))
    err.source = err.source or recipe._source
    err.args = (err.render(),)
    return err
