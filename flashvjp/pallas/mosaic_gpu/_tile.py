"""The per-tile math of the Mosaic-GPU backward kernels (Hopper, sm_90a), shared with the
d(rel) and tangent kernels.

Room: Pallas Mosaic-GPU backend (backward), below `backward`, `drel` and `tangent`, which
all import it. Probabilities recomputed from the saved logsumexp in the exp2 domain with the
mask, bias, dropout and the mods (`_probs`), the score gradient dS and the score_mod's vjp
with respect to its residual tiles (`_dscores`), and dropout's counter hash split where its
inputs split (`_dropout_rows` by XLA per row, `_keep` per element in the kernels).
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax

from flashvjp import _ad_compat as _ac
from flashvjp import _dropout
from flashvjp.pallas import _common as C

LOG2E = math.log2(math.e)


def _dropout_rows(cfg, seed, g: C.Geometry, off=None):
  """(cq, cq2), uint32 [B, H, Sqp]: the per-(b, h, q) part of `_dropout.random_bits`.

  The counter hash is split where its inputs split: everything before the kv position is
  a function of (seed, b, h, q) and is computed here, by XLA, once per row; the kernels
  finish it per element (`_keep`): bits = fmix(fmix(kv * K ^ cq) + cq2). The same bits as
  `_dropout.keep` (tests/test_pallas_mosaic_gpu_backward.py checks the split). `off`: None
  or the int32 [4] global (b0, h0, q0, kv0) of local element 0 (`C.offset_operand`): the
  words are those of the global (b, h, q); kv0 is added in the kernel (`_keep`).
  """
  u32 = jnp.uint32
  fmix = _dropout._fmix
  b = jnp.arange(g.B, dtype=jnp.int32)[:, None, None]
  h = jnp.arange(g.H, dtype=jnp.int32)[None, :, None]
  q = jnp.arange(g.Sqp, dtype=jnp.int32)[None, None, :]
  if off is not None:
    b, h, q = b + off[0], h + off[1], q + off[2]
  b, h = _dropout.hash_coords(cfg.dropout_broadcast, b, h)
  seed = jnp.asarray(seed).astype(u32)
  c = fmix(seed[0] ^ fmix(seed[1] + u32(0x9E3779B9)))
  c = fmix(c ^ (jnp.asarray(b).astype(u32) * u32(0x27D4EB2F)))
  c = fmix(c + jnp.asarray(h).astype(u32) * u32(0x165667B1))
  cq = fmix(c ^ (q.astype(u32) * u32(0x9E3779B1)))
  cq2 = fmix(cq + u32(0x7FEB352D))
  shape = (g.B, g.H, g.Sqp)
  return jnp.broadcast_to(cq, shape), jnp.broadcast_to(cq2, shape)


def _keep(cfg, kv_idx, cq, cq2, kv0=None):
  """float32 dropout multiplier of a tile: 1 / (1 - rate) where kept, 0 where dropped.
  `kv0`: None, or the global kv offset (int32, broadcast to the tile)."""
  u32 = jnp.uint32
  fmix = _dropout._fmix
  if kv0 is not None:
    kv_idx = kv_idx + kv0
  kv = lax.bitcast_convert_type(kv_idx, u32)  # positions are >= 0
  bits = fmix(fmix((kv * u32(0x85EBCA77)) ^ cq) + cq2)
  keep = bits >= u32(_dropout.threshold(cfg.dropout_rate))
  return jnp.where(keep, jnp.float32(1.0 / (1.0 - cfg.dropout_rate)), jnp.float32(0.0))


def _residual_tiles(v, prefix=""):
  """A mod's residual tiles in its tile part's order: per-(b, h) ("res<n>"), per q position
  ("qres<n>"), per kv position ("kvres<n>"), by kv_idx - q_idx ("relres<n>": windows of a
  skewed array, `_rel`); `prefix` "m" for the mask_mod's, "t" for the tangents. Returns
  (per-head, q, kv, rel) tuples."""
  get = lambda name: tuple(v[f"{prefix}{name}{n}"] for n in range(_num_res(v, prefix + name)))
  return get("res"), get("qres"), get("kvres"), get("relres")


def _plain_adds(fn):
  """`fn` with autodiff's `add_any` (the sum of a jvp's tangent terms, a vjp's fan-in of
  cotangents) evaluated as `lax.add`: the Mosaic-GPU lowering has no rule for add_any, and
  a score_mod's jvp / vjp in the kernels makes one whenever a value and an array it reads
  both carry tangents (``s * temp[q_idx]``) or a value is used twice."""
  def run(*args):
    closed, shapes = jax.make_jaxpr(fn, return_shape=True)(*args)
    out = _ac.eval_jaxpr_varying(closed.jaxpr, closed.consts, *jax.tree.leaves(args),
                                 add_any_as_add=True)
    return jax.tree.unflatten(jax.tree.structure(shapes), out)
  return run


def _with(fn, args, idx):
  """fn(x, *args) as a function of (x, *args[i] for i in idx)."""
  def f(x, *d):
    a = list(args)
    for i, val in zip(idx, d):
      a[i] = val
    return fn(x, *a)
  return f


def _probs(cfg, s, lse2, q_idx, kv_idx, masked, v, tangent=None, pos_diff=(0, 0),
           rel_diff=0):
  """(p, ok, m, sm_vjp) of one tile from raw scores s = q k (any orientation; lse2, the
  indices and the per-row / per-column vectors `v` (segment ids, dropout and score_mod
  words) already broadcast to the tile): the probabilities, the mask (None when not
  `masked`), the dropout multiplier (None without dropout) and the score_mod's vjp (None
  without one: d(modded score) -> (d(score before the mod), d(differentiable residual
  tiles)...)).

  The score_mod's differentiable residuals: the first cfg.num_diff_consts per-(b, h) ones,
  then the first `pos_diff` = (n_q, n_kv) per-q- and per-kv-position ones; the vjp returns
  their tile gradients in that order. With `rel_diff` (the d(rel) kernel, `drel`): the first
  rel_diff rel residuals ("relres<n>") instead, and only they.

  `tangent` (the tangent kernel): the tangent of score = scale * q k + bias, and in `v` the
  tangents of the first few residuals of each kind ("tres<n>", "tqres<n>", "tkvres<n>");
  then the 4th result is the modded score's tangent (the score_mod's jvp; the tangent
  itself without one)."""
  f32 = jnp.float32
  ok = None
  if masked:
    ok = C.mask_spec(cfg).allowed(q_idx, kv_idx, q_seg=v.get("q_seg"), kv_seg=v.get("kv_seg"),
                                  dense=v.get("dense"))
    if cfg.mask_mod is not None:
      # The tile part of `C.split_mask_mod` at positions clamped into the real sequences,
      # made global (as `C.mask_mod_allowed`); (b, h) are folded into its residuals.
      mres = sum(_residual_tiles(v, "m"), ())
      kv_m = jnp.minimum(kv_idx, cfg.seq_kv - 1) + v["kv0"]
      allowed = jnp.vectorize(lambda q_, k_, *r: cfg.mask_mod(0, 0, q_, k_, *r))
      ok = ok & allowed(v["qm"], kv_m, *mres)
  sm_vjp = tangent
  if cfg.score_mod is None:
    d = s * f32(cfg.scale * LOG2E) - lse2
    if "bias" in v:
      d = d + v["bias"] * f32(LOG2E)
  else:
    # As the other kernels (`C.scores`): masked q k set to 0 first (finite, whatever a
    # padded K holds), score = scale * q k + bias, then the mod at global positions.
    st = C.masked_scores_for_mod(cfg, s, ok) * f32(cfg.scale)
    if "bias" in v:
      st = st + v["bias"]
    res, qres, kvres, rel = _residual_tiles(v)
    args = res + qres + kvres + rel
    kv_g = kv_idx + v["kv0"]
    # The tile part of `C.split_per_head`: (b, h) are folded into its residuals (it ignores
    # its b, h arguments), which arrive as tiles (one word per row or column, broadcast)
    # and are vectorised over like the indices.
    mod = jnp.vectorize(lambda x, q_, k_, *r: cfg.score_mod(x, 0, 0, q_, k_, *r))
    fn = lambda x, *r: mod(x, v["qg"], kv_g, *r)
    at = lambda n_res, n_q, n_kv, n_rel=0: (
        list(range(n_res)) + [len(res) + n for n in range(n_q)]
        + [len(res) + len(qres) + n for n in range(n_kv)]
        + [len(res) + len(qres) + len(kvres) + n for n in range(n_rel)])
    if tangent is not None:  # forward mode: the jvp along the tangents
      ts = tangent if ok is None else jnp.where(ok, tangent, f32(0.0))
      t_res, t_q, t_kv, t_rel = _residual_tiles(v, "t")
      idx = at(len(t_res), len(t_q), len(t_kv), len(t_rel))
      st, sm_vjp = _plain_adds(lambda p, t: jax.jvp(_with(fn, args, idx), p, t))(
          (st, *(args[i] for i in idx)), (ts, *t_res, *t_q, *t_kv, *t_rel))
    else:  # the differentiable residuals take gradients (per element; the rel ones only in
      # the block-diagonal kernel, `drel`)
      idx = at(0, 0, 0, rel_diff) if rel_diff else at(cfg.num_diff_consts, *pos_diff)
      st, vjp = jax.vjp(_with(fn, args, idx), st, *(args[i] for i in idx))
      sm_vjp = _plain_adds(vjp)
    d = st * f32(LOG2E) - lse2
  if ok is not None:
    d = jnp.where(ok, d, C.mask_value(f32))
  m = _keep(cfg, kv_idx, v["cq"], v["cq2"], v.get("kv0")) if cfg.dropout_active else None
  return jnp.exp2(d), ok, m, sm_vjp


def _num_res(v, prefix) -> int:
  return sum(1 for name in v if name.startswith(prefix) and name[len(prefix):].isdigit())


def _dscores(p, dp, delta, ok, m, sm_vjp):
  """(ds, dres) of one tile: dL/d(score) (score = scale * q k + bias, before any score_mod:
  multiply by the scale for dL/d(q k)) from `_probs` and dp = dO v, and the tiles of
  dL/d(differentiable score_mod residual) (a tuple, empty without)."""
  f32 = jnp.float32
  if m is not None:
    dp = dp * m
  ds = p * (dp - delta)
  if ok is not None:
    # A select, not p * (...): a masked entry contributes exactly nothing.
    ds = jnp.where(ok, ds, f32(0.0))
  if sm_vjp is None:
    return ds, ()
  ds, *dres = sm_vjp(ds)
  return ds, tuple(dres)
