"""`selection:` reaches what serving teams pull: the MLflow alias moves to the selected artifact only (away from the
variant an earlier selection chose), and the selected artifact's OCI ref manifest carries its exact server command.
Against a real `mlflow server` and a real docker-registry on 127.0.0.1; the plan and outcomes are the few fields
publish.py reads, the objects real store objects."""

from __future__ import annotations

import uuid
from types import SimpleNamespace

import pytest
from remote_common import make_object, model_files

from qbuild.artifacts import mlflow_registry as reg
from qbuild.artifacts.remote import open_remote
from qbuild.artifacts.remote.config import RegisterSpec
from qbuild.artifacts.store import Store
from qbuild.results.publish import SERVE_COMMAND, SERVE_CONFIG, register, write_through

COMMANDS = {"q4km": "llama-server --model model.gguf --ctx-size 2048 --parallel 4 --cache-type-k q8_0",
            "q8_0": "llama-server --model model.gguf --ctx-size 2048 --parallel 4"}


@pytest.fixture
def built(tmp_path):
    store = Store(tmp_path / "store")
    hits = {v: make_object(store, model_files(size=1 << 16, seed=i), variant=v) for i, v in enumerate(COMMANDS)}
    outcomes = [SimpleNamespace(step=SimpleNamespace(key=h.key, variant=v, format="gguf"), status="built",
                                path=h.path, digest=h.digest, record=h.record, remote=None) for v, h in hits.items()]
    return store, hits, outcomes


def plan_for(recipe: str, name_template: str, remotes=()) -> SimpleNamespace:
    spec = RegisterSpec(name=name_template, tracking_uri=None)
    recipe_ns = SimpleNamespace(name=recipe, model_registry=spec, selection=object(),
                                model=SimpleNamespace(path="/models/smollm2"))
    return SimpleNamespace(recipe=recipe_ns, remotes=tuple(remotes), artifacts=[])


def summary_for(hits, chosen: str | None) -> dict:
    rows = [{"variant": v, "key": h.key, "status": "built", "kld": 0.01} for v, h in hits.items()]
    selected = None if chosen is None else {"variant": chosen, "config": "kv8", "command": COMMANDS[chosen],
                                            "digest": hits[chosen].digest, "key": hits[chosen].key}
    for r in rows:
        if chosen and r["variant"] == chosen:
            r["selected"] = {"config": "kv8", "command": COMMANDS[chosen], "objective": "max_throughput", "bounds": {}}
    return {"variants": rows, "selection": {"selected": selected, "passed": selected is not None}}


def test_alias_follows_the_selection_per_variant_models(built, mlflow_server):
    store, hits, outcomes = built
    uri, recipe = mlflow_server["uri"], f"sel-{uuid.uuid4().hex[:6]}"
    plan = plan_for(recipe, "{recipe}-{variant}")
    first = register(plan, outcomes, summary_for(hits, "q8_0"), store, uri)
    assert first["q8_0"]["alias"] == "champion" and first["q4km"]["alias"] is None
    assert reg.resolve_models_uri(f"models:/{recipe}-q8_0@champion", uri)[0] == hits["q8_0"].digest
    with pytest.raises(reg.RegistryError):
        reg.resolve_models_uri(f"models:/{recipe}-q4km@champion", uri)
    from mlflow.tracking import MlflowClient

    tags = MlflowClient(uri).get_model_version(f"{recipe}-q8_0", first["q8_0"]["version"]).tags
    assert tags["qbuild.serve.command"] == COMMANDS["q8_0"] and tags["qbuild.serve.config"] == "kv8"
    assert "qbuild.serve.command" not in MlflowClient(uri).get_model_version(f"{recipe}-q4km", "1").tags

    # the next run selects the other variant: the alias moves there and leaves q8_0's model
    second = register(plan, outcomes, summary_for(hits, "q4km"), store, uri)
    assert second["q4km"]["alias"] == "champion" and second["q8_0"]["alias"] is None
    assert reg.resolve_models_uri(f"models:/{recipe}-q4km@champion", uri)[0] == hits["q4km"].digest
    with pytest.raises(reg.RegistryError):
        reg.resolve_models_uri(f"models:/{recipe}-q8_0@champion", uri)

    # nothing meets the bounds: no alias moves (the last selected artifact keeps it, as with failed gates)
    third = register(plan, outcomes, summary_for(hits, None), store, uri)
    assert all(e["alias"] is None for e in third.values())
    assert reg.resolve_models_uri(f"models:/{recipe}-q4km@champion", uri)[0] == hits["q4km"].digest


def test_alias_follows_the_selection_one_model_name(built, mlflow_server):
    store, hits, outcomes = built
    uri, recipe = mlflow_server["uri"], f"one-{uuid.uuid4().hex[:6]}"
    plan = plan_for(recipe, "{recipe}")
    for chosen in ("q4km", "q8_0"):
        out = register(plan, outcomes, summary_for(hits, chosen), store, uri)
        assert {v for v, e in out.items() if e["alias"]} == {chosen}
        assert reg.resolve_models_uri(f"models:/{recipe}@champion", uri)[0] == hits[chosen].digest


def test_selected_oci_ref_carries_the_server_command(built, oci_url):
    store, hits, outcomes = built
    remote = open_remote(oci_url)
    summary = summary_for(hits, "q4km")
    plan = plan_for("demo", "{recipe}-{variant}", remotes=[remote])
    plan.artifacts = [SimpleNamespace(step=o.step, label=o.step.variant, baseline=False) for o in outcomes]
    report = write_through(store, plan, outcomes, summary, ["latest"])
    assert report[remote.name]["refs"] == 2
    selected, _ = remote._get_oci_manifest("demo-q4km-latest")
    assert selected["annotations"][SERVE_COMMAND] == COMMANDS["q4km"]
    assert selected["annotations"][SERVE_CONFIG] == "kv8"
    assert selected["annotations"]["org.qbuild.digest"] == hits["q4km"].digest
    other, _ = remote._get_oci_manifest("demo-q8__0-latest")   # q8_0: "_" is written "__" (oci_tag)
    assert SERVE_COMMAND not in other["annotations"]
    card = remote.get_sidecar(hits["q4km"].digest, "README.md").decode()
    assert COMMANDS["q4km"] in card   # the model card says it too
    # a later run that selects q8_0 re-points the annotations: the old ref loses its command
    write_through(store, plan, outcomes, summary_for(hits, "q8_0"), ["latest"])
    assert SERVE_COMMAND not in remote._get_oci_manifest("demo-q4km-latest")[0]["annotations"]
    assert remote._get_oci_manifest("demo-q8__0-latest")[0]["annotations"][SERVE_COMMAND] == COMMANDS["q8_0"]


def test_selected_file_ref_carries_the_server_command(built, tmp_path):
    store, hits, outcomes = built
    remote = open_remote(f"file://{tmp_path / 'remote'}")
    remote.check()
    plan = plan_for("demo", "{recipe}-{variant}", remotes=[remote])
    plan.artifacts = [SimpleNamespace(step=o.step, label=o.step.variant, baseline=False) for o in outcomes]
    write_through(store, plan, outcomes, summary_for(hits, "q8_0"), ["latest"])
    assert remote.get_ref("demo", "q8_0")["annotations"] == {SERVE_COMMAND: COMMANDS["q8_0"], SERVE_CONFIG: "kv8"}
    assert "annotations" not in remote.get_ref("demo", "q4km")
