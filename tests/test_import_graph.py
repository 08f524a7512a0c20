"""The package's import graph, read from the source (every import statement, function-local ones
included): no cycle, the trainer does not reach up into evaluation, and the library core does not
know the toy."""
import ast
from pathlib import Path

import pytest

import rstar2_jax

ROOT = Path(rstar2_jax.__file__).parent
PACKAGE = "rstar2_jax"


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, modules: set[str]) -> list[tuple[str, bool]]:
    """(imported module of this package, whether the import sits inside a function) per import."""
    found = []

    def visit(node: ast.AST, local: bool) -> None:
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            assert not node.level, f"{path}:{node.lineno}: the package uses absolute imports"
            base = node.module
            # `from pkg import sub` imports the submodule pkg.sub when there is one.
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base
                       for a in node.names]
        else:
            targets = []
        for target in targets:
            if target == PACKAGE or target.startswith(PACKAGE + "."):
                # `import a.b.c` of a name that is an attribute, not a module: its module.
                while target not in modules:
                    target = target.rpartition(".")[0]
                found.append((target, local))
        inside = local or isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
        for child in ast.iter_child_nodes(node):
            visit(child, inside)

    visit(ast.parse(path.read_text(), str(path)), False)
    return found


FILES = {_module_name(p): p for p in sorted(ROOT.rglob("*.py"))}
MODULES = set(FILES)
EDGES = {name: _imports(path, MODULES) for name, path in FILES.items()}


def _find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node], _ = 1, path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        state[node], _ = 2, path.pop()
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def _is_under(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def test_the_graph_is_read_from_the_source():
    # The reader finds each kind of import: `from pkg import module`, `from module import name`,
    # and an import inside a function (marked local).
    assert ("rstar2_jax.chat", False) in EDGES["rstar2_jax.sampler.rollout"]
    assert ("rstar2_jax.sampler.engine", False) in EDGES["rstar2_jax.sampler.rollout"]
    assert ("rstar2_jax.toy.demo", True) in EDGES["rstar2_jax.cli"]


def test_module_graph_has_no_cycle():
    graph = {m: {t for t, _ in edges if t != m} for m, edges in EDGES.items()}
    assert _find_cycle(graph) is None, f"import cycle: {' -> '.join(_find_cycle(graph))}"


def _part(module: str) -> str:
    """The module's part of the library: its subpackage (rstar2_jax.train), or itself."""
    parts = module.split(".")
    return ".".join(parts[:2]) if len(parts) > 1 else module


def test_parts_of_the_library_have_no_cycle():
    # Package level: train -> evaluate -> train would be a cycle here even if no two modules
    # imported each other. A package importing its own submodules is not an arrow.
    graph: dict[str, set[str]] = {}
    for module, edges in EDGES.items():
        if module == PACKAGE:
            continue
        graph.setdefault(_part(module), set()).update(
            _part(t) for t, _ in edges if _part(t) != _part(module) and t != PACKAGE)
    assert _find_cycle(graph) is None, f"import cycle: {' -> '.join(_find_cycle(graph))}"


def test_trainer_does_not_import_evaluation():
    arrows = [(m, t) for m, edges in EDGES.items() if _is_under(m, "rstar2_jax.train")
              for t, _ in edges if _is_under(t, "rstar2_jax.evaluate")]
    assert not arrows


@pytest.mark.parametrize("module", sorted(m for m in MODULES if not _is_under(m, "rstar2_jax.toy")))
def test_only_the_cli_knows_the_toy_and_lazily(module):
    toy = [(t, local) for t, local in EDGES[module] if _is_under(t, "rstar2_jax.toy")]
    if module == "rstar2_jax.cli":
        assert toy and all(local for _, local in toy), toy
    else:
        assert not toy
