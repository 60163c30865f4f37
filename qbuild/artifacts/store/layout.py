"""What a store root holds and the names qbuild writes there (the only names housekeeping removes)."""

from __future__ import annotations

import errno
import logging
import re
from dataclasses import dataclass
from pathlib import Path

from qbuild.base.names import NAME
from qbuild.base.owned import only_these

log = logging.getLogger("qbuild")

MANIFEST = "manifest.json"
REF_RE = re.compile(rf"^(?P<recipe>{NAME})/(?P<variant>{NAME})(?::(?P<tag>{NAME}))?$")
DIGEST_RE = re.compile(r"^[0-9a-f]{64}$")
SCRATCH_RE = re.compile(r"^(?P<key>[0-9a-f]{64})\.(?P<pid>\d+)\.[0-9a-f]{8}$")   # tmp/<key>.<pid>.<rand> (new_tmp)
# the only names housekeeping removes: what qbuild itself writes there (a foreign file in a store is left alone)
FETCH_RE = re.compile(r"^fetch-[0-9a-f]{32}$")                                   # tmp/: a remote fetch's staging
LOCK_RE = re.compile(r"^(?:fetch-)?[0-9a-f]{64}\.lock$")                        # locks/<key>.lock
RUN_ID_RE = re.compile(r"^\d{8}T\d{6}Z-[0-9a-f]{6}$")                               # new_run_id: runs/<id>.json, logs/<id>/
QUARANTINE_RE = re.compile(r"^[0-9a-f]{64}\.\d{8}T\d{6}Z\.[0-9a-f]{6}$")          # quarantine/<digest>.<when>.<id>
VERIFY_MODES = ("fast", "full")
# what a store root holds (docs/architecture.md); an old store without the marker is adopted only if it holds no more
LAYOUT = {"objects", "actions", "refs", "history", "runs", "stamps", "quarantine", "tmp", "locks", "logs", "rebuilds"}
looks_like_store = only_these(LAYOUT, {"objects", "actions", "refs", "runs"})
NO_SPACE = (errno.ENOSPC, errno.EDQUOT)


@dataclass(frozen=True)
class Hit:
    """A stored step: its key, its object's digest and folder, and the action record."""

    key: str
    digest: str
    path: Path
    record: dict

