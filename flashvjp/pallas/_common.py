"""Geometry, input padding and the per-tile math shared by the forward and backward kernels.

Room: Pallas kernels (shared part). Reads the mask model, score_mod, dropout and
config; never the API. Everything here runs either outside the kernels (padding,
block lists) or inside a kernel body on one [block_q, block_kv] tile. A chunk pair of a
sharded sequence (`flashvjp.ring`) passes its global offsets: score_mod, mask_mod and
dropout read global positions (`global_indices`), the static mask local ones.
"""
from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any
from typing import NamedTuple
from typing import Protocol

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from flashvjp import _aligned
from flashvjp import _config
from flashvjp import _delta
from flashvjp import _dropout
from flashvjp import _mask
from flashvjp._config import AttentionConfig
from flashvjp.pallas import _compat
from flashvjp.pallas import _positions

LOG2E = float(np.log2(np.e))  # exp(x) = exp2(x * LOG2E): the kernels' softmax runs in exp2

# Triton's dot needs every tile dimension >= 16 and every tensor a power of 2.
MIN_TRITON_DIM = 16
MAX_HEAD_DIM = 256


@dataclasses.dataclass(frozen=True)
class Geometry:
  """Static sizes of one kernel launch.

  Sequence lengths are padded to whole blocks and head dims to what the Triton
  lowering needs (a power of two >= 16; the same in interpret mode). Padding
  is masked by the mask model (positions >= seq_q / seq_kv never attend) and
  zero-padded head dims contribute nothing to the dot products.
  """

  B: int
  H: int
  Hkv: int
  Sq: int
  Skv: int
  D: int
  Dv: int
  bq: int
  bk: int
  Dp: int
  Dvp: int
  num_warps: int = 4  # launch parameters (from _config.LAUNCH_TABLE via `geometry`)
  num_stages: int = 2
  transposed: bool = True  # dK/dV kernel: [bk, bq] tiles (_config.Launch.transposed)

  @property
  def G(self) -> int:
    return self.H // self.Hkv

  @property
  def nq(self) -> int:
    return _mask.num_blocks(self.Sq, self.bq)

  @property
  def nk(self) -> int:
    return _mask.num_blocks(self.Skv, self.bk)

  @property
  def Sqp(self) -> int:
    return self.nq * self.bq

  @property
  def Skvp(self) -> int:
    return self.nk * self.bk


def effective_block(block: int, seq: int) -> int:
  """The block the kernels use: min(block, seq) rounded up to a power of 2 >= 16.

  Triton needs power-of-2 tiles with dims >= 16 for its dots. Interpret mode uses
  the same geometry, so that the CPU tests run exactly the shapes the GPU runs.
  """
  return max(MIN_TRITON_DIM, _compat.next_power_of_2(min(block, seq)))


def padded_head_dim(d: int) -> int:
  """Head dim padded (with zeros) to a power of 2 >= 16."""
  return max(MIN_TRITON_DIM, _compat.next_power_of_2(d))


# Head dims above this take at most the launch table's blocks, whatever the caller asked:
# the accumulators ([rows, head_dim] float32) live in registers under Triton, and larger
# tiles spill ("rows" is bq in the forward / dQ kernels and bk in the dK/dV kernel).
CAPPED_HEAD_DIM = 128


def geometry(cfg: AttentionConfig, q_shape, k_shape, v_shape, block_q, block_kv,
             role: str = "fwd", dtype=jnp.bfloat16) -> Geometry:
  """Geometry and launch parameters of one kernel (`role`: "fwd", "dkdv", "dq" or "dbias").

  num_warps / num_stages come from `_config.LAUNCH_TABLE` for (head dim, dtype,
  cfg.precision, role); so do the blocks for head dims > CAPPED_HEAD_DIM (as an upper bound).
  """
  B, H, Sq, D = q_shape
  Hkv, Skv, Dv = k_shape[1], k_shape[2], v_shape[3]
  Dp, Dvp = padded_head_dim(D), padded_head_dim(Dv)
  bq, bk = effective_block(block_q, Sq), effective_block(block_kv, Skv)
  table = _config.launch(max(Dp, Dvp), dtype, cfg.precision, role)
  if max(Dp, Dvp) > CAPPED_HEAD_DIM:
    bq, bk = min(bq, table.block_q), min(bk, table.block_kv)
  rows, table_rows = ((bk, table.block_kv) if role in ("dkdv", "dbias") else (bq, table.block_q))
  warps = table.num_warps if rows >= min(table_rows, 64) else min(table.num_warps, 4)
  return Geometry(B=B, H=H, Hkv=Hkv, Sq=Sq, Skv=Skv, D=D, Dv=Dv, bq=bq, bk=bk, Dp=Dp, Dvp=Dvp,
                  num_warps=warps, num_stages=table.num_stages, transposed=table.transposed)


def relaunch(cfg: AttentionConfig, g: Geometry, role: str, dtype) -> Geometry:
  """`g` (same blocks) with the launch table's num_warps / num_stages of another role."""
  table = _config.launch(max(g.Dp, g.Dvp), dtype, cfg.precision, role)
  warps = table.num_warps if g.bk >= 64 else min(table.num_warps, 4)
  return dataclasses.replace(g, num_warps=warps, num_stages=table.num_stages)


def mask_spec(cfg: AttentionConfig) -> _mask.MaskSpec:
  return _mask.MaskSpec(cfg.causal, cfg.window, cfg.seq_q, cfg.seq_kv)


def acc_dtype(dtype):
  return jnp.promote_types(dtype, jnp.float32)


def needs_mask(cfg: AttentionConfig, g: Geometry, has_seg: bool, has_mask: bool) -> bool:
  return (cfg.causal or cfg.window is not None or has_seg or has_mask
          or cfg.mask_mod is not None or g.Sqp != g.Sq or g.Skvp != g.Skv)


def hoist_constants(fn, consts, acc):
  """(fn', consts'): every array the scalar `fn` reads becomes an explicit argument.

  `jax.closure_convert` hoists only closed-over tracers; a concrete array (an ALiBi
  slope vector built outside any transformation) stays closed over, and a Pallas
  kernel may not capture array constants. We trace `fn` once on scalars and append
  its remaining constants to `consts` (after the given ones, so the first
  cfg.num_diff_consts stay the differentiable ones).
  """
  consts = tuple(consts)
  if isinstance(fn, _aligned.Aligned):  # its arrays are explicit already (`_aligned.align`)
    return fn, consts
  s = jax.ShapeDtypeStruct((), acc)
  i = jax.ShapeDtypeStruct((), jnp.int32)
  cs = [jax.ShapeDtypeStruct(jnp.shape(c), jnp.result_type(c)) for c in consts]
  closed = jax.make_jaxpr(fn)(s, i, i, i, i, *cs)
  hidden = tuple(jnp.asarray(c) for c in closed.consts)
  if not hidden:
    return fn, consts
  jaxpr, n = closed.jaxpr, len(consts)

  def hoisted(s_, b, h, q, kv, *args):
    (out,) = _compat.eval_jaxpr(jaxpr, args[n:], s_, b, h, q, kv, *args[:n])
    return out

  return hoisted, consts + hidden


def hoist_score_mod(cfg: AttentionConfig, consts, acc):
  """`hoist_constants` on cfg.score_mod: returns (cfg with the new score_mod, consts)."""
  if cfg.score_mod is None:
    return cfg, tuple(consts)
  fn, consts = hoist_constants(cfg.score_mod, consts, acc)
  return dataclasses.replace(cfg, score_mod=fn), consts


class KernelInputs:
  """Named kernel inputs with their BlockSpecs (optional inputs simply absent)."""

  def __init__(self):
    self.names, self.arrays, self.specs = [], [], []

  def add(self, name, array, spec):
    self.names.append(name)
    self.arrays.append(array)
    self.specs.append(spec)


@dataclasses.dataclass
class HeadSplit:
  """A score_mod split into a per-(batch, head) part (run by XLA) and a per-tile part.

  Everything in the score_mod that depends only on (b, h) and the closed-over
  arrays (ALiBi's ``slopes[h]``, a per-head temperature) is computed outside the
  kernels for every (b, h): the "residuals". The kernels load the residuals of
  their (b, h) and apply only the per-tile part, which then has no gather for
  Triton to choke on. Gradients to the closed-over arrays flow back through the
  per-head part with `jax.vjp` (`to_consts`).

  Attributes:
    cfg: the config with score_mod = tile part ``(s, b, h, q, kv, *residuals) -> s``.
    arrays: residuals [B, H, *shape] (scalars stored [B, H, 1]); float ones first.
    scalar: per residual, whether it is a scalar (loaded with ``ref[0]``).
    n_diff: leading residuals that carry gradients (0 unless consts are differentiable).
    to_consts: d(residuals[:n_diff]) [B, H, *shape] -> grads of the differentiable consts.
  """

  cfg: AttentionConfig
  arrays: tuple = ()
  scalar: tuple = ()
  n_diff: int = 0
  to_consts: Callable | None = None
  pos: PosResiduals | None = None


class Positions(NamedTuple):
  """What a family needs hoisted per position (`split_per_head(positions=...)`): the real
  and padded sequence lengths (the largest padding of the kernels that read the residuals)
  and whether its kernels look up rows by kv_idx - q_idx (`rel`)."""

  seq_q: int
  seq_kv: int
  Sqp: int
  Skvp: int
  rel: bool = False


@dataclasses.dataclass
class PosResiduals:
  """Per-position residuals of a mod (`_positions`): [B, H, Sqp] arrays read per q position,
  [B, H, Skvp] per kv position (padding reads the last real position), and [B, H, Sqp + Skvp]
  rows read by kv_idx - q_idx (`rel`: element e holds local difference e - (Sqp - 1), so a
  kernel with padded lengths (Sqp', Skvp') slices `rel_slice`). The tile part takes them
  after the per-(b, h) residuals, q ones first, then kv, then rel. Floats first within each;
  the first n_q_diff / n_kv_diff / n_rel_diff carry gradients (`HeadSplit.to_consts` then
  takes (d per-head residuals, d q residuals [B, H, Sqp], d kv residuals [B, H, Skvp],
  d rel residuals [B, H, Sqp + Skvp]))."""

  q: tuple = ()
  kv: tuple = ()
  n_q_diff: int = 0
  n_kv_diff: int = 0
  rel: tuple = ()
  n_rel_diff: int = 0
  rel_sqp: int = 0  # the Sqp of the rel rows' layout
  # per rel residual: the same for every batch index (`_positions.rel_batch_free`; its rows
  # are still [B, H, ...]: a family may read batch 0 for all)
  rel_batch_free: tuple = ()

  def rel_slice(self, Sqp: int, Skvp: int) -> slice:
    """The part of a rel row a kernel with padded lengths (Sqp, Skvp) reads: element
    kv - q + Sqp - 1 of the slice is the difference kv - q (0 <= q < Sqp, 0 <= kv < Skvp)."""
    start = self.rel_sqp - Sqp
    return slice(start, start + Sqp + Skvp)


def rel_strips(tiles):
  """[B, H, n_diag, n, n] summed tiles of the block diagonals -> d(rel row) [B, H, (n_diag + 1)
  * n] in a kernel's local layout (element kv - q + Sqp - 1; strip t starts at t * n). Static
  pads and reshapes: the diagonals of a tile are the anti-diagonals of its row reversal, read
  by the row skew of a padded flatten; then the strips are overlap-added."""
  B, H, nd, n, _ = tiles.shape
  x = tiles[..., ::-1, :]
  x = jnp.pad(x, [(0, 0)] * 4 + [(0, n)]).reshape(B, H, nd, 2 * n * n)
  strips = x[..., : n * (2 * n - 1)].reshape(B, H, nd, n, 2 * n - 1).sum(axis=3)
  first = jnp.pad(strips[..., :n], [(0, 0), (0, 0), (0, 1), (0, 0)])
  second = jnp.pad(strips[..., n:], [(0, 0), (0, 0), (1, 0), (0, 1)])
  return (first + second).reshape(B, H, (nd + 1) * n)


def rel_grad_rows(tiles, pos: PosResiduals, g: Geometry):
  """d(rel residual) rows [B, H, rel_sqp + Skvp'] (`PosResiduals.rel`'s layout) from a drel
  kernel's summed diagonal tiles at square blocks g.bq == g.bk (`rel_strips`)."""
  assert g.bq == g.bk and (g.nq + g.nk) * g.bq == g.Sqp + g.Skvp, g
  full = pos.rel[0].shape[-1]
  cut = pos.rel_slice(g.Sqp, g.Skvp)
  return jnp.pad(rel_strips(tiles), [(0, 0), (0, 0), (cut.start, full - cut.stop)])


def count_refs(r, stem: str) -> int:
  """How many refs "{stem}0", "{stem}1", ... a kernel's ref dict `r` has (per-position
  residuals and their tangents: "posq{n}", "mposkv{n}", ...)."""
  n = 0
  while f"{stem}{n}" in r:
    n += 1
  return n


def _hoisted(fn, consts, acc, positions):
  """`_positions.hoist` of fn when the family reads per-position residuals (`positions`:
  (seq_q, seq_kv, Sqp, Skvp)), else None. Non-float residuals travel as int32: the tile
  function casts them back."""
  if positions is None:
    return None
  h = _positions.hoist(fn, consts, acc, rel=getattr(positions, "rel", False))
  if h is None or h.problem is not None:
    return None
  avals = h.q_avals + h.kv_avals + h.rel_avals
  tile = h.tile

  def cast_tile(s_, b, hh, q, kv, *args):
    n = len(args) - len(avals)
    pos = tuple(jnp.asarray(p).astype(a.dtype) for p, a in zip(args[n:], avals))
    return tile(s_, b, hh, q, kv, *args[:n], *pos)

  travel = tuple(a if jnp.issubdtype(a.dtype, jnp.inexact)
                 else jax.ShapeDtypeStruct((), jnp.int32) for a in avals)
  return h, cast_tile, travel


def _position_arrays(h, consts, bs, hs, positions, offsets):
  """The q, kv and rel residual arrays of `_positions.Hoist` h at the padded positions,
  clamped into the real sequences, made global with `offsets` (rel: at the differences
  e - (Sqp - 1), e < Sqp + Skvp, clamped into [1 - seq_q, seq_kv - 1], plus kv0 - q0)."""
  seq_q, seq_kv, Sqp, Skvp = tuple(positions)[:4]
  q0, kv0 = (0, 0) if offsets is None else tuple(offsets)[2:]
  q0, kv0 = jnp.asarray(q0, jnp.int32), jnp.asarray(kv0, jnp.int32)
  qp = jnp.minimum(jnp.arange(Sqp, dtype=jnp.int32), seq_q - 1) + q0
  kp = jnp.minimum(jnp.arange(Skvp, dtype=jnp.int32), seq_kv - 1) + kv0
  rp = None
  if h.rel_avals:
    # an iota, not a numpy constant: custom_partitioning's traced bodies take no consts
    d = jnp.arange(Sqp + Skvp, dtype=jnp.int32) - (Sqp - 1)
    rp = jnp.clip(d, 1 - seq_q, seq_kv - 1) + (kv0 - q0)
  q_res, kv_res, rel_res = _positions.arrays(h, consts, bs, hs, qp, kp, rp)
  to32 = lambda xs: tuple(x if jnp.issubdtype(x.dtype, jnp.inexact) else x.astype(jnp.int32)
                          for x in xs)
  return to32(q_res), to32(kv_res), to32(rel_res)


def split_score_mod_jaxprs(fn, consts, acc, pos_avals=()):
  """(known(b, h, *consts) -> residuals, tile(s, b, h, q, kv, *residuals, *pos) -> s,
  residual avals, tile jaxpr).

  Residuals are ordered float first. `pos_avals`: `fn` takes that many trailing
  per-position residuals (`_positions.Hoist`), which vary over the tile like s, q and kv.
  """
  s = jax.ShapeDtypeStruct((), acc)
  i = jax.ShapeDtypeStruct((), jnp.int32)
  cs = [jax.ShapeDtypeStruct(jnp.shape(c), jnp.result_type(c)) for c in consts]
  closed = jax.make_jaxpr(fn)(s, i, i, i, i, *cs, *pos_avals)
  unknowns = [True, False, False, True, True] + [False] * len(cs) + [True] * len(pos_avals)
  known, unknown, res_avals = _compat.partial_eval(closed, unknowns)
  perm = ([n for n, a in enumerate(res_avals) if jnp.issubdtype(a.dtype, jnp.inexact)]
          + [n for n, a in enumerate(res_avals) if not jnp.issubdtype(a.dtype, jnp.inexact)])
  known_f, unknown_f = _compat.jaxpr_as_fun(known), _compat.jaxpr_as_fun(unknown)

  def known_fn(b, h, *cs_):
    out = known_f(b, h, *cs_)
    return tuple(out[k] for k in perm)

  def tile_fn(s_, b, h, q, kv, *res):
    del b, h  # folded into the residuals
    res, pos = res[:len(perm)], res[len(perm):]
    orig = [None] * len(perm)
    for new, old in enumerate(perm):
      orig[old] = res[new]
    (out,) = unknown_f(*orig, s_, q, kv, *pos)
    return out

  return known_fn, tile_fn, tuple(res_avals[k] for k in perm), unknown


def split_per_head(cfg: AttentionConfig, consts, acc, B: int, H: int, grads: bool,
                   offsets=None, positions=None) -> HeadSplit:
  """Split cfg.score_mod (after `hoist_score_mod`) into residual arrays and a tile function.

  `offsets`: None or the global (b0, h0, q0, kv0) of element 0 (`offset_operand`): the
  residuals of local (b, h) are those of the global (b0 + b, h0 + h).
  `positions`: None, or (seq_q, seq_kv, Sqp, Skvp) for a family whose kernels read
  per-position residuals (`PosResiduals`): values the score_mod reads from its arrays by
  one position are then hoisted (`_positions`) instead of refused.
  """
  if cfg.score_mod is None:
    return HeadSplit(cfg)
  consts = tuple(consts)
  mod = _aligned.shifted(cfg.score_mod, offsets)  # local slices of position-aligned arrays
  hoisted = _hoisted(mod, consts, acc, positions)
  fn, pos_avals = (mod, ()) if hoisted is None else (hoisted[1], hoisted[2])
  known_fn, tile_fn, res_avals, _ = split_score_mod_jaxprs(fn, consts, acc, pos_avals)
  n_user = cfg.num_diff_consts
  diff, fixed = consts[:n_user], consts[n_user:]
  bs, hs = global_batch_heads(B, H, offsets)

  def per_head(diff_):
    f = lambda b, h: known_fn(b, h, *diff_, *fixed)
    return jax.vmap(jax.vmap(f, (None, 0)), (0, None))(bs, hs)

  def per_position(diff_):
    if hoisted is None:
      return (), (), ()
    return _position_arrays(hoisted[0], tuple(diff_) + fixed, bs, hs, positions, offsets)

  n_float = sum(1 for a in res_avals if jnp.issubdtype(a.dtype, jnp.inexact))
  n_diff = n_float if (n_user and grads) else 0
  res = tuple(per_head(diff))
  q_res, kv_res, rel_res = per_position(diff)
  floats = lambda xs: sum(1 for x in xs if jnp.issubdtype(x.dtype, jnp.inexact))
  n_qd, n_kvd, n_reld = ((floats(q_res), floats(kv_res), floats(rel_res))
                         if (n_user and grads) else (0, 0, 0))
  to_consts = None
  if n_diff or n_qd or n_kvd or n_reld:
    def grads_of(d):
      qr, kr, rr = per_position(d)
      return tuple(per_head(d)[:n_diff]), qr[:n_qd], kr[:n_kvd], rr[:n_reld]
    _, vjp = jax.vjp(grads_of, tuple(diff))
    like = lambda ds, xs: tuple(x.astype(r.dtype) for x, r in zip(ds, xs))
    to_consts = lambda dres, dq=(), dkv=(), drel=(): vjp(
        (like(dres, res), like(dq, q_res), like(dkv, kv_res), like(drel, rel_res)))[0]
  scalar = tuple(r.ndim == 2 for r in res)
  arrays = tuple(r[..., None] if sc else r for r, sc in zip(res, scalar))
  new_cfg = dataclasses.replace(cfg, score_mod=tile_fn, num_diff_consts=n_diff)
  pos = None if hoisted is None else PosResiduals(
      q_res, kv_res, n_qd, n_kvd, rel_res, n_reld, positions[2],
      _positions.rel_batch_free(hoisted[0], tuple(diff) + fixed))
  return HeadSplit(new_cfg, arrays, scalar, n_diff, to_consts, pos)


def residual_tangents(cfg: AttentionConfig, consts, tconsts, acc, B: int, H: int, split,
                      offsets=None, positions=None):
  """(tangents of the float per-head residuals, PosResiduals of the float per-position
  residuals' tangents or None): the JVP of `split_per_head` (`split`, made from cfg after
  `hoist_score_mod` and `consts`) along `tconsts`, the tangents of cfg.num_diff_consts
  leading consts (None: zero). For the tangent kernels."""
  n_user = cfg.num_diff_consts
  if cfg.score_mod is None or not any(t is not None for t in tconsts):
    return (), None
  consts = tuple(consts)
  diff, fixed = consts[:n_user], consts[n_user:]
  tdiff = tuple(jnp.zeros_like(c) if t is None else t.astype(c.dtype)
                for c, t in zip(diff, tconsts))
  floats = lambda xs: tuple(x for x in xs if jnp.issubdtype(x.dtype, jnp.inexact))
  n_float = len(floats(split.arrays))

  def residuals(d):
    sp = split_per_head(cfg, tuple(d) + fixed, acc, B, H, grads=False, offsets=offsets,
                        positions=positions)
    p = sp.pos
    return sp.arrays[:n_float], (() if p is None else floats(p.q) + floats(p.kv) + floats(p.rel))

  _, (res_t, pos_t) = jax.jvp(residuals, (diff,), (tdiff,))
  if split.pos is None:
    return tuple(res_t), None
  nq, nkv = len(floats(split.pos.q)), len(floats(split.pos.kv))  # q ones, kv ones, rel ones
  rel_t = tuple(pos_t[nq + nkv:])  # the float rel residuals' (floats come first)
  return tuple(res_t), PosResiduals(tuple(pos_t[:nq]), tuple(pos_t[nq:nq + nkv]), rel=rel_t,
                                    rel_sqp=split.pos.rel_sqp,
                                    rel_batch_free=split.pos.rel_batch_free[:len(rel_t)])


@dataclasses.dataclass
class ModSplit:
  """A mask_mod split like a score_mod (`HeadSplit`): per-(b, h) residuals and a tile part.

  Attributes:
    cfg: the config with mask_mod = tile part ``(b, h, q, kv, *residuals) -> bool``
      (None without a mask_mod).
    arrays: residuals [B, H, *shape] (scalars stored [B, H, 1]); floats keep their
      dtype, everything else travels as int32 (cast back inside the tile part).
    scalar: per residual, whether it is a scalar (loaded with ``ref[0]``).
    avals: the residuals' abstract values (shape per (b, h), original dtype).
  """

  cfg: AttentionConfig
  arrays: tuple = ()
  scalar: tuple = ()
  avals: tuple = ()
  pos: PosResiduals | None = None


def _mask_mod_as_score_mod(mask_mod):
  """A mask_mod ``(b, h, q, kv, *c) -> bool`` in score_mod form ``(s, b, h, q, kv, *c)``
  (so that `hoist_constants` / `split_score_mod_jaxprs` split it; s is unused)."""
  return lambda s, b, h, q, kv, *c: mask_mod(b, h, q, kv, *c)


def _portable_eval(jaxpr, consts, *args):
  """`jax.core.eval_jaxpr` with integer `sign` written as two compares (recursing into
  jit): jnp's integer floor division (``q_idx // chunk``) goes through `sign`, which
  Mosaic lowers only when it knows the TPU generation (not when exporting from a host)."""
  env: dict = {}
  read = lambda v: v.val if type(v).__name__ == "Literal" else env[v]
  for v, x in zip(jaxpr.constvars, consts):
    env[v] = x
  for v, x in zip(jaxpr.invars, args):
    env[v] = x
  for e in jaxpr.eqns:
    ins = [read(v) for v in e.invars]
    name = e.primitive.name
    if name == "sign" and jnp.issubdtype(jnp.result_type(ins[0]), jnp.integer):
      x = ins[0]
      outs = [(x > 0).astype(x.dtype) - (x < 0).astype(x.dtype)]
    elif name in ("jit", "pjit") and hasattr(e.params.get("jaxpr"), "jaxpr"):
      sub = e.params["jaxpr"]
      outs = _portable_eval(sub.jaxpr, sub.consts, *ins)
    else:
      outs = e.primitive.bind(*ins, **e.primitive.get_bind_params(e.params))
      outs = list(outs) if e.primitive.multiple_results else [outs]
    for v, x in zip(e.outvars, outs):
      env[v] = x
  return [read(v) for v in jaxpr.outvars]


def split_mask_mod_jaxprs(mask_mod, consts, positions=None):
  """(known(b, h, *consts) -> residuals, tile(b, h, q, kv, *residuals, *pos) -> bool,
  residual avals, tile jaxpr, consts, hoisted) of a scalar mask_mod
  (`_mask_mod.ScalarMaskMod`).

  The split of `split_score_mod_jaxprs`: what depends on (b, h) and the closed-over
  arrays only (``prefix_lengths[b]``) is a residual, computed outside the kernels;
  with `positions` (as `split_per_head`) what is read by one position (``doc[b, q_idx]``)
  is a per-position residual (`hoisted`: the `_positions.Hoist`, or None).
  """
  fn, consts = hoist_constants(_mask_mod_as_score_mod(mask_mod), consts, jnp.float32)
  hoisted = _hoisted(fn, consts, jnp.float32, positions)
  pos_avals = ()
  if hoisted is not None:
    fn, pos_avals = hoisted[1], hoisted[2]
  known_fn, _, res_avals, tile_jaxpr = split_score_mod_jaxprs(fn, consts, jnp.float32,
                                                              pos_avals)
  dtypes = tuple(a.dtype for a in res_avals)
  # split_score_mod_jaxprs orders residuals float first; the tile jaxpr takes them in its
  # own order, then (s, q, kv).
  orig_avals = tile_jaxpr.in_avals[:len(res_avals)]
  perm = ([n for n, a in enumerate(orig_avals) if jnp.issubdtype(a.dtype, jnp.inexact)]
          + [n for n, a in enumerate(orig_avals) if not jnp.issubdtype(a.dtype, jnp.inexact)])

  def tile_fn(b, h, q, kv, *res):
    del b, h  # folded into the residuals
    res, pos = res[:len(dtypes)], res[len(dtypes):]
    res = tuple(jnp.asarray(x).astype(dt) for x, dt in zip(res, dtypes))
    orig = [None] * len(perm)
    for new_pos, old_pos in enumerate(perm):
      orig[old_pos] = res[new_pos]
    (out,) = _portable_eval(tile_jaxpr.jaxpr, tile_jaxpr.consts, *orig,
                            jnp.zeros((), jnp.float32), q, kv, *pos)
    return out

  return known_fn, tile_fn, res_avals, tile_jaxpr, consts, hoisted


def split_mask_mod(cfg: AttentionConfig, mod, B: int, H: int, offsets=None,
                   positions=None) -> ModSplit:
  """Split cfg.mask_mod into residual arrays [B, H, ...] and a tile function.

  `mod`: the `_mask_mod.ModInputs` (None without a mask_mod); its consts are the arrays
  the mask_mod closes over. Not differentiable (a mask has no gradient). `offsets`,
  `positions`: as `split_per_head` (the residuals of the global (b, h); per-position ones).
  """
  if cfg.mask_mod is None:
    return ModSplit(cfg)
  consts = tuple(jnp.asarray(c) for c in (() if mod is None else mod.consts))
  known_fn, tile_fn, res_avals, _, consts, hoisted = split_mask_mod_jaxprs(
      _aligned.shifted(cfg.mask_mod, offsets), consts, positions)
  bs, hs = global_batch_heads(B, H, offsets)
  f = lambda b, h: tuple(known_fn(b, h, *consts))
  res = tuple(jax.vmap(jax.vmap(f, (None, 0)), (0, None))(bs, hs)) if res_avals else ()
  res = tuple(r if jnp.issubdtype(r.dtype, jnp.inexact) else r.astype(jnp.int32) for r in res)
  scalar = tuple(r.ndim == 2 for r in res)
  arrays = tuple(r[..., None] if sc else r for r, sc in zip(res, scalar))
  pos = None
  if hoisted is not None:
    q_res, kv_res, rel_res = _position_arrays(hoisted[0], consts, bs, hs, positions, offsets)
    pos = PosResiduals(q_res, kv_res, rel=rel_res, rel_sqp=positions[2],
                       rel_batch_free=_positions.rel_batch_free(hoisted[0], consts))
  return ModSplit(dataclasses.replace(cfg, mask_mod=tile_fn), arrays, scalar, tuple(res_avals),
                  pos)


def mod_classes(cfg: AttentionConfig, g: Geometry, mod):
  """The mask_mod's block classes resampled to the kernel's blocks (g.bq, g.bk), or None.

  A mask_mod without classes (a ring's chunk pair: its classes would be those of the
  pair's global positions) makes every block PARTIAL: the kernels then evaluate it on
  every block the rest of the mask model visits (through the block lists).
  """
  if mod is None or cfg.mask_mod is None:
    return None
  if mod.classes is None:
    return jnp.full((1, 1, g.nq, g.nk), _mask.PARTIAL, jnp.int8)
  assert cfg.mask_mod_blocks is not None  # set with mask_mod
  return _mask.resample_classes(mod.classes, *cfg.mask_mod_blocks, g.bq, g.bk, g.Sq, g.Skv,
                                g.nq, g.nk)


# ---- global offsets (a chunk pair of a sharded sequence, `flashvjp.ring`) ------------

def offset_operand(offsets):
  """The kernel operand of `offsets`: int32 [4] (b0, h0, q0, kv0), or None.

  `offsets` (the backends' argument): None, or the global (batch, head, q, kv) position of
  local element (0, 0, 0, 0), each a Python int or a traced int32 scalar. score_mod,
  mask_mod and dropout's counter hash read global positions; the static mask (causal,
  window, padding) stays in local positions. The kernels read the four words as scalars
  (`load_offsets`), never as compile-time constants, so one kernel serves every chunk
  pair. All-zero static offsets (a one-device call) give None: no operand at all.
  """
  if offsets is None:
    return None
  offsets = tuple(offsets)
  if len(offsets) != 4:
    raise ValueError(f"offsets must be (b0, h0, q0, kv0), got {offsets!r}")
  if all(isinstance(o, (int, np.integer)) and int(o) == 0 for o in offsets):
    return None
  return jnp.stack([jnp.asarray(o, jnp.int32).reshape(()) for o in offsets])


def load_offsets(ref):
  """(b0, h0, q0, kv0) int32 scalars from the `offset_operand` ref (None: no offsets)."""
  if ref is None:
    return None
  return tuple(ref[n].astype(jnp.int32) for n in range(4))


def global_batch_heads(B: int, H: int, offsets=None):
  """int32 [B], [H]: the global batch and head indices of the local ones (outside kernels)."""
  bs, hs = jnp.arange(B, dtype=jnp.int32), jnp.arange(H, dtype=jnp.int32)
  if offsets is None:
    return bs, hs
  b0, h0 = tuple(offsets)[:2]
  shift = lambda x, o: x if isinstance(o, (int, np.integer)) and int(o) == 0 else (
      x + jnp.asarray(o, jnp.int32))
  return shift(bs, b0), shift(hs, h0)


def global_indices(t, qi, ki):
  """(b, h, q_idx, kv_idx) of a tile at the global positions (t.off added; `t`: TileInputs
  or the TPU family's Tile): what score_mod, mask_mod and dropout see."""
  if t.off is None:
    return t.b, t.h, qi, ki
  b0, h0, q0, kv0 = t.off
  return t.b + b0, t.h + h0, qi + q0, ki + kv0


def load_head_consts(refs, scalar, lead=()):
  """Load the residuals of one (b, h): `lead` indexes the leading dims of each ref."""
  return tuple(ref[tuple(lead) + (0,)] if sc else ref[tuple(lead) + (slice(None),) * (ref.ndim - len(lead))]
               for ref, sc in zip(refs, scalar))


# ---- input preparation (outside the kernels) -----------------------------------

def pad_to(x, axis, size):
  """Zero-pad `x` along `axis` to `size` (no-op when already that size)."""
  return _mask.pad_axis(x, axis, size, keep_broadcast=False)


def pad_seq_head(x, seq, head):
  """[B, H, S, D] -> [B, H, seq, head], zero padded."""
  return pad_to(pad_to(x, 2, seq), 3, head)


class PaddedSeqs(Protocol):
  """What padding reads of a geometry: the padded seq lengths (a `Geometry`, or a kernel
  family's own launch plan)."""
  @property
  def Sqp(self) -> int: ...

  @property
  def Skvp(self) -> int: ...


def pad_pair(x, g: PaddedSeqs):
  """Rank-4 bias/mask (dims 1 or full): pad the full seq dims to whole blocks."""
  if x is None:
    return None
  return _mask.pad_axis(_mask.pad_axis(x, 2, g.Sqp), 3, g.Skvp)


def pad_segments(q_seg, kv_seg, g: PaddedSeqs):
  if q_seg is None:
    return None, None
  return (_mask.pad_axis(q_seg, 1, g.Sqp, "edge", keep_broadcast=False),
          _mask.pad_axis(kv_seg, 1, g.Skvp, "edge", keep_broadcast=False))


def block_lists(cfg: AttentionConfig, g: Geometry, q_seg_p, kv_seg_p, mask_p, by: str,
                mod_cls=None):
  """Compacted block lists for segment ids / a dense mask / a mask_mod, as two kernel
  inputs; None without any of them.

  Returns (counts int32 [B', H', 2, n_rows], lists int32 [B', H', n_rows, 2, n_cols]):
  index 0 of the "2" axis is the PARTIAL list (elementwise mask needed), 1 the FULL
  list (no mask). Rows are q blocks (by="q") or kv blocks (by="kv"); see
  `_mask.block_lists` (it also applies causal / window / padding). `mask_p` is the
  padded bool mask; `mod_cls` the mask_mod's classes at the kernel's blocks (`mod_classes`).
  """
  if q_seg_p is None and mask_p is None and mod_cls is None:
    return None
  cls = _mask.block_classes(mask_spec(cfg), q_seg_p, kv_seg_p, mask_p, g.bq, g.bk, g.nq, g.nk,
                            mod_cls)
  # block_classes keeps a size-1 q (or kv) axis when nothing varies along it (a mask
  # broadcast over queries, no causal/window); the lists need every row and column.
  cls = jnp.broadcast_to(cls, cls.shape[:2] + (g.nq, g.nk))
  if by == "kv":
    cls = jnp.swapaxes(cls, -1, -2)
  num_partial, partial = _mask._compact(cls == _mask.PARTIAL)
  num_full, full = _mask._compact(cls == _mask.FULL)
  counts = jnp.stack([num_partial, num_full], axis=-2).astype(jnp.int32)
  lists = jnp.stack([partial, full], axis=-2).astype(jnp.int32)
  return counts, lists


def diagonal_lists(cfg: AttentionConfig, g: Geometry, q_seg_p, kv_seg_p, mask_p, mod_cls=None):
  """`block_lists` along the block diagonals (square blocks; the drel kernels): (counts int32
  [B', H', 2, n_diag], lists int32 [B', H', n_diag, 2, nq]) of the q blocks i whose tile
  (i, i + t - (nq - 1)) is PARTIAL (index 0) or FULL (1); None without segment ids, a dense
  mask or a mask_mod (the static causal / window band then bounds the loop)."""
  if q_seg_p is None and mask_p is None and mod_cls is None:
    return None
  cls = _mask.block_classes(mask_spec(cfg), q_seg_p, kv_seg_p, mask_p, g.bq, g.bk, g.nq, g.nk,
                            mod_cls)
  cls = jnp.broadcast_to(cls, cls.shape[:2] + (g.nq, g.nk))
  n_diag = g.nq + g.nk - 1
  # iotas, not numpy constants: custom_partitioning's traced bodies take no consts
  i = jnp.arange(g.nq, dtype=jnp.int32)[None, :]
  j = i + jnp.arange(n_diag, dtype=jnp.int32)[:, None] - (g.nq - 1)  # [n_diag, nq]
  valid = (j >= 0) & (j < g.nk)
  diag = jnp.where(valid, cls[:, :, i, jnp.clip(j, 0, g.nk - 1)], _mask.EMPTY)
  num_partial, partial = _mask._compact(diag == _mask.PARTIAL)
  num_full, full = _mask._compact(diag == _mask.FULL)
  counts = jnp.stack([num_partial, num_full], axis=-2).astype(jnp.int32)
  lists = jnp.stack([partial, full], axis=-2).astype(jnp.int32)
  return counts, lists


def list_loops(counts, block_at, body, carry):
  """`body(block, masked, carry)` over the PARTIAL list (masked) then the FULL list (unmasked).

  counts: (n_partial, n_full) int32 scalars; block_at(kind, t): the t-th block index of
  list `kind` (0 partial, 1 full), read from the list ref inside the loop, so the loop
  has no branch around its loads (Triton pipelines them) and empty blocks cost nothing.
  """
  zero = jnp.asarray(0, jnp.int32)
  for kind, masked in ((0, True), (1, False)):
    step = lambda t, c, kind=kind, masked=masked: body(block_at(kind, t), masked, c)
    carry = lax.fori_loop(zero, counts[kind], step, carry)
  return carry


# ---- per-tile math (inside kernel bodies) --------------------------------------

# What "high" asks of Triton for float32 operands: the 3xTF32 split (nearly float32 on the
# tensor cores, wgmma kept). "highest" asks for IEEE float32 dots (input_precision="ieee",
# FMA units), which JAX's own Pallas-Triton lowering gives lax.Precision.HIGHEST / F32_F32_F32.
HIGH_F32_ALGORITHM = lax.DotAlgorithmPreset.TF32_TF32_F32_X3
HIGHEST_F32_ALGORITHM = lax.DotAlgorithmPreset.F32_F32_F32
# The largest TF32 number, (2 - 2^-10) * 2^127. Triton's 3xTF32 rounds each operand to
# TF32 (cvt.rna) for its big x big product: a float32 within 2^-11 of finfo.max rounds up to
# inf there, and a masked entry (p = 0, or dS = 0) times that inf is NaN. "high" therefore
# saturates its operands to +-TF32_MAX first (`tf32x3_operand`): only |x| > TF32_MAX, the top
# 1/2048 of float32's last binade, changes (by < 2^-11 relative).
TF32_MAX = float(np.float32((2.0 - 2.0 ** -10) * 2.0 ** 127))


def tf32_truncate(x):
  """float32 -> what a TF32 tensor-core operand holds: the low 13 mantissa bits dropped."""
  u = lax.bitcast_convert_type(x, jnp.uint32)
  return lax.bitcast_convert_type(u & jnp.uint32(0xFFFFE000), jnp.float32)


def tf32_round(x):
  """float32 rounded to TF32, to nearest with ties away from zero (PTX cvt.rna.tf32.f32)."""
  u = lax.bitcast_convert_type(x, jnp.uint32)
  r = lax.bitcast_convert_type((u + jnp.uint32(0x1000)) & jnp.uint32(0xFFFFE000), jnp.float32)
  return jnp.where(jnp.isfinite(x), r, x)


def tf32x3_operand(x):
  """x saturated to +-TF32_MAX, so that the 3xTF32 split's cvt.rna cannot overflow a finite
  number to inf (see TF32_MAX). Selects, not min / max: NaN stays NaN (inf saturates)."""
  return jnp.where(x > TF32_MAX, TF32_MAX, jnp.where(x < -TF32_MAX, -TF32_MAX, x))


def pad_operand(cfg: AttentionConfig, x, seq, head):
  """`pad_seq_head` of a kernel input (q, k, v, dO, a tangent), saturated to the TF32 range
  at the "high" precision (`tf32x3_operand`), outside the kernels: one O(seq) pass in XLA
  instead of two selects per operand element inside every dot (which cost the dK/dV and
  dQ kernels at head dim 128 a 24-28 B register spill in the sm_90a compile check). The
  kernels' own operands P (<= 1) and dS (0 where masked) need no saturation."""
  if cfg.precision == "high" and jnp.dtype(x.dtype) == jnp.float32:
    x = tf32x3_operand(x)
  return pad_seq_head(x, seq, head)


def dot_kind(cfg: AttentionConfig | None, dtype) -> str:
  """How a dot on `dtype` operands runs: "native" (16-bit / float64 / no config), "tf32"
  ("default"), "tf32x3" ("high") or "ieee" ("highest") for float32 operands."""
  if cfg is None or jnp.dtype(dtype) != jnp.float32:
    return "native"
  return {"default": "tf32", "high": "tf32x3", "highest": "ieee"}[cfg.precision]


def _emulated_dot(a, b, dims, acc, kind):
  """Interpret mode: the float32 dot the GPU computes, on the CPU."""
  dot = functools.partial(lax.dot_general, dimension_numbers=dims, preferred_element_type=acc,
                          precision=lax.Precision.HIGHEST)
  if kind == "ieee":
    return dot(a, b)
  if kind == "tf32":
    return dot(tf32_truncate(a), tf32_truncate(b))
  # Triton's 3xTF32 (F32DotTC pass): big = cvt.rna(x), small = x - big; the tensor cores
  # read `small` as TF32 (truncated); small*big + big*small (NaN -> 0) + big*big.
  a_big, b_big = tf32_round(a), tf32_round(b)
  a_small, b_small = tf32_truncate(a - a_big), tf32_truncate(b - b_big)
  low = dot(a_small, b_big) + dot(a_big, b_small)
  return dot(a_big, b_big) + jnp.where(jnp.isnan(low), jnp.zeros_like(low), low)


def _dot(a, b, dims, acc, cfg):
  kind = dot_kind(cfg, a.dtype)
  if kind == "native":
    return lax.dot_general(a, b, dims, preferred_element_type=acc)
  if cfg.interpret:
    return _emulated_dot(a, b, dims, acc, kind)
  precision: Any = {"tf32": lax.Precision.DEFAULT, "tf32x3": HIGH_F32_ALGORITHM,
                    "ieee": HIGHEST_F32_ALGORITHM}[kind]
  return lax.dot_general(a, b, dims, precision=precision, preferred_element_type=acc)


def dot_nt(a, b, acc, cfg: AttentionConfig | None = None):
  """a [m, d] @ b[n, d]^T -> [m, n] in `acc`; float32 operands at cfg.precision."""
  return _dot(a, b, (((1,), (1,)), ((), ())), acc, cfg)


def dot_nn(a, b, acc, cfg: AttentionConfig | None = None):
  """a [m, k] @ b [k, n] -> [m, n] in `acc`; float32 operands at cfg.precision."""
  return _dot(a, b, (((1,), (0,)), ((), ())), acc, cfg)


def dot_tn(a, b, acc, cfg: AttentionConfig | None = None):
  """a [k, m]^T @ b [k, n] -> [m, n] in `acc`; float32 operands at cfg.precision."""
  return _dot(a, b, (((0,), (0,)), ((), ())), acc, cfg)


def tile_indices(g: Geometry, i, j, transposed: bool = False):
  """Local (q_idx [bq, 1], kv_idx [1, bk]) int32 positions of tile (i, j) (the global ones
  with no offsets; `global_indices` adds them).

  `transposed`: the tile is laid out [bk, bq] (the dK/dV kernel): q_idx [1, bq], kv_idx [bk, 1].
  """
  if transposed:
    qi = i * g.bq + lax.broadcasted_iota(jnp.int32, (1, g.bq), 1)
    ki = j * g.bk + lax.broadcasted_iota(jnp.int32, (g.bk, 1), 0)
    return qi, ki
  qi = i * g.bq + lax.broadcasted_iota(jnp.int32, (g.bq, 1), 0)
  ki = j * g.bk + lax.broadcasted_iota(jnp.int32, (1, g.bk), 1)
  return qi, ki


def pair_tile(ref, lead, i, j, g: Geometry, *, full_q: bool, full_kv: bool):
  """A [bq|1, bk|1] tile of a bias/mask ref whose last two dims are (Sq'', Skv'').

  `lead` indexes the leading (head-group) dims of the ref (a tuple, maybe empty).
  `full_q` / `full_kv`: the ref holds every q row / kv column (so the tile is sliced
  out here), else it holds just this program's block along that dim. Broadcast
  (size-1) dims are never sliced.
  """
  sq, sk = ref.shape[-2], ref.shape[-1]
  qs = _compat.ds(i * g.bq, g.bq) if (full_q and sq != 1) else slice(None)
  ks = _compat.ds(j * g.bk, g.bk) if (full_kv and sk != 1) else slice(None)
  return ref[tuple(lead) + (qs, ks)]


@dataclasses.dataclass
class TileInputs:
  """What the score computation of one tile may read, already loaded or sliced."""

  b: jax.Array  # scalar int32 batch index
  h: jax.Array  # scalar int32 query head index
  i: jax.Array  # q block index
  j: jax.Array  # kv block index
  bias: jax.Array | None = None  # [bq|1, bk|1] ([bk|1, bq|1] for a transposed tile)
  mask: jax.Array | None = None  # int8 [bq|1, bk|1] ([bk|1, bq|1] for a transposed tile)
  q_seg: jax.Array | None = None  # int32 [bq]
  kv_seg: jax.Array | None = None  # int32 [bk]
  mod: tuple = ()  # the mask_mod's residuals of (b, h), loaded (`ModSplit`)
  off: tuple | None = None  # (b0, h0, q0, kv0) int32 scalars (`load_offsets`), or None
  pos: tuple = ()  # the score_mod's per-position residuals of the tile (`PosResiduals`),
  mpos: tuple = ()  # the mask_mod's: [bq, 1] / [1, bk] ([1, bq] / [bk, 1] transposed)


def mask_mod_allowed(cfg: AttentionConfig, t, qi, ki):
  """The mask_mod's tile part at local (qi, ki) clamped into the real sequences (as
  `_mask_mod.tile_allowed`: padding is masked by the mask model anyway), then made global
  (`global_indices`); bool, broadcast shape of qi and ki. `t` has .b, .h, .off and .mod
  (the loaded residuals)."""
  qi, ki = jnp.minimum(qi, cfg.seq_q - 1), jnp.minimum(ki, cfg.seq_kv - 1)
  assert cfg.mask_mod is not None  # called for a mask_mod only
  return _positions.apply_mask(cfg.mask_mod, tuple(t.mod), tuple(getattr(t, "mpos", ())),
                              *global_indices(t, qi, ki))


def biased_modded(cfg: AttentionConfig, qk, t, qi, ki, consts, acc, diff_consts=None,
                  diff_pos=()):
  """scale * qk + bias, then score_mod at the global positions of local (qi, ki):
  (s, score_mod vjp or None).

  Shared by both kernel families' `scores` (each computes its own qk dot). With
  `diff_consts` the score_mod is differentiated (see `scores`); `diff_pos` (indices into
  t.pos) adds those per-position residuals: their cotangents follow the consts'.
  """
  s = qk * jnp.asarray(cfg.scale, acc)
  if t.bias is not None:
    s = s + t.bias.astype(acc)
  if cfg.score_mod is None:
    return s, None
  score_mod = cfg.score_mod
  assert score_mod is not None
  b, h, qi, ki = global_indices(t, qi, ki)
  pos = tuple(getattr(t, "pos", ()))
  if diff_consts is None:
    return _positions.apply(score_mod, tuple(consts), pos, s, b, h, qi, ki), None
  fixed = tuple(consts)
  if not diff_pos:
    return jax.vjp(
        lambda s_, c_: _positions.apply(score_mod, tuple(c_) + fixed, pos, s_, b, h, qi, ki),
        s, tuple(diff_consts))

  def f(s_, c_, p_):
    pos_ = list(pos)
    for k, x in zip(diff_pos, p_):
      pos_[k] = x
    return _positions.apply(score_mod, tuple(c_) + fixed, tuple(pos_), s_, b, h, qi, ki)

  out, vjp = jax.vjp(f, s, tuple(diff_consts), tuple(pos[k] for k in diff_pos))

  def vjp_flat(d):  # (d pre-mod score, (*d per-head consts, *d the diff_pos residuals))
    ds, dc, dp = vjp(d)
    return ds, tuple(dc) + tuple(dp)

  return out, vjp_flat


def modded_jvp(cfg: AttentionConfig, s, ts, t, qi, ki, consts, n_float: int, tconsts=(),
               tpos=()):
  """(score_mod(s), its tangent) on a tile, for the tangent kernels: `ts` the scores'
  tangent, `tconsts` the tangents of the first len(tconsts) of the n_float float per-head
  residuals `consts[:n_float]`, `tpos` those of the float per-position residuals in t.pos
  (q ones then kv ones, `PosResiduals`; empty: none)."""
  fl, rest = tuple(consts[:n_float]), tuple(consts[n_float:])
  gb, gh, gq, gk = global_indices(t, qi, ki)
  pos = list(getattr(t, "pos", ()))
  idx = [n for n, x in enumerate(pos) if jnp.issubdtype(x.dtype, jnp.inexact)]

  def fn(s_, c_, p_=()):
    pos_ = list(pos)
    for n, x in zip(idx, p_):
      pos_[n] = x
    return _positions.apply(cfg.score_mod, tuple(c_) + rest, tuple(pos_), s_, gb, gh, gq, gk)

  if not (tconsts or tpos):
    return jax.jvp(lambda s_: fn(s_, fl), (s,), (ts,))
  tc = tuple(tconsts) + tuple(jnp.zeros_like(c) for c in fl[len(tconsts):])
  tp = tuple(tpos) if tpos else tuple(jnp.zeros_like(pos[n]) for n in idx)
  return jax.jvp(fn, (s, fl, tuple(pos[n] for n in idx)), (ts, tc, tp))


def scores(cfg: AttentionConfig, g: Geometry, q, k, t: TileInputs, consts, acc, masked,
           diff_consts=None, transposed: bool = False, diff_pos=()):
  """Scores of one tile: scale * q k^T + bias, score_mod -> (s [bq, bk], ok, vjp or None).

  `transposed`: the tile in [bk, bq] layout, s^T = scale * k q^T + bias^T (the dK/dV
  kernel, so that its dots have M = block_kv rows; FlashAttention-2/3's orientation).
  t.bias / t.mask are then given transposed ([bk|1, bq|1]); s, ok and the vjp's
  cotangent are all [bk, bq]. Everything else is elementwise in (b, h, q_idx, kv_idx)
  with broadcast indices, so each entry is bitwise the same as in the [bq, bk] layout
  (the dot's own summation order aside).

  `ok` is the mask model's bool [bq, bk] (None when not `masked`), ANDed with the
  mask_mod's tile part (cfg.mask_mod after `split_mask_mod`, residuals in t.mod). `s` is returned
  unmasked: callers select with `ok` (against the finite `mask_value`, never -inf, so
  that no inf is produced inside the kernels for finite inputs, see `mask_value`).
  With `diff_consts` (a tuple, possibly empty) the score_mod is differentiated:
  the third result maps d(score) [bq, bk] -> (d(pre-mod score), d(diff consts)).
  `consts` are then the fixed (non-differentiable) consts only.
  """
  qk = dot_nt(k, q, acc, cfg) if transposed else dot_nt(q, k, acc, cfg)
  qi, ki = tile_indices(g, t.i, t.j, transposed)
  ok = None
  if masked:
    q_ax, kv_ax = ((None, slice(None)), (slice(None), None)) if transposed else (
        (slice(None), None), (None, slice(None)))
    qs = None if t.q_seg is None else t.q_seg[q_ax]
    ks = None if t.kv_seg is None else t.kv_seg[kv_ax]
    dense = None if t.mask is None else (t.mask != 0)
    ok = mask_spec(cfg).allowed(qi, ki, q_seg=qs, kv_seg=ks, dense=dense)
    if cfg.mask_mod is not None:  # PARTIAL blocks only: FULL ones come with masked=False
      ok = ok & mask_mod_allowed(cfg, t, qi, ki)
  s, sm_vjp = biased_modded(cfg, masked_scores_for_mod(cfg, qk, ok), t, qi, ki, consts, acc,
                            diff_consts, diff_pos)
  return s, ok, sm_vjp


def masked_scores_for_mod(cfg: AttentionConfig, qk, ok):
  """q k^T with masked entries set to 0 when a score_mod follows (else unchanged).

  A masked position may hold any finite K (finfo.max padding): its q k is then +-inf or
  NaN, and the score_mod's derivative there (tanh' of softcap, 0 * inf) would turn the
  zero cotangent of a masked entry into NaN. Without a score_mod the masked score only
  meets selects (`mask_value`, `select_masked`), so no select is spent on it.
  """
  if ok is None or cfg.score_mod is None:
    return qk
  return jnp.where(ok, qk, jnp.zeros((), qk.dtype))


def mask_value(acc):
  """The finite stand-in for -inf inside the kernels: the most negative `acc` number.

  Masked scores, the running max's start and the empty-row lse use it instead of -inf,
  so a kernel produces no inf / NaN for finite inputs (`jax.debug_infs` checks the
  kernels' outputs). p is 0 for a masked entry by a select (exp(mask_value) == 0), not
  by arithmetic on the sentinel; and `mask_value - x` stays finite for |x| below ~1e31
  (float32): it rounds back to `mask_value`.
  """
  return jnp.asarray(jnp.finfo(acc).min, acc)


def log2_lse(lse, Sqp: int):
  """float32 [B, H, Sqp]: lse [B, H, Sq] in the log2 domain (lse * log2(e)), the largest finite
  float32 at empty (-inf) and padded rows, so that exp2(s2 - lse2) == 0 there (zero, finite
  gradients): what the Mosaic-GPU backward and tangent kernels read (Hopper and Blackwell)."""
  f32 = jnp.float32
  big = jnp.finfo(f32).max
  lse2 = jnp.where(jnp.isfinite(lse), lse.astype(f32) * f32(LOG2E), big)
  return jnp.pad(lse2, ((0, 0), (0, 0), (0, Sqp - lse.shape[2])), constant_values=big)


def log2_rows(out, lse, dout, dlse, Sqp: int):
  """(lse2, delta), float32 [B, H, Sqp]: `log2_lse` and rowsum(dO * O) - dlse, delta 0 at
  padded rows."""
  delta = _delta.delta(out, dout, dlse, jnp.float32)
  return log2_lse(lse, Sqp), jnp.pad(delta, ((0, 0), (0, 0), (0, Sqp - delta.shape[2])))


def neg_inf_at_empty(rows, acc) -> tuple:
  """The forward's per-row outputs (lse first, then e.g. the row maxima), written by a kernel
  with `mask_value` at empty rows, with the API's -inf there: by adding log(0) at the empty
  rows only, so no array of -inf is built (a broadcast -inf operand would trip
  jax.debug_infs op by op) when no row is empty. Every family's forward ends with it."""
  empty = jnp.log(jnp.where(rows[0] == mask_value(acc), 0.0, 1.0).astype(acc))
  return tuple(x + empty for x in rows)


def select_masked(ok, x):
  """x where the mask model allows the entry, exactly 0 elsewhere (a select, never a product
  with p = 0: a masked position may hold any finite K / V, and 0 * inf is NaN)."""
  return jnp.where(ok, x, jnp.zeros((), x.dtype))


def lse_pad_value(acc):
  """Backward lse of padded and empty rows: exp(s - lse) == 0 for any moderate score s."""
  return jnp.asarray(jnp.finfo(acc).max, acc)


def dropout_scale(cfg: AttentionConfig, g: Geometry, seed_ref, t: TileInputs, acc,
                  transposed: bool = False):
  """[bq, bk] multiplier: 1 / (1 - rate) where kept, 0 where dropped (the shared hash).

  `transposed`: [bk, bq] (the hash is elementwise: the same keep bit per (q, kv)). The
  hash reads the global (b, h, q, kv) (`global_indices`).
  """
  b, h, qi, ki = global_indices(t, *tile_indices(g, t.i, t.j, transposed))
  keep = _dropout.keep(seed_ref[0], seed_ref[1], b, h, qi, ki, cfg.dropout_rate,
                       cfg.dropout_broadcast)
  return jnp.where(keep, jnp.asarray(1.0 / (1.0 - cfg.dropout_rate), acc), jnp.asarray(0.0, acc))


# ---- masked / unmasked loop split (the mask model's block classification) ----------

def full_kv_blocks(cfg: AttentionConfig, g: Geometry, i):
  """[lo, hi) of kv blocks every (q, kv) pair of q block i allows by causal/window/padding."""
  return mask_spec(cfg).full_kv_block_range(i, g.bq, g.bk)


def full_q_blocks(cfg: AttentionConfig, g: Geometry, j):
  """[lo, hi) of q blocks all of whose (q, kv) pairs with kv block j are allowed."""
  return mask_spec(cfg).full_q_block_range(j, g.bq, g.bk, g.nq)


split_loop = _mask.split_loop


def num_warps(g: Geometry) -> int:
  """The launch table's num_warps for this kernel (kept for callers of the old helper)."""
  return g.num_warps
