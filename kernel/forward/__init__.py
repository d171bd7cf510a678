"""The sm90 forward: warp-specialised flash attention in Pallas Mosaic GPU.

:func:`flash_attention_forward` launches it for one problem
(kernel.tiling.plan.Problem) and tiling (kernel/forward/launch.py says how
the modules beside it divide the work)."""

from kernel.forward.launch import flash_attention_forward

__all__ = ["flash_attention_forward"]
