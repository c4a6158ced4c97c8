"""The backends' partitioning rule under jit: batch, heads AND the sequence (custom_partitioning).

Room: partitioning (below _vjp; flashvjp.distributed holds the user-facing ring and mesh
helpers). XLA cannot partition a `pallas_call`, and partitions the blockwise loops only by
gathering what it cannot split: given q / k / v sharded along the sequence it would
all-gather them and run the whole op on every device. Wrapping each backend's `forward`,
`backward` and `tangent` in `jax.custom_partitioning` with a Shardy sharding rule lets the
partition run per device:

* batch and heads: each device runs the backend on its own slice, no collective (heads
  stay sharded when the head axes divide both num_heads and num_kv_heads: whole GQA
  groups per device); score_mod, mask_mod and dropout get the slice's global (b, h)
  offsets (every backend takes `offsets=(b, h, q, kv)`);
* the sequence (any mesh axis or axes, alone or with batch / head axes): a context-parallel
  strategy runs inside the partition, chosen by `flashvjp._strategy` from static facts
  (mesh, heads, shapes, the mask's ring schedule) unless `context_parallel=` names one:
  the ring (`flashvjp.ring`, ppermute, O(S/P) memory; the default), Ulysses (all_to_all
  sequence <-> heads around the one-device backend), or all-gather of K/V (only when
  asked). The strategies call the same backends with global offsets: no second mask model.

The choice is logged (absl, debug level) and
`flashvjp.explain` computes the same choice from a sharded query (`strategy_for`).

`wrap(name, backend, tangent)` returns an object with the backend interface::

    forward(cfg, q, k, v, bias, mask, q_seg, kv_seg, seed, consts, mod) -> (out, lse)
      (+ row_max [B, H, Sq] when cfg.max_logits: laid out, and moved, like lse)
    backward(cfg, q, k, v, bias, mask, q_seg, kv_seg, seed, consts, out, lse, dout, dlse, mod)
        -> (dq, dk, dv, dbias, dconsts)
    tangent(cfg, q, k, v, bias, mask, q_seg, kv_seg, seed, consts, out, lse, tq, tk, tv,
            tbias, tconsts, mod) -> (t_out, t_lse)

Under vmap the plain backend is vmapped (custom_partitioning has no batching rule).
Outside jit, on one device, or inside a fully manual shard_map, the wrapped function
simply runs the backend.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging
from jax import lax
from jax.custom_batching import custom_vmap
from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec

from flashvjp import _aligned
from flashvjp import _mask
from flashvjp import _mask_mod
from flashvjp import _record
from flashvjp import _strategy
from flashvjp import ring
from flashvjp._config import AttentionConfig
from flashvjp.ring import _ulysses as _ulysses_moves

# Dim tags: b batch, h query heads, k kv heads, q query positions, s kv positions,
# d / e head dims (always whole); None: a dim of its own (broadcast or a constant), whole.
_Q = ("b", "h", "q", "d")
_K = ("b", "k", "s", "d")
_V = ("b", "k", "s", "e")
_O = ("b", "h", "q", "e")
_L = ("b", "h", "q")


def _pair_tags(shape, rows=True):
  """Tags of a rank-4 [B, H, Sq, Skv] pair array (bias, mask, mask_mod classes): full dims
  follow the attention dims (columns always whole), size-1 dims are their own."""
  full = ("b", "h", "q" if rows else None, None)
  return tuple(t if n != 1 else None for t, n in zip(full, shape))


@dataclasses.dataclass(frozen=True)
class _Sig:
  """The operands of one partitioned call: names, dim tags, results (hashable, static)."""

  kind: str  # "forward" | "backward" | "tangent"
  backend: str
  names: tuple
  tags: tuple
  results: tuple
  result_tags: tuple
  n_consts: int
  has_mod: bool
  n_mod_consts: int


def _const_tags(fn, consts) -> list:
  """Dim tags of a mod's consts: whole, except an axis read at the query / key position
  (`flashvjp._aligned`), split like the sequence."""
  if isinstance(fn, _aligned.Aligned):
    return [fn.tags(i) for i in range(len(consts))]
  return [(None,) * jnp.ndim(c) for c in consts]


def _operands(cfg, q, k, v, bias, mask, q_seg, kv_seg, seed, consts, mod, extra) -> list:
  items: list[tuple[str, Any, tuple]] = [("q", q, _Q), ("k", k, _K), ("v", v, _V)]
  if bias is not None:
    items.append(("bias", bias, _pair_tags(bias.shape)))
  if mask is not None:
    items.append(("mask", mask, _pair_tags(mask.shape)))
  if q_seg is not None:
    items += [("q_seg", q_seg, ("b", "q")), ("kv_seg", kv_seg, ("b", "s"))]
  if seed is not None:
    items.append(("seed", seed, (None,) * jnp.ndim(seed)))
  items += [(f"c{i}", c, t) for i, (c, t) in
            enumerate(zip(consts, _const_tags(cfg.score_mod, consts)))]
  if mod is not None:
    if mod.classes is not None:
      items.append(("classes", mod.classes, _pair_tags(mod.classes.shape, rows=False)))
    items += [(f"m{i}", c, t) for i, (c, t) in
              enumerate(zip(mod.consts, _const_tags(cfg.mask_mod, mod.consts)))]
  items += [it for it in extra if it[1] is not None]
  return items


def _sig(kind, name, items, results, n_consts, mod):
  return _Sig(kind=kind, backend=name, names=tuple(i[0] for i in items),
              tags=tuple(i[2] for i in items), results=tuple(r[0] for r in results),
              result_tags=tuple(r[1] for r in results), n_consts=n_consts,
              has_mod=mod is not None, n_mod_consts=0 if mod is None else len(mod.consts))


# ---- the plan of one partition --------------------------------------------------------

def _axes_tuple(a) -> tuple:
  if a is None:
    return ()
  return tuple(a) if isinstance(a, (tuple, list)) else (a,)


def _size(mesh, axes) -> int:
  n = 1
  for a in _axes_tuple(axes):
    n *= mesh.shape[a]
  return n


def _norm(a):
  """A PartitionSpec entry as None, one name, or a tuple of names."""
  t = _axes_tuple(a)
  return None if not t else t[0] if len(t) == 1 else t


@dataclasses.dataclass(frozen=True)
class _Plan:
  bax: Any  # mesh axes of batch / heads / sequence (None: whole)
  hax: Any
  sax: Any
  strategy: Any  # a flashvjp._strategy.Strategy, or None (the sequence is whole)
  local: tuple  # (B, H, Sq, Skv) per device, before the strategy

  def axis(self, tag):
    return {"b": self.bax, "h": self.hax, "k": self.hax, "q": self.sax, "s": self.sax}.get(tag)

  @property
  def all_axes(self) -> tuple:
    return _axes_tuple(self.bax) + _axes_tuple(self.hax) + _axes_tuple(self.sax)


def uses_offsets(cfg: AttentionConfig) -> bool:
  return ring.uses_offsets(cfg)


def _plan(cfg: AttentionConfig, mesh, q_spec, q_shape, k_shape, v_shape, itemsize: int,
          pair_shapes: dict, has_seg: bool) -> _Plan:
  """Which mesh axes this call is split over, and the sequence strategy (static)."""
  spec = tuple(q_spec or ()) + (None,) * 4
  bax, hax, sax = (_norm(a) for a in spec[:3])
  B, H, Sq, D = q_shape
  Hk, Skv, Dv = k_shape[1], k_shape[2], v_shape[3]
  if bax is not None and B % _size(mesh, bax):
    logging.warning("flashvjp: batch (%d) is not divisible by the %d devices of mesh axes %s:"
                    " attention gathers the batch on every device", B, _size(mesh, bax), bax)
    bax = None
  if hax is not None and (H % _size(mesh, hax) or Hk % _size(mesh, hax)):
    logging.warning("flashvjp: num_heads (%d) and num_kv_heads (%d) must both be divisible by"
                    " the %d devices of mesh axes %s to stay sharded (whole GQA groups per"
                    " device): attention gathers the heads on every device", H, Hk,
                    _size(mesh, hax), hax)
    hax = None
  if sax is not None and _size(mesh, sax) == 1:
    sax = None
  B_l, H_l = B // _size(mesh, bax), H // _size(mesh, hax)
  if sax is None:
    return _Plan(bax, hax, None, None, (B_l, H_l, Sq, Skv))
  n = _size(mesh, sax)
  if Sq % n or Skv % n:
    raise ValueError(
        f"flashvjp: the sequence is sharded over {_axes_tuple(sax)} ({n} devices) but seq_q"
        f" ({Sq}) and seq_kv ({Skv}) must both be divisible by {n} for context parallelism;"
        " pad the sequence or shard it over fewer devices")
  rows_no_heads, pair_bytes = [], 0
  for name, (shape, dtype) in pair_shapes.items():
    if (shape[1] != 1) != (shape[2] != 1):
      rows_no_heads.append(name)
    if shape[2] != 1:  # rows follow the queries: Ulysses moves them
      local = list(shape)
      local[0] = shape[0] // _size(mesh, bax) if shape[0] != 1 else 1
      local[1] = shape[1] // _size(mesh, hax) if shape[1] != 1 else 1
      local[2] = shape[2] // n
      pair_bytes += _strategy.bytes_of(local, dtype)
  links = (axis_links(mesh, _axes_tuple(sax)) if cfg.intra_node_axes is None else
           tuple("in_node" if a in cfg.intra_node_axes else "across_nodes"
                 for a in _axes_tuple(sax)))
  problem = _strategy.Problem(
      num_shards=n, batch=B_l, heads=H_l, kv_heads=Hk // _size(mesh, hax), seq_q=Sq,
      seq_kv=Skv, head_dim=D, head_dim_v=Dv, itemsize=itemsize, causal=cfg.causal,
      window=cfg.window, mask_mod_hint=cfg.mask_mod_hint,
      pairs_not_split_by_heads=tuple(rows_no_heads), pair_bytes=pair_bytes,
      has_segments=has_seg, head_groups=cfg.ring_head_groups,
      axes=tuple((a, mesh.shape[a], l) for a, l in zip(_axes_tuple(sax), links)),
      bandwidth=_strategy.bandwidths(_device_kind(mesh)))
  strategy = _strategy.choose(cfg.context_parallel, problem, _axes_tuple(sax))
  return _Plan(bax, hax, sax, strategy, (B_l, H_l, Sq, Skv))


def _mesh_devices(mesh):
  try:
    devices = mesh.devices  # an AbstractMesh has none
  except (AttributeError, ValueError, TypeError, RuntimeError):
    return None
  return None if devices is None else np.asarray(devices)


def _device_kind(mesh) -> str | None:
  devs = _mesh_devices(mesh)
  return None if devs is None or not devs.size else getattr(devs.flat[0], "device_kind", None)


def _node_of(d):
  """The node a device is on, as its placement says: the slice on TPU (ICI joins a slice's
  chips, DCN the slices), the (slice, process) elsewhere (a process is one host)."""
  if getattr(d, "platform", "") == "tpu":
    return getattr(d, "slice_index", 0) or 0
  return (getattr(d, "slice_index", 0) or 0, getattr(d, "process_index", 0))


def axis_links(mesh, axes) -> tuple:
  """Per mesh axis in `axes`: "in_node" (every step along it stays on a node), "across_nodes"
  (some step leaves it) or None (unknown: no devices, as an AbstractMesh, or one device per
  process, where a process is no node)."""
  devs = _mesh_devices(mesh)
  if devs is None or devs.ndim != len(mesh.axis_names):
    return (None,) * len(axes)
  nodes = np.vectorize(lambda d: hash(_node_of(d)), otypes=[np.int64])(devs)
  if nodes.size > 1 and len(np.unique(nodes)) == nodes.size:
    return (None,) * len(axes)
  names = tuple(mesh.axis_names)
  out = []
  for a in axes:
    ax = names.index(a)
    same = np.all(nodes == np.take(nodes, [0], axis=ax))
    out.append("in_node" if same else "across_nodes")
  return tuple(out)


def strategy_for(cfg: AttentionConfig, mesh, q_spec, q_shape, k_shape, v_shape, itemsize,
                 pair_shapes, has_seg):
  """The Strategy a call with this sharding of the query would run (None: sequence whole).

  pair_shapes: {"bias" / "mask": (shape, dtype)} of the rank-4 pair arrays present.
  """
  return _plan(cfg, mesh, q_spec, q_shape, k_shape, v_shape, itemsize, pair_shapes,
               has_seg).strategy


# ---- running one partition ------------------------------------------------------------

_BACKENDS: dict = {}  # name -> (backend module, tangent function), filled by `wrap`
# families whose kernels read a mod's position-aligned arrays as local slices
# (`flashvjp._aligned`; the others take them whole)
_ALIGNS = ("pallas_triton", "pallas_tpu")


def _call_backend(name, kind, cfg, base, extra, mod, kw):
  if name == "ring":
    fn: Any = {"forward": ring.forward, "backward": ring.backward, "tangent": ring.tangent}[kind]
  else:
    module, tangent = _BACKENDS[name]
    fn = tangent if kind == "tangent" else getattr(module, kind)  # looked up at each call
  return fn(cfg, *base, *extra, mod, **kw)


def _has_ordered_effects(name: str, cfg) -> bool:
  """Kernels run through ordered-effect callbacks, which custom_partitioning cannot lower,
  run unpartitioned (replicated): the Mosaic-TPU simulator (`flashvjp.pallas.tpu._interpret.
  INTERPRET_PARAMS`, a test hook) and the Mosaic-GPU interpret mode (how CPU runs that
  family)."""
  if name == "pallas_mosaic_gpu":
    return bool(cfg.interpret)
  if name != "pallas_tpu":
    return False
  from flashvjp.pallas.tpu import _interpret
  return _interpret.INTERPRET_PARAMS is not None


def _parts(cfg, sig, arrays):
  """(base operands, extra operands, mod) of a flat operand list."""
  d = dict(zip(sig.names, arrays))
  consts = tuple(d[f"c{i}"] for i in range(sig.n_consts))
  mod = None
  if sig.has_mod:
    mod = _mask_mod.ModInputs(d.get("classes"),  # type: ignore[arg-type]  # None: no classes
                              tuple(d[f"m{i}"] for i in range(sig.n_mod_consts)))
  base = (d["q"], d["k"], d["v"], d.get("bias"), d.get("mask"), d.get("q_seg"),
          d.get("kv_seg"), d.get("seed"), consts)
  extra: tuple
  if sig.kind == "forward":
    extra = ()
  elif sig.kind == "backward":
    extra = (d["out"], d["lse"], d["dout"], d.get("dlse"))
  else:
    extra = (d["out"], d["lse"], d.get("tq"), d.get("tk"), d.get("tv"), d.get("tbias"),
             tuple(d.get(f"tc{i}") for i in range(cfg.num_diff_consts)))
  return base, extra, mod


def _flat(sig, res):
  if sig.kind != "backward":
    return list(res)
  dq, dk, dv, dbias, dconsts = res
  return [dq, dk, dv] + ([dbias] if "dbias" in sig.results else []) + list(dconsts)


def _classify(cfg, mod, B, H, seq_q, seq_kv, offsets=None):
  """The mask_mod's block classes of this device's slice (global b / h through offsets)."""
  fn = cfg.mask_mod
  if offsets is not None:
    b0, h0 = offsets[0], offsets[1]
    user = fn
    fn = lambda b, h, qi, ki, *c: user(b + b0, h + h0, qi, ki, *c)
  return _mask_mod.classify(fn, mod.consts, cfg.mask_mod_uses, B, H, seq_q, seq_kv,
                            *cfg.mask_mod_blocks)


def _with_classes(cfg, mod, B, H, seq_q, seq_kv, offsets=None):
  if mod is None or mod.classes is not None or cfg.mask_mod_blocks is None:
    return mod
  return mod._replace(classes=_classify(cfg, mod, B, H, seq_q, seq_kv, offsets))


def _run_whole(cfg, sig, arrays):
  """The backend on the operands as they are (one partition, under vmap, or kernels with
  ordered effects): no offsets, the mask_mod's classes of the whole call."""
  base, extra, mod = _parts(cfg, sig, arrays)
  mod = _with_classes(cfg, mod, base[0].shape[0], base[0].shape[1], cfg.seq_q, cfg.seq_kv)
  return _flat(sig, _call_backend(sig.backend, sig.kind, cfg, base, extra, mod, {}))


def _bh_offsets(plan: _Plan, B_l, H_l, h_extra=0):
  b0 = 0 if plan.bax is None else lax.axis_index(plan.bax) * B_l
  h0 = 0 if plan.hax is None else lax.axis_index(plan.hax) * H_l
  return (b0, h0 + h_extra, 0, 0)


def _run_partition(cfg, sig, plan: _Plan, arrays):
  """One device's part of the call, per `plan`; results in the partition's layout."""
  base, extra, mod = _parts(cfg, sig, arrays)
  st = plan.strategy
  B_l, H_l, Sq, Skv = plan.local
  if st is None:  # the sequence is whole: the backend on this batch / head slice
    offsets = _bh_offsets(plan, B_l, H_l) if plan.bax or plan.hax else None
    kw = {"offsets": offsets} if offsets is not None and uses_offsets(cfg) else {}
    mod = _with_classes(cfg, mod, B_l, H_l, Sq, Skv, offsets)
    res = _flat(sig, _call_backend(sig.backend, sig.kind, cfg, base, extra, mod, kw))
  elif st.name in ("ring", "all_gather"):
    n = st.num_shards
    spec = ring.RingSpec(axis_name=plan.sax, axis_size=n, layout="contiguous",
                         inner=sig.backend, batch_axis=plan.bax, head_axis=plan.hax,
                         mask_mod_hint=cfg.mask_mod_hint, gather=st.name == "all_gather",
                         head_groups=st.head_groups)
    cfg_r = dataclasses.replace(cfg, implementation="ring", ring=spec, seq_q=Sq // n,
                                seq_kv=Skv // n)
    mod = None if mod is None else mod._replace(classes=None)
    res = _flat(sig, _call_backend("ring", sig.kind, cfg_r, base, extra, mod, {}))
  elif st.name == "usp":
    # Ulysses over the inner axes around the ring over the outer ones (`flashvjp.ring`:
    # `RingSpec.ulysses_axis`): the ring runs on seq / P_ring rows for H / P_ulysses heads
    nu = st.ulysses_shards
    n_ring = st.num_shards // nu
    spec = ring.RingSpec(axis_name=_norm(st.ring_axes), axis_size=n_ring, layout="contiguous",
                         inner=sig.backend, batch_axis=plan.bax, head_axis=plan.hax,
                         mask_mod_hint=cfg.mask_mod_hint, head_groups=st.head_groups,
                         ulysses_axis=_norm(st.ulysses_axes), ulysses_size=nu)
    cfg_r = dataclasses.replace(cfg, implementation="ring", ring=spec,
                                seq_q=Sq // st.num_shards, seq_kv=Skv // st.num_shards)
    mod = None if mod is None else mod._replace(classes=None)
    res = _flat(sig, _call_backend("ring", sig.kind, cfg_r, base, extra, mod, {}))
  else:
    res = _ulysses(cfg, sig, plan, base, extra, mod)
  return _reduce(cfg, sig, plan, res, base)


def _reduce(cfg, sig, plan: _Plan, res, base):
  """Gradients of operands replicated over a split dim summed over its axes (dconsts over
  every split axis but those of a sequence-aligned dim; dbias over the axes of its
  broadcast dims)."""
  if sig.kind != "backward":
    return res
  axes = plan.all_axes
  n_fixed = 4 if "dbias" in sig.results else 3
  res = list(res)
  for n in range(n_fixed, len(res)):
    own = {a for t in sig.result_tags[n] if t for a in _axes_tuple(plan.axis(t))}
    over = tuple(a for a in axes if a not in own)
    if over:
      res[n] = lax.psum(res[n], over)
  if "dbias" in sig.results:
    bias = base[3]
    bax = tuple(a for i, t in enumerate(("b", "h", "q")) if bias.shape[i] == 1
                for a in _axes_tuple(plan.axis(t)))
    if bax:
      res[3] = lax.psum(res[3], bax)
  return res


def _ulysses(cfg, sig, plan: _Plan, base, extra, mod):
  """All-to-all the sequence for heads, run the one-device backend on the whole sequence
  for H / P heads (global offsets), all-to-all back (`flashvjp.ring._ulysses`)."""
  st, sax = plan.strategy, plan.sax
  n = st.num_shards
  B_l, H_l, Sq, Skv = plan.local
  U = _ulysses_moves.Ulysses(cfg, sax, n)
  offsets = _bh_offsets(plan, B_l, H_l, h_extra=U.head_index() * (H_l // n))
  base, extra, mod = U.inputs(sig.kind, base, extra, mod)
  if mod is not None:
    classes = mod.classes
    if classes is not None and classes.shape[1] != 1:
      classes = lax.dynamic_slice_in_dim(classes, U.head_index() * (classes.shape[1] // n),
                                         classes.shape[1] // n, axis=1)
    mod = _with_classes(cfg, mod._replace(classes=classes), B_l, H_l // n, Sq, Skv, offsets)
  kw = {"offsets": offsets} if uses_offsets(cfg) else {}
  res = _flat(sig, _call_backend(sig.backend, sig.kind, cfg, base, extra, mod, kw))
  return U.outputs(sig.kind, res, "dbias" in sig.results)


# ---- the custom_partitioning ops --------------------------------------------------------

def _rule(sig: _Sig):
  """The Shardy sharding rule: batch, heads and the sequence may be split; the rest whole."""
  count = iter(range(1 << 30))
  fs = lambda tags: " ".join(t if t else f"u{next(count)}" for t in tags)
  rule = ", ".join(fs(t) for t in sig.tags) + " -> " + ", ".join(fs(t) for t in sig.result_tags)
  # Shardy wants special factors in the order in which the factors first appear.
  order: dict = {}
  for tok in rule.replace(",", " ").replace("->", " ").split():
    order.setdefault(tok, len(order))
  replicate = tuple(f for f in order if f not in ("b", "h", "k", "q", "s"))
  return rule, dict(need_replication_factors=replicate)


def _plan_from_shapes(cfg, sig: _Sig, mesh, arg_shapes) -> _Plan:
  shapes = dict(zip(sig.names, arg_shapes))
  q = shapes["q"]
  pair = {n: (tuple(shapes[n].shape), shapes[n].dtype) for n in ("bias", "mask") if n in shapes}
  return _plan(cfg, mesh, getattr(q.sharding, "spec", ()), tuple(q.shape),
               tuple(shapes["k"].shape), tuple(shapes["v"].shape),
               jnp.dtype(q.dtype).itemsize, pair, "q_seg" in shapes)


def _make_op(kind: str):
  op = custom_partitioning(lambda cfg, sig, *arrays: _run_whole(cfg, sig, arrays),
                           static_argnums=(0, 1))

  def partition(cfg, sig, mesh, arg_shapes, result_shape):
    plan = _plan_from_shapes(cfg, sig, mesh, arg_shapes)
    if plan.strategy is not None:
      logging.debug("flashvjp %s: sequence sharded, %s", kind, plan.strategy)
    _record.add(_record.Event("partition", kind, plan.strategy, (plan.bax, plan.hax, plan.sax)))
    named = lambda tags: NamedSharding(mesh, PartitionSpec(*[plan.axis(t) for t in tags]))
    results = jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(result_shape),
                                           [named(t) for t in sig.result_tags])

    def lower_fn(*arrays):
      return _run_partition(cfg, sig, plan, arrays)

    return mesh, lower_fn, results, tuple(named(t) for t in sig.tags)

  op.def_partition(partition=partition,
                   sharding_rule=lambda cfg, sig, mesh, vt, rt: _rule(sig))
  return op


def align_mods(name: str, cfg, dtype, seq_q: int, seq_kv: int, consts, mod):
  """(cfg, consts, mod) with the mods' position-aligned arrays marked (`flashvjp._aligned`:
  split like the sequence, read as local slices) for the families that read them so
  (`_ALIGNS`); unchanged otherwise."""
  consts = tuple(consts)
  if name not in _ALIGNS or (cfg.score_mod is None and cfg.mask_mod is None):
    return cfg, consts, mod
  from flashvjp.pallas import _common  # the families' hoisting of hidden arrays
  acc = jnp.promote_types(dtype, jnp.float32)
  if cfg.score_mod is not None and not isinstance(cfg.score_mod, _aligned.Aligned):
    fn, cs = _common.hoist_constants(cfg.score_mod, consts, acc)
    found = _aligned.align(fn, cs, acc, seq_q, seq_kv, cfg.num_diff_consts)
    if found is not None:
      cfg, consts = dataclasses.replace(cfg, score_mod=found[0]), found[1]
  if mod is not None and cfg.mask_mod is not None and \
      not isinstance(cfg.mask_mod, _aligned.Aligned):
    sf, cs = _common.hoist_constants(_common._mask_mod_as_score_mod(cfg.mask_mod),
                                     tuple(mod.consts), jnp.float32)
    mf = lambda b, h, qi, ki, *c: sf(jnp.zeros((), jnp.float32), b, h, qi, ki, *c)
    found = _aligned.align(mf, cs, jnp.float32, seq_q, seq_kv, 0, mask=True)
    if found is not None:
      cfg, mod = dataclasses.replace(cfg, mask_mod=found[0]), mod._replace(consts=found[1])
  return cfg, consts, mod


def split_arrays(name: str, cfg, dtype, seq_q: int, seq_kv: int, consts, mod_consts) -> dict:
  """{(mod, index): "q" | "kv" | "q and kv"}: the arrays a sequence-sharded call of family
  `name` splits like the sequence (`align_mods`; for `flashvjp.explain`)."""
  mod = (_mask_mod.ModInputs(None, tuple(mod_consts))  # type: ignore[arg-type]  # no classes
         if cfg.mask_mod is not None else None)
  new, _, _ = align_mods(name, cfg, dtype, seq_q, seq_kv, consts, mod)
  out: dict = {}
  for fn, key in ((new.score_mod, "score_mod"), (new.mask_mod, "mask_mod")):
    if not isinstance(fn, _aligned.Aligned):
      continue
    for i, ax in enumerate(fn.axes):
      if ax is not None:
        k = (key, fn.source[i])
        out[k] = ax[1] if k not in out else "q and kv"
  return out


class _Wrapped:
  """A backend whose forward, backward and tangent carry the partitioning rule."""

  def __init__(self, name: str, backend, tangent):
    _BACKENDS[name] = (backend, tangent)
    self.name = name
    self._ops = {k: _make_op(k) for k in ("forward", "backward", "tangent")}

  def _go(self, kind, cfg, items, results, n_consts, mod):
    sig = _sig(kind, self.name, items, results, n_consts, mod)
    arrays = [i[1] for i in items]
    if _has_ordered_effects(self.name, cfg):
      return _run_whole(cfg, sig, arrays)
    op = self._ops[kind]

    def call(*a):
      with _mask.no_static_constants():  # the op's global body may close over no constants
        return op(cfg, sig, *a)

    fn = custom_vmap(call)

    @fn.def_vmap
    def _vmap_rule(axis_size, in_batched, *a):
      """Vmapped as the plain backend: custom_partitioning has no batching rule, and a
      vmapped call is not a sharded one."""
      del axis_size
      out = jax.vmap(lambda *x: _run_whole(cfg, sig, x),
                     in_axes=[0 if b else None for b in in_batched])(*a)
      return out, jax.tree_util.tree_map(lambda _: True, out)

    return fn(*arrays)

  def forward(self, cfg, q, k, v, bias, mask, q_seg, kv_seg, seed, consts, mod=None):
    cfg, consts, mod = align_mods(self.name, cfg, q.dtype, q.shape[2], k.shape[2], consts, mod)
    items = _operands(cfg, q, k, v, bias, mask, q_seg, kv_seg, seed, consts, mod, ())
    results = [("out", _O), ("lse", _L)] + ([("row_max", _L)] if cfg.max_logits else [])
    return tuple(self._go("forward", cfg, items, results, len(consts), mod))

  def backward(self, cfg, q, k, v, bias, mask, q_seg, kv_seg, seed, consts, out, lse, dout,
               dlse, mod=None):
    cfg, consts, mod = align_mods(self.name, cfg, q.dtype, q.shape[2], k.shape[2], consts, mod)
    extra = [("out", out, _O), ("lse", lse, _L), ("dout", dout, _O), ("dlse", dlse, _L)]
    items = _operands(cfg, q, k, v, bias, mask, q_seg, kv_seg, seed, consts, mod, extra)
    results: list[tuple[str, tuple]] = [("dq", _Q), ("dk", _K), ("dv", _V)]
    if bias is not None:
      results.append(("dbias", _pair_tags(bias.shape)))
    tags = _const_tags(cfg.score_mod, consts)
    results += [(f"dc{i}", tags[i]) for i in range(cfg.num_diff_consts)]
    res = list(self._go("backward", cfg, items, results, len(consts), mod))
    dq, dk, dv = res[:3]
    dbias = res[3] if bias is not None else None
    return dq, dk, dv, dbias, tuple(res[4 if bias is not None else 3:])

  def tangent(self, cfg, q, k, v, bias, mask, q_seg, kv_seg, seed, consts, out, lse, tq, tk,
              tv, tbias, tconsts, mod=None):
    cfg, consts, mod = align_mods(self.name, cfg, q.dtype, q.shape[2], k.shape[2], consts, mod)
    extra: list[tuple[str, Any, tuple]] = [("out", out, _O), ("lse", lse, _L), ("tq", tq, _Q),
                                           ("tk", tk, _K), ("tv", tv, _V)]
    if bias is not None:
      extra.append(("tbias", tbias, _pair_tags(bias.shape)))
    tags = _const_tags(cfg.score_mod, consts)
    extra += [(f"tc{i}", t, tags[i]) for i, t in enumerate(tconsts) if t is not None]
    items = _operands(cfg, q, k, v, bias, mask, q_seg, kv_seg, seed, consts, mod, extra)
    t_out, t_lse = self._go("tangent", cfg, items, [("t_out", _O), ("t_lse", _L)], len(consts),
                            mod)
    return t_out, t_lse


_WRAPPED: dict = {}


def wrap(name: str, backend, tangent) -> _Wrapped:
  """The partitioned version of a backend (cached per backend name)."""
  if name not in _WRAPPED:
    _WRAPPED[name] = _Wrapped(name, backend, tangent)
  return _WRAPPED[name]
