"""What is installed: every registered plugin and model format (`qbuild plugins`), the recipe's JSON Schema with
the installed plugins' options (`qbuild schema`), and the backend environments (`qbuild env`)."""

from __future__ import annotations

import time

from qbuild.base.errors import UserError


def plugins() -> dict:
    """Every registered plugin (methods, targets, runtimes, servers, remote stores) and every model format: who
    evaluates it and which engines load it."""
    from qbuild.artifacts.remote import remotes
    from qbuild.contract.formats import FORMATS, engines_for_format, runtimes_for
    from qbuild.contract.plugin import Runtime, Server, Target, methods, runtimes, servers, targets

    rows = []
    for kind, registry in (("method", methods), ("target", targets), ("runtime", runtimes), ("server", servers)):
        for p in registry.all():
            row = {"kind": kind, "name": p.name, "origin": p.origin, "extra": p.extra, "installed": not p.missing()}
            if isinstance(p, Runtime):
                row["formats"] = [f for f in FORMATS if p in runtimes_for(f)]
            if isinstance(p, Server):
                row["engine"] = p.engine
            if isinstance(p, Target):
                row["accepts"] = {f: list(s) if s else "any" for f, s in p.accepts.items()}
            rows.append(row)
    for cls in remotes.classes():   # remote stores are opened per URL: listed by class
        rows.append({"kind": "remote store", "name": cls.name, "origin": cls.origin, "extra": cls.extra,
                     "installed": not cls.missing(), "schemes": list(cls.schemes)})
    formats = [{"format": f.name, "description": f.description, "loads_in": list(engines_for_format(f.name)),
                "evaluated_by": [r.name for r in runtimes_for(f.name)]} for f in FORMATS.values() if f.model]
    return {"plugins": rows, "formats": formats}


def recipe_schema() -> dict:
    """The recipe's JSON Schema, with the methods and targets of installed plugins."""
    from qbuild.planning.recipe import Recipe

    return Recipe.model_json_schema()


def environments() -> dict:
    """Built-in backends and the environments created on this machine."""
    from qbuild import envs

    return {"root": str(envs.envs_root()), "builtin": {k: list(envs.backend_packages(k)) for k in envs.BACKENDS},
            "environments": envs.installed()}


def create_environments(names=(), *, recipe=None, log=None) -> list[dict]:
    """Resolve and create the environments NAMES (built-in backends) and those RECIPE's steps run in."""
    from qbuild import envs
    from qbuild.pipeline.run import backend_envs

    if not names and not recipe:
        raise UserError(f"name an environment ({', '.join(envs.BACKENDS)}) or give --recipe")
    wanted = [envs.backend(n) for n in names] + (backend_envs(recipe) if recipe else [])
    done = []
    for e in dict.fromkeys(wanted):
        t0 = time.perf_counter()
        existed = e.exists()
        python = envs.ensure(e, log=log or (lambda m: None))
        done.append({"name": e.name, "lock_hash": e.lock_hash, "python": python, "created": not existed,
                     "seconds": round(time.perf_counter() - t0, 2)})
    return done


def remove_environments(name: str | None) -> list:
    """Remove the environment NAME (every version of it), or every environment with None."""
    from qbuild import envs

    return envs.remove(name)
