"""The import graph of laplace_jax, train and serve, read with `ast` (no module is imported): no cycle, the
library imports neither program, and the two programs never import each other.

Every import statement counts, those inside functions too; only those under `if TYPE_CHECKING:` (never run)
do not.
"""

from __future__ import annotations

import ast
import functools
import pathlib

import helpers

ROOT = helpers.ROOT
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
  assert (
    "laplace_jax.model" in graph["laplace_jax.training.train_step"]
  )  # a known edge, so the parser reads imports


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


# The tiers, lowest first: a module imports only from its own folder or from folders of lower tiers (siblings
# in one tier do not import each other). Package __init__ files (facades) and the deprecated aliases at the
# library's root are above every tier.
TIERS = (
  ("laplace_jax.array_types", "laplace_jax.param_names"),  # imports nothing: beneath everything
  ("laplace_jax.platform", "laplace_jax.cli"),  # the root, in three floors
  ("laplace_jax.sharding",),
  ("laplace_jax.fsdp",),
  ("laplace_jax.analysis", "laplace_jax.data"),
  ("laplace_jax.ops",),
  ("laplace_jax.model",),
  ("laplace_jax.inference", "laplace_jax.training"),
  ("serve.files",),
  ("serve.slots",),
  ("serve.engine",),
  ("serve.api",),
  ("serve.__main__",),
)
FACADES = {"laplace_jax", "laplace_jax.gla", "laplace_jax.config", "laplace_jax.generate"}
FACADES |= {"laplace_jax.checkpoint", "laplace_jax.tokenizer", "laplace_jax.muon", "laplace_jax.state"}


def _tier(module: str) -> tuple[int, str] | None:
  """(tier index, the tier entry it falls under) for a module of laplace_jax or serve; None for train and the
  facades."""
  for i, entries in enumerate(TIERS):
    for entry in entries:
      if module == entry or module.startswith(entry + "."):
        return i, entry
  return None


def test_every_library_and_serve_module_has_a_tier():
  untiered = [m for m in import_graph() if _top(m) in ("laplace_jax", "serve") and _tier(m) is None]
  assert sorted(untiered) == sorted(FACADES | {"serve"}), untiered


def test_tiers_import_only_downward():
  graph = import_graph()
  bad = []
  for a, deps in graph.items():
    ta = _tier(a)
    if ta is None:
      continue
    for b in deps:
      tb = _tier(b)
      if tb is None and _top(b) == _top(a):
        bad.append(f"{a} -> {b} (a facade)")
      elif tb is not None and tb[1] != ta[1] and tb[0] >= ta[0]:
        bad.append(f"{a} -> {b}")
  assert not bad, "imports that run up or sideways between tiers:\n" + "\n".join(sorted(bad))


def _folders():
  for pkg in PACKAGES + ("tests",):
    for folder in [ROOT / pkg, *sorted(p for p in (ROOT / pkg).rglob("*") if p.is_dir())]:
      modules = [p.name for p in folder.glob("*.py") if p.name != "__init__.py"]
      if modules and "__pycache__" not in folder.parts:
        yield folder.relative_to(ROOT), modules


def test_no_folder_holds_more_than_15_modules():
  crowded = {str(f): len(m) for f, m in _folders() if len(m) > 15}
  assert not crowded, f"folders of more than 15 modules: {crowded}"


def test_no_two_modules_share_a_name_across_folders():
  """A module's name says which it is: the same file name in two folders (the deprecated aliases and the
  command-line entry points aside) is one a reader could confuse."""
  seen: dict[str, list[str]] = {}
  for folder, modules in _folders():
    for name in modules:
      seen.setdefault(name, []).append(str(folder))
  allowed = {"__main__.py", "conftest.py"} | {f"{m.rpartition('.')[2]}.py" for m in FACADES - {"laplace_jax"}}
  shared = {n: f for n, f in seen.items() if len(f) > 1 and n not in allowed}
  assert not shared, shared


def _private_uses(path: pathlib.Path, known: set[str]) -> list[str]:
  """`from m import _x` and `m._x` where m is another module of the project."""
  tree = ast.parse(path.read_text(), str(path))
  bound, out = {}, []
  for node in ast.walk(tree):
    if isinstance(node, ast.ImportFrom) and node.module and not node.level:
      for a in node.names:
        if f"{node.module}.{a.name}" in known:
          bound[a.asname or a.name] = f"{node.module}.{a.name}"
        elif node.module in known and a.name.startswith("_") and not a.name.startswith("__"):
          out.append(f"{path.relative_to(ROOT)}:{node.lineno} imports {node.module}.{a.name}")
    elif isinstance(node, ast.Import):
      bound.update({a.asname: a.name for a in node.names if a.asname and a.name in known})
  for node in ast.walk(tree):
    if (
      isinstance(node, ast.Attribute)
      and node.attr.startswith("_")
      and not node.attr.startswith("__")
      and isinstance(node.value, ast.Name)
      and node.value.id in bound
    ):
      out.append(f"{path.relative_to(ROOT)}:{node.lineno} reads {bound[node.value.id]}.{node.attr}")
  return out


def test_no_private_name_crosses_modules():
  """The library, the programs and the benchmarks use only each other's public names (tests may reach into
  the module they test)."""
  known = set(_modules())
  files = [p for pkg in PACKAGES + ("benchmarks",) for p in sorted((ROOT / pkg).rglob("*.py"))]
  crossings = [use for p in files for use in _private_uses(p, known)]
  assert not crossings, "\n".join(crossings)


MAX_FUNCTION_LINES, MAX_CLASS_LINES = 80, 450


def _oversized(path: pathlib.Path) -> list[str]:
  out = []

  def visit(node, prefix):
    for child in ast.iter_child_nodes(node):
      if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        name = f"{prefix}{child.name}"
        limit = MAX_CLASS_LINES if isinstance(child, ast.ClassDef) else MAX_FUNCTION_LINES
        if child.end_lineno - child.lineno + 1 > limit:
          out.append(f"{path.relative_to(ROOT)}:{name}")
        visit(child, name + ".")

  visit(ast.parse(path.read_text(), str(path)), "")
  return out


def test_no_function_over_80_lines_or_class_over_450():
  found = [o for pkg in PACKAGES for p in sorted((ROOT / pkg).rglob("*.py")) for o in _oversized(p)]
  assert not found, f"over {MAX_FUNCTION_LINES} lines (functions) or {MAX_CLASS_LINES} (classes): {found}"
