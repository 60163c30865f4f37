"""The run summary: one row per variant (and the baseline), as JSON data and as a rich table."""

from __future__ import annotations

from qbuild.base.bootstrap import plus_minus
from qbuild.base.units import human_size
from qbuild.contract.step import Outcome
from qbuild.evaluate.tasks import add_deltas as add_task_deltas
from qbuild.evaluate.tasks import summary_rows as task_rows
from qbuild.pipeline.outcome import StepOutcome
from qbuild.pipeline.plan import Artifact, Plan

# "reference" is the baseline's one pass with KLD on (its perplexity + reference log-probs); a variant's
# "perplexity" step carries its KLD and top-1 agreement when KLD is on
EVAL_KINDS = {"perplexity": "ppl", "reference": "ppl", "throughput": "speed"}


def _evaluations(outcomes: list[StepOutcome]) -> dict[tuple[str, str], StepOutcome]:
    """(artifact key, evaluation kind) → outcome: an evaluation belongs to the artifact it read."""
    return {(o.step.inputs["model"].key, o.step.kind): o for o in outcomes
            if o.step.kind in EVAL_KINDS and not o.step.runtime_args.get("serving_kv")
            and not o.step.runtime_args.get("also_runtime")}


def _other_runtimes(outcomes: list[StepOutcome]) -> dict[str, list[dict]]:
    """artifact key → its scores through the runtimes evaluation.runtimes names (beside its own numbers)."""
    found: dict[str, list[dict]] = {}
    for o in outcomes:
        name = o.step.runtime_args.get("also_runtime")
        if o.step.kind == "perplexity" and name:
            found.setdefault(o.step.inputs["model"].key, []).append(
                {"runtime": name, "status": o.status, "ppl": o.metrics.get("ppl"), "kld": o.metrics.get("kld"),
                 "top1": o.metrics.get("top1"), "step": o.step.name})
    return found


def _kv_quality(outcomes: list[StepOutcome]) -> dict[tuple[str, str], StepOutcome]:
    """(artifact key, KV-cache dtype) → the artifact's quality pass under a serving config's quantized KV cache."""
    return {(o.step.inputs["model"].key, o.step.runtime_args["serving_kv"]): o for o in outcomes
            if o.step.kind == "perplexity" and o.step.runtime_args.get("serving_kv")}


CHECK_KINDS = ("import-check", "convert-check")
QUALITY_FIELDS = ("ppl", "delta_ppl_pct", "kld", "top1")


def _add_serving_quality(rows: list[dict], outcomes: list[StepOutcome], recipe, base_ppl: float | None) -> None:
    """Each serving point gets the quality of its artifact under its config: the artifact's own numbers, or those of
    its pass under the config's quantized KV cache (qbuild.planning.evaluation.serving_quality_step; None where that could
    not be measured), so KLD cost and KV memory saving sit side by side."""
    from qbuild.planning.evaluation import kv_measured_apart

    perplexity = recipe.evaluation.perplexity
    kv_of = {c.name: c.kv_cache_dtype for c in recipe.evaluation.serving.configs}
    passes = _kv_quality(outcomes)
    for r in rows:
        for p in r.get("serving") or []:
            kv = kv_of.get(p["config"])
            p["kv_cache_dtype"] = kv
            if perplexity is None or not kv_measured_apart(perplexity, kv):
                p.update({k: r.get(k) for k in QUALITY_FIELDS})
                continue
            o = passes.get((r["key"], kv))
            m = o.metrics if o is not None else {}
            ppl = m.get("ppl")
            p.update(ppl=ppl, kld=m.get("kld"), top1=m.get("top1"), quality_step=o.step.name if o else None,
                     delta_ppl_pct=100 * (ppl - base_ppl) / base_ppl if ppl is not None and base_ppl else None)


def _load_checks(outcomes: list[StepOutcome]) -> dict[str, list[dict]]:
    """artifact key → its load checks, one per runtime: what each generated and how much of it the baseline's is."""
    checks: dict[str, list[dict]] = {}
    for o in outcomes:
        if o.step.kind != "load-check":
            continue
        info = o.record.get("info", {}) if o.record else {}
        m = o.metrics
        checks.setdefault(o.step.inputs["model"].key, []).append({
            "step": o.step.name, "runtime": o.step.params["runtime"], "status": o.status,
            "tokens": m.get("tokens"), "matches_baseline_tokens": m.get("matches_baseline_tokens"),
            "matches_baseline": m.get("matches_baseline"), "text": info.get("text"),
            "generated_token_ids": info.get("generated_token_ids"), "error": o.error})
    return checks


def load_label(checks: list[dict]) -> str | None:
    """The `load` column: "16/16" (leading tokens equal to the baseline's / generated), "ref" for the check the
    others are compared with, or the step's status; one entry per runtime when there are several."""
    def one(c: dict) -> str:
        if c["status"] not in (Outcome.BUILT, Outcome.CACHED):
            return str(c["status"])
        if c["matches_baseline_tokens"] is None:
            return "ref"
        return f"{c['matches_baseline_tokens']}/{c['tokens']}"

    if not checks:
        return None
    if len(checks) == 1:
        return one(checks[0])
    return ", ".join(f"{one(c)} {c['runtime']}" for c in checks)


# goodput's SLOs when the recipe has no `selection:` bounds: the common targets (TTFT p99 under ~500 ms,
# more than 20 tok/s per user)
DEFAULT_GOODPUT_SLO = {"ttft_ms": 500.0, "tpot_ms": 50.0}
SERVING_FIELDS = ("ttft_ms_p50", "ttft_ms_p90", "ttft_ms_p99", "tpot_ms_p50", "tpot_ms_p90", "tpot_ms_p99",
                  "itl_ms_p50", "itl_ms_p90", "itl_ms_p99", "e2e_ms_p50", "e2e_ms_p90", "e2e_ms_p99",
                  "output_tok_s", "requests_s", "errors", "requests", "completed")


def goodput_slo(recipe) -> dict:
    sel = getattr(recipe, "selection", None)
    slo = dict(DEFAULT_GOODPUT_SLO)
    if sel is not None:
        for field, key in (("ttft_p99_ms", "ttft_ms"), ("tpot_p50_ms", "tpot_ms")):
            bound = getattr(sel, field)
            if bound is not None:
                slo[key] = bound if isinstance(bound, (int, float)) else bound.value
    return slo


def _pooled_serving(outcomes: list[StepOutcome]) -> list[StepOutcome]:
    """The serving outcomes, one per (artifact, config): where selection's measure_more added rounds in steps of
    their own (`first_round` > 0), each point pools the rounds of every step (qbuild.results.measure_more)."""
    from dataclasses import replace

    groups: dict[tuple[str, str], list[StepOutcome]] = {}
    for o in outcomes:
        if o.step.kind == "serving":
            groups.setdefault((o.step.inputs["model"].key, o.step.params["config"]["name"]), []).append(o)
    pooled = []
    for group in groups.values():
        group.sort(key=lambda o: o.step.params["workload"].get("first_round", 0))
        base, added = group[0], [o for o in group[1:] if (o.metrics or {}).get("points")]
        if not added or not (base.metrics or {}).get("points"):
            pooled.append(base)
            continue
        from qbuild.serving.confidence import combine_rounds

        seed = base.step.params["workload"]["seed"]
        points = []
        for pts in zip(*(o.metrics["points"] for o in (base, *added)), strict=True):
            rounds = [r for pt in pts for r in (pt.get("rounds") or [pt])]
            where = {k: pts[0][k] for k in ("concurrency", "request_rate", "trace") if k in pts[0]}
            points.append({**where, **combine_rounds([{k: v for k, v in r.items() if k not in where}
                                                      for r in rounds], seed)})
        rss = max((o.metrics.get("peak_rss_bytes") or 0) for o in (base, *added)) or None
        pooled.append(replace(base, record={**base.record, "metrics": {**base.metrics, "points": points,
                                                                       "peak_rss_bytes": rss}}))
    return pooled


def _serving(outcomes: list[StepOutcome], slo: dict) -> dict[str, list[dict]]:
    """artifact key → its serving points, one per (serving config, concurrency or request rate)."""
    from qbuild.serving.client import goodput
    from qbuild.serving.confidence import ROUND_FIELDS

    by_artifact: dict[str, list[dict]] = {}
    for o in _pooled_serving(outcomes):
        m, config = o.metrics, o.step.params["config"]["name"]
        rows = by_artifact.setdefault(o.step.inputs["model"].key, [])
        if not m.get("points"):
            rows.append({"config": config, "status": o.status, "error": o.error, "step": o.step.name})
            continue
        rss = m.get("peak_rss_bytes")
        for pt in m["points"]:
            row = {"config": config, "server": m.get("server"), "engine": m.get("engine"), "status": o.status,
                   "step": o.step.name}
            row.update({k: pt[k] for k in ("concurrency", "request_rate", "trace") if k in pt})
            row.update({k: pt.get(k) for k in SERVING_FIELDS})
            row["goodput_requests_s"] = goodput(pt, slo["ttft_ms"], slo["tpot_ms"])
            # measured in rounds: 95 % intervals (field → [lo, hi]) and each round's own figures, samples left out
            row["ci"] = pt.get("ci")
            row["rounds"] = [{k: rd.get(k) for k in ROUND_FIELDS} for rd in pt.get("rounds") or []] or None
            if pt.get("by_turn"):   # conversations: TTFT and prompt tokens per turn
                row["by_turn"] = pt["by_turn"]
            row["peak_rss_mb"] = round(rss / 2**20, 1) if rss else None
            row["kv_bytes_per_token"] = m.get("kv_bytes_per_token")
            row["command"] = m.get("command")
            rows.append(row)
    return by_artifact


def _capacity(outcomes: list[StepOutcome]) -> dict[str, list[dict]]:
    """artifact key → its capacity per serving config (qbuild.serving.capacity_step): the rate, the concurrency it settled
    at, and every probe (rate, figures, interval, verdict), or the step's status when it did not run."""
    by_artifact: dict[str, list[dict]] = {}
    for o in outcomes:
        if o.step.kind != "capacity":
            continue
        m = o.metrics or {}
        row = {"config": o.step.params["config"]["name"], "status": o.status, "step": o.step.name, "error": o.error}
        row.update({k: m.get(k) for k in ("capacity_rps", "concurrency", "next_rps", "bracketed", "complete", "slo",
                                          "max_error_pct", "seconds", "probes_measured", "probes_reused", "command",
                                          "start_rps", "one_at_a_time_rps", "one_at_a_time_reused", "stopped_by",
                                          "stopped_probe")})
        row["probes"] = [{**{k: p.get(k) for k in ("rate_rps", "meets", "misses", "uncertain", "reused",
                                                   "mean_in_flight", "ci", *CAPACITY_PROBE_FIELDS)},
                          "rounds": len(p.get("rounds") or [p])} for p in m.get("probes") or []]
        by_artifact.setdefault(o.step.inputs["model"].key, []).append(row)
    return by_artifact


CAPACITY_PROBE_FIELDS = ("ttft_ms_p50", "ttft_ms_p99", "tpot_ms_p50", "itl_ms_p99", "e2e_ms_p99", "requests_s",
                         "output_tok_s", "errors", "requests", "arrival_rps", "saturated_rps", "saturated_rps_ci")


def _row(art: Artifact, artifact: StepOutcome | None, evals: dict, not_evaluated: str | None,
         load_checks: list[dict] | None = None, serving: list[dict] | None = None,
         tasks: list[dict] | None = None) -> dict:
    key = art.step.key
    ppl = evals.get((key, "perplexity")) or evals.get((key, "reference"))
    speed = evals.get((key, "throughput"))
    kld = ppl if ppl and "kld" in ppl.metrics else None
    own = artifact.metrics if artifact else {}   # a step may measure itself (a target that benchmarks its engine)

    def metric(evaluation: StepOutcome | None, name: str):
        return evaluation.metrics.get(name) if evaluation else own.get(name)

    return {
        "variant": art.label, "method": art.method, "detail": art.detail, "target": art.target,
        "format": art.step.format, "scheme": art.step.scheme or None,
        "status": artifact.status if artifact else "-",
        "size_bytes": artifact.size if artifact and artifact.record else None, "key": key,
        "digest": artifact.digest if artifact else None,
        "error": artifact.error if artifact else None, "log": artifact.log if artifact else None,
        "not_evaluated": not_evaluated,
        "ppl": metric(ppl, "ppl"), "kld": metric(kld, "kld"), "top1": metric(kld, "top1"),
        "decode_tok_s": metric(speed, "decode_tok_s"), "prefill_tok_s": metric(speed, "prefill_tok_s"),
        "ttft_ms": metric(speed, "ttft_ms"),
        # 95 % intervals over the repetitions (qbuild.evaluate.throughput), where there were two or more
        **{f"{k}_ci": metric(speed, f"{k}_ci") for k in ("decode_tok_s", "prefill_tok_s")},
        "load": load_label(load_checks or []), "load_check": load_checks or None, "tasks": tasks or [],
        **({"serving": serving} if serving is not None else {}),
        **({"search": _search_points(artifact.record)} if artifact and _search_points(artifact.record) else {}),
    }


def _search_points(record: dict | None) -> dict | None:
    """A searched artifact's measured candidates (size, KLD) and budget, for the report's KLD-vs-size plot."""
    search = ((record or {}).get("info") or {}).get("search")
    if not isinstance(search, dict) or not isinstance(search.get("candidates"), list):
        return None
    return {"budget": search.get("budget"), "chosen": search.get("chosen"),
            "candidates": [{"candidate": c.get("candidate"), "size_bytes": c.get("size_bytes"), "kld": c.get("kld"),
                            "meets_budget": c.get("meets_budget")} for c in search["candidates"]]}


def step_rows(plan: Plan, outcomes: list[StepOutcome]) -> tuple[list[dict], dict]:
    """One row per step run (status, key, digest, time, and why a built step missed) and the count per status."""
    planned = {ps.step.key: ps for ps in plan.steps}
    # why each built step missed (the planner's reasons, as `qbuild plan` shows them): `qbuild diff` reads them
    steps = [{"name": o.step.name, "kind": o.step.kind, "status": o.status, "key": o.step.key, "digest": o.digest,
              "seconds": round(o.seconds, 2), "error": o.error, "log": o.log, "started": o.started, "ended": o.ended,
              "why": list(planned[o.step.key].reasons) if o.step.key in planned and o.status == Outcome.BUILT else [],
              "worker": o.worker}
             for o in outcomes]
    counts = {s: sum(1 for o in outcomes if o.status == s)
              for s in (Outcome.BUILT, Outcome.CACHED, Outcome.FAILED, Outcome.SKIPPED)}
    return steps, counts


def summarize(plan: Plan, outcomes: list[StepOutcome]) -> dict:
    """One row per artifact of the plan (baseline, variants, target outputs), with its evaluations."""
    recipe = plan.recipe
    by_key = {o.step.key: o for o in outcomes}
    evals = _evaluations(outcomes)
    checks = _load_checks(outcomes)
    served = _serving(outcomes, goodput_slo(recipe)) if recipe.evaluation.serving else {}
    tasks = task_rows(outcomes)
    rows = [_row(a, by_key.get(a.step.key), evals, plan.not_evaluated.get(a.label), checks.get(a.step.key),
                 served.get(a.step.key, []) if recipe.evaluation.serving else None, tasks.get(a.step.key))
            for a in plan.artifacts]
    add_task_deltas(rows)
    if recipe.evaluation.serving and recipe.evaluation.serving.capacity:
        capacity = _capacity(outcomes)
        for a, r in zip(plan.artifacts, rows, strict=True):
            if a.step.key in capacity:
                r["capacity"] = capacity[a.step.key]
    base = rows[0] if rows and rows[0]["variant"] == "baseline" else None
    for r in rows:
        if base and r is not base:
            if r["ppl"] is not None and base["ppl"]:
                r["delta_ppl"] = r["ppl"] - base["ppl"]
                r["delta_ppl_pct"] = 100 * r["delta_ppl"] / base["ppl"]
            if r["decode_tok_s"] and base["decode_tok_s"]:
                r["throughput_ratio"] = r["decode_tok_s"] / base["decode_tok_s"]
    if recipe.evaluation.serving:
        _add_serving_quality(rows, outcomes, recipe, base["ppl"] if base else None)
    if recipe.evaluation.runtimes:
        others = _other_runtimes(outcomes)
        for r in rows:
            r["runtimes"] = others.get(r["key"], [])
            for o in r["runtimes"]:   # how far this runtime's number is from the artifact's own
                o["ppl_vs_own_pct"] = (100 * (o["ppl"] - r["ppl"]) / r["ppl"]
                                       if o["ppl"] is not None and r["ppl"] else None)
    steps, counts = step_rows(plan, outcomes)
    protocol = plan.protocol   # as evaluated: BOS as the model's own tokenizer has it, and why
    out = {"recipe": recipe.name, "variants": rows, "steps": steps, "counts": counts, "protocol": protocol,
           "warnings": list(plan.warnings), "overlap": plan.overlap}
    # the baseline against llama.cpp on its source file, a conversion against the checkpoint (models.import_check)
    checks = [o for o in outcomes if o.step.kind in CHECK_KINDS and o.status in (Outcome.BUILT, Outcome.CACHED)]
    if checks:
        out["fidelity_checks"] = [{"step": o.step.name, **o.metrics, **(o.record.get("info", {}) if o.record else {})}
                                  for o in checks]
    if recipe.evaluation.serving:
        out["goodput_slo"] = goodput_slo(recipe)
    if recipe.deploy is not None:
        from qbuild.results.deploy_report import from_outcomes

        out["deploy"] = from_outcomes(outcomes)
    if recipe.selection is not None:
        from qbuild.results.selection import select

        out["selection"] = select(recipe.selection, rows, recipe.evaluation.serving)
        chosen = out["selection"]["selected"]
        for r in rows:   # the selected artifact's row (and so its model card) carries how it met the bounds
            if chosen and r["variant"] == chosen["variant"]:
                r["selected"] = {"config": chosen["config"], "command": chosen["command"],
                                 "objective": recipe.selection.objective, "bounds": out["selection"]["bounds"],
                                 "tie": tie_line(out["selection"]) if out["selection"].get("tie") else None}
    return out


def _fmt(v, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def bos_line(protocol: dict) -> str:
    """One line: whether each perplexity window starts with BOS, and why."""
    return (f"perplexity windows {'start with BOS' if protocol['add_bos'] else 'have no BOS'}: "
            f"{protocol['bos_why']}")


def render_table(summary: dict, console) -> None:
    from rich.markup import escape
    from rich.table import Table

    rows = summary["variants"]
    table = Table(title=f"qbuild · {summary['recipe']}", title_justify="left")
    cols = [("variant", "left"), ("method", "left"), ("size", "right"), ("key", "left"), ("status", "left")]
    optional = [("PPL", "ppl", ".3f"), ("ΔPPL", "delta_ppl", "+.3f"), ("KLD", "kld", ".4f"), ("top-1", "top1", ".1%"),
                ("tok/s", "decode_tok_s", ".1f"), ("load", "load", "")]
    shown = [o for o in optional if any(r.get(o[1]) is not None for r in rows)]
    for name, justify in cols:
        table.add_column(name, justify=justify, overflow="fold")
    for name, _, _ in shown:
        table.add_column(name, justify="right", overflow="fold")
    style = {"built": "green", "cached": "cyan", "failed": "bold red", "skipped": "yellow"}
    for r in rows:
        method = "-" if r["method"] == "-" else f"{r['method']} {r['detail']}".strip()
        table.add_row(escape(r["variant"]), escape(method), human_size(r["size_bytes"]), (r["key"] or "")[:12],
                      f"[{style[r['status']]}]{r['status']}[/]" if r["status"] in style else escape(str(r["status"])),
                      *(plus_minus(r.get(field), r.get(f"{field}_ci"), spec) for _, field, spec in shown))
    console.print(table)
    if any(r.get("decode_tok_s_ci") for r in rows):
        console.print("tok/s: decode, ± half the 95 % interval over the throughput repetitions")
    _render_tasks(rows, console)
    _render_other_runtimes(rows, console)
    render_serving(summary, console)
    if summary.get("deploy"):
        from qbuild.results.deploy_report import deploy_lines

        for line in deploy_lines(summary["deploy"]):
            console.print(escape(line), highlight=False, soft_wrap=True)
    for check in summary.get("fidelity_checks") or []:
        _render_fidelity_check(check, console)
    if (summary.get("protocol") or {}).get("bos_why"):
        console.print(bos_line(summary["protocol"]), highlight=False, soft_wrap=True)
    c = summary["counts"]
    console.print(f"{c['built']} built, {c['cached']} cached, {c['failed']} failed, {c['skipped']} skipped")
    for r in rows:
        if r.get("not_evaluated"):
            console.print(f"[yellow]not evaluated: {escape(r['variant'])}[/] ({escape(str(r['format']))}): "
                          f"{escape(r['not_evaluated'])}")
    skipped: dict[str, list[str]] = {}   # one line per reason: a stopped search skips dozens of steps at once
    for s in summary["steps"]:
        if s["status"] == "skipped":
            skipped.setdefault(str(s["error"]), []).append(s["name"])
    for why, names in skipped.items():
        what = names[0] if len(names) == 1 else f"{len(names)} steps ({', '.join(names[:3])}{', ...' * (len(names) > 3)})"
        console.print(f"[yellow]skipped {escape(what)}[/]: {escape(why)}")
    for s in summary["steps"]:
        if s["status"] == "failed":   # the error's first line, then the lines a failed tool printed (tool_run)
            log = f"  (log: {escape(str(s['log']))})" if s.get("log") else ""
            first, *tool_lines = str(s["error"]).split("\n")
            console.print(f"[bold red]step {escape(s['name'])} failed[/]: {escape(first)}{log}", soft_wrap=True)
            for line in tool_lines:
                console.print(escape(line), highlight=False, soft_wrap=True)


def _render_fidelity_check(check: dict, console) -> None:
    """One line: how the imported baseline agrees with llama.cpp on its source file, or a GGUF conversion with the
    checkpoint."""
    what = ("import checked against llama.cpp on the source" if check["step"] == "import-check"
            else f"{check['step']}: the GGUF conversion through llama.cpp checked against the checkpoint")
    line = (f"{what} ({check.get('source_file_type', '?')}): "
            f"{check.get('tokens_compared')} tokens identical, KLD {_fmt(check.get('kld'), '.4f')}, "
            f"top-1 {_fmt(check.get('top1'), '.1%')}")
    if check.get("ppl") is not None:
        line += (f", PPL {check['ppl']:.3f} (transformers) vs {check['ppl_source']:.3f} (llama.cpp) "
                 f"({check['ppl_delta_pct']:+.2f} %) on the first windows")
    console.print(line, highlight=False, soft_wrap=True)


def _render_other_runtimes(rows: list[dict], console) -> None:
    """evaluation.runtimes: each artifact's numbers through another runtime, beside its own."""
    if not any(r.get("runtimes") for r in rows):
        return
    from rich.markup import escape
    from rich.table import Table

    table = Table(title="through other runtimes (evaluation.runtimes)", title_justify="left")
    for name in ("variant", "runtime", "status", "PPL", "vs own PPL", "KLD", "top-1"):
        table.add_column(name, justify="left" if name in ("variant", "runtime", "status") else "right")
    for r in rows:
        for o in r.get("runtimes") or []:
            table.add_row(escape(r["variant"]), escape(o["runtime"]), escape(str(o["status"])), _fmt(o["ppl"], ".3f"),
                          _fmt(o["ppl_vs_own_pct"], "+.2f") + (" %" if o["ppl_vs_own_pct"] is not None else ""),
                          _fmt(o["kld"], ".4f"), _fmt(o["top1"], ".1%"))
    console.print(table)


def _render_tasks(rows: list[dict], console) -> None:
    """One table of lm-eval task accuracy: acc ± stderr per artifact, and the flips against the baseline."""
    if not any(r.get("tasks") for r in rows):
        return
    from rich.markup import escape
    from rich.table import Table

    table = Table(title="tasks (lm-eval)", title_justify="left")
    for name in ("variant", "task", "acc", "± stderr", "right→wrong", "wrong→right", "flipped"):
        table.add_column(name, justify="left" if name in ("variant", "task") else "right")
    for r in rows:
        for t in r.get("tasks") or []:
            f = t["flips"]
            table.add_row(escape(r["variant"]), escape(t["task"]), _fmt(t["acc"], ".3f"), _fmt(t["acc_stderr"], ".3f"),
                          *((str(f["right_to_wrong"]), str(f["wrong_to_right"]), f"{f['pct']:.1f} %") if f else
                            ("-", "-", "-" if r["variant"] != "baseline" else "ref")))
    console.print(table)


def render_serving(summary: dict, console) -> None:
    """One table of serving points: artifact × config × concurrency (or request rate)."""
    from rich.markup import escape
    from rich.table import Table

    rows = [(r["variant"], p) for r in summary["variants"] for p in r.get("serving") or [] if "concurrency" in p
            or "request_rate" in p or "trace" in p]
    if not rows:
        return
    slo = summary.get("goodput_slo") or DEFAULT_GOODPUT_SLO
    rounds = {len(p.get("rounds") or []) or 1 for _, p in rows}
    spread = (f"; ± half the 95 % interval over {'/'.join(map(str, sorted(rounds)))} rounds"
              if any(p.get("ci") for _, p in rows) else "")
    table = Table(title="serving (ms; tok/s of the whole server; goodput: requests/s with TTFT ≤ "
                  f"{slo['ttft_ms']:g} ms and TPOT ≤ {slo['tpot_ms']:g} ms{spread})", title_justify="left")
    # the artifact's quality under each config (a quantized KV cache has its own pass) beside its KV-cache bytes
    quality = [c for c, field in (("KLD", "kld"), ("ΔPPL %", "delta_ppl_pct")) if any(p.get(field) is not None
                                                                                    for _, p in rows)]
    for col in ("variant", "config", "conc.", "TTFT p50", "TTFT p99", "TPOT p50", "ITL p99", "tok/s", "req/s",
                "goodput", "errors", "peak RSS", "KV B/tok", *quality):
        table.add_column(col, justify="left" if col in ("variant", "config") else "right")
    from qbuild.serving.confidence import with_ci  # here: a run without serving points never loads the client

    for variant, p in rows:
        where = (str(p["concurrency"]) if "concurrency" in p else f"{p['request_rate']:g}/s" if "request_rate" in p
                 else f"trace {p['trace']}")
        extra = {"KLD": _fmt(p.get("kld"), ".4f"), "ΔPPL %": _fmt(p.get("delta_ppl_pct"), "+.2f")}
        table.add_row(escape(variant), escape(p["config"]), where, with_ci(p, "ttft_ms_p50", ".1f"),
                      with_ci(p, "ttft_ms_p99", ".1f"), with_ci(p, "tpot_ms_p50", ".2f"), with_ci(p, "itl_ms_p99", ".2f"),
                      with_ci(p, "output_tok_s", ".1f"), with_ci(p, "requests_s", ".2f"),
                      _fmt(p["goodput_requests_s"], ".2f"),
                      str(p["errors"]), f"{p['peak_rss_mb']:.0f} MiB" if p.get("peak_rss_mb") else "-",
                      _fmt(p.get("kv_bytes_per_token"), ".0f"), *(extra[c] for c in quality))
    console.print(table)
    for line in [*turn_lines(rows), *capacity_lines(summary)]:
        console.print(escape(line))


def turn_lines(rows: list[tuple[str, dict]]) -> list[str]:
    """One line per point measured in conversations: TTFT p50 and the prompt's length, turn by turn."""
    from qbuild.serving.client import turns_text

    lines = []
    for variant, p in rows:
        if not p.get("by_turn"):
            continue
        where = f"concurrency {p['concurrency']}" if "concurrency" in p else f"{p.get('request_rate'):g} conversations/s"
        lines.append(f"{variant} {p['config']} {where}: TTFT p50 by turn: {turns_text(p['by_turn'])}")
    return lines


def capacity_lines(summary: dict) -> list[str]:
    """One line per capacity search: the rate, the concurrency it settled at, the next rate (missed), the probes."""
    lines = []
    for r in summary["variants"]:
        for c in r.get("capacity") or []:
            slo = ", ".join(f"{k} ≤ {v:g}" for k, v in (c.get("slo") or {}).items())
            if c.get("capacity_rps") is None:
                what = (f"not found ({c['status']}{': ' + c['error'] if c.get('error') else ''})"
                        if c["status"] not in ("built", "cached") else
                        f"not found: stopped by {c['stopped_by']} before a rate met the SLOs" if c.get("stopped_by")
                        else "no rate meets the SLOs")
            else:
                what = (f"{c['capacity_rps']:.4g} requests/s ({c['concurrency']} in flight"
                        + (f"; {c['next_rps']:.4g}/s missed" if c.get("next_rps") else "") + ")"
                        + ("" if c.get("complete") else "; stopped by max_minutes"))
            probes = (f"; {len(c['probes'])} probes, {c.get('probes_reused') or 0} reused" if c.get("probes") else "")
            lines.append(f"capacity {r['variant']} @ {c['config']} ({slo}, errors ≤ {c.get('max_error_pct')} %): "
                         f"{what}{probes}")
    return lines


def tie_line(selection: dict) -> str:
    """One line: which candidates tied on the objective (their intervals overlap) and how the tie was broken."""
    tie = selection["tie"]
    first = tie["candidates"][0]
    if selection["objective"] == "max_capacity":
        each = " and ".join(f"{c['variant']}@{c['config']}" for c in tie["candidates"])
        return (f"{each} have the same capacity, {first['capacity_rps']:.4g} requests/s; {tie['broken_by_text']} "
                f"(tie_break: {', '.join(selection['tie_break'])}): {first['variant']}@{first['config']}")
    each = " and ".join(f"{c['variant']}@{c['config']} {c['output_tok_s']:.4g}"
                        + (f" [{c['ci'][0]:.4g}, {c['ci'][1]:.4g}]" if c.get("ci") else "") for c in tie["candidates"])
    return (f"{each} tok/s overlap; {tie['broken_by_text']} (tie_break: {', '.join(selection['tie_break'])}): "
            f"{first['variant']}@{first['config']}")


def target_lines(target: dict) -> list[str]:
    """selection.target_rps: each candidate's servers needed at its capacity, and the cheapest choice."""
    lines = [f"servers needed for {target['rps']:g} requests/s (each at its capacity):"]
    for r in target["candidates"]:
        need = (f"{r['servers']} server(s) at {r['capacity_rps']:.4g} requests/s each"
                + (f", {r['memory_mb']:.0f} MiB in all" if r["memory_mb"] else "")) if r["servers"] else "no capacity found"
        lines.append(f"  {r['variant']} @ {r['config']}: {need}")
    c = target["cheapest"]
    lines.append(f"cheapest: {c['variant']} @ {c['config']}, {c['servers']} server(s)" if c
                 else "cheapest: none (no candidate meeting every bound has a capacity)")
    return lines


def render_selection(selection: dict, console) -> None:
    from rich.markup import escape

    sel = selection.get("selected")
    if sel:
        console.print(f"[bold green]selected[/]: {escape(sel['variant'])} @ {escape(str(sel['config']))} "
                      f"(objective {selection['objective']})")
        if sel.get("command"):
            console.print(f"  serve it with: {escape(sel['command'])}")
        for note in sel.get("uncertain") or []:   # on_uncertain: accept let these pass
            console.print(f"  [yellow]accepted within noise[/] (on_uncertain: accept): {escape(note)}")
    if selection.get("tie"):
        console.print(f"[yellow]tie[/]: {escape(tie_line(selection))}", soft_wrap=True)
    if not sel:
        console.print(f"[bold red]nothing meets every selection bound[/] (objective {selection['objective']})"
                      if not selection.get("reason") else f"[bold red]nothing selected[/]: {escape(selection['reason'])}")
    for r in selection["rejected"]:
        on = f" on {r['server']}" if r.get("server") and r["server"] != (sel or {}).get("server") else ""
        console.print(f"  {escape(r['variant'])} @ {escape(str(r['config']))}{escape(on)}: {escape(r['why'])}")
    if selection.get("target"):
        for line in target_lines(selection["target"]):
            console.print(escape(line))
    if selection.get("not_stored"):
        console.print(f"[yellow]not stored (run the recipe first)[/]: {escape(', '.join(selection['not_stored']))}")
