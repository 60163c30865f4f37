"""What the llm-compressor methods (gptq, awq, fp8, rtn, smoothquant) share on the plan side: the plan-time checks
and the plan step (LLMCompressorMethod).

Each method is its own package (gptq/, awq/, fp8/, rtn/, smoothquant/, each options.py, method.py, run.py) with a
`LLMCompressorMethod` subclass in its method.py that declares its options and plans its quantize step through
`quantize_step(variant, ctx, runner="qbuild.quantize.<method>.run:run")`; that runner, a function of the method's
run.py, turns the params into llm-compressor modifiers and hands them to this package's run.py (`run_quantize`):
`oneshot` on the shared calibration set, saving a compressed-tensors HF directory (vLLM, SGLang and transformers load
it). A data-free scheme (RTN, FP8 dynamic) runs llm-compressor's
`model_free_ptq` instead, one safetensors shard at a time, so its memory is a shard's, not the model's (an 8B or 70B
quantizes on a 24 GB machine), with the same quantized tensors. Nothing here imports torch or llm-compressor.
"""

from __future__ import annotations

from qbuild.plugin_services import with_untouched_dtype
from qbuild.plugins import Method, Step, VariantBase, check_int_weights, check_module_patterns
from qbuild.quantize.llmcompressor.options import (
    COMPRESSED_TENSORS,
    MIXTRAL_EXPERTS,
    PATTERN_FIELDS,
    TOOLS,
    IntWeightVariant,
)


class LLMCompressorMethod(Method):
    """A method run by llm-compressor's `oneshot`: subclasses give the options, and their `plan` names their run.py's
    runner (which builds the modifiers) to `quantize_step`."""

    extra = "llmcompressor"
    requires = ("llmcompressor", "compressed_tensors")
    runs_in_env = True     # `env: llm-compressor` (or your own) runs oneshot outside qbuild's environment
    unsupported_families = (MIXTRAL_EXPERTS,)

    def check(self, variant, ctx, field: str) -> None:
        # module patterns first: a typo in `ignore` would otherwise surface as a group-size complaint about the
        # very layers the user meant to ignore
        for name in PATTERN_FIELDS:
            patterns = getattr(variant, name, None)
            if patterns:
                model = ctx.model()
                check_module_patterns(list(patterns), model.source_path, ctx.model_info(), f"{field}.{name}")
        if isinstance(variant, IntWeightVariant):
            _, note = check_int_weights(variant, ctx, field)
            if note:
                ctx.warn(note)

    def scheme(self, variant) -> str:
        """The quantization scheme targets select on (integer weight-only: w<bits>a16)."""
        return f"w{variant.bits}a16"

    def quantize_step(self, variant: VariantBase, ctx, *, runner: str) -> Step:
        """The variant's quantize step, run by `runner` (its method's "qbuild.quantize.<method>.run:run")."""
        params = with_untouched_dtype(variant.quant_params(), ctx)
        if isinstance(variant, IntWeightVariant):
            auto_ignore, _ = check_int_weights(variant, ctx, "variants")   # check() has reported it
            if auto_ignore:
                params["auto_ignore"] = list(auto_ignore)
        inputs = {"model": ctx.model()}
        if variant.needs_calibration():
            inputs["calibration"] = ctx.calibration()
        # shard by shard where the scheme is data-free and the model's files name its modules (impl 2: files laid
        # out as the source's shards); the whole model through oneshot otherwise
        shards = self.model_free_scheme(params) is not None and model_free_fits(ctx.model_info())
        return ctx.add(Step("quantize", f"quantize[{variant.name}]", params, runner, inputs=inputs, tools=TOOLS,
                            threads=ctx.threads, variant=variant.name, format=COMPRESSED_TENSORS,
                            scheme=self.scheme(variant), backend_env=ctx.backend_env(variant, self),
                            memory="shard-streamed" if shards else "offloads-to-disk", gpu_capable=True,
                            impl_version=2 if shards else 1, runtime_args={"model_free": True} if shards else {}))

    def model_free_scheme(self, params: dict) -> dict | str | None:
        """The compressed-tensors scheme (QuantizationScheme fields, or a preset's name) when these params need no
        calibration data, so `model_free_ptq` can quantize the checkpoint shard by shard; None: run oneshot. Asked at
        plan time (may the step go shard by shard) and by the method's runner (the same function of the params)."""
        return None


def model_free_fits(info: dict) -> bool:
    """Plan time (no torch): may the checkpoint go through model_free_ptq? Not a MoE (transformers fuses the experts
    on load, so the files' names are not the model's modules) nor a multimodal checkpoint (towers of their own)."""
    return not (info.get("num_experts") or info.get("num_local_experts") or "vision_config" in info
                or "text_config" in info)
