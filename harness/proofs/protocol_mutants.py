"""Protocol defects written into a copy of the kernel's source, for the
extracted proof (:mod:`harness.proofs.prove_pool`) to refute.

Each mutant is a list of anchored edits (:mod:`harness.tools.anchors`: a
function's declared seam, found in whichever file under ``kernel/``
declares it, and a pattern of its code) that keep the file's line count (statements joined
with ``;`` where one moves, blank lines where code shrinks), so every source
line a refutation names is the mutated file's line.  :func:`load` compiles
each edited file as a module of its own (``kernel/forward/producer.mutant_<name>.py``
beside ``kernel/forward/producer.py``, registered with ``linecache`` so traces print
the mutated lines) without touching the file on disk or the imported
modules.  The kernel the proof traces (``kernel``: the forward or the
backward) is executed afresh over the edited module, and so is every module
between them that imports it (:func:`reexecuted`): an edit of the ring's
``PipelineState`` reaches the forward through ``ring``.

:data:`SAFE` are reorderings and rewrites that keep the protocol correct:
the proof must still succeed on them (no false alarms from a proof tied to
one statement order, or to the lines that make its events).
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
import linecache
import sys
import types
from pathlib import Path

from harness.proofs import kernel_lines
from harness.tools import anchors
from harness.tools.anchors import edit

KERNEL_DIR = kernel_lines.KERNEL_DIR
REPO = Path(KERNEL_DIR).parent
# The module each kernel's proof traces (harness.proofs.tracing.shipped_modules).
KERNELS = {"forward": "kernel.forward", "backward": "kernel.backward"}


@dataclasses.dataclass(frozen=True)
class Mutant:
  name: str
  what: str
  edits: tuple              # anchored edits (harness.tools.anchors.Edit)
  persistent: bool = False  # only a persistent block can show it
  kernel: str = "forward"   # the kernel the proof traces over the edit: forward or backward
  backward: tuple = ()      # (head_dim, causal, bias, fuse_dq): the backward that shows it
  shows: str = ""           # words of the forward cases that show it (ForwardCase.describe)


def backward_mutants(backward: tuple, *mutants: Mutant) -> tuple[Mutant, ...]:
  """``mutants`` as edits of the backward kernel that the backward of
  ``backward`` (head_dim, causal, bias, fuse_dq) shows."""
  return tuple(dataclasses.replace(m, kernel="backward", backward=backward) for m in mutants)


MUTANTS = (
    Mutant("key_released_before_qk",
           "the first key slot of a tile released before its QK is issued",
           (edit("mainloop.first_qk", "s = qk(c, t, t.lb)",
                 "c.keys.consumer_release(key_position(c, t, t.lb)); s = qk(c, t, t.lb)"),
            edit("mainloop.first_qk", "c.keys.consumer_release(key_position(c, t, t.lb))",
                 "pass"))),
    Mutant("last_value_released_before_pv",
           "the last value slot released right after its PV is issued, before it completes",
           (edit("mainloop.last_pv.pv", "issue_pv(c, acc_ref, p16, st)",
                 "issue_pv(c, acc_ref, p16, st); c.values.consumer_release(st)"),
            edit("mainloop.last_pv", "c.values.consumer_release(st)", "pass")),
           persistent=True),  # one tile never refills its last slots
    Mutant("value_released_before_pv",
           "in the key loop, a value slot released after its PV is issued, before it completes",
           (edit("mainloop.issue_then_softmax", "wait_staged(c, next_st)",
                 "c.values.consumer_release(st); wait_staged(c, next_st)"),
            edit("mainloop.loop_body", "c.values.consumer_release(st)", "pass"))),
    Mutant("producer_first_reuse_wait_skipped",
           "the producer's first wait for a released slot skipped (> for >=)",
           (edit("pipeline.refills", "return self.count >= self.num_stages",
                 "return self.count > self.num_stages"),)),
    # Past every position a probe reaches: the refill test on a ring
    # position kept in a 6-bit counter skips the producer's wait for a
    # release at positions 64 .. 64 + S - 1 (and every 64 on).  Probes of a
    # few ring periods never see it; Z3 does (properties/proof/test_premise.py).
    Mutant("refill_test_on_a_6_bit_position",
           "the producer's refill test reads the ring position modulo 64, so it skips the "
           "wait for a release once the position wraps 64",
           (edit("pipeline.refills", "return self.count >= self.num_stages",
                 "return _rem(self.count, 64) >= self.num_stages"),)),
    Mutant("producer_ring_off_by_one",
           "the producer's ring position one ahead of the consumers'",
           (edit("producer.fill", "st = ring_state(keys, prev_iters, lb, ki)",
                 "st = ring_state(keys, prev_iters, lb, ki + 1)"),)),
    Mutant("producer_ignores_the_piece",
           "under the split tail the memory warpgroup fills a piece's whole tile, "
           "not only the piece's key blocks",
           (edit("producer.tile", "lb, ub, _, _ = tile_range(c, qi, b, h, piece)",
                 "lb, ub, _, _ = tile_range(c, qi, b, h)"),),
           persistent=True, shows="split-tail"),
    Mutant("one_warpgroup_drops_prev_iters",
           "compute warpgroup 1 does not carry prev_iters across tiles",
           (edit("context.key_position", "return ring_state(c.keys, t.prev_iters, t.lb, ki)",
                 "return ring_state(c.keys, t.prev_iters * (1 - c.wg), t.lb, ki)"),),
           persistent=True),
    Mutant("pingpong_token_to_wrong_warpgroup",
           "after the first QK, the pingpong token passed to the warpgroup's own barrier",
           (edit("mainloop.compute_qk", "barriers.schedule_release_other(c.wg, c.cw)",
                 "barriers.schedule_release_other(1 - c.wg, c.cw)"),)),
    Mutant("epilogue_on_pingpong_id",
           "the epilogue's sync on the pingpong barrier's id (one id, two purposes)",
           (edit("epilogue.epilogue", "barriers.epilogue_sync(c.cw)",
                 "barriers._bar('sync', barriers.schedule_id(0), "
                 "barriers.BY_NAME['epilogue'].num_threads)"),)),
    Mutant("epilogue_without_its_sync",
           "the non-persistent epilogue stages its output over the queries and keys without "
           "waiting for the other warpgroup (no epilogue_sync)",
           (edit("epilogue.epilogue", "barriers.epilogue_sync(c.cw)", "pass"),)),
    Mutant("query_prefetch_before_consumed",
           "the next tile's queries fetched before the second tile waits q_consumed (> 1 for > 0)",
           (edit("producer.prefetch_queries", "c.queries.producer_acquire(w, step > 0)",
                 "c.queries.producer_acquire(w, step > 1)"),),
           persistent=True),
    Mutant("missing_commit_smem_before_store",
           "the output tile stored to shared memory and TMA-stored without commit_smem",
           (edit("epilogue.epilogue", "plgpu.commit_smem()", "pass"),)),
    # the forward kernel before 0b8ad79: deadlocks only after two tiles
    # without key blocks in a row (trip counts 0, 0, 0), which no check of
    # two tiles could show.
    Mutant("empty_tile_skips_token",
           "a persistent tile without key blocks neither passes nor acquires the pingpong token",
           (edit("mainloop.tile_prologue", "barriers.schedule_release_other(c.wg, c.cw)", "pass"),
            edit("mainloop.tile_prologue", "barriers.schedule_sync(c.wg, c.cw)", "pass")),
           persistent=True),
    # Two compute warpgroups need one extra pass (warpgroup 0's); with three
    # the middle one owes the last one its final pass too.
    Mutant("last_pass_from_warpgroup_0_only",
           "with three compute warpgroups only warpgroup 0 passes the token after its last PV",
           (edit("mainloop.last_token",
                 "last = c.wg == 0 if c.cw == 2 else c.wg < c.cw - 1", "last = c.wg == 0"),),
           shows="3 compute warpgroups"),
    # GQA only: the probes' traces have one head, always the first of its
    # group; the symbolic traces' grid (symbolic_dims.GRID_COUNTS) has every
    # place in a group.
    Mutant("values_unacquired_past_a_groups_first_head",
           "the producer copies values without waiting for their slot's release when the "
           "query head is not the first of its group",
           (edit("producer.fill", "values.producer_acquire(st)",
                 "pl.when(lax.rem(h, jnp.int32(c.group)) == 0)("
                 "lambda: values.producer_acquire(st))"),)),
    # Only a ragged remainder of more than 128 keys shows it: a config at
    # block_kv 256 (FP8's at head dim 64).  A case traced at a smaller block
    # never has such a remainder; its representatives' blocks are the
    # largest of the configs they stand for (cases.Representatives).
    Mutant("values_unacquired_past_128_ragged_keys",
           "the producer copies a ragged last key block's values without waiting for their "
           "slot's release when more than 128 keys are left",
           (edit("producer.fill", "values.producer_acquire(st)",
                 "pl.when((ki * c.block_kv + c.block_kv <= c.problem.seq_kv) | "
                 "(ki * c.block_kv + 128 >= c.problem.seq_kv))"
                 "(lambda: values.producer_acquire(st))"),),
           shows="x256"),
    # Only a persistent grid whose size is no multiple of 4 shows it (6
    # blocks, an H100 PCIe's 114 SMs): the probes' traces have 16 blocks;
    # the symbolic traces' grid size is a symbol (forward_traces' "sms").
    Mutant("values_unacquired_on_a_grid_of_no_multiple_of_4",
           "the producer copies values without waiting for their slot's release when the "
           "persistent grid's size is no multiple of 4",
           (edit("producer.fill", "values.producer_acquire(st)",
                 "(pl.when(jnp.remainder(lax.axis_size('sm'), 4) == 0) if c.config.persistent "
                 "else (lambda f: f()))(lambda: values.producer_acquire(st))"),),
           persistent=True, shows="persistent round-robin"),
    # Only a chunked call shows it, and only with chunks that fit the ring:
    # no trace carried a chunk until the ranged traces took a chunk of every
    # size (forward_traces.WINDOWS).
    Mutant("values_unacquired_under_chunks_that_fit",
           "the producer copies values without waiting for their slot's release when the "
           "call's chunks fit the ring",
           (edit("producer.fill", "values.producer_acquire(st)",
                 "(pl.when(jnp.asarray(c.problem.mask.chunk, jnp.int32) "
                 "> c.stages * c.config.block_kv) "
                 "if c.problem.mask.chunk is not None else (lambda f: f()))("
                 "lambda: values.producer_acquire(st))"),)),
    # Only a call with a window shows it (a left side under one key block):
    # likewise.
    Mutant("values_unacquired_under_a_narrow_window",
           "the producer copies values without waiting for their slot's release when the "
           "call's window reaches less than a key block to the left",
           (edit("producer.fill", "values.producer_acquire(st)",
                 "(pl.when(jnp.asarray(c.problem.mask.window[0], jnp.int32) >= c.config.block_kv) "
                 "if c.problem.mask.window is not None else (lambda f: f()))("
                 "lambda: values.producer_acquire(st))"),)),
    # Only a call without key ranges runs this loop (no causal bound, whole
    # key blocks): the kernels that read ranges never do, so only the proof
    # of the plain kernels (forward_traces.trace_plain) can refute it.
    Mutant("plain_key_loop_one_block_short",
           "a call without key ranges runs its unmasked key loop one block short",
           (edit("mainloop.key_loop",
                 "carry = lax.fori_loop(lb, last, functools.partial(body, edge=False), carry)",
                 "carry = lax.fori_loop(lb, last - 1, functools.partial(body, edge=False), "
                 "carry)"),)),
)

BACKWARD_MUTANTS = (
    *backward_mutants((64, False, False, False),
      Mutant("dq_slot_without_lb",
             "the dQ kernel's ring slot computed from ki instead of ki - lb",
             (edit("dq.step", "st = stream.position(ki - c.lb)", "st = stream.position(ki)"),))),
    *backward_mutants((64, False, False, True),
      Mutant("backward_producer_first_consumed_wait_skipped",
             "the backward producer's first wait for a released slot skipped (> for >=)",
             (edit("pipeline.refills", "return self.count >= self.num_stages",
                   "return self.count > self.num_stages"),)),
      Mutant("dkv_slot_released_before_products",
             "a dK/dV ring slot released once dK's product is issued, before it completes",
             (edit("dkv.step.grads", 'plgpu.wgmma(refs["dk"], ds.astype(c.dtype), q_slot)',
                   'plgpu.wgmma(refs["dk"], ds.astype(c.dtype), q_slot); '
                   'stream.consumer_release(st)'),
              edit("dkv.step", "stream.consumer_release(st)", "pass"))),
      Mutant("ds_handoff_without_commit_smem",
             "the fused dQ's dS^T stored and handed to the owner's wgmma without commit_smem",
             (edit("dkv.step", "plgpu.commit_smem()", "pass"),)),
      Mutant("ds_handoff_one_buffer",
             "every step of the fused dQ stages its dS^T in the same buffer",
             (edit("fused_dq.ds_buffer", "return t % DS_BUFFERS", "return 0 * t"),)),
      Mutant("ds_owner_skips_wait",
             "the fused dQ's rendezvous: neither warpgroup waits, the step's owner reads the "
             "other's dS^T unsynchronised",
             (edit("dkv.step", "barriers.ds_ready(dq_owner(t), wg)",
                   "barriers.ds_ready(1 - wg, wg)"),)),
      Mutant("dk_staged_before_dq_products_end",
             "the fused dQ's K tiles overwritten with dK without the epilogue barrier",
             (edit("dkv.compute", "barriers.epilogue_sync()", "pass"),))),
    *backward_mutants((256, False, False, False),
      # The head split (head dims over 128): the exchange of P^T and dS^T
      # halves between the two compute warpgroups, and the epilogue that
      # overwrites the shared K and V tiles.
      Mutant("halves_read_before_rendezvous",
             "the head split's dK/dV products read the other warpgroup's halves of P^T and "
             "dS^T without the rendezvous",
             (edit("dkv.wide_step", "barriers.halves_ready()", "pass"),)),
      Mutant("halves_one_exchange_buffer",
             "every step of the head split stages its halves in the same exchange buffer",
             (edit("head_split.exchange_buffer", "return t % EXCHANGE_BUFFERS", "return 0 * t"),)),
      Mutant("wide_dk_stored_before_both_halves",
             "the head split's dK tile copied out before the other warpgroup staged its half",
             (edit("dkv.wide_compute", "barriers.epilogue_sync()", "pass"),))),
)

SAFE = (
    Mutant("release_key_after_qk_wait",
           "the next key slot released inside the loop body as soon as its QK retired "
           "(wait_n=1), before the PV completes",
           (edit("mainloop.issue_then_softmax", "s = plgpu.wgmma_accumulator_load(s_ref, wait_n=1)",
                 "s = plgpu.wgmma_accumulator_load(s_ref, wait_n=1); "
                 "c.keys.consumer_release(next_st)"),
            edit("mainloop.loop_body", "c.keys.consumer_release(next_st)", "pass"))),
    Mutant("releases_swapped",
           "the loop's two releases in the other order (key slot, then value slot)",
           (edit("mainloop.loop_body",
                 "c.values.consumer_release(st)\nc.keys.consumer_release(next_st)",
                 "c.keys.consumer_release(next_st)\nc.values.consumer_release(st)"),)),
    # One wait on two lines, taken on different paths: an event is what it does, not its line.
    Mutant("same_acquire_in_both_branches",
           "the producer's key acquire written in both branches of an if/else on key ranges, "
           "so the plain kernel's wait sits on another line than the ranged kernel's",
           (edit("producer.fill",
                 "st = ring_state(keys, prev_iters, lb, ki)\n"
                 "kb = pl.ds(ki * c.block_kv, c.block_kv)\n"
                 "keys.producer_acquire(st)",
                 "st = ring_state(keys, prev_iters, lb, ki); "
                 "kb = pl.ds(ki * c.block_kv, c.block_kv)\n"
                 "if c.key_ranges: keys.producer_acquire(st)\n"
                 "else: keys.producer_acquire(st)"),)),
    Mutant("cond_of_two_equal_lambdas",
           "the key loop's value wait made by a lax.cond on the block's parity whose two "
           "branches, two lambdas on two lines, make the same wait",
           (edit("mainloop.loop_body",
                 "acc, p16, m_i, l_i, *pending = carry\n"
                 "st, next_st = key_position(c, t, ki), key_position(c, t, ki + 1)\n"
                 "c.values.consumer_wait(st)",
                 "acc, p16, m_i, l_i, *pending = carry; "
                 "st, next_st = key_position(c, t, ki), key_position(c, t, ki + 1)\n"
                 "lax.cond(lax.rem(ki, 2) == 0, lambda: c.values.consumer_wait(st),\n"
                 "         lambda: c.values.consumer_wait(st))"),)),
    # Guards that hold for every size the API runs: the proof must follow the
    # symbolic sizes to see that, not refuse a guard that reads them.
    Mutant("value_acquire_under_chunks_of_at_least_one",
           "the producer's value acquire under a guard that the call's chunks hold at least "
           "one position (always)",
           (edit("producer.fill", "values.producer_acquire(st)",
                 "(pl.when(jnp.asarray(c.problem.mask.chunk, jnp.int32) >= 1) "
                 "if c.problem.mask.chunk is not None "
                 "else (lambda f: f()))(lambda: values.producer_acquire(st))"),)),
    Mutant("key_acquire_on_a_grid_of_at_least_one_block",
           "the producer's key acquire under a guard that the persistent grid has a block "
           "(always)",
           (edit("producer.fill", "keys.producer_acquire(st)",
                 "(pl.when(lax.axis_size('sm') >= 1) "
                 "if c.config.persistent else (lambda f: f()))("
                 "lambda: keys.producer_acquire(st))"),)),
)

BY_NAME = {m.name: m for m in MUTANTS + BACKWARD_MUTANTS + SAFE}


def mutated_sources(mutant: Mutant, tree: anchors.Tree | None = None) -> dict[Path, str]:
  """{path from the repository: edited text} of the files ``mutant`` edits,
  each with its line count kept; AnchorError names the mutant and why."""
  tree = tree or anchors.Tree(REPO)
  try:
    return anchors.splice(mutant.edits, tree, keep_lines=True)
  except anchors.AnchorError as err:
    raise anchors.AnchorError(f"protocol mutant {mutant.name}: {err}") from None


def module_name(path: Path) -> str:
  """kernel/forward/producer.py -> kernel.forward.producer; kernel/sync/__init__.py -> kernel.sync."""
  return ".".join(anchors._module_scope(Path(path)))


def mutant_path(path: Path, name: str) -> Path:
  """Where a module executed for mutant ``name`` says it lives (beside its file)."""
  return Path(path).with_name(f"{Path(path).stem}.mutant_{name}.py")


def imports(tree: anchors.Tree) -> dict[str, set[str]]:
  """Each module of ``tree``: the modules of ``tree`` it binds names from
  when executed (imports at module level, not inside functions)."""
  paths = {module_name(p): p for p in tree.modules}
  out = {}
  for name, path in paths.items():
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out[name] = set()
    for node in _module_level(tree.modules[path]):
      if isinstance(node, ast.Import):
        out[name] |= {a.name for a in node.names if a.name in paths}
      elif isinstance(node, ast.ImportFrom):
        base = package.split(".")[:len(package.split(".")) - node.level + 1] if node.level else []
        source = ".".join(base + ([node.module] if node.module else []))
        for alias in node.names:
          sub = f"{source}.{alias.name}"
          out[name] |= {sub} if sub in paths else ({source} if source in paths else set())
  return out


def _module_level(module: ast.Module):
  stack = list(module.body)
  while stack:
    node = stack.pop()
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
      continue
    yield node
    stack.extend(ast.iter_child_nodes(node))


def reexecuted(edited: set[str], host: str, graph: dict[str, set[str]]) -> list[str]:
  """The modules to execute afresh, dependencies first, the host last: the
  edited ones and every module the host imports (or is) that imports one
  of them."""
  if host not in graph:
    raise anchors.AnchorError(f"no module {host} in the kernel's tree")

  def below(m, seen):
    for d in graph[m] - seen:
      seen.add(d)
      below(d, seen)
    return seen

  under = {m: below(m, set()) for m in graph}
  between = {m for m in under[host] | {host} if m in edited or under[m] & edited}
  lost = edited - between
  if lost:
    raise anchors.AnchorError(f"{host} does not import {', '.join(sorted(lost))}: an edit "
                              "there cannot reach the kernel the proof traces")
  order: list[str] = []

  def visit(m):
    if m not in order:
      for d in sorted(graph[m] & between):
        visit(d)
      order.append(m)

  visit(host)
  return order


def _module(name: str, src: str, filename: str, package: bool) -> types.ModuleType:
  linecache.cache[filename] = (len(src), None, src.splitlines(keepends=True), filename)
  module = types.ModuleType(name)
  module.__file__ = filename
  module.__package__ = name if package else name.rpartition(".")[0]
  if package:
    module.__path__ = list(sys.modules[name].__path__)
  exec(compile(src, filename, "exec"), module.__dict__)  # noqa: S102 -- the kernel's own source
  return module


def _host(tree: anchors.Tree, mutant: Mutant) -> Path:
  for path in tree.modules:
    if module_name(path) == KERNELS[mutant.kernel]:
      return path
  raise anchors.AnchorError(f"protocol mutant {mutant.name}: no module "
                            f"{KERNELS[mutant.kernel]} in the kernel's tree")


def mutant_files(mutant: Mutant | str, tree: anchors.Tree | None = None) -> list[str]:
  """The files, from the repository, whose lines the mutant's traces may
  name under its name: the edited ones and the kernel the proof traces."""
  mutant = BY_NAME[mutant] if isinstance(mutant, str) else mutant
  tree = tree or anchors.Tree(REPO)
  paths = dict.fromkeys([*mutated_sources(mutant, tree), _host(tree, mutant)])
  return [mutant_path(p, mutant.name).as_posix() for p in paths]


def load(mutant: Mutant | str) -> types.ModuleType:
  """The kernel the proof traces, executed afresh over ``mutant``'s edits,
  as a fresh module; the imported modules are left as they were."""
  mutant = BY_NAME[mutant] if isinstance(mutant, str) else mutant
  tree = anchors.Tree(REPO)
  return execute(mutated_sources(mutant, tree), module_name(_host(tree, mutant)), tree,
                 mutant.name)


def modules(mutant: Mutant | str) -> types.SimpleNamespace:
  """The kernel modules the proof traces (harness.proofs.tracing.shipped_modules'
  ``forward``, ``backward``, ``common``, ``backward_plan``), with the traced
  kernel executed afresh over ``mutant``'s edits (:func:`load`)."""
  from kernel import backward, common, forward
  from kernel.tiling import backward_plan
  mutant = BY_NAME[mutant] if isinstance(mutant, str) else mutant
  shipped = dict(forward=forward, backward=backward, common=common,
                 backward_plan=backward_plan)
  return types.SimpleNamespace(**{**shipped, mutant.kernel: load(mutant)})


def execute(edited: dict[Path, str], host: str, tree: anchors.Tree, name: str
            ) -> types.ModuleType:
  """Module ``host`` of ``tree`` executed afresh over the ``edited`` texts
  of some of its files, and with it every module between them
  (:func:`reexecuted`); the edited files and the host are named
  ``<file>.mutant_<name>.py`` in tracebacks, the others by their own file.
  ``sys.modules`` is as it was afterwards."""
  paths = {module_name(p): p for p in tree.modules}
  texts = {module_name(p): text for p, text in edited.items()}
  chain = reexecuted(set(texts), host, imports(tree))
  for module in chain:  # the shipped modules, imported before any is swapped
    importlib.import_module(module)
  fresh, saved = {}, {}
  try:
    for module in chain:
      path = paths[module]
      shown = mutant_path(path, name) if module in texts or module == host else path
      text = texts.get(module, tree.sources[path].decode())
      fresh[module] = _module(module, text, str(tree.root / shown), path.name == "__init__.py")
      # What the next module's imports bind: this fresh one.
      parent, _, leaf = module.rpartition(".")
      saved.setdefault(module, (sys.modules[module], getattr(sys.modules[parent], leaf)))
      sys.modules[module] = fresh[module]
      setattr(sys.modules[parent], leaf, fresh[module])
  finally:
    for module, (shipped, attr) in saved.items():
      sys.modules[module] = shipped
      parent, _, leaf = module.rpartition(".")
      setattr(sys.modules[parent], leaf, attr)
  return fresh[host]
