"""A time limit per test that names the test that hung.

A kernel that hangs (a barrier waited on that is never completed) must not
hang the gate.  With ``FLASH_TEST_TIMEOUT=<seconds>`` set, properties/conftest.py
runs every test under :func:`armed`: past the limit it writes
``TEST TIMEOUT: <test id> exceeded N s`` and every thread's stack to stderr,
records the test id under ``FLASH_HANG_DIR`` when set (the gate's summary
reads it), and ends the process with :data:`HANG_EXIT`; under xdist the
controller then reports that the worker crashed while running that test.
pytest-timeout is not needed (the GPU images may lack it).

A plain thread suffices: a process waiting on the GPU has released the GIL.
faulthandler's own watchdog, 30 s later, covers a process that holds it.
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import sys
import threading
from pathlib import Path

TEST_TIMEOUT_ENV = "FLASH_TEST_TIMEOUT"
HANG_DIR_ENV = "FLASH_HANG_DIR"
HANG_EXIT = 86
PREFIX = "TEST TIMEOUT:"


def test_timeout() -> float:
  """The limit from the environment (0: none); a bad value is an error."""
  raw = os.environ.get(TEST_TIMEOUT_ENV, "")
  try:
    value = float(raw) if raw else 0.0
  except ValueError:
    value = -1.0
  if value < 0:
    raise ValueError(f"{TEST_TIMEOUT_ENV}: expected seconds >= 0, got {raw!r}")
  return value


def _stop(test_id: str, limit: float, before_write) -> None:
  message = f"{PREFIX} {test_id} exceeded {limit:.0f} s; stopping this process\n"
  folder = os.environ.get(HANG_DIR_ENV)
  if folder:
    os.makedirs(folder, exist_ok=True)
    Path(folder, f"hang-{os.getpid()}.txt").write_text(test_id + "\n")
  try:
    before_write()
  except Exception:  # the message still goes to the hang file
    pass
  sys.stderr.write(message)
  faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
  sys.stderr.write(message)
  sys.stderr.flush()
  os._exit(HANG_EXIT)


@contextlib.contextmanager
def armed(test_id: str, limit: float, before_write=lambda: None):
  """Run the body under the limit (none when ``limit`` <= 0).
  ``before_write``: called before the message (pytest: suspend capture)."""
  if limit <= 0:
    yield
    return
  timer = threading.Timer(limit, _stop, args=(test_id, limit, before_write))
  timer.daemon = True
  timer.start()
  faulthandler.dump_traceback_later(limit + 30, exit=True)
  try:
    yield
  finally:
    timer.cancel()
    faulthandler.cancel_dump_traceback_later()


def hung_tests(output: str = "", folder: str | Path | None = None) -> list[str]:
  """Test ids a watchdog stopped: from a process's output and/or the
  records under ``folder``."""
  found = [line[len(PREFIX):].strip().split(" exceeded ", 1)[0]
           for line in output.splitlines() if line.startswith(PREFIX)]
  if folder is not None and Path(folder).is_dir():
    found += [p.read_text().strip() for p in sorted(Path(folder).glob("hang-*.txt"))]
  return list(dict.fromkeys(found))
