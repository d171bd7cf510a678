"""The gate's kept records (docs/gate/README.md): the newest summary per
device and the newest mutants table, each naming in its head the date,
device and commit its file name gives; every docs/gate/ file the README,
ci/ or the decision records name exists; the index lists every record."""

from __future__ import annotations

import collections
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
GATE = ROOT / "docs" / "gate"
NAME = re.compile(r"(?P<date>20\d\d-\d\d-\d\d)-(?P<device>h100|h200)-(?P<kind>[a-z-]+)-"
                  r"(?P<commit>[0-9a-f]{7,40})\.md")
REFERENCE = re.compile(r"docs/gate/[A-Za-z0-9_.-]+\.md")


def _records() -> list[Path]:
  return sorted(p for p in GATE.glob("*.md") if p.name != "README.md")


def test_every_record_is_named_by_date_device_kind_and_commit():
  records = _records()
  assert records, "docs/gate/ holds no record"
  bad = [p.name for p in records if not NAME.fullmatch(p.name)]
  assert not bad, f"not DATE-DEVICE-KIND-COMMIT.md: {bad}"


def test_a_records_head_names_its_date_device_and_commit():
  for p in _records():
    m = NAME.fullmatch(p.name)
    head = "\n".join(p.read_text().splitlines()[:12])
    for what in (m["date"], m["commit"], m["device"].upper()):
      assert what in head, f"{p.name}: its head does not name {what}"


def test_one_gate_summary_per_device_and_one_mutants_table():
  kinds = collections.Counter()
  for p in _records():
    m = NAME.fullmatch(p.name)
    kinds["mutants" if m["kind"] == "mutants" else f"gate {m['device']}"] += 1
  assert kinds == {"gate h200": 1, "gate h100": 1, "mutants": 1}, (
      f"keep the newest gate summary per device and the newest mutants table: {dict(kinds)}")


def test_every_gate_record_named_exists_and_the_index_lists_them():
  texts = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted((ROOT / "ci").rglob("*")),
           *sorted((ROOT / "docs" / "decisions").glob("*.md"))]
  named = {ref for p in texts if p.is_file() for ref in REFERENCE.findall(p.read_text())}
  assert named, "nothing names a gate record"
  missing = sorted(ref for ref in named if not (ROOT / ref).is_file())
  assert not missing, f"named but absent: {missing}"
  index = (GATE / "README.md").read_text()
  unlisted = [p.name for p in _records() if f"`{p.name}`" not in index]
  assert not unlisted, f"not in docs/gate/README.md: {unlisted}"


def test_the_source_tree_keeps_no_gate_logs():
  assert not (ROOT / "ci" / "results").exists(), "gate records belong in docs/gate/"
