"""Ring attention as a backend: forward, hand-written backward and tangent pass of a call
whose sequence is sharded over a mesh axis (run inside shard_map).

Room: ring / backend. The same three functions as every backend (flashvjp.blockwise,
flashvjp.pallas), so `flashvjp._vjp.attention` differentiates a sharded call exactly as a
one-device call: jax.grad runs `backward`, jax.jvp / jax.linearize run `forward` +
`tangent`, forward-over-reverse runs forward-mode autodiff of `backward` with the
blockwise backend per pair. Per (q piece, kv piece) pair each function calls the per-pair
backend (`RingSpec.inner`) with the pair's own mask (`_schedule.pair_window`) and its
global offsets (score_mod, mask_mod and dropout see global positions); nothing of the
mask model lives here.

Forward: per taken step the K/V chunk in hand moves on by the distance to the next taken
step (`lax.ppermute`; steps no device needs are never taken), each pair's partial
(out, lse) merges through logsumexp. Backward: the one-device backward per pair against
the GLOBAL (out, lse) (p = exp(s - lse) is then the global probability), dQ stays home,
the dK/dV accumulators travel with their chunk and return to its owner after the last
step. Tangent: with the global (out, lse) the fused tangent pass is additive over kv, so
the per-pair tangents (a_p - mu_p out, mu_p) simply sum. Sinks are applied to the ring's
global (out, lse) around it (`flashvjp._vjp.apply_sinks`), once, never per step.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from flashvjp import _aligned
from flashvjp._config import AttentionConfig
from flashvjp.ring import _compat
from flashvjp.ring import _schedule
from flashvjp.ring import _ulysses


def _inner(name: str):
  """The per-pair backend module (called directly: no partitioning wrapper in shard_map)."""
  if name == "blockwise":
    from flashvjp import blockwise
    return blockwise
  if name == "pallas_triton":
    from flashvjp.pallas import triton
    return triton
  if name == "pallas_tpu":
    from flashvjp.pallas import tpu
    return tpu
  if name == "pallas_mosaic_gpu":
    from flashvjp.pallas.mosaic_gpu import backend
    return backend
  raise ValueError(f"the ring has no per-pair backend named {name!r}")


def _inner_tangent(name: str):
  if name == "blockwise":
    from flashvjp.blockwise import _tangent
    return _tangent.tangent
  if name == "pallas_triton":
    from flashvjp.pallas.triton import tangent
    return tangent.tangent
  if name == "pallas_mosaic_gpu":
    from flashvjp.pallas.mosaic_gpu import tangent as mgpu_tangent
    return mgpu_tangent.tangent
  from flashvjp.pallas.tpu import tangent as tpu_tangent
  return tpu_tangent.tangent


def uses_offsets(cfg: AttentionConfig) -> bool:
  """Whether a pair's result depends on its global position beyond the static mask."""
  return cfg.score_mod is not None or cfg.mask_mod is not None or cfg.dropout_active


class _Ctx:
  """Per-device view of one ring call: pieces, slicing, offsets."""

  def __init__(self, cfg: AttentionConfig, q, k, head0=0, heads=None):
    self.q = q
    # (head groups) this call's first head within the device's heads (traced or 0), and the
    # device's number of heads (the global head of dropout and the mods)
    self.head0, self.heads = head0, q.shape[1] if heads is None else heads
    self.cfg = cfg
    self.R = R = cfg.ring
    self.n = R.axis_size
    self.i = lax.axis_index(R.axis_name)
    self.Sq, self.Skv = q.shape[2], k.shape[2]
    self.B, self.H = q.shape[0], q.shape[1]
    self.acc = jnp.promote_types(q.dtype, jnp.float32)
    self.steps = R.steps(cfg.causal, cfg.window, self.Sq, self.Skv)
    self.qp = _schedule.pieces(R.layout, 0, self.n, self.Sq)
    self.kp = _schedule.pieces(R.layout, 0, self.n, self.Skv)
    self.offsets_needed = uses_offsets(cfg)

  def varying(self, xs):
    """Arrays made varying like q before any branch: a device-dependent switch branch must
    hold no collective, and the transpose of an implicit cast to varying (inside a score_mod's
    autodiff) is a psum; their cotangents are summed once, after the last step."""
    if xs is None:
      return None
    return type(xs)(_compat.match_varying(x, self.q) if x is not None else None for x in xs)

  def first_chunk(self, chunk, aligned=()):
    """The chunk (a pytree: K, V, kv segment ids, ...) in hand at the first step, with
    `aligned` (the mods' key-aligned arrays, `_Aligned.travelling`) appended: the chunk is
    then ``(*chunk, aligned)``. With `RingSpec.gather`, every device's chunk is
    all-gathered here once and each step slices its own."""
    self.aligned_axes = tuple(ax for _, ax in aligned)
    chunk = tuple(chunk) + (tuple(x for x, _ in aligned),)
    if self.R.gather and self.steps:
      self.full = self._per_leaf(chunk, lambda x, ax: lax.all_gather(
          x, self.R.axis_name, axis=ax, tiled=True))
      return self.take(0)
    return _shift(chunk, self.R, self.steps[0].shift if self.steps else 0)

  def _per_leaf(self, chunk, f):
    """f(leaf, its sequence axis) over a chunk (K/V: 2, segment ids: 1, the aligned
    arrays: their own)."""
    *main, al = chunk
    main = jax.tree_util.tree_map(lambda x: f(x, _seq_axis(x)), tuple(main))
    return main + (tuple(f(x, ax) for x, ax in zip(al, self.aligned_axes)),)

  def take(self, t):
    """(gather) The chunk of step t, sliced from the gathered sequence."""
    j = (self.i - self.steps[t].shift) % self.n
    return self._per_leaf(self.full, lambda x, ax: lax.dynamic_slice_in_dim(
        x, j * (x.shape[ax] // self.n), x.shape[ax] // self.n, ax))

  def next_chunk(self, chunk, t):
    """The chunk (a pytree) moved on to where step t + 1 needs it (after the last step:
    unchanged, nothing sent). With the optimization barrier after each step's compute,
    at most one transfer is in flight: O(local seq) memory, never every chunk at once."""
    if t + 1 >= len(self.steps):
      return chunk
    if self.R.gather:
      return self.take(t + 1)
    return _shift(chunk, self.R, self.steps[t + 1].shift - self.steps[t].shift)

  def pair_cfg(self, mask, a, b):
    lq, lk = self.qp[a].length, self.kp[b].length
    window = None if mask == ("full",) else mask[1]
    return dataclasses.replace(self.cfg, implementation=self.R.inner, ring=None, seq_q=lq,
                               seq_kv=lk, causal=False, window=window)

  # global starts (traced int32) of q piece a on this device and kv piece b of chunk j
  def _start(self, dev, piece, local_len):
    h = local_len // 2
    if self.R.layout == "contiguous":
      return dev * local_len
    return dev * h if piece == 0 else (2 * self.n - 1 - dev) * h

  def offsets(self, a, b, j):
    if not self.offsets_needed:
      return None
    R = self.R
    b0 = 0 if R.batch_axis is None else lax.axis_index(R.batch_axis) * self.B
    h0 = 0 if R.head_axis is None else lax.axis_index(R.head_axis) * self.heads
    return (b0, h0 + self.head0, self._start(self.i, a, self.Sq), self._start(j, b, self.Skv))

  def q_piece(self, x, a, axis=2):
    """Rows of q piece a (None stays None; a broadcast dim of 1 stays)."""
    if x is None or x.shape[axis] == 1:
      return x
    p = self.qp[a]
    if p.length == x.shape[axis]:
      return x
    return lax.slice_in_dim(x, p.local, p.local + p.length, axis=axis)

  def kv_piece(self, x, b, axis=2):
    if x is None:
      return None
    p = self.kp[b]
    if p.length == x.shape[axis]:
      return x
    return lax.slice_in_dim(x, p.local, p.local + p.length, axis=axis)

  def cols(self, x, b, j):
    """Columns (global kv dim, in the sequence's layout) of kv piece b of chunk j."""
    if x is None or x.shape[3] == 1:
      return x
    p = self.kp[b]
    return lax.dynamic_slice_in_dim(x, j * self.Skv + p.local, p.length, axis=3)

  def pair_block(self, x, a, b, j):
    return self.cols(self.q_piece(x, a), b, j)

  def switch(self, index, branches, fn, ref, *ops):
    """fn(mask, *ops) for this device's branch; outputs marked varying like `ref`."""
    def make(mask):
      def run(*o):
        outs = fn(mask, *o)
        return jax.tree_util.tree_map(lambda x: _compat.match_varying(x, ref), outs)
      return run
    if len(branches) == 1:
      return make(branches[0])(*ops)
    idx = jnp.asarray(np.asarray(index, np.int32))[self.i]
    return lax.switch(idx, [make(m) for m in branches], *ops)


def _varying_mod(C: _Ctx, mod):
  if mod is None:
    return None
  return mod._replace(consts=C.varying(tuple(mod.consts)))


def _kv_aligned(xs, axes) -> tuple:
  """(array, axis) of the key-aligned ones: they travel with the K/V chunk."""
  return tuple((x, ax[0]) for x, ax in zip(xs, axes)
               if x is not None and ax is not None and ax[1] == "kv")


class _Aligned:
  """The mods' arrays read at the query / key position, here as this device's slices
  (`flashvjp._aligned`): the key-aligned ones (of the score_mod's consts, the mask_mod's,
  the consts' tangents) travel with the K/V chunk (`travelling`, for `_Ctx.first_chunk`),
  and `pair` cuts one pair's consts, mod and tangents from the chunk in hand."""

  def __init__(self, C: _Ctx, cfg: AttentionConfig, consts, mod, tconsts=None):
    self.C, self.consts, self.mod, self.tconsts = C, consts, mod, tconsts
    self.c_axes = _aligned.axes_of(cfg.score_mod, len(consts))
    self.m_axes = () if mod is None else _aligned.axes_of(cfg.mask_mod, len(mod.consts))
    groups = (_kv_aligned(consts, self.c_axes),
              _kv_aligned(() if mod is None else mod.consts, self.m_axes),
              _kv_aligned(() if tconsts is None else tconsts, self.c_axes))
    self.travelling = sum(groups, ())
    self._cuts = (len(groups[0]), len(groups[0]) + len(groups[1]))

  def _cut(self, xs, axes, travelling, a, b):
    """Query-aligned arrays cut to q piece a, key-aligned ones taken from the chunk in
    hand (`travelling`, in order) cut to kv piece b, the rest whole."""
    it = iter(travelling)
    out = []
    for x, ax in zip(xs, axes):
      if ax is None or x is None:
        out.append(x)
      elif ax[1] == "q":
        out.append(self.C.q_piece(x, a, ax[0]))
      else:
        out.append(self.C.kv_piece(next(it), b, ax[0]))
    return tuple(out)

  def pair(self, al, a, b):
    """(consts, mod, tangents of the consts) of pair (a, b); `al`: the chunk's arrays."""
    n1, n2 = self._cuts
    consts = self._cut(self.consts, self.c_axes, al[:n1], a, b)
    mod = self.mod
    if mod is not None and any(ax is not None for ax in self.m_axes):
      mod = mod._replace(consts=self._cut(mod.consts, self.m_axes, al[n1:n2], a, b))
    tconsts = (None if self.tconsts is None
               else self._cut(self.tconsts, self.c_axes, al[n2:], a, b))
    return consts, mod, tconsts


def _seq_axis(x) -> int:
  return 2 if x.ndim == 4 else 1  # K/V [B, Hk, S, D]; segment ids [B, S]


def _shift(tree, R, by: int):
  """Every leaf from device d to device d + by on the ring (None leaves stay None)."""
  n = R.axis_size
  by %= n
  if by == 0:
    return tree
  perm = [(d, (d + by) % n) for d in range(n)]
  return jax.tree_util.tree_map(lambda x: lax.ppermute(x, R.axis_name, perm), tree)


def _merge(o, lse, o_c, lse_c):
  """Combine two partial softmax results over disjoint kv sets through their lse."""
  new = jnp.logaddexp(lse, lse_c)
  safe = jnp.where(new == -jnp.inf, 0.0, new)
  w, w_c = jnp.exp(lse - safe), jnp.exp(lse_c - safe)
  return o * w[..., None] + o_c.astype(o.dtype) * w_c[..., None], new


def _zeros(x, dtype, ref):
  return None if x is None else _compat.match_varying(jnp.zeros(x.shape, dtype), ref)


def _add_rows(x, piece, d, axis=2):
  """x with d added at the rows of `piece` (the whole of x when it has one piece)."""
  if d.shape[axis] == x.shape[axis]:
    return x + d.astype(x.dtype)
  cur = lax.slice_in_dim(x, piece.local, piece.local + piece.length, axis=axis)
  return lax.dynamic_update_slice_in_dim(x, cur + d.astype(x.dtype), piece.local, axis=axis)


# ---- forward ------------------------------------------------------------------------

def _forward(cfg: AttentionConfig, q, k, v, bias, mask, q_seg, kv_seg, seed, consts, mod=None,
             head0=0, heads=None):
  """`forward` of one ring (every head of q, k, v: one head group's, `head0` its first)."""
  C = _Ctx(cfg, q, k, head0, heads)
  inner = _inner(C.R.inner)
  acc = C.acc
  consts, mod = C.varying(tuple(consts)), _varying_mod(C, mod)
  A = _Aligned(C, cfg, consts, mod)
  outs = [_compat.match_varying(jnp.zeros(q.shape[:2] + (p.length, v.shape[3]), acc), q)
          for p in C.qp]
  lses = [_compat.match_varying(jnp.full(q.shape[:2] + (p.length,), -jnp.inf, acc), q)
          for p in C.qp]
  # cfg.max_logits: each row's max logit, the max over the pairs (a skipped pair: -inf)
  maxes = list(lses) if cfg.max_logits else None
  chunk = C.first_chunk((k, v, kv_seg), A.travelling)
  for t, st in enumerate(C.steps):
    nxt = C.next_chunk(chunk, t)  # issued before this step's compute: they overlap
    kc, vc, ksc, al = chunk
    j = (C.i - st.shift) % C.n
    for a, b, branches, index in st.pairs:
      cs_ab, mod_ab, _ = A.pair(al, a, b)

      # The pair's result is merged into the running (out, lse) inside the branch (a
      # skipped pair passes them through): the kernel's out (input dtype) never becomes a
      # float32 copy of its own as the switch's result.
      def fn(m, qa, kb, vb, bias_ab, mask_ab, qs, ks, o_run, lse_run, max_run, a=a, b=b, j=j,
             cs_ab=cs_ab, mod_ab=mod_ab):
        if m == ("skip",):
          return o_run, lse_run, max_run
        kw = {} if not C.offsets_needed else {"offsets": C.offsets(a, b, j)}
        res = inner.forward(C.pair_cfg(m, a, b), qa, kb, vb, bias_ab, mask_ab, qs, ks, seed,
                            cs_ab, mod_ab, **kw)
        o_new, lse_new = _merge(o_run, lse_run, res[0], res[1].astype(acc))
        return (o_new, lse_new,
                None if max_run is None else jnp.maximum(max_run, res[2].astype(acc)))
      outs[a], lses[a], mx = C.switch(
          index, branches, fn, q, C.q_piece(q, a), C.kv_piece(kc, b), C.kv_piece(vc, b),
          C.pair_block(bias, a, b, j), C.pair_block(mask, a, b, j), C.q_piece(q_seg, a, 1),
          C.kv_piece(ksc, b, 1), outs[a], lses[a], None if maxes is None else maxes[a])
      if maxes is not None:
        maxes[a] = mx
    chunk, outs, lses, maxes = lax.optimization_barrier((nxt, outs, lses, maxes))
  cat = lambda xs: xs[0] if len(xs) == 1 else jnp.concatenate(xs, axis=2)
  out, lse = cat(outs), cat(lses)
  out = out.astype(acc if cfg.out_f32 else q.dtype)
  return (out, lse) if maxes is None else (out, lse, cat(maxes))


# ---- backward -----------------------------------------------------------------------

def _backward(cfg: AttentionConfig, q, k, v, bias, mask, q_seg, kv_seg, seed, consts, out,
              lse, dout, dlse, mod=None, head0=0, heads=None, finish=True):
  """`backward` of one ring (one head group's: `_forward`). Without `finish`, dbias and
  dconsts are this ring's sums (float32, not yet summed over the devices they are
  replicated on): the head groups' are added first."""
  C = _Ctx(cfg, q, k, head0, heads)
  inner = _inner(C.R.inner)
  acc = C.acc
  n_diff = cfg.num_diff_consts
  orig_consts = tuple(consts)
  consts, mod = C.varying(tuple(consts)), _varying_mod(C, mod)
  A = _Aligned(C, cfg, consts, mod)
  c_axes = A.c_axes
  dq = _zeros(q, acc, q)
  dbias = _zeros(bias, acc, q)
  dconsts = [_compat.match_varying(jnp.zeros(jnp.shape(c), jnp.promote_types(
      jnp.result_type(c), acc)), q) for c in consts[:n_diff]]
  # key-aligned consts' gradients travel with their chunk like dK/dV (`kv_d`: their indices)
  kv_d = [n for n in range(n_diff) if c_axes[n] is not None and c_axes[n][1] == "kv"]
  chunk = C.first_chunk((k, v, kv_seg), A.travelling)
  # the accumulators of the chunk in hand: dK, dV and the key-aligned consts' gradients
  dkv_c = (_zeros(k, acc, q), _zeros(v, acc, q), tuple(dconsts[n] for n in kv_d))
  seq_axes = (2, 2, tuple(c_axes[n][0] for n in kv_d))
  if C.R.gather:  # dK/dV of every chunk, reduce-scattered to their owners at the end
    dkv_all = jax.tree_util.tree_map(lambda x, ax: _compat.match_varying(jnp.zeros(
        x.shape[:ax] + (C.n * x.shape[ax],) + x.shape[ax + 1:], acc), q), dkv_c, seq_axes)
  home_first = bool(C.steps) and C.steps[0].shift % C.n == 0 and not C.R.gather
  for t, st in enumerate(C.steps):
    nxt = C.next_chunk(chunk, t)
    kc, vc, ksc, al = chunk
    j = (C.i - st.shift) % C.n
    for a, b, branches, index in st.pairs:
      cs_ab, mod_ab, _ = A.pair(al, a, b)

      # The pair's dQ / dK / dV are added to the accumulators inside the branch: the
      # kernels' outputs (input dtype) go straight into the float32 sums, never a float32
      # copy of their own as the switch's results (8 x H100, S=64k: 64 MiB less temp).
      def fn(m, qa, kb, vb, bias_ab, mask_ab, qs, ks, oa, la, doa, dla, sq, sk, sv, a=a, b=b,
             j=j, dtypes=tuple(d.dtype for d in dconsts), cs_ab=cs_ab, mod_ab=mod_ab):
        if m == ("skip",):
          z = lambda x: None if x is None else jnp.zeros(x.shape, acc)
          return (sq, sk, sv, z(bias_ab),
                  [jnp.zeros(jnp.shape(c), dt) for c, dt in zip(cs_ab, dtypes)])
        kw = {} if not C.offsets_needed else {"offsets": C.offsets(a, b, j)}
        g = inner.backward(C.pair_cfg(m, a, b), qa, kb, vb, bias_ab, mask_ab, qs, ks, seed,
                           cs_ab, oa, la, doa, dla, mod_ab, **kw)
        gq, gk, gv, gb, gc = g
        return (_add_rows(sq, C.qp[a], gq), _add_rows(sk, C.kp[b], gk),
                _add_rows(sv, C.kp[b], gv), None if gb is None else gb.astype(acc),
                [x.astype(dt) for x, dt in zip(gc, dtypes)])
      bias_ab = C.pair_block(bias, a, b, j)
      dk_c, dv_c, dal_c = dkv_c
      dq, dk_c, dv_c, gb, gc = C.switch(
          index, branches, fn, q, C.q_piece(q, a), C.kv_piece(kc, b), C.kv_piece(vc, b), bias_ab,
          C.pair_block(mask, a, b, j), C.q_piece(q_seg, a, 1), C.kv_piece(ksc, b, 1),
          C.q_piece(out, a), C.q_piece(lse, a), C.q_piece(dout, a), C.q_piece(dlse, a),
          dq, dk_c, dv_c)
      dkv_c = (dk_c, dv_c,
               tuple(_add_rows(x, C.kp[b], gc[n], c_axes[n][0]) for x, n in zip(dal_c, kv_d)))
      for n, (x, y) in enumerate(zip(dconsts, gc)):
        ax = c_axes[n]
        if ax is None:
          dconsts[n] = x + y
        elif ax[1] == "q":  # query-aligned: this device's rows, at home like dQ
          dconsts[n] = _add_rows(x, C.qp[a], y, ax[0])
      if dbias is not None:
        dbias = _add_bias(C, dbias, gb, a, b, j)
    if C.R.gather:  # into the gathered gradient at the chunk's place
      dkv_all = jax.tree_util.tree_map(
          lambda full, d, ax, j=j: lax.dynamic_update_slice_in_dim(
              full, lax.dynamic_slice_in_dim(full, j * d.shape[ax], d.shape[ax], ax) + d,
              j * d.shape[ax], ax), dkv_all, dkv_c, seq_axes)
      dkv_c = jax.tree_util.tree_map(jnp.zeros_like, dkv_c)
      chunk, dkv_all, dq, dbias, dconsts = lax.optimization_barrier(
          (nxt, dkv_all, dq, dbias, dconsts))
      continue
    if t == 0 and home_first:
      # The own chunk's gradient stays home; the chunk's next visitor starts a fresh
      # accumulator where it is (nothing to send: one dK/dV transfer fewer per call).
      dkv_home = dkv_c
      dkv_c = jax.tree_util.tree_map(lambda x: _compat.match_varying(jnp.zeros_like(x), q),
                                     dkv_c)
    else:
      # dK/dV travel on with their chunk (after this step's compute, which updates them)
      dkv_c = C.next_chunk(dkv_c, t)
    chunk, dkv_c, dq, dbias, dconsts = lax.optimization_barrier(
        (nxt, dkv_c, dq, dbias, dconsts))
  if C.R.gather:
    dkv = jax.tree_util.tree_map(lambda x, ax: lax.psum_scatter(
        x, C.R.axis_name, scatter_dimension=ax, tiled=True), dkv_all, seq_axes)
  else:
    last = C.steps[-1].shift if C.steps else 0
    dkv = _shift(dkv_c, C.R, -last if C.steps else 0)  # back to their chunk's owner
    if home_first:
      dkv = jax.tree_util.tree_map(lambda x, y: x + y, dkv, dkv_home)
  dk, dv, dal = dkv
  for n, d in zip(kv_d, dal):
    dconsts[n] = d
  sm = _compat.sum_to_match
  dq, dk, dv = (sm(g, x).astype(x.dtype) for g, x in ((dq, q), (dk, k), (dv, v)))
  if not finish:
    return dq, dk, dv, dbias, tuple(dconsts)
  return (dq, dk, dv) + _finish_sums(dbias, dconsts, bias, orig_consts)


def _finish_sums(dbias, dconsts, bias, consts):
  """dbias and dconsts summed over the devices their inputs are replicated on, in their
  inputs' dtypes."""
  sm = _compat.sum_to_match
  if dbias is not None:
    dbias = sm(dbias, bias).astype(bias.dtype)
  return dbias, tuple(sm(d, c).astype(jnp.result_type(c)) for d, c in zip(dconsts, consts))


def _add_bias(C: _Ctx, dbias, gb, a, b, j):
  """dbias (local rows, global columns) with the pair's gradient block added."""
  row = C.qp[a].local if dbias.shape[2] != 1 and gb.shape[2] != dbias.shape[2] else 0
  if dbias.shape[3] == 1:
    col = jnp.zeros((), jnp.int32)
  else:
    col = (j * C.Skv + C.kp[b].local).astype(jnp.int32)
  z = jnp.zeros((), jnp.int32)
  starts = (z, z, jnp.asarray(row, jnp.int32), col)
  cur = lax.dynamic_slice(dbias, starts, gb.shape)
  return lax.dynamic_update_slice(dbias, cur + gb.astype(dbias.dtype), starts)


# ---- tangent (forward mode) -----------------------------------------------------------

def _tangent(cfg: AttentionConfig, q, k, v, bias, mask, q_seg, kv_seg, seed, consts, out, lse,
             tq, tk, tv, tbias, tconsts, mod=None, head0=0, heads=None):
  """`tangent` of one ring (one head group's: `_forward`)."""
  C = _Ctx(cfg, q, k, head0, heads)
  fn_t = _inner_tangent(C.R.inner)
  acc = C.acc
  consts, mod = C.varying(tuple(consts)), _varying_mod(C, mod)
  tconsts = C.varying(tuple(tconsts)) if tconsts is not None else None
  A = _Aligned(C, cfg, consts, mod, tconsts)
  # out None (Ulysses around the ring, `_ulysses`): the pass returns a, its O term is
  # applied by the caller (`flashvjp._delta.tangent_out`)
  t_out = _compat.match_varying(jnp.zeros(q.shape[:3] + (v.shape[3],), acc), q)
  t_lse = _compat.match_varying(jnp.zeros(lse.shape, acc), q)
  chunk = C.first_chunk((k, v, kv_seg, tk, tv), A.travelling)
  for t, st in enumerate(C.steps):
    nxt = C.next_chunk(chunk, t)
    kc, vc, ksc, tkc, tvc, al = chunk
    j = (C.i - st.shift) % C.n
    for a, b, branches, index in st.pairs:
      cs_ab, mod_ab, tcs_ab = A.pair(al, a, b)

      # added to the running sums inside the branch (as the forward and backward do)
      def fn(m, qa, kb, vb, bias_ab, mask_ab, qs, ks, oa, la, tqa, tkb, tvb, tb_ab, so, sl,
             a=a, b=b, j=j, cs_ab=cs_ab, mod_ab=mod_ab, tcs_ab=tcs_ab):
        if m == ("skip",):
          return so, sl
        kw = {} if not C.offsets_needed else {"offsets": C.offsets(a, b, j)}
        to, tl = fn_t(C.pair_cfg(m, a, b), qa, kb, vb, bias_ab, mask_ab, qs, ks, seed, cs_ab,
                      oa, la, tqa, tkb, tvb, tb_ab, tcs_ab, mod_ab, **kw)
        return _add_rows(so, C.qp[a], to), _add_rows(sl, C.qp[a], tl)
      t_out, t_lse = C.switch(
          index, branches, fn, q, C.q_piece(q, a), C.kv_piece(kc, b), C.kv_piece(vc, b),
          C.pair_block(bias, a, b, j), C.pair_block(mask, a, b, j), C.q_piece(q_seg, a, 1),
          C.kv_piece(ksc, b, 1), C.q_piece(out, a), C.q_piece(lse, a), C.q_piece(tq, a),
          C.kv_piece(tkc, b), C.kv_piece(tvc, b), C.pair_block(tbias, a, b, j), t_out, t_lse)
    chunk, t_out, t_lse = lax.optimization_barrier((nxt, t_out, t_lse))
  return t_out.astype(acc if out is None else out.dtype), t_lse.astype(lse.dtype)


# ---- head groups: the ring once per group of kv heads ---------------------------------
#
# With `RingSpec.head_groups` G > 1, each function runs its ring once per group of Hkv / G
# kv heads and their H / G query heads, one group after the other (a `lax.fori_loop`: one
# group's ring in the program, its buffers reused by the next). A group's heads are
# attended exactly as in one ring (a query head's kv head is in its group); the global head
# (dropout, score_mod, mask_mod) is the group's first head plus the local one. The ring's
# per-device state (the K/V chunk in flight, float32 dQ, the dK/dV sums that travel) is
# that of one group: 1 / G of it, for G times the steps, each with 1 / G of the work.


def _groups(cfg: AttentionConfig, q, k):
  """(G, query heads per group, kv heads per group)."""
  G = _schedule.check_head_groups(cfg.ring.head_groups, q.shape[1], k.shape[1],
                                  " on each device")
  return G, q.shape[1] // G, k.shape[1] // G


def _heads_of(x, g, n, heads):
  """x's heads of group g (`n` a group; `heads` x's full count): x itself when its head dim
  is a broadcast 1 (a bias shared by the heads) or x is None."""
  if x is None or x.shape[1] != heads or heads == n:
    return x
  return lax.dynamic_slice_in_dim(x, g * n, n, axis=1)


def _put_heads(buf, x, g, n):
  return lax.dynamic_update_slice_in_dim(buf, x.astype(buf.dtype), g * n, axis=1)


def _buffer(shape, dtype, ref):
  return _compat.match_varying(jnp.zeros(shape, dtype), ref)


def forward(cfg: AttentionConfig, q, k, v, bias, mask, q_seg, kv_seg, seed, consts, mod=None):
  """(out [B, H, Sl, Dv], lse [B, H, Sl]) of the local queries against the whole sequence
  (and their row maxima, the max over every pair, when cfg.max_logits)."""
  if cfg.ring.ulysses_axis is not None:
    return tuple(_usp("forward", cfg, (q, k, v, bias, mask, q_seg, kv_seg, seed, consts), (),
                      mod))
  return _rings_forward(cfg, q, k, v, bias, mask, q_seg, kv_seg, seed, consts, mod)


def backward(cfg: AttentionConfig, q, k, v, bias, mask, q_seg, kv_seg, seed, consts, out, lse,
             dout, dlse, mod=None):
  """(dq, dk, dv, dbias or None, dconsts) of the local shards (the backend contract)."""
  if cfg.ring.ulysses_axis is not None:
    flat = _usp("backward", cfg, (q, k, v, bias, mask, q_seg, kv_seg, seed, consts),
                (out, lse, dout, dlse), mod)
    nb = 4 if bias is not None else 3
    return (*flat[:3], flat[3] if bias is not None else None, tuple(flat[nb:]))
  return _rings_backward(cfg, q, k, v, bias, mask, q_seg, kv_seg, seed, consts, out, lse, dout,
                         dlse, mod)


def tangent(cfg: AttentionConfig, q, k, v, bias, mask, q_seg, kv_seg, seed, consts, out, lse,
            tq, tk, tv, tbias, tconsts, mod=None):
  """(t_out, t_lse) of the local queries: the per-pair tangent passes against the global
  (out, lse), summed (the pass is additive over kv given the exact lse)."""
  if cfg.ring.ulysses_axis is not None:
    return tuple(_usp("tangent", cfg, (q, k, v, bias, mask, q_seg, kv_seg, seed, consts),
                      (out, lse, tq, tk, tv, tbias, tconsts), mod))
  return _rings_tangent(cfg, q, k, v, bias, mask, q_seg, kv_seg, seed, consts, out, lse, tq,
                        tk, tv, tbias, tconsts, mod)


def _axes(a) -> tuple:
  return () if a is None else tuple(a) if isinstance(a, (tuple, list)) else (a,)


def _usp(kind: str, cfg: AttentionConfig, base, extra, mod) -> list:
  """Hierarchical: Ulysses over `RingSpec.ulysses_axis` around the ring over `axis_name`.

  After the all-to-all a device holds num_heads / U heads of the U inner chunks, which are
  one contiguous chunk of seq / axis_size (the inner axes are minor): the ring runs on it
  as on any chunk, its global head the index over (head axes, inner axes) times its heads.
  Results come back as flat lists (`_ulysses.Ulysses.outputs`).
  """
  R = cfg.ring
  U = _ulysses.Ulysses(cfg, R.ulysses_axis, R.ulysses_size)
  base, extra, mod = U.inputs(kind, base, extra, mod)
  heads = _axes(R.head_axis) + _axes(R.ulysses_axis)
  spec = dataclasses.replace(R, ulysses_axis=None, ulysses_size=1,
                             head_axis=heads[0] if len(heads) == 1 else heads)
  q, k = base[0], base[1]
  cfg_r = dataclasses.replace(cfg, ring=spec, seq_q=q.shape[2], seq_kv=k.shape[2])
  args: list = [cfg_r, *base, *extra, mod]
  if kind == "forward":
    res = list(_rings_forward(*args))
  elif kind == "backward":
    dq, dk, dv, dbias, dconsts = _rings_backward(*args)
    res = [dq, dk, dv] + ([dbias] if dbias is not None else []) + list(dconsts)
  else:
    res = list(_rings_tangent(*args))
  return U.outputs(kind, res, base[3] is not None)


def _rings_forward(cfg: AttentionConfig, q, k, v, bias, mask, q_seg, kv_seg, seed, consts,
                   mod=None):
  """(out [B, H, Sl, Dv], lse [B, H, Sl]) of the local queries against the whole sequence
  (and their row maxima, the max over every pair, when cfg.max_logits)."""
  G, n, nk = _groups(cfg, q, k)
  if G == 1:
    return _forward(cfg, q, k, v, bias, mask, q_seg, kv_seg, seed, consts, mod)
  H, Hkv = q.shape[1], k.shape[1]
  acc = jnp.promote_types(q.dtype, jnp.float32)
  rows = q.shape[:3]
  init = [_buffer(rows + (v.shape[3],), acc if cfg.out_f32 else q.dtype, q),
          _buffer(rows, acc, q)] + ([_buffer(rows, acc, q)] if cfg.max_logits else [])

  def body(g, bufs):
    qh = lambda x: _heads_of(x, g, n, H)
    kh = lambda x: _heads_of(x, g, nk, Hkv)
    res = _forward(cfg, qh(q), kh(k), kh(v), qh(bias), qh(mask), q_seg, kv_seg, seed, consts,
                   mod, head0=g * n, heads=H)
    return [_put_heads(b, r, g, n) for b, r in zip(bufs, res)]
  return tuple(lax.fori_loop(0, G, body, init))


def _rings_backward(cfg: AttentionConfig, q, k, v, bias, mask, q_seg, kv_seg, seed, consts, out,
                    lse, dout, dlse, mod=None):
  """`backward` of the ring (per head group when `RingSpec.head_groups` > 1)."""
  G, n, nk = _groups(cfg, q, k)
  if G == 1:
    return _backward(cfg, q, k, v, bias, mask, q_seg, kv_seg, seed, consts, out, lse, dout,
                     dlse, mod)
  H, Hkv = q.shape[1], k.shape[1]
  acc = jnp.promote_types(q.dtype, jnp.float32)
  n_diff = cfg.num_diff_consts
  per_head_bias = bias is not None and bias.shape[1] == H and H != 1
  init = (_buffer(q.shape, q.dtype, q), _buffer(k.shape, k.dtype, q),
          _buffer(v.shape, v.dtype, q), None if bias is None else _buffer(bias.shape, acc, q),
          tuple(_buffer(jnp.shape(c), jnp.promote_types(jnp.result_type(c), acc), q)
                for c in consts[:n_diff]))

  def body(g, bufs):
    qh = lambda x: _heads_of(x, g, n, H)
    kh = lambda x: _heads_of(x, g, nk, Hkv)
    gq, gk, gv, gb, gc = _backward(
        cfg, qh(q), kh(k), kh(v), qh(bias), qh(mask), q_seg, kv_seg, seed, consts, qh(out),
        qh(lse), qh(dout), qh(dlse), mod, head0=g * n, heads=H, finish=False)
    dq, dk, dv, db, dc = bufs
    if db is not None:
      db = _put_heads(db, qh(db) + gb, g, n) if per_head_bias else db + gb
    return (_put_heads(dq, gq, g, n), _put_heads(dk, gk, g, nk), _put_heads(dv, gv, g, nk), db,
            tuple(x + y.astype(x.dtype) for x, y in zip(dc, gc)))
  dq, dk, dv, dbias, dconsts = lax.fori_loop(0, G, body, init)
  return (dq, dk, dv) + _finish_sums(dbias, dconsts, bias, consts[:n_diff])


def _rings_tangent(cfg: AttentionConfig, q, k, v, bias, mask, q_seg, kv_seg, seed, consts, out,
                   lse, tq, tk, tv, tbias, tconsts, mod=None):
  """`tangent` of the ring (per head group when `RingSpec.head_groups` > 1)."""
  G, n, nk = _groups(cfg, q, k)
  if G == 1:
    return _tangent(cfg, q, k, v, bias, mask, q_seg, kv_seg, seed, consts, out, lse, tq, tk,
                    tv, tbias, tconsts, mod)
  H, Hkv = q.shape[1], k.shape[1]
  rows = q.shape[:3] + (v.shape[3],)
  init = (_buffer(rows, jnp.promote_types(q.dtype, jnp.float32) if out is None else out.dtype,
                  q), _buffer(lse.shape, lse.dtype, q))

  def body(g, bufs):
    qh = lambda x: _heads_of(x, g, n, H)
    kh = lambda x: _heads_of(x, g, nk, Hkv)
    res = _tangent(cfg, qh(q), kh(k), kh(v), qh(bias), qh(mask), q_seg, kv_seg, seed, consts,
                   qh(out), qh(lse), qh(tq), kh(tk), kh(tv), qh(tbias), tconsts, mod,
                   head0=g * n, heads=H)
    return tuple(_put_heads(b, r, g, n) for b, r in zip(bufs, res))
  return lax.fori_loop(0, G, body, init)
