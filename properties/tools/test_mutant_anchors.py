"""Every catalogued mutant finds its place in the kernel by syntax, wherever
the function it edits lives (harness/tools/anchors.py): the numeric catalogue
(harness/tools/mutants.py) and the protocol mutants
(harness/proofs/protocol_mutants.py).  A kernel edit that loses a mutant's
place fails here, naming the mutant, the function and why, before any
lowering, GPU run or proof (CPU, seconds)."""

from __future__ import annotations

import ast
import functools
import linecache
import re
import sys
import textwrap
from pathlib import Path

import pytest

from harness.proofs import protocol_mutants as pmut
from harness.tools import anchors, mutants

REPO = Path(__file__).resolve().parents[2]
NUMERIC = {f"numeric:{m.name}": m for m in mutants.CATALOG}
PROTOCOL = {f"protocol:{m.name}": m for m in pmut.BY_NAME.values()}


@functools.cache
def _tree(within: str = "kernel") -> anchors.Tree:
  return anchors.Tree(REPO, within)


def _spliced(key, tree: anchors.Tree) -> dict[Path, str]:
  if key in NUMERIC:
    return mutants.patched_files(NUMERIC[key], tree.root, tree)
  return pmut.mutated_sources(PROTOCOL[key], tree)


def _functions(mutant, tree: anchors.Tree, files: dict[Path, str]) -> dict[str, str]:
  """{anchored function: its syntax tree, dumped} in the patched ``files``."""
  patched = anchors.Tree(tree.root, tree.within, files)
  return {e.anchor.seam: ast.dump(patched.find(e.anchor.seam).node)
          for e in mutant.edits}


@pytest.mark.parametrize("key", [*NUMERIC, *PROTOCOL])
def test_every_mutant_finds_its_place_and_changes_its_function(key):
  """Each anchor matches exactly once; the patched files compile; every
  anchored function's syntax tree changes; a protocol mutant keeps each
  file's line count (its traces name the mutated file's lines)."""
  mutant = NUMERIC.get(key) or PROTOCOL[key]
  tree = _tree(getattr(mutant, "within", "kernel"))
  try:
    files = _spliced(key, tree)
  except (mutants.MutantError, anchors.AnchorError) as err:
    pytest.fail(f"lost its place: {err}", pytrace=False)
  before = {e.anchor.seam: ast.dump(tree.find(e.anchor.seam).node) for e in mutant.edits}
  after = _functions(mutant, tree, files)
  assert all(after[f] != before[f] for f in before), (key, before.keys())
  for path, text in files.items():
    compile(text, str(path), "exec")
    if key in PROTOCOL:
      assert text.count("\n") == tree.sources[path].count(b"\n"), (key, path)


# A small kernel with what loses places: a pattern twice in one function, a
# seam declared on two functions, and a function of the same name as a
# seamed one, declaring none.
_SMALL = {
    "kernel/forward.py": textwrap.dedent('''\
        @seam("context.ring_state")
        def ring_state(keys, prev_iters, lb, ki):
          return keys.position(prev_iters + (ki - lb))


        @seam("softmax.logits")
        def logits(s, keep, staged):
          if staged:
            s = jnp.where(keep != 0, s, NEG_INF)
          else:
            s = jnp.where(keep != 0, s, NEG_INF)
          return s
        '''),
    "kernel/backward.py": textwrap.dedent('''\
        @seam("backward.attention")
        def attention_backward(dq, scale):
          dq = dq * scale
          return dq


        def _dkv_step(t):
          @seam("dkv.grads")
          def grads(refs):
            return refs["dk"]
          return grads


        def _wide_step(t):
          @seam("dkv.grads")
          def grads(refs):
            return refs["dv"]
          return grads
        '''),
    "kernel/backward_xla.py": "def attention_backward(dq, scale):\n  return dq * scale\n",
}


def _small(root: Path = Path("/small")) -> anchors.Tree:
  return anchors.Tree(root, sources={Path(p): text for p, text in _SMALL.items()})


def _message(seam, pattern, occurrence=0, tree=None):
  with pytest.raises(anchors.AnchorError) as err:
    anchors.locate(anchors.Anchor(seam, pattern, occurrence), tree or _small())
  return str(err.value)


def test_a_lost_anchor_says_which_seam_and_why():
  """The four ways to lose a place, each named with what is there instead."""
  gone = _message("context.ring_stat", "return keys.position(ki)")
  assert gone == ("seam context.ring_stat: no def or class under kernel/ declares it "
                  "(nearest seams: context.ring_state)"), gone
  twice = _message("dkv.grads", "return refs['dk']")
  assert "seam dkv.grads: declared 2 times" in twice, twice
  assert "kernel/backward.py:9 (kernel.backward._dkv_step.grads)" in twice
  assert "kernel/backward.py:16 (kernel.backward._wide_step.grads)" in twice
  none = _message("context.ring_state", "return keys.position(prev_iters + (ki - lb) + 1)")
  assert none.startswith("seam context.ring_state (kernel.forward.ring_state, "
                         "kernel/forward.py:2): the pattern matched 0 times"), none
  assert "nearest there:\n      line 3: return keys.position(prev_iters + (ki - lb))" in none
  many = _message("softmax.logits", "s = jnp.where(keep != 0, s, NEG_INF)")
  assert "matched 2 times (lines 9, 11)" in many and "give the occurrence" in many
  beyond = _message("softmax.logits", "s = jnp.where(keep != 0, s, NEG_INF)", occurrence=3)
  assert "occurrence 3 asked, the pattern matched 2 times" in beyond
  assert anchors.locate(anchors.Anchor("softmax.logits", "s = jnp.where(keep != 0, s, NEG_INF)",
                                       2), _small()).nodes[0].lineno == 11


def test_both_catalogues_name_the_mutant_that_lost_its_place(tmp_path):
  for rel, text in _SMALL.items():
    (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
    (tmp_path / rel).write_text(text)
  lost = anchors.edit("context.ring_state", "return keys.position(prev_iters - lb)", "pass")
  numeric = mutants.Mutant("lost-carry", "test", (lost,), ("t",))
  assert mutants.check(tmp_path, mutants=(numeric,)) == [
      f"lost-carry: edit 0: {_message('context.ring_state', lost.anchor.pattern)}"]
  protocol = pmut.Mutant("lost_carry", "test", (lost,))
  with pytest.raises(anchors.AnchorError, match=r"^protocol mutant lost_carry: edit 0: "
                                                 r"seam context.ring_state \(kernel.forward"):
    pmut.mutated_sources(protocol, anchors.Tree(tmp_path))


def test_a_seam_follows_its_function_not_its_name():
  """The seam finds the function it is declared on, renamed or not; a
  function of the seamed one's name that declares no seam is not it."""
  tree = _small()
  assert tree.find("backward.attention").path == Path("kernel/backward.py")
  renamed = {Path(p): text.replace("def ring_state", "def ring_position")
             for p, text in _SMALL.items()}
  found = anchors.Tree(Path("/small"), sources=renamed).find("context.ring_state")
  assert found.qualified == "kernel.forward.ring_position"


def _without(tree: anchors.Tree, seam: str) -> anchors.Tree:
  """``tree`` with the declaration of ``seam`` removed."""
  (definition,) = tree.seams[seam]
  decorator = next(d for d in definition.node.decorator_list
                   if isinstance(d, ast.Call) and d.args and d.args[0].value == seam)
  lines = tree.sources[definition.path].decode().split("\n")
  del lines[decorator.lineno - 1]
  return anchors.Tree(tree.root, tree.within,
                      {**tree.sources, definition.path: "\n".join(lines)})


@pytest.mark.parametrize("seam", ["producer.fill", "dkv.step"])
def test_a_removed_seam_fails_by_its_name(seam):
  """Remove a seam the catalogues anchor on, and each mutant that edits it
  loses its place, named by the seam; a rename of its function keeps them."""
  shipped = _tree()
  on_it = [k for k, m in {**NUMERIC, **PROTOCOL}.items()
           if any(e.anchor.seam == seam for e in m.edits)]
  assert on_it, seam
  removed, renamed = _without(shipped, seam), _renamed(shipped, seam)
  for key in on_it:
    with pytest.raises((mutants.MutantError, anchors.AnchorError),
                       match=rf"seam {re.escape(seam)}: no def or class under kernel/ declares it"):
      _spliced(key, removed)
    assert _spliced(key, renamed), key


def _renamed(tree: anchors.Tree, seam: str) -> anchors.Tree:
  """``tree`` with the function declared as ``seam`` renamed, at its def."""
  (definition,) = tree.seams[seam]
  lines = tree.sources[definition.path].decode().split("\n")
  i = definition.node.lineno - 1
  lines[i] = lines[i].replace(f"def {definition.name}(", f"def {definition.name}_renamed(", 1)
  return anchors.Tree(tree.root, tree.within, {**tree.sources, definition.path: "\n".join(lines)})


def test_every_seam_is_declared_once():
  """A seam names one function of the kernel: none is declared twice."""
  twice = {name: [d.where for d in found] for name, found in _tree().seams.items()
           if len(found) > 1}
  assert not twice, twice


def _scattered(tree: anchors.Tree) -> dict[Path, str]:
  """The package re-laid out: each module a package of its own, its
  top-level defs and classes one file each, everything re-formatted
  (four-space indents, each statement re-wrapped on one line, comments
  gone)."""
  out = {}
  defs = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)
  for path, module in tree.modules.items():
    home = path.parent if path.name == "__init__.py" else path.with_suffix("")
    rest = [n for n in module.body if not isinstance(n, defs)]
    out[home / "__init__.py"] = ast.unparse(ast.Module(rest, []))
    for node in module.body:
      if isinstance(node, defs):
        out[home / f"{node.name}.py"] = ast.unparse(node)
  return out


def test_functions_moved_to_other_files_and_reformatted_keep_their_anchors(tmp_path):
  """Every mutant of both catalogues finds its place in the scattered copy
  (written to disk and read back as the catalogues read the kernel) and
  makes of each function it edits the same syntax tree as in the shipped
  layout; protocol mutants keep the scattered files' line counts."""
  shipped = _tree()
  for path, text in _scattered(shipped).items():
    (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
    (tmp_path / path).write_text(text)
  moved = anchors.Tree(tmp_path)
  for key in (*NUMERIC, *PROTOCOL):
    mutant = NUMERIC.get(key) or PROTOCOL[key]
    if getattr(mutant, "within", "kernel") != "kernel":
      continue
    for e in mutant.edits:  # each function really is elsewhere now
      assert moved.find(e.anchor.seam).path != shipped.find(e.anchor.seam).path
    here, there = _spliced(key, shipped), _spliced(key, moved)
    assert _functions(mutant, moved, there) == _functions(mutant, shipped, here), key
    if key in PROTOCOL:
      for path, text in there.items():
        assert text.count("\n") == moved.sources[path].count(b"\n"), (key, path)


_WRAPPED = '''\
@seam("producer.fill")
def fill(c, ki):
  st = ring_state(
      c.keys,
      c.prev_iters,  # the carry
      c.lb, ki)
  if c.staged: st = ring_state(c.keys, c.prev_iters,
                               c.lb, ki)
  return (st,
          ki)
'''


def test_a_protocol_edit_of_wrapped_code_keeps_the_line_count():
  """Shorter code in place of code wrapped over several lines is padded
  with blank lines (statements) or inside parentheses (expressions), and
  longer code is joined with ';': the same program, the same line count."""
  tree = anchors.Tree(Path("/x"), sources={Path("kernel/k.py"): _WRAPPED})
  edits = (anchors.edit("producer.fill", "st = ring_state(c.keys, c.prev_iters, c.lb, ki)",
                        "st = ring_state(c.keys, c.prev_iters, c.lb, ki + 1)", occurrence=1),
           anchors.edit("producer.fill", "st = ring_state(c.keys, c.prev_iters, c.lb, ki)",
                        "pass\nst = 0", occurrence=2),
           anchors.edit("producer.fill", "(st, ki)", "(ki, st)"))
  kept = anchors.splice(edits, tree, keep_lines=True)[Path("kernel/k.py")]
  free = anchors.splice(edits, tree)[Path("kernel/k.py")]
  assert kept.count("\n") == _WRAPPED.count("\n") and free.count("\n") < _WRAPPED.count("\n")
  assert ast.dump(ast.parse(kept)) == ast.dump(ast.parse(free)) != ast.dump(ast.parse(_WRAPPED))
  assert "ki + 1" in kept.splitlines()[5]  # the edited statement ends where it ended


def test_a_deleted_statement_takes_its_lines_and_only_those():
  source = '@seam("k.f")\ndef f(x):\n  a = 1\n  b = 2  # why\n  c = 3; d = 4\n  return a\n'
  tree = anchors.Tree(Path("/x"), sources={Path("kernel/k.py"): source})
  out = anchors.splice((anchors.edit("k.f", "b = 2", ""), anchors.edit("k.f", "c = 3", "")),
                       tree)[Path("kernel/k.py")]
  assert out == '@seam("k.f")\ndef f(x):\n  a = 1\n  d = 4\n  return a\n'
  with pytest.raises(anchors.AnchorError, match="edits 0 and 1 overlap"):
    anchors.splice((anchors.edit("k.f", "a = 1", "a = 2"), anchors.edit("k.f", "1", "2")), tree)


_PACKAGE = {
    "pkg/__init__.py": "",
    "pkg/sync/__init__.py": "",
    "pkg/sync/state.py": "from kernel.sync.seams import seam\n\n\n@seam(\"pipeline.refills\")\n"
                         "def refills(count, stages):\n  return count >= stages\n",
    "pkg/sync/verbs.py": "from pkg.sync.state import refills\n\n\n"
                         "def must_wait(count):\n  return refills(count, 2)\n",
    "pkg/forward/__init__.py": "from .loop import run\n",
    "pkg/forward/loop.py": "from pkg.sync import verbs\n\n\n"
                           "def run(count):\n  return verbs.must_wait(count)\n",
    "pkg/unrelated.py": "import pkg.sync.state\n",
}


def test_a_protocol_mutant_runs_its_kernel_over_the_file_its_function_lives_in(tmp_path):
  """An edit of a helper two packages away from the kernel: the kernel
  (a package) and the modules between them are executed afresh over the
  edited file, whose lines tracebacks name; the imported modules stay the
  shipped ones."""
  name = f"pkg_{tmp_path.name}".replace("-", "_")
  for rel, text in _PACKAGE.items():
    target = tmp_path / rel.replace("pkg", name, 1)
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(text.replace("pkg", name))
  sys.path.insert(0, str(tmp_path))
  try:
    tree = anchors.Tree(tmp_path, name)
    graph = pmut.imports(tree)
    edited = anchors.splice((anchors.edit("pipeline.refills", "return count >= stages",
                                          "return count > stages"),), tree, keep_lines=True)
    assert pmut.reexecuted({f"{name}.sync.state"}, f"{name}.forward", graph) == [
        f"{name}.sync.state", f"{name}.sync.verbs", f"{name}.forward.loop", f"{name}.forward"]
    fresh = pmut.execute(edited, f"{name}.forward", tree, "late")
    shipped = sys.modules[f"{name}.forward"]
    assert fresh.run(2) is False and shipped.run(2) is True
    assert sys.modules[f"{name}.sync.state"].refills(2, 2) is True
    state_file = tmp_path / name / "sync" / "state.mutant_late.py"
    assert linecache.getline(str(state_file), 6).strip() == "return count > stages"
    assert fresh.__file__ == str(tmp_path / name / "forward" / "__init__.mutant_late.py")
    with pytest.raises(anchors.AnchorError, match="does not import"):
      pmut.reexecuted({f"{name}.unrelated"}, f"{name}.forward", graph)
  finally:
    sys.path.remove(str(tmp_path))
    for module in [m for m in sys.modules if m == name or m.startswith(name + ".")]:
      del sys.modules[module]


@pytest.mark.parametrize("key", PROTOCOL)
def test_every_protocol_mutant_reaches_the_kernel_it_is_proved_on(key):
  """The modules a protocol mutant edits are imported, at module level, by
  the kernel the proof traces (directly or through others, such as the
  ring between PipelineState and the kernels): it is executed afresh over
  them, the edited ones first."""
  mutant, tree = PROTOCOL[key], _tree()
  edited = {pmut.module_name(p) for p in pmut.mutated_sources(mutant, tree)}
  graph = pmut.imports(tree)
  chain = pmut.reexecuted(edited, pmut.KERNELS[mutant.kernel], graph)
  assert chain[-1] == pmut.KERNELS[mutant.kernel] and edited <= set(chain)
  for i, module in enumerate(chain):  # what a module imports from the chain runs before it
    assert graph[module] & set(chain) <= set(chain[:i]), (module, chain)
