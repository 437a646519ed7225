"""The layout's rules, which a move can break:

- the top level holds the algorithm's files, the entry points, model.py and config.py, and nothing
  else (TOP); everything else is in a package named for its role (PACKAGES);
- a package imports nothing from the top-level files (the top uses the packages, never the reverse),
  and the sampler's engine/ imports nothing of trainer/ (trainer/policy_sampler.py bridges the two);
- no import cycle among the project's modules. Every import counts, wherever it stands: inside a
  function, under `if TYPE_CHECKING:` or `if __name__ == "__main__":` (a file run as a script
  imports it too);
- no tracked file holds an absolute path of one machine, and none points into the shared folder beside the checkout (a fork
  has neither).
"""
from __future__ import annotations

import ast
import re
import subprocess

from conftest import ROOT

# the algorithm's own files, the entry points, the model and the hyperparameters
TOP = {"train", "rollout", "replay", "stream", "env", "grpo", "reward", "sft", "eval", "sweep", "plot", "model", "config"}
PACKAGES = ("engine", "trainer", "sqltask", "toy")


def project_modules() -> dict[str, ast.Module]:
    mods = {p.stem: ast.parse(p.read_text()) for p in ROOT.glob("*.py")}
    for pkg in PACKAGES:
        mods.update({f"{pkg}.{p.stem}": ast.parse(p.read_text()) for p in (ROOT / pkg).glob("*.py")
                     if p.stem != "__init__"})
    return mods


def imported(name: str, tree: ast.Module, mods: dict) -> set[str]:
    """Project modules `name` imports, at any depth (functions, TYPE_CHECKING, __main__ included)."""
    deps = set()
    package = name.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            deps |= {a.name for a in node.names if a.name in mods}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: inside a package
                base = f"{package}.{base}" if base else package
            for target in (base, *(f"{base}.{a.name}" for a in node.names)):
                if target in mods:
                    deps.add(target)
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


def test_the_checker_sees_a_cycle_and_every_import():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) == []
    tree = ast.parse("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import b\nimport c\n"
                     "def f():\n    import d\nif __name__ == '__main__':\n    import e\n")
    assert imported("a", tree, dict.fromkeys("abcde")) == {"b", "c", "d", "e"}
    tree = ast.parse("from . import x\nfrom .y import z\nfrom other.w import v\n")
    assert imported("pkg.m", tree, dict.fromkeys(["pkg.x", "pkg.y", "other.w"])) == {"pkg.x", "pkg.y", "other.w"}


def test_the_top_level_holds_only_the_algorithm_and_the_entry_points():
    top = {p.stem for p in ROOT.glob("*.py")}
    assert top == TOP, f"not a top-level file: {sorted(top - TOP)}; missing: {sorted(TOP - top)}"
    assert all((ROOT / pkg / "__init__.py").exists() for pkg in PACKAGES)


def test_no_import_cycle():
    graph = import_graph()
    assert {"train", "model", "engine.engine", "trainer.policy_sampler", "sqltask.sandbox", "toy.tiny"} <= set(graph)
    assert graph["train"] >= {"trainer.policy_sampler", "grpo", "rollout"}  # the graph is read, not empty
    assert find_cycle(graph) == [], "import cycle: " + " -> ".join(find_cycle(graph))


def test_packages_import_nothing_from_the_top():
    """The top uses the packages, never the reverse: a package gets what it needs from the top as
    an argument (engine/ the model; toy/tiny.prepare_assets the model class and the gold texts)."""
    for name, deps in import_graph().items():
        if "." in name:
            up = sorted(d for d in deps if "." not in d)
            assert not up, f"{name} imports the top-level {up}"


def test_no_cycle_between_packages():
    """Packages stack too: each imports only packages below it (toy/ -> trainer/, sqltask/; trainer/ ->
    sqltask/, engine/), so a package can be read without the ones above it."""
    graph = {pkg: set() for pkg in PACKAGES}
    for name, deps in import_graph().items():
        if "." in name:
            graph[name.split(".")[0]] |= {d.split(".")[0] for d in deps} - {name.split(".")[0]}
    assert find_cycle(graph) == [], "packages import each other: " + " -> ".join(find_cycle(graph))


def test_engine_does_not_import_the_trainer():
    """engine/ is the sampler: it may use its own files, never the trainer's plumbing nor the bridge."""
    for name, deps in import_graph().items():
        if name.startswith("engine."):
            bad = {d for d in deps if not d.startswith("engine.")}
            assert not bad, f"{name} imports {sorted(bad)}"


SHARED = "../" + "shared"  # the folder beside the checkout that a fork does not have (joined: this file is checked too)
# an absolute path of one machine (a home, a work tree, a mount); /tmp is everyone's
MACHINE_PATH = re.compile(r"(?<![\w.~])/(?:work|home|Users|root|mnt|scratch)/[\w.-]")


def tracked_text_files() -> list:
    names = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    out = []
    for name in names:
        path = ROOT / name
        try:
            out.append((name, path.read_text()))
        except (UnicodeDecodeError, FileNotFoundError, IsADirectoryError):
            continue  # binary, or deleted in the work tree
    return out


def test_the_checker_sees_a_machine_path():
    # made-up checkouts, joined at run time: no tracked file (this one included) spells a real path
    root = "/"
    assert MACHINE_PATH.search(f"run from {root}work/ann/grpo-sql/.venv") and MACHINE_PATH.search(f"{root}home/ann/x")
    assert not MACHINE_PATH.search("runs/work/x") and not MACHINE_PATH.search("/tmp/v/bin/pip")


def test_no_machine_paths_and_nothing_points_into_shared():
    files = tracked_text_files()
    assert len(files) > 100
    bad = [f"{name}:{text[:m.start()].count(chr(10)) + 1}" for name, text in files
           for m in MACHINE_PATH.finditer(text)]
    assert not bad, f"absolute machine paths: {bad}"
    shared = [name for name, text in files if SHARED in text]
    assert not shared, f"pointing into {SHARED} (a fork has none; state the fact where it is used): {shared}"
