"""The autotune cache as ``config=None`` reads it: which config to run.

Results are kept per (device, shape signature, dtype, features) in a JSON
cache; the cache shipped with the package (``autotune_cache.json`` beside this
file) holds H200 entries, and ``config=None`` uses it when it has the call's
signature, else the nearest entry tuned for the same mask and arguments,
of the same head dims or else the narrowest wider ones (:func:`nearest`),
else the heuristic (:func:`choose`).  A GPU
the cache has no entries for (an H100) reads the H200's
(:func:`tuned_device_kind`).

The cache is ``{device_kind: {signature: entry}}``: the top level is keyed by
``jax.Device.device_kind`` ("NVIDIA H200"), so entries for another GPU (an
H100) sit beside the H200's without touching them.  An entry holds the
chosen ``config`` (``Config``'s fields) and every candidate's ``median_ms``;
newer entries add the ``date``, the ``jax`` version and the ``shape`` they
were tuned at.  Only ``config`` is read here, so entries with or without
those fields are read alike.

Timing the candidates and writing the cache is the harness's job
(``python -m harness autotune``, ``harness/tools/autotune.py``): the kernel package
only reads what the autotuner timed.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import re
from pathlib import Path

from kernel.tiling import heuristics, plan
from kernel.tiling.config import Config

CACHE_PATH = Path(__file__).with_name("autotune_cache.json")


def _pow2(n: int) -> int:
  return 1 if n <= 1 else 1 << (n - 1).bit_length()


def selection_problem(problem: plan.Problem) -> plan.Problem:
  """The problem a config is chosen (and tuned) for: with residuals, so the
  choice also fits the forward of ``jax.grad``, which stores them for the
  backward.  The API's lookup and the tuner both go through here, so what is
  tuned is what is found."""
  return problem.replace(return_residuals=True)


def signature(problem: plan.Problem, *, has_bias=False, has_mask=False,
              has_key_ranges=False) -> str:
  """Calls that share a signature share a best config: sequence lengths are
  bucketed to the next power of two."""
  return (f"{plan.np.dtype(problem.dtype).name}-d{problem.head_dim}-dv{problem.head_dim_out}"
          f"-q{_pow2(problem.seq_q)}-kv{_pow2(problem.seq_kv)}"
          f"-{'causal' if problem.mask.causal else 'full'}"
          f"{'-bias' if has_bias else ''}"
          f"{'-mask' if has_mask else ''}{'-ranges' if has_key_ranges else ''}")


def load_cache(path: Path | None = None) -> dict:
  path = CACHE_PATH if path is None else path
  if not path.exists():
    return {}
  data = json.loads(path.read_text())
  if not isinstance(data, dict):
    raise ValueError(f"{path}: expected a JSON object of device -> signature -> entry")
  return data


def _cache_as_read(path: Path | None) -> dict:
  """:func:`load_cache` for the lookups, which only read it: parsed once
  per version of the file (every config=None call and every problem of a
  grid asks)."""
  path = CACHE_PATH if path is None else path
  try:
    stat = path.stat()
  except FileNotFoundError:
    return {}
  return _parsed(path, stat.st_mtime_ns, stat.st_size)


@functools.lru_cache(maxsize=8)
def _parsed(path: Path, mtime_ns: int, size: int) -> dict:
  return load_cache(path)


def entry_config(entry: dict) -> Config | None:
  """The entry's config, or None where this kernel cannot run it: a field
  or value its ``Config`` does not know (an entry written by another
  version of the kernel is skipped, never a failed call)."""
  try:
    return Config(**entry["config"])
  except (KeyError, TypeError, ValueError):
    return None


def lookup(problem: plan.Problem, device_kind: str, *, path: Path | None = None,
           **features) -> Config | None:
  """The cached best config, if it is still a legal candidate for the problem."""
  entry = _cache_as_read(path).get(device_kind, {}).get(signature(problem, **features))
  config = None if entry is None else entry_config(entry)
  # A cache written for another shape in the same bucket must still fit.
  if config is None or not plan.config_fits(problem, config):
    return None
  return config


# signature()'s parts, read back (properties/kernel/test_autotune.py checks that it
# reads every signature signature() writes).
_SIGNATURE = re.compile(r"(?P<dtype>[a-z0-9_]+)-(?P<head>d\d+-dv\d+)-q(?P<q>\d+)-kv(?P<kv>\d+)"
                        r"-(?P<rest>.+)")
# Tiling behaves alike for the two 16-bit dtypes (same bytes per element, same
# tensor-core rate): one's entries stand in for the other's.  FP8's stand
# only for FP8's (half the bytes, twice the rate: other tilings win).
SIXTEEN_BIT = ("bfloat16", "float16")
FAMILIES = (SIXTEEN_BIT, ("float8_e4m3fn",))


def _family(dtype: str) -> tuple[str, ...]:
  return next((f for f in FAMILIES if dtype in f), ())


def nearest(problem: plan.Problem, device_kind: str, *, path: Path | None = None,
            **features) -> tuple[str, Config] | None:
  """(signature, config): the cached entry nearest to ``problem``'s own
  signature among those of the same device, mask and features (``-bias``,
  ``-mask``, ``-ranges``) and dtype family (the 16-bit dtypes; FP8),
  whose config fits the problem.
  Nearest: entries of the same head dims first, then those of wider head
  dims (query and value both at least the problem's), the narrowest first;
  within that, the fewest doublings between the sequence buckets (query
  plus key), then the same dtype, then the signature's name (a fixed
  order).  None where no entry qualifies.

  Why: a signature the cache lacks otherwise runs the heuristic, which is
  the tuned winner for no causal signature tuned so far (all of them chose
  a persistent longest-first or a longest-first config; the heuristic runs
  causal round-robin), so the nearest tuned bucket is the better guess for
  a sequence bucket or dtype not tuned.  A head dim with no entries of its
  own (96 or 192, or a value head dim unlike the query's) reads a wider
  one's: its configs were tuned under more shared-memory and register
  pressure, and they fit or are passed over.  A narrower head's entries are
  never read (their tiles may not fit, and were not tuned for the
  pressure; docs/decisions/autotune-nearest-entry.md)."""
  want = _SIGNATURE.fullmatch(signature(problem, **features))
  family = () if want is None else _family(want["dtype"])
  if not family:
    return None
  want_dims = _head_dims(want["head"])
  ranked = []
  for sig, entry in _cache_as_read(path).get(device_kind, {}).items():
    got = _SIGNATURE.fullmatch(sig)
    if got is None or got["dtype"] not in family or got["rest"] != want["rest"]:
      continue
    dims = _head_dims(got["head"])
    if any(d < w for d, w in zip(dims, want_dims)):
      continue
    wider = sum(d.bit_length() - w.bit_length() for d, w in zip(dims, want_dims))
    steps = sum(abs(int(got[k]).bit_length() - int(want[k]).bit_length()) for k in ("q", "kv"))
    ranked.append((dims != want_dims, wider, dims, steps, got["dtype"] != want["dtype"], sig,
                   entry))
  for *_, sig, entry in sorted(ranked, key=lambda r: r[:6]):
    config = entry_config(entry)
    if config is not None and plan.config_fits(problem, config):
      return sig, config
  return None


def _head_dims(head: str) -> tuple[int, int]:
  """(query, value) head dims of a signature's "d128-dv128" part."""
  d, dv = head[1:].split("-dv")
  return int(d), int(dv)


def choose(problem: plan.Problem, device_kind: str | None, **features) -> Config:
  """``config=None``: the autotuned config when cached, else the nearest
  tuned entry of the same mask and features, of the same head dims or else
  the narrowest wider ones (:func:`nearest`),
  else the heuristic, which with key ranges (``has_key_ranges``: lengths,
  windows, packed documents) on one tile per block runs longest-first.

  The heuristic runs a causal problem one tile per block, in the grid's
  order; longest-first starts the tiles with the most key blocks first
  (kernel/tiling/schedule.py: the causal triangle and a local window), so
  the short ones fill the end.  A persistent heuristic config (non-causal)
  is kept: one tile per block, longest-first, ran a local window slower
  (docs/decisions/heuristic-key-ranges-longest-first.md).  The persistent
  deal weighs tiles by the causal triangle, not by the documents it cannot
  see; the non-persistent launch ranked by their work on the device
  (kernel.forward.order.range_tile_blocks) beats it
  (docs/decisions/no-dynamic-deal.md)."""
  return choice(problem, device_kind, **features)[0]


# The device whose entries a GPU without entries of its own reads.
REFERENCE_DEVICE_KIND = "NVIDIA H200"


def tuned_device_kind(device_kind: str | None, *, path: Path | None = None) -> str | None:
  """The cache's device whose entries ``device_kind`` reads: its own where
  the cache has any, else the H200's (:data:`REFERENCE_DEVICE_KIND`).  The
  kernel runs on sm90 GPUs only (kernel.api refuses others), which share
  the instruction set and the 227 KiB of shared memory per block, so every
  H200 config compiles and fits on an H100; what is the H200's own is the
  ranking, and on the H100 it ranked better than the heuristic
  (docs/decisions/h100-reads-h200-entries.md)."""
  if not device_kind:
    return None
  cache = _cache_as_read(path)
  return device_kind if cache.get(device_kind) else REFERENCE_DEVICE_KIND


def choice(problem: plan.Problem, device_kind: str | None,
           **features) -> tuple[Config, str]:
  """:func:`choose`'s config and where it came from: "autotune cache",
  "autotune cache, nearest: SIGNATURE" or "heuristic" (the golden files
  record it), with " (DEVICE)" after "autotune cache" where the entries
  are another device's (:func:`tuned_device_kind`)."""
  tuned = tuned_device_kind(device_kind)
  if tuned:
    cache = "autotune cache" + ("" if tuned == device_kind else f" ({tuned})")
    cached = lookup(problem, tuned, **features)
    if cached is not None:
      return cached, cache
    near = nearest(problem, tuned, **features)
    if near is not None:
      return near[1], f"{cache}, nearest: {near[0]}"
  config = heuristics.get_heuristics_config(problem)
  if features.get("has_key_ranges") and not config.persistent:
    config = dataclasses.replace(config, schedule="longest-first")
  return config, "heuristic"
