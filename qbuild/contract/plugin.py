"""The plugin contract: the kinds of plugins the pipeline calls (quantization methods, build targets, evaluation
runtimes, inference servers), what their plan-time code sees (PlanningContext) and their registries.

Each is a class that declares everything the pipeline needs, registered by name (plugin authors import these
names from qbuild.plugins). The registries scan the in-tree plugin packages named here (PLUGIN_PACKAGES, and
qbuild.servers for servers) and the entry point groups: discovery by name, never an import of this module.
Plugin modules must stay light at import: heavy libraries are imported inside the functions their steps run.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Literal, Protocol

from pydantic import Field

from qbuild.base.errors import RecipeError
from qbuild.base.registry import Plugin, Registry
from qbuild.base.schema_base import StrictModel

if TYPE_CHECKING:
    import numpy as np

    from qbuild.contract.envs import BackendEnv
    from qbuild.contract.protocol import Window
    from qbuild.contract.shapes import UnsupportedFamily
    from qbuild.contract.step import OnUnavailable, Step, StepContext


class PlanningContext(Protocol):
    """What a plugin's plan-time code may use of the plan being built (qbuild.pipeline.plan.PlanContext is the one)."""

    recipe: Any                                        # the qbuild.planning.recipe.Recipe being planned

    @property
    def threads(self) -> int: ...                      # threads each step may use (recipe `runtime.threads`)

    @property
    def device(self) -> str: ...                       # "cpu", "cuda" or "auto"

    def add(self, step: Step) -> Step: ...             # add a step (an equal key returns the one already planned)

    def model(self) -> Step: ...                       # the source model's step (an HF checkpoint)

    def model_info(self) -> dict: ...                  # its config: shapes, architecture, tensor names

    def untouched_dtype(self) -> str | None: ...       # where an artifact's unquantized matrices go narrower than
                                                       # the model step's (qbuild.models.untouched)

    def calibration(self) -> Step: ...                 # the shared tokenized calibration set

    def backend_env(self, variant, method: Method) -> BackendEnv | None: ...   # where a variant's step runs

    def named_env(self, option, field: str, explicit: bool = True) -> BackendEnv | None: ...

    def warn(self, message: str) -> None: ...          # shown with the plan and logged


# --- quantization methods ------------------------------------------------------------------------------
class Method(Plugin, ABC):
    """A quantization method: recipe `variants[i].method: NAME`."""

    options: ClassVar[type[StrictModel]]   # subclass of qbuild.contract.variant.VariantBase
    # backend environments (qbuild/envs/): whether the variant's `env:` is honoured, and the default one
    # (None: qbuild's own environment). A method that honours it passes ctx.backend_env(variant, self) to its Step.
    runs_in_env: ClassVar[bool] = False
    default_env: ClassVar[str | None] = None
    # model architectures (and configurations, and variant options) it cannot build, each with why
    # (qbuild.contract.shapes.UnsupportedFamily): planning refuses them in one line
    unsupported_families: ClassVar[tuple[UnsupportedFamily, ...]] = ()

    def check(self, variant, ctx: PlanningContext, field: str) -> None:
        """Plan-time validation beyond the schema (shapes, unsupported combinations): raise RecipeError."""

    @abstractmethod
    def plan(self, variant, ctx) -> Step:
        """Add this variant's steps to the plan (ctx.add) and return the step that produces its artifact.

        That step sets `variant`, `format` (qbuild.contract.formats) and `scheme`, which is what targets and
        runtimes select on."""


# --- build targets -----------------------------------------------------------------------------------------
class TargetOptions(StrictModel):
    """Fields every target entry has; a target's own options model subclasses this."""

    variants: list[str] | Literal["all"] = Field("all", description="Which variants to build this target for.")


@dataclass(frozen=True)
class PullOption:
    """A `qbuild pull` flag a target declares, to pick a machine-bound build for another machine than this one."""

    flag: str       # "tensorrt-llm" → --tensorrt-llm
    key: str        # the key of machine_needs' `chosen` it sets ("tensorrt_llm")
    help: str


class Target(Plugin, ABC):
    """A build target: recipe `targets[i].type: NAME`, applied to variant artifacts.

    A target takes inputs by capability, never by method name: `accepts` maps each input format it
    reads to the schemes it takes (None: any scheme of that format)."""

    options: ClassVar[type[TargetOptions]]
    accepts: ClassVar[dict[str, tuple[str, ...] | None]] = {}
    hints: ClassVar[dict[str, str]] = {}     # format → what to do instead, for the refusal message
    purpose: ClassVar[str] = ""              # "be built into a TensorRT-LLM engine": completes the refusal message
    # Outputs that load only on the machine they were built for (a TensorRT engine: GPU model, CPU architecture,
    # toolchain): `qbuild pull` picks, among every stored build of a recipe/variant, the one that fits the machine.
    machine_bound_kind: ClassVar[str | None] = None     # the manifest `kind` of those builds
    pull_options: ClassVar[tuple[PullOption, ...]] = ()  # extra `qbuild pull` flags that select another machine

    def machine_needs(self, chosen: dict[str, str | None]) -> dict:
        """What a build must have been made for to load on this machine; `chosen` overrides probed facts ("gpu.sm",
        "gpu.name", "host.arch" and the keys of `pull_options`). Raises UserError where a fact cannot be told."""
        raise NotImplementedError(f"target {self.name} declares no machine-bound builds")

    def select_build(self, builds: list[dict], need: dict, ref: str) -> dict:
        """The manifest among `builds` (newest first) that fits `need`; UserError says what exists and why none fits."""
        raise NotImplementedError(f"target {self.name} declares no machine-bound builds")

    def refusal(self, artifact: Step) -> str | None:
        """None if this target takes the artifact, else why not (and what would work)."""
        if artifact.format in self.accepts:
            schemes = self.accepts[artifact.format]
            if schemes is None or artifact.scheme in schemes:
                return None
            why = f"it takes {artifact.format} with scheme {', '.join(schemes)}, not {artifact.scheme or '?'}"
        else:
            why = f"it reads {', '.join(self.accepts) or 'nothing'}, not {artifact.format or '?'}"
        hint = self.hints.get(artifact.format)
        return why + (f"; {hint}" if hint else "")

    def check_input(self, artifact: Step, field: str) -> None:
        why = self.refusal(artifact)
        if why:
            method = artifact.params.get("method", artifact.kind)
            raise RecipeError(field, f"variant {artifact.variant!r} (method {method}, format {artifact.format or '?'}"
                              f"{', scheme ' + artifact.scheme if artifact.scheme else ''}) cannot "
                              f"{self.purpose or 'be used by target ' + self.name}: {why}")

    def describe(self, output: Step) -> str:
        """Short label of a built output for the summary (e.g. 'engine, SM 9.0')."""
        return output.format

    @abstractmethod
    def plan(self, target, artifact: Step, ctx: PlanningContext, field: str) -> Step:
        """Add the build of `artifact` for this target; return the step producing the output.

        Its `variant` is "<variant>.<target name>" (its ref), its `format` says what runtimes evaluate it."""


# --- evaluation runtimes ------------------------------------------------------------------------------------
class RuntimeSession:
    """An opened model: logits for token windows, greedy and timed generation. Made by Runtime.open in a worker.

    Two optional members, used where the session's flags say so: `scored_logits` (only the rows a window scores:
    llama.cpp) and `throughput` (its own speed benchmark: the TensorRT-LLM runtime runs trtllm-bench); otherwise rows
    are cut from `window_logits` and qbuild times `generate_timed`."""

    scores_rows: ClassVar[bool] = False        # implements scored_logits
    own_throughput: ClassVar[bool] = False     # implements throughput

    def scored_logits(self, tokens: list[int], first_scored: int) -> np.ndarray:
        """The logit rows that predict tokens[first_scored:] (Runtime.scores_rows)."""
        raise NotImplementedError

    def throughput(self, ctx: StepContext, params: dict) -> dict:
        """A throughput step's result measured the runtime's own way (Runtime.own_throughput)."""
        raise NotImplementedError

    def logits(self, tokens: list[int]) -> np.ndarray:
        raise NotImplementedError

    def window_logits(self, windows: list[Window]) -> Iterator[np.ndarray]:
        """Logits (tokens × vocab, float32) of each window, in order."""
        for w in windows:
            yield self.logits(w.tokens)

    def set_threads(self, n: int) -> None:
        """Use `n` CPU threads from the next forward pass on (an elastic step's allowance changed). Default: keep."""

    def generate_timed(self, prompts: list[list[int]], n_out: int) -> dict:
        """Greedy decode of a batch: {"prefill_s": float, "decode_s": [seconds per token]}."""
        raise NotImplementedError

    def generate(self, prompt_tokens: list[int], n: int) -> list[int]:
        """Greedy continuation: the `n` most likely next tokens (never stopping at an end token, so always `n`).

        Default: the growing sequence re-run through `window_logits` for each token, which needs nothing but
        logits and is fine for the few tokens a load check asks for; runtimes with a decoder override it."""

        from qbuild.contract.protocol import Window

        sequence = [int(t) for t in prompt_tokens]
        for _ in range(n):
            [logits] = list(self.window_logits([Window(sequence, 1)]))   # exhausted: a runtime may clean up after
            sequence.append(int(logits[-1].argmax()))
        return sequence[len(prompt_tokens):]

    def info(self) -> dict:
        return {}


@dataclass(frozen=True)
class EvalStepFields:
    """What a runtime adds to each of its evaluation steps (Runtime.plan_fields)."""

    extra_inputs: dict = field(default_factory=dict)      # role → Step: more stored inputs (the engine's tokenizer)
    runtime_args: dict = field(default_factory=dict)      # given to the runner, not hashed (an interpreter path)
    env_toolchain: dict = field(default_factory=dict)     # facts outside qbuild's Python that enter the key
    requires_gpu: bool = False
    unavailable: str = ""                                 # why this machine cannot run it ("" = it can)
    on_unavailable: OnUnavailable | None = None           # None: the step's default (fail)


class Runtime(Plugin, ABC):
    """Evaluates model artifacts (perplexity, KLD, throughput) of the formats whose declaration names it."""

    # formats it reads besides those whose declaration names it (qbuild.contract.formats `evaluated_by`): an out-of-tree
    # runtime that reads an existing format lists it here
    formats: ClassVar[tuple[str, ...]] = ()
    tools: ClassVar[tuple[str, ...]] = ()        # distributions whose versions enter evaluation keys
    max_batch_size: ClassVar[int | None] = None  # largest throughput batch it measures (None: any)
    preload: ClassVar[tuple[str, ...]] = ()      # modules a session imports: a standby worker imports them ahead
    # its logits are the same bit for bit at any thread count, so its perplexity steps may take idle cores mid-run.
    # llama.cpp on CPU: checked. torch on CPU: not (SmolLM2, 63-96-token windows differ by 2e-5 between 1 and 2
    # threads; 255-512 agree): a transformers step keeps its threads, so a rebuild gives the same bytes
    thread_invariant: ClassVar[bool] = False
    fallback: ClassVar[bool] = False             # evaluates a format only where no other installed runtime reads it
    # KV-cache element types a session can run with (evaluation.perplexity.kv_cache_dtype, a serving config's):
    # () where the runtime has no such setting, so a quantized KV cache's quality cost is not measured through it
    kv_cache_dtypes: ClassVar[tuple[str, ...]] = ()

    def memory(self, kind: str) -> str:
        """How a step of `kind` holds the model it evaluates (Step.memory, qbuild.pipeline.memory_fit): "whole-model",
        "layer-streamed", or "" where the runtime maps the file or runs elsewhere (not limited at plan time)."""
        return ""

    def plan_fields(self, label: str, artifact: Step, ctx: PlanningContext, measure: str) -> EvalStepFields:
        """What this runtime adds to an evaluation step of `artifact` (inputs, toolchain facts, availability)."""
        return EvalStepFields()

    def cannot_measure(self, label: str, artifact: Step, evaluation) -> dict[str, str]:
        """Measures ("perplexity", "kld", "throughput") it cannot take for this artifact → why; bad settings
        raise RecipeError."""
        if evaluation.throughput and self.max_batch_size is not None and \
                max(evaluation.throughput.batch_sizes) > self.max_batch_size:
            sizes = "batch size 1" if self.max_batch_size == 1 else f"batch sizes up to {self.max_batch_size}"
            raise RecipeError("evaluation.throughput.batch_sizes",
                              f"variant {label!r} is {artifact.format}, and the {self.name} runtime measures {sizes} "
                              f"only (got {evaluation.throughput.batch_sizes})")
        return {}

    @abstractmethod
    def open(self, model: Path, ctx: StepContext, n_ctx: int) -> RuntimeSession:
        """Load the artifact at `model` in the step's worker (heavy imports go here)."""


# --- inference servers ------------------------------------------------------------------------------------------
class Server(Plugin, ABC):
    """An inference server that serves artifacts the way they are deployed (OpenAI-compatible, streaming).

    It declares the engine name (as `qbuild.contract.formats.LOADS_IN` spells it: an artifact is served by the servers of
    the engines that load it), the distributions whose versions enter the serving keys (`tools`), whether it needs
    a GPU, and `launch()`: the command, readiness probe and stop of one server for one artifact and serving config
    (qbuild/serving/server.py starts it on 127.0.0.1, a free port, and always stops and reaps it). Settings of a
    serving config it cannot express are refused at plan time (`refusal`)."""

    engine: ClassVar[str]                    # LOADS_IN engine name: "llama.cpp", "vllm", "sglang", "trtllm-pytorch"
    tools: ClassVar[tuple[str, ...]] = ()
    needs_gpu: ClassVar[bool] = False

    def unavailable(self) -> str:
        """Why this machine cannot run the server ("" if it can): a missing package, binary or GPU."""
        missing = self.missing()
        return f"{self.name} needs {missing[0]!r} (pip install {self.extra or self.origin})" if missing else ""

    def environment(self) -> dict[str, str]:
        """Facts outside qbuild's Python that enter the key (a built binary's id, a GPU's SM)."""
        return {}

    def cannot_serve(self, fmt: str, scheme: str | None) -> str | None:
        """Why this server, as installed here, cannot serve an artifact its engine loads elsewhere (None: it can):
        vLLM's CPU build has no FP8 kernels, say."""
        return None

    def caveat(self, fmt: str, scheme: str | None) -> str | None:
        """What this server, as installed here, computes inexactly for an artifact it serves (None: nothing known),
        said with the plan: vLLM's CPU INT8 GEMM without VNNI, say."""
        return None

    @abstractmethod
    def refusal(self, config) -> str | None:
        """None if every setting of the serving config maps onto this server's flags, else the one-line reason."""

    @abstractmethod
    def args(self, config, *, threads: int, slots: int, context: int) -> list[str]:
        """The server's flags for a serving config (a qbuild.planning.recipe.ServingConfig at plan time; in a step's
        worker its view qbuild.serving.config.ServedConfig, read by attribute alike), without program, model and port:
        `slots` requests decoded at once, `context` tokens per request. They enter the serving step's key."""

    @abstractmethod
    def launch(self, model: Path, config, *, threads: int, slots: int, context: int, workdir: Path, log=print,
               draft: Path | None = None):
        """A qbuild.serving.server.ServerLaunch for `model` (the artifact's path) under `config`: the full command
        (an argument of its own, `{port}` = qbuild.serving.server.PORT, where the port goes), readiness probe and
        stop. `workdir`: where it may write files the command reads (they are stored with the results). `draft`: the
        path of config.draft's artifact (a server that maps drafts). Runs in the step's worker."""

    def speculative_stats(self, url: str, timeout_s: float) -> dict | None:
        """With a draft: what the server counted of it since it started ({draft_tokens, accepted,
        acceptance_rate}); None where the server does not tell."""
        return None

    def kv_bytes_per_token(self, model: Path, config, log_text: str) -> float | None:
        """KV-cache bytes per token of `model` under `config` (the model's shape × the cache's element size, or what
        the server's log says about its cache); None where it cannot tell."""
        return None


# --- registries ------------------------------------------------------------------------------------------------
# in-tree plugin packages: every module in them is imported when a registry is first used
PLUGIN_PACKAGES = ("qbuild.quantize", "qbuild.targets", "qbuild.runtimes")


methods: Registry[Method] = Registry("qbuild.methods", Method, "method", PLUGIN_PACKAGES, discriminator="method")
targets: Registry[Target] = Registry("qbuild.targets", Target, "target", PLUGIN_PACKAGES, discriminator="type")
runtimes: Registry[Runtime] = Registry("qbuild.runtimes", Runtime, "runtime", PLUGIN_PACKAGES)
servers: Registry[Server] = Registry("qbuild.servers", Server, "server", packages=("qbuild.servers",))


def load_all() -> None:
    """Import every plugin module (in-tree and entry points), once: what they declare (formats too) is known after."""
    for registry in (methods, targets, runtimes, servers):
        registry.names()



def open_session(runtime: str, model: Path, ctx: StepContext, n_ctx: int) -> RuntimeSession:
    """A session of the registered runtime `runtime` (recorded in the step's params) on `model`."""
    return runtimes.get(runtime).open(model, ctx, n_ctx)
