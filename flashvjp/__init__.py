"""flashvjp: exact, memory-efficient, differentiable attention for JAX."""
from flashvjp import testing  # the public gradient checks (flashvjp.testing.check)
from flashvjp._api import explain
from flashvjp._api import flash_attention
from flashvjp._api import memory_efficient_attention
from flashvjp._api import pallas_flash_attention
from flashvjp._config import BlockSizes
from flashvjp._dispatch import Decision
from flashvjp._dropout import dropout_mask
from flashvjp._jax_nn import dot_product_attention
from flashvjp._mask_mod import BlockMask
from flashvjp._mask_mod import MaskMod
from flashvjp._mask_mod import chunked
from flashvjp._mask_mod import document_causal
from flashvjp._mask_mod import make_block_mask
from flashvjp._mask_mod import prefix_lm
from flashvjp._mask_mod import sliding_window_with_global
from flashvjp._plan import Plan
from flashvjp._plan import plan
from flashvjp._record import record_decisions
from flashvjp._remat import RESIDUAL_NAMES
from flashvjp._remat import checkpoint_policy
from flashvjp._score_mod import ScoreMod
from flashvjp._score_mod import alibi
from flashvjp._score_mod import alibi_slopes
from flashvjp._score_mod import relative_position_bias
from flashvjp._score_mod import softcap
from flashvjp.distributed import from_zigzag
from flashvjp.distributed import ring_attention
from flashvjp.distributed import ring_schedule
from flashvjp.distributed import sharded_attention
from flashvjp.distributed import to_zigzag

__version__ = "0.2.0"  # the one place; pyproject reads it (CHANGELOG.md says what changed)

__all__ = [
    "BlockMask", "BlockSizes", "Decision", "MaskMod", "ScoreMod", "alibi", "alibi_slopes",
    "chunked", "document_causal", "dot_product_attention", "dropout_mask", "explain",
    "make_block_mask", "Plan", "plan", "prefix_lm", "sliding_window_with_global",
    "flash_attention", "memory_efficient_attention", "pallas_flash_attention",
    "relative_position_bias", "softcap", "RESIDUAL_NAMES", "checkpoint_policy",
    "record_decisions",
    "from_zigzag", "ring_attention", "ring_schedule", "sharded_attention", "to_zigzag", "testing",
]
