"""A checkpoint is untrusted input: no Python it carries runs unless the recipe says so (`model.trust_remote_code`).

transformers runs a checkpoint's own code when a config names it through `auto_map` and the caller passes
`trust_remote_code=True`; qbuild never passes it, but llama.cpp's converter does for a dozen architectures. So a
checkpoint that carries code is refused at plan time (`carries_code`), and the converter runs behind a guard that
keeps transformers from loading any module a model names (`no_remote_code.py`, a launcher run by path so it imports
nothing of qbuild).
"""

from __future__ import annotations

from pathlib import Path

from qbuild.models.model_config import ConfigRefused, read_json_mapping

# the JSON files through which transformers' Auto* classes (config, tokenizer, processor) look for an `auto_map`
AUTO_MAP_FILES = ("config.json", "tokenizer_config.json", "processor_config.json", "preprocessor_config.json",
                  "feature_extractor_config.json", "image_processor_config.json")
LAUNCHER = Path(__file__).with_name("no_remote_code.py")


def carries_code(checkpoint: Path) -> str | None:
    """Why `checkpoint` (an HF directory) would run its own Python when loaded with remote code on, or None."""
    for name in AUTO_MAP_FILES:
        path = checkpoint / name
        if not path.is_file():
            continue
        try:
            auto_map = read_json_mapping(path).get("auto_map")
        except ConfigRefused:
            continue   # the config check names what is wrong with it
        if auto_map:
            first = next(iter(auto_map.values()), "") if isinstance(auto_map, dict) else auto_map
            shown = str(first if not isinstance(first, list) else first[0])[:80]
            return f"{name} has an auto_map naming code to run ({shown})"
    sources = sorted(p.name for p in checkpoint.glob("*.py"))
    if sources:
        return f"it ships Python files ({', '.join(sources[:3])}{', ...' if len(sources) > 3 else ''})"
    return None
