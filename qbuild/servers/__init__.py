"""Inference servers, one module per server: each a `qbuild.contract.plugin.Server` registered by name (how to start
it for an artifact and a serving config). Starting, stopping and measuring one is the serving service's
(qbuild/serving/)."""
