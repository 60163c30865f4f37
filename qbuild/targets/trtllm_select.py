"""Which stored TensorRT-LLM engine fits this machine (used by `qbuild pull`, qbuild/api.py).

An engine is built for one GPU model (H100, H200 and GH200 share SM 9.0 but not engines), one host
CPU architecture and the exact TensorRT / TensorRT-LLM versions, so an engine ref
(recipe/<variant>.<target>[:tag]) names a family of builds: every stored engine manifest of that
recipe and variant. pull picks the one whose GPU, architecture and toolchain match this machine and
refuses a mismatch, saying what the store has, what this machine needs, and the command that builds
it here. A fact this machine cannot read is never a wildcard. Light module: nothing heavy is imported.
"""

from __future__ import annotations

import json

from qbuild.plugins import UserError

ENGINE_KIND = "trtllm-engine"   # the step kind (and manifest `kind`) of an engine build

MATCH_KEYS = (("gpu.sm", "SM"), ("gpu.name", "GPU"), ("host.arch", "CPU arch"), ("tensorrt_llm", "TensorRT-LLM"),
              ("tensorrt", "TensorRT"), ("cuda", "CUDA"))
EXACT = ("gpu.sm", "gpu.name", "host.arch", "tensorrt_llm", "tensorrt")   # must be equal; CUDA: same major


def _cuda_major(v: str | None) -> str | None:
    return v.split(".")[0] if v else v


def describe(facts: dict) -> str:
    return ", ".join(f"{label} {facts.get(k) or '?'}" for k, label in MATCH_KEYS)


def is_engine_of(m: dict, recipe: str, variant: str) -> bool:
    """Whether manifest m is a TensorRT-LLM engine build of recipe/variant (local store or remote)."""
    return m.get("kind") == ENGINE_KIND and m.get("variant") == variant and (m.get("recipe") or {}).get("name") == recipe


def newest_first(manifests: list[dict]) -> list[dict]:
    return sorted(manifests, key=lambda m: m.get("created", ""), reverse=True)


def engine_manifests(store, recipe: str, variant: str) -> list[dict]:
    """Every stored engine build of recipe/variant (newest first)."""
    found = []
    for obj in store.objects():
        try:
            m = json.loads((obj / "manifest.json").read_text())
        except (OSError, ValueError):
            continue
        if is_engine_of(m, recipe, variant):
            found.append(m)
    return newest_first(found)


def select_engine(manifests: list[dict], need: dict, ref: str) -> dict:
    """The manifest whose GPU (SM and model), CPU architecture, TensorRT-LLM and TensorRT versions equal `need`
    (CUDA: same major; an unknown need matches nothing).

    Raises UserError naming what the store has, what is needed, and how to build it.
    """
    def fits(m: dict) -> bool:
        tc = m.get("toolchain", {})
        return all(need.get(k) and tc.get(k) == need.get(k) for k in EXACT) and \
            (need.get("cuda") is None or _cuda_major(tc.get("cuda")) == _cuda_major(need.get("cuda")))

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
                    f"The store has: {has}. An engine only loads on the GPU model, CPU architecture and TensorRT "
                    f"version it was built with; build one here with: qbuild run {recipe}")


def local_needs(sm: str | None = None, tensorrt_llm: str | None = None, tensorrt: str | None = None,
                python: str | None = None, gpu_name: str | None = None, arch: str | None = None) -> dict:
    """What an engine must have been built for to load here; the arguments select for another machine."""
    from qbuild.plugin_services import trtllm_env

    gpu = trtllm_env.gpu()
    env = trtllm_env.trtllm(trtllm_env.configured_python(python))
    need = {"gpu.sm": sm or (gpu.sm if gpu else None),
            "gpu.name": gpu_name or (gpu.name if gpu else None),
            "host.arch": arch or trtllm_env.host_arch() or None,
            "tensorrt_llm": tensorrt_llm or (env.tensorrt_llm if env else None),
            "tensorrt": tensorrt or (env.tensorrt if env else None),
            "cuda": env.cuda if env else None}
    missing = [label for k, label in MATCH_KEYS if k in EXACT and not need[k]]
    if env is not None and not env.cuda:   # installed but unreadable: not a wildcard
        missing.append("CUDA")
    if missing:
        raise UserError(f"cannot tell which engine fits this machine: no {', '.join(missing)} found "
                        "(no NVIDIA GPU / TensorRT-LLM here, or its versions are unreadable); pass "
                        "--sm/--gpu/--arch/--tensorrt-llm/--tensorrt")
    return need
