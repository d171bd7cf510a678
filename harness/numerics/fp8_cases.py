"""Named FP8 calls: each a name, its sizes and features, and an Fp8Spec
(harness.numerics.strategies) that makes its e4m3 values and descales from
the name's own seed.  properties/gpu/test_fp8_gpu.py runs them on the GPU under
every schedule (the FP8 mutants of harness/tools/mutants.py name them as
their killers); properties/numerics/test_fp8.py builds them all on the CPU and holds
the NumPy model of the kernel to the rule on the small ones."""

from __future__ import annotations

import zlib

from harness.numerics import strategies as hs
from kernel.call import AttentionShapes, Call

FP8 = "float8_e4m3fn"


def fp8_case(name: str, *, batch=1, seq_q=256, seq_kv=256, heads=2, kv_heads=1, head_dim=64,
             head_dim_out=None, is_causal=False, fp8: hs.Fp8Spec | None = None, scale=None,
             logits_soft_cap=None, mask=None, bias=None, key_range=None, variants=None,
             **call_kwargs) -> Call:
  """A named FP8 call, its arrays drawn from the name's own seed
  (harness.numerics.strategies.Fp8Spec makes the e4m3 values and descales)."""
  shapes = AttentionShapes(B=batch, T=seq_q, N=heads, H=head_dim, S=seq_kv, K=kv_heads,
                           Hv=head_dim if head_dim_out is None else head_dim_out)
  seed = zlib.crc32(name.encode())
  spec = hs.CaseSpec(shapes=shapes, dtype=FP8, seed=seed, scale=scale, is_causal=is_causal,
                     logits_soft_cap=logits_soft_cap,
                     mask=None if mask is None else hs.MaskSpec(mask, 0.7, seed, empty_rows=0.1),
                     bias=None if bias is None else hs.BiasSpec(bias, 1.0, seed),
                     key_range=None if key_range is None else hs.KeyRangeSpec(key_range, seq_kv,
                                                                              seed),
                     variants=variants, fp8=fp8 or hs.Fp8Spec(log2_v=-3.0))
  return hs.build_case(spec).call.replace(**call_kwargs)


# name: the call's arguments.  Descales per tensor unless "head" is named;
# the killers of the FP8 mutants (harness/tools/mutants.py) are among them.
FP8_NAMED = {
    "basic-d64": dict(fp8=hs.Fp8Spec(log2_q=1.0, log2_k=0.5, log2_v=-3.0)),
    "d128-gqa-head-descales": dict(batch=2, seq_q=1024, seq_kv=1024, heads=4, kv_heads=2,
                                   head_dim=128, fp8=hs.Fp8Spec(layout="head", spread=2.0,
                                                                log2_v=2.0)),
    "d256-causal": dict(seq_q=512, seq_kv=512, head_dim=256, is_causal=True),
    "ragged-113x203-d72-dv96": dict(seq_q=113, seq_kv=203, head_dim=72, head_dim_out=96),
    "ragged-1023x1024-causal": dict(seq_q=1023, seq_kv=1024, head_dim=128, is_causal=True),
    "ragged-239x1": dict(seq_q=239, seq_kv=1),
    "outliers-wide-range": dict(seq_q=300, seq_kv=700, fp8=hs.Fp8Spec(
        stored_std=200.0, outliers=0.02, log2_q=-6.0, log2_k=3.0, log2_v=9.0)),
    "one-hot-rows": dict(seq_q=256, seq_kv=1024, fp8=hs.Fp8Spec(log2_q=4.0, log2_k=4.0)),
    "broad-rows-4096": dict(seq_q=128, seq_kv=4096, head_dim=128,
                            fp8=hs.Fp8Spec(stored_std=4.0, log2_q=-3.0, log2_k=-3.0)),
    "softcap-threshold-half": dict(logits_soft_cap=8.0, rescale_threshold=0.5),
    "threshold-0-unnormalised": dict(seq_kv=1024, rescale_threshold=0.0,
                                     normalize_output=False),
    "f16-output-head-descales": dict(kv_heads=2, heads=4, fp8=hs.Fp8Spec(
        layout="head", spread=1.0, out_dtype="float16", log2_v=5.0)),
    "mask-bias-ranges-2d": dict(seq_q=300, seq_kv=500, mask=(1, 1, 300, 500),
                                bias=(1, 2, 300, 500), key_range=(1, 2, 300)),
    "window-segments-causal": dict(seq_q=448, seq_kv=448, is_causal=True,
                                   variants=hs.VariantSpec(local_window_size=(100, 0),
                                                           query_seq_lengths=(400,))),
}
