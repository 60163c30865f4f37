"""The parallel local executor: independent steps overlap within the machine's cores, timing steps run alone,
Ctrl-C / SIGTERM / kill -9 stop every worker and leave no scratch, runs resume; several recipes run as one
deduplicated graph with one JUnit report. Overlap is asserted from recorded start/end times, never wall clock."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest

from qbuild.pipeline.budget import cpu_count

from helpers import fake_recipe, qbuild, run_api, step_infos, write_recipe


def _overlaps(steps: list[dict]) -> int:
    """The largest number of builds running at the same moment."""
    events = sorted([(s["started"], 1) for s in steps] + [(s["ended"], -1) for s in steps])
    now = peak = 0
    for _, delta in events:
        now += delta
        peak = max(peak, now)
    return peak


def _built(summary: dict) -> list[dict]:
    return [s for s in summary["steps"] if s["status"] == "built"]


def test_independent_steps_overlap_within_the_cores(tmp_path, store_dir):
    variants = [{"name": f"v{i}", "method": "fake", "level": i, "sleep": 1.5} for i in range(4)]
    recipe = write_recipe(tmp_path / "r.yaml", fake_recipe(tmp_path, variants, runtime={"threads": 1}))
    rc, summary = run_api(recipe, store_dir, jobs=4)
    assert rc == 0
    built = _built(summary)
    assert len(built) == 4 and all(s["started"] and s["ended"] for s in built)
    # 1 thread per step: as many at once as there are cores (never more), so 4 steps take ~2 rounds on 2 cores
    assert _overlaps(built) == min(4, cpu_count())


def test_steps_that_need_every_core_run_one_at_a_time(tmp_path, store_dir):
    variants = [{"name": f"v{i}", "method": "fake", "level": i, "sleep": 0.8} for i in range(3)]
    recipe = write_recipe(tmp_path / "r.yaml", fake_recipe(tmp_path, variants, runtime={"threads": cpu_count()}))
    rc, summary = run_api(recipe, store_dir, jobs=4)
    assert rc == 0 and _overlaps(_built(summary)) == 1


def test_jobs_1_is_sequential_and_timing_steps_run_alone(tmp_path, store_dir):
    variants = [{"name": "a", "method": "fake", "sleep": 0.8}, {"name": "t", "method": "fake", "level": 2, "sleep": 0.8,
                                                              "timing": True},
                {"name": "b", "method": "fake", "level": 3, "sleep": 0.8}]
    recipe = write_recipe(tmp_path / "r.yaml", fake_recipe(tmp_path, variants, runtime={"threads": 1}))
    rc, summary = run_api(recipe, store_dir, jobs=4)
    assert rc == 0
    steps = {s["name"]: s for s in _built(summary)}
    timing = steps.pop("quantize[t]")
    for other in steps.values():  # nothing runs while the timing step measures
        assert other["ended"] <= timing["started"] or other["started"] >= timing["ended"], (other, timing)
    rc, summary = run_api(write_recipe(tmp_path / "r2.yaml", fake_recipe(
        tmp_path, [dict(v, level=v.get("level", 1) + 10) for v in variants], runtime={"threads": 1})), store_dir, jobs=1)
    assert rc == 0 and _overlaps(_built(summary)) == 1


def _start_slow_run(tmp_path, store_dir, sleep=20.0):
    variants = [{"name": f"s{i}", "method": "fake", "level": i, "sleep": sleep} for i in range(2)]
    # a third step waits for a core: a standby worker is started for it, and must go when qbuild goes
    variants.append({"name": "w", "method": "fake", "level": 9, "preload": ["fake_heavy"]})
    recipe = write_recipe(tmp_path / "slow.yaml", fake_recipe(tmp_path, variants, runtime={"threads": 1}))
    proc = subprocess.Popen([sys.executable, "-m", "qbuild", str(recipe), "--store", str(store_dir), "--jobs", "2"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    want = min(2, cpu_count())
    deadline = time.time() + 60
    while time.time() < deadline and len(list((store_dir / "tmp").glob("*/out/weights.bin"))) < want:
        time.sleep(0.1)
    assert len(list((store_dir / "tmp").glob("*/out/weights.bin"))) == want, "the workers never started"
    return recipe, proc


def _workers_of(store_dir: Path) -> list[int]:
    """Worker processes still running for this store (found by their spec path)."""
    out = subprocess.run(["pgrep", "-f", f"qbuild.pipeline.worker {store_dir}"], capture_output=True, text=True)
    return [int(p) for p in out.stdout.split()]


@pytest.mark.parametrize("sig, code, word", [(signal.SIGINT, 130, "interrupted"), (signal.SIGTERM, 143, "terminated")])
def test_interrupt_stops_workers_removes_scratch_and_the_rerun_resumes(tmp_path, store_dir, sig, code, word):
    recipe, proc = _start_slow_run(tmp_path, store_dir)
    proc.send_signal(sig)                       # to qbuild only: workers are in sessions of their own
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == code, err
    assert word in err and "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert not list((store_dir / "tmp").glob("*")), "scratch left behind"
    assert not _workers_of(store_dir) and not _standbys()
    assert not list((store_dir / "objects").glob("*/*")) if (store_dir / "objects").exists() else True
    data = json.loads(json.dumps(fake_recipe(tmp_path, [{"name": f"s{i}", "method": "fake", "level": i, "sleep": 0.2}
                                                        for i in range(2)], runtime={"threads": 1})))
    rc, summary = run_api(write_recipe(recipe, data), store_dir)
    assert rc == 0 and len(_built(summary)) == 2


def test_workers_die_with_a_killed_qbuild(tmp_path, store_dir):
    _, proc = _start_slow_run(tmp_path, store_dir)
    assert _workers_of(store_dir)
    if cpu_count() == 2:   # two steps hold the cores, the third waits with a standby worker
        assert _standbys()
    proc.kill()                                 # kill -9: no cleanup code runs in qbuild
    proc.wait(timeout=30)
    deadline = time.time() + 15
    while time.time() < deadline and (_workers_of(store_dir) or _standbys()):
        time.sleep(0.2)
    assert not _workers_of(store_dir), "workers outlived their parent"
    assert not _standbys(), "a standby worker outlived its parent"


# --- elastic threads and standby workers ----------------------------------------------------------------------
def _standbys() -> list[int]:
    """Standby workers these tests start (they preload the test module fake_heavy: a real run's preload torch)."""
    out = subprocess.run(["pgrep", "-f", "qbuild.pipeline.worker --standby fake_heavy"], capture_output=True, text=True)
    return [int(p) for p in out.stdout.split()]


@pytest.mark.skipif(cpu_count() < 2, reason="needs 2 cores")
def test_an_elastic_step_takes_the_cores_another_step_gives_back(tmp_path, store_dir):
    # threads: auto = half the cores each: both start together; when the short one ends, the elastic one's
    # allowance grows to every core, and the step sees it while it runs
    variants = [{"name": "e", "method": "fake", "elastic": True, "sleep": 3.0},
                {"name": "s", "method": "fake", "level": 2, "sleep": 0.8}]
    rc, summary = run_api(write_recipe(tmp_path / "r.yaml", fake_recipe(tmp_path, variants)), store_dir, jobs=2)
    assert rc == 0 and _overlaps(_built(summary)) == 2
    base = max(1, cpu_count() // 2)
    seen = step_infos(store_dir)["quantize[e]"]["threads_seen"]
    # while both run it has its share (plus any odd core left over); alone, every core
    assert seen[0] <= cpu_count() - base and seen[-1] == cpu_count(), seen
    assert step_infos(store_dir)["quantize[s]"]["threads_seen"] == [base]   # not elastic: keeps its share


def test_a_fixed_thread_count_is_a_cap(tmp_path, store_dir):
    variants = [{"name": "e", "method": "fake", "elastic": True, "sleep": 1.0}]
    recipe = write_recipe(tmp_path / "r.yaml", fake_recipe(tmp_path, variants, runtime={"threads": 1}))
    rc, _ = run_api(recipe, store_dir, jobs=2)
    assert rc == 0 and step_infos(store_dir)["quantize[e]"]["threads_seen"] == [1]


def test_a_waiting_step_runs_in_a_worker_started_ahead(tmp_path, store_dir):
    # each step wants every core, so "b" waits while "a" runs: a standby worker imports b's preload meanwhile
    variants = [{"name": "a", "method": "fake", "sleep": 1.5, "preload": ["fake_heavy"]},
                {"name": "b", "method": "fake", "level": 2, "sleep": 0.3, "preload": ["fake_heavy"]}]
    recipe = write_recipe(tmp_path / "r.yaml", fake_recipe(tmp_path, variants, runtime={"threads": cpu_count()}))
    rc, summary = run_api(recipe, store_dir, jobs=2)
    assert rc == 0 and _overlaps(_built(summary)) == 1
    infos = step_infos(store_dir)
    first, second = sorted(("quantize[a]", "quantize[b]"), key=lambda n: next(
        s["started"] for s in summary["steps"] if s["name"] == n))
    assert infos[first]["preloaded"] == []                 # it started at once, in a fresh worker
    assert infos[second]["preloaded"] == ["fake_heavy"]    # imported before it ran
    # the step's own variables and directory, as a fresh worker has them
    assert infos[second]["omp_threads"] == str(cpu_count()) and infos[second]["cwd_is_scratch"]
    log = next(p for p in (store_dir / "logs").rglob("*.log") if p.name == f"{second}.log").read_text()
    assert "started ahead of its step; imported fake_heavy" in log and "fake step, level" in log
    assert not _standbys(), "a standby worker outlived the run"


def test_no_standby_runs_beside_a_timing_step(tmp_path, store_dir):
    # "b" waits behind "a" with a standby; the timing step "t" goes first and must run with nothing beside it
    variants = [{"name": "a", "method": "fake", "sleep": 1.0, "preload": ["fake_heavy"]},
                {"name": "t", "method": "fake", "level": 2, "sleep": 1.0, "timing": True},
                {"name": "b", "method": "fake", "level": 3, "sleep": 0.2, "preload": ["fake_heavy"]}]
    recipe = write_recipe(tmp_path / "r.yaml", fake_recipe(tmp_path, variants, runtime={"threads": cpu_count()}))
    rc, _ = run_api(recipe, store_dir, jobs=2)
    assert rc == 0
    assert step_infos(store_dir)["quantize[t]"]["standbys_beside"] == 0
    assert not _standbys()


# --- several recipes, one graph, one JUnit report -------------------------------------------------------------
@pytest.fixture(scope="session")
def junit_xsd(tmp_path_factory) -> Path:
    """The JUnit schema Jenkins' xUnit reads (junit-10.xsd), as shipped in pytest's own sdist (testing/)."""
    import pytest as pytest_module

    pytest.importorskip("xmlschema", reason="xmlschema is not installed (pip install 'qbuild[dev]')")
    cache = tmp_path_factory.mktemp("junit-xsd")
    res = subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--no-binary", ":all:",
                          f"pytest=={pytest_module.__version__}", "-d", str(cache)], capture_output=True, text=True,
                         timeout=300)
    sdists = list(cache.glob("pytest-*.tar.gz"))
    if res.returncode != 0 or not sdists:
        pytest.skip(f"pytest's sdist (which ships junit-10.xsd) could not be downloaded: {res.stderr[-300:]}")
    with tarfile.open(sdists[0]) as tar:
        member = next(m for m in tar.getmembers() if m.name.endswith("testing/example_scripts/junit-10.xsd"))
        member.name = "junit-10.xsd"
        tar.extract(member, cache, filter="data")
    return cache / "junit-10.xsd"


def test_several_recipes_one_deduplicated_plan_and_junit(tmp_path, store_dir, junit_xsd):
    import xmlschema

    shared = {"name": "shared", "method": "fake", "sleep": 0.3}
    a = fake_recipe(tmp_path, [shared, {"name": "a-only", "method": "fake", "level": 2}])
    a.update(name="nightly-a")
    a["evaluation"]["gates"] = [{"max_size_mb": 10}]
    b = fake_recipe(tmp_path, [shared, {"name": "b-only", "method": "fake", "level": 3, "fail": True}])
    b.update(name="nightly-b")
    b["evaluation"]["gates"] = [{"max_size_mb": 0.001}]   # fails: exit 1 (a step failed) beats 3
    folder = tmp_path / "nightly"
    folder.mkdir()
    write_recipe(folder / "a.yaml", a)
    write_recipe(folder / "b.yaml", b)
    xml = tmp_path / "out" / "gates.xml"
    res = qbuild("run", folder, "--store", store_dir, "--json", "--junit-xml", xml)
    assert res.returncode == 1, res.stderr
    data = json.loads(res.stdout)
    assert [s["recipe"] for s in data["recipes"]] == ["nightly-a", "nightly-b"]
    built = [s["name"] for r in data["recipes"] for s in r["steps"] if s["status"] == "built"]
    shared_steps = [s for r in data["recipes"] for s in r["steps"] if s["name"] == "quantize[shared]"]
    assert len(shared_steps) == 2 and len({(s["key"], s["started"]) for s in shared_steps}) == 1   # built once
    assert built.count("quantize[shared]") == 2   # ... and both recipes report that one build
    xmlschema.XMLSchema(junit_xsd).validate(xml)
    text = xml.read_text()
    assert 'name="gates[a-only]"' in text and 'name="gates[b-only]"' in text
    assert "max_size_mb" in text and 'type="quality gate"' in text and "quantize[b-only]" in text
    assert 'type="step failed"' in text and "fake failure requested" in text
    # without the failing step, the failed gate alone exits 3
    b["variants"][1]["fail"] = False
    write_recipe(folder / "b.yaml", b)
    res = qbuild("run", folder, "--store", store_dir, "--junit-xml", xml)
    assert res.returncode == 3, res.stderr
    assert os.path.getsize(xml) > 0


def test_a_time_limited_set_stops_starting_steps_past_its_limit_and_a_rerun_resumes(tmp_path, store_dir):
    """A search's max_minutes at run time: once the set's first step has run longer than the limit, the next step of
    the set fails with one line naming the field and what is stored, the rest are skipped; a rerun builds only those."""
    from qbuild.artifacts.store import Store
    from qbuild.pipeline.executor import Executor
    from qbuild.pipeline.outcome import Outcome
    from qbuild.pipeline.plan import TimeLimit, make_plan
    from qbuild.planning.recipe import parse_recipe

    variants = [{"name": f"v{i}", "method": "fake", "level": i, "sleep": 0.5} for i in range(3)]
    recipe = parse_recipe(fake_recipe(tmp_path, variants, runtime={"threads": 1}))
    store = Store(store_dir)
    plan = make_plan(recipe, tmp_path, store)
    limited = tuple(ps.step for ps in plan.steps if ps.step.name.startswith("quantize["))
    limit = TimeLimit("variants[0].search.max_minutes", 0.3 / 60, "the search for v", limited, {}, "")
    outcomes = {o.step.name: o for o in Executor(store, store.new_run_id(), {}, jobs=1, time_limits=[limit]).run(
        list(plan.steps))}
    statuses = sorted(outcomes[s.name].status for s in limited)
    assert statuses == sorted([Outcome.BUILT, Outcome.FAILED, Outcome.SKIPPED]), statuses
    failed = next(outcomes[s.name] for s in limited if outcomes[s.name].status == Outcome.FAILED)
    assert failed.error.startswith("the search for v stopped after 0.0") and "1 of 3 of its steps are stored" in failed.error
    assert "variants[0].search.max_minutes 0.005" in failed.error and "\n" not in failed.error
    again = {o.step.name: o.status for o in Executor(store, store.new_run_id(), {}, jobs=1).run(
        list(make_plan(recipe, tmp_path, store).steps))}
    assert sorted(again[s.name] for s in limited) == sorted([Outcome.CACHED, Outcome.BUILT, Outcome.BUILT])


def test_an_interrupt_inside_a_step_kills_its_worker_before_its_scratch_goes(tmp_path, store_dir):
    """A Ray task's cancel raises KeyboardInterrupt in the thread that waits on the step's worker (here: on its first
    progress line): the worker dies there and then, and its scratch goes after it, with nothing written since."""
    from qbuild.artifacts.store import Store
    from qbuild.pipeline.budget import Claim
    from qbuild.pipeline.executor import Executor
    from qbuild.pipeline.outcome import Outcome, StepOutcome
    from qbuild.pipeline.plan import make_plan
    from qbuild.planning.recipe import parse_recipe

    class Interrupted(Executor):
        def _on_progress(self, task, line):
            raise KeyboardInterrupt

    recipe = parse_recipe(fake_recipe(tmp_path, [{"name": "v", "method": "fake", "sleep": 30.0}]))
    store = Store(store_dir)
    step = next(ps.step for ps in make_plan(recipe, tmp_path, store).steps if ps.step.kind == "quantize")
    outcomes = {s.key: StepOutcome(s, Outcome.SOURCE, path=s.source_path) for s in step.inputs.values()}
    ex = Interrupted(store, store.new_run_id(), {}, jobs=1)
    with pytest.raises(KeyboardInterrupt):
        ex._build(step, outcomes, Claim(cpus=1, memory_mb=0, gpu=None, alone=False, key=step.key, base=1))
    workers = subprocess.run(["pgrep", "-f", f"qbuild.pipeline.worker {store_dir}"], capture_output=True, text=True)
    assert workers.stdout == "", "the step's worker outlived the interrupt"
    time.sleep(0.5)   # a worker still alive would write its result into the scratch now
    assert not list((store_dir / "tmp").iterdir())


def test_steps_that_would_fill_the_disk_together_run_one_at_a_time(tmp_path, store_dir, monkeypatch):
    """Each step fits the free disk alone, two do not: the executor holds what a running step is expected to write
    against the free space, so the second waits for the first (and with room for both they overlap)."""
    from qbuild.pipeline import executor

    variants = [{"name": f"v{i}", "method": "fake", "level": i, "sleep": 1.0} for i in range(2)]
    recipe = write_recipe(tmp_path / "r.yaml", fake_recipe(tmp_path, variants, runtime={"threads": 1}))
    model = tmp_path / "fake-model"
    one = sum(f.stat().st_size for f in model.iterdir()) // 4   # what a quantize step is expected to write
    for free, expected in ((one * 3 // 2, 1), (one * 3, 2)):
        monkeypatch.setattr(executor, "free_bytes", lambda _root, free=free: free)
        store = store_dir.with_name(f"store-{free}")
        rc, summary = run_api(recipe, store, jobs=2)
        assert rc == 0
        assert _overlaps(_built(summary)) == min(expected, cpu_count()), free


def test_steps_of_one_at_once_group_never_run_more_than_its_limit_together(tmp_path, store_dir):
    """A search's probes share a group (Step.at_once) whose limit keeps their scratch within the search's disk bound:
    with 4 cores' worth of jobs, 3 such steps run one at a time while a step outside the group still overlaps them."""
    variants = [*({"name": f"p{i}", "method": "fake", "level": i, "sleep": 1.0, "at_once": 1} for i in range(3)),
                {"name": "free", "method": "fake", "level": 9, "sleep": 2.0}]
    recipe = write_recipe(tmp_path / "r.yaml", fake_recipe(tmp_path, variants, runtime={"threads": 1}))
    rc, summary = run_api(recipe, store_dir, jobs=4)
    assert rc == 0
    built = _built(summary)
    grouped = [s for s in built if "[p" in s["name"]]
    assert len(grouped) == 3 and _overlaps(grouped) == 1
    if cpu_count() > 1:
        assert _overlaps(built) == 2   # the step outside the group ran beside them
