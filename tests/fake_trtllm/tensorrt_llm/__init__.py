"""Test-only stub of tensorrt_llm 1.2.x (see tests/fake_trtllm/README.md). Not TensorRT-LLM."""

__version__ = "1.2.1"
FAKE = True


class SamplingParams:
    def __init__(self, max_tokens=32, return_context_logits=False, **kw):
        self.max_tokens = max_tokens
        self.return_context_logits = return_context_logits
        self.kw = kw
