"""The served check: a served artifact must compute what its offline evaluation measured.

An engine can load an artifact and still compute something else: a scale convention read the other way, a tensor
dropped, a layer fused wrongly. Throughput figures of such a server are figures of a broken model. So before a
serving step (or a capacity search) measures anything, it asks the server for the next-token distribution at a few
positions of the evaluation text (`probes`: the first windows the baseline's reference stored, at their middle and
last scored position, each sent as the exact token ids the evaluation scored) and compares it with the baseline's
stored log-probs there:

- KLD: the server returns its top-k log-probs (k = TOP_K). The KL divergence of the baseline's distribution to the
  served one over the partition {each of those k tokens, everything else} is a lower bound of the served model's KLD
  at that position (merging outcomes never increases a KL divergence). Its mean over the probes must not exceed
  the offline evaluation's 99th-percentile per-position KLD of the same artifact, plus KLD_SLACK nats.
- top-1: the share of probes where the served top token is the baseline's must not fall below the offline top-1
  agreement by more than TOP1_SLACK plus three binomial standard errors.

The offline numbers are the artifact's own (`perplexity[<variant>]`'s divergence.json; the baseline's are 0 and 1),
so the bounds follow its format: a 4-bit artifact may be as far from the baseline as it was measured to be, and no
farther. A broken server is far beyond either bound (a zeroed projection: KLD of nats, top-1 near chance).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from qbuild.serving.client import post_json

TOP_K = 20             # vLLM's default cap on returned log-probs (max_logprobs)
PROBE_WINDOWS = 8      # windows probed (their middle and last scored rows): 16 requests of one output token
KLD_SLACK = 0.05       # nats above the offline 99th percentile: a different kernel's rounding stays far below it
TOP1_SLACK = 0.1       # below the offline top-1 agreement, besides the probes' own sampling error
MISSING_LOGPROB = -30.0   # what "everything else" gets when the served top-k already holds all the probability


@dataclass(frozen=True)
class Probe:
    prompt: list[int]           # the window's tokens up to the predicted one: what the evaluation fed the model
    reference: np.ndarray       # the baseline's log-probs of the next token (float32, the whole vocabulary)
    reference_top1: int


def probes(reference_dir: Path, data_dir: Path, max_prompt: int, windows: int = PROBE_WINDOWS) -> list[Probe]:
    """The probes on the evaluation text the reference `reference_dir` stored (its protocol rebuilds its windows),
    each prompt at most `max_prompt` tokens (the server's context per request, less the one token it generates):
    a window longer than that is probed at positions within it."""
    from qbuild.contract.protocol import windows as make_windows
    from qbuild.evaluate.data import load_tokens
    from qbuild.evaluate.quality import ReferenceReader

    reader = ReferenceReader(reference_dir)
    protocol = reader.info["protocol"]
    ids, _ = load_tokens(data_dir)
    wins = make_windows(ids, protocol["protocol"], protocol["context_length"], protocol["add_bos"],
                        protocol["bos_token_id"], protocol["max_windows"], protocol.get("stride"))
    found = []
    for i, w in enumerate(wins[:min(windows, len(reader))]):
        n, top1 = reader.rows_in(i), reader.top1(i)
        last = min(n - 1, max_prompt - w.first_scored)   # row r's prompt is first_scored + r tokens long
        if last < 0:
            continue
        for r in sorted({last // 2, last}):
            # row r predicts token first_scored + r: the model has seen every token before it
            row = reader.row(i, r)
            found.append(Probe([int(t) for t in w.tokens[: w.first_scored + r]], row,
                               int(top1[r]) if top1 is not None else int(row.argmax())))
    return found


def divergence_lower_bound(reference: np.ndarray, served: dict[int, float]) -> float:
    """KL(baseline ‖ served) over the partition {each served top-k token, the rest}: ≤ the full KL divergence."""
    ids = np.fromiter(served, dtype=np.int64)
    q = np.exp(np.fromiter(served.values(), dtype=np.float64))
    p = np.exp(reference[ids].astype(np.float64))
    p_rest, q_rest = max(0.0, 1.0 - p.sum()), max(1.0 - q.sum(), math.exp(MISSING_LOGPROB))
    kl = float(np.sum(np.where(p > 0, p * (np.log(np.maximum(p, 1e-300)) - np.log(np.maximum(q, 1e-300))), 0.0)))
    if p_rest > 0:
        kl += p_rest * (math.log(p_rest) - math.log(q_rest))
    return max(kl, 0.0)


def expected(divergence_json: Path | None) -> dict:
    """What the offline evaluation measured for the artifact: its divergence.json, or the baseline's own (exact)."""
    if divergence_json is None:
        return {"kld_p99": 0.0, "top1_agreement": 1.0, "of": "the baseline itself"}
    d = json.loads(Path(divergence_json).read_text())
    return {"kld_p99": float(d["kld_p99"]), "top1_agreement": float(d["top1_agreement"]), "of": "its offline evaluation"}


def verdict(klds: list[float], top1: list[bool], offline: dict) -> dict:
    """The check's record; `refused` is the one-line reason when the server computes something else."""
    n = len(klds)
    kld, agree = float(np.mean(klds)), float(np.mean(top1))
    kld_bound = offline["kld_p99"] + KLD_SLACK
    t = offline["top1_agreement"]
    top1_bound = max(0.0, t - TOP1_SLACK - 3 * math.sqrt(max(t * (1 - t), 1 / n) / n))
    record = {"probes": n, "served_kld_lower_bound": round(kld, 5), "kld_bound": round(kld_bound, 5),
              "served_top1": round(agree, 4), "top1_bound": round(top1_bound, 4), "offline": offline}
    why = []
    if kld > kld_bound:
        why.append(f"KLD to the baseline at least {kld:.3f} on {n} probes, above {kld_bound:.3f} "
                   f"({offline['of']}: 99th percentile {offline['kld_p99']:.3f} + {KLD_SLACK})")
    if agree < top1_bound:
        why.append(f"top-1 agreement {agree:.2f} on {n} probes, below {top1_bound:.2f} "
                   f"({offline['of']}: {offline['top1_agreement']:.2f})")
    if why:
        record["refused"] = "; ".join(why)
    return record


def run_check(url: str, server, model_name: str, found: list[Probe], offline: dict, timeout_s: float) -> dict:
    """Ask the running server for each probe's next-token log-probs and judge them (qbuild.serving.served_check)."""
    ask = getattr(server, "next_token_logprobs", None) or openai_next_token_logprobs
    klds, top1 = [], []
    for probe in found:
        served = checked_logprobs(ask(url, model_name, probe.prompt, TOP_K, timeout_s), len(probe.reference), TOP_K,
                                  server.name)
        klds.append(divergence_lower_bound(probe.reference, served))
        top1.append(max(served, key=served.get) == probe.reference_top1)
    return verdict(klds, top1, offline)


def checked_logprobs(served: object, vocab: int, k: int, engine: str) -> dict[int, float]:
    """A server's top-k answer as the check uses it, or MalformedResponse: at most k entries, each a token id inside
    the vocabulary and a finite log-probability (not above 0, bar rounding). A NaN would pass every bound unnoticed,
    an id past the vocabulary would index elsewhere."""
    from qbuild.serving.client import MalformedResponse

    if not isinstance(served, dict) or not served or len(served) > k:
        raise MalformedResponse(f"{engine} answered {len(served) if isinstance(served, dict) else served!r:.40} "
                                f"log-probs for a top {k}")
    for token, lp in served.items():
        if isinstance(token, bool) or not isinstance(token, int) or not 0 <= token < vocab:
            raise MalformedResponse(f"{engine} answered token id {token!r:.40}, outside the vocabulary of {vocab}")
        if isinstance(lp, bool) or not isinstance(lp, float) or not math.isfinite(lp) or lp > 1e-3:
            raise MalformedResponse(f"{engine} answered log-probability {lp!r:.40} for token {token}")
    return {token: min(lp, 0.0) for token, lp in served.items()}


def openai_next_token_logprobs(url: str, model_name: str, prompt: list[int], k: int, timeout_s: float
                               ) -> dict[int, float]:
    """One output token's top-k log-probs through `/v1/completions`, tokens as ids (vLLM's
    `return_tokens_as_token_ids`: keys "token_id:<id>")."""
    body = {"model": model_name, "prompt": prompt, "max_tokens": 1, "temperature": 0.0, "logprobs": k,
            "return_tokens_as_token_ids": True}
    answer = post_json(f"{url}/v1/completions", body, timeout_s)
    try:
        top = answer["choices"][0]["logprobs"]["top_logprobs"][0]
        return {int(str(token).rsplit(":", 1)[1]): float(lp) for token, lp in top.items()}
    except (KeyError, IndexError, TypeError, ValueError) as exc:
        raise RuntimeError(f"the server's /v1/completions answer has no token-id log-probs ({exc!r})") from None


