"""Serving at plan time, without starting anything: which server serves what, the refusals, keys, the GPU servers'
command lines (vLLM, SGLang, trtllm-serve: built and checked on CPU), and the recipe's selection rules."""

from __future__ import annotations

import shlex
from pathlib import Path

import numpy as np
import pytest
import yaml

from qbuild.errors import RecipeError
from qbuild.pipeline.plan import build_steps
from qbuild.planning.recipe import ServingConfig, parse_recipe

from helpers import fake_model, qbuild, write_recipe


def recipe(tmp_path: Path, serving: dict | None = None, selection: dict | None = None, **evaluation) -> dict:
    data = {"name": "t", "model": {"source": "local", "path": str(fake_model(tmp_path))},
            "variants": [{"name": "q8_0", "method": "gguf", "type": "Q8_0"},
                         {"name": "q4", "method": "gguf", "type": "Q4_0"}],
            "evaluation": {"perplexity": None, "baseline": True,
                           "serving": serving if serving is not None else
                           {"configs": [{"name": "default"}, {"name": "kv8", "kv_cache_dtype": "q8_0"}],
                            "variants": ["q8_0", "q4"]},
                           **evaluation}}
    if selection is not None:
        data["selection"] = selection
    return data


def steps(data: dict, tmp_path: Path) -> dict:
    return {s.name: s for s in build_steps(parse_recipe(data), tmp_path).steps}


@pytest.fixture
def no_gpu(monkeypatch):
    monkeypatch.setenv("QBUILD_FAKE_GPU", "none")


def test_one_serving_step_per_artifact_and_config(tmp_path, no_gpu):
    s = steps(recipe(tmp_path), tmp_path)
    served = sorted(n for n in s if n.startswith("serving["))
    assert served == ["serving[q4@default]", "serving[q4@kv8]", "serving[q8_0@default]", "serving[q8_0@kv8]"]
    step = s["serving[q8_0@kv8]"]
    assert step.per_hardware and step.inputs["model"] is s["quantize[q8_0]"] and step.params["server"] == "llama-server"
    args = step.params["server_args"]
    assert args[args.index("--cache-type-k") + 1] == "q8_0" and args[args.index("--cache-type-v") + 1] == "q8_0"
    assert args[args.index("--host") + 1] == "127.0.0.1" and args[args.index("--parallel") + 1] == "4"
    assert "llama-server" in step.toolchain() and any(k.startswith("hw.") for k in step.toolchain())


def test_llama_server_prefix_caching_flags():
    from qbuild.servers.llamacpp import LlamaServer

    def args(**config):
        return LlamaServer().args(ServingConfig(name="c", **config), threads=1, slots=4, context=168)

    assert "--cache-reuse" in args(prefix_caching=True) and "--no-cache-prompt" not in args(prefix_caching=True)
    off = args(prefix_caching=False)
    assert "--no-cache-prompt" in off and off[off.index("--cache-ram") + 1] == "0"
    assert "--no-cache-prompt" not in args() and "--cache-reuse" not in args()   # the engine's default


def test_hf_baseline_is_planned_for_vllm_and_skipped_where_it_cannot_run(tmp_path, no_gpu):
    """No vLLM here: unavailable, saying how to get it; vLLM's CUDA build without a GPU: needs-gpu. (Its CPU build
    serving for real: tests/test_vllm_cpu.py.)"""
    import json
    import sys

    data = recipe(tmp_path, serving={"configs": [{"name": "default"}], "engine": "vllm"})
    data["variants"] = [{"name": "q8_0", "method": "gguf", "type": "Q8_0"}]
    data["evaluation"]["serving"]["variants"] = ["baseline"]
    path = write_recipe(tmp_path / "r.yaml", data)

    def planned(env=None) -> dict:
        res = qbuild("plan", path, "--store", tmp_path / "store", "--json", env=env)
        assert res.returncode == 0, res.stderr
        return next(r for r in json.loads(res.stdout)["steps"] if r["step"] == "serving[baseline@default]")

    row = planned()
    assert row["status"] == "unavailable" and "qbuild env create vllm" in row["reason"], row
    cuda_build = f"env PYTHONPATH={Path(__file__).parent / 'fake_vllm'} {sys.executable}"   # a stand-in "vllm" package
    row = planned({"QBUILD_VLLM_PYTHON": cuda_build})
    assert row["status"] == "needs-gpu" and "no NVIDIA GPU" in row["reason"], row


def test_key_follows_workload_config_and_server_flags_never_selection(tmp_path, no_gpu):
    base = steps(recipe(tmp_path), tmp_path)["serving[q8_0@default]"].key
    with_sel = recipe(tmp_path, selection={"ttft_p99_ms": 100, "objective": "min_size"})
    assert steps(with_sel, tmp_path)["serving[q8_0@default]"].key == base
    more = recipe(tmp_path, serving={"requests": 32, "configs": [{"name": "default"}], "variants": ["q8_0"]})
    assert steps(more, tmp_path)["serving[q8_0@default]"].key != base
    par = recipe(tmp_path, serving={"configs": [{"name": "default", "parallel": 2}], "variants": ["q8_0"]})
    assert steps(par, tmp_path)["serving[q8_0@default]"].key != base


def test_a_shared_prefix_is_part_of_the_workload_and_the_context(tmp_path, no_gpu):
    from qbuild.serving.bench_step import prompts_from

    def plan(**extra):
        return steps(recipe(tmp_path, serving={"configs": [{"name": "default"}], "variants": ["q8_0"], **extra}),
                     tmp_path)

    plain, prefixed = plan(), plan(prefix_tokens=256)
    assert "prefix_tokens" not in plain["serving[q8_0@default]"].params["workload"]   # the key it had
    step = prefixed["serving[q8_0@default]"]
    assert step.params["workload"]["prefix_tokens"] == 256 and step.params["context"] == 256 + 128 + 32 + 8
    assert step.key != plain["serving[q8_0@default]"].key
    assert {n: s.key for n, s in prefixed.items() if n != "serving[q8_0@default]"} == {
        n: s.key for n, s in plain.items() if n != "serving[q8_0@default]"}   # the prompts step too

    tokens = np.arange(1000) % 997
    prompts = prompts_from(tokens, 100, 20, seed=3, prefix_tokens=64)
    assert all(p[:64] == tokens[-64:].tolist() and len(p) == 164 for p in prompts)
    assert all(min(p[64:]) >= 0 and max(p[64:]) < 900 for p in prompts)   # windows stop short of the prefix
    assert [p[64:] for p in prompts] == prompts_from(tokens[:-64], 100, 20, seed=3)
    with pytest.raises(ValueError, match="after a prefix of 950"):
        prompts_from(tokens, 100, 1, seed=0, prefix_tokens=950)


def test_rounds_are_part_of_the_serving_key_and_nothing_else_moves(tmp_path, no_gpu):
    def plan(rounds):
        return steps(recipe(tmp_path, serving={"configs": [{"name": "default"}], "variants": ["q8_0"],
                                               **({} if rounds is None else {"rounds": rounds})}), tmp_path)

    default, three, five, one = plan(None), plan(3), plan(5), plan(1)
    assert default["serving[q8_0@default]"].params["workload"]["rounds"] == 3
    assert default["serving[q8_0@default]"].key == three["serving[q8_0@default]"].key
    assert len({p["serving[q8_0@default]"].key for p in (three, five, one)}) == 3
    assert "rounds" not in one["serving[q8_0@default]"].params["workload"]   # one round: the key it had before
    for other in set(default) - {"serving[q8_0@default]"}:
        assert default[other].key == five[other].key == one[other].key, other


def test_a_conversation_is_part_of_the_workload_and_its_context_holds_every_turn(tmp_path, no_gpu):
    from qbuild.serving.bench_step import _round_prompts

    def plan(**extra):
        return steps(recipe(tmp_path, serving={"configs": [{"name": "default"}], "variants": ["q8_0"],
                                               "prefix_tokens": 16, **extra}), tmp_path)

    plain, chat = plan(), plan(conversation={"turns": 3, "think_s": 0.5})
    assert "conversation" not in plain["serving[q8_0@default]"].params["workload"]   # the key it had
    step = chat["serving[q8_0@default]"]
    assert step.params["workload"]["conversation"] == {"turns": 3, "think_s": 0.5}
    # the last turn resends the prefix and every earlier input and output: 3 × (128 + 32) (+ 8 a turn)
    assert step.params["context"] == 16 + 3 * (128 + 32 + 8) and plain["serving[q8_0@default]"].params["context"] == (
        16 + 128 + 32 + 8)
    assert step.key != plain["serving[q8_0@default]"].key
    assert {n: s.key for n, s in chat.items() if n != "serving[q8_0@default]"} == {
        n: s.key for n, s in plain.items() if n != "serving[q8_0@default]"}
    with pytest.raises(RecipeError, match="turns"):
        plan(conversation={"turns": 1})

    # per round, (warmup + requests) conversations × turns prompts a point; only a conversation's first has the prefix
    tokens = np.arange(5000) % 4999
    w = {**step.params["workload"], "requests": 2, "warmup": 1, "rounds": 2, "input_len": 10}
    count, prompts, lengths = _round_prompts(tokens, w, n_points=1)
    assert count == (1 + 2) * 3 and len(prompts) == len(lengths) == 2 * count
    assert [len(p) for p in prompts] == [26, 10, 10] * 6
    assert all(p[:16] == tokens[-16:].tolist() for p in prompts[::3])


def test_a_conversation_enters_the_capacity_search_only_when_set(tmp_path, no_gpu):
    def plan(**extra):
        return steps(recipe(tmp_path, serving={"configs": [{"name": "default"}], "variants": ["q8_0"],
                                               "capacity": {"slo": {"ttft_p99_ms": 500}}, **extra}), tmp_path)

    plain, chat = plan(), plan(conversation={"turns": 3, "think_s": 0.5})
    assert "conversation" not in plain["capacity[q8_0@default]"].params["workload"]   # the key it had
    assert chat["capacity[q8_0@default]"].params["workload"]["conversation"] == {"turns": 3, "think_s": 0.5}
    assert chat["capacity[q8_0@default]"].key != plain["capacity[q8_0@default]"].key


@pytest.mark.parametrize("config, problem", [
    ({"name": "fp8", "kv_cache_dtype": "fp8"}, "llama.cpp has no fp8 KV cache"),
    ({"name": "nofa", "kv_cache_dtype": "q4_0", "flash_attn": False}, "only with flash attention"),
])
def test_config_the_engine_cannot_express_is_refused_in_one_line(tmp_path, no_gpu, config, problem):
    with pytest.raises(RecipeError) as err:
        steps(recipe(tmp_path, serving={"configs": [{"name": "default"}, config], "variants": ["q8_0"]}), tmp_path)
    msg = str(err.value)
    assert "evaluation.serving.configs[1]" in msg and problem in msg and "\n" not in msg


@pytest.mark.parametrize("selection, problem", [
    ({"ttft_p99_ms": 500}, None),
    ({"ttft_p99_ms": {"value": 500, "concurrency": 8}}, "concurrency 8"),
    ({"max_kld": 0.1, "objective": "min_size"}, "need evaluation.kld"),
])
def test_selection_rules(tmp_path, no_gpu, selection, problem):
    data = recipe(tmp_path, selection=selection)
    if problem is None:
        parse_recipe(data)
        return
    with pytest.raises(RecipeError, match=problem):
        parse_recipe(data)


def test_latency_slo_without_serving_is_refused(tmp_path):
    data = recipe(tmp_path, selection={"ttft_p99_ms": 500})
    data["evaluation"].pop("serving")
    with pytest.raises(RecipeError, match="need evaluation.serving"):
        parse_recipe(data)


# --- the GPU servers' commands, built on CPU ------------------------------------------------------------------
def command(server, tmp_path, **config) -> list[str]:
    from qbuild.plugins import servers

    launch = servers.get(server).launch(Path("/models/q"), ServingConfig(name="c", **config), threads=4, slots=8,
                                        context=168, workdir=tmp_path)
    return launch.argv(8123)


def flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def test_vllm_serve_command(tmp_path, monkeypatch):
    """vLLM's OpenAI server module (what `vllm serve` runs) in vLLM's own interpreter, here a stand-in CUDA build."""
    import sys

    monkeypatch.setenv("QBUILD_FAKE_GPU", "NVIDIA H100 80GB HBM3:9.0:550.54.15")
    monkeypatch.setenv("QBUILD_VLLM_PYTHON", f"env PYTHONPATH={Path(__file__).parent / 'fake_vllm'} {sys.executable}")
    argv = command("vllm", tmp_path, kv_cache_dtype="fp8", prefix_caching=True)
    assert argv[:7] == ["env", f"PYTHONPATH={Path(__file__).parent / 'fake_vllm'}", sys.executable, "-m",
                        "vllm.entrypoints.openai.api_server", "--model", "/models/q"]
    assert flag(argv, "--host") == "127.0.0.1" and flag(argv, "--port") == "8123"
    assert flag(argv, "--kv-cache-dtype") == "fp8" and "--enable-prefix-caching" in argv
    assert flag(argv, "--max-num-seqs") == "8" and flag(argv, "--max-model-len") == "168"
    assert "--no-enable-prefix-caching" in command("vllm", tmp_path, prefix_caching=False)


def test_sglang_command(tmp_path):
    import sys

    argv = command("sglang", tmp_path, kv_cache_dtype="fp8", prefix_caching=False, parallel=2)
    assert argv[:4] == [sys.executable, "-m", "sglang.launch_server", "--model-path"] and argv[4] == "/models/q"
    assert flag(argv, "--host") == "127.0.0.1" and flag(argv, "--port") == "8123"
    assert flag(argv, "--kv-cache-dtype") == "fp8_e4m3" and "--disable-radix-cache" in argv
    assert flag(argv, "--max-running-requests") == "2" and flag(argv, "--context-length") == "168"


def test_trtllm_serve_command_and_options_file(tmp_path):
    argv = command("trtllm-serve", tmp_path, kv_cache_dtype="fp8", prefix_caching=True)
    assert argv[:2] == ["trtllm-serve", "/models/q"] and flag(argv, "--backend") == "pytorch"
    assert flag(argv, "--host") == "127.0.0.1" and flag(argv, "--max_batch_size") == "8"
    options = Path(flag(argv, "--extra_llm_api_options"))
    assert options.parent == tmp_path
    assert yaml.safe_load(options.read_text()) == {"kv_cache_config": {"dtype": "fp8", "enable_block_reuse": True}}
    assert "--extra_llm_api_options" not in command("trtllm-serve", tmp_path)
    assert shlex.join(argv)   # printable as one command line


@pytest.mark.parametrize("server", ["vllm", "sglang", "trtllm-serve"])
def test_gpu_servers_refuse_llamacpp_settings(server):
    from qbuild.plugins import servers

    s = servers.get(server)
    assert "q8_0" in s.refusal(ServingConfig(name="c", kv_cache_dtype="q8_0"))
    assert "llama.cpp setting" in s.refusal(ServingConfig(name="c", flash_attn=True))
    assert s.refusal(ServingConfig(name="c", kv_cache_dtype="fp8")) is None


@pytest.mark.parametrize("config", [{}, {"kv_cache_dtype": "fp8", "prefix_caching": True, "parallel": 4},
                                    {"kv_cache_dtype": "q8_0", "flash_attn": True, "threads": 2, "batch_size": 256,
                                     "ubatch_size": 64, "draft": "q4", "draft_max": 6, "draft_min": 1}])
def test_the_workers_view_of_a_serving_config_reads_as_the_plans(config):
    """The runners (qbuild/serving/*_step.py) start servers from the step's params["config"], the plan's
    ServingConfig.canonical(), through qbuild.serving.config.ServedConfig, without the recipe's model: the same fields
    in the same order, the same canonical form back, and the same flags from every server."""
    from qbuild.plugins import servers
    from qbuild.serving.config import ServedConfig

    planned = ServingConfig(name="c", **config)
    view = ServedConfig(**planned.canonical())
    assert list(ServedConfig.__dataclass_fields__) == list(ServingConfig.model_fields)
    assert view.canonical() == planned.canonical() and list(view.canonical()) == list(planned.canonical())
    for name in servers.names():
        server = servers.get(name)
        if server.refusal(planned) is None:
            assert server.args(view, threads=1, slots=2, context=64) == \
                server.args(planned, threads=1, slots=2, context=64), name


def test_lengths_drawn_from_a_range(tmp_path, no_gpu):
    from qbuild.serving.bench_step import drawn_lengths, prompts_from

    fixed = steps(recipe(tmp_path, serving={"configs": [{"name": "default"}], "variants": ["q8_0"]}), tmp_path)
    work = fixed["serving[q8_0@default]"].params["workload"]
    assert work["input_len"] == 128 and work["output_len"] == 32 and "rampup_s" not in work   # the keys they had
    ranged = steps(recipe(tmp_path, serving={"configs": [{"name": "default"}], "variants": ["q8_0"],
                                             "input_len": {"min": 64, "max": 256}, "output_len": {"min": 16, "max": 48},
                                             "rampup_s": 2}), tmp_path)["serving[q8_0@default]"]
    assert ranged.params["workload"]["output_len"] == {"min": 16, "max": 48} and ranged.params["workload"]["rampup_s"] == 2
    assert ranged.params["context"] == 256 + 48 + 8 and ranged.inputs["prompts"].params["context_length"] == 256
    lengths = drawn_lengths({"min": 16, "max": 48}, 200, seed=5)
    assert lengths == drawn_lengths({"min": 16, "max": 48}, 200, seed=5) and min(lengths) == 16 and max(lengths) == 48
    corpus = __import__("numpy").arange(10_000)
    prompts = prompts_from(corpus, {"min": 64, "max": 256}, 50, seed=1)
    assert all(64 <= len(p) <= 256 for p in prompts) and len({len(p) for p in prompts}) > 10
    assert all(p == list(range(p[0], p[0] + len(p))) and p[0] % 256 == 0 for p in prompts)   # window starts


@pytest.mark.parametrize("serving, problem", [
    ({"output_len": {"min": 1, "max": 8}}, "at least 2"),
    ({"input_len": {"min": 64, "max": 32}}, r"input_len: min \(64\) is larger than max \(32\)"),
])
def test_bad_length_ranges_are_refused(tmp_path, serving, problem):
    with pytest.raises(RecipeError, match=problem):
        parse_recipe(recipe(tmp_path, serving={"configs": [{"name": "default"}], **serving}))


# --- quality under a serving config's quantized KV cache --------------------------------------------------------------
def kv_recipe(tmp_path: Path, configs: list[dict], **perplexity) -> dict:
    return recipe(tmp_path, serving={"configs": configs, "variants": ["q8_0", "q4"]}, kld=True,
                  perplexity={"context_length": 128, "max_windows": 2, **perplexity})


def test_quantized_kv_configs_get_a_quality_step_and_every_other_key_stays(tmp_path, no_gpu):
    plain = steps(kv_recipe(tmp_path, [{"name": "default"}]), tmp_path)
    configs = [{"name": "default"}, {"name": "f16", "kv_cache_dtype": "f16"}, {"name": "kv8", "kv_cache_dtype": "q8_0"},
               {"name": "kv8-prefix", "kv_cache_dtype": "q8_0", "prefix_caching": True},
               {"name": "kv4", "kv_cache_dtype": "q4_0", "flash_attn": True}]
    s = steps(kv_recipe(tmp_path, configs), tmp_path)
    # every step of the plan without those configs keeps its key: nothing stored is rebuilt
    assert {n: st.key for n, st in s.items() if n in plain} == {n: st.key for n, st in plain.items()}
    extra = sorted(n for n in s if n not in plain and not n.startswith("serving["))
    # one pass per artifact and quantized KV dtype: kv8-prefix shares kv8's (same key); f16 is the variant's own
    assert extra == ["perplexity[q4@kv4]", "perplexity[q4@kv8]", "perplexity[q8_0@kv4]", "perplexity[q8_0@kv8]"]
    own, kv8 = s["perplexity[q8_0]"], s["perplexity[q8_0@kv8]"]
    assert kv8.params == {**own.params, "kv_cache_dtype": "q8_0", "flash_attn": True}
    assert kv8.inputs["reference"] is own.inputs["reference"] is s["reference[baseline]"]   # the f16-KV reference
    assert kv8.inputs["model"] is s["quantize[q8_0]"] and kv8.runtime_args["serving_kv"] == "q8_0"
    assert "kv_cache_dtype" not in s["reference[baseline]"].params
    assert s["perplexity[q4@kv4]"].params["kv_cache_dtype"] == "q4_0"


def test_recipe_pass_under_the_same_kv_dtype_needs_no_second_pass(tmp_path, no_gpu):
    configs = [{"name": "default"}, {"name": "kv8", "kv_cache_dtype": "q8_0"}, {"name": "kv4", "kv_cache_dtype": "q4_0"}]
    s = steps(kv_recipe(tmp_path, configs, kv_cache_dtype="q8_0", flash_attn=True), tmp_path)
    assert sorted(n for n in s if n.startswith("perplexity[")) == [
        "perplexity[q4@kv4]", "perplexity[q4]", "perplexity[q8_0@kv4]", "perplexity[q8_0]"]
    no_ppl = recipe(tmp_path, serving={"configs": configs, "variants": ["q8_0"]})   # perplexity: None
    assert not [n for n in steps(no_ppl, tmp_path) if n.startswith("perplexity[")]


def test_an_engine_that_cannot_evaluate_under_the_kv_dtype_gets_a_plan_note(tmp_path, no_gpu):
    """The HF baseline served by vLLM with an fp8 KV cache: it is evaluated by transformers, which has no KV dtype;
    no quality step, one plan note, the plan still builds."""
    data = kv_recipe(tmp_path, [{"name": "default"}, {"name": "fp8", "kv_cache_dtype": "fp8"}])
    data["evaluation"]["serving"].update(engine="vllm", variants=["baseline"])
    data["variants"] = [{"name": "q8_0", "method": "gguf", "type": "Q8_0"}]
    ctx = build_steps(parse_recipe(data), tmp_path)
    names = [st.name for st in ctx.steps]
    assert "serving[baseline@fp8]" in names and not [n for n in names if n.startswith("perplexity[baseline")]
    notes = [w for w in ctx.warnings if "serving config 'fp8'" in w]
    assert notes == ["quality of baseline under serving config 'fp8' (kv_cache_dtype fp8) not measured: it is "
                     "evaluated by the transformers runtime, which cannot run a fp8 KV cache"]
