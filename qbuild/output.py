"""What the CLI prints and how it exits, in one place: tables and reports rendered from the API's data, sizes and
durations for people, redaction of anything that may hold a credential, and the process's interrupt handling.
qbuild/cli.py imports this module, qbuild.api and qbuild.base.errors, nothing else of qbuild's.

The renderers are imported on first use (module __getattr__), so `qbuild --help` and a command's error path stay
light; they all sit below this module (qbuild.results, qbuild.evaluate.gates, qbuild.pipeline.estimate)."""

from __future__ import annotations

import importlib

from qbuild.base.names import check_name, redact_tree, redact_url
from qbuild.base.process import EXIT_INTERRUPTED, finish, guard_interrupts, interrupted
from qbuild.base.units import human_seconds, human_size

_RENDERERS = {
    "bos_line": ("qbuild.results.summary", "bos_line"),
    "history_note": ("qbuild.pipeline.estimate", "history_note"),
    "render_gates": ("qbuild.evaluate.gates", "render_gates"),
    "render_diff": ("qbuild.results.diff", "render"),
    "write_junit": ("qbuild.results.junit", "write_junit"),
    "render_html": ("qbuild.results.report", "render_html"),
    "render_markdown": ("qbuild.results.report", "render_markdown"),
    "render_selection": ("qbuild.results.summary", "render_selection"),
    "render_table": ("qbuild.results.summary", "render_table"),
}


def __getattr__(name: str):
    if name in _RENDERERS:
        module, attr = _RENDERERS[name]
        return getattr(importlib.import_module(module), attr)
    raise AttributeError(f"module 'qbuild.output' has no attribute {name!r}")


__all__ = ["EXIT_INTERRUPTED", "check_name", "finish", "guard_interrupts", "human_seconds", "human_size",
           "interrupted", "redact_tree", "redact_url", *_RENDERERS]
