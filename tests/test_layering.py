"""The import graph of laplace_jax, train and serve, read with `ast` (no module is imported): no cycle, the
library imports neither program, and the two programs never import each other.

Every import statement counts, those inside functions too; only those under `if TYPE_CHECKING:` (never run)
do not.
"""

from __future__ import annotations

import ast
import functools
import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGES = ("laplace_jax", "train", "serve")


def _module_name(path: pathlib.Path) -> str:
  parts = list(path.relative_to(ROOT).with_suffix("").parts)
  if parts[-1] == "__init__":
    parts.pop()
  return ".".join(parts)


def _modules() -> dict[str, pathlib.Path]:
  return {_module_name(p): p for pkg in PACKAGES for p in sorted((ROOT / pkg).rglob("*.py"))}


def _is_type_checking(test: ast.expr) -> bool:
  return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
    isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
  )


def _import_nodes(tree: ast.AST):
  """Every Import / ImportFrom in the tree, in functions too, except the bodies of `if TYPE_CHECKING:`."""
  for node in ast.iter_child_nodes(tree):
    if isinstance(node, (ast.Import, ast.ImportFrom)):
      yield node
    if isinstance(node, ast.If) and _is_type_checking(node.test):
      for child in node.orelse:
        yield from _import_nodes(ast.Module(body=[child], type_ignores=[]))
      continue
    yield from _import_nodes(node)


def _imports(name: str, path: pathlib.Path, known: set[str]) -> set[str]:
  """The modules among `known` that module `name` imports. `from pkg import sub` counts as importing pkg.sub
  when that is a module, else pkg."""
  package = name if path.name == "__init__.py" else name.rpartition(".")[0]
  out = set()
  for node in _import_nodes(ast.parse(path.read_text(), str(path))):
    if isinstance(node, ast.Import):
      targets = [a.name for a in node.names]
    else:
      base = node.module or ""
      if node.level:
        anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
        base = ".".join(anchor + ([base] if base else []))
      targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
    out |= {t for t in targets if t in known and t != name}
  return out


@functools.cache  # one parse of the tree for every test here
def import_graph() -> dict[str, frozenset[str]]:
  modules = _modules()
  known = set(modules)
  return {name: frozenset(_imports(name, path, known)) for name, path in modules.items()}


def find_cycle(graph) -> list[str] | None:
  """One cycle as [m0, m1, ..., m0], or None (iterative depth-first search, deterministic order)."""
  state: dict[str, int] = {}  # 1: on the current path, 2: done
  for start in sorted(graph):
    if state.get(start):
      continue
    path = [start]
    stack = [iter(sorted(graph[start]))]
    state[start] = 1
    while stack:
      nxt = next(stack[-1], None)
      if nxt is None:
        state[path.pop()] = 2
        stack.pop()
      elif state.get(nxt) == 1:
        return path[path.index(nxt) :] + [nxt]
      elif not state.get(nxt):
        state[nxt] = 1
        path.append(nxt)
        stack.append(iter(sorted(graph[nxt])))
  return None


def _top(module: str) -> str:
  return module.partition(".")[0]


def _crossings(graph, src: str, dst: str) -> list[str]:
  return sorted(f"{a} -> {b}" for a, deps in graph.items() for b in deps if _top(a) == src and _top(b) == dst)


def test_graph_sees_every_package():
  graph = import_graph()
  assert {_top(m) for m in graph} == set(PACKAGES)
  assert "laplace_jax.model" in graph["laplace_jax.train_step"]  # a known edge, so the parser reads imports


def test_no_import_cycle():
  cycle = find_cycle(import_graph())
  assert cycle is None, f"import cycle: {' -> '.join(cycle)}"


def test_library_imports_no_program():
  graph = import_graph()
  bad = _crossings(graph, "laplace_jax", "train") + _crossings(graph, "laplace_jax", "serve")
  assert not bad, f"laplace_jax must import neither train nor serve: {bad}"


def test_programs_do_not_import_each_other():
  graph = import_graph()
  bad = _crossings(graph, "train", "serve") + _crossings(graph, "serve", "train")
  assert not bad, f"train and serve must not import each other: {bad}"


def test_find_cycle_reports_the_cycle():
  assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
  assert find_cycle({"a": {"b"}, "b": set()}) is None
