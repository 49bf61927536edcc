"""One import direction: the CLI sits on top, nothing below imports it, and no module of the
package reaches itself through its imports (function-level imports included)."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "megatron_rlhf"
# `python -m megatron_rlhf.<job>` shims: entry points above the CLI, imported by nothing.
ENTRY_SHIMS = {"megatron_rlhf.sft", "megatron_rlhf.train_rm", "megatron_rlhf.ppo"}


def import_graph() -> dict[str, set[str]]:
    modules = {}
    for path in PACKAGE.rglob("*.py"):
        name = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        modules[name.removesuffix(".__init__")] = path
    graph = {name: set() for name in modules}
    for name, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                continue
            graph[name].update(t for t in targets if t in modules and t != name)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(node):
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for succ in graph[node]:
            if succ not in index:
                visit(succ)
                low[node] = min(low[node], low[succ])
            elif succ in on_stack:
                low[node] = min(low[node], index[succ])
        if low[node] == index[node]:
            component = []
            while not component or component[-1] != node:
                component.append(stack.pop())
                on_stack.discard(component[-1])
            if len(component) > 1:
                found.append(sorted(component))

    for node in graph:
        if node not in index:
            visit(node)
    return found


def test_no_import_cycles():
    graph = import_graph()
    assert len(graph) > 40  # the walk found the package
    assert cycles(graph) == []


def test_cycle_finder_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_nothing_below_the_cli_imports_it():
    graph = import_graph()
    importers = {name for name, deps in graph.items() if "megatron_rlhf.cli" in deps}
    assert importers <= ENTRY_SHIMS, importers - ENTRY_SHIMS


ARCHITECTURE = PACKAGE.parent / "docs" / "architecture.md"


def allowed_imports() -> dict[str, set[str]]:
    """docs/architecture.md's "Allowed imports" list: ``- `unit`: `a`, `b``` per line."""
    import re

    text = ARCHITECTURE.read_text().split("## Allowed imports", 1)[1].split("\n## ", 1)[0]
    allowed = {}
    for line in text.splitlines():
        if not line.startswith("- `"):
            continue
        units, _, deps = line[2:].partition(":")
        for unit in re.findall(r"`(\w+)`", units):
            allowed[unit] = set(re.findall(r"`(\w+)`", deps))
    return allowed


def unit_of(module: str) -> str:
    """A module's folder (or top-level module) under the package."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def layering_violations(graph: dict[str, set[str]], allowed: dict[str, set[str]]) -> list[str]:
    found = []
    for module, targets in sorted(graph.items()):
        here = unit_of(module)
        for target in sorted(targets):
            there = unit_of(target)
            if there != here and there not in allowed.get(here, set()):
                found.append(f"{module} imports {target}: {here} may not import {there}")
    return found


def test_folders_import_only_what_docs_architecture_allows():
    graph, allowed = import_graph(), allowed_imports()
    units = {unit_of(m) for m in graph} - {"__init__"}
    assert units <= set(allowed), f"not in docs/architecture.md: {sorted(units - set(allowed))}"
    assert layering_violations(graph, allowed) == []
    # The allowed list itself has no cycle between folders.
    assert cycles({u: allowed[u] & set(allowed) for u in allowed}) == []


def test_a_forbidden_import_is_reported():
    graph, allowed = import_graph(), allowed_imports()
    graph["megatron_rlhf.checkpoint.train_ckpt"] = graph["megatron_rlhf.checkpoint.train_ckpt"] | {
        "megatron_rlhf.trainers.engine"}
    assert layering_violations(graph, allowed) == [
        "megatron_rlhf.checkpoint.train_ckpt imports megatron_rlhf.trainers.engine: "
        "checkpoint may not import trainers"]
