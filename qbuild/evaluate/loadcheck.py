"""Load check: does each runtime load the artifact, and does it continue a fixed prompt like the baseline?

Two step runners:

- `prompt` (step `load-check-prompt`, once per recipe): the prompt tokenized with the baseline's tokenizer, and
  that tokenizer saved next to the ids, so every artifact and runtime is fed the same ids and every generation is
  decoded the same way (a GGUF's own tokenizer or an engine's missing one never makes two checks disagree).
- `run` (step `load-check[<artifact>]`, per artifact and runtime): open the artifact with the runtime, generate
  `tokens` tokens greedily (RuntimeSession.generate), and with a `reference` input (the baseline's check) count how
  many leading tokens equal the baseline's. A runtime that cannot load the artifact or generate fails the step with
  one line naming the artifact and the runtime: that failure is what the check is for.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from qbuild.contract.plugin import open_session
from qbuild.contract.step import StepContext

PROMPT = "prompt.json"        # {prompt, token_ids, add_special_tokens}
TOKENIZER = "tokenizer"       # the baseline's tokenizer files, which decode every check's tokens
RESULT = "load-check.json"


class LoadCheckFailed(RuntimeError):
    """The artifact does not load or generate in a runtime (the worker reports it as one line)."""


def prompt(ctx: StepContext) -> dict:
    from qbuild.calibration.build import load_tokenizer

    tokenizer = load_tokenizer(ctx.inputs["tokenizer"])
    # the tokenizer's own special tokens (e.g. a BOS where the model expects one), as a serving engine would add them
    ids = [int(t) for t in tokenizer(ctx.params["prompt"], add_special_tokens=True)["input_ids"]]
    if not ids:
        raise ValueError("the load-check prompt tokenizes to no tokens")
    tokenizer.save_pretrained(str(ctx.out / TOKENIZER))
    (ctx.out / PROMPT).write_text(json.dumps({"prompt": ctx.params["prompt"], "token_ids": ids,
                                              "add_special_tokens": True}, indent=2))
    return {"format": "tokens", "metrics": {"tokens": len(ids)}}


def _one_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0] if lines else ''}".rstrip(": ")


def leading_matches(tokens: list[int], reference: list[int]) -> int:
    """How many tokens, from the first, equal the reference's."""
    n = 0
    for a, b in zip(tokens, reference, strict=False):   # a shorter reference ends the match
        if a != b:
            break
        n += 1
    return n


def run(ctx: StepContext) -> dict:
    p = ctx.params
    runtime = p["runtime"]
    # the artifact's name is for the message only (runtime_args): the stored result is the same under any name
    who = ctx.runtime_args.get("label", ctx.step_name)
    who = who if who == "baseline" else f"variant {who!r}"
    request = json.loads((ctx.inputs["prompt"] / PROMPT).read_text())
    ids, n = request["token_ids"], p["tokens"]

    t0 = time.perf_counter()
    try:
        session = open_session(runtime, ctx.inputs["model"], ctx, len(ids) + n + 1)
    except Exception as exc:
        raise LoadCheckFailed(f"{who} does not load in runtime {runtime}: {_one_line(exc)}") from exc
    t1 = time.perf_counter()
    try:
        generated = [int(t) for t in session.generate(ids, n)]
    except Exception as exc:
        raise LoadCheckFailed(f"{who} loads in runtime {runtime} but does not generate: {_one_line(exc)}") from exc
    t2 = time.perf_counter()
    if len(generated) != n:
        raise LoadCheckFailed(f"{who}: runtime {runtime} generated {len(generated)} tokens, {n} were asked for")

    from qbuild.calibration.build import load_tokenizer

    text = load_tokenizer(ctx.inputs["prompt"] / TOKENIZER).decode(generated)
    runtime_info = session.info()
    result = {"runtime": runtime_info, "prompt": request["prompt"], "prompt_token_ids": ids, "tokens": n,
              "generated_token_ids": generated, "text": text}
    metrics = {"tokens": n}
    seconds = {"load": round(t1 - t0, 3), "generate": round(t2 - t1, 3)}   # manifest only: the files stay bit-identical
    if "reference" in ctx.inputs:
        base = json.loads((Path(ctx.inputs["reference"]) / RESULT).read_text())
        if base["prompt_token_ids"] != ids:   # both read the same prompt step: a mismatch is a planning bug
            raise RuntimeError("the baseline's load check was fed other prompt tokens")
        matched = leading_matches(generated, base["generated_token_ids"])
        result["baseline"] = {"runtime": base["runtime"], "generated_token_ids": base["generated_token_ids"],
                              "text": base["text"]}
        result |= {"matches_baseline_tokens": matched, "matches_baseline": matched == n}
        metrics |= {"matches_baseline_tokens": matched, "matches_baseline": matched == n}
    (ctx.out / RESULT).write_text(json.dumps(result, indent=2, ensure_ascii=False))
    ctx.log(f"{runtime}: {text!r}" + (f" ({metrics['matches_baseline_tokens']}/{n} as the baseline)"
                                      if "reference" in ctx.inputs else ""))
    return {"format": "metrics", "metrics": metrics,
            "info": {"runtime": runtime_info, "text": text, "generated_token_ids": generated, "seconds": seconds}}
