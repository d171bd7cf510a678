"""How a call is tiled: the forward's ``Config``, the shared-memory plans of
both passes and the one fit predicate, the heuristics, the autotune cache
and the order tiles run in.  Pure Python: importing it costs no JAX."""
