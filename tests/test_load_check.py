"""The load-check step: each artifact loaded by its runtime(s), 16 tokens generated greedily from a fixed prompt
and compared with the baseline's. Run for real on the 2-layer SmolLM2: the baseline and an RTN W8 variant through
transformers, a GGUF Q8_0 variant through llama.cpp, and artifacts that do not load."""

from __future__ import annotations

import importlib.util
import json
import shutil
import sys
from pathlib import Path

import pytest
from test_backend_envs import envs_dir  # noqa: F401  (fixture: the session's backend environments directory)

from qbuild.artifacts.store import Store
from qbuild.contract.step import StepContext
from qbuild.errors import RecipeError
from qbuild.evaluate.loadcheck import RESULT, leading_matches
from qbuild.pipeline.plan import build_steps
from qbuild.planning.recipe import LOAD_CHECK_PROMPT, parse_recipe

from helpers import build_module_recipe, fake_model, run_api, write_recipe

needs_backends = pytest.mark.skipif(
    importlib.util.find_spec("llmcompressor") is None or importlib.util.find_spec("llama_cpp") is None,
    reason="needs qbuild[llmcompressor] and qbuild[gguf]")

VARIANTS = [{"name": "w8", "method": "rtn", "bits": 8, "group_size": 32},
            {"name": "q8", "method": "gguf", "type": "Q8_0"}]


def recipe_for(model: Path, store: Path, variants=VARIANTS, load_check=True) -> dict:
    return {"name": "loadck", "model": {"source": "local", "path": str(model)}, "variants": variants,
            "evaluation": {"perplexity": None, "load_check": load_check},
            "runtime": {"threads": 1}, "store": {"path": str(store)}}


def check_result(store: Path, step: dict) -> dict:
    return json.loads((Store(store).object_dir(step["digest"]) / RESULT).read_text())


def greedy(logits_of, prompt: list[int], n: int) -> list[int]:
    """The reference greedy decode: the whole growing sequence through the model for every token, no cache."""
    seq = list(prompt)
    for _ in range(n):
        seq.append(int(logits_of(seq)[-1].argmax()))
    return seq[len(prompt):]


@pytest.fixture(scope="module")
def built(tiny_model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("loadck")
    return build_module_recipe(root, recipe_for(tiny_model_dir, root / "store"))


@needs_backends
def test_each_artifact_is_checked_by_the_runtime_that_reads_it(built):
    steps, store = built["steps"], built["store"]
    assert {n for n in steps if n.startswith("load-check[")} == {"load-check[baseline]", "load-check[w8]",
                                                                  "load-check[q8]"}
    runtimes = {name: check_result(store, steps[f"load-check[{name}]"])["runtime"] for name in ("baseline", "w8", "q8")}
    assert runtimes["baseline"]["name"] == runtimes["w8"]["name"] == "transformers"
    assert runtimes["w8"]["quant_method"] == "compressed-tensors"
    assert runtimes["q8"]["name"] == "llama.cpp" and runtimes["q8"]["llama_cpp_python"]
    for name in ("baseline", "w8", "q8"):
        r = check_result(store, steps[f"load-check[{name}]"])
        assert r["prompt"] == LOAD_CHECK_PROMPT and len(r["generated_token_ids"]) == r["tokens"] == 16
        assert r["text"].strip(), (name, r["text"])   # something printable came out


@needs_backends
def test_generated_tokens_are_the_true_greedy_continuation(built, tiny_model_dir):
    """Baseline and W8 tokens equal an independent no-cache greedy decode of each model, and the W8 count is the
    number of leading tokens those two decodes share (whatever near-ties the 2-layer model has)."""
    import torch
    from transformers import AutoModelForCausalLM

    store, steps = built["store"], built["steps"]
    base, w8 = (check_result(store, steps[f"load-check[{n}]"]) for n in ("baseline", "w8"))
    prompt = base["prompt_token_ids"]
    assert w8["prompt_token_ids"] == prompt

    def decode(path):
        model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
        with torch.inference_mode():
            return greedy(lambda seq: model(torch.tensor([seq])).logits[0], prompt, 16)

    base_ids = decode(tiny_model_dir)
    w8_ids = decode(Store(store).object_dir(built["variants"]["w8"]["digest"]))
    assert base["generated_token_ids"] == base_ids
    assert w8["generated_token_ids"] == w8_ids
    assert w8["matches_baseline_tokens"] == leading_matches(w8_ids, base_ids)
    assert w8["matches_baseline"] == (w8_ids == base_ids)
    assert w8["baseline"]["generated_token_ids"] == base_ids


@needs_backends
def test_quantized_variants_agree_with_the_baseline_where_it_is_sure(built):
    """The first token has a logit margin over 2 in the baseline: 8-bit weights (KLD ~1e-4 here) cannot flip it."""
    rows = built["variants"]
    for name in ("w8", "q8"):
        check = rows[name]["load_check"][0]
        assert 1 <= check["matches_baseline_tokens"] <= 16
        assert check["matches_baseline"] == (check["matches_baseline_tokens"] == 16)


@needs_backends
def test_summary_and_json_carry_the_check(built):
    rows = built["variants"]
    assert rows["baseline"]["load"] == "ref" and rows["baseline"]["load_check"][0]["matches_baseline_tokens"] is None
    for name in ("w8", "q8"):
        [check] = rows[name]["load_check"]
        assert rows[name]["load"] == f"{check['matches_baseline_tokens']}/16"
        assert check["runtime"] == ("llama.cpp" if name == "q8" else "transformers")
        assert check["text"] == check_result(built["store"], built["steps"][f"load-check[{name}]"])["text"]


@needs_backends
def test_second_run_is_cached_and_identical(built):
    rc, again = run_api(built["recipe"])
    assert rc == 0 and again["counts"]["built"] == 0
    before, after = built["variants"], {r["variant"]: r for r in again["variants"]}
    for name in ("baseline", "w8", "q8"):
        assert after[name]["load_check"][0]["status"] == "cached"
        assert after[name]["load"] == before[name]["load"]
        assert after[name]["load_check"][0]["text"] == before[name]["load_check"][0]["text"]


@needs_backends
def test_a_fresh_run_generates_the_same_tokens(built, tiny_model_dir, tmp_path):
    """Determinism beyond the cache: the baseline's check run again from scratch gives the same tokens."""
    from qbuild.evaluate import loadcheck

    stored = Store(built["store"])
    ctx = StepContext(params={"tokens": 16, "runtime": "transformers"},
                      inputs={"model": tiny_model_dir,
                              "prompt": stored.object_dir(built["steps"]["load-check-prompt"]["digest"])},
                      input_manifests={}, out=tmp_path, threads=1, device="cpu", step_name="load-check[baseline]",
                      runtime_args={"label": "baseline"})
    result = loadcheck.run(ctx)
    assert (result["info"]["generated_token_ids"] == json.loads((tmp_path / RESULT).read_text())["generated_token_ids"]
            == check_result(built["store"], built["steps"]["load-check[baseline]"])["generated_token_ids"])


# --- generate: the runtimes' fast paths give what the plain re-run gives ------------------------------------
@needs_backends
def test_runtime_generate_overrides_equal_the_default(built, tiny_model_dir, tmp_path):
    from qbuild.plugins import RuntimeSession, runtimes

    ctx = StepContext(params={}, inputs={}, input_manifests={}, out=tmp_path, threads=1, device="cpu", step_name="t")
    prompt = check_result(built["store"], built["steps"]["load-check[baseline]"])["prompt_token_ids"]
    gguf_dir = Store(built["store"]).object_dir(built["variants"]["q8"]["digest"])
    for runtime, model in (("transformers", tiny_model_dir), ("llama.cpp", gguf_dir)):
        session = runtimes.get(runtime).open(model, ctx, len(prompt) + 17)
        assert type(session).generate is not RuntimeSession.generate   # the fast path is what is tested
        assert session.generate(prompt, 16) == RuntimeSession.generate(session, prompt, 16), runtime


# --- a runtime that cannot load the artifact fails the step, in one line ----------------------------------
@needs_backends
def test_an_artifact_that_does_not_load_fails_its_check_in_one_line(tiny_model_dir, tmp_path):
    broken = tmp_path / "broken-model"
    shutil.copytree(tiny_model_dir, broken)
    weights = broken / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:4096])   # a truncated download
    recipe = write_recipe(tmp_path / "r.yaml", recipe_for(broken, tmp_path / "store",
                                                          variants=[{"name": "f", "method": "fake"}]))
    rc, summary = run_api(recipe)
    assert rc == 1
    steps = {s["name"]: s for s in summary["steps"]}
    failed = steps["load-check[baseline]"]
    assert failed["status"] == "failed" and "\n" not in failed["error"]
    assert failed["error"].startswith("LoadCheckFailed: baseline does not load in runtime transformers: ")
    assert steps["load-check-prompt"]["status"] == "built"   # the tokenizer was fine: only the weights are broken
    rows = {r["variant"]: r for r in summary["variants"]}
    assert rows["baseline"]["load"] == "failed"


@needs_backends
def test_a_variant_whose_runtime_cannot_load_it_is_named(built, tmp_path):
    from qbuild.evaluate import loadcheck

    bad = tmp_path / "bad-gguf"
    bad.mkdir()
    (bad / "model.gguf").write_bytes(b"GGUF" + b"\0" * 60)
    prompt_dir = Store(built["store"]).object_dir(built["steps"]["load-check-prompt"]["digest"])
    ctx = StepContext(params={"tokens": 16, "runtime": "llama.cpp"}, inputs={"model": bad, "prompt": prompt_dir},
                      input_manifests={}, out=tmp_path, threads=1, device="cpu", step_name="load-check[q4]",
                      runtime_args={"label": "q4"})
    with pytest.raises(loadcheck.LoadCheckFailed, match=r"^variant 'q4' does not load in runtime llama\.cpp: \w+"):
        loadcheck.run(ctx)


# --- plan time ---------------------------------------------------------------------------------------------
def _plan(tmp_path, **load_check):
    model = fake_model(tmp_path)
    data = recipe_for(model, tmp_path / "store", variants=[{"name": "w8", "method": "rtn", "bits": 8, "group_size": 32}],
                      load_check=load_check or True)
    return build_steps(parse_recipe(data), tmp_path)


@pytest.mark.skipif(importlib.util.find_spec("llmcompressor") is None, reason="needs qbuild[llmcompressor]")
def test_plan_wires_each_check_to_the_baseline(tmp_path):
    ctx = _plan(tmp_path)
    by_name = {s.name: s for s in ctx.steps}
    base, w8 = by_name["load-check[baseline]"], by_name["load-check[w8]"]
    assert set(base.inputs) == {"model", "prompt"} and set(w8.inputs) == {"model", "prompt", "reference"}
    assert w8.inputs["reference"] is base and w8.inputs["model"] is by_name["quantize[w8]"]
    assert w8.params == {"tokens": 16, "runtime": "transformers"}
    assert by_name["load-check-prompt"].params["prompt"] == LOAD_CHECK_PROMPT
    # off by default: no step at all
    data = recipe_for(fake_model(tmp_path), tmp_path / "store", variants=[{"name": "w8", "method": "rtn"}],
                      load_check=False)
    assert not [s for s in build_steps(parse_recipe(data), tmp_path).steps if s.kind.startswith("load-check")]


@pytest.mark.skipif(importlib.util.find_spec("llmcompressor") is None, reason="needs qbuild[llmcompressor]")
def test_prompt_and_tokens_enter_the_keys_of_checks_only(tmp_path):
    plain = {s.name: s.key for s in _plan(tmp_path).steps}
    other = {s.name: s.key for s in _plan(tmp_path, prompt="Once upon a time").steps}
    longer = {s.name: s.key for s in _plan(tmp_path, tokens=32).steps}
    assert other["quantize[w8]"] == plain["quantize[w8]"] == longer["quantize[w8]"]
    assert other["load-check-prompt"] != plain["load-check-prompt"] == longer["load-check-prompt"]
    for name in ("load-check[baseline]", "load-check[w8]"):
        assert plain[name] != other[name] and plain[name] != longer[name]


@pytest.mark.skipif(importlib.util.find_spec("llmcompressor") is None, reason="needs qbuild[llmcompressor]")
def test_a_renamed_variant_keeps_its_check(tmp_path):
    """The artifact's name is given to the step for its error message only: it never enters the key."""
    model = fake_model(tmp_path)
    keys = []
    for name in ("w8", "eight-bit"):
        data = recipe_for(model, tmp_path / "store", variants=[{"name": name, "method": "rtn", "bits": 8}])
        keys.append(next(s.key for s in build_steps(parse_recipe(data), tmp_path).steps
                         if s.name == f"load-check[{name}]"))
    assert keys[0] == keys[1]


@pytest.mark.skipif(importlib.util.find_spec("llmcompressor") is None, reason="needs qbuild[llmcompressor]")
def test_several_runtimes_give_one_check_each(tmp_path, monkeypatch):
    """A second installed runtime for HF checkpoints (vLLM on a GPU machine, say): one check per runtime, each
    compared with the baseline's check through the same runtime."""
    from qbuild.plugins import Runtime, runtimes

    class Second(Runtime):
        name = "second-hf"
        formats = ("hf", "compressed-tensors")   # an out-of-tree runtime names the existing formats it reads
        tools = ("pydantic",)

        def open(self, model, ctx, n_ctx):
            raise NotImplementedError

    runtimes.names()   # load the registry before adding to it for this test only
    monkeypatch.setitem(runtimes._classes, Second.name, Second)
    by_name = {s.name: s for s in _plan(tmp_path).steps}
    assert {n for n in by_name if n.startswith("load-check[")} == {
        "load-check[baseline@transformers]", "load-check[baseline@second-hf]",
        "load-check[w8@transformers]", "load-check[w8@second-hf]"}
    assert "reference" not in by_name["load-check[baseline@transformers]"].inputs
    assert by_name["load-check[baseline@second-hf]"].inputs["reference"] is by_name["load-check[baseline@transformers]"]
    assert by_name["load-check[w8@second-hf]"].inputs["reference"] is by_name["load-check[baseline@second-hf]"]
    # naming runtimes picks those, in that order
    only = {s.name for s in _plan(tmp_path, runtimes=["second-hf"]).steps if s.kind == "load-check"}
    assert only == {"load-check[baseline]", "load-check[w8]"}
    assert all(s.params["runtime"] == "second-hf" for s in _plan(tmp_path, runtimes=["second-hf"]).steps
               if s.kind == "load-check")


def test_bad_load_check_settings_are_one_line_recipe_errors(tmp_path):
    model = fake_model(tmp_path)
    data = recipe_for(model, tmp_path / "store", variants=[{"name": "f", "method": "fake"}],
                      load_check={"runtimes": ["vllm-typo"]})
    with pytest.raises(RecipeError) as exc:
        build_steps(parse_recipe(data), tmp_path)
    assert exc.value.field == "evaluation.load_check.runtimes[0]" and "transformers" in str(exc.value)
    for bad, field in (({"tokens": 0}, "evaluation.load_check.tokens"), ("yes", "evaluation.load_check"),
                       ({"promt": "x"}, "evaluation.load_check.promt")):
        with pytest.raises(RecipeError) as exc:
            parse_recipe(recipe_for(model, tmp_path / "store", load_check=bad))
        assert exc.value.field == field


def test_a_format_no_runtime_reads_is_reported_not_dropped(tmp_path):
    data = recipe_for(fake_model(tmp_path), tmp_path / "store", variants=[{"name": "f", "method": "fake"}])
    ctx = build_steps(parse_recipe(data), tmp_path)
    assert "load-check[f]" not in {s.name for s in ctx.steps}
    assert any("reads fake; f is not loaded" in w for w in ctx.warnings), ctx.warnings


# --- an engine: the default generate (logits of the growing sequence) through TensorRT-LLM's logits path -------
@pytest.mark.slow   # over a minute here, most of it the calibration set the engine's recipe builds
def test_engine_check_through_the_fake_tensorrt_llm_interpreter(tmp_path, tiny_model_dir, monkeypatch):
    """No GPU here: a stub tensorrt_llm (tests/fake_trtllm) whose logits are a fixed function of the tokens. The
    engine's check must be the greedy decode of exactly those logits, compared with the baseline's."""
    import test_trtllm_eval as trt

    from qbuild.envs import tensorrt_llm as trtllm_env

    monkeypatch.delenv(trtllm_env.ENV_PYTHON, raising=False)
    monkeypatch.setenv(trtllm_env.FAKE_GPU, trt.H100)
    monkeypatch.setenv(trtllm_env.FAKE_TRTLLM, trt.TRT_121)
    sys.path.insert(0, str(trt.FAKE_DIR))
    try:
        from tensorrt_llm._tensorrt_engine import fake_logits
    finally:
        sys.path.remove(str(trt.FAKE_DIR))
        for m in [m for m in sys.modules if m == "tensorrt_llm" or m.startswith("tensorrt_llm.")]:
            del sys.modules[m]   # never leave a (fake) tensorrt_llm importable in this process

    path = trt._recipe(tmp_path, tiny_model_dir, {"baseline": True, "perplexity": None,
                                                  "load_check": {"tokens": 4}})
    trt._store_checkpoint(path, tiny_model_dir)
    code, summary, out = trt._run(path)
    assert code == 0, out
    steps = {s["name"]: s for s in summary["steps"]}
    engine_check = check_result(tmp_path / "store", steps["load-check[fp8.trtllm]"])
    vocab = json.loads((tiny_model_dir / "config.json").read_text())["vocab_size"]
    prompt = engine_check["prompt_token_ids"]
    assert engine_check["generated_token_ids"] == greedy(lambda seq: fake_logits(seq, vocab), prompt, 4)
    assert engine_check["runtime"]["name"] == "tensorrt-llm"
    rows = {r["variant"]: r for r in summary["variants"]}
    assert rows["fp8.trtllm"]["load"] == f"{engine_check['matches_baseline_tokens']}/4"


# --- a format read in another backend environment is checked there ---------------------------------------------
needs_uv = pytest.mark.skipif(shutil.which("uv") is None and not (Path(sys.executable).parent / "uv").exists(),
                              reason="uv is not installed")
GPTQ_RECIPE = {"calibration": {"sources": [{"type": "pydocs", "split": "train"}], "samples": 4, "seq_len": 64},
               "variants": [{"name": "gptq-fmt", "method": "gptqmodel", "bits": 4, "group_size": 32}]}


@needs_uv
@pytest.mark.usefixtures("envs_dir")
def test_a_gptq_check_is_planned_in_the_gptqmodel_environment(tmp_path, tiny_model_dir):
    data = {**recipe_for(tiny_model_dir, tmp_path / "store"), **GPTQ_RECIPE}
    by_name = {s.name: s for s in build_steps(parse_recipe(data), tmp_path).steps}
    check = by_name["load-check[gptq-fmt]"]
    assert check.backend_env is not None and check.backend_env.label.startswith("gptqmodel@")
    assert check.toolchain()["gptqmodel"] == check.backend_env.versions["gptqmodel"]
    assert by_name["load-check[baseline]"].backend_env is None


@needs_uv
@pytest.mark.slow   # a GPTQ quantization and a backend environment (created on first use): about a minute
@pytest.mark.usefixtures("envs_dir")
def test_a_gptq_checkpoint_loads_through_gptqmodel_in_its_environment(tmp_path, tiny_model_dir):
    data = {**recipe_for(tiny_model_dir, tmp_path / "store"), **GPTQ_RECIPE}
    rc, summary = run_api(write_recipe(tmp_path / "r.yaml", data))
    assert rc == 0, summary["steps"]
    step = {s["name"]: s for s in summary["steps"]}["load-check[gptq-fmt]"]
    result = check_result(tmp_path / "store", step)
    assert result["runtime"]["quant_method"] == "gptq" and result["runtime"]["linear_class"].startswith("gptqmodel.")
    assert Store(tmp_path / "store").manifest(step["digest"])["toolchain"]["env"].startswith("gptqmodel@")
    [check] = {r["variant"]: r for r in summary["variants"]}["gptq-fmt"]["load_check"]
    assert 0 <= check["matches_baseline_tokens"] <= 16 and len(check["generated_token_ids"]) == 16
