"""The harness's tools: the gate, goldens, benchmarks, autotuner, mutants, ptxas report and the CPU lowering checks."""
