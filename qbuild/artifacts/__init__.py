"""The artifact store: immutable content-addressed objects, an action cache, refs and run records."""

from __future__ import annotations

from typing import Protocol

from qbuild.artifacts.store import Store, open_store


class StoreReader(Protocol):
    """What the local store and every remote answer alike (`qbuild ls`, `show`, `pull` read through it)."""

    display: str                                    # how messages name it: a path, or a URL without credentials

    def list_refs(self) -> list[dict]: ...          # {"ref": "recipe/variant:tag", "digest", ...}

    def get_ref(self, recipe: str, variant: str, tag: str = "latest") -> dict | None: ...

    def list_objects(self) -> list[str]: ...        # digests

    def get_manifest(self, digest: str) -> dict | None: ...   # None: missing or unreadable


__all__ = ["Store", "StoreReader", "open_store"]
