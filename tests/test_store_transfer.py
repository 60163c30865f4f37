"""Pull and push read each file once (issue 33: they re-hashed the whole object, then copied it): the bytes are
hashed while they are copied or uploaded, and a file whose bytes are not its manifest's is never placed, on
disk or on a remote (file://, S3 through moto, an OCI registry). Bench: bench/bench_pull.py --backends local."""

from __future__ import annotations

import builtins
import hashlib
import os
from pathlib import Path

import pytest
from remote_common import make_object, model_files

from qbuild import api
from qbuild.artifacts.remote import RemoteError, open_remote
from qbuild.artifacts.store import Store
from qbuild.base.owned import ContentMismatch, output_root
from qbuild.errors import QBuildError

WEIGHTS = "model.safetensors"


def tamper_keeping_stat(path: Path) -> None:
    """Flip one byte of a stored file, same size and mtime: the stat-level check (the stamp) still says sound."""
    st = os.stat(path)
    os.chmod(path, 0o644)
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    os.chmod(path, 0o444)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


@pytest.fixture
def stored(tmp_path):
    store = Store(tmp_path / "store")
    return store, make_object(store, model_files())


def count_reads(monkeypatch, path: Path) -> list[str]:
    """The modes `path` is opened for reading in from now on (this process)."""
    opened: list[str] = []
    real_open = builtins.open

    def counting_open(file, mode="r", *args, **kwargs):
        if str(file) == str(path) and "r" in mode:
            opened.append(mode)
        return real_open(file, mode, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", counting_open)
    return opened


def test_a_local_pull_reads_each_file_once_and_copies_it_exactly(stored, tmp_path, monkeypatch):
    store, hit = stored
    opened = count_reads(monkeypatch, hit.path / WEIGHTS)
    digest, out = api.pull(hit.digest, store=store.root, out=tmp_path / "out")
    assert opened == ["rb"]   # the verify pass and the copy pass were two reads
    for f in store.manifest(hit.digest)["files"]:
        assert (out / f["path"]).read_bytes() == (hit.path / f["path"]).read_bytes()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "store"]   # no staging folder left


def test_a_damaged_file_is_never_placed_and_the_out_folder_never_appears(stored, tmp_path):
    store, hit = stored
    tamper_keeping_stat(hit.path / WEIGHTS)
    assert store.check_object(hit.digest) == []   # the stamp cannot see it: only the bytes can
    with pytest.raises(QBuildError, match=f"object {hit.digest[:12]} is damaged: content changed: {WEIGHTS}"):
        api.pull(hit.digest, store=store.root, out=tmp_path / "out")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["store"]   # neither the folder nor its staging


def test_force_into_a_folder_keeps_its_file_when_the_stored_one_is_damaged(stored, tmp_path):
    store, hit = stored
    out = tmp_path / "out"
    out.mkdir()
    (out / WEIGHTS).write_bytes(b"the user's previous weights")
    (out / "notes.txt").write_text("mine")
    tamper_keeping_stat(hit.path / WEIGHTS)
    with pytest.raises(QBuildError, match="content changed"):
        api.pull(hit.digest, store=store.root, out=out, force=True)
    assert (out / WEIGHTS).read_bytes() == b"the user's previous weights" and (out / "notes.txt").read_text() == "mine"
    assert not [p for p in out.rglob("*.tmp")]


def test_a_verified_copy_leaves_nothing_behind_on_a_mismatch(tmp_path):
    src = tmp_path / "src.bin"
    src.write_bytes(b"x" * 3_000_000)
    dest = tmp_path / "dest"
    dest.mkdir()
    root = output_root(dest)
    root.copy_in(src, dest / "ok.bin", sha256=hashlib.sha256(src.read_bytes()).hexdigest())
    assert (dest / "ok.bin").read_bytes() == src.read_bytes()
    with pytest.raises(ContentMismatch):
        root.copy_in(src, dest / "bad.bin", sha256="0" * 64)
    assert sorted(p.name for p in dest.iterdir()) == ["ok.bin"]


@pytest.mark.parametrize("backend", ["file", "s3", "oci"])
def test_a_push_of_a_damaged_file_uploads_nothing_of_it(backend, stored, tmp_path, request):
    store, hit = stored
    if backend == "file":
        url = f"file://{tmp_path / 'remote'}"
    else:
        url = request.getfixturevalue("s3_url" if backend == "s3" else "oci_url")
    tamper_keeping_stat(hit.path / WEIGHTS)
    remote = open_remote(url)
    with pytest.raises(RemoteError) as err:
        remote.put_object(hit.digest, hit.path, store.manifest(hit.digest))
    assert f"local file {WEIGHTS} does not match its manifest; not uploaded" in str(err.value)
    assert "\n" not in str(err.value)
    fresh = open_remote(url)
    assert not fresh.has_object(hit.digest) and fresh.get_manifest(hit.digest) is None
    if backend == "file":   # nothing of the bad file, not even a temporary name
        assert not [p for p in (tmp_path / "remote").rglob("*") if p.is_file() and WEIGHTS in p.name]


def test_a_push_then_pull_round_trip_reads_each_local_file_once(stored, tmp_path, monkeypatch):
    store, hit = stored
    url = f"file://{tmp_path / 'remote'}"
    reads = count_reads(monkeypatch, hit.path / WEIGHTS)
    result = api.push(hit.digest, url, store=store.root)
    assert result["uploaded"] and reads == ["rb"]
    digest, out = api.pull(hit.digest, remote=url, out=tmp_path / "pulled")
    assert (out / WEIGHTS).read_bytes() == (hit.path / WEIGHTS).read_bytes()


def test_a_pull_killed_with_9_leaves_a_staging_folder_the_next_pull_removes(tmp_path):
    """kill -9 during the copy: DIR never appears half-written, and the next pull into DIR removes the killed pull's
    staging folder. A live pull's folder and an unmarked folder of the same name pattern are kept."""
    import subprocess
    import sys

    from remote_common import run_child

    from qbuild.artifacts.store.export import HOST, staging_prefix

    store = Store(tmp_path / "store")
    hit = make_object(store, model_files(size=400 << 20))   # big enough to be killed while it is copied
    out = tmp_path / "out"
    prefix = staging_prefix(out)

    def copying() -> bool:
        return any(p.name.startswith(prefix) and any(p.iterdir()) for p in tmp_path.iterdir())

    killed = run_child(f"from qbuild import api; api.pull({hit.digest!r}, store={str(store.root)!r}, "
                       f"out={str(out)!r})", kill_when=copying)
    assert killed is None, "the pull ended before it could be killed"
    left = [p for p in tmp_path.iterdir() if p.name.startswith(prefix)]
    assert len(left) == 1 and not out.exists()
    with subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"]) as alive:
        live = tmp_path / f"{prefix}{HOST}-{alive.pid}-000000000000"   # a pull still running
        unmarked = tmp_path / f"{prefix}{HOST}-999999999-000000000000"   # matches, but not qbuild's
        for d in (live, unmarked):
            d.mkdir()
        (live / ".qbuild-root.json").write_text('{"kind": "pull staging folder"}')
        api.pull(hit.digest, store=store.root, out=out)
        alive.kill()
    assert not left[0].exists()
    assert live.is_dir() and unmarked.is_dir()
    assert not (out / ".qbuild-root.json").exists()
    assert (out / WEIGHTS).read_bytes() == (hit.path / WEIGHTS).read_bytes()
