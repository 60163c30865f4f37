"""The remote-store contract on every backend (file://, S3 through moto, an OCI registry): round trip,
commit ordering under kill -9, resume, corruption, unsafe manifests, gc, a shared remote cache."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest
from remote_common import make_object, model_files, run_child

from qbuild import api
from qbuild.artifacts.remote import RemoteError, cache, open_remote
from qbuild.artifacts.remote.base import part_name
from qbuild.artifacts.remote.gc import gc_remote, parse_age, plan_gc, plan_store_gc
from qbuild.artifacts.store import Store
from qbuild.base.hashing import tree_digest
from qbuild.errors import UserError

BACKENDS = ["file", "s3", "oci"]


@pytest.fixture(params=BACKENDS)
def remote_url(request, tmp_path):
    if request.param == "file":
        (tmp_path / "share").mkdir()
        return f"file://{tmp_path / 'share' / 'qbuild'}"
    return request.getfixturevalue("s3_url" if request.param == "s3" else "oci_url")


def _check_same(obj_dir: Path, manifest: dict, out: Path) -> None:
    for f in manifest["files"]:
        data = (out / f["path"]).read_bytes()
        assert hashlib.sha256(data).hexdigest() == f["sha256"] and data == (obj_dir / f["path"]).read_bytes()
    assert json.loads((out / "manifest.json").read_text())["digest"] == manifest["digest"]


def test_round_trip(remote_url, tmp_path):
    store = Store(tmp_path / "a")
    hit = make_object(store, model_files())
    remote = open_remote(remote_url, name="shared")
    remote.check()
    assert remote.get_action(hit.key) is None and not remote.has_object(hit.digest)
    seen = []
    remote.put_object(hit.digest, hit.path, store.manifest(hit.digest), progress=lambda d, t: seen.append((d, t)),
                      sidecars={"README.md": b"# card"})
    assert seen[-1][0] == seen[-1][1] == sum(f["size"] for f in store.manifest(hit.digest)["files"])
    remote.put_action(hit.key, hit.record)
    remote.set_ref("demo", "q4km", "latest", hit.digest, hit.key)
    # a second machine: a fresh client, an empty directory
    other = open_remote(remote_url)
    assert other.get_action(hit.key)["digest"] == hit.digest and other.has_object(hit.digest)
    assert other.get_ref("demo", "q4km")["digest"] == hit.digest and other.get_ref("demo", "nope") is None
    assert [r["ref"] for r in other.list_refs()] == ["demo/q4km:latest"]
    assert other.list_objects() == [hit.digest] and list(other.list_actions()) == [(hit.key, hit.digest)]
    assert other.get_sidecar(hit.digest, "README.md") == b"# card" and other.get_sidecar(hit.digest, "x.json") is None
    out = tmp_path / "b" / "pulled"
    manifest = other.fetch_object(hit.digest, out, jobs=3)
    _check_same(hit.path, manifest, out)
    assert not list(out.parent.glob(".*partial*"))
    # pushing again uploads nothing; fetching again downloads nothing
    again = open_remote(remote_url)
    again.put_object(hit.digest, hit.path, store.manifest(hit.digest))
    again.fetch_object(hit.digest, out)
    assert again.stats["bytes_up"] == 0 and again.stats["bytes_down"] == 0


PUSH_CHILD = """
import json, os, sys, time
from pathlib import Path
from qbuild.artifacts.remote import open_remote
from qbuild.artifacts.store import Store
store = Store(Path(sys.argv[1] if len(sys.argv) > 1 else {store!r}))
remote = open_remote({url!r}, jobs=1)
manifest = store.manifest({digest!r})
def progress(done, total):
    Path({marker!r}).write_text(str(done))
    time.sleep(0.3)
remote.put_object({digest!r}, store.object_dir({digest!r}), manifest, progress=progress)
remote.put_action({key!r}, {{"digest": {digest!r}}})
print("pushed")
"""


def _big_object(store: Store, n: int = 4, size: int = 2 << 20):
    files = {f"model-{i:05d}-of-{n:05d}.safetensors": os.urandom(size) for i in range(n)}
    files["config.json"] = b"{}"
    return make_object(store, files)


def test_kill9_during_push_leaves_no_action_record_and_resumes(remote_url, tmp_path):
    store = Store(tmp_path / "a")
    hit = _big_object(store)
    marker = tmp_path / "progress"
    total = sum(f["size"] for f in store.manifest(hit.digest)["files"])

    def half_done():
        try:
            return int(marker.read_text() or 0) >= total // 2
        except (OSError, ValueError):
            return False

    code = PUSH_CHILD.format(store=str(store.root), url=remote_url, digest=hit.digest, marker=str(marker), key=hit.key)
    assert run_child(code, kill_when=half_done) is None, "the push finished before it could be killed"
    remote = open_remote(remote_url)
    assert remote.get_action(hit.key) is None and not remote.has_object(hit.digest)
    assert remote.list_objects() == [] and remote.get_manifest(hit.digest) is None
    # the next run finishes the upload, skipping the files that made it
    remote.put_object(hit.digest, hit.path, store.manifest(hit.digest))
    remote.put_action(hit.key, hit.record)
    assert remote.stats["files_skipped"] >= 1 and remote.stats["bytes_up"] < total
    assert remote.get_action(hit.key)["digest"] == hit.digest
    out = tmp_path / "check"
    _check_same(hit.path, remote.fetch_object(hit.digest, out), out)


FETCH_CHILD = """
import time
from pathlib import Path
from qbuild.artifacts.remote import open_remote
remote = open_remote({url!r}, jobs=1)
read = remote._read_file
def slow(*args):
    for chunk in read(*args):
        for i in range(0, len(chunk), 1 << 20):
            time.sleep(0.3)  # a slow link, so the test can kill it mid-file
            yield chunk[i:i + (1 << 20)]
remote._read_file = slow
remote.fetch_object({digest!r}, Path({out!r}))
print("fetched")
"""


def test_kill9_during_fetch_places_nothing_and_resumes(remote_url, tmp_path):
    store = Store(tmp_path / "a")
    hit = _big_object(store, n=3, size=3 << 20)
    remote = open_remote(remote_url)
    remote.put_object(hit.digest, hit.path, store.manifest(hit.digest))
    out = tmp_path / "b" / "model"
    staging = out.with_name(f".model.partial-{hit.digest[:16]}")
    files = store.manifest(hit.digest)["files"]

    def staged() -> dict[str, int]:   # manifest path -> bytes in its part (parts/ is named by the hash of the path)
        sizes = {}
        for f in files:
            try:
                sizes[f["path"]] = (staging / "parts" / part_name(f)).stat().st_size
            except OSError:
                pass
        return sizes

    def one_verified_and_one_partial():
        sizes = {f["path"]: f["size"] for f in files}
        done = [p for p, n in staged().items() if p.endswith(".safetensors") and n == sizes[p]]
        return bool(done) and any(0 < n < sizes[p] for p, n in staged().items())

    code = FETCH_CHILD.format(url=remote_url, digest=hit.digest, out=str(out))
    assert run_child(code, kill_when=one_verified_and_one_partial) is None
    assert not out.exists(), "a killed fetch must place nothing at the destination"
    sizes = {f["path"]: f["size"] for f in files}
    verified = {p for p, n in staged().items() if n == sizes[p]}
    partial = sum(n for p, n in staged().items() if n < sizes[p])
    assert verified and partial > 0
    resumed = open_remote(remote_url)
    manifest = resumed.fetch_object(hit.digest, out)
    _check_same(hit.path, manifest, out)
    total = sum(f["size"] for f in manifest["files"])
    # verified files are not downloaded again, and the part resumes where it stopped
    assert resumed.stats["bytes_down"] <= total - sum(sizes[v] for v in verified) - partial
    assert not staging.exists()


def _tamper_blob(remote, remote_url: str, hit, rel: str, registry=None) -> None:
    f = next(x for x in hit.record["files"] if x["path"] == rel)
    bad = bytearray((hit.path / rel).read_bytes())
    bad[len(bad) // 2] ^= 0xFF
    if remote_url.startswith("oci://"):
        blob = registry["data"] / "docker/registry/v2/blobs/sha256" / f["sha256"][:2] / f["sha256"] / "data"
        blob.chmod(0o644)
        blob.write_bytes(bytes(bad))
    else:
        remote.fs.pipe_file(remote._obj(hit.digest, rel), bytes(bad))


def test_corrupted_remote_blob_is_detected(remote_url, tmp_path, request):
    store = Store(tmp_path / "a")
    hit = make_object(store, model_files(seed=int.from_bytes(os.urandom(4), "little")))  # registry blobs are shared
    remote = open_remote(remote_url)
    remote.put_object(hit.digest, hit.path, store.manifest(hit.digest))
    reg = request.getfixturevalue("registry") if remote_url.startswith("oci://") else None
    _tamper_blob(remote, remote_url, hit, "model.safetensors", reg)
    out = tmp_path / "b" / "model"
    with pytest.raises(RemoteError) as exc:
        open_remote(remote_url).fetch_object(hit.digest, out)
    msg = str(exc.value)
    assert "\n" not in msg and remote.display in msg and "model.safetensors is corrupt" in msg
    assert not out.exists()
    # `qbuild verify --remote`: the quick check sees sizes only; the deep one hashes every file
    assert remote.verify()[0]["ok"]
    assert remote.verify(deep=True) == [{"digest": hit.digest, "kind": "quantize", "ok": False,
                                         "problems": ["content changed: model.safetensors"], "provenance": "unbound"}]


def _plant_manifest(remote, remote_url: str, files: list[dict]) -> str:
    """A hostile remote: a manifest whose digest is right but whose paths are not."""
    digest = tree_digest(files)
    manifest = {"digest": digest, "key": "0" * 64, "files": files}
    if remote_url.startswith("oci://"):
        from qbuild.artifacts.remote.oci import DOC, MODEL_ARTIFACT, MODEL_CONFIG, OBJ_TAG, OCI_MANIFEST, ROLE, TITLE

        layer = remote._push_bytes(json.dumps(manifest).encode(), DOC, {TITLE: "manifest.json", ROLE: "manifest"})
        cfg = remote._push_bytes(b'{"descriptor": {}, "config": {}, "modelfs": {"type": "layers", "diff_ids": []}}',
                                 MODEL_CONFIG)
        remote._put_oci_manifest(OBJ_TAG + digest, {"schemaVersion": 2, "mediaType": OCI_MANIFEST,
                                                    "artifactType": MODEL_ARTIFACT, "config": cfg, "layers": [layer],
                                                    "annotations": {"org.qbuild.digest": digest}})
    else:
        remote._write_bytes(remote._obj(digest, "manifest.json"), json.dumps(manifest).encode())
    return digest


@pytest.mark.parametrize("entry,why", [
    ({"path": "../evil.txt"}, "unsafe path"),
    ({"path": "a/../../evil.txt"}, "unsafe path"),
    ({"path": "/tmp/evil.txt"}, "unsafe path"),
    ({"path": "link", "type": "symlink", "target": "/etc/passwd"}, "not a regular file"),
])
def test_hostile_manifest_is_refused(remote_url, tmp_path, entry, why):
    remote = open_remote(remote_url)
    remote.check()
    files = [{"size": 5, "sha256": hashlib.sha256(b"pwned").hexdigest(), **entry}]
    digest = _plant_manifest(remote, remote_url, files)
    out = tmp_path / "deep" / "b" / "out"
    with pytest.raises(RemoteError, match=why) as exc:
        open_remote(remote_url).fetch_object(digest, out)
    assert "\n" not in str(exc.value)
    assert not out.exists() and not (tmp_path / "deep" / "evil.txt").exists() and not (tmp_path / "evil.txt").exists()


def test_gc_keeps_refs_aliases_and_dependencies(remote_url, tmp_path):
    store = Store(tmp_path / "a")
    remote = open_remote(remote_url)
    base = make_object(store, {"model.safetensors": b"base" * 1000}, kind="model", name="import")
    quant = make_object(store, {"model.gguf": b"quant" * 1000}, name="gguf[q4km]",
                        inputs={"model": {"key": base.key, "digest": base.digest, "step": "import"}})
    aliased = make_object(store, {"model.gguf": b"aliased" * 1000}, name="gguf[q8]")
    orphan = make_object(store, {"model.gguf": b"orphan" * 1000}, name="gguf[old]")
    for h in (base, quant, aliased, orphan):
        cache.push_hit(remote, store, h.key, h.digest, h.record)
    remote.set_ref("demo", "q4km", "latest", quant.digest, quant.key)
    dry = gc_remote(remote, extra_roots=[aliased.digest], dry_run=True)
    assert [r["digest"] for r in dry] == [orphan.digest] and dry[0]["bytes"] == 6000
    assert orphan.digest in remote.list_objects()
    rows = gc_remote(remote, extra_roots=[aliased.digest])
    assert [r["digest"] for r in rows] == [orphan.digest]
    assert sorted(remote.list_objects()) == sorted([base.digest, quant.digest, aliased.digest])
    assert remote.get_action(orphan.key) is None and remote.get_action(base.key)["digest"] == base.digest
    assert gc_remote(remote, extra_roots=[aliased.digest]) == []
    # the same planning for the local store
    store.set_ref("demo", "q4km", "latest", quant.digest, quant.key)
    assert [r["digest"] for r in plan_store_gc(store, extra_roots=[aliased.digest])] == [orphan.digest]


def test_push_policies():
    assert [cache.should_push(open_remote("file:///tmp/x", push=p), "step") for p in ("always", "on-success", "never")] \
        == [True, False, False]
    assert [cache.should_push(open_remote("file:///tmp/x", push=p), "success") for p in ("always", "on-success", "never")] \
        == [True, True, False]


def test_plan_gc_keep_last_and_age():
    ms = {f"{i:064x}": {"name": "q", "recipe": {"name": "r"}, "created": f"2026-01-{i + 1:02d}T00:00:00Z",
                        "inputs": {"m": {"digest": "f" * 64}} if i == 2 else {}} for i in range(3)}
    ms["f" * 64] = {"name": "import", "created": "2025-01-01T00:00:00Z"}
    keep, remove = plan_gc(ms, roots=[], keep_last=1)
    assert f"{2:064x}" in keep and "f" * 64 in keep and remove == [f"{0:064x}", f"{1:064x}"]
    now = 1767225600 + 2.5 * 86400  # 2026-01-03T12:00Z
    keep, remove = plan_gc(ms, roots=[], older_than=parse_age("2d"), now=now)
    assert remove == [f"{0:064x}"]
    with pytest.raises(UserError, match="30d"):
        parse_age("thirty days")


def test_two_machines_share_one_remote(remote_url, tmp_path):
    """Machine A builds and pushes; machine B, with an empty local store, finds every step in the remote,
    downloads only action records and small objects (metrics), and no weights."""
    a = Store(tmp_path / "machine-a")
    base = make_object(a, model_files(4 << 20, seed=1), kind="model", name="import")
    quant = make_object(a, {"model.gguf": os.urandom(3 << 20)}, name="gguf[q4km]",
                        inputs={"model": {"key": base.key, "digest": base.digest, "step": "import"}})
    evals = make_object(a, {"metrics.json": b'{"ppl": 19.08}'}, kind="eval", name="eval[q4km]",
                        inputs={"model": {"key": quant.key, "digest": quant.digest, "step": "gguf[q4km]"}})
    remote_a = open_remote(remote_url)
    for h in (base, quant, evals):
        assert cache.push_hit(remote_a, a, h.key, h.digest, h.record, refs=[("demo", h.record["name"].replace("[", "-")
                                                                              .rstrip("]"), "latest")])
    # nothing left to do: the next run neither uploads nor renders/signs sidecars again
    assert not cache.push_hit(remote_a, a, quant.key, quant.digest, quant.record,
                              sidecars=lambda: pytest.fail("sidecars built for an artifact the remote has"))

    b = Store(tmp_path / "machine-b")
    remote_b = open_remote(remote_url, name="team-cache")
    hits = {}
    for h in (base, quant, evals):
        assert b.lookup(h.key) is None
        hits[h.key] = cache.lookup([remote_b], h.key)
        assert hits[h.key].digest == h.digest and hits[h.key].where == "remote team-cache"
    assert remote_b.stats["bytes_down"] == 0  # planning read only action records
    small = [hit for hit in hits.values() if remote_b.object_size(hit.digest) < 64 << 10]
    assert [s.digest for s in small] == [evals.digest]
    for hit in small:
        cache.materialize(b, hit.remote, hit.digest, hit.key, hit.record)
    assert b.lookup(evals.key).digest == evals.digest and b.lookup(quant.key) is None
    assert json.loads((b.object_dir(evals.digest) / "metrics.json").read_text()) == {"ppl": 19.08}
    assert remote_b.stats["bytes_down"] == len(b'{"ppl": 19.08}')
    assert b.verify()[0]["ok"]
    # --materialize (or a step that must run) brings the weights, verified, into the local store
    cache.materialize(b, remote_b, quant.digest, quant.key, quant.record)
    assert b.lookup(quant.key).digest == quant.digest and all(r["ok"] for r in b.verify())


def test_resolve_and_pull_by_ref(remote_url, tmp_path):
    store = Store(tmp_path / "a")
    hit = make_object(store, model_files())
    remote = open_remote(remote_url)
    cache.push_hit(remote, store, hit.key, hit.digest, hit.record, sidecars={"README.md": b"# card"},
                   refs=[("demo", "q4km", "v1")])
    assert cache.resolve(remote, "demo/q4km:v1") == hit.digest
    assert cache.resolve(remote, "sha256:" + hit.digest) == hit.digest
    with pytest.raises(RemoteError, match="no ref demo/q4km:latest"):
        cache.resolve(remote, "demo/q4km")
    out = tmp_path / "out"
    cache.pull(remote, "demo/q4km:v1", out)
    cache.write_sidecars(remote, hit.digest, out, ["README.md", "signature.sig"])
    assert (out / "README.md").read_text() == "# card" and not (out / ".qbuild").exists()
    _check_same(hit.path, store.manifest(hit.digest), out)


def _engine(store: Store, sm: str, created: str):
    from qbuild.envs import tensorrt_llm as trtllm_env
    from qbuild.targets.tensorrt_llm import ENGINE_KIND

    gpu = {"9.0": "NVIDIA H100 80GB HBM3", "8.9": "NVIDIA L4"}[sm]
    return make_object(store, {"rank0.engine": f"engine for sm{sm}".encode(), "config.json": b"{}"},
                       kind=ENGINE_KIND, name="engine[fp8.trtllm]", variant="fp8.trtllm", format="trtllm-engine",
                       toolchain={"gpu.sm": sm, "gpu.name": gpu, "host.arch": trtllm_env.host_arch(),
                                  "tensorrt_llm": "1.2.1", "tensorrt": "10.13.3.9", "cuda": "13.0"},
                       info={"gpu": {"name": gpu}}, recipe={"name": "trt", "path": "/r/trt.yaml"},
                       created=created)


def test_pull_picks_the_engine_for_this_gpu(remote_url, tmp_path, monkeypatch):
    from qbuild.envs import tensorrt_llm as trtllm_env
    from qbuild.targets.trtllm_select import local_needs

    store = Store(tmp_path / "a")
    h100, l4 = _engine(store, "9.0", "2026-01-01T00:00:00Z"), _engine(store, "8.9", "2026-01-02T00:00:00Z")
    remote = open_remote(remote_url)
    for h in (h100, l4):
        cache.push_hit(remote, store, h.key, h.digest, h.record)
    remote.set_ref("trt", "fp8.trtllm", "latest", l4.digest, l4.key)  # the newest build (L4)
    monkeypatch.setenv(trtllm_env.FAKE_GPU, "NVIDIA H100 80GB HBM3:9.0:550.54.15")
    monkeypatch.setenv(trtllm_env.FAKE_TRTLLM, "1.2.1:10.13.3.9:13.0")
    digest, _ = api.pull("trt/fp8.trtllm", remote=remote, out=tmp_path / "out", need=local_needs())
    assert digest == h100.digest and (tmp_path / "out" / "rank0.engine").read_text() == "engine for sm9.0"
    monkeypatch.setenv(trtllm_env.FAKE_GPU, "NVIDIA B200:10.0:570.00")
    with pytest.raises(UserError) as exc:
        api.pull("trt/fp8.trtllm", remote=remote, out=tmp_path / "out2")   # this machine's facts, probed
    msg = str(exc.value)
    assert "needs: SM 10.0" in msg and "SM 9.0" in msg and "SM 8.9" in msg and remote.display in msg
    assert not (tmp_path / "out2").exists()
