"""The `serving[<artifact>@<config>]` step: start the artifact's server, sweep it with the streaming client, stop it.

Prompts are windows of `input_len` tokens of the tokenized evaluation corpus, in an order drawn with the workload's
seed; each is sent as token ids, so every engine sees exactly `input_len` prompt tokens. Results: one point per
concurrency (and request rate) with TTFT/TPOT/ITL/e2e percentiles, requests/s, output tok/s and errors, plus the
server's peak RSS, its KV-cache bytes per token (where the engine reports its KV cache) and the exact server command.
With `rounds` > 1 the whole sweep runs that many times on the same server, each round with prompts of its own; a
point then pools its rounds and keeps each one, with bootstrap intervals (qbuild.serving.confidence). With a
`conversation`, each measured unit is a conversation of `turns` requests (qbuild.serving.client): the prompts are
each turn's own input, the shared prefix only in a conversation's first.
"""

from __future__ import annotations

import json
import shlex
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

from qbuild.contract.plugin import servers
from qbuild.contract.step import StepContext
from qbuild.serving.config import ServedConfig
from qbuild.serving.server import PORT

RESULT = "serving.json"
SERVER_LOG = "server.log"


def prompts_from(tokens: np.ndarray, input_len: int | dict, count: int, seed: int,
                 prefix_tokens: int = 0) -> list[list[int]]:
    """`count` prompts of exactly `input_len` tokens (or of lengths drawn uniformly from {min, max}): corpus windows
    in a seeded order (repeating if it runs out), each after the same `prefix_tokens` (the corpus's last tokens,
    which no window reaches)."""
    longest = input_len["max"] if isinstance(input_len, dict) else input_len
    if prefix_tokens >= len(tokens):
        raise ValueError(f"the prompt corpus has {len(tokens)} tokens, not more than prefix_tokens {prefix_tokens}")
    n = (len(tokens) - prefix_tokens) // longest
    if n < 1:
        raise ValueError(f"the prompt corpus has {len(tokens)} tokens, fewer than one prompt of {longest}"
                         + (f" after a prefix of {prefix_tokens}" if prefix_tokens else ""))
    prefix = tokens[len(tokens) - prefix_tokens:].tolist() if prefix_tokens else []
    order = np.random.default_rng(seed).permutation(n)
    lengths = drawn_lengths(input_len, count, seed + 1)
    return [prefix + tokens[i * longest:i * longest + length].tolist()
            for i, length in zip((order[k % n] for k in range(count)), lengths, strict=True)]


def drawn_lengths(length: int | dict, count: int, seed: int) -> list[int]:
    """`count` token counts: all `length`, or drawn uniformly (inclusive) from a {min, max} range with `seed`."""
    if not isinstance(length, dict):
        return [length] * count
    return np.random.default_rng(seed).integers(length["min"], length["max"], endpoint=True, size=count).tolist()


def conversation_prompts(prompts: list[list[int]], turns: int, prefix_tokens: int) -> list[list[int]]:
    """Each turn's own input: a conversation's later turns resend the shared prefix as part of its history, so only
    its first turn's prompt keeps it."""
    if turns <= 1 or not prefix_tokens:
        return prompts
    return [p if k % turns == 0 else p[prefix_tokens:] for k, p in enumerate(prompts)]


def _cpu_seconds(pid: int) -> float | None:
    import os

    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


def _round_prompts(tokens, w: dict, n_points: int) -> tuple[int, list, list[int]]:
    """The prompts per round (`count`), and every round's prompts and output lengths, rounds after one another."""
    rounds = w.get("rounds", 1)
    first = w.get("first_round", 0)   # rounds added later (selection's measure_more) go on where the others ended
    turns = w.get("conversation", {}).get("turns", 1)
    count = n_points * (w["requests"] + w["warmup"]) * turns   # per round: each round sends prompts of its own
    prefix = w.get("prefix_tokens", 0)
    prompts = conversation_prompts(
        prompts_from(tokens, w["input_len"], count * (first + rounds), w["seed"], prefix)[count * first:], turns, prefix)
    output_len = drawn_lengths(w["output_len"], count * (first + rounds), w["seed"] + 2)[count * first:]
    return count, prompts, output_len


def run(ctx: StepContext) -> dict:
    from qbuild.evaluate.data import load_tokens
    from qbuild.serving.client import Workload, replay, sweep
    from qbuild.serving.server import running

    p = ctx.params
    w = p["workload"]
    label = ctx.runtime_args.get("label", ctx.step_name)
    server = servers.get(p["server"])
    config = ServedConfig(**p["config"])
    tokens, _ = load_tokens(ctx.inputs["prompts"])
    n_points = len(w["concurrency"]) + len(w["request_rates"] or [])
    rounds, first = w.get("rounds", 1), w.get("first_round", 0)
    count, prompts, output_len = _round_prompts(tokens, w, n_points)
    launch = server.launch(ctx.inputs["model"], config, threads=ctx.threads, slots=p["slots"], context=p["context"],
                           workdir=ctx.out, log=lambda msg: _log_with_progress(ctx, msg), draft=ctx.inputs.get("draft"))
    work = Workload(prompts=prompts[:count], output_len=output_len[:count], requests=w["requests"], warmup=w["warmup"],
                    timeout_s=w["timeout_s"], ignore_eos=launch.ignore_eos, model=launch.model_name,
                    rampup_s=w.get("rampup_s", 0.0), turns=w.get("conversation", {}).get("turns", 1),
                    think_s=w.get("conversation", {}).get("think_s", 0.0))
    trace, trace_arrivals = None, []
    if "trace" in w:
        trace, trace_arrivals = trace_workload(Path(ctx.runtime_args["trace_path"]), tokens, w, launch)
    log = ctx.out / SERVER_LOG
    ctx.log(f"starting {launch.engine} for {label}: {shlex.join(launch.argv(0)).replace(' 0 ', ' PORT ', 1)}")
    started = time.monotonic()
    try:
        with running(launch, log, label, ctx.runtime_args.get("ready_timeout_s", 300.0)) as srv:
            ready_s = time.monotonic() - started
            ctx.log(f"{launch.engine} ready on {srv.url} after {ready_s:.1f} s (pid {srv.pid})")
            checked = check_served(ctx, srv, server, launch, label, w["timeout_s"])
            server_cpu0, client_cpu0 = _cpu_seconds(srv.pid), time.process_time()
            by_round = []
            for r in range(rounds):   # round-major: each point's rounds are spread over the step's time, not adjacent
                this = replace(work, prompts=prompts[r * count:(r + 1) * count],
                               output_len=output_len[r * count:(r + 1) * count])
                by_round.append(sweep(srv.url, this, w["concurrency"], w["request_rates"],
                                      w["seed"] + (first + r) * n_points, between=srv.check_alive,
                                      progress=_round_progress(ctx.progress, r, rounds)))
                if trace is not None:   # the user's trace, replayed at its arrival times, after the sweep
                    by_round[-1].append({"trace": Path(ctx.runtime_args["trace_path"]).name,
                                         **replay(srv.url, trace, trace_arrivals)})
                    srv.check_alive()
            server_cpu = (_cpu_seconds(srv.pid) or 0) - (server_cpu0 or 0)
            client_cpu = time.process_time() - client_cpu0
            peak_rss = srv.peak_rss_bytes()
            speculative = server.speculative_stats(srv.url, w["timeout_s"]) if config.draft else None
    except BaseException:
        print(f"--- {SERVER_LOG} (last lines) ---\n" + "\n".join(_tail(log, 20)), flush=True)
        raise
    points = [_point(list(measured), w["seed"]) for measured in zip(*by_round, strict=True)]
    failed = [pt for pt in points if pt["errors"]]
    if failed and all(pt["completed"] == 0 for pt in points):
        raise RuntimeError(f"{launch.engine} server for {label}: every request failed: {failed[0].get('first_error')}")
    kv = server.kv_bytes_per_token(ctx.inputs["model"], config, log.read_text(errors="replace"))
    info = {"server": server.name, "engine": launch.engine, "config": p["config"],
            "command": shlex.join(_portable(list(launch.command), ctx.inputs["model"], ctx.inputs.get("draft"))),
            "server_args": p["server_args"], "ready_s": round(ready_s, 2), "peak_rss_bytes": peak_rss,
            "kv_bytes_per_token": kv, "server_cpu_s": round(server_cpu, 3), "client_cpu_s": round(client_cpu, 3),
            "workload": w, "environment": server.environment(), "served_check": checked,
            **({"speculative": speculative} if config.draft else {})}
    (ctx.out / RESULT).write_text(json.dumps({**info, "points": points}, indent=2))
    return {"format": "metrics", "metrics": {**info, "points": points}}


def check_served(ctx: StepContext, srv, server, launch, label: str, timeout_s: float) -> dict | None:
    """The served check (qbuild.serving.served_check) on the running server, before anything is measured: a server that
    computes something else than the artifact's offline evaluation fails the step in one line."""
    from qbuild.serving.served_check import expected, probes, run_check

    if "reference" not in ctx.inputs:
        return None
    found = probes(Path(ctx.inputs["reference"]), Path(ctx.inputs["reference_data"]), ctx.params["context"] - 1)
    if not found:
        raise RuntimeError(f"the served check has no probe within {label}'s context of {ctx.params['context']} tokens")
    offline = expected(Path(ctx.inputs["divergence"]) / "divergence.json" if "divergence" in ctx.inputs else None)
    record = run_check(srv.url, server, launch.model_name, found, offline, timeout_s)
    srv.check_alive()
    if "refused" in record:
        raise RuntimeError(f"{launch.engine} serving {label} does not compute what was measured offline: "
                           f"{record['refused']}")
    ctx.log(f"served check: {label} on {launch.engine}: KLD >= {record['served_kld_lower_bound']} "
            f"(bound {record['kld_bound']}), top-1 {record['served_top1']} (bound {record['top1_bound']})")
    return record


def trace_workload(path: Path, tokens: np.ndarray, w: dict, launch):
    """The trace's requests as a Workload (its first `warmup` requests sent once more ahead, one at a time, not
    counted) and their arrival times: text prompts as they are, token lengths as corpus windows after the prefix."""
    from qbuild.serving.client import Workload
    from qbuild.serving.trace import read_trace

    requests = read_trace(path)
    longest_prompt = max((r.get("input_len", 1) for r in requests), default=1)
    windows = prompts_from(tokens, longest_prompt, len(requests), w["seed"], w.get("prefix_tokens", 0))
    prefix = w.get("prefix_tokens", 0)
    prompts = [r["prompt"] if "prompt" in r else window[:prefix + r["input_len"]]
               for r, window in zip(requests, windows, strict=True)]
    ahead = min(w["warmup"], len(requests))
    work = Workload(prompts=prompts[:ahead] + prompts, output_len=[r["output_len"] for r in requests[:ahead] + requests],
                    requests=len(requests), warmup=ahead, timeout_s=w["timeout_s"], ignore_eos=launch.ignore_eos,
                    model=launch.model_name)
    return work, [r["arrival_s"] - requests[0]["arrival_s"] for r in requests]


def _point(rounds: list[dict], seed: int) -> dict:
    """A sweep point from its rounds (one round: the round itself, as before rounds existed)."""
    from qbuild.serving.confidence import combine_rounds

    where = {k: rounds[0][k] for k in ("concurrency", "request_rate", "trace") if k in rounds[0]}
    measured = [{k: v for k, v in r.items() if k not in where} for r in rounds]
    return {**where, **(measured[0] if len(rounds) == 1 else combine_rounds(measured, seed))}


def _round_progress(progress, r: int, rounds: int):
    if rounds == 1:
        return progress
    return lambda done, total, desc: progress(r * total + done, rounds * total, f"round {r + 1}/{rounds}, {desc}")


def _log_with_progress(ctx: StepContext, msg: str) -> None:
    """A server's first-use build logs "llama.cpp build 40%": the step's progress line shows it too."""
    import re

    ctx.log(msg)
    m = re.search(r"build (\d+)%", msg)
    if m:
        ctx.progress(int(m.group(1)), 100, "building llama-server (once)")


def _portable(command: list[str], model: Path, *others: Path | None) -> list[str]:
    """The server command as a user would type it: the program and the model file (and a draft's, `others`) by
    name, port 8080."""
    ours = tuple(str(m) for m in (model, *others) if m is not None)
    out = [Path(command[0]).name if "/" in command[0] else command[0]]
    for a in command[1:]:
        out.append("8080" if a == PORT else Path(a).name if a.startswith(ours) else a)
    return out


def _tail(path: Path, n: int) -> list[str]:
    try:
        return path.read_text(errors="replace").splitlines()[-n:]
    except OSError:
        return ["(no server log)"]
