"""The sm90 forward: warp-specialised flash attention in Pallas Mosaic GPU.

:func:`flash_attention_forward` launches it (kernel/forward/launch.py, which
says how the modules beside it divide the work) over the static switches of
:class:`Features`."""

from kernel.forward.context import Features
from kernel.forward.launch import flash_attention_forward

__all__ = ["Features", "flash_attention_forward"]
