"""The kernel package with some of its files' sources replaced, loaded beside
the shipped one: what the proof traces to refute a protocol mutant.

Only the edited modules and the kernel modules that import them (directly or
through others) are executed afresh, so every other module, and the classes
it defines (``Config``, the plans), is the one the caller already holds.
The fresh modules are left out of ``sys.modules`` afterwards: importing
``kernel`` later still gives the shipped package.  An edited file is
compiled under a name of its own (``kernel/forward/mainloop.mutant_<tag>.py``),
registered with ``linecache``, so a trace prints the edited lines.
"""

from __future__ import annotations

import ast
import importlib
import importlib.abc
import importlib.util
import linecache
import os
import sys
import types

KERNEL_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))), "kernel")


def module_name(relpath: str) -> str:
  """``kernel.forward.mainloop`` for ``forward/mainloop.py`` (relative to kernel/)."""
  stem = relpath[:-3].replace(os.sep, "/")
  parts = ["kernel", *stem.split("/")]
  if parts[-1] == "__init__":
    parts.pop()
  return ".".join(parts)


def _kernel_modules() -> dict[str, str]:
  """{module name: path} of every module of the kernel package on disk."""
  out = {}
  for root, _, files in os.walk(KERNEL_DIR):
    for f in files:
      if f.endswith(".py"):
        path = os.path.join(root, f)
        out[module_name(os.path.relpath(path, KERNEL_DIR))] = path
  return out


def _imports(path: str, modules: dict[str, str]) -> set[str]:
  """The kernel modules a file imports at its top level (what it binds when executed)."""
  tree = ast.parse(open(path).read())
  out = set()
  for node in tree.body:
    if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("kernel"):
      out.add(node.module)
      out |= {f"{node.module}.{a.name}" for a in node.names} & modules.keys()
    elif isinstance(node, ast.Import):
      out |= {a.name for a in node.names if a.name.startswith("kernel")}
  return out & modules.keys()


def dependents(edited: set[str]) -> set[str]:
  """``edited`` and every kernel module that imports one of them, transitively,
  and the packages whose ``__init__`` does."""
  modules = _kernel_modules()
  imports = {m: _imports(p, modules) for m, p in modules.items()}
  out = set(edited)
  grew = True
  while grew:
    grew = False
    for m, deps in imports.items():
      if m not in out and deps & out:
        out.add(m)
        grew = True
  return out


class _EditedSource(importlib.abc.MetaPathFinder, importlib.abc.Loader):
  """Finds the edited modules and executes their edited text."""

  def __init__(self, texts: dict[str, tuple[str, str]]):
    self.texts = texts   # module name -> (source, file name it is compiled under)

  def find_spec(self, fullname, path, target=None):
    if fullname not in self.texts:
      return None
    return importlib.util.spec_from_loader(fullname, self, origin=self.texts[fullname][1])

  def create_module(self, spec):
    return None

  def exec_module(self, module):
    text, filename = self.texts[module.__name__]
    module.__file__ = filename
    exec(compile(text, filename, "exec"), module.__dict__)  # noqa: S102 -- the kernel's own source


def load(edits: dict[str, str], tag: str, want: tuple[str, ...]) -> types.SimpleNamespace:
  """The modules ``want`` (names, e.g. ``kernel.forward``) of the kernel
  package with the files of ``edits`` ({path relative to kernel/: source})
  replaced; each edited file compiled as ``<file>.mutant_<tag>.py``."""
  texts = {}
  for relpath, text in edits.items():
    filename = os.path.join(KERNEL_DIR, f"{relpath[:-3]}.mutant_{tag}.py")
    linecache.cache[filename] = (len(text), None, text.splitlines(keepends=True), filename)
    texts[module_name(relpath)] = (text, filename)
  fresh = dependents(set(texts))
  for name in sorted(fresh | set(want)):  # the shipped modules, imported before any is set aside
    importlib.import_module(name)
  saved = {name: sys.modules.pop(name) for name in fresh}
  # `from kernel.sync import ring` reads the package's attribute first: hide
  # the shipped submodule there, so that the import runs afresh.
  hidden = {}
  for name in fresh:
    parent, _, leaf = name.rpartition(".")
    holder = sys.modules.get(parent)
    if holder is not None and parent not in fresh and hasattr(holder, leaf):
      hidden[(parent, leaf)] = getattr(holder, leaf)
      delattr(holder, leaf)
  finder = _EditedSource(texts)
  sys.meta_path.insert(0, finder)
  try:
    got = {name: importlib.import_module(name) for name in want}
  finally:
    sys.meta_path.remove(finder)
    for name in fresh:
      sys.modules.pop(name, None)
    sys.modules.update(saved)
    for (parent, leaf), module in hidden.items():
      setattr(sys.modules[parent], leaf, module)
  return types.SimpleNamespace(**{name.rpartition(".")[2]: m for name, m in got.items()})
