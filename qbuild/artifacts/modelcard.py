"""A Hugging Face model card (README.md) that travels with every pushed artifact, so it explains itself:
YAML front matter (base_model, quantization, library, tags), then the metrics with their protocol, the
gate results, the size, provenance, and how to load it in each engine that can."""

from __future__ import annotations

import yaml

from qbuild.base.bootstrap import half_width
from qbuild.base.units import human_size
from qbuild.serving.confidence import with_ci

METRIC_COLUMNS = (("ppl", "PPL", "{:.3f}"), ("delta_ppl", "ΔPPL", "{:+.3f}"), ("delta_ppl_pct", "ΔPPL %", "{:+.2f}"),
                  ("kld", "KLD", "{:.4f}"), ("top1", "top-1", "{:.1%}"), ("decode_tok_s", "decode tok/s", "{:.1f}"),
                  ("prefill_tok_s", "prefill tok/s", "{:.1f}"), ("ttft_ms", "TTFT ms", "{:.1f}"))
ENGINES = ("vLLM", "SGLang", "TGI", "LMDeploy", "transformers", "llama.cpp", "TensorRT-LLM", "ExLlamaV2")
# qbuild.contract.formats' engine names (manifest `loads_in`) → the card's
ENGINE_NAMES = {"vllm": "vLLM", "sglang": "SGLang", "tgi": "TGI", "lmdeploy": "LMDeploy", "transformers": "transformers",
                "llama.cpp": "llama.cpp", "trtllm-pytorch": "TensorRT-LLM", "tensorrt-llm": "TensorRT-LLM",
                "trtllm-build": "TensorRT-LLM", "exllamav2": "ExLlamaV2"}
LIBRARY = {"gguf": "gguf", "hf": "transformers", "hf-modelopt": "transformers", "trtllm-engine": "tensorrt-llm",
           "trtllm-checkpoint": "tensorrt-llm", "trtllm-pytorch": "tensorrt-llm"}


def quantization_of(manifest: dict) -> dict:
    """method + its settings (from the step's params), and the checkpoint format the engines care about."""
    params = dict(manifest.get("params") or {})
    info = manifest.get("info") or {}
    q = {"method": params.pop("method", None) or manifest.get("kind")}
    for k in ("type", "bits", "group_size", "scheme", "qformat", "kv_cache_dtype", "dtype", "sym", "damp",
              "actorder", "targets", "ignore", "imatrix"):
        if params.get(k) is not None:
            q[k] = params[k]
    q["format"] = manifest.get("format")
    if info.get("checkpoint_format"):
        q["checkpoint_format"] = info["checkpoint_format"]
    if info.get("quant_format"):
        q["quant_format"] = info["quant_format"]
    return {k: v for k, v in q.items() if v is not None}


def _gguf_file(manifest: dict) -> str:
    return next((f["path"] for f in manifest.get("files", []) if f["path"].endswith(".gguf")), "model.gguf")


def load_table(manifest: dict, name: str = "MODEL_DIR") -> list[tuple[str, bool, str]]:
    """(engine, loads it, how) for every engine. Which engines load it is the manifest's `loads_in` (the one
    table in qbuild/contract/formats.py, worked out for manifests older than it); the command is the format's declared one."""
    from qbuild.contract.formats import manifest_loads_in

    fmt = manifest.get("format") or ""
    info = manifest.get("info") or {}
    if fmt == "hf" and info.get("checkpoint_format") == "compressed-tensors":   # manifests from before the format
        fmt = "compressed-tensors"
    engines = manifest.get("loads_in")
    if engines is None:
        engines = manifest_loads_in(fmt, manifest.get("scheme"), info) or []
    by_card: dict[str, str] = {}      # the card's engine → the first engine (as manifests name it) that loads it
    for e in engines:
        if e in ENGINE_NAMES:
            by_card.setdefault(ENGINE_NAMES[e], e)
    rows = {e: (True, _how(by_card[e], fmt, manifest, name)) if e in by_card else (False, _why_not(e, fmt))
            for e in ENGINES}
    if fmt == "hf":
        rows["llama.cpp"] = (True, f"convert first: `python convert_hf_to_gguf.py {name}`")
    return [(e, ok, how) for e, (ok, how) in rows.items()]


def _how(engine: str, fmt: str, manifest: dict, name: str) -> str:
    from qbuild.contract.formats import load_command

    how = load_command(fmt, engine, name, _gguf_file(manifest)) or f"load `{name}` with {ENGINE_NAMES[engine]}"
    tc = manifest.get("toolchain") or {}
    if engine == "tensorrt-llm" and tc.get("gpu.sm"):   # an engine runs only where it was built
        how += f" (only on SM {tc['gpu.sm']} GPUs, TensorRT-LLM {tc.get('tensorrt_llm')})"
    return how


def _why_not(engine: str, fmt: str) -> str:
    if fmt == "compressed-tensors" and engine == "LMDeploy":
        return "compressed-tensors checkpoints are not supported"
    if fmt == "compressed-tensors" and engine == "llama.cpp":
        return "quantized with llm-compressor: build a GGUF variant instead"
    return "—"


def render_model_card(manifest: dict, summary_row: dict | None = None, protocol: dict | None = None,
                      gates: dict | None = None, base_model: str | None = None, license: str | None = None) -> str:
    """README.md for one artifact. summary_row: its row of the run summary (metrics); protocol: the
    evaluation protocol; gates: the run's gate results ({"passed", "checks": [...]})."""
    row = summary_row or {}
    recipe = (manifest.get("recipe") or {}).get("name") or "qbuild"
    variant = manifest.get("variant") or row.get("variant") or manifest.get("name") or "artifact"
    quant = quantization_of(manifest)
    size = sum(f["size"] for f in manifest.get("files", []))
    front = {"base_model": base_model, "base_model_relation": "quantized" if base_model else None,
             "library_name": LIBRARY.get(manifest.get("format") or ""), "license": license,
             "quantized_by": "qbuild",
             "tags": [t for t in ("qbuild", "quantized", quant.get("method"), manifest.get("format")) if t],
             "quantization": quant}
    front = {k: v for k, v in front.items() if v not in (None, [], {})}
    out = ["---", yaml.safe_dump(front, sort_keys=False, allow_unicode=True).rstrip(), "---", "",
           f"# {recipe} / {variant}", "",
           f"{'Quantized with **' + quant['method'] + '**' if quant.get('method') else 'Built'} by "
           f"[qbuild](https://github.com/qbuild/qbuild) from `{base_model or 'the recipe model'}`. "
           f"Format: `{manifest.get('format')}`. Size: **{human_size(size)}** ({size:,} bytes, "
           f"{len(manifest.get('files', []))} files).", ""]
    metrics = {**(manifest.get("metrics") or {}), **{k: v for k, v in row.items() if v is not None}}
    cols = [(k, label, fmt) for k, label, fmt in METRIC_COLUMNS if isinstance(metrics.get(k), (int, float))]
    out += ["## Quality and speed", ""]
    if cols:
        out += ["| " + " | ".join(label for _, label, _ in cols) + " |", "|" + "---|" * len(cols),
                "| " + " | ".join(fmt.format(metrics[k]) + half_width(metrics.get(f"{k}_ci"), fmt)
                                  for k, _, fmt in cols) + " |", ""]
        if any(metrics.get(f"{k}_ci") for k, _, _ in cols):
            out += ["± is half the 95 % bootstrap interval over the throughput repetitions (seeded).", ""]
    else:
        out += ["No evaluation was recorded for this artifact.", ""]
    if protocol:
        out += ["Protocol: " + ", ".join(f"{k} {v}" for k, v in protocol.items() if v is not None) + ".", ""]
    if gates is not None:
        mine = [c for c in gates.get("checks", []) if c.get("variant") in (None, variant)]
        status = "passed" if gates.get("passed") and all(c.get("passed") for c in mine) else (
            "failed" if mine or not gates.get("passed") else "passed")
        out += ["## Quality gates", "", f"Gates **{status}**.", ""]
        if mine:
            out += ["| check | value | bound | result |", "|---|---|---|---|"]
            out += [f"| {c.get('check')} | {c.get('value')} | {c.get('bound')} | "
                    f"{'pass' if c.get('passed') else 'FAIL'} |" for c in mine]
            out.append("")
    out += _serving_section(row)
    out += ["## How to load it", "", "| engine | loads it | how |", "|---|---|---|"]
    out += [f"| {e} | {'yes' if ok else 'no'} | {how} |" for e, ok, how in load_table(manifest)]
    out += ["", "`MODEL_DIR` is where `qbuild pull` (or `oras pull`) put the files.", "",
            "## Provenance", "",
            f"- digest: `{manifest.get('digest')}`",
            f"- step key: `{manifest.get('key')}`",
            f"- recipe: `{recipe}` (sha256 `{(manifest.get('recipe') or {}).get('sha256')}`)",
            "- toolchain: " + ", ".join(f"{k} {v}" for k, v in sorted((manifest.get("toolchain") or {}).items())),
            f"- built: {manifest.get('created')}", ""]
    return "\n".join(out)


def _serving_section(row: dict) -> list[str]:
    """Measured through its server under load (evaluation.serving), and, when `selection:` chose it, the exact
    server command that met the bounds."""
    out: list[str] = []
    chosen = row.get("selected")
    if chosen:
        bounds = ", ".join(f"{k} {v['value'] if isinstance(v, dict) else v}"
                           + (f" at concurrency {v['concurrency']}" if isinstance(v, dict) else "")
                           for k, v in chosen["bounds"].items())
        out += ["## Selected for serving", "",
                f"qbuild selected this artifact with serving config **{chosen['config']}** (objective "
                f"{chosen['objective']}; bounds: {bounds or 'none'}). It met them served exactly like this "
                "(`model.gguf`/`MODEL_DIR`: the pulled files; pick your own port):", "",
                f"    {chosen['command']}", ""]
        if chosen.get("tie"):
            out += [f"It was chosen from a tie within measurement noise: {chosen['tie']}.", ""]
    points = [p for p in row.get("serving") or [] if p.get("ttft_ms_p50") is not None]
    if points:
        out += ["## Serving under load", "",
                "| config | concurrency | TTFT p50 ms | TTFT p99 ms | TPOT p50 ms | ITL p99 ms | output tok/s | "
                "requests/s | errors | peak RSS MiB | KLD under the config |", "|---|---|---|---|---|---|---|---|---|---|---|"]
        out += [f"| {p['config']} | {p.get('concurrency', str(p.get('request_rate')) + '/s')} | "
                f"{with_ci(p, 'ttft_ms_p50', '.1f')} | {with_ci(p, 'ttft_ms_p99', '.1f')} | "
                f"{with_ci(p, 'tpot_ms_p50', '.2f')} | {with_ci(p, 'itl_ms_p99', '.2f')} | "
                f"{with_ci(p, 'output_tok_s', '.1f')} | {with_ci(p, 'requests_s', '.2f')} | {p['errors']} | "
                f"{p.get('peak_rss_mb') or '-'} | {'-' if p.get('kld') is None else format(p['kld'], '.4g')} |"
                for p in points]
        chats = [p for p in points if p.get("by_turn")]
        if chats:
            from qbuild.serving.client import turns_text

            out += ["", f"Measured in conversations of {len(chats[0]['by_turn'])} turns (each turn resends the history); "
                    "TTFT p50 (and prompt tokens) by turn:", ""]
            out += [f"- {p['config']}, concurrency {p['concurrency']}: {turns_text(p['by_turn'])}" if "concurrency" in p
                    else f"- {p['config']}, {p.get('request_rate')} conversations/s: {turns_text(p['by_turn'])}"
                    for p in chats]
        rounds = max(len(p.get("rounds") or []) for p in points)
        if any(p.get("ci") for p in points):
            out += ["", f"Each point was measured in {rounds} independent rounds; ± is half the 95 % bootstrap "
                    "interval (seeded; rounds, then requests within them, resampled)."]
        out.append("")
    return out


__all__ = ["render_model_card", "load_table", "quantization_of"]
