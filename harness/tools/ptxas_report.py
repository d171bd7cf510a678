"""``python -m harness ptxas``: what ptxas made of every shipped kernel kind.

Each launch kind (forward and forward + backward at head dims 64 / 128 / 256,
causal and not, ``config=None``, and the arguments that change the kernel's
code: :data:`FEATURES`) is compiled once in a child process with
Mosaic GPU's dumps on (``MOSAIC_GPU_DUMP_PTXAS``, ``MOSAIC_GPU_DUMP_PTX``,
``MOSAIC_GPU_DUMP_TO``); the report gives, per kernel, the registers, the
stack frame and spill bytes, and whether ptxas **serialised the wgmmas**
(its message C7513: a non-wgmma instruction defines an input register of a
wgmma still in flight, so every wgmma of the kernel is followed by a wait).
A serialised kernel loses its tensor-core overlap: the d256 causal
forward ran at half its speed so (docs/decisions/pv-operand-cast-after-pv.md).
Spills are reported, not refused.

Needs an sm90 GPU (the compile happens when the kernel is first run).
``--out DIR`` keeps the PTX and ptxas logs.
"""

from __future__ import annotations

import argparse
import dataclasses
import glob
import os
import re
import subprocess
import sys
import tempfile

SERIALISED = "C7513"
HEAD_DIMS = {64: 32, 128: 16, 256: 8}   # head dim -> query heads (16k tokens of d x heads = 2048)


@dataclasses.dataclass(frozen=True)
class Kind:
  head_dim: int
  causal: bool
  backward: bool
  feature: str = ""    # a key of FEATURES: the call's other arguments

  @property
  def name(self) -> str:
    return (f"{'bwd' if self.backward else 'fwd'}-d{self.head_dim}-"
            f"{'causal' if self.causal else 'full'}{'-' + self.feature if self.feature else ''}")


# Arguments that change the kernel's code (not only its tiling), each
# compiled once beside the plain kinds: the deferred rescale, a staged 2-D
# bias, the soft cap, per-row key ranges (jax.nn's lengths), a local window.
FEATURES = {
    "threshold0.5": "rescale_threshold=0.5",
    "bias2d": "bias=jax.random.normal(ks[0], (1, {heads}, 4096, 4096), jnp.bfloat16)",
    "softcap": "logits_soft_cap=30.0",
    "lengths": "key_value_seq_lengths=jnp.array([3000], jnp.int32)",
    "window": "local_window_size=(1024, 0)",
    # Three compute warpgroups at 160 registers each (kernel/forward/context.py's
    # COMPUTE_REGISTERS), in the one tiling they run: whether the key loop
    # fits them without spills.
    "three-warpgroups": "config=Config(*THREE_WARPGROUP_TILING, {persistent}, "
                        "compute_warpgroups=3)",
}


@dataclasses.dataclass(frozen=True)
class KernelReport:
  kind: str
  kernel: str          # the dump's file stem: one per launch
  registers: int | None
  spill_bytes: int     # stores + loads
  serialised: bool

  def line(self) -> str:
    flags = " SERIALISED (C7513)" if self.serialised else ""
    return (f"{self.kind:18s} {self.kernel:16s} {self.registers or '?':>4} registers  "
            f"{self.spill_bytes:5d} spill bytes{flags}")


KINDS = tuple(Kind(d, c, b) for d in HEAD_DIMS for c in (False, True) for b in (False, True)) + (
    Kind(128, False, False, "threshold0.5"), Kind(128, True, False, "bias2d"),
    Kind(128, False, True, "bias2d"), Kind(128, False, False, "softcap"),
    Kind(64, False, True, "lengths"), Kind(128, True, False, "window"),
    Kind(64, False, False, "three-warpgroups"), Kind(64, True, False, "three-warpgroups"))

_PROGRAM = """
import jax, jax.numpy as jnp
from kernel import api
from kernel.tiling.config import Config
from kernel.tiling.plan import THREE_WARPGROUP_TILING
ks = jax.random.split(jax.random.key(0), 3)
q, k, v = (jax.random.normal(s, (1, 4096, {heads}, {d}), jnp.bfloat16) for s in ks)
f = lambda q, k, v: api.dot_product_attention(q, k, v, is_causal={causal}, {extra})
if {backward}:
  g = jax.grad(lambda q, k, v: f(q, k, v).astype(jnp.float32).sum(), argnums=(0, 1, 2))
  jax.block_until_ready(jax.jit(g)(q, k, v))
else:
  jax.block_until_ready(jax.jit(f)(q, k, v))
"""


def parse_ptxas(kind: str, kernel: str, text: str) -> KernelReport:
  """One kernel's ptxas log (``-v`` output) read into a report."""
  regs = re.search(r"Used (\d+) registers", text)
  spills = [int(n) for n in re.findall(r"(\d+) bytes spill (?:stores|loads)", text)]
  # ptxas prints the spill line twice (a warning and the properties); count once.
  spill = sum(spills[-2:]) if spills else 0
  return KernelReport(kind, kernel, int(regs.group(1)) if regs else None, spill,
                      SERIALISED in text)


def program(kind: Kind) -> str:
  """The Python program that compiles ``kind`` (run in a child process)."""
  heads = HEAD_DIMS[kind.head_dim]
  extra = (FEATURES[kind.feature].format(heads=heads, persistent=not kind.causal)
           if kind.feature else "")
  return _PROGRAM.format(heads=heads, d=kind.head_dim, causal=kind.causal,
                         backward=kind.backward, extra=extra)


def compile_kind(kind: Kind, dump: str, timeout: float = 180.0) -> list[KernelReport]:
  os.makedirs(dump, exist_ok=True)
  code = program(kind)
  env = dict(os.environ, MOSAIC_GPU_DUMP_PTXAS="1", MOSAIC_GPU_DUMP_PTX="1",
             MOSAIC_GPU_DUMP_TO=dump)
  run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                       timeout=timeout)
  if run.returncode:
    raise RuntimeError(f"{kind.name}: the compile failed:\n{run.stderr[-2000:]}")
  for path in glob.glob(os.path.join(dump, "*")):
    if not path.endswith((".ptx", ".ptxas")):
      os.remove(path)   # the MLIR pass log alone runs to ~100 MB per kernel
  reports = []
  for path in sorted(glob.glob(os.path.join(dump, "*.ptxas"))):
    stem = os.path.basename(path)[:-len(".ptxas")]
    with open(path) as fh:
      reports.append(parse_ptxas(kind.name, stem, fh.read()))
  if not reports:
    raise RuntimeError(f"{kind.name}: Mosaic GPU wrote no ptxas log under {dump}")
  return reports


def report(kinds=KINDS, out: str | None = None) -> list[KernelReport]:
  root = out or tempfile.mkdtemp(prefix="ptxas-")
  rows = []
  for kind in kinds:
    rows += compile_kind(kind, os.path.join(root, kind.name))
  return rows


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(prog="python -m harness ptxas", description=__doc__.split("\n")[0])
  parser.add_argument("--out", default=None, help="keep the PTX and ptxas logs here")
  parser.add_argument("--select", default=None,
                      help="comma-separated kind names (e.g. fwd-d256-causal,bwd-d128-full)")
  args = parser.parse_args(argv)
  kinds = KINDS
  if args.select:
    names = {k.name: k for k in KINDS}
    unknown = sorted(set(args.select.split(",")) - set(names))
    if unknown:
      parser.error(f"--select: unknown kind(s) {unknown}; known: {sorted(names)}")
    kinds = tuple(names[n] for n in args.select.split(","))
  rows = report(kinds, args.out)
  for r in rows:
    print(r.line())
  bad = [r for r in rows if r.serialised]
  print(f"{len(rows)} kernels, {len(bad)} with serialised wgmmas, "
        f"{sum(1 for r in rows if r.spill_bytes)} with spills")
  return 1 if bad else 0


if __name__ == "__main__":
  raise SystemExit(main())
