"""`qbuild init MODEL`: a commented starter recipe for a user's own model, planned before it is written.

MODEL is a Hugging Face checkpoint folder, a .gguf file or pkg://package/file.gguf. The model is read with the
plan-time readers (qbuild.planning.models: config.json or the GGUF header, bounded and checked; no torch), the
machine with qbuild.models.size.machine_memory and the GPU probe. The variants are those the architecture matrix
lets this family build for the chosen engine (GGUF types for llama-server; GPTQ W4A16 and FP8 compressed-tensors
checkpoints for vLLM/SGLang/TensorRT-LLM; both on a machine with a GPU and no --engine). Each variant slot lists
alternatives in order of preference; the recipe text is planned (make_plan, exactly what `qbuild plan` does) and an
alternative that the plan refuses, or warns about (a GGUF type whose blocks do not divide the model's rows, a group
size that does not divide a layer), gives way to the next: the file written validates and plans without edits.
Its header carries the plan's cold-time estimate from the store the recipe names.

Layer: results. It plans whole recipes (pipeline.plan, pipeline.estimate), which only the results layer and above
may import; it reaches the quantization plugins only through the plan, never by importing them.
"""

from __future__ import annotations

import json
import logging
import os
import re
import textwrap
from dataclasses import dataclass, field
from pathlib import Path

from qbuild.base.errors import RecipeError, UserError

# The families of the architecture matrix (docs/architectures.md, tests/architecture_matrix.py): as config.json's
# model_type, and as a GGUF's general.architecture (Mistral and Mixtral GGUFs say llama).
MATRIX_MODEL_TYPES = ("llama", "qwen2", "qwen3", "qwen3_moe", "gemma2", "gemma3_text", "phi3", "mistral", "mixtral")
MATRIX_GGUF_ARCHS = ("llama", "qwen2", "qwen3", "qwen3moe", "gemma2", "gemma3", "phi3")
LLAMA_CPP = "llama.cpp"
WIDTH = 116   # comment lines wrap here


@dataclass
class Option:
    variant: dict
    about: str            # the comment above the variant


@dataclass
class Slot:
    role: str             # what the slot is for, in the left-out notes
    options: list[Option]
    tried: list[str] = field(default_factory=list)   # why earlier options gave way
    index: int = 0
    warned: int | None = None                          # the first option that planned with a warning
    warning: str = ""
    done: bool = False

    @property
    def option(self) -> Option:
        return self.options[self.index]


@dataclass(frozen=True)
class InitResult:
    path: Path
    name: str
    engine: str
    variants: tuple[tuple[str, str], ...]   # (name, what it is)
    left_out: tuple[str, ...]               # slots no option of which plans on this model, with why
    steps: int
    estimate: str                           # the header's TIME line, without "TIME: "
    text: str


def _one_line(text: str, limit: int = 400) -> str:
    """Text from a model or a message made safe for a YAML comment: one line, printable, cut short."""
    flat = "".join(c if c.isprintable() else " " for c in str(text))
    flat = " ".join(flat.split())
    return flat if len(flat) <= limit else flat[:limit] + "..."


def _comment(text: str, indent: int = 0, first: str = "# ", rest: str = "#   ") -> list[str]:
    pad = " " * indent
    lines = textwrap.wrap(_one_line(text, 2000), WIDTH - indent - len(first), break_long_words=False,
                          break_on_hyphens=False) or [""]
    return [pad + (first if i == 0 else rest) + line for i, line in enumerate(lines)]


def _at(code: str, comment: str, column: int = 37) -> str:
    """A YAML line with its comment at `column` (one space after the code when the code is longer)."""
    return code + " " * max(1, column - len(code)) + "# " + comment


def _q(value: str) -> str:
    """A YAML double-quoted scalar (JSON's escapes are YAML's): safe for any path or name."""
    return json.dumps(value)


def recipe_name(model: str, path: Path) -> str:
    """A recipe name (qbuild.base.names grammar) from the model's file or folder name, lower case."""
    stem = path.name.removesuffix(".gguf") if path.is_file() else path.name
    if re.fullmatch(r"[0-9a-f]{40}", stem) and path.parent.name == "snapshots":   # an HF cache snapshot folder
        stem = path.parent.parent.name.removeprefix("models--").replace("--", "-")
    name = re.sub(r"[^a-z0-9._-]+", "-", stem.lower()).strip("-._")[:64]
    return name or "model"


def _source(model: str) -> tuple[str, Path]:
    """('gguf' | 'local', the resolved path) of MODEL, or a one-line UserError saying what it must be."""
    from qbuild.planning.models import resolve_path

    what = "qbuild init takes a Hugging Face checkpoint folder, a .gguf file or pkg://package/file.gguf"
    try:
        path = resolve_path(model, Path.cwd(), "MODEL")
    except RecipeError as exc:
        raise UserError(f"{model}: {exc.message}; {what}") from None
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise UserError(f"{model}: {path} has no config.json, so it is not a Hugging Face checkpoint; {what}")
        return "local", path
    try:
        with open(path, "rb") as f:
            magic = f.read(4)
    except OSError as exc:
        raise UserError(f"{model}: cannot read it ({exc.strerror or exc})") from None
    if magic != b"GGUF":
        raise UserError(f"{model}: not a GGUF file (it does not start with the GGUF magic); {what}")
    return "gguf", path


def _path_in_recipe(model: str, out_dir: Path) -> str:
    """MODEL as the recipe names it: pkg:// and absolute paths as given, a relative path relative to the recipe's
    folder (recipes resolve paths against their own folder)."""
    if model.startswith("pkg://") or Path(model).expanduser().is_absolute():
        return model
    return os.path.relpath(Path(model).absolute(), out_dir.absolute())


CT_SCHEMES = {"w4a16": "W4A16 (GPTQ)", "fp8-dynamic": "FP8 (llm-compressor)"}   # scheme → slot role


def _engine(engine: str | None, has_gpu: bool) -> tuple[str, bool, tuple[str, ...], list[str]]:
    """(engine label, GGUF variants?, the compressed-tensors schemes to write, notes) for --engine (a server plugin's
    name) or the machine's default: llama-server on a CPU, both kinds (each served by the first installed server that
    loads it) where there is a GPU."""
    from qbuild.contract.formats import loads_in
    from qbuild.contract.plugin import servers

    if engine is None:
        return ("llama-server + vLLM/SGLang", True, tuple(CT_SCHEMES), []) if has_gpu else ("llama-server", True, (), [])
    if engine not in servers:
        raise UserError(f"--engine {engine!r} is not a server; known servers: {', '.join(servers.names())}")
    server = servers.get(engine)
    if server.engine == LLAMA_CPP:
        return engine, True, (), []
    ct = "compressed-tensors"   # the format the W4A16 and FP8 variants it writes are in (declared by their methods)
    why_not = {s: (None if server.engine in loads_in(ct, s) else
                   f"{engine} ({server.engine}) does not load a compressed-tensors {s} checkpoint")
               or server.cannot_serve(ct, s) for s in CT_SCHEMES}   # e.g. vLLM's CPU build: no FP8
    schemes = tuple(s for s in CT_SCHEMES if not why_not[s])
    if not schemes:
        raise UserError(f"--engine {engine}: its engine ({server.engine}) loads neither GGUF files nor the "
                        "compressed-tensors checkpoints qbuild init writes variants for (W4A16, FP8)")
    notes = [f"{CT_SCHEMES[s]} left out: {why_not[s]}" for s in CT_SCHEMES if s not in schemes]
    return engine, False, schemes, notes


def _gguf_slots(max_size_mb: float | None) -> list[Slot]:
    slots = [
        Slot("8-bit GGUF", [Option({"name": "q8_0", "method": "gguf", "type": "Q8_0"},
                                   "Q8_0: 8.5 bits per weight, near-lossless (the demo model: KLD 0.004 against the "
                                   "baseline), about half the size of F16.")]),
        Slot("4-bit GGUF", [
            Option({"name": "q4_k_m", "method": "gguf", "type": "Q4_K_M"},
                   "Q4_K_M: about 4.9 bits per weight, llama.cpp's usual 4-bit choice. `imatrix: true` (with a "
                   "calibration: section) usually halves its KLD."),
            Option({"name": "iq4_nl", "method": "gguf", "type": "IQ4_NL"},
                   "IQ4_NL: 4.5 bits per weight, non-linear 4-bit in 32-column blocks."),
            Option({"name": "q4_0", "method": "gguf", "type": "Q4_0"},
                   "Q4_0: 4.5 bits per weight in 32-column blocks."),
        ]),
    ]
    if max_size_mb is not None:
        slots.append(Slot(f"GGUF mix under {max_size_mb:g} MB", [Option(
            {"name": f"mix-{max_size_mb:g}mb", "method": "gguf", "search": {"max_size_mb": max_size_mb}},
            f"A size budget: per-tensor GGUF types chosen by measured KLD so that the file stays under "
            f"{max_size_mb:g} MB (10^6 bytes; docs/mixed-precision.md). About 60 measurement steps: "
            "recipes/mixed-precision.yaml took 12 min on 2 cores on a 135M-parameter model. Add "
            "max_minutes: N under search: to refuse a search estimated longer.")]))
    return slots


def _ct_slots(gpu, schemes: tuple[str, ...]) -> list[Slot]:
    where = (f"this GPU ({_one_line(gpu.name, 80)}, compute capability {_one_line(gpu.sm, 10)}) "
             + ("runs FP8 natively" if _sm(gpu.sm) >= 8.9 else "has no FP8 units: vLLM runs it weight-only (Marlin)")
             if gpu is not None else "native on Ada/Hopper GPUs (compute capability 8.9+), weight-only on older ones")
    w4 = ("W4A16: 4-bit integer weights in groups of {g} columns, 16-bit activations, by GPTQ through llm-compressor, "
          "calibrated on the set above; a compressed-tensors checkpoint vLLM and SGLang load (Marlin kernels).")
    options = [Option({"name": "w4a16", "method": "gptq", "bits": 4, "group_size": g}, w4.format(g=g))
               for g in (128, 64, 32)]
    options.append(Option({"name": "w4a16", "method": "gptq", "bits": 4, "group_size": 128,
                           "on_indivisible": "ignore"},
                          w4.format(g=128) + " Layers whose input size 128 does not divide stay unquantized."))
    fp8 = Option({"name": "fp8", "method": "fp8", "scheme": "dynamic"},
                 f"FP8 dynamic: E4M3 weights, per-token activation scales computed at run time, no calibration; {where}.")
    slots = {"w4a16": Slot(CT_SCHEMES["w4a16"], options), "fp8-dynamic": Slot(CT_SCHEMES["fp8-dynamic"], [fp8])}
    return [slots[s] for s in schemes]


def _sm(sm: str) -> float:
    try:
        return float(sm)
    except ValueError:
        return 0.0


def _variant_yaml(v: dict) -> list[str]:
    lines = [f"  - name: {v['name']}"]
    for key, value in v.items():
        if key == "name":
            continue
        if isinstance(value, dict):
            inner = ", ".join(f"{k}: {json.dumps(x) if isinstance(x, str) else x}" for k, x in value.items())
            lines.append(f"    {key}: {{{inner}}}")
        else:
            lines.append(f"    {key}: {value}")
    return lines


@dataclass
class _Facts:
    model: str
    kind: str            # gguf | local
    path_in_recipe: str
    info: dict
    parameters: int
    memory: tuple[int, str]
    cores: int
    gpu: object
    engine: str
    engine_flag: str | None
    max_size_mib: float | None = None


def _header(f: _Facts, name: str, file_name: str, time_line: str, notes: list[str]) -> list[str]:
    from qbuild.base.units import human_size

    cfg = f.info.get("text_config") or f.info
    mtype = _one_line(cfg.get("model_type") or f.info.get("model_type") or "unknown", 60)
    dims = [f"{f.parameters / 1e6:,.1f}M parameters" if f.parameters else "",
            f"{int(cfg['vocab_size']):,}-token vocabulary" if isinstance(cfg.get("vocab_size"), int) else "",
            f"{cfg['num_hidden_layers']} layers" if isinstance(cfg.get("num_hidden_layers"), int) else "",
            f"hidden size {cfg['hidden_size']}" if isinstance(cfg.get("hidden_size"), int) else ""]
    source = "a GGUF file" if f.kind == "gguf" else "a Hugging Face checkpoint"
    proven = MATRIX_GGUF_ARCHS if f.kind == "gguf" else MATRIX_MODEL_TYPES
    family = ("a family of the architecture matrix (docs/architectures.md)" if mtype in proven else
              "not a family of the architecture matrix (docs/architectures.md): unproven here; the import and "
              "conversion checks stop a run whose model does not convert faithfully")
    gpu = (f"GPU {_one_line(f.gpu.name, 80)} (compute capability {_one_line(f.gpu.sm, 10)})" if f.gpu is not None
           else "no GPU")
    out = _comment(f"Starter recipe for {_one_line(f.model, 300)}, written by `qbuild init`. Edit freely: every "
                   "field is in docs/recipes.md, and `qbuild schema` gives your editor completion.")
    out += _comment(f"Model: {mtype} ({source}), " + ", ".join(d for d in dims if d) + f"; {family}.")
    out += _comment(f"Machine: {human_size(f.memory[0])} of memory ({_one_line(f.memory[1], 80)}), {f.cores} CPU "
                    f"core(s), {gpu}. Variants for: {f.engine}" + ("" if f.engine_flag else " (--engine picks another)")
                    + ".")
    out += _comment(f"TIME: {time_line}")
    for note in notes:
        out += _comment(note)
    out += ["#",
            f"#   qbuild validate {file_name}    # schema, files, shapes; builds nothing",
            f"#   qbuild plan {file_name}        # every step: cached or to build, and why; the time estimate",
            f"#   qbuild {file_name}             # build, evaluate, serve; exit 3 when a gate fails",
            f"#   qbuild select {file_name}      # which variant to ship under the selection: bounds below",
            _at(f"name: {name}", "the first part of every ref: NAME/VARIANT:latest"),
            ""]
    return out


def render(f: _Facts, name: str, file_name: str, slots: list[Slot], time_line: str, notes: list[str]) -> str:
    chosen = [(s, s.option) for s in slots]
    variants = [o.variant for _, o in chosen]
    calibrated = any(v["method"] == "gptq" for v in variants)
    cfg = f.info.get("text_config") or f.info
    positions = cfg.get("max_position_embeddings")
    context = min(512, positions) if isinstance(positions, int) and positions >= 64 else 512
    lines = _header(f, name, file_name, time_line, notes)
    lines += ["model:"]
    if f.kind == "gguf":
        lines += ["  source: gguf                       # dequantized into an HF checkpoint, the baseline, which is checked",
                  "                                     #   against llama.cpp on the file before anything is built on it"]
    else:
        lines += ["  source: local                      # a Hugging Face checkpoint folder, fingerprinted by content"]
    lines += [f"  path: {_q(f.path_in_recipe)}", ""]
    if calibrated:
        lines += ["calibration:                         # tokenized once, shared by every method that calibrates (GPTQ here)",
                  "  sources:",
                  "    - {type: pydocs, split: train}   # offline English: Python's stdlib docstrings (your own: type: file)",
                  "  samples: 128",
                  "  seq_len: 512",
                  "  seed: 0", ""]
    else:
        lines += ["# calibration:                       # for methods that calibrate: gptq, awq, static fp8, gguf imatrix: true",
                  "#   sources: [{type: pydocs, split: train}]",
                  "#   samples: 128",
                  "#   seq_len: 512", ""]
    lines += ["variants:                            # each entry is one method's options (docs/methods.md)"]
    for slot, option in chosen:
        about = option.about
        if slot.tried:
            about += " Chosen over " + "; over ".join(slot.tried)
        if slot.warned is not None and slot.index == slot.warned and slot.warning:
            about += f" The plan notes: {slot.warning}"
        lines += _comment(about, indent=2)
        lines += _variant_yaml(option.variant)
    lines += [""]
    lines += ["evaluation:",
              "  baseline: true                     # the unquantized model through transformers: what variants are "
              "compared with",
              "  perplexity:",
              "    dataset:",
              "      sources: [{type: pydocs, split: test}]   # held-out text, disjoint from the calibration split",
              "    protocol: fixed-window",
              f"    context_length: {context}",
              f"    max_windows: 8                   # 8 x {context} tokens scored: more windows, tighter numbers, "
              "longer runs",
              "  kld: true                          # KL divergence and top-1 agreement against the baseline's "
              "next-token distribution",
              "  # throughput: {batch_sizes: [1], input_len: 128, output_len: 32, repetitions: 3}   # offline tok/s, "
              "TTFT",
              "  # tasks:                           # task accuracy through lm-eval, and answers that flip against the "
              "baseline.",
              "  #   - task: pystdlib_mc            # qbuild's offline 40-question task is left out: it lives in qbuild's",
              "  #     include_path: PATH           #   source tree (tests/tasks/pystdlib_mc), not in the installed "
              "package,",
              "  #                                  #   and recipes/demo.yaml's ../tests/tasks/pystdlib_mc only resolves "
              "inside",
              "  #                                  #   the repository. Point include_path at a copy, or name any lm-eval "
              "task.",
              "  gates:                             # `qbuild FILE` exits 3 when a variant misses one (a nightly "
              "job's signal)",
              "    - max_delta_ppl_pct: 10          # perplexity at most 10 % above the baseline's",
              "      min_top1: 0.8                  # the baseline's top token kept at 80 % of positions or more"]
    served = [v["name"] for v in variants if v["method"] == "gguf"] if f.engine_flag is None and f.gpu is None \
        else [v["name"] for v in variants]
    engine = f.engine_flag or ("llama-server" if f.gpu is None else None)
    lines += ["  serving:                           # each variant behind its real server, concurrent streaming "
              "load (docs/serving.md)"]
    if engine == "llama-server":
        lines += ["    engine: llama-server             # llama.cpp's server (built once per machine on first use, "
                  "about 6 min on 2 cores)"]
    elif engine is not None:
        lines += [_at(f"    engine: {engine}", "serve every variant with this server")]
    else:
        lines += ["    # engine: vllm                   # unset: each variant by the first installed server whose "
                  "engine loads it"]
    lines += [_at(f"    variants: [{', '.join(served)}]", "the baseline, an HF checkpoint, is served only by GPU engines"),
              "    concurrency: [1, 4]              # requests in flight at once: one measured point each",
              "    requests: 16                     # measured per point, after 2 warm-up requests",
              "    rounds: 3                        # each point measured 3 times: figures with 95 % intervals "
              "(1: fastest)",
              "    input_len: 128                   # prompt tokens (windows of the held-out text)",
              "    output_len: 32                   # tokens generated per request",
              "    configs:",
              "      - name: default                # the engine's defaults; compare another: {name: kv8, "
              "kv_cache_dtype: q8_0}", ""]
    fast = f.gpu is not None and engine != "llama-server"
    ttft, tpot = (500, 50) if fast else (3000, 150)
    lines += ["selection:                           # `qbuild select FILE`: the (variant, serving config) to ship; "
              "exit 3 when none qualifies",
              "  # Placeholder bounds: set them from your product's latency budget. A latency bound applies at one "
              "concurrency",
              "  # point of evaluation.serving (4 here: four requests in flight); a bound within measurement noise "
              "rejects.",
              _at(f"  ttft_p99_ms: {{value: {ttft}, concurrency: 4}}", "time to first token, 99th percentile, in ms", 46),
              _at(f"  tpot_p50_ms: {{value: {tpot}, concurrency: 4}}", "time per output token after the first, median, "
                  "in ms", 46),
              "  max_kld: 0.1                       # quality: KL divergence against the baseline at most this"]
    if f.max_size_mib is not None:
        lines += [_at(f"  max_size_mb: {f.max_size_mib:g}", "the artifact's size, in MiB (--max-size-mb, converted "
                      "from MB)")]
    else:
        lines += ["  # max_size_mb: 500                 # the artifact's size, in MiB"]
    lines += ["  # max_delta_ppl_pct: 5             # perplexity at most 5 % above the baseline's",
              "  # max_memory_mb: 4000              # the server's peak RSS over the sweep, in MiB",
              "  objective: max_throughput          # among those meeting every bound: most output tok/s at "
              "concurrency 4",
              "                                     #   (or min_size, min_kld; max_capacity needs "
              "evaluation.serving.capacity)",
              "  on_uncertain: reject               # a bound within noise: reject, accept, or measure_more (more "
              "rounds)", ""]
    lines += ["store:",
              "  path: ./artifacts                  # content-addressed, relative to where you run qbuild: a rerun "
              "builds nothing", ""]
    return "\n".join(lines)


def _variant_index(err: RecipeError) -> int | None:
    found = re.match(r"variants\[(\d+)\]", err.field or "")
    return int(found.group(1)) if found else None


def _plan(text: str, out: Path):
    """The plan of the recipe `text` as if it were the file `out` (paths resolve against its folder; the store is the
    one it names, or QBUILD_STORE, as `qbuild plan` opens it): the text is parsed from YAML, so its quoting is checked
    too."""
    from qbuild.artifacts.access import open_store
    from qbuild.base.yamlio import load_yaml
    from qbuild.pipeline.plan import make_plan
    from qbuild.planning.recipe import parse_recipe

    data, lines = load_yaml(text, source=str(out))
    recipe = parse_recipe(data, lines, source=str(out))
    recipe._lines, recipe._source = lines, str(out)
    store = open_store(None, recipe)
    store.repair = False   # a dry run: nothing is moved to quarantine
    quiet = _Quiet()   # the plan's warnings are about options being tried: they go into the recipe's comments
    logger = logging.getLogger("qbuild")
    logger.addFilter(quiet)
    try:
        return make_plan(recipe, out.parent, store), store
    finally:
        logger.removeFilter(quiet)


class _Quiet(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno > logging.WARNING


def _settle(facts: _Facts, name: str, out: Path, slots: list[Slot], notes: list[str]):
    """Plan the recipe until every slot's option plans cleanly (or with the warning of its best option), dropping slots
    that no option fits. Returns (plan, store, left-out notes)."""
    left_out: list[tuple[str, str]] = []
    for _ in range(64):
        if not slots:
            break
        text = render(facts, name, out.name, slots, "", notes)
        try:
            the_plan, store = _plan(text, out)
        except RecipeError as err:
            i = _variant_index(err)
            if i is None or i >= len(slots):
                raise UserError(f"{facts.model}: {_one_line(err.message, 900)}") from None
            slot = slots[i]
            if err.field.endswith(".method"):   # the method itself (its family refusal, its backend): no option helps
                left_out.append((slot.role, _one_line(err.message, 600)))
                slots.pop(i)
                continue
            why = f"{_option_label(slot.option.variant)}: {_one_line(err.message, 600)}"
            if not _advance(slot, why):
                left_out.append((slot.role, why))
                slots.pop(i)
            continue
        moved = False
        for i, slot in enumerate(slots):
            if slot.done:
                continue
            warnings = [w for w in the_plan.warnings if _warns_variant(w, i)]
            if not warnings:
                slot.done = True
                continue
            warning = _one_line(re.sub(r"^variants\[\d+\][\w.\[\]]*:\s*", "", warnings[0]), 600)
            if slot.warned is None:
                slot.warned, slot.warning = slot.index, warning
            _advance(slot, f"{_option_label(slot.option.variant)}: {warning}")   # at the end: back to the first that warned
            moved = True
            break
        if not moved:
            return the_plan, store, left_out
    if not slots:
        return None, None, left_out
    raise UserError(f"{facts.model}: the starter recipe did not settle on variants that plan")


def _option_label(v: dict) -> str:
    if v["method"] == "gguf":
        return v.get("type") or "the search"
    if v["method"] == "gptq":
        return f"group_size {v['group_size']}"
    return v["method"]


def _warns_variant(warning: str, i: int) -> bool:
    return re.match(rf"variants\[{i}\][.\[:]", warning) is not None


def _advance(slot: Slot, why: str) -> bool:
    """Move the slot to its next option, remembering why; False when it has none left."""
    if slot.index + 1 >= len(slot.options):
        if slot.warned is not None:   # an earlier option planned, with a warning: keep it
            slot.index, slot.done = slot.warned, True
            slot.tried = slot.tried[:slot.index]
            return True
        return False
    slot.tried.append(why)
    slot.index += 1
    return True


def _time_line(the_plan, store, file_name: str) -> str:
    from qbuild.base.units import human_seconds
    from qbuild.pipeline.estimate import estimate_plan

    est = estimate_plan(the_plan.steps, store, the_plan.recipe.name)
    where = _one_line(str(store.root), 200)
    if est.cold_seconds is not None:
        return (f"about {human_seconds(est.cold_seconds)} cold on this machine ({est.cores} core(s)), `qbuild plan`'s "
                f"estimate from the history of the store {where}" + (
                    f"; {est.cold_excluded} step(s) this machine cannot build not counted" if est.cold_excluded else ""))
    known = len(est.steps) - est.unknown
    if known:
        return (f"{human_seconds(est.total_seconds)} for {known} of the {the_plan.to_build} steps to build, from the "
                f"history of the store {where}; {est.unknown} step(s) have no history there yet (`qbuild plan "
                f"{file_name}` estimates them once similar steps are stored)")
    return (f"no estimate yet: the store {where} holds no history of steps like the {the_plan.to_build} to build; "
            f"`qbuild plan {file_name}` estimates a cold run once similar steps are stored there. For scale, on 2 CPU cores and "
            "a 135M-parameter model (their headers): recipes/demo.yaml took 4 min, recipes/serving.yaml with 3 rounds "
            "per serving point 13-15 min")


def init_recipe(model: str, out: str | os.PathLike | None = None, *, engine: str | None = None,
                max_size_mb: float | None = None, force: bool = False) -> InitResult:
    """Write a commented starter recipe for MODEL (module docstring); UserError (exit 2) when the model cannot be
    read, its family is refused for every variant, or the file exists (without force)."""
    from qbuild.base.hardware import gpu as probe_gpu
    from qbuild.base.owned import NotOurs, output_root
    from qbuild.models.size import machine_memory, model_size
    from qbuild.planning.models import model_info, model_step
    from qbuild.planning.recipe import GGUFModel, LocalModel

    if max_size_mb is not None and not max_size_mb > 0:
        raise UserError(f"--max-size-mb {max_size_mb:g}: give a size above 0 (MB, 10^6 bytes)")
    kind, path = _source(model)
    name = recipe_name(model, path)
    target = Path(out) if out is not None else Path(f"{name}.yaml")
    target = target.expanduser()
    if target.is_dir():
        raise UserError(f"{target} is a folder: -o takes the recipe file to write")
    if (target.exists() or target.is_symlink()) and not force:
        raise UserError(f"{target} exists; pass --force to overwrite it")
    if not target.parent.absolute().is_dir():
        raise UserError(f"{target}: the folder {target.parent} does not exist")
    out_path = target.absolute()
    gpu = probe_gpu()
    label, want_gguf, ct_schemes, notes = _engine(engine, gpu is not None)
    spec_path = _path_in_recipe(model, out_path.parent)
    spec = GGUFModel(source="gguf", path=spec_path) if kind == "gguf" else LocalModel(source="local", path=spec_path)
    try:
        info = model_info(model_step(spec, out_path.parent))
    except RecipeError as err:
        raise UserError(f"{model}: {_one_line(err.message, 900)}") from None
    size = model_size(info, path if kind == "local" else None)
    parameters = (size.file_parameters or size.parameters) if size else int(info.get("gguf_elements") or 0)
    facts = _Facts(model, kind, spec_path, info, parameters, machine_memory(), os.cpu_count() or 1, gpu, label,
                   engine, None if max_size_mb is None else int(max_size_mb * 1e6 / (1 << 20) * 10) / 10)
    slots = (_gguf_slots(max_size_mb) if want_gguf else []) + _ct_slots(gpu, ct_schemes)
    if max_size_mb is not None and not want_gguf:
        notes.append(f"--max-size-mb {max_size_mb:g}: a size-budget search is a gguf variant's; for {label}, an rtn "
                     "variant with search: {max_bits: N} mixes W4A16/W8A16 under an average-bits budget "
                     "(docs/mixed-precision.md). The size bound is kept in selection: below.")
    the_plan, store, left_out = _settle(facts, name, out_path, slots, notes)
    mtype = _one_line((info.get("text_config") or info).get("model_type") or info.get("model_type") or "unknown", 60)
    if the_plan is None:
        raise UserError(f"{model} ({mtype}): no variant for {label} plans on this model: " + _grouped(left_out))
    if left_out:
        notes.append(f"Left out: {_grouped(left_out)}")
    notes += [f"The plan notes: {_one_line(w, 400)}" for w in the_plan.warnings
              if not re.match(r"variants\[\d+\]", w)]
    time_line = _time_line(the_plan, store, target.name)
    text = render(facts, name, target.name, slots, time_line, notes)
    if (target.exists() or target.is_symlink()) and not force:   # made while we planned
        raise UserError(f"{target} exists; pass --force to overwrite it")
    try:
        output_root(out_path.parent).write_bytes(out_path, text.encode("utf-8"))
    except (OSError, NotOurs) as exc:
        raise UserError(f"cannot write {target}: {_one_line(getattr(exc, 'strerror', None) or exc, 200)}") from None
    chosen = tuple((s.option.variant["name"], _describe(s.option.variant)) for s in slots)
    return InitResult(target, name, label, chosen, tuple(f"{role}: {why}" for role, why in left_out),
                      len(the_plan.steps), time_line, text)


def _grouped(left_out: list[tuple[str, str]]) -> str:
    """'ROLE, ROLE: why; ROLE: why': slots left out for the same reason named together."""
    reasons: dict[str, list[str]] = {}
    for role, why in left_out:
        reasons.setdefault(why, []).append(role)
    return "; ".join(f"{', '.join(roles)}: {why}" for why, roles in reasons.items())


def _describe(v: dict) -> str:
    if v["method"] == "gguf":
        return f"GGUF {v['type']}" if "type" in v else f"GGUF search max_size_mb {v['search']['max_size_mb']:g}"
    if v["method"] == "gptq":
        return f"GPTQ W4A16 g{v['group_size']}"
    return "FP8 dynamic"
