"""The harness's proofs: the barrier and stage-ring protocol read out of the
traced kernels, its role programs, and the check of every interleaving."""
