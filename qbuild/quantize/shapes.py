"""Plan-time shape checks from the model's config.json (never imports torch).

Group quantization needs every quantized Linear's input dimension (weight columns) to be a
multiple of the group size; compressed-tensors refuses to save or run otherwise. We find out at
plan time, from the HF config alone, instead of after an hour of calibration.
"""

from __future__ import annotations

import re

from qbuild.errors import RecipeError

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


def check_group_size(group_size: int | None, info: dict, ignore: list[str], field: str,
                     on_indivisible: str = "error") -> list[str]:
    """Raise RecipeError naming the layers whose input dim the group size does not divide.

    With on_indivisible="ignore", return `re:` ignore rules that keep those layers unquantized
    instead (the caller records them in the step params, so they are part of the key and manifest).
    """
    if not group_size or group_size <= 0:
        return []
    bad: list[tuple[str, int, list[str]]] = []
    for dim_name, size, modules in linear_inputs(info):
        if size < group_size or size % group_size == 0:  # compressed-tensors' own condition
            continue
        hit = [m for m in modules if not is_ignored(m, ignore)]
        if hit:
            bad.append((dim_name, size, hit))
    if not bad:
        return []
    if on_indivisible == "ignore":
        leaves = sorted({m.rsplit(".", 1)[-1] for _, _, mods in bad for m in mods})
        return [f"re:.*{re.escape(leaf)}$" for leaf in leaves]
    all_dims = [size for _, size, _ in linear_inputs(info)]
    ok = working_group_sizes(all_dims)
    what = "; ".join(
        f"{dim}={size} (not a multiple of {group_size}) feeds {len(mods)} layer(s): "
        + ", ".join(sorted({m.rsplit('.', 1)[-1] for m in mods}))
        for dim, size, mods in bad)
    hint = f"group sizes that divide every layer: {', '.join(map(str, ok))}" if ok else "no common group size ≤ 256 fits"
    example = sorted(m.rsplit(".", 1)[-1] for m in bad[0][2])[0]
    raise RecipeError(
        f"{field}.group_size",
        f"group_size {group_size} does not divide {what}; {hint}; or add those layers to `ignore` "
        f"(e.g. 're:.*{example}$'), or set on_indivisible: ignore to keep them unquantized",
    )
