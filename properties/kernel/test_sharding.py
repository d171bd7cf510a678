"""Attention on a mesh, without a GPU: the program XLA partitions for CUDA
runs each device's kernels at its local shape and moves no attention operand.

``harness.tools.mesh_lowering`` runs in a subprocess (four host devices must be
set before jax initialises, and pytest's process already has it
initialised): for batch, head and batch x head meshes it lowers the forward
and ``jax.grad`` for CUDA, lets XLA's pipeline partition them through
``kernel/sharding.py``'s rule, and reads the optimised program (how, and why
``jax.export`` cannot, is in its docstring).  The tests below hold that
program to the contract of ``kernel/sharding.py``.
"""

from __future__ import annotations

import fcntl
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from harness.numerics import strategies as hs
from harness.tools import mesh_lowering
from kernel.tiling import backward_plan

ROOT = Path(__file__).resolve().parents[2]
CASES = {c.name: c for c in mesh_lowering.CASES}


# Shardy is jax 0.11.2's partitioner; GSPMD (deprecated, still selectable
# with jax_use_shardy_partitioner=False) calls the rule through other hooks.
# The 'data' axis of the 2 x 2 mesh as GSPMD's replica groups: devices
# (0, 2) and (1, 3).  Each partitioner's report is a subprocess of about 40 s
# on a 2-core machine: the ci profile checks Shardy's, the thorough profile
# (properties/conftest.py) both.
PARTITIONERS = {"shardy": "{'data'}", "gspmd": "{{0,2},{1,3}}"}
CHECKED = (list(PARTITIONERS) if hs.thorough()
           else ["shardy"])


@pytest.fixture(scope="module", params=CHECKED)
def report(request, tmp_path_factory):
  """The partitioner's report, made once per pytest run: under xdist every
  worker that runs this module would make its own (a subprocess of about
  40 s on 2 cores), so the first writes it beside the workers' temporary
  directories, under a lock, and the others read it."""
  shared = tmp_path_factory.getbasetemp()
  if os.environ.get("PYTEST_XDIST_WORKER"):
    shared = shared.parent      # the run's directory, above each worker's own
  path = shared / f"mesh-report-{request.param}.json"
  with open(shared / f"mesh-report-{request.param}.lock", "w") as lock:
    fcntl.flock(lock, fcntl.LOCK_EX)
    if not path.exists():
      env = dict(os.environ, JAX_PLATFORMS="cpu",
                 JAX_USE_SHARDY_PARTITIONER=str(request.param == "shardy").lower(),
                 XLA_FLAGS=f"--xla_force_host_platform_device_count={mesh_lowering.HOST_DEVICES}")
      proc = subprocess.run([sys.executable, "-m", "harness.tools.mesh_lowering"], cwd=ROOT,
                            env=env, capture_output=True, text=True, timeout=300)
      assert proc.returncode == 0, proc.stderr[-4000:]
      path.write_text(proc.stdout)
  return dict(json.loads(path.read_text()), partitioner=request.param)


def _expected_launches(case) -> int:
  if not case.gradients:
    return 1
  _, _, _, H, _, _ = case.dims
  return 1 + len(backward_plan.launches(H, H, with_bias=case.bias is not None,
                                        causal=dict(case.kwargs).get("is_causal", False)))


def test_the_cases_take_both_dq_paths():
  """The fused dQ (its float32 accumulator inside the partitioned program)
  and the dQ kernel are both partitioned by some case."""
  counts = {_expected_launches(c) for c in mesh_lowering.CASES if c.gradients}
  assert counts == {2, 3}, counts


@pytest.mark.parametrize("name", list(CASES))
def test_each_device_launches_the_kernels_of_its_local_shape(report, name):
  """Every kernel launch of the partitioned program has exactly the operand
  and result shapes of the single-device program run on one device's shard
  (batch and heads divided by their shard counts, broadcast axes whole), and
  there are as many launches: forward, and the backward's (dK/dV, and the
  dQ kernel where the fused dQ does not apply: kernel.tiling.backward_plan.launches)."""
  case = report["cases"][name]
  launches = sorted(case["launches"], key=json.dumps)
  local = sorted(case["local_launches"], key=json.dumps)
  assert launches, "no kernel launch in the partitioned program"
  assert all(launch["operands"] for launch in launches), launches
  assert len(launches) == _expected_launches(CASES[name]), launches
  assert launches == local, (case["local_shapes"], launches, local)
  B, T, N, H, S, K = CASES[name].dims
  query = case["local_shapes"]["query"]
  assert query[0] * query[2] < B * N, "the case shards nothing"


def _sums_dbias_over_batch(case) -> bool:
  """A gradient through a bias broadcast over a sharded batch."""
  return bool(case.gradients and case.bias is not None and case.bias[0][0] == 1
              and case.qkv_spec[0] is not None)


@pytest.mark.parametrize("name", list(CASES))
def test_no_collective_moves_an_attention_operand(report, name):
  """No all-gather, all-to-all, collective-permute or reduce-scatter
  anywhere, forward or backward; the one all-reduce allowed is the sum of
  dbias over a mesh axis the bias broadcasts over (a (1, N, T, S) bias with
  the batch sharded), and only over that axis."""
  found = report["cases"][name]["collectives"]
  moved = [c for c in found if c["op"] != "all-reduce"]
  assert not moved, moved
  reduces = [c for c in found if c["op"] == "all-reduce"]
  if _sums_dbias_over_batch(CASES[name]):
    B, T, N, H, S, K = CASES[name].dims
    assert len(reduces) == 1, reduces
    assert reduces[0]["result"].endswith(f"[1,{N // 2},{T},{S}]"), reduces
    assert PARTITIONERS[report["partitioner"]] in reduces[0]["groups"], reduces
  else:
    assert not reduces, reduces


@pytest.mark.parametrize("name,want", [(n, w) for n, _, w in mesh_lowering.REFUSALS],
                         ids=[n for n, _, _ in mesh_lowering.REFUSALS])
def test_sharded_sequence_head_dim_or_split_gqa_group_is_refused(report, name, want):
  """Sharding a sequence axis (of the query, the key, a bias) or the head
  dim, or heads that split a GQA group, stops the compile with the rule's
  ValueError naming the operand, its axis and the mesh axes (XLA calls the
  rule, so JAX re-raises it as a JaxRuntimeError holding that message;
  with Explicit mesh axes the ValueError itself, while tracing)."""
  err = report["refusals"][name]
  assert err is not None, f"{name}: compiled without an error"
  assert f"ValueError: {want}" in err, err[-2000:]
  if name.endswith("-explicit"):
    assert err.startswith(f"ValueError: {want}"), err[:2000]


def test_the_rule_reads_only_named_shardings():
  """Outside the partitioner: a sharding that is not a NamedSharding (no
  mesh axis names for the dbias sum) is refused with a ValueError."""
  import jax
  import jax.numpy as jnp
  from kernel import sharding
  arg = jax.ShapeDtypeStruct((2, 128, 2, 64), jnp.bfloat16,
                             sharding=jax.sharding.SingleDeviceSharding(jax.devices()[0]))
  with pytest.raises(ValueError, match="NamedSharding"):
    sharding.layout_of(None, ("query", "key", "value"), (arg, arg, arg))


def test_the_sharded_benchmark_programs_lower_for_cuda_and_render():
  """``python -m harness.tools.bench_sharded`` times these programs (forward, and
  forward + backward with no bias); they lower for CUDA without a GPU, and
  the table reports per-device TFLOP/s and their ratio."""
  import jax
  import jax.numpy as jnp
  from harness.tools import bench, bench_sharded
  from kernel import api
  shape = bench.BenchShape(1, 256, 2, 64, True)
  big = jax.ShapeDtypeStruct((1, 256, 2, 64), jnp.bfloat16)
  with api.lowering_only():
    attention = bench_sharded._attention(shape.causal)
    assert jax.export.export(jax.jit(attention), platforms=["cuda"])(big, big, big).out_avals
    grads = jax.jit(bench._with_backward(attention))
    d_out = jax.ShapeDtypeStruct(big.shape, jnp.float32)
    assert len(jax.export.export(grads, platforms=["cuda"])(big, big, big, None, d_out).out_avals) == 3
  row = {"devices": 2, "device": "H200", "jax": "0.11.2", "pass": "forward",
         "per_device_shape": dict(batch=4, seq=4096, heads=16, head_dim=128, causal=False),
         "single_tflops": 600.0, "sharded_tflops_per_device": 582.0, "ratio": 0.97}
  assert bench_sharded.render(row).splitlines()[-1] == (
      "| 4 | 4096 | 16 | 128 | False | 600.0 | 582.0 | 0.970 |")


@pytest.mark.parametrize("name", [c.name for c in mesh_lowering.CASES if c.gradients])
def test_the_partitioned_program_computes_what_one_device_does(report, name):
  """Executed, not only lowered: with the kernels replaced by a float32 jnp
  stand-in of the same operands and results (``harness.tools.mesh_lowering``, only
  there), the program partitioned by the rule over 4 host devices gives the
  one-device out, m, l and gradients (dbias summed over the batch where it
  broadcasts) to float32 rounding, and its output stays spread over the
  devices.  A wrong GQA grouping, a missing or doubled dbias sum, or
  results reassembled in the wrong order are off by O(1)."""
  got = report["stand_in"][name]
  assert got["out_devices"] == mesh_lowering.HOST_DEVICES, got
  for field, diff in got["max_abs_diff"].items():
    assert diff <= 1e-5 * max(1.0, got["max_abs"][field]), (field, got)
