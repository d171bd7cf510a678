"""Session 5, run 10: the dK/dV kernel's grid order, (kv_tiles, kv_heads,
batch) as shipped against (kv_heads, batch, kv_tiles) (the private
`pallas-tiles-last`), forward + backward at the headline shape, non-causal
and causal, each in one process with cuDNN.  Writes argv[1] when given."""
import json
import sys

from harness.bench import DEFAULT_SHAPES, Variant, bench_shape, render

rows = []
for shape in DEFAULT_SHAPES[:2]:
  rows += bench_shape(shape, configs=(Variant(backward="pallas"),
                                      Variant(backward="pallas-tiles-last")), backward=True)
  print(render(rows[-2:]), flush=True)
if len(sys.argv) > 1:
  with open(sys.argv[1], "w") as fh:
    json.dump(rows, fh, indent=1)
