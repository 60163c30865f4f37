"""The end of a run: write-through to remote tiers, and registration in the MLflow model registry.

write_through  every object of the run that a remote lacks is uploaded (files, sidecars, manifest, then
               the action record: the commit point); the named artifacts get their model card (and, with a
               signing key, SLSA provenance + signature) and their refs; a named object that is no model
               (RECIPE/imatrix) gets its refs only. Called when no step failed, for
               remotes whose policy is `always` or `on-success`; `always` remotes already got each object
               right after it was built (qbuild/pipeline/executor.py), this adds what only the end of a run knows.
register       one MLflow model version per variant artifact, pointing at the store that holds it; the
               alias (e.g. champion) moves only when every quality gate passed, and with `selection:` only to
               the selected artifact (tagged with its serving config and server command).

With `selection:`, the selected artifact's refs carry the exact server command it was measured with
(SERVE_COMMAND: an annotation of its OCI ref manifest, a field of the ref record on other remotes).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from qbuild.artifacts.remote.cache import build_sidecars, push_hit, should_push
from qbuild.base.errors import QBuildError
from qbuild.contract.formats import spec as format_spec
from qbuild.contract.step import Outcome

if TYPE_CHECKING:
    from qbuild.artifacts.remote.base import RemoteStore
    from qbuild.artifacts.store import Store
    from qbuild.pipeline.outcome import StepOutcome
    from qbuild.pipeline.plan import Plan

log = logging.getLogger("qbuild")

SERVE_COMMAND = "org.qbuild.serve.command"
SERVE_CONFIG = "org.qbuild.serve.config"


def selected(summary: dict) -> dict | None:
    """The artifact `selection:` chose ({variant, config, command, ...}), or None (no selection, or nothing met it)."""
    return (summary.get("selection") or {}).get("selected")


def serve_annotations(summary: dict, variant: str | None) -> dict[str, str] | None:
    """The selected artifact's serving config and exact server command, for its refs; None for any other."""
    chosen = selected(summary)
    if not chosen or variant is None or chosen["variant"] != variant or not chosen.get("command"):
        return None
    return {SERVE_COMMAND: chosen["command"], SERVE_CONFIG: str(chosen["config"])}


def _base_model(plan: Plan) -> str | None:
    model = plan.recipe.model
    return getattr(model, "repo", None) or getattr(model, "path", None)


def write_through(store: Store, plan: Plan, outcomes: list[StepOutcome], summary: dict, tags: list[str]) -> dict:
    """Upload what the remotes lack; returns {remote name: {"objects": n uploaded, "refs": n set}}."""
    rows = {r["variant"]: r for r in summary.get("variants", [])}
    named = {a.step.key: a.label for a in plan.artifacts if not a.baseline}
    labels: dict[str, list[str]] = {}   # every name of a step's object (identical variants share one step)
    for a in plan.artifacts:
        if not a.baseline:
            labels.setdefault(a.step.key, []).append(a.label)
    names = {key: [f"{plan.recipe.name}/{label}" for label in found] for key, found in labels.items()}  # signed
    # named objects that are not models (the importance matrix, RECIPE/imatrix): a ref, no model card
    named_data = {o.step.key: o.step.variant for o in outcomes
                  if o.step.variant and not format_spec(o.step.format).model and o.step.key not in named}
    report: dict = {}
    for remote in plan.remotes:
        if not should_push(remote, "success"):
            continue
        uploaded = refs = 0
        for o in outcomes:
            label = named.get(o.step.key)
            ref_labels = labels.get(o.step.key) or ([named_data[o.step.key]] if o.step.key in named_data else [])
            if o.path is None and o.status == Outcome.BUILT and ref_labels and o.remote and o.remote.remote.url == remote.url:
                for ref_label in ref_labels:   # built on a Ray node, pushed there already: the run's refs point at it
                    for t in tags:
                        remote.set_ref(plan.recipe.name, ref_label, t, o.digest, o.step.key,
                                       annotations=serve_annotations(summary, ref_label))
                        refs += 1
                continue
            if o.digest is None or o.path is None or o.status not in (Outcome.BUILT, Outcome.CACHED):
                continue  # sources, failures, and remote hits not fetched here (the remote has them)
            sidecars = None
            if label is not None:
                def sidecars(o=o, label=label, previous=None):
                    return build_sidecars(store, o.digest, rows.get(label), summary.get("protocol"),
                                          summary.get("gates"), _base_model(plan), hardware=summary.get("hardware"),
                                          names=names.get(o.step.key, ()), previous=previous)
            ref_list = [(plan.recipe.name, ref_label, t) for ref_label in ref_labels for t in tags]
            if push_hit(remote, store, o.step.key, o.digest, o.record, sidecars=sidecars, refs=()):
                uploaded += 1
            elif label is not None:
                _refresh_sidecars(remote, o.digest, sidecars, names.get(o.step.key, ()))
            for recipe, variant, tag in ref_list:  # refs last: on OCI a sidecar re-tags the object
                remote.set_ref(recipe, variant, tag, o.digest, o.step.key, annotations=serve_annotations(summary, variant))
                refs += 1
        report[remote.name] = {"objects": uploaded, "refs": refs}
    return report


def _refresh_sidecars(remote: RemoteStore, digest: str, sidecars, names) -> None:
    """An object already on the remote: its model card follows the latest run; its signature is added, or re-made
    when it does not name all of `names`."""
    data = refresh_signature(remote, digest, sidecars, names)
    if "README.md" in data:
        remote.put_sidecar(digest, "README.md", data["README.md"])


def refresh_signature(remote: RemoteStore, digest: str, sidecars, names) -> dict[str, bytes]:
    """Sign an object already on the remote for `names` (recipe/variant) when its signature is missing or does not
    name them all: the new statement keeps the names of the old one only where that one verifies with the same
    key for the same files (signing.sign's `previous`). Returns the sidecars made (none are signed without a key)."""
    import json

    from qbuild.artifacts import signing

    statement, signature = remote.get_sidecar(digest, signing.STATEMENT), remote.get_sidecar(digest, signing.SIGNATURE)
    previous = (statement, signature) if statement is not None and signature is not None else None
    data = sidecars(previous=previous)
    if signing.SIGNATURE not in data:
        return data
    try:
        covered = previous is not None and set(names) <= set(signing.signed_names(json.loads(statement)))
    except (ValueError, AttributeError):
        covered = False
    if not covered:
        remote.put_sidecar(digest, signing.STATEMENT, data[signing.STATEMENT])
        remote.put_sidecar(digest, signing.SIGNATURE, data[signing.SIGNATURE])
    return data


def register(plan: Plan, outcomes: list[StepOutcome], summary: dict, store: Store, tracking_uri: str | None) -> dict:
    """Register every variant artifact (or the listed ones) in the MLflow model registry."""
    import os

    from qbuild.artifacts import mlflow_registry

    spec = plan.recipe.model_registry
    uri = spec.tracking_uri or tracking_uri or os.environ.get("MLFLOW_TRACKING_URI")
    if not uri:
        from qbuild.base.errors import UserError

        raise UserError("register: needs an MLflow tracking URI (register.tracking_uri, tracking.mlflow.uri, "
                        "--mlflow or MLFLOW_TRACKING_URI)")
    pushed = [r for r in plan.remotes if r.push != "never"]
    store_url = pushed[0].url if pushed else f"qbuild-file://{store.root}"
    by_key = {o.step.key: o for o in outcomes}
    gates = summary.get("gates")
    chosen = selected(summary)
    out = {}
    for row in summary.get("variants", []):
        variant = row["variant"]
        if row.get("target") or variant == "baseline" or (spec.variants and variant not in spec.variants):
            continue
        o = by_key.get(row.get("key"))
        if o is None or o.digest is None:
            continue
        passed = gates["passed"] if gates else True  # the alias moves only when the whole run passed its gates
        if plan.recipe.selection is not None:   # ... and, with `selection:`, only to the selected artifact
            passed = passed and chosen is not None and chosen["variant"] == variant
        name = spec.model_name(plan.recipe.name, variant)
        metrics = {k: row[k] for k in ("ppl", "delta_ppl", "delta_ppl_pct", "kld", "top1", "decode_tok_s")
                   if row.get(k) is not None}
        version = mlflow_registry.register(uri, name, {**o.record, "digest": o.digest}, store_url, metrics,
                                           gates_passed=passed, alias=spec.alias, gates=gates,
                                           serve=serve_annotations(summary, variant))
        out[variant] = {"name": name, "version": version, "alias": spec.alias if passed else None}
    if plan.recipe.selection is not None and chosen is not None and spec.alias:
        # a per-variant model name: an alias an earlier selection left on another variant's model no longer names
        # the artifact to ship
        holders = {e["name"] for e in out.values() if e["alias"]}
        for e in out.values():
            if not e["alias"] and e["name"] not in holders:
                mlflow_registry.drop_alias(uri, e["name"], spec.alias)
    return out


def push(name: str, to: str, *, store=None, progress=None) -> dict:
    """Upload NAME (ref or digest) from the local store to a remote: files, sidecars, manifest, action record, ref."""
    from qbuild.artifacts.access import open_store
    from qbuild.artifacts.remote import open_remote
    from qbuild.artifacts.signing import signing_key
    from qbuild.artifacts.store import REF_RE

    st = open_store(store)
    digest = st.resolve(name)
    manifest = st.manifest(digest)
    problems = st.check_object(digest)   # the upload hashes each file as it sends it (one read)
    if problems or not isinstance(manifest.get("key"), str):
        raise QBuildError(f"{name}: object {digest[:12]} is damaged: {'; '.join(problems) or 'manifest has no key'} "
                          "(run `qbuild verify --repair`, then rebuild); nothing pushed")
    remote = open_remote(to)
    m = REF_RE.match(name)
    refs = [(m.group("recipe"), m.group("variant"), m.group("tag") or "latest")] if m else []
    names = [f"{recipe}/{variant}" for recipe, variant, _ in refs]   # what the signature binds (signing.verify)

    def sidecars(previous=None):
        return build_sidecars(st, digest, names=names, previous=previous)

    # an object already there is hashed on the remote (one download): a same-size damaged copy is uploaded again
    uploaded = push_hit(remote, st, manifest["key"], digest, None, sidecars=sidecars, refs=(), progress=progress,
                        check_content=True)
    if not uploaded and signing_key() is not None:   # already there: its signature must name this ref too
        refresh_signature(remote, digest, sidecars, names)
    for recipe, variant, tag in refs:
        remote.set_ref(recipe, variant, tag, digest, manifest["key"])
    return {"digest": digest, "remote": remote.display, "uploaded": uploaded, "refs": [f"{a}/{b}:{c}" for a, b, c in refs]}
