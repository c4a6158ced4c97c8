"""mask_mod: masks as functions, their block classification, BlockMask and built-ins.

Room: mask model (functions). A mask_mod is elementwise: ``(b, h, q_idx, kv_idx) ->
bool`` (True = may attend) with global int32 indices shaped to broadcast against each
other, as FlexAttention's. flashvjp traces it once on scalars (`check`), so arrays it
closes over (per-batch prefix lengths, a document-id vector) become explicit,
non-differentiable inputs; every implementation then applies the scalar function to its
own tile (`apply`). The mask is combined with mask / causal / window / segment_ids by AND.

Block sparsity: `classify` evaluates the mask_mod one row of blocks at a time (never the
whole [seq_q, seq_kv] grid at once) and gives each (q block, kv block) pair a class,
EMPTY / PARTIAL / FULL (`flashvjp._mask`); the kernels skip EMPTY blocks and apply the
elementwise mask only on PARTIAL ones. `make_block_mask` returns that table as a pytree
(`BlockMask`), so a training step builds it once per batch and passes it in.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import NamedTuple
from typing import Protocol

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from flashvjp import _ad_compat as _ac
from flashvjp import _mask
from flashvjp import _score_mod


class MaskMod(Protocol):
  """The callable type of `mask_mod`: ``(b, h, q_idx, kv_idx) -> bool`` (True = may attend)."""

  def __call__(self, b: jax.Array, h: jax.Array, q_idx: jax.Array,
               kv_idx: jax.Array) -> jax.Array:
    ...


class ModInputs(NamedTuple):
  """What the implementations receive for a mask_mod (a pytree; not differentiable).

  classes: int8 [B', H', nq, nk] block classes (`_mask.EMPTY / PARTIAL / FULL`) at the
    block sizes `AttentionConfig.mask_mod_blocks` (B', H' are 1 where the mask_mod
    ignores b / h).
  consts: the arrays the mask_mod closes over, in the order its scalar form takes them.
  """

  classes: jax.Array
  consts: tuple


class ScalarMaskMod:
  """A mask_mod traced on scalars: ``fn(b, h, q, kv, *consts) -> bool``.

  Equality and hash are those of the traced computation (so an equal configuration
  compiles once, as `_score_mod.ScalarScoreMod`).
  """

  def __init__(self, jaxpr, key):
    self._jaxpr = jaxpr
    self._key = key

  def __call__(self, b, h, q, kv, *consts):
    (out,) = _ac.eval_jaxpr_varying(self._jaxpr, list(consts), b, h, q, kv)
    return out

  __eq__ = _score_mod.keyed_eq
  __hash__ = _score_mod.keyed_hash
  __repr__ = _score_mod.keyed_repr


def _traced(what, fn, *args):
  return _score_mod._traced(what, fn, *args, name="mask_mod",  # pylint: disable=protected-access
                            argnames="(b, h, q_idx, kv_idx)")


def convert(mask_mod: Callable) -> tuple[ScalarMaskMod, tuple]:
  """Trace `mask_mod` on scalar int32 indices; every array it reads becomes an input."""
  i = jax.ShapeDtypeStruct((), jnp.int32)
  closed = _traced("on scalar indices", jax.make_jaxpr(mask_mod), i, i, i, i)
  out_avals = closed.out_avals
  if len(out_avals) != 1 or out_avals[0].shape != ():
    raise ValueError(
        "mask_mod must be elementwise: called on scalar indices it must return one bool,"
        f" got {[tuple(a.shape) for a in out_avals]}")
  if out_avals[0].dtype != jnp.bool_:
    raise TypeError(f"mask_mod must return bool (True = may attend), got {out_avals[0].dtype}")
  consts = tuple(_score_mod.concrete_const(c) for c in closed.consts)
  return ScalarMaskMod(closed.jaxpr, str(closed.jaxpr)), consts


_ELEMENTWISE_OK: dict = {}


def check(mask_mod: Callable, target) -> tuple[ScalarMaskMod, tuple, tuple[bool, bool]]:
  """Validate `mask_mod` for scores of shape `target` = (B, H, Sq, Skv).

  Returns (fn, consts, (uses_b, uses_h)). Raises TypeError / ValueError naming mask_mod
  when it is not callable, fails while traced, returns a non-bool or an array that does
  not broadcast to `target`, or is not elementwise (applied to a small tile of indices it
  differs from its scalar form applied to each index; evaluated only when
  `_score_mod.provably_elementwise` cannot prove it from the jaxpr).
  """
  if not callable(mask_mod):
    raise TypeError("mask_mod must be callable (b, h, q_idx, kv_idx) -> bool, got"
                    f" {type(mask_mod).__name__}")
  B, H, Sq, Skv = target
  i32 = jnp.int32
  sds = jax.ShapeDtypeStruct
  idx = (sds((B, 1, 1, 1), i32), sds((1, H, 1, 1), i32), sds((1, 1, Sq, 1), i32),
         sds((1, 1, 1, Skv), i32))
  out = _traced(f"on indices for scores of shape {tuple(target)}", jax.eval_shape, mask_mod, *idx)
  shape = tuple(getattr(out, "shape", ()))
  if getattr(out, "dtype", None) != jnp.bool_:
    raise TypeError(f"mask_mod must return bool (True = may attend), got "
                    f"{getattr(out, 'dtype', type(out).__name__)}")
  try:
    full = jnp.broadcast_shapes(shape, tuple(target))
  except ValueError:
    full = None
  if full != tuple(target):
    raise ValueError(f"mask_mod must return a bool array broadcastable to {tuple(target)},"
                     f" got shape {shape}")
  shape = (1,) * (4 - len(shape)) + shape
  uses = (shape[0] != 1 or B == 1, shape[1] != 1 or H == 1)
  try:
    fn, consts = convert(mask_mod)
  except (TypeError, ValueError) as e:
    # It runs on index arrays but not on scalar indices: it reduces, slices or indexes
    # along the index axes.
    closed = jax.make_jaxpr(mask_mod)(*idx)
    prims = sorted(set(_score_mod._mixing_prims(  # pylint: disable=protected-access
        closed.jaxpr, closed.jaxpr.invars)))
    why = f"it applies {', '.join(prims)} to the indices, and " if prims else ""
    raise ValueError(
        f"mask_mod must be elementwise: {why}on scalar indices (how flashvjp's kernels call"
        f" it) it fails: {e.__cause__ or e}") from e
  tb, th, tq, tk = min(B, 2), min(H, 2), min(Sq, 3), min(Skv, 4)
  pos = lambda n, t: np.unique(np.linspace(0, n - 1, t).round().astype(np.int32))
  bi, hi, qi, ki = pos(B, tb), pos(H, th), pos(Sq, tq), pos(Skv, tk)
  tile = (len(bi), len(hi), len(qi), len(ki))
  key = (fn, tile)
  proven = False
  if key not in _ELEMENTWISE_OK:
    zeros = lambda c: jnp.zeros(jnp.shape(c), jnp.result_type(c)) if isinstance(
        c, jax.core.Tracer) else c
    args_t = (bi.reshape(-1, 1, 1, 1), hi.reshape(1, -1, 1, 1), qi.reshape(1, 1, -1, 1),
              ki.reshape(1, 1, 1, -1))
    tile_idx = tuple(sds(a.shape, i32) for a in args_t)
    closed = _traced(f"on a tile of indices of shape {tile}", jax.make_jaxpr(mask_mod), *tile_idx)
    # Elementwise by construction: nothing to evaluate (no jax op runs while tracing).
    proven = _score_mod.provably_elementwise(
        closed.jaxpr, fn._jaxpr, 4)  # pylint: disable=protected-access
  if key not in _ELEMENTWISE_OK and not proven:
    with jax.ensure_compile_time_eval():
      args = tuple(jnp.asarray(a) for a in args_t)
      (whole,) = _traced("on a tile", jax.core.eval_jaxpr, closed.jaxpr,
                         [zeros(c) for c in closed.consts], *args)
      each = apply(fn, tuple(zeros(c) for c in consts), *args)
      whole = np.asarray(jnp.broadcast_to(whole, tile))
      each = np.asarray(jnp.broadcast_to(each, tile))
    if (whole != each).any():
      prims = sorted(set(_score_mod._mixing_prims(  # pylint: disable=protected-access
          closed.jaxpr, closed.jaxpr.invars)))
      why = f" (it applies {', '.join(prims)} to the indices)" if prims else ""
      raise ValueError(
          "mask_mod must be elementwise: each entry may depend only on its own (b, h, q_idx,"
          f" kv_idx), but on a tile of indices of shape {tile} it differs from applying it to"
          f" each index alone{why}. flashvjp evaluates mask_mod block by block, so reductions"
          " or cumulative ops over the index arrays cannot be computed exactly")
  if key not in _ELEMENTWISE_OK:
    if len(_ELEMENTWISE_OK) > 1024:
      _ELEMENTWISE_OK.clear()
    _ELEMENTWISE_OK[key] = True
  return fn, consts, uses


def apply(fn: Callable, consts, b, h, q_idx, kv_idx):
  """The scalar mask_mod `fn` applied elementwise to broadcasting index arrays (bool)."""
  i32 = lambda x: jnp.asarray(x).astype(jnp.int32)
  # under shard_map: the traced mask_mod's operands agree on their varying axes
  b, h, q_idx, kv_idx, *consts = _ac.unify_varying(i32(b), i32(h), i32(q_idx), i32(kv_idx),
                                                   *consts)
  vec = jnp.vectorize(lambda b_, h_, q_, k_: fn(b_, h_, q_, k_, *consts))
  return vec(b, h, q_idx, kv_idx)


def tile_allowed(fn, consts, b, h, q_idx, kv_idx, seq_q: int, seq_kv: int):
  """`apply` at indices clamped into the real sequences (padding never reaches the user's
  function, so its array lookups stay in range; the mask model masks padding anyway)."""
  q_idx = jnp.minimum(q_idx, seq_q - 1)
  kv_idx = jnp.minimum(kv_idx, seq_kv - 1)
  return apply(fn, consts, b, h, q_idx, kv_idx)


# ---- block classification ------------------------------------------------------------

def classify(fn, consts, uses, B: int, H: int, seq_q: int, seq_kv: int, block_q: int,
             block_kv: int):
  """int8 [B', H', nq, nk] block classes of the scalar mask_mod `fn` (see `ModInputs`).

  Evaluated one row of q blocks at a time (`lax.map`): memory O(B' H' block_q seq_kv),
  never [seq_q, seq_kv]. A class counts real positions only (q < seq_q, kv < seq_kv):
  EMPTY when the mask_mod allows none of the block's, FULL when it allows all of them.
  """
  nq, nk = _mask.num_blocks(seq_q, block_q), _mask.num_blocks(seq_kv, block_kv)
  Bp, Hp = (B if uses[0] else 1), (H if uses[1] else 1)
  b = jnp.arange(Bp, dtype=jnp.int32).reshape(Bp, 1, 1, 1)
  h = jnp.arange(Hp, dtype=jnp.int32).reshape(1, Hp, 1, 1)
  kv = jnp.arange(nk * block_kv, dtype=jnp.int32).reshape(1, 1, 1, nk * block_kv)
  kv_real = kv < seq_kv

  def row(i):
    q = (i * block_q + jnp.arange(block_q, dtype=jnp.int32)).reshape(1, 1, block_q, 1)
    ok = tile_allowed(fn, consts, b, h, q, kv, seq_q, seq_kv)
    ok = jnp.broadcast_to(ok, (Bp, Hp, block_q, nk * block_kv))
    real = (q < seq_q) & kv_real
    some = (ok & real).reshape(Bp, Hp, block_q, nk, block_kv).any(axis=(2, 4))
    every = (ok | ~real).reshape(Bp, Hp, block_q, nk, block_kv).all(axis=(2, 4))
    return jnp.where(every, _mask.FULL, jnp.where(some, _mask.PARTIAL, _mask.EMPTY)).astype(
        jnp.int8)

  rows = lax.map(row, jnp.arange(nq, dtype=jnp.int32))  # [nq, B', H', nk]
  return jnp.moveaxis(rows, 0, 2)


@jax.tree_util.register_pytree_node_class
@dataclasses.dataclass(frozen=True)
class BlockMask:
  """A mask_mod's block classes, built once per batch by `make_block_mask`.

  Attributes:
    classes: int8 [B', H', num_q_blocks, num_kv_blocks]: 0 empty (skipped), 1 partial (the
      elementwise mask is applied), 2 full (no mask needed). B' / H' are 1 where the
      mask_mod ignores the batch / head index.
    block_q, block_kv, seq_q, seq_kv, batch, num_heads: static (pytree metadata).

  A pytree: pass it through jit, or build it inside a jitted step.
  """

  classes: jax.Array
  block_q: int
  block_kv: int
  seq_q: int
  seq_kv: int
  batch: int
  num_heads: int

  def tree_flatten(self):
    return (self.classes,), (self.block_q, self.block_kv, self.seq_q, self.seq_kv, self.batch,
                             self.num_heads)

  @classmethod
  def tree_unflatten(cls, aux, children):
    return cls(children[0], *aux)

  def fraction_computed(self) -> jax.Array:
    """Fraction of (batch, head, q block, kv block) tiles that are not empty."""
    return jnp.mean((self.classes != _mask.EMPTY).astype(jnp.float32))

  def fraction_partial(self) -> jax.Array:
    """Fraction of tiles that need the elementwise mask."""
    return jnp.mean((self.classes == _mask.PARTIAL).astype(jnp.float32))


def _positive(name, x):
  if not isinstance(x, (int, np.integer)) or isinstance(x, bool) or x <= 0:
    raise (TypeError if not isinstance(x, (int, np.integer)) or isinstance(x, bool)
           else ValueError)(f"{name} must be a positive int, got {x!r}")
  return int(x)


def make_block_mask(mask_mod: Callable, B: int, H: int, seq_q: int, seq_kv: int,
                    block_q: int = 128, block_kv: int = 128) -> BlockMask:
  """The block classes of `mask_mod` for [B, H, seq_q, seq_kv] scores, as a pytree.

  Pass the result with the same mask_mod: ``flash_attention(..., mask_mod=m,
  block_mask=make_block_mask(m, B, H, Sq, Skv))``. Costs one evaluation of mask_mod per
  (q, kv) position, done one row of blocks at a time (memory O(seq), not O(seq^2)).
  Any block sizes work: kernels with other block sizes resample the table conservatively
  (exact when their blocks are multiples or divisors of these).
  """
  B, H = _positive("B", B), _positive("H", H)
  seq_q, seq_kv = _positive("seq_q", seq_q), _positive("seq_kv", seq_kv)
  block_q, block_kv = _positive("block_q", block_q), _positive("block_kv", block_kv)
  fn, consts, uses = check(mask_mod, (B, H, seq_q, seq_kv))
  bq, bk = min(block_q, seq_q), min(block_kv, seq_kv)
  classes = _classify_jit(fn, uses, B, H, seq_q, seq_kv, bq, bk, consts)
  return BlockMask(classes, bq, bk, seq_q, seq_kv, B, H)


@jax.jit
def _classify_jitted(args, consts):
  fn, uses, B, H, seq_q, seq_kv, bq, bk = args.value
  return classify(fn, consts, uses, B, H, seq_q, seq_kv, bq, bk)


class _Static:
  """A hashable static wrapper (so `_classify_jitted` compiles once per configuration)."""

  def __init__(self, value):
    self.value = value

  def __hash__(self):
    return hash(self.value)

  def __eq__(self, other):
    return isinstance(other, _Static) and self.value == other.value


jax.tree_util.register_static(_Static)


def _classify_jit(fn, uses, B, H, seq_q, seq_kv, bq, bk, consts):
  return _classify_jitted(_Static((fn, uses, B, H, seq_q, seq_kv, bq, bk)), tuple(consts))


def check_block_mask(block_mask, target, name="block_mask") -> BlockMask:
  """Validate a user's BlockMask against scores of shape `target` (static checks only)."""
  if not isinstance(block_mask, BlockMask):
    raise TypeError(f"{name} must be a flashvjp.BlockMask from flashvjp.make_block_mask(...),"
                    f" got {type(block_mask).__name__}")
  B, H, Sq, Skv = target
  got = (block_mask.batch, block_mask.num_heads, block_mask.seq_q, block_mask.seq_kv)
  if got != (B, H, Sq, Skv):
    raise ValueError(f"{name} was made for scores [batch, num_heads, seq_q, seq_kv] = {got},"
                     f" but this call has {tuple(target)}")
  nq, nk = _mask.num_blocks(Sq, block_mask.block_q), _mask.num_blocks(Skv, block_mask.block_kv)
  cs = tuple(block_mask.classes.shape)
  if len(cs) != 4 or cs[2:] != (nq, nk) or cs[0] not in (1, B) or cs[1] not in (1, H):
    raise ValueError(f"{name}.classes has shape {cs}, expected [1 or {B}, 1 or {H}, {nq}, {nk}]")
  return block_mask


# ---- built-ins ---------------------------------------------------------------------------

def _int_array(name, x, ndim):
  x = jnp.asarray(x)
  if not jnp.issubdtype(x.dtype, jnp.integer):
    raise TypeError(f"{name} must be an int array, got dtype {x.dtype}")
  if x.ndim != ndim:
    raise ValueError(f"{name} must have rank {ndim}, got shape {x.shape}")
  return x.astype(jnp.int32)


def prefix_lm(prefix_lengths) -> MaskMod:
  """Prefix-LM: bidirectional over each row's prefix, causal after it.

  ``kv_idx <= q_idx or kv_idx < prefix_lengths[b]``. `prefix_lengths`: int [batch]
  (or a Python int for every row).
  """
  if isinstance(prefix_lengths, (int, np.integer)) and not isinstance(prefix_lengths, bool):
    n = int(prefix_lengths)
    mod_int = lambda b, h, q_idx, kv_idx: (kv_idx <= q_idx) | (kv_idx < n)
    return _with_hint(mod_int, lambda lo, hi: [(0, max(hi, n))])
  concrete = _concrete_max(prefix_lengths)
  lengths = _int_array("prefix_lengths", prefix_lengths, 1)

  def mod(b, h, q_idx, kv_idx):
    del h
    return (kv_idx <= q_idx) | (kv_idx < lengths[b])

  if concrete is None:  # traced lengths: no static hint (every ring pair is computed)
    return mod
  return _with_hint(mod, lambda lo, hi: [(0, max(hi, concrete))])


def _with_hint(mod, kv_intervals):
  """Attach a static hint: kv_intervals(q_lo, q_hi) -> [(kv_lo, kv_hi), ...], the kv
  positions any query in [q_lo, q_hi) may attend (a superset; Python ints). The ring
  (`flashvjp.ring._schedule`) skips chunk pairs outside it, so K/V move only where needed."""
  mod.kv_intervals = kv_intervals
  return mod


def _concrete_max(x):
  """max(x) as a Python int when x is concrete (numpy, a committed jax array), else None."""
  if isinstance(x, jax.core.Tracer):  # traced: no static value
    return None
  return int(np.max(np.asarray(x)))


def chunked(chunk_size: int, causal: bool = True) -> MaskMod:
  """Chunked local attention (Llama 4): attend within one's own chunk of `chunk_size`
  positions (``q_idx // chunk == kv_idx // chunk``), causally unless ``causal=False``."""
  chunk = _positive("chunk_size", chunk_size)

  def mod(b, h, q_idx, kv_idx):
    del b, h
    same = (q_idx // chunk) == (kv_idx // chunk)
    return same & (kv_idx <= q_idx) if causal else same

  return _with_hint(mod, lambda lo, hi: [(lo // chunk * chunk,
                                          hi if causal else -(-hi // chunk) * chunk)])


def sliding_window_with_global(window: int, num_global: int, causal: bool = True) -> MaskMod:
  """Sliding window plus global tokens (Longformer / BigBird style, causal by default).

  Each query attends to the `window` previous positions (``q_idx - window < kv_idx``)
  and to the first `num_global` positions; the first `num_global` queries attend to
  everything allowed by causality. ``causal=False`` makes the window symmetric and lets
  global queries see every key.
  """
  window = _positive("window", window)
  if not isinstance(num_global, (int, np.integer)) or isinstance(num_global, bool) or num_global < 0:
    raise ValueError(f"num_global must be a non-negative int, got {num_global!r}")
  g = int(num_global)

  def mod(b, h, q_idx, kv_idx):
    del b, h
    near = (q_idx - kv_idx < window) & (kv_idx - q_idx < (1 if causal else window))
    glob = (kv_idx < g) | (q_idx < g)
    ok = near | glob
    return ok & (kv_idx <= q_idx) if causal else ok

  def hint(lo, hi):
    if lo < g:  # global queries see everything allowed by causality
      return [(0, hi if causal else 1 << 62)]
    return [(0, g), (lo - window + 1, hi if causal else hi + window - 1)]

  return _with_hint(mod, hint)


def document_causal(doc_ids) -> MaskMod:
  """Causal attention within documents: ``doc_ids[b, q] == doc_ids[b, kv] and kv <= q``.

  `doc_ids`: int [batch, seq] (seq_q == seq_kv), e.g. packed sequences.
  """
  docs = _int_array("doc_ids", doc_ids, 2)

  def mod(b, h, q_idx, kv_idx):
    del h
    return (docs[b, q_idx] == docs[b, kv_idx]) & (kv_idx <= q_idx)

  return mod
