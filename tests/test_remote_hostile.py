"""A hostile or damaged remote, and planted links: what a remote is trusted for (docs/remote-stores.md).

Each test builds a throwaway store and remote (file:// and S3 through moto), plants what a hostile peer would, runs
the CLI in a subprocess (`python -m qbuild`) and checks: no traceback, a failure is one line naming the object or
field, and every precious file is byte-identical afterwards.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from remote_common import REPO, make_object, model_files

from qbuild.artifacts.remote import open_remote
from qbuild.artifacts.remote.base import MANIFEST
from qbuild.artifacts.store import Store


@pytest.fixture(params=["file", "s3"])
def remote_url(request, tmp_path):
    if request.param == "file":
        (tmp_path / "share").mkdir()
        return f"file://{tmp_path / 'share' / 'qbuild'}"
    return request.getfixturevalue("s3_url")


def cli(*args, timeout: float = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-m", "qbuild", *map(str, args)], capture_output=True, text=True, env=env,
                          timeout=timeout)


def one_line_error(res: subprocess.CompletedProcess, *names: str) -> str:
    """The failure: non-zero, no traceback, exactly one line on stderr that names each of `names`."""
    assert res.returncode != 0, res.stdout
    assert "Traceback" not in res.stderr and "Traceback" not in res.stdout, res.stderr
    lines = [line for line in res.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, res.stderr
    for name in names:
        assert name in lines[0], (name, lines[0])
    return lines[0]


def ok(res: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert res.returncode == 0 and "Traceback" not in res.stderr, res.stderr
    return res


def snapshot(*roots: Path) -> dict[str, bytes | str]:
    """Every file and link under roots (the precious ones): compared before and after."""
    out: dict[str, bytes | str] = {}
    for root in roots:
        for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
            for name in dirnames + filenames:
                p = Path(dirpath) / name
                if p.is_symlink():
                    out[str(p)] = "-> " + os.readlink(p)
                elif p.is_file():
                    out[str(p)] = p.read_bytes()
    return out


def put(remote, store: Store, hit, ref: tuple[str, str, str] | None = ("demo", "q4km", "latest")) -> None:
    remote.put_object(hit.digest, hit.path, store.manifest(hit.digest))
    remote.put_action(hit.key, hit.record)
    if ref:
        remote.set_ref(*ref, hit.digest, hit.key)


def plant(remote, rel: str, data: bytes) -> None:
    """Write `rel` under the remote's root as a hostile peer would (no qbuild in between)."""
    path = remote._p(rel)
    remote.fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)
    remote.fs.pipe_file(path, data)


def same_files(obj_dir: Path, out: Path) -> None:
    manifest = json.loads((obj_dir / MANIFEST).read_text())
    for f in manifest["files"]:
        assert (out / f["path"]).read_bytes() == (obj_dir / f["path"]).read_bytes(), f["path"]
    placed = {p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file() or p.is_symlink()}
    extra = placed - {f["path"] for f in manifest["files"]} - {MANIFEST, "README.md"}
    assert not {e for e in extra if not e.startswith(".qbuild/")}, extra


# --- 3. a push trusts only a manifest that is the object's ---------------------------------------------------------
@pytest.mark.parametrize("planted", [{"files": []}, {"files": {"model.safetensors": 1}}])
def test_push_uploads_past_a_planted_manifest(remote_url, tmp_path, planted):
    store = Store(tmp_path / "store")
    hit = make_object(store, model_files(size=1 << 20))
    remote = open_remote(remote_url)
    remote.check()
    plant(remote, f"objects/{hit.digest[:2]}/{hit.digest}/{MANIFEST}", json.dumps(planted).encode())
    before = snapshot(store.root / "objects")
    res = ok(cli("push", hit.digest, "--to", remote_url, "--store", store.root))
    assert "uploaded" in res.stdout
    fresh = open_remote(remote_url)
    assert fresh.has_object(hit.digest) and fresh.get_action(hit.key)["digest"] == hit.digest
    out = tmp_path / "pulled"
    ok(cli("pull", hit.digest, "--from", remote_url, "-o", out))
    same_files(hit.path, out)
    assert snapshot(store.root / "objects") == before


def test_a_committed_record_over_a_planted_manifest_is_not_already_there(remote_url, tmp_path):
    """The earlier bug's aftermath: a record and ref committed over a manifest with no files. The next push must
    upload the object, not say "already there"; a pull of it refuses it in one line naming the object."""
    store = Store(tmp_path / "store")
    hit = make_object(store, model_files(size=1 << 20))
    remote = open_remote(remote_url)
    remote.check()
    plant(remote, f"objects/{hit.digest[:2]}/{hit.digest}/{MANIFEST}", json.dumps({"files": []}).encode())
    remote.put_action(hit.key, hit.record)
    remote.set_ref("demo", "q4km", "latest", hit.digest, hit.key)
    one_line_error(cli("pull", "demo/q4km", "--from", remote_url, "-o", tmp_path / "out"), hit.digest[:12],
                   "refused")
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out.*"))
    res = ok(cli("push", hit.digest, "--to", remote_url, "--store", store.root))
    assert "uploaded" in res.stdout and "already there" not in res.stdout
    ok(cli("pull", "demo/q4km", "--from", remote_url, "-o", tmp_path / "out"))
    same_files(hit.path, tmp_path / "out")


def test_a_push_replaces_a_refused_action_record(remote_url, tmp_path):
    """A record that is no record at all (too deep to parse) is a miss for the push, which replaces it."""
    store = Store(tmp_path / "store")
    hit = make_object(store, model_files(size=1 << 20))
    remote = open_remote(remote_url)
    remote.check()
    plant(remote, f"actions/{hit.key[:2]}/{hit.key}.json", b"[" * 100_000)
    res = ok(cli("push", hit.digest, "--to", remote_url, "--store", store.root))
    assert "uploaded" in res.stdout and "Traceback" not in res.stderr
    assert open_remote(remote_url).get_action(hit.key)["digest"] == hit.digest


# --- 4. staging names never collide with the object's own names ------------------------------------------------------
def test_a_file_named_like_a_staging_part_is_pulled(remote_url, tmp_path):
    """`w.part` is a real file of the object, not w's partial download. Both orders that once lost it: a large `w`
    still downloading while the small `w.part` lands (parallel), and a larger `a.part` landing before `a` (one job)."""
    store = Store(tmp_path / "store")
    files = {"w": os.urandom(24 << 20), "w.part": b"the other file, not a partial download",
             "a": b"a" * 1000, "a.part": b"b" * 5000, "d/x": b"x", "d/x.part": b"y" * 10}
    hit = make_object(store, files)
    put(open_remote(remote_url), store, hit)
    out = tmp_path / "out"
    ok(cli("pull", "demo/q4km", "--from", remote_url, "-o", out))
    for rel, data in files.items():
        assert (out / rel).read_bytes() == data, rel
    same_files(hit.path, out)
    one_job = tmp_path / "one-job"
    open_remote(remote_url, jobs=1).fetch_object(hit.digest, one_job)
    same_files(hit.path, one_job)
    ok(cli("verify", "--remote", remote_url, "--deep"))


# --- 5. a leftover staging folder is never the pulled artifact -------------------------------------------------------
def test_a_leftover_staging_folder_is_not_accepted(remote_url, tmp_path):
    store = Store(tmp_path / "store")
    hit = make_object(store, model_files(size=1 << 20))
    put(open_remote(remote_url), store, hit)
    out = tmp_path / "out"
    for leftover in (tmp_path / f".out.pull-{hit.digest[:16]}", tmp_path / f".out.partial-{hit.digest[:16]}",
                     tmp_path / f".out.partial-{hit.digest[:16]}" / "tree"):
        leftover.mkdir(parents=True, exist_ok=True)
        (leftover / MANIFEST).write_text(json.dumps({"digest": hit.digest, "files": []}))
        (leftover / "evil.sh").write_text("#!/bin/sh\nrm -rf ~\n")
    ok(cli("pull", "demo/q4km", "--from", remote_url, "-o", out))
    assert not (out / "evil.sh").exists()
    same_files(hit.path, out)


def test_a_symlinked_out_is_refused_before_anything_is_downloaded(remote_url, tmp_path):
    store = Store(tmp_path / "store")
    hit = make_object(store, model_files(size=1 << 20))
    put(open_remote(remote_url), store, hit)
    for name, precious in (("empty", {}), ("full", {"model.safetensors": b"precious"})):
        victim = tmp_path / name
        victim.mkdir()
        for rel, data in precious.items():
            (victim / rel).write_bytes(data)
        out = tmp_path / f"out-{name}"
        out.symlink_to(victim, target_is_directory=True)
        before = snapshot(victim)
        one_line_error(cli("pull", "demo/q4km", "--from", remote_url, "-o", out), str(out), "symlink")
        assert snapshot(victim) == before and out.is_symlink()
        assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".out")] == []


# --- 6. writes never follow links --------------------------------------------------------------------------------
def test_tag_never_writes_through_a_linked_refs_folder(tmp_path):
    store = Store(tmp_path / "store")
    hit = make_object(store, model_files(size=4096))
    store.set_ref("demo", "q4km", "latest", hit.digest, hit.key)
    victim = tmp_path / "victim"
    (victim / "a").mkdir(parents=True)
    (victim / "a" / "latest").write_bytes(b"precious")
    (store.root / "refs" / "t").symlink_to(victim, target_is_directory=True)
    before = snapshot(victim)
    one_line_error(cli("tag", "demo/q4km", "t/a:latest", "--store", store.root), "refs")
    one_line_error(cli("tag", "demo/q4km", "t/b:latest", "--store", store.root), "refs")
    assert snapshot(victim) == before


def test_a_planted_staging_link_is_never_written_through(remote_url, tmp_path):
    store = Store(tmp_path / "store")
    hit = make_object(store, model_files(size=1 << 20))
    put(open_remote(remote_url), store, hit)
    victim = tmp_path / "victim"
    (victim / "parts").mkdir(parents=True)
    (victim / "model.safetensors").write_bytes(b"precious weights")
    (victim / "parts" / "x.part").write_bytes(b"precious part")
    out = tmp_path / "out"
    (tmp_path / f".out.partial-{hit.digest[:16]}").symlink_to(victim, target_is_directory=True)
    before = snapshot(victim)
    one_line_error(cli("pull", "demo/q4km", "--from", remote_url, "-o", out), f".out.partial-{hit.digest[:16]}")
    assert snapshot(victim) == before
    assert not out.exists() and not out.is_symlink()


def test_links_planted_inside_the_staging_folder_are_never_written_through(remote_url, tmp_path):
    store = Store(tmp_path / "store")
    hit = make_object(store, model_files(size=1 << 20))
    put(open_remote(remote_url), store, hit)
    from qbuild.artifacts.remote.base import part_name

    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "w").write_bytes(b"precious")
    staging = tmp_path / f".out.partial-{hit.digest[:16]}"
    (staging / "parts").mkdir(parents=True)
    entry = next(f for f in hit.record["files"] if f["path"] == "model.safetensors")
    (staging / "parts" / part_name(entry)).symlink_to(victim / "w")
    (staging / "tree").symlink_to(victim, target_is_directory=True)
    before = snapshot(victim)
    out = tmp_path / "out"
    ok(cli("pull", "demo/q4km", "--from", remote_url, "-o", out))
    assert snapshot(victim) == before
    same_files(hit.path, out)
    assert not out.is_symlink() and not staging.exists()


def test_a_pull_into_the_store_never_writes_through_a_linked_tmp(remote_url, tmp_path):
    """The store side of the same rule: the fetch's staging under tmp/ and the object folder are confined."""
    src = Store(tmp_path / "src")
    hit = make_object(src, model_files(size=1 << 20))
    put(open_remote(remote_url), src, hit)
    store = Store(tmp_path / "store")
    store.owned  # noqa: B018 (a real, marked store)
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "keep").write_bytes(b"precious")
    (store.root / "tmp").symlink_to(victim, target_is_directory=True)
    before = snapshot(victim)
    one_line_error(_materialize(remote_url, store.root, hit.digest), "tmp")
    assert snapshot(victim) == before


def _materialize(url: str, store_root: Path, digest: str) -> subprocess.CompletedProcess:
    code = ("import sys\nfrom qbuild.artifacts.remote import open_remote\nfrom qbuild.artifacts.remote.cache import "
            "materialize\nfrom qbuild.artifacts.store import Store\nfrom qbuild.errors import QBuildError\n"
            f"try:\n    materialize(Store({str(store_root)!r}), open_remote({url!r}), {digest!r})\n"
            "except QBuildError as exc:\n    print(f'qbuild: error: {exc}', file=sys.stderr); sys.exit(exc.exit_code)\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)


# --- 10. remote JSON is bounded as it is read, and one bad record fails alone ----------------------------------------
def _peak_rss_mib(args: list[str]) -> tuple[subprocess.CompletedProcess, float]:
    """Run the CLI in a child and return its peak RSS (ru_maxrss of the waited-for child, KiB on Linux)."""
    code = ("import resource, subprocess, sys\n"
            "res = subprocess.run(sys.argv[1:], capture_output=True, text=True)\n"
            "sys.stdout.write(res.stdout); sys.stderr.write(res.stderr)\n"
            "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, file=sys.stdout)\n"
            "sys.exit(res.returncode)\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    res = subprocess.run([sys.executable, "-c", code, sys.executable, "-m", "qbuild", *map(str, args)],
                         capture_output=True, text=True, env=env, timeout=300)
    *out, rss = res.stdout.splitlines()
    return subprocess.CompletedProcess(res.args, res.returncode, "\n".join(out), res.stderr), int(rss) / 1024


def test_an_oversized_manifest_is_refused_before_it_is_read(tmp_path):
    (tmp_path / "share").mkdir()
    url = f"file://{tmp_path / 'share' / 'qbuild'}"
    store = Store(tmp_path / "store")
    hit = make_object(store, model_files(size=4096))
    remote = open_remote(url)
    put(remote, store, hit)
    digest = "e" * 64
    huge = Path(remote._obj(digest, MANIFEST))
    huge.parent.mkdir(parents=True)
    with open(huge, "wb") as f:   # 400 MB of JSON whitespace (sparse: costs no disk)
        f.truncate(400 << 20)
    res, peak = _peak_rss_mib(["verify", "--remote", url])
    assert res.returncode == 1 and "Traceback" not in res.stderr, res.stderr
    assert f"DAMAGED {digest[:12]}" in res.stdout and "not a qbuild record" in res.stdout, res.stdout
    assert "2 object(s) checked, 1 damaged" in res.stdout    # the good object is still checked
    assert peak < 120, f"peak RSS {peak:.0f} MiB: the body was read before it was refused"


def test_one_bad_record_fails_alone(remote_url, tmp_path):
    store = Store(tmp_path / "store")
    good = make_object(store, model_files(size=4096, seed=1))
    remote = open_remote(remote_url)
    put(remote, store, good)
    bad = {"a" * 64: b"[" * 100_000 + b"]" * 100_000,                  # too deep
           "b" * 64: b"{not json",                                     # not JSON
           "c" * 64: b'{"files": [], "pad": "' + b"x" * (5 << 20) + b'"}'}   # larger than any record
    for digest, data in bad.items():
        plant(remote, f"objects/{digest[:2]}/{digest}/{MANIFEST}", data)
    plant(remote, f"actions/dd/{'d' * 64}.json", b"[" * 100_000)
    plant(remote, "refs/demo/q4km/broken", b"{")
    t0 = time.monotonic()
    res = cli("verify", "--remote", remote_url)
    took = time.monotonic() - t0
    assert res.returncode == 1 and "Traceback" not in res.stderr, res.stderr
    for digest in bad:
        assert f"DAMAGED {digest[:12]}" in res.stdout, res.stdout
    assert f"DAMAGED {good.digest[:12]}" not in res.stdout and "4 object(s) checked, 3 damaged" in res.stdout
    assert took < 60, took
    # listings skip a bad record (one warning naming it) and keep the good ones
    res = ok(cli("ls", "--remote", remote_url))
    assert "demo/q4km:latest" in res.stdout and "Traceback" not in res.stderr
    # a missing ref is "no ref", not the first bad manifest the machine-bound scan happens to read
    one_line_error(cli("pull", "demo/nope", "--from", remote_url, "-o", tmp_path / "out"), "no ref demo/nope")
    ok(cli("pull", "demo/q4km", "--from", remote_url, "-o", tmp_path / "out"))
    same_files(good.path, tmp_path / "out")


def test_a_large_record_is_parsed_or_refused_fast():
    from qbuild.artifacts.remote.base import MAX_JSON_BYTES, bounded_json

    record = b'{"digest": "' + b"a" * 64 + b'", "pad": "' + b"x" * (MAX_JSON_BYTES - 200) + b'"}'
    t0 = time.process_time()
    assert bounded_json(record, "record")["digest"] == "a" * 64
    nested = b"[" * 63 + b"1" + b"]" * 63
    assert bounded_json(b"[" + b",".join([nested] * 20_000) + b"]", "record")
    with pytest.raises(ValueError, match="more than"):
        bounded_json(record + b" " * 300, "record")
    # only a pathological (quadratic) parser fails this: 1.4 s of CPU alone, 6 s beside the full suite
    assert time.process_time() - t0 < 60
