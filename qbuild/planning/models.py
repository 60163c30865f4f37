"""Turn the recipe's model section into the plan's first step (cheap: no torch, no download)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

from qbuild.artifacts.store import atomic_write_json
from qbuild.base.errors import RecipeError
from qbuild.base.fingerprint import cache_dir as fingerprint_cache
from qbuild.base.fingerprint import dir_fingerprint
from qbuild.base.hashing import sha256_text
from qbuild.contract.formats import Format
from qbuild.contract.step import HF_PRELOAD, Step
from qbuild.planning.recipe import GGUFModel, HubModel, LocalModel

HF_TOOLS = ("torch", "transformers", "safetensors")


def resolve_path(spec: str, base: Path, field: str) -> Path:
    """A path relative to the recipe, or pkg://<package>/<file> inside an installed package.

    The package is located with find_spec, never imported (importing may pull unrelated deps).
    """
    if spec.startswith("pkg://"):
        pkg, _, rel = spec.removeprefix("pkg://").partition("/")
        found = importlib.util.find_spec(pkg.replace("-", "_"))
        if found is None or not found.submodule_search_locations:
            raise RecipeError(field, f"package {pkg!r} is not installed (pip install {pkg.replace('_', '-')})")
        path = Path(list(found.submodule_search_locations)[0]) / rel
    else:
        path = Path(spec).expanduser()
        if not path.is_absolute():
            path = base / path
    if not path.exists():
        raise RecipeError(field, f"{spec!r} does not exist ({path})")
    return path


def hub_snapshot(repo: str, revision: str) -> Path:
    """Resolve a hub repo@revision through the local HF cache only."""
    try:
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import LocalEntryNotFoundError
    except ImportError:
        raise RecipeError("model.repo", "hub models need huggingface-hub; run: pip install 'qbuild[hf]'") from None
    try:
        return Path(snapshot_download(repo, revision=revision, local_files_only=True))
    except LocalEntryNotFoundError:
        raise RecipeError(
            "model.repo",
            f"{repo}@{revision} is not in the local Hugging Face cache and qbuild never downloads at run time; "
            f"fetch it first: hf download {repo} --revision {revision}",
        ) from None
    except Exception as exc:  # invalid repo id, corrupt cache
        raise RecipeError("model.repo", f"cannot resolve {repo}@{revision} from the local cache: {exc}") from None


def checkpoint_code(path: Path, spec, field: str) -> dict:
    """Refuse a checkpoint that carries its own Python unless the recipe trusts it; the model step's params for
    that choice (empty when off, so no key changes for a checkpoint without code)."""
    from qbuild.models.custom_code import carries_code

    if spec.trust_remote_code:
        return {"trust_remote_code": True}
    why = carries_code(path)
    if why:
        raise RecipeError(field, f"{path} carries its own Python code: {why}. qbuild runs no code from a model "
                                 f"unless the recipe says so: read the code, then set model.trust_remote_code: true")
    return {}


def model_step(spec, recipe_dir: Path) -> Step:
    if isinstance(spec, LocalModel):
        path = resolve_path(spec.path, recipe_dir, "model.path")
        if not (path / "config.json").is_file():
            raise RecipeError("model.path", f"{path} is not a Hugging Face checkpoint (no config.json)")
        trust = checkpoint_code(path, spec, "model.path")
        digest = sha256_text("local-dir:" + dir_fingerprint(path))
        return Step("model", "model", {"source": "local", **trust}, None, source_path=path, source_digest=digest,
                    format=Format.HF)
    if isinstance(spec, HubModel):
        path = hub_snapshot(spec.repo, spec.revision)
        trust = checkpoint_code(path, spec, "model.repo")
        commit = path.name  # snapshots/<commit sha>
        digest = sha256_text(f"hub:{spec.repo}@{commit}")
        return Step("model", "model", {"source": "hub", "repo": spec.repo, "commit": commit, **trust}, None,
                    source_path=path, source_digest=digest, format=Format.HF)
    if isinstance(spec, GGUFModel):
        path = resolve_path(spec.path, recipe_dir, "model.path")
        if not path.is_file():
            raise RecipeError("model.path", f"{path} is not a GGUF file (source: gguf takes one .gguf file)")
        digest = dir_fingerprint(path)
        facts = gguf_facts(path, digest)
        dtype = facts["source_dtype"] if spec.dtype == "auto" else spec.dtype
        params = {"source": "gguf", "gguf_sha256": digest, "dtype": dtype}
        if facts.get("tokenizer_writer") is not None:   # the tokenizer written for it changed (issue 47): the
            params["tokenizer_writer"] = facts["tokenizer_writer"]   # key follows; SmolLM2's did not, its key stays
        return Step("import-gguf", "model", params, "qbuild.models.gguf_import:run",
                    tools=HF_TOOLS + ("gguf", "accelerate"), variant="base", format=Format.HF,
                    runtime_args={"gguf_path": str(path)},
                    preload=HF_PRELOAD, memory="dequantizes-gguf",
                    impl_version=4)  # 2: byte-level BPE tokenizers restored; 3: tokenizers rebuilt from the GGUF's own
                                     # vocabulary (SentencePiece as tokenizer.model, BPE with its pre-tokenizer);
                                     # 4: Llama 3's RoPE scaling recovered from rope_freqs, Gemma's query scaling
    raise AssertionError(spec)


def model_info(step: Step) -> dict:
    """Architecture facts for plan-time checks (hidden size, layer dims), read without torch. The model is untrusted:
    what it states is read bounded and checked first (qbuild.models.model_config); a bad file is one RecipeError
    naming it and the field."""
    from qbuild.models.model_config import ConfigRefused, check_sizes, read_json_mapping

    if step.source_path is not None:
        config = step.source_path / "config.json"
        try:
            return check_sizes(read_json_mapping(config))
        except ConfigRefused as exc:
            raise RecipeError("model.path", f"{config}: {exc}") from None
    return gguf_facts(Path(step.runtime_args["gguf_path"]), step.params["gguf_sha256"])


def gguf_facts(path: Path, digest: str) -> dict:
    """A GGUF's checked architecture facts (qbuild.models.gguf_import.gguf_config). Parsing its metadata (vocab,
    merges) takes seconds: memoized by the file's content hash, and only what passed the checks is memoized."""
    memo = fingerprint_cache() / "model-info" / f"{digest}.v9.json"   # v9: + untouched_dtype; v8: + tokenizer_writer/_refusal
    try:
        return json.loads(memo.read_text())
    except (OSError, ValueError):
        pass
    info = _read_gguf(path)
    atomic_write_json(memo, info)
    return info


def _read_gguf(path: Path) -> dict:
    from qbuild.models.gguf_header import GGUFRefused
    from qbuild.models.gguf_import import gguf_config
    from qbuild.models.model_config import ConfigRefused

    try:
        return gguf_config(path)
    except (GGUFRefused, ConfigRefused) as exc:
        raise RecipeError("model.path", f"{path}: {exc}") from None


def model_bos(step: Step) -> tuple[bool | None, str]:
    """(whether the model's own tokenizer starts a sequence with BOS, where that is read from), or (None, why not)
    where the model does not say. The same weights give the same answer from any source: a GGUF's
    `tokenizer.ggml.add_bos_token` (llama.cpp's default for its vocabulary where it is absent), an HF checkpoint's
    `tokenizer_config.json` `add_bos_token`, else what its `tokenizer.json` post-processor adds."""
    from qbuild.models.model_config import ConfigRefused, read_json_mapping

    if step.source_path is None:
        info = model_info(step)
        if "add_bos_token" not in info:
            return None, "the GGUF states no add_bos_token"
        return info["add_bos_token"], info.get("add_bos_from") or "the GGUF's tokenizer.ggml.add_bos_token"
    try:
        config = read_json_mapping(step.source_path / "tokenizer_config.json")
    except ConfigRefused:
        config = {}
    if isinstance(config.get("add_bos_token"), bool):
        return config["add_bos_token"], "tokenizer_config.json's add_bos_token"
    try:
        tokenizer = read_json_mapping(step.source_path / "tokenizer.json", limit=TOKENIZER_JSON_LIMIT)
    except ConfigRefused:
        return None, "the checkpoint states no add_bos_token"
    bos = config.get("bos_token")
    bos = bos.get("content") if isinstance(bos, dict) else bos if isinstance(bos, str) else None
    adds = post_processor_adds_bos(tokenizer.get("post_processor"), bos)
    if adds is None:
        return None, "the checkpoint states no add_bos_token"
    return adds, "tokenizer.json's post-processor"


TOKENIZER_JSON_LIMIT = 256 << 20   # a 256k-token vocabulary with its merges is ~30 MB


def post_processor_adds_bos(processor, bos: str | None) -> bool | None:
    """Whether a tokenizers post-processor (tokenizer.json) puts the BOS token `bos` first; None where it cannot tell."""
    if processor is None:
        return False
    if not isinstance(processor, dict):
        return None
    kind = processor.get("type")
    if kind == "Sequence":
        found = [post_processor_adds_bos(p, bos) for p in processor.get("processors") or []]
        return True if True in found else None if None in found else False
    if kind == "TemplateProcessing":
        single = processor.get("single") or []
        first = single[0] if single and isinstance(single[0], dict) else {}
        special = first.get("SpecialToken")
        if special is None:
            return False
        return bos is None or special.get("id") == bos
    if kind == "ByteLevel":
        return False
    return None   # Bert/Roberta processors add their CLS: not a BOS convention this reads
