"""Block sizes and the static configuration shared by every implementation.

Room: configuration. Imports nothing from the API; kernels read it.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any


@dataclasses.dataclass(frozen=True)
class BlockSizes:
  """Block sizes of the forward and the two backward passes.

  Any positive size works: sequence lengths are padded internally and the
  padding is masked. ``None`` for a backward size means "same as forward".
  """

  block_q: int = 128
  block_kv: int = 128
  block_q_dkv: int | None = None
  block_kv_dkv: int | None = None
  block_q_dq: int | None = None
  block_kv_dq: int | None = None

  def __post_init__(self):
    for f in dataclasses.fields(self):
      v = getattr(self, f.name)
      if v is None and f.name not in ("block_q", "block_kv"):
        continue
      if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
        raise ValueError(f"{f.name} must be a positive int, got {v!r}")

  @property
  def dkv(self) -> tuple[int, int]:
    return (self.block_q_dkv or self.block_q, self.block_kv_dkv or self.block_kv)

  @property
  def dq(self) -> tuple[int, int]:
    return (self.block_q_dq or self.block_q, self.block_kv_dq or self.block_kv)


# Tuned defaults. Blockwise on this 2-core CPU, measured on an idle machine in one run
# (benchmarks/bench_cpu.py --quick --seq 4096 --impl blockwise:BQxBK; B=1, H=8, D=64,
# float32, fwd+bwd, 2026-12-02): 256x256 causal 448 ms / full 832 ms; 128x128 698 / 1230;
# 512x512 514 / 801 (and twice the temp memory: 30 vs 16 MiB). 256x256 tiles keep the
# matmuls efficient while skipping most of the causal triangle.
BLOCKWISE_DEFAULT = BlockSizes(block_q=256, block_kv=256)
PALLAS_INTERPRET_DEFAULT = BlockSizes(block_q=64, block_kv=64)


# ---- Pallas-Triton launch table -------------------------------------------------------------
# Float32 matmul precision, as jax.default_matmul_precision names it, reduced to what the
# kernels' float32 dots do (16-bit inputs are unaffected). The one table of what each setting
# computes, its measured error and its cost is docs/implementations.md's "Precision" section:
#   "default": TF32 on the GPU (jax.nn's float32 default there; 10 explicit mantissa bits,
#              the tensor cores ignore the low 13 bits of each operand); Mosaic's default
#              contraction on a TPU. Also None, "fastest", "bfloat16", "tensorfloat32".
#   "high":    3xTF32 on the GPU (Triton's tf32x3 split: three TF32 products, nearly float32,
#              tensor cores kept; operands saturated to the TF32 range first, see
#              pallas/_common.py `TF32_MAX`); bf16x3 on a TPU. Also "bfloat16_3x",
#              lax.Precision.HIGH, "TF32_TF32_F32_X3".
#   "highest": float32 (IEEE float32 dots: Triton's input_precision="ieee", JAX's own lowering
#              of HIGHEST / F32_F32_F32; fp32 contraction on a TPU). Also "float32".
PRECISIONS = ("default", "high", "highest")
_PRECISION_NAMES = {
    None: "default", "default": "default", "fastest": "default", "bfloat16": "default",
    "tensorfloat32": "default", "DEFAULT": "default", "TF32_TF32_F32": "default",
    "high": "high", "HIGH": "high", "bfloat16_3x": "high", "TF32_TF32_F32_X3": "high",
    "highest": "highest", "float32": "highest", "HIGHEST": "highest", "F32_F32_F32": "highest",
}


def canonical_precision(value) -> str:
  """`jax.default_matmul_precision` value -> one of PRECISIONS (ValueError otherwise)."""
  name = getattr(value, "name", value)  # a lax.Precision / DotAlgorithmPreset member
  if name in _PRECISION_NAMES:
    return _PRECISION_NAMES[name]
  raise ValueError(
      f"jax_default_matmul_precision={value!r} is not supported by flashvjp's kernels; use None,"
      " 'default', 'bfloat16', 'tensorfloat32' (TF32 float32 matmuls on GPU), 'high',"
      " 'bfloat16_3x', 'TF32_TF32_F32_X3' (3xTF32: nearly float32) or 'highest', 'float32',"
      " 'F32_F32_F32' (IEEE float32)")


@dataclasses.dataclass(frozen=True)
class Launch:
  """Launch parameters of one Pallas-Triton kernel."""

  block_q: int
  block_kv: int
  num_warps: int
  num_stages: int
  # dK/dV only: compute its tiles transposed ([bk, bq], every dot M = block_kv rows, wgmma);
  # False: [bq, bk] tiles (the two score dots have M = block_q rows).
  transposed: bool = True


def head_dim_bucket(head_dim: int) -> int:
  """The padded head dim the kernels see (a power of 2, 64..256; smaller ones share 64's row)."""
  b = 64
  while b < head_dim:
    b *= 2
  return b


def matmul_kind(dtype, precision: str) -> str:
  """"16bit" (bf16/f16 operands), or for float32 operands at `precision`: "tf32"
  ("default"), "tf32x3" ("high") or "f32" ("highest": IEEE float32 dots, FMA units)."""
  import numpy as np
  if np.dtype(dtype).itemsize <= 2:
    return "16bit"
  return {"default": "tf32", "high": "tf32x3", "highest": "f32"}[precision]


# (padded head dim, matmul kind, kernel role) -> Launch. Roles: "fwd" (accumulator rows =
# block_q), "dkdv" (rows = block_kv), "dq" (rows = block_q), "dbias" (the dK/dV blocks).
# Chosen with the sm_90a compile check (Triton 3.6 + ptxas 12.8, no GPU; 2026-12-03, features
# causal/full/window/segments/mask/bias/dropout/softcap+window/alibi/GQA/combo, head dims
# 64-256): no register spill, shared memory <= 227 KiB, pipelined loops, and >= 64 accumulator
# rows (wgmma) for 16-bit and TF32 up to head dim 128. Why each entry:
# * forward / dQ keep [rows, head_dim] float32 accumulators plus the q (and dO) tile in
#   registers: 8 warps split 128 rows over two warpgroups; float32 operands (TF32) at 256 and
#   3xTF32 ("high", every operand split in two in registers) need fewer rows / columns;
#   IEEE float32 ("highest": FMA dots, each thread holds its rows of both operands along
#   the whole contraction) spills in the forward at 32x64 (d64, 552 B) and 16x32 (d128,
#   236-464 B): 32x32 / 16x16 forward tiles are spill-free (79 / 64 registers); its
#   backward keeps 3xTF32's tiles (71-126 registers).
# * dK/dV keeps two [block_kv, head_dim] accumulators (and K, V) in registers and computes its
#   tiles transposed ([bk, bq], as FlashAttention-2/3), so all four dots have M = block_kv rows
#   (wgmma at 64) and block_q is only their N: 16-bit 64x64 at d64; 32x64 at d128 (64x64
#   spills: gqa causal 72 B, softcap+window 20 B); 16x64 at d256 (32x64: causal 80 B); TF32
#   32x64 at d64 (64x64: causal 32 B); TF32 d128 16x64 NOT transposed (transposed 16x64
#   spills 660 B causal (K, V are then the A operands, likely held in registers); 4 or 16 warps
#   worse; 32x32 transposed is spill-free but all mma.sync): its dK/dV dots stay wgmma, the
#   two 16-row score dots mma.sync; float32 head dim > 128 and 3xTF32 d128 keep 32-row kv
#   tiles (64 rows spill 0.1-5 KB).
# * num_stages 2 everywhere: software-pipelined K/V (Q/dO) loads (1 stage loses the async copies).
# Known residue: 3xTF32 ("high") spills at head dim 128 with softcap+window in dK/dV (4 B;
# 1 stage avoids it but is not pipelined) and at head dim > 128 (dK/dV up to ~26 KB, dQ
# ~0.5 KB) at every tile size tried down to 16x16; 16-bit and TF32 are spill-free.
LAUNCH_TABLE: dict = {}


def _fill(hd, kind, fwd, dkdv, dq, dbias=None):
  for role, p in (("fwd", fwd), ("dkdv", dkdv), ("dq", dq), ("dbias", dbias or dkdv)):
    LAUNCH_TABLE[(hd, kind, role)] = Launch(*p)


#    head dim, kind     fwd (bq, bk, warps, stages)  dK/dV            dQ
_fill(64, "16bit", (128, 64, 8, 2), (64, 64, 8, 2), (64, 64, 4, 2))
_fill(128, "16bit", (128, 64, 8, 2), (32, 64, 8, 2), (64, 64, 8, 2))
_fill(256, "16bit", (64, 32, 8, 2), (16, 64, 8, 2), (64, 32, 8, 2))
_fill(64, "tf32", (128, 64, 8, 2), (32, 64, 8, 2), (64, 64, 8, 2))
_fill(128, "tf32", (128, 64, 8, 2), (16, 64, 8, 2, False), (64, 16, 8, 2))
_fill(256, "tf32", (64, 16, 8, 2), (32, 32, 8, 2), (32, 32, 8, 2))
_fill(64, "tf32x3", (32, 64, 4, 2), (16, 64, 8, 2), (32, 32, 4, 2))
_fill(128, "tf32x3", (16, 32, 4, 2), (16, 32, 8, 2), (16, 32, 4, 2))
_fill(256, "tf32x3", (16, 16, 8, 2), (16, 32, 8, 2), (16, 16, 4, 2))
_fill(64, "f32", (32, 32, 4, 2), (16, 64, 8, 2), (32, 32, 4, 2))
_fill(128, "f32", (16, 16, 4, 2), (16, 32, 8, 2), (16, 32, 4, 2))
_fill(256, "f32", (16, 16, 8, 2), (16, 32, 8, 2), (16, 16, 4, 2))


def launch(head_dim: int, dtype, precision: str, role: str) -> Launch:
  """The table's launch parameters for one kernel (head_dim: the larger of D and Dv)."""
  return LAUNCH_TABLE[(head_dim_bucket(head_dim), matmul_kind(dtype, precision), role)]


def default_block_sizes(implementation: str, interpret: bool, head_dim: int = 64,
                        dtype="bfloat16", precision: str = "default") -> BlockSizes:
  """Default blocks of a concrete implementation ("pallas_triton", "blockwise", ...).

  Compiled Pallas-Triton kernels get the launch table's blocks for (head_dim, dtype,
  precision) whatever the host (an export for CUDA on a CPU host compiles what a GPU
  would); interpret mode gets small blocks.
  """
  if implementation == "pallas_triton":
    if interpret:
      return PALLAS_INTERPRET_DEFAULT
    f, dkv, dq = (launch(head_dim, dtype, precision, r) for r in ("fwd", "dkdv", "dq"))
    return BlockSizes(block_q=f.block_q, block_kv=f.block_kv, block_q_dkv=dkv.block_q,
                      block_kv_dkv=dkv.block_kv, block_q_dq=dq.block_q, block_kv_dq=dq.block_kv)
  if implementation == "pallas_tpu":
    return PALLAS_TPU_INTERPRET_DEFAULT if interpret else PALLAS_TPU_DEFAULT
  if implementation == "pallas_mosaic_gpu":
    # The kernels plan their own blocks (not read); these are the finest of them, at which
    # a mask_mod is classified (`mask_mod_blocks`) so that every kernel's visit lists are
    # exact: forward CTAs of 128 rows, kv blocks of 64 or 128; dK/dV 32 (or 64) x 64;
    # dQ 64 x 64.
    del interpret
    return PALLAS_MOSAIC_GPU_BLOCKS
  return BLOCKWISE_DEFAULT


PALLAS_MOSAIC_GPU_BLOCKS = BlockSizes(block_q=128, block_kv=64, block_q_dkv=32,
                                      block_kv_dkv=64, block_q_dq=64, block_kv_dq=64)

# Where the Mosaic-GPU family has earned the default on Hopper: (head_dim bucket, causal) ->
# the evidence, a GPU check's verdict (`benchmarks/gpu_check.py`'s `mosaic_verdict`: every
# Mosaic correctness row passed and its fwd+bwd and fwd beat Pallas-Triton at every timed
# shape of the class), e.g. "gpu_check 2027-01-05, NVIDIA H200: valid, 1.4x Pallas-Triton".
# `implementation=None` / "pallas" on a Hopper target then runs the Mosaic-GPU kernels for
# that class (`flashvjp._dispatch.decide`; explain says so and quotes the evidence). Empty:
# the family has never run on a GPU, so Pallas-Triton runs on every NVIDIA GPU.
MOSAIC_GPU_EARNED: dict[tuple[int, bool], str] = {}


def mosaic_gpu_earned(head_dim: int, causal: bool) -> str | None:
  """The recorded evidence that the Mosaic-GPU family is valid and faster on Hopper for this
  class (`MOSAIC_GPU_EARNED`), or None."""
  return MOSAIC_GPU_EARNED.get((head_dim_bucket(head_dim), bool(causal)))


# Pallas on TPU (Mosaic): (8, 128)-legal blocks (kv blocks are score-tile lanes). Forward
# 256 x 512, backward 256 x 256: every kernel's blocks x 2 buffers + scratch stay under
# 16 MiB of VMEM at head_dim 256, float32, with a full bias and a dense mask
# (tests/test_pallas_tpu.py::test_vmem_footprint). Untuned (no TPU was available).
PALLAS_TPU_DEFAULT = BlockSizes(block_q=256, block_kv=512, block_q_dkv=256, block_kv_dkv=256,
                                block_q_dq=256, block_kv_dq=256)
# Interpret mode (CPU tests): small q blocks; kv blocks are rounded up to 128 lanes anyway.
PALLAS_TPU_INTERPRET_DEFAULT = BlockSizes(block_q=64, block_kv=128)


# The GPU defaults at head_dim 64, bfloat16 (what the benchmarks' tables name "default").
PALLAS_GPU_DEFAULT = default_block_sizes("pallas_triton", False)


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
  window: tuple[int | None, int | None] | None
  seq_q: int
  seq_kv: int
  dropout_rate: float
  blocks: BlockSizes
  # score_mod, closure converted and traced on scalars: (s, b, h, q_idx, kv_idx, *consts) -> s.
  score_mod: Callable | None = None
  num_diff_consts: int = 0  # the first num_diff_consts score_mod consts are differentiable
  interpret: bool = False
  implementation: str = "blockwise"  # one of flashvjp._dispatch.CONCRETE
  # float32 matmuls: "default" (TF32 on GPU, as jax.nn), "high" (3xTF32) or "highest"
  # (IEEE float32); from jax.default_matmul_precision when the call is prepared (PRECISIONS).
  precision: str = "default"
  # Dropout keep-mask shared across (batch, heads) where True (Flax's broadcast_dropout):
  # the counter hash then sees b = 0 / h = 0 (flashvjp._dropout.hash_coords).
  dropout_broadcast: tuple[bool, bool] = (False, False)
  # mask_mod, closure converted and traced on scalars: (b, h, q_idx, kv_idx, *consts) -> bool
  # (flashvjp._mask_mod.ScalarMaskMod); its consts and block classes travel as `mod`
  # (flashvjp._mask_mod.ModInputs), the classes at blocks `mask_mod_blocks` (bq, bk).
  mask_mod: Callable | None = None
  mask_mod_blocks: tuple[int, int] | None = None
  mask_mod_uses: tuple[bool, bool] = (True, True)  # whether it reads (b, h)
  # out in the accumulation dtype (float32), its p @ v in float32: set for a traced scale
  # with low-precision inputs (flashvjp._api._fold_scale), so that the backward's
  # delta = rowsum(dO * O) is that of the backward's own float32 probabilities.
  out_f32: bool = False
  # With out_f32 and a bias: the traced scale's folded part divides the bias (float32)
  # before the kernels (flashvjp._api._fold_bias), since the bias is added after the scale.
  fold_bias: bool = False
  # With fold_bias and no score_mod of the user's: the folded bias' rows are shifted by
  # their largest finite entry (the softmax is shift invariant; lse gets it back).
  fold_shift: bool = False
  # The sequence sharded over a mesh axis (implementation "ring"): a
  # flashvjp.ring.RingSpec (axis, layout, the per-pair backend); seq_q / seq_kv are then
  # the local lengths and causal / window / score_mod / mask_mod / dropout keep their
  # global meaning. None for a one-device call.
  ring: Any = None
  # Under jit with the sequence sharded (flashvjp._partition): the context-parallel strategy
  # asked for ("auto", "ring", "ulysses", "usp", "all_gather"; flashvjp._strategy) and the
  # mask_mod's static hint (`kv_intervals`: which pairs of chunks can meet), set when more
  # than one device exists.
  context_parallel: str = "auto"
  # The ring (or all-gather) run once per group of kv heads, one group after the other
  # (`flashvjp.ring.RingSpec.head_groups`): 1 / ring_head_groups of its per-device state.
  ring_head_groups: int = 1
  # The mesh axes the user says join devices of one node (fast links): the others of the
  # sequence's axes cross nodes. None: read from the devices' placement
  # (`flashvjp._partition.axis_links`).
  intra_node_axes: tuple | None = None
  mask_mod_hint: Callable | None = None
  # Whether the program's mesh has more than one device (flashvjp._target: the inputs'
  # shardings, else the abstract mesh, else the host): the backends are then wrapped in
  # the partitioning rule under jit; with one device that rule is skipped.
  partition: bool = False
  # Also return each row's maximum logit (after scale, bias and score_mod, over allowed
  # positions; -inf for a row with none): every backend's forward then returns
  # (out, lse, row_max [B, H, Sq] float32), from the same pass (QK-clip; no gradient).
  max_logits: bool = False
  # The compiled Mosaic-GPU family's kernels for the program's target: None (Hopper, sm_90a:
  # flashvjp.pallas.mosaic_gpu) or "sm_100a" (Blackwell: flashvjp.pallas.mosaic_gpu_sm100),
  # from the target's device kind (`pallas.mosaic_gpu._limits.gpu_arch`), never the host's.
  gpu_arch: str | None = None

  @property
  def dropout_active(self) -> bool:
    return self.dropout_rate > 0.0


# ---- recorded launch tables (benchmarks/gpu_check.py's sweep) ------------------------------
# A file written by a GPU run's sweep: {"format": LAUNCH_TABLE_FORMAT, "machine": {device_kind,
# jax, triton, date, ...}, "entries": [{"head_dim", "kind", "role", "block_q", "block_kv",
# "num_warps", "num_stages", "transposed", ...measurements}]}. Loading it changes nothing by
# itself: `launch_overrides` applies entries for a block of code; adopting them as defaults is
# an edit of the `_fill` lines above, naming the file and machine they came from.
LAUNCH_TABLE_FORMAT = "flashvjp-launch-table/1"


def load_launch_table(path):
  """({(head dim, kind, role): Launch}, machine dict) of a recorded launch table file.

  Every entry must name a key of LAUNCH_TABLE (a known head-dim bucket, matmul kind and
  role) and positive ints for blocks, warps and stages; ValueError names what is wrong.
  """
  import json
  with open(path) as f:
    try:
      data = json.load(f)
    except ValueError as e:
      raise ValueError(f"launch table {path}: not JSON ({e})") from None
  if not isinstance(data, dict) or data.get("format") != LAUNCH_TABLE_FORMAT:
    raise ValueError(f"launch table {path}: format must be {LAUNCH_TABLE_FORMAT!r}, got "
                     f"{data.get('format') if isinstance(data, dict) else type(data).__name__!r}")
  machine, entries = data.get("machine"), data.get("entries")
  if not isinstance(machine, dict) or not machine.get("device_kind"):
    raise ValueError(f"launch table {path}: machine must be a dict with device_kind, got {machine!r}")
  if not isinstance(entries, list):
    raise ValueError(f"launch table {path}: entries must be a list, got {type(entries).__name__}")
  table = {}
  for i, entry in enumerate(entries):
    where = f"launch table {path}: entries[{i}]"
    if not isinstance(entry, dict):
      raise ValueError(f"{where} must be a dict, got {type(entry).__name__}")
    key = (entry.get("head_dim"), entry.get("kind"), entry.get("role"))
    if key not in LAUNCH_TABLE:
      raise ValueError(f"{where}: (head_dim, kind, role) = {key} is not a key of LAUNCH_TABLE")
    for name in ("block_q", "block_kv", "num_warps", "num_stages"):
      v = entry.get(name)
      if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
        raise ValueError(f"{where}: {name} must be a positive int, got {v!r}")
    transposed = entry.get("transposed", True)
    if not isinstance(transposed, bool):
      raise ValueError(f"{where}: transposed must be a bool, got {transposed!r}")
    if key in table:
      raise ValueError(f"{where}: {key} appears twice")
    table[key] = Launch(entry["block_q"], entry["block_kv"], entry["num_warps"], entry["num_stages"], transposed)
  return table, machine


class launch_overrides:
  """Context manager: LAUNCH_TABLE with `entries` ({key: Launch}) replacing its values.

  Kernels read the table when they are traced, so jax's caches are cleared on entry and on
  exit (a cached trace would otherwise keep the other table's launch parameters).
  """

  def __init__(self, entries):
    unknown = [k for k in entries if k not in LAUNCH_TABLE]
    if unknown:
      raise ValueError(f"entries must be keys of LAUNCH_TABLE, got unknown {unknown}")
    self._entries = dict(entries)
    self._saved: dict = {}

  def __enter__(self):
    import jax
    self._saved = {k: LAUNCH_TABLE[k] for k in self._entries}
    LAUNCH_TABLE.update(self._entries)
    jax.clear_caches()
    return self

  def __exit__(self, *exc):
    import jax
    LAUNCH_TABLE.update(self._saved)
    jax.clear_caches()
    return False
