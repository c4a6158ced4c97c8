"""Ulysses around an inner call: all-to-all the sequence for heads, run, all-to-all back.

Room: ring / Ulysses. One place for the moves of the Ulysses strategy, shared by the
partitioning rule's `"ulysses"` (`flashvjp._partition`: the one-device backend inside) and
the hierarchical `"usp"` (Ulysses over the inner mesh axes, the ring over the outer ones:
`flashvjp.ring._backend` when `RingSpec.ulysses_axis` is set, under plain jit and in
`ring_attention`). Nothing of the mask model lives here: the inner call gets the arrays of
its heads over a longer sequence, and global offsets from its caller.

Given P devices on `axes` (sequence chunk d on device d, contiguous), device i leaves with
heads [i H / P, (i + 1) H / P) of the P chunks' concatenation: every array with a query or
key row moves (q, k, v, a bias / mask with full heads and rows, dO, lse, tangents),
segment ids and the mods' position-aligned arrays are all-gathered (they are small),
arrays shared by the heads stay. The backward folds rowsum(dO * O) into the lse cotangent
before the move and the tangent pass applies its O term after it (`flashvjp._delta`): O
never moves to the heads layout.
"""
from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from flashvjp import _aligned
from flashvjp import _delta


class Ulysses:
  """The moves of one Ulysses call over mesh `axes` (P devices): `inputs` before the inner
  call, `outputs` after it (results as a flat list: backward's is [dq, dk, dv, (dbias),
  *dconsts])."""

  def __init__(self, cfg, axes, num_shards: int):
    self.cfg, self.axes, self.n = cfg, axes, num_shards

  def to_heads(self, x):
    return None if x is None else lax.all_to_all(x, self.axes, split_axis=1, concat_axis=2,
                                                 tiled=True)

  def to_seq(self, x):
    return None if x is None else lax.all_to_all(x, self.axes, split_axis=2, concat_axis=1,
                                                 tiled=True)

  def _whole(self, x):
    return None if x is None else lax.all_gather(x, self.axes, axis=1, tiled=True)

  def _pair(self, x):
    """A [B, H, Sq, Skv]-like pair array: its heads split, its rows whole (full in both
    heads and rows, or broadcast over both: `flashvjp._strategy`)."""
    return x if x is None or x.shape[1] == 1 else self.to_heads(x)

  def _gather_all(self, xs, axes):
    return tuple(x if x is None or ax is None
                 else lax.all_gather(x, self.axes, axis=ax[0], tiled=True)
                 for x, ax in zip(xs, axes))

  def head_index(self):
    """This device's first head among the local heads, in units of H / P."""
    return lax.axis_index(self.axes)

  def inputs(self, kind: str, base, extra, mod):
    """(base, extra, mod) in the heads layout (`kind`: forward / backward / tangent)."""
    cfg = self.cfg
    q, k, v, bias, mask, q_seg, kv_seg, seed, consts = base
    self.c_axes = _aligned.axes_of(cfg.score_mod, len(consts))
    self.split_bias = bias is not None and bias.shape[1] != 1  # (H / P may be 1: ask it)
    self.out = None
    new = (self.to_heads(q), self.to_heads(k), self.to_heads(v), self._pair(bias),
           self._pair(mask), self._whole(q_seg), self._whole(kv_seg), seed,
           self._gather_all(consts, self.c_axes))
    if kind == "backward":
      # rowsum(dO * O) is a per-row term: computed here, where the rows are local, and
      # folded into the lse cotangent, so O never moves to the heads layout (`_delta`): one
      # all-to-all of a [B, H, S, Dv] array fewer (8 x H100, 16/8 heads, S=64k: 257 -> 225.5
      # MiB per device; temp unchanged, O's heads copy was not at the backward's peak).
      out, lse, dout, dlse = extra
      acc = jnp.promote_types(q.dtype, jnp.float32)
      extra = (None, self.to_heads(lse), self.to_heads(dout),
               self.to_heads(_delta.fold(out, dout, dlse, acc)))
    elif kind == "tangent":
      # t_out = a - t_lse * O: the pass returns a (out=None) and the O term is applied back
      # in the sequence layout, where O's rows are local (`_delta.tangent_out`)
      out, lse, tq, tk, tv, tbias, tconsts = extra
      self.out = out
      extra = (None, self.to_heads(lse), self.to_heads(tq), self.to_heads(tk),
               self.to_heads(tv), self._pair(tbias), self._gather_all(tconsts, self.c_axes))
    if mod is not None:
      mod = mod._replace(consts=self._gather_all(
          mod.consts, _aligned.axes_of(cfg.mask_mod, len(mod.consts))))
    return new, extra, mod

  def outputs(self, kind: str, res, has_dbias: bool) -> list:
    """The inner call's flat results back in the sequence layout."""
    if kind == "tangent":
      a, t_lse = (self.to_seq(x) for x in res)
      return [_delta.tangent_out(a, t_lse, self.out), t_lse]
    if kind != "backward":
      return [self.to_seq(x) for x in res]
    out = [self.to_seq(x) for x in res[:3]]
    if has_dbias:  # back like the bias came (broadcast: summed by the caller)
      out.append(self.to_seq(res[3]) if self.split_bias else res[3])
    # a gathered array's gradient: summed over the heads' devices, each keeps its own part
    scatter = lambda g, ax: g if ax is None else lax.psum_scatter(
        g, self.axes, scatter_dimension=ax[0], tiled=True)
    return out + [scatter(g, ax) for g, ax in zip(res[len(out):], self.c_axes)]
