"""What the proof's tests ask of a refuted defect's counterexample: probed
where Z3 said, the search shows it."""

from harness.proofs import forward_probes as fwd
from harness.proofs import search


def assert_value_slot_overwritten(case, modules, where: str):
  """``case``'s probes (as the caller has moved them to the counterexample,
  ``where`` in words) learned afresh over ``modules``: the checker finds a
  value copy over a slot its readers have not released."""
  result = search.check(fwd._ForwardProber(case, modules, None).learn())
  assert not result.ok, f"the checker found nothing {where}"
  text = result.violation.format()
  assert "overwrite before release" in text and "values" in text, text
