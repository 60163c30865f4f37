"""`qbuild run --executor ray` on a real two-node Ray cluster (tests/ray_cluster.py: 127.0.0.1 only), with the
moto S3 server as the shared remote store. Each node has its own local store; steps are fake-method steps.

- each step is built exactly once across both nodes, and every object reaches the remote;
- Ctrl-C cancels the tasks: exit 130, no scratch and no worker process left on any node;
- a node lost mid-step: its step is retried on the other node, the run succeeds, `qbuild verify` is clean;
- with no remote store, `--executor ray` fails at once with one line saying what to configure.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from helpers import fake_recipe, qbuild, write_recipe

pytest.importorskip("ray", reason="Ray is not installed (pip install 'qbuild[ray]')")

CLUSTER = Path(__file__).parent / "ray_cluster.py"
DRIVER_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}   # connect to a cluster on 127.0.0.1 (see ray_cluster.py)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, moto_s3):
    """Two nodes; the S3 credentials reach their workers through the environment, as on real machines."""
    root = tmp_path_factory.mktemp("ray")
    env = {**os.environ, "AWS_ACCESS_KEY_ID": moto_s3["key"], "AWS_SECRET_ACCESS_KEY": moto_s3["secret"],
           "AWS_ENDPOINT_URL": moto_s3["endpoint"], "AWS_DEFAULT_REGION": "us-east-1",
           "AWS_SHARED_CREDENTIALS_FILE": os.devnull, "AWS_CONFIG_FILE": os.devnull}
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).parents[1]), env.get("PYTHONPATH", "")])
    proc = subprocess.Popen([sys.executable, str(CLUSTER), str(root)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True, env=env)
    try:
        line = proc.stdout.readline()
        if not line:
            pytest.fail("the Ray cluster did not start")
        info = json.loads(line)
        yield {"address": info["address"], "root": root, "proc": proc, "env": env,
               "stores": {"head": root / "store-head", "worker2": root / "store-worker2"}}
    finally:
        if proc.poll() is None:
            proc.stdin.write("stop\n")
            proc.stdin.flush()
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def _objects(store: Path) -> dict[str, str]:
    """step key → digest of what this node's store published."""
    out = {}
    for f in (store / "actions").glob("*/*.json"):
        out[f.stem] = json.loads(f.read_text())["digest"]
    return out


def _workers(root: Path) -> list[int]:
    """qbuild.pipeline.worker processes building into this cluster's node stores (found by their spec path)."""
    out = subprocess.run(["pgrep", "-f", f"qbuild.pipeline.worker {root}"], capture_output=True, text=True)
    return [int(p) for p in out.stdout.split()]


def _run(cluster, recipe: Path, s3: str, store: Path, *extra) -> subprocess.Popen:
    env = {**cluster["env"], **DRIVER_ENV}
    return subprocess.Popen([sys.executable, "-m", "qbuild", "run", str(recipe), "--store", str(store), "--executor",
                             "ray", "--address", cluster["address"], "--remote", s3, "--json", *extra],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


# ~15 s to start the cluster, ~40 s for the runs, on 2 shared cores
def test_each_step_is_built_once_across_the_nodes_and_a_lost_node_is_retried(cluster, tmp_path, s3_url):
    variants = [{"name": f"v{i}", "method": "fake", "level": i, "sleep": 0.5} for i in range(3)]
    recipe = write_recipe(tmp_path / "r.yaml", fake_recipe(tmp_path, variants, runtime={"threads": 1}))
    proc = _run(cluster, recipe, s3_url, tmp_path / "driver")
    out, err = proc.communicate(timeout=300)
    data = json.loads(out) if out else {}   # the summary, or {"error", "exit_code"} when the run could not finish
    failed = [(s["name"], s.get("error")) for s in data.get("steps", []) if s["status"] == "failed"] or data.get("error")
    assert proc.returncode == 0, f"{failed} {err[-1500:]}"
    summary = json.loads(out)
    built = {s["key"]: s for s in summary["steps"] if s["status"] == "built"}
    assert len(built) == 3 and all(s["worker"] for s in built.values())
    per_node = {name: _objects(store) for name, store in cluster["stores"].items()}
    for key in built:   # built exactly once: one node's store published it, the other never did
        assert sum(key in objs for objs in per_node.values()) == 1, per_node
    assert not list((tmp_path / "driver" / "objects").glob("*/*"))   # the driver never needed the files
    log = tmp_path / "driver" / "logs" / summary["run_id"] / "quantize[v1].log"   # each node's log, on the driver
    assert "[quantize[v1]] fake step, level 1" in log.read_text()
    res = qbuild("verify", "--remote", s3_url, "--json", env=cluster["env"])
    assert res.returncode == 0, res.stderr
    assert {k: json.loads(res.stdout)[k] for k in ("checked", "damaged")} == {"checked": 3, "damaged": []}, res.stdout
    assert qbuild("ls", "--remote", s3_url, env=cluster["env"]).stdout.count("t/v") == 3   # refs set on the remote

    # Ctrl-C while both nodes build: exit 130, the tasks are cancelled, no scratch and no worker process is left
    slow = [{"name": f"c{i}", "method": "fake", "level": 20 + i, "sleep": 60.0} for i in range(2)]
    proc = _run(cluster, write_recipe(tmp_path / "cancel.yaml", fake_recipe(tmp_path, slow, runtime={"threads": 1})),
                s3_url, tmp_path / "driver")
    scratch = [store / "tmp" for store in cluster["stores"].values()]
    deadline = time.time() + 120
    while time.time() < deadline and sum(len(list(d.glob("*/out/weights.bin"))) for d in scratch) < 2:
        time.sleep(0.1)
    assert sum(len(list(d.glob("*/out/weights.bin"))) for d in scratch) == 2, "the steps never started"
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130 and "interrupted" in err, err
    deadline = time.time() + 120   # the nodes clean up after the cancel: over 60 s seen with the 2 cores busy
    while time.time() < deadline and (any(list(d.iterdir()) for d in scratch) or _workers(cluster["root"])):
        time.sleep(0.2)
    left = [str(f.relative_to(d)) for d in scratch for f in d.rglob("*")]
    assert not left, f"scratch left on a node: {left[:20]}"
    assert not _workers(cluster["root"]), "a worker process outlived its cancelled task"

    # two slow steps, one per node (1 CPU each); the second node dies while it builds its step
    slow = [{"name": f"s{i}", "method": "fake", "level": 10 + i, "sleep": 6.0} for i in range(2)]
    recipe = write_recipe(tmp_path / "slow.yaml", fake_recipe(tmp_path, slow, runtime={"threads": 1}))
    proc = _run(cluster, recipe, s3_url, tmp_path / "driver")
    worker_tmp = cluster["stores"]["worker2"] / "tmp"
    deadline = time.time() + 120
    while time.time() < deadline and not list(worker_tmp.glob("*/out/weights.bin")):
        time.sleep(0.1)
    assert list(worker_tmp.glob("*/out/weights.bin")), "no step started on the second node"
    lost_key = next(worker_tmp.glob("*/out/weights.bin")).parents[1].name.split(".")[0]
    cluster["proc"].stdin.write("kill worker2\n")
    cluster["proc"].stdin.flush()
    assert json.loads(cluster["proc"].stdout.readline()) == {"killed": "worker2"}
    out, err = proc.communicate(timeout=300)
    data = json.loads(out) if out else {}   # the summary, or {"error", "exit_code"} when the run could not finish
    failed = [(s["name"], s.get("error")) for s in data.get("steps", []) if s["status"] == "failed"] or data.get("error")
    assert proc.returncode == 0, f"{failed} {err[-1500:]}"
    summary = json.loads(out)
    steps = {s["key"]: s for s in summary["steps"] if s["kind"] == "quantize"}
    assert steps[lost_key]["status"] == "built"
    head = _objects(cluster["stores"]["head"])
    assert lost_key in head and lost_key not in _objects(cluster["stores"]["worker2"])   # retried on the head
    res = qbuild("verify", "--remote", s3_url, "--json", env=cluster["env"])
    assert res.returncode == 0, res.stderr
    assert {k: json.loads(res.stdout)[k] for k in ("checked", "damaged")} == {"checked": 5, "damaged": []}, res.stdout
    for store in cluster["stores"].values():   # the lost node's scratch is no object: nothing damaged anywhere
        res = qbuild("verify", "--store", store, "--json")
        assert res.returncode == 0, res.stderr + res.stdout
        assert json.loads(res.stdout)["damaged"] == [], res.stdout


def test_a_worker_killed_by_a_signal_is_retried(cluster, tmp_path, s3_url):
    """SIGKILL of a step's worker process (what a node going down or the OOM killer does) while its Ray task lives
    on: the task reports it and Ray runs the step again, instead of the run failing. Also what made the lost-node
    check above flaky: the lost node's task reported its killed worker before the node was gone."""
    slow = [{"name": "k", "method": "fake", "level": 40, "sleep": 8.0}]
    proc = _run(cluster, write_recipe(tmp_path / "k.yaml", fake_recipe(tmp_path, slow, runtime={"threads": 1})),
                s3_url, tmp_path / "driver")
    deadline = time.time() + 120
    while time.time() < deadline and not _workers(cluster["root"]):
        time.sleep(0.1)
    [pid] = _workers(cluster["root"])
    os.kill(pid, signal.SIGKILL)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-1500:]
    [step] = [s for s in json.loads(out)["steps"] if s["kind"] == "quantize"]
    assert step["status"] == "built"
    assert pid not in _workers(cluster["root"])


def test_ray_without_a_remote_store_fails_at_once_in_one_line(tmp_path):
    recipe = write_recipe(tmp_path / "r.yaml", fake_recipe(tmp_path, [{"name": "a", "method": "fake"}]))
    res = qbuild("run", recipe, "--store", tmp_path / "s", "--executor", "ray", "--address", "127.0.0.1:9",
                 env={"QBUILD_REMOTE": ""})
    assert res.returncode == 2 and len(res.stderr.strip().splitlines()) == 1, res.stderr
    assert "needs a shared remote store" in res.stderr and "--remote" in res.stderr and "store.remotes" in res.stderr
    assert not (tmp_path / "s" / "objects").exists()


def test_a_dead_cluster_address_fails_in_seconds_in_one_line(tmp_path):
    # ray.init retries an address that refuses connections for minutes: a nightly job must not hang on it
    recipe = write_recipe(tmp_path / "r.yaml", fake_recipe(tmp_path, [{"name": "a", "method": "fake"}]))
    for address, why in (("127.0.0.1:9", "Connection refused"), ("127.0.0.1", "expected HOST:PORT")):
        t0 = time.monotonic()
        res = qbuild("run", recipe, "--store", tmp_path / "s", "--executor", "ray", "--address", address,
                     "--remote", (tmp_path / "remote").as_uri(), timeout=120)
        assert res.returncode == 2 and len(res.stderr.strip().splitlines()) == 1, res.stderr
        assert f"no Ray cluster at {address}: " in res.stderr and why in res.stderr, res.stderr
        assert time.monotonic() - t0 < 60
    assert not list((tmp_path / "s" / "objects").glob("*/*"))


def test_step_resources_for_ray():
    from qbuild.contract.step import Step
    from qbuild.pipeline.executor_ray import resources

    cpu = Step("quantize", "quantize[a]", {"x": 1}, "m:f", threads=8)
    assert resources(cpu, max_cpus=4) == {"num_cpus": 4}   # never more than the largest node has: no infeasible task
    engine = Step("trtllm-engine", "engine[a]", {"x": 1}, "m:f", threads=2, requires_gpu=True,
                  env_toolchain={"gpu.sm": "9.0", "trtllm": "1.2.0"})
    assert resources(engine, max_cpus=16) == {"num_cpus": 2, "num_gpus": 1, "resources": {"sm_90": 0.001}}


def test_a_group_limit_holds_across_the_cluster():
    """A search's probes (Step.at_once) are not submitted past their limit, wherever the running ones are."""
    from types import SimpleNamespace

    from qbuild.contract.step import Step
    from qbuild.pipeline.executor_ray import _group_full

    def probe(i, group="gguf-search[mix]"):
        return Step("gguf-probe", f"probe[{i}]", {"i": i}, "m:f", at_once=(group, 2))

    running = {i: (SimpleNamespace(step=probe(i)), None, 0.0) for i in range(2)}
    assert _group_full(probe(9), running)
    assert not _group_full(probe(9, "gguf-search[other]"), running)   # another search's probes are not counted
    assert not _group_full(Step("quantize", "q", {}, "m:f"), running)
    running.pop(0)
    assert not _group_full(probe(9), running)


# a few minutes on 2 shared cores: ~60 steps, each a Ray task in a fresh interpreter
@pytest.mark.slow
def test_a_gguf_search_spreads_over_the_nodes_and_meets_its_budget(cluster, tmp_path, s3_url, tiny_model_dir):
    from test_gguf_search import recipe_for

    search = {"max_size_mb": 36.6, "types": ["Q4_0", "Q5_0", "Q2_K"], "max_candidates": 2}
    recipe = write_recipe(tmp_path / "search.yaml", recipe_for(tiny_model_dir, tmp_path / "driver", search))
    proc = _run(cluster, recipe, s3_url, tmp_path / "driver")
    out, err = proc.communicate(timeout=1500)
    data = json.loads(out) if out else {}
    failed = [(s["name"], s.get("error")) for s in data.get("steps", []) if s["status"] == "failed"] or data.get("error")
    assert proc.returncode == 0, f"{failed} {err[-1500:]}"
    built = [s for s in data["steps"] if s["status"] == "built"]
    # the sensitivity measurements and finalists are ordinary steps: both nodes took some
    assert len({s["worker"] for s in built if "~" in s["name"]}) == 2, {s["name"]: s["worker"] for s in built}
    row = {v["variant"]: v for v in data["variants"]}["mix"]
    assert row["size_bytes"] <= 36.6e6 and row["kld"] is not None
