"""Protocol defects written into a copy of the kernel's source, for the
extracted proof (:mod:`harness.prove_extracted`) to refute.

Each mutant is a list of textual edits of ``kernel/forward.py`` or
``kernel/backward.py``, each edit
matching exactly once, that keep the line count (two statements joined with
``;`` where one moves), so every source line a refutation names is the
mutated file's line.  :func:`load` compiles the edited source as a module of
its own (``kernel/forward.mutant_<name>.py``, registered with ``linecache``
so traces print the mutated lines) without touching the file on disk or the
imported ``kernel.forward``.

:data:`SAFE` are reorderings that keep the protocol correct: the proof must
still succeed on them (no false alarms from a proof tied to one statement
order).
"""

from __future__ import annotations

import dataclasses
import linecache
import os
import types

from harness import extract

KERNEL_DIR = extract.KERNEL_DIR


@dataclasses.dataclass(frozen=True)
class Mutant:
  name: str
  what: str
  edits: tuple            # ((old, new), ...) on kernel/forward.py
  persistent: bool = False  # only a persistent block can show it
  file: str = "forward.py"  # the kernel file edited
  backward: tuple = ()      # (head_dim, causal, bias, fuse_dq): the backward that shows it


MUTANTS = (
    Mutant("key_released_before_qk",
           "the first key slot of a tile released before its QK is issued",
           (("        s = qk(lb)\n",
             "        plgpu.barrier_arrive(k_consumed.at[ring(prev_iters, lb, lb)]); s = qk(lb)\n"),
            ("        if not staged:\n          plgpu.barrier_arrive(k_consumed.at[ring(prev_iters, lb, lb)])\n",
             "        if not staged:\n          pass\n"))),
    Mutant("last_value_released_before_pv",
           "the last value slot released right after its PV is issued, before it completes",
           (("            plgpu.wgmma(acc_ref, p16, v_smems.at[slot])\n          acc = pl.run_state(pv)",
             "            plgpu.wgmma(acc_ref, p16, v_smems.at[slot]); plgpu.barrier_arrive(v_consumed.at[slot])\n          acc = pl.run_state(pv)"),
            ("          acc = pl.run_state(pv)(plgpu.ACC.init(acc))\n          plgpu.barrier_arrive(v_consumed.at[slot])\n",
             "          acc = pl.run_state(pv)(plgpu.ACC.init(acc))\n          pass\n")),
           persistent=True),  # one tile never refills its last slots
    Mutant("value_released_before_pv",
           "in the key loop, a value slot released after its PV is issued, before it completes",
           (("          wait_staged(next_slot)\n",
             "          plgpu.barrier_arrive(v_consumed.at[slot]); wait_staged(next_slot)\n"),
            ("        plgpu.barrier_arrive(v_consumed.at[slot])\n        plgpu.barrier_arrive(k_consumed.at[next_slot])\n",
             "        pass\n        plgpu.barrier_arrive(k_consumed.at[next_slot])\n"))),
    Mutant("producer_first_reuse_wait_skipped",
           "the producer's first wait for a released slot skipped (> for >=)",
           (("          reuse = st.count >= stages\n", "          reuse = st.count > stages\n"),)),
    Mutant("producer_ring_off_by_one",
           "the producer's ring position one ahead of the consumers'",
           (("          st = ring_state(prev_iters, lb, ki)\n",
             "          st = ring_state(prev_iters, lb, ki + 1)\n"),)),
    Mutant("one_warpgroup_drops_prev_iters",
           "compute warpgroup 1 does not carry prev_iters across tiles",
           (("      return ring_state(prev_iters, lb, ki).index\n",
             "      return ring_state(prev_iters * (1 - wg), lb, ki).index\n"),),
           persistent=True),
    Mutant("pingpong_token_to_wrong_warpgroup",
           "after the first QK, the pingpong token passed to the warpgroup's own barrier",
           (("          wait_staged(slot)\n          barriers.schedule_release_other(wg)\n",
             "          wait_staged(slot)\n          barriers.schedule_release_other(1 - wg)\n"),)),
    Mutant("epilogue_on_pingpong_id",
           "the epilogue's sync on the pingpong barrier's id (one id, two purposes)",
           (("        barriers.epilogue_sync()  # both warpgroups are done with q and k\n",
             "        barriers._bar('sync', barriers.schedule_id(0), barriers.BY_NAME['epilogue'].num_threads)\n"),)),
    Mutant("query_prefetch_before_consumed",
           "the next tile's queries fetched before the second tile waits q_consumed (> 1 for > 0)",
           (("            pl.when(step > 0)(lambda w=w: plgpu.barrier_wait(q_consumed.at[w]))\n",
             "            pl.when(step > 1)(lambda w=w: plgpu.barrier_wait(q_consumed.at[w]))\n"),),
           persistent=True),
    Mutant("missing_commit_smem_before_store",
           "the output tile stored to shared memory and TMA-stored without commit_smem",
           (("      plgpu.commit_smem()\n      plgpu.copy_smem_to_gmem(o_smem,",
             "      pass\n      plgpu.copy_smem_to_gmem(o_smem,"),)),
    # kernel/forward.py before 0b8ad79: deadlocks only after two tiles
    # without key blocks in a row (trip counts 0, 0, 0), which no check of
    # two tiles could show.
    Mutant("empty_tile_skips_token",
           "a persistent tile without key blocks neither passes nor acquires the pingpong token",
           (("        @pl.when(ub == lb)\n        def _():\n          barriers.schedule_release_other(wg)\n"
             "          barriers.schedule_sync(wg)\n",
             "        @pl.when(ub == lb)\n        def _():\n          pass\n          pass\n"),),
           persistent=True),
)

BACKWARD_MUTANTS = (
    Mutant("dq_slot_without_lb",
           "the dQ kernel's ring slot computed from ki instead of ki - lb",
           (("        slot = PipelineState.at(stages, ki - lb).index\n",
             "        slot = PipelineState.at(stages, ki).index\n"),),
           file="backward.py", backward=(64, False, False, False)),
    Mutant("backward_producer_first_consumed_wait_skipped",
           "the backward producer's first wait for a released slot skipped (> for >=)",
           (("        pl.when(t >= stages)(lambda: plgpu.barrier_wait(consumed.at[slot]))\n",
             "        pl.when(t > stages)(lambda: plgpu.barrier_wait(consumed.at[slot]))\n"),),
           file="backward.py", backward=(64, False, False, True)),
    Mutant("dkv_slot_released_before_products",
           "a dK/dV ring slot released once dK's product is issued, before it completes",
           (('            plgpu.wgmma(refs["dk"], ds.astype(dtype), q_ring.at[slot])\n',
             '            plgpu.wgmma(refs["dk"], ds.astype(dtype), q_ring.at[slot]); plgpu.barrier_arrive(consumed.at[slot])\n'),
            ("        # Every product reading the slot has completed (run_state waits).\n        plgpu.barrier_arrive(consumed.at[slot])\n",
             "        # Every product reading the slot has completed (run_state waits).\n        pass\n")),
           file="backward.py", backward=(64, False, False, True)),
    Mutant("ds_handoff_without_commit_smem",
           "the fused dQ's dS^T stored and handed to the owner's wgmma without commit_smem",
           (("          plgpu.commit_smem()\n          barriers.ds_ready(dq_owner(t), wg)\n",
             "          pass\n          barriers.ds_ready(dq_owner(t), wg)\n"),),
           file="backward.py", backward=(64, False, False, True)),
    Mutant("ds_handoff_one_buffer",
           "every step of the fused dQ stages its dS^T in the same buffer",
           (("def ds_buffer(t):\n  return t % DS_BUFFERS\n",
             "def ds_buffer(t):\n  return 0 * t\n"),),
           file="backward.py", backward=(64, False, False, True)),
    Mutant("ds_owner_skips_wait",
           "the fused dQ's rendezvous: neither warpgroup waits, the step's owner reads the "
           "other's dS^T unsynchronised",
           (("          barriers.ds_ready(dq_owner(t), wg)\n",
             "          barriers.ds_ready(1 - wg, wg)\n"),),
           file="backward.py", backward=(64, False, False, True)),
    Mutant("dk_staged_before_dq_products_end",
           "the fused dQ's K tiles overwritten with dK without the epilogue barrier",
           (("      if fused:  # the last dQ product has read both K tiles before they stage dK\n"
             "        barriers.epilogue_sync()\n",
             "      if fused:  # the last dQ product has read both K tiles before they stage dK\n"
             "        pass\n"),),
           file="backward.py", backward=(64, False, False, True)),
)

SAFE = (
    Mutant("release_key_after_qk_wait",
           "the next key slot released inside the loop body as soon as its QK retired "
           "(wait_n=1), before the PV completes",
           (("          s = plgpu.wgmma_accumulator_load(s_ref, wait_n=1)\n",
             "          s = plgpu.wgmma_accumulator_load(s_ref, wait_n=1); plgpu.barrier_arrive(k_consumed.at[next_slot])\n"),
            ("        plgpu.barrier_arrive(v_consumed.at[slot])\n        plgpu.barrier_arrive(k_consumed.at[next_slot])\n",
             "        plgpu.barrier_arrive(v_consumed.at[slot])\n        pass\n"))),
    Mutant("releases_swapped",
           "the loop's two releases in the other order (key slot, then value slot)",
           (("        plgpu.barrier_arrive(v_consumed.at[slot])\n        plgpu.barrier_arrive(k_consumed.at[next_slot])\n",
             "        plgpu.barrier_arrive(k_consumed.at[next_slot])\n        plgpu.barrier_arrive(v_consumed.at[slot])\n"),)),
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


def load(mutant: Mutant | str) -> types.ModuleType:
  """The kernel file with ``mutant``'s edits, as a fresh module."""
  mutant = BY_NAME[mutant] if isinstance(mutant, str) else mutant
  src = mutated_source(mutant)
  stem = mutant.file[:-3]
  filename = os.path.join(KERNEL_DIR, f"{stem}.mutant_{mutant.name}.py")
  lines = src.splitlines(keepends=True)
  linecache.cache[filename] = (len(src), None, lines, filename)
  import importlib
  importlib.import_module(f"kernel.{stem}")  # dataclasses look their module up in sys.modules
  module = types.ModuleType(f"kernel.{stem}")
  module.__file__ = filename
  exec(compile(src, filename, "exec"), module.__dict__)  # noqa: S102 -- the kernel's own source
  return module
