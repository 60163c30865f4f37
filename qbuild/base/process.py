"""How a qbuild process ends: without Python's module teardown, and on Ctrl-C at any moment with one line and 130.

Both the command line and a step's worker end through `exit_without_teardown`. The command line also guards
SIGINT from its first line on (`guard_interrupts`, before qbuild.cli is even imported): a Ctrl-C raises
KeyboardInterrupt as usual, so a running build cancels its workers and removes their scratch, and it is also
remembered, so an interrupt that a library turned into another error (pydantic wraps one that lands in a class
body into a RuntimeError) still ends as `qbuild: interrupted`, exit 130. Once the command's work is done, a
Ctrl-C exits 130 at once with one line: Python's own teardown, where an interrupt once ended the process by
SIGINT with no word (2 of 16 tries), never runs.
"""

from __future__ import annotations

import os
import signal
import sys
from typing import NoReturn

EXIT_INTERRUPTED = 130
_interrupted = False


def _on_sigint(signum, frame) -> None:
    global _interrupted
    if _interrupted:   # a second Ctrl-C while the first one is handled: leave now
        leave_interrupted()
    _interrupted = True
    raise KeyboardInterrupt


def guard_interrupts() -> None:
    signal.signal(signal.SIGINT, _on_sigint)


def interrupted() -> bool:
    """Whether a Ctrl-C arrived in this process."""
    return _interrupted


def leave_interrupted(message: str = "qbuild: interrupted") -> NoReturn:
    try:
        sys.stderr.write(message + "\n")
        sys.stderr.flush()
    finally:
        os._exit(EXIT_INTERRUPTED)


def _late_sigint(signum, frame) -> None:
    leave_interrupted("qbuild: interrupted after the command finished: what it built is stored")


def finish(code: int) -> NoReturn:
    """End the command line with `code`: from here a Ctrl-C is one line and 130, never a traceback or a SIGINT exit."""
    signal.signal(signal.SIGINT, _late_sigint)
    exit_without_teardown(code)


def exit_without_teardown(code: int) -> NoReturn:
    """End the worker as Python's exit would, less freeing every module's objects one by one.

    With torch and transformers loaded that teardown takes ~1.2 s of each step's wall and CPU time, for memory
    the OS takes back at once. What exit does that can matter still happens, in its order: threading's exit
    hooks and a join of non-daemon threads, the atexit handlers (logging flushes its handlers, multiprocessing
    stops its children, weakref finalizers remove temporary directories), then every open file object that
    writes is flushed, so nothing a step wrote stays in a Python buffer."""
    import _io  # its C base class: isinstance against io.IOBase (an ABC) takes 0.5 s over a torch process's objects
    import atexit
    import gc
    import threading

    shutdown = getattr(threading, "_shutdown", None)   # what Py_FinalizeEx calls first
    if shutdown is not None:
        shutdown()
    atexit._run_exitfuncs()
    for obj in gc.get_objects():
        if isinstance(obj, _io._IOBase):
            try:
                if not obj.closed and obj.writable():
                    obj.flush()
            except Exception:   # a detached or broken stream: exit would not have written it either
                pass
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass
    os._exit(code)
