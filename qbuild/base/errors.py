"""Error types and the exit codes they map to (docs/architecture.md, "Errors"): defined here, the one place, so that
every layer can raise them. Their public name is qbuild.errors (users, the CLI, the API); plugin authors import the
ones they raise from qbuild.plugins."""

from __future__ import annotations

EXIT_STEP_FAILED = 1
EXIT_USER_ERROR = 2
EXIT_GATE_FAILED = 3


def quoted(value: object, limit: int = 120) -> str:
    """repr(value) for an error line, cut short: a 100,000-character bad value is shown as its start and its length."""
    text = repr(value)
    if len(text) <= limit:
        return text
    return f"{text[:limit]}... ({len(str(value)):,} characters)"


FIELD_LIMIT = 200
MESSAGE_LIMIT = 1000


def cut(text: str, limit: int) -> str:
    """`text` at most about `limit` characters: its start and how long it was."""
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text):,} characters)"


def first_line(exc: BaseException, limit: int = 200) -> str:
    """An exception in one line for a one-line error: its message's first line, or its class when it has none."""
    text = str(exc).strip()
    return (text.splitlines()[0] if text else type(exc).__name__)[:limit]


class QBuildError(Exception):
    """Base class: every qbuild error carries the exit code it should produce."""

    exit_code = EXIT_STEP_FAILED


class UserError(QBuildError):
    """Bad recipe, path, flag or missing optional backend: caught before heavy work starts."""

    exit_code = EXIT_USER_ERROR


class RecipeError(UserError):
    """A recipe field is wrong. Rendered as one line: file:line: field: problem."""

    def __init__(self, field: str, message: str, line: int | None = None, source: str | None = None):
        self.field = field
        self.message = message
        self.line = line
        self.source = source
        super().__init__(self.render())

    def __str__(self) -> str:
        return self.render()

    def render(self) -> str:
        where = self.source or "recipe"
        if self.line is not None:
            where = f"{where}:{self.line}"
        # a hostile recipe can make a key or a value as long as it likes: the line stays readable
        field, message = cut(self.field, FIELD_LIMIT), cut(self.message, MESSAGE_LIMIT)
        return f"{where}: {field}: {message}" if field else f"{where}: {message}"


class MissingBackendError(UserError):
    """An optional library a recipe needs is not installed."""

    def __init__(self, what: str, extra: str, field: str | None = None):
        hint = f"pip install 'qbuild[{extra}]'"
        msg = f"{what} is not installed; run: {hint}"
        if field:
            msg = f"{field}: {msg}"
        super().__init__(msg)


class StepFailed(QBuildError):
    """A step's worker failed: names the step and its log."""

    exit_code = EXIT_STEP_FAILED

    def __init__(self, step: str, reason: str, log: str | None = None):
        self.step = step
        self.reason = reason
        self.log = log
        text = f"step {step} failed: {reason}"
        if log:
            text += f" (log: {log})"
        super().__init__(text)
