"""Kernel mutants as source patches, and the runner that measures the harness.

A mutant is a small, named edit of the kernel's source that stands for one
class of bug kernel engineers make (../shared/GUIDE.md, issue 18), anchored
on the declared seam of the function it edits (kernel/sync/seams.py) and a
pattern of that function's code (harness/tools/anchors.py), not on a file,
a name or its exact text.  It is
applied to a temporary copy of the package, never to the shipped kernel, and
the tests expected to kill it run in a child process whose ``PYTHONPATH``
and working directory are that copy, under a time limit: a hang is reported
as such and the child is killed.

``python -m harness mutants [--select NAMES | --shard I/N] [--budget S]
[--jobs J] [--out DIR] [--list] [--check] [--lower]`` prints and writes
(Markdown and JSON) one row per mutant: its bug class, the verdict (killed,
hang, survived, error, skipped, not started), the tests that failed, seconds;
and the mutation score.  A control row runs the same tests on the unpatched
copy: they must pass there, or a "kill" would mean nothing.  The whole run
stays within ``--budget`` seconds (220 by default, one device call with
room to spare): every child's limit is cut to what is left, and mutants not
started in time are listed as "not started" and fail the run.

Without an sm90 GPU it says so and runs only the CPU part, ``--lower``
(harness/tools/mutant_lowering.py): each patch applies, lowers for CUDA and
changes the traced program of its probe.  ``--check`` only applies every
patch and compiles the result.  properties/tools/test_mutants_catalog.py runs both;
properties/tools/test_mutant_anchors.py names each mutant that no longer finds its
place, and why.

Verdicts: killed (a selected test failed or crashed), hang (the per-test
watchdog of properties/conftest.py or the child's time limit fired), survived
(every selected test passed), error (the patch does not apply, or pytest could
not collect: a mutant that breaks the import is not a kill), skipped (every
selected test was skipped: no sm90 GPU here).  Score = (killed + hang) /
(killed + hang + survived + error); equivalent mutants are listed, not run.
"""

from __future__ import annotations

import argparse
import ast
import concurrent.futures
import dataclasses
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

from harness.tools import anchors, watchdog

REPO = Path(__file__).resolve().parents[2]
# What a child needs: the package, the harness, the properties and the
# goldens (the golden check is one of the killers), and pytest's settings.
COPIED = ("kernel", "harness", "properties", "golden", "pyproject.toml")

# The GPU properties' room (docs/decisions/properties-rooms.md).
FWD_T = "properties/gpu/test_forward_gpu.py"
GRAD_T = "properties/gpu/test_gradients_gpu.py"
GUARD_T = "properties/gpu/test_guard_band_gpu.py"
FP8_T = "properties/gpu/test_fp8_gpu.py"


def named(*ids: str) -> tuple[str, ...]:
  return tuple(f"{FWD_T}::test_named_cases[{i}]" for i in ids)


def feature(*ids: str) -> tuple[str, ...]:
  return tuple(f"{FWD_T}::test_named_feature_cases[{i}]" for i in ids)


# The CPU test of V^T's layout, which kills V^T's mutants before any GPU test.
FP8_VT = ("properties/numerics/test_fp8.py::test_v_transposed_holds_each_block_in_the_key_order",)


def fp8_named(*ids: str) -> tuple[str, ...]:
  return tuple(f"{FP8_T}::test_fp8_named_cases[{i}]" for i in ids)


def grads(*ids: str) -> tuple[str, ...]:
  return tuple(f"{GRAD_T}::test_named_gradient_cases[{i}]" for i in ids)


CARRY = tuple(f"{FWD_T}::test_persistent_ring_carry_cases[{n}]" for n in (
    "3-blocks-per-tile", "causal-1-to-16", "causal-3-stages", "key-ranges-with-empty-tiles"))
GUARD = (f"{GUARD_T}::test_the_forward_writes_nothing_past_its_padded_outputs",)
MASKED_ROWS = (f"{FWD_T}::test_fully_masked_rows_follow_the_contract[False]",
               f"{FWD_T}::test_fully_masked_rows_follow_the_contract[True]")


@dataclasses.dataclass(frozen=True)
class Mutant:
  """One defect: ``edits`` are anchored edits (harness/tools/anchors.py) of
  the source under ``within`` (relative to the repository root), each
  anchor a declared seam (kernel/sync/seams.py) and matching exactly once
  there, whichever file holds it;
  ``tests`` the pytest node ids expected to kill it, run in order with
  ``-x``; ``equivalent``, where set, the one-line argument that no test can
  kill it (it is then listed, not run); ``probe``, the lowering
  (harness/tools/mutant_lowering.py) whose program the patch must change on
  the CPU."""

  name: str
  bug_class: str
  edits: tuple[anchors.Edit, ...]
  tests: tuple[str, ...] = ()
  equivalent: str = ""
  probe: str = "fwd"
  within: str = "kernel"

  @property
  def seams(self) -> str:
    return ", ".join(dict.fromkeys(e.anchor.seam for e in self.edits))


def _m(name, bug_class, seam, old, new, tests, equivalent="", probe="fwd"):
  return Mutant(name, bug_class, (anchors.edit(seam, old, new),), tuple(tests), equivalent,
                probe)


def _b(name, bug_class, seam, old, new, tests, probe="grad"):
  """A mutant of the backward: its probe takes the gradients."""
  return _m(name, bug_class, seam, old, new, tests, probe=probe)


CATALOG: tuple[Mutant, ...] = (
    # -- forward: arithmetic of the online softmax --------------------------------
    _m("residual-m-base2", "residual in the wrong base (seed 000)", "epilogue.epilogue",
       "m_smems.at[wg][...] = m_i * (1.0 / LOG2E)", "m_smems.at[wg][...] = m_i",
       named("heuristic-basic-d64")),
    _m("exp2-without-log2e", "exp2 without the log2(e) fold", "softmax.logits",
       "sc *= LOG2E", "", named("heuristic-basic-d64")),
    _m("acc-not-rescaled", "alpha applied to l but not to the accumulator", "softmax.rescaled",
       "return acc * lax.broadcast_in_dim(factor, acc.shape, [0])", "return acc",
       named("heuristic-d128-gqa", "heuristic-threshold-0")),
    _m("l-not-rescaled", "l not rescaled when the max moves", "softmax.softmax",
       "factor = jnp.exp2(m_i - base)\nl_i = l_i * factor",
       "factor = jnp.exp2(m_i - base)", named("heuristic-d128-gqa"), probe="fwd-threshold-1"),
    _m("threshold-branch-skips-l", "rescale below the threshold applied to acc, not l",
       "softmax.softmax", "factor = jnp.where(rescale, alpha, 1.0)\nl_i = l_i * factor",
       "factor = jnp.where(rescale, alpha, 1.0)",
       named("heuristic-threshold-0.5-unnormalised", "heuristic-threshold-tiny")),
    _m("pending-scale-dropped-from-l", "the pending scale dropped when the threshold is below 1",
       "epilogue.final_rows", "l_res = l_i * jnp.exp2(m_scale - safe(m_i))", "l_res = l_i",
       named("heuristic-threshold-0", "heuristic-threshold-tiny")),
    _m("pending-scale-dropped-unnormalised",
       "the pending scale dropped from the unnormalised output", "epilogue.final_rows",
       "out = each_part(lambda a: a * lax.broadcast_in_dim(alpha, a.shape, [0]), acc)",
       "out = acc", named("heuristic-threshold-0.5-unnormalised"), probe="fwd-unnormalised"),
    Mutant("pv-operand-rewritten-in-flight",
           "a register an in-flight wgmma reads rewritten before its wait (ptxas then "
           "serialises every wgmma of the kernel)", (
               anchors.edit("mainloop.issue_then_softmax", "p_ref[...] = p",
                            "p_ref[...] = p.astype(c.dtype)"),
               anchors.edit("mainloop.loop_body",
                            "p_init = plgpu.layout_cast(jnp.zeros(c.bq_kv, jnp.float32), WGMMA)",
                            "p_init = p16")),
           ("properties/tools/test_ptxas_report.py::"
            "test_no_shipped_kernel_has_its_wgmmas_serialised[fwd-d256-causal]",)),
    _m("threshold-0.999-takes-the-1.0-branch", "threshold branch selection",
       "context.always_rescale",
       "return self.threshold == 1.0", "return self.threshold >= 0.999", (),
       equivalent="rescaling at every block is what the threshold branch does when alpha < "
                  "0.999, and otherwise keeps acc and l relative to one max either way: same "
                  "values up to rounding, only speed differs"),
    _m("f16-threshold-guard-dropped", "float16 overflow of deferred probabilities",
       "api.effective_threshold",
       "if np.dtype(dtype) == np.float16 and threshold < F16_MIN_THRESHOLD:\n"
       "  return F16_MIN_THRESHOLD\nreturn threshold",
       "return threshold",
       (f"{FWD_T}::test_float16_deferred_rescale_does_not_overflow",), probe="fwd-f16"),
    _m("safe-base-dropped", "fully masked row without its -inf guard (NaN)", "softmax.safe",
       "return jnp.where(x == NEG_INF, 0.0, x)", "return x", MASKED_ROWS),
    _m("normalise-without-tiny", "0/0 for a fully masked row", "epilogue.final_rows",
       "inv = 1.0 / (l_i + float(np.finfo(np.float32).tiny))", "inv = 1.0 / l_i", MASKED_ROWS),
    _m("default-scale-from-padded-head-dim", "default scale from the padded head dim",
       "api.problem_of", "float(shapes.H ** -0.5 if call.scale is None else call.scale)",
       "float(plan_lib.padded_head_dim(shapes.H) ** -0.5 if call.scale is None else call.scale)",
       named("heuristic-ragged-113x203-d72-dv96"), probe="fwd-d72"),
    # -- forward: masks, bias, soft cap ------------------------------------------
    _m("causal-diagonal-masked", "causal off by one (the diagonal masked)", "masks.masked_logits",
       "s = jnp.where(q_base + _iota(shape, 0) >= key, s, NEG_INF)",
       "s = jnp.where(q_base + _iota(shape, 0) > key, s, NEG_INF)", named("heuristic-causal-1024")),
    _m("causal-bottom-right", "causal aligned bottom-right instead of top-left",
       "masks.masked_logits",
       "s = jnp.where(q_base + _iota(shape, 0) >= key, s, NEG_INF)",
       "s = jnp.where(q_base + _iota(shape, 0) + (mask.seq_kv - mask.seq_q) >= key, s, NEG_INF)",
       named("heuristic-ragged-1023x1024-causal")
       + feature("causal-kend-bias-softcap-threshold")),
    _m("k-end-inclusive", "k_end treated as inclusive", "masks.masked_logits",
       "jnp.where(key < lax.broadcast_in_dim(k_end, shape, [0]), s, NEG_INF)",
       "jnp.where(key <= lax.broadcast_in_dim(k_end, shape, [0]), s, NEG_INF)",
       feature("key-ranges-with-empty")),
    _m("k-start-exclusive", "k_start treated as exclusive", "masks.masked_logits",
       "jnp.where(key >= lax.broadcast_in_dim(k_start, shape, [0]), s, NEG_INF)",
       "jnp.where(key > lax.broadcast_in_dim(k_start, shape, [0]), s, NEG_INF)",
       feature("key-ranges-with-empty")),
    _m("staged-mask-ignored", "the staged mask ignored", "softmax.logits",
       "keep = staged_tile(c, t, \"mask\", ki)\ns = jnp.where(keep != 0, s, NEG_INF)",
       "keep = staged_tile(c, t, \"mask\", ki)", feature("mask-2d-with-empty-row"),
       probe="fwd-staged"),
    _m("softcap-without-outer-multiply", "the soft cap without its outer multiply",
       "softmax.logits",
       "s, sc = jnp.tanh(s * (sc / problem.logits_soft_cap)), problem.logits_soft_cap",
       "s, sc = jnp.tanh(s * (sc / problem.logits_soft_cap)), 1.0",
       named("heuristic-softcap-scale")),
    # -- forward: data movement and the ring protocol ----------------------------
    _m("gqa-head-modulo", "GQA mapping h % K instead of h // group", "producer.tile",
       "hk = lax.div(h, jnp.int32(c.group))",
       "hk = lax.rem(h, jnp.int32(c.num_heads // c.group))",
       named("heuristic-d128-gqa")),
    _m("last-pv-reads-k", "V read from K's slot (the tile's last PV)", "mainloop.last_pv.pv",
       "issue_pv(c, acc_ref, p16, st)",
       # the keys' ring as the values' (whole rows or column parts alike)
       "issue_pv(__import__('dataclasses').replace(c, values=c.keys), acc_ref, p16, st)",
       named("heuristic-basic-d64")),
    _m("query-prefetch-swapped", "the query prefetch of the wrong rows (warpgroups swapped)",
       "producer.prefetch_queries", "rows = pl.ds((c.cw * qi + w) * c.block_q, c.block_q)",
       "rows = pl.ds((c.cw * qi + c.cw - 1 - w) * c.block_q, c.block_q)",
       named("heuristic-basic-d64")),
    _m("no-prev-iters-carry", "ring phase not carried across persistent tiles (tilelang #2674)",
       "context.ring_state", "return keys.position(prev_iters + (ki - lb))",
       "return keys.position(ki - lb)", CARRY),
    # The refill rule is the ring's (PipelineState.refills, read by the
    # ring's producer_acquire), one for every kernel: the same patch twice,
    # against the forward's tests and against the backward's.
    _m("producer-skips-first-reuse-wait", "producer refills a slot before its release",
       "pipeline.refills", "return self.count >= self.num_stages",
       "return self.count >= self.num_stages + 1",
       named("heuristic-d128-gqa", "nonpersistent-bq128-3stages") + CARRY[:1]),
    _m("query-released-one-block-early", "a consumer released its slot one block early",
       "mainloop.release_query",
       "pl.when(ki + 1 == t.ub)(lambda: c.queries.consumer_release(c.wg))",
       "pl.when(ki + 2 == t.ub)(lambda: c.queries.consumer_release(c.wg))",
       CARRY[:1] + named("persistent-d128-gqa")),
    _m("empty-tile-keeps-query-slot", "an empty tile never releases its query slot (deadlock)",
       "epilogue.epilogue", "pl.when(t.ub == t.lb)(lambda: c.queries.consumer_release(wg))", "None",
       CARRY[3:]),
    _m("empty-tile-skips-token-pass", "an empty tile skips the pingpong token (Z3-found deadlock)",
       "mainloop.tile_prologue", "@pl.when(t.ub == t.lb)\ndef _():\n"
       "  barriers.schedule_release_other(c.wg, c.cw)\n  barriers.schedule_sync(c.wg, c.cw)",
       "pass", CARRY[3:]),
    _m("extra-query-tile", "tile count rounded up past the padded end (out-of-bounds write)",
       "launch.extent", "-(-seq_q // config.tile_q)", "-(-seq_q // config.tile_q) + 1", GUARD),
    _m("residuals-clipped-at-T", "m, l stored clipped at the unpadded length (seen on the "
       "H200: the last tile's rows spilled into the next head)", "launch.out_type",
       "out_type += [jax.ShapeDtypeStruct((batch, num_heads, num_tiles * tile_q),\n"
       "                                  jnp.float32)] * 2",
       "out_type += [jax.ShapeDtypeStruct((batch, num_heads, seq_q), jnp.float32)] * 2",
       named("heuristic-ragged-1000-causal-gqa", "heuristic-ragged-776x1304-d64") + GUARD,
       probe="fwd-unpadded"),
    _m("l-store-one-row-late", "a store one row past its tile (one row past the end)",
       "epilogue.into_output", "c.l_ref.at[t.b, t.h, t.rows]",
       "c.l_ref.at[t.b, t.h, pl.ds(t.q_base + 1, c.block_q)]", GUARD),
    # -- forward: FP8 ----------------------------------------------------------------
    _m("fp8-qk-descale-twice", "a descale applied twice (q_descale * k_descale squared)",
       "softmax.logits", "sc = sc * t.descales[0]", "sc = sc * t.descales[0] * t.descales[0]",
       fp8_named("heuristic-basic-d64", "heuristic-d128-gqa-head-descales"), probe="fwd-fp8"),
    _m("fp8-p-scale-dropped", "P quantised at its own value, not at 2^8 (e4m3 subnormals)",
       "softmax.softmax", "base = base - fp8.P_SCALE_LOG2", "base = base",
       fp8_named("heuristic-basic-d64", "heuristic-broad-rows-4096"), probe="fwd-fp8"),
    _m("fp8-v-read-untransposed", "V read untransposed (its bytes taken for V^T's)",
       "padding.values_transposed", "v = jnp.transpose(v, (0, 5, 6, 1, 3, 2, 4))",
       "v = v.reshape(batch, heads, dv, seq // 16, 4, 2, 2)",
       FP8_VT + fp8_named("heuristic-basic-d64", "heuristic-d128-gqa-head-descales"),
       probe="fwd-fp8"),
    _m("fp8-keys-in-natural-order", "V^T's keys in natural order against P's relabelled "
       "registers (each 16 keys paired with the wrong probabilities)", "padding.values_transposed",
       "v = jnp.transpose(v, (0, 5, 6, 1, 3, 2, 4))",
       "v = jnp.transpose(v, (0, 5, 6, 1, 2, 3, 4))",
       FP8_VT + fp8_named("heuristic-basic-d64", "heuristic-ragged-113x203-d72-dv96"),
       probe="fwd-fp8"),
    # -- backward ------------------------------------------------------------------
    _b("lse-base-e", "the backward reading lse in base e", "backward.residual_rows",
       "lse2 = jnp.where(live, m * LOG2E + jnp.log2(jnp.where(live, l, 1.0)), jnp.inf)",
       "lse2 = jnp.where(live, m + jnp.log(jnp.where(live, l, 1.0)), jnp.inf)",
       ("properties/kernel/test_residual_rows.py::test_rows_match_float64",) + grads("gqa-d128")),
    _b("delta-in-bf16", "delta formed in bf16", "backward.residual_rows",
       "delta = jnp.sum(d_out.astype(jnp.float32) * out.astype(jnp.float32), axis=-1)",
       "delta = jnp.sum(d_out.astype(out.dtype) * out, axis=-1).astype(jnp.float32)",
       ("properties/kernel/test_residual_rows.py::test_rows_match_float64",) + grads("gqa-d128")),
    _b("fused-dq-missing-scale", "dq missing the scale (fused dQ)",
       "backward.fused_dq", "dq = dq_acc.astype(jnp.float32) * problem.scale",
       "dq = dq_acc.astype(jnp.float32)", grads("gqa-d128"), probe="grad-fused"),
    _b("dq-kernel-missing-scale", "dq missing the scale (dQ kernel)", "dq.compute",
       "q_st[...] = (dq_acc * c.problem.scale).astype(c.dtype)",
       "q_st[...] = dq_acc.astype(c.dtype)", grads("ragged-causal-d72-dv96"), probe="grad-causal"),
    _b("dk-missing-scale", "dk missing the scale", "dkv.compute",
       "if name == \"dk\":\n  acc = acc * c.problem.scale", "", grads("gqa-d128")),
    _b("dk-dv-swapped", "dk and dv swapped (joint launch)", "dkv.compute",
       'results = {"dk": (dk_acc, c.k_st), "dv": (dv_acc, c.v_st)}',
       'results = {"dk": (dv_acc, c.k_st), "dv": (dk_acc, c.v_st)}', grads("gqa-d128")),
    _b("backward-causal-diagonal-masked", "causal off by one in the backward", "masks.keep_select",
       "self.query_base", "self.query_base - 1",
       grads("ragged-causal-d72-dv96", "causal-kv-longer"), probe="grad-causal"),
    _b("meets-diagonal-off-by-one", "causal mask skipped on a step that needs it",
       "masks.meets_diagonal", "return key_base + num_keys - 1 > query_base",
       "return key_base + num_keys - 1 > query_base + 1",
       ("properties/kernel/test_causal_skip.py::test_the_predicate_sees_the_corners",)
       + grads("ragged-causal-d72-dv96"), probe="grad-causal"),
    _b("dkv-causal-skips-first-query-block", "causal dK/dV skips the diagonal's query block",
       "masks.first_query_block",
       "return lax.div(tile * key_tile, jnp.int32(block_q)) if self.causal else jnp.int32(0)",
       "return lax.div(tile * key_tile, jnp.int32(block_q)) + 1 if self.causal "
       "else jnp.int32(0)",
       grads("ragged-causal-d72-dv96", "causal-kv-longer"), probe="grad-causal"),
    _b("dkv-gqa-head-modulo", "GQA group summed over h % K heads in dK/dV", "dkv.coords",
       "return c.hk * c.group + lax.div(t, c.per_head), c.lo + lax.rem(t, c.per_head)",
       "return c.hk + c.num_kv_heads * lax.div(t, c.per_head), c.lo + lax.rem(t, c.per_head)",
       grads("gqa-d128")),
    _b("dq-kernel-gqa-head-modulo", "GQA mapping h % K in the dQ kernel", "dq.kernel",
       "hk = lax.div(h, jnp.int32(c.group))", "hk = lax.rem(h, jnp.int32(c.num_kv_heads))",
       grads("gqa-causal-dq-kernel"), probe="grad-causal"),
    _b("bias-after-softcap", "bias added after the soft cap", "scores.scaled_logits",
       "if bias is not None:\n  u = u + bias.astype(jnp.float32)\n"
       "if problem.logits_soft_cap is None:\n  return u, None\n"
       "t = jnp.tanh(u * (1.0 / problem.logits_soft_cap))\n"
       "return t * problem.logits_soft_cap, 1.0 - t * t",
       "late = 0.0 if bias is None else bias.astype(jnp.float32)\n"
       "if problem.logits_soft_cap is None:\n  return u + late, None\n"
       "t = jnp.tanh(u * (1.0 / problem.logits_soft_cap))\n"
       "return t * problem.logits_soft_cap + late, 1.0 - t * t",
       grads("bias-full-softcap")),
    _b("softcap-derivative-wrong", "the soft cap's derivative without its square",
       "scores.scaled_logits", "return t * problem.logits_soft_cap, 1.0 - t * t",
       "return t * problem.logits_soft_cap, 1.0 - t", grads("bias-full-softcap")),
    _b("dbias-mean-not-sum", "dbias reduced over broadcast axes by mean, not sum",
       "backward.bias_gradient",
       "summed = jnp.sum(ds, axis=tuple(a for a in range(4) if full[a] == 1), keepdims=True)",
       "summed = jnp.mean(ds, axis=tuple(a for a in range(4) if full[a] == 1), keepdims=True)",
       grads("bias-row-neg-inf")),
    _b("masked-ds-not-zeroed", "dS of a masked pair left at 0 * NaN", "scores.masked_to_zero",
       "return ds if keep is None else keep.select(ds)", "return ds",
       (f"{GRAD_T}::test_nan_in_the_cotangent_propagates_as_the_reference_says",),
       probe="grad-causal"),
    _b("backward-producer-skips-first-reuse-wait", "backward producer refills a slot early",
       "pipeline.refills", "return self.count >= self.num_stages",
       "return self.count >= self.num_stages + 1", grads("gqa-d128", "d256-head-split")),
    Mutant("dkv-releases-slot-before-its-products", "a consumer released its slot before the "
           "products reading it completed", (
               anchors.edit("dkv.step", "stream.consumer_release(st)", ""),
               anchors.edit("dkv.step", 'accs = {"dv": dv_acc, "dk": dk_acc}',
                            'stream.consumer_release(st)\naccs = {"dv": dv_acc, "dk": dk_acc}')),
           grads("gqa-d128", "d256-head-split"), probe="grad"),
    # -- backward: the head split (head dims over 128) -------------------------
    _b("head-split-dv-other-half", "a warpgroup's dV half formed from the other half of dO",
       "dkv.wide_step.grads", "plgpu.wgmma(refs[\"dv\"], pt_st.at[x], do_slot.at[:, dv_cols])",
       "plgpu.wgmma(refs[\"dv\"], pt_st.at[x], do_slot.at[:, pl.ds((1 - wg) * "
       "dv_acc.shape[1], dv_acc.shape[1])])",
       grads("d256-head-split", "d256-gqa-causal"), probe="grad-d256"),
    _b("head-split-ds-halves-swapped", "the dQ kernel's dS halves staged in each other's "
       "columns", "dq.wide_step", "c.exchange.at[x, :, mine][...] = ds.astype(c.dtype)",
       "c.exchange.at[x, :, pl.ds((1 - wg) * half, half)][...] = ds.astype(c.dtype)",
       grads("d256-head-split", "d256-gqa-causal"), probe="grad-d256"),
)


class MutantError(ValueError):
  pass


def by_name(name: str) -> Mutant:
  for m in CATALOG:
    if m.name == name:
      return m
  raise MutantError(f"unknown mutant {name!r}; known: {', '.join(m.name for m in CATALOG)}")


def patched_files(mutant: Mutant, root: Path = REPO, tree: anchors.Tree | None = None
                  ) -> dict[Path, str]:
  """{path relative to ``root``: patched text} of the files the mutant's
  edits change; an anchor that does not find exactly one place means the
  catalogue has rotted: MutantError names the mutant, the seam and why."""
  try:
    return anchors.splice(mutant.edits, tree or anchors.Tree(root, mutant.within))
  except anchors.AnchorError as err:
    raise MutantError(f"{mutant.name}: {err}") from None


def copy_tree(dest: Path, root: Path = REPO) -> Path:
  """The parts of the repository a child needs, copied under ``dest``."""
  ignore = shutil.ignore_patterns("__pycache__", ".hypothesis", "*.pyc")
  for name in COPIED:
    src = root / name
    if src.is_dir():
      shutil.copytree(src, dest / name, ignore=ignore)
    elif src.exists():
      shutil.copy2(src, dest / name)
  return dest


def apply(mutant: Mutant, root: Path) -> list[Path]:
  """Patch the copy under ``root`` in place; returns the patched files."""
  out = []
  for rel, text in patched_files(mutant, root).items():
    (root / rel).write_text(text)
    out.append(root / rel)
  return out


def child_env(root: Path, test_timeout: float | None) -> dict:
  env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false", PYTHONDONTWRITEBYTECODE="1")
  env["PYTHONPATH"] = os.pathsep.join([str(root), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
  # One failing example kills a mutant: no shrinking (properties/conftest.py).
  env["HYPOTHESIS_PROFILE"] = "mutants"
  # A mutant's broken comparisons must not reach the gate's error-ratio table,
  # nor its hangs the gate's hang records (the child's own output names them):
  # the CPU suite's test of a deliberate hang, run by the gate, left a record
  # there and failed the cpu-properties step with every test passed.
  from harness.numerics.conformance import RATIO_LOG_ENV
  env.pop(RATIO_LOG_ENV, None)
  env.pop(watchdog.HANG_DIR_ENV, None)
  if test_timeout:
    env[watchdog.TEST_TIMEOUT_ENV] = str(test_timeout)
  return env


def run_child(cmd: list[str], root: Path, timeout: float, test_timeout: float | None = None):
  """(returncode or None on timeout, output) of ``cmd`` run in ``root``; on
  timeout the child's whole process group is killed."""
  proc = subprocess.Popen(cmd, cwd=root, env=child_env(root, test_timeout),
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          start_new_session=True)
  try:
    out, _ = proc.communicate(timeout=timeout)
    return proc.returncode, out
  except subprocess.TimeoutExpired:
    os.killpg(proc.pid, signal.SIGKILL)
    out, _ = proc.communicate()
    return None, out


def run_in_copy(mutant: Mutant | None, argv: list[str], timeout: float):
  """(returncode or None on timeout, output) of ``python ARGV`` in a fresh
  copy of the repository patched with ``mutant`` (None: unpatched)."""
  root = Path(tempfile.mkdtemp(prefix=f"{mutant.name if mutant else 'shipped'}-"))
  try:
    copy_tree(root)
    if mutant is not None:
      apply(mutant, root)
    return run_child([sys.executable, *argv], root, timeout)
  finally:
    shutil.rmtree(root, ignore_errors=True)


@dataclasses.dataclass
class Result:
  name: str
  bug_class: str
  verdict: str            # killed, hang, survived, error, skipped, equivalent
  killed_by: list[str]
  seconds: float
  detail: str = ""


def _junit(path: Path):
  """(passed, failed node names, skipped, collection errors) of a JUnit file."""
  root = ET.parse(path).getroot()
  passed, failed, skipped = 0, [], 0
  for case in root.iter("testcase"):
    name = case.get("name", "")
    if case.find("failure") is not None or case.find("error") is not None:
      failed.append(name)
    elif case.find("skipped") is not None:
      skipped += 1
    else:
      passed += 1
  return passed, failed, skipped


def run_tests(root: Path, tests: tuple[str, ...], timeout: float,
              test_timeout: float | None, workers: int = 0) -> tuple[str, list[str], str]:
  """(verdict, failing tests, detail) of ``pytest -x tests`` in ``root``
  (``workers`` > 0: under xdist, without -x)."""
  junit = root / "mutant-junit.xml"
  spread = ["-n", str(workers)] if workers > 0 else ["-x", "-n", "0"]
  cmd = [sys.executable, "-m", "pytest", "-q", *spread, "-p", "no:cacheprovider",
         "-p", "no:randomly", f"--junitxml={junit}", *tests]
  rc, out = run_child(cmd, root, timeout, test_timeout)
  tail = " ".join(out.strip().splitlines()[-3:])[-300:]
  if rc is None:
    return "hang", [], f"no result after {timeout:.0f} s (killed)"
  hung = watchdog.hung_tests(out)
  if rc == watchdog.HANG_EXIT or hung:
    return "hang", hung, f"the watchdog stopped {', '.join(hung) or 'a test'}"
  if not junit.exists():
    return "error", [], f"pytest exited {rc} without a report: {tail}"
  passed, failed, skipped = _junit(junit)
  if rc in (2, 3, 4) or (rc == 5 and not skipped):
    return "error", failed, f"pytest exited {rc} (collection or usage error): {tail}"
  if failed:
    return "killed", failed, tail
  if passed:
    return "survived", [], tail
  return "skipped", [], "every selected test was skipped (no sm90 GPU here)"


def run_mutant(mutant: Mutant, *, timeout: float, test_timeout: float | None,
               workdir: Path) -> Result:
  start = time.time()
  if mutant.equivalent:
    return Result(mutant.name, mutant.bug_class, "equivalent", [], 0.0, mutant.equivalent)
  root = Path(tempfile.mkdtemp(prefix=f"{mutant.name}-", dir=workdir))
  try:
    copy_tree(root)
    try:
      apply(mutant, root)
    except MutantError as err:
      return Result(mutant.name, mutant.bug_class, "error", [], time.time() - start, str(err))
    verdict, failed, detail = run_tests(root, mutant.tests, timeout, test_timeout)
    return Result(mutant.name, mutant.bug_class, verdict, failed, time.time() - start, detail)
  finally:
    shutil.rmtree(root, ignore_errors=True)


def run_control(mutants, *, timeout, test_timeout, workdir: Path, workers: int = 0) -> Result:
  """Every selected test on the unpatched copy: all must pass (or skip)."""
  start = time.time()
  tests = tuple(dict.fromkeys(t for m in mutants for t in m.tests))
  root = Path(tempfile.mkdtemp(prefix="control-", dir=workdir))
  try:
    copy_tree(root)
    verdict, failed, detail = run_tests(root, tests, timeout, test_timeout, workers)
  finally:
    shutil.rmtree(root, ignore_errors=True)
  status = {"survived": "passed", "killed": "FAILED"}.get(verdict, verdict)
  return Result("(control: unpatched)", "-", status, failed, time.time() - start, detail)


NOT_STARTED = "not started"


def score_line(results: list[Result]) -> str:
  n = {v: sum(r.verdict == v for r in results)
       for v in ("killed", "hang", "survived", "error", "skipped", "equivalent", NOT_STARTED)}
  scored = n["killed"] + n["hang"] + n["survived"] + n["error"]
  caught = n["killed"] + n["hang"]
  pct = f"{100.0 * caught / scored:.1f} %" if scored else "n/a"
  return (f"mutation score: {caught}/{scored} = {pct} (killed {n['killed']}, hang {n['hang']}, "
          f"survived {n['survived']}, error {n['error']}; skipped {n['skipped']}, "
          f"equivalent {n['equivalent']}, not started {n[NOT_STARTED]})")


def render(results: list[Result], control: Result | None) -> str:
  lines = ["| mutant | bug class | verdict | killed by | seconds |", "|---|---|---|---|---|"]
  rows = ([control] if control else []) + results
  for r in rows:
    by = ", ".join(t.replace(" ", "") for t in r.killed_by) or (r.detail if r.verdict in (
        "error", "equivalent", "hang", "skipped", NOT_STARTED) else "")
    lines.append(f"| {r.name} | {r.bug_class} | {r.verdict} | {by.replace('|', '/')} "
                 f"| {r.seconds:.0f} |")
  text = "\n".join(lines) + "\n\n" + score_line(results) + "\n"
  if control and control.verdict not in ("passed", "skipped"):
    text += ("\n**the control failed: the selected tests do not pass on the unpatched "
             "kernel, so the kills above prove nothing**\n")
  return text


def heading(device: str, argv: list[str] | None) -> str:
  """The record's provenance: the device, jax, commit and date (as the
  gate's summary names them) and the command that made it."""
  from harness.tools.gate import provenance
  args = sys.argv[1:] if argv is None else argv
  command = " ".join(["python -m harness mutants", *map(shlex.quote, args)])
  return f"device: {device}; {provenance()}; command: `{command}`"


def select(names: str | None, shard: str | None) -> list[Mutant]:
  chosen = list(CATALOG)
  if names:
    chosen = [by_name(n.strip()) for n in names.split(",") if n.strip()]
  if shard:
    try:
      i, n = (int(x) for x in shard.split("/"))
      if not 0 <= i < n:
        raise ValueError
    except ValueError:
      raise MutantError(f"--shard: expected I/N with 0 <= I < N, got {shard!r}") from None
    chosen = chosen[i::n]
  return chosen


def check(root: Path = REPO, mutants=CATALOG) -> list[str]:
  """Problems with the catalogue against the source under ``root``: an
  anchor that does not find exactly one place, a patched file that does not
  compile, or a patch that leaves the program as it was."""
  problems, trees = [], {}
  for m in mutants:
    if m.within not in trees:
      trees[m.within] = anchors.Tree(root, m.within)
    tree = trees[m.within]
    try:
      for rel, text in patched_files(m, root, tree).items():
        if ast.dump(ast.parse(text)) == ast.dump(tree.modules[rel]):
          problems.append(f"{m.name}: the patch leaves {rel.as_posix()} the same program")
        compile(text, rel.as_posix(), "exec")
    except MutantError as err:
      problems.append(str(err))
    except SyntaxError as err:
      problems.append(f"{m.name}: SyntaxError: {err}")
  return problems


def run_all(chosen, *, budget: float, timeout: float, test_timeout: float, jobs: int,
            control_workers: int, with_control: bool = True):
  """(results, control) of the chosen mutants, ``jobs`` at a time, the
  control beside them on ``control_workers`` xdist workers.  Nothing runs
  past ``budget`` seconds from now: each child's limit is cut to what is
  left, and a mutant not started while at least MIN_START seconds remain,
  or stopped by the budget's end rather than its own limit, is reported
  "not started" (a later ``--shard`` or ``--select`` covers it)."""
  deadline = time.time() + budget
  workdir = Path(tempfile.mkdtemp(prefix="harness-mutants-"))

  def one(m):
    left = deadline - time.time()
    if not m.equivalent and left < MIN_START:
      return Result(m.name, m.bug_class, NOT_STARTED, [], 0.0,
                    f"the budget of {budget:.0f} s was spent first")
    limit = min(timeout, left)
    r = run_mutant(m, timeout=limit, test_timeout=test_timeout, workdir=workdir)
    if r.verdict == "hang" and not r.killed_by and limit < timeout:
      # Stopped by the budget's end, not by its own limit: no evidence of a hang.
      return dataclasses.replace(r, verdict=NOT_STARTED,
                                 detail=f"stopped at the end of the {budget:.0f} s budget")
    return r

  try:
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
      control = (pool.submit(run_control, chosen, timeout=budget, test_timeout=test_timeout,
                             workdir=workdir, workers=control_workers)
                 if with_control else None)
      with concurrent.futures.ThreadPoolExecutor(max(1, jobs)) as mutant_pool:
        futures = [mutant_pool.submit(one, m) for m in chosen]
        results = []
        for m, fut in zip(chosen, futures):
          r = fut.result()
          results.append(r)
          print(f"{r.verdict:10s} {r.seconds:5.0f}s {m.name}  {', '.join(r.killed_by)}",
                flush=True)
      control = control.result() if control else None
  finally:
    shutil.rmtree(workdir, ignore_errors=True)
  return results, control


# A mutant needs about this long on the H200 (copy, pytest and jax start-up,
# compiling its cases): one started later could only time out.
MIN_START = 25.0


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(
      prog="python -m harness mutants",
      description="Each catalogued kernel defect against the tests that must kill it, on an "
                  "sm90 GPU; elsewhere only the CPU part (--lower).")
  parser.add_argument("--select", help="comma-separated mutant names (default: all)")
  parser.add_argument("--shard", help="I/N: every N-th mutant from the I-th")
  parser.add_argument("--budget", type=float, default=220.0,
                      help="seconds for the whole run: no child outlives it; mutants not "
                           "started in time are reported 'not started'")
  parser.add_argument("--timeout", type=float, default=120.0,
                      help="seconds per mutant's child before it is killed as a hang")
  parser.add_argument("--test-timeout", type=float, default=60.0,
                      help="seconds per test (the conftest watchdog names the test)")
  parser.add_argument("--jobs", type=int, default=8,
                      help="mutants run at once (the H200 hosts have 16 cores: compiling and "
                           "the float64 references are CPU work)")
  parser.add_argument("--control-workers", type=int, default=4,
                      help="xdist workers of the control run (the unpatched copy)")
  parser.add_argument("--out", default="results/mutants", help="folder for mutants.md/json")
  parser.add_argument("--no-control", action="store_true")
  parser.add_argument("--list", action="store_true", help="print the catalogue and exit")
  parser.add_argument("--check", action="store_true",
                      help="only anchor, apply and compile every patch (no tests)")
  parser.add_argument("--lower", action="store_true",
                      help="CPU: every patch applies, lowers for CUDA and changes its probe's "
                           "traced program (harness/tools/mutant_lowering.py)")
  args = parser.parse_args(argv)
  try:
    chosen = select(args.select, args.shard)
  except MutantError as err:
    parser.error(str(err))
  if args.list:
    for m in chosen:
      print(f"{m.name:44s} {m.seams:28s} {m.bug_class}")
    return 0
  if args.check:
    problems = check(mutants=chosen)
    print("\n".join(problems) or f"{len(chosen)} patches find their places and compile")
    return 1 if problems else 0
  device = None
  if not args.lower:
    from harness.tools.gate import gpu_summary
    has_gpu, device = gpu_summary()
    if not has_gpu:
      print(f"python -m harness mutants: the kills need an sm90 GPU (this machine: {device}); "
            "running the CPU part only: each patch applies, lowers for CUDA and changes its "
            "probe's program.  Nothing is killed or scored here.", flush=True)
      args.lower = True
  if args.lower:
    # Its own process: it swaps patched packages in and out of sys.modules.
    names = ",".join(m.name for m in chosen)
    return subprocess.run([sys.executable, "-m", "harness.tools.mutant_lowering", names],
                          cwd=REPO).returncode

  out_dir = (REPO / args.out).resolve()
  out_dir.mkdir(parents=True, exist_ok=True)
  start = time.time()
  results, control = run_all(chosen, budget=args.budget, timeout=args.timeout,
                             test_timeout=args.test_timeout, jobs=args.jobs,
                             control_workers=args.control_workers,
                             with_control=not args.no_control)
  text = (f"# Kernel mutants\n\n{heading(device, argv)}\n\n"
          f"{len(chosen)} mutants, {time.time() - start:.0f} s "
          f"(budget {args.budget:.0f} s, {args.jobs} at a time)\n\n" + render(results, control))
  (out_dir / "mutants.md").write_text(text)
  (out_dir / "mutants.json").write_text(json.dumps(
      {"control": dataclasses.asdict(control) if control else None,
       "results": [dataclasses.asdict(r) for r in results], "score": score_line(results)},
      indent=1))
  print("\n" + text)
  bad_control = control is not None and control.verdict not in ("passed", "skipped")
  caught = all(r.verdict in ("killed", "hang", "skipped", "equivalent") for r in results)
  return 0 if caught and not bad_control else 1


if __name__ == "__main__":
  sys.exit(main())
