"""A model's architecture facts are untrusted input: read bounded, checked before anything sizes or divides by them.

Both kinds of source end here: an HF checkpoint's `config.json` and the facts read from a GGUF's metadata
(qbuild.models.gguf_import.gguf_config). A config that is not a mapping, or whose sizes are not positive integers
within bounds (zero attention heads, a negative layer count, a size in the trillions), is refused with
ConfigRefused naming the field; the planner turns that into one line naming the file.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

MAX_CONFIG_BYTES = 16 << 20      # a real config.json is a few KB; tokenizer_config.json with a template, ~100 KB
# field → the largest value any model has a reason to state (far above today's largest models)
SIZE_FIELDS = {
    "hidden_size": 1 << 20,
    "num_hidden_layers": 100_000,
    "num_attention_heads": 100_000,
    "num_key_value_heads": 100_000,
    "intermediate_size": 1 << 24,
    "vocab_size": 1 << 24,
    "head_dim": 1 << 16,
    "max_position_embeddings": 1 << 34,
    "num_local_experts": 1 << 16,
    "num_experts": 1 << 16,
    "moe_intermediate_size": 1 << 24,
    "num_experts_per_tok": 1 << 16,
}


class ConfigRefused(ValueError):
    """The config breaks a bound: the message names the field (one line)."""


def read_json_mapping(path: Path, limit: int = MAX_CONFIG_BYTES) -> dict:
    """`path` parsed as a JSON object, read only when it is at most `limit` bytes."""
    try:
        size = path.stat().st_size
    except OSError as exc:
        raise ConfigRefused(f"cannot read it ({exc.strerror or exc})") from None
    if size > limit:
        raise ConfigRefused(f"{size:,} bytes, over the limit of {limit:,} for a JSON config")
    try:
        data = json.loads(path.read_bytes())
    except (OSError, ValueError, RecursionError) as exc:
        raise ConfigRefused(f"not valid JSON ({str(exc).splitlines()[0][:120] if str(exc) else type(exc).__name__})"
                            ) from None
    if not isinstance(data, dict):
        raise ConfigRefused(f"a JSON {type(data).__name__}, not an object (a mapping of settings)")
    return data


def check_sizes(info: dict, names: dict[str, str] | None = None) -> dict:
    """`info` (and its `text_config`) with every size field a positive integer within SIZE_FIELDS' bounds; the
    per-layer lists some GGUFs store (one head count per layer) become their one value when every layer agrees.
    `names`: how the source calls each field, for the message (a GGUF's metadata keys)."""
    text = info.get("text_config")
    if text is not None:
        if not isinstance(text, dict):
            raise ConfigRefused(f"text_config: a {type(text).__name__}, not a mapping")
        info = {**info, "text_config": _checked(text, "text_config.", {})}
    return _checked(info, "", names or {})


def _checked(section: dict, prefix: str, names: dict[str, str]) -> dict:
    out = dict(section)
    for field, bound in SIZE_FIELDS.items():
        if field not in section or section[field] is None:
            continue
        name, value = names.get(field, field), section[field]
        if isinstance(value, list):
            distinct = {v for v in value if not isinstance(v, list | dict)}
            if len(distinct) != 1 or len(value) == 0:
                shown = value[:8] + (["..."] if len(value) > 8 else [])
                raise ConfigRefused(f"{prefix}{name}: a per-layer list with different values ({shown}): qbuild "
                                    f"imports models whose layers all have the same shape")
            value = distinct.pop()
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) \
                or value != int(value):
            raise ConfigRefused(f"{prefix}{name}: {_short(value)} is not a whole number")
        value = int(value)
        if not 0 < value <= bound:
            raise ConfigRefused(f"{prefix}{name}: {value:,} is out of range (1 to {bound:,})")
        out[field] = value
    return out


def _short(value, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."
