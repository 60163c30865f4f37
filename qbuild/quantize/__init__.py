"""Quantization methods: one package per method, each registering a `qbuild.plugins.Method` by name: options.py (its
schema and tables), method.py (the registered Method: plan-time only, importable without torch or the method's
library) and run.py (the functions its steps run, named 'qbuild.quantize.<method>.run:<function>', imported only in a
step's worker).

gguf/ (llama.cpp, with its per-tensor search), llmcompressor/ (the llm-compressor family: its subpackages gptq/,
awq/, fp8/, rtn/, smoothquant/ are the methods, whose run.py each hands its modifiers to llmcompressor/run.py; it
holds the compressed-tensors search too; awq/ also converts to AutoAWQ's GEMM layout), gptqmodel/ (GPTQ format, in its own backend
environment), bitsandbytes/ (bitsandbytes through transformers), autoround/ (auto-round), modelopt/ (NVIDIA ModelOpt,
for TensorRT-LLM).
Adding a method is adding a package (or a module) here (see docs/plugins.md); heavy libraries are imported only
inside the functions its steps run, or at the top of a run.py.
"""
