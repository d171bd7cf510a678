"""Decisions live in records, not in the code (docs/decisions/README.md).

No line under ``kernel/`` quotes a measurement; every record that the
kernel, the harness, the README or ``ci/`` names exists, and the kernel
names every record; each record carries a device, a date, a commit and a
command with its numbers; the index lists every record."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DECISIONS = ROOT / "docs" / "decisions"
INDEX = DECISIONS / "README.md"

# What a quoted measurement looks like: a rate, a timing in ms, a date,
# "measured on/in/against", or two decimals set against each other.
MEASUREMENT = re.compile(
    r"TFLOP/s"
    r"|\b\d+(?:\.\d+)?\s?ms\b"
    r"|\b20\d\d-[01]\d-[0-3]\d\b"
    r"|\b[Mm]easured (?:on|in|against)\b"
    r"|\b\d+\.\d+\s+(?:vs\.?|against)\s+\d+\.\d+")
REFERENCE = re.compile(r"docs/decisions/[A-Za-z0-9_.-]+\.md")
FIELDS = ("Device", "Date", "Commit", "Command")


def _records() -> list[Path]:
  return sorted(p for p in DECISIONS.glob("*.md") if p.name != "README.md")


def _kernel_files() -> list[Path]:
  return sorted((ROOT / "kernel").rglob("*.py"))


def _naming_files() -> list[Path]:
  """Where a record may be named: the kernel, the harness, the README and docs/ pages, ci/."""
  files = _kernel_files() + sorted((ROOT / "harness").rglob("*.py"))
  files += [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
  files += sorted(p for p in (ROOT / "ci").rglob("*") if p.is_file())
  return files


@pytest.mark.parametrize("line", [
    "Measured on the H200 (2026-11-30), headline shape: 608.4",
    "forward (0.49 against 0.46 ms, H200)",
    "d128 4k B4 N16 at threshold 1.0 611.9 vs 570.5",
    "# 3.21 ms for the kernel at the headline shape",
    "(measured on the H100 at B1 N16 d128)",
])
def test_the_pattern_catches_a_quoted_measurement(line):
  assert MEASUREMENT.search(line)


@pytest.mark.parametrize("line", [
    "# Multiplied at every block (docs/decisions/rescale-every-block.md).",
    "SMEM_LIMIT_BYTES = 227 * 1024  # usable shared memory per block on sm90",
    "Streaming multiprocessors of the sm90 GPU (132 on H100 SXM and H200;",
    "thr = 0.5",
])
def test_the_pattern_passes_a_why_comment(line):
  assert not MEASUREMENT.search(line)


def test_no_line_of_the_kernel_quotes_a_measurement():
  files = _kernel_files()
  assert files, "no kernel/*.py found"
  quoted = [f"{p.relative_to(ROOT)}:{i}: {line.strip()}"
            for p in files for i, line in enumerate(p.read_text().splitlines(), 1)
            if MEASUREMENT.search(line)]
  assert not quoted, ("measurements belong in docs/decisions/, the code names the record:\n"
                      + "\n".join(quoted))


def test_every_record_named_exists():
  named = {(p.relative_to(ROOT), ref) for p in _naming_files()
           for ref in REFERENCE.findall(p.read_text(errors="replace"))}
  assert named, "nothing names a record in docs/decisions/"
  missing = sorted(f"{p}: {ref}" for p, ref in named if not (ROOT / ref).is_file())
  assert not missing, "records named but absent:\n" + "\n".join(missing)


def test_the_code_names_every_record():
  """Every record is named where its decision is carried out: a comment in
  kernel/ (or, for the harness's own decisions, in harness/)."""
  code = [*_kernel_files(), *sorted((ROOT / "harness").rglob("*.py"))]
  named = {ref for p in code for ref in REFERENCE.findall(p.read_text())}
  orphans = [p.name for p in _records() if f"docs/decisions/{p.name}" not in named]
  assert not orphans, f"records no comment in kernel/ or harness/ names: {orphans}"


def test_every_record_has_its_fields_and_numbers():
  records = _records()
  assert records, "docs/decisions/ holds no record"
  problems = []
  for p in records:
    text = p.read_text()
    if not text.startswith("# "):
      problems.append(f"{p.name}: no title line")
    for field in FIELDS:
      if not re.search(rf"^- {field}: \S", text, flags=re.M):
        problems.append(f"{p.name}: no '- {field}:' line")
    _, sep, measurements = text.partition("\n## Measurements\n")
    if not sep or not re.search(r"\d", measurements):
      problems.append(f"{p.name}: no '## Measurements' section with a number")
  assert not problems, "\n".join(problems)


def test_the_index_lists_every_record():
  index = INDEX.read_text()
  listed = set(re.findall(r"\]\(([A-Za-z0-9_.-]+\.md)\)", index))
  names = {p.name for p in _records()}
  assert names - listed == set(), f"not in docs/decisions/README.md: {sorted(names - listed)}"
  assert listed - names == set(), f"listed but absent: {sorted(listed - names)}"
