"""Remote stores behind the local store: S3 and other fsspec filesystems, OCI registries.

    remote = open_remote("s3://bucket/prefix")       # or oci://host/repo, file:///mnt/share/qbuild
    remote.check()
    record = remote.get_action(key)                  # read-through action cache (no weights)
    remote.put_object(digest, obj_dir, manifest)     # write-through: files, then the manifest...
    remote.put_action(key, record)                   # ...then the action record: the commit point
    remote.fetch_object(digest, dest)                # verified, resumable, parallel

Plugins: a RemoteStore subclass with `name`, `schemes`, `extra` and `requires` (see base.RemoteStore),
in this package (registered with `@remotes.register`) or from another distribution through the
`qbuild.remotes` entry-point group.
"""

from __future__ import annotations

import os
from urllib.parse import urlsplit

from qbuild.artifacts.remote.base import (
    PUSH_POLICIES,
    RemoteConfigError,
    RemoteError,
    RemoteStore,
    check_manifest,
    safe_relpath,
    scrub,
    split_url,
)
from qbuild.base.errors import MissingBackendError, UserError
from qbuild.contract.plugin import Registry

ENV_REMOTE = "QBUILD_REMOTE"

remotes: Registry[RemoteStore] = Registry("qbuild.remotes", RemoteStore, "remote store",
                                          packages=("qbuild.artifacts.remote",))


def plugins() -> list[type[RemoteStore]]:
    return remotes.classes()


def known_schemes() -> list[str]:
    return sorted({s for p in plugins() for s in p.schemes})


def plugin_for(url: str) -> type[RemoteStore]:
    scheme, display = split_url(url)
    for plugin in plugins():
        if scheme in plugin.schemes:
            missing = plugin.missing()
            if missing:
                raise MissingBackendError(f"remote {display} needs {', '.join(missing)}, which", plugin.extra)
            return plugin
    raise RemoteConfigError(display, f"unknown scheme {scheme}://; known: "
                                     + ", ".join(f"{s}://" for s in known_schemes()))


def open_remote(url: str, **options) -> RemoteStore:
    """The remote for `url`, picked by scheme. Options: name, endpoint_url, region, insecure, push, jobs."""
    if not isinstance(url, str) or "://" not in url:
        raise RemoteConfigError(str(url).split("@")[-1], "not a remote URL (expected scheme://...; known: "
                                + ", ".join(f"{s}://" for s in known_schemes()) + ")")
    return plugin_for(url)(url, **options)


def remotes_from_env(cli: list[str] | tuple[str, ...] = ()) -> list[str]:
    """--remote URL (repeatable) beats QBUILD_REMOTE (comma- or space-separated URLs)."""
    if cli:
        return list(cli)
    raw = os.environ.get(ENV_REMOTE, "")
    return [u for u in raw.replace(",", " ").split() if u]


def host_of(url: str) -> str:
    return urlsplit(url).hostname or ""


__all__ = ["remotes", "RemoteStore", "RemoteError", "RemoteConfigError", "open_remote", "plugin_for", "known_schemes",
           "remotes_from_env", "check_manifest", "safe_relpath", "scrub", "PUSH_POLICIES", "UserError"]
