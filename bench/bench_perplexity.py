"""qbuild's perplexity vs a plain transformers loop and vs lm-eval-harness, on the same model and tokens.

    .venv/bin/python bench/bench_perplexity.py --model PATH_TO_HF_DIR [--windows 8 --ctx 512]

Without --model it uses the demo's baseline from the store (`qbuild recipes/demo.yaml` first).
Targets (issue 3): qbuild = plain loop within ±0.1 % at a time ratio ≤ 1.05; ≥ 1.5× faster than
lm-eval's rolling loglikelihood (the number differs there: lm-eval has its own windowing).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
REPO = Path(__file__).resolve().parents[1]


def demo_model(store: Path) -> Path:
    res = subprocess.run([sys.executable, "-m", "qbuild", "show", "demo/base", "--store", str(store)],
                         capture_output=True, text=True)
    if res.returncode != 0:
        sys.exit("no demo/base in the store: run `qbuild recipes/demo.yaml` first, or pass --model")
    return Path(json.loads(res.stdout)["path"])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", type=Path)
    ap.add_argument("--store", type=Path, default=REPO / "artifacts")
    ap.add_argument("--windows", type=int, default=8)
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeat", type=int, default=2)
    args = ap.parse_args()
    model_dir = args.model or demo_model(args.store)

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from qbuild.calibration.corpus import pydocs_documents
    from qbuild.contract.protocol import summarize, window_nll, windows
    from qbuild.runtimes.transformers import TransformersSession

    torch.set_num_threads(args.threads)
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    ids = tok("\n\n".join(pydocs_documents("test")), add_special_tokens=False)["input_ids"]
    wins = windows(ids, "fixed-window", args.ctx, True, tok.bos_token_id, args.windows)

    # qbuild: the runtime + protocol code the perplexity step runs; plain: labels=input_ids, mean loss.
    # Interleaved per window, best of `--repeat`, so a busy machine penalizes both alike.
    rt = TransformersSession(model_dir, args.threads, "cpu")
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()

    def plain(w):
        with torch.inference_mode():
            x = torch.tensor([w.tokens])
            return model(x, labels=x).loss.item() * (len(w.tokens) - 1), len(w.tokens) - 1

    rt.logits(wins[0].tokens), plain(wins[0])  # warm-up
    t_qbuild = t_plain = 0.0
    nlls, total, count = [], 0.0, 0
    for w in wins:
        best_q = best_p = float("inf")
        for _ in range(args.repeat):
            t0 = time.perf_counter()
            nll = window_nll(rt.logits(w.tokens), w)
            best_q = min(best_q, time.perf_counter() - t0)
            t0 = time.perf_counter()
            loss, n = plain(w)
            best_p = min(best_p, time.perf_counter() - t0)
        nlls.append(nll)
        total, count = total + loss, count + n
        t_qbuild, t_plain = t_qbuild + best_q, t_plain + best_p
    q = summarize(nlls)
    plain_ppl = math.exp(total / count)

    print(f"model           {model_dir}")
    print(f"tokens scored   {q['tokens_scored']} in {len(wins)} windows of {args.ctx}")
    print(f"qbuild          PPL {q['ppl']:.4f}  {t_qbuild:7.2f} s")
    print(f"plain loop      PPL {plain_ppl:.4f}  {t_plain:7.2f} s")
    print(f"PPL difference  {100 * (q['ppl'] - plain_ppl) / plain_ppl:+.4f} %   (target within ±0.1 %)")
    print(f"time ratio      {t_qbuild / t_plain:.3f}   (qbuild / plain; target ≤ 1.05)")

    try:
        from lm_eval.api.instance import Instance
        from lm_eval.models.huggingface import HFLM
    except ImportError:
        print("lm-eval        not installed (pip install lm_eval): skipped")
        return
    text = tok.decode([t for w in wins for t in w.tokens[1:]])
    lm = HFLM(pretrained=str(model_dir), batch_size=1, max_length=args.ctx, device="cpu", dtype="float32")
    req = [Instance(request_type="loglikelihood_rolling", doc={}, arguments=(text,), idx=0)]
    t0 = time.perf_counter()
    ll = lm.loglikelihood_rolling(req, disable_tqdm=True)[0]
    t_lm = time.perf_counter() - t0
    n_tok = len(lm.tok_encode(text))
    print(f"lm-eval rolling PPL {math.exp(-ll / n_tok):.4f}  {t_lm:7.2f} s   ({n_tok} tokens, its own windowing)")
    print(f"speed-up        {t_lm / t_qbuild:.2f}×   (lm-eval / qbuild; target ≥ 1.5×)")


if __name__ == "__main__":
    main()
