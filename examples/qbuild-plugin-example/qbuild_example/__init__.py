"""Example qbuild plugin (docs/plugins.md): method `int8-rtn`, which writes its own format that qbuild's built-in
transformers runtime evaluates. The whole plugin is qbuild_example/method.py plus one entry point."""
