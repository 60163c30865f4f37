"""Local content-addressed store.

Layout (the same on any filesystem; see docs/architecture.md):
  objects/<dd>/<digest>/        immutable artifact files + manifest.json (provenance of its producer)
  actions/<kk>/<key>.json       action cache: step key -> digest, with that step's provenance
  refs/<recipe>/<variant>/<tag> mutable names -> digest
  history/<recipe>/<step>.json  last build of each named step, so `plan` can say why a step misses
  runs/<run-id>.json            one record per invocation
  tmp/  locks/  logs/           private scratch: never visible as objects
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from qbuild.errors import UserError
from qbuild.hashing import canonical_json, sha256_file, tree_digest

MANIFEST = "manifest.json"
REF_RE = re.compile(r"^(?P<recipe>[A-Za-z0-9][\w.-]*)/(?P<variant>[A-Za-z0-9][\w.-]*)(?::(?P<tag>[\w.-]+))?$")


def atomic_write_json(path: Path, data) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
    tmp.write_text(json.dumps(data, indent=2, sort_keys=True, default=str))
    os.replace(tmp, path)


def now_iso() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


@dataclass(frozen=True)
class Hit:
    key: str
    digest: str
    path: Path
    record: dict


class Store:
    def __init__(self, root: Path):
        self.root = Path(root).absolute()

    # --- paths -----------------------------------------------------------------------------------
    def object_dir(self, digest: str) -> Path:
        return self.root / "objects" / digest[:2] / digest

    def _action_file(self, key: str) -> Path:
        return self.root / "actions" / key[:2] / f"{key}.json"

    def log_path(self, run_id: str, step_name: str) -> Path:
        safe = re.sub(r"[^\w.\-\[\]]", "_", step_name)
        return self.root / "logs" / run_id / f"{safe}.log"

    # --- action cache ----------------------------------------------------------------------------
    def lookup(self, key: str) -> Hit | None:
        """A hit needs both the action record and its object on disk."""
        try:
            record = json.loads(self._action_file(key).read_text())
        except (OSError, ValueError):
            return None
        path = self.object_dir(record["digest"])
        if not (path / MANIFEST).is_file():
            return None
        return Hit(key, record["digest"], path, record)

    @contextmanager
    def lock(self, key: str, timeout: float = -1) -> Iterator[None]:
        """Per-key lock: concurrent runs build a step once; the others wait, then hit."""
        from filelock import FileLock

        lock_dir = self.root / "locks"
        lock_dir.mkdir(parents=True, exist_ok=True)
        with FileLock(str(lock_dir / f"{key}.lock"), timeout=timeout):
            yield

    def new_tmp(self, key: str) -> Path:
        """Private scratch dir for building `key`. Call with the key's lock held."""
        tmp_root = self.root / "tmp"
        tmp_root.mkdir(parents=True, exist_ok=True)
        for stale in tmp_root.glob(f"{key}.*"):  # left by a crashed build of this key
            shutil.rmtree(stale, ignore_errors=True)
        path = tmp_root / f"{key}.{os.getpid()}.{uuid.uuid4().hex[:8]}"
        path.mkdir()
        return path

    def publish(self, key: str, tmp: Path, provenance: dict) -> Hit:
        """Hash the files in tmp, write the manifest, and make the object visible by atomic rename."""
        files = []
        for f in sorted(p for p in tmp.rglob("*") if p.is_file()):
            rel = f.relative_to(tmp).as_posix()
            if rel == MANIFEST:
                continue
            files.append({"path": rel, "size": f.stat().st_size, "sha256": sha256_file(f)})
        digest = tree_digest(files)
        manifest = {"digest": digest, "key": key, **provenance, "files": files, "created": now_iso()}
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=True, default=str))
        for f in tmp.rglob("*"):
            if f.is_file():
                f.chmod(0o444)  # immutable from here on
        final = self.object_dir(digest)
        final.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.rename(tmp, final)
        except OSError:
            if not (final / MANIFEST).is_file():
                raise
            shutil.rmtree(tmp, ignore_errors=True)  # identical content already stored
        record = {**manifest, "object_manifest_key": json.loads((final / MANIFEST).read_text())["key"]}
        atomic_write_json(self._action_file(key), record)
        return Hit(key, digest, final, record)

    def manifest(self, digest: str) -> dict:
        return json.loads((self.object_dir(digest) / MANIFEST).read_text())

    # --- history (for `plan` explanations) ----------------------------------------------------------
    def _history_file(self, recipe: str, step_name: str) -> Path:
        safe = re.sub(r"[^\w.\-\[\]]", "_", step_name)
        return self.root / "history" / recipe / f"{safe}.json"

    def last_build(self, recipe: str, step_name: str) -> dict | None:
        try:
            return json.loads(self._history_file(recipe, step_name).read_text())
        except (OSError, ValueError):
            return None

    def remember_build(self, recipe: str, step_name: str, record: dict) -> None:
        atomic_write_json(self._history_file(recipe, step_name), record)

    # --- refs ------------------------------------------------------------------------------------------
    def set_ref(self, recipe: str, variant: str, tag: str, digest: str, key: str) -> None:
        atomic_write_json(
            self.root / "refs" / recipe / variant / tag, {"digest": digest, "key": key, "updated": now_iso()}
        )

    def refs(self) -> list[dict]:
        out = []
        base = self.root / "refs"
        for f in sorted(base.glob("*/*/*")):
            if f.name.startswith("."):
                continue
            try:
                data = json.loads(f.read_text())
            except (OSError, ValueError):
                continue
            recipe, variant, tag = f.relative_to(base).parts
            out.append({"ref": f"{recipe}/{variant}:{tag}", **data})
        return out

    def resolve(self, name: str) -> str:
        """Ref (recipe/variant[:tag]), full digest, 'sha256:'-prefixed digest, or a unique prefix (≥ 8)."""
        m = REF_RE.match(name)
        if m:
            tag = m.group("tag") or "latest"
            f = self.root / "refs" / m.group("recipe") / m.group("variant") / tag
            try:
                return json.loads(f.read_text())["digest"]
            except (OSError, ValueError):
                raise UserError(f"no ref {m.group('recipe')}/{m.group('variant')}:{tag} in store {self.root}") from None
        hexpart = name.removeprefix("sha256:").lower()
        if not re.fullmatch(r"[0-9a-f]{8,64}", hexpart):
            raise UserError(f"{name!r} is neither a ref (recipe/variant:tag) nor a digest")
        matches = [p.name for p in (self.root / "objects" / hexpart[:2]).glob(f"{hexpart}*")]
        if not matches:
            action = self.lookup(hexpart) if len(hexpart) == 64 else None
            if action:
                return action.digest
            raise UserError(f"no object {name} in store {self.root}")
        if len(matches) > 1:
            raise UserError(f"digest prefix {name} is ambiguous ({len(matches)} objects)")
        return matches[0]

    def objects(self) -> Iterator[Path]:
        yield from sorted((self.root / "objects").glob("*/*"))

    # --- runs ------------------------------------------------------------------------------------------
    def new_run_id(self) -> str:
        return time.strftime("%Y%m%dT%H%M%SZ", time.gmtime()) + f"-{uuid.uuid4().hex[:6]}"

    def write_run(self, run_id: str, record: dict) -> Path:
        path = self.root / "runs" / f"{run_id}.json"
        atomic_write_json(path, record)
        return path

    def runs(self, recipe: str | None = None) -> list[dict]:
        """Run records, oldest first (by when they finished), of one recipe or all."""
        out = []
        for f in (self.root / "runs").glob("*.json"):
            try:
                record = json.loads(f.read_text())
            except (OSError, ValueError):
                continue
            if recipe is None or record.get("recipe") == recipe:
                out.append(record)
        return sorted(out, key=lambda r: (r.get("finished") or 0, r.get("run_id") or ""))

    def last_good_run(self, recipe: str, before: str | None = None) -> dict | None:
        """The latest successful run of `recipe` (no step failed, its gates passed), other than run `before`."""
        for record in reversed(self.runs(recipe)):
            if record.get("run_id") == before:
                continue
            if not record.get("counts", {}).get("failed") and (record.get("gates") or {}).get("passed", True):
                return record
        return None

    # --- integrity -------------------------------------------------------------------------------------
    def verify(self, digests: list[str] | None = None) -> list[dict]:
        """Re-hash objects against their manifests; returns one row per object."""
        rows = []
        targets = [self.object_dir(d) for d in digests] if digests else list(self.objects())
        for obj in targets:
            problems = []
            try:
                manifest = json.loads((obj / MANIFEST).read_text())
            except (OSError, ValueError) as exc:
                rows.append({"digest": obj.name, "ok": False, "problems": [f"manifest unreadable: {exc}"]})
                continue
            listed = {f["path"] for f in manifest["files"]}
            for f in manifest["files"]:
                p = obj / f["path"]
                if not p.is_file():
                    problems.append(f"missing file {f['path']}")
                elif p.stat().st_size != f["size"]:
                    problems.append(f"size changed: {f['path']}")
                elif sha256_file(p) != f["sha256"]:
                    problems.append(f"content changed: {f['path']}")
            for p in obj.rglob("*"):
                rel = p.relative_to(obj).as_posix()
                if p.is_file() and rel != MANIFEST and rel not in listed:
                    problems.append(f"unexpected file {rel}")
            if tree_digest(manifest["files"]) != obj.name:
                problems.append("manifest does not match the object's digest")
            rows.append({"digest": obj.name, "kind": manifest.get("kind"), "ok": not problems, "problems": problems})
        return rows


def open_store(path: str | os.PathLike | None, recipe_default: str | None = None) -> Store:
    """--store beats QBUILD_STORE beats the recipe's store.path beats ./artifacts."""
    root = path or os.environ.get("QBUILD_STORE") or recipe_default or "./artifacts"
    return Store(Path(root))


__all__ = ["Store", "Hit", "open_store", "canonical_json"]
