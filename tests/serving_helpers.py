"""What the serving tests look at: servers left running and ports left listening, read from /proc."""

from __future__ import annotations

import os
import socket
from pathlib import Path


def processes_with(marker: str) -> list[int]:
    """PIDs (not zombies) whose command line contains `marker`, this test process excluded."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmd = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if marker in cmd and state != "Z":
            found.append(int(entry.name))
    return found


def port_of(pid: int) -> int | None:
    try:
        args = (Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0"))
    except OSError:
        return None
    for a, b in zip(args, args[1:], strict=False):
        if a == b"--port":
            return int(b)
    return None


def listening(port: int) -> list[str]:
    """Local addresses (hex, as /proc/net/tcp{,6} write them) listening on `port`."""
    out = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            parts = line.split()
            addr, state = parts[1], parts[3]
            if state == "0A" and int(addr.rsplit(":", 1)[1], 16) == port:
                out.append(addr.rsplit(":", 1)[0])
    return out


def connectable(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(1)
        return s.connect_ex(("127.0.0.1", port)) == 0


LOOPBACK = "0100007F"   # 127.0.0.1 in /proc/net/tcp


def llama_server_bin():
    """The built llama-server's folder; the calling test is skipped without llama-cpp-python, httpx or the build."""
    import pytest

    pytest.importorskip("llama_cpp")
    pytest.importorskip("httpx")
    from qbuild.models.llamacpp_toolchain import cached_bin_dir

    found = cached_bin_dir()
    if found is None:
        pytest.skip("llama-server is not built yet (scripts/install.sh builds it)")
    return found
