"""eval-data step runner: held-out documents → one joined token stream, saved with its protocol."""

from __future__ import annotations

import json

import numpy as np

from qbuild.calibration.build import load_tokenizer, render
from qbuild.calibration.sources import read_source
from qbuild.contract.step import StepContext

TOKENS = "tokens.safetensors"
INFO = "tokens.json"


def documents(dataset: dict, sources_runtime: list, tok) -> list[str]:
    """The evaluation text's documents, as the tokenizer is given them (rendered with its chat template if asked)."""
    docs = []
    for src, rt in zip(dataset["sources"], sources_runtime, strict=True):
        docs += [render(d, tok, dataset["chat_template"]) for d in read_source(src, rt)]
    return docs


def run(ctx: StepContext) -> dict:
    p = ctx.params
    tok = load_tokenizer(ctx.inputs["tokenizer"])
    docs = documents(p["dataset"], ctx.runtime_args["sources"], tok)
    ids = np.array(tok("\n\n".join(docs), add_special_tokens=False)["input_ids"], dtype=np.int32)
    body = p["context_length"] - (1 if p["add_bos"] else 0)
    if p["max_windows"]:
        ids = ids[: body * p["max_windows"]]
    if len(ids) < body:
        raise ValueError(f"evaluation text has {len(ids)} tokens, fewer than one window of {body}")
    from safetensors.numpy import save_file

    save_file({"input_ids": ids}, str(ctx.out / TOKENS))
    info = {"documents": len(docs), "tokens": int(len(ids)), "bos_token_id": tok.bos_token_id, "join": "\n\n",
            "sources": p["dataset"]["sources"]}
    extra = {"overlap": ctx.runtime_args["overlap"]} if ctx.runtime_args.get("overlap") else {}
    info |= extra
    (ctx.out / INFO).write_text(json.dumps(info, indent=2))
    return {"format": "tokens", "metrics": {"tokens": int(len(ids)), "documents": len(docs)}, "info": extra}


def load_tokens(path) -> tuple[np.ndarray, dict]:
    from safetensors.numpy import load_file

    return load_file(str(path / TOKENS))["input_ids"], json.loads((path / INFO).read_text())
