"""Pure-JAX blockwise attention: O(seq) memory forward and hand-written backward."""
from flashvjp.blockwise._impl import backward
from flashvjp.blockwise._impl import forward

__all__ = ["forward", "backward"]
