"""Distribution through the CLI, as users run it: machine A builds and pushes to a real S3 server (moto) and
registers in a real MLflow server; machine B (an empty store) builds nothing, downloads no weights, and a
serving team pulls by ref, by registry alias, with signature checks. Plus the remote commands on file://."""

from __future__ import annotations

import json
import os
from pathlib import Path

from helpers import fake_recipe, qbuild, write_recipe


def _json(res):
    assert res.returncode == 0, res.stderr[-3000:] + res.stdout[-2000:]
    return json.loads(res.stdout)


def _weights_bytes(store: Path) -> int:
    """Bytes of model files (not JSON records) in a store's objects."""
    objects = store / "objects"
    return sum(f.stat().st_size for f in objects.rglob("*") if f.is_file() and f.suffix != ".json") \
        if objects.exists() else 0


def test_machine_b_reuses_machine_a_through_s3_and_serving_pulls_by_alias(
        tmp_path, tiny_model_dir, s3_url, mlflow_server, monkeypatch):
    key = tmp_path / "keys" / "qbuild.key"
    assert qbuild("keygen", key).returncode == 0 and Path(f"{key}.pub").is_file()
    recipe = write_recipe(tmp_path / "dist.yaml", {
        "name": "dist", "model": {"source": "local", "path": str(tiny_model_dir)},
        "variants": [{"name": "q8", "method": "gguf", "type": "Q8_0"}],
        "evaluation": {"baseline": True, "perplexity": {"context_length": 64, "max_windows": 2},
                       "gates": [{"max_delta_ppl_pct": 50}]},
        "runtime": {"threads": 1},
        "store": {"remotes": [{"url": s3_url, "name": "team"}]},
        "register": {"alias": "champion", "tracking_uri": mlflow_server["uri"]},
    })
    a, b = tmp_path / "machine-a", tmp_path / "machine-b"

    # machine A builds, pushes (on-success) and registers
    first = _json(qbuild(recipe, "--store", a, "--json", env={"QBUILD_SIGNING_KEY": str(key)}))
    # convert, its check, quantize, eval-data, 2 perplexities
    assert first["counts"]["failed"] == 0 and first["counts"]["built"] == 6
    assert first["remotes"]["team"]["objects"] == first["counts"]["built"]
    assert first["registered"]["q8"]["alias"] == "champion"
    ppl = {r["variant"]: r["ppl"] for r in first["variants"]}

    # machine B: every step is a remote hit; the run builds 0 steps and downloads no weights
    plan = _json(qbuild("plan", recipe, "--store", b, "--json"))
    statuses = {s["step"]: s["status"] for s in plan["steps"]}
    assert statuses.pop("model") == "source" and set(statuses.values()) == {"hit-remote"}
    assert all(s["reason"] == "remote team" for s in plan["steps"] if s["status"] == "hit-remote")
    human = qbuild("plan", recipe, "--store", b)
    assert "hit (remote team)" in human.stdout and "0 step(s) to build" in human.stdout
    second = _json(qbuild(recipe, "--store", b, "--json"))
    assert second["counts"]["built"] == 0 and second["counts"]["cached"] == first["counts"]["built"]
    assert {r["variant"]: r["ppl"] for r in second["variants"]} == ppl     # metrics from the action records
    assert _weights_bytes(b) == 0
    assert second["gates"]["passed"]

    # a serving team on machine B: pull by ref (read through the remote), verified
    out = tmp_path / "q8"
    res = qbuild("pull", "dist/q8", "--store", b, "-o", out, env={"QBUILD_REMOTE": s3_url})
    assert res.returncode == 0, res.stderr
    assert (out / "model.gguf").stat().st_size > 1_000_000

    # by registry alias, with the signature made on machine A checked
    by_alias = tmp_path / "champion"
    res = qbuild("pull", "models:/dist-q8@champion", "-o", by_alias, "--verify-with", f"{key}.pub",
                 env={"MLFLOW_TRACKING_URI": mlflow_server["uri"]})
    assert res.returncode == 0, res.stderr
    assert (by_alias / "model.gguf").read_bytes() == (out / "model.gguf").read_bytes()
    card = (by_alias / "README.md").read_text()
    assert card.startswith("---") and "llama.cpp" in card and f"{ppl['q8']:.3f}" in card
    assert (by_alias / ".qbuild" / "signature.sig").is_file()

    # the remote commands see the same artifact
    refs = _json(qbuild("ls", "--remote", s3_url, "--json"))
    assert "dist/q8:latest" in {r["ref"] for r in refs}
    assert qbuild("verify", "--remote", s3_url, "--deep").returncode == 0


def test_push_tag_ls_verify_gc_on_a_file_remote(tmp_path):
    remote = f"file://{tmp_path / 'share'}"
    data = fake_recipe(tmp_path, [{"name": "a", "method": "fake"}, {"name": "b", "method": "fake", "level": 2}])
    recipe = write_recipe(tmp_path / "r.yaml", data)
    store = tmp_path / "store"
    assert qbuild(recipe, "--store", store).returncode == 0          # no remote configured: nothing pushed
    pushed = _json(qbuild("push", "t/a", "--to", remote, "--store", store, "--json"))
    assert pushed["uploaded"] and pushed["refs"] == ["t/a:latest"]
    again = _json(qbuild("push", "t/a", "--to", remote, "--store", store, "--json"))
    assert not again["uploaded"]                                       # already there: nothing re-uploaded
    assert qbuild("tag", "t/a", "t/a:prod", "--remote", remote).returncode == 0
    refs = {r["ref"] for r in _json(qbuild("ls", "--remote", remote, "--json"))}
    assert refs == {"t/a:latest", "t/a:prod"}
    assert "0 damaged" in qbuild("verify", "--remote", remote).stdout
    # b is pushed without a ref: gc removes it, and keeps what refs reach
    digest_b = _json(qbuild("push", pushed["digest"], "--to", remote, "--store", store, "--json"))["digest"]
    assert digest_b == pushed["digest"]
    b = json.loads(qbuild("show", "t/b", "--store", store).stdout)["digest"]
    assert qbuild("push", b, "--to", remote, "--store", store).returncode == 0
    dry = _json(qbuild("gc", "--remote", remote, "--dry-run", "--json"))
    assert [r["digest"] for r in dry["removed"]] == [b] and dry["bytes_freed"] > 0
    assert (tmp_path / "share" / "objects" / b[:2] / b).is_dir()       # dry run: still there
    gone = _json(qbuild("gc", "--remote", remote, "--json"))
    assert [r["digest"] for r in gone["removed"]] == [b]
    assert not (tmp_path / "share" / "objects" / b[:2] / b).exists()
    assert (tmp_path / "share" / "objects" / pushed["digest"][:2] / pushed["digest"]).is_dir()


def test_remote_errors_are_one_line(tmp_path):
    data = fake_recipe(tmp_path, [{"name": "a", "method": "fake"}])
    recipe = write_recipe(tmp_path / "r.yaml", data)
    res = qbuild("plan", recipe, "--store", tmp_path / "s", "--remote", "ftpx://host/path")
    assert res.returncode == 2 and "unknown scheme ftpx://" in res.stderr and len(res.stderr.splitlines()) == 1
    res = qbuild("pull", "t/a", "--from", "oci://127.0.0.1:1/nothing/here", "-o", tmp_path / "o",
                 env={"AWS_ACCESS_KEY_ID": os.environ.get("AWS_ACCESS_KEY_ID", "")})
    assert res.returncode != 0 and "remote oci://127.0.0.1:1/nothing/here" in res.stderr
    assert "Traceback" not in res.stderr and not (tmp_path / "o").exists()
