"""A user's request trace (`evaluation.serving.trace`): JSONL, one request a line, replayed at its arrival times.

    {"arrival_s": 0.0, "input_len": 128, "output_len": 32}        # prompt: a corpus window of 128 tokens
    {"arrival_s": 0.7, "prompt": "Summarize ...", "output_len": 64}   # or the text itself

`arrival_s` is seconds from the trace's start (non-decreasing). A bad line is one error naming the file, the line
and the field.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path


class TraceError(ValueError):
    """A trace that cannot be replayed: the message names the file, the line and what is wrong."""


def read_trace(path: Path) -> list[dict]:
    """The trace's requests, in order: {arrival_s, output_len, and input_len or prompt}."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise TraceError(f"{path}: cannot read the trace: {exc}") from None
    out: list[dict] = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{path}:{n}"
        try:
            entry = json.loads(line)
        except ValueError as exc:
            raise TraceError(f"{where}: not JSON: {exc}") from None
        if not isinstance(entry, dict):
            raise TraceError(f"{where}: expected an object with arrival_s, output_len and input_len or prompt")
        arrival = entry.get("arrival_s")
        if not isinstance(arrival, (int, float)) or isinstance(arrival, bool) or arrival < 0:
            raise TraceError(f"{where}: arrival_s must be a number of seconds >= 0, got {arrival!r}")
        if out and arrival < out[-1]["arrival_s"]:
            raise TraceError(f"{where}: arrival_s {arrival} is before the previous request's {out[-1]['arrival_s']}")
        output_len = entry.get("output_len")
        if not isinstance(output_len, int) or isinstance(output_len, bool) or output_len < 1:
            raise TraceError(f"{where}: output_len must be an integer >= 1, got {output_len!r}")
        request = {"arrival_s": float(arrival), "output_len": output_len}
        if "prompt" in entry:
            if not isinstance(entry["prompt"], str) or not entry["prompt"]:
                raise TraceError(f"{where}: prompt must be a non-empty string")
            request["prompt"] = entry["prompt"]
        else:
            input_len = entry.get("input_len")
            if not isinstance(input_len, int) or isinstance(input_len, bool) or input_len < 1:
                raise TraceError(f"{where}: give prompt (text) or input_len (an integer >= 1), got {input_len!r}")
            request["input_len"] = input_len
        out.append(request)
    if not out:
        raise TraceError(f"{path}: the trace has no requests")
    return out


def trace_digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()
