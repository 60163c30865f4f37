"""Quantization methods: one module per method, each a `qbuild.contract.plugin.Method` registered by name.

gguf.py (llama.cpp), gptq.py / awq.py / fp8.py / rtn.py / smoothquant.py (llm-compressor, sharing
llmcompressor.py), bitsandbytes.py (bitsandbytes through transformers), autoround.py (auto-round);
ModelOpt for TensorRT-LLM lives with the rest of TensorRT-LLM in qbuild/quantize/modelopt.py.
Adding a method is adding a module here (see docs/plugins.md); heavy libraries are imported only
inside the functions its steps run.
"""
