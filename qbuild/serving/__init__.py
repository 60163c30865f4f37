"""Serving benchmarks: each artifact measured through the server that would serve it.

The servers themselves are plugins (qbuild/servers/: one `qbuild.contract.plugin.Server` per inference server,
llama-server, vllm serve, SGLang, trtllm-serve: how to start it for an artifact and a serving config). Here:
server.py starts and always stops one; client.py is the streaming load generator; served_check.py checks that a
served artifact computes what its offline evaluation measured; confidence.py and trace.py are a point's rounds and a
user's request trace (llama.cpp's own server is built by qbuild/models/llamacpp_toolchain.py). The runners of the
steps that start servers are here too: bench_step.py (`serving[...]`, `deploy-screen[...]`), capacity_step.py
(`capacity[...]`), deploy_step.py (`deploy`), each handing the server plugins config.py's view of the serving config
its params hold. The steps are planned in qbuild/planning/serving.py and deploy.py.
"""
