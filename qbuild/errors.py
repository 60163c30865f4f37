"""The one-line errors and exit codes, where users and the CLI import them (they live in qbuild/base/errors.py)."""

from qbuild.base.errors import (  # noqa: F401
    EXIT_GATE_FAILED,
    EXIT_STEP_FAILED,
    EXIT_USER_ERROR,
    MissingBackendError,
    QBuildError,
    RecipeError,
    StepFailed,
    UserError,
    first_line,
    quoted,
)
