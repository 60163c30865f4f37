"""The remote-store contract and what every backend shares: URL hygiene, errors, verified resumable fetch.

A remote is a second tier behind the local store (see docs/remote-stores.md). Each backend maps four
things onto its storage: objects (files + qbuild's manifest.json), action records (step key -> digest,
the commit point), refs (recipe/variant:tag -> digest) and sidecars (model card, provenance, signature).

Ordering guarantees every backend keeps:
  put_object   uploads every file first (skipping blobs already there, so a re-run resumes), then the
               manifest: an object is visible only when complete.
  put_action   is called only after put_object returned; a crash before it leaves no action record,
               so no remote record ever points at a partial object.
  fetch_object verifies every file's size and sha256 before it is placed, stages into a private
               directory (`parts/` resume), refuses unsafe paths, and renames the finished
               directory into place: an interrupted fetch leaves nothing at the destination.

What a remote is trusted for: nothing it says is used unchecked. An object's manifest is used only after
get_manifest checked it against the digest it was asked for (check_manifest: its file list hashes to that
digest, every entry is a regular file with a safe path, size and sha256), and its other fields (provenance) only
as the action records naming the object commit to them (check_provenance, store/binding.py); every file is then
checked against that list, hashed from the file it was written to. Every JSON record is read bounded (size
first, at most MAX_JSON_BYTES streamed) and a bad record is refused alone, naming it. Every write the fetch makes
goes through the guarded helper (qbuild/base/owned.py): confined to the store or the --out folder, never through a
link.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import logging
import os
import re
import shutil
import stat
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path, PurePosixPath
from typing import ClassVar
from urllib.parse import urlsplit, urlunsplit

from qbuild.artifacts.remote.resume import UploadResume
from qbuild.artifacts.store.binding import binding_problem, committed_digest, manifest_digest
from qbuild.artifacts.store.export import out_lock
from qbuild.base.errors import QBuildError, UserError
from qbuild.base.hashing import copy_hashed, sha256_file, tree_digest
from qbuild.base.names import check_name as check_ref_name
from qbuild.base.owned import NotOurs, OwnedRoot, output_root
from qbuild.contract.plugin import Plugin

log = logging.getLogger("qbuild")

MANIFEST = "manifest.json"
CHUNK = 8 << 20
HEX64 = re.compile(r"^[0-9a-f]{64}$")
SIDECAR_RE = re.compile(r"^[A-Za-z0-9][\w.-]{0,99}$")
PUSH_POLICIES = ("always", "on-success", "never")

# Environment variables whose values are secrets: scrubbed from every message we produce.
SECRET_ENV = ("AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_ACCESS_KEY_ID", "MLFLOW_TRACKING_PASSWORD",
              "MLFLOW_TRACKING_TOKEN", "QBUILD_REGISTRY_PASSWORD", "ORAS_PASS", "GOOGLE_APPLICATION_CREDENTIALS",
              "AZURE_STORAGE_KEY", "AZURE_STORAGE_SAS_TOKEN", "AZURE_STORAGE_CONNECTION_STRING")

Progress = Callable[[int, int], None]  # (bytes done, bytes total), called from any thread


class RemoteError(QBuildError):
    """A remote failed: one line that names the remote by its display URL. Exit 1 (2: configuration)."""

    def __init__(self, display: str, message: str, exit_code: int | None = None):
        self.display = display
        self.reason = scrub(" ".join(str(message).split()))
        if exit_code is not None:
            self.exit_code = exit_code
        super().__init__(f"remote {display}: {self.reason}")


class RemoteRecordError(RemoteError):
    """One record on a remote is bad (not a manifest, too large, corrupt): the remote itself answers. Where many
    records are read (`verify --remote`) it fails that record alone."""


class RemoteConfigError(RemoteError, UserError):
    """Bad remote URL or option: caught before any transfer (exit 2)."""

    exit_code = 2


def scrub(text: str) -> str:
    """Remove credentials from a message: URL userinfo and the values of secret environment variables."""
    from qbuild.base.names import redact_url

    text = redact_url(text)   # the one URL redaction (qbuild/base/names.py)
    for var in SECRET_ENV:
        value = os.environ.get(var)
        if value and len(value) >= 4:
            text = text.replace(value, "***")
    text = re.sub(r"(?i)(authorization:\s*)(basic|bearer)\s+\S+", r"\1\2 ***", text)
    return text


def split_url(url: str) -> tuple[str, str]:
    """(scheme, display URL). Refuses credentials in the URL: they come only from env/provider chains."""
    parts = urlsplit(url)
    if not parts.scheme or not re.fullmatch(r"[a-z][a-z0-9+.-]*", parts.scheme):
        raise RemoteConfigError(url.split("@")[-1], "not a remote URL (expected scheme://...)")
    if parts.username is not None or parts.password is not None:
        clean = urlunsplit((parts.scheme, parts.hostname + (f":{parts.port}" if parts.port else ""), parts.path, "", ""))
        raise RemoteConfigError(clean, "credentials in a remote URL are refused; use the environment "
                                       "(AWS_*, docker config, QBUILD_REGISTRY_USERNAME/PASSWORD) instead")
    display = urlunsplit((parts.scheme, parts.netloc, parts.path.rstrip("/"), "", ""))
    return parts.scheme, display


def safe_relpath(path: str) -> str:
    """A manifest entry's path, or ValueError: no absolute paths, no '..', no backslashes or NULs."""
    if not isinstance(path, str) or not path or "\\" in path or "\0" in path:
        raise ValueError(f"unsafe path {path!r}")
    p = PurePosixPath(path)
    if p.is_absolute() or any(part in ("..", ".", "") for part in path.split("/")) or re.match(r"^[A-Za-z]:", path):
        raise ValueError(f"unsafe path {path!r}")
    return p.as_posix()


def check_manifest(manifest: dict, digest: str) -> list[dict]:
    """The manifest's file list if it is the object `digest` and every path is safe; ValueError otherwise."""
    if not isinstance(manifest, dict):
        raise ValueError("manifest is not a JSON object")
    if manifest.get("digest", digest) != digest:
        raise ValueError(f"manifest names digest {str(manifest.get('digest'))[:16]!r}, not this object")
    files = manifest.get("files")
    if not isinstance(files, list):
        raise ValueError("manifest has no file list")
    seen: set[str] = set()
    for f in files:
        if not isinstance(f, dict) or f.get("type", "file") != "file":
            raise ValueError(f"manifest entry {f.get('path') if isinstance(f, dict) else f!r} is not a regular file "
                             "(symlinks and special files are refused)")
        rel = safe_relpath(f.get("path"))
        if rel == MANIFEST or rel in seen:
            raise ValueError(f"unsafe path {rel!r} (duplicate or reserved)")
        size = f.get("size")
        if not isinstance(size, int) or isinstance(size, bool) or size < 0 or not isinstance(f.get("sha256"), str) \
                or not HEX64.match(f["sha256"]):
            raise ValueError(f"manifest entry {rel!r} has no valid size/sha256")
        seen.add(rel)
    for rel in seen:  # a file may not also be a directory of another entry
        for parent in PurePosixPath(rel).parents:
            if parent.as_posix() in seen:
                raise ValueError(f"unsafe path {rel!r} (under another file)")
    if tree_digest(files) != digest:
        raise ValueError("manifest does not match the object's digest")
    return files


def check_name(kind: str, value: str) -> str:
    """A recipe, variant or tag in a remote ref: the one name grammar (qbuild/base/names.py)."""
    return check_ref_name(value, kind)


def check_sidecar(name: str) -> str:
    if not isinstance(name, str) or not SIDECAR_RE.fullmatch(name):
        raise UserError(f"invalid sidecar {name!r}")
    return name


def check_digest(digest: str) -> str:
    if not isinstance(digest, str) or not HEX64.match(digest):
        raise UserError(f"invalid digest {str(digest)[:80]!r} (64 lowercase hex characters)")
    return digest


# --- what a remote says, checked as it enters ----------------------------------------------------------------
# A remote is not trusted: its records are read by every machine that pulls. Every digest and key in a record is
# checked against the digest grammar here, where it is read, before anything builds a path from it (a record
# with digest `x/../../victim/evil` once created files outside the store).
MAX_JSON_BYTES = 4 << 20      # a manifest of a 1,000-shard checkpoint is ~300 KB; refuse what no record needs
MAX_JSON_DEPTH = 64


def bounded_json(data: bytes | str, what: str) -> object:
    """Parse JSON read from a remote, refusing more than MAX_JSON_BYTES or nesting deeper than MAX_JSON_DEPTH
    (ValueError, one line naming `what`). Never RecursionError, and at most a few seconds for the worst record
    under the bound (a Python loop over each character once took 15 s for 60 MiB). Read a remote body with
    read_bounded first, so an oversized one is refused before it is in memory."""
    raw = data.encode() if isinstance(data, str) else bytes(data)
    if len(raw) > MAX_JSON_BYTES:
        raise ValueError(f"{what} is {len(raw):,} bytes (more than {MAX_JSON_BYTES:,}: not a qbuild record)")
    try:
        parsed = json.loads(raw)   # the C parser stops at the interpreter's recursion limit: RecursionError
    except RecursionError:
        raise ValueError(f"{what} nests deeper than {MAX_JSON_DEPTH} levels") from None
    except ValueError as exc:   # JSONDecodeError, UnicodeDecodeError: named, in one line
        raise ValueError(f"{what} is not JSON ({exc})") from None
    if _deeper_than(parsed, MAX_JSON_DEPTH):
        raise ValueError(f"{what} nests deeper than {MAX_JSON_DEPTH} levels")
    return parsed


def _deeper_than(obj: object, limit: int) -> bool:
    """Whether containers nest more than `limit` levels: an explicit stack over the containers only."""
    stack = [(obj, 1)] if isinstance(obj, (dict, list)) else []
    while stack:
        node, depth = stack.pop()
        if depth > limit:
            return True
        for child in node.values() if isinstance(node, dict) else node:
            if isinstance(child, (dict, list)):
                stack.append((child, depth + 1))
    return False


def read_bounded(chunks: Iterable[bytes], what: str, size: int | None = None, limit: int = MAX_JSON_BYTES) -> bytes:
    """A remote body of at most `limit` bytes: refused from its announced `size` before a byte is read, and
    again while streaming (a body longer than announced), so no more than `limit` bytes are ever held."""
    if size is not None and size > limit:
        raise ValueError(f"{what} is {size:,} bytes (more than {limit:,}: not a qbuild record); not read")
    out = bytearray()
    for chunk in chunks:
        out += chunk
        if len(out) > limit:
            raise ValueError(f"{what} is more than {limit:,} bytes (not a qbuild record); stopped reading")
    return bytes(out)


def remote_record(record: object, key: str | None = None) -> dict | None:
    """An action record or ref read from a remote, or None (ignored) when it is not an object, its `digest` is not
    a 64-hex digest, its `key` (if any) is not one, it names another key than `key`, or it carries a file list
    (an action record is its object's manifest) that is not the object it names."""
    if not isinstance(record, dict) or not isinstance(record.get("digest"), str) or not HEX64.match(record["digest"]):
        return None
    named = record.get("key")
    if named is not None and (not isinstance(named, str) or not HEX64.match(named) or (key is not None and named != key)):
        return None
    if "files" in record:
        try:
            check_manifest(record, record["digest"])
        except ValueError:
            return None
    return record


class RemoteRefused(RemoteError):
    """Something a remote holds that is refused (a damaged or hostile remote), one line naming it: an object whose
    manifest is not the object it is stored as, a record too large, too deep or not JSON. Never used: not pulled,
    not counted as present (a push uploads the object again), a failed row of verify, a record a listing skips."""


class RemoteCorrupt(RemoteRefused):
    """An object whose bytes on the remote are not its manifest's (a file's sha256 or size, or a manifest.json that
    is not the one its action record commits to): never placed. For a run it is a miss (the step is built here and
    the push replaces the remote's copy), for `verify --remote` a damaged row, for `push` a reason to upload again."""


class _Counter:
    """Thread-safe byte counter that reports (done, total) to a progress callback."""

    def __init__(self, total: int, progress: Progress | None):
        self.total, self.done, self.progress = total, 0, progress
        self._lock = threading.Lock()

    def add(self, n: int) -> None:
        if not n:
            return
        with self._lock:
            self.done += n
            done = self.done
        if self.progress:
            self.progress(done, self.total)


class RemoteStore(Plugin, ABC):
    """One remote tier: a plugin (registry `qbuild.artifacts.remote.remotes`, entry points `qbuild.remotes`).

    Subclasses serve `schemes`; their libraries come with the pip extra `extra`. The class's `name`
    names the plugin ("fsspec", "oci"); an opened remote's `name` is the remote's own (recipe `name:`
    or its display URL)."""

    schemes: ClassVar[tuple[str, ...]] = ()

    def __init__(self, url: str, *, name: str | None = None, endpoint_url: str | None = None,
                 region: str | None = None, insecure: bool = False, push: str = "on-success", jobs: int = 4,
                 env_credentials: bool = True):
        self.scheme, self.display = split_url(url)
        # False for a remote the user did not name (a URL read from a registry tag): credentials from qbuild's own
        # environment variables (QBUILD_REGISTRY_USERNAME/PASSWORD) go only to remotes the user configured
        self.env_credentials = env_credentials
        self.url = self.display  # credentials never kept
        self.name = name or self.display
        if push not in PUSH_POLICIES:
            raise RemoteConfigError(self.display, f"push: {push!r} is not one of {', '.join(PUSH_POLICIES)}")
        if endpoint_url is not None:
            _, endpoint_url = split_url(endpoint_url)
        self.endpoint_url, self.region, self.insecure, self.push, self.jobs = endpoint_url, region, insecure, push, jobs
        # transfer counters since construction (file contents only; JSON records are not counted)
        self.stats = {"bytes_up": 0, "bytes_down": 0, "files_up": 0, "files_down": 0, "files_skipped": 0,
                      "bytes_resumed": 0}   # of bytes_up: already on the remote from an interrupted push
        self._stats_lock = threading.Lock()
        # digest -> paths (manifest.json included) this process found damaged here by their content (a fetch, verify,
        # a push's check): a push uploads them again although they are present with their size
        self.damaged: dict[str, set[str]] = {}

    def _count(self, **kw: int) -> None:
        with self._stats_lock:
            for k, v in kw.items():
                self.stats[k] += v

    def _mark_damaged(self, digest: str, path: str) -> None:
        with self._stats_lock:
            self.damaged.setdefault(digest, set()).add(path)

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.display}>"

    def error(self, message: str, exit_code: int | None = None) -> RemoteError:
        return RemoteError(self.display, message, exit_code)

    # --- the contract ----------------------------------------------------------------------------
    @abstractmethod
    def check(self) -> None:
        """Endpoint reachable, credentials accepted, bucket exists: else one-line RemoteError."""

    @abstractmethod
    def get_action(self, key: str) -> dict | None:
        """The action record of step `key` (small JSON, no weights), or None; None too if its object is gone."""

    @abstractmethod
    def put_action(self, key: str, record: dict) -> None:
        """The commit point: call only after put_object(record['digest']) returned."""

    @abstractmethod
    def _read_manifest(self, digest: str) -> dict | None:
        """The stored manifest of `digest` as it is (read bounded), or None: get_manifest checks it before any use."""

    @abstractmethod
    def has_object(self, digest: str) -> bool:
        """A manifest that is `digest`'s (get_manifest) and every file present."""

    @abstractmethod
    def put_object(self, digest: str, local_dir: Path, manifest: dict, progress: Progress | None = None,
                   sidecars: dict[str, bytes] | None = None, resume: UploadResume | None = None) -> None:
        """Upload files (skipping those already there), sidecars, then the manifest. A re-run skips the files
        already uploaded; with `resume` (the local store's records, qbuild.artifacts.remote.resume) a large
        file cut off in the middle continues where it stopped, on backends that can (file://, S3, OCI).
        A backend may take `replace` (paths, manifest.json included, found damaged by their content: uploaded
        again although present); push_hit passes it only when there is something to replace."""

    @abstractmethod
    def set_ref(self, recipe: str, variant: str, tag: str, digest: str, key: str | None = None,
                annotations: dict[str, str] | None = None) -> None:
        """Point the ref at `digest`. `annotations` (the selected artifact's serve command, ...) are kept where the
        remote's ref format has a place for them: the OCI ref manifest's annotations, the ref record elsewhere."""

    @abstractmethod
    def get_ref(self, recipe: str, variant: str, tag: str = "latest") -> dict | None:
        """{'ref', 'digest', 'key', 'updated'} or None."""

    @abstractmethod
    def list_refs(self) -> list[dict]:
        ...

    @abstractmethod
    def list_objects(self) -> list[str]:
        """Digests of complete objects."""

    @abstractmethod
    def list_actions(self) -> Iterator[tuple[str, str]]:
        """(key, digest) of every action record."""

    @abstractmethod
    def delete_object(self, digest: str) -> None:
        """Remove an object with its sidecars and every action record that points at it."""

    @abstractmethod
    def put_sidecar(self, digest: str, name: str, data: bytes) -> None:
        ...

    @abstractmethod
    def get_sidecar(self, digest: str, name: str) -> bytes | None:
        ...

    # blob primitives used by the shared fetch: read one file of an object from `offset`
    @abstractmethod
    def _read_file(self, digest: str, entry: dict, offset: int) -> Iterator[bytes]:
        ...

    # --- shared --------------------------------------------------------------------------------------
    def get_manifest(self, digest: str) -> dict | None:
        """The manifest of object `digest`, or None when the remote has none. The one way a remote object is
        trusted: the manifest must be `digest`'s (its file list hashes to it, every entry is a safe regular file,
        see check_manifest) before anything reads it; otherwise RemoteRefused, one line naming the object."""
        check_digest(digest)
        manifest = self._read_manifest(digest)
        if manifest is None:
            return None
        try:
            check_manifest(manifest, digest)
        except ValueError as exc:
            raise RemoteRefused(self.display, f"object {digest[:12]} refused: {exc}") from None
        return manifest

    def object_size(self, digest: str) -> int | None:
        m = self.get_manifest(digest)
        return None if m is None else sum(f["size"] for f in m["files"])

    def verify(self, digests: Iterable[str] | None = None, deep: bool = False) -> list[dict]:
        """`qbuild verify --remote R`: one row per object, like Store.verify. Every object's manifest must be
        safe and match its digest, every file must be present with its size, and its manifest.json must be the one
        the action records naming it commit to (store/binding.py; `provenance`: "bound", or "unbound" where no
        record commits to one); deep=True also streams each file and checks its sha256 (nothing is written)."""
        targets = list(digests) if digests is not None else self.list_objects()
        records = self._records_naming(set(targets))
        rows = []
        for digest in targets:
            problems: list[str] = []
            try:
                manifest = self.get_manifest(digest)
            except RemoteError as exc:   # one bad object (or record) fails its own row, never the whole check
                rows.append({"digest": digest, "kind": None, "ok": False, "problems": [exc.reason]})
                continue
            if manifest is None:
                rows.append({"digest": digest, "ok": False, "problems": ["no manifest"]})
                continue
            if not self.has_object(digest):
                problems.append("files missing or truncated")
            elif deep:
                problems += self.content_problems(digest, manifest)
            found = records.get(digest, [])
            problems += [p for p in (binding_problem(manifest, r) for r in found) if p][:1]
            if any(p.startswith("provenance changed") for p in problems):
                self._mark_damaged(digest, MANIFEST)
            bound = any(committed_digest(r, manifest) is not None for r in found)
            rows.append({"digest": digest, "kind": manifest.get("kind"), "ok": not problems, "problems": problems,
                         "provenance": "bound" if bound else "unbound"})
        return rows

    def content_problems(self, digest: str, manifest: dict) -> list[str]:
        """Stream every file of object `digest` and check its size and sha256 against `manifest` (nothing is
        written); each file that differs is remembered in `damaged`. Costs one download of the object."""
        problems = []
        for f in manifest["files"]:
            h, n = hashlib.sha256(), 0
            for chunk in self._read_file(digest, f, 0):
                h.update(chunk)
                n += len(chunk)
                if n > f["size"]:
                    break
            if n != f["size"] or h.hexdigest() != f["sha256"]:
                problems.append(f"content changed: {f['path']}")
                self._mark_damaged(digest, f["path"])
        return problems

    def _records_naming(self, digests: set[str]) -> dict[str, list[dict]]:
        """The action records here that name each of `digests` (a bad record is skipped: its own listing warns)."""
        found: dict[str, list[dict]] = {}
        for key, digest in list(self.list_actions()):
            if digest not in digests:
                continue
            try:
                record = self.get_action(key)
            except RemoteRefused:
                continue
            if record is not None and record.get("digest") == digest:
                found.setdefault(digest, []).append(record)
        return found

    def check_provenance(self, digest: str, manifest: dict, keys: Iterable[str] = (),
                         records: Iterable[dict] = ()) -> bool:
        """Whether an action record binds object `digest`'s manifest (True) or none does (False: unbound, e.g. pushed
        before the binding); RemoteCorrupt (one line naming the object and what changed) when a record naming the
        object commits it to another manifest.json. Looks at `records` and the records of `keys` and of the
        manifest's own key."""
        seen = [r for r in records if isinstance(r, dict)]
        for key in dict.fromkeys([*keys, manifest.get("key")]):
            if isinstance(key, str) and HEX64.match(key) and not any(r.get("key") == key for r in seen):
                try:
                    record = self.get_action(key)
                except RemoteRefused:
                    record = None
                if record is not None:
                    seen.append(record)
        bound = False
        for record in seen:
            if record.get("digest") != digest:
                continue
            problem = binding_problem(manifest, record)
            if problem:
                self._mark_damaged(digest, MANIFEST)
                raise RemoteCorrupt(self.display, f"object {digest[:12]} refused: {problem}; nothing was placed")
            bound = bound or committed_digest(record, manifest) is not None
        return bound

    def fetch_object(self, digest: str, dest_dir: Path, progress: Progress | None = None, jobs: int | None = None,
                     staging: Path | None = None, root: OwnedRoot | None = None,
                     prepare: Callable[[Path], None] | None = None, keys: Iterable[str] = (),
                     records: Iterable[dict] = (), lock: bool = True, warn_unbound: bool = False,
                     check_present: Callable[[Path], None] | None = None) -> dict:
        """Download object `digest` into dest_dir (files + manifest.json); returns its manifest.

        The manifest must be `digest`'s (get_manifest) and the one the action records naming the object commit to
        (check_provenance over `records`, the records of `keys` and of the manifest's key; `warn_unbound`: say so
        when none does). Every write stays inside `root` (the store; by default dest_dir's folder, output_root) and
        follows no link. With `lock`, fetches into one dest_dir take turns (out_lock: a lock file beside it; a
        second one waits, then finds the object placed). The staging folder holds `parts/`, one file per manifest
        entry named by the hash of its path (so no name of the object's own can collide with it); an interrupted
        fetch resumes from them. A part is kept only when the file on disk hashes to its size and sha256. Only when
        every part does is a fresh `tree/` built from them (nothing else in it), `prepare(tree)` run (a pull adds
        its sidecars and checks the signature) and the tree renamed to dest_dir: dest_dir appears in one rename,
        complete. Where dest_dir already holds exactly the object, nothing is written and `check_present(dest_dir)`
        is run (a pull checks the signature there).
        """
        check_digest(digest)
        dest_dir = Path(dest_dir).absolute()
        manifest = self.get_manifest(digest)
        if manifest is None:
            raise self.error(f"no object {digest[:12]} here")
        if not self.check_provenance(digest, manifest, keys, records) and warn_unbound:
            log.warning(f"object {digest[:12]} on {self.display}: no action record here commits to its manifest.json "
                        "(pushed by a qbuild before provenance was bound, or its records are gone); its provenance "
                        "is as the remote has it")
        if dest_dir.is_symlink():
            raise UserError(f"{dest_dir} is a symlink; give the folder itself (a pull never writes through a link)")
        staging = Path(staging).absolute() if staging else dest_dir.with_name(f".{dest_dir.name}.partial-{digest[:16]}")
        try:
            if root is None:
                dest_dir.parent.mkdir(parents=True, exist_ok=True)
                root = output_root(dest_dir.parent)
            with out_lock(root, dest_dir) if lock else contextlib.nullcontext():
                return self._fetch_into(digest, manifest, dest_dir, staging, root, progress, jobs, prepare,
                                        check_present)
        except OSError as exc:
            if exc.errno == errno.ENOSPC:
                raise self.error(f"disk full while pulling {digest[:12]} into {dest_dir.parent}; "
                                 "free space and re-run to resume") from None
            raise self.error(f"pull of {digest[:12]} failed: {exc}") from None

    def _fetch_into(self, digest: str, manifest: dict, dest_dir: Path, staging: Path, root: OwnedRoot,
                    progress: Progress | None, jobs: int | None, prepare: Callable[[Path], None] | None,
                    check_present: Callable[[Path], None] | None) -> dict:
        """fetch_object's work once it holds dest_dir's lock: what it finds there is checked under the lock."""
        files = manifest["files"]
        if _holds_exactly(dest_dir, manifest):   # fetched before, or by the pull this one waited for
            if check_present is not None:
                check_present(dest_dir)
            return manifest
        if dest_dir.exists() and (not dest_dir.is_dir() or any(dest_dir.iterdir())):
            raise UserError(f"{dest_dir} exists and is not empty")
        if staging.is_symlink() or (staging.exists() and not staging.is_dir()):
            raise NotOurs(f"staging folder {staging} is {'a symlink' if staging.is_symlink() else 'not a folder'}"
                          "; refusing to write through it (remove it and pull again)")
        self._fetch_parts(digest, files, root, staging, progress, jobs)
        tree = staging / "tree"
        root.mkdirs(tree)
        for f in files:
            final = tree / f["path"]
            if final.parent != tree:
                root.mkdirs(final.parent, within=tree)
            root.move(staging / "parts" / part_name(f), final, within=staging)
        root.write_bytes(tree / MANIFEST, json.dumps(manifest, indent=2, sort_keys=True, default=str).encode(),
                         within=tree)
        if prepare is not None:
            prepare(tree)
        if os.path.realpath(dest_dir.parent) != str(root.real):
            root.mkdirs(dest_dir.parent)
        if dest_dir.exists():
            os.rmdir(root.confine(dest_dir))   # the empty folder checked above (rmdir refuses any other)
        root.move(tree, dest_dir)
        root.remove(staging)        # what is left: the empty parts/
        return manifest

    def _fetch_parts(self, digest: str, files: list[dict], root: OwnedRoot, staging: Path, progress: Progress | None,
                     jobs: int | None) -> None:
        """Every file of the object into staging/parts/, verified, in parallel (largest first), after what an
        interrupted fetch left is reclaimed and the disk is checked for what is still missing."""
        parts = staging / "parts"
        root.mkdirs(parts)
        _reclaim_tree(root, staging, files)   # an interrupted placing: its verified files go back to parts/
        need = sum(f["size"] for f in files) - sum(_part_size(parts, f) for f in files)
        free = shutil.disk_usage(parts).free
        if need > free:
            raise self.error(f"not enough disk space in {staging.parent}: the pull needs {need:,} more bytes, "
                             f"{free:,} are free")
        counter = _Counter(sum(f["size"] for f in files), progress)
        with ThreadPoolExecutor(max_workers=max(1, jobs or self.jobs)) as pool:
            for fut in [pool.submit(self._fetch_file, digest, root, staging, f, counter)
                        for f in sorted(files, key=lambda f: -f["size"])]:
                fut.result()

    def _fetch_file(self, digest: str, root: OwnedRoot, staging: Path, entry: dict, counter: _Counter) -> None:
        """Stream one file into parts/<part_name>, resuming a part left by an interrupted fetch; it stays there
        only when the file on disk has the manifest's size and sha256."""
        part = staging / "parts" / part_name(entry)
        resume = _regular_size(part) is not None and _regular_size(part) <= entry["size"]
        if not resume and os.path.lexists(part):
            root.remove(part, within=staging)   # a stale part, or a link planted in its place: never written through
        while True:
            start = _regular_size(part) if resume else 0
            counter.add(start)
            got = start
            with root.open_write(part, append=bool(start), within=staging) as out:
                if start < entry["size"]:
                    for chunk in self._read_file(digest, entry, start):
                        out.write(chunk)
                        got += len(chunk)
                        counter.add(len(chunk))
                        self._count(bytes_down=len(chunk))
                        if got > entry["size"]:
                            break
            # hashed from the file, not from the stream: what is placed is the bytes the file holds (two pulls into one
            # --out once appended to one part, and each passed the hash of what it had streamed)
            if _file_digest(part) == (entry["size"], entry["sha256"]):
                self._count(**({"files_down": 1} if got > start or not start else {"files_skipped": 1}))
                return
            root.remove(part, within=staging)
            counter.add(-got)
            if not start:
                self._mark_damaged(digest, entry["path"])
                raise RemoteCorrupt(self.display, f"object {digest[:12]}: file {entry['path']} is corrupt on the remote "
                                                  "(size or sha256 does not match the manifest); nothing was placed")
            resume = False  # a stale part: once more from scratch

    def _push_files(self, digest: str, manifest: dict) -> list[dict]:
        """The file list of an object about to be pushed; refuses a manifest that is not `digest`'s."""
        check_digest(digest)
        try:
            return check_manifest(manifest, digest)
        except ValueError as exc:
            raise self.error(f"object {digest[:12]} not pushed: {exc}") from None

    def _upload_files(self, local_dir: Path, files: list[dict], exists: Callable[[dict], bool],
                      put: Callable[[Path, dict], None], progress: Progress | None) -> None:
        """Parallel upload of the files not yet on the remote. Each is read once: `put` checks its sha256 while
        it uploads (hash_while_uploading, or a registry that verifies the blob's digest) and leaves no file of
        that name behind when the bytes are not the manifest's (mismatch())."""
        counter = _Counter(sum(f["size"] for f in files), progress)
        local_dir = Path(local_dir)

        def one(f: dict) -> None:
            src = local_dir / f["path"]
            if exists(f):
                counter.add(f["size"])
                self._count(files_skipped=1)
                return
            if src.is_symlink() or not src.is_file() or src.stat().st_size != f["size"]:
                raise self.mismatch(f)
            put(src, f)
            counter.add(f["size"])
            self._count(bytes_up=f["size"], files_up=1)

        with ThreadPoolExecutor(max_workers=max(1, self.jobs)) as pool:
            for fut in [pool.submit(one, f) for f in sorted(files, key=lambda f: -f["size"])]:
                fut.result()


    def mismatch(self, entry: dict) -> RemoteError:
        return self.error(f"local file {entry['path']} does not match its manifest; not uploaded (run qbuild verify)")


def hash_while_uploading(src: Path, out, entry: dict) -> bool:
    """Write the file `src` into the open remote file `out`, hashing each chunk as it goes (one read of src);
    True when it hashed to the entry's sha256. The caller closes `out` and removes it on False."""
    with open(src, "rb") as inp:
        return copy_hashed(inp, out, detach=True) == entry["sha256"]


def part_name(entry: dict) -> str:
    """The staging name of a manifest entry under parts/: the hash of its path, never one of the object's names."""
    return hashlib.sha256(entry["path"].encode()).hexdigest()[:40] + ".part"


def _file_digest(path: Path) -> tuple[int, str] | None:
    """(size, sha256) of the regular file at `path` as it is on disk (opened without following a link), or None."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    except OSError:
        return None
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
            return None
        sha = copy_hashed(f, None)
        return f.tell(), sha


def _regular_size(path: Path) -> int | None:
    try:
        st = os.lstat(path)
    except OSError:
        return None
    return st.st_size if stat.S_ISREG(st.st_mode) else None


def _part_size(parts: Path, f: dict) -> int:
    return min(_regular_size(parts / part_name(f)) or 0, f["size"])


def _holds_exactly(folder: Path, manifest: dict) -> bool:
    """True when `folder` holds object `manifest` and nothing else: its manifest.json is that manifest, every file
    is a regular file with its size and sha256, and beside them only sidecars (README.md, .qbuild/) and no link."""
    if _regular_size(folder / MANIFEST) is None:
        return False
    try:
        there = json.loads((folder / MANIFEST).read_bytes()[:MAX_JSON_BYTES])
        if there.get("digest") != manifest["digest"] or manifest_digest(there) != manifest_digest(manifest):
            return False
    except (OSError, ValueError, AttributeError):
        return False
    listed = {f["path"]: f for f in manifest["files"]}
    for dirpath, dirnames, filenames in os.walk(folder, followlinks=False):
        for name in dirnames + filenames:
            path = Path(dirpath) / name
            rel = path.relative_to(folder).as_posix()
            if os.path.islink(path):
                return False
            if name in filenames and rel not in listed and rel not in (MANIFEST, "README.md") \
                    and not rel.startswith(".qbuild/"):
                return False
    return all(_regular_size(folder / rel) == f["size"] and sha256_file(folder / rel) == f["sha256"]
               for rel, f in listed.items())


def _reclaim_tree(root: OwnedRoot, staging: Path, files: list[dict]) -> None:
    """A fetch interrupted while it placed its verified parts into tree/: move each manifest file back to parts/
    (it is re-hashed there), then drop the tree with anything else in it (never placed)."""
    tree = staging / "tree"
    if not os.path.lexists(tree):
        return
    if os.path.isdir(tree) and not os.path.islink(tree):
        for f in files:
            placed = tree / f["path"]
            if _regular_size(placed) is not None and _regular_size(staging / "parts" / part_name(f)) is None:
                try:
                    root.move(placed, staging / "parts" / part_name(f), within=staging)
                except NotOurs:
                    pass   # under a link planted in the tree: not ours to move; dropped with the tree
    root.remove(tree, within=staging)
