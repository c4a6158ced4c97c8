"""Arrays a mod reads at the query or key position: sharded with the sequence, not copied.

Room: the mask / score_mod model (shared by the partitioning rule, the ring and the
Pallas families). ``doc_ids[b, q_idx]``, ``bias_vec[kv_idx]``, ``temp[q_idx]``: an array
with an axis as long as the sequence, read at exactly the query (or key) position along
it. Under sequence sharding each device only ever reads its own part of that axis (the
ring: the part of the K/V chunk in hand), so the array can be sharded like the tokens
instead of copied whole to every device (issue 32).

`align` finds such arrays in a scalar mod's jaxpr, traced once at the global shapes: every
use of the array is a ``dynamic_slice`` (what jnp's scalar indexing lowers to) whose start
index on one axis of the sequence's length is the raw position (up to jnp's
negative-index normalisation and integer casts, identities for positions in range), with
a slice of one there. It returns an `Aligned` mod: the same function (`__call__`, global
semantics, for whole arrays) plus `shifted(offsets)`, which reads a LOCAL slice of each
aligned array (starting at global position q0 / kv0, the backends' offsets) by
subtracting the offset from that start index. The jaxpr is never retraced at the local
shapes, so a mod that reads an array's shape (``bias.shape[0] - 1``) keeps its global
meaning. An array read at both positions (``doc[b, q_idx] == doc[b, kv_idx]``) is passed
twice (a second, key-aligned copy of a non-differentiable array; a differentiable one
stays whole). Everything else (tables read by ``kv_idx - q_idx``, per-head vectors,
arrays of another length) stays whole.

`axes` tells the layers above what moves where: per const, None (whole) or (axis, "q" /
"kv"). The partitioning rule shards "q" arrays like the queries and "kv" ones like the
keys; the ring slices "q" arrays per query piece and sends "kv" ones round with the K/V
chunk (their gradients come home with dK/dV); Ulysses gathers them whole for its heads.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from flashvjp import _ad_compat as _ac

_MAX_CHAIN = 8  # casts / normalisations between a raw position and a slice index


def _is_literal(v) -> bool:
  return type(v).__name__ == "Literal"


def _literal_int(v):
  if not _is_literal(v):
    return None
  try:
    return int(np.asarray(v.val))
  except (TypeError, ValueError):
    return None


def _position_of(v, producers: dict, Q, KV):
  """"q" / "kv" when the scalar integer var `v` equals the raw position Q / KV for every
  position in range (Q itself through integer casts and jnp's normalisation
  ``select_n(lt(p, 0), p, add(p, n))``), else None."""
  for _ in range(_MAX_CHAIN):
    if v is Q:
      return "q"
    if v is KV:
      return "kv"
    e = producers.get(v)
    if e is None:
      return None
    name = e.primitive.name
    if name == "convert_element_type" and jnp.issubdtype(e.outvars[0].aval.dtype, jnp.integer):
      v = e.invars[0]
      continue
    if name == "select_n" and len(e.invars) == 3:
      pred, x, y = e.invars
      pe, ye = producers.get(pred), producers.get(y)
      neg = (pe is not None and pe.primitive.name == "lt" and pe.invars[0] is x
             and _literal_int(pe.invars[1]) == 0)
      wrap = (ye is not None and ye.primitive.name == "add"
              and ((ye.invars[0] is x and _literal_int(ye.invars[1]) is not None)
                   or (ye.invars[1] is x and _literal_int(ye.invars[0]) is not None)))
      if neg and wrap:
        v = x
        continue
    return None
  return None


@dataclasses.dataclass(frozen=True, eq=False)
class Aligned:
  """A scalar mod whose position-aligned arrays may arrive as local slices (module doc).

  Attributes:
    closed: the mod's jaxpr in score form ``(s, b, h, q, kv, *consts)``, global shapes.
    axes: per const of this mod: None (whole) or (axis, "q" | "kv").
    reads: {equation index: (const index, axis, "q" | "kv")} of the aligned slices.
    mask: a mask_mod (called ``(b, h, q, kv, *consts)``) rather than a score_mod.
    source: per const, the index of the caller's const it is (a key-aligned copy repeats
      its array's index).
  """

  closed: object
  axes: tuple
  reads: dict
  mask: bool
  source: tuple

  def _eval(self, args, shift):
    jaxpr = self.closed.jaxpr  # type: ignore[attr-defined]
    n_in = len(jaxpr.invars)
    head, cs = list(args[:5]), list(args[5:])
    # a key-aligned copy is read only by its own slices: bind the invars to the originals
    ins = head + [cs[i] for i in range(n_in - 5)]
    override = {}
    for n, (ci, axis, tag) in self.reads.items():
      off = None if shift is None else shift[0 if tag == "q" else 1]
      override[n] = (axis, off, cs[ci])
    return _ac.eval_jaxpr_varying(jaxpr, self.closed.consts, *ins,  # type: ignore[attr-defined]
                                  override=_overrider(override))[0]

  def _score_args(self, args) -> tuple:
    """A mask_mod's (b, h, q, kv, *consts) in the jaxpr's score form (s unused)."""
    return ((jnp.zeros((), jnp.float32),) if self.mask else ()) + tuple(args)

  def __call__(self, *args):
    return self._eval(self._score_args(args), None)

  def shifted(self, offsets):
    """The mod reading its aligned arrays as local slices starting at the global positions
    (q0, kv0) of `offsets` (the backends' (b0, h0, q0, kv0); None: whole arrays)."""
    if offsets is None:
      return self
    shift = tuple(offsets)[2:]  # (q0, kv0)
    return lambda *args: self._eval(self._score_args(args), shift)

  def tags(self, i: int, q_tag: str = "q", kv_tag: str = "s") -> tuple:
    """Dim tags of const i for the partitioning rule (aligned axis: q_tag / kv_tag)."""
    shape = self.closed.jaxpr.invars[5 + self.source[i]].aval.shape  # type: ignore[attr-defined]
    tags: list = [None] * len(shape)
    if self.axes[i] is not None:
      axis, tag = self.axes[i]
      tags[axis] = q_tag if tag == "q" else kv_tag
    return tuple(tags)


def _overrider(override: dict):
  """`eval_jaxpr_varying`'s hook: the aligned slices read their (local) array at the start
  index minus the offset."""
  def hook(n, invals):
    if n not in override:
      return invals
    axis, off, array = override[n]
    invals = list(invals)
    invals[0] = array
    if off is not None and not (isinstance(off, (int, np.integer)) and int(off) == 0):
      i = 1 + axis
      invals[i] = invals[i] - jnp.asarray(off).astype(jnp.result_type(invals[i]))
    return invals
  return hook


def axes_of(fn, n: int) -> tuple:
  """Per const of the mod `fn` (n of them): None or (axis, "q" | "kv")."""
  return fn.axes if isinstance(fn, Aligned) else (None,) * n


def shifted(fn, offsets):
  """`fn` reading local slices of its aligned arrays (an `Aligned` mod), else `fn`."""
  return fn.shifted(offsets) if isinstance(fn, Aligned) else fn


def align(fn, consts, acc, seq_q: int, seq_kv: int, n_diff: int = 0, mask: bool = False):
  """(Aligned mod, consts) with a key-aligned copy appended per array read at both
  positions, or None when no array is aligned. `fn`: a scalar score_mod ``(s, b, h, q,
  kv, *consts)`` (or mask_mod ``(b, h, q, kv, *consts)`` with `mask`) with every array it
  reads among `consts` (`_common.hoist_constants` first); the first `n_diff` consts are
  differentiable (never copied)."""
  consts = tuple(consts)
  score_form = (lambda s, b, h, q, kv, *c: fn(b, h, q, kv, *c)) if mask else fn
  s_aval = jax.ShapeDtypeStruct((), jnp.float32 if mask else acc)
  i = jax.ShapeDtypeStruct((), jnp.int32)
  cs = [jax.ShapeDtypeStruct(jnp.shape(c), jnp.result_type(c)) for c in consts]
  closed = jax.make_jaxpr(score_form)(s_aval, i, i, i, i, *cs)
  jaxpr = closed.jaxpr
  Q, KV = jaxpr.invars[3], jaxpr.invars[4]
  cvars = list(jaxpr.invars[5:])
  index = {v: n for n, v in enumerate(cvars)}
  producers = {ov: e for e in jaxpr.eqns for ov in e.outvars}
  uses: dict = {n: [] for n in range(len(cvars))}
  bad: set = {index[v] for v in jaxpr.outvars if not _is_literal(v) and v in index}
  seq = {"q": seq_q, "kv": seq_kv}
  for n, e in enumerate(jaxpr.eqns):
    for p, v in enumerate(e.invars):
      if _is_literal(v) or v not in index:
        continue
      c = index[v]
      if e.primitive.name != "dynamic_slice" or p != 0:
        bad.add(c)
        continue
      sizes, shape = e.params["slice_sizes"], jnp.shape(consts[c])
      found = []
      for axis, iv in enumerate(e.invars[1:]):
        tag = None if _is_literal(iv) else _position_of(iv, producers, Q, KV)
        if tag is not None and sizes[axis] == 1 and shape[axis] == seq[tag]:
          found.append((axis, tag))
      if len(found) != 1:
        bad.add(c)
      else:
        uses[c].append((n, *found[0]))
  axes: list = [None] * len(cvars)
  reads: dict = {}
  copies: list = []  # (const index of the original, axis) of key-aligned copies
  for c, us in uses.items():
    if c in bad or not us:
      continue
    kinds = {(axis, tag) for _, axis, tag in us}
    if len(kinds) == 1:
      (axis, tag), = kinds
      axes[c] = (axis, tag)
      reads.update({n: (c, axis, tag) for n, _, _ in us})
    elif len({axis for axis, _ in kinds}) == 1 and c >= n_diff:
      axis = us[0][1]
      axes[c] = (axis, "q")
      copy = len(cvars) + len(copies)
      copies.append((c, axis))
      reads.update({n: (c if tag == "q" else copy, axis, tag) for n, _, tag in us})
  if not reads:
    return None
  axes += [(axis, "kv") for _, axis in copies]
  source = tuple(range(len(cvars))) + tuple(c for c, _ in copies)
  new = consts + tuple(consts[c] for c, _ in copies)
  return Aligned(closed, tuple(axes), reads, mask, source), new
