"""compressed-tensors, the checkpoint format several plugins write (the llm-compressor methods and their search,
AutoRound's llm_compressor export) and targets take (trtllm-pytorch): declared here, once, as a service the plugins
import (qbuild.plugin_services.COMPRESSED_TENSORS, its name), so none imports another's. Importing it registers
the format; no torch."""

from __future__ import annotations

from qbuild.contract.formats import HF_RUNTIMES, FormatSpec, register_format

# Which engines load it depends on the scheme: vLLM and SGLang (CompressedTensorsWNA16) and TGI (WNA16Loader) take 4- and
# 8-bit integer weights, with or without zero points; LMDeploy's TurboMind reads llm-compressor W4A16 only at group
# sizes 32 and 128, so it is left out
_INT_WEIGHTS = ("vllm", "sglang", "tgi", "transformers")
COMPRESSED_TENSORS = register_format(FormatSpec(
    "compressed-tensors", "HF checkpoint with compressed-tensors quantization (llm-compressor)",
    load_tools=("compressed-tensors",), evaluated_by=HF_RUNTIMES,
    loads_in=("transformers",),                      # transformers decompresses any scheme
    loads_in_by_scheme=(
        ("w4a16", _INT_WEIGHTS),
        ("w8a16", _INT_WEIGHTS),
        ("w3a16", ("transformers",)),                # the serving kernels take 4 and 8 bits only
        ("w2a16", ("transformers",)),
        # W8A8 INT8 (SmoothQuant + RTN/GPTQ): vLLM's int8 scaled-mm kernels (CUDA, and CPUInt8ScaledMMLinearKernel in
        # its CPU build, served here) and SGLang's CompressedTensorsW8A8Int8
        ("w8a8-int8", ("vllm", "sglang", "transformers")),
        ("fp8-dynamic", ("vllm", "sglang", "tgi", "transformers", "trtllm-pytorch")),
        ("fp8-static", ("vllm", "sglang", "tgi", "transformers")),   # TensorRT-LLM's PyTorch backend: no
    ))).name
