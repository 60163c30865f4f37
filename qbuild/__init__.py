"""qbuild: recipe → plan → steps → content-addressed store of quantized model artifacts.

The Python API (qbuild/api.py) is available from the package root; importing qbuild is cheap
(nothing heavy is imported until a step runs):

    import qbuild
    result = qbuild.run("recipes/demo.yaml")
"""

__version__ = "0.1.0"

__all__ = ["plan", "run", "pull", "report", "validate", "select", "RunResult"]


def __getattr__(name):
    if name in __all__:
        from qbuild import api

        return getattr(api, name)
    raise AttributeError(f"module 'qbuild' has no attribute {name!r}")
