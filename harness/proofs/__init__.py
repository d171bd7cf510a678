"""The harness's proofs: the barrier and stage-ring protocol read out of the
traced kernels, its role programs, and the check of every interleaving.

One concern a file, none over 800 lines (docs/decisions/proof-engine-files.md):
tracing the kernels (forward_traces, backward_traces, symbolic_dims,
tracing), reading their events (extract, events, jaxprs, kernel_lines,
symbolic), probing and learning their programs (probes, forward_probes,
backward_probes, role_programs), Z3's proof of the premise (premise,
premise_rounds, terms, term_walks, z3_terms), the search (search,
search_program, search_state, search_environment, search_steps,
violations), and running them all (prove_pool, prove_cache, prove)."""
