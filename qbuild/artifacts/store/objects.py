"""Objects and the action cache: a step key's hit (checked before use), publishing a step's output as an immutable
object under a per-key lock, and its private scratch."""

from __future__ import annotations

import json
import os
import re
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from qbuild.artifacts.store.binding import MANIFEST_DIGEST, manifest_digest
from qbuild.artifacts.store.files import (
    _materialize_links,
    _quiet,
    _quiet_store,
    _walk,
    checked_digest,
    fsync_dir,
    fsync_file,
    now_iso,
    read_json,
    store_full,
    valid_files,
)
from qbuild.artifacts.store.layout import DIGEST_RE, MANIFEST, NO_SPACE, SCRATCH_RE, Hit, log
from qbuild.base.errors import UserError
from qbuild.base.hashing import sha256_file, tree_digest


class ObjectsMixin:
    """Store methods: objects and the action cache: a step key's hit (checked before use), publishing a step's output
    as an immutable object under a per-key lock, and its private scratch."""

    # --- paths -----------------------------------------------------------------------------------
    def object_dir(self, digest: str) -> Path:
        return self.root / "objects" / digest[:2] / checked_digest(digest)

    def _action_file(self, key: str) -> Path:
        return self.root / "actions" / key[:2] / f"{checked_digest(key, 'step key')}.json"

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
            root.write_bytes(tmp / MANIFEST, json.dumps(manifest, indent=2, sort_keys=True, default=str).encode(),
                             within=tmp)
            for f in _walk(tmp):
                root.chmod(f, 0o444, within=tmp)  # immutable from here on (regular files only: links were replaced)
                fsync_file(f)
            for d in {f.parent for f in _walk(tmp)} | {tmp}:
                fsync_dir(d)
            final = self.object_dir(digest)
            root.mkdirs(final.parent)
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
            # the commit point binds the object's manifest.json (store/binding.py): pull and verify check it
            record = {**manifest, "object_manifest_key": object_manifest.get("key"),
                      MANIFEST_DIGEST: manifest_digest(object_manifest)}
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

    def objects(self) -> Iterator[Path]:
        yield from sorted(p for p in (self.root / "objects").glob("*/*") if p.is_dir())

    # --- the reading interface the local store shares with remotes (qbuild.artifacts.StoreReader) -----------------
    def list_objects(self) -> list[str]:
        return [p.name for p in self.objects() if DIGEST_RE.match(p.name)]

    def get_manifest(self, digest: str) -> dict | None:
        """The object's manifest, or None where it is missing or unreadable."""
        return read_json(self.object_dir(digest) / MANIFEST)

    @contextmanager
    def lock(self, key: str, timeout: float = -1) -> Iterator[None]:
        """Per-key lock: concurrent runs build a step once; the others wait, then hit."""
        from filelock import FileLock

        if not re.fullmatch(r"[\w.-]{1,100}", key):
            raise ValueError(f"invalid lock name {key[:80]!r}")
        lock_dir = self.root / "locks"
        self.owned.mkdirs(lock_dir)   # the first write claims the root
        with FileLock(str(lock_dir / f"{key}.lock"), timeout=timeout):
            yield

    def new_tmp(self, key: str) -> Path:
        """Private scratch dir for building `key`. Call with the key's lock held."""
        checked_digest(key, "step key")
        root = self.owned   # the first write claims the store
        tmp_root = self.root / "tmp"
        root.mkdirs(tmp_root)
        for stale in tmp_root.glob(f"{key}.*"):  # left by a crashed build of this key
            if SCRATCH_RE.match(stale.name):
                with _quiet():
                    root.remove(stale)
        path = tmp_root / f"{key}.{os.getpid()}.{uuid.uuid4().hex[:8]}"
        root.confine(path)
        path.mkdir()   # a new name (pid, random) in a folder checked above: fails rather than follows
        return path
