"""Is vLLM's CPU INT8 GEMM exact on this CPU? (issue 48: the W8A8 KLD gap between vLLM and transformers)

    .venv/bin/python bench/bench_vllm_int8_gemm.py [--max-isa AVX2]

In the `vllm` backend environment (`qbuild env create vllm`), with the kernels vLLM's W8A8 layers call on a CPU
without AMX (CPUInt8ScaledMMLinearKernel's oneDNN path): activations quantized per token by
`onednn_scaled_int8_quant`, multiplied by per-channel INT8 weights with `onednn_scaled_mm`. Each product is compared
with the same INT8 operands multiplied exactly (int32 sums, scaled in float64), on random operands and on operands
at the extremes (every activation at ±127, alternating, against weights at up to ±127). Also the activation
quantization against round(x / (amax / 127)). Prints the largest relative errors; 1e-6 or less is exact to float32
rounding, and oneDNN's kernel and ISA.

`--max-isa` caps oneDNN's instruction set (its ONEDNN_MAX_CPU_ISA: AVX2, AVX512_CORE, AVX2_VNNI, AVX512_CORE_VNNI,
...), so a VNNI CPU measures what a CPU without VNNI computes: there oneDNN sums pairs of u8 x s8 products in 16 bits
and saturates ("Nuances of int8 computations" in its docs).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

PROBE = r"""
import json, torch
from vllm import _custom_ops as ops
torch.manual_seed(0)
K, N, M = 576, 1536, 64          # SmolLM2-135M's MLP up projection, 64 tokens
out = {}
def gemm(x, w_q, w_s):
    x_q, x_s, _ = ops.onednn_scaled_int8_quant(x, None, None, True)
    handler = ops.create_onednn_scaled_mm(w_q.t(), w_s.t().contiguous().float(), torch.float32, True, False, 32)
    y = torch.empty(M, N)
    ops.onednn_scaled_mm(handler, x_q, y, x_s, None, None, None)
    exact = (x_q.double() @ w_q.double().t()) * x_s.double().view(-1, 1) * w_s.double().view(1, -1)
    return x_q, x_s, ((y.double() - exact).abs().max() / exact.abs().max()).item()
w = torch.randn(N, K)
w_s = w.abs().amax(dim=1, keepdim=True) / 127
w_q = torch.round(w / w_s).clamp(-127, 127).to(torch.int8)
x = torch.randn(M, K) * 3
x_q, x_s, out["random"] = gemm(x, w_q, w_s)
ref = torch.round(x / (x.abs().amax(dim=1, keepdim=True) / 127)).clamp(-127, 127)
out["activation_codes_differing"] = (x_q.float() != ref).float().mean().item()
extreme = torch.ones(M, K); extreme[:, ::2] = -1
_, _, out["adversarial"] = gemm(extreme, torch.randint(-127, 128, (N, K), dtype=torch.int8), torch.full((N, 1), 0.01))
print("RESULT " + json.dumps(out))
"""


def main() -> None:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--max-isa", help="cap oneDNN's ISA (ONEDNN_MAX_CPU_ISA), e.g. AVX2: a CPU without VNNI")
    args = parser.parse_args()
    sys.path.insert(0, str(REPO))
    from qbuild import envs
    from qbuild.base.hardware import cpu_isa

    made = envs.created("vllm")
    if made is None:
        sys.exit("no vllm environment: .venv/bin/qbuild env create vllm")
    env = {"OMP_NUM_THREADS": "1", "VLLM_NO_USAGE_STATS": "1", "PATH": "/usr/bin:/bin", "ONEDNN_VERBOSE": "1",
           **({"ONEDNN_MAX_CPU_ISA": args.max_isa} if args.max_isa else {})}
    proc = subprocess.run([made.python, "-c", PROBE], capture_output=True, text=True, timeout=600, env=env)
    line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
    if proc.returncode != 0 or line is None:
        sys.exit(f"the probe failed: {proc.stderr[-2000:]}")
    r = json.loads(line[len("RESULT "):])
    verbose = [x.split(",") for x in proc.stdout.splitlines() if x.startswith("onednn_verbose")]
    r |= {"cpu_isa": cpu_isa(), "max_isa": args.max_isa,
          "onednn_isa": next((f[4].split(":", 1)[1] for f in verbose if len(f) > 4 and f[4].startswith("isa:")), None),
          "onednn_matmul": next((f[6] for f in verbose if len(f) > 6 and f[5] == "matmul"), None)}
    print(f"this CPU: {r['cpu_isa']}; oneDNN: {r['onednn_isa']} (max-isa {args.max_isa or 'not capped'}), "
          f"matmul {r['onednn_matmul']}")
    print(f"oneDNN INT8 GEMM, largest error relative to the largest output: random operands {r['random']:.1e}, "
          f"extreme operands {r['adversarial']:.1e} (exact: <= 1e-6)")
    print(f"activation codes differing from round(x / (amax/127)): {r['activation_codes_differing']:.2%}")
    out = REPO / "bench" / "results" / "vllm_int8_gemm.jsonl"
    out.parent.mkdir(exist_ok=True)
    with out.open("a") as f:
        f.write(json.dumps(r) + "\n")


if __name__ == "__main__":
    main()
