"""Prose that stays true: every ``kernel/…`` or ``harness/…`` path and every
dotted ``kernel.…`` or ``harness.…`` name that a docstring, a comment or a
page names resolves: the file or folder exists, the module imports and
each attribute after it is there (a dataclass field counts).  Decision
records (docs/decisions/) and gate records (docs/gate/'s dated files) are
history, true of the commit they name, and are not read.  A name followed
by ``<`` or ``{`` is a template (``kernel/<file>.py``), not a reference."""

from __future__ import annotations

import ast
import dataclasses
import importlib
import io
import re
import tokenize
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SOURCES = ("kernel/**/*.py", "harness/**/*.py", "properties/**/*.py")
PAGES = ("*.md", "docs/*.md", "docs/gate/README.md", "docs/*/performance.md", "ci/**/*.md",
         "properties/**/*.md", "golden/**/*.md")
# A reference, greedy (templates' <...> and {...} taken in, then left out).
PATH = re.compile(r"(?<![\w./-])((?:kernel|harness)/[\w/.<>{}-]*)")
DOTTED = re.compile(r"(?<![\w./-])((?:kernel|harness)(?:\.[\w<>{}]+)+)")
TEMPLATE = re.compile(r"[<>{}]")


def prose(path: Path) -> str:
  """A page's text; a Python file's comments and docstrings."""
  text = path.read_text()
  return prose_of_source(text) if path.suffix == ".py" else text


def prose_of_source(text: str) -> str:
  """The comments and docstrings of Python source ``text``."""
  out = [tok.string for tok in tokenize.generate_tokens(io.StringIO(text).readline)
         if tok.type == tokenize.COMMENT]
  for node in ast.walk(ast.parse(text)):
    if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
      doc = ast.get_docstring(node, clean=False)
      if doc:
        out.append(doc)
  return "\n".join(out)


def resolves(name: str) -> bool:
  """Whether the dotted ``name`` is a module, or a module's attribute chain."""
  parts = name.split(".")
  for i in range(len(parts), 0, -1):
    try:
      obj = importlib.import_module(".".join(parts[:i]))
    except ImportError:
      continue
    for attr in parts[i:]:
      if obj is not None and hasattr(obj, attr):
        obj = getattr(obj, attr)
      elif dataclasses.is_dataclass(obj) and attr in {f.name for f in dataclasses.fields(obj)}:
        obj = None   # a field without a default: no class attribute, and nothing past it
      else:
        return False
    return True
  return False


def stale(text: str) -> list[str]:
  """The references of ``text`` that do not resolve."""
  out = []
  for m in PATH.finditer(text):
    path = m.group(1).rstrip(".-")
    if not TEMPLATE.search(path) and not (ROOT / path).exists():
      out.append(path)
  for m in DOTTED.finditer(text):
    name = m.group(1).rstrip(".")
    if not TEMPLATE.search(name) and not name.endswith((".py", ".md")) and not resolves(name):
      out.append(name)
  return out


def _files():
  for pattern in SOURCES + PAGES:
    for path in sorted(ROOT.glob(pattern)):
      if ".tox" not in path.parts and "decisions" not in path.parts:
        yield path


def test_every_reference_in_prose_resolves():
  bad = {f"{path.relative_to(ROOT)}: {ref}" for path in dict.fromkeys(_files())
         for ref in stale(prose(path))}
  assert not bad, "names that no longer point anywhere:\n" + "\n".join(sorted(bad))


@pytest.mark.parametrize("text", [
    "the launch kinds of kernel/backward.py",            # a file split into a folder
    "see kernel.schedule.SplitTail",                      # a module moved
    "kernel.tiling.schedule.SplitTail.tabel",             # an attribute misspelt
    "harness/proofs/prove_extracted.py's main"])          # a file renamed
def test_a_stale_reference_is_caught(text):
  assert stale(text)


@pytest.mark.parametrize("text", [
    "kernel/backward/ and kernel/forward/producer.py:52",
    "kernel.tiling.schedule.SplitTail.table and kernel.tiling.plan.Problem.head_dim",
    "a mutant's kernel/forward/producer.mutant_<name>.py",
    "harness.proofs.prove"])
def test_a_resolving_reference_passes(text):
  assert not stale(text)


# A day's date in code prose is history: a measurement or an incident that
# belongs in its decision or gate record, which the comment names instead.
DATE = re.compile(r"\b20\d\d-[01]\d-[0-3]\d\b")
SHELL = ("ci/**/*.sh", ".ci/*")


def shell_comments(path: Path) -> str:
  """A shell script's comments (the text after a ``#`` that starts a word)."""
  return "\n".join(m.group(1) for m in re.finditer(r"(?:^|\s)#(.*)$", path.read_text(), re.M))


def dated(text: str) -> list[str]:
  """The dates ``text`` names."""
  return DATE.findall(text)


def test_no_comment_or_docstring_names_a_date():
  """Code prose under kernel/, harness/, properties/ and ci/ names no day:
  what was measured or seen then lives in docs/decisions/ or docs/gate/."""
  code = [p for pattern in SOURCES for p in sorted(ROOT.glob(pattern)) if ".tox" not in p.parts]
  scripts = [p for pattern in SHELL for p in sorted(ROOT.glob(pattern)) if p.is_file()]
  bad = [f"{p.relative_to(ROOT)}: {d}" for p in code for d in dated(prose(p))]
  bad += [f"{p.relative_to(ROOT)}: {d}" for p in scripts for d in dated(shell_comments(p))]
  assert not bad, "dates in code prose (move the history to its record):\n" + "\n".join(bad)


def test_a_dated_comment_is_caught():
  source = "x = 1  # 5 % faster on the H200 (2026-12-05)\ndef f():\n  'Seen 2026-11-30.'\n"
  assert len(dated(prose_of_source(source))) == 2
  assert not dated(prose_of_source("date = '2026-12-05'  # a record's field, not prose\n"))
