"""Batch/head partitioning of a backend's forward and backward under jit (custom_partitioning).

Room: partitioning (below _vjp; distributed/ holds the user-facing ring and mesh helpers). XLA cannot partition a `pallas_call`: given inputs
sharded over batch or heads it would all-gather them and run the whole kernel on every
device. Wrapping the backend's `forward` / `backward` in `jax.custom_partitioning` with a
Shardy sharding rule tells the partitioner that batch and heads are independent (each
device runs the kernel on its own slice, no collective) while the sequence and feature
dims must be whole on a device. Heads stay sharded when the head axes divide both
num_heads and num_kv_heads (whole GQA groups per device); otherwise they are gathered. The same wrapper makes the blockwise
path's block-skip table per device (under plain SPMD it is reduced over the batch, an
all-reduce).

`wrap(backend)` returns an object with the backend interface::

    forward(cfg, q, k, v, bias, mask, q_seg, kv_seg, seed, consts) -> (out, lse)
    backward(cfg, q, k, v, bias, mask, q_seg, kv_seg, seed, consts, out, lse, dout, dlse)
        -> (dq, dk, dv, dbias, dconsts)

A score_mod or dropout sees global (b, h) indices: calls with either are left to XLA's own
partitioning (correct for the blockwise path, whose indices are iotas of the global
program; a pallas_call is gathered). Under vmap the plain backend is vmapped
(custom_partitioning has no batching rule). Outside jit, on one device, or inside a fully
manual shard_map, the wrapped function simply runs the backend.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import jax
from jax.custom_batching import custom_vmap
from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec


@dataclasses.dataclass(frozen=True)
class _Signature:
  """Which optional operands are present, and the shapes that shape the sharding rule."""

  backend: Any  # the backend module (hashable)
  groups: int  # num_heads // num_kv_heads
  bias_shape: Any  # None or rank-4 tuple (dims 1 or full)
  mask_shape: Any
  has_seg: bool
  has_seed: bool
  const_ranks: tuple[int, ...]
  num_diff_consts: int
  has_dlse: bool = False


def _pair_factors(shape, tag):
  """Factors of a rank-4 bias/mask: full dims share the attention factors, size-1 dims get their own."""
  full = ("b", "h", "q", "s")
  return " ".join(f if n != 1 else f"{tag}{i}" for i, (f, n) in enumerate(zip(full, shape)))


def _operand_factors(sig: _Signature):
  ops = ["b h q d", "b k s d", "b k s e"]
  if sig.bias_shape is not None:
    ops.append(_pair_factors(sig.bias_shape, "x"))
  if sig.mask_shape is not None:
    ops.append(_pair_factors(sig.mask_shape, "y"))
  if sig.has_seg:
    ops += ["b q", "b s"]
  extra = []
  if sig.has_seed:
    ops.append("z")
    extra.append("z")
  for n, r in enumerate(sig.const_ranks):
    names = [f"c{n}r{i}" for i in range(r)]
    ops.append(" ".join(names))
    extra += names
  return ops, extra


def _mappings(sig: _Signature, backward: bool):
  """(operand factor strings, result factor strings, factors that must stay whole)."""
  ops, extra = _operand_factors(sig)
  if backward:
    fwd_ops = list(ops)
    ops = ops + ["b h q e", "b h q", "b h q e"] + (["b h q"] if sig.has_dlse else [])
    results = fwd_ops[:3]
    if sig.bias_shape is not None:
      results.append(fwd_ops[3])
    if sig.const_ranks:
      results += fwd_ops[len(fwd_ops) - len(sig.const_ranks):][: sig.num_diff_consts]
  else:
    results = ["b h q e", "b h q"]
  return ops, results, ["q", "s", "d", "e"] + extra


def _rule(sig: _Signature, backward: bool):
  """The Shardy sharding rule: batch and heads are independent, the rest stays whole."""
  ops, results, replicate = _mappings(sig, backward)
  rule = ", ".join(ops) + " -> " + ", ".join(results)
  # Shardy wants special factors in the order in which the factors first appear.
  order: dict = {}
  for tok in rule.replace("(", " ").replace(")", " ").replace(",", " ").split():
    order.setdefault(tok, len(order))
  replicate = sorted(set(f for f in replicate if f in order), key=order.__getitem__)
  return rule, dict(need_replication_factors=tuple(replicate))


def _dims(factors: str):
  return factors.split()


def _axes_size(mesh, axes):
  if axes is None:
    return 1
  n = 1
  for a in (axes if isinstance(axes, tuple) else (axes,)):
    n *= mesh.shape[a]
  return n


def _shardings(sig: _Signature, backward: bool, mesh, q_sharding, q_shape):
  """Operand and result NamedShardings: q's batch and head axes, everything else whole.

  Heads stay sharded only when the head axes divide num_kv_heads too (each device then
  holds whole GQA groups); otherwise they are replicated.
  """
  spec = tuple(getattr(q_sharding, "spec", ())) + (None,) * 4
  bax, hax = spec[0], spec[1]
  if q_shape[0] % _axes_size(mesh, bax):
    bax = None
  n_h = _axes_size(mesh, hax)
  if q_shape[1] % n_h or (q_shape[1] // sig.groups) % n_h:
    hax = None
  pick = lambda d: bax if d == "b" else hax if d in ("h", "k") else None
  named = lambda f: NamedSharding(mesh, PartitionSpec(*[pick(d) for d in _dims(f)]))
  ops, results, _ = _mappings(sig, backward)
  return [named(f) for f in ops], [named(f) for f in results]


def _make_op(backward: bool):
  def run(cfg, sig, *arrays):
    fn = sig.backend.backward if backward else sig.backend.forward
    return fn(cfg, *_unflatten(sig, arrays, backward))

  op = custom_partitioning(run, static_argnums=(0, 1))

  def partition(cfg, sig, mesh, arg_shapes, result_shape):
    arg_shardings, result_shardings = _shardings(
        sig, backward, mesh, arg_shapes[0].sharding, arg_shapes[0].shape)
    result_shardings = jax.tree_util.tree_unflatten(
        jax.tree_util.tree_structure(result_shape), result_shardings)

    def lower_fn(*arrays):
      return run(cfg, sig, *arrays)

    return mesh, lower_fn, result_shardings, tuple(arg_shardings)

  op.def_partition(partition=partition,
                   sharding_rule=lambda cfg, sig, mesh, vt, rt: _rule(sig, backward))
  return op


def _flatten(bias, mask, q_seg, kv_seg, seed, consts):
  out = []
  if bias is not None:
    out.append(bias)
  if mask is not None:
    out.append(mask)
  if q_seg is not None:
    out += [q_seg, kv_seg]
  if seed is not None:
    out.append(seed)
  return out + list(consts)


def _unflatten(sig: _Signature, arrays, backward):
  arrays = list(arrays)
  q, k, v = arrays[:3]
  rest = arrays[3:]
  take = lambda present: rest.pop(0) if present else None
  bias = take(sig.bias_shape is not None)
  mask = take(sig.mask_shape is not None)
  q_seg = take(sig.has_seg)
  kv_seg = take(sig.has_seg)
  seed = take(sig.has_seed)
  consts = tuple(rest.pop(0) for _ in sig.const_ranks)
  args = [q, k, v, bias, mask, q_seg, kv_seg, seed, consts]
  if backward:
    out, lse, dout = rest[:3]
    dlse = rest[3] if sig.has_dlse else None
    args += [out, lse, dout, dlse]
  return args


class _Wrapped:
  """A backend whose forward and backward carry a batch/head partitioning rule."""

  def __init__(self, backend):
    self.backend = backend
    self._fwd = _make_op(backward=False)
    self._bwd = _make_op(backward=True)

  def _sig(self, cfg, q, k, bias, mask, q_seg, seed, consts, has_dlse=False):
    return _Signature(
        backend=self.backend, groups=q.shape[1] // k.shape[1],
        bias_shape=None if bias is None else tuple(bias.shape),
        mask_shape=None if mask is None else tuple(mask.shape), has_seg=q_seg is not None,
        has_seed=seed is not None, const_ranks=tuple(len(c.shape) for c in consts),
        num_diff_consts=cfg.num_diff_consts, has_dlse=has_dlse)

  def _call(self, op, backward, cfg, sig, arrays):
    """op(cfg, sig, *arrays), vmapped (if ever) as the plain backend: custom_partitioning
    has no batching rule, and a vmapped call is not a batch/head-sharded one."""
    fn = custom_vmap(lambda *a: op(cfg, sig, *a))

    @fn.def_vmap
    def _rule(axis_size, in_batched, *a):
      del axis_size
      raw = self.backend.backward if backward else self.backend.forward
      plain = lambda *x: raw(cfg, *_unflatten(sig, x, backward))
      out = jax.vmap(plain, in_axes=[0 if b else None for b in in_batched])(*a)
      return out, jax.tree_util.tree_map(lambda _: True, out)

    return fn(*arrays)

  @staticmethod
  def _global_indices(cfg):
    """score_mod, mask_mod and dropout read global (b, h) indices: leave those calls to
    XLA's own partitioning (correct for the blockwise path; a pallas_call is then gathered)."""
    return cfg.score_mod is not None or cfg.dropout_active

  def forward(self, cfg, q, k, v, bias, mask, q_seg, kv_seg, seed, consts, mod=None):
    if self._global_indices(cfg) or mod is not None:
      return self.backend.forward(cfg, q, k, v, bias, mask, q_seg, kv_seg, seed, consts, mod)
    sig = self._sig(cfg, q, k, bias, mask, q_seg, seed, consts)
    out, lse = self._call(self._fwd, False, cfg, sig,
                          (q, k, v, *_flatten(bias, mask, q_seg, kv_seg, seed, consts)))
    return out, lse

  def backward(self, cfg, q, k, v, bias, mask, q_seg, kv_seg, seed, consts, out, lse, dout, dlse,
               mod=None):
    if self._global_indices(cfg) or mod is not None:
      return self.backend.backward(cfg, q, k, v, bias, mask, q_seg, kv_seg, seed, consts, out,
                                   lse, dout, dlse, mod)
    sig = self._sig(cfg, q, k, bias, mask, q_seg, seed, consts, has_dlse=dlse is not None)
    extra = [out, lse, dout] + ([dlse] if dlse is not None else [])
    res = self._call(self._bwd, True, cfg, sig,
                     (q, k, v, *_flatten(bias, mask, q_seg, kv_seg, seed, consts), *extra))
    res = jax.tree_util.tree_leaves(res)
    dq, dk, dv = res[:3]
    dbias = res[3] if bias is not None else None
    dconsts = tuple(res[4 if bias is not None else 3:])
    return dq, dk, dv, dbias, dconsts


_WRAPPED: dict = {}


def wrap(backend) -> _Wrapped:
  """The batch/head-partitioned version of a backend module (cached per backend)."""
  if backend not in _WRAPPED:
    _WRAPPED[backend] = _Wrapped(backend)
  return _WRAPPED[backend]
