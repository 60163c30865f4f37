"""GGUF beyond the plain types: importance matrix from the shared calibration set, per-tensor type
overrides, output/embedding types. Run for real on the 2-layer SmolLM2 through llama.cpp."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest

from qbuild.artifacts.store import Store
from qbuild.errors import RecipeError
from qbuild.pipeline.plan import build_steps
from qbuild.planning.recipe import parse_recipe

from helpers import build_module_recipe, fake_model, run_api

pytestmark = pytest.mark.skipif(importlib.util.find_spec("llama_cpp") is None, reason="needs qbuild[gguf]")

VARIANTS = [
    {"name": "q4_0", "method": "gguf", "type": "Q4_0"},
    {"name": "q4_0-im", "method": "gguf", "type": "Q4_0", "imatrix": True},
    {"name": "iq2_xs", "method": "gguf", "type": "IQ2_XS"},                       # imatrix implied
    {"name": "mixed", "method": "gguf", "type": "Q4_K_M", "output_type": "Q8_0", "embedding_type": "Q8_0",
     "tensor_types": [{"pattern": "ffn_down", "type": "Q8_0"}, {"pattern": "attn_v", "type": "F16"}]},
]


def recipe_for(model: Path, store: Path, variants=VARIANTS, calibration=True) -> dict:
    data = {"name": "ggufx", "model": {"source": "local", "path": str(model)}, "variants": variants,
            "evaluation": {"perplexity": {"context_length": 256, "max_windows": 2}},
            "runtime": {"threads": 1}, "store": {"path": str(store)}}
    if calibration:
        data["calibration"] = {"sources": [{"type": "pydocs", "split": "train"}], "samples": 8, "seq_len": 128}
    return data


def obj(store: Path, digest: str) -> Path:
    return Store(store).object_dir(digest)


@pytest.fixture(scope="module")
def built(tiny_model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("ggufx")
    return build_module_recipe(root, recipe_for(tiny_model_dir, root / "store"))


def gguf_file(built, variant: str):
    import gguf

    return gguf.GGUFReader(str(obj(built["store"], built["variants"][variant]["digest"]) / "model.gguf"))


def test_one_imatrix_step_shared_and_recorded(built):
    assert built["summary"]["counts"]["failed"] == 0
    assert [n for n in built["steps"] if n.startswith("imatrix")] == ["imatrix[f16]"]
    im_key = built["steps"]["imatrix[f16]"]["key"]
    for name in ("q4_0-im", "iq2_xs"):
        m = json.loads((obj(built["store"], built["variants"][name]["digest"]) / "manifest.json").read_text())
        assert m["inputs"]["imatrix"]["key"] == im_key
        assert m["info"]["imatrix"]["entries"] == 14 and m["info"]["imatrix"]["chunks"] == 8   # 2 layers × 7 Linear
        fields = gguf_file(built, name).fields
        assert fields["quantize.imatrix.file"].contents() == f"qbuild:imatrix:{im_key[:32]}"
        assert fields["quantize.imatrix.entries_count"].contents() == 14
    m = json.loads((obj(built["store"], built["variants"]["q4_0"]["digest"]) / "manifest.json").read_text())
    assert "imatrix" not in m["inputs"] and "quantize.imatrix.file" not in gguf_file(built, "q4_0").fields


def test_iq2_type_is_really_used(built):
    types = {t.name: t.tensor_type.name for t in gguf_file(built, "iq2_xs").tensors}
    # 1536-column ffn_down fits IQ2_XS's 256 blocks; 576-column tensors fall back (llama.cpp's rule)
    assert types["blk.0.ffn_down.weight"] == "IQ2_XS"


def test_predicted_fallback_is_what_llama_cpp_wrote(built):
    """The plan warning's fallback (qbuild's mirror of llama.cpp's rule) against the files llama.cpp wrote."""
    from qbuild.quantize.gguf import fallback_type

    for variant, default in (("iq2_xs", "IQ2_XS"), ("q4_0", "Q4_0")):
        types = {t.name: t.tensor_type.name for t in gguf_file(built, variant).tensors}
        for name in ("blk.0.ffn_up.weight", "blk.1.ffn_gate.weight"):   # 576 columns; the mixes leave these alone
            assert types[name] == fallback_type(default, 576), (variant, name, types[name])
    assert fallback_type("IQ2_XS", 576) == "IQ4_NL" and fallback_type("Q4_0", 576) == "Q4_0"


def test_imatrix_is_a_named_artifact_listed_shown_and_pulled(built, tmp_path):
    """Built once for the two variants that use it, and reachable by its ref like any variant."""
    from helpers import qbuild

    store = built["store"]
    im = built["steps"]["imatrix[f16]"]
    assert im["status"] == "built"
    ls = {r["ref"]: r for r in json.loads(qbuild("ls", "--store", store, "--json").stdout)}
    assert ls["ggufx/imatrix:latest"]["digest"] == im["digest"] and ls["ggufx/imatrix:latest"]["format"] == "imatrix"
    shown = json.loads(qbuild("show", "ggufx/imatrix", "--store", store).stdout)
    assert shown["kind"] == "imatrix" and shown["info"]["entries"] == 14
    assert shown["inputs"]["calibration"]["step"] == "calibrate"
    res = qbuild("pull", "ggufx/imatrix", "--store", store, "-o", tmp_path / "im")
    assert res.returncode == 0, res.stderr
    from safetensors.numpy import load_file

    assert set(load_file(str(tmp_path / "im" / "imatrix.safetensors"))) == set(
        load_file(str(obj(store, im["digest"]) / "imatrix.safetensors")))


def test_imatrix_lowers_activation_weighted_error(built):
    """The point of an imatrix: smaller weight error where the calibration activations are large."""
    import gguf
    from gguf.quants import dequantize
    from safetensors.numpy import load_file

    ref_reader = gguf.GGUFReader(str(obj(built["store"], built["steps"]["gguf-convert[f16]"]["digest"]) / "model.gguf"))
    ref = {t.name: dequantize(t.data, t.tensor_type).astype(np.float64) for t in ref_reader.tensors}
    im = load_file(str(obj(built["store"], built["steps"]["imatrix[f16]"]["digest"]) / "imatrix.safetensors"))
    assert set(im) <= set(ref) and all(im[k].shape == (ref[k].shape[-1],) and (im[k] >= 0).all() for k in im)

    def weighted_error(variant):
        errs = []
        for t in gguf_file(built, variant).tensors:
            if t.name in im:
                w = dequantize(t.data, t.tensor_type).astype(np.float64).reshape(ref[t.name].shape)
                errs.append(((ref[t.name] - w) ** 2 * im[t.name]).sum() / (ref[t.name] ** 2 * im[t.name]).sum())
        return float(np.mean(errs))

    plain, with_im = weighted_error("q4_0"), weighted_error("q4_0-im")
    assert with_im < 0.85 * plain, (plain, with_im)


def test_tensor_type_overrides_and_output_embedding_types(built):
    types = {t.name: t.tensor_type.name for t in gguf_file(built, "mixed").tensors}
    assert types["token_embd.weight"] == "Q8_0"
    assert types["blk.0.ffn_down.weight"] == types["blk.1.ffn_down.weight"] == "Q8_0"
    assert types["blk.0.attn_v.weight"] == "F16"
    assert built["variants"]["mixed"]["detail"] == "Q4_K_M ffn_down=Q8_0 attn_v=F16 output=Q8_0 embd=Q8_0"


def test_all_load_in_llama_cpp_with_finite_perplexity(built):
    base = built["variants"]["baseline"]["ppl"]
    for v in VARIANTS:
        ppl = built["variants"][v["name"]]["ppl"]
        assert ppl is not None and np.isfinite(ppl) and ppl < 2 * base, (v["name"], ppl, base)


def test_second_run_rebuilds_nothing(built):
    rc, summary = run_api(built["recipe"])
    assert rc == 0 and summary["counts"]["built"] == 0


# --- plan time ---------------------------------------------------------------------------------------
def test_explicit_type_that_does_not_fit_the_rows_fails_at_plan_time(tiny_model_dir, tmp_path):
    bad = [{"name": "x", "method": "gguf", "type": "Q4_K_M", "embedding_type": "Q6_K"}]
    with pytest.raises(RecipeError) as exc:
        build_steps(parse_recipe(recipe_for(tiny_model_dir, tmp_path, bad)), tmp_path)
    assert exc.value.field == "variants[0].embedding_type"
    assert "576" in str(exc.value) and "Q8_0" in str(exc.value)
    bad = [{"name": "x", "method": "gguf", "type": "Q8_0", "tensor_types": [{"pattern": "attn_q", "type": "IQ4_XS"}]}]
    with pytest.raises(RecipeError, match=r"tensor_types\[0\]\.type"):
        build_steps(parse_recipe(recipe_for(tiny_model_dir, tmp_path, bad)), tmp_path)


@pytest.mark.parametrize("variant, calibration, problem", [
    ({"name": "x", "method": "gguf", "type": "IQ2_XS", "imatrix": False}, True, "needs an importance matrix"),
    ({"name": "x", "method": "gguf", "type": "IQ1_S"}, False, "needs calibration data"),
    ({"name": "x", "method": "gguf", "type": "Q4_0", "tensor_types": [{"pattern": "(", "type": "Q8_0"}]}, True,
     "not a valid regex"),
    ({"name": "x", "method": "gguf", "type": "Q4_0", "output_type": "Q9_X"}, True, "not a ggml tensor type"),
])
def test_gguf_recipe_errors(tmp_path, variant, calibration, problem):
    with pytest.raises(RecipeError, match=problem):
        parse_recipe(recipe_for(fake_model(tmp_path), tmp_path, [variant], calibration=calibration))


def test_calibration_seed_invalidates_only_imatrix_variants(tmp_path):
    data = recipe_for(fake_model(tmp_path), tmp_path, [
        {"name": "a", "method": "gguf", "type": "Q4_K_M"}, {"name": "b", "method": "gguf", "type": "Q4_K_M", "imatrix": True}])
    before = build_steps(parse_recipe(data), tmp_path).artifact_steps()
    data["calibration"]["seed"] = 7
    after = build_steps(parse_recipe(data), tmp_path).artifact_steps()
    assert before["a"].key == after["a"].key and before["b"].key != after["b"].key


def test_a_run_writes_the_imatrix_ref_through_to_its_remote(built, tmp_path):
    """RECIPE/imatrix reaches a remote with the run that has it, not only through `qbuild push`."""
    from helpers import qbuild

    remote = f"file://{tmp_path / 'remote'}"
    res = qbuild(built["recipe"], "--remote", remote, "--json")   # everything is a hit; write-through on success
    assert res.returncode == 0, res.stderr
    refs = {r["ref"]: r for r in json.loads(qbuild("ls", "--remote", remote, "--json").stdout)}
    assert refs["ggufx/imatrix:latest"]["digest"] == built["steps"]["imatrix[f16]"]["digest"]
    assert refs["ggufx/q4_0-im:latest"]["digest"] == built["variants"]["q4_0-im"]["digest"]
    pulled = qbuild("pull", "ggufx/imatrix", "--from", remote, "--store", tmp_path / "other", "-o", tmp_path / "im")
    assert pulled.returncode == 0, pulled.stderr
    assert (tmp_path / "im" / "imatrix.safetensors").is_file()


def test_imatrix_is_llama_imatrix_own_output(built, tiny_model_dir, tmp_path):
    """The step's matrix is llama-imatrix's (in_sum2 / counts) on the same F16 GGUF and calibration text, the
    calibration text tokenizes back (llama.cpp's tokenizer) to exactly the calibration tokens, and the key names
    the tool build."""
    import subprocess

    import gguf
    import llama_cpp
    from safetensors.numpy import load_file

    from qbuild.base.fingerprint import package_version
    from qbuild.calibration.build import load_calibration
    from qbuild.models.llamacpp_toolchain import build_id, tool
    from qbuild.quantize.gguf.run import llama_imatrix_command, write_calibration_text

    store = built["store"]
    im = built["steps"]["imatrix[f16]"]
    manifest = Store(store).manifest(im["digest"])
    assert manifest["toolchain"]["llama.cpp-tools"] == build_id(package_version("llama-cpp-python"))
    assert manifest["info"]["tool"] == "llama-imatrix"
    calib = Store(store).object_dir(built["steps"]["calibrate"]["digest"])
    f16 = obj(store, built["steps"]["gguf-convert[f16]"]["digest"]) / "model.gguf"
    text = tmp_path / "calib.txt"
    seq_len = write_calibration_text(tiny_model_dir, calib, text)

    ids, mask = load_calibration(calib)
    vocab = llama_cpp.Llama(model_path=str(f16), vocab_only=True, verbose=False)
    assert vocab.tokenize(text.read_bytes(), add_bos=False, special=True) == ids[mask.astype(bool)].tolist()

    out = tmp_path / "direct.gguf"
    res = subprocess.run(llama_imatrix_command(tool("llama-imatrix"), f16, text, out, seq_len, 1),
                         capture_output=True, text=True)
    assert res.returncode == 0, res.stderr[-2000:]
    direct = {t.name: np.asarray(t.data, dtype=np.float64) for t in gguf.GGUFReader(str(out)).tensors}
    stored = load_file(str(obj(store, im["digest"]) / "imatrix.safetensors"))
    assert set(stored) == {n[: -len(".in_sum2")] for n in direct if n.endswith(".in_sum2")}
    for name, values in stored.items():
        expected = direct[name + ".in_sum2"].reshape(-1) / direct[name + ".counts"].reshape(-1)[0]
        assert np.allclose(values, expected, rtol=1e-5, atol=0), name
