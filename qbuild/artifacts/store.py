"""Local content-addressed store.

Layout (the same on any filesystem; see docs/architecture.md):
  objects/<dd>/<digest>/        immutable artifact files + manifest.json (provenance of its producer)
  actions/<kk>/<key>.json       action cache: step key -> digest, with that step's provenance
  refs/<recipe>/<variant>/<tag> mutable names -> digest
  history/<recipe>/<step>.json  last build of each named step, so `plan` can say why a step misses
  runs/<run-id>.json            one record per invocation
  stamps/<dd>/<digest>.json     memo of verified file hashes by (size, mtime, inode): a warm hit check is a stat
  quarantine/<digest>.<when>/   damaged objects moved out of the way, kept for inspection
  tmp/  locks/  logs/           private scratch: never visible as objects

Integrity and durability (docs/store-integrity.md): every hit is checked before use (file set, sizes, and
hashes through the stamp; `full` re-hashes); a damaged object is quarantined and rebuilt. Files and their
directory are fsynced before the rename that publishes an object and before a record is replaced; an
unreadable record is a miss. A read-only store serves hits without writing anything.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import re
import shutil
import stat
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from qbuild.core.hashing import canonical_json, memo_sha256, sha256_file, tree_digest
from qbuild.core.names import NAME, check_name
from qbuild.core.owned import OwnedRoot, claim_root, only_these, owned_root
from qbuild.errors import EXIT_USER_ERROR, QBuildError, UserError

log = logging.getLogger("qbuild")

MANIFEST = "manifest.json"
REF_RE = re.compile(rf"^(?P<recipe>{NAME})/(?P<variant>{NAME})(?::(?P<tag>{NAME}))?$")
DIGEST_RE = re.compile(r"^[0-9a-f]{64}$")
SCRATCH_RE = re.compile(r"^(?P<key>[0-9a-f]{64})\.(?P<pid>\d+)\.[0-9a-f]{8}$")   # tmp/<key>.<pid>.<rand> (new_tmp)
# the only names housekeeping removes: what qbuild itself writes there (a foreign file in a store is left alone)
FETCH_RE = re.compile(r"^fetch-[0-9a-f]{32}$")                                   # tmp/: a remote fetch's staging
LOCK_RE = re.compile(r"^(?:fetch-)?[0-9a-f]{64}\.lock$")                        # locks/<key>.lock
RUN_ID_RE = re.compile(r"^\d{8}T\d{6}Z-[0-9a-f]{6}$")                               # new_run_id: runs/<id>.json, logs/<id>/
QUARANTINE_RE = re.compile(r"^[0-9a-f]{64}\.\d{8}T\d{6}Z\.[0-9a-f]{6}$")          # quarantine/<digest>.<when>.<id>
VERIFY_MODES = ("fast", "full")
# what a store root holds (docs/architecture.md); an old store without the marker is adopted only if it holds no more
LAYOUT = {"objects", "actions", "refs", "history", "runs", "stamps", "quarantine", "tmp", "locks", "logs", "rebuilds"}
looks_like_store = only_these(LAYOUT, {"objects", "actions", "refs", "runs"})
NO_SPACE = (errno.ENOSPC, errno.EDQUOT)


class StoreFull(QBuildError):
    """The store's filesystem is full (ENOSPC/EDQUOT): one line naming the store, what was written, free vs needed."""


class StoreReadOnly(QBuildError):
    """Something must be written to a read-only store (a serving team's shared mount): exit 2, before any work."""

    exit_code = EXIT_USER_ERROR


def free_bytes(path: Path) -> int | None:
    p = Path(path)
    while not p.exists() and p != p.parent:
        p = p.parent
    try:
        return shutil.disk_usage(p).free
    except OSError:
        return None


def _human(n: int | None) -> str:
    if n is None:
        return "?"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def store_full(root: Path, what: str, needed: int | None) -> StoreFull:
    return StoreFull(f"store {root} is full: writing {what} needs {_human(needed)}, {_human(free_bytes(root))} free; "
                     "free some space (qbuild gc) or use another --store")


def fsync_dir(path: Path) -> None:
    """Make a directory's entries (a rename, a new file) durable."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write_json(path: Path, data, root: Path | None = None) -> None:
    """Write a fresh file beside `path`, fsync it, rename it over `path` (never following a link), fsync the dir.

    A power cut leaves either the old or the new content, never an empty record. ENOSPC → StoreFull (one line),
    with the half-written file removed."""
    text = json.dumps(data, indent=2, sort_keys=True, default=str).encode()
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o644)
        try:
            view = memoryview(text)
            while view:
                view = view[os.write(fd, view):]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
        fsync_dir(path.parent)
    except OSError as exc:
        with _quiet():
            tmp.unlink()
        if exc.errno in NO_SPACE:
            raise store_full(root or path.parent, str(path), len(text)) from None
        if exc.errno == errno.EROFS:
            raise StoreReadOnly(f"store {root or path.parent} is read-only: cannot write {path}") from None
        raise


class _quiet:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return exc[0] is not None and issubclass(exc[0], OSError)


def read_json(path: Path) -> dict | None:
    """A record as a dict, or None when missing, empty, unreadable, not JSON or not an object (never raises)."""
    try:
        data = json.loads(Path(path).read_bytes())
    except (OSError, ValueError, RecursionError):
        return None
    return data if isinstance(data, dict) else None


def valid_files(files) -> bool:
    """A manifest's file list: [{path: relative, size: int >= 0, sha256: 64 hex}, ...] with no '..' or absolute path."""
    if not isinstance(files, list):
        return False
    for f in files:
        if not isinstance(f, dict) or not isinstance(f.get("path"), str) or not isinstance(f.get("sha256"), str):
            return False
        if not isinstance(f.get("size"), int) or isinstance(f.get("size"), bool) or f["size"] < 0:
            return False
        parts = f["path"].split("/")
        if not f["path"] or f["path"].startswith("/") or ".." in parts or "" in parts or "\0" in f["path"]:
            return False
    return True


def now_iso() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


@dataclass(frozen=True)
class Hit:
    key: str
    digest: str
    path: Path
    record: dict


def checked_digest(value: object, what: str = "digest") -> str:
    """`value` if it is a 64-hex digest or key; ValueError otherwise. Every store path built from a digest or key
    goes through here, so a name from a remote record (`x/../../victim`) never becomes a path."""
    if not isinstance(value, str) or not DIGEST_RE.match(value):
        raise ValueError(f"invalid {what} {str(value)[:80]!r} (expected 64 lowercase hex characters)")
    return value


class Store:
    def __init__(self, root: Path):
        self.root = Path(root).absolute()
        self._writable: bool | None = None
        self._owned: OwnedRoot | None = None
        self.repair = True                  # False for a plan (a dry run): a damaged object misses, nothing moves
        self.quarantined: list[dict] = []   # what this process moved to quarantine/ (digest, reason, where)

    # --- ownership -------------------------------------------------------------------------------
    @property
    def owned(self) -> OwnedRoot:
        """This store as a root qbuild owns: claimed (marker written) on the first write, so a new store or an old
        one gets its marker; a non-empty folder that is not a store is refused in one line (NotOurs, exit 2)."""
        if self._owned is None:
            try:
                self._owned = claim_root(self.root, "store", adopt=looks_like_store)
            except OSError as exc:
                if exc.errno in NO_SPACE:
                    raise store_full(self.root, "the store's marker", 4096) from None
                if exc.errno in (errno.EROFS, errno.EACCES):
                    raise StoreReadOnly(f"store {self.root} is read-only: cannot write its marker") from None
                raise
        return self._owned

    def owned_existing(self) -> OwnedRoot:
        """For destructive commands (gc, verify --repair): the store must already carry its marker."""
        if self._owned is None:
            self._owned = owned_root(self.root, "store")
        return self._owned

    # --- paths -----------------------------------------------------------------------------------
    def object_dir(self, digest: str) -> Path:
        return self.root / "objects" / digest[:2] / checked_digest(digest)

    def _action_file(self, key: str) -> Path:
        return self.root / "actions" / key[:2] / f"{checked_digest(key, 'step key')}.json"

    def _stamp_file(self, digest: str) -> Path:
        return self.root / "stamps" / digest[:2] / f"{checked_digest(digest)}.json"

    def log_path(self, run_id: str, step_name: str) -> Path:
        """Where a step's log goes (written by the caller: the store is claimed here)."""
        self.owned  # noqa: B018 (claims the root before its first write)
        safe = re.sub(r"[^\w.\-\[\]]", "_", step_name)
        return self.root / "logs" / run_id / f"{safe}.log"

    # --- writability -----------------------------------------------------------------------------
    @property
    def writable(self) -> bool:
        """False on a read-only mount (EROFS) or a directory this user may not write: hits are still served."""
        if self._writable is None:
            probe = self.root
            while not probe.exists() and probe != probe.parent:
                probe = probe.parent
            ok = os.access(probe, os.W_OK)
            if ok and probe.is_dir():
                try:  # root passes os.access on a read-only mount in some setups: statvfs knows
                    ok = not (os.statvfs(probe).f_flag & os.ST_RDONLY)
                except OSError:
                    pass
            self._writable = ok
        return self._writable

    def require_writable(self, what: str) -> None:
        if not self.writable:
            raise StoreReadOnly(f"store {self.root} is read-only; {what} needs a writable store "
                                "(give another --store, or run where the mount is writable)")

    def write_json(self, path: Path, data) -> None:
        self.owned  # noqa: B018 (claims the root on the first write)
        atomic_write_json(path, data, root=self.root)

    # --- action cache ----------------------------------------------------------------------------
    def lookup(self, key: str, verify: str = "fast") -> Hit | None:
        """A hit: a readable action record for `key` whose object exists, agrees with it and passes the check.

        verify="fast": file set, sizes, and hashes through the stamp (a file whose size, mtime or inode changed is
        re-hashed); "full": every file re-hashed. A damaged object is quarantined (one warning) and the lookup misses,
        so the step is rebuilt. An unreadable or empty record is a miss (rewritten when the step is published)."""
        record = read_json(self._action_file(key))
        if record is None:
            return None
        digest = record.get("digest")
        if not isinstance(digest, str) or not DIGEST_RE.match(digest):
            return None
        path = self.object_dir(digest)
        if not path.is_dir():
            return None
        wrong = self.check_record(key, record, digest)
        if wrong:  # the record is wrong, not (necessarily) the object it names: drop the record, a miss
            log.warning(f"action record of step {key[:12]} in store {self.root} is wrong ({wrong}); it will be rebuilt")
            if self.writable and self.repair:
                with _quiet():
                    self.owned.remove(self._action_file(key))
            return None
        problems = self.check_object(digest, full=verify == "full")
        if problems:
            if self.repair:
                self.quarantine(digest, problems, key=key)
            else:
                log.warning(f"object {digest[:12]} in store {self.root} is damaged ({'; '.join(problems[:3])}); "
                            "a run will quarantine and rebuild it (or run `qbuild verify --repair`)")
            return None
        return Hit(key, digest, path, record)

    @staticmethod
    def check_record(key: str, record: dict, digest: str) -> str | None:
        """Why an action record cannot be trusted for `key` (None: it can): it must name this key, and its file
        list must hash to the digest it names (so a record edited to point at another object is refused)."""
        if record.get("key") != key:
            return f"it names key {str(record.get('key'))[:12]}"
        if not valid_files(record.get("files")) or tree_digest(record["files"]) != digest:
            return "its file list does not match the object it names"
        return None

    def check_object(self, digest: str, full: bool = False) -> list[str]:
        """Problems with object `digest` (empty: sound). Never raises on any manifest or record content."""
        obj = self.object_dir(digest)
        manifest = read_json(obj / MANIFEST)
        if manifest is None:
            return ["manifest missing or unreadable"]
        files = manifest.get("files")
        if not valid_files(files):
            return ["manifest has no valid file list"]
        problems = []
        if manifest.get("digest") != digest or tree_digest(files) != digest:
            problems.append("manifest does not match the object's digest")
        stamp = read_json(self._stamp_file(digest)) or {}
        fresh, changed = {}, False
        listed = set()
        for f in files:
            listed.add(f["path"])
            p = obj / f["path"]
            try:
                st = os.lstat(p)
            except OSError:
                problems.append(f"missing file {f['path']}")
                continue
            if not stat.S_ISREG(st.st_mode):
                problems.append(f"not a regular file: {f['path']}")
                continue
            if st.st_size != f["size"]:
                problems.append(f"size changed: {f['path']} ({st.st_size} bytes, manifest says {f['size']})")
                continue
            try:
                fresh[f["path"]], hashed = memo_sha256(p, st, None if full else stamp.get(f["path"]))
            except OSError as exc:
                problems.append(f"unreadable file {f['path']}: {exc.strerror}")
                continue
            changed = changed or hashed
            sha = fresh[f["path"]][3]
            if sha != f["sha256"]:
                problems.append(f"content changed: {f['path']}")
        for p in _walk(obj):
            rel = p.relative_to(obj).as_posix()
            if rel != MANIFEST and rel not in listed:
                problems.append(f"unexpected file {rel}")
        if not problems and (changed or set(fresh) != set(stamp)) and self.writable and self.repair:
            with _quiet(), _quiet_store():
                self.write_json(self._stamp_file(digest), fresh)
        return problems

    def quarantine(self, digest: str, problems: list[str], key: str | None = None) -> Path | None:
        """Move a damaged object under quarantine/ (kept for inspection) and drop the action record naming it.

        One warning line names it. On a read-only store nothing moves: the lookup still misses."""
        obj = self.object_dir(digest)
        reason = "; ".join(problems[:3]) + (f"; +{len(problems) - 3} more" if len(problems) > 3 else "")
        if not self.writable:
            log.warning(f"object {digest[:12]} in store {self.root} is damaged ({reason}); read-only store: not used")
            return None
        dest = self.root / "quarantine" / f"{digest}.{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}.{uuid.uuid4().hex[:6]}"
        dest.parent.mkdir(parents=True, exist_ok=True)
        try:
            self.owned.move(obj, dest)
        except FileNotFoundError:
            dest = None  # another process quarantined it first
        except OSError as exc:
            log.warning(f"object {digest[:12]} is damaged ({reason}) and could not be quarantined: {exc}")
            return None
        with _quiet():
            self.owned.remove(self._stamp_file(digest))
        if key is not None:
            with _quiet():
                self.owned.remove(self._action_file(key))
        fsync_dir(obj.parent)
        if dest is not None:
            log.warning(f"damaged object {digest[:12]} ({reason}) moved to {dest}; it will be rebuilt")
            self.quarantined.append({"digest": digest, "key": key, "problems": problems, "path": str(dest)})
        return dest

    @contextmanager
    def lock(self, key: str, timeout: float = -1) -> Iterator[None]:
        """Per-key lock: concurrent runs build a step once; the others wait, then hit."""
        from filelock import FileLock

        if not re.fullmatch(r"[\w.-]{1,100}", key):
            raise ValueError(f"invalid lock name {key[:80]!r}")
        self.owned  # noqa: B018 (claims the root on the first write)
        lock_dir = self.root / "locks"
        lock_dir.mkdir(parents=True, exist_ok=True)
        with FileLock(str(lock_dir / f"{key}.lock"), timeout=timeout):
            yield

    def new_tmp(self, key: str) -> Path:
        """Private scratch dir for building `key`. Call with the key's lock held."""
        checked_digest(key, "step key")
        root = self.owned   # the first write claims the store
        tmp_root = self.root / "tmp"
        tmp_root.mkdir(parents=True, exist_ok=True)
        for stale in tmp_root.glob(f"{key}.*"):  # left by a crashed build of this key
            if SCRATCH_RE.match(stale.name):
                with _quiet():
                    root.remove(stale)
        path = tmp_root / f"{key}.{os.getpid()}.{uuid.uuid4().hex[:8]}"
        path.mkdir()
        return path

    def clean_stale(self, min_age_s: float = 60.0) -> dict:
        """Remove scratch and lock files no live process holds (safe beside running builds); returns counts."""
        from filelock import FileLock, Timeout

        removed = {"tmp": 0, "locks": 0}
        if not self.writable:
            return removed
        root = self.owned   # a run starts here: the store is claimed (or refused) before anything is written
        now = time.time()
        for entry in _listdir(self.root / "tmp"):
            m = SCRATCH_RE.match(entry.name)  # only build scratch: a remote fetch's staging is kept to resume
            try:
                age = now - entry.lstat().st_mtime
            except OSError:
                continue
            if m is None or age < min_age_s:
                continue
            pid = int(m.group("pid"))
            if pid != os.getpid() and _alive(pid):
                continue
            lock_file = self.root / "locks" / f"{m.group('key')}.lock"
            try:
                with FileLock(str(lock_file), timeout=0):
                    root.remove(entry)
                    removed["tmp"] += 1
                    with _quiet():
                        root.remove(lock_file)   # held by us: a waiter re-opens it (filelock checks st_nlink)
            except (Timeout, OSError):
                continue
        for entry in _listdir(self.root / "locks"):
            if not LOCK_RE.match(entry.name):
                continue
            try:
                if now - entry.lstat().st_mtime < min_age_s:
                    continue
                with FileLock(str(entry), timeout=0):  # held by nobody: removing it cannot break a build
                    root.remove(entry)
                    removed["locks"] += 1
            except (Timeout, OSError):
                continue
        return removed

    def gc_housekeeping(self, older_than_s: float = 30 * 86400, keep_runs: int = 20, dry_run: bool = False,
                        now: float | None = None) -> list[dict]:
        """Remove what only accumulates: stale scratch and unheld locks (any age > 60 s), and logs, run records,
        stamps of gone objects and quarantined objects older than `older_than_s` (the newest `keep_runs` run
        records and their logs always stay). Objects themselves are not touched here. Returns one row per removal."""
        from filelock import FileLock, Timeout

        self.require_writable("gc")
        root = self.owned_existing()   # `qbuild gc --store /` must never clear /tmp: the root must carry the marker
        now = time.time() if now is None else now
        rows: list[dict] = []

        def size(p: Path) -> int:
            if p.is_dir() and not p.is_symlink():
                return sum(f.lstat().st_size for f in p.rglob("*") if f.is_file() or f.is_symlink())
            return p.lstat().st_size

        def drop(kind: str, p: Path) -> None:
            rows.append({"kind": kind, "path": str(p), "bytes": size(p)})
            if not dry_run:
                root.remove(p)

        def old(p: Path, limit: float) -> bool:
            try:
                return now - p.lstat().st_mtime > limit
            except OSError:
                return False

        for entry in _listdir(self.root / "tmp"):
            m = SCRATCH_RE.match(entry.name)
            if m is None:  # a remote fetch's staging (kept so it can resume): only once past the retention
                if FETCH_RE.match(entry.name) and old(entry, older_than_s):
                    drop("tmp", entry)
                continue
            pid = int(m.group("pid"))
            if not old(entry, 60) or (pid != os.getpid() and _alive(pid)):
                continue
            lock_file = self.root / "locks" / f"{m.group('key')}.lock"
            try:
                with FileLock(str(lock_file), timeout=0):
                    drop("tmp", entry)
                    if not dry_run:
                        with _quiet():
                            root.remove(lock_file)   # held by us: a waiter re-opens it (filelock checks st_nlink)
            except (Timeout, OSError):
                continue
        for entry in _listdir(self.root / "locks"):
            if not LOCK_RE.match(entry.name) or entry.is_symlink() or not old(entry, 60):
                continue
            try:
                with FileLock(str(entry), timeout=0):
                    drop("lock", entry)
            except (Timeout, OSError):
                continue
        def finished(p: Path):   # the order of store.runs(): run ids of one second sort at random by name
            record = None if p.is_symlink() else read_json(p)
            when = record.get("finished") if record else None
            return (when if isinstance(when, int | float) else 0, p.name)

        runs = sorted((p for p in _listdir(self.root / "runs") if p.suffix == ".json" and RUN_ID_RE.match(p.stem)), key=finished)
        keep = {p.stem for p in runs[-keep_runs:]} if keep_runs > 0 else set()
        for entry in runs:
            if entry.stem not in keep and old(entry, older_than_s):
                drop("run", entry)
        for entry in _listdir(self.root / "logs"):
            if RUN_ID_RE.match(entry.name) and entry.name not in keep and old(entry, older_than_s):
                drop("log", entry)
        for entry in _listdir(self.root / "quarantine"):
            if QUARANTINE_RE.match(entry.name) and old(entry, older_than_s):
                drop("quarantine", entry)
        for entry in (self.root / "stamps").glob("*/*.json"):
            if DIGEST_RE.match(entry.stem) and not self.object_dir(entry.stem).is_dir():
                drop("stamp", entry)
        return rows

    def publish(self, key: str, tmp: Path, provenance: dict, link_roots: tuple[Path, ...] = ()) -> Hit:
        """Hash the files in tmp, write the manifest, and make the object visible by atomic rename.

        A symlink a step wrote is replaced by the bytes it points at only when it resolves into the step's scratch,
        this store's objects (the step's inputs) or `link_roots` (its model files, the model cache); any other link
        is refused in one line naming it (a library's link to ~/.aws/credentials is never stored or pushed).
        Every file and directory is fsynced before the rename. An existing object with this digest that is damaged
        is quarantined and replaced, never kept."""
        self.require_writable(f"storing step {provenance.get('name') or key[:12]}")
        root = self.owned
        root.confine(tmp, within=self.root / "tmp")
        try:
            _materialize_links(tmp, (tmp, self.root / "objects", *link_roots))
            files = []
            for f in _walk(tmp):
                rel = f.relative_to(tmp).as_posix()
                if rel == MANIFEST:
                    continue
                files.append({"path": rel, "size": f.stat().st_size, "sha256": sha256_file(f)})
            digest = tree_digest(files)
            manifest = {"digest": digest, "key": key, **provenance, "files": files, "created": now_iso()}
            (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=True, default=str))
            for f in _walk(tmp):
                root.chmod(f, 0o444, within=tmp)  # immutable from here on (regular files only: links were replaced)
                fsync_file(f)
            for d in {f.parent for f in _walk(tmp)} | {tmp}:
                fsync_dir(d)
            final = self.object_dir(digest)
            final.parent.mkdir(parents=True, exist_ok=True)
            if final.exists():
                problems = self.check_object(digest, full=True)
                if problems:
                    self.quarantine(digest, problems)
            try:
                root.move(tmp, final)
            except OSError:
                if not (final / MANIFEST).is_file():
                    raise
                with _quiet():
                    root.remove(tmp, within=self.root / "tmp")  # identical content already stored (and checked above)
            fsync_dir(final.parent)
            stamp = {}
            for f in files:
                st = os.lstat(final / f["path"])
                stamp[f["path"]] = [st.st_size, st.st_mtime_ns, st.st_ino, f["sha256"]]
            with _quiet_store():
                self.write_json(self._stamp_file(digest), stamp)
            object_manifest = read_json(final / MANIFEST) or manifest
            record = {**manifest, "object_manifest_key": object_manifest.get("key")}
            self.write_json(self._action_file(key), record)
        except OSError as exc:
            if exc.errno in NO_SPACE:
                needed = sum(f.stat().st_size for f in _walk(tmp)) if tmp.exists() else None
                raise store_full(self.root, f"the object of step {provenance.get('name') or key[:12]}", needed) from None
            raise
        return Hit(key, digest, final, record)

    def manifest(self, digest: str) -> dict:
        """The object's manifest; UserError (one line) when it is missing or unreadable."""
        data = read_json(self.object_dir(digest) / MANIFEST)
        if data is None:
            raise UserError(f"object {digest[:12]} in store {self.root} has no readable manifest "
                            "(run `qbuild verify --repair`)")
        return data

    # --- history (for `plan` explanations) ----------------------------------------------------------
    def _history_file(self, recipe: str, step_name: str) -> Path:
        safe = re.sub(r"[^\w.\-\[\]]", "_", step_name)
        return self.root / "history" / recipe / f"{safe}.json"

    def last_build(self, recipe: str, step_name: str) -> dict | None:
        return read_json(self._history_file(recipe, step_name))

    def remember_build(self, recipe: str, step_name: str, record: dict) -> None:
        if self.writable:
            self.write_json(self._history_file(recipe, step_name), record)

    # --- refs ------------------------------------------------------------------------------------------
    def set_ref(self, recipe: str, variant: str, tag: str, digest: str, key: str) -> None:
        for what, value in (("recipe", recipe), ("variant", variant), ("tag", tag)):
            check_name(value, what)
        current = self.get_ref(recipe, variant, tag)
        if current and current.get("digest") == digest and current.get("key") == key:
            return  # already there: a fully cached run rewrites (and fsyncs) nothing
        self.write_json(self.root / "refs" / recipe / variant / tag, {"digest": digest, "key": key, "updated": now_iso()})

    def get_ref(self, recipe: str, variant: str, tag: str) -> dict | None:
        data = read_json(self.root / "refs" / recipe / variant / tag)
        return data if data and isinstance(data.get("digest"), str) and DIGEST_RE.match(data["digest"]) else None

    def refs(self) -> list[dict]:
        out = []
        base = self.root / "refs"
        for f in sorted(base.glob("*/*/*")):
            if f.name.startswith(".") or not f.is_file():
                continue
            data = read_json(f)
            if data is None or not isinstance(data.get("digest"), str) or not DIGEST_RE.match(data["digest"]):
                continue
            recipe, variant, tag = f.relative_to(base).parts
            out.append({"ref": f"{recipe}/{variant}:{tag}", **data})
        return out

    def resolve(self, name: str) -> str:
        """Ref (recipe/variant[:tag]), full digest, 'sha256:'-prefixed digest, or a unique prefix (≥ 8)."""
        m = REF_RE.match(name)
        if m:
            tag = m.group("tag") or "latest"
            ref = self.get_ref(m.group("recipe"), m.group("variant"), tag)
            if ref is None:
                raise UserError(f"no ref {m.group('recipe')}/{m.group('variant')}:{tag} in store {self.root}")
            return ref["digest"]
        hexpart = name.removeprefix("sha256:").lower()
        if not re.fullmatch(r"[0-9a-f]{8,64}", hexpart):
            raise UserError(f"{name!r} is neither a ref (recipe/variant:tag) nor a digest")
        matches = [p.name for p in (self.root / "objects" / hexpart[:2]).glob(f"{hexpart}*")]
        if not matches:
            action = read_json(self._action_file(hexpart)) if len(hexpart) == 64 else None
            if action and isinstance(action.get("digest"), str) and DIGEST_RE.match(action["digest"]):
                return action["digest"]
            raise UserError(f"no object {name} in store {self.root}")
        if len(matches) > 1:
            raise UserError(f"digest prefix {name} is ambiguous ({len(matches)} objects)")
        return matches[0]

    def objects(self) -> Iterator[Path]:
        yield from sorted(p for p in (self.root / "objects").glob("*/*") if p.is_dir())

    # --- runs ------------------------------------------------------------------------------------------
    def new_run_id(self) -> str:
        return time.strftime("%Y%m%dT%H%M%SZ", time.gmtime()) + f"-{uuid.uuid4().hex[:6]}"

    def write_run(self, run_id: str, record: dict) -> Path | None:
        """runs/<run_id>.json; nothing on a read-only store (a fully cached run there writes nothing)."""
        check_name(run_id, "run id")
        path = self.root / "runs" / f"{run_id}.json"
        if not self.writable:
            return None
        self.write_json(path, record)
        return path

    def runs(self, recipe: str | None = None) -> list[dict]:
        """Run records, oldest first (by when they finished), of one recipe or all."""
        out = []
        for f in (self.root / "runs").glob("*.json"):
            record = None if f.is_symlink() else read_json(f)   # unreadable or foreign records are skipped
            if isinstance(record, dict) and (recipe is None or record.get("recipe") == recipe):
                out.append(record)

        def when(r):
            finished = r.get("finished")
            return (finished if isinstance(finished, int | float) else 0, str(r.get("run_id") or ""))
        return sorted(out, key=when)

    def last_good_run(self, recipe: str, before: str | None = None) -> dict | None:
        """The latest successful run of `recipe` (no step failed, its gates passed), other than run `before`."""
        for record in reversed(self.runs(recipe)):
            if record.get("run_id") == before:
                continue
            if not record.get("counts", {}).get("failed") and (record.get("gates") or {}).get("passed", True):
                return record
        return None

    # --- integrity -------------------------------------------------------------------------------------
    def verify(self, digests: list[str] | None = None, repair: bool = False) -> list[dict]:
        """Re-hash objects against their manifests; returns one row per object (never raises on bad content).

        repair: quarantine each damaged object and drop every action record that names it (the next run rebuilds)."""
        rows = []
        targets = digests if digests is not None else [p.name for p in self.objects()]
        for digest in targets:
            problems = self.check_object(digest, full=True) if self.object_dir(digest).is_dir() else ["object missing"]
            manifest = read_json(self.object_dir(digest) / MANIFEST) or {}
            row = {"digest": digest, "kind": manifest.get("kind") if isinstance(manifest.get("kind"), str) else None,
                   "ok": not problems, "problems": problems}
            if problems and repair and self.object_dir(digest).is_dir():
                self.require_writable("verify --repair")
                where = self.quarantine(digest, problems)
                row["quarantined"] = str(where) if where else None
            rows.append(row)
        if repair:
            self.require_writable("verify --repair")
            bad = {r["digest"] for r in rows if not r["ok"]}
            for rec in sorted((self.root / "actions").glob("*/*.json")):
                data = read_json(rec)
                digest = data.get("digest") if data else None
                if data is None or not isinstance(digest, str) or digest in bad or not self.object_dir(digest).is_dir() \
                        or self.check_record(rec.stem, data, digest):
                    with _quiet():
                        self.owned_existing().remove(rec)  # a miss: the step is rebuilt by the next run
        return rows


class _quiet_store:
    """Best-effort writes (stamps): a full or read-only store must not fail a lookup."""

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return exc[0] is not None and issubclass(exc[0], (StoreFull, StoreReadOnly, OSError))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _listdir(path: Path) -> list[Path]:
    try:
        return sorted(path.iterdir())
    except OSError:
        return []


def _walk(root: Path) -> list[Path]:
    """Regular files under root, sorted; never follows a symlink (links are listed as files when not materialized)."""
    out = []
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        d = Path(dirpath)
        out += [d / n for n in filenames]
        out += [d / n for n in dirnames if (d / n).is_symlink()]
    return sorted(out)


def _materialize_links(tmp: Path, allowed: tuple[Path, ...]) -> None:
    """Replace each symlink a step wrote by a fresh copy of the bytes it points at, when it resolves to a regular
    file inside one of `allowed`; refuse links to folders, to nothing, and to anywhere else (one line naming it)."""
    from qbuild.errors import StepFailed

    bases = [Path(os.path.realpath(a)) for a in allowed]
    for p in _walk(tmp):
        if not p.is_symlink():
            continue
        target = p.resolve()
        rel = p.relative_to(tmp)
        if not any(target == b or b in target.parents for b in bases):
            raise StepFailed(str(rel), f"output {rel} is a symlink to {target}, outside the step's scratch, inputs and "
                             "model files; refusing to store it (a library must write the file itself)")
        if not target.is_file():
            raise StepFailed(str(rel), f"output {rel} is a symlink to "
                             f"{'a directory' if target.is_dir() else 'nothing'}; write the file itself")
        staged = p.with_name(f".{p.name}.{uuid.uuid4().hex[:8]}.copy")
        shutil.copyfile(target, staged)
        os.replace(staged, p)


def open_store(path: str | os.PathLike | None, recipe_default: str | None = None) -> Store:
    """--store beats QBUILD_STORE beats the recipe's store.path beats ./artifacts."""
    root = path or os.environ.get("QBUILD_STORE") or recipe_default or "./artifacts"
    return Store(Path(root))


__all__ = ["Store", "Hit", "open_store", "canonical_json", "StoreFull", "StoreReadOnly", "read_json"]
