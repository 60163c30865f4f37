"""What the CLI prints and how it exits, in one place: tables and reports rendered from the API's data, sizes and
durations for people, redaction of anything that may hold a credential, and the process's interrupt handling.
qbuild/cli.py imports this module, qbuild.api and qbuild.base.errors, nothing else of qbuild's.

The renderers are imported on first use (module __getattr__, by ordinary imports), so `qbuild --help` and a
command's error path stay light; they all sit below this module (qbuild.results, qbuild.evaluate.gates,
qbuild.pipeline.estimate)."""

from __future__ import annotations

from qbuild.base.names import check_name, redact_tree, redact_url
from qbuild.base.process import EXIT_INTERRUPTED, finish, guard_interrupts, interrupted
from qbuild.base.units import human_seconds, human_size

_RENDERERS = ("bos_line", "deploy_lines", "history_note", "render_gates", "render_diff", "write_junit", "render_html",
              "render_markdown", "render_selection", "render_table")


def __getattr__(name: str):
    # ordinary imports, each where its names are asked for: tests/test_architecture.py reads them (it refuses a
    # module loaded by a computed name) and sees what this module depends on
    if name in ("bos_line", "render_selection", "render_table"):
        from qbuild.results import summary as module
    elif name == "deploy_lines":
        from qbuild.results import deploy_report as module
    elif name == "history_note":
        from qbuild.pipeline import estimate as module
    elif name == "render_gates":
        from qbuild.evaluate import gates as module
    elif name == "render_diff":
        from qbuild.results.diff import render

        return render
    elif name == "write_junit":
        from qbuild.results import junit as module
    elif name in ("render_html", "render_markdown"):
        from qbuild.results import report as module
    else:
        raise AttributeError(f"module 'qbuild.output' has no attribute {name!r}")
    return getattr(module, name)


__all__ = ["EXIT_INTERRUPTED", "check_name", "finish", "guard_interrupts", "human_seconds", "human_size",
           "interrupted", "redact_tree", "redact_url", *_RENDERERS]
