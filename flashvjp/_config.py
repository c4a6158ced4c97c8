"""Block sizes and the static configuration shared by every implementation.

Room: configuration. Imports nothing from the API; kernels read it.
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Optional, Tuple


@dataclasses.dataclass(frozen=True)
class BlockSizes:
  """Block sizes of the forward and the two backward passes.

  Any positive size works: sequence lengths are padded internally and the
  padding is masked. ``None`` for a backward size means "same as forward".
  """

  block_q: int = 128
  block_kv: int = 128
  block_q_dkv: Optional[int] = None
  block_kv_dkv: Optional[int] = None
  block_q_dq: Optional[int] = None
  block_kv_dq: Optional[int] = None

  def __post_init__(self):
    for f in dataclasses.fields(self):
      v = getattr(self, f.name)
      if v is None and f.name not in ("block_q", "block_kv"):
        continue
      if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
        raise ValueError(f"{f.name} must be a positive int, got {v!r}")

  @property
  def dkv(self) -> Tuple[int, int]:
    return (self.block_q_dkv or self.block_q, self.block_kv_dkv or self.block_kv)

  @property
  def dq(self) -> Tuple[int, int]:
    return (self.block_q_dq or self.block_q, self.block_kv_dq or self.block_kv)


# Tuned defaults. Blockwise on this 2-core CPU, measured on an idle machine in one run
# (benchmarks/bench_cpu.py --quick --seq 4096 --impl blockwise:BQxBK; B=1, H=8, D=64,
# float32, fwd+bwd, 2026-12-02): 256x256 causal 448 ms / full 832 ms; 128x128 698 / 1230;
# 512x512 514 / 801 (and twice the temp memory: 30 vs 16 MiB). 256x256 tiles keep the
# matmuls efficient while skipping most of the causal triangle.
BLOCKWISE_DEFAULT = BlockSizes(block_q=256, block_kv=256)
# Pallas on GPU: forward 128x64 tiles; backward 64x64 (the dK/dV and dQ kernels keep two
# [64, head_dim] float32 accumulators in registers). Untuned: benchmarks/gpu_check.py
# sweeps alternatives. Head dims > 128 shrink them further (flashvjp.pallas._common).
PALLAS_GPU_DEFAULT = BlockSizes(block_q=128, block_kv=64, block_q_dkv=64, block_kv_dkv=64,
                                block_q_dq=64, block_kv_dq=64)
PALLAS_INTERPRET_DEFAULT = BlockSizes(block_q=64, block_kv=64)


def default_block_sizes(implementation: str, interpret: bool) -> BlockSizes:
  """Default blocks of a concrete implementation ("pallas_triton", "blockwise", ...).

  Compiled Pallas-Triton kernels get the GPU table whatever the host (an export for
  CUDA on a CPU host compiles what a GPU would); interpret mode gets small blocks.
  """
  if implementation == "pallas_triton":
    return PALLAS_INTERPRET_DEFAULT if interpret else PALLAS_GPU_DEFAULT
  if implementation == "pallas_tpu":
    return PALLAS_TPU_INTERPRET_DEFAULT if interpret else PALLAS_TPU_DEFAULT
  return BLOCKWISE_DEFAULT


# Pallas on TPU (Mosaic): (8, 128)-legal blocks (kv blocks are score-tile lanes). Forward
# 256 x 512, backward 256 x 256: every kernel's blocks x 2 buffers + scratch stay under
# 16 MiB of VMEM at head_dim 256, float32, with a full bias and a dense mask
# (tests/test_pallas_tpu.py::test_vmem_footprint). Untuned (no TPU was available).
PALLAS_TPU_DEFAULT = BlockSizes(block_q=256, block_kv=512, block_q_dkv=256, block_kv_dkv=256,
                                block_q_dq=256, block_kv_dq=256)
# Interpret mode (CPU tests): small q blocks; kv blocks are rounded up to 128 lanes anyway.
PALLAS_TPU_INTERPRET_DEFAULT = BlockSizes(block_q=64, block_kv=128)


@dataclasses.dataclass(frozen=True)
class AttentionConfig:
  """Everything static about one attention call (hashable: a custom_vjp nondiff arg).

  Array inputs travel separately, normalised by the API:
    q [B, H, Sq, D], k [B, Hkv, Skv, D], v [B, Hkv, Skv, Dv];
    bias: None or rank 4, each dim 1 or full ([B, H, Sq, Skv]);
    mask: None or bool rank 4, each dim 1 or full;
    q_segment_ids [B, Sq] int32 / kv_segment_ids [B, Skv] int32, or None;
    dropout_seed: uint32 [2] or None;
    score_mod_consts: tuple of arrays closed over by score_mod (inexact first).
  """

  scale: float
  causal: bool
  window: Optional[Tuple[Optional[int], Optional[int]]]
  seq_q: int
  seq_kv: int
  dropout_rate: float
  blocks: BlockSizes
  # score_mod, closure converted and traced on scalars: (s, b, h, q_idx, kv_idx, *consts) -> s.
  score_mod: Optional[Callable] = None
  num_diff_consts: int = 0  # the first num_diff_consts score_mod consts are differentiable
  interpret: bool = False
  implementation: str = "blockwise"  # one of flashvjp._dispatch.CONCRETE
  # Dropout keep-mask shared across (batch, heads) where True (Flax's broadcast_dropout):
  # the counter hash then sees b = 0 / h = 0 (flashvjp._dropout.hash_coords).
  dropout_broadcast: Tuple[bool, bool] = (False, False)
  # Dropout keep-mask shared across (batch, heads) where True (Flax's broadcast_dropout):
  # the counter hash then sees b = 0 / h = 0 (flashvjp._dropout.hash_coords).
  dropout_broadcast: Tuple[bool, bool] = (False, False)

  @property
  def dropout_active(self) -> bool:
    return self.dropout_rate > 0.0
