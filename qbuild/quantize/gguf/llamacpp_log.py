"""llama.cpp's log while qbuild calls the library in-process (llama_model_quantize): it goes on into the step's log
as llama-cpp-python sends it, and its last bytes are kept, so a call that fails says why
(qbuild.base.tool_run.ToolFailed) instead of only its return code."""

from __future__ import annotations

import ctypes
from collections.abc import Iterator
from contextlib import contextmanager

from qbuild.plugins import OutputTail


@contextmanager
def llama_log_tail() -> Iterator[OutputTail]:
    """While inside: every llama.cpp log message is kept in the yielded tail, then passed to llama-cpp-python's own
    callback (which prints what its verbosity allows). Its callback is back in place on the way out."""
    import llama_cpp
    from llama_cpp import _logger

    tail = OutputTail()

    @llama_cpp.llama_log_callback
    def keep(level, text, user_data):
        tail.add(text or b"")
        _logger.llama_log_callback(level, text, user_data)

    llama_cpp.llama_log_set(keep, ctypes.c_void_p(0))
    try:
        yield tail
    finally:
        llama_cpp.llama_log_set(_logger.llama_log_callback, ctypes.c_void_p(0))
