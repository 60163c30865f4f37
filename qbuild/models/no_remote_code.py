"""Run a Python script (llama.cpp's convert_hf_to_gguf.py) with transformers unable to run a model's own code.

Usage: python no_remote_code.py SCRIPT [ARGS...]  (run by path: it imports nothing of qbuild)

The converter calls `AutoTokenizer.from_pretrained(dir, trust_remote_code=True)` for some architectures; with this
guard transformers treats every such call as trust_remote_code=False (a model with its own classes then fails, in
one line, instead of running them) and refuses to import any module a model names. qbuild refuses such checkpoints
at plan time (qbuild.models.custom_code); this is the second wall, around the one tool that asks for remote code.
"""

from __future__ import annotations

import os
import runpy
import sys

REFUSED = ("qbuild: this model asks to run its own Python code, and remote code is off "
           "(set model.trust_remote_code: true in the recipe to allow it)")


def forbid_remote_code() -> None:
    try:
        import transformers.dynamic_module_utils as dynamic
    except ImportError:   # no transformers: nothing can load a model's code this way
        return

    def refused(*args, **kwargs):
        raise RuntimeError(REFUSED)

    resolve = dynamic.resolve_trust_remote_code

    def never_trusted(trust_remote_code, *args, **kwargs):
        return resolve(False, *args, **kwargs)

    # every path to a model's module ends in get_class_in_module (looked up as a module global)
    dynamic.get_class_in_module = refused
    dynamic.resolve_trust_remote_code = never_trusted
    for name, module in list(sys.modules.items()):   # Auto* modules already imported hold the resolver by name
        # (vars(), not getattr: transformers' lazy modules import a submodule on every attribute asked for)
        if name.startswith("transformers.") and vars(module).get("resolve_trust_remote_code") is resolve:
            module.resolve_trust_remote_code = never_trusted


def main() -> None:
    script, *args = sys.argv[1:]
    forbid_remote_code()   # transformers imports its Auto* modules lazily, after this: they bind the guarded names
    sys.argv = [script, *args]
    # as `python SCRIPT` would have it: the script's folder first on the path, not this file's (qbuild/models)
    sys.path[0] = os.path.dirname(os.path.abspath(script))
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
