"""OCI remotes against registries that answer badly, through the CLI: refs that once shared a tag (a real
registry), and hostile manifests, oversized answers and endless bodies (a small fake registry on 127.0.0.1 that
this file starts and stops). Each failure is one line naming the object or field, never a traceback; one bad
record fails alone."""

from __future__ import annotations

import hashlib
import json
import re
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from remote_common import make_object, model_files

from qbuild.artifacts.remote import open_remote
from qbuild.artifacts.remote.base import MAX_JSON_BYTES
from qbuild.artifacts.remote.oci import (
    ACTION_ARTIFACT,
    DOC,
    MODEL_ARTIFACT,
    OCI_MANIFEST,
    ROLE,
    TITLE,
    oci_tag,
)
from qbuild.artifacts.store import Store

from helpers import fake_recipe, qbuild, write_recipe

pytest.importorskip("oras", reason="oras is not installed (pip install 'qbuild[oci]')")
OCI_TAG_GRAMMAR = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9._-]{0,127}$")


def _ok(res):
    assert res.returncode == 0, res.stderr[-3000:] + res.stdout[-2000:]
    assert "Traceback" not in res.stderr
    return res


def _one_line_failure(res, *needles: str) -> str:
    """A refused command: non-zero exit, no traceback, one line on stderr naming what failed."""
    assert res.returncode != 0, res.stdout[-2000:]
    assert "Traceback" not in res.stderr and "Error:" not in res.stderr.replace("SignatureError", ""), res.stderr
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, res.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


def _tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


# --- point 8: refs that the old `<recipe>-<variant>-<tag>`[:128] tag mixed up ---------------------------------------
def legacy_oci_tag(recipe: str, variant: str, tag: str) -> str:
    """The tag qbuild gave a ref before the injective encoding (what a registry it pushed to holds)."""
    return f"{recipe}-{variant}-{tag}"[:128]


def test_encoding_is_injective_and_keeps_plain_tags():
    from qbuild.artifacts.remote.oci import parse_oci_tag

    assert oci_tag("demo", "q4km", "latest") == "demo-q4km-latest"        # what docs and outside clients use
    assert oci_tag("a", "b-c", "latest") != oci_tag("a-b", "c", "latest")
    refs = [("a", "b-c", "t"), ("a-b", "c", "t"), ("a_", "b", "t"), ("a", "b_", "t"), ("a__b", "c", "t"),
            ("a_b", "c", "t"), ("a", "b", "c-t"), ("a", "b-", "t"), ("x.y", "z-", "1_")]
    tags = {}
    for ref in refs:
        tag = oci_tag(*ref)
        assert OCI_TAG_GRAMMAR.match(tag) and parse_oci_tag(tag) == ref
        tags.setdefault(tag, set()).add(ref)
    assert all(len(v) == 1 for v in tags.values())
    assert parse_oci_tag("_obj-" + "0" * 64) is None and parse_oci_tag("a-b") is None


@pytest.fixture
def two_objects(tmp_path):
    """A store with t/a and t/b (two different objects), built by the CLI."""
    data = fake_recipe(tmp_path, [{"name": "a", "method": "fake"}, {"name": "b", "method": "fake", "level": 2}])
    recipe = write_recipe(tmp_path / "r.yaml", data)
    store = tmp_path / "store"
    _ok(qbuild(recipe, "--store", store))
    digests = {v: json.loads(_ok(qbuild("show", f"t/{v}", "--store", store)).stdout)["digest"] for v in "ab"}
    assert digests["a"] != digests["b"]
    return store, digests


def test_refs_whose_old_tags_collide_stay_apart(tmp_path, two_objects, oci_url):
    store, digests = two_objects
    for v in "ab":
        _ok(qbuild("push", f"t/{v}", "--to", oci_url, "--store", store))
    # a/b-c and a-b/c were both tagged a-b-c-latest: the second push took the first one's tag
    _ok(qbuild("tag", "t/a", "x/y-z:latest", "--remote", oci_url))
    _ok(qbuild("tag", "t/b", "x-y/z:latest", "--remote", oci_url))
    for name, v in (("x/y-z", "a"), ("x-y/z", "b")):
        out = tmp_path / f"pulled-{v}"
        res = _ok(qbuild("pull", name, "--from", oci_url, "-o", out))
        assert res.stdout.split()[0] == digests[v]
        assert json.loads((out / "manifest.json").read_text())["digest"] == digests[v]
    refs = {r["ref"]: r["digest"] for r in json.loads(_ok(qbuild("ls", "--remote", oci_url, "--json")).stdout)}
    assert refs["x/y-z:latest"] == digests["a"] and refs["x-y/z:latest"] == digests["b"]
    # past 128 characters the old tag was cut, so these two shared one: now refused, one line, nothing written
    long_recipe, long_variant = "r" * 60, "v" * 70
    before = _tree(store)
    for suffix in "12":
        res = qbuild("tag", "t/a", f"{long_recipe}/{long_variant}{suffix}:latest", "--remote", oci_url)
        _one_line_failure(res, "cannot be an OCI tag", "more than 128")
    assert _tree(store) == before
    remote = open_remote(oci_url)
    tags = remote._tags()
    assert all(OCI_TAG_GRAMMAR.match(t) for t in tags) and not any(t.startswith("r" * 60) for t in tags)
    assert {r["ref"] for r in remote.list_refs()} == {"t/a:latest", "t/b:latest", "x/y-z:latest", "x-y/z:latest"}


def _tag_like_the_previous_version(remote, ref: tuple[str, str, str], digest: str, key: str | None) -> str:
    """What qbuild's set_ref did before the injective encoding: the object's manifest under `r-v-t`[:128]."""
    oci, _ = remote._get_oci_manifest("_obj-" + digest)
    recipe, variant, tag = ref
    oci = {**oci, "annotations": {**oci["annotations"], "org.qbuild.ref": f"{recipe}/{variant}:{tag}",
                                  "org.qbuild.ref.updated": "2026-01-01T00:00:00Z", "org.qbuild.key": key}}
    remote._put_oci_manifest(legacy_oci_tag(*ref), oci)
    return legacy_oci_tag(*ref)


def test_registry_pushed_by_the_previous_version_still_pulls_by_name(tmp_path, two_objects, oci_url):
    store, digests = two_objects
    for v in "ab":
        _ok(qbuild("push", f"t/{v}", "--to", oci_url, "--store", store))
    remote = open_remote(oci_url)
    key = remote.get_ref("t", "a")["key"]
    old = _tag_like_the_previous_version(remote, ("my-recipe", "q4_k_m", "prod"), digests["a"], key)
    assert old == "my-recipe-q4_k_m-prod" != oci_tag("my-recipe", "q4_k_m", "prod")
    res = _ok(qbuild("pull", "my-recipe/q4_k_m:prod", "--from", oci_url, "-o", tmp_path / "old"))
    assert res.stdout.split()[0] == digests["a"]
    refs = json.loads(_ok(qbuild("ls", "--remote", oci_url, "--json")).stdout)
    assert [r["digest"] for r in refs if r["ref"] == "my-recipe/q4_k_m:prod"] == [digests["a"]]
    # re-pointed by this version: its own tag wins, the legacy one is no longer read, the ref is listed once
    _ok(qbuild("tag", "t/b", "my-recipe/q4_k_m:prod", "--remote", oci_url))
    res = _ok(qbuild("pull", "my-recipe/q4_k_m:prod", "--from", oci_url, "-o", tmp_path / "new"))
    assert res.stdout.split()[0] == digests["b"]
    refs = json.loads(_ok(qbuild("ls", "--remote", oci_url, "--json")).stdout)
    assert [r["digest"] for r in refs if r["ref"] == "my-recipe/q4_k_m:prod"] == [digests["b"]]
    # a legacy tag that another ref's encoding now equals is not overwritten (a__b/c's old tag is a_b/c's new one)
    taken = _tag_like_the_previous_version(remote, ("a__b", "c", "latest"), digests["a"], key)
    assert taken == oci_tag("a_b", "c", "latest")
    _one_line_failure(qbuild("tag", "t/b", "a_b/c:latest", "--remote", oci_url), "holds ref a__b/c:latest",
                      "re-tag that one first")
    res = _ok(qbuild("pull", "a__b/c", "--from", oci_url, "-o", tmp_path / "kept"))
    assert res.stdout.split()[0] == digests["a"]
    # once a__b/c has its own tag (re-tagged by this version), a_b/c may take the old one
    _ok(qbuild("tag", "a__b/c", "a__b/c:latest", "--remote", oci_url))
    _ok(qbuild("tag", "t/b", "a_b/c:latest", "--remote", oci_url))
    for name, v in (("a__b/c", "a"), ("a_b/c", "b")):
        res = _ok(qbuild("pull", name, "--from", oci_url, "-o", tmp_path / f"after-{v}"))
        assert res.stdout.split()[0] == digests[v]


# --- a small registry on 127.0.0.1 that answers what it is told ----------------------------------------------------
class Stall:
    """An answer that declares `declared` bytes (None: no Content-Length, the body ends when the connection does),
    sends `send` of them, then holds the connection open until the server stops."""

    def __init__(self, send: int, declared: int | None = None, hold: bool = True):
        self.send, self.declared, self.hold = send, declared, hold


class FakeRegistry:
    def __init__(self, repo: str = "qbuild/hostile"):
        self.repo, self.manifests, self.blobs = repo, {}, {}
        self.next_page: str | None = None   # a Link header on the tag list
        self.sent: dict[str, int] = {}
        self.requests: list[tuple[str, str]] = []
        self.stopping = threading.Event()
        registry = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def do_HEAD(self):
                self._answer(head=True)

            def do_GET(self):
                self._answer(head=False)

            def _answer(self, head: bool):
                registry.requests.append((self.command, self.path))
                path = self.path.split("?")[0]
                prefix = f"/v2/{registry.repo}/"
                if path == "/v2/":
                    return self._send(200, b"{}", head)
                if path == prefix + "tags/list":
                    return self._send(200, json.dumps({"name": registry.repo,
                                                       "tags": sorted(registry.manifests)}).encode(), head)
                for kind, table in (("manifests/", registry.manifests), ("blobs/", registry.blobs)):
                    if path.startswith(prefix + kind) and path[len(prefix + kind):] in table:
                        return self._send(200, table[path[len(prefix + kind):]], head, path)
                return self._send(404, b'{"errors": [{"code": "NOT_FOUND", "message": "unknown"}]}', head)

            def _send(self, status: int, body, head: bool, path: str = ""):
                self.send_response(status)
                self.send_header("Content-Type", OCI_MANIFEST if "/manifests/" in path else "application/json")
                if isinstance(body, Stall):
                    if body.declared is not None:
                        self.send_header("Content-Length", str(body.declared))
                    self.send_header("Connection", "close")
                    self.end_headers()
                    self.close_connection = True
                    if head:
                        return
                    chunk, sent = b" " * (1 << 20), 0
                    try:
                        while sent < body.send and not registry.stopping.is_set():
                            self.wfile.write(chunk)
                            sent += len(chunk)
                            registry.sent[path] = sent
                        while body.hold and not registry.stopping.wait(0.1):
                            pass
                    except OSError:
                        pass
                    return
                self.send_header("Content-Length", str(len(body)))
                if registry.next_page and self.path.startswith(f"/v2/{registry.repo}/tags/list"):
                    self.send_header("Link", f'<{registry.next_page}>; rel="next"')
                if "/manifests/" in path:
                    self.send_header("Docker-Content-Digest", "sha256:" + hashlib.sha256(body).hexdigest())
                self.end_headers()
                if not head:
                    self.wfile.write(body)
                    registry.sent[path] = len(body)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"oci://127.0.0.1:{self.server.server_address[1]}/{self.repo}"

    def blob(self, data: bytes) -> dict:
        digest = "sha256:" + hashlib.sha256(data).hexdigest()
        self.blobs[digest] = data
        return {"digest": digest, "size": len(data)}

    def add_object(self, store: Store, digest: str) -> None:
        """The object as qbuild pushes it: one layer per file, manifest.json as a doc layer, tagged _obj-<digest>."""
        manifest = store.manifest(digest)
        layers = [{"mediaType": DOC, **self.blob((store.object_dir(digest) / f["path"]).read_bytes()),
                   "annotations": {TITLE: f["path"]}} for f in manifest["files"]]
        layers.append({"mediaType": DOC, **self.blob(json.dumps(manifest).encode()),
                       "annotations": {TITLE: "manifest.json", ROLE: "manifest"}})
        self.manifest("_obj-" + digest, {"artifactType": MODEL_ARTIFACT, "layers": layers,
                                         "config": {"mediaType": "application/vnd.oci.empty.v1+json",
                                                    **self.blob(b"{}")},
                                         "annotations": {"org.qbuild.digest": digest, "org.qbuild.key": manifest["key"]}})

    def add_ref(self, recipe: str, variant: str, digest: str) -> None:
        self.manifest(oci_tag(recipe, variant, "latest"), {
            "layers": [], "annotations": {"org.qbuild.ref": f"{recipe}/{variant}:latest", "org.qbuild.digest": digest,
                                          "org.qbuild.key": "e" * 64}})

    def manifest(self, tag: str, body) -> None:
        self.manifests[tag] = body if isinstance(body, bytes | Stall) else json.dumps(
            {"schemaVersion": 2, "mediaType": OCI_MANIFEST, **body}).encode()

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stopping.set()
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(timeout=10)


@pytest.fixture
def fake_registry(tmp_path, monkeypatch):
    docker = tmp_path / "docker"   # no credentials anywhere: the fake registry asks for none
    docker.mkdir()
    monkeypatch.setenv("DOCKER_CONFIG", str(docker))
    with FakeRegistry() as registry:
        yield registry


@pytest.fixture
def good_object(tmp_path):
    store = Store(tmp_path / "src")
    hit = make_object(store, model_files(size=64 << 10))
    return store, hit.digest


HOSTILE_LAYERS = [(["x"], "layers[0] is not a descriptor"), ([7], "layers[0] is not a descriptor"),
                  ("x", "layers is not a list"), ([{"digest": "sha256:../../x", "size": 1}], "layers[0].digest"),
                  ([{"digest": "sha256:" + "a" * 64, "size": "9"}], "layers[0].size"),
                  ([{"digest": "sha256:" + "a" * 64, "size": 1, "annotations": []}], "layers[0].annotations")]


# --- point 9: hostile OCI manifests --------------------------------------------------------------------------------
@pytest.mark.parametrize("layers,field", HOSTILE_LAYERS[:3])
def test_hostile_object_manifest_fails_pull_in_one_line(tmp_path, fake_registry, good_object, layers, field):
    bad = "b" * 64
    fake_registry.add_ref("t", "a", bad)
    fake_registry.manifest("_obj-" + bad, {"artifactType": MODEL_ARTIFACT, "layers": layers,
                                           "annotations": {"org.qbuild.digest": bad}})
    out, before = tmp_path / "out", _tree(tmp_path)
    line = _one_line_failure(qbuild("pull", "t/a", "--from", fake_registry.url, "-o", out),
                             fake_registry.url, f"_obj-{bad}", field)
    assert "not a valid OCI manifest" in line
    assert _tree(tmp_path) == before and not out.exists() and not list(tmp_path.glob(".out*"))


def test_verify_remote_reports_each_bad_manifest_on_its_own_row(fake_registry, good_object):
    store, good = good_object
    fake_registry.add_object(store, good)
    bad = {}
    for i, (layers, field) in enumerate(HOSTILE_LAYERS):
        digest = f"{i:x}" * 64
        fake_registry.manifest("_obj-" + digest, {"artifactType": MODEL_ARTIFACT, "layers": layers,
                                                  "annotations": {"org.qbuild.digest": digest}})
        bad[digest] = field
    res = qbuild("verify", "--remote", fake_registry.url, "--json")
    assert res.returncode == 1 and "Traceback" not in res.stderr, res.stderr
    report = json.loads(res.stdout)
    assert report["checked"] == len(bad) + 1                  # the good object was checked too, and passed
    rows = {r["digest"]: r for r in report["damaged"]}
    assert set(rows) == set(bad)
    for digest, field in bad.items():
        assert len(rows[digest]["problems"]) == 1 and field in rows[digest]["problems"][0]
    human = qbuild("verify", "--remote", fake_registry.url)
    assert f"{len(bad) + 1} object(s) checked, {len(bad)} damaged" in human.stdout and "Traceback" not in human.stderr


def test_plan_read_through_treats_a_hostile_action_record_as_a_miss(tmp_path, fake_registry):
    data = fake_recipe(tmp_path, [{"name": "a", "method": "fake"}])
    recipe = write_recipe(tmp_path / "r.yaml", data)
    store = tmp_path / "store"
    plan = json.loads(_ok(qbuild("plan", recipe, "--store", store, "--json")).stdout)
    keys = [s["key"] for s in plan["steps"] if s["status"] != "source"]
    for key, layers in zip(keys, [[7], ["x"], [None]] * len(keys), strict=False):
        fake_registry.manifest("_key-" + key, {"artifactType": ACTION_ARTIFACT, "layers": layers})
    res = _ok(qbuild("plan", recipe, "--store", store, "--remote", fake_registry.url, "--json"))
    statuses = {s["key"]: s["status"] for s in json.loads(res.stdout)["steps"]}
    assert all(statuses[k] != "hit-remote" for k in keys)
    warnings = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert len(warnings) == len(keys)
    for key, line in zip(keys, warnings, strict=True):
        assert f"_key-{key}" in line and "layers[0] is not a descriptor" in line and "a miss" in line


# --- point 10: bounded reads -------------------------------------------------------------------------------------
def test_oversized_manifest_is_refused_from_its_declared_size(tmp_path, fake_registry):
    """10 GiB declared, 1 MiB sent, then the registry holds the connection: refused at once, not read."""
    bad = "c" * 64
    fake_registry.add_ref("t", "a", bad)
    fake_registry.manifest("_obj-" + bad, Stall(send=1 << 20, declared=10 << 30))
    started, before = time.monotonic(), _tree(tmp_path)
    res = qbuild("pull", "t/a", "--from", fake_registry.url, "-o", tmp_path / "out", timeout=60)
    _one_line_failure(res, f"manifest _obj-{bad}", "10,737,418,240 bytes", "not read")
    assert time.monotonic() - started < 30 and _tree(tmp_path) == before


def test_endless_manifest_stops_at_the_bound(tmp_path, fake_registry, good_object):
    """No Content-Length and a body that would run to 256 MiB: reading stops past the bound, and verify --remote
    still checks the other objects."""
    store, good = good_object
    fake_registry.add_object(store, good)
    endless = "d" * 64
    fake_registry.manifest("_obj-" + endless, Stall(send=256 << 20, declared=None, hold=False))
    res = qbuild("verify", "--remote", fake_registry.url, "--json", timeout=120)
    assert res.returncode == 1 and "Traceback" not in res.stderr, res.stderr
    report = json.loads(res.stdout)
    assert report["checked"] == 2
    (row,) = report["damaged"]
    assert row["digest"] == endless and "stopped reading" in row["problems"][0]
    assert fake_registry.sent[f"/v2/{fake_registry.repo}/manifests/_obj-{endless}"] < MAX_JSON_BYTES + (32 << 20)


def test_blob_larger_than_its_descriptor_allows_is_not_fetched(tmp_path, fake_registry, good_object):
    """A manifest.json layer whose descriptor says 10 GiB: refused from the descriptor, the blob never requested."""
    bad = "e" * 64
    huge = "sha256:" + "f" * 64
    fake_registry.add_ref("t", "a", bad)
    fake_registry.manifest("_obj-" + bad, {"artifactType": MODEL_ARTIFACT, "annotations": {"org.qbuild.digest": bad},
                                           "layers": [{"mediaType": DOC, "digest": huge, "size": 10 << 30,
                                                       "annotations": {TITLE: "manifest.json", ROLE: "manifest"}}]})
    fake_registry.blobs[huge] = Stall(send=1 << 20, declared=10 << 30)
    before = _tree(tmp_path)
    res = qbuild("pull", "t/a", "--from", fake_registry.url, "-o", tmp_path / "out", timeout=60)
    _one_line_failure(res, f"manifest.json of object {bad[:12]}", "descriptor says 10,737,418,240 bytes")
    assert not any(huge in path for _, path in fake_registry.requests) and _tree(tmp_path) == before


def test_tag_list_paging_to_another_host_is_not_followed(tmp_path, fake_registry, good_object):
    """A registry whose tag list pages on to another host would send our credentials there: refused, one line."""
    store, good = good_object
    fake_registry.add_object(store, good)
    with FakeRegistry() as other:
        port = other.server.server_address[1]
        fake_registry.next_page = f"http://localhost:{port}/v2/{other.repo}/tags/list?n=1000&last=x"
        _one_line_failure(qbuild("verify", "--remote", fake_registry.url), "next page is on another host",
                          "not followed")
        assert other.requests == []


def test_push_uploads_past_a_planted_object_manifest(tmp_path, two_objects, oci_url):
    """An object tag whose qbuild manifest.json is not the object's (here: it lists no files) is not "already
    there": a push uploads the object again, and the pull gets every file (as on fsspec remotes)."""
    store, digests = two_objects
    digest = digests["a"]
    _ok(qbuild("push", "t/a", "--to", oci_url, "--store", store))
    remote = open_remote(oci_url)
    oci, _ = remote._get_oci_manifest("_obj-" + digest)
    planted = remote._push_bytes(json.dumps({"files": []}).encode(), DOC, {TITLE: "manifest.json", ROLE: "manifest"})
    others = [la for la in oci["layers"] if (la.get("annotations") or {}).get(ROLE) != "manifest"]
    remote._put_oci_manifest("_obj-" + digest, {**oci, "layers": [*others, planted]})
    assert not open_remote(oci_url).has_object(digest)
    res = _ok(qbuild("push", "t/a", "--to", oci_url, "--store", store))
    assert "already there" not in res.stdout
    assert open_remote(oci_url).has_object(digest)
    out = tmp_path / "pulled"
    _ok(qbuild("pull", "t/a", "--from", oci_url, "-o", out))
    local = store / "objects" / digest[:2] / digest
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["digest"] == digest and manifest["files"]
    for f in manifest["files"]:
        assert (out / f["path"]).read_bytes() == (local / f["path"]).read_bytes()
