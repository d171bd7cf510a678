"""The harness's tools: the gate, goldens, benchmarks, autotuner, mutants,
the ptxas report and the CPU lowering checks (``python -m harness``)."""
