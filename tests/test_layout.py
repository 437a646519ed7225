"""The layout's rules that a move can break: no import cycle among the project's modules, and the
sampler's engine/ package never imports the trainer above it (trainer/policy_sampler.py bridges the two).

Imports under `if TYPE_CHECKING:` (annotations only) and under `if __name__ == "__main__":` (a
file run as a script) are not edges: neither runs when the module is imported.
"""
from __future__ import annotations

import ast

from conftest import ROOT


PACKAGES = ("engine", "trainer", "sqltask", "toy")


def project_modules() -> dict[str, ast.Module]:
    mods = {p.stem: ast.parse(p.read_text()) for p in ROOT.glob("*.py")}
    for pkg in PACKAGES:
        mods.update({f"{pkg}.{p.stem}": ast.parse(p.read_text()) for p in (ROOT / pkg).glob("*.py")
                     if p.stem != "__init__"})
    return mods


def skipped_block(node: ast.AST) -> bool:
    """`if TYPE_CHECKING:` or `if __name__ == "__main__":`."""
    if not isinstance(node, ast.If):
        return False
    test = ast.unparse(node.test)
    return test in ("TYPE_CHECKING", "typing.TYPE_CHECKING") or "__name__" in test


def imported(name: str, tree: ast.Module, mods: dict) -> set[str]:
    """Project modules `name` imports when it is imported (at any depth but the skipped blocks)."""
    deps, todo = set(), list(tree.body)
    package = name.rpartition(".")[0]
    while todo:
        node = todo.pop()
        if skipped_block(node):
            todo += node.orelse
            continue
        if isinstance(node, ast.Import):
            deps |= {a.name for a in node.names if a.name in mods}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: inside a package
                base = f"{package}.{base}" if base else package
            for target in (base, *(f"{base}.{a.name}" for a in node.names)):
                if target in mods:
                    deps.add(target)
        todo += list(ast.iter_child_nodes(node))
    return deps - {name}


def import_graph() -> dict[str, set[str]]:
    mods = project_modules()
    return {name: imported(name, tree, mods) for name, tree in mods.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str]:
    state, stack = {}, []

    def visit(u):
        state[u] = "open"
        stack.append(u)
        for v in sorted(graph[u]):
            if state.get(v) == "open":
                return stack[stack.index(v):] + [v]
            if v not in state and (found := visit(v)):
                return found
        stack.pop()
        state[u] = "done"
        return []

    for m in sorted(graph):
        if m not in state and (found := visit(m)):
            return found
    return []


def test_the_checker_sees_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) == []
    tree = ast.parse("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import b\nimport c\n"
                     "def f():\n    import d\nif __name__ == '__main__':\n    import e\n")
    assert imported("a", tree, dict.fromkeys("abcde")) == {"c", "d"}


def test_no_import_cycle():
    graph = import_graph()
    assert {"train", "model", "engine.engine", "trainer.policy_sampler"} <= set(graph)
    assert graph["train"] >= {"trainer.policy_sampler", "grpo", "rollout"}  # the graph is read, not empty
    assert find_cycle(graph) == [], "import cycle: " + " -> ".join(find_cycle(graph))


def test_engine_does_not_import_the_trainer():
    """engine/ is the sampler: it may use the model, its attention and the tool, never the trainer
    (train, grpo, the update, SFT, checkpoints, FSDP) nor the bridge that wraps it."""
    graph = import_graph()
    for name, deps in graph.items():
        if name.startswith("engine."):
            bad = {d for d in deps if d.startswith("trainer.") or d in ("train", "grpo", "sft", "eval")}
            assert not bad, f"{name} imports {sorted(bad)}"
