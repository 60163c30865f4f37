"""Build targets: one module per target, each a `qbuild.contract.plugin.Target` registered by name (recipe
`targets[i].type`), applied to variant artifacts. Both in-tree targets are TensorRT-LLM's:

tensorrt_llm.py     target `tensorrt-llm`: trtllm-build engines (TensorRT-LLM 1.2.x), keyed by GPU model, SM,
                    CPU architecture and toolchain
trtllm_pytorch.py   target `trtllm-pytorch`: checkpoint + extra_llm_api_options.yaml for the PyTorch backend, no build
trtllm_select.py    which stored engine fits this machine (`qbuild pull`)

The rest of TensorRT-LLM lives with its kind: method `modelopt` (qbuild/quantize/modelopt/), the export checks
(qbuild/models/checkpoint.py), runtime `tensorrt-llm` (qbuild/runtimes/tensorrt_llm.py) and server `trtllm-serve`
(qbuild/servers/trtllm.py); the TensorRT-LLM environment (cheap probes of the GPU and the TensorRT-LLM install, never
importing tensorrt_llm) is a service, qbuild/envs/tensorrt_llm.py, that the target and the runtime share.
"""
