"""Hypothesis profiles and the ``gpu`` marker for the property tests.

Profiles, chosen by the environment variable HYPOTHESIS_PROFILE:

* ``ci`` (default): a few dozen examples per property, fast on a CPU;
* ``gpu``: for runs on an H100/H200 where the kernel is compiled per shape;
* ``thorough``: many examples, for a long run before a release.

Tests marked ``gpu`` need an sm90 GPU (compute capability 9.0) visible to JAX;
elsewhere they are skipped with the reason shown in the summary (``-rs``).
"""

from __future__ import annotations

import functools
import os


def _share_the_gpus() -> None:
  """Before JAX is imported in this process: no xdist worker may take most of
  a GPU's memory (JAX preallocates 75% by default), and on a host with several
  GPUs each worker uses its own (round robin over the visible ones)."""
  os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
  worker = os.environ.get("PYTEST_XDIST_WORKER", "")
  if not worker.startswith("gw"):
    return
  visible = os.environ.get("CUDA_VISIBLE_DEVICES")
  if visible is not None:
    gpus = [g for g in visible.split(",") if g.strip()]
  else:
    gpus = sorted(d for d in os.listdir("/dev") if d[len("nvidia"):].isdigit()
                  and d.startswith("nvidia")) if os.path.isdir("/dev") else []
    gpus = [g[len("nvidia"):] for g in gpus]
  # Kept for properties/tools/test_gpu_sharing.py, which checks the assignment.
  os.environ["FLASH_HOST_GPUS"] = ",".join(gpus)
  if len(gpus) > 1:
    os.environ["CUDA_VISIBLE_DEVICES"] = gpus[int(worker[2:]) % len(gpus)]


_share_the_gpus()

import pytest  # noqa: E402
from hypothesis import HealthCheck, Phase, settings

_common = dict(
  deadline=None,
  print_blob=True,
  derandomize=False,
  suppress_health_check=(HealthCheck.too_slow, HealthCheck.data_too_large),
)
# ci: derandomized, so a CI verdict is reproducible run to run (the same
# examples every time; print_blob still reproduces a failure); the gpu and
# thorough profiles draw fresh examples on every run to keep exploring.
settings.register_profile("ci", max_examples=30, **{**_common, "derandomize": True})
# Every phase but the shrink: a failure is reported as first drawn.
_NO_SHRINK = (Phase.explicit, Phase.reuse, Phase.generate)
# gpu: fresh examples, reported as drawn.  On the H200 each shrink step
# compiles kernels for a new shape: shrinking a drawn gradient case that
# broke the rule ran past the 300 s per-test watchdog, which stopped the
# worker before Hypothesis printed the example, so the failure named no
# case.  An unshrunk example with its note() is a report; a killed
# shrink is none.
settings.register_profile("gpu", max_examples=50, phases=_NO_SHRINK, **_common)
settings.register_profile("thorough", max_examples=1000, **_common)
# mutants: the ci examples without shrinking.  A mutant needs one failing
# example, not the smallest: shrinking a broken kernel's failure took the
# residual-rows property past its 60 s watchdog on the H200.
settings.register_profile("mutants", max_examples=30, phases=_NO_SHRINK,
                          **{**_common, "derandomize": True})
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


def pytest_configure(config):
  config.addinivalue_line(
    "markers", "gpu: needs an sm90 (H100/H200) GPU visible to JAX")
  config.addinivalue_line("markers", "slow: takes more than a few seconds")
  config.addinivalue_line(
    "markers", "smoke: one call of every shipped path (the gate's smoke step)")


@functools.cache
def _sm90_unavailable_reason() -> str | None:
  """None when JAX sees an sm90 GPU, else why not."""
  try:
    import jax
    devices = jax.devices("gpu")
  except Exception as err:  # no CUDA plugin, no driver, no device
    return f"no GPU visible to JAX ({type(err).__name__}: {err})"
  capabilities = [getattr(d, "compute_capability", None) for d in devices]
  if "9.0" not in capabilities:
    return f"needs compute capability 9.0 (sm90), found {capabilities}"
  return None


def pytest_addoption(parser):
  parser.addoption(
    "--part", default=None, metavar="K/N",
    help="run only part K of N of the selected tests (1-based): the tests in "
         "node-id order, every N-th from the K-th, so that each part gets a share "
         "of every file and N parts together run each test once")


def parse_part(spec: str) -> tuple[int, int]:
  """(K, N) of a ``--part K/N`` value, checked: 1 <= K <= N."""
  try:
    k, n = (int(x) for x in spec.split("/"))
  except ValueError:
    raise pytest.UsageError(f"--part: expected K/N (say 1/3), got {spec!r}") from None
  if not 1 <= k <= n:
    raise pytest.UsageError(f"--part: need 1 <= K <= N, got {spec!r}")
  return k, n


def _keep_part(config, items) -> None:
  """Deselect every test outside ``--part K/N``.  Node-id order is the same in
  every xdist worker, so the workers agree on the part."""
  spec = config.getoption("--part")
  if spec is None:
    return
  k, n = parse_part(spec)
  order = {item.nodeid: i for i, item in enumerate(sorted(items, key=lambda it: it.nodeid))}
  kept = [item for item in items if order[item.nodeid] % n == k - 1]
  dropped = [item for item in items if order[item.nodeid] % n != k - 1]
  if dropped:
    config.hook.pytest_deselected(items=dropped)
  items[:] = kept


# Last, so that --part splits what -m and -k left (pytest's own deselection).
@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config, items):
  _keep_part(config, items)
  gpu_items = [item for item in items if item.get_closest_marker("gpu")]
  if not gpu_items:
    return
  reason = _sm90_unavailable_reason()
  if reason is None:
    return
  skip = pytest.mark.skip(reason=f"gpu test skipped: {reason}")
  for item in gpu_items:
    item.add_marker(skip)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
  """Each test under harness.tools.watchdog's time limit (FLASH_TEST_TIMEOUT)."""
  from harness.tools import watchdog
  try:
    limit = watchdog.test_timeout()
  except ValueError as err:
    raise pytest.UsageError(str(err)) from None
  capture = item.config.pluginmanager.getplugin("capturemanager")
  release = (lambda: capture.suspend_global_capture(in_=False)) if capture else (lambda: None)
  with watchdog.armed(item.nodeid, limit, release):
    yield
