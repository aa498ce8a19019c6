"""The package's layers: imports only go down, and no import cycle exists (lazy imports included).

Read statically from the source (every `import` statement, at any depth), so an import inside a
function counts as much as one at the top of a module.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "fgrpo_kernels"
PACKAGE = "fgrpo_kernels"

# Dependency order, bottom first (docs/architecture.md draws it). A module's layer is that of the
# longest entry that prefixes its dotted name below the package ("core.options" before "core").
LAYERS = [
    ("core", "core.validation", "core.divergences", "divergences", "core.policy_terms"),
    ("core.options",),
    ("core.grpo_math", "core.kl_estimators", "core.rollout_sources", "core.rollout_correction"),
    ("core.reference", "reference"),
    (
        "core.policy_variants",
        "core.policy_variants_verl",
        "core.policy_variants_verl_pg",
        "core.policy_m2po",
    ),
    ("backends.memory", "backends.phases"),
    ("backends", "distributed"),
    ("head.autograd", "head.options"),
    ("head", "logprobs", "losses.epilogue", "losses.metrics", "losses.single_pass"),
    ("losses", "losses_preference"),
    ("testing", "integrations", "trainer"),
    ("benchmarks", "cli", ""),
]


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in sorted(ROOT.rglob("*.py"))}


def _resolve(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    if node.level == 0:
        return node.module or ""
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _imports(module: str, path: Path, known: set[str]) -> set[str]:
    """Package modules that `module` imports anywhere in its source."""
    out = set()
    is_package = path.name == "__init__.py"
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = _resolve(module, is_package, node)
            targets = [
                f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names
            ]
        else:
            continue
        for target in targets:
            while target and target not in known:
                target = target.rpartition(".")[0]
            if target.startswith(PACKAGE) and target != module:
                out.add(target)
    return out


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    known = set(modules)
    return {name: _imports(name, path, known) for name, path in modules.items()}


def _rank(module: str) -> int:
    name = module[len(PACKAGE) + 1 :] if module != PACKAGE else ""
    best = None
    for rank, layer in enumerate(LAYERS):
        for entry in layer:
            covers = name == entry or name.startswith(entry + ".") or (entry == "" and not name)
            if covers and (best is None or len(entry) > len(best[1])):
                best = (rank, entry)
    if best is None:
        raise AssertionError(f"{module}: not in any layer of tests/test_architecture.py")
    return best[0]


def test_every_module_has_a_layer():
    for module in _graph():
        _rank(module)


def test_imports_only_go_down():
    upward = [
        f"{src} (layer {_rank(src)}) imports {dst} (layer {_rank(dst)})"
        for src, targets in _graph().items()
        for dst in targets
        if _rank(dst) > _rank(src)
    ]
    assert not upward, "\n".join(upward)


def test_no_import_cycle():
    graph = _graph()
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node):
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                cycle = stack[stack.index(nxt) :] + [nxt]
                pytest.fail("import cycle: " + " -> ".join(cycle))
            if nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node)


def test_the_checker_sees_lazy_imports_and_cycles(tmp_path):
    """The reader itself: an import inside a function is an edge, and a two-module cycle is
    reported (so the two tests above can fail)."""
    src = "def f():\n    from . import b\n"
    node = ast.parse(src).body[0].body[0]
    assert _resolve(f"{PACKAGE}.a", False, node) == PACKAGE
    path = tmp_path / "a.py"
    path.write_text(src)
    assert _imports(f"{PACKAGE}.a", path, {PACKAGE, f"{PACKAGE}.a", f"{PACKAGE}.b"}) == {
        f"{PACKAGE}.b"
    }
