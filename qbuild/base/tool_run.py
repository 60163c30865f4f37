"""Running an external tool from a step, and saying why it failed.

A step's tools (llama.cpp's converter, llama-imatrix, trtllm-build, the vLLM and TensorRT-LLM shims...) write into
the step's log as they run. When one fails, the step's one-line error must say why, not "see the log": `run_tool`
keeps the last bytes of the tool's output as they pass into the log, and raises `ToolFailed` with the lines that
matter: the error the tool ended with (a Python traceback's final exception line, else its last line that says
error/failed) and a few lines before it, each cut to a bounded length. The run summary prints the first line of the
error with the step's name and log, and the tool's lines under it.
"""

from __future__ import annotations

import re
import subprocess
import sys

from qbuild.base.names import redact_url

TAIL_BYTES = 64 * 1024     # of the tool's output, kept to find its error in (the log has all of it)
CONTEXT_LINES = 4          # lines shown before the error line
LINE_CHARS = 300           # each shown line cut to this

# a Python exception line: `ValueError: ...`, `torch.OutOfMemoryError: ...`, `KeyboardInterrupt`
_EXCEPTION = re.compile(r"^(?:[A-Za-z_][\w]*\.)*[A-Za-z_]\w*(?:Error|Exception|Exit|Interrupt|Failure)\b(?::|$)")
_SAYS_ERROR = re.compile(r"\b(?:error|failed|fatal|abort(?:ed|ing)?|exception|cannot|unable)\b", re.IGNORECASE)
_ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
# an error that only points at another one (vLLM's engine and worker processes: the cause was raised in a child and
# logged above), and an exception named inside a logger's line ("(Worker pid=7) ERROR ... ValueError: ...")
_POINTER = re.compile(r"root cause above|stack trace for root cause|Worker failed with error", re.IGNORECASE)
_LOGGED_EXCEPTION = re.compile(r"\b((?:[A-Za-z_]\w*\.)*[A-Za-z_]\w*(?:Error|Exception): \S.*)$")


class ToolFailed(RuntimeError):
    """A tool exited non-zero: `what`, its exit code, and the last lines of its output that say why."""

    def __init__(self, what: str, code: int, lines: list[str], ended: str = "exited with code"):
        self.what, self.code, self.lines = what, code, lines
        head = f"{what} {ended} {code}"
        head += f": {lines[-1].strip()}" if lines else " and printed nothing"
        super().__init__("\n".join([head, *("  | " + line for line in lines[:-1])]) if lines else head)


def failure_lines(output: str) -> list[str]:
    """The lines of a failed tool's output that say why, in order, the error line last: its last line that is a
    Python exception (a traceback's final line) or says error/failed/..., else its last line; with up to
    CONTEXT_LINES lines before it. Blank lines and terminal colours are left out."""
    lines = [_ANSI.sub("", line).rstrip() for line in re.split(r"\r\n|\r|\n", output)]
    lines = [line for line in lines if line.strip()]
    if not lines:
        return []
    last = next((i for i in range(len(lines) - 1, -1, -1)
                 if _EXCEPTION.match(lines[i]) or _SAYS_ERROR.search(lines[i])), len(lines) - 1)
    shown = lines[max(0, last - CONTEXT_LINES): last + 1]
    cause = pointed_cause(lines[: last + 1])
    if cause:   # the error says its cause is further up: that one becomes the error line
        shown = [*shown, cause]
    return [redact_url(_cut(line)) for line in shown]


def pointed_cause(lines: list[str]) -> str | None:
    """When the last line is an error that points at another one logged above it ("See root cause above"), that
    exception's line (e.g. vLLM's worker: "ValueError: Failed to find a kernel ..."); else None."""
    if not lines or not _POINTER.search(lines[-1]):
        return None
    return next((m.group(1) for line in reversed(lines[:-1]) if not _POINTER.search(line)
                 for m in [_LOGGED_EXCEPTION.search(line)] if m), None)


def _cut(line: str) -> str:
    return line if len(line) <= LINE_CHARS else line[: LINE_CHARS - 1] + "…"


class OutputTail:
    """The last TAIL_BYTES of what passed through, to find the error in."""

    def __init__(self):
        self.data = bytearray()

    def add(self, chunk: bytes) -> None:
        self.data += chunk
        if len(self.data) > 2 * TAIL_BYTES:
            del self.data[:-TAIL_BYTES]

    def lines(self) -> list[str]:
        return failure_lines(bytes(self.data[-TAIL_BYTES:]).decode("utf-8", errors="replace"))


def _write_through(chunk: bytes) -> None:
    """Into this process's stdout (a step's log) as it comes."""
    buffer = getattr(sys.stdout, "buffer", None)
    if buffer is not None:
        buffer.write(chunk)
        buffer.flush()
    else:   # a text stream with no bytes layer (a test's capture)
        sys.stdout.write(chunk.decode("utf-8", errors="replace"))
        sys.stdout.flush()


def run_tool(cmd: list[str], what: str, env: dict | None = None, cwd: str | None = None) -> None:
    """Run `cmd` (named `what` in errors), its stdout and stderr into this process's stdout as they come; on a
    non-zero exit raise ToolFailed with the lines that say why. An exception here (Ctrl-C, a cancelled step)
    kills the tool first."""
    sys.stdout.flush()
    tail = OutputTail()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                            env=env, cwd=cwd)
    try:
        assert proc.stdout is not None
        while chunk := proc.stdout.read1(65536):
            tail.add(chunk)
            _write_through(chunk)
        code = proc.wait()
    except BaseException:
        proc.kill()
        proc.wait()
        raise
    finally:
        proc.stdout.close()
    if code != 0:
        raise ToolFailed(what, code, tail.lines())
