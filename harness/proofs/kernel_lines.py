"""What a kernel's source says about the events read out of its jaxpr: the
kernel line each comes from (past the helpers of ``kernel/sync/``), the
named-barrier helper family it was made by, and readable names for the
buffers and barriers, from the lines that touch them."""

from __future__ import annotations

import linecache
import os
import re

from harness.proofs.memos import IdMemo

# harness/proofs/kernel_lines.py -> the repository's kernel/
KERNEL_DIR = os.path.join(
    os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "kernel")


_FRAMES = IdMemo()  # id(traceback) -> (traceback, "kernel/<file>.py:line")


def kernel_frame(source_info, site: str | None = None) -> str:
  """The innermost line of a kernel file, past the helpers of barriers.py,
  pipeline.py and ring.py.  ``site``: the line of the ``cond`` being run,
  for an operation whose frames hold none: JAX's traceback of an operation
  in a branch stops at the branch function, which for a ring verb's
  conditional wait is ring.py's own."""
  tb = getattr(source_info, "traceback", None)
  hit = _FRAMES.get(id(tb))
  if hit is not None and hit[0] is tb:
    out = hit[1]
  else:
    out = kernel_frame_uncached(source_info)
    if tb is not None:
      _FRAMES[id(tb)] = (tb, out)
  if out is not None:
    return out
  if site is not None:
    return site
  from jax._src import source_info_util
  return source_info_util.summarize(source_info)


# The barrier helpers' files, never an event's line (a mutant's file whose
# name ends like one is the kernel's own).
_HELPERS = frozenset({"barriers.py", "pipeline.py", "ring.py"})
_KERNEL_FILES: dict = {}  # a frame's file name -> its path from the repository, or None


def _kernel_file(file_name: str) -> str | None:
  """kernel/<file>.py for a kernel file other than the helpers, else None."""
  hit = _KERNEL_FILES.get(file_name, _KERNEL_FILES)
  if hit is _KERNEL_FILES:
    fn = os.path.abspath(file_name)
    hit = None
    if fn.startswith(KERNEL_DIR) and os.path.basename(fn) not in _HELPERS:
      hit = os.path.relpath(fn, os.path.dirname(KERNEL_DIR))
    _KERNEL_FILES[file_name] = hit
  return hit


def kernel_frame_uncached(source_info) -> str | None:
  frames = getattr(getattr(source_info, "traceback", None), "frames", None) or []
  for f in frames:
    path = _kernel_file(f.file_name)
    if path is not None:
      return f"{path}:{f.line_num}"
  return None


_FAMILIES = IdMemo()  # id(traceback) -> (traceback, family)


def barrier_family(source_info) -> str:
  tb = getattr(source_info, "traceback", None)
  hit = _FAMILIES.get(id(tb))
  if hit is not None and hit[0] is tb:
    return hit[1]
  out = _barrier_family_uncached(source_info)
  if tb is not None:
    _FAMILIES[id(tb)] = (tb, out)
  return out


def _barrier_family_uncached(source_info) -> str:
  frames = getattr(getattr(source_info, "traceback", None), "frames", None) or []
  family = ""
  for f in frames:  # innermost first: keep the outermost helper of barriers.py
    if os.path.abspath(f.file_name).endswith(os.path.join("kernel", "sync", "barriers.py")):
      name = f.function_name.split(".")[0]
      if name != "_bar":
        family = name
  return {"schedule_sync": "schedule", "schedule_release_other": "schedule",
          "ds_ready": "ds_ready"}.get(family, family or kernel_frame(source_info))


def src_line(src: str) -> str:
  path, _, line = src.rpartition(":")
  full = os.path.join(os.path.dirname(KERNEL_DIR), path)
  try:
    return linecache.getline(full, int(line)).strip()
  except ValueError:
    return ""


_LINE_NAMES: dict = {}  # kernel file:line -> (identifiers indexed with .at[, store source)


def _line_names(src: str):
  hit = _LINE_NAMES.get(src)
  if hit is None:
    line = src_line(src)
    m = re.search(r"copy_smem_to_gmem\(\s*([A-Za-z_]\w*)", line)
    hit = _LINE_NAMES[src] = (re.findall(r"([A-Za-z_]\w*)\.at\[", line),
                              m.group(1) if m else None)
  return hit


_RING_VERB = re.compile(r"([A-Za-z_]\w*)\.(producer_acquire|producer_copy|consumer_wait|"
                        r"consumer_release)\((.*)")


_RING_NAMES: dict = {}  # (event kind, kernel file:line) -> _ring_verb_name


def _ring_verb_name(e) -> str | None:
  """A line that calls a verb of kernel/sync/ring.py (``keys.consumer_wait(st,
  "bias")``) names what it touches after the ring and the buffer it names:
  ``keys.bias`` for the buffer, ``keys.bias.produced`` for its barriers,
  ``keys.consumed``."""
  if e.kind not in ("wait", "arrive", "tma_load"):
    return None
  key = (e.kind, e.src)
  if key not in _RING_NAMES:
    _RING_NAMES[key] = _ring_verb_name_uncached(e)
  return _RING_NAMES[key]


def _ring_verb_name_uncached(e) -> str | None:
  verb = _RING_VERB.search(src_line(e.src))
  if not verb:
    return None
  ring, verb, args = verb.groups()
  part = re.match(r"[^\"]*\"(\w+)\"", args)
  buf = f"{ring}.{part.group(1)}" if part else ring
  return {"consumer_wait": f"{buf}.produced", "producer_copy": buf}.get(verb, f"{ring}.consumed")


def name_buffers(events: dict) -> dict:
  """Readable names from the kernel's source, for traces: a ring's buffers
  and barriers after the ring verb that touches them (:func:`_ring_verb_name`),
  else an mbarrier array by the identifier its wait lines index (its arrive
  lines where nobody waits), a buffer by the destination of its TMA loads or
  the source of its TMA stores.  A line with several ``.at[`` is read as the
  call's argument order has it; a name two buffers would share is made
  unique."""
  votes: dict = {}
  rank = {"ring": -1, "wait": 0, "tma_load": 0, "tma_store": 1, "arrive": 2, "smem_store": 3,
          "smem_load": 4}
  for evs in events.values():
    for e in evs:
      if e.kind not in rank:
        continue
      ring_name = _ring_verb_name(e)
      if ring_name:
        best = votes.get(e.buf)
        if best is None or rank["ring"] < best[0]:
          votes[e.buf] = (rank["ring"], ring_name)
        continue
      found, stored = _line_names(e.src)
      name = None
      if e.kind == "wait" and len(found) == 1:
        name = found[0]
      elif e.kind in ("arrive", "smem_store", "smem_load") and len(found) == 1:
        name = found[0]
      elif e.kind == "tma_load" and len(found) >= 2:
        name = found[1]
      elif e.kind == "tma_store" and stored:
        name = stored
      if name:
        best = votes.get(e.buf)
        if best is None or rank[e.kind] < best[0]:
          votes[e.buf] = (rank[e.kind], name)
  names, taken = {}, set()
  for raw in sorted(votes, key=lambda b: (votes[b], b)):
    name = votes[raw][1]
    names[raw] = name if name not in taken else f"{name}#{raw}"
    taken.add(names[raw])
  return names
