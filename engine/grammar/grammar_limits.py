"""GrammarLimits: what a grammar may cost, checked on its text before anything compiles it.

A grammar's compile time and memory grow with its size, and faster than linearly for some
shapes (xgrammar on the tiny vocabulary: 1,000 optional properties of one object 1.9 s and
+138 MB RSS, 2,000 of them 15 s and +500 MB; 30,000 required properties 32 s). The bytes and
the count of JSON nodes (objects, arrays and their members) are checked first, in microseconds
per KB; what passes them still compiles under a time limit (engine/grammar/compile_pool.py).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class GrammarLimits:
    max_bytes: int = 256 << 10  # the grammar's text (schema, regex, EBNF, structural tag)
    max_schema_nodes: int = 20_000  # objects, arrays and their members in a JSON grammar
    compile_timeout_s: float = 10.0  # one compile, from when a worker takes it

    @classmethod
    def of(cls, args: Any) -> "GrammarLimits":
        return cls(args.grammar_max_bytes, args.grammar_max_schema_nodes, args.grammar_compile_timeout)


def check_grammar_size(kind: str, spec: str, limits: GrammarLimits) -> None:
    """ValueError naming the limit a grammar's text passes (never compiles anything)."""
    size = len(spec.encode("utf-8", "surrogatepass"))
    if size > limits.max_bytes:
        raise ValueError(f"{kind} is {size} bytes; the limit is {limits.max_bytes} (--grammar-max-bytes)")
    if kind not in ("json_schema", "structural_tag"):
        return
    try:
        value = json.loads(spec)
    except (json.JSONDecodeError, RecursionError) as exc:
        raise ValueError(f"invalid {kind}: not valid JSON ({exc})") from None
    nodes = count_nodes(value, limits.max_schema_nodes)
    if nodes > limits.max_schema_nodes:
        raise ValueError(f"{kind} has over {limits.max_schema_nodes} JSON nodes (objects, arrays and their "
                         f"members); the limit is --grammar-max-schema-nodes")


def count_nodes(value: Any, stop_after: int) -> int:
    """Objects, arrays and their members in a parsed JSON value, counted up to just past
    `stop_after` (iterative: a deeply nested value cannot overflow the stack here)."""
    count, stack = 0, [value]
    while stack and count <= stop_after:
        item = stack.pop()
        if isinstance(item, dict):
            count += 1 + len(item)
            stack.extend(item.values())
        elif isinstance(item, list):
            count += 1 + len(item)
            stack.extend(item)
    return count
