"""Inference servers, one module per server: each a `qbuild.contract.plugin.Server` registered by name."""
