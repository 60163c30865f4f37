"""Real servers for the remote-store tests, each on 127.0.0.1, started once per session and stopped after.

- moto_s3:   moto's ThreadedMotoServer with authentication on (an IAM user with S3 rights, a bucket)
- registry:  Debian's docker-registry (CNCF distribution 2.8) with htpasswd auth, deletes enabled
- mlflow:    `mlflow server --backend-store-uri sqlite:///...`
- FaultProxy: a TCP proxy that cuts every connection after N bytes from the client (fault injection)
tests/conftest.py imports the fixtures once, so each server starts at most once per test session.
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
import urllib.request
import uuid
import warnings

import pytest

REGISTRY_BIN = shutil.which("docker-registry") or ("/usr/bin/docker-registry" if os.path.exists("/usr/bin/docker-registry")
                                                   else None)
SECRET_MARK = "qbuildSECRET"  # every planted secret contains it: grep for it


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_http(url: str, proc: subprocess.Popen | None = None, timeout: float = 60, ok=(200, 401)) -> None:
    deadline = time.time() + timeout
    while True:
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status in ok:
                    return
        except urllib.error.HTTPError as exc:
            if exc.code in ok:
                return
        except OSError:
            pass
        if time.time() > deadline or (proc is not None and proc.poll() is not None):
            raise RuntimeError(f"server at {url} did not start")
        time.sleep(0.3)


# --- S3 (moto) ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="session")
def moto_s3():
    pytest.importorskip("moto.server", reason="moto[server] is not installed (pip install 'qbuild[dev]')")
    pytest.importorskip("s3fs", reason="s3fs is not installed (pip install 'qbuild[s3]')")
    import boto3
    from moto.server import ThreadedMotoServer

    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    endpoint = f"http://127.0.0.1:{port}"
    try:
        boot = dict(endpoint_url=endpoint, region_name="us-east-1", aws_access_key_id="bootstrap",
                    aws_secret_access_key="bootstrap")
        iam = boto3.client("iam", **boot)
        iam.create_user(UserName="qbuild")
        iam.put_user_policy(UserName="qbuild", PolicyName="s3", PolicyDocument=json.dumps({
            "Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": "s3:*", "Resource": "*"}]}))
        key = iam.create_access_key(UserName="qbuild")["AccessKey"]
        boto3.client("s3", **boot).create_bucket(Bucket="qbuild-test")
        # from here on every request must be signed with the IAM user's key
        req = urllib.request.Request(f"{endpoint}/moto-api/reset-auth", data=b"0", method="POST",
                                     headers={"Content-Type": "text/plain"})
        urllib.request.urlopen(req, timeout=10).read()
        yield {"endpoint": endpoint, "port": port, "bucket": "qbuild-test", "key": key["AccessKeyId"],
               "secret": key["SecretAccessKey"]}
    finally:
        server.stop()


@pytest.fixture
def s3_env(moto_s3, monkeypatch):
    """Credentials and endpoint the way a user sets them: only in the environment."""
    for var in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL_S3", "AWS_CONFIG_FILE",
                "AWS_SHARED_CREDENTIALS_FILE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", moto_s3["key"])
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", moto_s3["secret"])
    monkeypatch.setenv("AWS_ENDPOINT_URL", moto_s3["endpoint"])
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", os.devnull)
    monkeypatch.setenv("AWS_CONFIG_FILE", os.devnull)
    return moto_s3


@pytest.fixture
def s3_url(s3_env, request):
    return f"s3://{s3_env['bucket']}/{request.node.name[:40].replace('[', '-').replace(']', '')}-{uuid.uuid4().hex[:6]}"


# --- OCI registry (CNCF distribution) ----------------------------------------------------------------------
REGISTRY_CONFIG = """version: 0.1
log:
  level: error
  accesslog:
    disabled: true
storage:
  filesystem:
    rootdirectory: {root}
  delete:
    enabled: true
http:
  addr: 127.0.0.1:{port}
  secret: {secret}
auth:
  htpasswd:
    realm: qbuild-test
    path: {htpasswd}
"""


def _bcrypt(password: str) -> str | None:
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            import crypt  # libxcrypt's bcrypt; cost 4 keeps per-request checks cheap

            return crypt.crypt(password, crypt.mksalt(crypt.METHOD_BLOWFISH, rounds=16))
    except (ImportError, AttributeError, ValueError):
        pass
    try:
        import bcrypt

        return bcrypt.hashpw(password.encode(), bcrypt.gensalt(4)).decode()
    except ImportError:
        return None


@pytest.fixture(scope="session")
def registry(tmp_path_factory):
    if REGISTRY_BIN is None:
        pytest.skip("docker-registry is not installed (apt-get install docker-registry)")
    pytest.importorskip("oras", reason="oras is not installed (pip install 'qbuild[oci]')")
    root = tmp_path_factory.mktemp("registry")
    user, password = "qbuild", f"{SECRET_MARK}-registry-{uuid.uuid4().hex[:8]}"
    hashed = _bcrypt(password)
    if hashed is None:
        pytest.skip("no bcrypt implementation to write the registry's htpasswd file")
    (root / "htpasswd").write_text(f"{user}:{hashed}\n")
    port = free_port()
    (root / "config.yml").write_text(REGISTRY_CONFIG.format(root=root / "data", port=port, secret=uuid.uuid4().hex,
                                                            htpasswd=root / "htpasswd"))
    docker_config = root / "docker"
    docker_config.mkdir()
    auth = base64.b64encode(f"{user}:{password}".encode()).decode()
    (docker_config / "config.json").write_text(json.dumps({"auths": {f"127.0.0.1:{port}": {"auth": auth}}}))
    log = open(root / "registry.log", "wb")  # noqa: SIM115 - held open for the server's lifetime
    proc = subprocess.Popen([REGISTRY_BIN, "serve", str(root / "config.yml")], stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_http(f"http://127.0.0.1:{port}/v2/", proc)
        yield {"host": f"127.0.0.1:{port}", "port": port, "root": root, "data": root / "data", "user": user,
               "password": password, "docker_config": docker_config, "log": root / "registry.log"}
    finally:
        proc.terminate()
        proc.wait(timeout=20)
        log.close()


@pytest.fixture
def oci_env(registry, monkeypatch):
    monkeypatch.setenv("DOCKER_CONFIG", str(registry["docker_config"]))
    monkeypatch.delenv("QBUILD_REGISTRY_USERNAME", raising=False)
    monkeypatch.delenv("QBUILD_REGISTRY_PASSWORD", raising=False)
    return registry


@pytest.fixture
def oci_url(oci_env, request):
    name = "".join(c if c.isalnum() else "-" for c in request.node.name.lower())[:40].strip("-")
    return f"oci://{oci_env['host']}/qbuild/{name}-{uuid.uuid4().hex[:6]}"


# --- MLflow -----------------------------------------------------------------------------------------------
@pytest.fixture(scope="session")
def mlflow_server(tmp_path_factory):
    pytest.importorskip("mlflow", reason="mlflow is not installed (pip install 'qbuild[mlflow]')")
    root = tmp_path_factory.mktemp("mlflow")
    port = free_port()
    db = root / "server.db"
    log = open(root / "server.log", "wb")  # noqa: SIM115 - held open for the server's lifetime
    proc = subprocess.Popen(
        [sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(port),
         "--backend-store-uri", f"sqlite:///{db}", "--artifacts-destination", str(root / "artifacts"),
         "--workers", "1"], stdout=log, stderr=subprocess.STDOUT, cwd=root)
    try:
        wait_http(f"http://127.0.0.1:{port}/health", proc, timeout=120, ok=(200,))
        yield {"uri": f"http://127.0.0.1:{port}", "db": db, "root": root}
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        log.close()


# --- fault injection ------------------------------------------------------------------------------------------
class FaultProxy:
    """127.0.0.1 TCP proxy to `target_port`. With cut_after=N, a connection is reset once the client has sent
    more than N bytes (a server failing mid-upload). Accepts a bounded number of connections."""

    def __init__(self, target_port: int, cut_after: int | None = None, max_connections: int = 200):
        self.target_port, self.cut_after, self.max_connections = target_port, cut_after, max_connections
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.port = self.sock.getsockname()[1]
        self.cuts = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        self.sock.settimeout(0.2)
        served = 0
        while not self._stop.is_set() and served < self.max_connections:
            try:
                client, _ = self.sock.accept()
            except (TimeoutError, OSError):
                continue
            served += 1
            threading.Thread(target=self._pipe_pair, args=(client,), daemon=True).start()

    def _pipe_pair(self, client: socket.socket) -> None:
        try:
            upstream = socket.create_connection(("127.0.0.1", self.target_port), timeout=10)
        except OSError:
            client.close()
            return
        sent = [0]

        def pump(src, dst, count: bool):
            try:
                while True:
                    data = src.recv(65536)
                    if not data:
                        break
                    if count and self.cut_after is not None:
                        sent[0] += len(data)
                        if sent[0] > self.cut_after:
                            self.cuts += 1
                            client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
                            break
                    dst.sendall(data)
            except OSError:
                pass
            finally:
                for s in (client, upstream):
                    try:
                        s.close()
                    except OSError:
                        pass

        threading.Thread(target=pump, args=(upstream, client, False), daemon=True).start()
        pump(client, upstream, True)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self.sock.close()


__all__ = ["moto_s3", "s3_env", "s3_url", "registry", "oci_env", "oci_url", "mlflow_server", "FaultProxy",
           "free_port", "SECRET_MARK"]
