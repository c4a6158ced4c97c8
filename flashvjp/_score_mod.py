"""score_mod: the type, built-ins, and how closed-over arrays become explicit inputs.

Room: score_mod. A score_mod is elementwise:
``(scores, b, h, q_idx, kv_idx) -> scores`` with global int32 indices shaped to
broadcast against the scores. flashvjp traces it once on scalars (`convert`), so that
any array it closes over (an ALiBi slope vector, a learned relative-position table)
becomes an explicit input of the custom_vjp and receives its gradient; `check`
rejects a score_mod that is not elementwise; every implementation then applies the scalar function to
its own tile shape through `jnp.vectorize`.
"""
from __future__ import annotations

import math
from collections.abc import Callable
from typing import Protocol

import jax
import jax.extend  # jax.extend.core.Literal
import jax.numpy as jnp
import numpy as np

from flashvjp import _ad_compat as _ac


class ScoreMod(Protocol):
  """The callable type of `score_mod`."""

  def __call__(self, scores: jax.Array, b: jax.Array, h: jax.Array,
               q_idx: jax.Array, kv_idx: jax.Array) -> jax.Array:
    ...


def softcap(cap: float) -> ScoreMod:
  """Gemma-style logit soft-capping: ``cap * tanh(scores / cap)``."""
  if not cap > 0:
    raise ValueError(f"cap must be positive, got {cap!r}")

  def mod(scores, b, h, q_idx, kv_idx):
    del b, h, q_idx, kv_idx
    return cap * jnp.tanh(scores / cap)

  return mod


def alibi_slopes(num_heads: int) -> jax.Array:
  """The standard ALiBi slopes (Press et al.) for `num_heads` heads, float32 [num_heads]."""
  def pow2(n):
    start = 2.0 ** (-(2.0 ** -(math.log2(n) - 3)))
    return [start * start**i for i in range(n)]
  if math.log2(num_heads).is_integer():
    s = pow2(num_heads)
  else:
    p = 2 ** math.floor(math.log2(num_heads))
    s = pow2(p) + pow2(2 * p)[0::2][: num_heads - p]
  return jnp.asarray(s, jnp.float32)


def alibi(slopes: jax.Array) -> ScoreMod:
  """ALiBi: ``scores + slopes[h] * (kv_idx - q_idx)``; `slopes` [num_heads] is differentiable."""
  slopes = jnp.asarray(slopes)  # a numpy array cannot be indexed by a traced head index

  def mod(scores, b, h, q_idx, kv_idx):
    del b
    return scores + slopes[h].astype(scores.dtype) * (kv_idx - q_idx).astype(scores.dtype)

  return mod


def relative_position_bias(table: jax.Array, max_distance: int) -> ScoreMod:
  """Learned relative-position bias: ``scores + table[h, clip(kv - q, -d, d) + d]``.

  Args:
    table: [num_heads, 2 * max_distance + 1], differentiable.
    max_distance: distances beyond it share the edge bucket.
  """
  table = jnp.asarray(table)  # a numpy array cannot be indexed by traced indices
  if table.ndim != 2 or table.shape[1] != 2 * max_distance + 1:
    raise ValueError(
        f"table must be [num_heads, 2 * max_distance + 1] = [H, {2 * max_distance + 1}],"
        f" got {table.shape}")

  def mod(scores, b, h, q_idx, kv_idx):
    del b
    rel = jnp.clip(kv_idx - q_idx, -max_distance, max_distance) + max_distance
    return scores + table[h, rel].astype(scores.dtype)

  return mod


# Equality, hash and repr of a function traced on scalars (`ScalarScoreMod`,
# `flashvjp._mask_mod.ScalarMaskMod`): those of its traced computation, `self._key`.
def keyed_eq(self, other):
  return type(other) is type(self) and self._key == other._key  # pylint: disable=protected-access


def keyed_hash(self):
  return hash(self._key)  # pylint: disable=protected-access


def keyed_repr(self):
  return f"{type(self).__name__}({self._key[:60]!r}...)"  # pylint: disable=protected-access


class ScalarScoreMod:
  """A score_mod traced on scalars: ``fn(s, b, h, q, kv, *consts) -> s``.

  Every array the user's function reads is an explicit argument (the consts, in the
  order `convert` returns them). Equality and hash are those of the traced
  computation (the jaxpr's text), not of the Python function: the same score_mod
  passed on every call, or rebuilt with the same code and array shapes, gives an
  equal AttentionConfig, so a jitted attention body is traced and compiled once.
  """

  def __init__(self, jaxpr, perm, key):
    self._jaxpr = jaxpr
    self._perm = tuple(perm)
    self._key = key

  def __call__(self, s, b, h, q, kv, *consts):
    orig = [None] * len(consts)
    for new_i, old_i in enumerate(self._perm):
      orig[old_i] = consts[new_i]
    (out,) = _ac.eval_jaxpr_varying(self._jaxpr, orig, s, b, h, q, kv)
    return out

  __eq__, __hash__, __repr__ = keyed_eq, keyed_hash, keyed_repr


def _traced(what, fn, *args, name="score_mod", argnames="(scores, b, h, q_idx, kv_idx)"):
  """Run a trace of the user's `name` function; wrap what it raises in an error naming it."""
  try:
    return fn(*args)
  except Exception as e:  # re-raised, chained
    cls = TypeError if isinstance(e, TypeError) else ValueError
    raise cls(
        f"{name} raised {type(e).__name__} while flashvjp traced it ({what}): {e}\n"
        f"{name} is traced by JAX, not run on concrete numbers: its arguments {argnames} are"
        " tracers, so Python control flow on their values (`if q_idx > 0`, int(q_idx)) is not"
        " allowed; use jnp.where / lax.cond instead") from e


def concrete_const(c):
  """A constant of a traced user function, kept concrete where it is.

  A tracer (an array closed over inside the caller's jit) stays as it is; a jax Array
  too; a numpy-like constant (an array literal built inside the function) becomes a
  numpy array, not `jnp.asarray(c)`: under the caller's jit that would stage it as a
  tracer, whose value the elementwise checks could then not read.
  """
  if isinstance(c, (jax.core.Tracer, jax.Array)):
    return c
  return np.asarray(c)


def convert(score_mod: Callable, acc_dtype) -> tuple[Callable, tuple, int]:
  """Trace `score_mod` on scalars; every array it reads becomes an explicit input.

  Returns (fn, consts, num_diff) where fn(s, b, h, q, kv, *consts) is the scalar
  function (a hashable `ScalarScoreMod`) and the first num_diff consts are inexact
  (differentiable). Closed-over arrays, concrete or traced (a learned table inside a
  jitted training step), are all hoisted, so gradients reach every inexact one.
  """
  s = jax.ShapeDtypeStruct((), acc_dtype)
  i = jax.ShapeDtypeStruct((), jnp.int32)
  closed = _traced("on scalar scores", jax.make_jaxpr(score_mod), s, i, i, i, i)
  out_avals = closed.out_avals
  if len(out_avals) != 1 or out_avals[0].shape != ():
    raise ValueError(
        "score_mod must be elementwise: called on one scalar score it must return one scalar,"
        f" got {[tuple(a.shape) for a in out_avals]}")
  consts = [concrete_const(c) for c in closed.consts]
  inexact = [jnp.issubdtype(jnp.result_type(c), jnp.inexact) for c in consts]
  perm = ([n for n, f in enumerate(inexact) if f] + [n for n, f in enumerate(inexact) if not f])
  key = (str(closed.jaxpr), tuple(perm))
  fn = ScalarScoreMod(closed.jaxpr, perm, key)
  return fn, tuple(consts[n] for n in perm), sum(inexact)


# Primitives that mix scores across positions when applied to (values derived from) the
# scores: named in the error of `check_elementwise`.
_MIXING = ("reduce_", "argmax", "argmin", "cum", "dot_general", "sort", "gather", "scatter",
           "dynamic_slice", "dynamic_update_slice", "slice", "concatenate", "pad", "rev",
           "transpose", "conv_general", "fft",
           "top_k")


def _mixing_prims(jaxpr, dep):
  """Names of position-mixing primitives applied to values that depend on `dep` invars."""
  dep = set(dep)
  found = []
  for eqn in jaxpr.eqns:
    ins = [v for v in eqn.invars if not isinstance(v, jax.extend.core.Literal)]
    if not any(v in dep for v in ins):
      continue
    name = eqn.primitive.name
    if any(name.startswith(m) for m in _MIXING) and name != "reduce_precision":
      found.append(name)
    for p in eqn.params.values():
      sub = getattr(p, "jaxpr", p)
      if hasattr(sub, "eqns") and len(sub.invars) == len(eqn.invars):
        sub_dep = [sv for sv, v in zip(sub.invars, eqn.invars)
                   if not isinstance(v, jax.extend.core.Literal) and v in dep]
        found += _mixing_prims(sub, sub_dep)
    dep.update(eqn.outvars)
  return found


# ---- a structural elementwise proof (no evaluation, so no jax op while tracing) --------
# A tile jaxpr is elementwise by construction when every value that depends on the
# scores / indices keeps the tile's first four dims as its own (numpy broadcasting of
# size-1 dims) and only pointwise primitives act on it: then entry p is computed from the
# inputs at p alone. Array lookups (``table[h, rel]``) qualify: a gather from an array
# that does not depend on the inputs, one element per index vector. Anything else falls
# back to the numeric check (`check`), which evaluates the function eagerly.

_POINTWISE = frozenset("""
abs acos acosh add and asin asinh atan atan2 atanh cbrt ceil clamp clz convert_element_type
copy copy_p cos cosh digamma div eq erf erf_inv erfc exp exp2 expm1 floor ge gt imag
integer_pow is_finite le lgamma log log1p logistic lt max min mul ne neg nextafter not or
population_count pow real reduce_precision rem round rsqrt select_n shift_left
shift_right_arithmetic shift_right_logical sign sin sinh sqrt square sub tan tanh xor
""".split())
_SHAPE_ONLY = frozenset({"broadcast_in_dim", "reshape", "squeeze", "expand_dims",
                         "concatenate"})


class _NotProvable(Exception):
  pass


def _sub_jaxpr(eqn):
  """The one sub-jaxpr of a call-like eqn (jit, custom_jvp_call, ...) with matching
  inputs and outputs, as (jaxpr, consts), or None."""
  subs = []
  for p in eqn.params.values():
    j = getattr(p, "jaxpr", None)
    if j is not None and hasattr(j, "eqns"):
      subs.append((j, tuple(getattr(p, "consts", ()))))
    elif hasattr(p, "eqns"):
      subs.append((p, ()))
  if len(subs) != 1:
    return None
  j, _ = subs[0]
  if len(j.invars) != len(eqn.invars) or len(j.outvars) != len(eqn.outvars):
    return None
  return subs[0]


def _pointwise(jaxpr, in_states, sig):
  """States of jaxpr's outvars. A state is None (independent of the inputs) or t: the
  value's first four dims are the tile's and it has t trailing (index vector) dims.
  Appends each primitive's canonical name to `sig`. Raises _NotProvable."""
  Lit = jax.extend.core.Literal
  env = dict(zip(jaxpr.invars, in_states))
  read = lambda v: None if isinstance(v, Lit) else env.get(v)
  for eqn in jaxpr.eqns:
    ins = [read(v) for v in eqn.invars]
    name = eqn.primitive.name
    lits = tuple(repr(v.val) for v in eqn.invars if isinstance(v, Lit))
    sub = _sub_jaxpr(eqn)
    if sub is not None:
      outs = _pointwise(sub[0], ins, sig)
    elif all(x is None for x in ins):
      outs = [None] * len(eqn.outvars)
      sig.append((name, lits))
    else:
      shape = lambda v: tuple(v.aval.shape)
      out_shape = shape(eqn.outvars[0])
      dep = [(v, t) for v, t in zip(eqn.invars, ins) if t is not None]
      ts = {t for _, t in dep}
      if len(ts) != 1 or len(eqn.outvars) != 1:
        raise _NotProvable(name)
      (t,) = ts
      if name in _POINTWISE:
        for v, x in zip(eqn.invars, ins):
          sh = () if isinstance(v, Lit) else shape(v)
          if x is None and any(d != 1 for d in sh):
            raise _NotProvable(name)  # an input-independent array: position dependent
          if x is not None and (len(sh) != len(out_shape) or any(
              a not in (1, b) for a, b in zip(sh, out_shape))):
            raise _NotProvable(name)
        outs = [t]
        sig.append((name, lits))
      elif name == "broadcast_in_dim":
        dims = tuple(eqn.params["broadcast_dimensions"])
        if dims[:4] != (0, 1, 2, 3):
          raise _NotProvable(name)
        outs = [len(out_shape) - 4]
      elif name == "reshape":
        (v, _), = dep
        if eqn.params.get("dimensions") is not None or out_shape[:4] != shape(v)[:4]:
          raise _NotProvable(name)
        outs = [len(out_shape) - 4]
      elif name == "squeeze":
        if any(d < 4 for d in eqn.params["dimensions"]):
          raise _NotProvable(name)
        outs = [len(out_shape) - 4]
      elif name == "concatenate":
        if eqn.params["dimension"] < 4 or any(x is None for x in ins):
          raise _NotProvable(name)
        outs = [t]
      elif name == "gather":
        dn = eqn.params["dimension_numbers"]
        idx_shape = shape(eqn.invars[1])
        if (ins[0] is not None or ins[1] is None or t < 1 or tuple(dn.offset_dims)
            or tuple(getattr(dn, "operand_batching_dims", ())) or any(
                d != 1 for d in eqn.params["slice_sizes"])
            or out_shape != idx_shape[:-1]):
          raise _NotProvable(name)
        outs = [t - 1]
        sig.append(("lookup", ()))
      else:
        raise _NotProvable(name)
    for v, x in zip(eqn.outvars, outs):
      env[v] = x
  return [read(v) for v in jaxpr.outvars]


def _scalar_signature(jaxpr, sig):
  """The canonical primitive sequence of a function traced on scalars (see `_pointwise`)."""
  Lit = jax.extend.core.Literal
  for eqn in jaxpr.eqns:
    sub = _sub_jaxpr(eqn)
    if sub is not None:
      _scalar_signature(sub[0], sig)
      continue
    name = eqn.primitive.name
    if name in _SHAPE_ONLY:
      continue
    if name == "dynamic_slice" and all(d == 1 for d in eqn.params["slice_sizes"]):
      sig.append(("lookup", ()))
      continue
    sig.append((name, tuple(repr(v.val) for v in eqn.invars if isinstance(v, Lit))))
  return sig


def provably_elementwise(tile_jaxpr, scalar_jaxpr, num_inputs: int) -> bool:
  """Whether the user function traced on a tile (`tile_jaxpr`, whose first `num_inputs`
  invars are the rank-4 scores / index arrays) is elementwise by construction and runs
  the same primitives as its scalar form (`scalar_jaxpr`): then the numeric check of
  `check` cannot fail and is skipped (no eager evaluation while tracing)."""
  try:
    sig: list = []
    states = [0] * num_inputs + [None] * (len(tile_jaxpr.invars) - num_inputs)
    outs = _pointwise(tile_jaxpr, states, sig)
  except _NotProvable:
    return False
  if any(t not in (None, 0) for t in outs):
    return False
  keep = lambda sg: [x for x in sg if x[0] not in _SHAPE_ONLY]
  return keep(sig) == keep(_scalar_signature(scalar_jaxpr, []))


_ELEMENTWISE_OK: dict = {}


def check(score_mod: Callable, target, acc_dtype):
  """Validate `score_mod` for scores of shape `target` = (B, H, Sq, Skv).

  Raises ValueError / TypeError naming score_mod when it changes the scores' shape,
  raises while traced, or is not elementwise; returns `convert`'s (fn, consts, num_diff).
  Elementwise means each output score depends only on its own score and indices:
  applied to a small tile of random scores it must equal its scalar form applied to
  each entry (what the kernels run). Checked once per distinct traced computation, and
  not evaluated at all when `provably_elementwise` proves it from the jaxpr (built-ins,
  index arithmetic, table lookups), so no jax op runs while a caller's jit traces.
  """
  B, H, Sq, Skv = target
  i32 = jnp.int32
  sds = jax.ShapeDtypeStruct
  idx = (sds((B, 1, 1, 1), i32), sds((1, H, 1, 1), i32), sds((1, 1, Sq, 1), i32),
         sds((1, 1, 1, Skv), i32))
  out = _traced(f"on scores of shape {tuple(target)}", jax.eval_shape, score_mod,
                sds(tuple(target), acc_dtype), *idx)
  if getattr(out, "shape", None) != tuple(target):
    raise ValueError(f"score_mod must return scores of the same shape {tuple(target)}, got "
                     f"{getattr(out, 'shape', type(out).__name__)}")
  if not jnp.issubdtype(out.dtype, jnp.floating):
    hint = (": a bool is a mask, which is mask_mod's job (mask_mod=lambda b, h, q_idx, kv_idx:"
            " ...), or jnp.where(cond, scores, -jnp.inf) inside score_mod"
            if out.dtype == jnp.bool_ else "")
    raise TypeError(f"score_mod must return float scores (the modified scores, e.g. scores +"
                    f" bias), got dtype {out.dtype}{hint}")
  # A small tile at positions spread over the real ranges (first and last batch/head).
  tb, th, tq, tk = min(B, 2), min(H, 2), min(Sq, 3), min(Skv, 4)
  pos = lambda n, t: np.unique(np.linspace(0, n - 1, t).round().astype(np.int32))
  bi, hi, qi, ki = pos(B, tb), pos(H, th), pos(Sq, tq), pos(Skv, tk)
  tile = (len(bi), len(hi), len(qi), len(ki))
  tile_idx = (sds((tile[0], 1, 1, 1), i32), sds((1, tile[1], 1, 1), i32),
              sds((1, 1, tile[2], 1), i32), sds((1, 1, 1, tile[3]), i32))
  try:
    closed = jax.make_jaxpr(score_mod)(sds(tile, acc_dtype), *tile_idx)
  except Exception as e:  # re-raised, chained
    raise ValueError(
        f"score_mod must be elementwise: it runs on the full scores {tuple(target)} but fails on"
        f" a block of scores of shape {tile} (flashvjp calls it block by block): {e}") from e
  try:
    fn, consts, n_diff = convert(score_mod, acc_dtype)
  except (TypeError, ValueError) as e:
    # It runs on blocks of scores but not on one scalar score: it depends on the scores'
    # shape (slices, reductions or indexing along the score axes).
    prims = sorted(set(_mixing_prims(closed.jaxpr, closed.jaxpr.invars[:1])))
    why = f"it applies {', '.join(prims)} to the scores, and " if prims else ""
    raise ValueError(
        f"score_mod must be elementwise: {why}on one scalar score (how flashvjp's kernels"
        f" call it) it fails: {e.__cause__ or e}") from e
  key = (fn, str(closed.jaxpr), tile)
  if key in _ELEMENTWISE_OK:
    return fn, consts, n_diff
  if provably_elementwise(closed.jaxpr, fn._jaxpr, 5):  # type: ignore[attr-defined]  # set by convert
    _ELEMENTWISE_OK[key] = True  # by construction: nothing evaluated (no jax op)
    return fn, consts, n_diff
  # Concrete stand-ins for traced consts (closed over inside a jit): zeros of their type.
  zeros = lambda c: jnp.zeros(jnp.shape(c), jnp.result_type(c)) if isinstance(
      c, jax.core.Tracer) else c
  with jax.ensure_compile_time_eval():
    rng = np.random.default_rng(0)
    s = jnp.asarray(rng.standard_normal(tile) * 3.0, acc_dtype)
    args = (jnp.asarray(bi.reshape(-1, 1, 1, 1)), jnp.asarray(hi.reshape(1, -1, 1, 1)),
            jnp.asarray(qi.reshape(1, 1, -1, 1)), jnp.asarray(ki.reshape(1, 1, 1, -1)))
    (whole,) = _traced("on a tile", jax.core.eval_jaxpr, closed.jaxpr,
                       [zeros(c) for c in closed.consts], s, *args)
    each = apply(fn, tuple(zeros(c) for c in consts), s, *args)
    whole = np.asarray(jnp.broadcast_to(whole, tile), np.float64)
    each = np.asarray(each, np.float64)
  bad = ~np.isclose(whole, each, rtol=1e-5, atol=1e-6, equal_nan=True)
  if bad.any():
    prims = sorted(set(_mixing_prims(closed.jaxpr, closed.jaxpr.invars[:1])))
    why = (f" (it applies {', '.join(prims)} to the scores)" if prims else "")
    raise ValueError(
        "score_mod must be elementwise: each output score may depend only on its own score"
        " and its (b, h, q_idx, kv_idx), but applied to a tile of scores of shape"
        f" {tile} it differs from applying it to each score alone{why}; max difference"
        f" {np.nanmax(np.abs(whole - each)):.3g}. flashvjp runs score_mod on blocks of scores,"
        " so reductions over the scores (jnp.max(s), s.sum(-1)), cumulative ops, matmuls or"
        " gathers across score positions cannot be computed exactly")
  if len(_ELEMENTWISE_OK) > 1024:
    _ELEMENTWISE_OK.clear()
  _ELEMENTWISE_OK[key] = True
  return fn, consts, n_diff


def apply(fn: Callable, consts, scores, b, h, q_idx, kv_idx):
  """Apply the scalar score_mod `fn` elementwise to a tile, broadcasting the indices."""
  # under shard_map: the traced score_mod's operands agree on their varying axes
  scores, b, h, q_idx, kv_idx, *consts = _ac.unify_varying(scores, b, h, q_idx, kv_idx, *consts)
  vec = jnp.vectorize(lambda s, b_, h_, q_, k_: fn(s, b_, h_, q_, k_, *consts))
  out = vec(scores, b, h, q_idx, kv_idx)
  return jnp.broadcast_to(out, scores.shape).astype(scores.dtype)
