"""How pytest-xdist workers share the GPUs of a host (properties/conftest.py).

Marker ``gpu``.  Under ``pytest -n N`` on a host with several GPUs each worker
must see exactly one, chosen round robin; on any host no worker may have
preallocated most of a GPU's memory.
"""

from __future__ import annotations

import os

import pytest

pytestmark = pytest.mark.gpu


def test_this_worker_uses_one_gpu_and_does_not_preallocate(record_property):
  import jax
  worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
  visible = os.environ.get("CUDA_VISIBLE_DEVICES", "(unset)")
  gpus = jax.devices("gpu")
  stats = gpus[0].memory_stats() or {}
  in_use = stats.get("bytes_in_use", 0)
  limit = stats.get("bytes_limit", 0)
  line = (f"worker {worker}: CUDA_VISIBLE_DEVICES={visible} sees {len(gpus)} GPU(s) "
          f"[{gpus[0].device_kind}], bytes_in_use={in_use}")
  print(line)
  record_property("gpu_assignment", line)
  assert os.environ.get("XLA_PYTHON_CLIENT_PREALLOCATE") == "false"
  # A preallocating client would hold ~75% of the card from the start.
  assert limit > 0, f"no memory statistics from {gpus[0]}: {stats}"
  assert in_use < 0.1 * limit, line
  host_gpus = [g for g in os.environ.get("FLASH_HOST_GPUS", "").split(",") if g]
  if worker.startswith("gw") and len(host_gpus) > 1:
    assert len(gpus) == 1, line
    assert visible == host_gpus[int(worker[2:]) % len(host_gpus)], line
