"""Bad input and faults: one clear line naming the remote, a non-zero exit code, nothing partial, and resume."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid

import pytest
from remote_common import REPO, make_object, model_files

from qbuild.artifacts.remote import RemoteConfigError, RemoteError, open_remote
from qbuild.artifacts.store import Store
from qbuild.errors import MissingBackendError

from servers import FaultProxy, free_port


def _one_line(exc: BaseException, display: str | None = None) -> str:
    msg = str(exc)
    assert "\n" not in msg and "Traceback" not in msg, msg
    if display:
        assert display in msg
    return msg


def test_unknown_scheme_lists_the_known_ones():
    with pytest.raises(RemoteConfigError) as exc:
        open_remote("ftpx://host/path")
    msg = _one_line(exc.value)
    assert exc.value.exit_code == 2 and "unknown scheme ftpx://" in msg
    assert "s3://" in msg and "oci://" in msg and "file://" in msg
    with pytest.raises(RemoteConfigError, match="not a remote URL"):
        open_remote("just-a-path")


def test_scheme_without_its_library_names_the_extra():
    import importlib.util

    if importlib.util.find_spec("gcsfs") is not None:
        pytest.skip("gcsfs is installed here")
    with pytest.raises((RemoteConfigError, MissingBackendError)) as exc:
        open_remote("gs://bucket/prefix")
    assert exc.value.exit_code == 2 and "not installed" in _one_line(exc.value)


def test_credentials_in_the_url_are_refused_and_never_echoed():
    for url in ("s3://AKIAXXXX:qbuildSECRETurl@bucket/p", "oci://user:qbuildSECRETurl@registry.example/repo"):
        with pytest.raises(RemoteConfigError) as exc:
            open_remote(url)
        msg = _one_line(exc.value)
        assert "qbuildSECRET" not in msg and "AKIA" not in msg and "credentials in a remote URL" in msg


def test_bad_push_policy():
    with pytest.raises(RemoteConfigError, match="push: 'sometimes'"):
        open_remote("file:///tmp/x", push="sometimes")


def test_unreachable_s3_endpoint_fails_fast(s3_env, monkeypatch):
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{free_port()}")
    remote = open_remote(f"s3://{s3_env['bucket']}/x")
    t0 = time.monotonic()
    with pytest.raises(RemoteError) as exc:
        remote.check()
    assert time.monotonic() - t0 < 30
    assert "unreachable" in _one_line(exc.value, remote.display) and exc.value.exit_code == 1


def test_unreachable_registry_fails_fast():
    remote = open_remote(f"oci://127.0.0.1:{free_port()}/qbuild/x")
    t0 = time.monotonic()
    with pytest.raises(RemoteError) as exc:
        remote.check()
    assert time.monotonic() - t0 < 15
    assert "unreachable" in _one_line(exc.value, remote.display)


def test_missing_bucket(s3_env):
    remote = open_remote("s3://no-such-bucket-qbuild/prefix")
    with pytest.raises(RemoteError) as exc:
        remote.check()
    assert "not found" in _one_line(exc.value, remote.display)


def test_wrong_s3_credentials(s3_env, monkeypatch):
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "qbuildSECRET-wrong-" + uuid.uuid4().hex)
    remote = open_remote(f"s3://{s3_env['bucket']}/x")
    with pytest.raises(RemoteError) as exc:
        remote.check()
    msg = _one_line(exc.value, remote.display)
    assert "access denied" in msg and "qbuildSECRET" not in msg


def test_wrong_registry_credentials(oci_url, monkeypatch):
    monkeypatch.setenv("QBUILD_REGISTRY_USERNAME", "qbuild")
    monkeypatch.setenv("QBUILD_REGISTRY_PASSWORD", "qbuildSECRET-wrong")
    remote = open_remote(oci_url)
    with pytest.raises(RemoteError) as exc:
        remote.check()
    msg = _one_line(exc.value, remote.display)
    assert "authentication failed" in msg and "qbuildSECRET" not in msg


def test_registry_without_credentials(oci_url, monkeypatch, tmp_path):
    monkeypatch.setenv("DOCKER_CONFIG", str(tmp_path))  # an empty docker config
    monkeypatch.setenv("HOME", str(tmp_path))
    remote = open_remote(oci_url)
    with pytest.raises(RemoteError) as exc:
        remote.check()
    assert "requires credentials" in _one_line(exc.value, remote.display)


def test_missing_repository_is_a_miss_not_an_error(oci_url):
    remote = open_remote(oci_url)
    remote.check()
    assert not remote.repository_exists()
    assert remote.get_action("0" * 64) is None and remote.get_manifest("0" * 64) is None
    assert remote.list_objects() == [] and remote.list_refs() == []
    with pytest.raises(RemoteError) as exc:
        remote.fetch_object("0" * 64, "/tmp/never")
    assert "no object" in _one_line(exc.value, remote.display)


def test_s3_server_failing_mid_upload(s3_env, tmp_path):
    store = Store(tmp_path / "a")
    hit = make_object(store, model_files(4 << 20, seed=7))
    url = f"s3://{s3_env['bucket']}/faulty-{uuid.uuid4().hex[:6]}"
    proxy = FaultProxy(s3_env["port"], cut_after=1 << 20)
    try:
        faulty = open_remote(url, endpoint_url=f"http://127.0.0.1:{proxy.port}")
        faulty.check()  # small requests pass
        with pytest.raises(RemoteError) as exc:
            faulty.put_object(hit.digest, hit.path, store.manifest(hit.digest))
        _one_line(exc.value, faulty.display)
        assert proxy.cuts >= 1
    finally:
        proxy.close()
    direct = open_remote(url)
    assert direct.get_manifest(hit.digest) is None and not direct.has_object(hit.digest)
    assert direct.list_objects() == [] and direct.get_action(hit.key) is None
    direct.put_object(hit.digest, hit.path, store.manifest(hit.digest))  # the next run completes it
    direct.put_action(hit.key, hit.record)
    assert direct.get_action(hit.key)["digest"] == hit.digest


def test_registry_failing_mid_upload(oci_env, tmp_path, monkeypatch):
    store = Store(tmp_path / "a")
    hit = make_object(store, model_files(4 << 20, seed=int.from_bytes(os.urandom(4), "little")))
    monkeypatch.setenv("QBUILD_REGISTRY_USERNAME", oci_env["user"])
    monkeypatch.setenv("QBUILD_REGISTRY_PASSWORD", oci_env["password"])
    repo = f"qbuild/faulty-{uuid.uuid4().hex[:6]}"
    proxy = FaultProxy(oci_env["port"], cut_after=1 << 20)
    try:
        faulty = open_remote(f"oci://127.0.0.1:{proxy.port}/{repo}")
        with pytest.raises(RemoteError) as exc:
            faulty.put_object(hit.digest, hit.path, store.manifest(hit.digest))
        msg = _one_line(exc.value, faulty.display)
        assert oci_env["password"] not in msg
    finally:
        proxy.close()
    direct = open_remote(f"oci://{oci_env['host']}/{repo}")
    assert direct.get_manifest(hit.digest) is None and not direct.has_object(hit.digest)
    assert direct.get_action(hit.key) is None
    direct.put_object(hit.digest, hit.path, store.manifest(hit.digest))
    direct.put_action(hit.key, hit.record)
    assert direct.get_action(hit.key)["digest"] == hit.digest


def test_not_enough_disk_space_is_caught_before_the_download(tmp_path, monkeypatch):
    store = Store(tmp_path / "a")
    hit = make_object(store, model_files())
    remote = open_remote(f"file://{tmp_path / 'remote'}")
    remote.check()
    remote.put_object(hit.digest, hit.path, store.manifest(hit.digest))
    import shutil as _shutil

    real = _shutil.disk_usage
    monkeypatch.setattr("qbuild.artifacts.remote.base.shutil.disk_usage",
                        lambda p: real(p)._replace(free=1000))
    out = tmp_path / "out" / "model"
    with pytest.raises(RemoteError) as exc:
        remote.fetch_object(hit.digest, out)
    assert "not enough disk space" in _one_line(exc.value, remote.display) and not out.exists()
    assert remote.stats["bytes_down"] == 0


FILL_CHILD = """
import sys, json
from pathlib import Path
from qbuild.artifacts.remote import open_remote, RemoteError
mount, url, digest = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
filled = []
def progress(done, total):
    if not filled:  # another process takes the space after the free-space check
        filled.append(1)
        try:
            with open(mount / "filler", "wb") as f:
                f.write(b"x" * (8 << 20))
        except OSError:
            pass
remote = open_remote(url)
try:
    remote.fetch_object(digest, mount / "out", progress=progress, jobs=1)
    print(json.dumps({"ok": True}))
except RemoteError as exc:
    print(json.dumps({"ok": False, "msg": str(exc), "code": exc.exit_code,
                      "placed": (mount / "out").exists()}))
"""


def test_disk_full_while_pulling_then_resume(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root")
    store = Store(tmp_path / "a")
    hit = make_object(store, model_files(3 << 20, seed=3))
    remote_dir = tmp_path / "remote"
    remote = open_remote(f"file://{remote_dir}")
    remote.check()
    remote.put_object(hit.digest, hit.path, store.manifest(hit.digest))
    mount = tmp_path / "small"
    mount.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=5m", "tmpfs", str(mount)], capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here")
    try:
        proc = subprocess.run([sys.executable, "-c", FILL_CHILD, str(mount), remote.url, hit.digest],
                              capture_output=True, text=True, timeout=120,
                              env={**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])})
        out = json.loads(proc.stdout.strip().splitlines()[-1])
        assert not out["ok"] and "disk full while pulling" in out["msg"] and remote.display in out["msg"]
        assert out["code"] == 1 and not out["placed"] and "\n" not in out["msg"]
        (mount / "filler").unlink()
        resumed = open_remote(remote.url)
        resumed.fetch_object(hit.digest, mount / "out")
        assert all(r for r in ((mount / "out" / f["path"]).stat().st_size == f["size"]
                               for f in hit.record["files"]))
    finally:
        subprocess.run(["umount", str(mount)], capture_output=True)


def test_recipe_remote_sections(tmp_path):
    from pydantic import ValidationError

    from qbuild.errors import RecipeError
    from qbuild.planning.recipe import StoreConfig, parse_recipe

    from helpers import fake_recipe

    cfg = StoreConfig.model_validate({"remotes": ["s3://team/qbuild", {"url": "oci://localhost:5000/ml/q",
                                                                      "name": "reg", "push": "always"}]})
    assert [r.push for r in cfg.remotes] == ["on-success", "always"] and cfg.remotes[1].display_name == "reg"
    assert cfg.remotes[1].open().plain_http
    with pytest.raises(ValidationError, match="credentials in a remote URL") as exc:
        StoreConfig.model_validate({"remotes": ["s3://AKIA:qbuildSECRET@b/p"]})
    assert "qbuildSECRET" not in str(exc.value)
    with pytest.raises(ValidationError):
        StoreConfig.model_validate({"remotes": [{"url": "s3://b/p", "aws_secret_access_key": "x"}]})
    # through the recipe: one line naming the field, never the secret
    data = fake_recipe(tmp_path, [{"name": "a", "method": "fake"}], store={"remotes": ["s3://AKIA:qbuildSECRET@b/p"]})
    with pytest.raises(RecipeError) as exc:
        parse_recipe(data)
    assert "store.remotes" in str(exc.value) and "qbuildSECRET" not in str(exc.value)
    recipe = parse_recipe(fake_recipe(tmp_path, [{"name": "a", "method": "fake"}],
                                      register={"alias": "prod"}))
    assert recipe.model_registry.model_name("demo", "q4km") == "demo-q4km" and recipe.model_registry.alias == "prod"


def test_registry_credentials_from_a_docker_credential_helper(oci_url, oci_env, tmp_path, monkeypatch):
    """credHelpers in the docker config: the password comes from `docker-credential-<helper> get`, never stored."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    helper = bin_dir / "docker-credential-qbtest"
    helper.write_text("#!/bin/sh\ncat >/dev/null\nprintf '%s' \"$QBTEST_CRED\"\n")
    helper.chmod(0o755)
    cfg = tmp_path / "docker"
    cfg.mkdir()
    (cfg / "config.json").write_text(json.dumps({"credHelpers": {oci_env["host"]: "qbtest"}}))
    monkeypatch.setenv("DOCKER_CONFIG", str(cfg))
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("QBTEST_CRED", json.dumps({"Username": oci_env["user"], "Secret": oci_env["password"]}))
    store = Store(tmp_path / "a")
    hit = make_object(store, {"model.gguf": b"weights"})
    remote = open_remote(oci_url)
    remote.put_object(hit.digest, hit.path, store.manifest(hit.digest))
    assert remote.has_object(hit.digest)
    assert oci_env["password"] not in (cfg / "config.json").read_text()
