"""The store under stress: crashes mid-write, concurrent runs, damage, failures and resume."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from qbuild.artifacts.store import Store

from helpers import fake_recipe, qbuild, run_api, write_recipe


def run_json(recipe: Path, store: Path, **kwargs) -> tuple[int, dict]:
    return run_api(recipe, store, **kwargs)


def statuses(summary: dict) -> dict[str, str]:
    return {s["name"]: s["status"] for s in summary["steps"]}


def test_second_run_builds_nothing_and_refs_resolve(tmp_path, store_dir):
    recipe = write_recipe(tmp_path / "r.yaml", fake_recipe(tmp_path, [
        {"name": "a", "method": "fake"}, {"name": "b", "method": "fake", "level": 2}]))
    rc, first = run_json(recipe, store_dir, tag="nightly")
    assert rc == 0 and statuses(first) == {"model": "source", "quantize[a]": "built", "quantize[b]": "built"}
    rc, second = run_json(recipe, store_dir)
    assert rc == 0 and statuses(second) == {"model": "source", "quantize[a]": "cached", "quantize[b]": "cached"}
    store = Store(store_dir)
    digest = first["variants"][0]["digest"]
    assert store.resolve("t/a") == store.resolve("t/a:nightly") == store.resolve(digest[:10]) == digest
    manifest = json.loads(qbuild("show", "t/a:latest", "--store", store_dir).stdout)
    assert manifest["params"] == {"method": "fake", "level": 1, "calibrated": False, "sleep": 0.0, "fail": False,
                                  "timing": False, "ppl": None, "decode_tok_s": None, "work": 0, "elastic": False, "noise": False,
                                  "preload": []}
    assert manifest["files"][0]["path"] == "weights.bin" and len(manifest["files"][0]["sha256"]) == 64
    assert manifest["toolchain"]["pydantic"] and manifest["recipe"]["name"] == "t"
    ls = json.loads(qbuild("ls", "--store", store_dir, "--json").stdout)
    assert {r["ref"] for r in ls} == {"t/a:latest", "t/a:nightly", "t/b:latest", "t/b:nightly"}
    assert len(list((store_dir / "runs").glob("*.json"))) == 2


def test_killed_mid_write_leaves_nothing_visible_and_rerun_completes(tmp_path, store_dir):
    recipe = write_recipe(tmp_path / "r.yaml", fake_recipe(tmp_path, [{"name": "slow", "method": "fake", "sleep": 4}]))
    proc = subprocess.Popen([sys.executable, "-m", "qbuild", str(recipe), "--store", str(store_dir)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.time() + 60
    while time.time() < deadline and not list((store_dir / "tmp").glob("*/out/weights.bin")):
        time.sleep(0.1)
    assert list((store_dir / "tmp").glob("*/out/weights.bin")), "worker never started writing"
    os.killpg(proc.pid, signal.SIGKILL)  # the run and its worker die mid-write
    proc.wait()
    assert not list((store_dir / "objects").glob("*/*")) if (store_dir / "objects").exists() else True
    assert not list((store_dir / "actions").glob("*/*")) if (store_dir / "actions").exists() else True
    rc, summary = run_json(recipe, store_dir)  # the same recipe resumes the same key
    assert rc == 0 and statuses(summary)["quantize[slow]"] == "built"
    assert Store(store_dir).verify() and all(r["ok"] for r in Store(store_dir).verify())
    assert not list((store_dir / "tmp").glob("*"))  # the crashed build's scratch was cleaned up


def test_two_concurrent_runs_build_each_key_once(tmp_path, store_dir):
    recipe = write_recipe(tmp_path / "r.yaml", fake_recipe(tmp_path, [
        {"name": "a", "method": "fake", "sleep": 1.5}, {"name": "b", "method": "fake", "sleep": 1.5, "level": 3}]))
    cmd = [sys.executable, "-m", "qbuild", str(recipe), "--store", str(store_dir), "--json"]
    procs = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    outs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    summaries = [json.loads(o[0]) for o in outs]
    for step in ("quantize[a]", "quantize[b]"):
        built = [statuses(s)[step] for s in summaries]
        assert sorted(built) == ["built", "cached"], built  # built once, shared once
    digests = [{v["variant"]: v["digest"] for v in s["variants"]} for s in summaries]
    assert digests[0] == digests[1]
    assert len(list((store_dir / "objects").glob("*/*"))) == 2


def test_verify_catches_a_flipped_byte(tmp_path, store_dir):
    recipe = write_recipe(tmp_path / "r.yaml", fake_recipe(tmp_path, [{"name": "a", "method": "fake"}]))
    rc, summary = run_json(recipe, store_dir)
    assert rc == 0
    res = qbuild("verify", "--store", store_dir)
    assert res.returncode == 0 and "0 damaged" in res.stdout
    target = Store(store_dir).object_dir(summary["variants"][0]["digest"]) / "weights.bin"
    target.chmod(0o644)
    data = bytearray(target.read_bytes())
    data[100] ^= 0x01
    target.write_bytes(bytes(data))
    res = qbuild("verify", "--store", store_dir)
    assert res.returncode == 1
    assert "DAMAGED" in res.stdout and "content changed: weights.bin" in res.stdout
    # a damaged object is not silently reused by the next run... but it is never deleted either
    assert target.exists()


def test_failed_step_is_named_others_stay_stored_and_rerun_resumes(tmp_path, store_dir):
    variants = [{"name": "ok", "method": "fake"}, {"name": "bad", "method": "fake", "level": 2, "fail": True}]
    recipe = write_recipe(tmp_path / "r.yaml", fake_recipe(tmp_path, variants))
    res = qbuild(recipe, "--store", store_dir)
    assert res.returncode == 1
    assert "quantize[bad] failed" in res.stdout and "fake failure requested" in res.stdout
    log = next((store_dir / "logs").glob("*/quantize[[]bad].log"))
    assert "RuntimeError: fake failure requested" in log.read_text()
    variants[1]["fail"] = False
    write_recipe(recipe, fake_recipe(tmp_path, variants))
    rc, summary = run_json(recipe, store_dir)
    assert rc == 0 and statuses(summary) == {"model": "source", "quantize[ok]": "cached", "quantize[bad]": "built"}


def test_show_unknown_ref_is_a_clear_error(store_dir):
    res = qbuild("show", "nope/nothing:latest", "--store", store_dir)
    assert res.returncode == 2
    assert "no ref nope/nothing:latest" in res.stderr and "Traceback" not in res.stderr


def test_identical_variants_share_one_artifact_and_both_get_refs(tmp_path, store_dir):
    recipe = write_recipe(tmp_path / "r.yaml", fake_recipe(tmp_path, [
        {"name": "one", "method": "fake"}, {"name": "same", "method": "fake"}]))
    rc, summary = run_json(recipe, store_dir)
    assert rc == 0
    rows = {v["variant"]: v for v in summary["variants"]}
    assert rows["one"]["digest"] == rows["same"]["digest"] and rows["same"]["status"] == "built"
    store = Store(store_dir)
    assert store.resolve("t/one") == store.resolve("t/same")
