"""Quantization methods: one module per method, each a `qbuild.plugins.Method` registered by name; a method with
both a plan side and a worker side of any size is a small package instead: options.py (its schema and tables),
method.py (the registered Method: plan-time only) and run.py (what its steps run, imported only in a worker).

gguf/ (llama.cpp, with its per-tensor search), gptq.py / awq.py / fp8.py / rtn.py / smoothquant.py (llm-compressor,
sharing llmcompressor/, which holds the compressed-tensors search too), gptqmodel/ (GPTQ format, in its own backend
environment), bitsandbytes/ (bitsandbytes through transformers), autoround/ (auto-round), modelopt/ (NVIDIA ModelOpt,
for TensorRT-LLM).
Adding a method is adding a module here (see docs/plugins.md); heavy libraries are imported only
inside the functions its steps run, or at the top of a run.py.
"""
