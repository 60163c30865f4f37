"""The plugin surface, services side: what plugins use from qbuild's services and planning, the second and last
module of the surface beside qbuild.plugins (docs/plugins.md).

Why a second module: these live above the contract in qbuild's layers (docs/architecture.md: calibration/, models/,
serving/, envs/, evaluate/, planning/), and the services themselves import qbuild.plugins, so qbuild.plugins cannot
re-export them; some load numpy (the calibration set, the serving client, the evaluation protocol's measure), and
qbuild.plugins stays light for the plan side. Most are the run side's (imported in a step's worker); a few are plan
time (the llama.cpp build id, checkpoint facts, the evaluation step of a search's probe).

Every name is loaded on first use (module __getattr__, by ordinary imports), so importing this module costs nothing
and a plan-side module that needs one name loads only that name's module:

    from qbuild.plugin_services import load_calibration   # in a runner: the calibration set (numpy arrays)

The names, by what they are for:
- calibration:  load_calibration (the shared calibration artifact: token ids, attention mask)
- evaluation:   measure (the evaluation protocol's perplexity/KLD loop over a session), protocol (the protocol's module
                itself: windows, NLL; numpy), probe_step and kld_step (plan a search probe's or a candidate's
                evaluation step)
- checkpoints:  QUANT_ALGO, linear_in_features, source_facts, validate_hf_export, validate_trtllm_checkpoint,
                read_json_mapping
- model size:   GB, QUANTIZER_OVERHEAD, machine_memory, model_size
- formats:      COMPRESSED_TENSORS (the compressed-tensors format's name; importing it declares the format, which
                several plugins write)
- untouched tensors: with_untouched_dtype (plan time: the quantize step's untouched_dtype param), narrow_untouched
                (in the worker: the source's precision for what the quantization left as it was; torch)
- llama.cpp:    build_id, cached_bin_dir, run_converter, tool (the one llama.cpp build qbuild makes: its binaries),
                ggml_type_id (a tensor type's enum value in the llama-cpp-python bindings)
- GGUF files:   check_gguf (the bounded walk of a GGUF's header: tensors, weights, blocks), gguf_metadata_values
                (some metadata values, read by that walk without decoding every field)
- serving:      PORT, ServerLaunch (a server's launch: command, readiness, stop), get_text, post_json (HTTP to it)
- environments: created_env (a backend environment already created, or None), EnvError
- TensorRT-LLM: trtllm_env (the module of the TensorRT-LLM environment: the GPU and TensorRT-LLM probes, the facts an
                engine is keyed by, current_environment (the check where a step runs), interpreter; the target that
                builds engines and the runtime that evaluates them both ask it)
- vLLM:         vllm_env (the module that says where vLLM is and which build: availability, the facts its steps are
                keyed by, on_cpu, runs_on_gpu, cpu_cannot_load, cpu_settings, OFFLINE, interpreter; the vllm runtime
                and the vllm server both ask it)
"""

from __future__ import annotations

_CALIBRATION = ("load_calibration",)
_QUALITY = ("measure",)
_EVALUATION_PLAN = ("kld_step", "probe_step")
_CHECKPOINT = ("QUANT_ALGO", "linear_in_features", "source_facts", "validate_hf_export", "validate_trtllm_checkpoint")
_MODEL_CONFIG = ("read_json_mapping",)
_GGUF = {"check_gguf": "check_gguf", "gguf_metadata_values": "metadata_values"}
_SIZE = ("GB", "QUANTIZER_OVERHEAD", "machine_memory", "model_size")
_UNTOUCHED = ("narrow_untouched", "with_untouched_dtype")
_FORMATS = ("COMPRESSED_TENSORS",)
_LLAMACPP = ("build_id", "cached_bin_dir", "ggml_type_id", "run_converter", "tool")
_SERVER = ("PORT", "ServerLaunch")
_CLIENT = ("get_text", "post_json")
_ENVS = {"created_env": "created", "EnvError": "EnvError"}
_MODULES = ("protocol", "trtllm_env", "vllm_env")

__all__ = sorted([*_CALIBRATION, *_QUALITY, *_EVALUATION_PLAN, *_CHECKPOINT, *_MODEL_CONFIG, *_GGUF, *_SIZE, *_UNTOUCHED,
                  *_FORMATS, *_LLAMACPP, *_SERVER, *_CLIENT, *_ENVS, *_MODULES])


def __getattr__(name: str):
    if name in _CALIBRATION:
        from qbuild.calibration import build as module
    elif name in _QUALITY:
        from qbuild.evaluate import quality as module
    elif name in _EVALUATION_PLAN:
        from qbuild.planning import evaluation as module
    elif name in _CHECKPOINT:
        from qbuild.models import checkpoint as module
    elif name in _MODEL_CONFIG:
        from qbuild.models import model_config as module
    elif name in _GGUF:
        from qbuild.models import gguf_header as module

        name = _GGUF[name]
    elif name in _SIZE:
        from qbuild.models import size as module
    elif name in _UNTOUCHED:
        from qbuild.models import untouched as module
    elif name in _FORMATS:
        from qbuild.models import compressed_tensors as module
    elif name in _LLAMACPP:
        from qbuild.models import llamacpp_toolchain as module
    elif name in _SERVER:
        from qbuild.serving import server as module
    elif name in _CLIENT:
        from qbuild.serving import client as module
    elif name in _ENVS:
        from qbuild import envs as module

        name = _ENVS[name]
    elif name == "protocol":
        from qbuild.contract import protocol

        return protocol
    elif name == "trtllm_env":
        from qbuild.envs import tensorrt_llm as trtllm_env

        return trtllm_env
    elif name == "vllm_env":
        from qbuild.envs import vllm as vllm_env

        return vllm_env
    else:
        raise AttributeError(f"module 'qbuild.plugin_services' has no attribute {name!r}")
    return getattr(module, name)


def __dir__() -> list[str]:
    return list(__all__)
