"""Code a reader can hold: no function of ``kernel/`` or ``harness/`` over
80 lines, from its ``def`` to its last line (decorators not counted; a
method or a nested function counts on its own, and within the function
around it), and no file there over 800 lines
(docs/decisions/proof-engine-files.md).  A longer one is split into
functions named for the roles they play (parse, plan, run, report; one
checker per argument group; a launch's specs and its call)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("kernel", "harness")
MAX_FUNCTION_LINES = 80
MAX_FILE_LINES = 800


def long_functions(source: str, where: str, limit: int = MAX_FUNCTION_LINES) -> list[str]:
  """``where:line: name (n lines)`` for each function of ``source`` over
  ``limit`` lines, methods and nested functions included."""
  out = []
  for node in ast.walk(ast.parse(source)):
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
      lines = node.end_lineno - node.lineno + 1
      if lines > limit:
        out.append(f"{where}:{node.lineno}: {node.name} ({lines} lines)")
  return out


def oversized(root: Path) -> list[str]:
  """Every function over MAX_FUNCTION_LINES and every file over
  MAX_FILE_LINES in the Python files of ``root``'s kernel/ and harness/."""
  out = []
  for package in PACKAGES:
    for path in sorted((root / package).rglob("*.py")):
      where, source = path.relative_to(root).as_posix(), path.read_text()
      lines = len(source.splitlines())
      if lines > MAX_FILE_LINES:
        out.append(f"{where}: the file ({lines} lines)")
      out += long_functions(source, where)
  return out


def test_no_function_over_80_lines_and_no_file_over_800():
  """Every function of kernel/ and harness/ fits in 80 lines, every file in 800."""
  found = oversized(ROOT)
  assert not found, (f"over {MAX_FUNCTION_LINES} lines (a function) or {MAX_FILE_LINES} "
                     f"(a file); split them by role:\n" + "\n".join(found))


def _function(name: str, lines: int, indent: str = "") -> str:
  """A function of exactly ``lines`` lines, its def included."""
  body = [f"{indent}  x{i} = {i}" for i in range(lines - 2)]
  return "\n".join([f"{indent}def {name}():", *body, f"{indent}  return x0"])


def test_the_check_names_each_long_function_and_file(tmp_path):
  """A generated tree: a top-level function, a method and a nested function
  one line over the limit are named with their lines (and the function
  around the nested one, which holds its lines); one at the limit is not; a
  file one line over 800 is named, one of 800 is not, and a file outside
  kernel/ and harness/ is not read."""
  method = "class Holder:\n" + _function("long_method", 81, "  ")
  host = "def host():\n" + _function("long_nested", 81, "  ") + "\n  return long_nested"
  module = "\n\n\n".join([_function("at_the_limit", 80), _function("too_long", 81), method,
                          host]) + "\n"
  (tmp_path / "kernel").mkdir()
  (tmp_path / "kernel" / "roles.py").write_text(module)
  (tmp_path / "harness" / "tools").mkdir(parents=True)
  (tmp_path / "harness" / "tools" / "at_800.py").write_text("x = 0\n" * 800)
  (tmp_path / "harness" / "tools" / "over_800.py").write_text("x = 0\n" * 801)
  (tmp_path / "docs").mkdir()
  (tmp_path / "docs" / "elsewhere.py").write_text(_function("not_read", 200) + "\n")
  line = {text.strip(): i + 1 for i, text in enumerate(module.splitlines())}
  assert oversized(tmp_path) == [
      f"kernel/roles.py:{line['def too_long():']}: too_long (81 lines)",
      f"kernel/roles.py:{line['def host():']}: host (83 lines)",
      f"kernel/roles.py:{line['def long_method():']}: long_method (81 lines)",
      f"kernel/roles.py:{line['def long_nested():']}: long_nested (81 lines)",
      "harness/tools/over_800.py: the file (801 lines)",
  ]
