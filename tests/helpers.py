"""Helpers shared by tests: write recipes, run qbuild through its Python API or its CLI (a subprocess)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import yaml


def fake_model(root: Path) -> Path:
    """A directory that passes as a local HF checkpoint for planning (never loaded)."""
    d = root / "fake-model"
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 256, "intermediate_size": 512,
                                               "num_attention_heads": 4, "num_hidden_layers": 2, "vocab_size": 100}))
    (d / "model.safetensors").write_bytes(b"\0" * 64)
    return d


def write_recipe(path: Path, data: dict | str) -> Path:
    path.write_text(data if isinstance(data, str) else yaml.safe_dump(data, sort_keys=False))
    return path


def run_api(recipe, store=None, **kwargs) -> tuple[int, dict]:
    """qbuild.api.run; (exit code, the summary as `qbuild run --json` prints it)."""
    from qbuild import api

    result = api.run(recipe, store=store, **kwargs)
    return result.exit_code, json.loads(json.dumps(result.summary, default=str))


def rerun_then_another_budget(recipe: Path, other_budget: dict) -> dict:
    """A search's recipe run again builds nothing; then the recipe's next budget (`other_budget`, written over it)
    reuses the sensitivity: no measurement step (named with "@" or "~base") runs again. Its summary."""
    rc, again = run_api(recipe)
    assert rc == 0 and again["counts"]["built"] == 0
    rc, other = run_api(write_recipe(recipe, other_budget))
    assert rc == 0
    built = sorted(s["name"] for s in other["steps"] if s["status"] == "built")
    assert not any("@" in n or "~base" in n for n in built), built
    return other


def build_module_recipe(root: Path, data: dict) -> dict:
    """Run `data` once for a test module (its `store.path` is the store): the recipe path, the summary, and
    its variants by name and steps by name."""
    recipe = write_recipe(root / "recipe.yaml", data)
    rc, summary = run_api(recipe)
    assert rc == 0, summary["steps"]
    return {"root": root, "store": Path(data["store"]["path"]), "recipe": recipe, "summary": summary,
            "variants": {v["variant"]: v for v in summary["variants"]},
            "steps": {s["name"]: s for s in summary["steps"]}}


def qbuild(*args, cwd=None, env=None, timeout=900) -> subprocess.CompletedProcess:
    full_env = {**os.environ, **(env or {})}
    return subprocess.run([sys.executable, "-m", "qbuild", *map(str, args)], capture_output=True, text=True,
                          cwd=cwd, env=full_env, timeout=timeout)


def fake_recipe(tmp: Path, variants: list[dict], **extra) -> dict:
    model = fake_model(tmp)
    return {"name": "t", "model": {"source": "local", "path": str(model)}, "variants": variants,
            "evaluation": {"perplexity": None, "baseline": False}, **extra}


def step_infos(store_dir: Path) -> dict[str, dict]:
    """Each stored object's `info` (what a fake step recorded of its worker), by step name."""
    found = {}
    for m in (store_dir / "objects").glob("*/*/manifest.json"):
        d = json.loads(m.read_text())
        found[d["name"]] = d.get("info", {})
    return found


def installs(dist: str, extras: tuple[str, ...] = ()) -> set[str]:
    """Every distribution `pip install 'dist[extras]'` brings, read from the installed packages' metadata."""
    from importlib import metadata

    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    seen: set[tuple[str, tuple[str, ...]]] = set()
    todo = [(dist, extras)]
    while todo:
        name, wanted = todo.pop()
        if (canonicalize_name(name), wanted) in seen:
            continue
        seen.add((canonicalize_name(name), wanted))
        try:
            requires = metadata.requires(name) or []
        except metadata.PackageNotFoundError:
            continue
        for line in requires:
            req = Requirement(line)
            if req.marker is None or any(req.marker.evaluate({"extra": e}) for e in ("", *wanted)):
                todo.append((req.name, tuple(sorted(req.extras))))
    return {name for name, _ in seen}
