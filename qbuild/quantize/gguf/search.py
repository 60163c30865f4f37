"""Per-tensor mixed precision for a `gguf` variant, searched by measured KL divergence (`search:`).

A `gguf` variant with `search: {max_size_mb | max_bpw | max_kld, ...}` and no `type` is planned as ordinary steps, all
keyed, cached and spread by the executor like any other (docs/mixed-precision.md). Every file the search measures is
a probe (qbuild.quantize.gguf.probe, step kind gguf-probe): quantized in its step's scratch, measured there against
the baseline's stored log-probs, removed; only its measurement (KLD, PPL, size, bpw, sha256) is stored.

1. `probe[V~base]`: the whole model at `base_type` (Q8_0), its size and KLD.
2. Sensitivity: for each tensor group (one tensor kind, attn_q .. ffn_down, token_embd, output, within one band of
   layers) × each candidate type, `probe[V~G@T]`: only that group at T, the rest at the base type (llama.cpp's
   per-tensor overrides), its size and its KLD on `sensitivity_windows` windows. These params name no budget: a
   second budget on the same model reuses every one of them.
3. `gguf-search-allocate[V]`: assumes the groups' KLD increments add up and solves the budgeted choice exactly
   (a multiple-choice knapsack by dynamic programming over bytes, sizes measured by the probes); it writes
   `max_candidates` allocations (the optimum under the budget and under slightly tighter ones, since real sizes and
   KLDs are not exactly additive).
4. Each candidate is probed (`probe[V~cand<i>]`) on the full evaluation windows.
5. `quantize[V]` (kind gguf-search-select): the best candidate that meets the budget is quantized again (the same
   bytes as its probe's, checked by sha256) and becomes the variant's artifact (its manifest holds the chosen tensor
   types, the budget, size, bpw, KLD and the whole search record). It is the only .gguf the search stores.

Nothing here imports llama.cpp at plan time; the runners import numpy and gguf only (the probes and the selection
quantize through qbuild.quantize.gguf.run).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

from qbuild.plugins import RecipeError, Step, StepContext, allocate, smallest_within
from qbuild.quantize.gguf.probe import gguf_weights
from qbuild.quantize.gguf.search_options import ALLOCATION_FILE, BPW, DEFAULT_TYPES, NEEDS_IMATRIX, GGUFSearch

OUTPUT_FILE = "model.gguf"   # qbuild.quantize.gguf.options' file name (a quantize step's one file)
SEARCH_FILE = "search.json"   # the artifact's own short record (budget, chosen types, command) beside the .gguf
RECORD_RESERVE = 8192         # bytes of the budget kept for search.json, so the whole artifact meets it
MB = 1_000_000               # max_size_mb is in decimal megabytes, as file sizes are usually quoted
# a probe's file against the F16 GGUF it is quantized from: the base type (Q8_0: 8.5 of 16 bits per weight) with
# one group at another type; measured 1.14 GB from 2.15 GB (0.53) on the 1B model. The executor holds this much
# disk for each running probe, so probes that each fit do not fill the disk together
PROBE_SCRATCH = 0.6
# a search's scratch files at once stay within this many times the artifact it ends with (issue 33's bound)
SEARCH_DISK_BOUND = 3

@dataclass(frozen=True)
class Group:
    """Tensors whose type is chosen together: one tensor kind within one band of layers."""

    name: str          # e.g. ffn_down, ffn_down.b0-9, token_embd
    pattern: str       # regex llama.cpp's --tensor-type matches (searched) against tensor names
    tensors: tuple[str, ...]
    columns: tuple[int, ...]


def tensor_groups(names: list[str], cols: dict[str, int], layers: int, bands: int) -> list[Group]:
    """The search's groups over the model's quantizable weights `names` (GGUF names)."""
    by: dict[tuple[str, int], list[str]] = {}
    for n in names:
        m = re.match(r"blk\.(\d+)\.(.+)\.weight$", n)
        if m:
            layer, kind = int(m.group(1)), m.group(2)
            band = layer * bands // max(layers, 1)
        else:
            kind, band = n.removesuffix(".weight"), -1
        by.setdefault((kind, band), []).append(n)
    groups = []
    for (kind, band), tensors in sorted(by.items()):
        tensors = sorted(tensors, key=lambda s: [int(x) if x.isdigit() else x for x in re.split(r"(\d+)", s)])
        if band < 0:
            name, pattern = kind, rf"^{re.escape(kind)}\.weight$"
        else:
            idx = sorted({int(t.split(".")[1]) for t in tensors})
            name = kind if bands == 1 else f"{kind}.b{idx[0]}-{idx[-1]}"
            pattern = rf"^blk\.({'|'.join(map(str, idx))})\.{re.escape(kind)}\.weight$"
        groups.append(Group(name, pattern, tuple(tensors), tuple(cols.get(t, 0) for t in tensors)))
    return groups


def group_types(group: Group, search: GGUFSearch, imatrix: bool, block_size) -> list[str]:
    """The candidate types of a group: those asked for (or the defaults) whose blocks fit every row of the group."""
    wanted = search.types or [t for t in DEFAULT_TYPES if imatrix or t not in NEEDS_IMATRIX]
    return [t for t in wanted if t != search.base_type and all(c and c % block_size(t) == 0 for c in group.columns)]


def _total(options, choice) -> tuple[int, float]:
    return (sum(options[g][i][0] for g, i in enumerate(choice)), sum(options[g][i][1] for g, i in enumerate(choice)))


# --- planning ----------------------------------------------------------------------------------------------------
def check_search(variant, ctx, field: str) -> None:
    """A search needs the baseline's log-probs (evaluation.kld, or a llama-perplexity kld_base file) to measure
    against."""
    ev = ctx.recipe.evaluation
    if not (ev.kld and ev.perplexity):
        raise RecipeError(f"{field}.search", "a search measures KL divergence against the baseline: set "
                                             "evaluation.kld: true and evaluation.perplexity")


def plan_search(variant, ctx, inputs: dict[str, Step], tools: tuple[str, ...], block_size, names, cols) -> Step:
    """The search's steps (module docstring); returns the step whose output is the variant's artifact. `inputs`: the
    variant's quantize inputs (the converted GGUF, the importance matrix), `tools` its quantize steps' tools."""
    from qbuild.plugin_services import probe_step

    search = variant.search
    imatrix = "imatrix" in inputs
    info = ctx.model_info()
    cfg = info.get("text_config") or info
    groups = tensor_groups(names, cols, int(cfg.get("num_hidden_layers") or 0), search.layer_bands)
    common = {"method": "gguf", "type": search.base_type, "convert_type": variant.convert_type, "imatrix": imatrix}
    if not imatrix:
        common.pop("imatrix")
    label = variant.name
    weights = estimated_weights(info)
    at_once = (f"gguf-search[{label}]", probes_at_once(search, weights))

    def probe(tag: str, build: dict, extra: dict, windows: int | None) -> Step:
        return probe_step(ctx, "gguf-probe", f"probe[{label}~{tag}]", f"{label}~{tag}", inputs["gguf"], build,
                          {**inputs, **extra}, windows, tools, runner="qbuild.quantize.gguf.probe:run_probe",
                          scratch=PROBE_SCRATCH, at_once=at_once)

    alloc_inputs = {"base": probe("base", dict(common), {}, search.sensitivity_windows)}
    sensitivity_reference = alloc_inputs["base"].inputs["reference"]   # its own over the first windows (or shared)
    table = []
    for g in groups:
        types = group_types(g, search, imatrix, block_size)
        table.append({"group": g.name, "pattern": g.pattern, "tensors": list(g.tensors), "types": types})
        for t in types:
            tag = f"{g.name}@{t}"
            alloc_inputs[f"p:{tag}"] = probe(tag, {**common, "tensor_types": [{"pattern": g.pattern, "type": t}]}, {},
                                             search.sensitivity_windows)
    if not any(row["types"] for row in table):
        raise RecipeError(f"variants[{ctx.recipe.variants.index(variant)}].search.types",
                          "no candidate type fits any tensor group's rows")
    allocation = ctx.add(Step("gguf-search-allocate", f"gguf-search-allocate[{label}]",
                              {"budget": search.budget(), "objective": search.objective, "groups": table,
                               "base_type": search.base_type, "candidates": search.max_candidates},
                              "qbuild.quantize.gguf.search:run_allocate", inputs={**alloc_inputs, "gguf": inputs["gguf"]},
                              tools=("gguf", "numpy"), threads=1, format="metrics",
                              runtime_args={"variant": label}))   # for its messages; not hashed
    select_inputs = {"allocation": allocation, **inputs}
    for i in range(search.max_candidates):
        select_inputs[f"m:{i}"] = probe(f"cand{i}", {**common, "candidate": i}, {"allocation": allocation}, None)
    select = ctx.add(Step("gguf-search-select", f"quantize[{label}]", {"budget": search.budget(), "imatrix": imatrix,
                                                                        "objective": search.objective,
                                                                        "quantize": common},
                          "qbuild.quantize.gguf.search:run_select", inputs=select_inputs, tools=tools,
                          threads=ctx.threads, runtime_args={"variant": label}, impl_version=3,
                          # 2: search.json beside the .gguf; 3: the chosen probe's file built again here
                          variant=label, format="gguf", scheme=search.base_type))
    if search.max_minutes is not None:
        steps = [*alloc_inputs.values(), allocation, *select_inputs.values(), select]
        steps = [s for s in steps if s.key not in {v.key for v in inputs.values()}]
        if "~" in sensitivity_reference.name:
            steps.append(sensitivity_reference)   # reference[baseline~Nw]: made for the search alone
        index = ctx.recipe.variants.index(variant)
        ctx.limit_time(f"variants[{index}].search.max_minutes", search.max_minutes, f"the search for {label}", steps,
                       {s.key: guessed_seconds(s, weights) for s in steps},
                       "lower types, layer_bands, max_candidates or sensitivity_windows")
    return select


# what a search step takes on one core of this project's 2-core machine, per weight of the model (the demo's
# SmolLM2-135M under load 5-10, docs/mixed-precision.md): a guess for a store with no history of such steps
SECONDS_PER_WEIGHT = {"sensitivity-quantize": 3.3e-8, "candidate-quantize": 2.2e-7}
SECONDS_PER_WEIGHT_TOKEN = 1.4e-10     # a perplexity pass: ~10 s per 512-token window at 135M weights
WINDOWS_IF_ALL = 16                    # max_windows null: the text's windows, unknown at plan time


def probes_at_once(search, weights: int) -> int:
    """How many of a search's probes may run at once: each quantizes a whole model, about the base type's size
    (one group at another type), into its scratch, and together they stay within SEARCH_DISK_BOUND × the artifact
    the search ends with, which is about the budget's size (a KLD budget's is unknown: taken as its smallest
    candidate type's). Never fewer than one: a probe alone is about base/target × the artifact."""
    if search.max_bpw is not None:
        target = search.max_bpw
    elif search.max_size_mb is not None and weights:
        target = search.max_size_mb * MB * 8 / weights
    else:
        target = min(BPW.get(t, BPW[search.base_type]) for t in (search.types or DEFAULT_TYPES))
    return max(1, int(SEARCH_DISK_BOUND * target / BPW[search.base_type]))


def estimated_weights(info: dict) -> int:
    """The weights of a llama-style model from its config (no checkpoint read): embeddings, attention, MLP."""
    cfg = info.get("text_config") or info
    hidden, layers = int(cfg.get("hidden_size") or 0), int(cfg.get("num_hidden_layers") or 0)
    heads = int(cfg.get("num_attention_heads") or 1)
    head_dim = int(cfg.get("head_dim") or hidden // heads)
    kv = int(cfg.get("num_key_value_heads") or heads) * head_dim
    tied = cfg.get("tie_word_embeddings", info.get("tie_word_embeddings", True))
    vocab = int(cfg.get("vocab_size") or 0) * hidden * (1 if tied else 2)
    per_layer = 2 * hidden * heads * head_dim + 2 * hidden * kv + 3 * hidden * int(cfg.get("intermediate_size") or 0)
    return vocab + layers * per_layer


def guessed_seconds(step: Step, weights: int) -> float:
    """A search step's time from the model's size alone (SECONDS_PER_WEIGHT*): used where the store has no history."""
    if step.kind == "gguf-probe":   # a quantization and an evaluation pass in one step
        kind = "candidate-quantize" if "allocation" in step.inputs else "sensitivity-quantize"
        return SECONDS_PER_WEIGHT[kind] * weights + _pass_seconds(step.params["measure"], weights)
    if step.kind in ("perplexity", "reference"):
        return _pass_seconds(step.params, weights)
    if step.kind == "gguf-search-select":   # the chosen candidate quantized again
        return SECONDS_PER_WEIGHT["candidate-quantize"] * weights
    return 5.0   # allocation: reading manifests and a small DP


def _pass_seconds(params, weights: int) -> float:
    windows = params.get("max_windows") or WINDOWS_IF_ALL
    return SECONDS_PER_WEIGHT_TOKEN * weights * windows * int(params.get("context_length") or 512)


# --- runners -----------------------------------------------------------------------------------------------------
def input_metrics(ctx: StepContext, role: str) -> dict:
    return ctx.input_manifests.get(role, {}).get("metrics", {})


def probed_size(ctx: StepContext, role: str) -> int:
    """The size of the .gguf a probe measured (it is not stored: its manifest says)."""
    return int(input_metrics(ctx, role)["gguf_bytes"])


def size_budget(budget: dict, weights: int) -> int | None:
    if "max_size_mb" in budget:
        return int(budget["max_size_mb"] * MB) - RECORD_RESERVE
    if "max_bpw" in budget:
        return int(budget["max_bpw"] * weights / 8) - RECORD_RESERVE
    return None


def run_allocate(ctx: StepContext) -> dict:
    """Measured sizes and KLDs → allocations under the budget (additive model), as candidates to build."""
    p = ctx.params
    base_size, base_kld = probed_size(ctx, "base"), float(input_metrics(ctx, "base")["kld"])
    weights = gguf_weights(Path(ctx.inputs["gguf"]) / OUTPUT_FILE)
    options, measured = [], []
    for row in p["groups"]:
        opts = [(0, 0.0, p["base_type"])]
        for t in row["types"]:
            tag = f"{row['group']}@{t}"
            size, kld = probed_size(ctx, f"p:{tag}"), float(input_metrics(ctx, f"p:{tag}")["kld"])
            opts.append((size - base_size, kld - base_kld, t))
            measured.append({"group": row["group"], "type": t, "size_bytes": size, "kld": kld})
        options.append(opts)
    pairs = [[(c, v) for c, v, _ in opts] for opts in options]
    span = sum(max(c for c, _ in o) - min(c for c, _ in o) for o in pairs)
    unit = max(1, span // 4000)   # a few thousand columns: exact to well under 0.1 % of the range
    limit = size_budget(p["budget"], weights)
    choices = []
    for i in range(p["candidates"] * 4):   # tighter budgets until enough distinct allocations
        if limit is not None:
            choice = allocate(pairs, int(limit * (1 - 0.004 * i)) - base_size, unit)
        else:
            choice = smallest_within(pairs, p["budget"]["max_kld"] * (1 - 0.1 * i) - base_kld, unit)
        if choice is not None and choice not in choices:
            choices.append(choice)
        if len(choices) == p["candidates"]:
            break
    if not choices:
        raise RuntimeError(unreachable_budget(ctx.runtime_args.get("variant", "?"), p["budget"], pairs, base_size,
                                              base_kld, weights))
    candidates = []
    for choice in choices:
        size, dkld = _total(pairs, choice)
        types = [{"pattern": row["pattern"], "type": options[g][i][2], "group": row["group"]}
                 for g, (row, i) in enumerate(zip(p["groups"], choice, strict=True)) if i]
        candidates.append({"tensor_types": [{"pattern": t["pattern"], "type": t["type"]} for t in types],
                           "groups": {t["group"]: t["type"] for t in types},
                           "predicted_size_bytes": base_size + size, "predicted_kld": base_kld + dkld})
    while len(candidates) < p["candidates"]:   # fewer distinct allocations than slots: repeat the best
        candidates.append(candidates[0])
    record = {"base": {"type": p["base_type"], "size_bytes": base_size, "kld": base_kld}, "weights": weights,
              "budget": p["budget"], "objective": p["objective"], "size_limit_bytes": limit, "unit_bytes": unit,
              "method": "multiple-choice knapsack, exact DP over bytes, additive KLD increments",
              "sensitivity": measured, "candidates": candidates}
    (ctx.out / ALLOCATION_FILE).write_text(json.dumps(record, indent=2))
    return {"format": "metrics", "metrics": {"candidates": len(choices), "measurements": len(measured)}}


def run_select(ctx: StepContext) -> dict:
    """The best measured candidate that meets the budget becomes the artifact: its .gguf, quantized again here from the
    same inputs as its probe (which measured it and did not keep it), and a short search.json (it travels with the
    file on `qbuild pull`). A size budget counts both files. The .gguf must be the probe's byte for byte (llama.cpp's
    quantization is deterministic); a different sha256 fails the step, since the measurements would not be this
    file's."""
    p = ctx.params
    alloc = json.loads((Path(ctx.inputs["allocation"]) / ALLOCATION_FILE).read_text())
    weights, base_type = alloc["weights"], alloc["base"]["type"]
    limit = size_budget(p["budget"], weights)
    budget_bytes = None if limit is None else limit + RECORD_RESERVE
    rows, shorts = [], []
    for i, cand in enumerate(alloc["candidates"]):
        m = input_metrics(ctx, f"m:{i}")
        size = probed_size(ctx, f"m:{i}")
        short = {"budget": p["budget"], "objective": p["objective"], "base_type": base_type,
                 "tensor_types": cand["tensor_types"], "gguf_bytes": size, "bpw": size * 8 / weights, "kld": m["kld"],
                 "command": llama_quantize_command(base_type, cand["tensor_types"], p.get("imatrix", False))}
        text = json.dumps(short, indent=2)
        total = size + len(text.encode())
        ok = total <= budget_bytes if budget_bytes is not None else m["kld"] <= p["budget"]["max_kld"]
        rows.append({"candidate": i, "size_bytes": total, "gguf_bytes": size, "bpw": size * 8 / weights,
                     "kld": m["kld"], "top1": m.get("top1"), "ppl": m.get("ppl"), "meets_budget": ok, **cand})
        shorts.append(text)
    fits = [r for r in rows if r["meets_budget"]]
    if not fits:
        (name, value), = p["budget"].items()
        raise RuntimeError(f"search for {ctx.runtime_args.get('variant', '?')}: no candidate met {name} {value}: "
                           "measured " + ", ".join(
            f"{r['size_bytes'] / MB:.3f} MB / KLD {r['kld']:.5f}" for r in rows))
    order = (lambda r: (r["kld"], r["size_bytes"])) if p["objective"] == "min_kld" else \
        (lambda r: (r["size_bytes"], r["kld"]))
    best = min(fits, key=order)
    rebuild_probed(ctx, {**p["quantize"], "candidate": best["candidate"]}, f"m:{best['candidate']}",
                   ctx.out / OUTPUT_FILE)
    (ctx.out / SEARCH_FILE).write_text(shorts[best["candidate"]])
    record = {**json.loads(shorts[best["candidate"]]), "chosen": best["candidate"], "size_bytes": best["size_bytes"],
              "candidates": rows, "base": alloc["base"], "sensitivity": alloc["sensitivity"],
              "method": alloc["method"]}
    types = sorted({t["type"] for t in best["tensor_types"]} | {base_type})
    info = {"gguf_type": base_type, "part_types": types, "tensor_types": best["tensor_types"], "search": record}
    return {"format": "gguf", "metrics": {"size_bytes": best["size_bytes"], "gguf_bytes": best["gguf_bytes"],
                                          "bpw": round(best["bpw"], 4), "search_kld": best["kld"]}, "info": info}


def rebuild_probed(ctx: StepContext, build: dict, role: str, out: Path) -> None:
    """The file probe `role` measured, quantized again to `out` under its build params `build` (the step has the
    probe's inputs); RuntimeError (one line) when its sha256 is not the one the probe recorded."""
    from qbuild.plugins import sha256_file
    from qbuild.quantize.gguf.run import quantize_into

    quantize_into(ctx, build, out)
    probed, = ctx.input_manifests[role]["info"]["probed_files"]
    got = sha256_file(out)
    if got != probed["sha256"]:
        raise RuntimeError(f"search for {ctx.runtime_args.get('variant', '?')}: the chosen candidate quantized again "
                           f"({got[:12]}, {out.stat().st_size} bytes) is not the file its probe measured "
                           f"({probed['sha256'][:12]}, {probed['size']} bytes): llama.cpp's quantization was not "
                           "deterministic here, so the measurements do not stand for the file")


def unreachable_budget(variant: str, budget: dict, pairs, base_size: int, base_kld: float, weights: int) -> str:
    """One line: no mix of the candidate types meets the budget, and what the types can reach (by the measured,
    additive sensitivity): the smallest file for a size budget, the least KLD for a KLD budget."""
    (name, value), = budget.items()
    head = f"search for {variant}: no mix of its types meets {name} {value:g}"
    if name == "max_kld":
        least = base_kld + sum(min(v for _, v in o) for o in pairs)
        return (f"{head}: the least KLD they reach is {least:.5f} (the base type alone: {base_kld:.5f}); raise "
                "max_kld or use a more precise base_type")
    pick = [min(range(len(o)), key=lambda i, o=o: (o[i][0], o[i][1])) for o in pairs]
    size, dkld = _total(pairs, pick)
    smallest = base_size + size + RECORD_RESERVE
    return (f"{head}: the smallest they reach is {smallest / MB:.2f} MB ({smallest * 8 / weights:.2f} bpw, KLD "
            f"{base_kld + dkld:.5f} predicted); raise {name} or add smaller types")


def llama_quantize_command(base_type: str, tensor_types: list[dict], imatrix: bool = False) -> str:
    """The llama-quantize command line that builds the same file from the converted GGUF."""
    import shlex

    parts = ["llama-quantize"] + (["--imatrix", "imatrix.gguf"] if imatrix else [])
    for t in tensor_types:
        parts += ["--tensor-type", shlex.quote(f"{t['pattern']}={t['type'].lower()}")]
    return " ".join(parts + ["model-f16.gguf", "model-mixed.gguf", base_type])
