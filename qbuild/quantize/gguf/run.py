"""The gguf method's worker side (imported only in a step's worker): convert, the importance matrix through
llama.cpp's own llama-imatrix, quantize in-process with llama_model_quantize."""

from __future__ import annotations

from pathlib import Path

from qbuild.plugin_services import ggml_type_id
from qbuild.plugins import StepContext
from qbuild.quantize.gguf.options import IMATRIX_FILE, OUTPUT_FILE


def run_convert(ctx: StepContext) -> dict:
    from qbuild.plugin_services import run_converter

    ctx.progress(0, 1, "convert_hf_to_gguf.py")
    out = ctx.out / OUTPUT_FILE
    run_converter(Path(ctx.inputs["model"]), out, ctx.params["outtype"], log=ctx.log,
                  trust_remote_code=bool(ctx.runtime_args.get("trust_remote_code")))
    ctx.progress(1, 1, "converted")
    return {"format": "gguf", "metrics": {"size_bytes": out.stat().st_size}}


def write_calibration_text(model_dir: Path, calibration_dir: Path, path: Path) -> int:
    """The calibration rows as text for llama-imatrix (it reads text and tokenizes it itself): each row's unpadded
    tokens decoded with special tokens kept (parsed back as such with --parse-special), so it sees the same tokens,
    cut into chunks of seq_len. Returns seq_len."""
    from qbuild.plugin_services import load_calibration

    ids, mask = load_calibration(calibration_dir)
    if (model_dir / "tokenizer.json").is_file():   # the tokenizers library alone: importing transformers costs ~3 s
        from tokenizers import Tokenizer

        tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    else:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    path.write_text("".join(tokenizer.decode(row[keep.astype(bool)].tolist(), skip_special_tokens=False)
                            for row, keep in zip(ids, mask, strict=True)))
    return int(ids.shape[1])


def llama_imatrix_command(binary: Path, gguf: Path, text: Path, out: Path, seq_len: int, threads: int) -> list[str]:
    """llama-imatrix over `text` in chunks of seq_len, GGUF output, no perplexity pass (only the matrix is wanted)."""
    return [str(binary), "-m", str(gguf), "-f", str(text), "-o", str(out), "--output-format", "gguf",
            "-c", str(seq_len), "-t", str(threads), "--parse-special", "--no-ppl", "--output-frequency", "1000000",
            "-lv", "1"]


def run_imatrix(ctx: StepContext) -> dict:
    """llama.cpp's own `llama-imatrix` on the converted GGUF over the shared calibration tokens; its GGUF output
    (per tensor: in_sum2 and counts) is stored as the per-column mean (in_sum2 / counts), what llama-quantize
    derives from it and what run_quantize passes to llama_model_quantize."""
    import json

    import gguf
    import numpy as np
    from safetensors.numpy import save_file

    from qbuild.plugin_services import tool
    from qbuild.plugins import run_tool

    text_file, out_file = ctx.out / "calibration.txt", ctx.out / "imatrix.gguf"
    seq_len = write_calibration_text(Path(ctx.inputs["model"]), Path(ctx.inputs["calibration"]), text_file)
    cmd = llama_imatrix_command(tool("llama-imatrix", log=ctx.log), Path(ctx.inputs["gguf"]) / OUTPUT_FILE, text_file,
                                out_file, seq_len, ctx.threads)
    ctx.progress(0, 1, "llama-imatrix")
    try:
        run_tool(cmd, "llama-imatrix")
    finally:
        ctx.owned().remove(text_file, within=ctx.out)   # the step's own file, through its store's guarded helper
    if not out_file.is_file():
        raise RuntimeError(f"llama-imatrix exited with code 0 but wrote no {out_file.name}")
    reader = gguf.GGUFReader(str(out_file))
    tensors = {t.name: np.asarray(t.data, dtype=np.float32) for t in reader.tensors}
    data = {}
    for name in sorted(n[: -len(".in_sum2")] for n in tensors if n.endswith(".in_sum2")):
        sums, counts = tensors[name + ".in_sum2"], tensors[name + ".counts"].reshape(-1)
        # one row per expert (one for a dense tensor), each divided by its own count, as llama-quantize does
        data[name] = (sums.reshape(len(counts), -1) / np.maximum(counts, 1)[:, None]).reshape(-1).astype(np.float32)
    field = reader.fields.get("imatrix.chunk_count")
    chunks = int(field.contents()) if field is not None else 0
    chunk_size = reader.fields.get("imatrix.chunk_size")
    ctx.owned().remove(out_file, within=ctx.out)   # the step's own file, through its store's guarded helper
    save_file(data, str(ctx.out / IMATRIX_FILE))
    ctx.progress(1, 1, "llama-imatrix")
    info = {"statistic": "llama-imatrix's in_sum2 / counts per input column",
            "tool": "llama-imatrix", "entries": len(data), "chunks": chunks,
            "tokens": chunks * (int(chunk_size.contents()) if chunk_size is not None else seq_len),
            "calibration": ctx.input_manifests.get("calibration", {}).get("key")}
    (ctx.out / "imatrix.json").write_text(json.dumps(info, indent=2))
    return {"format": "imatrix", "metrics": {"entries": len(data), "tokens": info["tokens"]}, "info": info}


def _tensor_overrides(llama_cpp, ctx: StepContext, p: dict, params, keep: list) -> list[dict]:
    """Per-tensor types (the variant's tensor_types, or a search candidate's from the allocation step's output) as
    `params.tt_overrides`; returns them."""
    import ctypes

    overrides = p.get("tensor_types") or []
    if "allocation" in ctx.inputs:   # a search's candidate: its types come from the allocation step's output
        from qbuild.quantize.gguf.search_options import candidate_overrides

        overrides = candidate_overrides(Path(ctx.inputs["allocation"]), p["candidate"])
    if overrides:
        arr = (llama_cpp.llama_model_tensor_override * (len(overrides) + 1))()  # zeroed terminator
        for i, o in enumerate(overrides):
            arr[i].pattern = o["pattern"].encode()
            arr[i].type = ggml_type_id(llama_cpp, o["type"])
        params.tt_overrides = ctypes.cast(arr, ctypes.POINTER(llama_cpp.llama_model_tensor_override))
        keep.append(arr)
    return overrides


def _imatrix_params(llama_cpp, ctx: StepContext, params, keep: list) -> dict:
    """Give llama_model_quantize the imatrix step's matrix (`params.imatrix`) and its provenance in the GGUF metadata,
    under the keys llama-quantize uses; returns the manifest's `imatrix` facts. `keep`: buffers that must outlive
    the call."""
    import ctypes
    import json

    from safetensors.numpy import load_file

    im_dir = Path(ctx.inputs["imatrix"])
    data = load_file(str(im_dir / IMATRIX_FILE))
    im_info = json.loads((im_dir / "imatrix.json").read_text())
    entries = (llama_cpp.llama_model_imatrix_data * (len(data) + 1))()  # zeroed terminator
    for i, (tname, vec) in enumerate(sorted(data.items())):
        buf = (ctypes.c_float * len(vec))(*vec.astype("float32").tolist())
        keep.append(buf)
        entries[i].name = tname.encode()
        entries[i].data = ctypes.cast(buf, ctypes.POINTER(ctypes.c_float))
        entries[i].size = len(vec)
    params.imatrix = ctypes.cast(entries, ctypes.POINTER(llama_cpp.llama_model_imatrix_data))
    keep.append(entries)
    digest = ctx.input_manifests.get("imatrix", {}).get("key", "")
    kv = [("quantize.imatrix.file", llama_cpp.LLAMA_KV_OVERRIDE_TYPE_STR, f"qbuild:imatrix:{digest[:32]}"),
          ("quantize.imatrix.dataset", llama_cpp.LLAMA_KV_OVERRIDE_TYPE_STR,
           f"qbuild:calibration:{str(im_info.get('calibration') or '')[:32]}"),
          ("quantize.imatrix.entries_count", llama_cpp.LLAMA_KV_OVERRIDE_TYPE_INT, len(data)),
          ("quantize.imatrix.chunks_count", llama_cpp.LLAMA_KV_OVERRIDE_TYPE_INT, int(im_info.get("chunks", 0)))]
    kvs = (llama_cpp.llama_model_kv_override * (len(kv) + 1))()  # terminator: empty key
    for i, (key, tag, value) in enumerate(kv):
        kvs[i].key = key.encode()
        kvs[i].tag = tag
        if tag == llama_cpp.LLAMA_KV_OVERRIDE_TYPE_STR:
            kvs[i].value.val_str = value.encode()[:127]
        else:
            kvs[i].value.val_i64 = value
    params.kv_overrides = ctypes.cast(kvs, ctypes.POINTER(llama_cpp.llama_model_kv_override))
    keep.append(kvs)
    return {"step_key": digest, "entries": len(data), "chunks": im_info.get("chunks"), "tokens": im_info.get("tokens"),
            "calibration_key": im_info.get("calibration")}


def run_quantize(ctx: StepContext) -> dict:
    out = ctx.out / OUTPUT_FILE
    info = quantize_into(ctx, ctx.params, out)
    return {"format": "gguf", "metrics": {"size_bytes": out.stat().st_size}, "info": info}


def quantize_into(ctx: StepContext, p: dict, out: Path) -> dict:
    """llama_model_quantize of the step's converted GGUF (with its importance matrix, if an input) to `out` under the
    quantize params `p` (type, output/embedding types, tensor_types or a search candidate); returns the manifest's
    info. A search's probes and selection call it with their own `out` (qbuild.quantize.gguf.probe)."""
    import llama_cpp

    from qbuild.plugins import ToolFailed
    from qbuild.quantize.gguf.llamacpp_log import llama_log_tail

    src = Path(ctx.inputs["gguf"]) / OUTPUT_FILE
    name = p["type"]
    ftype = llama_cpp.LLAMA_FTYPE_ALL_F32 if name == "F32" else getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{name}", None)
    if ftype is None:
        raise ValueError(f"this llama.cpp build ({llama_cpp.__version__}) has no type {name}")
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = ftype
    params.nthread = ctx.threads
    if p.get("output_type"):
        params.output_tensor_type = ggml_type_id(llama_cpp, p["output_type"])
    if p.get("embedding_type"):
        params.token_embedding_type = ggml_type_id(llama_cpp, p["embedding_type"])
    keep = []  # ctypes buffers must outlive the call
    overrides = _tensor_overrides(llama_cpp, ctx, p, params, keep)
    info: dict = {"gguf_type": name, "llama_cpp_python": llama_cpp.__version__}
    requested = sorted({o["type"] for o in overrides} | {p.get("output_type"), p.get("embedding_type")} - {None})
    if requested:   # tensors stored in other types than the file type: they decide where it loads too (loads_in)
        info["part_types"] = requested
    if "imatrix" in ctx.inputs:
        info["imatrix"] = _imatrix_params(llama_cpp, ctx, params, keep)
    ctx.progress(0, 1, f"llama_model_quantize {name}")
    with llama_log_tail() as log_tail:
        rc = llama_cpp.llama_model_quantize(str(src).encode(), str(out).encode(), params)
    if rc != 0:
        raise ToolFailed(f"llama_model_quantize({name})", rc, log_tail.lines(), ended="returned")
    ctx.progress(1, 1, "quantized")
    return info
