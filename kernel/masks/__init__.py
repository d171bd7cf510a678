"""The static masks of attention, in one place
(docs/decisions/mask-room.md): the record of a call's mask and what
follows from it, the row ranges, block bounds and tile weights
(kernel/masks/mask.py), the kernels' selects of a tile's pairs
(kernel/masks/selects.py) and the backward's per-register selects
(kernel/masks/register_selects.py).  The passes, the tiling and the float64
reference ask the call's ``Mask`` (kernel.tiling.plan.Problem.mask), not
its flags.

Only the record is imported here: it is pure Python, which
kernel.tiling.plan reads without JAX."""

from kernel.masks.mask import Mask

__all__ = ["Mask"]
