"""Garbage collection for a remote (and, through plan_gc, for the local store): never removes what a ref, a
tag or a registry alias points at, nor anything a kept object depends on (manifest inputs[*].digest).

    rows = gc_remote(remote, extra_roots=aliases, keep_last=3, older_than="30d", dry_run=True)
    # [{"digest", "kind", "name", "created", "bytes"}...]: what is (or would be) removed, and the bytes freed
"""

from __future__ import annotations

import calendar
import logging
import re
import time
from collections.abc import Iterable

from qbuild.artifacts.remote.base import RemoteRefused, RemoteStore
from qbuild.base.errors import UserError

AGE_RE = re.compile(r"^(\d+)\s*([smhdw])$")
UNIT = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


def parse_age(text: str | None) -> float | None:
    """'30d' / '12h' / '2w' -> seconds; None stays None."""
    if text is None:
        return None
    m = AGE_RE.match(str(text).strip().lower())
    if not m:
        raise UserError(f"--older-than {text!r}: expected a number and a unit (s, m, h, d, w), e.g. 30d")
    return int(m.group(1)) * UNIT[m.group(2)]


def _created(m: dict) -> float:
    stamp = m.get("created") or m.get("created_at") or ""
    try:
        return calendar.timegm(time.strptime(str(stamp)[:19], "%Y-%m-%dT%H:%M:%S"))
    except ValueError:
        return 0.0


def dependencies(m: dict) -> list[str]:
    inputs = m.get("inputs") or {}
    items = inputs.values() if isinstance(inputs, dict) else inputs
    return [i["digest"] for i in items if isinstance(i, dict) and isinstance(i.get("digest"), str)]


def plan_gc(manifests: dict[str, dict], roots: Iterable[str], keep_last: int | None = None,
            older_than: float | None = None, now: float | None = None) -> tuple[set[str], list[str]]:
    """(kept, removable) digests. Kept: the roots, the `keep_last` newest objects of each (recipe, step name),
    objects younger than `older_than` seconds, and everything any kept object depends on, transitively."""
    now = time.time() if now is None else now
    keep = {d for d in roots if d in manifests}
    if keep_last is not None:
        groups: dict[tuple, list[str]] = {}
        for d, m in manifests.items():
            groups.setdefault(((m.get("recipe") or {}).get("name"), m.get("name") or m.get("kind")), []).append(d)
        for digests in groups.values():
            keep.update(sorted(digests, key=lambda d: _created(manifests[d]), reverse=True)[:keep_last])
    if older_than is not None:
        keep.update(d for d, m in manifests.items() if now - _created(m) < older_than)
    stack = list(keep)
    while stack:  # dependency closure
        for dep in dependencies(manifests.get(stack.pop(), {})):
            if dep not in keep:
                keep.add(dep)
                stack.append(dep)
    return keep, sorted(d for d in manifests if d not in keep)


def gc_remote(remote: RemoteStore, extra_roots: Iterable[str] = (), keep_last: int | None = None,
              older_than: str | float | None = None, dry_run: bool = False) -> list[dict]:
    """Collect a remote. Roots: every ref on it plus `extra_roots` (MLflow alias targets, local refs...)."""
    age = parse_age(older_than) if isinstance(older_than, str) else older_than
    manifests = {}
    for d in remote.list_objects():
        try:
            m = remote.get_manifest(d)
        except RemoteRefused as exc:   # not an object qbuild can read: neither kept nor collected, named
            logging.getLogger("qbuild").warning(f"{exc}; left as it is")
            continue
        if m is not None:
            manifests[d] = m
    roots = {r["digest"] for r in remote.list_refs()} | set(extra_roots)
    _, remove = plan_gc(manifests, roots, keep_last, age)
    rows = _rows(manifests, remove)
    if not dry_run:
        for row in rows:
            remote.delete_object(row["digest"])
    return rows


def plan_store_gc(store, extra_roots: Iterable[str] = (), keep_last: int | None = None,
                  older_than: str | float | None = None) -> list[dict]:
    """`qbuild gc` for the local store, planning only (deleting is the Store's job: its objects are locked and
    read-only): the same rows as gc_remote. Roots: every local ref plus `extra_roots` (e.g. alias targets)."""
    import json

    age = parse_age(older_than) if isinstance(older_than, str) else older_than
    manifests = {}
    for obj in store.objects():
        try:
            manifests[obj.name] = json.loads((obj / "manifest.json").read_text())
        except (OSError, ValueError):
            continue
    roots = {r["digest"] for r in store.refs()} | set(extra_roots)
    _, remove = plan_gc(manifests, roots, keep_last, age)
    return _rows(manifests, remove)


def _rows(manifests: dict[str, dict], remove: list[str]) -> list[dict]:
    return [{"digest": d, "kind": manifests[d].get("kind"), "name": manifests[d].get("name"),
             "created": manifests[d].get("created"), "bytes": sum(f["size"] for f in manifests[d].get("files", []))}
            for d in remove]
