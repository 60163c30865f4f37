"""import-check step: an imported baseline is compared with llama.cpp on its source GGUF before anything is built on it.

Two things must agree, or the import fails in one line and no step that reads the baseline runs:

- tokens: the evaluation text as the imported tokenizer splits it (the eval-data step's tokens) is llama.cpp's
  tokenization of the same text with the source file, token for token;
- next-token distributions: on the first evaluation windows (the recipe's protocol), the imported checkpoint
  through transformers against the source file through llama.cpp: KL(llama.cpp ‖ import) and top-1 agreement
  within bounds the source's quantization type explains, and perplexity on those windows within PPL_BOUND_PCT of
  llama.cpp's. transformers dequantizes the GGUF's weights exactly, but
  llama.cpp multiplies quantized weights with activations quantized too (to Q8 for most types, F16 for F16
  weights), so a quantized source is close, not bit-exact.

The step is keyed on the import (its key), the evaluation text (the eval-data step) and the protocol, so a passing
check is stored and costs once. Plan side: qbuild/planning/fidelity.py; PlanContext.gate makes every step that
reads the baseline wait for it.
"""

from __future__ import annotations

import json
from pathlib import Path

from qbuild.contract.step import StepContext

# the source's general.file_type (gguf.LlamaFileType name) → (mean KLD bound, top-1 agreement bound): what llama.cpp's
# arithmetic on that type (activations rounded to F16 or Q8 in its matrix products) leaves against exact float32 on
# the dequantized weights, with margin; a mismatched import (wrong tensor layout, RoPE, norm, vocabulary) is off by
# orders of magnitude more. Measured: the demo's SmolLM2 Q4_1 source KLD 0.0034, top-1 97.2 %; tiny random F16 models
# KLD 1e-7..5e-6, top-1 96-99.9 % (near-flat distributions: a rounding flips near-ties, so top-1 is bounded loosely).
BOUNDS = {
    "ALL_F32": (1e-4, 0.95),
    "MOSTLY_F16": (1e-3, 0.9),
    "MOSTLY_BF16": (2e-3, 0.9),
    "MOSTLY_Q8_0": (0.01, 0.9),
}
QUANTIZED_BOUND = (0.05, 0.85)      # every other (4-6 bit, K- and I-quant) type
# perplexity on the check windows, import vs llama.cpp on the source: a user compares the baseline's figure with
# llama.cpp's own; measured -1.2 % on Gemma 3 270M Q4_K_M (2 windows of 512), under 0.1 % on F16 sources
PPL_BOUND_PCT = 2.0
# the import's own dtype rounds the dequantized weights again: its share of the KLD bound
DTYPE_KLD = {"float32": 0.0, "float16": 2e-3, "bfloat16": 0.01}


class ImportMismatch(RuntimeError):
    """The imported baseline does not reproduce its source: the step fails, in one line."""


def bounds(file_type: str, dtype: str) -> tuple[float, float]:
    kld, top1 = BOUNDS.get(file_type, QUANTIZED_BOUND)
    return kld + DTYPE_KLD.get(dtype, 0.0), top1


def first_difference(ours: list[int], theirs: list[int]) -> int | None:
    """Where two token sequences first differ over `ours` (llama.cpp's may run on: ours is cut at the windows)."""
    for i, (a, b) in enumerate(zip(ours, theirs, strict=False)):
        if a != b:
            return i
    return None if len(theirs) >= len(ours) else len(theirs)


def run(ctx: StepContext) -> dict:
    """import-check: the imported checkpoint against llama.cpp on the source GGUF."""
    source = Path(ctx.runtime_args["gguf_path"])
    return _compare(ctx, source, ctx.params["dtype"], {
        "tokens": f"the imported tokenizer splits the evaluation text unlike llama.cpp on {source.name}",
        "subject": "the imported baseline's {what}", "other": f"llama.cpp's on {source.name}",
        "file": "source", "checkpoint": "import"})


def run_convert_check(ctx: StepContext) -> dict:
    """convert-check: a GGUF conversion of an HF checkpoint, through llama.cpp, against the checkpoint through
    transformers (the truth here is the checkpoint, so the GGUF is what is under test)."""
    [gguf] = sorted(Path(ctx.inputs["gguf"]).glob("*.gguf"))
    kind = f"{ctx.params['outtype']} GGUF conversion"
    return _compare(ctx, gguf, "float32", {
        "tokens": f"llama.cpp's tokenizer in the {kind} splits the evaluation text unlike the checkpoint's",
        "subject": f"the {kind}'s {{what}} through llama.cpp", "other": "the checkpoint's through transformers",
        "file": "file", "checkpoint": "checkpoint"})


def _compare(ctx: StepContext, gguf: Path, dtype: str, say: dict) -> dict:
    """Tokens, then next-token distributions and perplexity on the first windows: the checkpoint `ctx.inputs["model"]`
    through transformers against `gguf` through llama.cpp. `say` words the one-line refusals."""
    import numpy as np
    from llama_cpp import Llama
    from transformers import AutoTokenizer

    from qbuild.evaluate.data import documents, load_tokens

    p = ctx.params
    ours, info = load_tokens(ctx.inputs["data"])
    ours = [int(t) for t in ours]
    tok = AutoTokenizer.from_pretrained(str(ctx.inputs["model"]))
    text = info["join"].join(documents(p["dataset"], ctx.runtime_args["sources"], tok))
    ctx.progress(0, 3, "tokenizing with llama.cpp")
    vocab = Llama(model_path=str(gguf), vocab_only=True, verbose=False)
    theirs = vocab.tokenize(text.encode("utf-8"), add_bos=False, special=True)
    n = first_difference(ours, theirs)
    if n is not None:
        def shown(ids, i, name):
            if i >= len(ids):
                return f"{name} end of text"
            piece = vocab.detokenize([ids[i]]).decode("utf-8", "replace") if name == "llama.cpp's" \
                else tok.convert_ids_to_tokens(ids[i])
            return f"{name} {piece!r} (id {ids[i]})"
        raise ImportMismatch(f"{say['tokens']}: tokens at position {n} of {len(ours)}: {shown(ours, n, 'ours')} vs "
                             f"{shown(theirs, n, 'llama.cpp' + chr(39) + 's')}")
    if p["add_bos"] and info["bos_token_id"] != vocab.token_bos():
        raise ImportMismatch(f"BOS token: ours is id {info['bos_token_id']}, llama.cpp's on {gguf.name} "
                             f"is id {vocab.token_bos()}")
    file_type = _file_type(gguf)
    kld_bound, top1_bound = bounds(file_type, dtype)
    measured = _divergence(ctx, gguf, ours, info["bos_token_id"])
    result = {"source": gguf.name, "source_file_type": file_type, "import_dtype": dtype,
              "tokens_compared": len(ours), "tokens_identical": True, **measured,
              "kld_bound": kld_bound, "top1_bound": top1_bound, "ppl_bound_pct": PPL_BOUND_PCT}
    (ctx.out / "check.json").write_text(json.dumps(result, indent=2))
    where = f"on the first {measured['windows']} evaluation windows ({measured['positions']} positions)"
    kind = f"for a {file_type} {say['file']} {where}"
    if not np.isfinite(measured["kld"]) or measured["kld"] > kld_bound:
        raise ImportMismatch(f"{say['subject'].format(what='next-token distribution')} differs from {say['other']}: "
                             f"KLD {measured['kld']:.4g} over the bound {kld_bound:g} {kind} "
                             f"(top-1 agreement {measured['top1']:.1%})")
    if measured["top1"] < top1_bound:
        raise ImportMismatch(f"{say['subject'].format(what='top-1 token')} agrees with {say['other']} at "
                             f"{measured['top1']:.1%} of positions, under the bound {top1_bound:.0%} {kind} "
                             f"(KLD {measured['kld']:.4g})")
    if not abs(measured["ppl_delta_pct"]) <= PPL_BOUND_PCT:
        raise ImportMismatch(f"perplexity disagrees: {measured['ppl']:.4g} through transformers on the "
                             f"{say['checkpoint']} vs {measured['ppl_source']:.4g} through llama.cpp on {gguf.name} "
                             f"({measured['ppl_delta_pct']:+.2f} %), over the bound {PPL_BOUND_PCT:g} % {kind} "
                             f"(KLD {measured['kld']:.4g})")
    ctx.progress(3, 3, "agrees")
    return {"format": "metrics", "metrics": {"kld": measured["kld"], "top1": measured["top1"],
                                             "ppl": measured["ppl"], "ppl_source": measured["ppl_source"],
                                             "ppl_delta_pct": measured["ppl_delta_pct"],
                                             "tokens_compared": len(ours)},
            "info": {"source_file_type": file_type, "kld_bound": kld_bound, "top1_bound": top1_bound}}


def _file_type(source: Path) -> str:
    from gguf import LlamaFileType

    from qbuild.models.gguf_header import metadata_values

    value = metadata_values(source, ("general.file_type",)).get("general.file_type")
    if value is None:
        return "unknown"
    try:
        return LlamaFileType(int(value)).name
    except (TypeError, ValueError):
        return f"file type {value}"


def _divergence(ctx: StepContext, source: Path, ids: list[int], bos: int | None) -> dict:
    """KL(llama.cpp on the source ‖ transformers on the import) and top-1 agreement on the first windows."""
    import numpy as np

    from qbuild.contract.plugin import open_session
    from qbuild.contract.protocol import score_rows, windows

    p = ctx.params
    wins = windows(np.asarray(ids), p["protocol"], p["context_length"], p["add_bos"], bos, p["windows"], p["stride"])
    if not wins:
        raise ImportMismatch(f"the evaluation text ({len(ids)} tokens) is shorter than one window")
    ctx.progress(1, 3, "llama.cpp on the source")
    llama = open_session("llama.cpp", source, ctx, p["context_length"])
    reference = [np.array(llama.scored_logits(w.tokens, w.first_scored)) for w in wins]
    del llama
    ctx.progress(2, 3, "transformers on the import")
    model = open_session("transformers", ctx.inputs["model"], ctx, p["context_length"])
    klds, top1, nll, nll_source, count = [], [], 0.0, 0.0, 0
    for w, base, logits in zip(wins, reference, model.window_logits(wins), strict=True):
        rows = logits[w.first_scored - 1: len(w.tokens) - 1]
        if rows.shape[1] != base.shape[1]:
            raise ImportMismatch(f"vocabulary size: the import's logits have {rows.shape[1]} entries, llama.cpp's "
                                 f"on {source.name} {base.shape[1]}")
        base_scored = score_rows(base, w, logprobs=True)
        scored = score_rows(rows, w, reference=base_scored["logprobs"])
        nll, nll_source, count = nll + scored["nll"], nll_source + base_scored["nll"], count + scored["count"]
        klds.append(scored["kld"])
        top1.append(scored["top1"])
    kld, same = np.concatenate(klds), np.concatenate(top1)
    ppl, ppl_source = float(np.exp(nll / count)), float(np.exp(nll_source / count))
    return {"ppl": ppl, "ppl_source": ppl_source, "ppl_delta_pct": 100.0 * (ppl / ppl_source - 1.0),
            "kld": float(kld.mean()), "kld_max": float(kld.max()), "top1": float(same.mean()),
            "windows": len(wins), "positions": int(len(kld)), "protocol": p["protocol"],
            "context_length": p["context_length"]}
