"""The product does not lean on its test rig: no module of ``kernel/`` imports
``harness/``, and no import circle runs through the two packages.

Read from the source with ``ast`` (every import, also those inside functions,
which a run would only reach on some paths), so nothing is executed."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("kernel", "harness")


def _modules(package: str) -> dict[str, Path]:
  out = {}
  for path in sorted((ROOT / package).rglob("*.py")):
    parts = path.relative_to(ROOT).with_suffix("").parts
    out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
  return out


def imports_of(path: Path, known: set[str]) -> set[str]:
  """The modules of ``known`` (or their packages) that ``path`` imports."""
  found = set()
  for node in ast.walk(ast.parse(path.read_text(), str(path))):
    if isinstance(node, ast.Import):
      names = [a.name for a in node.names]
    elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
      # ``from kernel import api`` imports the module kernel.api when it is one.
      names = [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in known
               else node.module for a in node.names]
    else:
      continue
    for name in names:
      parts = name.split(".")
      for i in range(len(parts), 0, -1):
        if ".".join(parts[:i]) in known:
          found.add(".".join(parts[:i]))
          break
  return found


def import_graph() -> dict[str, set[str]]:
  modules = {}
  for package in PACKAGES:
    modules.update(_modules(package))
  known = set(modules)
  return {name: imports_of(path, known) - {name} for name, path in modules.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
  """Strongly connected components with more than one module (Tarjan)."""
  index, low, stack, on_stack, out = {}, {}, [], set(), []

  def visit(v):
    index[v] = low[v] = len(index)
    stack.append(v)
    on_stack.add(v)
    for w in sorted(graph.get(v, ())):
      if w not in index:
        visit(w)
        low[v] = min(low[v], low[w])
      elif w in on_stack:
        low[v] = min(low[v], index[w])
    if low[v] == index[v]:
      component = []
      while True:
        w = stack.pop()
        on_stack.discard(w)
        component.append(w)
        if w == v:
          break
      if len(component) > 1:
        out.append(sorted(component))

  for v in sorted(graph):
    if v not in index:
      visit(v)
  return out


def test_kernel_imports_nothing_from_harness():
  graph = import_graph()
  offenders = {m: sorted(d for d in deps if d.split(".")[0] == "harness")
               for m, deps in graph.items() if m.split(".")[0] == "kernel"}
  offenders = {m: d for m, d in offenders.items() if d}
  assert not offenders, f"kernel modules importing the harness: {offenders}"


def test_no_import_circle_between_kernel_and_harness():
  """Package level (kernel -> harness and back) and module level."""
  graph = import_graph()
  crossing = {(m.split(".")[0], d.split(".")[0]) for m, deps in graph.items() for d in deps}
  assert not {("kernel", "harness"), ("harness", "kernel")} <= crossing
  found = cycles(graph)
  assert not found, f"import circles: {found}"


def test_the_walk_sees_imports_inside_functions(tmp_path):
  """A lazy import is an import: the walk must not miss one."""
  source = tmp_path / "m.py"
  source.write_text("def f():\n  from harness.tools.bench import time_fns\n  import kernel.tiling.plan\n")
  assert imports_of(source, {"harness", "harness.tools.bench", "kernel", "kernel.tiling.plan"}) == {
      "harness.tools.bench", "kernel.tiling.plan"}
  assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
