"""An on-disk memo for ``python -m harness prove``, keyed by the sources.

Three kinds of entries, each a pickle under ``.cache/prove/`` (git-ignored;
``HARNESS_PROVE_CACHE`` names another folder, ``--no-cache`` skips it):

* **learned**: a case's role programs (:func:`harness.proofs.prove_pool.prove`),
  with Z3's proof of their premise, under a digest of everything that
  decides them: every file of ``kernel/`` (the autotuner's cache included),
  the extraction, learning and premise modules of ``harness/``, the
  versions of Python, JAX, jaxlib, NumPy, ml_dtypes and Z3, and the ``JAX_*`` /
  ``XLA_*`` environment.
* **listed**: the list of cases, and a run where every emitted config had its
  representative's program (``harness/proofs/representatives.py``), under that
  digest with the problem grid's module and that one too.
* **checked**: a proof (:func:`harness.proofs.search.check`) of one program
  shape (:meth:`harness.proofs.role_programs.LaunchProgram.shape`), under a digest of
  the checker's sources only, so that a kernel edit that leaves a launch's
  program as it was (lines moved, say) does not search it again.

Only what passed is kept: a case whose premise failed and a check that found
a violation are recomputed on every run, so that their report is always
made from the current sources.  An entry that cannot be read counts as
missing.  A fresh clone has no cache: its run is the cold one.
"""

from __future__ import annotations

import hashlib
import os
import pickle
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DEFAULT_DIR = REPO / ".cache" / "prove"
ENV = "HARNESS_PROVE_CACHE"
# What the learned programs are made from (paths relative to the repository);
# not the command's own module, nor the mutants (whose runs skip the cache),
# so that an edit of what the command prints learns nothing again.
LEARN_SOURCES = ("kernel", "harness/proofs/extract.py", "harness/proofs/events.py",
                 "harness/proofs/memos.py",
                 "harness/proofs/jaxprs.py", "harness/proofs/kernel_lines.py",
                 "harness/proofs/role_programs.py",
                 "harness/proofs/tracing.py", "harness/proofs/probes.py",
                 "harness/proofs/symbolic_dims.py", "harness/proofs/forward_traces.py",
                 "harness/proofs/forward_probes.py", "harness/proofs/backward_traces.py",
                 "harness/proofs/backward_probes.py", "harness/proofs/premise_rounds.py",
                 "harness/proofs/prove_pool.py", "harness/proofs/cases.py",
                 "harness/proofs/symbolic.py", "harness/proofs/terms.py",
                 "harness/proofs/term_walks.py", "harness/proofs/z3_terms.py",
                 "harness/proofs/premise.py", "harness/proofs/prove_cache.py")
# What the list of cases is made from: the heuristics and plans (kernel/) and
# the problem grid of harness/proofs/prove.py.
LIST_SOURCES = LEARN_SOURCES + ("harness/proofs/prove.py", "harness/proofs/representatives.py")
# What a check's verdict is made from.
CHECK_SOURCES = ("harness/proofs/search.py", "harness/proofs/search_environment.py",
                 "harness/proofs/search_program.py", "harness/proofs/search_state.py",
                 "harness/proofs/search_steps.py", "harness/proofs/violations.py",
                 "harness/proofs/role_programs.py", "harness/proofs/events.py",
                 "kernel/sync/barriers.py", "harness/proofs/prove_cache.py")


def _files(paths):
  for rel in paths:
    p = REPO / rel
    if p.is_dir():
      yield from sorted(f for f in p.rglob("*") if f.is_file() and ".mutant_" not in f.name
                        and "__pycache__" not in f.parts and f.suffix != ".pyc")
    elif p.exists():
      yield p


def _versions() -> str:
  from importlib import metadata
  out = [sys.version]
  for dist in ("jax", "jaxlib", "numpy", "ml_dtypes", "z3-solver"):
    try:
      out.append(f"{dist}={metadata.version(dist)}")
    except metadata.PackageNotFoundError:
      out.append(f"{dist}=none")
  out += sorted(f"{k}={v}" for k, v in os.environ.items() if k.startswith(("JAX_", "XLA_")))
  return "\n".join(out)


def digest(paths) -> str:
  h = hashlib.sha256(_versions().encode())
  for f in _files(paths):
    h.update(b"\0" + str(f.relative_to(REPO)).encode() + b"\0" + f.read_bytes())
  return h.hexdigest()


class Cache:
  """``get(kind, key)`` / ``put(kind, key, value)``; kind "learned", "listed"
  or "checked", key a string (a ``repr`` of what the entry is for)."""

  def __init__(self, root: str | os.PathLike | None = None):
    self.root = Path(root or os.environ.get(ENV) or DEFAULT_DIR)
    self.digests = {"learned": digest(LEARN_SOURCES), "listed": digest(LIST_SOURCES),
                    "checked": digest(CHECK_SOURCES)}
    self.hits = {kind: 0 for kind in self.digests}

  def _path(self, kind: str, key: str) -> Path:
    name = hashlib.sha256(f"{self.digests[kind]}\0{key}".encode()).hexdigest()
    return self.root / kind / name[:2] / f"{name}.pkl"

  def get(self, kind: str, key: str):
    try:
      with open(self._path(kind, key), "rb") as f:
        stored_key, value = pickle.load(f)
    except Exception:  # noqa: BLE001 -- missing, partial or from other code: recompute
      return None
    if stored_key != key:
      return None
    self.hits[kind] += 1
    return value

  def put(self, kind: str, key: str, value) -> None:
    path = self._path(kind, key)
    try:
      path.parent.mkdir(parents=True, exist_ok=True)
      fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
      with os.fdopen(fd, "wb") as f:
        pickle.dump((key, value), f, protocol=pickle.HIGHEST_PROTOCOL)
      os.replace(tmp, path)
    except OSError:
      pass  # a read-only or full disk: the run goes on without its memo
