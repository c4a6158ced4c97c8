"""Batch / head / sequence sharding of attention over a mesh, with one shard_map.

Room: distributed / sharding. Batch and head sharding need no communication at all:
every device runs `flash_attention` on its own slice (as `flash_attention` under jit with
batch/head-sharded inputs also does, through the backends' partitioning rule in
_partition.py). Sequence sharding runs `ring_attention` over the sequence axis.
"""
from __future__ import annotations

import functools
from collections.abc import Hashable

import jax
import numpy as np
from jax.sharding import Mesh
from jax.sharding import PartitionSpec

from flashvjp import _api
from flashvjp.distributed import _compat
from flashvjp.distributed import _ring

# flash_attention arguments whose meaning does not depend on where a slice sits.
_LOCAL_KWARGS = ("causal", "window", "scale", "bias", "mask", "implementation", "block_q",
                 "block_kv", "interpret")
# With seq_axis: every flash_attention argument (the ring is the same op), and the layout.
_RING_KWARGS = ("causal", "window", "scale", "bias", "mask", "layout", "implementation",
                "block_q", "block_kv", "interpret", "score_mod", "dropout_rate", "dropout_rng",
                "deterministic", "dropout_broadcast", "mask_mod", "sinks", "ring_head_groups")


def _axis_size(mesh: Mesh, name, arg):
  if name is None:
    return 1
  names = name if isinstance(name, tuple) else (name,)
  size = 1
  for n in names:
    if n not in mesh.shape:
      raise ValueError(f"{arg} {n!r} is not an axis of the mesh (axes {tuple(mesh.shape)})")
    size *= mesh.shape[n]
  return size


def sharded_attention(query, key, value, *, mesh: Mesh, batch_axis: Hashable | None = None,
                      head_axis: Hashable | None = None, seq_axis: Hashable | None = None,
                      segment_ids=None, return_lse: bool = False,
                      return_max_logits: bool = False, **kwargs):
  """Attention on global arrays, sharded over `mesh` by batch, heads and/or sequence.

  Without `seq_axis` every device computes `flash_attention` on its own batch/head
  slice (no collective in the program). With `seq_axis` the sequence is split over
  that axis and `ring_attention` passes K/V chunks around the ring (collective-permute
  only). Works inside or outside jit; the inputs are resharded to the layout below if
  they are not already in it.

  Layout: query/key/value [batch, heads, seq, dim] sharded as
  P(batch_axis, head_axis, seq_axis, None); segment_ids [batch, seq] as
  P(batch_axis, seq_axis); out likewise, lse as P(batch_axis, head_axis, seq_axis).

  Args:
    query: [batch, num_heads, seq_q, head_dim] (global).
    key: [batch, num_kv_heads, seq_kv, head_dim]; with `head_axis`, num_kv_heads must be
      divisible by its size (each device keeps whole GQA groups).
    value: [batch, num_kv_heads, seq_kv, head_dim_v].
    mesh: a jax.sharding.Mesh.
    batch_axis, head_axis, seq_axis: mesh axis names (or tuples of names), or None.
    segment_ids: as in `flash_attention`; with `seq_axis` and layout="zigzag" it must be
      zigzag-permuted like the sequence.
    return_lse: also return lse [batch, num_heads, seq_q].
    return_max_logits: also return max_logits [batch, num_heads] (`flash_attention`'s: the
      max over the whole sequence), sharded as P(batch_axis, head_axis).
    **kwargs: without seq_axis: causal, window, scale, bias, mask, implementation, block_q,
      block_kv, interpret. With seq_axis: every argument of `flash_attention` (window,
      mask, score_mod, mask_mod, sinks, dropout, a traced scale, ring_head_groups: see
      `ring_attention`) and layout ("contiguous" or "zigzag"; the arrays, bias and mask included, must
      already be in that order, see `to_zigzag`). bias and mask are broadcastable to
      [batch, num_heads, seq_q, seq_kv] and sharded like the queries.

  Returns:
    out [batch, num_heads, seq_q, head_dim_v] (global, sharded as above); (out, lse),
    (out, max_logits) or (out, lse, max_logits) as `flash_attention`.
  """
  if not isinstance(mesh, Mesh):
    raise TypeError(f"mesh must be a jax.sharding.Mesh, got {type(mesh).__name__}")
  allowed = _RING_KWARGS if seq_axis is not None else _LOCAL_KWARGS
  unknown = sorted(set(kwargs) - set(allowed))
  if unknown:
    raise TypeError(
        f"sharded_attention got arguments {unknown} it cannot shard"
        f" ({'with' if seq_axis is not None else 'without'} seq_axis it accepts {list(allowed)});"
        " score_mod and dropout see global (b, h) indices: call flash_attention under jit"
        " with sharded inputs (it partitions over batch, heads and the sequence, with global"
        " offsets) or shard_map yourself")
  used = [a for a in (batch_axis, head_axis, seq_axis) if a is not None]
  flat = [n for a in used for n in (a if isinstance(a, tuple) else (a,))]
  if len(set(flat)) != len(flat):
    raise ValueError(f"batch_axis, head_axis and seq_axis must be distinct mesh axes, got {used}")
  # Validate shapes on the global arrays first (errors name the argument, as flash_attention).
  _api._check_qkv(query, key, value)
  B, H, Sq, _ = query.shape
  Hkv, Skv = key.shape[1], key.shape[2]
  for arg, name, dims in (("batch_axis", batch_axis, (("batch", B),)),
                          ("head_axis", head_axis, (("num_heads", H), ("num_kv_heads", Hkv))),
                          ("seq_axis", seq_axis, (("seq_q", Sq), ("seq_kv", Skv)))):
    n = _axis_size(mesh, name, arg)
    for what, size in dims:
      if size % n:
        raise ValueError(f"{what} ({size}) must be divisible by the size of {arg} {name!r} ({n})")

  qkv_spec = PartitionSpec(batch_axis, head_axis, seq_axis, None)
  lse_spec = PartitionSpec(batch_axis, head_axis, seq_axis)
  seg_spec = PartitionSpec(batch_axis, seq_axis)
  pair = isinstance(segment_ids, (tuple, list))
  seg_specs: PartitionSpec | tuple[PartitionSpec, PartitionSpec] | None
  if segment_ids is None:
    seg_in, seg_specs = None, None
  elif pair:
    seg_in, seg_specs = tuple(segment_ids), (seg_spec, seg_spec)
  else:
    seg_in, seg_specs = segment_ids, seg_spec

  # bias / mask [batch, heads, seq_q, seq_kv] (dims 1 or full): rows follow the queries,
  # the kv dim stays whole (the ring reads the columns of the chunk in hand).
  pairs = {}
  for name in ("bias", "mask"):
    if kwargs.get(name) is not None:
      x = _api._pair_rank4(name, kwargs.pop(name), (B, H, Sq, Skv), want_bool=name == "mask")
      axes = (batch_axis, head_axis, seq_axis, None)
      pairs[name] = (x, PartitionSpec(*[a if n != 1 else None for a, n in zip(axes, x.shape)]))
    else:
      kwargs.pop(name, None)
  names = tuple(pairs)

  want_max = _api._check_flag("return_max_logits", return_max_logits)
  # Array arguments (sinks, a dropout key, a traced scale) are arguments of the jitted
  # shard_map, replicated; the rest key a cache of it (`_program`), so that calls outside
  # jit with the same static arguments reuse one trace and one compile.
  dyn = tuple(k for k, x in kwargs.items() if isinstance(x, (jax.Array, np.ndarray)))
  static = tuple(sorted((k, x) for k, x in kwargs.items() if k not in dyn))

  in_specs = (qkv_spec, qkv_spec, qkv_spec, seg_specs) + tuple(pairs[n][1] for n in names)
  # The Pallas kernels do not yet declare how their outputs vary over manual mesh axes,
  # which shard_map's check_vma requires; without the check, shard_map's own transpose sums
  # the cotangents of replicated inputs (tests/test_distributed.py checks the gradients).
  nb, nh, ns = (_axis_size(mesh, a, "") for a in (batch_axis, head_axis, seq_axis))
  # placed on the mesh (replicated), so that the decision is made for the mesh's devices
  # (flashvjp._target), as the call inside shard_map will be
  on_mesh = jax.sharding.NamedSharding(mesh, PartitionSpec())
  local_shape = lambda x, n_heads: jax.ShapeDtypeStruct(
      (x.shape[0] // nb, x.shape[1] // n_heads, x.shape[2] // ns, x.shape[3]), x.dtype,
      sharding=on_mesh)
  decision = _api.explain(local_shape(query, nh), local_shape(key, nh), local_shape(value, nh),
                          implementation=kwargs.get("implementation"),
                          interpret=kwargs.get("interpret"))
  out_specs = (qkv_spec, lse_spec) + ((PartitionSpec(batch_axis, head_axis),) if want_max
                                      else ())
  # Under jit: called eagerly, shard_map would run the ring op by op on every device (20 s
  # for a [2, 4, 512, 32] causal call on 8 CPU devices); under an outer jit this inner one is
  # inlined. Cached per configuration: a second eager call with the same static arguments
  # traces and compiles nothing (tests/test_distributed.py).
  key_ = (mesh, batch_axis, head_axis, seq_axis, in_specs, out_specs, names, dyn, static,
          want_max, not decision.is_pallas)
  try:
    fn = _program(*key_)
  except TypeError:  # an unhashable static argument (a list): this call's own program
    fn = _program.__wrapped__(*key_)
  out, lse, *max_logits = fn(query, key, value, seg_in, *(pairs[n][0] for n in names),
                             *(kwargs[k] for k in dyn))
  extra = ((lse,) if return_lse else ()) + tuple(max_logits)
  return (out, *extra) if extra else out


@functools.lru_cache(maxsize=64)
def _program(mesh, batch_axis, head_axis, seq_axis, in_specs, out_specs, names, dyn, static,
             want_max, check_vma):
  """The jitted shard_map of one `sharded_attention` configuration: args (q, k, v, segment
  ids, the pair arrays `names`, the array arguments `dyn`); `static` the other arguments."""

  def local(q, k, v, seg, *arrays):
    kw = dict(static, **dict(zip(names + dyn, arrays)), return_max_logits=want_max)
    if seq_axis is None:
      return _api.flash_attention(q, k, v, segment_ids=seg, return_lse=True, **kw)
    return _ring.ring_attention(q, k, v, axis_name=seq_axis, segment_ids=seg, return_lse=True,
                                batch_axis=batch_axis, head_axis=head_axis, **kw)

  specs = in_specs + (PartitionSpec(),) * len(dyn)
  return jax.jit(_compat.shard_map(local, mesh=mesh, in_specs=specs, out_specs=out_specs,
                                   check_vma=check_vma))

