"""Resumable uploads of one file to an fsspec remote (qbuild.artifacts.remote.resume says who remembers what).

* A filesystem with renames (file://, an NFS mount): the file is written to a partial name of this push's own
  (`.<name>.<random>.part`, remembered), appended to where it stopped, and renamed into place when complete. What
  the partial holds is checked against the local file's first bytes (both hashed) before anything is appended.
* S3: a multipart upload, its id remembered. On resume, S3's list of uploaded parts is checked part by part against
  the local file (each part's ETag is its MD5), and only the parts missing or different are sent.

Either way the local file is read once (the parts already uploaded are read to check them, the rest to send it),
its sha256 is computed on the way, and a file whose bytes are not its manifest's is never completed on the remote.
"""

from __future__ import annotations

import hashlib
import re
import uuid
from pathlib import Path

from qbuild.base.hashing import copy_hashed

PART_RE = re.compile(r"^\.[^/]{1,255}\.[0-9a-f]{12}\.part$")
MIN_PART = 8 << 20          # S3: every part but the last is at least 5 MiB
MAX_PARTS = 10_000          # S3's limit


def partial_name(parent: str, name: str, record: dict | None) -> str:
    """The remembered partial file of this upload when the record names a valid one in `parent`, else a new one.
    A record is never trusted as a path: only a name of the partial pattern, for this file, inside `parent`."""
    kept = (record or {}).get("part")
    if isinstance(kept, str) and PART_RE.match(kept) and kept.startswith(f".{name}."):
        return f"{parent}/{kept}"
    return f"{parent}/.{name}.{uuid.uuid4().hex[:12]}.part"


def append_upload(fs, src: Path, part: str, entry: dict) -> tuple[bool, int]:
    """Write `src` into the remote file `part`, continuing it where it holds a prefix of `src`. Returns (whether
    the whole file hashed to the entry's sha256, bytes that were already there)."""
    have = _size(fs, part)
    if have is None or have > entry["size"]:
        have = 0
    h = hashlib.sha256()
    with open(src, "rb") as inp:
        if have:
            with fs.open(part, "rb") as there:
                theirs = copy_hashed(there, None, limit=have)
            if copy_hashed(inp, None, hasher=h, limit=have) != theirs:   # not our bytes: from the start
                have, h = 0, hashlib.sha256()
                inp.seek(0)
        with fs.open(part, "ab" if have else "wb") as out:
            return copy_hashed(inp, out, detach=True, hasher=h) == entry["sha256"], have


def multipart_upload(fs, src: Path, path: str, entry: dict, record: dict | None, remember) -> tuple[bool, int]:
    """Upload `src` to the S3 object `path` as a multipart upload, continuing the one `record` names where S3
    still has it; `remember(record)` keeps the new upload's id. Returns (whether it hashed to the entry's sha256
    and was completed, bytes already uploaded). A mismatch aborts the upload: nothing of it stays."""
    bucket, key = fs.split_path(path)[:2]
    part_size = max(MIN_PART, -(-entry["size"] // MAX_PARTS))
    upload_id, done = _continue(fs, bucket, key, part_size, record)
    if upload_id is None:
        upload_id = fs.call_s3("create_multipart_upload", Bucket=bucket, Key=key)["UploadId"]
        remember({"upload_id": upload_id, "key": key, "part_size": part_size})
    h, parts, kept = hashlib.sha256(), [], 0
    with open(src, "rb") as inp:
        for number in range(1, max(1, -(-entry["size"] // part_size)) + 1):
            data = inp.read(part_size)
            h.update(data)
            etag, size = done.get(number, (None, None))
            if etag is not None and size == len(data) and etag.strip('"') == hashlib.md5(data).hexdigest():
                kept += len(data)
            else:
                etag = fs.call_s3("upload_part", Bucket=bucket, Key=key, UploadId=upload_id, PartNumber=number,
                                  Body=data)["ETag"]
            parts.append({"PartNumber": number, "ETag": etag})
    if h.hexdigest() != entry["sha256"]:
        fs.call_s3("abort_multipart_upload", Bucket=bucket, Key=key, UploadId=upload_id)
        return False, kept
    fs.call_s3("complete_multipart_upload", Bucket=bucket, Key=key, UploadId=upload_id,
               MultipartUpload={"Parts": parts})
    return True, kept


def _continue(fs, bucket: str, key: str, part_size: int, record: dict | None) -> tuple[str | None, dict]:
    """The remembered upload's id and its parts {number: (etag, size)} where S3 still has it, else (None, {})."""
    if not record or record.get("key") != key or record.get("part_size") != part_size:
        return None, {}
    upload_id = record.get("upload_id")
    if not isinstance(upload_id, str):
        return None, {}
    done, marker = {}, 0
    try:
        while True:
            page = fs.call_s3("list_parts", Bucket=bucket, Key=key, UploadId=upload_id, PartNumberMarker=marker)
            done.update({p["PartNumber"]: (p["ETag"], p["Size"]) for p in page.get("Parts", [])})
            if not page.get("IsTruncated"):
                return upload_id, done
            marker = page["NextPartNumberMarker"]
    except Exception:   # expired, aborted or completed meanwhile: a new upload
        return None, {}


def _size(fs, path: str) -> int | None:
    try:
        info = fs.info(path)
    except FileNotFoundError:
        return None
    return info.get("size") if info.get("type", "file") == "file" else None
