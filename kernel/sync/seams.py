"""Declared seams: stable names for the kernel functions that code outside
``kernel/`` finds by name.

The harness edits the kernel's source at a seam to show that its checks
can fail (``harness/tools/anchors.py`` finds the seam by its declaration,
in whichever file defines it), and the proof's extractor knows a few
helpers by their seams (the register-only ``inline_mgpu`` functions, the
named barrier's emitter).  A seam is declared where its function is
defined, so a rename or a move of the function keeps every edit and the
extractor hooked; a seam removed fails the harness's anchor check, which
names the seam (docs/decisions/declared-seams.md).

Pure Python: :func:`seam` returns the function it decorates, marked, so
nothing JAX traces changes.
"""

from __future__ import annotations

import re

# Dotted lowercase words, the first the part of the kernel the seam is in.
_NAME = re.compile(r"[a-z][a-z0-9_]*(\.[a-z][a-z0-9_]*)+")


def seam(name: str):
  """Declares the decorated function (or class) as the seam ``name``, e.g.
  ``@seam("producer.fill")``; place it next to the ``def``, under any
  decorator that wraps the function."""
  if not _NAME.fullmatch(name):
    raise ValueError(f"seam name {name!r}: dotted lowercase words, e.g. 'producer.fill'")

  def declare(fn):
    fn.__seam__ = name
    return fn
  return declare


def seam_of(fn) -> str | None:
  """The seam ``fn`` is declared as, or None."""
  return getattr(fn, "__seam__", None)
