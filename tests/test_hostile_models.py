"""Issue 46: a model file from the internet is untrusted input. No code from it runs unless the recipe says so; a
crafted GGUF or config is refused at plan time in one line naming the file and the field, in bounded time and memory,
with nothing written to the store; the import is memory-checked like every other step.

Every file here is made by the test (tests/hostile_models.py), in its own tmp_path.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from click.testing import CliRunner
from hostile_models import (
    ARRAY,
    HEADS,
    LAYERS,
    U32,
    base_metadata,
    gguf_bytes,
    gguf_corpus,
    hf_config_corpus,
    kv,
    write,
)

from qbuild.cli import cli
from qbuild.models.custom_code import LAUNCHER, carries_code
from qbuild.models.gguf_header import check_gguf
from qbuild.models.gguf_import import gguf_config

from helpers import fake_model, write_recipe

GGUF_CASES = gguf_corpus()
HF_CASES = hf_config_corpus()


def _invoke(*args) -> tuple[int, str]:
    res = CliRunner().invoke(cli, [str(a) for a in args], catch_exceptions=True)
    if res.exception is not None and not isinstance(res.exception, SystemExit):
        raise res.exception
    return res.exit_code, res.stderr


def _gguf_recipe(tmp_path: Path, gguf: Path) -> Path:
    return write_recipe(tmp_path / "r.yaml", {
        "name": "t", "model": {"source": "gguf", "path": str(gguf)},
        "variants": [{"name": "f16", "method": "gguf", "type": "F16"}],
        "evaluation": {"perplexity": None, "baseline": False}, "store": {"path": str(tmp_path / "store")}})


def _local_recipe(tmp_path: Path, model: Path, **model_extra) -> Path:
    return write_recipe(tmp_path / "r.yaml", {
        "name": "t", "model": {"source": "local", "path": str(model), **model_extra},
        "variants": [{"name": "f16", "method": "gguf", "type": "F16"}],
        "evaluation": {"perplexity": None, "baseline": False}, "store": {"path": str(tmp_path / "store")}})


def _one_line_refusal(recipe: Path, *needles: str, commands=("validate", "plan")) -> str:
    for command in commands:
        code, err = _invoke(command, recipe)
        lines = err.strip().splitlines()
        assert code == 2, (command, err)
        assert len(lines) == 1 and lines[0].startswith("qbuild: error: "), err
        for needle in needles:
            assert needle in lines[0], (needle, lines[0])
    return lines[0]


def test_the_base_file_is_a_gguf_gguf_py_and_the_check_both_read(tmp_path):
    """The corpus is the base file with one lie each: the base itself passes, so each refusal is for its lie."""
    path = write(tmp_path / "base.gguf", gguf_bytes())
    header = check_gguf(path)
    assert (header.tensors, header.blocks, header.elements) == (6, 2, 32 * 16 + 32 + 2 * (32 + 32 * 32))
    info = gguf_config(path)
    assert (info["num_attention_heads"], info["num_hidden_layers"], info["vocab_size"]) == (HEADS, 2, 16)
    assert info["gguf_elements"] == header.elements
    from gguf import GGUFReader

    assert len(GGUFReader(str(path)).tensors) == 6


def test_metadata_values_read_by_the_bounded_walk_are_gguf_pys(tmp_path):
    """The values qbuild reads from a GGUF's metadata (file type, architecture, layer and head counts) come from the
    bounded header walk, not from gguf-py decoding every field (2 s for the demo model's 49k-token vocabulary): the
    same values as gguf-py's, on the crafted base file and on the real demo model; string arrays are not decoded."""
    from conftest import smollm2_gguf_path
    from gguf import GGUFReader

    from qbuild.models.gguf_header import metadata_values

    files = [write(tmp_path / "base.gguf", gguf_bytes()),
             write(tmp_path / "per-layer.gguf", gguf_bytes(base_metadata(
                 heads=kv("llama.attention.head_count", ARRAY, (U32, [HEADS, HEADS])))))]
    if smollm2_gguf_path() is not None:
        files.append(smollm2_gguf_path())
    for path in files:
        fields = {k: f for k, f in GGUFReader(str(path)).fields.items() if not k.startswith("GGUF.")}
        values = metadata_values(path, (*fields, "no.such.key"))
        assert "no.such.key" not in values
        for key, field in fields.items():
            want = field.contents()
            if isinstance(want, list) and want and isinstance(want[0], str):
                assert values[key] is None, key          # the vocabulary: never decoded
            else:
                assert values[key] == want, (path.name, key, values[key], want)
    assert metadata_values(files[1], ("llama.attention.head_count",)) == {"llama.attention.head_count": [HEADS, HEADS]}


def test_architecture_keys_are_read_in_one_walk_whatever_the_order(tmp_path):
    """`arch_keys` gives `<arch>.<name>` for the file's own architecture in one walk: also where the architecture
    comes after its keys, and never another prefix's key of the same name (a decoy `qwen2.block_count`)."""
    from qbuild.models.gguf_header import metadata_values

    base = base_metadata()
    decoy = kv("qwen2.block_count", U32, 99)
    reordered = [decoy, *base[1:], base[0]]          # general.architecture last
    for name, metadata in (("base", base), ("reordered", reordered)):
        values = metadata_values(write(tmp_path / f"{name}.gguf", gguf_bytes(metadata)),
                                 arch_keys=("block_count", "attention.head_count_kv", "no_such_name"))
        assert values == {"general.architecture": "llama", "llama.block_count": LAYERS,
                          "llama.attention.head_count_kv": HEADS}, name
    no_arch = metadata_values(write(tmp_path / "no-arch.gguf", gguf_bytes(base[1:])), arch_keys=("block_count",))
    assert no_arch == {}


def test_a_per_layer_head_count_that_every_layer_shares_is_read_as_one_value(tmp_path):
    """Some real GGUFs store head_count as one value per layer: where the layers agree it is that value."""
    uniform = kv("llama.attention.head_count", ARRAY, (U32, [HEADS, HEADS]))
    info = gguf_config(write(tmp_path / "m.gguf", gguf_bytes(base_metadata(heads=uniform))))
    assert info["num_attention_heads"] == HEADS


@pytest.mark.parametrize("case", sorted(GGUF_CASES))
def test_a_crafted_gguf_is_refused_at_plan_time_in_one_line(tmp_path, case):
    data, needles = GGUF_CASES[case]
    gguf = write(tmp_path / "model.gguf", data)
    t0 = time.perf_counter()
    line = _one_line_refusal(_gguf_recipe(tmp_path, gguf), "model.path", str(gguf), *needles)
    assert time.perf_counter() - t0 < 5, line
    assert len(line) < 600, line
    assert not (tmp_path / "store" / "objects").exists() or not any((tmp_path / "store" / "objects").iterdir())
    assert gguf.read_bytes() == data   # the input is only read


@pytest.mark.parametrize("case", sorted(HF_CASES))
def test_a_bad_hf_config_is_refused_at_plan_time_in_one_line(tmp_path, case):
    text, needles = HF_CASES[case]
    model = fake_model(tmp_path)
    (model / "config.json").write_text(text)
    _one_line_refusal(_local_recipe(tmp_path, model), "model.path", "config.json", *needles)


def test_the_hostile_corpus_plans_in_bounded_time_and_memory(tmp_path):
    """Every case in one fresh interpreter, as `qbuild plan` runs it: each exits 2 in under 5 s, and the process
    never holds 500 MB (the lying array count grew gguf-py's reader past 1.9 GB in 30 s)."""
    for name, (data, _) in GGUF_CASES.items():
        case = tmp_path / name
        case.mkdir()
        _gguf_recipe(case, write(case / "model.gguf", data))
    for name, (text, _) in HF_CASES.items():
        case = tmp_path / f"hf-{name}"
        case.mkdir()
        (fake_model(case) / "config.json").write_text(text)
        _local_recipe(case, case / "fake-model")
    script = textwrap.dedent("""
        import json, sys, time
        from pathlib import Path
        from click.testing import CliRunner
        from qbuild.cli import cli
        out = {}
        for recipe in sorted(Path(sys.argv[1]).glob("*/r.yaml")):
            t0 = time.perf_counter()
            res = CliRunner().invoke(cli, ["plan", str(recipe)], catch_exceptions=True)
            out[recipe.parent.name] = [res.exit_code, time.perf_counter() - t0, res.stderr]
        # VmHWM: this process's own peak (ru_maxrss would also hold the pytest process it was forked from)
        hwm = next(l for l in open("/proc/self/status") if l.startswith("VmHWM:"))
        print(json.dumps({"cases": out, "peak_kb": int(hwm.split()[1])}))
    """)
    proc = subprocess.run([sys.executable, "-c", script, str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout)
    assert len(out["cases"]) == len(GGUF_CASES) + len(HF_CASES)
    for name, (code, seconds, err) in out["cases"].items():
        assert code == 2 and seconds < 5 and len(err.strip().splitlines()) == 1, (name, code, seconds, err)
    assert out["peak_kb"] / 1024 < 500, f"peak RSS {out['peak_kb'] / 1024:.0f} MB"


# --- code carried by a checkpoint -----------------------------------------------------------------------------------
def _checkpoint_with_code(root: Path, marker: Path) -> Path:
    """A checkpoint whose tokenizer is its own Python file, which leaves `marker` behind when it runs (as a real
    attack would do anything else)."""
    model = fake_model(root)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "architectures": ["QWenLMHeadModel"]}))
    (model / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "EvilTokenizer",
        "auto_map": {"AutoTokenizer": ["tokenization_evil.EvilTokenizer", None]}}))
    (model / "tokenization_evil.py").write_text(
        f"import os\nopen({str(marker)!r}, 'w').write(str(os.getpid()))\n"
        "from transformers import PreTrainedTokenizer\nclass EvilTokenizer(PreTrainedTokenizer):\n    pass\n")
    return model


def test_a_checkpoint_carrying_code_is_refused_naming_the_file(tmp_path):
    marker = tmp_path / "ran"
    model = _checkpoint_with_code(tmp_path, marker)
    assert "tokenizer_config.json has an auto_map" in carries_code(model)
    line = _one_line_refusal(_local_recipe(tmp_path, model), "model.path", "tokenizer_config.json",
                             "trust_remote_code: true")
    assert "auto_map" in line
    code, err = _invoke("run", _local_recipe(tmp_path, model))   # the run, GGUF variant included, stops there
    assert code == 2 and "trust_remote_code" in err
    assert not marker.exists()


def test_python_files_beside_the_weights_are_code_too(tmp_path):
    model = fake_model(tmp_path)
    (model / "modeling_x.py").write_text("raise SystemExit('ran')\n")
    assert carries_code(model) == "it ships Python files (modeling_x.py)"
    _one_line_refusal(_local_recipe(tmp_path, model), "modeling_x.py")


def test_trust_remote_code_in_the_recipe_lets_the_checkpoint_plan(tmp_path):
    model = _checkpoint_with_code(tmp_path, tmp_path / "ran")
    code, err = _invoke("validate", _local_recipe(tmp_path, model, trust_remote_code=True))
    assert "trust_remote_code" not in err and "carries its own Python code" not in err, err
    assert code in (0, 2)   # (what else validate says of a fake checkpoint is not this test's concern)


@pytest.mark.parametrize("trusted", [False, True])
def test_the_converter_guard_keeps_transformers_from_running_a_models_code(tmp_path, trusted):
    """The call llama.cpp's converter makes for a dozen architectures, `AutoTokenizer.from_pretrained(dir,
    trust_remote_code=True)`, run the way qbuild runs the converter: behind the guard it runs nothing; without the
    guard (the recipe's trust_remote_code: true) the model's file runs, as the user asked."""
    marker = tmp_path / "ran"
    model = _checkpoint_with_code(tmp_path, marker)
    script = tmp_path / "convert_like.py"
    script.write_text("import sys\nfrom transformers import AutoTokenizer\n"
                      "AutoTokenizer.from_pretrained(sys.argv[1], trust_remote_code=True)\n")
    guard = [] if trusted else [str(LAUNCHER)]
    proc = subprocess.run([sys.executable, *guard, str(script), str(model)], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert marker.exists() == trusted, proc.stderr[-1500:]
    if not trusted:
        assert proc.returncode != 0 and ("custom code" in proc.stderr or "remote code is off" in proc.stderr)


@pytest.mark.parametrize("trusted", [False, True])
def test_llama_cpps_converter_runs_no_code_from_the_model_unless_trusted(tmp_path, trusted):
    """The real converter, as qbuild starts it, on a QWen-architecture checkpoint whose tokenizer is its own file
    (`--vocab-only`: the tokenizer is what asks for remote code). Guarded, the file never runs; trusted, it does."""
    import numpy as np
    from safetensors.numpy import save_file

    from qbuild.models.llamacpp_toolchain import converter_command, converter_env

    marker = tmp_path / "ran"
    model = _checkpoint_with_code(tmp_path, marker)
    save_file({"transformer.wte.weight": np.zeros((16, 32), np.float32)}, str(model / "model.safetensors"))
    cmd = converter_command(model, tmp_path / "out.gguf", "f16", trust_remote_code=trusted) + ["--vocab-only"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300,
                          env={**converter_env(), "HF_HUB_OFFLINE": "1"})
    assert marker.exists() == trusted, proc.stderr[-2000:]
    if not trusted:
        assert proc.returncode != 0 and "custom code" in proc.stderr, proc.stderr[-2000:]


# --- the import's memory ----------------------------------------------------------------------------------------------
def test_the_gguf_import_is_memory_checked_at_plan_time(tmp_path, monkeypatch):
    """The import dequantizes to float32 in memory (5.7 bytes a parameter measured): it gets an estimate like every
    other step, and a machine that cannot hold it refuses the plan naming the model."""
    gguf = write(tmp_path / "model.gguf", gguf_bytes())
    recipe = _gguf_recipe(tmp_path, gguf)
    monkeypatch.setenv("QBUILD_MEMORY_GB", "0.5")   # below the import's runtime alone
    line = _one_line_refusal(recipe, "model", "import", "dequantizes the GGUF", "0.5 GB", commands=("plan",))
    assert "QBUILD_MEMORY_GB" in line
    monkeypatch.setenv("QBUILD_MEMORY_GB", "4")
    code, err = _invoke("plan", recipe)
    assert "dequantizes" not in err, err


def test_the_import_estimate_grows_with_the_parameters_in_the_file():
    from qbuild.contract.step import Step
    from qbuild.models.size import GB, IMPORT_OVERHEAD, model_size
    from qbuild.pipeline.memory_fit import step_memory

    step = Step("import-gguf", "model", {}, None, memory="dequantizes-gguf")
    info = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4, "vocab_size": 16,
            "gguf_elements": 309_000_000}
    need, why = step_memory(step, model_size(info), False)
    # the 309M-parameter import the review measured peaked at 2.32 GB: the estimate holds it, not much more
    assert need == int(6.2 * 309_000_000 + IMPORT_OVERHEAD) and 2.32 * GB < need < 2.8 * GB and "float32" in why
    # a GGUF that states no dimensions is still sized by its tensors (an 8B one: ~46 GB, as the review found)
    need, _ = step_memory(step, model_size({"gguf_elements": 8_000_000_000}), False)
    assert need > 46 * GB


# --- the error line itself ------------------------------------------------------------------------------------------
def test_an_error_line_quotes_only_the_start_of_a_huge_value(tmp_path):
    recipe = {"name": "t", "model": {"source": "local", "path": str(fake_model(tmp_path))},
              "variants": [{"name": "x", "method": "gguf", "type": "Q" * 100_000}]}
    line = _one_line_refusal(write_recipe(tmp_path / "r.yaml", recipe), "variants[0].type", "100,000 characters")
    assert len(line) < 700, len(line)   # the value's start, and the allowed types
    recipe["variants"] = [{"name": "x", "method": "gguf", "type": "F16", "k" * 100_000: 1}]
    line = _one_line_refusal(write_recipe(tmp_path / "r.yaml", recipe), "unknown key")
    assert len(line) < 1500, len(line)


# --- the import's precision (issue 47) --------------------------------------------------------------------------------
@pytest.mark.parametrize(("types", "dtype"), [
    ({}, "float32"),                                            # an F32 file: its exact values
    ({"token_embd.weight": 1, "blk.0.attn_q.weight": 1, "blk.1.attn_q.weight": 1}, "float16"),   # all F16
    ({"token_embd.weight": 30, "blk.0.attn_q.weight": 30, "blk.1.attn_q.weight": 30}, "bfloat16"),  # all BF16
    ({"token_embd.weight": 1, "blk.0.attn_q.weight": 8, "blk.1.attn_q.weight": 8}, "float32"),   # quantized: exact
])
def test_the_import_keeps_a_16_bit_gguf_16_bit(tmp_path, types, dtype):
    """`dtype: auto` (the default): a GGUF whose matrices are all F16 or all BF16 is imported at that precision, so a
    quantized variant's untouched tensors (embeddings, head) are not widened to float32; a quantized GGUF keeps its
    exact dequantized values in float32. The recipe's dtype still decides where it is given."""
    from qbuild import api

    sizes = {1: 2, 30: 2, 8: 34 / 32}   # bytes a value: F16, BF16, Q8_0 (blocks of 32: 34 bytes)
    gguf = write(tmp_path / "m.gguf", _typed_gguf(types, sizes))
    recipe = {"name": "t", "model": {"source": "gguf", "path": str(gguf)},
              "variants": [{"name": "f16", "method": "gguf", "type": "F16"}],
              "evaluation": {"perplexity": None, "baseline": False}, "store": {"path": str(tmp_path / "store")}}
    model = next(p.step for p in api.validate(recipe).steps if p.step.kind == "import-gguf")
    assert model.params["dtype"] == dtype
    recipe["model"]["dtype"] = "float32"
    model = next(p.step for p in api.validate(recipe).steps if p.step.kind == "import-gguf")
    assert model.params["dtype"] == "float32"


def _typed_gguf(types: dict[str, int], bytes_per_value: dict[int, float]) -> bytes:
    """The base file with some tensors stored in other ggml types (data sized for each type)."""
    import struct

    from hostile_models import _str, base_metadata, base_tensors

    metadata = base_metadata()
    head = b"GGUF" + struct.pack("<IQQ", 3, len(base_tensors()), len(metadata)) + b"".join(metadata)
    infos, offset, sizes = b"", 0, []
    for name, dims in base_tensors():
        kind = types.get(name, 0)
        count = 1
        for d in dims:
            count *= d
        nbytes = int(count * bytes_per_value.get(kind, 4))
        infos += _str(name) + struct.pack("<I", len(dims)) + b"".join(struct.pack("<Q", d) for d in dims)
        infos += struct.pack("<IQ", kind, offset)
        sizes.append(nbytes)
        offset += -(-nbytes // 32) * 32
    body = head + infos
    return body + b"\0" * ((-len(body)) % 32) + b"".join(b"\0" * (-(-n // 32) * 32) for n in sizes)
