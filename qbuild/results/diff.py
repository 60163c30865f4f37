"""`qbuild diff RUN_A RUN_B`: what changed between two recorded runs of a recipe.

Per variant: Δ perplexity, ΔKLD, Δ decode throughput and the sizes. Per step run B built: why, relative to
run A (the same named step's action records compared: recipe parameter, source model digest, another
input, tool version, qbuild's implementation), else the reasons the planner recorded when B was planned.
"""

from __future__ import annotations

from qbuild.base.errors import UserError
from qbuild.pipeline.plan import change_reasons

METRICS = ("ppl", "kld", "top1", "decode_tok_s", "size_bytes")


def find_record(store, name: str) -> dict:
    """A run id (or a unique prefix of one). NAME follows the name grammar: it never becomes a path by itself."""
    from qbuild.artifacts.store import read_json
    from qbuild.base.names import valid_name

    if not valid_name(name):
        raise UserError(f"invalid run id {name[:80]!r}: use letters, digits, '.', '_' or '-'")
    exact = store.root / "runs" / f"{name}.json"
    found = [exact] if exact.is_file() else sorted((store.root / "runs").glob(f"{name}*.json"))
    if len(found) > 1:
        raise UserError(f"run id prefix {name!r} is ambiguous ({len(found)} runs)")
    if not found:
        raise UserError(f"no run {name!r} in store {store.root} (`qbuild diff --last RECIPE` compares its last two runs)")
    record = None if found[0].is_symlink() else read_json(found[0])
    if record is None:
        raise UserError(f"run record {found[0]} is unreadable or damaged")
    return record


def last_two(store, recipe: str) -> tuple[dict, dict]:
    runs = store.runs(recipe)
    if len(runs) < 2:
        raise UserError(f"recipe {recipe!r} has {len(runs)} run(s) in store {store.root}; a diff needs two")
    return runs[-2], runs[-1]


def _delta(a, b):
    return None if a is None or b is None else b - a


def _pct(a, b):
    return None if a is None or b is None or not a else 100 * (b - a) / a


def variant_rows(a: dict, b: dict) -> list[dict]:
    before = {r["variant"]: r for r in a.get("variants", [])}
    rows = []
    for r in b.get("variants", []):
        old = before.get(r["variant"], {})
        row = {"variant": r["variant"], "in_a": bool(old),
               "a": {m: old.get(m) for m in METRICS}, "b": {m: r.get(m) for m in METRICS},
               "digest_a": old.get("digest"), "digest_b": r.get("digest"),
               "same_artifact": bool(old) and old.get("digest") == r.get("digest")}
        row.update({"delta_ppl": _delta(old.get("ppl"), r.get("ppl")), "delta_ppl_pct": _pct(old.get("ppl"), r.get("ppl")),
                    "delta_kld": _delta(old.get("kld"), r.get("kld")),
                    "delta_decode_tok_s": _delta(old.get("decode_tok_s"), r.get("decode_tok_s")),
                    "delta_decode_pct": _pct(old.get("decode_tok_s"), r.get("decode_tok_s")),
                    "delta_size_bytes": _delta(old.get("size_bytes"), r.get("size_bytes"))})
        rows.append(row)
    gone = [v for v in before if v not in {r["variant"] for r in b.get("variants", [])}]
    for v in gone:
        rows.append({"variant": v, "in_a": True, "in_b": False, "a": {m: before[v].get(m) for m in METRICS}, "b": {}})
    return rows


def _build_record(store, key: str | None) -> dict | None:
    """The action record of a step key (params, inputs, toolchain, impl), if the store still has it."""
    if not key:
        return None
    from qbuild.artifacts.store import read_json

    record = read_json(store._action_file(key))
    inputs = record.get("inputs") if record else None
    if not isinstance(inputs, dict) or not all(isinstance(i, dict) for i in inputs.values()):
        return None   # missing, damaged or from another version: the diff says "why" is unknown
    return {"params": record.get("params", {}), "toolchain": record.get("toolchain", {}),
            "impl": record.get("impl", 1), "kind": record.get("kind"),
            "inputs": {role: i.get("key") for role, i in (record.get("inputs") or {}).items()},
            "input_steps": {role: i.get("step") for role, i in (record.get("inputs") or {}).items()}}


def step_rows(store, a: dict, b: dict) -> list[dict]:
    """Every step run B built, with why (relative to run A where both builds are on record)."""
    before = {s["name"]: s for s in a.get("steps", [])}
    rows = []
    for s in b.get("steps", []):
        if s["status"] != "built":
            continue
        old = before.get(s["name"])
        if old is None:
            reasons = [{"kind": "new", "detail": "not in run A"}]
        elif old["key"] == s["key"]:
            reasons = [{"kind": "object missing", "detail": "same key as in run A: its object was deleted or damaged"}]
        else:
            ra, rb = _build_record(store, old["key"]), _build_record(store, s["key"])
            if old.get("kind") == "model" or s.get("kind") == "model":
                reasons = [{"kind": "source model digest", "detail": "the source model's files changed"}]
            elif ra and rb:
                reasons = change_reasons(ra, rb) or [{"kind": "key", "detail": "key changed"}]
            else:  # an object collected since: what the planner said when run B was planned
                reasons = s.get("why") or [{"kind": "key", "detail": "key changed"}]
        rows.append({"step": s["name"], "kind": s.get("kind"), "key_a": old["key"] if old else None, "key_b": s["key"],
                     "reasons": reasons})
    # a changed source model is never "built" (it is an input), but it is why much else was: show it
    for s in b.get("steps", []):
        old = before.get(s["name"])
        if s.get("kind") == "model" and s["status"] == "source" and old and old["key"] != s["key"]:
            rows.insert(0, {"step": s["name"], "kind": "model", "key_a": old["key"], "key_b": s["key"],
                            "reasons": [{"kind": "source model digest", "detail": "the source model's files changed"}],
                            "source": True})
    return rows


def diff_runs(store, a: dict, b: dict) -> dict:
    if a.get("recipe") != b.get("recipe"):
        note = f"runs of different recipes ({a.get('recipe')} vs {b.get('recipe')})"
    else:
        note = None
    return {"a": a.get("run_id"), "b": b.get("run_id"), "recipe": b.get("recipe"), "note": note,
            "variants": variant_rows(a, b), "rebuilt": step_rows(store, a, b)}


def _num(v, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def render(data: dict, console) -> None:
    from rich.markup import escape
    from rich.table import Table

    from qbuild.base.units import human_size

    table = Table(title=f"diff · {data['recipe']} · {data['a']} → {data['b']}", title_justify="left")
    for col, just in (("variant", "left"), ("PPL", "right"), ("ΔPPL", "right"), ("ΔKLD", "right"),
                      ("tok/s", "right"), ("Δtok/s", "right"), ("size", "right"), ("artifact", "left")):
        table.add_column(col, justify=just)
    for r in data["variants"]:
        b = r.get("b") or {}
        if r.get("in_b") is False:
            table.add_row(escape(r["variant"]), "-", "-", "-", "-", "-", "-", "[yellow]only in A[/]")
            continue
        dppl = _num(r["delta_ppl"], "+.3f") + (f" ({r['delta_ppl_pct']:+.1f}%)" if r["delta_ppl_pct"] is not None else "")
        dtok = _num(r["delta_decode_tok_s"], "+.1f") + (f" ({r['delta_decode_pct']:+.1f}%)"
                                                        if r["delta_decode_pct"] is not None else "")
        size = human_size(b.get("size_bytes"))
        if r["delta_size_bytes"]:
            size += f" ({'+' if r['delta_size_bytes'] > 0 else '-'}{human_size(abs(r['delta_size_bytes']))})"
        where = "new in B" if not r["in_a"] else ("same" if r["same_artifact"] else "rebuilt")
        table.add_row(escape(r["variant"]), _num(b.get("ppl"), ".3f"), dppl, _num(r["delta_kld"], "+.4f"),
                      _num(b.get("decode_tok_s"), ".1f"), dtok, size, where)
    console.print(table)
    if data.get("note"):
        console.print(f"[yellow]note[/]: {escape(data['note'])}")
    if not data["rebuilt"]:
        console.print("no step rebuilt: run B reused every object of run A")
    for s in data["rebuilt"]:
        why = "; ".join(f"{r['kind']}: {r['detail']}" for r in s["reasons"])
        console.print(f"{'changed' if s.get('source') else 'rebuilt'} [bold]{escape(s['step'])}[/]: {escape(why)}")
