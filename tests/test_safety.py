"""Nothing outside qbuild's own folders is moved, deleted or read into an artifact (issue 19, docs/store-integrity.md
"What qbuild may delete"). Every test builds its own throwaway tree (a fake home with precious files, a hostile
remote, a library stand-in that leaves links) under tmp_path and checks afterwards that each precious file is
byte-identical and nothing exists outside the store, the scratch and --out."""

from __future__ import annotations

import hashlib
import http.server
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from qbuild.artifacts.store import Store

from helpers import fake_recipe, qbuild, run_api, write_recipe

MARKER = ".qbuild-root.json"   # qbuild.base.owned.MARKER (imported in the tests, so this module runs on older code too)


def fake_home(root: Path) -> tuple[Path, dict[Path, bytes]]:
    """A home directory with precious files and folders, some named the way qbuild names its own."""
    home = root / "home"
    files = {
        home / "Documents" / "thesis.tex": b"\\documentclass{article}",
        home / "projects-2024" / "notes.md": b"# notes",
        home / "notes-0123456789abcdef" / "keep.txt": b"not an environment",
        home / ".bashrc": b"export PATH=$HOME/bin:$PATH\n",
        home / ".aws" / "credentials": b"[default]\naws_secret_access_key = hunter2hunter2\n",
        home / ".config" / "app.ini": b"[x]\n",
    }
    for path, data in files.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    return home, files


def assert_intact(files: dict[Path, bytes]) -> None:
    for path, data in files.items():
        assert path.is_file() and not path.is_symlink() and path.read_bytes() == data, path


# --- the guarded operations themselves ----------------------------------------------------------------------------
def test_owned_root_confines_every_operation_and_never_follows_a_link(tmp_path):
    from qbuild.base.owned import NotOurs, claim_root, owned_root

    home, precious = fake_home(tmp_path)
    root = claim_root(tmp_path / "store", "store")
    assert (root.path / MARKER).is_file()
    (root.path / "tmp").mkdir()
    (root.path / "tmp" / "to-home").symlink_to(home)              # a link to a folder outside
    (root.path / "tmp" / "rc").symlink_to(home / ".bashrc")       # a link to a file outside
    for bad in (home / ".bashrc", home, root.path, root.path / "..", "/", "/etc", root.path / "tmp" / "to-home" / ".bashrc"):
        with pytest.raises(NotOurs):
            root.remove(bad)
    with pytest.raises(NotOurs):
        root.move(root.path / "tmp" / "rc", home / "moved")
    with pytest.raises(NotOurs):
        root.chmod(root.path / "tmp" / "rc", 0o444)             # chmod would follow the link
    assert root.remove(root.path / "tmp" / "to-home") and root.remove(root.path / "tmp" / "rc")   # the links only
    assert_intact(precious)
    with pytest.raises(NotOurs, match="not empty"):
        claim_root(home, "store")                                   # a home is never adopted as a store
    with pytest.raises(NotOurs, match="no qbuild marker"):
        owned_root(home, "store")
    assert not (home / MARKER).exists()
    assert_intact(precious)


# --- 1. env rm ----------------------------------------------------------------------------------------------------
def _fake_env(root: Path, name: str, lock_hash: str) -> Path:
    d = root / f"{name}-{lock_hash[:16]}"
    (d / "bin").mkdir(parents=True)
    (d / "bin" / "python").write_text("#!/bin/sh\n")
    (d / ".qbuild-env.json").write_text(json.dumps({"name": name, "lock_hash": lock_hash, "packages": []}))
    return d


def test_env_rm_all_never_touches_a_home_directory(tmp_path):
    home, precious = fake_home(tmp_path)
    res = qbuild("env", "rm", "--all", env={"QBUILD_ENVS_DIR": str(home)})
    assert res.returncode == 2 and len(res.stderr.strip().splitlines()) == 1, res.stderr
    assert "not a qbuild envs" in res.stderr and "Traceback" not in res.stderr
    assert_intact(precious)
    assert sorted(p.name for p in home.iterdir()) == [".aws", ".bashrc", ".config", "Documents",
                                                      "notes-0123456789abcdef", "projects-2024"]


def test_env_rm_removes_only_complete_environments_it_made(tmp_path):
    home, precious = fake_home(tmp_path)
    envs = tmp_path / "envs"
    keep = _fake_env(envs, "gptqmodel", "a" * 64)
    gone = _fake_env(envs, "llm-compressor", "b" * 64)
    half = envs / f"vllm-{'c' * 16}"                      # named like one, but no marker and no pyvenv.cfg: stays
    half.mkdir()
    (half / "notes.txt").write_bytes(b"keep")
    interrupted = envs / f"sglang-{'9' * 16}"             # an interrupted creation (uv wrote pyvenv.cfg): removed
    interrupted.mkdir()
    (interrupted / "pyvenv.cfg").write_text("home = /usr/bin\n")
    (envs / f"evil-{'d' * 16}").symlink_to(home)          # a link named like an environment
    env = {"QBUILD_ENVS_DIR": str(envs)}
    res = qbuild("env", "rm", "llm-compressor", env=env)
    assert res.returncode == 0, res.stderr
    assert not gone.exists() and keep.is_dir() and half.is_dir() and (envs / f"evil-{'d' * 16}").is_symlink()
    res = qbuild("env", "rm", "--all", env=env)
    assert res.returncode == 0, res.stderr
    assert not keep.exists() and not interrupted.exists() and (half / "notes.txt").read_bytes() == b"keep"
    assert (envs / f"evil-{'d' * 16}").is_symlink()
    assert (envs / MARKER).is_file()                      # an old environments folder is adopted (marked)
    assert_intact(precious)


# --- 2. gc ----------------------------------------------------------------------------------------------------------
def _age(path: Path, days: float = 400) -> None:
    t = time.time() - days * 86400
    os.utime(path, (t, t), follow_symlinks=False)


def test_gc_refuses_a_root_that_is_not_a_store_and_removes_only_its_own_names(tmp_path, store_dir):
    fake = tmp_path / "not-a-store"
    precious = {}
    for sub in ("tmp", "logs", "quarantine"):
        f = fake / sub / "old-thing" / "data.txt"
        f.parent.mkdir(parents=True)
        f.write_bytes(sub.encode())
        _age(f.parent)
        precious[f] = sub.encode()
    res = qbuild("gc", "--store", fake, "--older-than", "1d")
    assert res.returncode == 2 and len(res.stderr.strip().splitlines()) == 1 and "not a qbuild store" in res.stderr
    assert_intact(precious)
    assert not (fake / MARKER).exists()

    recipe = write_recipe(tmp_path / "r.yaml", fake_recipe(tmp_path, [{"name": "a", "method": "fake"}]))
    assert run_api(recipe, store_dir)[0] == 0
    foreign = store_dir / "tmp" / "someone-elses"           # a folder qbuild never names so: left alone
    (foreign / "f.txt").parent.mkdir(parents=True)
    (foreign / "f.txt").write_bytes(b"mine")
    _age(foreign)
    ours = store_dir / "quarantine" / f"{'e' * 64}.20200101T000000Z.abcdef"
    ours.mkdir(parents=True)
    _age(ours)
    res = qbuild("gc", "--store", store_dir, "--older-than", "1d", "--json")
    assert res.returncode == 0, res.stderr
    removed = {r["path"] for r in json.loads(res.stdout)["removed"]}
    assert str(ours) in removed and not ours.exists()
    assert (foreign / "f.txt").read_bytes() == b"mine" and str(foreign) not in removed


# --- 3. names from a remote are checked before they become paths --------------------------------------------------
def test_a_hostile_remote_record_never_becomes_a_local_path(tmp_path, store_dir):
    from qbuild import api
    from qbuild.artifacts.remote import open_remote
    from qbuild.artifacts.remote.cache import lookup

    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "evil.lock").write_bytes(b"precious lock")
    recipe = write_recipe(tmp_path / "r.yaml", fake_recipe(tmp_path, [{"name": "a", "method": "fake"}]))
    plan = api.plan(recipe, store=store_dir).as_dict()
    key = next(s["key"] for s in plan["steps"] if s["step"] == "quantize[a]")
    remote_dir = tmp_path / "remote"
    depth = len(store_dir.relative_to(tmp_path).parts) + 2          # objects/<dd>/ -> up to tmp_path
    hostile = {
        "x/" + "../" * (depth + 1) + "victim/evil": key,
        "../someone-elses-model": key,
        "A" * 64: key,
    }
    url = f"file://{remote_dir}"
    remote = open_remote(url)
    for i, digest in enumerate(hostile):
        path = remote_dir / "actions" / key[:2] / f"{key}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"digest": digest, "key": key, "files": []}))
        (remote_dir / "refs" / "t" / "a").mkdir(parents=True, exist_ok=True)
        (remote_dir / "refs" / "t" / "a" / f"tag{i}").write_text(json.dumps({"digest": digest}))
        assert remote.get_action(key) is None and lookup([remote], key) is None
        assert remote.get_ref("t", "a", f"tag{i}") is None
    assert remote.list_refs() == [] and list(remote.list_actions()) == []
    for digest in hostile:
        with pytest.raises(ValueError):
            Store(store_dir).object_dir(digest)
    # a real run against that remote: a miss, built locally, nothing created outside the store
    def outside() -> list[Path]:   # everything but the store and the remote's own storage (write-through)
        return sorted(p for p in tmp_path.rglob("*") if not {store_dir, remote_dir} & {p, *p.parents})

    before = outside()
    rc, summary = run_api(recipe, store_dir, remotes=[url])
    assert rc == 0 and {s["name"]: s["status"] for s in summary["steps"]}["quantize[a]"] == "built"
    assert outside() == before
    assert (victim / "evil.lock").read_bytes() == b"precious lock"


def test_json_from_a_remote_is_bounded(tmp_path):
    from qbuild.artifacts.remote import RemoteError, open_remote
    from qbuild.artifacts.remote.base import MAX_JSON_DEPTH, bounded_json

    with pytest.raises(ValueError, match="deeper"):
        bounded_json("[" * 100_000 + "]" * 100_000, "record")
    assert bounded_json('{"a": "[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[["}', "r")
    assert bounded_json("[" * MAX_JSON_DEPTH + "]" * MAX_JSON_DEPTH, "record")
    key = "f" * 64
    path = tmp_path / "remote" / "actions" / key[:2] / f"{key}.json"
    path.parent.mkdir(parents=True)
    path.write_text('{"digest": ' + "[" * 50_000 + "]" * 50_000 + "}")
    with pytest.raises(RemoteError) as info:
        open_remote(f"file://{tmp_path / 'remote'}").get_action(key)
    assert "deeper" in str(info.value) and "\n" not in str(info.value)


# --- 4. auto-round's export folder ------------------------------------------------------------------------------------
def test_lift_export_refuses_a_symlinked_export_folder(tmp_path):
    from qbuild.base.owned import claim_root
    from qbuild.quantize.autoround.run import lift_export

    home, precious = fake_home(tmp_path)
    (home / "Documents" / "config.json").write_bytes(b"{}")
    precious[home / "Documents" / "config.json"] = b"{}"
    root = claim_root(tmp_path / "store", "store")
    out = root.path / "tmp" / ("a" * 64 + ".1.deadbeef") / "out"
    out.mkdir(parents=True)
    (out / "_export").symlink_to(home / "Documents")
    with pytest.raises(RuntimeError, match="symlink"):
        lift_export(out / "_export", out, root)
    (out / "_export").unlink()
    (out / "_export").mkdir()
    (out / "_export" / "w4g64").symlink_to(home / "Documents")     # a link inside: never searched, never moved from
    with pytest.raises(RuntimeError, match="found 0"):
        lift_export(out / "_export", out, root)
    assert_intact(precious)
    (out / "_export" / "w4g64").unlink()
    real = out / "_export" / "model-w4g64"
    real.mkdir()
    (real / "config.json").write_bytes(b'{"quantization_config": {}}')
    (real / "model.safetensors").write_bytes(b"w")
    lift_export(out / "_export", out, root)
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]


# --- 5. links in a step's output ----------------------------------------------------------------------------------------
def test_a_link_to_a_credential_is_refused_and_never_stored(tmp_path, store_dir):
    home, precious = fake_home(tmp_path)
    store = Store(store_dir)
    tmp = store.new_tmp("b" * 64)
    (tmp / "weights.bin").write_bytes(b"w")
    (tmp / "credentials").symlink_to(home / ".aws" / "credentials")
    with pytest.raises(Exception, match="credentials.*outside the step's scratch") as info:
        store.publish("b" * 64, tmp, {"kind": "quantize", "name": "quantize[a]"})
    assert "\n" not in str(info.value)
    secret = (home / ".aws" / "credentials").read_bytes()
    assert not any(p.is_file() and not p.is_symlink() and p.read_bytes() == secret for p in store_dir.rglob("*"))
    assert_intact(precious)


# --- 6. pull --out --------------------------------------------------------------------------------------------------------
def test_local_pull_refuses_a_non_empty_out(tmp_path, store_dir):
    home, precious = fake_home(tmp_path)
    recipe = write_recipe(tmp_path / "r.yaml", fake_recipe(tmp_path, [{"name": "a", "method": "fake"}]))
    assert run_api(recipe, store_dir)[0] == 0
    (home / ".config").rename(home / "real-config")
    (home / ".config").symlink_to(home / "real-config")
    precious = {(home / "real-config" / "app.ini" if p.name == "app.ini" else p): d for p, d in precious.items()}
    res = qbuild("pull", "t/a", "-o", home, "--store", store_dir)
    assert res.returncode == 2 and "not empty" in res.stderr and len(res.stderr.strip().splitlines()) == 1
    assert (home / ".config").is_symlink() and not (home / "weights.bin").exists()
    assert_intact(precious)
    res = qbuild("pull", "t/a", "-o", home / ".config", "--store", store_dir)
    assert res.returncode == 2 and "symlink" in res.stderr
    assert_intact(precious)
    res = qbuild("pull", "t/a", "-o", tmp_path / "new", "--store", store_dir)
    assert res.returncode == 0 and (tmp_path / "new" / "weights.bin").is_file()


# --- 7. registry credentials go only where the user sent them -------------------------------------------------------------
class _Recorder(http.server.BaseHTTPRequestHandler):
    """A registry stand-in on 127.0.0.1 that asks for basic auth and records every Authorization header."""

    seen: list[str | None] = []

    def do_GET(self):
        type(self).seen.append(self.headers.get("Authorization"))
        self.send_response(401)
        self.send_header("WWW-Authenticate", 'Basic realm="r"')
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args):
        pass


def test_registry_credentials_are_not_sent_to_a_host_a_registry_tag_names(tmp_path, monkeypatch):
    pytest.importorskip("oras")
    from qbuild.artifacts import pull
    from qbuild.artifacts.remote import RemoteError

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Recorder)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        host = f"127.0.0.1:{server.server_address[1]}"
        url = f"oci://{host}/team/models"   # plain HTTP: the host is loopback
        monkeypatch.setenv("QBUILD_REGISTRY_USERNAME", "alice")
        monkeypatch.setenv("QBUILD_REGISTRY_PASSWORD", "hunter2hunter2")
        monkeypatch.setenv("DOCKER_CONFIG", str(tmp_path / "no-docker-config"))
        monkeypatch.delenv("QBUILD_REMOTE", raising=False)
        remote = pull._remote_named_by_registry(url)     # a URL read from a model version's tags
        with pytest.raises(RemoteError, match="requires credentials"):
            remote.check()
        assert _Recorder.seen and all(h is None for h in _Recorder.seen)
        _Recorder.seen.clear()
        monkeypatch.setenv("QBUILD_REMOTE", f"oci://{host}/team/models")   # the user configured this registry
        remote = pull._remote_named_by_registry(url)
        with pytest.raises(RemoteError):
            remote.check()
        assert any(h and h.startswith("Basic ") for h in _Recorder.seen)
    finally:
        server.shutdown()


# --- 8. what a worker sees ------------------------------------------------------------------------------------------------
def test_workers_get_no_credentials(tmp_path, store_dir):
    secrets = {"AWS_SECRET_ACCESS_KEY": "s3cr3t", "AWS_ACCESS_KEY_ID": "AKIA", "HF_TOKEN": "hf_x",
               "QBUILD_REGISTRY_PASSWORD": "pw", "MLFLOW_TRACKING_PASSWORD": "pw", "GITHUB_TOKEN": "ghp",
               "MY_SERVICE_API_KEY": "k", "QBUILD_SIGNING_KEY": str(tmp_path / "key")}
    recipe = write_recipe(tmp_path / "r.yaml", fake_recipe(tmp_path, [{"name": "a", "method": "fake"}]))
    res = qbuild("run", recipe, "--store", store_dir, "--json", env={**secrets, "QBUILD_EVAL_BATCH_SIZE": "4"})
    assert res.returncode == 0, res.stderr
    step = next(s for s in json.loads(res.stdout)["steps"] if s["name"] == "quantize[a]")
    info = json.loads((Store(store_dir).object_dir(step["digest"]) / "manifest.json").read_text())["info"]
    names = set(info["env_names"])
    assert not names & set(secrets), names & set(secrets)
    assert {"PATH", "HOME", "OMP_NUM_THREADS", "QBUILD_EVAL_BATCH_SIZE", "QBUILD_PROGRESS_FD"} <= names

    from qbuild.base.worker_env import step_environ

    assert "HF_TOKEN" in step_environ("calibrate", secrets) and "HF_TOKEN" not in step_environ("quantize", secrets)
    assert "AWS_SECRET_ACCESS_KEY" not in step_environ("calibrate", secrets)


def test_proxy_settings_reach_the_steps_that_may_read_a_hub_only(tmp_path, store_dir):
    """HTTPS_PROXY & co. (either case; a proxy URL may carry a password) go to the steps that may download from a
    hub (calibration and evaluation text), and to no other: they were dropped for every step."""
    from qbuild.base.worker_env import step_environ

    proxies = {"HTTPS_PROXY": "http://u:pw@proxy:3128", "HTTP_PROXY": "http://proxy:3128", "NO_PROXY": "127.0.0.1",
               "https_proxy": "http://proxy:3128", "http_proxy": "http://proxy:3128", "no_proxy": "localhost",
               "ALL_PROXY": "socks5://proxy:1080", "all_proxy": "socks5://proxy:1080"}
    for kind in ("calibrate", "eval-data"):
        assert step_environ(kind, {**proxies, "PATH": "/bin"}) == {**proxies, "PATH": "/bin"}
    for kind in ("quantize", "perplexity", "task", "serving", None):
        assert step_environ(kind, {**proxies, "PATH": "/bin"}) == {"PATH": "/bin"}
    # what a real quantize worker saw of them: nothing
    recipe = write_recipe(tmp_path / "r.yaml", fake_recipe(tmp_path, [{"name": "a", "method": "fake"}]))
    res = qbuild("run", recipe, "--store", store_dir, "--json", env=proxies)
    assert res.returncode == 0, res.stderr
    step = next(s for s in json.loads(res.stdout)["steps"] if s["name"] == "quantize[a]")
    info = json.loads((Store(store_dir).object_dir(step["digest"]) / "manifest.json").read_text())["info"]
    assert not set(info["env_names"]) & set(proxies)


# --- 9. keygen ------------------------------------------------------------------------------------------------------------
def test_keygen_never_writes_through_a_link_or_over_a_file(tmp_path):
    home, precious = fake_home(tmp_path)
    key = tmp_path / "keys" / "team.key"
    key.parent.mkdir()
    key.symlink_to(home / ".bashrc")
    res = qbuild("keygen", key)
    assert res.returncode == 2 and "already exists" in res.stderr and len(res.stderr.strip().splitlines()) == 1
    assert_intact(precious)
    dangling = tmp_path / "keys" / "dangling.key"
    dangling.symlink_to(home / "new-file")
    assert qbuild("keygen", dangling).returncode == 2 and not (home / "new-file").exists()
    fresh = tmp_path / "keys" / "fresh.key"
    assert qbuild("keygen", fresh).returncode == 0
    assert fresh.stat().st_mode & 0o777 == 0o600 and Path(f"{fresh}.pub").is_file()
    pub = Path(f"{fresh}.pub").read_bytes()
    assert qbuild("keygen", fresh).returncode == 2 and Path(f"{fresh}.pub").read_bytes() == pub


# --- 10. redaction is linear; a bad value is quoted short --------------------------------------------------------------------
def test_redaction_is_linear_and_an_error_quotes_a_long_value_short(tmp_path):
    from qbuild.base.names import redact_url

    t0 = time.perf_counter()
    assert redact_url("a" * (1 << 20)) == "a" * (1 << 20)   # was quadratic: ~35 min of one core at this size
    assert time.perf_counter() - t0 < 10
    assert redact_url("x" * 40 + "://user:pw@host/p") == "x" * 40 + "://***@host/p"
    recipe = write_recipe(tmp_path / "r.yaml", fake_recipe(tmp_path, [{"name": "a", "method": "fake", "level": "9" * 100_000}]))
    t0 = time.perf_counter()
    res = qbuild("validate", recipe)
    assert res.returncode == 2 and len(res.stderr.strip().splitlines()) == 1
    assert len(res.stderr) < 1000 and "100,000 characters" in res.stderr, res.stderr[:300]


# --- 11. Ctrl-C after the summary, --json on a full disk, a plan never changes the store ----------------------------------
def test_ctrl_c_at_any_moment_of_a_cached_run_is_one_line_and_130(tmp_path, store_dir):
    recipe = write_recipe(tmp_path / "r.yaml", fake_recipe(tmp_path, [{"name": f"v{i}", "method": "fake", "level": i}
                                                                      for i in range(3)]))
    assert run_api(recipe, store_dir)[0] == 0
    cmd = [sys.executable, "-m", "qbuild", "run", str(recipe), "--store", str(store_dir), "--json"]
    t0 = time.perf_counter()
    subprocess.run(cmd, capture_output=True, check=True)
    span = time.perf_counter() - t0
    codes = []
    for i in range(16):   # spread over the whole life of the process, its end (summary, teardown) included
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        time.sleep(span * (0.3 + 0.8 * i / 15))
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
        codes.append(proc.returncode)
        assert proc.returncode in (0, 130), (proc.returncode, err)
        assert "Traceback" not in err, err
        if proc.returncode == 130:
            assert "qbuild: interrupted" in err and len(err.strip().splitlines()) == 1, err
    assert qbuild("verify", "--store", store_dir).returncode == 0


def test_plan_reports_a_damaged_object_without_moving_it(tmp_path, store_dir):
    recipe = write_recipe(tmp_path / "r.yaml", fake_recipe(tmp_path, [{"name": "a", "method": "fake"}]))
    rc, summary = run_api(recipe, store_dir)
    digest = next(s["digest"] for s in summary["steps"] if s["name"] == "quantize[a]")
    weights = Store(store_dir).object_dir(digest) / "weights.bin"
    weights.chmod(0o644)
    weights.write_bytes(b"damaged")
    before = hashlib.sha256(json.dumps(sorted(str(p) for p in store_dir.rglob("*"))).encode()).hexdigest()
    res = qbuild("plan", recipe, "--store", store_dir, "--json")
    assert res.returncode == 0, res.stderr
    assert next(s for s in json.loads(res.stdout)["steps"] if s["step"] == "quantize[a]")["status"] == "miss"
    assert weights.read_bytes() == b"damaged" and not (store_dir / "quarantine").exists()
    assert hashlib.sha256(json.dumps(sorted(str(p) for p in store_dir.rglob("*"))).encode()).hexdigest() == before
    assert run_api(recipe, store_dir)[0] == 0 and any((store_dir / "quarantine").iterdir())   # a run repairs


def test_a_full_disk_with_json_still_prints_json(tmp_path):
    mnt = tmp_path / "tiny"
    mnt.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(mnt)],
                                           capture_output=True).returncode:
        pytest.skip("needs root and tmpfs mounts")
    try:
        recipe = write_recipe(tmp_path / "r.yaml", fake_recipe(tmp_path, [{"name": f"v{i}", "method": "fake", "level": i}
                                                                          for i in range(4)]))
        with open(mnt / "filler", "wb") as f:
            try:
                f.write(b"\0" * (1 << 20))
            except OSError:
                pass
        res = qbuild("run", recipe, "--store", mnt / "store", "--json")
        assert res.returncode == 1 and len(res.stderr.strip().splitlines()) == 1, res.stderr
        data = json.loads(res.stdout)
        assert data["exit_code"] == 1 and "full" in data["error"]
    finally:
        subprocess.run(["umount", str(mnt)], capture_output=True)
