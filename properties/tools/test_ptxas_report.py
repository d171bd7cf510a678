"""ptxas's view of the shipped kernels (harness/tools/ptxas_report.py).

CPU: the report reads ptxas's own logs right (two logs as Mosaic GPU wrote
them on the H200: a forward whose wgmmas ptxas serialised, and a
backward kernel that spills).  GPU (marker ``gpu``): no shipped kernel kind
has its wgmmas serialised, which would cost it its tensor-core overlap.
"""

from __future__ import annotations

import pytest

from harness.numerics import strategies as hs
from harness.tools import ptxas_report as pr

# Each kind's lowering costs seconds: the ci profile lowers every third
# (docs/decisions/cpu-suite-time.md); thorough, all of them.
LOWERED_KINDS = hs.ci_sample(pr.KINDS, 3)

SERIALISED_LOG = """\
ptxas info    : (C7519) warpgroup.arrive is injected in around line 1550 by compiler to allow use of registers in GMMA in function 'kernel_body_mosaic_gpu_kernel'
ptxas info    : (C7513) Potential Performance Loss: wgmma.mma_async instructions are serialized due to non wgmma instructions defining input registers of a wgmma between start and end of the pipeline stage in the function 'kernel_body_mosaic_gpu_kernel'
ptxas info    : 0 bytes gmem
ptxas info    : Compiling entry function 'kernel_body_mosaic_gpu_kernel' for 'sm_90a'
ptxas info    : Function properties for kernel_body_mosaic_gpu_kernel
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 168 registers, used 16 barriers, 1 bytes smem
"""

SPILLING_LOG = """\
ptxas warning : Registers are spilled to local memory in function 'body_mosaic_gpu_kernel', 332 bytes spill stores, 340 bytes spill loads
ptxas info    : 0 bytes gmem
ptxas info    : Compiling entry function 'body_mosaic_gpu_kernel' for 'sm_90a'
ptxas info    : Function properties for body_mosaic_gpu_kernel
    336 bytes stack frame, 332 bytes spill stores, 340 bytes spill loads
ptxas info    : Used 168 registers, used 16 barriers, 336 bytes cumulative stack size, 1 bytes smem
"""


def test_a_serialised_kernel_is_reported_as_such():
  r = pr.parse_ptxas("fwd-d256-causal", "kernel_body_0", SERIALISED_LOG)
  assert r.serialised and r.registers == 168 and r.spill_bytes == 0
  assert "SERIALISED" in r.line()


def test_spills_are_counted_once_and_do_not_mark_serialisation():
  r = pr.parse_ptxas("bwd-d256-full", "body_1", SPILLING_LOG)
  assert not r.serialised and r.spill_bytes == 332 + 340 and r.registers == 168


def test_every_launch_kind_is_compiled():
  names = [k.name for k in pr.KINDS]
  assert len(set(names)) == len(names)
  assert {(k.head_dim, k.causal, k.backward) for k in pr.KINDS if not k.feature} == {
      (d, c, b) for d in (64, 128, 256) for c in (False, True) for b in (False, True)}
  assert {k.feature for k in pr.KINDS if k.feature} == set(pr.FEATURES)


@pytest.mark.parametrize("kind", LOWERED_KINDS, ids=lambda k: k.name)
def test_every_kind_lowers_for_cuda(kind):
  """The program each kind compiles on the GPU lowers here (so a kind that
  the API refuses fails on the CPU, not in the device's time)."""
  program = pr.program(kind)
  # The same calls, exported for CUDA instead of run (shapes only).
  program = program.replace("jax.block_until_ready(jax.jit(g)(q, k, v))",
                            "_lower(g, q, k, v)")
  program = program.replace("jax.block_until_ready(jax.jit(f)(q, k, v))",
                            "_lower(f, q, k, v)")
  def _lower(fn, *args):
    with api.lowering_only():
      text = jax.export.export(jax.jit(fn), platforms=["cuda"])(*args).mlir_module()
    assert "mosaic_gpu" in text
  import jax
  from kernel import api
  exec(program, {"_lower": _lower})


def test_unknown_kind_is_refused_by_name(capsys):
  with pytest.raises(SystemExit):
    pr.main(["--select", "fwd-d96-causal"])
  assert "fwd-d96-causal" in capsys.readouterr().err


@pytest.mark.gpu
@pytest.mark.parametrize("kind", pr.KINDS, ids=lambda k: k.name)
def test_no_shipped_kernel_has_its_wgmmas_serialised(kind, tmp_path):
  """Every kernel of the launch kind keeps its wgmma pipeline: ptxas
  serialised none of them (C7513)."""
  rows = pr.compile_kind(kind, str(tmp_path))
  print("\n".join(r.line() for r in rows))
  serialised = [r.line() for r in rows if r.serialised]
  assert not serialised, "\n".join(serialised)
