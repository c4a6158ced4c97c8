"""Scale-out: batch/head sharding and ring (context-parallel) attention."""
from flashvjp.distributed._ring import from_zigzag
from flashvjp.distributed._ring import ring_attention
from flashvjp.distributed._ring import ring_schedule
from flashvjp.distributed._ring import to_zigzag
from flashvjp.distributed._sharding import sharded_attention

__all__ = ["from_zigzag", "ring_attention", "ring_schedule", "sharded_attention", "to_zigzag"]
