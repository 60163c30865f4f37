"""Everything TensorRT-LLM-specific, in one place.

quantize/modelopt/  method `modelopt`: NVIDIA ModelOpt quantization, exported as a TensorRT-LLM
                    checkpoint (engine path) or an HF checkpoint (PyTorch-backend path)
checkpoint.py       validation of those exports against the source model (the RoPE-base trap ...)
engine.py           target `tensorrt-llm`: trtllm-build engines (TensorRT-LLM 1.2.x), keyed by GPU SM
pytorch_backend.py  target `trtllm-pytorch`: checkpoint + extra_llm_api_options.yaml, no build
runtime.py          runtime `tensorrt-llm`: engine perplexity/KLD (via _shim.py) and trtllm-bench throughput
env.py              cheap probes of the GPU and the TensorRT-LLM install (never imports tensorrt_llm)
select.py           which stored engine fits this machine (`qbuild pull`)
"""
