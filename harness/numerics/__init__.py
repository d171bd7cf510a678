"""The harness's numerics: the float64 references, the tolerance rule, the
online-softmax model, the Hypothesis strategies and the conformance checks
that compare the kernel with them."""
