"""Integrity: an object's files against its manifest (through the stamp memo), quarantine of a damaged one, and
`qbuild verify`."""

from __future__ import annotations

import os
import stat
import time
import uuid
from pathlib import Path

from qbuild.artifacts.store.files import _quiet, _quiet_store, _walk, checked_digest, fsync_dir, read_json, valid_files
from qbuild.artifacts.store.layout import MANIFEST, log
from qbuild.base.hashing import memo_sha256, tree_digest


class IntegrityMixin:
    """Store methods: integrity: an object's files against its manifest (through the stamp memo), quarantine of a
    damaged one, and `qbuild verify`."""

    def _stamp_file(self, digest: str) -> Path:
        return self.root / "stamps" / digest[:2] / f"{checked_digest(digest)}.json"

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
        try:
            self.owned.mkdirs(dest.parent)
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
