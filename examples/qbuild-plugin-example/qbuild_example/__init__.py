"""Example qbuild plugins (docs/plugins.md): method `int8-rtn` writes format `int8-safetensors`,
runtime `int8-dequant` evaluates it."""

from qbuild.formats import FormatSpec, register_format

FORMAT = "int8-safetensors"
WEIGHTS = "model.int8.safetensors"

# A new format is declared once; runtimes that read it say so in their `formats`.
register_format(FormatSpec(FORMAT, "INT8 weight-only safetensors (per-output-channel scales), example plugin",
                           loads_in=("qbuild-example",)))
