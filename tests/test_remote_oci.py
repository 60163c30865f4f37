"""OCI registry remote against a real CNCF distribution registry: ModelPack layout, outside clients."""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess

import pytest
from remote_common import make_object, model_files

from qbuild.artifacts.remote import open_remote
from qbuild.artifacts.remote.oci import DOC, MODEL_ARTIFACT, MODEL_CONFIG, OBJ_TAG, WEIGHT, WEIGHT_CONFIG
from qbuild.artifacts.store import Store

SKOPEO = shutil.which("skopeo")
MODELPACK_CONFIG_KEYS = {"descriptor", "config", "modelfs"}
MODELPACK_DESCRIPTOR = {"createdAt", "authors", "family", "name", "docURL", "sourceURL", "version", "revision",
                        "vendor", "licenses", "title", "description"}
MODELPACK_MODEL_CONFIG = {"architecture", "format", "paramSize", "precision", "quantization"}


@pytest.fixture
def pushed(tmp_path, oci_url):
    store = Store(tmp_path / "a")
    hit = make_object(store, model_files())
    remote = open_remote(oci_url)
    remote.put_object(hit.digest, hit.path, store.manifest(hit.digest), sidecars={"README.md": b"# card\n"})
    remote.put_action(hit.key, hit.record)
    remote.set_ref("demo", "q4km", "latest", hit.digest, hit.key)
    return store, hit, remote


def test_modelpack_manifest_layout(pushed):
    store, hit, remote = pushed
    oci, _ = remote._get_oci_manifest("demo-q4km-latest")
    assert oci["artifactType"] == MODEL_ARTIFACT and oci["config"]["mediaType"] == MODEL_CONFIG
    files = {f["path"]: f for f in store.manifest(hit.digest)["files"]}
    layers = {la["annotations"]["org.opencontainers.image.title"]: la for la in oci["layers"]}
    for path, f in files.items():  # one layer per file, digest = the sha256 our manifest records
        assert layers[path]["digest"] == "sha256:" + f["sha256"] and layers[path]["size"] == f["size"]
    assert layers["model.safetensors"]["mediaType"] == WEIGHT
    assert layers["config.json"]["mediaType"] == WEIGHT_CONFIG
    assert layers["tok/tokenizer.json"]["mediaType"] == WEIGHT_CONFIG
    assert layers["manifest.json"]["mediaType"] == DOC and layers["README.md"]["mediaType"] == DOC
    config = json.loads(remote._get_blob(oci["config"]["digest"]))
    # the config follows the ModelPack schema (no extra properties) and carries format/precision/quantization
    assert set(config) == MODELPACK_CONFIG_KEYS
    assert set(config["descriptor"]) <= MODELPACK_DESCRIPTOR and set(config["config"]) <= MODELPACK_MODEL_CONFIG
    assert config["config"] == {"format": "gguf", "precision": "q4_k_m", "quantization": "gguf"}
    assert config["descriptor"]["revision"] == hit.digest
    assert config["modelfs"]["type"] == "layers" and config["modelfs"]["diff_ids"] == [la["digest"] for la in oci["layers"]]
    ann = oci["annotations"]
    assert ann["org.qbuild.digest"] == hit.digest and ann["org.qbuild.key"] == hit.key
    assert ann["org.qbuild.ref"] == "demo/q4km:latest"
    assert remote.get_ref("demo", "q4km") ["digest"] == hit.digest
    assert [r["ref"] for r in remote.list_refs()] == ["demo/q4km:latest"]
    assert remote.list_objects() == [hit.digest]
    assert list(remote.list_actions()) == [(hit.key, hit.digest)]
    assert remote.get_sidecar(hit.digest, "README.md") == b"# card\n"


def test_oras_py_pull_gets_the_files(pushed, tmp_path, oci_env):
    """oras-py's own pull (a generic OCI client: it knows nothing about qbuild) fetches what we pushed."""
    import oras.client

    store, hit, remote = pushed
    client = oras.client.OrasClient(hostname=oci_env["host"], insecure=True, auth_backend="basic")
    client.auth.set_basic_auth(oci_env["user"], oci_env["password"])
    out = tmp_path / "oras-out"
    target = f"{remote.host}/{remote.repository}:demo-q4km-latest"
    client.pull(target=target, outdir=str(out))
    for f in store.manifest(hit.digest)["files"]:
        assert hashlib.sha256((out / f["path"]).read_bytes()).hexdigest() == f["sha256"]
    assert json.loads((out / "manifest.json").read_text())["digest"] == hit.digest
    assert (out / "README.md").read_text() == "# card\n"


@pytest.mark.skipif(SKOPEO is None, reason="skopeo is not installed (apt-get install skopeo): no outside Go OCI client")
def test_skopeo_copies_the_artifact_unchanged(pushed, tmp_path, oci_env):
    """An outside client written in Go (containers/image) copies the artifact; layer digests = our sha256s."""
    store, hit, remote = pushed
    dest = tmp_path / "layout"
    res = subprocess.run([SKOPEO, "copy", "--preserve-digests", "--src-tls-verify=false",
                          "--src-creds", f"{oci_env['user']}:{oci_env['password']}",
                          f"docker://{remote.host}/{remote.repository}:demo-q4km-latest", f"oci:{dest}:model"],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    index = json.loads((dest / "index.json").read_text())
    mdigest = index["manifests"][0]["digest"].split(":")[1]
    manifest = json.loads((dest / "blobs" / "sha256" / mdigest).read_text())
    assert manifest["artifactType"] == MODEL_ARTIFACT
    by_title = {la["annotations"]["org.opencontainers.image.title"]: la["digest"] for la in manifest["layers"]}
    for f in store.manifest(hit.digest)["files"]:
        blob = dest / "blobs" / "sha256" / f["sha256"]
        assert by_title[f["path"]] == "sha256:" + f["sha256"]
        assert hashlib.sha256(blob.read_bytes()).hexdigest() == f["sha256"]


def test_round_trip_through_registry(pushed, tmp_path):
    store, hit, remote = pushed
    fresh = open_remote(remote.url)
    assert fresh.get_action(hit.key)["digest"] == hit.digest and fresh.has_object(hit.digest)
    manifest = fresh.fetch_object(hit.digest, tmp_path / "b" / "obj")
    assert manifest["digest"] == hit.digest
    for f in manifest["files"]:
        assert (tmp_path / "b" / "obj" / f["path"]).read_bytes() == (hit.path / f["path"]).read_bytes()
    assert fresh.stats["bytes_down"] == sum(f["size"] for f in manifest["files"])


def test_object_tag_is_reserved(pushed):
    store, hit, remote = pushed
    tags = remote._tags()
    assert OBJ_TAG + hit.digest in tags and "_key-" + hit.key in tags
    assert all(t.startswith("_") or t == "demo-q4km-latest" for t in tags)
