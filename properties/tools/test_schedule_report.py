"""``python -m harness schedule`` (harness/tools/schedule_report.py), on the
CPU: the tail it reports is the kernel's own deal of the shipped order, and
of the filled one beside it.  The points read the shipped autotune cache's
H200 configs (causal d128 at 16k tokens: persistent, longest-first)."""

from __future__ import annotations

import pytest

from harness.tools import schedule_report as sr


def test_the_12017_row_is_the_evening_the_schedule_predicts():
  """Evened sections deal a tail of 566 key blocks against a mean of 564;
  the filled ones (5, 5, 5, 1: 620 in order) are dealt light tiles last,
  which the model finds as good."""
  r = sr.row(128, 12017, True)
  assert r["config"].schedule == "longest-first" and r["config"].persistent
  assert r["shipped"]["sections"] == (4, 4, 4, 4) and r["filled"]["sections"] == (5, 5, 5, 1)
  assert (r["shipped"]["light_last"], r["filled"]["light_last"]) == (False, True)
  assert (r["shipped"]["makespan"], r["filled"]["makespan"]) == (566, 566)
  assert r["shipped"]["mean"] == r["filled"]["mean"] == pytest.approx(564.0, abs=0.5)
  assert r["filled"]["tail"] == pytest.approx(566 / r["filled"]["mean"])


def test_the_d256_9522_row_runs_its_light_tiles_last():
  """The model's case for deferring (kernel.tiling.schedule.light_last_gain): d256
  causal, B1, sections of 3, 3 and 2 heads, 1.157 of the mean in order."""
  r = sr.row(256, 9522, True)
  assert r["shipped"]["sections"] == (3, 3, 2) and r["shipped"]["light_last"]
  assert r["shipped"]["tail"] == pytest.approx(1.027, abs=0.001)


def test_a_point_without_the_longest_first_schedule_has_no_deal():
  r = sr.row(128, 4096, False)
  assert r["config"].schedule != "longest-first"
  assert r["shipped"] is None and r["filled"] is None


def test_the_command_prints_the_worst_tail_first(capsys):
  assert sr.main(["--head-dims", "128", "--seqs", "12017,16384", "--gqa", "1"]) == 0
  lines = capsys.readouterr().out.splitlines()
  assert lines[0].startswith("| D | seq | causal |")
  tails = [float(line.split("|")[8]) for line in lines[2:]]
  assert len(tails) == 2 and tails == sorted(tails, reverse=True)
  assert "| 5,5,5,1 light last |" in "\n".join(lines)


def test_the_backward_rows_deal_each_kernel_s_launch_order():
  """d128 causal 16k: dQ has its own kernel, and both grids launch in
  sections whose deal is within 1 % of the ideal; d64 causal 4k fuses dQ
  and launches its dK/dV grid head by head (the sections do not repay the
  spread of the fused dQ's reduce-adds: kernel.tiling.schedule.MIN_SECTION_GAIN)."""
  r = sr.backward_row(128, 16384)
  assert not r["fused"] and r["dkv"]["sections"] == r["dq"]["sections"] == (4, 3, 3, 3, 3)
  assert 1.0 <= r["dkv"]["tail"] < 1.01 and 1.0 <= r["dq"]["tail"] < 1.01
  fused = sr.backward_row(64, 4096)
  assert fused["fused"] and "dq" not in fused and fused["dkv"]["sections"] is None
  assert fused["dkv"]["tail"] == fused["dkv"]["head_by_head"] > 1.02
  # GQA 4 at 1k: head by head would deal the dK/dV grid 1.275 of ideal.
  gqa = sr.backward_row(128, 1024, 4)
  assert gqa["dkv"]["head_by_head"] > 1.2 > gqa["dkv"]["tail"]


def test_the_backward_command_prints_the_worst_tail_first(capsys):
  assert sr.main(["--backward", "--head-dims", "64,128", "--gqa", "1"]) == 0
  lines = capsys.readouterr().out.splitlines()
  assert lines[0].startswith("| D | seq | causal | B | N/K | dQ | dK/dV order |")
  assert len(lines) == 2 + 6
  worst = [max(float(c) for c in (line.split("|")[8], line.split("|")[11]) if c.strip() != "-")
           for line in lines[2:]]
  assert worst == sorted(worst, reverse=True)
