"""The plan side of lm-eval tasks (torch-free): one `task:<name>[<artifact>]` step per task and model artifact, keyed
by the artifact × the task (its name and the contents of its include_path) × lm-eval's version × the runtime. A
variant's step reads the baseline's step (`reference`). The step's worker side: qbuild/evaluate/task_run.py."""

from __future__ import annotations

from pathlib import Path

from qbuild.base.errors import RecipeError
from qbuild.base.fingerprint import dir_fingerprint
from qbuild.evaluate.tasks import MAX_LENGTH, TOOLS
from qbuild.planning.evaluation import evaluable_artifacts, runtime_step
from qbuild.planning.models import resolve_path


def task_steps(ctx) -> None:
    """Add the task steps of every model artifact (baseline first: a variant's step reads the baseline's)."""
    ev = ctx.recipe.evaluation
    if not ev.tasks:
        return
    for ti, t in enumerate(ev.tasks):
        field = f"evaluation.tasks[{ti}]"
        params = {"task": t.task, "num_fewshot": t.num_fewshot, "limit": t.limit, "max_length": MAX_LENGTH}
        runtime_args = {}
        if t.include_path is not None:
            path = resolve_path(t.include_path, ctx.recipe_dir, f"{field}.include_path")
            if not path.is_dir():
                raise RecipeError(f"{field}.include_path", f"{t.include_path!r} is not a directory of task YAML files")
            if not _declares(path, t.task):
                raise RecipeError(f"{field}.task", f"{t.task!r}: no task YAML under {t.include_path} declares it "
                                  "(task: NAME, or group: NAME)")
            # the task's own sources, by content (a moved task dir still hits); never the bytecode lm-eval's import
            # of a `!function` writes there, which would change the key after the first run and per Python version
            params["task_files"] = dir_fingerprint(path, sources_only=True)
            runtime_args["include_path"] = str(path)
        reference = None
        for art, rt in evaluable_artifacts(ctx):
            inputs = {"model": art.step, "tokenizer": ctx.model()}
            if reference is not None and not art.baseline:
                inputs["reference"] = reference
            step = runtime_step("task", f"task:{t.task}[{art.label}]", {**params, "runtime": rt.name}, rt, art.label,
                         art.step, inputs, TOOLS + ("transformers", "tokenizers"), ctx, runner="qbuild.evaluate.task_run:run",
                         runtime_args={**runtime_args, "label": art.label})
            if art.baseline:
                reference = step


def _declares(root: Path, name: str) -> bool:
    """Whether a task YAML under `root` names `name` as its task, group or tag (a text scan: no lm-eval at plan
    time; lm-eval's own loader reports anything subtler when the step runs)."""
    import re

    pattern = re.compile(rf"^\s*(?:task|group|tag)\s*:\s*[\"']?{re.escape(name)}[\"']?\s*(?:#.*)?$", re.MULTILINE)
    for f in sorted(root.rglob("*.y*ml")):
        try:
            if pattern.search(f.read_text(encoding="utf-8", errors="replace")):
                return True
        except OSError:
            continue
    return False
