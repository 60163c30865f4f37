"""Runs the missing steps of a plan in dependency order, each heavy step in its own process."""

from __future__ import annotations

import json
import os
import select
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from qbuild.artifacts.store import Hit, Store, now_iso
from qbuild.errors import StepFailed, UserError
from qbuild.hashing import sha256_text
from qbuild.plan import PlannedStep
from qbuild.step import Step


def escape(text: str) -> str:
    from rich.markup import escape as _escape

    return _escape(text)


@dataclass
class StepOutcome:
    step: Step
    status: str                 # cached | built | failed | skipped | source
    path: Path | None = None
    digest: str | None = None
    seconds: float = 0.0
    record: dict = field(default_factory=dict)
    error: str | None = None
    log: str | None = None

    @property
    def metrics(self) -> dict:
        return self.record.get("metrics", {}) if self.record else {}

    @property
    def size(self) -> int:
        return sum(f["size"] for f in self.record.get("files", [])) if self.record else 0


class Executor:
    def __init__(self, store: Store, recipe, recipe_path: Path, run_id: str, progress=None, device: str = "auto"):
        self.store = store
        self.recipe = recipe
        self.recipe_path = recipe_path
        self.recipe_sha = sha256_text(recipe_path.read_text()) if recipe_path.is_file() else None
        self.run_id = run_id
        self.progress = progress
        self.device = device

    def run(self, planned: list[PlannedStep]) -> list[StepOutcome]:
        outcomes: dict[str, StepOutcome] = {}
        blocked = [ps for ps in planned if ps.status in ("needs-gpu", "unavailable") and ps.step.on_unavailable != "skip"]
        if blocked:  # fail before any work (exit 2), naming each step and why
            raise UserError("cannot run on this machine: " + "; ".join(f"step {ps.step.name}: {ps.reason}" for ps in blocked)
                            + " (set on_missing_gpu: skip on the target to build the rest)")
        for ps in planned:
            step = ps.step
            broken = [s.name for s in step.inputs.values() if outcomes[s.key].status in ("failed", "skipped")]
            if ps.status == "source":
                outcome = StepOutcome(step, "source", path=step.source_path)
            elif broken:
                outcome = StepOutcome(step, "skipped", error=f"input failed: {', '.join(broken)}")
            elif ps.status == "hit":
                outcome = StepOutcome(step, "cached", ps.hit.path, ps.hit.digest, record=ps.hit.record)
            elif ps.status in ("needs-gpu", "unavailable"):
                outcome = StepOutcome(step, "skipped", error=ps.reason)
            else:
                outcome = self._build(step, outcomes)
            if outcome.status in ("built", "cached"):
                self._remember(step)
            outcomes[step.key] = outcome
        return list(outcomes.values())

    def _remember(self, step: Step) -> None:
        last = self.store.last_build(self.recipe.name, step.name)
        if last is None or last.get("key") != step.key:
            self.store.remember_build(self.recipe.name, step.name, {
                "key": step.key, "params": step.params, "inputs": step.input_keys(), "toolchain": step.toolchain(),
                "impl": step.impl_version, "when": now_iso()})

    def _build(self, step: Step, outcomes: dict[str, StepOutcome]) -> StepOutcome:
        task = self.progress.add_task(escape(step.name), total=None, step=escape(step.name)) if self.progress else None
        t0 = time.perf_counter()
        try:
            with self.store.lock(step.key):
                hit = self.store.lookup(step.key)  # another run may have built it while we waited
                if hit:
                    return StepOutcome(step, "cached", hit.path, hit.digest, record=hit.record)
                hit = self._run_worker(step, outcomes, task)
                return StepOutcome(step, "built", hit.path, hit.digest, time.perf_counter() - t0, hit.record)
        except StepFailed as exc:
            return StepOutcome(step, "failed", seconds=time.perf_counter() - t0, error=exc.reason, log=exc.log)
        finally:
            if self.progress and task is not None:
                self.progress.update(task, visible=False)

    def _run_worker(self, step: Step, outcomes: dict[str, StepOutcome], task) -> Hit:
        tmp = self.store.new_tmp(step.key)
        out = tmp / "out"
        out.mkdir()
        log_path = self.store.log_path(self.run_id, step.name)
        log_path.parent.mkdir(parents=True, exist_ok=True)
        inputs = {role: outcomes[s.key] for role, s in step.inputs.items()}
        spec = {
            "name": step.name, "runner": step.runner, "params": step.params, "out": str(out),
            "inputs": {r: str(o.path) for r, o in inputs.items()},
            "input_manifests": {r: o.record for r, o in inputs.items()},
            "threads": step.threads, "device": self.device, "runtime_args": step.runtime_args,
            "result": str(tmp / "result.json"),
        }
        (tmp / "spec.json").write_text(json.dumps(spec, default=str))
        rusage, rc = self._spawn(tmp / "spec.json", log_path, step, task)
        try:
            result = json.loads((tmp / "result.json").read_text())
        except (OSError, ValueError):
            result = {"error": f"worker exited with code {rc} (killed? out of memory?)"}
        if rc != 0 or "error" in result:
            raise StepFailed(step.name, result.get("error", f"exit code {rc}"), str(log_path))
        # only `out` becomes the object: spec/result/log stay private
        provenance = {
            "kind": step.kind, "name": step.name, "variant": step.variant, "format": result.get("format", step.format),
            "params": step.params, "toolchain": step.toolchain(), "runner": step.runner,
            "inputs": {r: {"key": s.key, "digest": inputs[r].digest, "step": s.name} for r, s in step.inputs.items()},
            "metrics": result.get("metrics", {}), "info": result.get("info", {}),
            "timings": {"seconds": round(rusage["wall"], 3), "cpu_seconds": round(rusage["cpu"], 3),
                        "peak_rss_mb": rusage["peak_rss_mb"]},
            "recipe": {"name": self.recipe.name, "path": str(self.recipe_path), "sha256": self.recipe_sha},
            "run_id": self.run_id,
        }
        hit = self.store.publish(step.key, out, provenance)
        shutil.rmtree(tmp, ignore_errors=True)
        return hit

    def _spawn(self, spec: Path, log_path: Path, step: Step, task) -> tuple[dict, int]:
        read_fd, write_fd = os.pipe()
        env = dict(os.environ)
        threads = str(step.threads)
        env.update({"QBUILD_PROGRESS_FD": str(write_fd), "OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads,
                    "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": env.get("HF_HUB_OFFLINE", "1"),
                    "HF_DATASETS_OFFLINE": env.get("HF_DATASETS_OFFLINE", "1"), "PYTHONUNBUFFERED": "1"})
        t0 = time.perf_counter()
        with open(log_path, "ab") as log:
            proc = subprocess.Popen([sys.executable, "-m", "qbuild.worker", str(spec)], stdout=log,
                                    stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, pass_fds=(write_fd,), env=env)
        os.close(write_fd)
        buf = b""
        with os.fdopen(read_fd, "rb", buffering=0) as pipe:
            while True:
                ready, _, _ = select.select([pipe], [], [], 0.5)
                if ready:
                    chunk = pipe.read(65536)
                    if not chunk:
                        break
                    buf += chunk
                    *lines, buf = buf.split(b"\n")
                    for line in lines:
                        self._on_progress(task, line)
        _, status, usage = os.wait4(proc.pid, 0)
        rc = os.waitstatus_to_exitcode(status)
        proc.returncode = rc
        return {"wall": time.perf_counter() - t0, "cpu": usage.ru_utime + usage.ru_stime,
                "peak_rss_mb": round(usage.ru_maxrss / 1024, 1)}, rc

    def _on_progress(self, task, line: bytes) -> None:
        if not self.progress or task is None:
            return
        try:
            p = json.loads(line)
        except ValueError:
            return
        desc = f"{self.progress.tasks[task].fields.get('step', '')}"
        self.progress.update(task, completed=p["done"], total=p["total"] or None,
                             description=f"{desc}{': ' if desc else ''}{escape(str(p.get('desc', '')))}")
