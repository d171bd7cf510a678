"""What the extractor (:mod:`harness.proofs.extract`) reads out of a traced
kernel: each role's protocol events (:class:`Event`) for one launch under
one environment (:class:`Extracted`), the buffers they name, and the errors
that refuse a kernel the proof cannot read."""

from __future__ import annotations

import dataclasses


class UnknownPrimitive(ValueError):
  """The kernel uses a primitive the extractor does not understand."""


class ExtractionError(ValueError):
  """The kernel's protocol cannot be read as a sequence of events."""


class KernelTraceError(ExtractionError):
  """The kernel failed to trace at all (an edit that does not run): the
  proof cannot read it, and says at which of its lines."""


def kernel_trace_error(what: str, err: BaseException) -> KernelTraceError:
  """``err``, raised while tracing ``what``, as a :class:`KernelTraceError`
  naming the deepest line of kernel/ it passed through (a mutant's copy of
  kernel/ named as kernel/ too): a plain message, which a worker process
  sends back whole."""
  import traceback
  frames = traceback.extract_tb(err.__traceback__)
  ours = [f for f in frames if "/kernel/" in f.filename.replace("\\", "/")]
  where = ""
  if ours:
    f = ours[-1]
    path = "kernel/" + f.filename.replace("\\", "/").rsplit("/kernel/", 1)[1]
    where = f" at {path}:{f.lineno} ({(f.line or '').strip()})"
  first = (str(err).strip().splitlines() or [""])[0]
  return KernelTraceError(f"{what}: the kernel failed to trace{where}: "
                          f"{type(err).__name__}: {first}")



class Opaque:
  """A value the protocol does not depend on (arrays, floats, unknown ints)."""

  __slots__ = ()

  def __repr__(self):
    return "?"


OPAQUE = Opaque()

@dataclasses.dataclass(frozen=True)
class Buffer:
  name: str
  space: str            # smem | gmem | barrier | regs
  shape: tuple
  num_arrivals: int = 0  # mbarriers


@dataclasses.dataclass(frozen=True)
class RefV:
  buf: Buffer


@dataclasses.dataclass(frozen=True)
class Event:
  """One protocol step of one role.

  kind: wait | arrive | tma_load | tma_store | store_wait | wgmma | wgmma_wait |
  smem_load | smem_store | fence | bar_sync | bar_arrive.
  """

  kind: str
  role: str
  src: str = dataclasses.field(compare=False)  # file:line: a label, not what it does
  buf: str = ""                # the buffer (smem, or the mbarrier array for wait/arrive)
  slot: int | None = None
  bar: str = ""                # tma_load: the mbarrier array it completes
  bar_slot: int | None = None
  reads: tuple = ()            # wgmma: ((buffer, slot), ...)
  n: int = 0                   # wgmma_wait / store_wait: groups left in flight
  bar_id: int | None = None    # named barriers
  threads: int = 0
  family: str = ""             # named barriers: the kernel/sync/barriers.py helper family

  def where(self):
    return (self.buf, self.slot)

  def describe(self) -> str:
    if self.kind in ("wait", "arrive"):
      return f"{self.kind} {self.buf}[{self.slot}]"
    if self.kind == "tma_load":
      return f"TMA load -> {self.buf}[{self.slot}] completes {self.bar}[{self.bar_slot}]"
    if self.kind == "tma_store":
      return f"TMA store <- {self.buf}[{self.slot}]"
    if self.kind == "wgmma":
      return "wgmma reads " + ", ".join(f"{b}[{s}]" for b, s in self.reads)
    if self.kind in ("wgmma_wait", "store_wait"):
      return f"{self.kind}({self.n})"
    if self.kind in ("smem_load", "smem_store"):
      return f"{self.kind} {self.buf}[{self.slot}]"
    if self.kind in ("bar_sync", "bar_arrive"):
      return f"bar.{self.kind[4:]} id {self.bar_id} ({self.threads} threads, {self.family})"
    return self.kind


@dataclasses.dataclass
class Extracted:
  """The protocol of one kernel launch under one environment."""

  name: str
  roles: dict            # role name -> tuple[Event, ...]
  threads: dict          # role name -> threads it contributes to named barriers
  barriers: dict         # mbarrier array name -> Buffer
  buffers: dict          # smem buffer name -> Buffer
  overlaps: dict = dataclasses.field(default_factory=dict)  # buffer -> buffers sharing bytes
  # role name -> per event, the iterations of the evaluated while loops
  # around it, outermost first: ((loop source line, iteration), ...).
  loops: dict = dataclasses.field(default_factory=dict)
  # Buffers and barriers are named by allocation (smem12, barrier7: the same
  # in every extraction of one trace); these are their names in the
  # kernel's source, for traces.
  names: dict = dataclasses.field(default_factory=dict)

  def label(self, e: Event) -> Event:
    """``e`` with the source's names."""
    n = self.names.get
    return dataclasses.replace(e, buf=n(e.buf, e.buf), bar=n(e.bar, e.bar),
                               reads=tuple((n(b, b), s) for b, s in e.reads))

  def skeleton(self):
    """A hashable form: environments giving the same skeleton share a check."""
    return tuple((r, tuple(ev)) for r, ev in sorted(self.roles.items()))
