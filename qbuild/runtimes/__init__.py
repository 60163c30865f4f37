"""Evaluation runtimes: one module per runtime, each a `qbuild.contract.plugin.Runtime` registered by name.

transformers.py evaluates HF checkpoints (plain and compressed-tensors), llamacpp.py GGUF files;
TensorRT-LLM engines are evaluated by qbuild/runtimes/tensorrt_llm.py. Which runtime evaluates an artifact
is decided by its format (`Runtime.formats`); protocols live in qbuild/contract/protocol.py, so the
same protocol gives the same number through any runtime.
"""
