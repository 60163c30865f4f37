"""A push killed (kill -9) in the middle of a large file continues where it stopped (issue 33): on a file://
remote from its partial file, on S3 (moto) from its multipart upload's parts, on an OCI registry (docker-registry)
from its upload session. The local store remembers each unfinished upload; what the remote holds is checked
against the local file before it is continued, and the object that arrives is the local one, byte for byte."""

from __future__ import annotations

import json
import uuid
from pathlib import Path

from remote_common import make_object, model_files, run_child

from qbuild import api
from qbuild.artifacts.remote import open_remote
from qbuild.artifacts.remote.cache import push_hit
from qbuild.artifacts.remote.resume import store_resume
from qbuild.artifacts.store import Store

WEIGHTS = "model.safetensors"
MB = 1 << 20


def push_in_child(store: Store, url: str, digest: str, key: str, kill_when) -> None:
    """`push_hit` in another process, killed with SIGKILL as soon as `kill_when()` says enough has arrived."""
    code = ("import qbuild.artifacts.remote.oci as oci; oci.UPLOAD_CHUNK = 4 << 20\n"   # many chunks: killable
            "from qbuild.artifacts.remote import open_remote\n"
            "from qbuild.artifacts.remote.cache import push_hit\n"
            "from qbuild.artifacts.store import Store\n"
            f"push_hit(open_remote({url!r}), Store({str(store.root)!r}), {key!r}, {digest!r})\n")
    result = run_child(code, kill_when=kill_when)
    assert result is None, f"the push ended before it could be killed: {result and result.stderr[-400:]}"


def push_again_and_check(store: Store, url: str, hit, tmp_path: Path) -> dict:
    remote = open_remote(url)
    assert push_hit(remote, store, hit.key, hit.digest)
    _, pulled = api.pull(hit.digest, remote=url, out=tmp_path / "pulled")
    assert (pulled / WEIGHTS).read_bytes() == (hit.path / WEIGHTS).read_bytes()
    assert not list((store.root / "tmp" / "uploads").glob("*.json"))   # every record dropped once done
    return remote.stats


def big_object(tmp_path: Path, size: int):
    store = Store(tmp_path / "store")
    return store, make_object(store, model_files(size=size, seed=int.from_bytes(uuid.uuid4().bytes[:4], "little")))


def test_a_killed_push_to_a_file_remote_continues_its_partial_file(tmp_path):
    store, hit = big_object(tmp_path, 400 * MB)
    remote_dir = tmp_path / "remote"
    url = f"file://{remote_dir}"

    def partial() -> list[Path]:
        return [p for p in remote_dir.rglob(f".{WEIGHTS}.*.part")] if remote_dir.exists() else []

    push_in_child(store, url, hit.digest, hit.key, lambda: any(p.stat().st_size >= 40 * MB for p in partial()))
    [part] = partial()
    there = part.stat().st_size
    stats = push_again_and_check(store, url, hit, tmp_path)
    assert stats["bytes_resumed"] >= there - 1 * MB   # a chunk being written when it was killed may be redone
    assert not partial()


def test_a_partial_file_that_is_not_the_local_files_start_is_not_continued(tmp_path):
    store, hit = big_object(tmp_path, 64 * MB)
    remote_dir = tmp_path / "remote"
    url = f"file://{remote_dir}"
    remote = open_remote(url)
    name = f".{WEIGHTS}.{uuid.uuid4().hex[:12]}.part"
    partial = remote_dir / "objects" / hit.digest[:2] / hit.digest / name
    partial.parent.mkdir(parents=True)
    partial.write_bytes(b"\0" * (10 * MB))   # someone else's bytes under a remembered name
    store_resume(store).put(remote.display, hit.digest, WEIGHTS, {"part": name})
    stats = push_again_and_check(store, url, hit, tmp_path)
    assert stats["bytes_resumed"] == 0


def test_a_record_naming_a_path_outside_the_object_is_never_used(tmp_path):
    store, hit = big_object(tmp_path, 40 * MB)
    victim = tmp_path / "victim.txt"
    victim.write_text("keep me")
    url = f"file://{tmp_path / 'remote'}"
    store_resume(store).put(open_remote(url).display, hit.digest, WEIGHTS, {"part": "../../../../victim.txt"})
    push_again_and_check(store, url, hit, tmp_path)
    assert victim.read_text() == "keep me"


def test_a_killed_push_to_s3_continues_its_multipart_upload(s3_url, s3_env, tmp_path):
    import boto3

    store, hit = big_object(tmp_path, 96 * MB)
    s3 = boto3.client("s3", endpoint_url=s3_env["endpoint"], region_name="us-east-1",
                      aws_access_key_id=s3_env["key"], aws_secret_access_key=s3_env["secret"])
    bucket = s3_env["bucket"]
    prefix = s3_url.split("/", 3)[3]

    def parts_done() -> int:
        uploads = s3.list_multipart_uploads(Bucket=bucket, Prefix=prefix).get("Uploads", [])
        return sum(len(s3.list_parts(Bucket=bucket, Key=u["Key"], UploadId=u["UploadId"]).get("Parts", []))
                   for u in uploads)

    push_in_child(store, s3_url, hit.digest, hit.key, lambda: parts_done() >= 4)
    done = parts_done()
    stats = push_again_and_check(store, s3_url, hit, tmp_path)
    assert stats["bytes_resumed"] >= done * 8 * MB
    assert s3.list_multipart_uploads(Bucket=bucket, Prefix=prefix).get("Uploads", []) == []


def test_a_stale_multipart_record_starts_a_new_upload(s3_url, tmp_path):
    store, hit = big_object(tmp_path, 40 * MB)
    remote = open_remote(s3_url)
    key = remote.fs.split_path(remote._obj(hit.digest, WEIGHTS))[1]
    store_resume(store).put(remote.display, hit.digest, WEIGHTS,
                            {"upload_id": "no-such-upload", "key": key, "part_size": 8 * MB})
    assert push_again_and_check(store, s3_url, hit, tmp_path)["bytes_resumed"] == 0


def test_a_push_killed_between_chunks_continues_its_registry_session(oci_env, registry, tmp_path):
    """The push process kills itself (SIGKILL) right after the registry accepted its fourth 4 MB chunk: the next
    push asks the session how far it got and sends only the rest."""
    store, hit = big_object(tmp_path, 40 * MB)
    url = f"oci://{registry['host']}/qbuild/resume-{uuid.uuid4().hex[:6]}"
    code = ("import os, signal\n"
            "import qbuild.artifacts.remote.oci as oci; oci.UPLOAD_CHUNK = 4 << 20\n"
            "from qbuild.artifacts.remote import resume\n"
            "real, calls = resume.UploadResume.put, []\n"
            "def put(self, *args):\n"
            "    real(self, *args); calls.append(1)\n"
            "    if len(calls) == 5: os.kill(os.getpid(), signal.SIGKILL)   # the session opened, 4 chunks sent\n"
            "resume.UploadResume.put = put\n"
            "from qbuild.artifacts.remote import open_remote\n"
            "from qbuild.artifacts.remote.cache import push_hit\n"
            "from qbuild.artifacts.store import Store\n"
            f"push_hit(open_remote({url!r}), Store({str(store.root)!r}), {hit.key!r}, {hit.digest!r})\n")
    assert run_child(code).returncode == -9
    records = [json.loads(p.read_text()) for p in (store.root / "tmp" / "uploads").glob("*.json")]
    assert len(records) == 1 and registry["password"] not in json.dumps(records)
    stats = push_again_and_check(store, url, hit, tmp_path)
    assert stats["bytes_resumed"] == 16 * MB


def test_a_push_killed_mid_chunk_still_arrives_whole(oci_env, registry, tmp_path):
    """docker-registry (distribution) refuses a session whose last chunk was cut off part-way (BLOB_UPLOAD_INVALID:
    its stored bytes no longer match the session's offset): the next push opens a new session, and what arrives is
    the local file."""
    store, hit = big_object(tmp_path, 40 * MB)
    repo = f"qbuild/resume-{uuid.uuid4().hex[:6]}"
    url = f"oci://{registry['host']}/{repo}"
    uploads = registry["data"] / "docker" / "registry" / "v2" / "repositories" / repo / "_uploads"

    def received() -> int:
        return max((p.stat().st_size for p in uploads.glob("*/data")), default=0) if uploads.exists() else 0

    push_in_child(store, url, hit.digest, hit.key, lambda: received() >= 10 * MB)
    push_again_and_check(store, url, hit, tmp_path)
