"""`qbuild pull REF`: fetch an artifact by name; for TensorRT-LLM engines, the build that fits this GPU.

An engine only loads on the GPU architecture (SM) and the exact TensorRT / TensorRT-LLM versions it
was built with, so an engine ref (recipe/<variant>.<target>[:tag]) names a family of builds: every
stored engine manifest of that recipe and variant. pull picks the one whose SM and toolchain match
this machine, verifies its files against its manifest, and refuses a mismatch, saying what the
store has, what this machine needs, and the command that builds it here.
Light module: click and qbuild's core only; nothing heavy is imported.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import click

from qbuild.errors import QBuildError, UserError

MATCH_KEYS = (("gpu.sm", "SM"), ("tensorrt_llm", "TensorRT-LLM"), ("tensorrt", "TensorRT"), ("cuda", "CUDA"))


def _cuda_major(v: str | None) -> str | None:
    return v.split(".")[0] if v else v


def describe(facts: dict) -> str:
    return ", ".join(f"{label} {facts.get(k) or '?'}" for k, label in MATCH_KEYS)


def engine_manifests(store, recipe: str, variant: str) -> list[dict]:
    """Every stored engine build of recipe/variant (newest first)."""
    from qbuild.build.tensorrt_llm import ENGINE_KIND

    found = []
    for obj in store.objects():
        try:
            m = json.loads((obj / "manifest.json").read_text())
        except (OSError, ValueError):
            continue
        if m.get("kind") == ENGINE_KIND and m.get("variant") == variant and (m.get("recipe") or {}).get("name") == recipe:
            found.append(m)
    return sorted(found, key=lambda m: m.get("created", ""), reverse=True)


def select_engine(manifests: list[dict], need: dict, ref: str) -> dict:
    """The manifest whose SM, TensorRT-LLM and TensorRT versions equal `need` (CUDA: same major).

    Raises UserError naming what the store has, what is needed, and how to build it.
    """
    def fits(m: dict) -> bool:
        tc = m.get("toolchain", {})
        return all(tc.get(k) == need.get(k) for k in ("gpu.sm", "tensorrt_llm", "tensorrt")) and \
            (need.get("cuda") in (None, "unknown") or _cuda_major(tc.get("cuda")) == _cuda_major(need.get("cuda")))

    for m in manifests:
        if fits(m):
            return m
    if not manifests:
        raise UserError(f"{ref}: no TensorRT-LLM engine is stored under this name")
    recipe = next((m.get("recipe", {}).get("path") for m in manifests if m.get("recipe", {}).get("path")), "RECIPE.yaml")
    has = "; ".join(f"{describe(m.get('toolchain', {}))} (digest {m['digest'][:12]}"
                    + (f", built on {m['info']['gpu']['name']}" if (m.get("info") or {}).get("gpu") else "") + ")"
                    for m in manifests)
    raise UserError(f"{ref}: no stored engine fits this machine. It needs: {describe(need)}. "
                    f"The store has: {has}. An engine only loads on the SM and TensorRT version it was built "
                    f"with; build one here with: qbuild run {recipe}")


def local_needs(sm: str | None = None, tensorrt_llm: str | None = None, tensorrt: str | None = None,
                python: str | None = None) -> dict:
    from qbuild.build import trtllm_env

    gpu = trtllm_env.gpu()
    env = trtllm_env.trtllm(trtllm_env.configured_python(python))
    need = {"gpu.sm": sm or (gpu.sm if gpu else None),
            "tensorrt_llm": tensorrt_llm or (env.tensorrt_llm if env else None),
            "tensorrt": tensorrt or (env.tensorrt if env else None),
            "cuda": env.cuda if env else None}
    missing = [label for k, label in MATCH_KEYS[:3] if not need[k]]
    if missing:
        raise UserError(f"cannot tell which engine fits this machine: no {', '.join(missing)} found "
                        "(no NVIDIA GPU / TensorRT-LLM here); pass --sm/--tensorrt-llm/--tensorrt")
    return need


def pull(store, name: str, dest: Path | None = None, need: dict | None = None) -> tuple[str, Path]:
    """Resolve NAME; for an engine ref select by SM/toolchain; verify; optionally copy to dest."""
    from qbuild.artifacts.store import REF_RE

    from qbuild.build.tensorrt_llm import ENGINE_KIND

    m = REF_RE.match(name)
    try:
        digest = store.resolve(name)
    except UserError:
        # engine builds are found by recipe/variant even where no ref was set for them
        family = engine_manifests(store, m.group("recipe"), m.group("variant")) if m else []
        if not family:
            raise
        digest = family[0]["digest"]
    manifest = store.manifest(digest)
    if manifest.get("kind") == ENGINE_KIND:
        need = need or local_needs()
        family = engine_manifests(store, m.group("recipe"), m.group("variant")) if m else [manifest]
        if m is None or manifest not in family:
            family = [manifest] + family
        digest = select_engine(family, need, name)["digest"]
    rows = store.verify([digest])
    if not rows[0]["ok"]:
        raise QBuildError(f"{name}: object {digest[:12]} is damaged: " + "; ".join(rows[0]["problems"]))
    src = store.object_dir(digest)
    if dest is None:
        return digest, src
    dest.mkdir(parents=True, exist_ok=True)
    for f in sorted(p for p in src.rglob("*") if p.is_file()):
        target = dest / f.relative_to(src)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(f, target)
    return digest, dest


@click.command(name="pull")
@click.argument("name")
@click.option("--store", "store_path", envvar="QBUILD_STORE", type=click.Path(file_okay=False),
              help="Artifact store directory [env QBUILD_STORE; default ./artifacts].")
@click.option("-o", "--output", type=click.Path(file_okay=False), help="Copy the verified files here.")
@click.option("--sm", help="Select engines for this compute capability (e.g. 9.0) instead of the local GPU's.")
@click.option("--tensorrt-llm", "trtllm_version", help="Select engines built with this TensorRT-LLM version.")
@click.option("--tensorrt", "trt_version", help="Select engines built with this TensorRT version.")
def pull_command(name, store_path, output, sm, trtllm_version, trt_version):
    """Fetch NAME (ref, digest) verified against its manifest; an engine ref picks the build for this GPU."""
    from qbuild.artifacts import open_store

    try:
        store = open_store(store_path)
        need = None
        if sm or trtllm_version or trt_version:
            need = local_needs(sm, trtllm_version, trt_version)
        digest, path = pull(store, name, Path(output) if output else None, need)
    except QBuildError as exc:
        click.echo(f"qbuild: error: {exc}", err=True)
        sys.exit(exc.exit_code)
    click.echo(f"{digest}  {path}")
