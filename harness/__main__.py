"""``python -m harness <command>``: gate, prove, golden, bench, autotune, mutants, ptxas,
schedule."""

import sys


def main(argv=None) -> int:
  argv = list(sys.argv[1:] if argv is None else argv)
  commands = {
      "gate": ("harness.tools.gate", "the conformance gate: everything this machine can run"),
      "prove": ("harness.proofs.prove", "the barrier and ring protocol read out of the traced kernels, proved"),
      "golden": ("harness.tools.golden", "golden-file regression: check | update"),
      "bench": ("harness.tools.bench", "TFLOP/s beside cuDNN; --grid: the whole performance grid"),
      "autotune": ("harness.tools.autotune", "time the candidate configs on the GPU, write the cache"),
      "mutants": ("harness.tools.mutants", "kernel mutants against the tests that must kill them"),
      "ptxas": ("harness.tools.ptxas_report", "registers, spills and wgmma serialisation per kernel (GPU)"),
      "schedule": ("harness.tools.schedule_report", "how evenly the forward's tiles deal to the SMs, per shape (CPU)"),
  }
  if not argv or argv[0] in ("-h", "--help") or argv[0] not in commands:
    print("usage: python -m harness {" + ",".join(commands) + "} [args]")
    for name, (_, what) in commands.items():
      print(f"  {name:8s} {what}")
    return 0 if argv and argv[0] in ("-h", "--help") else 2
  import importlib
  module = importlib.import_module(commands[argv[0]][0])
  return int(module.main(argv[1:]) or 0)


if __name__ == "__main__":
  sys.exit(main())
