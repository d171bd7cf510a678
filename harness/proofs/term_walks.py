"""Walks over the terms of :mod:`harness.proofs.terms`: their atoms, a
substitution of atoms by terms, the generalisation that widens a claim to a
canonical one (:mod:`harness.proofs.premise`), and evaluation at given
values."""

from __future__ import annotations

from harness.proofs.terms import (Atom, Bool, Lin, add, and_, cdiv, cmp0, div_by, ite, mul_by,
                                  not_, of_atom, or_, pos, read, rem_by, scale, var)


def atoms_of(x, out=None) -> list:
  """Every atom of ``x``, innermost first, each once."""
  out = [] if out is None else out
  seen = set(a.key for a in out)

  def walk(t):
    if type(t) is Lin:
      for a, _ in t.mono:
        walk_atom(a)
    elif type(t) is Atom:
      walk_atom(t)
    elif type(t) is Bool:
      for a in t.args:
        walk(a)
    elif type(t) is tuple:
      for a in t:
        walk(a)

  def walk_atom(a):
    if a.key in seen:
      return
    for arg in a.args:
      walk(arg)
    seen.add(a.key)
    out.append(a)

  walk(x)
  return out


def direct_atoms(x, out=None) -> list:
  """The atoms of ``x`` not inside another atom."""
  out = [] if out is None else out
  t = type(x)
  if t is Lin:
    out.extend(a for a, _ in x.mono)
  elif t is Atom:
    out.append(x)
  elif t is Bool or t is tuple:
    for a in (x.args if t is Bool else x):
      direct_atoms(a, out)
  return out


def contains(x, names: frozenset) -> bool:
  """Whether ``x`` mentions a variable named in ``names``."""
  return any(a.op == "var" and a.args[0] in names for a in atoms_of(x))


def subst(x, mapping: dict, memo=None):
  """``x`` with every atom whose key is in ``mapping`` replaced by its term,
  inside other atoms too, renormalised."""
  memo = {} if memo is None else memo
  t = type(x)
  if t is int or t is bool or t is str or x is None:
    return x
  if t is tuple:
    return tuple(subst(v, mapping, memo) for v in x)
  hit = memo.get(x)
  if hit is not None:
    return hit[0]
  if t is Lin:
    new = [(_subst_atom(a, mapping, memo), c) for a, c in x.mono]
    if all(r is a.one for (r, _), (a, _) in zip(new, x.mono)):
      out = x   # nothing in it changed
    else:
      out = x.const
      for r, c in new:
        out = add(out, scale(r, c))
  elif t is Atom:
    out = _subst_atom(x, mapping, memo)
  else:
    args = [subst(a, mapping, memo) for a in x.args]
    if all(a is b for a, b in zip(args, x.args)):
      out = x
    elif x.op in ("lt0", "le0", "eq0"):
      out = cmp0(x.op, args[0])
    elif x.op == "not":
      out = not_(args[0])
    elif x.op == "and":
      out = and_(*args)
    else:
      out = or_(*args)
  memo[x] = (out,)
  return out


def _same(a, b) -> bool:
  if a is b:
    return True
  if type(a) is tuple and type(b) is tuple:
    return len(a) == len(b) and all(x is y for x, y in zip(a, b))
  return type(a) in (int, str) and type(a) is type(b) and a == b


def _subst_atom(a: Atom, mapping, memo, rebuild=None):
  if a in mapping:
    return mapping[a]
  hit = memo.get(a)
  if hit is not None:
    return hit[0]
  if a.op == "var":
    out = of_atom(a)
  else:
    args = [(rebuild or (lambda v: subst(v, mapping, memo)))(v) for v in a.args]
    if all(_same(x, y) for x, y in zip(args, a.args)):
      out = of_atom(a)
    elif a.op == "div":
      out = div_by(args[0], args[1])
    elif a.op == "rem":
      out = rem_by(args[0], args[1])
    elif a.op == "mul":
      out = mul_by(args[0], args[1])
    elif a.op == "pos":
      out = pos(args[0])
    elif a.op == "ite":
      out = ite(*args)
    else:
      out = read(args[0], args[1])
  memo[a] = (out,)
  return out


def generalise(x, essential: frozenset, table: dict, memo: dict, keep=()):
  """``x`` with every atom that mentions no variable of ``essential`` (a read
  never does: its values are free) replaced by a variable of its own
  (``table``: atom -> that variable, shared by the calls that share it);
  atoms whose op is in ``keep`` are rebuilt instead, their arguments
  generalised."""
  t = type(x)
  if t is int or t is bool or t is str or x is None:
    return x
  if t is tuple:
    return tuple(generalise(v, essential, table, memo, keep) for v in x)
  hit = memo.get(x)
  if hit is not None:
    return hit[0]
  if t is Lin:
    out = x.const
    for a, c in x.mono:
      out = add(out, scale(_general_atom(a, essential, table, memo, keep), c))
  else:
    args = [generalise(a, essential, table, memo, keep) for a in x.args]
    out = {"lt0": lambda: cmp0("lt0", args[0]), "le0": lambda: cmp0("le0", args[0]),
           "eq0": lambda: cmp0("eq0", args[0]), "not": lambda: not_(args[0]),
           "and": lambda: and_(*args), "or": lambda: or_(*args)}[x.op]()
  memo[x] = (out,)
  return out


def _essential(a: Atom, essential, memo) -> bool:
  k = ("essential", a)
  hit = memo.get(k)
  if hit is None:
    if a.op == "var":
      hit = a.args[0] in essential
    elif a.op == "read":
      hit = False
    else:
      hit = any(_essential(b, essential, memo) for b in direct_atoms(a.args))
    memo[k] = hit
  return hit


def _general_atom(a: Atom, essential, table, memo, keep):
  hit = memo.get(a)
  if hit is not None:
    return hit[0]
  if not _essential(a, essential, memo) and a.op not in keep:
    out = table.get(a)
    if out is None:
      out = table[a] = var(f"gen:{len(table)}")
  elif a.op == "var":
    out = of_atom(a)
  else:
    out = _subst_atom(a, {}, {}, rebuild=lambda v: generalise(v, essential, table, memo, keep))
  memo[a] = (out,)
  return out


def evaluate(x, values: dict, reads=None):
  """``x`` with its variables given (name -> int; ``reads(buf, idx)`` for
  reads), as a Python int or bool."""
  t = type(x)
  if t is int or t is bool:
    return x
  if t is tuple:
    return tuple(evaluate(v, values, reads) for v in x)
  if t is Lin:
    return x.const + sum(c * _eval_atom(a, values, reads) for a, c in x.mono)
  if t is Atom:
    return _eval_atom(x, values, reads)
  args = [evaluate(a, values, reads) for a in x.args]
  if x.op == "lt0":
    return args[0] < 0
  if x.op == "le0":
    return args[0] <= 0
  if x.op == "eq0":
    return args[0] == 0
  if x.op == "not":
    return not args[0]
  return all(args) if x.op == "and" else any(args)


def _eval_atom(a, values, reads):
  if a.op == "var":
    return values[a.args[0]]
  if a.op == "read":
    if reads is None:
      raise KeyError(a.key)
    return reads(a.args[0], evaluate(a.args[1], values, reads))
  if a.op == "ite":
    c = evaluate(a.args[0], values, reads)
    return evaluate(a.args[1] if c else a.args[2], values, reads)
  v = evaluate(a.args[0], values, reads)
  if a.op == "pos":
    return max(0, v)
  d = evaluate(a.args[1], values, reads)
  if a.op == "mul":
    return v * d
  if a.op == "div":
    return cdiv(v, d)
  return v - d * cdiv(v, d)
