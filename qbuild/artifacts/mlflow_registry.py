"""MLflow model registry: one registered model version per variant, pointing at the stored artifact.

    version = register(uri, "smollm2-q4km", manifest, "s3://team/qbuild", metrics, gates_passed=True)
    digest, store_url = resolve_models_uri("models:/smollm2-q4km@champion", uri)

A version's `source` is the artifact's location in the store; its tags carry the digest (the identity
that `qbuild pull` verifies against), step key, format, metrics and gate results. When every gate passed
the version gets an alias (`champion` by default). Credentials come only from MLFLOW_TRACKING_USERNAME /
MLFLOW_TRACKING_PASSWORD / MLFLOW_TRACKING_TOKEN (read by MLflow itself); none reach tags or params.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from contextlib import contextmanager
from urllib.parse import urlsplit

from qbuild.base.errors import MissingBackendError, QBuildError, UserError

MODELS_URI = re.compile(r"^models:/(?P<name>[^/@]+)(?:@(?P<alias>[\w.-]+)|/(?P<version>\d+))$")
TIMEOUT_ENV = {"MLFLOW_HTTP_REQUEST_TIMEOUT": "30", "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2",
               "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1"}
TAG_PREFIX = "qbuild."


class RegistryError(QBuildError):
    """The model registry failed or has no such model/alias: one line naming the tracking server."""


def _display(uri: str) -> str:
    parts = urlsplit(uri)
    if parts.username or parts.password:
        raise UserError("credentials in the MLflow tracking URI are refused; set MLFLOW_TRACKING_USERNAME/"
                        "MLFLOW_TRACKING_PASSWORD (or MLFLOW_TRACKING_TOKEN) instead")
    return uri


@contextmanager
def mlflow_http_limits(defaults: dict[str, str]) -> Iterator[None]:
    """Bound MLflow's HTTP timeout/retries with `defaults` (MLFLOW_HTTP_REQUEST_* variables the user has not
    set), restoring the environment afterwards: an unreachable server costs seconds, not minutes."""
    saved = {k: os.environ.get(k) for k in defaults}
    for k, v in defaults.items():
        os.environ.setdefault(k, v)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@contextmanager
def _client(tracking_uri: str) -> Iterator:
    """An MlflowClient with bounded HTTP timeouts/retries (unless the user set their own)."""
    try:
        from mlflow.tracking import MlflowClient
    except ImportError:
        raise MissingBackendError("the MLflow model registry needs mlflow, which", "mlflow") from None
    display = _display(tracking_uri)
    with mlflow_http_limits(TIMEOUT_ENV):
        try:
            yield MlflowClient(tracking_uri=tracking_uri, registry_uri=tracking_uri)
        except QBuildError:
            raise
        except Exception as exc:
            text = " ".join(str(exc).split())
            from qbuild.artifacts.remote.base import scrub

            raise RegistryError(f"MLflow registry {display}: {scrub(text)[:300]}") from None


def artifact_source(store_url: str, digest: str) -> str:
    """Where the artifact lives: the object's path in an fsspec store, the object tag in a registry."""
    base = store_url.rstrip("/")
    if base.startswith("oci://"):
        return f"{base}:_obj-{digest}"
    if base.startswith("file://") or "://" not in base:
        # MLflow refuses local paths as a version source (they would be read as run artifacts)
        base = "qbuild-file://" + base.removeprefix("file://")
    return f"{base}/objects/{digest[:2]}/{digest}"


def register(tracking_uri: str, name: str, manifest: dict, store_url: str, metrics: dict | None = None,
             gates_passed: bool | None = None, alias: str | None = "champion", gates: dict | None = None,
             description: str | None = None, serve: dict[str, str] | None = None) -> str:
    """Create a model version of `name` for the artifact; alias it when every gate passed. Returns the version."""
    from qbuild.artifacts.remote.base import split_url

    if "://" in store_url:
        split_url(store_url)  # refuses credentials in the store URL too
    digest = manifest["digest"]
    tags = {
        f"{TAG_PREFIX}digest": digest, f"{TAG_PREFIX}store": store_url, f"{TAG_PREFIX}key": manifest.get("key"),
        f"{TAG_PREFIX}format": manifest.get("format"), f"{TAG_PREFIX}kind": manifest.get("kind"),
        f"{TAG_PREFIX}recipe": (manifest.get("recipe") or {}).get("name"),
        f"{TAG_PREFIX}recipe_sha256": (manifest.get("recipe") or {}).get("sha256"),
        f"{TAG_PREFIX}variant": manifest.get("variant"),
        f"{TAG_PREFIX}gates_passed": None if gates_passed is None else str(bool(gates_passed)).lower(),
        f"{TAG_PREFIX}size_bytes": sum(f["size"] for f in manifest.get("files", [])),
    }
    for k, v in (serve or {}).items():   # the selected artifact's serving config and server command
        tags[k.removeprefix("org.")] = v
    for k, v in (metrics or {}).items():
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            tags[f"{TAG_PREFIX}metric.{k}"] = v
    for c in (gates or {}).get("checks", []):
        if c.get("variant") in (None, manifest.get("variant")):
            tags[f"{TAG_PREFIX}gate.{c.get('check')}"] = "pass" if c.get("passed") else "fail"
    tags = {k: str(v) for k, v in tags.items() if v is not None}
    with _client(tracking_uri) as client:
        from mlflow.exceptions import MlflowException

        try:
            client.get_registered_model(name)
        except MlflowException:
            client.create_registered_model(name, tags={f"{TAG_PREFIX}managed": "true"},
                                           description="Quantized artifacts registered by qbuild.")
        # one version per artifact: a nightly run that rebuilt nothing re-uses the version it registered before
        mv = next((v for v in client.search_model_versions(f"name='{name}'")
                   if (v.tags or {}).get(f"{TAG_PREFIX}digest") == digest
                   and (v.tags or {}).get(f"{TAG_PREFIX}store") == store_url), None)
        if mv is None:
            mv = client.create_model_version(name, source=artifact_source(store_url, digest), tags=tags,
                                             description=description or f"qbuild artifact {digest[:12]} "
                                                                        f"({manifest.get('format')})")
        else:
            for k, v in tags.items():
                if k.startswith((f"{TAG_PREFIX}metric.", f"{TAG_PREFIX}gate", f"{TAG_PREFIX}serve.")) \
                        and (mv.tags or {}).get(k) != v:
                    client.set_model_version_tag(name, mv.version, k, v)
        if alias and gates_passed:
            client.set_registered_model_alias(name, alias, mv.version)
        return str(mv.version)


def drop_alias(tracking_uri: str, name: str, alias: str) -> None:
    """Remove `alias` from registered model `name` if it has it (the selection moved it elsewhere)."""
    with _client(tracking_uri) as client:
        from mlflow.exceptions import MlflowException

        try:
            if alias in (client.get_registered_model(name).aliases or {}):
                client.delete_registered_model_alias(name, alias)
        except MlflowException:
            return   # no such model: nothing to drop


def resolve_models_uri(uri: str, tracking_uri: str) -> tuple[str, str]:
    """models:/NAME@ALIAS or models:/NAME/VERSION -> (digest, store_url) from the version's tags."""
    m = MODELS_URI.match(uri)
    if not m:
        raise UserError(f"{uri!r}: expected models:/NAME@ALIAS or models:/NAME/VERSION")
    with _client(tracking_uri) as client:
        if m.group("alias"):
            mv = client.get_model_version_by_alias(m.group("name"), m.group("alias"))
        else:
            mv = client.get_model_version(m.group("name"), m.group("version"))
    tags = mv.tags or {}
    digest, store = tags.get(f"{TAG_PREFIX}digest"), tags.get(f"{TAG_PREFIX}store")
    if not digest or not store:
        raise RegistryError(f"{uri} (version {mv.version}) was not registered by qbuild: no {TAG_PREFIX}digest tag")
    return digest, store


def alias_digests(tracking_uri: str, names: list[str] | None = None) -> set[str]:
    """Digests that a registry alias points at: gc roots that must never be collected."""
    out: set[str] = set()
    with _client(tracking_uri) as client:
        models = [client.get_registered_model(n) for n in names] if names else client.search_registered_models()
        for rm in models:
            for version in set((rm.aliases or {}).values()):
                mv = client.get_model_version(rm.name, version)
                if (mv.tags or {}).get(f"{TAG_PREFIX}digest"):
                    out.add(mv.tags[f"{TAG_PREFIX}digest"])
    return out


__all__ = ["register", "drop_alias", "resolve_models_uri", "alias_digests", "artifact_source", "RegistryError"]
