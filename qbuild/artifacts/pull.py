"""`qbuild pull`: a name (ref, digest, or an MLflow registry name) resolved to an object in the local store or a
remote, the build that fits this machine where a target's builds are machine-bound (a TensorRT engine), its files
verified and written out without following links."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING

from qbuild.artifacts.access import open_remotes, open_store
from qbuild.base.errors import UserError

if TYPE_CHECKING:
    from qbuild.artifacts.store import Store

log = logging.getLogger("qbuild")


def pull(name: str, *, store=None, out: str | Path | None = None, need: dict | None = None, remote=None,
         machine: dict | None = None, verify_with: str | Path | None = None, tracking_uri: str | None = None,
         progress=None, force: bool = False) -> tuple[str, Path]:
    """qbuild.api.pull: (digest, path)."""
    if name.startswith("models:/"):
        import os

        from qbuild.artifacts.mlflow_registry import resolve_models_uri

        uri = tracking_uri or os.environ.get("MLFLOW_TRACKING_URI")
        if not uri:
            raise UserError(f"{name}: set MLFLOW_TRACKING_URI (or pass --mlflow) to resolve registry names")
        name, store_url = resolve_models_uri(name, uri)
        if store_url.startswith("qbuild-file://"):
            store = store or store_url.removeprefix("qbuild-file://")
        elif remote is None:
            remote = _remote_named_by_registry(store_url)
    if remote is not None:
        return _pull_remote(name, remote, out, need, verify_with, progress, machine)
    if verify_with is not None:
        raise UserError("--verify-with checks the signature pushed with an artifact: pull it from its remote "
                        "(--from REMOTE) or by registry name (models:/NAME@ALIAS)")
    return _pull_local(name, open_store(store), out, need, progress, force, machine)


def _remote_named_by_registry(url: str):
    """The remote a registry version's tag names. It may use qbuild's credential variables only when the user
    configured that host themselves (QBUILD_REMOTE): a tag must not send QBUILD_REGISTRY_PASSWORD to any host."""
    from urllib.parse import urlsplit

    from qbuild.artifacts.remote import open_remote, remotes_from_env

    def netloc(u: str) -> str:   # host and port: another port on the same host is another registry
        return urlsplit(u).netloc.rsplit("@", 1)[-1].lower()

    configured = {netloc(u) for u in remotes_from_env()}
    return open_remote(url, env_credentials=bool(netloc(url)) and netloc(url) in configured)


def machine_bound_targets() -> list:
    """Targets whose builds load only on the machine they were built for (TensorRT-LLM engines)."""
    from qbuild.contract.plugin import targets

    return [t for t in targets.all() if t.machine_bound_kind]


def pull_options() -> list[dict]:
    """The `qbuild pull` flags targets declare to pick a machine-bound build for another machine."""
    seen: dict[str, dict] = {}
    for t in machine_bound_targets():
        for o in t.pull_options:
            seen.setdefault(o.flag, {"flag": o.flag, "key": o.key, "help": o.help})
    return list(seen.values())


def _builds_of(manifests, target, recipe: str, variant: str) -> list[dict]:
    """The manifests among `manifests` that are builds of recipe/variant by `target`, newest first."""
    found = [m for m in manifests if isinstance(m, dict) and m.get("kind") == target.machine_bound_kind
             and m.get("variant") == variant and (m.get("recipe") or {}).get("name") == recipe]
    return sorted(found, key=lambda m: m.get("created", ""), reverse=True)


def _manifests(src):
    """Every readable manifest of a store or remote (the shared reading interface, qbuild.artifacts.StoreReader);
    a remote object whose manifest is refused is no candidate, and fails alone."""
    from qbuild.artifacts.remote.base import RemoteRefused

    for digest in src.list_objects():
        try:
            yield src.get_manifest(digest)
        except RemoteRefused as exc:   # `verify --remote` names it; here it is only no candidate
            log.debug(f"{exc}; skipped")


def _machine_bound_family(name: str, manifest: dict | None, all_manifests):
    """(target, builds newest first) when NAME names a machine-bound build, or a family of them that no ref names
    (builds are found by recipe/variant); (None, []) otherwise."""
    from qbuild.artifacts.store import REF_RE

    bound = machine_bound_targets()
    target = next((t for t in bound if manifest is not None and t.machine_bound_kind == manifest.get("kind")), None)
    if manifest is not None and target is None:
        return None, []
    m = REF_RE.match(name)
    family: list[dict] = []
    if m:
        manifests = list(all_manifests())
        for t in [target] if target else bound:
            family = _builds_of(manifests, t, m.group("recipe"), m.group("variant"))
            if family:
                target = t
                break
    if target is not None and manifest is not None and manifest not in family:
        family = [manifest, *family]
    return (target, family) if family else (None, [])


def _choose_build(target, family: list[dict], need: dict | None, machine: dict | None, where: str) -> str:
    need = need or target.machine_needs(dict(machine or {}))
    return target.select_build(family, need, where)["digest"]


def _pull_remote(name, remote, out, need, verify_with, progress, machine=None) -> tuple[str, Path]:
    from qbuild.artifacts.remote import RemoteError, open_remote
    from qbuild.artifacts.remote.cache import pull as pull_from
    from qbuild.artifacts.remote.cache import resolve

    r = open_remote(remote) if isinstance(remote, str) else remote
    if out is None:
        raise UserError(f"pulling from {r.display} needs a destination: --out DIR")
    where = f"{name} on {r.display}"
    try:
        digest = resolve(r, name)
        target, family = _machine_bound_family(name, r.get_manifest(digest) or {}, lambda: _manifests(r))
    except RemoteError as exc:
        if not exc.reason.startswith(("no ref", "no object")):
            raise
        target, family = _machine_bound_family(name, None, lambda: _manifests(r))
        if target is None:
            raise
        try:   # this machine's facts cannot be read: the name's own error says more
            need = need or target.machine_needs(dict(machine or {}))
        except UserError:
            raise exc from None
    if target is not None:
        digest = _choose_build(target, family, need, machine, where)
    manifest = pull_from(r, digest, Path(out), progress=progress, verify_with=verify_with, requested=name)
    return manifest["digest"], Path(out)


def _pull_local(name: str, st: Store, out, need, progress, force: bool = False, machine=None) -> tuple[str, Path]:
    try:
        digest = st.resolve(name)
    except UserError:
        target, family = _machine_bound_family(name, None, lambda: _manifests(st))
        if target is None:
            raise
        digest = family[0]["digest"]
    if not (st.object_dir(digest) / "manifest.json").is_file():
        _fetch_missing(st, digest, progress)  # a ref set by a run that hit a remote: read through now
    target, family = _machine_bound_family(name, st.manifest(digest), lambda: _manifests(st))
    if target is not None:
        digest = _choose_build(target, family, need, machine, name)
    from qbuild.artifacts.store.export import damaged, export_object

    if out is None:
        rows = st.verify([digest])
        if not rows[0]["ok"]:
            raise damaged(name, digest, rows[0]["problems"])
        return digest, st.object_dir(digest)
    return digest, export_object(st, digest, Path(out), name, force=force)


def _fetch_missing(st: Store, digest: str, progress) -> None:
    from qbuild.artifacts.remote.base import RemoteRefused
    from qbuild.artifacts.remote.cache import materialize

    refused = None
    for r in open_remotes():
        try:
            if r.get_manifest(digest) is not None:
                materialize(st, r, digest, progress=progress)
                return
        except RemoteRefused as exc:   # this remote's copy is not the object: the next remote may have it
            refused = exc
    if refused is not None:
        raise refused
    raise UserError(f"object {digest[:12]} is not in store {st.root}, and no remote (QBUILD_REMOTE / --from) has it")


def verified_as(name: str, digest: str, path: str | Path) -> str:
    """What a `pull NAME --verify-with KEY` into `path` verified: the name the signature binds and the object
    ("demo/q4km (object <digest>)"); a registry name (models:/...) is bound by the digest it resolved to."""
    import json

    from qbuild.artifacts.signing import SIDECAR_DIR, STATEMENT, check_binding

    statement = json.loads((Path(path) / SIDECAR_DIR / STATEMENT).read_text())
    manifest = json.loads((Path(path) / "manifest.json").read_text())
    bound = digest if name.startswith("models:/") else name
    what = check_binding(statement, manifest, bound)
    return what if bound == name else f"{name} = {what}"
