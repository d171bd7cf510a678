"""The sm90 backward: a dK/dV kernel (accumulating dQ where it fits) and a
dQ kernel, from the forward's natural-log residuals; dbias from dS.
:func:`attention_backward` runs them (kernel/backward/launch.py)."""

from kernel.backward.launch import attention_backward

__all__ = ["attention_backward"]
