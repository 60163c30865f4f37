"""qbuild's errors and exit codes, under their public name: users, the CLI and the API (qbuild/api.py) import them
from here, plugin authors the ones they raise from qbuild.plugins. Each is defined once, in qbuild/base/errors.py,
the lowest layer, so that every layer can raise them; this module only names them."""

from qbuild.base.errors import (
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

__all__ = ["EXIT_GATE_FAILED", "EXIT_STEP_FAILED", "EXIT_USER_ERROR", "MissingBackendError", "QBuildError", "RecipeError",
           "StepFailed", "UserError", "first_line", "quoted"]
