"""Serving benchmarks: each artifact measured through the server that would serve it.

engines/ holds one `qbuild.contract.plugin.Server` per inference server (llama-server, vllm serve, SGLang, trtllm-serve):
how to start it for an artifact and a serving config. server.py starts and always stops one; client.py is the
streaming load generator; bench.py is the `serving[...]` step; plan.py plans those steps; llamacpp_build.py builds
llama.cpp's own tools from the vendored source of the installed llama-cpp-python.
"""
