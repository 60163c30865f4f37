"""qbuild: recipe → plan → steps → content-addressed store of quantized model artifacts."""

__version__ = "0.1.0"
