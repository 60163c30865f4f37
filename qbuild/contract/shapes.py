"""Plan-time model checks from the model's config.json and safetensors headers (never imports torch).

Group quantization needs every quantized Linear's input dimension (weight columns) to be a
multiple of the group size; compressed-tensors refuses to save or run otherwise. We find out at
plan time, from the HF config alone, instead of after an hour of calibration.

A module pattern (`ignore:`, `targets:`) that matches nothing is silently ineffective in
llm-compressor, so it is an error here too: the module names come from the checkpoint's
safetensors headers (JSON, read without torch or the safetensors package) and, for llama-style
models, from config.json.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import os
import re
import struct
from collections.abc import Callable
from pathlib import Path

from qbuild.base.errors import RecipeError

# Linear layers of a decoder block, grouped by the config dimension that is their input size.
# Llama-style names (llama, mistral, qwen2/3, gemma, phi3 after unfusing, smollm ...).
_ATTN_IN = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")
_MLP_IN = ("mlp.gate_proj", "mlp.up_proj")


def _text_config(info: dict) -> dict:
    return info.get("text_config") or info


def linear_inputs(info: dict) -> list[tuple[str, int, list[str]]]:
    """[(config dim name, size, full module names)] of the Linear layers a weight scheme targets."""
    cfg = _text_config(info)
    hidden = cfg.get("hidden_size")
    if not hidden:
        return []
    layers = int(cfg.get("num_hidden_layers") or 0)
    heads = cfg.get("num_attention_heads")
    head_dim = cfg.get("head_dim") or (hidden // heads if heads else None)
    inter = cfg.get("intermediate_size")

    def names(leaves) -> list[str]:
        return [f"model.layers.{i}.{leaf}" for i in range(layers) for leaf in leaves]

    rows = [("hidden_size", int(hidden), names(_ATTN_IN + _MLP_IN) + ["lm_head"])]
    if heads and head_dim:
        rows.append(("num_attention_heads*head_dim", int(heads) * int(head_dim), names(("self_attn.o_proj",))))
    if inter:
        rows.append(("intermediate_size", int(inter), names(("mlp.down_proj",))))
    moe = cfg.get("moe_intermediate_size")
    if moe:
        rows.append(("moe_intermediate_size", int(moe), [f"model.layers.{i}.mlp.experts.*.down_proj" for i in range(layers)]))
    return rows


def is_ignored(name: str, ignore: list[str]) -> bool:
    """compressed-tensors' rule: an exact module name, or `re:<regex>` matched at the start."""
    for target in ignore:
        if target.startswith("re:"):
            if re.match(target[3:], name):
                return True
        elif target == name:
            return True
    return False


def working_group_sizes(dims: list[int], candidates=(32, 64, 128, 256)) -> list[int]:
    return [g for g in candidates if all(d % g == 0 or d < g for d in dims)]


def indivisible_layers(group_size: int | None, info: dict, ignore: list[str]) -> list[tuple[str, int, list[str]]]:
    """[(config dim name, size, modules)] of the quantized layers whose input dim the group size does not divide."""
    if not group_size or group_size <= 0:
        return []
    bad: list[tuple[str, int, list[str]]] = []
    for dim_name, size, modules in linear_inputs(info):
        if size < group_size or size % group_size == 0:  # compressed-tensors' own condition
            continue
        hit = [m for m in modules if not is_ignored(m, ignore)]
        if hit:
            bad.append((dim_name, size, hit))
    return bad


def _describe(group_size: int, bad: list[tuple[str, int, list[str]]]) -> str:
    return "; ".join(f"{dim}={size} (not a multiple of {group_size}) feeds {len(mods)} layer(s): "
                     + ", ".join(sorted({m.rsplit('.', 1)[-1] for m in mods})) for dim, size, mods in bad)


def check_group_size(group_size: int | None, info: dict, ignore: list[str], field: str,
                     on_indivisible: str = "error", method: str = "the method",
                     escapes: tuple[str, ...] = ("ignore", "on_indivisible")) -> tuple[list[str], str]:
    """Raise RecipeError naming the layers whose input dim the group size does not divide.

    With on_indivisible="ignore", return `re:` ignore rules that keep those layers unquantized instead
    (the caller records them in the step params, so they are part of the key and manifest) and the
    sentence that tells the user so; ([], "") when every layer divides. `escapes` names the fields the method
    has to route around it (`ignore`, `on_indivisible`, both or neither), so the hint offers only those.
    """
    bad = indivisible_layers(group_size, info, ignore)
    if not bad:
        return [], ""
    what = _describe(group_size, bad)
    if on_indivisible == "ignore":
        leaves = sorted({m.rsplit(".", 1)[-1] for _, _, mods in bad for m in mods})
        rules = [f"re:.*{re.escape(leaf)}$" for leaf in leaves]
        count = sum(len(mods) for _, _, mods in bad)
        return rules, (f"{field}.group_size: {group_size} does not divide {what}; on_indivisible: ignore keeps "
                       f"these {count} layers unquantized (ignore rules {', '.join(rules)})")
    all_dims = [size for _, size, _ in linear_inputs(info)]
    ok = working_group_sizes(all_dims)
    hint = f"use a group size that divides every layer ({', '.join(map(str, ok))})" if ok else \
        "no common group size ≤ 256 fits"
    example = sorted(m.rsplit(".", 1)[-1] for m in bad[0][2])[0]
    options = [hint]
    if "ignore" in escapes:
        options.append(f"add those layers to `ignore` (e.g. 're:.*{example}$')")
    if "on_indivisible" in escapes:
        options.append("set on_indivisible: ignore to keep them unquantized")
    raise RecipeError(
        f"{field}.group_size",
        f"group_size {group_size} does not divide {what}; {method} cannot quantize those layers in groups of "
        f"{group_size} (their rows are not a whole number of groups), so planning stops here: "
        + (", ".join(options[:-1]) + ", or " + options[-1] if len(options) > 1 else options[0]),
    )


# --- module names and the patterns that must match them ----------------------------------------------
_MOE_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_intermediate_size")


def config_linear_names(info: dict) -> list[str] | None:
    """Llama-style Linear module names from config.json; None where the config cannot tell (MoE experts)."""
    cfg = _text_config(info)
    if any(cfg.get(k) for k in _MOE_KEYS):
        return None  # expert modules are named per architecture; the config does not say how
    names = [m for _, _, mods in linear_inputs(info) for m in mods]
    return names or None


_HEADER_MEMO: dict[tuple, tuple[tuple[str, int], ...]] = {}   # one planning process reads a header once


_MAX_HEADER = 100 << 20   # the safetensors format's own limit on the header


def _header_weights(path: str, stamp: tuple) -> tuple[tuple[str, int], ...]:
    """(tensor name, rank) of every tensor in one safetensors file, from its header: 8 bytes of little-endian
    length, then that much JSON (the documented format). Read directly so that planning imports nothing."""
    key = (path, stamp)
    if key not in _HEADER_MEMO:
        with open(path, "rb") as f:
            (size,) = struct.unpack("<Q", f.read(8))
            if size > _MAX_HEADER:
                raise ValueError(f"{path}: a {size}-byte safetensors header")
            header = json.loads(f.read(size))
        _HEADER_MEMO[key] = tuple((k, len(v["shape"])) for k, v in header.items() if k != "__metadata__")
    return _HEADER_MEMO[key]


def checkpoint_weight_names(model_dir: Path) -> list[str] | None:
    """Names of the 2-D weights (`<module>.weight`: Linear layers and embeddings) in a checkpoint's safetensors;
    None when there is no readable safetensors file."""
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        return None
    names: list[str] = []
    try:
        for f in files:
            st = os.stat(f)
            names += [n for n, rank in _header_weights(str(f), (st.st_size, st.st_mtime_ns)) if rank == 2]
    except (OSError, ValueError, KeyError, TypeError, AttributeError, struct.error):   # not a safetensors file
        return None
    return sorted(n for n in names if n.endswith(".weight"))


def weight_modules(model_dir: Path | None, info: dict) -> list[str] | None:
    """Names of the modules a weight scheme can target: the checkpoint's 2-D weights (plus a tied `lm_head`,
    which owns no tensor of its own) and the llama-style Linear names from the config. None when neither is
    known (a MoE model whose checkpoint is made by an earlier step): the caller then skips its check."""
    found = set(config_linear_names(info) or ())
    weights = checkpoint_weight_names(model_dir) if model_dir is not None else None
    if weights is not None:
        found |= {n.removesuffix(".weight") for n in weights}
        archs = _text_config(info).get("architectures") or info.get("architectures") or []
        if "lm_head" not in found and any(a.endswith("ForCausalLM") for a in archs):
            found.add("lm_head")
    return sorted(found) or None


def matches_module(pattern: str, name: str) -> bool:
    """compressed-tensors' rule for one pattern: an exact module name, or `re:<regex>` matched at the start."""
    return is_ignored(name, [pattern])


def looks_like_class(pattern: str) -> bool:
    """compressed-tensors also matches module class names (`Linear`, `LlamaDecoderLayer`), which need torch to
    list: a CamelCase identifier is taken for one and not checked."""
    return pattern.isidentifier() and pattern[:1].isupper()


def closest_names(query: str, names: list[str], n: int = 3) -> list[str]:
    """The n names most like `query` (difflib), one per module kind: layer numbers vary, the module does not."""
    text = re.sub(r"^re:|[\^$\\()|?+*]|\.\*", "", query)
    kinds: dict[str, str] = {}
    for name in names:
        kinds.setdefault(re.sub(r"\d+", "N", name), name)
    ranked = sorted(kinds.values(), key=lambda s: -difflib.SequenceMatcher(None, text, s).ratio())
    return ranked[:n]


def check_patterns(patterns: list[str], names: list[str], field: str, what: str, match,
                   class_names: bool = False) -> None:
    """RecipeError `field[i]` for the first pattern that matches none of `names`, with the closest names.
    class_names: the patterns may also be class names (compressed-tensors), which are not checked."""
    for i, pattern in enumerate(patterns):
        if class_names and not pattern.startswith("re:") and looks_like_class(pattern):
            continue
        try:
            hit = any(match(pattern, n) for n in names)
        except re.error as exc:
            raise RecipeError(f"{field}[{i}]", f"{pattern!r} is not a valid regex: {exc}") from None
        if not hit:
            raise RecipeError(f"{field}[{i}]", f"{pattern!r} matches no {what}, so it would have no effect; "
                              f"closest names: {', '.join(closest_names(pattern, names))}")


def check_module_patterns(patterns: list[str], model_dir: Path | None, info: dict, field: str) -> None:
    """compressed-tensors patterns (exact names or `re:` regexes) must each match a module of the model."""
    names = weight_modules(model_dir, info)
    if names:
        check_patterns(patterns, names, field, "module of the model", matches_module, class_names=True)


# --- architecture families a method cannot build --------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class UnsupportedFamily:
    """Models of `model_type` (whose config meets `applies`) that a method cannot build, and why. A method declares
    its own (Method.unsupported_families): planning refuses them in one line instead of a step failing, or a wrong
    artifact being built, later."""

    model_type: str
    reason: str
    condition: str = ""                                   # `applies` in words, for the refusal and the docs
    applies: Callable[[dict], bool] = dataclasses.field(default=lambda cfg: True, compare=False)
    variant_condition: str = ""                           # `variant_applies` in words
    # on the variant's options (a recipe variant or its dict); None: every variant of the method
    variant_applies: Callable[[Callable[[str, object], object]], bool] = dataclasses.field(
        default=lambda option: True, compare=False)


def family_refusal(info: dict, method, variant=None) -> str | None:
    """Why `method` (a Method plugin: its `unsupported_families`), with the options of `variant` (a recipe variant or
    its dict), cannot build a model of this architecture and configuration, or None."""
    cfg = _text_config(info)
    model_type = cfg.get("model_type") or info.get("model_type")

    def option(name: str, default):
        if variant is None:
            return default
        return variant.get(name, default) if isinstance(variant, dict) else getattr(variant, name, default)

    for rule in method.unsupported_families:
        if rule.model_type == model_type and rule.applies(cfg) and rule.variant_applies(option):
            when = [f"its config's {rule.condition}" if rule.condition else "",
                    f"the variant's {rule.variant_condition}" if rule.variant_condition else ""]
            return ", ".join(w for w in when if w) + (": " if any(when) else "") + rule.reason
    return None


def check_family(info: dict, method, field: str, variant=None) -> None:
    """RecipeError `<field>.method` when `method` (a Method plugin) cannot build this model's architecture."""
    why = family_refusal(info, method, variant)
    if why:
        model_type = _text_config(info).get("model_type") or info.get("model_type")
        raise RecipeError(f"{field}.method", f"{method.name} cannot build this {model_type} model: {why}")
