"""The protocol of any Pallas Mosaic GPU kernel, checked at the shapes given.

``prove_call(fn, *args)`` traces ``fn`` (any function that launches Mosaic
GPU kernels through ``plgpu.kernel`` or ``pallas_call``) on the CPU with
abstract arguments, finds every kernel in its jaxpr, reads each role's
events out of it (:func:`harness.proofs.extract.extract_kernel`: the same
reading of mbarriers, TMA copies, wgmma, fences and named barriers as for
ours) at every corner of its grid, and searches every interleaving of the
roles and of the copies' completions (:func:`harness.proofs.search.check`)
for the same violations.  Nothing here knows a kernel by name.

What it proves: the kernel at these shapes, at the grid points checked (the
first and last index of each grid axis), with every integer the kernel
reads from global memory taken as 0.  Ours is proved at every length by
``python -m harness prove``, which learns its role programs from probes
(:mod:`harness.proofs.role_programs`); a kernel of another author is read
here as its events stand, one unit per role.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import itertools
import sys
import time
import types

from harness.proofs import extract, jaxprs, role_programs, search
from harness.proofs.events import ExtractionError, UnknownPrimitive

# Mosaic GPU is built for CUDA 13 here (jax 0.11.2's cuda13 wheels).
_CUDA_RUNTIME = 13000


@dataclasses.dataclass(frozen=True)
class KernelResult:
  """One kernel of a traced call at one grid point: its verdict."""

  label: str          # the call's label, the kernel's number and grid point
  ok: bool
  states: int
  seconds: float
  violation: str = ""  # the search's report, or why the kernel could not be read

  def line(self) -> str:
    verdict = ("proven" if self.ok else "VIOLATION" if self.states
               else "NOTHING" if self.violation.startswith("nothing") else "UNREADABLE")
    return f"{self.label:<72} {verdict:<10} {self.states:>7} {self.seconds:6.2f}s"


@contextlib.contextmanager
def cpu_tracing():
  """Tracing for CUDA on a host without it: JAX's kernel modules that ask
  the CUDA runtime's version when they trace see one (jax._src.lib's
  ``cuda_versions`` is None without CUDA), and no kernel is compiled."""
  from kernel import api
  patched = [(m, m.cuda_versions) for m in list(sys.modules.values())
             if isinstance(m, types.ModuleType) and "cuda_versions" in vars(m)
             and m.cuda_versions is None]
  stub = types.SimpleNamespace(cuda_runtime_get_version=lambda: _CUDA_RUNTIME)
  for m, _ in patched:
    m.cuda_versions = stub
  try:
    with api.lowering_only():
      yield
  finally:
    for m, was in patched:
      m.cuda_versions = was


def _corners(mesh) -> list[dict]:
  """The first and last index of each grid and cluster axis, every combination."""
  names = tuple(getattr(mesh, "grid_names", ()) or ()) + tuple(getattr(mesh, "cluster_names", ()) or ())
  sizes = tuple(getattr(mesh, "grid", ()) or ()) + tuple(getattr(mesh, "cluster", ()) or ())
  ends = [sorted({0, size - 1}) for size in sizes]
  return [dict(zip(names, point)) for point in itertools.product(*ends)]


def _check(kernel_eqn, grid: dict, label: str) -> KernelResult:
  """Read one kernel at one grid point and search its interleavings."""
  start = time.perf_counter()
  try:
    ex = extract.extract_kernel(kernel_eqn, env=lambda buffer, index: 0, grid=grid, name=label,
                                every_index=True)
  except (ExtractionError, UnknownPrimitive) as err:
    return KernelResult(label, False, 0, time.perf_counter() - start,
                        f"the proof cannot read the kernel: {err}")
  if not any(ex.roles.values()):
    return KernelResult(label, False, 0, time.perf_counter() - start,
                        "nothing to check: no role synchronises here with the integers read "
                        "from global memory taken as 0 (their trip counts may come from them)")
  # One unit per role: its events as they stand, no loop cut into iterations.
  flat = dataclasses.replace(ex, loops={r: tuple(() for _ in evs) for r, evs in ex.roles.items()})
  prog = role_programs.concrete(label, 1, (flat, [0], "the shapes given"), persistent=False)
  result = search.check(prog)
  return KernelResult(label, result.ok, result.states, time.perf_counter() - start,
                      "" if result.ok else result.violation.format())


def prove_call(fn, *args, label: str = "") -> list[KernelResult]:
  """Every Mosaic GPU kernel ``fn(*args)`` launches (``args``: arrays or
  ``jax.ShapeDtypeStruct``), each at every corner of its grid: its verdict."""
  import jax
  import traceback
  try:
    with cpu_tracing():
      closed = jax.make_jaxpr(fn)(*args)
  except Exception as err:   # the author's code, any error: named with its line
    frame = traceback.extract_tb(err.__traceback__)[-1]
    raise ValueError(f"{label or fn}: the call failed to trace at {frame.filename}:"
                     f"{frame.lineno} ({frame.line}): {type(err).__name__}: {err}") from err
  kernels = jaxprs.find_kernels(closed.jaxpr, one_thread_too=True)
  if not kernels:
    raise ValueError(f"{label or fn}: the call launches no Mosaic GPU kernel")
  out = []
  for k, kernel_eqn in enumerate(kernels):
    for grid in _corners(kernel_eqn.params["meshes"][0]):
      at = ", ".join(f"{n} {i}" for n, i in grid.items())
      out.append(_check(kernel_eqn, grid, f"{label} kernel {k} at {at}".strip()))
  return out


def cases_of(spec: str):
  """``MODULE:FUNCTION``'s cases: the function returns (label, fn, args)
  triples, each a call to prove at its shapes."""
  module, sep, name = spec.partition(":")
  if not sep or not module or not name:
    raise ValueError(f"--kernel: expected MODULE:FUNCTION, got {spec!r}")
  return getattr(importlib.import_module(module), name)()


def prove_spec(spec: str) -> tuple[list[KernelResult], str]:
  """(every verdict of ``MODULE:FUNCTION``'s cases, the report to print)."""
  results = [r for label, fn, args in cases_of(spec) for r in prove_call(fn, *args, label=label)]
  lines = [r.line() for r in results]
  lines += [f"\n{r.label}:\n{r.violation}" for r in results if not r.ok]
  proven = sum(r.ok for r in results)
  lines.append(f"{proven}/{len(results)} proven: {spec}'s kernels at the shapes given, at the "
               f"first and last index of each grid axis, integers read from global memory 0")
  return results, "\n".join(lines)
