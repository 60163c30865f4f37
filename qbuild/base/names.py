"""One grammar for every name a user gives qbuild (tag, ref part, run id, variant, recipe), and URL redaction.

A name is 1-128 characters: letters, digits, '.', '_', '-', starting with a letter or digit, and never '.' or
'..' (so it can be a file name inside the store and nothing else). Checked at the edge: CLI options, API
arguments, the recipe schema, and again where the store turns a name into a path.
"""

from __future__ import annotations

import re
from urllib.parse import urlsplit, urlunsplit

from qbuild.base.errors import UserError

NAME = r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}"
NAME_PATTERN = rf"^{NAME}$"           # for pydantic Field(pattern=...): recipe names, variants, tags
NAME_RE = re.compile(NAME_PATTERN)


def valid_name(value: object) -> bool:
    return isinstance(value, str) and bool(NAME_RE.fullmatch(value)) and value not in (".", "..")


def check_name(value: object, what: str = "name") -> str:
    """The name, or UserError (exit 2, one line) saying what is allowed."""
    if not valid_name(value):
        shown = repr(value)[:80]
        raise UserError(f"invalid {what} {shown}: use 1-128 letters, digits, '.', '_' or '-', starting with a letter "
                        "or digit")
    return value  # type: ignore[return-value]


# Bounded quantifiers keep every attempt short, so redaction is linear in the text: with `*` a 100,000-character
# recipe value took ~21 s (each start position scanned to the end of the run of letters).
# (each userinfo scan starts after a '://' and stops at the next '/', so it stays linear too)
_USERINFO = re.compile(r"(?P<scheme>[A-Za-z][A-Za-z0-9+.-]{0,31}://)(?P<userinfo>[^/@\s]*)@")
_SECRET_QUERY = re.compile(r"(?i)([?&](?:token|access_token|api_key|apikey|key|password|passwd|pwd|secret|sig|signature|"
                           r"x-amz-signature|x-amz-credential|x-amz-security-token)=)[^&#\s]*")


def redact_url(value: str | None) -> str | None:
    """The URL with its credentials (user:pass@ → ***@) and secret query values replaced by ***.

    Every place that prints or records a URL goes through here: CLI output, --json, runs/*.json, MLflow params.
    Works on free text too (each URL inside is redacted)."""
    if not isinstance(value, str):
        return value

    return _SECRET_QUERY.sub(r"\1***", _USERINFO.sub(r"\g<scheme>***@", value))


def redact_tree(data):
    """redact_url applied to every string in a JSON-like structure (for --json, run records, MLflow params)."""
    if isinstance(data, str):
        return redact_url(data) if "://" in data or "=" in data else data
    if isinstance(data, dict):
        return {k: redact_tree(v) for k, v in data.items()}
    if isinstance(data, (list, tuple)):
        return [redact_tree(v) for v in data]
    return data


def has_credentials(url: str) -> bool:
    try:
        parts = urlsplit(url)
    except ValueError:
        return False
    return bool(parts.password)


__all__ = ["NAME", "NAME_PATTERN", "NAME_RE", "check_name", "valid_name", "redact_url", "redact_tree", "has_credentials", "urlunsplit"]
