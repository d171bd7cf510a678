"""harness.tools.device_check's case list and ``--select``, on the CPU."""

from __future__ import annotations

import pytest

from harness.tools import device_check


def test_case_names_are_unique_and_select_refuses_a_name_it_cannot_find():
  names = [name for name, _, _ in device_check.fixed_cases()]
  assert len(names) == len(set(names))
  assert any("split-tail" in n for n in names)
  with pytest.raises(SystemExit, match="--select"):
    device_check.run(select=("no-such-case",))
