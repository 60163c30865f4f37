"""Safe, bounded YAML loading that remembers the line of every key, so errors can name it.

A recipe is untrusted input: the loader bounds its size (MAX_BYTES), its nesting (MAX_DEPTH) and the number
of nodes once aliases are expanded (MAX_NODES: a 500-byte "billion laughs" alias bomb is refused in
milliseconds), refuses duplicate keys (naming both lines) and non-scalar keys, and turns every loader failure
(bad bytes, recursive aliases, 5,000-digit integers, ...) into one RecipeError line (exit 2).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from qbuild.base.errors import RecipeError

Loc = tuple[str | int, ...]

MAX_BYTES = 1 << 20       # a recipe is a page of YAML; 1 MiB is generous
MAX_DEPTH = 64            # nesting levels (mappings and sequences)
MAX_NODES = 100_000       # nodes after alias expansion (what pydantic would walk)
MERGE_TAG = "tag:yaml.org,2002:merge"


class _Bounded(Exception):
    def __init__(self, message: str, line: int | None):
        self.message, self.line = message, line


class _LineLoader(yaml.SafeLoader):
    """SafeLoader that records the 1-based line of every mapping key and sequence item, within bounds."""

    def __init__(self, stream):
        super().__init__(stream)
        self.lines: dict[Loc, int] = {}
        self._nodes = 0

    def construct_document(self, node):
        self._walk(node, (), 0, frozenset())
        return super().construct_document(node)

    def _walk(self, node, loc: Loc, depth: int, ancestors: frozenset) -> None:
        line = node.start_mark.line + 1
        self._nodes += 1
        if self._nodes > MAX_NODES:
            raise _Bounded(f"too many values after expanding aliases (more than {MAX_NODES:,}): "
                           "is an anchor (&) referenced too often?", line)
        if depth > MAX_DEPTH:
            raise _Bounded(f"nested deeper than {MAX_DEPTH} levels", line)
        if id(node) in ancestors:
            raise _Bounded("an alias (*) refers to a value that contains it (a recursive structure)", line)
        self.lines.setdefault(loc, line)
        if isinstance(node, yaml.MappingNode):
            inner = ancestors | {id(node)}
            seen: dict[str, int] = {}
            for key_node, value_node in node.value:
                key_line = key_node.start_mark.line + 1
                if key_node.tag == MERGE_TAG:
                    self._walk(value_node, loc, depth + 1, inner)
                    continue
                if not isinstance(key_node, yaml.ScalarNode):
                    raise _Bounded("a mapping key must be a plain value (a name), not a list or a mapping", key_line)
                key = key_node.value
                if key in seen:
                    raise _Bounded(f"duplicate key {key[:60]!r} (first on line {seen[key]}, again on line {key_line})",
                                   key_line)
                seen[key] = key_line
                self.lines[loc + (key,)] = key_line
                self._walk(value_node, loc + (key,), depth + 1, inner)
        elif isinstance(node, yaml.SequenceNode):
            inner = ancestors | {id(node)}
            for i, item in enumerate(node.value):
                self._walk(item, loc + (i,), depth + 1, inner)


def load_yaml(text: str, source: str = "recipe") -> tuple[Any, dict[Loc, int]]:
    """Parse YAML safely and within bounds; returns the data and a map from key path to line number."""
    if len(text) > MAX_BYTES:
        raise RecipeError("", f"too large ({len(text):,} characters; a recipe may have at most {MAX_BYTES:,})",
                          source=source)
    loader = None
    try:
        loader = _LineLoader(text)
        data = loader.get_single_data()
    except _Bounded as exc:
        raise RecipeError("", exc.message, line=exc.line, source=source) from None
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark
        line = mark.line + 1 if mark else None
        raise RecipeError("", f"invalid YAML: {_one_line(exc.problem or exc.context)}", line=line,
                          source=source) from None
    except yaml.YAMLError as exc:
        raise RecipeError("", f"invalid YAML: {_one_line(exc)}", source=source) from None
    except RecursionError:
        raise RecipeError("", f"nested deeper than {MAX_DEPTH} levels", source=source) from None
    except (ValueError, TypeError, OverflowError, MemoryError) as exc:  # e.g. a 5,000-digit integer
        raise RecipeError("", f"invalid value: {_one_line(exc)}", source=source) from None
    finally:
        if loader is not None:
            loader.dispose()
    return data, loader.lines


def _one_line(exc) -> str:
    text = " ".join(str(exc).split())
    return text[:200] + ("..." if len(text) > 200 else "")


def load_yaml_file(path: Path) -> tuple[Any, dict[Loc, int]]:
    try:
        size = path.stat().st_size
        if size > MAX_BYTES:
            raise RecipeError("", f"too large ({size:,} bytes; a recipe may have at most {MAX_BYTES:,})",
                              source=str(path))
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise RecipeError("", f"recipe file not found: {path}") from None
    except IsADirectoryError:
        raise RecipeError("", f"{path} is a directory, not a recipe file") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise RecipeError("", f"cannot read recipe {path}: {_one_line(exc)}") from None
    return load_yaml(text, source=str(path))


def line_for(lines: dict[Loc, int], loc: Loc) -> int | None:
    """Line of the deepest known prefix of loc (pydantic may point inside a value)."""
    for end in range(len(loc), -1, -1):
        if loc[:end] in lines:
            return lines[loc[:end]]
    return None
