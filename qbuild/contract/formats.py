"""Artifact formats, declared once: what each one is, which runtimes evaluate it, which serving engines load it
and with what command.

The contract declares only the formats qbuild itself makes: the Hugging Face checkpoint (`Format.HF`, the
baseline) and the data artifacts every recipe has. Every other format is declared by the plugin that writes it, in
its own module (`register_format(FormatSpec(...))`, once, at import): a method's quantized layouts, a target's build
outputs. The declaration names the runtimes that read it (`evaluated_by`, in order of preference; runtimes_for asks
it), so a format transformers or llama.cpp can read is evaluated, summarised and reported like any other, with no
runtime of its own; a format nothing reads is shown as "not evaluated: no runtime for FORMAT". `load_commands`
gives the model card's command per engine.

Which engines load an artifact depends on its quantization, not only its format (an engine's kernels may take some
bit widths or scale layouts of a format and not others): a declaration says so itself, `loads_in` for every scheme
and `loads_in_by_scheme` for the schemes that differ. `LOADS_IN`, one row per (format, scheme), is built from the
declarations as they register; `loads_in(fmt, scheme)` asks it. Every model artifact's manifest records `loads_in`
from it when the artifact is built, and `qbuild show` prints it.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from enum import StrEnum
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from qbuild.contract.plugin import Runtime


class Format(StrEnum):
    """The formats qbuild itself makes (plugins' formats are declared in their own modules)."""

    HF = "hf"                                   # a plain Hugging Face checkpoint (the baseline)
    # data, not models: never evaluated or summarised as a variant
    CALIBRATION = "calibration"
    TOKENS = "tokens"
    METRICS = "metrics"
    LOGPROBS = "logprobs"                       # a baseline's reference log-probabilities (KLD)


@dataclass(frozen=True)
class FormatSpec:
    name: str
    description: str
    model: bool = True                 # a model artifact: evaluated and given a summary row
    # the engines (ENGINES' names, or a plugin's own) that load every artifact of it: its LOADS_IN row for any scheme
    loads_in: tuple[str, ...] = ()
    # where engines differ by scheme: (scheme, engines) rows, each its own LOADS_IN row (loads_in: the other schemes)
    loads_in_by_scheme: tuple[tuple[str, tuple[str, ...]], ...] = ()
    load_tools: tuple[str, ...] = ()   # distributions a runtime needs to read it: they enter evaluation keys
    eval_env: str | None = None        # backend environment (qbuild/envs/) its evaluation runs in; None: qbuild's
    evaluated_by: tuple[str, ...] = ()  # runtimes (qbuild.contract.plugin) that read it, preferred first
    # engine → how to load it, for the model card: `{dir}` the artifact's folder, `{file}` its model file. Engines not
    # named here use HF_LOAD_COMMANDS (a Hugging Face checkpoint folder)
    load_commands: tuple[tuple[str, str], ...] = ()


# --- which engines load an artifact ----------------------------------------------------------------------------
# Engine names as manifests record them, in the order `qbuild plugins` lists them. trtllm-pytorch: TensorRT-LLM's
# PyTorch backend (trtllm-serve, the path after 1.2.x); tensorrt-llm: its TensorRT engine runtime (1.2.x);
# trtllm-build: not an engine, the builder that reads a TensorRT-LLM checkpoint.
ENGINES = ("vllm", "sglang", "tgi", "lmdeploy", "transformers", "llama.cpp", "trtllm-pytorch", "tensorrt-llm",
           "exllamav2", "trtllm-build")
ANY = "*"   # the row for every scheme of a format that has no row of its own

# Every declared format by name, in declaration order: the contract's, then the plugins' as the registries import their
# modules (the order `qbuild plugins` lists them in).
FORMATS: dict[str, FormatSpec] = {}
# One row per (format, scheme), from the declarations: the engines that load *every* artifact the row covers. An
# engine that loads only some of them (a group size, a GPU generation) is left out, never guessed. Every model format
# has its ANY row (empty where no engine is known to read it).
LOADS_IN: dict[tuple[str, str], tuple[str, ...]] = {}


def register_format(spec: FormatSpec) -> FormatSpec:
    """Declare a format (a plugin module does, at import): its LOADS_IN rows come from the declaration."""
    known = FORMATS.get(spec.name)
    if known is not None and known != spec:
        raise ValueError(f"format {spec.name!r} is already declared differently")
    FORMATS[spec.name] = spec
    for scheme, engines in spec.loads_in_by_scheme:
        LOADS_IN.setdefault((spec.name, scheme), tuple(engines))
    if spec.model or spec.loads_in:
        LOADS_IN.setdefault((spec.name, ANY), tuple(spec.loads_in))
    return spec


_plugins_loaded = False


def _load_plugin_formats() -> None:
    """Plugins declare their formats in their modules: load the plugin modules once, through the registries
    (qbuild.contract.plugin, which never imports this module)."""
    global _plugins_loaded
    if not _plugins_loaded:
        _plugins_loaded = True
        from qbuild.contract.plugin import load_all

        load_all()


def spec(name: str) -> FormatSpec:
    """The declaration of a format; an undeclared one is a model format nothing is known about."""
    if name not in FORMATS:
        _load_plugin_formats()
    return FORMATS.get(name) or FormatSpec(name, "undeclared format")


def declared() -> dict[str, FormatSpec]:
    """Every declared format, the plugins' included (their modules are loaded first)."""
    _load_plugin_formats()
    return FORMATS


# How each engine loads a Hugging Face checkpoint folder; a format's own `load_commands` take precedence.
HF_LOAD_COMMANDS: dict[str, str] = {
    "vllm": "`vllm serve {dir}`",
    "sglang": "`python -m sglang.launch_server --model-path {dir}`",
    "tgi": "`text-generation-launcher --model-id {dir}`",
    "lmdeploy": "`lmdeploy serve api_server {dir}`",
    "transformers": "`AutoModelForCausalLM.from_pretrained('{dir}')`",
    "trtllm-pytorch": "`trtllm-serve {dir}` (PyTorch backend)",
}
# transformers and vLLM read every HF-folder format qbuild knows (vLLM: on a GPU, where transformers cannot); a
# plugin module that declares its own HF-folder format names them too
HF_RUNTIMES = ("transformers", "vllm")

for _spec in (
    FormatSpec(Format.HF, "Hugging Face checkpoint (safetensors + config.json)", evaluated_by=HF_RUNTIMES,
               loads_in=("vllm", "sglang", "tgi", "lmdeploy", "transformers", "trtllm-pytorch")),
    FormatSpec(Format.CALIBRATION, "tokenized calibration set", model=False),
    FormatSpec(Format.TOKENS, "tokenized evaluation text", model=False),
    FormatSpec(Format.METRICS, "evaluation results", model=False),
    FormatSpec(Format.LOGPROBS, "reference log-probabilities of the baseline on the evaluation tokens", model=False),
):
    register_format(_spec)


def load_command(fmt: str, engine: str, directory: str, file: str = "") -> str | None:
    """How `engine` loads an artifact of `fmt` in `directory` (model file `file`), for the model card; None where
    nothing is declared."""
    s = spec(fmt)
    template = dict(s.load_commands).get(engine) or HF_LOAD_COMMANDS.get(engine)
    if template is None:
        return None
    command = template.format(dir=directory, file=file)
    if engine == "transformers" and s.load_tools and "{file}" not in template:
        command += f" (needs the {s.load_tools[0]} package)"
    return command


def _row(fmt: str, scheme: str | None) -> tuple[str, ...]:
    spec(fmt)   # a format a plugin module declares: its row exists once the module is loaded
    return LOADS_IN.get((fmt, scheme or ANY), LOADS_IN.get((fmt, ANY), ()))


def loads_in(fmt: str, scheme: str | None = None, parts: Iterable[str] = ()) -> tuple[str, ...]:
    """The engines that load an artifact of `fmt` quantized as `scheme`. `parts`: the types its tensors really
    have (a quantized file's per-tensor types, mixes and fallbacks included); each narrows the answer to the engines that read
    it too."""
    engines = _row(fmt, scheme)
    for part in parts:
        engines = tuple(e for e in engines if e in _row(fmt, part))
    return engines


def engines_for_format(fmt: str) -> tuple[str, ...]:
    """Every engine that loads some artifact of `fmt` (for `qbuild plugins`), in ENGINES order."""
    spec(fmt)
    found = {e for (f, _), engines in LOADS_IN.items() if f == fmt for e in engines}
    return tuple([e for e in ENGINES if e in found] + sorted(found - set(ENGINES)))


def manifest_loads_in(fmt: str, scheme: str | None, info: dict | None) -> list[str] | None:
    """`loads_in` for an artifact's manifest: None for data (calibration sets, metrics ...), which no engine loads.
    `info["part_types"]`, where a runner records it, lists the types some tensors have besides the scheme's
    (per-tensor overrides)."""
    if not spec(fmt).model:
        return None
    return list(loads_in(fmt, scheme, (info or {}).get("part_types") or ()))


def runtimes_for(fmt: str) -> list[Runtime]:
    """Registered runtimes that evaluate `fmt`: those its declaration names (`evaluated_by`), then any runtime that
    names it in its own `formats`; installed ones first, fallbacks after the others (declaration order otherwise)."""
    from qbuild.contract.plugin import runtimes

    named = [runtimes.get(n) for n in spec(fmt).evaluated_by if n in runtimes]
    found = named + [r for r in runtimes.all() if fmt in r.formats and r not in named]
    return sorted(found, key=lambda r: (bool(r.missing()), r.fallback))
