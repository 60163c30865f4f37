"""The folders qbuild owns, and the only way qbuild writes, deletes, moves or chmods anything in them.

A root qbuild owns (a store, the backend-environments folder) carries a marker file naming its kind. Every
destructive operation goes through an `OwnedRoot`:

    root = claim_root(path, "store", adopt=looks_like_store)   # create/adopt: the first write makes it ours
    root = owned_root(path, "store")                           # destructive commands: refuse a root without it
    root.remove(root.path / "tmp" / name)                      # file, link or tree: never follows a link
    root.move(src, dst)                                        # both ends inside the root
    root.chmod(path, 0o444)
    root.write_bytes(root.path / "refs" / r / v / t, data)   # fresh file beside, fsync, rename over: never through a link
    with root.open_write(part, append=True) as f: ...      # a staging file opened with O_NOFOLLOW
    root.mkdirs(root.path / "tmp" / "x")                   # each missing folder made here, none a link

Each call resolves the *parent* of the path (the last component is never followed: a link is removed or
moved as a link), checks that it lies inside the resolved root, and refuses the root itself. A tree is
removed with shutil.rmtree, whose fd-based walk never follows a link inside it. So a wrong value handed in
(a library's return value taken as a folder, a name from a remote record, a `--store /`) ends in one line
(`NotOurs`, exit 2) instead of in /etc. Why: a runner once treated "/" as its export folder and moved a
machine's /etc away (docs/store-integrity.md, "What qbuild may delete"). Writes are confined the same way: a
store's `refs/r` that is a link to another folder once had `qbuild tag` overwrite a file there.

`output_root(folder)` is the folder a pull writes `--out` into: not marked (it is the user's), so it gives the
same confined writes and moves, and removes only the names the pull itself built there.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from qbuild.base.errors import UserError
from qbuild.base.hashing import copy_hashed

MARKER = ".qbuild-root.json"


class NotOurs(UserError):
    """A destructive operation on a path qbuild does not own: one line, exit 2, nothing touched."""


def _real(path: Path) -> Path:
    return Path(os.path.realpath(path))


def _read_marker(root: Path) -> dict | None:
    marker = root / MARKER
    try:
        if not stat.S_ISREG(os.lstat(marker).st_mode):
            return None
        data = json.loads(marker.read_bytes()[:65536])
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


@dataclass(frozen=True)
class OwnedRoot:
    path: Path    # the root as the user named it (absolute)
    real: Path    # ...resolved once: every check compares against this
    kind: str

    # --- confinement ------------------------------------------------------------------------------------
    def confine(self, path: str | os.PathLike, within: str | os.PathLike | None = None) -> Path:
        """`path` with its parent resolved, if it lies strictly inside this root (and inside `within`, itself
        inside the root); NotOurs otherwise. The last component is kept as is: it is never followed."""
        p = Path(path)
        if not p.is_absolute():
            p = self.path / p
        name = p.name
        if name in ("", ".", ".."):
            raise NotOurs(f"refusing to touch {str(path)[:200]!r}: not a name inside {self.kind} {self.path}")
        located = _real(p.parent) / name
        inside = [self.real]
        if within is not None:
            w = _real(within)
            if not _is_under(w, self.real):
                raise NotOurs(f"refusing to touch {str(path)[:200]}: {within} is outside {self.kind} {self.path}")
            inside.append(w)
        for base in inside:
            if not _is_under(located, base) or located == base:
                raise NotOurs(f"refusing to touch {str(path)[:200]}: it is not inside {self.kind} {base}")
        return located

    # --- the destructive operations ------------------------------------------------------------------
    def remove(self, path: str | os.PathLike, within: str | os.PathLike | None = None, missing_ok: bool = True) -> bool:
        """Remove a file, a link (the link itself) or a directory tree inside the root. False when absent."""
        p = self.confine(path, within)
        try:
            st = os.lstat(p)
        except FileNotFoundError:
            if missing_ok:
                return False
            raise
        if stat.S_ISDIR(st.st_mode):
            shutil.rmtree(p)   # fd-based on Linux: links inside are removed, never followed
        else:
            os.unlink(p)
        return True

    def move(self, src: str | os.PathLike, dst: str | os.PathLike, within: str | os.PathLike | None = None) -> Path:
        """Rename src to dst, both inside the root (a link moves as a link); dst must not exist as a folder."""
        s, d = self.confine(src, within), self.confine(dst, within)
        os.rename(s, d)
        return d

    def chmod(self, path: str | os.PathLike, mode: int, within: str | os.PathLike | None = None) -> None:
        """chmod a regular file or directory inside the root; a link is refused (chmod would follow it)."""
        p = self.confine(path, within)
        if stat.S_ISLNK(os.lstat(p).st_mode):
            raise NotOurs(f"refusing to chmod {p}: it is a symlink")
        os.chmod(p, mode)   # checked above: not a link (Linux has no lchmod)

    # --- writes --------------------------------------------------------------------------------------
    def mkdirs(self, path: str | os.PathLike, within: str | os.PathLike | None = None) -> Path:
        """Make the folder `path` and its missing parents inside the root, one level at a time: a level that is a
        link or not a folder is refused (NotOurs), so nothing is ever created through a link."""
        target = self.confine(path, within)
        parts = target.relative_to(self.real).parts
        at = self.real
        for part in parts:
            at = at / part
            try:
                st = os.lstat(at)
            except FileNotFoundError:
                try:
                    os.mkdir(at)
                except FileExistsError:   # made by a concurrent writer: checked below like any other
                    pass
                st = os.lstat(at)
            if not stat.S_ISDIR(st.st_mode):
                raise NotOurs(f"refusing to write under {at}: it is {'a symlink' if stat.S_ISLNK(st.st_mode) else 'not a folder'}")
        return target

    def open_write(self, path: str | os.PathLike, append: bool = False, within: str | os.PathLike | None = None):
        """A binary file object writing `path` inside the root (its folder made with mkdirs); opened with O_NOFOLLOW,
        so a link planted at the name is refused (ELOOP), never written through."""
        p = self.confine(path, within)
        if p.parent != self.real:
            self.mkdirs(p.parent)
        flags = os.O_WRONLY | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0) | (os.O_APPEND if append else os.O_TRUNC)
        try:
            fd = os.open(p, flags, 0o644)
        except OSError:
            if os.path.islink(p):
                raise NotOurs(f"refusing to write {p}: it is a symlink") from None
            raise
        return os.fdopen(fd, "ab" if append else "wb")

    def write_bytes(self, path: str | os.PathLike, data: bytes, within: str | os.PathLike | None = None,
                    durable: bool = True) -> Path:
        """Replace `path` inside the root with `data`: a fresh file beside it (O_EXCL, O_NOFOLLOW), fsynced, renamed
        over the name (a link there is replaced, never followed), the folder fsynced. A power cut leaves the old or
        the new content. OSError (ENOSPC, EROFS...) is the caller's to translate; the fresh file is removed."""
        def fill(fd: int) -> None:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
        return self._replace(path, fill, within, durable)

    def copy_in(self, src: str | os.PathLike, path: str | os.PathLike, within: str | os.PathLike | None = None,
                durable: bool = False, sha256: str | None = None) -> Path:
        """Replace `path` inside the root with a copy of the file `src`, like write_bytes (streamed).

        With `sha256`, the bytes are hashed as they are copied (one read of src: a copy that verifies costs what
        hashing costs) and the copy replaces `path` only when they hash to it; ContentMismatch otherwise, with
        nothing left behind. Where the filesystem can share extents (a reflink: btrfs, XFS), the copy is one and
        only src is read, to hash it."""
        def fill(fd: int) -> None:
            with open(src, "rb") as inp, os.fdopen(os.dup(fd), "wb") as out:
                if sha256 is None:
                    shutil.copyfileobj(inp, out, 1 << 20)
                    return
                got = _copy_hashing(inp, out)
                if got != sha256:
                    raise ContentMismatch(f"{src} does not hash to {sha256[:12]} (it hashes to {got[:12]})")
        return self._replace(path, fill, within, durable)

    def _replace(self, path, fill: Callable[[int], None], within, durable: bool) -> Path:
        p = self.confine(path, within)
        if p.parent != self.real:
            self.mkdirs(p.parent)
        tmp = p.with_name(f".{p.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o644)
            try:
                fill(fd)
                if durable:
                    os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, p)
        except BaseException:   # a failed write, a content mismatch, an interrupt: never a half file left
            try:
                os.unlink(tmp)   # the file this call created (O_EXCL)
            except OSError:
                pass
            raise
        if durable:
            fsync_dir(p.parent)
        return p


class ContentMismatch(ValueError):
    """A verified copy (OwnedRoot.copy_in with sha256=) whose bytes are not the expected ones; nothing was placed."""


FICLONE = 0x40049409   # linux/fs.h: share src's extents with dst (copy-on-write), where the filesystem can


def _copy_hashing(inp, out) -> str:
    """Copy the open file `inp` into `out` and return the sha256 of what was copied, reading `inp` once."""
    out.flush()
    try:
        import fcntl

        fcntl.ioctl(out.fileno(), FICLONE, inp.fileno())
        cloned = True    # the extents are shared: only hash
    except (OSError, ImportError):
        cloned = False   # ext4, tmpfs, another filesystem, not Linux: copy the bytes
    return copy_hashed(inp, None if cloned else out)


def fsync_dir(path: Path) -> None:
    """Make a directory's entries (a rename, a new file) durable."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _is_under(path: Path, base: Path) -> bool:
    return path == base or base in path.parents


def owned_root(path: str | os.PathLike, kind: str) -> OwnedRoot:
    """The root at `path` if it carries qbuild's marker of `kind`; NotOurs (one line) otherwise."""
    p = Path(path).absolute()
    if p.is_symlink() and not p.is_dir():
        raise NotOurs(f"{p} is a dangling symlink, not a qbuild {kind}")
    marker = _read_marker(p)
    if marker is None or marker.get("kind") != kind:
        what = "has no qbuild marker" if marker is None else f"is a qbuild {marker.get('kind')}, not a {kind}"
        raise NotOurs(f"{p} is not a qbuild {kind} ({what} {MARKER}); refusing to delete or move anything in it")
    return OwnedRoot(p, _real(p), kind)


def output_root(path: str | os.PathLike) -> OwnedRoot:
    """The existing folder `path` that a command writes its output into (the parent of a pull's --out): not
    qbuild's, so not marked; every write and move in it is confined to it and follows no link."""
    p = Path(path).absolute()
    if not p.is_dir():
        raise NotOurs(f"{p} is not a folder")
    return OwnedRoot(p, _real(p), "output folder")


def claim_root(path: str | os.PathLike, kind: str, adopt: Callable[[Path], str | None] | None = None) -> OwnedRoot:
    """Make `path` a root of `kind` that qbuild owns and return it.

    A missing or empty folder is created and marked; a folder with the marker is returned as is; a non-empty
    folder without one is adopted (marked) only when `adopt(path)` returns None, i.e. it holds nothing but what
    qbuild itself puts in such a root (an old store, made before markers); otherwise NotOurs, naming what
    adopt found. The marker is written with O_EXCL beside, then renamed into place."""
    p = Path(path).absolute()
    marker = _read_marker(p)
    if marker is not None:
        if marker.get("kind") != kind:
            raise NotOurs(f"{p} is a qbuild {marker.get('kind')}, not a {kind}")
        return OwnedRoot(p, _real(p), kind)
    p.mkdir(parents=True, exist_ok=True)
    if not p.is_dir():
        raise NotOurs(f"{p} is not a folder")
    entries = [e for e in os.listdir(p) if not e.startswith(f".{MARKER}.")]
    if entries:
        why = adopt(p) if adopt is not None else "it is not empty"
        if why is not None:
            raise NotOurs(f"{p} is not a qbuild {kind} and not empty ({why}); use a new or empty folder")
    # per process and thread: two threads claiming the same new folder must not share (and unlink) one temporary file
    tmp = p / f".{MARKER}.{os.getpid()}.{threading.get_ident()}.tmp"
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o644)
    except FileExistsError:
        os.unlink(tmp)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o644)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump({"kind": kind, "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}, f)
            f.flush()
            os.fsync(f.fileno())   # durable before it is visible, like every record of a store
        os.replace(tmp, p / MARKER)
    except OSError:
        try:
            os.unlink(tmp)   # the file this call created (O_EXCL): a full disk leaves nothing behind
        except OSError:
            pass
        raise
    dfd = os.open(p, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)
    return OwnedRoot(p, _real(p), kind)


def keep_in_cache(root: str | os.PathLike, kind: str, name: str, data: bytes,
                  adopt: Callable[[Path], str | None] | None = None) -> None:
    """Write a per-user cache file `name` under `root`, a root of `kind` qbuild owns (its marker checked, no link
    followed). A cache is an optimisation: a read-only home or a folder not ours leaves it unwritten, never an
    error."""
    try:
        owned = claim_root(root, kind, adopt=adopt)
        owned.write_bytes(owned.path / name, data, durable=False)
    except (OSError, NotOurs):
        pass


def only_these(allowed: set[str], layout: set[str]) -> Callable[[Path], str | None]:
    """An `adopt` test: every entry is one of `allowed` (dot-files of our atomic writes too) and at least one of
    `layout` is a real folder; returns why not, or None."""
    def check(p: Path) -> str | None:
        names = [e for e in os.listdir(p) if not (e.startswith(".") and e.endswith(".tmp"))]
        foreign = sorted(n for n in names if n not in allowed)
        if foreign:
            return f"it holds {', '.join(foreign[:3])}{' ...' if len(foreign) > 3 else ''}"
        if not any((p / n).is_dir() and not (p / n).is_symlink() for n in layout if n in names):
            return f"none of {', '.join(sorted(layout))} is there"
        return None
    return check


__all__ = ["MARKER", "NotOurs", "OwnedRoot", "owned_root", "output_root", "claim_root", "only_these"]
