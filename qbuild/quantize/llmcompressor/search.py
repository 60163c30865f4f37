"""Mixed precision for compressed-tensors (`search:` on an `rtn` variant): per-layer W4A16 / W8A16 for vLLM.

The same search as the GGUF one (qbuild/quantize/gguf/search.py, docs/mixed-precision.md), every part an ordinary
keyed step:

1. `quantize[V~base]`: every targeted Linear at the base scheme (W8A16), and its KLD against the baseline's stored
   log-probs (the transformers runtime reads compressed-tensors).
2. Sensitivity: for each group (one vLLM-fused unit of every layer in a band: q/k/v together, o, gate/up together,
   down) × each other scheme, `quantize[V~G@S]` (only that group at S) and `perplexity[V~G@S]` (its KLD on
   `sensitivity_windows` windows). No budget in their params: a second budget reuses them.
3. `ct-search-allocate[V]`: the GGUF search's exact multiple-choice knapsack (`allocate`, `smallest_within`) over
   the measured bytes of the quantized weights and the measured KLD increments; `max_candidates` allocations.
4. Each candidate is one llm-compressor run with one config group per scheme (`quantize[V~cand<i>]`), measured on
   every evaluation window.
5. `quantize[V]` (kind ct-search-select): the best candidate that meets the budget, copied as the variant's
   artifact (a normal compressed-tensors checkpoint whose `config_groups` target `re:` module regexes, which vLLM
   loads directly) plus `search.json`; its manifest holds the search record.

Why fused units rather than q, k, v ... one by one: vLLM fuses q/k/v into `qkv_proj` and gate/up into
`gate_up_proj` and refuses a checkpoint whose shards of one fused layer have different schemes.

Bits are counted from the checkpoint itself: 8 × the bytes of every stored tensor of the quantized Linear layers
(packed weights, scales, zero points, shapes) / their number of weights. Ignored layers (lm_head), embeddings and
norms are not counted. Planning imports neither torch nor llm-compressor.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator, model_validator

from qbuild.plugins import RecipeError, Step, StepContext, StrictModel

SCHEME_BITS = {"W4A16": 4, "W8A16": 8}   # integer weight-only schemes vLLM's kernels serve (4 and 8 bits)
BASE_SCHEME = "W8A16"
ALLOCATION_FILE = "allocation.json"
SEARCH_FILE = "search.json"
# vLLM's fused units of a llama-style decoder layer: the shards of one must share a scheme
UNITS = {"attn_qkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
         "attn_o": ("self_attn.o_proj",),
         "mlp_gate_up": ("mlp.gate_proj", "mlp.up_proj"),
         "mlp_down": ("mlp.down_proj",)}


class CTSearch(StrictModel):
    """Reach an average-bits or KLD budget with per-layer W4A16 / W8A16 chosen from measured KL divergence."""

    max_bits: float | None = Field(None, gt=0, description="Average weight bits over the quantized Linear layers "
                                                           "(their stored bytes × 8 / weights, scales and zero points "
                                                           "included); objective min_kld.")
    max_kld: float | None = Field(None, gt=0, description="Mean KLD budget against the baseline; objective min_size.")
    objective: Literal["min_kld", "min_size"] | None = Field(
        None, description="min_kld under max_bits, min_size under max_kld (default: the budget's).")
    schemes: list[str] = Field(default_factory=lambda: ["W4A16", "W8A16"], validate_default=True,
                               description="Candidate schemes (" + ", ".join(SCHEME_BITS) + "), at the variant's "
                                           "group_size; the base is W8A16.")
    layer_bands: int = Field(1, ge=1, description="Split the layers into this many contiguous bands; each fused unit "
                                                  "(qkv, o, gate_up, down) in each band is one group.")
    sensitivity_windows: int | None = Field(
        2, ge=1, description="Evaluation windows per sensitivity measurement (null: all); finalists use all.")
    max_candidates: int = Field(3, ge=1, le=16, description="Allocations built and measured for real.")

    @field_validator("schemes")
    @classmethod
    def _schemes(cls, v):
        out = [s.upper() for s in v]
        bad = [s for s in out if s not in SCHEME_BITS]
        if bad or not out:
            raise ValueError(f"{', '.join(bad) or 'no scheme'}: the schemes are {', '.join(SCHEME_BITS)}")
        return sorted(set(out) | {BASE_SCHEME}, key=lambda s: -SCHEME_BITS[s])

    @model_validator(mode="before")
    @classmethod
    def _one_budget(cls, data):
        if not isinstance(data, dict):
            return data
        given = [k for k in ("max_bits", "max_kld") if data.get(k) is not None]
        if len(given) != 1:
            raise ValueError("give exactly one budget: max_bits or max_kld" + (f" (got {', '.join(given)})" if given else ""))
        implied = "min_size" if given[0] == "max_kld" else "min_kld"
        if data.get("objective") is None:
            data = {**data, "objective": implied}
        elif data["objective"] != implied:
            raise ValueError(f"objective {data['objective']} does not go with {given[0]}: use {implied}")
        return data

    def budget(self) -> dict:
        return {k: getattr(self, k) for k in ("max_bits", "max_kld") if getattr(self, k) is not None}

    def describe(self) -> str:
        (name, value), = self.budget().items()
        return f"search {name.removeprefix('max_')}≤{value:g} {self.objective}"


def module_groups(layers: int, bands: int) -> list[dict]:
    """The search's groups: each fused unit within each band of layers (1 ≤ bands ≤ layers: check_search), with the
    `re:` regex of its modules."""
    if not 1 <= bands <= layers:
        raise ValueError(f"{bands} bands of {layers} layers: a band needs at least one layer")
    groups = []
    for band in range(bands):
        idx = [i for i in range(layers) if i * bands // layers == band]
        for unit, leaves in UNITS.items():
            name = unit if bands == 1 else f"{unit}.b{idx[0]}-{idx[-1]}"
            parts = sorted({leaf.split(".")[0] for leaf in leaves})
            leaf_names = "|".join(leaf.split(".")[1] for leaf in leaves)
            regex = rf"re:^model\.layers\.({'|'.join(map(str, idx))})\.{parts[0]}\.({leaf_names})$"
            groups.append({"group": name, "target": regex,
                           "modules": [f"model.layers.{i}.{leaf}" for i in idx for leaf in leaves]})
    return groups


def assignment(groups: list[dict], choice: dict[str, str]) -> list[dict]:
    """One config group per scheme: the regexes of the groups at it (a group not in `choice` stays at the base)."""
    by: dict[str, list[str]] = {}
    for g in groups:
        by.setdefault(choice.get(g["group"], BASE_SCHEME), []).append(g["target"])
    return [{"scheme": s, "targets": by[s]} for s in sorted(by, key=lambda s: -SCHEME_BITS[s])]


# --- planning ----------------------------------------------------------------------------------------------------
def check_search(variant, ctx, field: str) -> None:
    """Plan-time refusals: no baseline log-probs to measure against, bits fixed by hand, a model whose Linear names
    are not llama-style, asymmetric weights (vLLM's 8-bit kernels take symmetric ones only)."""
    ev = ctx.recipe.evaluation
    if not (ev.kld and ev.perplexity):
        raise RecipeError(f"{field}.search", "a search measures KL divergence against the baseline: set "
                                             "evaluation.kld: true and evaluation.perplexity")
    if "bits" in variant.model_fields_set:
        raise RecipeError(f"{field}.bits", "search chooses each layer's bits: remove bits (or give search.schemes)")
    if not variant.sym:
        raise RecipeError(f"{field}.sym", "a search mixes W8A16, which vLLM serves symmetric only: set sym: true")
    from qbuild.plugins import config_linear_names

    names = set(config_linear_names(ctx.model_info()) or ())
    layers = _layers(ctx)
    if not names or not layers or not all(m in names for g in module_groups(layers, 1) for m in g["modules"]):
        raise RecipeError(f"{field}.search", "the search needs a llama-style model (model.layers.N.self_attn.q_proj "
                                             "... mlp.down_proj); this model's config does not name those layers")
    if variant.search.layer_bands > layers:   # a band needs at least one layer
        raise RecipeError(f"{field}.search.layer_bands", f"{variant.search.layer_bands} bands of a model with {layers} "
                                                         f"layers: give 1 to {layers}")


def _layers(ctx) -> int:
    info = ctx.model_info()
    return int((info.get("text_config") or info).get("num_hidden_layers") or 0)


def plan_search(variant, ctx, quantize_step) -> Step:
    """The search's steps (module docstring); returns the step whose output is the variant's artifact.
    `quantize_step(name, params, extra_inputs)` makes an llm-compressor quantize step of this variant."""
    from qbuild.plugin_services import kld_step

    search, label = variant.search, variant.name
    groups = module_groups(_layers(ctx), search.layer_bands)
    common = {"method": "rtn", "group_size": variant.group_size, "sym": variant.sym, "ignore": list(variant.ignore)}
    base = quantize_step(f"quantize[{label}~base]", {**common, "assign": assignment(groups, {})}, {})
    alloc_inputs = {"base": base, "base_kld": kld_step(ctx, f"{label}~base", base, search.sensitivity_windows)}
    others = [s for s in search.schemes if s != BASE_SCHEME]
    if not others:
        raise RecipeError(f"variants[{ctx.recipe.variants.index(variant)}].search.schemes",
                          f"give at least one scheme besides the base {BASE_SCHEME}")
    for g in groups:
        for s in others:
            tag = f"{g['group']}@{s}"
            q = quantize_step(f"quantize[{label}~{tag}]", {**common, "assign": assignment(groups, {g["group"]: s})}, {})
            alloc_inputs[f"q:{tag}"] = q
            alloc_inputs[f"m:{tag}"] = kld_step(ctx, f"{label}~{tag}", q, search.sensitivity_windows)
    table = [{"group": g["group"], "target": g["target"], "schemes": others} for g in groups]
    allocation = ctx.add(Step("ct-search-allocate", f"ct-search-allocate[{label}]",
                              {"budget": search.budget(), "objective": search.objective, "groups": table,
                               "base_scheme": BASE_SCHEME, "candidates": search.max_candidates},
                              "qbuild.quantize.llmcompressor.search:run_allocate", inputs=alloc_inputs, tools=("numpy",),
                              threads=1, format="metrics"))
    select_inputs = {"allocation": allocation}
    for i in range(search.max_candidates):
        q = quantize_step(f"quantize[{label}~cand{i}]", {**common, "candidate": i}, {"allocation": allocation})
        select_inputs[f"q:{i}"] = q
        select_inputs[f"m:{i}"] = kld_step(ctx, f"{label}~cand{i}", q, None)
    from qbuild.quantize.llmcompressor.options import COMPRESSED_TENSORS

    return ctx.add(Step("ct-search-select", f"quantize[{label}]", {"budget": search.budget(),
                                                                   "objective": search.objective},
                        "qbuild.quantize.llmcompressor.search:run_select", inputs=select_inputs, threads=1,
                        variant=label, format=COMPRESSED_TENSORS, scheme=BASE_SCHEME.lower()))


# --- runners -----------------------------------------------------------------------------------------------------
def quantized_weight_stats(directory: Path) -> dict:
    """Bytes and weight count of the quantized Linear layers of a compressed-tensors checkpoint (those with a
    `weight_scale`): every tensor `<module>.weight` / `<module>.weight_*` counts; weights from `weight_shape`."""
    import numpy as np
    from safetensors import safe_open

    nbytes = weights = 0
    for f in sorted(Path(directory).glob("*.safetensors")):
        with safe_open(str(f), framework="np") as st:
            names = list(st.keys())
            modules = {n.removesuffix(".weight_scale") for n in names if n.endswith(".weight_scale")}
            header = _header(f)
            for m in modules:
                own = [n for n in names if n == f"{m}.weight" or n.startswith(f"{m}.weight_")]
                nbytes += sum(header[n]["data_offsets"][1] - header[n]["data_offsets"][0] for n in own)
                if f"{m}.weight_shape" in names:
                    weights += int(np.prod(st.get_tensor(f"{m}.weight_shape")))
                else:
                    weights += int(np.prod(header[f"{m}.weight"]["shape"]))
    return {"quantized_weight_bytes": nbytes, "quantized_weights": weights,
            "weight_bits": round(nbytes * 8 / weights, 6) if weights else None}


def _header(path: Path) -> dict:
    import struct

    with open(path, "rb") as f:
        (size,) = struct.unpack("<Q", f.read(8))
        return json.loads(f.read(size))


def _metrics(ctx: StepContext, role: str) -> dict:
    return ctx.input_manifests.get(role, {}).get("metrics", {})


def run_allocate(ctx: StepContext) -> dict:
    """Measured bytes and KLDs → allocations under the budget (additive model), as candidates to build."""
    p = ctx.params
    base = _metrics(ctx, "base")
    base_bytes, weights = int(base["quantized_weight_bytes"]), int(base["quantized_weights"])
    base_kld = float(_metrics(ctx, "base_kld")["kld"])
    options, measured = [], []
    for row in p["groups"]:
        opts = [(0, 0.0, p["base_scheme"])]
        for s in row["schemes"]:
            tag = f"{row['group']}@{s}"
            nbytes, kld = int(_metrics(ctx, f"q:{tag}")["quantized_weight_bytes"]), float(_metrics(ctx, f"m:{tag}")["kld"])
            opts.append((nbytes - base_bytes, kld - base_kld, s))
            measured.append({"group": row["group"], "scheme": s, "weight_bits": nbytes * 8 / weights, "kld": kld})
        options.append(opts)
    pairs = [[(c, v) for c, v, _ in opts] for opts in options]
    limit = int(p["budget"]["max_bits"] * weights / 8) if "max_bits" in p["budget"] else None
    choices = distinct_choices(pairs, p["candidates"], None if limit is None else limit - base_bytes,
                               None if limit is not None else p["budget"]["max_kld"] - base_kld)
    if not choices:
        (name, value), = p["budget"].items()
        least = (base_bytes + sum(min(c for c, _ in o) for o in pairs)) * 8 / weights
        raise RuntimeError(f"no allocation meets {name} {value}: the smallest mix of these schemes averages "
                           f"{least:.3f} bits, the base model's KLD is {base_kld:.5f}")
    candidates = []
    for choice in choices:
        picked = {row["group"]: options[g][i][2] for g, (row, i) in enumerate(zip(p["groups"], choice, strict=True))}
        cost = sum(pairs[g][i][0] for g, i in enumerate(choice))
        dkld = sum(pairs[g][i][1] for g, i in enumerate(choice))
        candidates.append({"groups": picked, "predicted_weight_bits": (base_bytes + cost) * 8 / weights,
                           "predicted_kld": base_kld + dkld})
    while len(candidates) < p["candidates"]:   # fewer distinct allocations than slots: repeat the best
        candidates.append(candidates[0])
    record = {"base": {"scheme": p["base_scheme"], "weight_bits": base_bytes * 8 / weights, "kld": base_kld},
              "quantized_weights": weights, "budget": p["budget"], "objective": p["objective"],
              "groups": [{"group": r["group"], "target": r["target"]} for r in p["groups"]],
              "method": "multiple-choice knapsack, exact DP over bytes, additive KLD increments",
              "sensitivity": measured, "candidates": candidates}
    (ctx.out / ALLOCATION_FILE).write_text(json.dumps(record, indent=2))
    return {"format": "metrics", "metrics": {"candidates": len(choices), "measurements": len(measured)}}


def distinct_choices(pairs: list[list[tuple[int, float]]], n: int, max_cost: int | None, max_value: float | None,
                     cost_step: float = 0.01, value_step: float = 0.1) -> list[list[int]]:
    """Up to `n` distinct knapsack optima (qbuild.plugins' exact DP, as in the GGUF search): under the budget, then under budgets
    `cost_step` (`value_step` for a KLD budget) tighter each time, because real sizes and KLDs are not exactly additive. The
    GGUF search's run_allocate does the same inline (0.4 % steps); this is the generic form."""
    from qbuild.plugins import allocate, smallest_within  # the exact knapsack the GGUF search allocates with too

    span = sum(max(c for c, _ in o) - min(c for c, _ in o) for o in pairs)
    unit = max(1, span // 4000)   # a few thousand columns: exact to well under 0.1 % of the range
    choices: list[list[int]] = []
    for i in range(n * 8):
        if max_cost is not None:
            choice = allocate(pairs, int(max_cost - abs(max_cost) * cost_step * i), unit)
        else:
            choice = smallest_within(pairs, max_value * (1 - value_step * i) if max_value > 0 else max_value, unit)
        if choice is not None and choice not in choices:
            choices.append(choice)
        if len(choices) == n:
            break
    return choices


def candidate_assignment(allocation_dir: Path, index: int) -> list[dict]:
    record = json.loads((Path(allocation_dir) / ALLOCATION_FILE).read_text())
    return assignment(record["groups"], record["candidates"][index]["groups"])


def run_select(ctx: StepContext) -> dict:
    """The best measured candidate that meets the budget becomes the artifact: its checkpoint's files and
    search.json (the record, travelling with the checkpoint)."""
    from qbuild.plugins import dir_size
    from qbuild.quantize.llmcompressor.options import COMPRESSED_TENSORS

    p = ctx.params
    alloc = json.loads((Path(ctx.inputs["allocation"]) / ALLOCATION_FILE).read_text())
    rows = []
    for i, cand in enumerate(alloc["candidates"]):
        m, q = _metrics(ctx, f"m:{i}"), _metrics(ctx, f"q:{i}")
        bits = float(q["weight_bits"])
        ok = bits <= p["budget"]["max_bits"] if "max_bits" in p["budget"] else m["kld"] <= p["budget"]["max_kld"]
        rows.append({"candidate": i, "weight_bits": bits, "size_bytes": q.get("size_bytes"), "kld": m["kld"],
                     "top1": m.get("top1"), "ppl": m.get("ppl"), "meets_budget": ok, **cand})
    fits = [r for r in rows if r["meets_budget"]]
    if not fits:
        (name, value), = p["budget"].items()
        raise RuntimeError(f"no candidate met {name} {value}: measured " + ", ".join(
            f"{r['weight_bits']:.3f} bits / KLD {r['kld']:.5f}" for r in rows))
    order = (lambda r: (r["kld"], r["weight_bits"])) if p["objective"] == "min_kld" else \
        (lambda r: (r["weight_bits"], r["kld"]))
    best = min(fits, key=order)
    src = Path(ctx.inputs[f"q:{best['candidate']}"])
    for f in ctx.input_manifests[f"q:{best['candidate']}"]["files"]:
        dest = ctx.out / f["path"]
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(src / f["path"], dest)
    qc = json.loads((ctx.out / "config.json").read_text()).get("quantization_config", {})
    assign = assignment(alloc["groups"], best["groups"])
    short = {"budget": p["budget"], "objective": p["objective"], "groups": best["groups"], "assign": assign,
             "weight_bits": best["weight_bits"], "kld": best["kld"]}
    (ctx.out / SEARCH_FILE).write_text(json.dumps(short, indent=2))
    record = {**short, "chosen": best["candidate"], "candidates": rows, "base": alloc["base"],
              "sensitivity": alloc["sensitivity"], "method": alloc["method"]}
    schemes = sorted({a["scheme"].lower() for a in assign})
    return {"format": COMPRESSED_TENSORS,
            "metrics": {"size_bytes": dir_size(ctx.out), "weight_bits": round(best["weight_bits"], 4),
                        "search_kld": best["kld"]},
            "info": {"checkpoint_format": "compressed-tensors", "quant_format": qc.get("format"),
                     "config_groups": {name: {"num_bits": g["weights"]["num_bits"], "targets": g["targets"]}
                                       for name, g in qc.get("config_groups", {}).items()}, "part_types": schemes, "search": record}}
