"""What the architecture matrix declares: its cells, each cell's recipe, the sanity bounds, the cells qbuild refuses
(read from qbuild's own table) and the cells known to fail today. tests/test_architectures.py runs it and
tests/gen_architectures.py renders docs/architectures.md from it."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import model_families as mf

GGUF_CELLS = ("F16", "Q8_0", "Q4_K_M")
CT_CELLS = ("rtn", "gptq", "awq", "fp8")
CELLS = ("hf", "gguf-import") + GGUF_CELLS + CT_CELLS + ("plan",)
CELL_TITLES = {"hf": "HF import", "gguf-import": "GGUF import", "F16": "GGUF F16", "Q8_0": "GGUF Q8_0",
               "Q4_K_M": "GGUF Q4_K_M", "rtn": "RTN", "gptq": "GPTQ", "awq": "AWQ", "fp8": "FP8",
               "plan": "serving plan"}
# The sanity bounds of the issue (#31): KL divergence from the baseline's next-token distribution.
KLD_BOUNDS = {"F16": 1e-4, "Q8_0": 0.01,
              # llm-compressor's on the tiny models (measured 0.0004-0.25): a checkpoint loaded wrong is ~1
              "rtn": 0.5, "gptq": 0.5, "awq": 0.5, "fp8": 0.1}
# The recipes a family's cells come from; the slow group is llm-compressor's.
GROUPS = ("gguf", "llm-compressor", "gguf-import", "plan")

VARIANTS = {
    "F16": {"name": "f16", "method": "gguf", "type": "F16"},
    "Q8_0": {"name": "q8_0", "method": "gguf", "type": "Q8_0"},
    "Q4_K_M": {"name": "q4km", "method": "gguf", "type": "Q4_K_M"},
    "rtn": {"name": "rtn", "method": "rtn", "bits": 4, "group_size": 128},
    "gptq": {"name": "gptq", "method": "gptq", "bits": 4, "group_size": 128},
    "awq": {"name": "awq", "method": "awq", "bits": 4, "group_size": 128},
    "fp8": {"name": "fp8", "method": "fp8", "scheme": "dynamic"},
}
PLAN_SERVED = ("q8_0", "rtn")     # what the plan cell serves: a GGUF and a compressed-tensors checkpoint

EVALUATION = {"perplexity": {"dataset": {"sources": [{"type": "pydocs", "split": "test"}]}, "protocol": "fixed-window",
                             "context_length": 64, "max_windows": 4},
              "kld": True}
CALIBRATION = {"sources": [{"type": "pydocs", "split": "train"}], "samples": 8, "seq_len": 64, "seed": 0}
SERVING = {"concurrency": [1], "requests": 4, "input_len": 32, "output_len": 8, "variants": list(PLAN_SERVED),
           "configs": [{"name": "default"}]}

# (family, cell) → why it fails today; the cell is an xfail (strict) until that is fixed.
KNOWN_FAILURES: dict[tuple[str, str], str] = {}


def variant_name(cell: str) -> str:
    return VARIANTS[cell]["name"]


def model_type(family: str) -> str:
    return mf.BY_NAME[family].make()[1].model_type


def config(family: str) -> dict:
    """The family's config.json as the tiny model has it."""
    return mf.BY_NAME[family].make()[1].to_dict()


def refusal(family: str, cell: str) -> str | None:
    """Why qbuild refuses this family's cell at plan time (its own table), or None."""
    if cell == "gguf-import":
        # llama.cpp's converter writes a Mixtral as the llama architecture with experts: what the import reads
        from qbuild.models.gguf_import import unimportable

        cfg = config(family)
        arch = "llama" if cfg["model_type"] == "mixtral" else cfg["model_type"]
        return unimportable({"model_type": arch, "num_local_experts": cfg.get("num_local_experts")})
    if cell not in VARIANTS:
        return None
    from qbuild.contract.plugin import methods
    from qbuild.contract.shapes import family_refusal

    return family_refusal(config(family), methods.get(VARIANTS[cell]["method"]), _variant(cell))


def _variant(cell: str):
    """The cell's variant as the recipe schema reads it (its method's defaults filled in, AWQ's sym: false)."""
    from qbuild.planning.recipe import parse_recipe

    recipe = parse_recipe({"name": "cell", "model": {"source": "local", "path": "."}, "calibration": CALIBRATION,
                           "variants": [VARIANTS[cell]]})
    return recipe.variants[0]


def recipe(family: str, group: str, model: Path, store: Path) -> dict:
    """The recipe of one group of a family's cells (or of one refused cell, by its name): a fresh copy, so a test
    that edits it leaves the matrix's own sections as they are."""
    return copy.deepcopy(_recipe(family, group, model, store))


def _recipe(family: str, group: str, model: Path, store: Path) -> dict:
    base = {"name": f"arch-{family}-{group}".replace(".", "-"), "model": {"source": "local", "path": str(model)},
            "runtime": {"threads": 1}, "store": {"path": str(store)}}
    if group == "gguf":
        return base | {"variants": [VARIANTS[c] for c in GGUF_CELLS if not refusal(family, c)],
                       "evaluation": EVALUATION}
    if group == "llm-compressor":
        return base | {"calibration": CALIBRATION,
                       "variants": [VARIANTS[c] for c in CT_CELLS if not refusal(family, c)],
                       "evaluation": EVALUATION}
    if group == "gguf-import":
        # the imported checkpoint converted again (F16): the whole way round, HF → GGUF → HF → GGUF
        return base | {"model": {"source": "gguf", "path": str(model)}, "variants": [VARIANTS["F16"]],
                       "evaluation": EVALUATION}
    if group == "plan":
        served = [c for c in ("Q8_0", "rtn") if not refusal(family, c)]
        return base | {"variants": [VARIANTS[c] for c in served],
                       "evaluation": {"perplexity": None, "baseline": False,
                                      "serving": SERVING | {"variants": [VARIANTS[c]["name"] for c in served]}}}
    if group in VARIANTS:   # one cell on its own: the refusal tests validate it
        return base | {"calibration": CALIBRATION, "variants": [VARIANTS[group]], "evaluation": EVALUATION}
    raise ValueError(group)


def load_results(folder: Path) -> dict[tuple[str, str], dict]:
    """The figures the cells wrote (test_architectures.record), by (family, cell)."""
    out = {}
    for path in sorted(folder.glob("*.json")):
        data = json.loads(path.read_text())
        out[(data["family"], data["cell"])] = data
    return out
