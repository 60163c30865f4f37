"""A format's declaration says everything about it, engines per scheme included (issue 35: plugins declare them in
FormatSpec instead of writing into the LOADS_IN table)."""

from __future__ import annotations


def test_a_plugin_format_declares_its_engines_per_scheme(monkeypatch):
    from qbuild.contract import formats
    from qbuild.plugins import FormatSpec, register_format

    formats.declared()   # loaded before the copies: a plugin module loaded during the test would declare into them
    monkeypatch.setattr(formats, "FORMATS", dict(formats.FORMATS))
    monkeypatch.setattr(formats, "LOADS_IN", dict(formats.LOADS_IN))
    register_format(FormatSpec("int4-custom", "a plugin's format", loads_in=("my-engine", "vllm"),
                               loads_in_by_scheme=(("w4g32", ("my-engine",)),)))
    assert formats.loads_in("int4-custom", "w4g32") == ("my-engine",)
    assert formats.loads_in("int4-custom", "w4g128") == ("my-engine", "vllm")
    assert formats.manifest_loads_in("int4-custom", "w4g32", None) == ["my-engine"]
