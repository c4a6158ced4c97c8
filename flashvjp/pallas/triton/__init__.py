"""Pallas-Triton kernels (GPU): forward that saves logsumexp, FlashAttention-2 backward.

Room: Pallas-Triton backend. `forward` / `backward` have the same interface as
`flashvjp.blockwise`; `_limits` says what the Triton lowering can take.
"""
from flashvjp.pallas.triton.backward import backward
from flashvjp.pallas.triton.forward import forward

__all__ = ["forward", "backward"]
