"""The `task` step's worker side: lm-eval runs the task (`simple_evaluate`, log_samples on) over `SessionLM`, an
lm-eval model (a TemplateLM, registered as `qbuild`) whose log-likelihoods come from a qbuild RuntimeSession's
`window_logits`. Tokenization is the baseline's HF tokenizer, exactly as lm-eval's own `hf` model tokenizes
(context/continuation split, left truncation to max_length + 1), so the baseline's accuracy through qbuild equals
`lm_eval --model hf` on the same checkpoint. Imported only in a task worker: lm-eval (and its datasets/evaluate
imports) load there, never at plan time (the plan side and the summary rows: qbuild/evaluate/tasks.py)."""

from __future__ import annotations

import json
import os
import time
from contextlib import contextmanager
from pathlib import Path

import lm_eval
import numpy as np
from lm_eval import utils
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import MODEL_REGISTRY, register_model
from lm_eval.evaluator import simple_evaluate
from lm_eval.tasks import TaskManager, get_task_dict

from qbuild.calibration.build import load_tokenizer
from qbuild.contract.plugin import open_session
from qbuild.contract.protocol import Window
from qbuild.contract.step import StepContext
from qbuild.evaluate.tasks import MAX_LENGTH, RESULTS, SAMPLES, flips, read_samples


class SessionLM(TemplateLM):
    """An lm-eval model over a qbuild RuntimeSession (anything with `window_logits`)."""

    def __init__(self, session=None, tokenizer=None, max_length: int = MAX_LENGTH, runtime: str | None = None,
                 pretrained: str | None = None, threads: int = 1, device: str = "cpu", **_):
        super().__init__()
        if session is None:   # `lm_eval --model qbuild --model_args runtime=transformers,pretrained=DIR`
            sctx = StepContext({}, {}, {}, Path("."), int(threads), device, "lm-eval")
            session = open_session(runtime or "transformers", Path(pretrained), sctx, int(max_length))
            tokenizer = tokenizer or load_tokenizer(pretrained)
        self.session, self.tokenizer, self._max_length = session, tokenizer, int(max_length)
        self.forward_passes = 0

    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eos_token_id

    @property
    def prefix_token_id(self) -> int:   # as lm-eval's hf model: BOS, else EOS
        bos = self.tokenizer.bos_token_id
        return bos if bos is not None else self.tokenizer.eos_token_id

    @property
    def max_length(self) -> int:
        return self._max_length

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        kw = {} if add_special_tokens is None else {"add_special_tokens": add_special_tokens}
        bos = self.tokenizer.decode(self.prefix_token_id)
        if add_special_tokens is None and bos and string.startswith(bos):
            kw["add_special_tokens"] = False
        return self.tokenizer.encode(string, **kw)

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs):
        """(log P(continuation | context), continuation is the greedy one) per request, as lm-eval's hf model
        computes them. Requests with the same model input (a one-token continuation's input is its context
        alone) share one forward pass, as lm-eval's logits cache does."""
        by_input: dict[tuple, list[int]] = {}
        for i, (_, context_enc, continuation_enc) in enumerate(requests):
            if not continuation_enc:
                raise ValueError("lm-eval gave an empty continuation")
            inp = tuple((list(context_enc) + list(continuation_enc))[-(self.max_length + 1):][:-1])
            by_input.setdefault(inp, []).append(i)
        order = sorted(by_input, key=lambda t: (-len(t), t))   # longest first, like lm-eval's collator
        out: list = [None] * len(requests)
        windows = [Window(list(t), 1) for t in order]
        for inp, logits in zip(order, self.session.window_logits(windows), strict=True):
            self.forward_passes += 1
            for i in by_input[inp]:
                cont = list(requests[i][2])
                rows = np.asarray(logits[len(inp) - len(cont):], dtype=np.float32)
                shifted = rows - rows.max(axis=-1, keepdims=True)
                logprobs = shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))
                picked = logprobs[np.arange(len(cont)), cont]
                greedy = bool((rows.argmax(axis=-1) == np.asarray(cont)).all())
                out[i] = (float(picked.astype(np.float64).sum()), greedy)
                if self.cache_hook is not None and requests[i][0] is not None:
                    self.cache_hook.add_partial("loglikelihood", requests[i][0], out[i])
        return out

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        results = []
        for (string,) in [req.args for req in requests]:
            windows = map(utils.make_disjoint_window, utils.get_rolling_token_windows(
                token_list=self.tok_encode(string), prefix_token=self.prefix_token_id,
                max_seq_len=self.max_length, context_len=1))
            scored = self._loglikelihood_tokens([(None, c, t) for c, t in windows])
            results.append(sum(s[0] for s in scored))
        return results

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Greedy continuation (the session's decoder), cut at the first stop string; sampling is not offered."""
        out = []
        for context, gen_kwargs in [req.args for req in requests]:
            until = gen_kwargs.get("until") or []
            until = [until] if isinstance(until, str) else list(until)
            n = int(gen_kwargs.get("max_gen_toks", 256))
            ids = self.tok_encode(context)[-(self.max_length - n):]
            text = self.tokenizer.decode(self.session.generate(ids, n), skip_special_tokens=False)
            eos = self.tokenizer.decode([self.eot_token_id])
            for stop in [*until, eos]:
                if stop and stop in text:
                    text = text[: text.index(stop)]
            out.append(text)
        return out


def registered() -> type:
    """SessionLM as lm-eval's model `qbuild` (lm-eval loads its own models only into an empty registry: first)."""
    if len(MODEL_REGISTRY) == 0:
        import lm_eval.models  # noqa: F401
    if "qbuild" not in MODEL_REGISTRY:
        register_model("qbuild")(SessionLM)
    return MODEL_REGISTRY.get("qbuild")


@contextmanager
def _cwd(path: str | None):
    """lm-eval's local data files are paths relative to where it runs: load the task from its include_path."""
    if path is None:
        yield
        return
    before = os.getcwd()
    os.chdir(path)
    try:
        yield
    finally:
        os.chdir(before)


def run(ctx) -> dict:
    """The `task` step: lm-eval's task over the artifact's runtime session; acc ± stderr, per-document outcomes,
    and flips against the baseline's step when it is an input."""
    p = ctx.params
    include = ctx.runtime_args.get("include_path")
    t0 = time.perf_counter()
    session = open_session(p["runtime"], ctx.inputs["model"], ctx, p["max_length"])
    lm = registered()(session=session, tokenizer=load_tokenizer(ctx.inputs["tokenizer"]), max_length=p["max_length"])
    with _cwd(include):
        manager = TaskManager(include_path=include)
        tasks = get_task_dict([p["task"]], manager)
        if not tasks:
            raise ValueError(f"lm-eval has no task {p['task']!r}" + (f" under {include}" if include else ""))
        ctx.progress(0, 1, f"lm-eval {p['task']}")
        res = simple_evaluate(model=lm, tasks=[tasks[k] for k in tasks], num_fewshot=p.get("num_fewshot"),
                              limit=p.get("limit"), log_samples=True, task_manager=manager)
    names = [n for n in res["results"] if n in res.get("samples", {})]
    if len(names) != 1:
        raise ValueError(f"task {p['task']!r} is a group of {len(names)} tasks; name one task per evaluation.tasks entry")
    name = names[0]
    row = res["results"][name]
    metric = "acc" if "acc,none" in row else next((k.split(",")[0] for k in row if k.endswith(",none")
                                                    and "_stderr" not in k), None)
    if metric is None:
        raise ValueError(f"task {name!r} reports no metric qbuild can read ({sorted(row)})")
    samples = sorted(res["samples"][name], key=lambda s: s["doc_id"])
    with open(ctx.out / SAMPLES, "w") as f:
        for s in samples:
            resps = s.get("filtered_resps") or []
            choice = (int(np.argmax([r[0] for r in resps])) if resps and isinstance(resps[0], (list, tuple))
                      else None)
            f.write(json.dumps({"doc_id": s["doc_id"], "correct": float(s[metric]), "target": str(s.get("target")),
                                "choice": choice}) + "\n")
    metrics = {"acc": float(row[f"{metric},none"]), "documents": len(samples)}
    stderr = row.get(f"{metric}_stderr,none")
    metrics["acc_stderr"] = float(stderr) if isinstance(stderr, (int, float)) else None
    if "acc_norm,none" in row and metric == "acc":
        metrics["acc_norm"] = float(row["acc_norm,none"])
    if "reference" in ctx.inputs:
        metrics |= flips(read_samples(ctx.inputs["reference"]), {s["doc_id"]: float(s[metric]) for s in samples})
    # the object's files hold nothing that varies between identical runs (no timings): a rebuild is bit-identical
    record = {"task": name, "metric": metric, "lm_eval": getattr(lm_eval, "__version__", None), "result": row,
              "runtime": session.info(), "forward_passes": lm.forward_passes,
              "n_samples": res.get("n-samples", {}).get(name), "versions": res.get("versions", {}).get(name),
              "config": res.get("configs", {}).get(name)}
    (ctx.out / RESULTS).write_text(json.dumps(record, indent=2, sort_keys=True, default=str))
    ctx.progress(1, 1, "done")
    return {"format": "metrics", "metrics": metrics,
            "info": {"task": name, "metric": metric, "lm_eval": record["lm_eval"],
                     "seconds": round(time.perf_counter() - t0, 3), "forward_passes": lm.forward_passes}}
