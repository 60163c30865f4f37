"""GGUF scoring speed: qbuild's scoring path now vs the path before issue 11, vs `llama-perplexity` if built.

    PYTHONPATH=$PWD .venv/bin/python bench/bench_eval_speed.py --store /tmp/eval-store/new [--variant demo/q8_0]
        [--protocol llama.cpp|fixed-window] [--llama-perplexity /path/to/llama-perplexity]

Same GGUF, same windows (the demo's eval-data tokens), same session, 1 thread; model load excluded for
both qbuild paths. "old": llama-cpp-python's Llama.eval with logits_all (every row copied into
Llama.scores, then into a fresh array), then window_nll. "new": one llama_decode that outputs only the
scored rows, read through a numpy view over llama.cpp's logits buffer, then score_rows (one log-sum-exp
per row). Both must give the same PPL bit for bit. With --llama-perplexity, the tool runs on the same
text (ASCII, see bench_llamacpp_protocol.py) with -t 1; its time includes model load and tokenization.
Target (issue 11): ≤ 1.15× llama-perplexity.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

from bench_llamacpp_protocol import REPO, stored  # bench/ is on sys.path when a bench runs as a script

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def eval_tokens(store: Path, gguf_manifest_path: Path):
    """The demo's eval-data tokens: the newest eval-data object in the store."""
    from qbuild.evaluate.data import load_tokens

    objs = []
    for m in store.glob("objects/*/*/manifest.json"):
        man = json.loads(m.read_text())
        if man.get("kind") == "eval-data":
            objs.append((m.stat().st_mtime, m.parent))
    if not objs:
        sys.exit(f"no eval-data object in {store}")
    return load_tokens(max(objs)[1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--store", type=Path, default=Path(os.environ.get("QBUILD_STORE", REPO / "artifacts")))
    ap.add_argument("--variant", default="demo/q8_0")
    ap.add_argument("--protocol", default="llama.cpp", choices=("llama.cpp", "fixed-window"))
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--windows", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--flash-attn", choices=("on", "off"), default="off",
                    help="flash attention in both qbuild's session and llama-perplexity (-fa); its default is on")
    ap.add_argument("--llama-perplexity", default=os.environ.get("LLAMA_PERPLEXITY") or shutil.which("llama-perplexity"))
    args = ap.parse_args()

    from qbuild.contract.protocol import score_rows, summarize, window_nll, windows
    from qbuild.runtimes.llamacpp import LlamaCppSession

    path = stored(args.variant, args.store)
    gguf = next(path.glob("*.gguf"))
    ids, info = eval_tokens(args.store, path)
    wins = windows(ids, args.protocol, args.ctx, True, info["bos_token_id"], args.windows)
    rt = LlamaCppSession(gguf, args.ctx, 1, flash_attn=args.flash_attn == "on")

    def old():
        return summarize([window_nll(rt.logits(w.tokens), w) for w in wins])

    def new():
        out = []
        for w in wins:
            d = score_rows(rt.scored_logits(w.tokens, w.first_scored), w)
            out.append((d["nll"], d["count"]))
        return summarize(out)

    times = {"old": [], "new": []}
    results = {}
    for _ in range(args.repeats):          # alternate, so a busy machine hurts both alike
        for name, fn in (("old", old), ("new", new)):
            t0 = time.perf_counter()
            results[name] = fn()
            times[name].append(time.perf_counter() - t0)
    t_old, t_new = min(times["old"]), min(times["new"])
    print(f"gguf        {gguf}")
    print(f"protocol    {args.protocol}, n_ctx {args.ctx}, {len(wins)} windows, {results['new']['tokens_scored']} "
          f"tokens scored, 1 thread, best of {args.repeats}")
    print(f"old path    PPL {results['old']['ppl']:.10f}   {t_old:7.2f} s")
    print(f"new path    PPL {results['new']['ppl']:.10f}   {t_new:7.2f} s")
    print(f"new / old   {t_new / t_old:.3f}×   same PPL: {results['old']['ppl'] == results['new']['ppl']}")
    if not args.llama_perplexity:
        print("llama-perplexity: not built here (pass --llama-perplexity); no ratio against it")
        return
    from transformers import AutoTokenizer

    from qbuild.calibration.corpus import pydocs_documents

    text = "\n\n".join(pydocs_documents("test")).encode("ascii", "ignore").decode()
    tok = AutoTokenizer.from_pretrained(str(stored(args.variant.split("/")[0] + "/base", args.store)))
    ascii_ids = tok(text, add_special_tokens=False)["input_ids"]
    wins = windows(ascii_ids, "llama.cpp", args.ctx, True, info["bos_token_id"], args.windows)
    import tempfile

    with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as f:
        f.write(text)
    cmd = [args.llama_perplexity, "-m", str(gguf), "-f", f.name, "-c", str(args.ctx), "-b", str(args.ctx),
           "--chunks", str(args.windows), "-t", "1", "-fa", args.flash_attn]
    t_news, t_ls = [], []
    for _ in range(args.repeats):          # alternate, best of each
        t0 = time.perf_counter()
        new()
        t_news.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        res = subprocess.run(cmd, capture_output=True, text=True)
        t_ls.append(time.perf_counter() - t0)
    t_new, t_l = min(t_news), min(t_ls)
    os.unlink(f.name)
    m = re.search(r"Final estimate: PPL = ([0-9.]+)", res.stdout + res.stderr)
    print(f"llama-perplexity PPL {m.group(1) if m else '?'}   {t_l:7.2f} s (incl. load, -fa {args.flash_attn})   "
          f"qbuild new {t_new:.2f} s / llama-perplexity = {t_new / t_l:.3f}×")


if __name__ == "__main__":
    main()
