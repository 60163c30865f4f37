"""MLflow model registry against a real `mlflow server` (sqlite backend) on 127.0.0.1; and planted secrets:
AWS keys, a docker-config password and an MLflow password never reach stores, registries or the database."""

from __future__ import annotations

import uuid

import pytest
from remote_common import make_object, model_files, tree_bytes

from qbuild.artifacts import mlflow_registry as reg
from qbuild.artifacts import modelcard
from qbuild.artifacts.remote import RemoteError, cache, open_remote
from qbuild.artifacts.remote.gc import gc_remote
from qbuild.artifacts.store import Store
from qbuild.errors import UserError

from servers import free_port


def _name(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:6]}"


def test_register_alias_resolve_and_pull(mlflow_server, tmp_path):
    uri = mlflow_server["uri"]
    store = Store(tmp_path / "store")
    remote = open_remote(f"file://{tmp_path / 'remote'}")
    remote.check()
    good = make_object(store, model_files(seed=1), variant="q4km")
    bad = make_object(store, model_files(seed=2), variant="q4km")
    for h in (good, bad):
        cache.push_hit(remote, store, h.key, h.digest, h.record)
    name = _name("smollm2-q4km")
    gates = {"passed": True, "checks": [{"variant": "q4km", "check": "max_delta_ppl_pct", "passed": True}]}
    v1 = reg.register(uri, name, store.manifest(good.digest), remote.url, {"ppl": 19.08, "kld": 0.058},
                      gates_passed=True, gates=gates)
    v2 = reg.register(uri, name, store.manifest(bad.digest), remote.url, {"ppl": 25.0}, gates_passed=False)
    assert (v1, v2) == ("1", "2")
    assert reg.resolve_models_uri(f"models:/{name}@champion", uri) == (good.digest, remote.url)
    assert reg.resolve_models_uri(f"models:/{name}/2", uri) == (bad.digest, remote.url)
    from mlflow.tracking import MlflowClient

    mv = MlflowClient(uri).get_model_version(name, "1")
    assert mv.tags["qbuild.metric.ppl"] == "19.08" and mv.tags["qbuild.gates_passed"] == "true"
    assert mv.tags["qbuild.format"] == "gguf" and mv.tags["qbuild.gate.max_delta_ppl_pct"] == "pass"
    assert mv.source == f"qbuild-{remote.url}/objects/{good.digest[:2]}/{good.digest}"
    # pull models:/NAME@ALIAS: the registry names the digest, the store serves it verified
    digest, store_url = reg.resolve_models_uri(f"models:/{name}@champion", uri)
    out = tmp_path / "out"
    cache.pull(open_remote(store_url), digest, out)
    assert (out / "model.safetensors").read_bytes() == (good.path / "model.safetensors").read_bytes()
    # gc keeps what the alias reaches, even without a ref
    assert good.digest in reg.alias_digests(uri, [name])
    removed = {r["digest"] for r in gc_remote(remote, extra_roots=reg.alias_digests(uri, [name]))}
    assert removed == {bad.digest} and remote.has_object(good.digest)
    again = reg.register(uri, name, store.manifest(good.digest), remote.url, gates_passed=True, alias="prod")
    assert again == "1", "the same artifact in the same store keeps its version"
    assert reg.resolve_models_uri(f"models:/{name}@prod", uri)[0] == good.digest


def test_registry_errors_are_one_line(mlflow_server):
    with pytest.raises(reg.RegistryError) as exc:
        reg.resolve_models_uri(f"models:/{_name('nope')}@champion", mlflow_server["uri"])
    assert "\n" not in str(exc.value) and mlflow_server["uri"] in str(exc.value)
    with pytest.raises(UserError, match="models:/NAME@ALIAS"):
        reg.resolve_models_uri("models:nope", mlflow_server["uri"])
    with pytest.raises(UserError, match="credentials in the MLflow tracking URI"):
        reg.resolve_models_uri("models:/x@y", "http://user:qbuildSECRET@127.0.0.1:1")


def test_unreachable_tracking_server_is_bounded(monkeypatch):
    import time

    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    t0 = time.monotonic()
    with pytest.raises(reg.RegistryError):
        reg.resolve_models_uri("models:/x@champion", f"http://127.0.0.1:{free_port()}")
    assert time.monotonic() - t0 < 30


def test_planted_secrets_never_stored(tmp_path, s3_env, oci_env, mlflow_server, monkeypatch, registry, moto_s3):
    """Credentials live only in the environment and the docker config: grep every byte we wrote."""
    mlflow_password = f"qbuildSECRET-mlflow-{uuid.uuid4().hex[:8]}"
    monkeypatch.setenv("MLFLOW_TRACKING_USERNAME", "qbuild")
    monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", mlflow_password)
    secrets = [moto_s3["secret"], moto_s3["key"], registry["password"], mlflow_password]
    store = Store(tmp_path / "store")
    hit = make_object(store, model_files(seed=11), variant="q4km")
    card = modelcard.render_model_card(store.manifest(hit.digest)).encode()
    s3_prefix = f"secrets-{uuid.uuid4().hex[:6]}"
    messages = []
    for url in (f"s3://{moto_s3['bucket']}/{s3_prefix}", f"oci://{registry['host']}/qbuild/{s3_prefix}"):
        remote = open_remote(url)
        cache.push_hit(remote, store, hit.key, hit.digest, hit.record, sidecars={"README.md": card},
                       refs=[("demo", "q4km", "latest")])
        cache.pull(remote, "demo/q4km", tmp_path / f"out-{remote.scheme}")
        reg.register(mlflow_server["uri"], _name("secrets"), store.manifest(hit.digest), remote.url,
                     {"ppl": 1.0}, gates_passed=True)
        try:
            remote.fetch_object("0" * 64, tmp_path / "never")
        except RemoteError as exc:
            messages.append(str(exc))
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "x" * 40)  # a wrong key: the error must not echo the real one
    try:
        open_remote(f"s3://{moto_s3['bucket']}/{s3_prefix}").check()
    except RemoteError as exc:
        messages.append(str(exc))
    # everything written: local store, pulled dirs, the bucket, the registry's storage, MLflow's database
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", moto_s3["secret"])
    s3 = open_remote(f"s3://{moto_s3['bucket']}/{s3_prefix}")
    bucket = b"".join(s3.fs.cat_file(p) for p in s3.fs.find(f"{moto_s3['bucket']}/{s3_prefix}"))
    assert len(bucket) > 3 << 20  # the weights, manifest, action record, ref and model card
    blobs = [tree_bytes(tmp_path), bucket, tree_bytes(registry["data"]), mlflow_server["db"].read_bytes(),
             "\n".join(messages).encode()]
    assert len(messages) == 3
    for secret in secrets:
        for where, data in zip(("local files", "bucket", "registry storage", "mlflow db", "messages"), blobs, strict=True):
            assert secret.encode() not in data, f"{secret[:6]}... found in {where}"
