"""What a signature binds: the object and the names it was published under. Through the CLI on a file:// remote:
a ref moved onto another signed artifact is refused by `pull --verify-with`, which says what it verified."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from qbuild.artifacts import signing

from helpers import fake_recipe, qbuild, write_recipe

pytest.importorskip("model_signing", reason="model-signing is not installed (pip install 'qbuild[sign]')")


def _ok(res):
    assert res.returncode == 0, res.stderr[-3000:] + res.stdout[-2000:]
    assert "Traceback" not in res.stderr
    return res


def _tree(*roots: Path) -> dict[str, bytes]:
    return {str(p): p.read_bytes() for root in roots for p in sorted(root.rglob("*")) if p.is_file()}


def _refused(res, *needles: str) -> str:
    assert res.returncode != 0, res.stdout
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "Traceback" not in res.stderr, res.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


@pytest.fixture
def key(tmp_path):
    key = tmp_path / "keys" / "team.key"
    _ok(qbuild("keygen", key))
    return key


def _digest(store: Path, name: str) -> str:
    return json.loads(_ok(qbuild("show", name, "--store", store)).stdout)["digest"]


def test_pull_refuses_a_ref_copied_onto_another_signed_artifact(tmp_path, key):
    data = fake_recipe(tmp_path, [{"name": "a", "method": "fake"}, {"name": "b", "method": "fake", "level": 2}])
    recipe = write_recipe(tmp_path / "r.yaml", data)
    store, share = tmp_path / "store", tmp_path / "share"
    remote = f"file://{share}"
    _ok(qbuild(recipe, "--store", store))
    for v in "ab":
        _ok(qbuild("push", f"t/{v}", "--to", remote, "--store", store, env={signing.ENV_KEY: str(key)}))
    digest_b = _digest(store, "t/b")
    # whoever can write the remote copies t/b's ref over t/a's: both artifacts carry valid signatures by one key
    shutil.copyfile(share / "refs" / "t" / "b" / "latest", share / "refs" / "t" / "a" / "latest")
    before = _tree(share, store)
    out = tmp_path / "a-out"
    line = _refused(qbuild("pull", "t/a", "--from", remote, "-o", out, "--verify-with", f"{key}.pub"),
                    "signature is for t/b", "not t/a", digest_b[:12])
    assert "refusing it" in line
    assert not out.exists() and not list(tmp_path.glob(".a-out*")) and _tree(share, store) == before
    # the artifact under its own name, and by digest: accepted, and the pull says what it verified
    res = _ok(qbuild("pull", "t/b", "--from", remote, "-o", tmp_path / "b-out", "--verify-with", f"{key}.pub"))
    assert f"signature verified with {key}.pub: t/b (object {digest_b})" in res.stderr
    res = _ok(qbuild("pull", digest_b, "--from", remote, "-o", tmp_path / "d-out", "--verify-with", f"{key}.pub"))
    assert f": object {digest_b} (t/b)" in res.stderr
    # a legacy statement (signed before names were recorded) binds its own recipe/variant
    statement = json.loads((tmp_path / "b-out" / ".qbuild" / signing.STATEMENT).read_text())
    assert signing.signed_names(statement) == ["t/b"]
    del statement["predicate"]["buildDefinition"]["externalParameters"]["names"]
    assert signing.signed_names(statement) == ["t/b"]


def test_every_name_of_a_shared_object_is_signed_and_a_new_name_is_signed_on_push(tmp_path, key):
    """Identical variants share one object: the run signs it for both names. A name given later (qbuild tag on the
    remote) is not signed until it is pushed with the key; that push keeps the names the old signature bound."""
    share = tmp_path / "share"
    remote = f"file://{share}"
    data = fake_recipe(tmp_path, [{"name": "a", "method": "fake"}, {"name": "a2", "method": "fake"}],
                       store={"remotes": [{"url": remote, "name": "team"}]})
    recipe = write_recipe(tmp_path / "r.yaml", data)
    store = tmp_path / "store"
    _ok(qbuild(recipe, "--store", store, env={signing.ENV_KEY: str(key)}))
    digest = _digest(store, "t/a")
    assert _digest(store, "t/a2") == digest
    pub = f"{key}.pub"
    for v in ("a", "a2"):
        res = _ok(qbuild("pull", f"t/{v}", "--from", remote, "-o", tmp_path / f"{v}-out", "--verify-with", pub))
        assert f"t/{v} (object {digest})" in res.stderr
    _ok(qbuild("tag", "t/a", "t/z:prod", "--remote", remote))
    _refused(qbuild("pull", "t/z:prod", "--from", remote, "-o", tmp_path / "z-out", "--verify-with", pub),
             "signature is for t/a, t/a2", "not t/z")
    _ok(qbuild("tag", "t/a", "t/z:prod", "--store", store))
    _ok(qbuild("push", "t/z:prod", "--to", remote, "--store", store, env={signing.ENV_KEY: str(key)}))
    for v in ("z:prod", "a", "a2"):
        out = tmp_path / f"{v.replace(':', '-')}-again"
        _ok(qbuild("pull", f"t/{v}", "--from", remote, "-o", out, "--verify-with", pub))
    # a signature the remote carries that this key did not make is not trusted for its names
    other = tmp_path / "keys" / "other.key"
    _ok(qbuild("keygen", other))
    _ok(qbuild("tag", "t/a", "t/y:prod", "--store", store))
    _ok(qbuild("push", "t/y:prod", "--to", remote, "--store", store, env={signing.ENV_KEY: str(other)}))
    statement = json.loads((share / "sidecars" / digest[:2] / digest / signing.STATEMENT).read_text())
    assert signing.signed_names(statement) == ["t/a", "t/y"]   # its own name and the pushed one, nothing kept
