"""A remote on any fsspec filesystem: s3:// (s3fs), gs://, az://, file:// (an NFS mount) and the rest.

The layout under the URL's prefix is the local store's, plus sidecars:
  objects/<dd>/<digest>/<files>        the artifact's files, written first
  objects/<dd>/<digest>/manifest.json  written after every file: an object is complete when it exists
  actions/<kk>/<key>.json              action records, written last (the commit point)
  refs/<recipe>/<variant>/<tag>        {"digest", "key", "updated"}
  sidecars/<dd>/<digest>/<name>        model card (README.md), provenance, signature
On file:// every write goes to a temporary name first and is renamed; object stores (S3, GCS, Azure)
make each PUT visible atomically, so the ordering above is the only commit protocol needed.
Credentials come from the library's provider chain (AWS_*, AWS_ENDPOINT_URL[_S3], instance roles...);
the recipe may add only `endpoint_url` and `region`.
"""

from __future__ import annotations

import json
import logging
import os
import uuid
from collections.abc import Iterable, Iterator
from pathlib import Path

from qbuild.artifacts.remote import remotes
from qbuild.artifacts.remote.base import (
    CHUNK,
    HEX64,
    MANIFEST,
    MAX_JSON_BYTES,
    Progress,
    RemoteConfigError,
    RemoteError,
    RemoteRefused,
    RemoteStore,
    bounded_json,
    check_digest,
    check_name,
    check_sidecar,
    hash_while_uploading,
    read_bounded,
    remote_record,
)
from qbuild.artifacts.remote.fsspec_upload import append_upload, multipart_upload, partial_name
from qbuild.artifacts.remote.resume import UploadResume
from qbuild.artifacts.store import now_iso
from qbuild.base.errors import first_line
from qbuild.base.names import valid_name

CONNECT_TIMEOUT = 5
READ_TIMEOUT = 60
BLOB_CHUNK = 32 << 20
RESUMABLE_MIN = 32 << 20   # smaller files are sent whole: a restart costs little
log = logging.getLogger("qbuild")
OBJECT_STORES = ("s3", "s3a", "gs", "gcs", "az", "abfs", "abfss", "adl")


@remotes.register
class FsspecRemote(RemoteStore):
    name = "fsspec"
    schemes = ("s3", "s3a", "gs", "gcs", "az", "abfs", "abfss", "file", "memory")
    extra = "s3"
    requires = ("fsspec",)

    def __init__(self, url: str, **options):
        super().__init__(url, **options)
        import fsspec
        from fsspec.core import url_to_fs

        try:
            fsspec.get_filesystem_class(self.scheme)
        except (ImportError, ValueError) as exc:
            raise RemoteConfigError(self.display, f"{self.scheme}:// needs a filesystem library that is not "
                                                  f"installed ({first_line(exc)})") from None
        opts: dict = {"skip_instance_cache": True}
        if self.scheme in ("s3", "s3a"):
            opts["config_kwargs"] = {"connect_timeout": CONNECT_TIMEOUT, "read_timeout": READ_TIMEOUT,
                                     "retries": {"max_attempts": 2, "mode": "standard"}}
            if self.endpoint_url:
                opts["endpoint_url"] = self.endpoint_url
            if self.region:
                opts["client_kwargs"] = {"region_name": self.region}
            if self.insecure:
                opts["use_ssl"] = False
        elif self.endpoint_url or self.region:
            raise RemoteConfigError(self.display, "endpoint_url/region apply to s3:// remotes only")
        try:
            self.fs, root = url_to_fs(url, **opts)
        except (ImportError, ValueError, TypeError) as exc:
            raise RemoteConfigError(self.display, f"cannot open: {exc}") from None
        if self.scheme in ("s3", "s3a"):
            self.fs.retries = 2
        self.root = root.rstrip("/")
        self.atomic_rename = self.scheme in ("file", "memory")
        self.is_s3 = self.scheme in ("s3", "s3a")

    # --- paths ---------------------------------------------------------------------------------------
    def _p(self, *parts: str) -> str:
        return "/".join([self.root, *parts])

    def _obj(self, digest: str, *rest: str) -> str:
        return self._p("objects", digest[:2], digest, *rest)

    def _action(self, key: str) -> str:
        return self._p("actions", key[:2], f"{key}.json")

    def _sidecar(self, digest: str, name: str) -> str:
        return self._p("sidecars", digest[:2], digest, name)

    # --- low level, every failure translated to one line -----------------------------------------------
    def _call(self, what: str, fn, *args, missing_ok: bool = False, **kwargs):
        try:
            return fn(*args, **kwargs)
        except FileNotFoundError:
            if missing_ok:
                return None
            raise self.error(f"{what}: not found (missing bucket or path?)") from None
        except PermissionError as exc:
            raise self.error(f"{what}: access denied ({first_line(exc)}); check the credentials "
                             "(AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY or the provider chain)") from None
        except RemoteError:
            raise
        except Exception as exc:
            raise self.error(f"{what} failed: {_describe(exc)}") from None

    def _read_bytes(self, path: str, limit: int = MAX_JSON_BYTES) -> bytes | None:
        """A small file (record, manifest, sidecar), or None when absent. Bounded: its size is asked first and a
        larger one refused before a byte is read; the read itself streams and stops past `limit`."""
        what = self._rel(path)

        def read() -> bytes:
            with self.fs.open(path, "rb", block_size=CHUNK) as f:
                size = getattr(f, "size", None)   # object stores: from the HEAD that opening made
                if not isinstance(size, int):
                    size = self.fs.size(path)     # file://: a stat
                try:
                    return read_bounded(iter(lambda: f.read(CHUNK), b""), what,
                                        size if isinstance(size, int) else None, limit)
                except ValueError as exc:
                    raise RemoteRefused(self.display, f"refused: {first_line(exc)}") from None

        return self._call(f"read {what}", read, missing_ok=True)

    def _write_bytes(self, path: str, data: bytes) -> None:
        def write():
            if self.atomic_rename:
                parent = path.rsplit("/", 1)[0]
                self.fs.makedirs(parent, exist_ok=True)
                tmp = f"{parent}/.{path.rsplit('/', 1)[1]}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp"
                self.fs.pipe_file(tmp, data)
                self.fs.mv(tmp, path)
            else:
                self.fs.pipe_file(path, data)
        self._call(f"write {self._rel(path)}", write)

    def _read_json(self, path: str) -> dict | None:
        data = self._read_bytes(path)
        if data is None:
            return None
        try:
            out = bounded_json(data, self._rel(path))
        except ValueError as exc:
            raise RemoteRefused(self.display, f"refused: {first_line(exc)}") from None
        return out if isinstance(out, dict) else None

    def _read_record(self, path: str) -> dict | None:
        """One record of a listing: a bad one (too large, too deep, not JSON) is skipped with a warning naming it,
        so it fails alone; an unreachable remote still fails the listing."""
        try:
            return self._read_json(path)
        except RemoteRefused as exc:
            log.warning(str(exc))
            return None

    def _rel(self, path: str) -> str:
        return path[len(self.root) + 1:] if path.startswith(self.root + "/") else path

    # --- contract ------------------------------------------------------------------------------------------
    def check(self) -> None:
        if self.scheme in OBJECT_STORES:
            bucket = self.root.split("/", 1)[0]
            if not bucket:
                raise RemoteConfigError(self.display, "no bucket in the URL")
            self._call(f"bucket {bucket}", self.fs.ls, bucket, detail=False, refresh=True)
        else:
            parent = self.root.rsplit("/", 1)[0] or "/"
            if not self._call("stat", self.fs.exists, parent):
                raise self.error(f"{parent} does not exist (is the share mounted?)")
            self._call("create", self.fs.makedirs, self.root, exist_ok=True)

    def _read_manifest(self, digest: str) -> dict | None:
        check_digest(digest)
        return self._read_json(self._obj(digest, MANIFEST))

    def has_object(self, digest: str) -> bool:
        """True when the object's manifest is `digest`'s (a planted or damaged one is not: a push uploads the
        object again) and every file it lists is there with its size."""
        try:
            manifest = self.get_manifest(digest)
        except RemoteRefused:
            return False
        if manifest is None:
            return False
        listing = self._call("list", self.fs.find, self._obj(digest), detail=True, missing_ok=True) or {}
        sizes = {self._rel(p): (info.get("size") if info.get("type", "file") == "file" else None)
                 for p, info in listing.items()}
        prefix = f"objects/{digest[:2]}/{digest}/"
        return all(sizes.get(prefix + f["path"]) == f["size"] for f in manifest["files"])

    def put_object(self, digest: str, local_dir: Path, manifest: dict, progress: Progress | None = None,
                   sidecars: dict[str, bytes] | None = None, resume: UploadResume | None = None,
                   replace: Iterable[str] = ()) -> None:
        files = self._push_files(digest, manifest)
        replace = set(replace)   # found damaged by their content: uploaded again though present with their size
        if not replace and self.has_object(digest):
            for name, data in (sidecars or {}).items():
                self.put_sidecar(digest, name, data)
            return
        listing = self._call("list", self.fs.find, self._obj(digest), detail=True, missing_ok=True) or {}
        have = {self._rel(p): info.get("size") for p, info in listing.items()}
        prefix = f"objects/{digest[:2]}/{digest}/"

        def put(src: Path, f: dict) -> None:
            dst = self._obj(digest, f["path"])
            if resume is not None and f["size"] >= RESUMABLE_MIN and (self.atomic_rename or self.is_s3):
                self._upload_resumable(src, dst, f, digest, resume)
            elif self.atomic_rename:
                parent = dst.rsplit("/", 1)[0]
                self._call("mkdir", self.fs.makedirs, parent, exist_ok=True)
                tmp = f"{parent}/.{f['path'].rsplit('/', 1)[-1]}.{uuid.uuid4().hex[:8]}.tmp"
                self._upload_verified(src, tmp, f)
                self._call(f"upload {f['path']}", self.fs.mv, tmp, dst)
            else:
                self._upload_verified(src, dst, f)

        self._upload_files(local_dir, files,
                           lambda f: f["path"] not in replace and have.get(prefix + f["path"]) == f["size"], put, progress)
        for name, data in (sidecars or {}).items():
            self.put_sidecar(digest, name, data)
        self._write_bytes(self._obj(digest, MANIFEST),
                          json.dumps(manifest, indent=2, sort_keys=True, default=str).encode())

    def _upload_verified(self, src: Path, path: str, entry: dict) -> None:
        """Stream src to `path`, hashed on the way; bytes that are not the manifest's do not stay on the remote
        (the object's manifest, written after every file, is never written for them either)."""
        def upload() -> bool:
            with self.fs.open(path, "wb", block_size=BLOB_CHUNK) as out:
                return hash_while_uploading(src, out, entry)

        if not self._call(f"upload {entry['path']}", upload):
            self._call(f"remove {entry['path']}", self.fs.rm, path, missing_ok=True)
            raise self.mismatch(entry)

    def _upload_resumable(self, src: Path, dst: str, entry: dict, digest: str, resume: UploadResume) -> None:
        """Upload one large file so that a push cut off in the middle continues it (qbuild.artifacts.remote.
        fsspec_upload): a partial file renamed into place, or an S3 multipart upload."""
        what = f"upload {entry['path']}"
        upload = resume.upload(self.display, digest, entry["path"])
        if self.is_s3:
            ok, kept = self._call(what, multipart_upload, self.fs, src, dst, entry, upload.get(), upload.remember)
        else:
            parent, name = dst.rsplit("/", 1)
            self._call("mkdir", self.fs.makedirs, parent, exist_ok=True)
            part = partial_name(parent, name, upload.get())
            upload.remember({"part": part.rsplit("/", 1)[1]})
            ok, kept = self._call(what, append_upload, self.fs, src, part, entry)
            if ok:
                self._call(what, self.fs.mv, part, dst)
            else:
                self._call(f"remove {entry['path']}", self.fs.rm, part, missing_ok=True)
        upload.drop()
        self._count(bytes_resumed=kept)
        if not ok:
            raise self.mismatch(entry)

    def _read_file(self, digest: str, entry: dict, offset: int) -> Iterator[bytes]:
        path = self._obj(digest, entry["path"])
        size = entry["size"]
        while offset < size:
            end = min(offset + BLOB_CHUNK, size)
            data = self._call(f"download {entry['path']}", self.fs.cat_file, path, start=offset, end=end)
            if not data:
                return
            view = memoryview(data)  # zero-copy slices: hashing and writing are the only passes over the bytes
            for i in range(0, len(view), CHUNK):
                yield view[i:i + CHUNK]
            offset += len(data)

    def get_action(self, key: str) -> dict | None:
        """The action record of `key`, or None: None too when the record does not name a valid object, or its
        object's manifest is gone (collected) or not that object's (so a push uploads it again, and a lookup misses).
        A record that is no JSON record at all (too large, too deep) is refused in one line naming it."""
        check_digest(key)
        record = remote_record(self._read_json(self._action(key)), key)
        if record is None:
            return None
        try:
            if self.get_manifest(record["digest"]) is None:
                return None  # its object was collected
        except RemoteRefused:
            return None
        return record

    def put_action(self, key: str, record: dict) -> None:
        check_digest(key)
        check_digest(record.get("digest", ""))
        self._write_bytes(self._action(key), json.dumps(record, indent=2, sort_keys=True, default=str).encode())

    def list_actions(self) -> Iterator[tuple[str, str]]:
        paths = self._call("list actions", self.fs.find, self._p("actions"), missing_ok=True) or []
        for p in paths:
            name = p.rsplit("/", 1)[-1]
            if name.endswith(".json") and not name.startswith(".") and HEX64.match(name[:-5]):
                rec = remote_record(self._read_record(p))
                if rec:
                    yield name[:-5], rec["digest"]

    def set_ref(self, recipe: str, variant: str, tag: str, digest: str, key: str | None = None,
                annotations: dict[str, str] | None = None) -> None:
        check_name("recipe", recipe), check_name("variant", variant), check_name("tag", tag)
        check_digest(digest)
        record = {"digest": digest, "key": key, "updated": now_iso(), **({"annotations": annotations} if annotations else {})}
        self._write_bytes(self._p("refs", recipe, variant, tag), json.dumps(record, sort_keys=True).encode())

    def get_ref(self, recipe: str, variant: str, tag: str = "latest") -> dict | None:
        check_name("recipe", recipe), check_name("variant", variant), check_name("tag", tag)
        data = remote_record(self._read_json(self._p("refs", recipe, variant, tag)))
        return None if data is None else {**data, "ref": f"{recipe}/{variant}:{tag}"}

    def list_refs(self) -> list[dict]:
        paths = self._call("list refs", self.fs.find, self._p("refs"), missing_ok=True) or []
        out = []
        for p in sorted(paths):
            parts = self._rel(p).split("/")
            if len(parts) != 4 or parts[3].startswith("."):
                continue
            if not all(valid_name(x) for x in parts[1:]):
                continue
            data = remote_record(self._read_record(p))
            if data:
                out.append({**data, "ref": f"{parts[1]}/{parts[2]}:{parts[3]}"})
        return out

    def list_objects(self) -> list[str]:
        paths = self._call("list objects", self.fs.glob, self._p("objects", "*", "*", MANIFEST)) or []
        return sorted(d for d in (p.rsplit("/", 2)[-2] for p in paths) if HEX64.match(d))

    def delete_object(self, digest: str) -> None:
        check_digest(digest)
        for key, d in list(self.list_actions()):
            if d == digest:
                self._call("delete action", self.fs.rm_file, self._action(key))
        # the manifest goes first: from then on the object is incomplete, never half-visible
        if self._read_bytes(self._obj(digest, MANIFEST)) is not None:
            self._call("delete manifest", self.fs.rm_file, self._obj(digest, MANIFEST))
        for base in (self._obj(digest), self._p("sidecars", digest[:2], digest)):
            if self._call("stat", self.fs.exists, base):
                self._call("delete", self.fs.rm, base, recursive=True)

    def put_sidecar(self, digest: str, name: str, data: bytes) -> None:
        check_digest(digest), check_sidecar(name)
        self._write_bytes(self._sidecar(digest, name), data)

    def get_sidecar(self, digest: str, name: str) -> bytes | None:
        check_digest(digest), check_sidecar(name)
        return self._read_bytes(self._sidecar(digest, name))


def _describe(exc: BaseException) -> str:
    """A network failure in a few words: the root cause's class and first line."""
    seen = exc
    while seen.__cause__ is not None or seen.__context__ is not None:
        nxt = seen.__cause__ or seen.__context__
        if nxt is seen:
            break
        seen = nxt
    root = seen if seen is not exc else exc
    name = type(root).__name__
    text = f"{name}: {first_line(root)}"
    if "Refused" in name or "Connect call failed" in text or "EndpointConnectionError" in text or "gaierror" in name:
        return f"unreachable ({text})"
    if any(s in name for s in ("Connection", "Timeout", "Disconnected")) or isinstance(root, (ConnectionError,
                                                                                             TimeoutError)):
        return f"network error ({text})"
    return text


__all__ = ["FsspecRemote"]
