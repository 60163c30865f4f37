"""Entry point of a step's own process: `python -m qbuild.worker SPEC.json`.

Heavy steps run here so memory is returned to the OS and a crash or OOM fails one step only.
stdout/stderr go to the step's log; progress goes to a dedicated pipe (QBUILD_PROGRESS_FD).
"""

from __future__ import annotations

import importlib
import json
import os
import sys
import traceback
from pathlib import Path


def main(spec_path: str) -> int:
    spec = json.loads(Path(spec_path).read_text())
    from qbuild.step import StepContext

    fd = os.environ.get("QBUILD_PROGRESS_FD")
    ctx = StepContext(
        params=spec["params"],
        inputs={k: Path(v) for k, v in spec["inputs"].items()},
        input_manifests=spec["input_manifests"],
        out=Path(spec["out"]),
        threads=spec["threads"],
        device=spec["device"],
        step_name=spec["name"],
        runtime_args=spec["runtime_args"],
        progress_fd=int(fd) if fd else None,
    )
    module, _, func = spec["runner"].partition(":")
    try:
        if spec["threads"]:
            try:
                import torch

                torch.set_num_threads(spec["threads"])
            except ImportError:
                pass
        result = getattr(importlib.import_module(module), func)(ctx) or {}
    except BaseException as exc:  # report every failure, incl. KeyboardInterrupt, as one line + log
        traceback.print_exc()
        Path(spec["result"]).write_text(json.dumps({"error": f"{type(exc).__name__}: {exc}"}))
        return 1
    Path(spec["result"]).write_text(json.dumps(result, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
