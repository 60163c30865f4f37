"""The artifact store: immutable content-addressed objects, an action cache, refs and run records."""

from qbuild.artifacts.store import Store, open_store

__all__ = ["Store", "open_store"]
