"""The layering of the packages (DESIGN section 1), checked on the source with `ast`.

Every import counts: at module level, inside functions (a lazy import is still a dependency) and
inside `if TYPE_CHECKING:` blocks (a type hint names the module it depends on). No exemptions.

Two cycle checks: none between packages (every import counts; the engine's sub-packages and its
root modules such as config.py each count as one), and none among engine modules over
module-level imports (imports inside functions are deliberate lazy imports).

Each violation prints as `file:line imports X (rule)`.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("engine", "engine_client", "weight_sync", "rollout", "trainer_bridge", "recipes", "tandem")


@dataclass(frozen=True)
class Import:
    path: str  # relative to the repository root
    line: int
    source: str  # importing module, e.g. engine.scheduler.batch
    target: str  # imported module, e.g. engine.forward_batch (or torch.cuda)
    type_only: bool  # inside `if TYPE_CHECKING:`
    in_function: bool


def _modules() -> dict[str, Path]:
    out: dict[str, Path] = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = path
    return out


MODULES = _modules()


def _resolve(module: str, name: Optional[str]) -> str:
    """`from module import name`: the submodule when `name` is one, else the module itself."""
    if name and f"{module}.{name}" in MODULES:
        return f"{module}.{name}"
    if name and module == "torch" and name == "cuda":
        return "torch.cuda"
    return module


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


class _Collector(ast.NodeVisitor):
    def __init__(self, source: str, path: str, is_package: bool) -> None:
        self.source, self.path, self.is_package = source, path, is_package
        self.type_only = False
        self.depth = 0
        self.found: list[Import] = []

    def _add(self, line: int, target: str) -> None:
        self.found.append(Import(self.path, line, self.source, target, self.type_only, self.depth > 0))

    def visit_If(self, node: ast.If) -> None:
        if _is_type_checking(node.test):
            saved, self.type_only = self.type_only, True
            for child in node.body:
                self.visit(child)
            self.type_only = saved
            for child in node.orelse:
                self.visit(child)
        else:
            self.generic_visit(node)

    def _visit_function(self, node: ast.AST) -> None:
        self.depth += 1
        self.generic_visit(node)
        self.depth -= 1

    visit_FunctionDef = visit_AsyncFunctionDef = visit_Lambda = _visit_function

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            self._add(node.lineno, alias.name)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        module = node.module or ""
        if node.level:  # relative: resolve against this module's package
            package = self.source.split(".")
            if not self.is_package:
                package = package[:-1]
            package = package[: len(package) - (node.level - 1)]
            module = ".".join(package + ([module] if module else []))
        for alias in node.names:
            self._add(node.lineno, _resolve(module, alias.name))


def _uses_torch_cuda(tree: ast.AST) -> list[int]:
    """Lines that touch `torch.cuda` as an attribute (an import is caught as an import)."""
    return [n.lineno for n in ast.walk(tree) if isinstance(n, ast.Attribute) and n.attr == "cuda"
            and isinstance(n.value, ast.Name) and n.value.id == "torch"]


def _collect() -> list[Import]:
    found: list[Import] = []
    for module, path in MODULES.items():
        rel = str(path.relative_to(ROOT))
        tree = ast.parse(path.read_text(), filename=rel)
        collector = _Collector(module, rel, path.name == "__init__.py")
        collector.visit(tree)
        found += collector.found
        found += [Import(rel, line, module, "torch.cuda", False, False) for line in _uses_torch_cuda(tree)]
    return found


IMPORTS = _collect()


def _under(module: str, *prefixes: str) -> bool:
    return any(module == p or module.startswith(p + ".") for p in prefixes)


def _engine_target(target: str) -> str:
    """`engine` itself re-exports the public API (Engine, ServerArgs, SamplingParams)."""
    return "engine.api" if target == "engine" else target


@dataclass(frozen=True)
class Rule:
    name: str
    applies: Callable[[str], bool]  # to the importing module
    forbids: Callable[[Import], bool]


def _forbid(*prefixes: str) -> Callable[[Import], bool]:
    return lambda imp: _under(_engine_target(imp.target), *prefixes)


def _only(*allowed: str) -> Callable[[Import], bool]:
    """Anything of the engine outside `allowed` (modules or packages) is forbidden."""
    return lambda imp: (_under(_engine_target(imp.target), "engine")
                        and not _under(_engine_target(imp.target), *allowed))


UPPER = ("engine.runner", "engine.core", "engine.api", "engine.server")
APPLICATION = ("rollout", "trainer_bridge", "recipes", "tandem", "engine_client")
RULES = (
    Rule("kernels are a leaf: they import nothing of the engine but engine.kernels",
         lambda m: _under(m, "engine.kernels"), _only("engine.kernels")),
    Rule("the forward contract sits below the scheduler, attention, models and runner",
         lambda m: _under(m, "engine.forward_batch"), _only("engine.forward_batch")),
    Rule("kv and scheduler are host-only bookkeeping: no CUDA, runner, models, server, api or core",
         lambda m: _under(m, "engine.kv", "engine.scheduler"),
         _forbid("torch.cuda", "engine.runner", "engine.models", "engine.server", "engine.api", "engine.core",
                 "engine.attention", "engine.kernels")),
    Rule("sampling, attention and models sit below the runner: no runner, scheduler, core, api or server",
         lambda m: _under(m, "engine.sampling", "engine.attention", "engine.models"),
         _forbid("engine.scheduler", *UPPER)),
    Rule("the runner sits below the core: no core, api or server",
         lambda m: _under(m, "engine.runner"), _forbid("engine.core", "engine.api", "engine.server")),
    Rule("the core sits below the API: no api or server",
         lambda m: _under(m, "engine.core"), _forbid("engine.api", "engine.server")),
    Rule("the API does not import the server",
         lambda m: _under(m, "engine.api"), _forbid("engine.server")),
    Rule("the server talks to the Engine API only (api, config, sampling_params, core.messages, tokenizer)",
         lambda m: _under(m, "engine.server"),
         _only("engine.server", "engine.api", "engine.config", "engine.sampling_params", "engine.core.messages",
               "engine.tokenizer")),
    Rule("the engine knows nothing of RL or the application: no rollout, trainer_bridge, recipes, tandem or "
         "engine_client", lambda m: _under(m, "engine"), _forbid(*APPLICATION)),
    Rule("weight_sync moves weights for both sides: it imports nothing of the engine or above",
         lambda m: _under(m, "weight_sync"), _forbid("engine", *APPLICATION)),
    Rule("the client package forwards the Engine API: engine and weight_sync only",
         lambda m: _under(m, "engine_client"), _forbid("rollout", "trainer_bridge", "recipes", "tandem")),
    Rule("rollout and trainer_bridge are peers: neither imports the other, recipes or the application",
         lambda m: _under(m, "rollout"), _forbid("trainer_bridge", "recipes", "tandem")),
    Rule("rollout and trainer_bridge are peers: neither imports the other, recipes or the application",
         lambda m: _under(m, "trainer_bridge"), _forbid("rollout", "recipes", "tandem")),
    Rule("recipes are definitions and plug-ins: they do not import the application",
         lambda m: _under(m, "recipes"), _forbid("tandem")),
)
# The server may use engine.tokenizer (a top-level leaf, transformers only) for chat templates.
# The rules name packages; DESIGN section 1 is the picture they keep true.


def layer_violations(imports: list[Import] = IMPORTS) -> list[str]:
    out: list[str] = []
    for imp in imports:
        for rule in RULES:
            line = f"{imp.path}:{imp.line} imports {imp.target} ({rule.name})"
            if rule.applies(imp.source) and rule.forbids(imp) and line not in out:
                out.append(line)
    return out


def import_cycles(imports: list[Import] = IMPORTS) -> list[list[str]]:
    """Strongly connected components (size > 1, or a self-import) of the engine's module graph."""
    graph: dict[str, set[str]] = {m: set() for m in MODULES if _under(m, "engine")}
    for imp in imports:
        if imp.in_function or imp.source not in graph or imp.target not in graph:
            continue
        graph[imp.source].add(imp.target)
    return _strongly_connected(graph)


def package_of(module: str) -> str:
    """The unit of the package-cycle check: a top-level package, or one of the engine's
    sub-packages or root modules (engine.config, engine.forward_batch, ...). `engine` itself
    re-exports the API, so importing it is importing engine.api."""
    parts = module.split(".")
    if parts[0] != "engine":
        return parts[0]
    return ".".join(parts[:2]) if len(parts) > 1 else "engine"


def package_cycles(imports: list[Import] = IMPORTS) -> list[list[str]]:
    """Cycles between packages, every import counted (lazy and type-only ones too)."""
    ours = {package_of(m) for m in MODULES}
    edges: dict[str, set[str]] = {p: set() for p in ours}
    for imp in imports:
        source, target = package_of(imp.source), package_of(_engine_target(imp.target))
        if target in ours and target != source:
            edges[source].add(target)
    return _strongly_connected(edges)


def _strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(node: str) -> None:  # Tarjan; the graph is small, recursion is fine
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph[node]):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1 or node in graph[node]:
                cycles.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return cycles


def _cycle_lines(cycles: list[list[str]], imports: list[Import]) -> list[str]:
    out = []
    for component in cycles:
        members = set(component)
        for imp in imports:
            if imp.source in members and imp.target in members and not imp.in_function:
                out.append(f"{imp.path}:{imp.line} imports {imp.target} (import cycle: {' <-> '.join(component)})")
    return out


def test_layers() -> None:
    violations = layer_violations()
    assert not violations, "layering violations:\n" + "\n".join(violations)


def test_no_cycles_between_packages() -> None:
    cycles = package_cycles()
    lines = [f"{imp.path}:{imp.line} imports {imp.target} (package cycle: {' <-> '.join(c)})"
             for c in cycles for imp in IMPORTS
             if package_of(imp.source) in c and package_of(_engine_target(imp.target)) in c
             and package_of(imp.source) != package_of(_engine_target(imp.target))]
    assert not cycles, "package cycles:\n" + "\n".join(lines)


def test_no_import_cycles_in_engine() -> None:
    lines = _cycle_lines(import_cycles(), IMPORTS)
    assert not lines, "import cycles:\n" + "\n".join(lines)


def test_the_checker_sees_every_kind_of_import(tmp_path: Path) -> None:
    """The collector finds imports in functions and TYPE_CHECKING blocks, relative ones and
    `torch.cuda` use, and each rule fires on a planted violation."""
    source = (
        "from typing import TYPE_CHECKING\nimport torch\n"
        "from engine.runner import model_runner\n"
        "if TYPE_CHECKING:\n    from engine.core.messages import ReqInput\n"
        "def f():\n    from ..api import engine\n    return torch.cuda.is_available()\n"
    )
    collector = _Collector("engine.scheduler.fake", "engine/scheduler/fake.py", False)
    tree = ast.parse(source)
    collector.visit(tree)
    found = collector.found + [Import("engine/scheduler/fake.py", n, "engine.scheduler.fake", "torch.cuda", False, False)
                               for n in _uses_torch_cuda(tree)]
    targets = {(imp.target, imp.type_only, imp.in_function) for imp in found}
    assert ("engine.runner.model_runner", False, False) in targets
    assert ("engine.core.messages", True, False) in targets
    assert ("engine.api.engine", False, True) in targets
    assert ("torch.cuda", False, False) in targets
    lines = layer_violations(found)
    assert "engine/scheduler/fake.py:3 imports engine.runner.model_runner" in "\n".join(lines)
    assert any(line.startswith("engine/scheduler/fake.py:5 imports engine.core.messages") for line in lines)
    assert any("engine/scheduler/fake.py:7 imports engine.api.engine" in line for line in lines)
    assert any(line.startswith("engine/scheduler/fake.py:8 imports torch.cuda") for line in lines)


def test_the_cycle_check_finds_a_planted_cycle() -> None:
    a = Import("engine/core/a.py", 1, "engine.core.engine_core", "engine.core.control", False, False)
    b = Import("engine/core/b.py", 2, "engine.core.control", "engine.core.engine_core", True, False)
    lazy = Import("engine/core/c.py", 3, "engine.core.control", "engine.core.output", False, True)
    back = Import("engine/core/d.py", 4, "engine.core.output", "engine.core.control", False, False)
    cycles = import_cycles([a, b, lazy, back])
    assert cycles == [["engine.core.control", "engine.core.engine_core"]]  # the lazy import breaks the other
    assert _cycle_lines(cycles, [a, b]) == [
        "engine/core/a.py:1 imports engine.core.control (import cycle: engine.core.control <-> engine.core.engine_core)",
        "engine/core/b.py:2 imports engine.core.engine_core (import cycle: engine.core.control <-> engine.core.engine_core)",
    ]


def test_the_package_cycle_check_counts_lazy_and_type_only_imports() -> None:
    down = Import("engine/models/a.py", 1, "engine.models.decoder", "engine.kernels.rmsnorm", False, False)
    up = Import("engine/kernels/b.py", 2, "engine.kernels.rmsnorm", "engine.models.layers", True, True)
    assert package_cycles([down]) == []
    assert package_cycles([down, up]) == [["engine.kernels", "engine.models"]]
    assert package_of("engine") == "engine" and package_of("engine.config") == "engine.config"
    assert package_of("tandem.rl.loop") == "tandem"
