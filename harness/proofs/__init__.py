"""The harness's proofs: the barrier and stage-ring protocol read out of the traced kernels, and its proof."""
