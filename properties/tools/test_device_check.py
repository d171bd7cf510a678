"""harness.tools.device_check's case list and ``--select``, on the CPU."""

from __future__ import annotations

import numpy as np
import pytest

from harness.tools import bench, device_check


def test_case_names_are_unique():
  names = [name for name, _, _ in device_check.fixed_cases()]
  names += [name for name, _, _ in device_check.extra_cases(np.random.default_rng(0))]
  assert len(names) == len(set(names))
  assert any("split-tail" in n for n in names)


def test_select_keeps_the_cases_whose_name_holds_a_substring():
  cases = [(name, None, None) for name, _, _ in device_check.fixed_cases()]
  kept = device_check.selected(cases, ("split-tail", "basic-d64"))
  assert [c[0] for c in kept] == [c[0] for c in cases
                                  if "split-tail" in c[0] or "basic-d64" in c[0]]
  assert "basic-d64" in [c[0] for c in kept] and len(kept) < len(cases)
  assert device_check.selected(cases) == cases
  with pytest.raises(SystemExit, match="--select"):
    device_check.selected(cases, ("no-such-case",))
  with pytest.raises(SystemExit, match="--select"):
    device_check.run(select=("no-such-case",))


def test_causal_only_and_non_causal_only_are_refused_together(capsys):
  with pytest.raises(SystemExit) as err:
    bench.main(["--grid", "--causal-only", "--non-causal-only"])
  assert err.value.code == 2
  assert "not allowed with argument" in capsys.readouterr().err
