"""Bounds on what a YAML/JSON recipe file may hold, checked before it is used.

A recipe file is a small mapping of fields. A hostile or broken one can still cost without end:
nesting thousands deep (the YAML composer and json recurse: a RecursionError traceback), an alias
bomb (a few lines whose aliases expand to billions of references once anything walks them), or a
huge file. Each is one ValueError naming the file and the bound.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

MAX_FILE_BYTES = 1 << 20
MAX_NESTING = 32  # a recipe is field: value, task_args/engine_args a level or two more
MAX_NODES = 100_000  # values, counting every alias again where it is used
MAX_BASE_CHAIN = 16  # recipe files reached through base:


def read_text(path: Path) -> str:
    size = path.stat().st_size
    if size > MAX_FILE_BYTES:
        raise ValueError(f"recipe file {path} is {size:,} bytes; a recipe file is at most {MAX_FILE_BYTES:,}")
    return path.read_text()


def check_yaml_nesting(yaml: Any, text: str, path: Path) -> None:
    """Depth from the parser's events (iterative), before the recursive composer builds anything."""
    depth = 0
    for event in yaml.parse(text, Loader=yaml.SafeLoader):
        if isinstance(event, (yaml.MappingStartEvent, yaml.SequenceStartEvent)):
            depth += 1
            if depth > MAX_NESTING:
                raise ValueError(_too_deep(path))
        elif isinstance(event, (yaml.MappingEndEvent, yaml.SequenceEndEvent)):
            depth -= 1


def check_size(data: Any, path: Path) -> None:
    """Every value walked once per reference (so an alias bomb runs out of budget at once), with
    its depth; iterative."""
    stack, seen = [(data, 1)], 0
    while stack:
        item, depth = stack.pop()
        seen += 1
        if seen > MAX_NODES:
            raise ValueError(f"recipe file {path} holds more than {MAX_NODES:,} values (counting every use "
                             f"of a YAML alias): a recipe is a few fields")
        children = (list(item.keys()) + list(item.values()) if isinstance(item, dict)
                    else item if isinstance(item, list) else ())
        if children and depth > MAX_NESTING:
            raise ValueError(_too_deep(path))
        stack.extend((child, depth + 1) for child in children)


def _too_deep(path: Path) -> str:
    return f"recipe file {path} nests mappings/lists deeper than {MAX_NESTING} levels"
