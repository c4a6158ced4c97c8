"""Per-position residuals: a mod's reads of arrays by q position, by kv position or by
kv_idx - q_idx, hoisted out of the tile into [B, H, seq] arrays that the kernels slice like
segment ids, or rows over the differences that they read as Toeplitz tiles (issue 32).

Room: Pallas kernels (shared part). `doc[b, q_idx]`, `bias_vec[kv_idx]`, `temp[q_idx]` read
an array at one position: a gather on a tile, which neither Triton nor Mosaic lowers, but
per tile only a [block_q] or [block_kv] slice of a per-position array. `hoist` walks the
scalar mod's jaxpr (traced on (s, b, h, q, kv, *consts)), finds the values that depend on
(b, h, q) only or on (b, h, kv) only *and* need an indexing primitive to compute (values
computable elementwise, `kv_idx < lengths[b]`, stay in the tile as before), and splits the
mod into

* `q_fn(b, h, q, *consts)` / `kv_fn(b, h, kv, *consts)` -> the hoisted scalars (run by XLA
  for every position: `arrays`, [B, H, seq_pad] per residual), and
* `tile(s, b, h, q, kv, *consts, *q_res, *kv_res)` -> the mod's output, with the hoisted
  values as trailing, elementwise arguments.

With `rel` (a family that reads them), values depending on the positions only through
``kv_idx - q_idx`` (``table[h, clip(kv_idx - q_idx, -d, d) + d]``, T5 buckets; the
subtraction of the raw indices is the source, either way round) are hoisted too, as
`rel_fn(b, h, kv_idx - q_idx, *consts)`: XLA evaluates it at every difference of the padded
tile grid ([B, H, Sqp + Skvp] rows, `_common.PosResiduals.rel`), and a tile (i, j) reads the
[block_q, block_kv] Toeplitz tile of its 2 * block - 1 differences (Triton: a gather load;
Mosaic-TPU: lane rolls).

The per-(b, h) split (`_common.split_score_mod_jaxprs`) then runs on `tile` with the
position residuals marked as varying, like s, q and kv. Gradients to the arrays go through
the residuals: the kernels return d(residual) per position (the dQ kernel's rows, the
dK/dV kernel's columns; for rel rows a kernel over the block diagonals, whose tiles share
their differences, summed then reduced along the diagonals), and `jax.vjp` of `q_fn` /
`kv_fn` / `rel_fn` maps them to the arrays.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp

from flashvjp import _ad_compat as _ac
from flashvjp import _score_mod

# Primitives computable on a tile: what the kernels' lowerings have rules for (the
# authoritative list is `flashvjp.pallas._limits.ELEMENTWISE_PRIMITIVES`; a value needing
# anything else, an indexing primitive above all, is hoisted when it depends on one position).
_INDEXING = frozenset({"gather", "dynamic_slice", "dynamic_update_slice", "scatter",
                       "scatter-add", "select_and_gather_add", "take", "argmax", "argmin"})


@dataclasses.dataclass(frozen=True)
class Hoist:
  """A scalar mod split into per-position residual functions and a tile function.

  Attributes:
    tile: ``(s, b, h, q, kv, *consts, *q_res, *kv_res) -> out``.
    q_fn: ``(b, h, q, *consts) -> tuple`` of the q residuals (scalars); kv_fn likewise.
    q_avals, kv_avals: the residuals' abstract values (scalar shapes, their dtypes).
    problem: None, or why a hoisted value cannot travel per position (not a scalar).
  """

  tile: Callable
  q_fn: Callable
  kv_fn: Callable
  q_avals: tuple
  kv_avals: tuple
  problem: str | None = None
  rel_fn: Callable | None = None
  rel_avals: tuple = ()

  @property
  def n_pos(self) -> int:
    return len(self.q_avals) + len(self.kv_avals) + len(self.rel_avals)


def _is_literal(v) -> bool:
  return type(v).__name__ == "Literal"


def _eval(jaxpr, env: dict, eqns):
  """Bind `eqns` (a subset of jaxpr's, in order) on `env` (var -> value), in place."""
  read = lambda v: v.val if _is_literal(v) else env[v]
  for e in eqns:
    ins = [read(v) for v in e.invars]
    outs = e.primitive.bind(*ins, **e.primitive.get_bind_params(e.params))
    outs = list(outs) if e.primitive.multiple_results else [outs]
    for v, x in zip(e.outvars, outs):
      env[v] = x
  return read


def hoist(fn, consts, acc, rel: bool = False) -> Hoist | None:
  """Split the scalar mod `fn` (see the module doc), or None when nothing is read by one
  position through an indexing primitive (the mod is then left as it is).

  `fn`: a score_mod ``fn(s, b, h, q, kv, *consts)``; a mask_mod is passed in the same form
  (`_common._mask_mod_as_score_mod`). `rel` (a family whose kernels look up a per-(b, h) row
  by kv_idx - q_idx): values depending on the positions through ``kv_idx - q_idx`` only
  (``table[h, bucket(kv_idx - q_idx)]``) are hoisted too, as functions of that difference
  (`Hoist.rel_fn`, evaluated by XLA at every difference).
  """
  consts = tuple(consts)
  s = jax.ShapeDtypeStruct((), acc)
  i = jax.ShapeDtypeStruct((), jnp.int32)
  cs = [jax.ShapeDtypeStruct(jnp.shape(c), jnp.result_type(c)) for c in consts]
  closed = jax.make_jaxpr(fn)(s, i, i, i, i, *cs)
  jaxpr = closed.jaxpr
  S, B, Hh, Q, KV = jaxpr.invars[:5]
  deps: dict = {v: frozenset() for v in jaxpr.constvars}
  deps.update({v: frozenset() for v in jaxpr.invars})
  deps[S], deps[Q], deps[KV] = frozenset("s"), frozenset({"q"}), frozenset({"kv"})
  hoisted: dict = {}  # var -> whether it needs an indexing primitive (one-position vars)
  sources: dict = {}  # (rel) var -> +1 for kv_idx - q_idx, -1 for q_idx - kv_idx
  get = lambda v: frozenset() if _is_literal(v) else deps[v]
  classes = (frozenset({"q"}), frozenset({"kv"})) + ((frozenset({"d"}),) if rel else ())
  for e in jaxpr.eqns:
    d = frozenset().union(*(get(v) for v in e.invars))
    idx = (e.primitive.name in _INDEXING
           or any(hoisted.get(v, False) for v in e.invars if not _is_literal(v)))
    if rel and e.primitive.name == "sub" and tuple(e.invars) in ((KV, Q), (Q, KV)):
      sources[e.outvars[0]] = 1 if e.invars[0] is KV else -1
      d = frozenset({"d"})
    for v in e.outvars:
      deps[v] = d
      if d in classes:
        hoisted[v] = idx
  hoist_eqn = lambda e: any(hoisted.get(v, False) for v in e.outvars)
  tile_eqns = [e for e in jaxpr.eqns if not hoist_eqn(e)]
  # the frontier: hoisted values read by the tile (or returned)
  reads: list = [v for e in tile_eqns for v in e.invars if not _is_literal(v)]
  reads += [v for v in jaxpr.outvars if not _is_literal(v)]
  frontier: dict = {}
  for v in reads:
    if hoisted.get(v, False):
      frontier.setdefault(v, None)
  if not frontier:
    return None
  q_vars = [v for v in frontier if deps[v] == frozenset({"q"})]
  kv_vars = [v for v in frontier if deps[v] == frozenset({"kv"})]
  rel_vars = [v for v in frontier if deps[v] == frozenset({"d"})]
  float_first = lambda vs: ([v for v in vs if jnp.issubdtype(v.aval.dtype, jnp.inexact)]
                            + [v for v in vs if not jnp.issubdtype(v.aval.dtype, jnp.inexact)])
  q_vars, kv_vars, rel_vars = float_first(q_vars), float_first(kv_vars), float_first(rel_vars)
  problem = None
  for v in q_vars + kv_vars + rel_vars:
    if v.aval.shape != ():
      problem = (f"a value read by one position has shape {tuple(v.aval.shape)} (per position"
                 " the kernels take scalars)")
  consts_vars = list(jaxpr.invars[5:])

  def needed(targets):
    """The equations the `targets` need, in order (all read (b, h, one position, consts)
    only: a one-position value's inputs depend on no more than it does)."""
    want = set(targets)
    out = []
    for e in reversed(jaxpr.eqns):
      if any(v in want for v in e.outvars) and e.outvars[0] not in sources:
        out.append(e)
        want.update(v for v in e.invars if not _is_literal(v))
    return out[::-1]

  def position_fn(targets, pos_var):
    eqns = needed(targets)

    def f(b, h, p, *cs_):
      env = dict(zip(jaxpr.constvars, closed.consts))
      env.update(zip(consts_vars, cs_))
      env.update({B: b, Hh: h})
      if pos_var is None:  # p = kv_idx - q_idx: bind each difference the mod computes
        env.update({v: p if sign > 0 else -p for v, sign in sources.items()})
      else:
        env[pos_var] = p
      read = _eval(jaxpr, env, eqns)
      return tuple(read(v) for v in targets)

    return f

  n_q, n_kv = len(q_vars), len(kv_vars)

  def tile(s_, b, h, q, kv, *args):
    cs_, pos = args[:len(consts_vars)], args[len(consts_vars):]
    env = dict(zip(jaxpr.constvars, closed.consts))
    env.update(zip(consts_vars, cs_))
    env.update({S: s_, B: b, Hh: h, Q: q, KV: kv})
    env.update(zip(q_vars, pos[:n_q]))
    env.update(zip(kv_vars, pos[n_q:n_q + n_kv]))
    env.update(zip(rel_vars, pos[n_q + n_kv:]))
    read = _eval(jaxpr, env, tile_eqns)
    (out,) = [read(v) for v in jaxpr.outvars]
    return out

  aval = lambda v: jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype)
  return Hoist(tile, position_fn(q_vars, Q), position_fn(kv_vars, KV),
               tuple(aval(v) for v in q_vars), tuple(aval(v) for v in kv_vars), problem,
               position_fn(rel_vars, None), tuple(aval(v) for v in rel_vars))


def arrays(h: Hoist, consts, bs, hs, q_pos, kv_pos, rel_pos=None):
  """(q residuals, kv residuals, rel residuals): tuples of [B, H, len(q_pos)] /
  [B, H, len(kv_pos)] / [B, H, len(rel_pos)] arrays, `h.q_fn` / `h.kv_fn` / `h.rel_fn` at
  every (b in bs, h in hs, position or difference) (int32 index vectors)."""
  consts = tuple(consts)

  def table(fn, pos, n):
    if not n:
      return ()
    f = lambda b, hh, p: fn(b, hh, p, *consts)
    f = jax.vmap(f, (None, None, 0))
    f = jax.vmap(f, (None, 0, None))
    return tuple(jax.vmap(f, (0, None, None))(bs, hs, pos))

  rel_res = () if rel_pos is None else table(h.rel_fn, rel_pos, len(h.rel_avals))
  return (table(h.q_fn, q_pos, len(h.q_avals)), table(h.kv_fn, kv_pos, len(h.kv_avals)),
          rel_res)


def rel_batch_free(h: Hoist, consts) -> tuple:
  """Per rel residual of `h` (`Hoist.rel_fn`'s outputs): whether it is the same for every
  batch index (a table per head, ``table[h, bucket(kv_idx - q_idx)]``), read from the jaxpr
  of rel_fn: no output that depends on b (conservatively: an equation any of whose inputs
  depends on b makes all its outputs depend on it)."""
  fn = h.rel_fn
  if fn is None or not h.rel_avals:
    return ()
  i = jax.ShapeDtypeStruct((), jnp.int32)
  avals = [jax.ShapeDtypeStruct(jnp.shape(c), jnp.result_type(c)) for c in consts]
  closed = jax.make_jaxpr(lambda b, *cs: fn(b, jnp.int32(0), jnp.int32(0), *cs))(i, *avals)
  jaxpr = closed.jaxpr
  dep = {jaxpr.invars[0]}
  for eqn in jaxpr.eqns:
    if any(not _is_literal(v) and v in dep for v in eqn.invars):
      dep.update(eqn.outvars)
  return tuple(_is_literal(v) or v not in dep for v in jaxpr.outvars)


def apply(fn, consts, pos, scores, b, h, q_idx, kv_idx):
  """`_score_mod.apply` of a hoisted tile function: `pos` (the loaded residual tiles, each
  broadcasting against the scores like q_idx or kv_idx) are elementwise arguments."""
  if not pos:
    return _score_mod.apply(fn, consts, scores, b, h, q_idx, kv_idx)
  scores, b, h, q_idx, kv_idx, *rest = _ac.unify_varying(scores, b, h, q_idx, kv_idx,
                                                          *consts, *pos)
  consts, pos = tuple(rest[:len(consts)]), tuple(rest[len(consts):])
  vec = jnp.vectorize(lambda s_, b_, h_, q_, k_, *p: fn(s_, b_, h_, q_, k_, *consts, *p))
  out = vec(scores, b, h, q_idx, kv_idx, *pos)
  return jnp.broadcast_to(out, scores.shape).astype(scores.dtype)


def apply_mask(fn, consts, pos, b, h, q_idx, kv_idx):
  """`_mask_mod.apply` of a hoisted mask_mod tile function (``fn(b, h, q, kv, *consts,
  *pos)``), `pos` elementwise as in `apply`."""
  i32 = lambda x: jnp.asarray(x).astype(jnp.int32)
  b, h, q_idx, kv_idx, *rest = _ac.unify_varying(i32(b), i32(h), i32(q_idx), i32(kv_idx),
                                                 *consts, *pos)
  consts, pos = tuple(rest[:len(consts)]), tuple(rest[len(consts):])
  vec = jnp.vectorize(lambda b_, h_, q_, k_, *p: fn(b_, h_, q_, k_, *consts, *p))
  return vec(b, h, q_idx, kv_idx, *pos)
