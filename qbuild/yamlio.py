"""Safe YAML loading that remembers the line of every key, so errors can name it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from qbuild.errors import RecipeError

Loc = tuple[str | int, ...]


class _LineLoader(yaml.SafeLoader):
    """SafeLoader that records the 1-based line of every mapping key and sequence item."""

    def __init__(self, stream):
        super().__init__(stream)
        self.lines: dict[Loc, int] = {}

    def construct_document(self, node):
        self._walk(node, ())
        return super().construct_document(node)

    def _walk(self, node, loc: Loc) -> None:
        self.lines.setdefault(loc, node.start_mark.line + 1)
        if isinstance(node, yaml.MappingNode):
            for key_node, value_node in node.value:
                key = key_node.value
                self.lines[loc + (key,)] = key_node.start_mark.line + 1
                self._walk(value_node, loc + (key,))
        elif isinstance(node, yaml.SequenceNode):
            for i, item in enumerate(node.value):
                self._walk(item, loc + (i,))


def load_yaml(text: str, source: str = "recipe") -> tuple[Any, dict[Loc, int]]:
    """Parse YAML safely; returns the data and a map from key path to line number."""
    loader = _LineLoader(text)
    try:
        data = loader.get_single_data()
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark
        line = mark.line + 1 if mark else None
        raise RecipeError("", f"invalid YAML: {exc.problem}", line=line, source=source) from None
    except yaml.YAMLError as exc:
        raise RecipeError("", f"invalid YAML: {exc}", source=source) from None
    finally:
        loader.dispose()
    return data, loader.lines


def load_yaml_file(path: Path) -> tuple[Any, dict[Loc, int]]:
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise RecipeError("", f"recipe file not found: {path}") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise RecipeError("", f"cannot read recipe {path}: {exc}") from None
    return load_yaml(text, source=str(path))


def line_for(lines: dict[Loc, int], loc: Loc) -> int | None:
    """Line of the deepest known prefix of loc (pydantic may point inside a value)."""
    for end in range(len(loc), -1, -1):
        if loc[:end] in lines:
            return lines[loc[:end]]
    return None
