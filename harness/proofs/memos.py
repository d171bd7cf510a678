"""Memos the extractor keys by ``id`` of objects they keep alive (tracebacks,
jaxprs, treedefs, kernel eqns), and :func:`forget`, which empties them all
between cases.

They serve the probes of one case, which read the same kernels many times.
Emptied before each case (:func:`harness.proofs.prove_pool._learn`,
:func:`harness.proofs.representatives.shape`), a worker that traces thousands
of kernels (every emitted config's) does not keep each kernel's jaxpr:
before, a worker grew by about a megabyte per config, to 12 GB over
``prove``'s configs."""

from __future__ import annotations


class IdMemo(dict):
  """A dict that :func:`forget` empties."""

  every: list = []

  def __init__(self):
    super().__init__()
    IdMemo.every.append(self)


def forget() -> None:
  """Empty every :class:`IdMemo`: the kernels traced so far are done with."""
  for memo in IdMemo.every:
    memo.clear()
