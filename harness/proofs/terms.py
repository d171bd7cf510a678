"""Integer and boolean terms over the kernel's loop counters and ring position,
as :mod:`harness.proofs.symbolic` builds them from a jaxpr and
:mod:`harness.proofs.premise` hands them to Z3.

A term is a Python ``int`` or ``bool`` (a constant), a :class:`Lin` (a
constant plus integer multiples of atoms) or a :class:`Bool`.  Atoms
(:class:`Atom`) are what linear arithmetic cannot see through: variables,
division and remainder by a constant (C semantics, as ``lax.div`` and
``lax.rem``), ``pos(x) = max(0, x)`` (every ``min`` and ``max`` is written
with it), a conditional value, and an integer read from global memory (an
uninterpreted function of its indices).  Terms are normalised as they are
built (constants folded, linear parts collected, comparisons moved to one
side), so that equal programs give equal terms: the premise's queries are
keyed by them.

Nothing here imports Z3 (:mod:`harness.proofs.z3_terms` writes terms for it);
:mod:`harness.proofs.term_walks` reads them: their atoms, substitution,
generalisation and evaluation.
"""

from __future__ import annotations


_TABLE: dict = {}      # structural key -> the one term with it (hash-consing)
_OPS = {op: i for i, op in enumerate(
    "var div rem pos ite read lin lt0 le0 eq0 not and or mul".split())}


_KEEP: dict = {}       # the entries of the variables made with permanent_var


def reset():
  """Forget every term but the permanent variables (each launch's terms are
  built anew)."""
  _TABLE.clear()
  _TABLE.update(_KEEP)


def permanent_var(name: str):
  """A variable that outlives :func:`reset` (module-level constants)."""
  v = var(name)
  a = v.mono[0][0]
  _KEEP[(Atom, "var", (name,))] = a
  _KEEP[(Lin, 0, ((a, 1),))] = v
  return v


_NAMES: dict = {}


def _h(x) -> int:
  """A hash that is the same in every process (strings by CRC)."""
  t = type(x)
  if t is int or t is bool:
    return hash(x)
  if t is str:
    hit = _NAMES.get(x)
    if hit is None:
      import zlib
      hit = _NAMES[x] = zlib.crc32(x.encode())
    return hit
  if t is tuple:
    return hash(tuple(_h(v) for v in x))
  return x.h


class _Term:
  """One object per term (hash-consed): equal terms are the same object,
  compared by identity, hashed by ``h`` (the same in every process)."""

  __slots__ = ("h", "__weakref__")

  def __hash__(self):
    return self.h

  @property
  def key(self):
    return self


class Atom(_Term):
  """op: var (name), div / rem (Lin, positive int or a term at least 1:
  :func:`div_by`), mul (two terms: :func:`mul_by`), pos (Lin), ite (Bool,
  term, term), read (buffer name, index terms)."""

  __slots__ = ("op", "args", "one")

  def __repr__(self):
    a = self.args
    if self.op == "var":
      return a[0]
    if self.op in ("div", "rem"):
      return f"{self.op}({a[0]!r}, {a[1]})"
    if self.op == "mul":
      return f"({a[0]!r}) * ({a[1]!r})"
    if self.op == "pos":
      return f"max(0, {a[0]!r})"
    if self.op == "ite":
      return f"({a[1]!r} if {a[0]!r} else {a[2]!r})"
    return f"{a[0]}[{', '.join(map(repr, a[1]))}]"


class Lin(_Term):
  """const + sum(coef * atom), monomials in a fixed order."""

  __slots__ = ("const", "mono")

  def __repr__(self):
    parts = [("" if c == 1 else "-" if c == -1 else f"{c}*") + repr(a) for a, c in self.mono]
    if self.const:
      parts.append(str(self.const))
    return " + ".join(parts).replace("+ -", "- ")


class Bool(_Term):
  """op: lt0 / le0 / eq0 (Lin: x < 0, x <= 0, x == 0), not (Bool), and / or
  (tuple of Bool)."""

  __slots__ = ("op", "args")

  def __repr__(self):
    if self.op in ("lt0", "le0", "eq0"):
      return f"{self.args[0]!r} {dict(lt0='<', le0='<=', eq0='==')[self.op]} 0"
    if self.op == "not":
      return f"not ({self.args[0]!r})"
    return f" {self.op} ".join(f"({a!r})" for a in self.args)


def is_int(x) -> bool:
  return type(x) is int or type(x) is Lin


def is_bool(x) -> bool:
  return type(x) is bool or type(x) is Bool


def is_term(x) -> bool:
  return type(x) in (int, bool, Lin, Bool)


def symbolic(x) -> bool:
  return type(x) is Lin or type(x) is Bool or type(x) is Atom


def _intern(cls, op, args):
  k = (cls, op, args)
  hit = _TABLE.get(k)
  if hit is None:
    hit = cls.__new__(cls)
    hit.op, hit.args = op, args
    hit.h = hash((_OPS[op], _h(args)))
    _TABLE[k] = hit
  return hit


def _atom(op, args) -> Atom:
  return _intern(Atom, op, args)


def _bool(op, args) -> Bool:
  return _intern(Bool, op, args)


def _mk(const, coefs: dict):
  mono = tuple(sorted(((a, c) for a, c in coefs.items() if c), key=_by_h))
  if not mono:
    return const
  k = (Lin, const, mono)
  hit = _TABLE.get(k)
  if hit is None:
    hit = Lin.__new__(Lin)
    hit.const, hit.mono = const, mono
    hit.h = hash((_OPS["lin"], const, tuple((a.h, c) for a, c in mono)))
    _TABLE[k] = hit
  return hit


def _by_h(ac):
  return ac[0].h


def lin(x) -> tuple:
  """(const, {atom: coef}) of an integer term."""
  if type(x) is int:
    return x, {}
  if type(x) is bool:
    return int(x), {}
  if type(x) is Atom:
    return 0, {x: 1}
  return x.const, dict(x.mono)


def of_atom(a: Atom):
  try:
    return a.one
  except AttributeError:
    a.one = _mk(0, {a: 1})
    return a.one


def var(name: str):
  return of_atom(_atom("var", (name,)))


def add(a, b):
  if type(a) is int and type(b) is int:
    return a + b
  if type(b) is int:
    return _mk(a.const + b, dict(a.mono)) if b else a
  if type(a) is int:
    return _mk(b.const + a, dict(b.mono)) if a else b
  ma = dict(a.mono)
  for k, v in b.mono:
    ma[k] = ma.get(k, 0) + v
  return _mk(a.const + b.const, ma)


def scale(a, k: int):
  if type(a) is int:
    return a * k
  if not k:
    return 0
  if k == 1:
    return a
  return _mk(a.const * k, {x: v * k for x, v in a.mono})


def neg(a):
  return scale(a, -1)


def sub(a, b):
  return add(a, scale(b, -1))


def mul(a, b):
  """a * b where one side is a constant; None otherwise (not linear)."""
  if type(a) is int:
    return scale(b, a)
  if type(b) is int:
    return scale(a, b)
  return None


def _lead(x) -> int:
  return x.mono[0][1] if type(x) is Lin else (1 if x >= 0 else -1)


def cdiv(a: int, b: int) -> int:
  q = abs(a) // abs(b)
  return q if (a >= 0) == (b > 0) else -q


def div(a, c):
  """C division (toward zero) by a constant; None for a divisor that is not one."""
  if type(c) is not int or c == 0:
    return None
  if type(a) is int:
    return cdiv(a, c)
  if c == 1:
    return a
  if c == -1:
    return neg(a)
  if c < 0:
    return neg(div(a, -c))
  return of_atom(_atom("div", (a, c)))


def div_by(a, d):
  """C division of ``a`` by ``d``, a term at least 1 (a count of the grid:
  a group of heads): exact, Z3 deciding the product of quotient and divisor."""
  return div(a, d) if type(d) is int else of_atom(_atom("div", (a, d)))


def mul_by(a, d):
  """``a`` times ``d``, a term that reads a count of the grid: exact, Z3
  deciding the product (a trip count of a group's heads)."""
  out = mul(a, d)
  return of_atom(_atom("mul", (a, d))) if out is None else out


def rem_by(a, d):
  """C remainder of ``a`` by ``d``, a term at least 1 (:func:`div_by`)."""
  return rem(a, d) if type(d) is int else of_atom(_atom("rem", (a, d)))


def rem(a, c):
  if type(c) is not int or c == 0:
    return None
  if type(a) is int:
    return a - c * cdiv(a, c)
  if c in (1, -1):
    return 0
  return of_atom(_atom("rem", (a, abs(c))))


def pos(x):
  """max(0, x)."""
  if type(x) is int:
    return max(0, x)
  if len(x.mono) == 1 and x.const >= 0 and x.mono[0][1] > 0 and x.mono[0][0].op == "pos":
    return x  # c * pos(y) + k with c > 0, k >= 0 is never negative
  return of_atom(_atom("pos", (x,)))


def _simpler(a, b) -> bool:
  """Whether ``a`` should be the base of max(a, b) = a + pos(b - a): the one
  with fewer atoms, then the orientation that keeps pos's argument leading
  with a positive coefficient."""
  la = 0 if type(a) is int else len(a.mono)
  lb_ = 0 if type(b) is int else len(b.mono)
  if la != lb_:
    return la < lb_
  return _lead(sub(b, a)) > 0


def _extreme(a, b, d, combine):
  """combine(a, pos(d)) = combine(b, pos(-d)), in the orientation _simpler
  picks; b if d > 0 else a where d is a number."""
  if type(d) is int:
    return b if d > 0 else a
  if _simpler(a, b):
    return combine(a, pos(d))
  return combine(b, pos(neg(d)))


def max_(a, b):
  # max(a, b) = a + pos(b - a) = b + pos(a - b)
  return _extreme(a, b, sub(b, a), add)


def min_(a, b):
  # min(a, b) = a - pos(a - b) = b - pos(b - a)
  return _extreme(a, b, sub(a, b), sub)


def cmp0(op, x):
  """x op 0, op in lt0 / le0 / eq0, normalised (a leading coefficient of 1
  where the constant allows it): the form every comparison is kept in."""
  if type(x) is int:
    return {"lt0": x < 0, "le0": x <= 0, "eq0": x == 0}[op]
  if op == "lt0":  # integers: x < 0 is x + 1 <= 0
    return cmp0("le0", add(x, 1))
  import math
  g = 0
  for _, c in x.mono:
    g = math.gcd(g, c)
  if op == "eq0":
    if x.const % g:
      return False
    if _lead(x) < 0:
      x = neg(x)
    if g > 1:
      x = _mk(x.const // g, {a: c // g for a, c in x.mono})
    return _bool("eq0", (x,))
  if g > 1:  # sum(c a) + k <= 0  <=>  sum(c/g a) + ceil(k/g) <= 0
    x = _mk(-((-x.const) // g), {a: c // g for a, c in x.mono})
  return _bool("le0", (x,))


def lt(a, b):
  return cmp0("lt0", sub(a, b))


def le(a, b):
  return cmp0("le0", sub(a, b))


def gt(a, b):
  return cmp0("lt0", sub(b, a))


def ge(a, b):
  return cmp0("le0", sub(b, a))


def eq(a, b):
  if is_bool(a) or is_bool(b):
    return iff(a, b)
  return cmp0("eq0", sub(a, b))


def ne(a, b):
  return not_(eq(a, b))


def not_(a):
  if type(a) is bool:
    return not a
  if a.op == "not":
    return a.args[0]
  if a.op == "le0":  # not (x <= 0)  <=>  -x + 1 <= 0
    return cmp0("le0", add(neg(a.args[0]), 1))
  return _bool("not", (a,))


def and_(*xs):
  out = []
  for x in xs:
    if x is False:
      return False
    if x is True:
      continue
    for y in (x.args if x.op == "and" else (x,)):
      if y not in out:
        out.append(y)
  if not out:
    return True
  if len(out) == 1:
    return out[0]
  for y in out:
    if not_(y) in out:
      return False
  return _bool("and", tuple(sorted(out, key=_bool_h)))


def _bool_h(b):
  return b.h


def or_(*xs):
  return not_(and_(*(not_(x) for x in xs)))


def iff(a, b):
  if type(a) is bool:
    return b if a else not_(b)
  if type(b) is bool:
    return a if b else not_(a)
  if a is b:
    return True
  return or_(and_(a, b), and_(not_(a), not_(b)))


def to_int(b):
  """A boolean as 0 / 1."""
  if type(b) is bool:
    return int(b)
  return ite(b, 1, 0)


def ite(c, a, b):
  if type(c) is bool:
    return a if c else b
  if is_bool(a) and is_bool(b):
    return or_(and_(c, a), and_(not_(c), b))
  if a == b and type(a) is type(b):
    return a
  if c.op == "not":
    c, a, b = c.args[0], b, a
  return of_atom(_atom("ite", (c, a, b)))


def read(buf: str, idx: tuple):
  return of_atom(_atom("read", (buf, tuple(idx))))


def nonneg(x, depth: int = 6, memo=None) -> bool:
  """Whether ``x`` is never negative by a syntactic argument (sound, not
  complete): a constant >= 0 plus positive multiples of max(0, .) terms is;
  r - c max(0, d) (c > 0) is where both r and r - c d are (it is their
  minimum); r + c max(0, e) is where r + c e or r is (both are no larger)."""
  if type(x) is int:
    return x >= 0
  if type(x) is not Lin:
    return False
  if x.const >= 0 and all(c > 0 and a.op == "pos" for a, c in x.mono):
    return True
  if depth == 0:
    return False
  memo = {} if memo is None else memo
  hit = memo.get((x, depth))
  if hit is not None:
    return hit
  memo[(x, depth)] = False
  out = False
  downs = [(a, c) for a, c in x.mono if c < 0 and a.op == "pos"]
  if downs:
    a, c = downs[0]
    r = add(x, scale(of_atom(a), -c))
    out = nonneg(r, depth - 1, memo) and nonneg(add(r, scale(a.args[0], c)), depth - 1, memo)
  ups = [(a, c) for a, c in x.mono if c > 0 and a.op == "pos"]
  if not out and ups and len(ups) <= 3:
    for mask in range(1, 1 << len(ups)):
      y = x
      for i, (a, c) in enumerate(ups):
        if mask >> i & 1:
          y = add(y, scale(sub(a.args[0], of_atom(a)), c))
      if nonneg(y, depth - 1, memo):
        out = True
        break
  memo[(x, depth)] = out
  return out


def serialise(x, memo=None) -> str:
  """A text of ``x`` that two equal terms share in every process."""
  memo = {} if memo is None else memo
  t = type(x)
  if t is bool:
    return "T" if x else "F"
  if t is int or t is str or x is None:
    return str(x)
  if t is tuple:
    return "[" + ",".join(serialise(v, memo) for v in x) + "]"
  hit = memo.get(id(x))
  if hit is not None:
    return hit
  if t is Lin:
    out = "(" + "+".join(f"{c}*{serialise(a, memo)}" for a, c in x.mono) + f"+{x.const})"
  else:
    out = x.op + "{" + ",".join(serialise(a, memo) for a in x.args) + "}"
  memo[id(x)] = out
  return out
