"""`qbuild pull NAME --out DIR` from the local store: the object's files copied out, each verified as it is copied.

One read of each file: it is hashed while it is copied (OwnedRoot.copy_in with sha256=), so a pull costs what
hashing the object once costs, where a verify pass and then a copy cost two reads (issue 33: 3.6-5.3x `cp -r`).
A file whose bytes are not its manifest's is never placed. Into a new or empty DIR the files are written into
a staging folder beside it that becomes DIR in one rename, so DIR appears complete or not at all (a pull killed
with -9 leaves its staging folder, marked as qbuild's, and the next pull into DIR removes it); with --force
(a non-empty DIR) each file replaces the one of its name, and a damaged file is never placed (the sound ones are).
Store objects are never hard-linked out: they are read-only, but a user may chmod and edit a pulled file, and
that would change the store's object. Where the filesystem shares extents (btrfs, XFS) the copy is a reflink.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import socket
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

from qbuild.base.errors import QBuildError, UserError
from qbuild.base.owned import MARKER, ContentMismatch, NotOurs, OwnedRoot, claim_root, output_root, owned_root

COPY_JOBS = max(2, min(8, os.cpu_count() or 2))
log = logging.getLogger("qbuild")


def export_object(store, digest: str, dest: Path, what: str, force: bool = False) -> Path:
    """Copy object `digest` of `store` into `dest` (new or empty; any folder with `force`), every manifest file
    verified against its sha256 as it is copied. `what` names the object in errors (the name the user pulled)."""
    problems = store.check_object(digest)   # the file set, sizes and the manifest's digest: a stat each
    if problems:
        raise damaged(what, digest, problems)
    dest = Path(dest).absolute()
    if dest.is_symlink():
        raise UserError(f"--out {dest} is a symlink; give the folder itself (a pull never writes through a link)")
    empty = not dest.exists() or (dest.is_dir() and not any(dest.iterdir()))
    if not empty and not force:
        raise UserError(f"--out {dest} exists and is not empty; give a new or empty folder (or --force to write "
                        "the artifact's files into it)")
    src = store.object_dir(digest)
    expected = {f["path"]: f["sha256"] for f in store.manifest(digest)["files"]}
    rels = sorted(p.relative_to(src) for p in src.rglob("*") if p.is_file() and not p.is_symlink())
    dest.parent.mkdir(parents=True, exist_ok=True)
    if not empty:
        copy_files(src, dest, rels, expected, output_root(dest), what, digest)
        return dest
    root = output_root(dest.parent)
    with out_lock(root, dest):   # a pull into this --out that began first has placed DIR or left it empty
        if dest.is_symlink() or (dest.exists() and (not dest.is_dir() or any(dest.iterdir()))):
            raise UserError(f"--out {dest} was filled by another pull while this one waited; give a new or empty "
                            "folder")
        remove_stale_staging(root, dest)
        staging = dest.with_name(f"{staging_prefix(dest)}{HOST}-{os.getpid()}-{uuid.uuid4().hex[:12]}")
        try:
            claim_root(staging, STAGING_KIND)   # marked: a later pull may remove it if this process is killed
            copy_files(src, staging, rels, expected, root, what, digest, within=staging)
            if dest.exists():
                os.rmdir(root.confine(dest))   # the empty folder checked above (rmdir refuses any other)
            root.remove(staging / MARKER, within=staging)
            root.move(staging, dest)
        finally:
            root.remove(staging)   # what a failed pull left: the folder this call made, never DIR
    return dest


STAGING_KIND = "pull staging folder"
HOST = hashlib.sha256(socket.gethostname().encode()).hexdigest()[:8]   # a staging folder's machine, in its name


def staging_prefix(dest: Path) -> str:
    return f".{dest.name}.partial-"


def remove_stale_staging(root: OwnedRoot, dest: Path) -> None:
    """Remove the staging folders that pulls into `dest` killed on this machine left beside it (kill -9, power
    loss): a folder of the staging name pattern, carrying the staging marker, made by a process of this host that
    no longer runs. A live pull's folder, another machine's (a shared filesystem) and anything unmarked are kept."""
    prefix = staging_prefix(dest)
    for entry in os.scandir(dest.parent):
        if not entry.name.startswith(prefix) or entry.is_symlink() or not entry.is_dir():
            continue
        host, _, rest = entry.name[len(prefix):].partition("-")
        pid = rest.partition("-")[0]
        if host != HOST or not pid.isdigit() or process_alive(int(pid)):
            continue
        try:
            owned_root(entry.path, STAGING_KIND)
        except NotOurs:
            continue
        root.remove(entry.path)


def lock_name(dest: Path) -> str:
    return f".{dest.name}.pull.lock"


@contextmanager
def out_lock(root: OwnedRoot, dest: Path) -> Iterator[None]:
    """Pulls into one --out take turns: an exclusive flock on `.<out>.pull.lock` beside it. Two pulls of one object
    into one --out once shared a staging folder without one: the second resumed the part the first was still writing
    and both placed a file of the wrong bytes. A second pull waits (saying so once) and then finds DIR placed. The
    file is removed by its holder before it lets go, and a waiter that finds its file gone or replaced locks the
    current one, so two holders never overlap; a lock left by a killed pull is free (flock dies with its process)."""
    path = root.confine(dest.with_name(lock_name(dest)))
    said = False
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | getattr(os, "O_NOFOLLOW", 0), 0o644)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                if not said:
                    log.warning(f"another pull into {dest} is under way; waiting for it")
                    said = True
                fcntl.flock(fd, fcntl.LOCK_EX)
            held = os.fstat(fd)
            try:
                now = os.lstat(path)
            except FileNotFoundError:
                now = None
        except BaseException:
            os.close(fd)
            raise
        if now is not None and (now.st_dev, now.st_ino) == (held.st_dev, held.st_ino):
            break
        os.close(fd)   # its holder removed it as it finished: lock the file that is there now
    try:
        yield
    finally:
        try:
            root.remove(path)   # before letting go: a waiter on this file sees it gone and takes the next one
        finally:
            os.close(fd)


def process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:   # another user's process: alive
        return True
    return True


def copy_files(src: Path, dest: Path, rels: list[Path], expected: dict[str, str], root: OwnedRoot, what: str,
               digest: str, within: Path | None = None) -> None:
    """Copy each of `rels` from src into dest through `root` (no link followed); a manifest file only if it hashes
    to its sha256. Files go in parallel, largest first (hashing and writing release the GIL: a sharded checkpoint
    is copied on every core). A symlinked folder on the way inside dest is replaced (the link removed), never
    written through."""
    for rel in rels:   # the folders first, in one thread: each link on the way is removed before anything is written
        parent = dest
        for part in rel.parts[:-1]:
            parent = parent / part
            if parent.is_symlink():
                root.remove(parent, within=within)
            if not parent.is_dir():
                root.mkdirs(parent, within=within)

    def one(rel: Path) -> None:
        try:
            root.copy_in(src / rel, dest / rel, within=within, sha256=expected.get(rel.as_posix()))
        except ContentMismatch:
            raise damaged(what, digest, [f"content changed: {rel.as_posix()}"]) from None

    by_size = sorted(rels, key=lambda rel: -(src / rel).stat().st_size)
    with ThreadPoolExecutor(max_workers=min(COPY_JOBS, max(1, len(rels)))) as pool:
        for future in [pool.submit(one, rel) for rel in by_size]:
            future.result()


def damaged(what: str, digest: str, problems: list[str]) -> QBuildError:
    """The one-line error of a pull whose stored object is damaged (`what`: the name pulled)."""
    return QBuildError(f"{what}: object {digest[:12]} is damaged: " + "; ".join(problems)
                       + " (run `qbuild verify --repair`, then rebuild)")
