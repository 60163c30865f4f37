"""Validate an exported checkpoint against the source model; fix what is safe to fix, refuse the rest.

Two layouts are checked:
  - a TensorRT-LLM checkpoint (config.json + rank<N>.safetensors), as written by ModelOpt's
    export_tensorrt_llm_checkpoint and read by `trtllm-build`;
  - a Hugging Face checkpoint read by TensorRT-LLM's PyTorch backend (which ships transformers 4.x).

Why: ModelOpt 0.47 writes no `rotary_base` into TensorRT-LLM checkpoints, so TensorRT-LLM silently
falls back to 10000; and transformers-5 configs keep the RoPE base under `rope_parameters`, which
transformers 4.x does not read (it falls back to 10000 too). Either way the engine loads and runs,
just with the wrong positions. Without tensorrt_llm importable (the `modelopt` environment) ModelOpt's
export also writes no `qwen_type` for Qwen checkpoints, which TensorRT-LLM's QWenForCausalLM reads
(trtllm-build fails), nor `attn_bias` (QWenConfig then assumes qkv biases, which Qwen3 has not).
Fixable facts (RoPE base, norm epsilon, qwen_type, attn_bias read off the weights) are rewritten in the
config and every fix is returned as a record for the step's manifest; facts baked into the weights
(dims, vocab, group sizes, layer count) are never "fixed": a mismatch is refused. One exception is
expected, not refused: ModelOpt pads the vocabulary of AWQ checkpoints to a multiple of 64 (and writes
the padded vocab_size); runtimes slice logits back to the source vocabulary (padded_vocab()).

Pure Python: reads JSON and safetensors headers only (no torch), so it is cheap and testable.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

DEFAULT_ROPE_BASE = 10000.0  # what TensorRT-LLM and transformers 4.x assume when none is given
AWQ_VOCAB_PAD = 64           # modelopt/torch/export/postprocess.py pad_embedding_lm_head (AWQ exports)
AWQ_ALGOS = ("W4A16_AWQ", "W4A8_AWQ")
QWEN_ARCHITECTURES = ("QWenForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")
# tensorrt_llm/models/qwen/config.py QWenConfig.from_hugging_face: the HF model types it accepts as qwen_type
QWEN_TYPES = ("qwen", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe")

QUANT_ALGO = {  # qbuild modelopt scheme -> quant_algo written by ModelOpt's TensorRT-LLM export
    "none": None,
    "fp8": "FP8",
    "int8-sq": "W8A8_SQ_PER_CHANNEL",
    "int4-awq": "W4A16_AWQ",
    "w4a8-awq": "W4A8_AWQ",
}


class CheckpointError(ValueError):
    """The checkpoint does not match its source model in a way that cannot be fixed safely."""

    def __init__(self, where: str, problems: list[str]):
        self.problems = problems
        super().__init__(f"{where}: " + "; ".join(problems))


def source_facts(cfg: dict) -> dict:
    """The architecture facts of a Hugging Face config, reading both transformers 4 and 5 layouts."""
    cfg = {**cfg.get("text_config", {}), **cfg} if "text_config" in cfg and "hidden_size" not in cfg else cfg
    rope = cfg.get("rope_parameters") or {}
    scaling = cfg.get("rope_scaling") or {}
    theta = rope.get("rope_theta", cfg.get("rope_theta"))
    rope_type = rope.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default"
    heads = cfg["num_attention_heads"]
    hidden = cfg["hidden_size"]
    return {
        "model_type": cfg.get("model_type"),
        "hidden_size": hidden,
        "num_hidden_layers": cfg["num_hidden_layers"],
        "num_attention_heads": heads,
        "num_key_value_heads": cfg.get("num_key_value_heads") or heads,
        "head_size": cfg.get("head_dim") or hidden // heads,
        "intermediate_size": cfg.get("intermediate_size"),
        "vocab_size": cfg["vocab_size"],
        "max_position_embeddings": cfg.get("max_position_embeddings"),
        "norm_epsilon": cfg.get("rms_norm_eps", cfg.get("layer_norm_eps")),
        "rope_theta": float(theta) if theta is not None else DEFAULT_ROPE_BASE,
        "rope_theta_declared": theta is not None,
        "rope_type": rope_type,
        "rope_scaling": {k: v for k, v in {**scaling, **rope}.items() if k not in ("rope_theta",)}
        if rope_type != "default" else None,
    }


def padded_vocab(vocab: int, multiple: int = AWQ_VOCAB_PAD) -> int:
    return -(-vocab // multiple) * multiple


def linear_in_features(cfg: dict) -> dict[str, int]:
    """Input width of each kind of linear layer (what a quantization group must divide)."""
    f = source_facts(cfg)
    dims = {"hidden_size (q/k/v, gate/up input)": f["hidden_size"],
            "num_attention_heads*head_dim (o_proj input)": f["num_attention_heads"] * f["head_size"]}
    if f["intermediate_size"]:
        dims["intermediate_size (down_proj input)"] = f["intermediate_size"]
    return dims


def safetensors_header(path: Path) -> dict:
    """Tensor name -> {dtype, shape} from a safetensors file's JSON header (no tensor data read)."""
    with open(path, "rb") as fh:
        (n,) = struct.unpack("<Q", fh.read(8))
        header = json.loads(fh.read(n))
    header.pop("__metadata__", None)
    return header


def _refuse_or_fix(where: str, cfg_path: Path, cfg: dict, problems: list[str], fixes: list[dict],
                   indent: int) -> list[dict]:
    """Refuse a checkpoint with problems; otherwise write the fixed config (if any fix) and return the fixes."""
    if problems:
        raise CheckpointError(where, problems)
    if fixes:
        cfg_path.chmod(0o644)
        cfg_path.write_text(json.dumps(cfg, indent=indent))
    return fixes


def _close(a, b, rel: float = 1e-6) -> bool:
    return a is not None and b is not None and abs(float(a) - float(b)) <= rel * max(1.0, abs(float(b)))


def validate_trtllm_checkpoint(ckpt: Path, source_config: dict, *, quant_algo: str | None = "any",
                               group_size: int | None = None, tp_size: int | None = None,
                               pp_size: int | None = None, fix: bool = True) -> list[dict]:
    """Check a TensorRT-LLM checkpoint dir against its source model's HF config.

    Returns the fixes applied (each {"field", "was", "now", "why"}); raises CheckpointError for
    anything unfixable. With fix=False a fixable problem is reported as an error instead.
    """
    ckpt = Path(ckpt)
    cfg_path = ckpt / "config.json"
    cfg = json.loads(cfg_path.read_text())
    src = source_facts(source_config)
    problems: list[str] = []
    fixes: list[dict] = []

    def need_fix(field: str, was, now, why: str) -> None:
        if fix:
            cfg[field] = now
            fixes.append({"field": field, "was": was, "now": now, "why": why})
        else:
            problems.append(f"{field} is {was!r}, the source model needs {now!r} ({why})")

    q = cfg.get("quantization") or {}
    problems += _weight_fact_problems(cfg, src, q)
    _check_rope_and_norm(cfg, src, need_fix, problems)
    problems += _quantization_problems(q, quant_algo, group_size)
    problems += _mapping_problems(ckpt, cfg, tp_size, pp_size)

    # 5. tensor shapes (rank 0): vocab and hidden size, quantization group size
    header = safetensors_header(ckpt / "rank0.safetensors") if (ckpt / "rank0.safetensors").is_file() else None
    if header is not None and not problems:
        problems += _check_tensors(header, cfg, src, (cfg.get("mapping") or {}).get("tp_size", 1), q)
    if header is not None and (cfg.get("architecture") in QWEN_ARCHITECTURES or cfg.get("decoder") == "qwen"):
        _check_qwen(cfg, src, header, need_fix, problems)

    return _refuse_or_fix(f"TensorRT-LLM checkpoint {ckpt}", cfg_path, cfg, problems, fixes, indent=4)


def _weight_fact_problems(cfg: dict, src: dict, q: dict) -> list[str]:
    """1. Facts baked into the weights: a mismatch is refused, never fixed."""
    problems = []
    for field in ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                  "vocab_size", "intermediate_size", "head_size"):
        want = src.get(field)
        have = cfg.get(field)
        if field == "head_size" and have is None:
            continue  # TensorRT-LLM derives hidden_size // num_attention_heads; checked below
        if field == "vocab_size" and q.get("quant_algo") in AWQ_ALGOS and have == padded_vocab(want):
            continue  # ModelOpt's AWQ padding (zero rows): the runtimes slice logits to the source vocabulary
        if want is not None and have != want:
            problems.append(f"{field} is {have!r} in the checkpoint but {want!r} in the source model")
    if cfg.get("head_size") is None and src["head_size"] != src["hidden_size"] // src["num_attention_heads"]:
        problems.append(f"head_size missing while the source model's head_dim ({src['head_size']}) "
                        f"is not hidden_size/num_attention_heads")
    return problems


def _check_rope_and_norm(cfg: dict, src: dict, need_fix, problems: list[str]) -> None:
    """2. RoPE: the base is not in the weights, so a missing or wrong value is fixed (norm_epsilon likewise)."""
    if str(cfg.get("position_embedding_type", "rope_gpt_neox")).startswith("rope"):
        have = cfg.get("rotary_base")
        if not _close(have, src["rope_theta"]):
            why = ("missing: TensorRT-LLM would assume 10000" if have is None
                   else "differs from the source model's rope_theta")
            if have is None and _close(src["rope_theta"], DEFAULT_ROPE_BASE):
                why = "missing; written explicitly (equals the default)"
            need_fix("rotary_base", have, src["rope_theta"], why)
        if src["rope_type"] != "default" and not cfg.get("rotary_scaling"):
            problems.append(f"the source model uses RoPE scaling {src['rope_type']!r} "
                            f"({src['rope_scaling']}) but the checkpoint has no rotary_scaling")
    if src["norm_epsilon"] is not None and cfg.get("norm_epsilon") is not None \
            and not _close(cfg["norm_epsilon"], src["norm_epsilon"], 1e-3):
        need_fix("norm_epsilon", cfg["norm_epsilon"], src["norm_epsilon"], "differs from the source model")


def _quantization_problems(q: dict, quant_algo: str | None, group_size: int | None) -> list[str]:
    """3. Quantization as requested."""
    problems = []
    if quant_algo != "any" and q.get("quant_algo") != quant_algo:
        problems.append(f"quantization.quant_algo is {q.get('quant_algo')!r}, expected {quant_algo!r}")
    if group_size is not None and q.get("group_size") != group_size:
        problems.append(f"quantization.group_size is {q.get('group_size')!r}, expected {group_size}")
    return problems


def _mapping_problems(ckpt: Path, cfg: dict, tp_size: int | None, pp_size: int | None) -> list[str]:
    """4. Mapping and rank files."""
    problems = []
    mapping = cfg.get("mapping") or {}
    world = mapping.get("world_size", 1)
    for name, want in (("tp_size", tp_size), ("pp_size", pp_size)):
        if want is not None and mapping.get(name, 1) != want:
            problems.append(f"mapping.{name} is {mapping.get(name, 1)}, expected {want}")
    ranks = sorted(ckpt.glob("rank*.safetensors"))
    if len(ranks) != world:
        problems.append(f"{len(ranks)} rank*.safetensors file(s) for world_size {world}")
    return problems


def _check_qwen(cfg: dict, src: dict, header: dict, need_fix, problems: list[str]) -> None:
    """6. Qwen: what TensorRT-LLM's QWenConfig reads but ModelOpt's export (without tensorrt_llm) does not write."""
    if not cfg.get("qwen_type"):
        if src["model_type"] in QWEN_TYPES:
            need_fix("qwen_type", cfg.get("qwen_type"), src["model_type"],
                     "missing: TensorRT-LLM's QWenForCausalLM reads it (the source model's model_type)")
        else:
            problems.append(f"qwen_type missing and the source model_type {src['model_type']!r} is not one "
                            f"TensorRT-LLM accepts ({', '.join(QWEN_TYPES)})")
    has_bias = any(n.endswith(".attention.qkv.bias") for n in header)
    if cfg.get("attn_bias") is None or bool(cfg["attn_bias"]) != has_bias:
        need_fix("attn_bias", cfg.get("attn_bias"), has_bias,
                 "QWenConfig assumes qkv biases when it is missing; read off the checkpoint's tensors")


def _check_tensors(header: dict, cfg: dict, src: dict, tp: int, q: dict) -> list[str]:
    problems = []
    hidden = src["hidden_size"]
    emb = header.get("transformer.vocab_embedding.weight")
    if emb is None:
        problems.append("rank0.safetensors has no transformer.vocab_embedding.weight")
    else:
        rows = emb["shape"][0]
        # use_parallel_embedding with embedding_sharding_dim 0 splits the vocabulary over the tensor-parallel ranks
        # only (tensorrt_llm Embedding: tp_size/tp_group); pipeline stages each hold a whole table (the first)
        sharded = cfg.get("use_parallel_embedding") and cfg.get("embedding_sharding_dim", 0) == 0 and tp > 1
        full = rows * tp if sharded else rows
        if emb["shape"][1] != hidden or not (src["vocab_size"] <= full < src["vocab_size"] + AWQ_VOCAB_PAD * tp):
            problems.append(f"vocab_embedding shape {emb['shape']} does not fit vocab {src['vocab_size']} x hidden {hidden}")
    lm = header.get("lm_head.weight")
    if lm is not None and lm["shape"][-1] != hidden:
        problems.append(f"lm_head.weight shape {lm['shape']} does not match hidden_size {hidden}")
    group = q.get("group_size")
    if group and "AWQ" in str(q.get("quant_algo")):
        for name, t in header.items():
            if not name.endswith(".weights_scaling_factor") or len(t["shape"]) != 2:
                continue
            w = header.get(name[: -len("weights_scaling_factor")] + "weight")
            if w is None:
                continue
            in_features, groups = w["shape"][1], t["shape"][1]
            if groups * group != in_features:
                problems.append(f"{name}: {groups} groups over {in_features} inputs is not group_size {group}")
                break
    return problems


def validate_hf_export(ckpt: Path, source_config: dict, fix: bool = True) -> list[dict]:
    """A Hugging Face checkpoint for TensorRT-LLM's PyTorch backend (transformers 4.x inside).

    transformers 5 writes the RoPE base only under `rope_parameters`; 4.x reads `rope_theta` and
    `rope_scaling`. Both are written so either version reads the source model's values.
    """
    ckpt = Path(ckpt)
    cfg_path = ckpt / "config.json"
    cfg = json.loads(cfg_path.read_text())
    src = source_facts(source_config)
    problems, fixes = [], []
    for field in ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size", "intermediate_size"):
        if src.get(field) is not None and cfg.get(field) != src[field]:
            problems.append(f"{field} is {cfg.get(field)!r} in the checkpoint but {src[field]!r} in the source model")
    if not _close(cfg.get("rope_theta"), src["rope_theta"]):
        if fix:
            fixes.append({"field": "rope_theta", "was": cfg.get("rope_theta"), "now": src["rope_theta"],
                          "why": "transformers 4.x (TensorRT-LLM's) reads rope_theta, not rope_parameters"})
            cfg["rope_theta"] = src["rope_theta"]
        else:
            problems.append(f"rope_theta is {cfg.get('rope_theta')!r}, the source model needs {src['rope_theta']}")
    if src["rope_type"] != "default" and not cfg.get("rope_scaling"):
        scaling = {k: v for k, v in (src["rope_scaling"] or {}).items()}
        if fix:
            fixes.append({"field": "rope_scaling", "was": None, "now": scaling,
                          "why": "transformers 4.x reads rope_scaling, not rope_parameters"})
            cfg["rope_scaling"] = scaling
        else:
            problems.append(f"rope_scaling missing for RoPE type {src['rope_type']!r}")
    return _refuse_or_fix(f"checkpoint {ckpt}", cfg_path, cfg, problems, fixes, indent=2)
