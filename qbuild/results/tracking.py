"""MLflow tracking (optional extra): one MLflow run per qbuild run, one nested run per variant.

params = the resolved recipe section, metrics = the evaluation results, tags = artifact keys and
digests, artifacts = each variant's manifest, the run summary and the HTML report.
"""

from __future__ import annotations

import json

from qbuild.base.errors import MissingBackendError

METRICS = ("ppl", "delta_ppl", "delta_ppl_pct", "kld", "top1", "decode_tok_s", "prefill_tok_s", "ttft_ms",
           "throughput_ratio", "size_bytes")


def flatten(data, prefix: str = "") -> dict[str, str]:
    out: dict[str, str] = {}
    if isinstance(data, dict):
        for k, v in data.items():
            out.update(flatten(v, f"{prefix}{k}."))
    elif isinstance(data, list) and data and all(isinstance(x, dict) for x in data):
        for i, v in enumerate(data):
            out.update(flatten(v, f"{prefix}{i}."))
    else:
        out[prefix.rstrip(".")] = json.dumps(data) if isinstance(data, (list, dict)) else str(data)
    return {k: v[:6000] for k, v in out.items()}  # MLflow's param value limit


def log_run(uri: str, experiment: str | None, recipe, summary: dict, store, report_html: str | None) -> str:
    """Log a finished qbuild run; returns the MLflow run id."""
    try:
        import mlflow
    except ImportError:
        raise MissingBackendError("MLflow tracking needs mlflow, which", "mlflow") from None
    from qbuild.base.names import redact_tree

    mlflow.set_tracking_uri(uri)
    mlflow.set_experiment(experiment or f"qbuild/{recipe.name}")
    resolved = redact_tree(recipe.canonical())   # a dataset URL's password never becomes an MLflow param
    summary = redact_tree(summary)
    with mlflow.start_run(run_name=f"{recipe.name} {summary['run_id']}") as parent:
        mlflow.log_params(flatten({k: v for k, v in resolved.items() if k not in ("variants", "store")}))
        mlflow.set_tags({"qbuild.run_id": summary["run_id"], "qbuild.planning.recipe": recipe.name,
                         "qbuild.store": summary.get("store", ""), "qbuild.gates_passed":
                         str(summary.get("gates", {}).get("passed", "n/a"))})
        mlflow.log_dict(summary, "summary.json")
        if report_html:
            mlflow.log_text(report_html, "report.html")
        variant_params = {v["name"]: v for v in resolved["variants"]}
        for row in summary["variants"]:
            with mlflow.start_run(run_name=row["variant"], nested=True):
                params = variant_params.get(row["variant"]) or {"method": row.get("method"), "detail": row.get("detail")}
                mlflow.log_params(flatten(params))
                mlflow.log_metrics({m: float(row[m]) for m in METRICS if row.get(m) is not None})
                mlflow.set_tags({"qbuild.variant": row["variant"], "qbuild.key": row.get("key") or "",
                                 "qbuild.digest": row.get("digest") or "", "qbuild.status": row.get("status") or ""})
                if row.get("digest"):
                    mlflow.log_dict(redact_tree(store.manifest(row["digest"])), "manifest.json")
        return parent.info.run_id
