"""The terms of :mod:`harness.proofs.terms` for Z3: an SMT-LIB 2 script for a
solver to parse (:func:`smt2`), or Z3's own expressions within one solver
(:class:`Z3Terms`).  Z3 itself is the caller's import."""

from __future__ import annotations

from harness.proofs.terms import Atom, Lin


def smt2(query) -> str:
  """``query`` (a Bool term) as an SMT-LIB 2 script of declarations and
  assertions, for a solver to parse (faster than building its terms one
  call at a time): every div / rem atom as a quotient and a remainder with
  linear constraints, reads as uninterpreted functions."""
  decls: dict = {}
  side: list = []
  memo: dict = {}

  def num(c):
    return str(c) if c >= 0 else f"(- {-c})"

  def name(v):
    return "|" + v.replace("|", "/") + "|"

  def term(x):
    t = type(x)
    if t is bool:
      return "true" if x else "false"
    if t is int:
      return num(x)
    hit = memo.get(x)
    if hit is not None:
      return hit
    if t is Lin:
      parts = [atom(a) if c == 1 else f"(* {num(c)} {atom(a)})" for a, c in x.mono]
      if x.const:
        parts.append(num(x.const))
      out = parts[0] if len(parts) == 1 else "(+ " + " ".join(parts) + ")"
    elif t is Atom:
      out = atom(x)
    else:
      args = [term(a) for a in x.args]
      out = {"lt0": lambda: f"(< {args[0]} 0)", "le0": lambda: f"(<= {args[0]} 0)",
             "eq0": lambda: f"(= {args[0]} 0)", "not": lambda: f"(not {args[0]})",
             "and": lambda: "(and " + " ".join(args) + ")",
             "or": lambda: "(or " + " ".join(args) + ")"}[x.op]()
    memo[x] = out
    return out

  def atom(a):
    hit = memo.get(a)
    if hit is not None:
      return hit
    if a.op == "var":
      out = name(a.args[0])
      decls[out] = f"(declare-const {out} Int)"
    elif a.op == "pos":
      v = term(a.args[0])
      out = f"(ite (> {v} 0) {v} 0)"
    elif a.op == "ite":
      out = f"(ite {term(a.args[0])} {term(a.args[1])} {term(a.args[2])})"
    elif a.op == "read":
      buf, idx = a.args
      f = name(f"read.{buf}.{len(idx)}")
      decls[f] = f"(declare-fun {f} ({' '.join(['Int'] * len(idx))}) Int)"
      out = f"({f} {' '.join(term(i) for i in idx)})" if idx else f
    elif a.op == "mul":
      out = f"(* {term(a.args[0])} {term(a.args[1])})"
    else:  # div / rem by a positive constant or term, truncating toward zero
      v, c = term(a.args[0]), term(a.args[1])
      k = len(decls)
      q, r = f"|q.{k}|", f"|r.{k}|"
      decls[q], decls[r] = f"(declare-const {q} Int)", f"(declare-const {r} Int)"
      side.append(f"(assert (= {v} (+ (* {c} {q}) {r})))")
      side.append(f"(assert (=> (>= {v} 0) (and (>= {r} 0) (< {r} {c}))))")
      side.append(f"(assert (=> (< {v} 0) (and (<= {r} 0) (> {r} (- {c})))))")
      out = q if a.op == "div" else r
    memo[a] = out
    return out

  body = term(query)
  return "\n".join([*decls.values(), *side, f"(assert {body})"])


class Z3Terms:
  """Terms as Z3 expressions, within one solver: every div / rem atom gets
  a quotient and a remainder bound by linear constraints (kept in
  :attr:`side`), reads become uninterpreted functions."""

  def __init__(self, z3):
    self.z3 = z3
    self.memo: dict = {}
    self.side: list = []
    self.funcs: dict = {}
    self.vars: dict = {}

  def var(self, name):
    v = self.vars.get(name)
    if v is None:
      v = self.vars[name] = self.z3.Int(name)
    return v

  def __call__(self, x):
    z3 = self.z3
    t = type(x)
    if t is bool:
      return z3.BoolVal(x)
    if t is int:
      return z3.IntVal(x)
    hit = self.memo.get(x.key)
    if hit is not None:
      return hit
    if t is Lin:
      parts = [self.atom(a) if c == 1 else c * self.atom(a) for a, c in x.mono]
      out = parts[0] if len(parts) == 1 else z3.Sum(parts)
      if x.const:
        out = out + x.const
    elif t is Atom:
      out = self.atom(x)
    else:
      args = [self(a) for a in x.args]
      if x.op == "lt0":
        out = args[0] < 0
      elif x.op == "le0":
        out = args[0] <= 0
      elif x.op == "eq0":
        out = args[0] == 0
      elif x.op == "not":
        out = z3.Not(args[0])
      elif x.op == "and":
        out = z3.And(args)
      else:
        out = z3.Or(args)
    self.memo[x.key] = out
    return out

  def atom(self, a: Atom):
    z3 = self.z3
    hit = self.memo.get(a.key)
    if hit is not None:
      return hit
    if a.op == "var":
      out = self.var(a.args[0])
    elif a.op == "pos":
      v = self(a.args[0])
      out = z3.If(v > 0, v, 0)
    elif a.op == "ite":
      out = z3.If(self(a.args[0]), self(a.args[1]), self(a.args[2]))
    elif a.op == "read":
      buf, idx = a.args
      f = self.funcs.get((buf, len(idx)))
      if f is None:
        f = self.funcs[(buf, len(idx))] = z3.Function(
            f"read.{buf}", *([z3.IntSort()] * (len(idx) + 1)))
      out = f(*[self(i) for i in idx]) if idx else f()
    elif a.op == "mul":
      out = self(a.args[0]) * self(a.args[1])
    else:  # div / rem by a positive constant or term, truncating toward zero
      v = self(a.args[0])
      c = self(a.args[1])
      n = len(self.memo)
      q, r = z3.Int(f"q{n}"), z3.Int(f"r{n}")
      self.side += [v == c * q + r,
                    z3.Implies(v >= 0, z3.And(r >= 0, r < c)),
                    z3.Implies(v < 0, z3.And(r <= 0, r > -c))]
      out = q if a.op == "div" else r
      self.memo[a.key] = out
      self.memo[("other", a.key)] = r if a.op == "div" else q
    self.memo[a.key] = out
    return out
