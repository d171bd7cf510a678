"""The conformance harness of the kernel, in three parts: ``numerics`` (the
float64 references, the tolerance rule, the strategies and the checks that
compare the kernel with them), ``proofs`` (the barrier and stage-ring
protocol read out of the traced kernels, proved) and ``tools`` (the gate,
goldens, benchmarks, autotuner, mutants and the lowering checks);
``python -m harness <command>`` runs the tools."""
