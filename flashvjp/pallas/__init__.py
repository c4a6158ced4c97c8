"""Pallas kernels: forward that saves logsumexp, FlashAttention-2 backward (dK/dV and dQ kernels).

Room: Pallas backend. `forward` / `backward` have the same interface as
`flashvjp.blockwise` and are called by the one custom_vjp in `flashvjp._vjp`.
"""
from flashvjp.pallas.backward import backward
from flashvjp.pallas.forward import forward

__all__ = ["forward", "backward"]
