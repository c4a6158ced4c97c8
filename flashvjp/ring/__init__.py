"""Ring (context-parallel) attention as a backend of the one differentiable op.

`forward`, `backward` and `tangent` have the backend contract (flashvjp.blockwise) and run
inside shard_map; `RingSpec` (in `AttentionConfig.ring`) says which axis, which layout and
which per-pair backend. The user-facing entry points are flashvjp.distributed's
`ring_attention` and `sharded_attention`.
"""
from flashvjp.ring._backend import backward
from flashvjp.ring._backend import forward
from flashvjp.ring._backend import tangent
from flashvjp.ring._backend import uses_offsets
from flashvjp.ring._schedule import LAYOUTS
from flashvjp.ring._schedule import RingSpec
from flashvjp.ring._schedule import check_head_groups

__all__ = ["LAYOUTS", "RingSpec", "backward", "check_head_groups", "forward", "tangent",
           "uses_offsets"]
