"""Places in the kernel's source found by syntax, and the edits spliced there.

Both mutant catalogues (harness/tools/mutants.py, harness/proofs/protocol_mutants.py)
say where a defect goes by an :class:`Anchor`: the seam of the function (or
class) it lives in, declared where the function is defined
(``@seam("producer.fill")``, kernel/sync/seams.py) and found in whichever
file under ``kernel/`` declares it, and a pattern, the source of one
expression or of one or more consecutive statements of that function.  The
pattern is compared with the function's code as syntax trees (positions,
layout, comments and a target's load/store context ignored), so renaming
the function, moving it to another file, re-indenting or re-wrapping it, or
editing its comments keeps the anchor; a change of what the matched code
says, or a seam removed or declared twice, loses it, and
:class:`AnchorError` says which and why (docs/decisions/declared-seams.md).

An :class:`Edit` puts new source in place of the matched code, spliced by
the matched nodes' line and column range: the rest of the file is byte for
byte what it was.  ``keep_lines`` (the protocol mutants, whose proof traces
name the mutated file's lines) keeps the file's line count: a replacement
shorter than the code it replaces is padded with blank lines, one longer is
joined with ``;`` where its statements allow.
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import textwrap
from pathlib import Path


class AnchorError(ValueError):
  """An anchor that does not find exactly one place, or an edit that cannot
  be spliced there."""


@dataclasses.dataclass(frozen=True)
class Anchor:
  """``seam``: the seam a def or class is declared as (``@seam(...)``,
  kernel/sync/seams.py), e.g. ``"mainloop.issue_then_softmax"``;
  ``pattern``: the source of one expression or of consecutive statements
  inside it; ``occurrence``: which match (1 = the first in the file), when
  the pattern occurs more than once (0: it must occur exactly once)."""

  seam: str
  pattern: str
  occurrence: int = 0


@dataclasses.dataclass(frozen=True)
class Edit:
  """``new`` in place of what ``anchor`` matches ("" deletes statements)."""

  anchor: Anchor
  new: str


def edit(seam: str, pattern: str, new: str, occurrence: int = 0) -> Edit:
  return Edit(Anchor(seam, pattern, occurrence), new)


# -- the source tree ----------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Definition:
  name: str
  scope: tuple[str, ...]   # the enclosing names: packages, module, classes, functions
  path: Path               # relative to the tree's root
  node: ast.AST

  @property
  def where(self) -> str:
    return f"{self.path.as_posix()}:{self.node.lineno}"

  @property
  def qualified(self) -> str:
    return ".".join(self.scope + (self.name,))


def _module_scope(rel: Path) -> tuple[str, ...]:
  parts = rel.with_suffix("").parts
  return parts[:-1] if parts[-1] == "__init__" else parts


class Tree:
  """The Python files under ``root/within``, each parsed once, every def
  and class they hold, and the seams declared on them."""

  def __init__(self, root: Path, within: str = "kernel", sources: dict | None = None):
    """``sources``: {path from ``root``: text} in place of the files on disk."""
    self.root, self.within = Path(root), within
    self.sources: dict[Path, bytes] = {}
    self.modules: dict[Path, ast.Module] = {}
    self.definitions: list[Definition] = []
    self.seams: dict[str, list[Definition]] = {}
    if sources is None:
      base = self.root / within
      files = [base] if base.is_file() else sorted(base.rglob("*.py"))
      sources = {f.relative_to(self.root): f.read_bytes() for f in files
                 if "__pycache__" not in f.parts}
    for rel, text in sorted(sources.items()):
      rel = Path(rel)
      self.sources[rel] = text.encode() if isinstance(text, str) else text
      self.modules[rel] = ast.parse(self.sources[rel], filename=str(rel))
      self._collect(self.modules[rel], _module_scope(rel), rel)

  def _collect(self, node, scope, rel):
    for child in ast.iter_child_nodes(node):
      if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        definition = Definition(child.name, scope, rel, child)
        self.definitions.append(definition)
        for name in _declared_seams(child):
          self.seams.setdefault(name, []).append(definition)
        self._collect(child, scope + (child.name,), rel)
      else:
        self._collect(child, scope, rel)

  def find(self, seam: str) -> Definition:
    """The one definition declared as ``seam``, else AnchorError."""
    declared = self.seams.get(seam, [])
    if not declared:
      near = difflib.get_close_matches(seam, sorted(self.seams), n=3, cutoff=0.6)
      raise AnchorError(f"seam {seam}: no def or class under {self.within}/ declares it"
                        + (f" (nearest seams: {', '.join(near)})" if near else ""))
    if len(declared) > 1:
      found = ", ".join(f"{d.where} ({d.qualified})" for d in declared)
      raise AnchorError(f"seam {seam}: declared {len(declared)} times under {self.within}/: "
                        f"{found}; a seam names one function")
    return declared[0]


def _declared_seams(node) -> list[str]:
  """The names of the ``@seam("...")`` decorators on a def or class."""
  names = []
  for d in node.decorator_list:
    func = d.func if isinstance(d, ast.Call) else None
    called = getattr(func, "id", None) or getattr(func, "attr", None)
    if called == "seam" and d.args and isinstance(d.args[0], ast.Constant) \
            and isinstance(d.args[0].value, str):
      names.append(d.args[0].value)
  return names


# -- matching -----------------------------------------------------------------------

_IGNORED_FIELDS = frozenset({"ctx", "type_comment", "kind"})


def _shape(node):
  """``node`` as nested tuples without positions, contexts or comments: two
  pieces of code have the same shape when they say the same thing."""
  if isinstance(node, ast.AST):
    return (type(node).__name__,) + tuple(
        _shape(getattr(node, f, None)) for f in node._fields if f not in _IGNORED_FIELDS)
  if isinstance(node, list):
    return tuple(_shape(x) for x in node)
  return (type(node).__name__, node)  # 1, 1.0 and True are different code


def _parse_pattern(pattern: str) -> list[ast.stmt]:
  try:
    body = ast.parse(textwrap.dedent(pattern).strip("\n")).body
  except SyntaxError as err:
    raise AnchorError(f"the pattern is not Python ({err.msg}): {pattern!r}") from None
  if not body:
    raise AnchorError("the pattern is empty")
  return body


def _statement_lists(fn: ast.AST):
  """Every list of statements inside ``fn``'s body, ``fn``'s own included."""
  yield fn.body
  for stmt in fn.body:
    for node in ast.walk(stmt):
      for field in ("body", "orelse", "finalbody"):
        block = getattr(node, field, None)
        if isinstance(block, list) and block and isinstance(block[0], ast.stmt):
          yield block


def _expressions(fn: ast.AST):
  for stmt in fn.body:
    for node in ast.walk(stmt):
      if isinstance(node, ast.expr):
        yield node


def _position(nodes) -> tuple[int, int]:
  first = nodes[0]
  decorators = getattr(first, "decorator_list", None)
  if decorators:
    return decorators[0].lineno, decorators[0].col_offset
  return first.lineno, first.col_offset


def _candidates(fn, pattern: list[ast.stmt]):
  """(whether the pattern is an expression, the runs of nodes that match
  it, the runs of its kind that do not: the candidates for "nearest")."""
  if len(pattern) == 1 and isinstance(pattern[0], ast.Expr):
    want = _shape(pattern[0].value)
    runs = [[e] for e in _expressions(fn)]
    same_kind = [r for r in runs if type(r[0]) is type(pattern[0].value)] or runs
    hits = [r for r in runs if _shape(r[0]) == want]
    return True, hits, same_kind
  want = _shape(pattern)
  n = len(pattern)
  runs = [block[i:i + n] for block in _statement_lists(fn) for i in range(len(block) - n + 1)]
  hits = [r for r in runs if _shape(r) == want]
  return False, hits, runs


def _nearest(pattern: list[ast.stmt], runs, count: int = 3) -> list[str]:
  """The runs whose source reads most like the pattern's, with their lines."""
  flat = lambda text: " ".join(text.split())
  want = flat("; ".join(ast.unparse(s) for s in pattern))
  scored = []
  for run in runs:
    text = flat("; ".join(ast.unparse(node) for node in run))
    scored.append((difflib.SequenceMatcher(None, want, text).ratio(), _position(run)[0], text))
  scored.sort(key=lambda s: (-s[0], s[1]))
  return [f"line {line}: {text[:110]}" for _, line, text in scored[:count]]


@dataclasses.dataclass(frozen=True)
class Place:
  """Where an anchor matched: ``nodes`` (one expression, or consecutive
  statements) of ``definition``'s file."""

  definition: Definition
  nodes: tuple
  expression: bool
  parent: ast.AST | None = None   # the statement whose body holds ``nodes`` first, if on its line

  @property
  def path(self) -> Path:
    return self.definition.path


def locate(anchor: Anchor, tree: Tree) -> Place:
  """The one place ``anchor`` matches in ``tree``, else AnchorError naming
  the seam and why (with the nearest code where nothing matched)."""
  definition = tree.find(anchor.seam)
  pattern = _parse_pattern(anchor.pattern)
  expression, hits, others = _candidates(definition.node, pattern)
  hits.sort(key=_position)
  where = f"seam {anchor.seam} ({definition.qualified}, {definition.where})"
  shown = textwrap.indent(textwrap.dedent(anchor.pattern).strip("\n"), "      ")
  if not hits:
    near = "\n".join("      " + c for c in _nearest(pattern, others))
    raise AnchorError(f"{where}: the pattern matched 0 times:\n{shown}\n    nearest there:\n{near}")
  if anchor.occurrence > len(hits) or (not anchor.occurrence and len(hits) > 1):
    lines = ", ".join(str(_position(h)[0]) for h in hits)
    asked = f"occurrence {anchor.occurrence} asked, " if anchor.occurrence else ""
    raise AnchorError(f"{where}: {asked}the pattern matched {len(hits)} times (lines {lines}); "
                      f"anchor on a seam inside it or give the occurrence:\n{shown}")
  nodes = tuple(hits[max(anchor.occurrence, 1) - 1])
  statement = _statement_of(definition.node, nodes[0]) if expression else None
  if statement is not None:  # a call on its own is the statement: any statement may replace it
    nodes, expression = (statement,), False
  return Place(definition, nodes, expression, _header_of(definition.node, nodes[0]))


def _header_of(fn, first):
  """The compound statement whose body starts with ``first`` on its own
  header's line (``if x: first``), or None."""
  for node in ast.walk(fn):
    body = getattr(node, "body", None)
    if isinstance(body, list) and body and body[0] is first and node.lineno == first.lineno:
      return node
  return None


def _statement_of(fn, expr):
  """The expression statement whose value is ``expr``, or None."""
  for node in ast.walk(fn):
    if isinstance(node, ast.Expr) and node.value is expr:
      return node
  return None


# -- splicing -----------------------------------------------------------------------

class _Lines:
  """Byte offsets of a file's lines: ast columns are UTF-8 byte offsets."""

  def __init__(self, source: bytes):
    self.source = source
    self.starts = [0]
    end = source.find(b"\n")
    while end >= 0:
      self.starts.append(end + 1)
      end = source.find(b"\n", end + 1)

  def offset(self, line: int, col: int) -> int:
    return self.starts[line - 1] + col

  def line(self, line: int) -> bytes:
    end = self.starts[line] if line < len(self.starts) else len(self.source)
    return self.source[self.starts[line - 1]:end]


def _indent(text: bytes) -> bytes:
  return text[:len(text) - len(text.lstrip(b" \t"))]


def _replacement(place: Place, new: str, lines: _Lines, keep_lines: bool):
  """(start, end, bytes) that put ``new`` in place of ``place``'s nodes."""
  if place.expression and not new.strip():
    raise AnchorError("an expression inside a statement cannot be deleted: say what replaces it")
  start, end, first, last = _range(place, lines)
  text = textwrap.dedent(new).strip("\n")
  if not text.strip() and not keep_lines:
    return _deletion(start, end, lines, first, last)
  body = (text if text.strip() else "pass").split("\n")
  if place.parent is not None:
    indent = b" " * (start - lines.starts[first - 1])  # a one-line suite becomes a block
  else:
    indent = _indent(lines.line(first))
  return start, end, _laid_out(body, place, indent, last - first + 1, keep_lines)


def _range(place: Place, lines: _Lines) -> tuple[int, int, int, int]:
  """(start, end) byte offsets and (first, last) lines of ``place``'s nodes."""
  nodes = place.nodes
  first, col = _position(nodes)
  if getattr(nodes[0], "decorator_list", None):  # a decorator's column is past its "@"
    col = lines.line(first).rindex(b"@", 0, col)
  end = lines.offset(nodes[-1].end_lineno, nodes[-1].end_col_offset)
  return lines.offset(first, col), end, first, nodes[-1].end_lineno


def _laid_out(body: list[str], place: Place, indent: bytes, span: int, keep_lines: bool) -> bytes:
  """``body``'s lines, the later ones at ``indent``; with ``keep_lines``,
  exactly ``span`` lines."""
  # A one-line suite (``if x: s``) holds one line: more start on the next.
  block = place.parent is not None and len(body) > 1
  if keep_lines and len(body) + block > span:
    body, block = [_joined(body, span)], False
  out = body[0].encode() + b"".join(b"\n" + (indent + l.encode() if l else b"") for l in body[1:])
  out = b"\n" + indent + out if block else out
  pad = b"\n" * (span - len(body) - block) if keep_lines else b""
  if pad and place.expression:
    return b"(" + out + pad + b")"
  if pad:
    return pad + (out if block else indent + out)
  return out


def _deletion(start, end, lines: _Lines, first_line: int, last_line: int):
  """The range that deletes statements: their whole lines where nothing
  else is on them, else the statements and one ``;`` beside them."""
  head = lines.source[lines.starts[first_line - 1]:start]
  tail_end = lines.starts[last_line] if last_line < len(lines.starts) else len(lines.source)
  tail = lines.source[end:tail_end]
  if not head.strip() and (not tail.strip() or tail.strip().startswith(b"#")):
    return lines.starts[first_line - 1], tail_end, b""  # whole lines
  after = len(tail) - len(tail.lstrip(b" \t"))
  if tail[after:after + 1] == b";":  # the separator of the next statement on the line
    rest = tail[after + 1:]
    return start, end + after + 1 + len(rest) - len(rest.lstrip(b" \t")), b""
  return start - (len(head) - len(head.rstrip(b" \t;"))), end, b""


def _joined(body: list[str], span: int) -> str:
  """``body``'s statements on one line, where each line is one or more
  simple statements (a block cannot be joined)."""
  for line in body:
    try:
      parsed = ast.parse(line).body
    except SyntaxError:
      parsed = None
    if not parsed or line[:1].isspace() or any(hasattr(s, "body") for s in parsed):
      raise AnchorError(f"the replacement has {len(body)} lines where the matched code spans "
                        f"{span}, and its lines cannot be joined with ';': {body!r}")
  return "; ".join(body)


def splice(edits, tree: Tree, *, keep_lines: bool = False) -> dict[Path, str]:
  """The text of each file ``edits`` change, every edit spliced at its
  anchor's place in ``tree`` (all located before any is applied)."""
  by_file: dict[Path, list] = {}
  for i, e in enumerate(edits):
    try:
      place = locate(e.anchor, tree)
      lines = _Lines(tree.sources[place.path])
      by_file.setdefault(place.path, []).append(
          (*_replacement(place, e.new, lines, keep_lines), i))
    except AnchorError as err:
      raise AnchorError(f"edit {i}: {err}") from None
  out = {}
  for path, cuts in by_file.items():
    source = tree.sources[path]
    cuts.sort()
    for (_, end, _, i), (start, _, _, j) in zip(cuts, cuts[1:]):
      if start < end:
        raise AnchorError(f"edits {i} and {j} overlap in {path.as_posix()}")
    for start, end, text, _ in reversed(cuts):
      source = source[:start] + text + source[end:]
    out[path] = source.decode()
  return out
