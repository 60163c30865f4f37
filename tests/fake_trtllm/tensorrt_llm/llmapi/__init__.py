"""Test-only stub (see tests/fake_trtllm/README.md)."""


class KvCacheConfig:
    def __init__(self, **kw):
        self.kw = kw
