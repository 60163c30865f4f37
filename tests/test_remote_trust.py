"""What a remote is trusted for, under concurrency and a peer that edits it (docs/remote-stores.md, issue 46):

- two pulls into one --out take turns, and what is placed is hashed from the file (item 5);
- a same-size damaged file on a remote is found by its content: verify reports it, push replaces it, a run builds
  the step here instead of failing (item 6);
- a pushed object's manifest.json (its provenance) is bound to the action records that name it: an edit is damage
  for verify and refused by pull; old records still bind their own manifest, old local stores keep working (item 7);
- an OCI tag list is bounded in total, not only per page (item 11).

Every test builds its own store, file:// remote or fake registry on 127.0.0.1 under tmp_path.
"""

from __future__ import annotations

import hashlib
import http.server
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from remote_common import REPO, make_object
from test_remote_hostile import cli, ok, one_line_error, put, same_files

from qbuild.artifacts.remote import open_remote
from qbuild.artifacts.remote.base import MANIFEST, RemoteError
from qbuild.artifacts.store import Store

from helpers import fake_recipe, write_recipe


def file_remote(tmp_path: Path) -> str:
    (tmp_path / "share").mkdir(parents=True, exist_ok=True)
    return f"file://{tmp_path / 'share' / 'qbuild'}"


def remote_file(url: str, digest: str, rel: str) -> Path:
    return Path(url.removeprefix("file://")) / "objects" / digest[:2] / digest / rel


def flip_byte(path: Path, at: int = 1000) -> None:
    """Damage a file in place, keeping its size (bit rot, a bad disk, a peer's edit)."""
    data = bytearray(path.read_bytes())
    data[at] ^= 0x01
    path.chmod(0o644)
    path.write_bytes(bytes(data))


def weights(size: int, seed: int) -> bytes:
    block = hashlib.sha256(b"trust-%d" % seed).digest() * 2048
    return (block * (size // len(block) + 1))[:size]


# --- 5. pulls into one --out take turns; what is placed is hashed from disk -----------------------------------------
SLOW_PULL = """
import os, sys, time
import qbuild.cli
from qbuild.artifacts.remote.fsspec_store import FsspecRemote
read = FsspecRemote._read_file
def slow(self, digest, entry, offset):   # a slow link: every pull of the pair is still downloading when the other starts
    for chunk in read(self, digest, entry, offset):
        time.sleep(0.05)
        yield chunk
FsspecRemote._read_file = slow
ready, go = sys.argv[1:3]
open(ready, "w").close()
while not os.path.exists(go):   # every pull starts at the same instant, once all have imported qbuild
    time.sleep(0.002)
sys.argv = ["qbuild", *sys.argv[3:]]
from qbuild.__main__ import main
main()
"""


def test_overlapping_pulls_into_one_out_place_only_verified_bytes(tmp_path):
    """6 pairs of pulls of a 40 MB object, each pair into one --out and started at the same instant: every pull that
    succeeds leaves exactly the object's bytes; one that does not says so in one line. Before pulls took turns, the
    second resumed the part the first was still writing and both placed a file longer than the object (exit 0)."""
    store = Store(tmp_path / "store")
    files = {"model.safetensors": weights(40 << 20, 1), "config.json": b'{"model_type": "llama"}'}
    hit = make_object(store, files)
    url = file_remote(tmp_path)
    put(open_remote(url), store, hit)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    (tmp_path / "sync").mkdir()
    go = tmp_path / "sync" / "go"
    procs = []
    for pair in range(6):
        out = tmp_path / f"out{pair}"
        for n in range(2):
            ready = tmp_path / "sync" / f"ready-{pair}-{n}"
            procs.append((out, subprocess.Popen([sys.executable, "-c", SLOW_PULL, str(ready), str(go), "pull",
                                                 "demo/q4km", "--from", url, "-o", str(out)], env=env, text=True,
                                                stdout=subprocess.PIPE, stderr=subprocess.PIPE)))
    deadline = time.time() + 60
    while len(list((tmp_path / "sync").glob("ready-*"))) < len(procs) and time.time() < deadline:
        time.sleep(0.01)
    go.touch()
    results = [(out, p, *p.communicate(timeout=120)) for out, p in procs]
    placed = 0
    for out, p, stdout, stderr in results:
        res = subprocess.CompletedProcess(p.args, p.returncode, stdout, stderr)
        if p.returncode == 0:
            placed += 1
            assert hit.digest in stdout
        else:
            one_line_error(res, str(out))
    assert placed >= 6   # at least one of each pair (the other waits for it, or finds --out filled)
    for pair in range(6):
        out = tmp_path / f"out{pair}"
        same_files(hit.path, out)
        assert json.loads((out / MANIFEST).read_text())["digest"] == hit.digest
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".out")) == []   # no staging, no lock left


# --- 6. a same-size damaged file on a remote is found by its content ------------------------------------------------
def test_verify_and_push_find_a_same_size_damaged_remote_file(tmp_path):
    """One byte flipped in a pushed model.safetensors, size kept: `verify --remote` names it (it hashes the remote's
    files by default; --quick sees sizes only), and `push` uploads it again instead of saying "already there"."""
    store = Store(tmp_path / "store")
    hit = make_object(store, {"model.safetensors": weights(3 << 20, 2), "config.json": b"{}"})
    url = file_remote(tmp_path)
    ok(cli("push", hit.digest, "--to", url, "--store", store.root))
    flip_byte(remote_file(url, hit.digest, "model.safetensors"))

    res = cli("verify", "--remote", url)
    assert res.returncode == 1, res.stdout + res.stderr
    assert f"DAMAGED {hit.digest[:12]}" in res.stdout and "content changed: model.safetensors" in res.stdout
    assert "1 damaged" in res.stdout
    assert "0 damaged" in ok(cli("verify", "--remote", url, "--quick")).stdout   # sizes only, as documented

    pushed = json.loads(ok(cli("push", hit.digest, "--to", url, "--store", store.root, "--json")).stdout)
    assert pushed["uploaded"]
    assert remote_file(url, hit.digest, "model.safetensors").read_bytes() == (hit.path / "model.safetensors").read_bytes()
    assert "0 damaged" in ok(cli("verify", "--remote", url)).stdout
    again = json.loads(ok(cli("push", hit.digest, "--to", url, "--store", store.root, "--json")).stdout)
    assert not again["uploaded"]   # sound now: already there


def _fake_recipe(tmp_path: Path, url: str) -> Path:
    data = fake_recipe(tmp_path, [{"name": "a", "method": "fake"}])
    data["store"] = {"remotes": [url]}
    return write_recipe(tmp_path / "r.yaml", data)


def _built_and_damaged(tmp_path: Path) -> tuple[Path, str, dict]:
    """Machine A builds the fake recipe and pushes it (on success) to a file:// remote; then one byte of the
    remote's copy of quantize[a] is flipped. (recipe, remote URL, A's record of quantize[a])."""
    url = file_remote(tmp_path)
    recipe = _fake_recipe(tmp_path, url)
    first = json.loads(ok(cli("run", recipe, "--store", tmp_path / "a", "--json")).stdout)
    step = next(s for s in first["steps"] if s["name"] == "quantize[a]")
    assert step["status"] == "built"
    record = Store(tmp_path / "a").lookup(step["key"]).record
    flip_byte(remote_file(url, step["digest"], "weights.bin"))
    return recipe, url, record


def test_a_run_builds_a_step_whose_remote_copy_is_damaged_and_repairs_the_remote(tmp_path):
    """Machine B (a fresh store) that must fetch quantize[a] finds the remote's copy damaged: one warning, the step is
    built here, the run exits 0 and its write-through replaces the damaged file, so the next machine hits again."""
    recipe, url, record = _built_and_damaged(tmp_path)
    res = cli("run", recipe, "--store", tmp_path / "b", "--materialize", "--json")
    summary = json.loads(ok(res).stdout)
    steps = {s["name"]: s for s in summary["steps"]}
    assert steps["quantize[a]"]["status"] == "built" and summary["counts"]["failed"] == 0
    warned = [line for line in res.stderr.splitlines() if record["digest"][:12] in line]
    assert len(warned) == 1 and "weights.bin is corrupt" in warned[0] and "building quantize[a] here" in warned[0]
    assert "0 damaged" in ok(cli("verify", "--remote", url)).stdout
    third = json.loads(ok(cli("run", recipe, "--store", tmp_path / "c", "--materialize", "--json")).stdout)
    assert {s["name"]: s["status"] for s in third["steps"]}["quantize[a]"] == "cached"


def test_a_step_that_reads_a_damaged_remote_input_builds_the_input(tmp_path):
    """The read-through of a step that must run (Executor.fetch_input): the input's remote copy fails verification,
    so the input is built here with the reading step's claim, and its outcome becomes a local build."""
    from qbuild import api
    from qbuild.contract.step import Outcome, PlanStatus
    from qbuild.pipeline.budget import Claim
    from qbuild.pipeline.executor import Executor

    recipe, url, record = _built_and_damaged(tmp_path)
    store_b = Store(tmp_path / "b")
    plan = api.plan(recipe, store=store_b, estimate=False)
    quant = next(p for p in plan.steps if p.step.name == "quantize[a]")
    assert quant.status == PlanStatus.REMOTE_HIT
    ex = Executor(store_b, "test-run", {}, remotes=plan.remotes)
    ex.warm_workers = False
    outcomes: dict = {}
    for p in plan.steps:   # the model (a source) and quantize[a] (a remote hit, not fetched)
        outcomes[p.step.key] = ex._resolve_without_building(p, [outcomes[s.key] for s in p.step.prerequisites()])
    fetched = outcomes[quant.step.key]
    assert fetched.status == Outcome.CACHED and fetched.path is None
    ex.fetch_input(fetched, outcomes, None, Claim(cpus=1, memory_mb=0, gpu=None, alone=False))
    assert fetched.status == Outcome.BUILT and fetched.remote is None
    assert (fetched.path / "weights.bin").read_bytes() == (Store(tmp_path / "a").object_dir(record["digest"])
                                                          / "weights.bin").read_bytes()
    assert plan.remotes[0].damaged == {record["digest"]: {"weights.bin"}}   # the run's push replaces it


# --- 7. a pushed object's provenance is bound ---------------------------------------------------------------------
FORGED = {"metrics": {"ppl": 1.01}, "recipe": {"name": "forged", "sha256": "f" * 64}, "variant": "best",
          "params": {"method": "gguf", "type": "Q8_0"}}


def _forge(url: str, digest: str, **fields) -> dict:
    path = remote_file(url, digest, MANIFEST)
    manifest = {**json.loads(path.read_text()), **(fields or FORGED)}
    path.write_text(json.dumps(manifest, indent=2, sort_keys=True))
    return manifest


def test_an_edited_manifest_is_damage_and_is_never_pulled(tmp_path):
    """A peer edits a pushed object's manifest.json (files untouched, so the digest still holds): verify names the
    object and the changed fields (even --quick, which downloads nothing), pull refuses it by ref and by digest in
    one line and places nothing, and push puts the real manifest back."""
    store = Store(tmp_path / "store")
    hit = make_object(store, {"model.safetensors": weights(1 << 20, 3), "config.json": b"{}"},
                      metrics={"ppl": 9.5})
    url = file_remote(tmp_path)
    ok(cli("push", hit.digest, "--to", url, "--store", store.root))
    open_remote(url).set_ref("demo", "q4km", "latest", hit.digest, hit.key)
    _forge(url, hit.digest)

    for args in ((), ("--quick",)):
        res = cli("verify", "--remote", url, *args)
        assert res.returncode == 1, res.stdout + res.stderr
        line = next(x for x in res.stdout.splitlines() if x.startswith("DAMAGED"))
        assert hit.digest[:12] in line and "provenance changed" in line
        assert all(f in line for f in ("metrics", "params", "recipe", "variant"))
    for name in ("demo/q4km", hit.digest):
        out = tmp_path / "out"
        one_line_error(cli("pull", name, "--from", url, "-o", out), hit.digest[:12], "provenance changed")
        assert not out.exists() and not list(tmp_path.glob(".out*"))

    assert json.loads(ok(cli("push", hit.digest, "--to", url, "--store", store.root, "--json")).stdout)["uploaded"]
    assert "0 damaged" in ok(cli("verify", "--remote", url)).stdout
    ok(cli("pull", "demo/q4km", "--from", url, "-o", tmp_path / "out"))
    assert json.loads((tmp_path / "out" / MANIFEST).read_text()) == store.manifest(hit.digest)


def test_old_records_still_bind_their_manifest_and_unbound_objects_are_said_so(tmp_path):
    """Pushed by a qbuild before manifest_digest: the action record is still the manifest of the step that made the
    object, so an edit is caught the same way. An object no record names is unbound: verify passes it and says so,
    pull places it with one warning. An old local store (records without the field) keeps hitting and pushing."""
    store = Store(tmp_path / "store")
    old = make_object(store, {"w.bin": weights(1 << 16, 4)})
    loose = make_object(store, {"w.bin": weights(1 << 16, 5)})
    for hit in (old, loose):   # an old store: its records have no manifest_digest
        record = {k: v for k, v in hit.record.items() if k != "manifest_digest"}
        store.write_json(store._action_file(hit.key), record)
        assert store.lookup(hit.key).digest == hit.digest
    url = file_remote(tmp_path)
    remote = open_remote(url)
    remote.put_object(old.digest, old.path, store.manifest(old.digest))
    remote.put_action(old.key, store.lookup(old.key).record)       # as an old qbuild pushed it
    remote.put_object(loose.digest, loose.path, store.manifest(loose.digest))   # no action record names it

    res = ok(cli("verify", "--remote", url))
    assert "0 damaged" in res.stdout and "1 with unbound provenance" in res.stdout
    _forge(url, old.digest, metrics={"ppl": 1.0})
    res = cli("verify", "--remote", url)
    assert res.returncode == 1 and f"DAMAGED {old.digest[:12]}" in res.stdout and "(metrics changed)" in res.stdout
    one_line_error(cli("pull", old.digest, "--from", url, "-o", tmp_path / "o1"), "provenance changed")

    pulled = ok(cli("pull", loose.digest, "--from", url, "-o", tmp_path / "o2"))
    assert [line for line in pulled.stderr.splitlines() if "no action record here commits" in line]
    same_files(loose.path, tmp_path / "o2")

    # the old store pushes through the current qbuild: the remote's record now carries the binding
    other = file_remote(tmp_path / "second")
    ok(cli("push", loose.digest, "--to", other, "--store", store.root))
    assert open_remote(other).get_action(loose.key)["manifest_digest"]
    assert "unbound" not in ok(cli("verify", "--remote", other)).stdout


def test_an_edited_manifest_on_a_registry_is_refused(oci_url, tmp_path):
    """The same on an OCI registry: the peer pushes another manifest.json layer and re-tags the object with it."""
    from qbuild.artifacts.remote.oci import DOC, OBJ_TAG, ROLE, TITLE

    store = Store(tmp_path / "store")
    hit = make_object(store, {"model.safetensors": weights(1 << 18, int.from_bytes(os.urandom(4), "little"))})
    remote = open_remote(oci_url)
    put(remote, store, hit)
    oci, _ = remote._get_oci_manifest(OBJ_TAG + hit.digest)
    forged = {**store.manifest(hit.digest), **FORGED}
    layer = remote._push_bytes(json.dumps(forged).encode(), DOC, {TITLE: MANIFEST, ROLE: "manifest"})
    oci["layers"] = [layer if (la.get("annotations") or {}).get(ROLE) == "manifest" else la for la in oci["layers"]]
    remote._put_oci_manifest(OBJ_TAG + hit.digest, oci)

    rows = open_remote(oci_url).verify()
    assert not rows[0]["ok"] and "provenance changed" in rows[0]["problems"][0]
    with pytest.raises(RemoteError, match="provenance changed"):
        open_remote(oci_url).fetch_object(hit.digest, tmp_path / "out")
    assert not (tmp_path / "out").exists()


# --- 11. an OCI tag list is bounded in total ------------------------------------------------------------------------
class EndlessTags(http.server.BaseHTTPRequestHandler):
    """A registry whose every tag page is under the per-page bound and links to the next one, up to `pages`."""

    pages = 200
    page_bytes = 1 << 20
    delay = 0.0
    served = 0

    def do_GET(self):
        path = self.path.split("?")[0]
        if path == "/v2/":
            return self._send(200, b"{}")
        if not path.endswith("/tags/list"):
            return self._send(404, b'{"errors": [{"code": "MANIFEST_UNKNOWN", "message": "unknown"}]}')
        type(self).served += 1
        page = type(self).served
        time.sleep(self.delay)
        count = max(1, self.page_bytes // 72)
        tags = [f"_obj-{hashlib.sha256(b'%d-%d' % (page, i)).hexdigest()}" for i in range(count)]
        headers = {} if page >= self.pages else {"Link": f'<{path}?n=1000&last={tags[-1]}>; rel="next"'}
        return self._send(200, json.dumps({"name": "endless/repo", "tags": tags}).encode(), headers)

    do_HEAD = do_GET

    def _send(self, code: int, body: bytes, headers: dict | None = None) -> None:
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture
def endless_registry():
    pytest.importorskip("oras", reason="oras is not installed (pip install 'qbuild[oci]')")
    handler = type("Handler", (EndlessTags,), {"served": 0})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield handler, f"oci://127.0.0.1:{server.server_address[1]}/endless/repo"
    finally:
        server.shutdown()
        server.server_close()


MEASURED = """
import atexit, os, sys
def peak():   # VmHWM: this process's own peak RSS (ru_maxrss of a child also counts the pages it forked from)
    with open("/proc/self/status") as f:
        hwm = next(line for line in f if line.startswith("VmHWM:"))
    with open(os.environ["PEAK_FILE"], "w") as out:
        out.write(hwm.split()[1])
atexit.register(peak)
sys.argv = ["qbuild", *sys.argv[1:]]
from qbuild.__main__ import main
main()
"""


def _run_measured(args: list[str], env: dict, peak_file: Path) -> tuple[subprocess.CompletedProcess, float, float]:
    """(result, seconds, peak RSS in MiB) of the command line `qbuild ARGS` in a child."""
    t0 = time.monotonic()
    res = subprocess.run([sys.executable, "-c", MEASURED, *args], env={**env, "PEAK_FILE": str(peak_file)},
                         capture_output=True, text=True, timeout=300)
    return res, time.monotonic() - t0, int(peak_file.read_text()) / 1024


def test_an_endless_tag_list_stops_fast_with_bounded_memory(endless_registry, tmp_path):
    """`ls --remote` and a pull of a name that is not there read a tag list whose 1 MiB pages link on (200 of them
    here, 200 MiB): both stop at the total bound in one line naming the remote, in seconds and with bounded memory.
    Before, every page was read and kept (10,000 pages: 1.6 GB in 45 s)."""
    handler, url = endless_registry
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
           "DOCKER_CONFIG": str(tmp_path / "no-docker-config")}
    env.pop("QBUILD_REGISTRY_USERNAME", None)
    for args in (["ls", "--remote", url], ["pull", "demo/absent", "--from", url, "-o", str(tmp_path / "out")]):
        handler.served = 0
        res, seconds, peak_mib = _run_measured(args, env, tmp_path / "peak")
        line = one_line_error(res, url, "tag list")
        assert "stopped reading" in line
        assert handler.served < 60 and seconds < 30 and peak_mib < 250, (handler.served, seconds, peak_mib)


def test_a_slow_endless_tag_list_stops_at_its_time_bound(endless_registry, monkeypatch):
    from qbuild.artifacts.remote import oci

    handler, url = endless_registry
    handler.pages, handler.page_bytes, handler.delay = 10**6, 100, 0.05
    monkeypatch.setattr(oci, "TAG_LIST_SECONDS", 1.0)
    monkeypatch.setenv("DOCKER_CONFIG", "/nonexistent")
    t0 = time.monotonic()
    with pytest.raises(RemoteError, match=r"tag list goes on past 1 s") as exc:
        open_remote(url).list_objects()
    assert time.monotonic() - t0 < 5 and url in str(exc.value)
