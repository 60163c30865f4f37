"""What the CLI prints and how it exits, in one place: tables and reports rendered from the API's data, sizes and
durations for people, redaction of anything that may hold a credential, and the process's interrupt handling.
qbuild/cli.py imports this module, qbuild.api and qbuild.errors, nothing else of qbuild's."""

from __future__ import annotations

from qbuild.core.estimate import history_note
from qbuild.core.names import check_name, redact_tree, redact_url
from qbuild.core.process import EXIT_INTERRUPTED, finish, guard_interrupts, interrupted
from qbuild.core.units import human_seconds, human_size
from qbuild.evaluate.gates import render_gates
from qbuild.results.diff import render as render_diff
from qbuild.results.junit import write_junit
from qbuild.results.report import render_html, render_markdown
from qbuild.results.summary import render_selection, render_table

__all__ = ["EXIT_INTERRUPTED", "check_name", "finish", "guard_interrupts", "history_note", "human_seconds",
           "human_size", "interrupted", "redact_tree", "redact_url", "render_diff", "render_gates", "render_html",
           "render_markdown", "render_selection", "render_table", "write_junit"]
