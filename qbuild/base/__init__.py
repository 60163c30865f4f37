"""The base layer: what every other layer uses and which knows nothing of quantization: errors, hashing, names,
YAML I/O, the guarded filesystem helper (owned), files (a directory's size), process and tool helpers, the worker
environment, hardware and toolchain fingerprints, units, the pydantic base of every schema and the plugin registry
mechanism. It imports nothing of qbuild outside this folder."""
