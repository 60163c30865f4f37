"""The local store and the remote tiers, opened from what a caller gives (a Store, a path, URLs, a recipe's store
section), and what `qbuild ls`, `verify`, `tag`, `gc` and `register` do with them: the store and a remote answer the
same reading calls (qbuild.artifacts.StoreReader)."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from qbuild.base.errors import QBuildError, UserError

if TYPE_CHECKING:
    from qbuild.artifacts.store import Store


def open_store(store=None, recipe=None) -> Store:
    """A Store, a path, or None: --store / QBUILD_STORE / the recipe's store.path / ./artifacts."""
    from qbuild.artifacts.store import Store
    from qbuild.artifacts.store import open_store as _open

    if isinstance(store, Store):
        return store
    return _open(store, recipe.store.path if recipe else None)


def open_remotes(recipe=None, urls: list[str] | tuple[str, ...] = ()) -> tuple:
    """The remote tiers: --remote URLs (or QBUILD_REMOTE) beat the recipe's store.remotes."""
    from qbuild.artifacts.remote import open_remote, remotes_from_env

    given = remotes_from_env(urls)
    if given:
        return tuple(open_remote(u) for u in given)
    return tuple(spec.open() for spec in (recipe.store.remotes if recipe else ()))


def union_remotes(recipes) -> tuple:
    """The remotes the recipes name, each once, in order."""
    seen: dict = {}
    for r in recipes:
        for spec in r.store.remotes:
            seen.setdefault(spec.url, spec)
    return tuple(spec.open() for spec in seen.values())


def check_verify(verify: str) -> None:
    from qbuild.artifacts.store import VERIFY_MODES

    if verify not in VERIFY_MODES:
        raise UserError(f"verify must be one of {', '.join(VERIFY_MODES)}, not {verify!r}")


def reader(store=None, remote: str | None = None):
    """The local store, or the remote at URL `remote`: both answer the same reading calls below."""
    if remote:
        from qbuild.artifacts.remote import open_remote

        return open_remote(remote)
    return open_store(store)


def refs(*, store=None, remote: str | None = None) -> tuple[str, list[dict]]:
    """(where, rows): every ref of the local store (or of `remote`) with its digest, kind, format, size and dates; a
    ref whose object or manifest is missing or unreadable says so in `problem`."""
    from qbuild.artifacts.store import valid_files

    src = reader(store, remote)
    rows = []
    for ref in src.list_refs():
        try:
            m = src.get_manifest(ref["digest"]) or {}
        except (OSError, ValueError, QBuildError):
            m = {}
        if not isinstance(m, dict):
            m = {}
        files = m.get("files") if valid_files(m.get("files")) else []
        rows.append({**ref, "kind": _text(m.get("kind")), "format": _text(m.get("format")),
                     "size_bytes": sum(f["size"] for f in files), "created": _text(m.get("created")),
                     **({} if m else {"problem": "object or manifest missing"})})
    return f"{'remote' if remote else 'store'} {src.display}", rows


def _text(value) -> str | None:
    return value if isinstance(value, str) else None


def verify(names=(), *, store=None, remote: str | None = None, deep: bool = False, repair: bool = False) -> list[dict]:
    """Re-hash stored objects (all, or the named refs/digests) against their manifests: one row per object, `ok`
    and its `problems`. `repair` quarantines the damaged ones (local store); `deep` streams and hashes a remote's
    files (`qbuild verify --remote` does unless --quick), and a remote's rows say whether an action record binds the
    object's manifest (`provenance`)."""
    if remote:
        from qbuild.artifacts.remote.cache import resolve

        r = reader(remote=remote)
        return r.verify([resolve(r, n) for n in names] if names else None, deep=deep)
    st = open_store(store)
    if repair:
        st.require_writable("verify --repair")
    return st.verify([st.resolve(n) for n in names] if names else None, repair=repair)


def tag(source: str, target: str, *, store=None, remote: str | None = None) -> str:
    """Point the ref TARGET (recipe/variant:tag) at SOURCE (a ref or a digest) in the local store or `remote`;
    returns the digest."""
    from qbuild.artifacts.store import REF_RE

    m = REF_RE.match(target)
    if not m or not m.group("tag") or any(v in (".", "..") for v in m.groups()):
        raise UserError(f"{target!r}: expected recipe/variant:tag (letters, digits, '.', '_', '-')")
    if remote:
        from qbuild.artifacts.remote.cache import resolve

        r = reader(remote=remote)
        digest = resolve(r, source)
        r.set_ref(m.group("recipe"), m.group("variant"), m.group("tag"), digest, (r.get_manifest(digest) or {}).get("key"))
        return digest
    st = open_store(store)
    digest = st.resolve(source)
    st.set_ref(m.group("recipe"), m.group("variant"), m.group("tag"), digest, st.manifest(digest).get("key"))
    return digest


def gc(*, store=None, remote: str | None = None, keep_last: int | None = None, older_than: str | None = None,
       dry_run: bool = False, mlflow_uri: str | None = None) -> dict:
    """Collect garbage. Local store: stale scratch, unheld locks, and logs, run records and quarantined objects older
    than `older_than` (default 30d; the `keep_last` newest runs, default 20, stay). A remote: objects no ref, tag or
    registry alias reaches. Returns {"removed": [...], "bytes_freed", "dry_run", "scope": "local" | "remote"}."""
    from qbuild.artifacts.remote.gc import gc_remote, parse_age

    if not remote:
        rows = open_store(store).gc_housekeeping(parse_age(older_than or "30d"),
                                                 keep_runs=20 if keep_last is None else keep_last, dry_run=dry_run)
        return {"removed": rows, "bytes_freed": sum(r["bytes"] for r in rows), "dry_run": dry_run, "scope": "local"}
    roots: set[str] = set()
    uri = mlflow_uri or os.environ.get("MLFLOW_TRACKING_URI")
    if uri:
        from qbuild.artifacts.mlflow_registry import alias_digests

        roots = alias_digests(uri)
    rows = gc_remote(reader(remote=remote), roots, keep_last, older_than, dry_run)
    return {"removed": rows, "bytes_freed": sum(r.get("bytes", 0) for r in rows), "dry_run": dry_run,
            "scope": "remote"}


def register_model(name: str, model_name: str, *, alias: str | None = None, mlflow_uri: str | None = None,
                   remote: str | None = None, store=None) -> str:
    """Register the artifact NAME as a new version of an MLflow registered model; returns the version."""
    from qbuild.artifacts import mlflow_registry

    uri = mlflow_uri or os.environ.get("MLFLOW_TRACKING_URI")
    if not uri:
        raise UserError("register needs --mlflow URI or MLFLOW_TRACKING_URI")
    st = open_store(store)
    digest = st.resolve(name)
    manifest = {**st.manifest(digest), "digest": digest}
    store_url = reader(remote=remote).url if remote else f"qbuild-file://{st.root}"
    return mlflow_registry.register(uri, model_name, manifest, store_url, manifest.get("metrics"),
                                    gates_passed=True if alias else None, alias=alias)
