"""Unfinished uploads that a local store remembers, so a push cut off in the middle of a multi-GB file continues
where it stopped instead of from its first byte.

One small record per (remote, object, file) under the store's tmp/uploads/, written through the store's guarded
root. It holds what the backend needs to continue its own upload: for a file:// remote the name of its partial
file, for S3 the multipart upload's id, for an OCI registry the upload session's URL. A record belongs to one
store, so two stores pushing the same object never continue each other's upload: each has its own partial file,
upload id or session, and whichever finishes last writes the same bytes (the object is content-addressed).
Within one store the pushes of one object hold the store's lock of that object (push_hit), so one record is
never used by two uploads at once. A record is a hint, never trusted: the backend checks that what the remote
holds is a prefix of the local file (hashes, ETags, or the registry's digest check) and otherwise starts over.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

from qbuild.base.owned import OwnedRoot

MAX_RECORD = 4096


@dataclass(frozen=True)
class UploadResume:
    root: OwnedRoot    # the local store's guarded root
    folder: Path       # <store>/tmp/uploads

    def _record(self, remote: str, digest: str, path: str) -> Path:
        name = hashlib.sha256(f"{remote}\0{digest}\0{path}".encode()).hexdigest()[:40]
        return self.folder / f"{name}.json"

    def get(self, remote: str, digest: str, path: str) -> dict | None:
        """The record of an unfinished upload of `path` of object `digest` to `remote`, or None."""
        try:
            data = json.loads(self._record(remote, digest, path).read_bytes()[:MAX_RECORD])
        except (OSError, ValueError):
            return None
        return data if isinstance(data, dict) else None

    def put(self, remote: str, digest: str, path: str, record: dict) -> None:
        self.root.mkdirs(self.folder)
        self.root.write_bytes(self._record(remote, digest, path), json.dumps(record).encode(), durable=False)

    def drop(self, remote: str, digest: str, path: str) -> None:
        self.root.remove(self._record(remote, digest, path))

    def upload(self, remote: str, digest: str, path: str) -> FileUpload:
        return FileUpload(self, remote, digest, path)


@dataclass(frozen=True)
class FileUpload:
    """The record of one file's upload: (remote, object, file) bound, for the backend that continues it."""

    resume: UploadResume
    remote: str
    digest: str
    path: str

    def get(self) -> dict | None:
        return self.resume.get(self.remote, self.digest, self.path)

    def remember(self, record: dict) -> None:
        self.resume.put(self.remote, self.digest, self.path, record)

    def drop(self) -> None:
        self.resume.drop(self.remote, self.digest, self.path)


def store_resume(store) -> UploadResume:
    """The unfinished-upload records of a local store (qbuild.artifacts.store.Store)."""
    return UploadResume(store.owned, Path(os.fspath(store.root)) / "tmp" / "uploads")
