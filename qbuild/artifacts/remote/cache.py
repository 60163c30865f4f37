"""Read-through / write-through between the local store and its remotes: what plan, run and pull call.

    hit = lookup(remotes, key)                 # plan: local miss -> first remote with the action record
    materialize(store, hit.remote, hit.digest) # only when a step that must run (or the user) needs the files
    push_hit(remote, store, key, digest, ...)  # run: files, sidecars, manifest, then the action record
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from qbuild.artifacts.remote.base import MANIFEST, Progress, RemoteError, RemoteRefused, RemoteStore, remote_record
from qbuild.artifacts.remote.resume import store_resume
from qbuild.artifacts.store import REF_RE, Store
from qbuild.artifacts.store.binding import MANIFEST_DIGEST, manifest_digest
from qbuild.base.errors import UserError
from qbuild.base.owned import OwnedRoot, output_root

log = logging.getLogger("qbuild")


@dataclass(frozen=True)
class RemoteHit:
    remote: RemoteStore
    key: str
    digest: str
    record: dict

    @property
    def where(self) -> str:
        """For `qbuild plan`: hit (remote NAME)."""
        return f"remote {self.remote.name}"


def lookup(remotes: Iterable[RemoteStore], key: str) -> RemoteHit | None:
    """First remote whose action cache has `key` with a complete object. Downloads the record only."""
    for remote in remotes:
        record = remote_record(_action_or_none(remote, key), key)   # a plugin remote's record is checked here too
        if record is not None:
            return RemoteHit(remote, key, record["digest"], record)
    return None


def _action_or_none(remote: RemoteStore, key: str) -> dict | None:
    """The remote's action record of `key`; a refused one (not JSON, too large) fails alone: a miss, one warning."""
    try:
        return remote.get_action(key)
    except RemoteRefused as exc:
        log.warning(f"{exc}; taken as a miss")
        return None


def materialize(store: Store, remote: RemoteStore, digest: str, key: str | None = None, record: dict | None = None,
                progress: Progress | None = None, jobs: int | None = None) -> Path:
    """Fetch object `digest` into the local store (every file verified), then adopt its action record.

    Stages under the store's tmp/ (an interrupted fetch resumes from there) and renames into objects/ only
    when complete, so the local store never shows a partial object.
    """
    dest = store.object_dir(digest)
    with store.lock(f"fetch-{digest}"):
        if not (dest / MANIFEST).is_file():
            remote.fetch_object(digest, dest, progress=progress, jobs=jobs,
                                staging=store.root / "tmp" / f"fetch-{digest[:32]}", root=store.owned,
                                keys=(key,) if key else (), records=(record,) if record else (), lock=False)
            for f in dest.rglob("*"):
                if f.is_file() and not f.is_symlink():
                    store.owned.chmod(f, 0o444, within=dest)
    if key and record:
        adopt_action(store, key, record)
    return dest


def adopt_action(store: Store, key: str, record: dict) -> None:
    """Record a remote action locally (its object must already be in the local store)."""
    if (store.object_dir(record["digest"]) / MANIFEST).is_file():
        store.write_json(store.root / "actions" / key[:2] / f"{key}.json", record)


def push_hit(remote: RemoteStore, store: Store, key: str, digest: str, record: dict | None = None,
             sidecars: dict[str, bytes] | Callable[[], dict[str, bytes]] | None = None,
             refs: Iterable[tuple[str, str, str]] = (), progress: Progress | None = None,
             check_content: bool = False) -> bool:
    """Write-through of one local object: files, sidecars and manifest, then the action record (the commit
    point), then refs. Safe to call for every hit of every run: when the remote already has the action record
    only the refs are set; an interrupted upload is finished (blobs already there are skipped). `sidecars` may
    be a callable (e.g. lambda: build_sidecars(...)) so cards are rendered and artifacts signed only when an
    upload really happens. Returns True when something was uploaded.

    A file present with its size is trusted as uploaded unless its content was found damaged: by this process
    (remote.damaged: a fetch or verify that failed on it), or, with `check_content` (`qbuild push`), by streaming
    the remote's copy of the object the action record names and hashing it (one download of that object; no
    remote offers a checksum qbuild can trust instead: S3's ETag is the MD5 the upload had, not a hash of what the
    bucket holds now, and a file:// share has none). A damaged object is uploaded again, the damaged files and
    manifest replaced, and its action record rewritten."""
    have = _action_or_none(remote, key)   # a refused record is replaced by this push
    if check_content and have is not None and not remote.damaged.get(have["digest"]):
        _check_remote_copy(remote, have)
    stale = have is not None and bool(remote.damaged.get(have["digest"]))
    uploaded = have is None or stale or bool(remote.damaged.get(digest))
    if uploaded:
        manifest = json.loads((store.object_dir(digest) / MANIFEST).read_text())
        extra = sidecars() if callable(sidecars) else sidecars
        replace = sorted(remote.damaged.get(digest, ()))
        # one push of an object at a time from this store: its unfinished-upload records are never shared
        with store.lock(f"push-{digest}"):
            remote.put_object(digest, store.object_dir(digest), manifest, progress=progress, sidecars=extra,
                              resume=store_resume(store), **({"replace": replace} if replace else {}))
        remote.damaged.pop(digest, None)
        remote.put_action(key, _bound_record(remote, digest, manifest, record))
    for recipe, variant, tag in refs:
        remote.set_ref(recipe, variant, tag, digest, key)
    return uploaded


def _check_remote_copy(remote: RemoteStore, record: dict) -> None:
    """Hash the remote's copy of the object `record` names and check its manifest against the record; what is
    damaged lands in remote.damaged. A copy that is not there at all is left to the push (it uploads what is
    missing)."""
    digest = record["digest"]
    try:
        manifest = remote.get_manifest(digest)
    except RemoteRefused:
        remote._mark_damaged(digest, MANIFEST)
        return
    if manifest is None or not remote.has_object(digest):
        remote._mark_damaged(digest, MANIFEST)   # incomplete: the upload sends what is missing, then the manifest
        return
    remote.content_problems(digest, manifest)
    try:
        remote.check_provenance(digest, manifest, records=(record,))
    except RemoteRefused:
        pass   # marked damaged: its manifest is replaced


def _bound_record(remote: RemoteStore, digest: str, manifest: dict, record: dict | None) -> dict:
    """The action record to commit: this store's record (or the object's manifest), binding the remote's
    manifest.json (manifest_digest, store/binding.py) only when it is this store's: an object another machine
    pushed first keeps that machine's manifest, which this record cannot vouch for."""
    out = dict(record or {**manifest, "object_manifest_key": manifest.get("key")})
    out.pop(MANIFEST_DIGEST, None)
    try:
        there = remote.get_manifest(digest)
    except RemoteRefused:
        there = None
    if there is not None and manifest_digest(there) == manifest_digest(manifest):
        out[MANIFEST_DIGEST] = manifest_digest(manifest)
    return out


def build_sidecars(store: Store, digest: str, summary_row: dict | None = None, protocol: dict | None = None,
                   gates: dict | None = None, base_model: str | None = None, signing_key: str | os.PathLike | None = None,
                   source: dict | None = None, hardware: dict | None = None, names: Iterable[str] = (),
                   previous: tuple[bytes, bytes] | None = None) -> dict[str, bytes]:
    """What travels with a pushed artifact: the model card, and with a signing key (or QBUILD_SIGNING_KEY)
    the SLSA provenance statement and the model-signing signature, bound to `names` (recipe/variant; see
    signing.sign for `previous`). Pass the result to push_hit(sidecars=)."""
    from qbuild.artifacts import signing
    from qbuild.artifacts.modelcard import render_model_card

    obj = store.object_dir(digest)
    manifest = json.loads((obj / MANIFEST).read_text())
    out = {"README.md": render_model_card(manifest, summary_row, protocol, gates, base_model).encode()}
    key = signing.signing_key(signing_key)
    if key is not None:
        statement, signature = signing.sign(obj, manifest, key, source=source, hardware=hardware, names=names,
                                            previous=previous)
        out[signing.STATEMENT], out[signing.SIGNATURE] = statement, signature
    return out


def should_push(remote: RemoteStore, when: str) -> bool:
    """when='step' (right after a step published) or 'success' (the run finished, gates passed)."""
    return remote.push == "always" or (remote.push == "on-success" and when == "success")


def resolve(remote: RemoteStore, name: str) -> str:
    """REF (recipe/variant[:tag]) or a full digest, on the remote; RemoteError when it has neither."""
    return resolve_ref(remote, name)[0]


def resolve_ref(remote: RemoteStore, name: str) -> tuple[str, str | None]:
    """(digest, the step key its ref names or None) of REF or a full digest on the remote."""
    m = REF_RE.match(name)
    if m:
        tag = m.group("tag") or "latest"
        ref = remote.get_ref(m.group("recipe"), m.group("variant"), tag)
        if ref is None:
            raise remote.error(f"no ref {m.group('recipe')}/{m.group('variant')}:{tag}")
        return ref["digest"], ref.get("key") if isinstance(ref.get("key"), str) else None
    digest = name.removeprefix("sha256:").lower()
    if len(digest) == 64 and remote.get_manifest(digest) is not None:
        return digest, None
    raise remote.error(f"no object {name} (give a ref recipe/variant:tag or a full 64-character digest)")


SIDECARS = ("README.md", "provenance.intoto.json", "signature.sig")


def pull(remote: RemoteStore, name: str, out: Path, progress: Progress | None = None, jobs: int | None = None,
         verify_with: str | os.PathLike | None = None, sidecars: Iterable[str] = SIDECARS,
         requested: str | None = None) -> dict:
    """`qbuild pull NAME --from REMOTE --out DIR [--verify-with PUBKEY]` without a local store: resolve the
    name (a ref or a digest: qbuild.api picks a machine-bound build first), fetch every file verified, add the model
    card and signature sidecars, check the signature when asked (bound to `requested`, the name the user asked
    for, else `name`), and only then make DIR appear (one rename). Every write stays inside DIR's folder and
    follows no link (qbuild/base/owned.py)."""
    out = Path(out).absolute()
    if out.is_symlink():   # refused before anything is downloaded, like a local pull
        raise UserError(f"--out {out} is a symlink; give the folder itself (a pull never writes through a link)")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise UserError(f"--out {out} exists and is not empty; give a new or empty folder")
    digest, ref_key = resolve_ref(remote, name)
    if ref_key is None and requested and requested != name and REF_RE.match(requested):
        try:   # qbuild.api resolved the name (or picked a machine-bound build): its ref's record binds it too
            named, key = resolve_ref(remote, requested)
            ref_key = key if named == digest else None
        except RemoteError:
            pass
    out.parent.mkdir(parents=True, exist_ok=True)
    root = output_root(out.parent)

    def check_signature(folder: Path) -> None:
        if verify_with is not None:
            from qbuild.artifacts.signing import verify

            verify(folder, verify_with, name=requested or name)

    def prepare(tree: Path) -> None:
        write_sidecars(remote, digest, tree, sidecars, root)
        try:
            check_signature(tree)
        except Exception:
            root.remove(tree.parent)   # the staging this pull made: what the key refuses is not kept to resume
            raise

    return remote.fetch_object(digest, out, progress=progress, jobs=jobs, root=root, prepare=prepare,
                               staging=out.with_name(f".{out.name}.partial-{digest[:16]}"),
                               keys=(ref_key,) if ref_key else (), warn_unbound=True, check_present=check_signature)


def write_sidecars(remote: RemoteStore, digest: str, out: Path, names: Iterable[str],
                   root: OwnedRoot | None = None) -> list[Path]:
    """Place sidecars beside a pulled object: README.md (if the object has none) and .qbuild/<name>; inside `root`
    (by default out's folder), never through a link."""
    out = Path(out).absolute()
    root = root or output_root(out.parent)
    written = []
    files = {f["path"] for f in (remote.get_manifest(digest) or {}).get("files", [])}
    for name in names:
        data = remote.get_sidecar(digest, name)
        if data is None:
            continue
        rel = name if name == "README.md" and "README.md" not in files else f".qbuild/{name}"
        written.append(root.write_bytes(out / rel, data, within=out, durable=False))
    return written
