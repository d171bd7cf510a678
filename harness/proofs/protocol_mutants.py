"""Protocol defects written into a copy of the kernel's source, for the
extracted proof (:mod:`harness.proofs.prove_extracted`) to refute.

Each mutant is a list of textual edits of ``kernel/forward.py``,
``kernel/backward.py`` or a module their rings run through
(``kernel/pipeline.py``), each edit
matching exactly once, that keep the line count (two statements joined with
``;`` where one moves), so every source line a refutation names is the
mutated file's line.  :func:`load` compiles the edited source as a module of
its own (``kernel/forward.mutant_<name>.py``, registered with ``linecache``
so traces print the mutated lines) without touching the file on disk or the
imported ``kernel.forward``.  A mutant of a helper module is loaded as
``kernel/<helper>.mutant_<name>.py``, and the kernel it is meant for (its
``host``) is executed afresh over it, as ``kernel/<host>.mutant_<name>.py``.

:data:`SAFE` are reorderings that keep the protocol correct: the proof must
still succeed on them (no false alarms from a proof tied to one statement
order).
"""

from __future__ import annotations

import dataclasses
import linecache
import os
import types

from harness.proofs import extract

KERNEL_DIR = extract.KERNEL_DIR


@dataclasses.dataclass(frozen=True)
class Mutant:
  name: str
  what: str
  edits: tuple            # ((old, new), ...) on kernel/forward.py
  persistent: bool = False  # only a persistent block can show it
  file: str = "forward.py"  # the kernel file edited
  backward: tuple = ()      # (head_dim, causal, bias, fuse_dq): the backward that shows it
  host: str = ""            # the kernel file run over an edited helper (default: file)

  @property
  def kernel(self) -> str:
    return self.host or self.file


MUTANTS = (
    Mutant("key_released_before_qk",
           "the first key slot of a tile released before its QK is issued",
           (("    s = qk(c, t, t.lb)\n",
             "    c.keys.consumer_release(key_position(c, t, t.lb)); s = qk(c, t, t.lb)\n"),
            ("    if not c.staged:\n      c.keys.consumer_release(key_position(c, t, t.lb))\n",
             "    if not c.staged:\n      pass\n"))),
    Mutant("last_value_released_before_pv",
           "the last value slot released right after its PV is issued, before it completes",
           (("    issue_pv(c, acc_ref, p16, st)\n  acc = pl.run_state(pv)",
             "    issue_pv(c, acc_ref, p16, st); c.values.consumer_release(st)\n  acc = pl.run_state(pv)"),
            ("  acc = pl.run_state(pv)(each_part(plgpu.ACC.init, acc))\n  c.values.consumer_release(st)\n",
             "  acc = pl.run_state(pv)(each_part(plgpu.ACC.init, acc))\n  pass\n")),
           persistent=True),  # one tile never refills its last slots
    Mutant("value_released_before_pv",
           "in the key loop, a value slot released after its PV is issued, before it completes",
           (("    wait_staged(c, next_st)\n",
             "    c.values.consumer_release(st); wait_staged(c, next_st)\n"),
            ("  c.values.consumer_release(st)\n  c.keys.consumer_release(next_st)\n",
             "  pass\n  c.keys.consumer_release(next_st)\n"))),
    Mutant("producer_first_reuse_wait_skipped",
           "the producer's first wait for a released slot skipped (> for >=)",
           (("    return self.count >= self.num_stages\n", "    return self.count > self.num_stages\n"),),
           file="pipeline.py", host="forward.py"),
    # Past every position a probe reaches: the refill test on a ring
    # position kept in a 6-bit counter skips the producer's wait for a
    # release at positions 64 .. 64 + S - 1 (and every 64 on).  Probes of a
    # few ring periods never see it; Z3 does (properties/test_extracted_proof.py).
    Mutant("refill_test_on_a_6_bit_position",
           "the producer's refill test reads the ring position modulo 64, so it skips the "
           "wait for a release once the position wraps 64",
           (("    return self.count >= self.num_stages\n",
             "    return _rem(self.count, 64) >= self.num_stages\n"),),
           file="pipeline.py", host="forward.py"),
    Mutant("producer_ring_off_by_one",
           "the producer's ring position one ahead of the consumers'",
           (("    st = ring_state(keys, prev_iters, lb, ki)\n",
             "    st = ring_state(keys, prev_iters, lb, ki + 1)\n"),)),
    Mutant("producer_ignores_the_piece",
           "under the split tail the memory warpgroup fills a piece's whole tile, "
           "not only the piece's key blocks",
           (("  lb, ub, _, _ = tile_range(c, qi, b, h, piece)\n",
             "  lb, ub, _, _ = tile_range(c, qi, b, h)\n"),),
           persistent=True),
    Mutant("one_warpgroup_drops_prev_iters",
           "compute warpgroup 1 does not carry prev_iters across tiles",
           (("  return ring_state(c.keys, t.prev_iters, t.lb, ki)\n",
             "  return ring_state(c.keys, t.prev_iters * (1 - c.wg), t.lb, ki)\n"),),
           persistent=True),
    Mutant("pingpong_token_to_wrong_warpgroup",
           "after the first QK, the pingpong token passed to the warpgroup's own barrier",
           (("    wait_staged(c, st)\n    barriers.schedule_release_other(c.wg, c.cw)\n",
             "    wait_staged(c, st)\n    barriers.schedule_release_other(1 - c.wg, c.cw)\n"),)),
    Mutant("epilogue_on_pingpong_id",
           "the epilogue's sync on the pingpong barrier's id (one id, two purposes)",
           (("    barriers.epilogue_sync(c.cw)  # every compute warpgroup is done with q and k\n",
             "    barriers._bar('sync', barriers.schedule_id(0), barriers.BY_NAME['epilogue'].num_threads)\n"),)),
    Mutant("epilogue_without_its_sync",
           "the non-persistent epilogue stages its output over the queries and keys without "
           "waiting for the other warpgroup (no epilogue_sync)",
           (("    barriers.epilogue_sync(c.cw)  # every compute warpgroup is done with q and k\n",
             "    pass\n"),)),
    Mutant("query_prefetch_before_consumed",
           "the next tile's queries fetched before the second tile waits q_consumed (> 1 for > 0)",
           (("      c.queries.producer_acquire(w, step > 0)\n",
             "      c.queries.producer_acquire(w, step > 1)\n"),),
           persistent=True),
    Mutant("missing_commit_smem_before_store",
           "the output tile stored to shared memory and TMA-stored without commit_smem",
           (("  plgpu.commit_smem()\n  if t.slot is None:",
             "  pass\n  if t.slot is None:"),)),
    # kernel/forward.py before 0b8ad79: deadlocks only after two tiles
    # without key blocks in a row (trip counts 0, 0, 0), which no check of
    # two tiles could show.
    Mutant("empty_tile_skips_token",
           "a persistent tile without key blocks neither passes nor acquires the pingpong token",
           (("    @pl.when(t.ub == t.lb)\n    def _():\n      barriers.schedule_release_other(c.wg, c.cw)\n"
             "      barriers.schedule_sync(c.wg, c.cw)\n",
             "    @pl.when(t.ub == t.lb)\n    def _():\n      pass\n      pass\n"),),
           persistent=True),
    # Two compute warpgroups need one extra pass (warpgroup 0's); with three
    # the middle one owes the last one its final pass too.
    Mutant("last_pass_from_warpgroup_0_only",
           "with three compute warpgroups only warpgroup 0 passes the token after its last PV",
           (("  last = c.wg == 0 if c.cw == 2 else c.wg < c.cw - 1\n",
             "  last = c.wg == 0\n"),)),
)

BACKWARD_MUTANTS = (
    Mutant("dq_slot_without_lb",
           "the dQ kernel's ring slot computed from ki instead of ki - lb",
           (("  st = stream.position(ki - c.lb)\n",
             "  st = stream.position(ki)\n"),),
           file="backward.py", backward=(64, False, False, False)),
    Mutant("backward_producer_first_consumed_wait_skipped",
           "the backward producer's first wait for a released slot skipped (> for >=)",
           (("    return self.count >= self.num_stages\n", "    return self.count > self.num_stages\n"),),
           file="pipeline.py", host="backward.py", backward=(64, False, False, True)),
    Mutant("dkv_slot_released_before_products",
           "a dK/dV ring slot released once dK's product is issued, before it completes",
           (('      plgpu.wgmma(refs["dk"], ds.astype(c.dtype), q_slot)\n',
             '      plgpu.wgmma(refs["dk"], ds.astype(c.dtype), q_slot); stream.consumer_release(st)\n'),
            ("  # Every product reading the slot has completed (run_state waits).\n  stream.consumer_release(st)\n",
             "  # Every product reading the slot has completed (run_state waits).\n  pass\n")),
           file="backward.py", backward=(64, False, False, True)),
    Mutant("ds_handoff_without_commit_smem",
           "the fused dQ's dS^T stored and handed to the owner's wgmma without commit_smem",
           (("    plgpu.commit_smem()\n    barriers.ds_ready(dq_owner(t), wg)\n",
             "    pass\n    barriers.ds_ready(dq_owner(t), wg)\n"),),
           file="backward.py", backward=(64, False, False, True)),
    Mutant("ds_handoff_one_buffer",
           "every step of the fused dQ stages its dS^T in the same buffer",
           (("def ds_buffer(t):\n  return t % DS_BUFFERS\n",
             "def ds_buffer(t):\n  return 0 * t\n"),),
           file="backward.py", backward=(64, False, False, True)),
    Mutant("ds_owner_skips_wait",
           "the fused dQ's rendezvous: neither warpgroup waits, the step's owner reads the "
           "other's dS^T unsynchronised",
           (("    barriers.ds_ready(dq_owner(t), wg)\n",
             "    barriers.ds_ready(1 - wg, wg)\n"),),
           file="backward.py", backward=(64, False, False, True)),
    Mutant("dk_staged_before_dq_products_end",
           "the fused dQ's K tiles overwritten with dK without the epilogue barrier",
           (("  if c.fused:  # the last dQ product has read both K tiles before they stage dK\n"
             "    barriers.epilogue_sync()\n",
             "  if c.fused:  # the last dQ product has read both K tiles before they stage dK\n"
             "    pass\n"),),
           file="backward.py", backward=(64, False, False, True)),
    # The head split (head dims over 128): the exchange of P^T and dS^T
    # halves between the two compute warpgroups, and the epilogue that
    # overwrites the shared K and V tiles.
    Mutant("halves_read_before_rendezvous",
           "the head split's dK/dV products read the other warpgroup's halves of P^T and "
           "dS^T without the rendezvous",
           (("  plgpu.commit_smem()\n  barriers.halves_ready()\n  dk_cols = ",
             "  plgpu.commit_smem()\n  pass\n  dk_cols = "),),
           file="backward.py", backward=(256, False, False, False)),
    Mutant("halves_one_exchange_buffer",
           "every step of the head split stages its halves in the same exchange buffer",
           (("def exchange_buffer(t):\n  return t % EXCHANGE_BUFFERS\n",
             "def exchange_buffer(t):\n  return 0 * t\n"),),
           file="backward.py", backward=(256, False, False, False)),
    Mutant("wide_dk_stored_before_both_halves",
           "the head split's dK tile copied out before the other warpgroup staged its half",
           (("  barriers.epilogue_sync()  # both halves staged before the copy reads them\n"
             "  keys = pl.ds(c.j * c.bkv, c.bkv)\n",
             "  pass\n  keys = pl.ds(c.j * c.bkv, c.bkv)\n"),),
           file="backward.py", backward=(256, False, False, False)),
)

SAFE = (
    Mutant("release_key_after_qk_wait",
           "the next key slot released inside the loop body as soon as its QK retired "
           "(wait_n=1), before the PV completes",
           (("    s = plgpu.wgmma_accumulator_load(s_ref, wait_n=1)\n",
             "    s = plgpu.wgmma_accumulator_load(s_ref, wait_n=1); c.keys.consumer_release(next_st)\n"),
            ("  c.values.consumer_release(st)\n  c.keys.consumer_release(next_st)\n",
             "  c.values.consumer_release(st)\n  pass\n"))),
    Mutant("releases_swapped",
           "the loop's two releases in the other order (key slot, then value slot)",
           (("  c.values.consumer_release(st)\n  c.keys.consumer_release(next_st)\n",
             "  c.keys.consumer_release(next_st)\n  c.values.consumer_release(st)\n"),)),
)

BY_NAME = {m.name: m for m in MUTANTS + BACKWARD_MUTANTS + SAFE}


def mutated_source(mutant: Mutant) -> str:
  path = os.path.join(KERNEL_DIR, mutant.file)
  with open(path) as f:
    src = f.read()
  for old, new in mutant.edits:
    if src.count(old) != 1:
      raise ValueError(f"mutant {mutant.name}: the edit's text occurs {src.count(old)} times "
                       f"in kernel/{mutant.file}, not once: {old!r}")
    if old.count("\n") != new.count("\n"):
      raise ValueError(f"mutant {mutant.name}: an edit must keep the line count")
    src = src.replace(old, new)
  return src


# The kernel modules between a helper and the kernels, executed afresh (in
# this order) over a mutated helper: ring.py binds pipeline's PipelineState
# when it is executed.
_THROUGH = {"pipeline.py": ("ring.py",), "ring.py": ()}


def _module(stem: str, src: str, filename: str) -> types.ModuleType:
  lines = src.splitlines(keepends=True)
  linecache.cache[filename] = (len(src), None, lines, filename)
  import importlib
  importlib.import_module(f"kernel.{stem}")  # dataclasses look their module up in sys.modules
  module = types.ModuleType(f"kernel.{stem}")
  module.__file__ = filename
  exec(compile(src, filename, "exec"), module.__dict__)  # noqa: S102 -- the kernel's own source
  return module


def load(mutant: Mutant | str) -> types.ModuleType:
  """The kernel file with ``mutant``'s edits, as a fresh module; for a
  mutant of a helper, its host kernel executed afresh over the edited
  helper (and the modules between them: :data:`_THROUGH`)."""
  import sys
  import kernel
  mutant = BY_NAME[mutant] if isinstance(mutant, str) else mutant
  src = mutated_source(mutant)
  if mutant.kernel == mutant.file:
    stem = mutant.file[:-3]
    return _module(stem, src, os.path.join(KERNEL_DIR, f"{stem}.mutant_{mutant.name}.py"))
  chain = [(mutant.file, src, f"{mutant.file[:-3]}.mutant_{mutant.name}.py")]
  for through in _THROUGH[mutant.file]:
    chain.append((through, open(os.path.join(KERNEL_DIR, through)).read(), through))
  host = mutant.kernel
  chain.append((host, open(os.path.join(KERNEL_DIR, host)).read(),
                f"{host[:-3]}.mutant_{mutant.name}.py"))
  import importlib
  for file, _, _ in chain:  # the shipped modules, imported before any is swapped
    importlib.import_module(f"kernel.{file[:-3]}")
  saved = {}
  try:
    for file, text, filename in chain:
      stem = file[:-3]
      module = _module(stem, text, os.path.join(KERNEL_DIR, filename))
      # What the next module's imports bind: this fresh one.
      saved.setdefault(stem, (sys.modules[f"kernel.{stem}"], getattr(kernel, stem)))
      sys.modules[f"kernel.{stem}"] = module
      setattr(kernel, stem, module)
  finally:
    for stem, (mod, attr) in saved.items():
      sys.modules[f"kernel.{stem}"] = mod
      setattr(kernel, stem, attr)
  return module
