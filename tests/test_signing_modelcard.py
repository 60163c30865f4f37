"""Signed provenance (model-signing + in-toto SLSA) and the model card that travels with each artifact."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
import yaml
from remote_common import make_object, model_files

from qbuild.artifacts import modelcard, signing
from qbuild.artifacts.remote import cache, open_remote
from qbuild.artifacts.store import Store
from qbuild.errors import UserError

pytest.importorskip("model_signing", reason="model-signing is not installed (pip install 'qbuild[sign]')")
MODEL_SIGNING = shutil.which("model_signing") or os.path.join(os.path.dirname(sys.executable), "model_signing")


@pytest.fixture
def keys(tmp_path):
    return signing.keygen(tmp_path / "keys" / "qbuild.key")


@pytest.fixture
def signed(tmp_path, keys):
    """A store object pushed to a file:// remote with card, provenance and signature sidecars."""
    store = Store(tmp_path / "store")
    hit = make_object(store, model_files(), variant="q4km")
    sidecars = cache.build_sidecars(store, hit.digest, base_model="HuggingFaceTB/SmolLM2-135M-Instruct",
                                    signing_key=keys[0], source={"name": "HuggingFaceTB/SmolLM2-135M-Instruct",
                                                                 "digest": {"sha256": "ab" * 32}},
                                    hardware={"cpu": "test-cpu"})
    assert set(sidecars) == {"README.md", signing.STATEMENT, signing.SIGNATURE}
    remote = open_remote(f"file://{tmp_path / 'remote'}")
    remote.check()
    cache.push_hit(remote, store, hit.key, hit.digest, hit.record, refs=[("demo", "q4km", "latest")],
                   sidecars=sidecars)
    return store, hit, remote


def test_unsigned_push_carries_only_the_card(tmp_path, monkeypatch):
    monkeypatch.delenv(signing.ENV_KEY, raising=False)
    store = Store(tmp_path / "store")
    hit = make_object(store, model_files())
    assert set(cache.build_sidecars(store, hit.digest)) == {"README.md"}


def test_keygen_refuses_to_overwrite(tmp_path, keys):
    priv, pub = keys
    assert oct(priv.stat().st_mode & 0o777) == "0o600" and b"PUBLIC KEY" in pub.read_bytes()
    with pytest.raises(UserError, match="refusing to overwrite"):
        signing.keygen(priv)


def test_signing_key_from_env(tmp_path, keys, monkeypatch):
    monkeypatch.setenv(signing.ENV_KEY, str(keys[0]))
    assert signing.signing_key() == keys[0]
    monkeypatch.setenv(signing.ENV_KEY, str(tmp_path / "missing.key"))
    with pytest.raises(UserError, match="qbuild keygen"):
        signing.signing_key()
    monkeypatch.delenv(signing.ENV_KEY)
    assert signing.signing_key() is None


def test_statement_is_slsa_provenance(signed):
    store, hit, remote = signed
    st = json.loads(remote.get_sidecar(hit.digest, signing.STATEMENT))
    assert st["_type"] == "https://in-toto.io/Statement/v1" and st["predicateType"] == "https://slsa.dev/provenance/v1"
    names = {s["name"]: s["digest"]["sha256"] for s in st["subject"]}
    assert {f["path"]: f["sha256"] for f in hit.record["files"]}.items() <= names.items() and "manifest.json" in names
    bd = st["predicate"]["buildDefinition"]
    assert bd["externalParameters"]["recipe"]["sha256"] == "0" * 64
    assert bd["externalParameters"]["step"]["params"] == {"method": "gguf", "type": "Q4_K_M"}
    assert bd["internalParameters"]["toolchain"] == {"llama-cpp-python": "0.3.16"}
    assert bd["internalParameters"]["hardware"]["cpu"] == "test-cpu"
    assert bd["resolvedDependencies"][0]["digest"] == {"sha256": "ab" * 32}
    assert st["predicate"]["runDetails"]["builder"]["version"]["qbuild"]


def test_pull_verify_with_accepts_ours_and_model_signing_cli_agrees(signed, keys, tmp_path):
    store, hit, remote = signed
    out = tmp_path / "pulled"
    manifest = cache.pull(remote, "demo/q4km", out, verify_with=keys[1])
    assert manifest["digest"] == hit.digest
    assert (out / "README.md").read_text().startswith("---\n") and (out / ".qbuild" / signing.SIGNATURE).is_file()
    res = subprocess.run([MODEL_SIGNING, "verify", "key", "--signature", str(out / ".qbuild" / signing.SIGNATURE),
                          "--public_key", str(keys[1]), str(out)], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr


def test_pull_verify_with_refuses_tampered_and_unsigned(signed, keys, tmp_path):
    store, hit, remote = signed
    # a file changed on the remote after signing, with a manifest rewritten to match it
    bad_store = Store(tmp_path / "evil")
    files = model_files()
    files["config.json"] = b'{"model_type": "evil"}'
    evil = make_object(bad_store, files, variant="q4km")
    cache.push_hit(remote, bad_store, evil.key, evil.digest, evil.record, refs=[("demo", "q4km", "evil")],
                   sidecars={signing.STATEMENT: remote.get_sidecar(hit.digest, signing.STATEMENT),
                             signing.SIGNATURE: remote.get_sidecar(hit.digest, signing.SIGNATURE)})
    with pytest.raises(signing.SignatureError, match="signature check failed") as exc:
        cache.pull(remote, "demo/q4km:evil", tmp_path / "evil-out", verify_with=keys[1])
    assert "\n" not in str(exc.value) and exc.value.exit_code == 1
    assert not (tmp_path / "evil-out").exists()
    # an artifact pushed without a signature
    plain = make_object(bad_store, model_files(seed=9), variant="q4km")
    cache.push_hit(remote, bad_store, plain.key, plain.digest, plain.record, refs=[("demo", "q4km", "plain")])
    with pytest.raises(signing.SignatureError, match="unsigned"):
        cache.pull(remote, "demo/q4km:plain", tmp_path / "plain-out", verify_with=keys[1])
    assert not (tmp_path / "plain-out").exists()
    # another key
    other = signing.keygen(tmp_path / "other.key")
    with pytest.raises(signing.SignatureError):
        cache.pull(remote, "demo/q4km", tmp_path / "other-out", verify_with=other[1])
    # a provenance statement swapped for another one
    out = tmp_path / "ok"
    cache.pull(remote, "demo/q4km", out, verify_with=keys[1])
    st = json.loads((out / ".qbuild" / signing.STATEMENT).read_text())
    st["predicate"]["buildDefinition"]["externalParameters"]["recipe"]["sha256"] = "f" * 64
    (out / ".qbuild" / signing.STATEMENT).write_text(json.dumps(st))
    with pytest.raises(signing.SignatureError):
        signing.verify(out, keys[1])


def test_model_card_front_matter_and_tables():
    manifest = {"digest": "d" * 64, "key": "k" * 64, "kind": "quantize", "variant": "q4km", "format": "gguf",
                "params": {"method": "gguf", "type": "Q4_K_M"}, "recipe": {"name": "demo", "sha256": "0" * 64},
                "toolchain": {"llama-cpp-python": "0.3.16"}, "created": "2026-01-01T00:00:00Z",
                "files": [{"path": "model-Q4_K_M.gguf", "size": 105_000_000, "sha256": "a" * 64}]}
    row = {"variant": "q4km", "ppl": 19.084, "delta_ppl": 1.242, "kld": 0.0579, "top1": 0.873, "decode_tok_s": 82.4}
    gates = {"passed": True, "checks": [{"variant": "q4km", "check": "max_delta_ppl_pct", "value": 6.96, "bound": 10,
                                         "passed": True}]}
    card = modelcard.render_model_card(manifest, row, {"protocol": "fixed-window", "context_length": 512}, gates,
                                       base_model="HuggingFaceTB/SmolLM2-135M-Instruct", license="apache-2.0")
    head, body = card.split("\n---\n", 1)
    front = yaml.safe_load(head.removeprefix("---\n"))
    assert front["base_model"] == "HuggingFaceTB/SmolLM2-135M-Instruct" and front["library_name"] == "gguf"
    assert front["quantization"] == {"method": "gguf", "type": "Q4_K_M", "format": "gguf"}
    assert "quantized" in front["tags"] and front["base_model_relation"] == "quantized"
    assert "| 19.084 | +1.242 | 0.0579 | 87.3% | 82.4 |" in body and "fixed-window" in body
    assert "Gates **passed**" in body and "| max_delta_ppl_pct | 6.96 | 10 | pass |" in body
    assert "100.1 MiB" in body
    assert "| llama.cpp | yes | `llama-server -m MODEL_DIR/model-Q4_K_M.gguf` |" in body
    assert "| TGI | no |" in body


@pytest.mark.parametrize("fmt,info,yes,no", [
    ("hf", {"checkpoint_format": "compressed-tensors"}, {"vLLM", "SGLang", "TGI", "transformers"},
     {"LMDeploy", "llama.cpp", "TensorRT-LLM"}),
    ("hf", {}, {"vLLM", "SGLang", "TGI", "LMDeploy", "transformers", "TensorRT-LLM", "llama.cpp"}, set()),
    ("hf-modelopt", {}, {"vLLM", "SGLang", "TensorRT-LLM"}, {"TGI", "llama.cpp"}),
    ("trtllm-engine", {}, {"TensorRT-LLM"}, {"vLLM", "llama.cpp", "transformers"}),
    ("compressed-tensors", {}, {"vLLM", "SGLang", "TGI", "transformers"}, {"LMDeploy", "llama.cpp"}),
    ("gptq", {}, {"vLLM", "TGI", "LMDeploy", "transformers", "ExLlamaV2"}, {"llama.cpp", "TensorRT-LLM"}),
    ("awq", {}, {"vLLM", "TGI", "LMDeploy", "transformers"}, {"llama.cpp", "ExLlamaV2"}),
])
def test_load_table_follows_the_format(fmt, info, yes, no):
    # the scheme each of these formats' manifests records (it selects the row of qbuild.contract.formats.LOADS_IN)
    scheme = {"hf-modelopt": "fp8", "compressed-tensors": "w4a16", "gptq": "w4a16", "awq": "w4a16"}.get(fmt)
    if info.get("checkpoint_format") == "compressed-tensors":
        scheme = "w4a16"
    rows = {e: ok for e, ok, _ in modelcard.load_table({"format": fmt, "info": info, "files": [], "scheme": scheme,
                                                        "toolchain": {"gpu.sm": "9.0", "tensorrt_llm": "1.2.1"}})}
    assert {e for e, ok in rows.items() if ok} >= yes and not ({e for e, ok in rows.items() if ok} & no)
