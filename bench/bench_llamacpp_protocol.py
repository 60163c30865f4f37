"""qbuild's `llama.cpp` perplexity protocol vs llama.cpp's own `llama-perplexity`, same GGUF, same text.

    .venv/bin/python bench/bench_llamacpp_protocol.py --llama-perplexity /path/to/llama-perplexity

`llama-perplexity` is a llama.cpp tool that llama-cpp-python does not ship; build it from the same
llama.cpp (e.g. the vendored tree in the llama-cpp-python sdist: cmake -B build -DLLAMA_CURL=OFF &&
cmake --build build --target llama-perplexity). Uses the demo's F16 variant from the store by default.
Target (issue 3): the same number.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
REPO = Path(__file__).resolve().parents[1]


def stored(ref: str, store: Path) -> Path:
    res = subprocess.run([sys.executable, "-m", "qbuild", "show", ref, "--store", str(store)], capture_output=True,
                         text=True)
    if res.returncode != 0:
        sys.exit(f"{ref} is not in {store}: run `qbuild recipes/demo.yaml --store {store}` first")
    return Path(json.loads(res.stdout)["path"])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--llama-perplexity", default=os.environ.get("LLAMA_PERPLEXITY") or shutil.which("llama-perplexity"))
    ap.add_argument("--store", type=Path, default=REPO / "artifacts")
    ap.add_argument("--variant", default="demo/f16")
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--chunks", type=int, default=8)
    args = ap.parse_args()
    if not args.llama_perplexity:
        sys.exit("llama-perplexity not found: pass --llama-perplexity or set LLAMA_PERPLEXITY")
    gguf = next(stored(args.variant, args.store).glob("*.gguf"))
    tokenizer_dir = stored("demo/base", args.store)

    from transformers import AutoTokenizer

    from qbuild.calibration.corpus import pydocs_documents
    from qbuild.contract.protocol import summarize, window_nll, windows
    from qbuild.runtimes.llamacpp import LlamaCppSession

    # ASCII only: this llama.cpp build's tokenizer aborts (unordered_map::at) on some stdlib docstring characters
    text = "\n\n".join(pydocs_documents("test")).encode("ascii", "ignore").decode()
    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    ids = tok(text, add_special_tokens=False)["input_ids"]
    # llama.cpp adds BOS only when the GGUF says so; the converter sets add_bos_token=false for this vocab
    import gguf as gguf_py

    field = gguf_py.GGUFReader(str(gguf)).fields.get("tokenizer.ggml.add_bos_token")
    add_bos = bool(field.contents()) if field is not None else False
    wins = windows(ids, "llama.cpp", args.ctx, add_bos, tok.bos_token_id, args.chunks)
    rt = LlamaCppSession(gguf, args.ctx, 1)
    t0 = time.perf_counter()
    q = summarize([window_nll(rt.logits(w.tokens), w) for w in wins])
    t_q = time.perf_counter() - t0

    with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as f:
        f.write(text)
    t0 = time.perf_counter()
    res = subprocess.run([args.llama_perplexity, "-m", str(gguf), "-f", f.name, "-c", str(args.ctx), "-b", str(args.ctx),
                          "--chunks", str(args.chunks), "-t", "1"], capture_output=True, text=True)
    t_l = time.perf_counter() - t0
    os.unlink(f.name)
    m = re.search(r"Final estimate: PPL = ([0-9.]+)", res.stdout + res.stderr)
    if not m:
        sys.exit(f"could not read llama-perplexity's result:\n{(res.stdout + res.stderr)[-2000:]}")
    ref = float(m.group(1))
    print(f"gguf              {gguf}")
    print(f"protocol          llama.cpp, n_ctx {args.ctx}, {len(wins)} chunks, add_bos={add_bos}, {q['tokens_scored']} tokens")
    print(f"qbuild            PPL {q['ppl']:.4f}   {t_q:6.2f} s")
    print(f"llama-perplexity  PPL {ref:.4f}   {t_l:6.2f} s (incl. model load)")
    print(f"difference        {100 * (q['ppl'] - ref) / ref:+.4f} %")


if __name__ == "__main__":
    main()
