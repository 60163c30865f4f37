"""Issue 12, the store: a damaged, power-cut, full or read-only store never serves wrong data or gets stuck.

Every test uses a real store on tmp_path and the real CLI (a subprocess) or the Python API; each case failed on
the code before the fix (a damaged object was served as "cached", a zeroed record crashed the run, ...).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from qbuild.artifacts.store import Store

from helpers import fake_recipe, qbuild, run_api, write_recipe


def statuses(summary: dict) -> dict[str, str]:
    return {s["name"]: s["status"] for s in summary["steps"]}


def _built_store(tmp_path: Path, store_dir: Path, variants=None) -> tuple[Path, dict]:
    recipe = write_recipe(tmp_path / "r.yaml", fake_recipe(tmp_path, variants or [{"name": "a", "method": "fake"}]))
    rc, summary = run_api(recipe, store_dir)
    assert rc == 0 and statuses(summary)["quantize[a]"] == "built"
    return recipe, summary


def _object(store_dir: Path, summary: dict, variant: str = "a") -> Path:
    digest = next(v["digest"] for v in summary["variants"] if v["variant"] == variant)
    return Store(store_dir).object_dir(digest)


def _writable(path: Path) -> None:
    path.chmod(0o644)


def _damage_flip(obj: Path) -> None:
    f = obj / "weights.bin"
    _writable(f)
    data = bytearray(f.read_bytes())
    data[100] ^= 0xFF
    st = f.stat()
    f.write_bytes(bytes(data))
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns))   # same size, same mtime: only a re-hash sees it


def _damage_truncate(obj: Path) -> None:
    f = obj / "weights.bin"
    _writable(f)
    with open(f, "r+b") as fh:
        fh.truncate(10)


def _damage_zero(obj: Path) -> None:
    f = obj / "weights.bin"
    _writable(f)
    f.write_bytes(b"")


def _damage_delete(obj: Path) -> None:
    (obj / "weights.bin").unlink()


def _damage_rewrite(obj: Path) -> None:      # same size, new mtime: the fast check re-hashes it
    f = obj / "weights.bin"
    _writable(f)
    data = bytearray(f.read_bytes())
    data[0] ^= 1
    before = f.stat().st_mtime_ns
    f.write_bytes(bytes(data))
    os.utime(f, ns=(before, before + 2_000_000_000))   # an edit moves mtime (explicit: kernel timestamps are coarse)


def _damage_manifest(obj: Path) -> None:
    m = obj / "manifest.json"
    _writable(m)
    m.write_text("{}")


@pytest.mark.parametrize("damage", [_damage_truncate, _damage_zero, _damage_delete, _damage_rewrite, _damage_manifest])
def test_a_damaged_object_is_quarantined_and_rebuilt_not_served(tmp_path, store_dir, damage, caplog):
    recipe, first = _built_store(tmp_path, store_dir)
    obj = _object(store_dir, first)
    good = (obj / "weights.bin").read_bytes()
    damage(obj)
    rc, second = run_api(recipe, store_dir)
    assert rc == 0 and statuses(second)["quantize[a]"] == "built"        # rebuilt, never "cached"
    assert (obj / "weights.bin").read_bytes() == good                    # the fresh object replaced it
    assert Store(store_dir).verify() and all(r["ok"] for r in Store(store_dir).verify())
    kept = list((store_dir / "quarantine").iterdir())
    assert len(kept) == 1 and kept[0].name.startswith(obj.name)          # kept for inspection
    warnings = [r.getMessage() for r in caplog.records if "damaged object" in r.getMessage()]
    assert len(warnings) == 1 and obj.name[:12] in warnings[0]
    assert second["quarantined"][0]["digest"] == obj.name


def test_same_size_same_mtime_bit_flip_is_caught_by_verify_full(tmp_path, store_dir):
    recipe, first = _built_store(tmp_path, store_dir)
    obj = _object(store_dir, first)
    _damage_flip(obj)
    res = qbuild("run", recipe, "--store", store_dir, "--verify", "full", "--json")
    assert res.returncode == 0, res.stderr
    assert statuses(json.loads(res.stdout))["quantize[a]"] == "built"
    assert "damaged object" in res.stderr and "Traceback" not in res.stderr
    assert all(r["ok"] for r in Store(store_dir).verify())


def test_warm_hit_check_uses_the_stamp_and_costs_milliseconds(tmp_path, store_dir):
    variants = [{"name": "a", "method": "fake"}]
    _, first = _built_store(tmp_path, store_dir, variants)
    store = Store(store_dir)
    key = next(s["key"] for s in first["steps"] if s["name"] == "quantize[a]")
    assert store.lookup(key) is not None
    import qbuild.base.hashing as hashing_module  # where a file is hashed (store and fingerprint memos share it)

    calls = []
    real = hashing_module.sha256_file
    hashing_module.sha256_file = lambda p: calls.append(p) or real(p)
    try:
        t0 = time.perf_counter()
        for _ in range(20):
            assert store.lookup(key) is not None
        warm = (time.perf_counter() - t0) / 20
        assert calls == []                               # warm: stat only, no re-hash
        assert store.lookup(key, verify="full") is not None and len(calls) == 1
    finally:
        hashing_module.sha256_file = real
    assert warm < 0.05   # typically well under 1 ms; generous for a loaded CI machine


def test_an_action_record_naming_another_object_is_not_followed(tmp_path, store_dir):
    recipe, first = _built_store(tmp_path, store_dir, [{"name": "a", "method": "fake"},
                                                       {"name": "b", "method": "fake", "level": 2}])
    keys = {s["name"]: s["key"] for s in first["steps"]}
    store = Store(store_dir)
    rec_a = store._action_file(keys["quantize[a]"])
    rec_b = json.loads(store._action_file(keys["quantize[b]"]).read_text())
    data = json.loads(rec_a.read_text())
    data["digest"] = rec_b["digest"]                     # a's record now points at b's object
    rec_a.write_text(json.dumps(data))
    rc, second = run_api(recipe, store_dir)
    assert rc == 0 and statuses(second) == {"model": "source", "quantize[a]": "built", "quantize[b]": "cached"}
    a = next(v for v in second["variants"] if v["variant"] == "a")
    assert a["digest"] == next(v for v in first["variants"] if v["variant"] == "a")["digest"]
    assert not (store_dir / "quarantine").exists()          # b's object is sound: only a's record was wrong


def test_publish_replaces_a_damaged_object_instead_of_keeping_it(tmp_path, store_dir):
    recipe, first = _built_store(tmp_path, store_dir)
    obj = _object(store_dir, first)
    good = (obj / "weights.bin").read_bytes()
    key = next(s["key"] for s in first["steps"] if s["name"] == "quantize[a]")
    _damage_flip(obj)
    Store(store_dir)._action_file(key).unlink()          # the old repair attempt: drop the record, rerun
    rc, second = run_api(recipe, store_dir)
    assert rc == 0 and statuses(second)["quantize[a]"] == "built"
    assert (obj / "weights.bin").read_bytes() == good
    assert all(r["ok"] for r in Store(store_dir).verify())


def test_verify_repair_quarantines_store_wide_and_the_next_run_rebuilds(tmp_path, store_dir):
    recipe, first = _built_store(tmp_path, store_dir)
    obj = _object(store_dir, first)
    _damage_flip(obj)
    res = qbuild("verify", "--store", store_dir)
    assert res.returncode == 1 and "DAMAGED" in res.stdout
    res = qbuild("verify", "--repair", "--store", store_dir)
    assert res.returncode == 0 and "quarantined" in res.stdout, res.stdout + res.stderr
    assert not obj.exists() and len(list((store_dir / "quarantine").iterdir())) == 1
    assert qbuild("verify", "--store", store_dir).returncode == 0
    rc, second = run_api(recipe, store_dir)
    assert rc == 0 and statuses(second)["quantize[a]"] == "built"


@pytest.mark.parametrize("content", [b"", b"{}", b"\x00\x00\x00", b"[1, 2]", b'{"digest": 5}', b'{"files": "x"}',
                                     b'{"digest": "../../etc", "files": [{"path": "../x", "size": 1, "sha256": "a"}]}'])
def test_commands_never_crash_on_any_manifest_content(tmp_path, store_dir, content):
    _, first = _built_store(tmp_path, store_dir)
    obj = _object(store_dir, first)
    m = obj / "manifest.json"
    _writable(m)
    m.write_bytes(content)
    out = tmp_path / "pulled"
    for args in (("verify",), ("show", "t/a"), ("pull", "t/a", "-o", out), ("ls",), ("ls", "--json"),
                 ("verify", "t/a")):
        res = qbuild(*args, "--store", store_dir)
        assert "Traceback" not in res.stderr, (args, res.stderr)
        assert res.returncode in (0, 1, 2), (args, res.returncode)
        if args[0] in ("show", "pull", "verify"):
            assert res.returncode != 0, (args, res.stdout)   # never presented as sound
    assert not out.exists() or not any(out.iterdir())


def test_a_dangling_or_garbage_ref_is_a_clean_error(tmp_path, store_dir):
    _, first = _built_store(tmp_path, store_dir)
    shutil.rmtree(_object(store_dir, first), onerror=lambda f, p, e: (os.chmod(p, 0o755), f(p)))
    (store_dir / "refs" / "t" / "a" / "junk").write_text("not json")
    for args in (("show", "t/a"), ("pull", "t/a", "-o", tmp_path / "o"), ("verify", "t/a"), ("ls",), ("show", "t/a:junk")):
        res = qbuild(*args, "--store", store_dir)
        assert "Traceback" not in res.stderr and res.returncode in (0, 1, 2), (args, res.stderr)


# --- durability -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("manifests_too", [False, True])
@pytest.mark.parametrize("content", [b"", b"\x00" * 64, b'{"digest": "', b"[]"])
def test_an_empty_or_garbage_action_record_is_a_miss_that_gets_rewritten(tmp_path, store_dir, content, manifests_too):
    recipe, first = _built_store(tmp_path, store_dir)
    store = Store(store_dir)
    if manifests_too:   # what the ext4 power cut left without fsync: records and manifests zero-length
        for m in (store_dir / "objects").glob("*/*/manifest.json"):
            _writable(m)
            m.write_bytes(content)
    for rec in (store_dir / "actions").glob("*/*.json"):
        rec.write_bytes(content)                          # what a power cut without fsync left behind
    for ref in (store_dir / "refs").glob("*/*/*"):
        ref.write_bytes(content)
    for hist in (store_dir / "history").glob("*/*.json"):
        hist.write_bytes(content)
    rc, second = run_api(recipe, store_dir)
    assert rc == 0 and statuses(second)["quantize[a]"] in ("built", "cached")
    rc, third = run_api(recipe, store_dir)
    assert rc == 0 and statuses(third)["quantize[a]"] == "cached"
    assert all(json.loads(r.read_text())["digest"] for r in (store_dir / "actions").glob("*/*.json"))
    assert store.resolve("t/a") == third["variants"][0]["digest"]


def test_records_and_objects_are_fsynced_before_they_become_visible(tmp_path, store_dir, monkeypatch):
    """Every rename that publishes an object or replaces a record comes after an fsync of what it names."""
    import qbuild.artifacts.store as store_module

    events: list[tuple[str, str]] = []
    real_fsync, real_replace, real_rename = os.fsync, os.replace, os.rename

    def fsync(fd):
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        return real_fsync(fd)

    monkeypatch.setattr(store_module.os, "fsync", fsync)
    monkeypatch.setattr(store_module.os, "replace", lambda a, b: (events.append(("rename", str(a))), real_replace(a, b)))
    monkeypatch.setattr(store_module.os, "rename", lambda a, b: (events.append(("rename", str(a))), real_rename(a, b)))
    store = Store(store_dir)
    tmp = store.new_tmp("c" * 64)
    (tmp / "w.bin").write_bytes(b"x" * 1000)
    store.publish("c" * 64, tmp, {"kind": "quantize", "name": "s"})
    store.set_ref("t", "a", "latest", store.lookup("c" * 64).digest, "c" * 64)
    renames = [i for i, e in enumerate(events) if e[0] == "rename"]
    assert renames
    for i in renames:
        src = events[i][1]
        synced = [e[1] for e in events[:i] if e[0] == "fsync"]
        assert any(s == src or s.startswith(src + "/") for s in synced), (src, synced)
    assert any(e == ("fsync", str(store_dir / "refs" / "t" / "a")) for e in events)


def _can_loop_mount() -> str | None:
    if os.geteuid() != 0:
        return "needs root (losetup, mount)"
    for tool in ("mkfs.ext4", "losetup", "mount", "umount"):
        if shutil.which(tool) is None:
            return f"{tool} not found"
    return None


def test_power_cut_on_a_real_ext4_leaves_a_usable_store(tmp_path):
    """Build, shut the filesystem down without flushing its journal (EXT4_IOC_SHUTDOWN, NOLOGFLUSH), remount:
    the store must still serve what the run published (or, at worst, rebuild it), never crash."""
    reason = _can_loop_mount()
    if reason:
        pytest.skip(reason)
    img, mnt = tmp_path / "fs.img", tmp_path / "mnt"
    mnt.mkdir()
    subprocess.run(["truncate", "-s", "64M", str(img)], check=True)
    subprocess.run(["mkfs.ext4", "-q", "-F", str(img)], check=True)
    if subprocess.run(["mount", "-o", "loop", str(img), str(mnt)], capture_output=True).returncode != 0:
        pytest.skip("loop mount not permitted here")
    try:
        store_dir = mnt / "store"
        recipe = write_recipe(tmp_path / "r.yaml", fake_recipe(tmp_path, [{"name": "a", "method": "fake"}]))
        rc, first = run_api(recipe, store_dir)
        assert rc == 0
        import fcntl

        fd = os.open(mnt, os.O_RDONLY)
        try:
            fcntl.ioctl(fd, 0x8004587D, (2).to_bytes(4, "little"))   # EXT4_IOC_SHUTDOWN, EXT4_GOING_FLAGS_NOLOGFLUSH
        except OSError as exc:
            pytest.skip(f"EXT4_IOC_SHUTDOWN not supported: {exc}")
        finally:
            os.close(fd)
    finally:
        subprocess.run(["umount", str(mnt)], capture_output=True)
    subprocess.run(["mount", "-o", "loop", str(img), str(mnt)], check=True)
    try:
        res = qbuild("run", recipe, "--store", mnt / "store", "--json")
        assert res.returncode == 0 and "Traceback" not in res.stderr, res.stderr
        assert statuses(json.loads(res.stdout))["quantize[a]"] == "cached"   # fsynced: nothing was lost
        assert qbuild("verify", "--store", mnt / "store").returncode == 0
    finally:
        subprocess.run(["umount", str(mnt)], capture_output=True)


# --- full disk, read-only store, leftovers ------------------------------------------------------------------------
def test_disk_full_is_one_line_exit_1_and_no_scratch(tmp_path, store_dir, monkeypatch):
    """ENOSPC while records are written (simulated at os.write, the only way without a tiny filesystem)."""
    import errno

    import qbuild.artifacts.store as store_module
    from qbuild.artifacts.store import StoreFull

    store = Store(store_dir)
    tmp = store.new_tmp("c" * 64)
    (tmp / "w.bin").write_bytes(b"x" * 1000)

    def full(fd, data):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(store_module.os, "write", full)
    with pytest.raises(StoreFull) as info:
        store.publish("c" * 64, tmp, {"kind": "quantize", "name": "quantize[a]"})
    msg = str(info.value)
    assert str(store_dir) in msg and "needs" in msg and "free" in msg and "\n" not in msg
    assert info.value.exit_code == 1
    assert not list(store_dir.rglob(".*.tmp"))


def _tiny_fs(tmp_path: Path, size: str) -> Path | None:
    if _can_loop_mount():
        return None
    mnt = tmp_path / "tiny"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mnt)], capture_output=True).returncode:
        return None
    return mnt


@pytest.mark.parametrize("free_kib", [0, 3, 20, 40, 70, 110, 150, 200])
def test_disk_full_on_a_real_small_filesystem_at_many_fill_levels(tmp_path, free_kib):
    """A real (tmpfs) filesystem that fills up at different moments: during a worker's output, the manifest, an
    action record, a ref or the run record. Always exit 0 or one line + exit 1, no scratch, no half-written
    record, and once space is freed the next run completes and the store verifies clean."""
    mnt = _tiny_fs(tmp_path, "1m")
    if mnt is None:
        pytest.skip("needs root and tmpfs mounts")
    try:
        store = mnt / "store"
        recipe = write_recipe(tmp_path / "r.yaml", fake_recipe(
            tmp_path, [{"name": f"v{i}", "method": "fake", "level": i} for i in range(5)]))
        filler = mnt / "filler"
        with open(filler, "wb") as f:
            try:
                f.write(b"\0" * max(shutil.disk_usage(mnt).free - free_kib * 1024, 0))
            except OSError:
                pass
        res = qbuild("run", recipe, "--store", store, "-j", "1")
        assert "Traceback" not in res.stderr, res.stderr
        if res.returncode != 0:
            assert res.returncode == 1 and len(res.stderr.strip().splitlines()) == 1, res.stderr
            assert "is full" in res.stderr and str(store) in res.stderr and "free" in res.stderr, res.stderr
        assert not list((store / "tmp").glob("*")) if (store / "tmp").exists() else True
        assert not list(store.rglob(".*.tmp"))
        filler.unlink()
        res = qbuild("run", recipe, "--store", store, "--json")
        assert res.returncode == 0, res.stderr
        assert qbuild("verify", "--store", store).returncode == 0
    finally:
        subprocess.run(["umount", str(mnt)], capture_output=True)


def _read_only(store_dir: Path, tmp_path: Path):
    """A read-only view of store_dir: a read-only bind mount as root, else chmod (not writable for this user)."""
    if os.geteuid() == 0:
        ro = tmp_path / "ro"
        ro.mkdir()
        if subprocess.run(["mount", "--bind", str(store_dir), str(ro)], capture_output=True).returncode == 0:
            if subprocess.run(["mount", "-o", "remount,ro,bind", str(ro)], capture_output=True).returncode == 0:
                return ro, lambda: subprocess.run(["umount", str(ro)], capture_output=True)
            subprocess.run(["umount", str(ro)], capture_output=True)
        pytest.skip("read-only bind mounts are not permitted here (and root ignores chmod)")
    for p in [store_dir, *store_dir.rglob("*")]:
        if p.is_dir():
            p.chmod(0o555)
    return store_dir, lambda: [p.chmod(0o755) for p in [store_dir, *store_dir.rglob("*")] if p.is_dir()]


def test_read_only_store_serves_hits_and_refuses_to_build_in_one_line(tmp_path, store_dir):
    recipe, _ = _built_store(tmp_path, store_dir)
    ro, undo = _read_only(store_dir, tmp_path)
    try:
        before = sorted(str(p) for p in store_dir.rglob("*"))
        res = qbuild("run", recipe, "--store", ro, "--json")
        assert res.returncode == 0, res.stderr
        assert statuses(json.loads(res.stdout))["quantize[a]"] == "cached"
        assert sorted(str(p) for p in store_dir.rglob("*")) == before          # nothing written
        for args in (("ls",), ("show", "t/a"), ("verify",), ("pull", "t/a", "-o", tmp_path / "out")):
            r = qbuild(*args, "--store", ro)
            assert r.returncode == 0 and "Traceback" not in r.stderr, (args, r.stderr)
        write_recipe(recipe, fake_recipe(tmp_path, [{"name": "a", "method": "fake"}, {"name": "new", "method": "fake",
                                                                                       "level": 9}]))
        res = qbuild("run", recipe, "--store", ro)
        assert res.returncode == 2 and "read-only" in res.stderr and "quantize[new]" in res.stderr
        assert "Traceback" not in res.stderr and len(res.stderr.strip().splitlines()) == 1, res.stderr
        for args in (("tag", "t/a", "t/a:prod"), ("gc",), ("verify", "--repair"), ("pull", "t/a", "-o", ro / "out"),
                     ("plan", recipe, "--verify", "full")):
            r = qbuild(*args, "--store", ro)
            assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) <= 1, (args, r.stderr)
            assert r.returncode in (0, 2), (args, r.returncode, r.stderr)
        assert sorted(str(p) for p in store_dir.rglob("*")) == before
    finally:
        undo()


def test_stale_scratch_and_locks_are_cleaned_on_start_but_live_ones_are_kept(tmp_path, store_dir):
    recipe, _ = _built_store(tmp_path, store_dir)
    store = Store(store_dir)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = store_dir / "tmp" / f"{'e' * 64}.{dead.pid}.abcd1234"
    (stale / "out").mkdir(parents=True)
    (stale / "out" / "half.bin").write_bytes(b"x" * 100)
    live = store_dir / "tmp" / f"{'f' * 64}.{os.getpid()}.abcd1234"   # our own pid... but its lock is held below
    live.mkdir()
    old = time.time() - 3600
    for p in (stale, live, *(store_dir / "locks").glob("*.lock")):
        os.utime(p, (old, old))
    from filelock import FileLock

    with FileLock(str(store_dir / "locks" / f"{'f' * 64}.lock")):
        os.utime(store_dir / "locks" / f"{'f' * 64}.lock", (old, old))
        removed = store.clean_stale()
        assert live.exists() and (store_dir / "locks" / f"{'f' * 64}.lock").exists()
    assert not stale.exists() and removed["tmp"] == 1 and removed["locks"] >= 1


def test_gc_cleans_tmp_locks_logs_runs_with_retention(tmp_path, store_dir):
    recipe, _ = _built_store(tmp_path, store_dir)
    for _ in range(3):
        rc, last = run_api(recipe, store_dir)   # cached runs: the last one, kept by --keep-last 1, has no logs
        assert rc == 0
    runs = sorted((store_dir / "runs").glob("*.json"))
    assert len(runs) == 4
    old = time.time() - 40 * 86400
    for p in [*runs, *(store_dir / "logs").iterdir(), *(store_dir / "locks").iterdir()]:
        os.utime(p, (old, old))
    stale = store_dir / "tmp" / f"{'e' * 64}.999999999.abcd1234"
    stale.mkdir(parents=True)
    os.utime(stale, (old, old))
    res = qbuild("gc", "--store", store_dir, "--dry-run", "--json")
    assert res.returncode == 0, res.stderr
    assert stale.exists() and len(list((store_dir / "runs").glob("*.json"))) == 4
    res = qbuild("gc", "--store", store_dir, "--keep-last", "1", "--json")
    assert res.returncode == 0, res.stderr
    kinds = {r["kind"] for r in json.loads(res.stdout)["removed"]}
    assert {"tmp", "lock", "run", "log"} <= kinds
    assert not stale.exists() and [p.stem for p in (store_dir / "runs").glob("*.json")] == [last["run_id"]]
    assert not list((store_dir / "locks").iterdir())
    assert statuses(run_api(recipe, store_dir)[1])["quantize[a]"] == "cached"    # objects untouched


def test_ls_in_a_pipe_prints_complete_lines(tmp_path, store_dir):
    long_name = "smollm2-methods-with-a-very-long-recipe-name"
    data = fake_recipe(tmp_path, [{"name": "a-variant-with-a-long-name-too", "method": "fake"}])
    data["name"] = long_name
    recipe = write_recipe(tmp_path / "r.yaml", data)
    assert run_api(recipe, store_dir)[0] == 0
    res = qbuild("ls", "--store", store_dir, env={"COLUMNS": "40"})
    assert res.returncode == 0
    ref = f"{long_name}/a-variant-with-a-long-name-too:latest"
    assert any(line.split("\t")[0] == ref for line in res.stdout.splitlines()), res.stdout
    assert "…" not in res.stdout


def test_a_step_that_cannot_fit_is_refused_before_it_runs(tmp_path, store_dir, monkeypatch):
    import qbuild.pipeline.executor as executor_module
    from qbuild.artifacts.store import StoreFull

    recipe = write_recipe(tmp_path / "r.yaml", fake_recipe(tmp_path, [{"name": "a", "method": "fake"}]))
    monkeypatch.setattr(executor_module, "free_bytes", lambda path: 1)   # 1 byte free; the step reads a 64-byte model
    with pytest.raises(StoreFull) as info:
        run_api(recipe, store_dir)
    msg = str(info.value)
    assert "quantize[a]" in msg and "estimated" in msg and str(store_dir) in msg and info.value.exit_code == 1
    assert not list((store_dir / "tmp").glob("*")) if (store_dir / "tmp").exists() else True


def test_kill_9_at_random_moments_never_leaves_a_damaged_or_stuck_store(tmp_path, store_dir):
    import random
    import signal

    rng = random.Random(12)
    variants = [{"name": f"v{i}", "method": "fake", "level": i, "sleep": 0.4} for i in range(3)]
    recipe = write_recipe(tmp_path / "r.yaml", fake_recipe(tmp_path, variants, runtime={"threads": 1}))
    for _ in range(6):
        proc = subprocess.Popen([sys.executable, "-m", "qbuild", str(recipe), "--store", str(store_dir), "-j", "2"],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(rng.uniform(0.3, 2.5))
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
        rows = Store(store_dir).verify()
        assert all(r["ok"] for r in rows), rows                 # nothing half-published is ever visible
    rc, summary = run_api(recipe, store_dir)
    assert rc == 0 and all(s in ("built", "cached", "source") for s in statuses(summary).values())
    assert all(r["ok"] for r in Store(store_dir).verify())
    assert not (store_dir / "quarantine").exists()
    rc, again = run_api(recipe, store_dir)
    assert rc == 0 and {s for n, s in statuses(again).items() if n != "model"} == {"cached"}


# --- property-based: no damage to an object's files is ever served by a full check ------------------------------------
hypothesis = pytest.importorskip("hypothesis", reason="hypothesis is not installed (pip install 'qbuild[dev]')")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

DAMAGE = st.one_of(
    st.tuples(st.just("flip"), st.integers(0, 2), st.integers(0, 4095)),
    st.tuples(st.just("truncate"), st.integers(0, 2), st.integers(0, 4095)),
    st.tuples(st.just("append"), st.integers(0, 2), st.integers(1, 64)),
    st.tuples(st.just("delete"), st.integers(0, 2), st.just(0)),
    st.tuples(st.just("extra"), st.integers(0, 2), st.just(0)),
    st.tuples(st.just("symlink"), st.integers(0, 2), st.just(0)),
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(damage=DAMAGE, keep_mtime=st.booleans())
def test_no_damage_is_ever_served_and_fast_sees_all_but_same_mtime_edits(tmp_path_factory, damage, keep_mtime):
    store = Store(tmp_path_factory.mktemp("store"))
    key = "c" * 64
    tmp = store.new_tmp(key)
    (tmp / "sub").mkdir()
    for i, name in enumerate(("a.bin", "b.bin", "sub/c.bin")):
        (tmp / name).write_bytes(bytes([i + 1]) * 4096)
    hit = store.publish(key, tmp, {"kind": "quantize", "name": "s"})
    assert store.lookup(key) is not None
    op, which, n = damage
    f = hit.path / ("a.bin", "b.bin", "sub/c.bin")[which]
    st_before = f.stat()
    f.chmod(0o644)
    if op == "flip":
        data = bytearray(f.read_bytes())
        data[n] ^= 0x55
        f.write_bytes(bytes(data))
    elif op == "truncate":
        with open(f, "r+b") as fh:
            fh.truncate(n)
    elif op == "append":
        with open(f, "ab") as fh:
            fh.write(b"x" * n)
    elif op == "delete":
        f.unlink()
    elif op == "extra":
        (f.parent / "intruder.bin").write_bytes(b"!")
    elif op == "symlink":
        f.unlink()
        f.symlink_to(tmp_path_factory.mktemp("elsewhere"))
    if f.exists() and not f.is_symlink():   # coarse kernel timestamps: make "an edit moves mtime" explicit
        shift = 0 if keep_mtime else 2_000_000_000
        os.utime(f, ns=(st_before.st_atime_ns, st_before.st_mtime_ns + shift))
    # the fast check (stat + stamp) sees everything but an in-place edit that keeps size and mtime: full sees that too
    mode = "full" if (op == "flip" and keep_mtime) else "fast"
    assert store.lookup(key, verify=mode) is None                     # never served
    assert not hit.path.exists() and len(list((store.root / "quarantine").iterdir())) == 1
    assert not store._action_file(key).exists()                       # a miss until rebuilt
