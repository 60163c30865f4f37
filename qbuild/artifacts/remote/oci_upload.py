"""Resumable blob uploads to an OCI registry: the distribution spec's chunked upload session (POST to open it,
PATCH each chunk with its Content-Range, PUT with the digest to close it), with the session's URL remembered by
the local store (qbuild.artifacts.remote.resume) after every chunk. A push cut off in the middle asks the session
how far it got (GET: `Range: 0-<last byte>`) and sends the rest. The registry checks the whole blob's digest when
the session is closed, so a session that holds anything but the local file's first bytes is refused there and the
next push starts a new one. A session URL is followed only on the registry's own host.
"""

from __future__ import annotations

import re
from pathlib import Path
from urllib.parse import urlencode, urlsplit

SESSION_RANGE = re.compile(r"^0-(-?\d+)$")
OCTETS = "application/octet-stream"


def push_blob_resumable(remote, path: Path, desc: dict, record: dict | None, remember, chunk_size: int) -> int:
    """Upload the file `path` as the blob desc["digest"], continuing the session `record` names where the
    registry still has it; `remember(record)` keeps the session after each chunk. Returns the bytes that were
    already uploaded. A refused request raises the remote's one-line error."""
    what = f"upload {desc.get('annotations', {}).get('org.opencontainers.image.title', desc['digest'][:19])}"
    client = remote.client
    session, offset = _continue(remote, client, record)
    if session is None:
        resp = remote._req(client, "POST", remote._url("blobs", "uploads/"),
                           headers={"Content-Length": "0", "Content-Type": OCTETS})
        if resp.status_code != 202:
            raise remote._fail(resp, what)
        session, offset = _location(remote, resp, what), 0
    kept = offset
    remember({"session": session})
    with open(path, "rb") as f:
        f.seek(offset)
        while chunk := f.read(chunk_size):
            headers = {"Content-Range": f"{offset}-{offset + len(chunk) - 1}", "Content-Length": str(len(chunk)),
                       "Content-Type": OCTETS}
            resp = remote._req(client, "PATCH", session, data=chunk, headers=headers)
            if resp.status_code != 202:
                raise remote._fail(resp, what)
            session, offset = _location(remote, resp, what), offset + len(chunk)
            remember({"session": session})
    sep = "&" if urlsplit(session).query else "?"
    resp = remote._req(client, "PUT", session + sep + urlencode({"digest": desc["digest"]}),
                       headers={"Content-Length": "0", "Content-Type": OCTETS})
    if resp.status_code != 201:
        raise remote._fail(resp, what)
    return kept


def _continue(remote, client, record: dict | None) -> tuple[str | None, int]:
    """The remembered session and the bytes it holds, where the registry still has it; else (None, 0)."""
    session = (record or {}).get("session")
    if not isinstance(session, str) or not _ours(remote, session):
        return None, 0
    resp = remote._req(client, "GET", session)
    match = SESSION_RANGE.match(resp.headers.get("Range", "")) if resp.status_code == 204 else None
    if match is None:
        return None, 0
    moved = resp.headers.get("Location")
    return (_absolute(remote, moved) if moved and _ours(remote, _absolute(remote, moved)) else session,
            int(match.group(1)) + 1)


def _location(remote, resp, what: str) -> str:
    url = _absolute(remote, resp.headers.get("Location", ""))
    if not _ours(remote, url):
        raise remote.error(f"{what}: the registry sent the upload to {urlsplit(url).netloc or 'nowhere'}, not "
                           f"{remote.host}; not followed")
    return url


def _absolute(remote, location: str) -> str:
    if location.startswith(("http://", "https://")):
        return location
    return f"{'http' if remote.plain_http else 'https'}://{remote.host}{location}" if location.startswith("/") else ""


def _ours(remote, url: str) -> bool:
    parts = urlsplit(url)
    return parts.scheme == ("http" if remote.plain_http else "https") and parts.netloc == remote.host
