"""The pipelined head-split launches on the GPU (marker ``gpu``; skipped,
visibly, elsewhere): kernel.experiments' "pallas-pipelined" gives the
shipped backward's bits (the same products and arithmetic, step t + 1's
scores formed while step t's accumulating products run: kernel/backward.py's
notes above _wide_pipelined_steps and _wide_dq_pipelined_steps) and is within
the tolerance rule of float64, on the named head-split gradient cases and on
drawn wide-head cases."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import assume, given, note, settings

from harness.numerics import strategies as hs
from harness.numerics.conformance import gradient_reports
from properties.test_gradients_gpu import _NAMED_GRADIENTS, kernel_grads

pytestmark = pytest.mark.gpu

_WIDE = [(n, s) for n, s in _NAMED_GRADIENTS if max(s.shapes.H, s.shapes.Hv) > 128]


def _check(case):
  shipped = kernel_grads(case, backward="pallas")
  pipelined = kernel_grads(case, backward="pallas-pipelined")
  for name, a, b in zip(("dq", "dk", "dv", "dbias"), shipped, pipelined):
    assert (a is None and b is None) or np.array_equal(a, b, equal_nan=True), name
  for r in gradient_reports(case, pipelined):
    note(f"{r.name}: err {r.max_error:.3g} bound {r.bound:.3g}")
    assert r.passed, f"{r.name}: err {r.max_error} > bound {r.bound}"


@pytest.mark.parametrize("name,spec", _WIDE, ids=[n for n, _ in _WIDE])
def test_pipelined_named_cases_match_the_shipped_bits(name, spec):
  _check(hs.build_case(spec))


@given(case=hs.attention_cases(max_batch=2, max_seq=500, max_head_dim=256, big=True,
                               max_logits=None))
@settings(max_examples=10)
def test_pipelined_drawn_cases_match_the_shipped_bits(case):
  assume(max(case.query.shape[3], case.value.shape[3]) > 128 and not case.variant_kwargs)
  note(case.describe())
  _check(case)
