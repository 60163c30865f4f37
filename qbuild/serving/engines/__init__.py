"""Inference servers, one module per server: each a `qbuild.plugins.Server` registered by name."""
