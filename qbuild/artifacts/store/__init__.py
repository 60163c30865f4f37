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

The Store class is assembled from one mixin per responsibility: objects.py (objects and the action cache),
integrity.py (checks, quarantine, verify), refs.py (refs and build history), runs.py (run records and logs),
housekeeping.py (stale scratch, gc); layout.py names what a root holds, files.py the durable file operations.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path

# the names other modules import from qbuild.artifacts.store
from qbuild.artifacts.store.files import (
    StoreFull,
    StoreReadOnly,
    atomic_write_json,
    checked_digest,
    free_bytes,
    now_iso,
    read_json,
    store_full,
    valid_files,
)
from qbuild.artifacts.store.housekeeping import HousekeepingMixin
from qbuild.artifacts.store.integrity import IntegrityMixin
from qbuild.artifacts.store.layout import MANIFEST, NO_SPACE, REF_RE, VERIFY_MODES, Hit, looks_like_store
from qbuild.artifacts.store.objects import ObjectsMixin
from qbuild.artifacts.store.refs import RefsMixin
from qbuild.artifacts.store.runs import RunsMixin
from qbuild.base.hashing import canonical_json
from qbuild.base.owned import OwnedRoot, claim_root, owned_root


class Store(ObjectsMixin, IntegrityMixin, RefsMixin, RunsMixin, HousekeepingMixin):
    def __init__(self, root: Path):
        self.root = Path(root).absolute()
        self._writable: bool | None = None
        self._owned: OwnedRoot | None = None
        self.repair = True                  # False for a plan (a dry run): a damaged object misses, nothing moves
        self.quarantined: list[dict] = []   # what this process moved to quarantine/ (digest, reason, where)

    @property
    def display(self) -> str:
        return str(self.root)

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
        atomic_write_json(path, data, self.owned)   # the first write claims the root


def open_store(path: str | os.PathLike | None, recipe_default: str | None = None) -> Store:
    """--store beats QBUILD_STORE beats the recipe's store.path beats ./artifacts."""
    root = path or os.environ.get("QBUILD_STORE") or recipe_default or "./artifacts"
    return Store(Path(root))


__all__ = ["MANIFEST", "NO_SPACE", "REF_RE", "VERIFY_MODES", "Hit", "Store", "StoreFull", "StoreReadOnly",
           "atomic_write_json", "canonical_json", "checked_digest", "free_bytes", "now_iso", "open_store", "read_json",
           "store_full", "valid_files"]
