"""The one differentiable op, wired once for every backend: reverse AND forward mode.

Room: differentiation. The op is a `jax.custom_jvp` (`attention`) whose JVP rule
computes the primal with the backend's forward and the tangent with a linear primitive,
`flashvjp_tangent` (the fused tangent pass). That primitive's transpose rule IS the
hand-written backward, so:

* `jax.jvp` / `jax.linearize` / `jax.jacfwd` run forward + the fused tangent pass;
* `jax.grad` (= linearize, then transpose) runs forward, then the hand-written backward
  on the residuals (q, k, v, out, lse): never autodiff of a forward kernel;
* forward-over-reverse (`jax.jvp(jax.grad(f))`, Hessian-vector products) differentiates
  the backward in forward mode: `_backward` is a `jax.custom_jvp` whose rule binds
  `flashvjp_backward_jvp`, JAX's forward-mode autodiff of the blockwise backward (pure JAX
  loops, O(seq) memory); its transpose (reverse-over-reverse, `jax.grad(jax.grad(f))`)
  raises `REVERSE_OVER_REVERSE`, a clear error naming forward-over-reverse;
* jvp-of-jvp (`jacfwd(jacfwd)`, `check_grads(order=2, modes=("fwd",))`): the tangent
  primitive's JVP is itself (linear in the tangents) plus a second primitive,
  `flashvjp_tangent_jvp` (forward-mode autodiff of the blockwise tangent pass, linear in
  the primals' tangents);
* reverse-over-forward (a gradient through a tangent output): w.r.t. the tangent
  direction it is the backward (the transpose of the tangent pass); w.r.t. the primals it
  transposes the second primitive, whose transpose rule is, by the symmetry of second
  derivatives, forward mode through the blockwise backward (O(seq)). With the tangent
  under `stop_gradient` (consistency-model training) nothing extra runs.

Both primitives batch (vmap) by recording, per vmap level, which operands carry a
leading batch axis, and implementing themselves as nested `jax.vmap`s of the backend
function; they lower with `mlir.lower_fun`. The primal itself stays the original
`jax.custom_vjp` (forward kernels, backward = the same hand-written backward), so a
transformation that differentiated the primal function directly would still get the
hand-written backward. Why this design: docs/forward_mode.md. Version differences: the
primitive API lives in `flashvjp._ad_compat`.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

# Importing Pallas (and its interpret mode) defines jax config states that are part of
# jit's cache key. Imported lazily, inside the first traced call, they would change that
# key after the caller's jit computed it, so a jitted Pallas call retraced on its second
# call. Imported here, before any user jit (about 0.07 s).
from jax.experimental import pallas as _pallas  # noqa: F401
from jax.experimental.pallas import tpu as _pallas_tpu  # noqa: F401

from flashvjp import _ad_compat as _ac
from flashvjp._config import AttentionConfig
from flashvjp._remat import name_residuals


def _backend(name: str, partition: bool = False):
  if name == "ring":  # inside shard_map: the ring calls its per-pair backend directly
    from flashvjp import ring
    return ring
  if name == "blockwise":
    from flashvjp import blockwise as backend
  elif name == "pallas_triton":
    from flashvjp.pallas import triton as backend  # type: ignore[no-redef]
  elif name == "pallas_tpu":
    from flashvjp.pallas import tpu as backend  # type: ignore[no-redef]
  elif name == "pallas_mosaic_gpu":
    from flashvjp.pallas.mosaic_gpu import backend  # type: ignore[no-redef]
  else:
    raise ValueError(f"no custom_vjp backend named {name!r}")
  # Under jit with inputs sharded over batch / heads / the sequence, each device runs its
  # part (a custom_partitioning rule; the sequence by a context-parallel strategy). With one device there is
  # nothing to partition: the rule would only trace and lower the backend a second time
  # (about a third of jit(grad)'s trace+lower time; benchmarks/results/compile_time.md).
  # `partition` is the program's device count > 1 (AttentionConfig.partition, from
  # flashvjp._target: the inputs' shardings, not the host's device count).
  if not partition:
    return backend
  from flashvjp import _partition
  return _partition.wrap(name, backend, _tangent_kernel(name)[0])


# ---- what forward mode runs, per implementation (explain() and docs/forward_mode.md) ----

def _tangent_kernel(implementation: str):
  """The fused tangent pass of a backend: (function, description)."""
  from flashvjp.blockwise import _tangent
  if implementation == "ring":
    from flashvjp import ring
    return ring.tangent, ("ring of per-pair fused tangent passes against the global (out, lse),"
                          " summed")
  if implementation == "blockwise":
    return _tangent.tangent, "blockwise fused tangent pass (pure JAX, O(seq) memory)"
  if implementation == "pallas_triton":
    from flashvjp.pallas.triton import tangent as triton_tangent
    return triton_tangent.tangent, "Pallas-Triton fused tangent kernel (flashvjp_tangent)"
  if implementation == "pallas_tpu":
    from flashvjp.pallas.tpu import tangent as tpu_tangent
    return tpu_tangent.tangent, "Mosaic-TPU fused tangent kernel (flashvjp_tpu_tangent)"
  if implementation == "pallas_mosaic_gpu":
    from flashvjp.pallas.mosaic_gpu import tangent as mgpu_tangent
    return mgpu_tangent.tangent, ("Mosaic-GPU fused tangent kernel (flashvjp_tangent: TMA"
                                  " ring, SS-wgmma)")
  return _tangent.tangent, ("blockwise fused tangent pass (pure JAX, O(seq) memory): the"
                            f" {implementation} family has no tangent kernel yet")


def forward_mode_paths(implementation: str) -> dict:
  """{mode: what runs} for an implementation (`flashvjp.explain(...).forward_mode`)."""
  if implementation == "naive":
    return {"jvp": "JAX autodiff of naive attention (O(seq^2))",
            "grad": "JAX autodiff of naive attention (O(seq^2))",
            "hvp": "JAX autodiff of naive attention (O(seq^2))"}
  fwd = f"{implementation} forward"
  return {
      "jvp": f"{fwd} + {_tangent_kernel(implementation)[1]}",
      "grad": f"{fwd} + {implementation} hand-written backward (the tangent pass's transpose)",
      "hvp": (f"{fwd} + tangent pass + {implementation} backward, differentiated in forward mode"
              " through the blockwise backward (JAX autodiff of pure-JAX loops, O(seq) memory)"),
      "jvp of jvp": "tangent pass + JAX forward-mode autodiff of the blockwise tangent pass",
      "grad through a tangent output": ("w.r.t. the tangent direction: the backward; w.r.t."
                                        " the primals: forward mode through the blockwise"
                                        " backward (O(seq))"),
      "grad of grad": ("refused (NotImplementedError): reverse-over-reverse; use"
                       " forward-over-reverse, jax.jvp(jax.grad(f))"),
  }


# ---- the op ------------------------------------------------------------------------


def apply_sinks(out, lse, sinks):
  """Attention sinks on (out, lse): each row's denominator gains exp(sinks).

  sinks: the sink logit of each row, broadcastable to lse [B, H, Sq] (the API's per-head
  sinks[h] as [1, H, 1], less a row shift where the scores were shifted). With the sink,
  ``lse' = logaddexp(lse, sinks)`` and every probability shrinks by ``w = exp(lse - lse')``,
  so ``out' = w * out`` (the sink attends to no value; dropout on p commutes with the
  scaling). An empty row (lse = -inf) keeps out = 0 and gets lse' = sinks, with zero,
  finite gradients. Inside the op (`attention`), (out', lse') are its residuals: the
  probabilities the backward and the tangent pass recompute, exp(s - lse'), are the
  sink-including ones, so they take the caller's cotangents / give the tangents of
  (out', lse') as they are (dO is never w * dO rounded to a 16-bit dtype); the sinks' own
  terms are O(seq) (`_sinks_grad`, `_attention_jvp`).
  """
  acc = lse.dtype
  new_lse = jnp.logaddexp(lse, sinks.astype(acc))
  w = jnp.exp(lse - new_lse)
  out = (out.astype(acc) * w[..., None]).astype(out.dtype)
  return out, new_lse


def _sinks_weight(lse, sinks):
  """exp(sinks - lse'): each row's sink probability (lse' the sink-including lse)."""
  return jnp.exp(sinks.astype(lse.dtype) - lse)


def _sinks_grad(out, lse, dout, dlse, sinks):
  """d sinks (sinks of lse's rank, dims 1 or full) from the sink-including residuals
  (out', lse'): -w' * (rowsum(dO * O') - dlse), w' = exp(sinks - lse'), summed to sinks'
  shape."""
  from flashvjp import _delta
  g = -_sinks_weight(lse, sinks) * _delta.delta(out, dout, dlse, lse.dtype)
  axes = tuple(a for a, (n, m) in enumerate(zip(g.shape, sinks.shape)) if m == 1 and n != 1)
  return jnp.sum(g, axis=axes, keepdims=True).astype(sinks.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _attention_vjp(cfg: AttentionConfig, q, k, v, bias, mask, q_seg, kv_seg, seed,
                   diff_consts, fixed_consts, mod=None, sinks=None):
  outs = _backend(cfg.implementation, cfg.partition).forward(
      cfg, q, k, v, bias, mask, q_seg, kv_seg, seed, tuple(diff_consts) + tuple(fixed_consts),
      mod)
  if sinks is None:
    return outs
  return apply_sinks(outs[0], outs[1], sinks) + tuple(outs[2:])


def _fwd(cfg, q, k, v, bias, mask, q_seg, kv_seg, seed, diff_consts, fixed_consts, mod=None,
         sinks=None):
  outs = _attention_vjp(cfg, q, k, v, bias, mask, q_seg, kv_seg, seed, diff_consts,
                        fixed_consts, mod, sinks)
  out, lse = name_residuals(*outs[:2])
  res = (q, k, v, bias, mask, q_seg, kv_seg, seed, diff_consts, fixed_consts, mod, out, lse,
         sinks)
  return (out, lse) + tuple(outs[2:]), res


def _bwd(cfg, res, cts):
  q, k, v, bias, mask, q_seg, kv_seg, seed, diff_consts, fixed_consts, mod, out, lse, sinks = res
  dout, dlse = cts[:2]  # cfg.max_logits: the row maxima carry no gradient
  dq, dk, dv, dbias, dconsts = _backward(
      cfg, q, k, v, bias, mask, q_seg, kv_seg, seed,
      tuple(diff_consts) + tuple(fixed_consts), out, lse, dout, dlse, mod)
  dsinks = None if sinks is None else _sinks_grad(out, lse, dout, dlse, sinks)
  none = lambda xs: None if xs is None else jax.tree_util.tree_map(lambda _: None, xs)
  return (dq, dk, dv, dbias, none(mask), none(q_seg), none(kv_seg), none(seed),
          tuple(dconsts), tuple(None for _ in fixed_consts), none(mod), dsinks)


_attention_vjp.defvjp(_fwd, _bwd)


@functools.partial(jax.custom_jvp, nondiff_argnums=(0,))
def attention(cfg: AttentionConfig, q, k, v, bias, mask, q_seg, kv_seg, seed,
              diff_consts, fixed_consts, mod=None, sinks=None):
  """(out [B, H, Sq, Dv], lse [B, H, Sq]), differentiable in forward and reverse mode.

  `mod`: None, or the mask_mod's inputs (`flashvjp._mask_mod.ModInputs`: its block
  classes and the arrays it closes over); not differentiable. `sinks`: None, or each
  row's sink logit, broadcastable to lse (`apply_sinks`); differentiable. With
  cfg.max_logits a third output, each row's maximum allowed logit [B, H, Sq] float32, from
  the same forward pass (sinks are no position); no gradient flows through it (its
  tangent is zero, its cotangent ignored).
  """
  return _attention_vjp(cfg, q, k, v, bias, mask, q_seg, kv_seg, seed, diff_consts,
                        fixed_consts, mod, sinks)


def _attention_jvp(cfg, primals, tangents):
  q, k, v, bias, mask, q_seg, kv_seg, seed, diff_consts, fixed_consts, mod, sinks = primals
  tq, tk, tv, tbias = tangents[:4]
  tdc = tangents[8]
  tsinks = None if sinks is None or _ac.is_zero(tangents[11]) else tangents[11]
  # out and lse are the backward's residuals: named where they are made, so a checkpoint
  # policy can save them (flashvjp._remat) and the forward is not re-run in the backward
  outs = attention(cfg, *primals)
  out, lse = name_residuals(*outs[:2])
  extra = tuple(outs[2:])  # cfg.max_logits: the row maxima, without gradient
  t_extra = tuple(jnp.zeros_like(x) for x in extra)
  ts = [None if _ac.is_zero(t) else t for t in (tq, tk, tv, tbias, *tdc)]
  if all(t is None for t in ts):
    t_out, t_lse = jnp.zeros_like(out), jnp.zeros_like(lse)
  else:  # with sinks, (out, lse) include them: the tangent pass's p are the sinks' too
    consts = tuple(diff_consts) + tuple(fixed_consts)
    t_out, t_lse = tangent(cfg, (q, k, v, bias, mask, q_seg, kv_seg, seed, consts, mod, out,
                                 lse), ts)
  if tsinks is not None:  # the sink's own term: d lse' = w' t_sinks, d out' = -w' t_sinks out'
    acc = lse.dtype
    wt = _sinks_weight(lse, sinks) * tsinks.astype(acc)
    t_lse = (t_lse.astype(acc) + wt).astype(lse.dtype)
    t_out = (t_out.astype(acc) - wt[..., None] * out.astype(acc)).astype(t_out.dtype)
  return (out, lse) + extra, (t_out, t_lse) + t_extra


attention.defjvp(_attention_jvp, symbolic_zeros=True)


# ---- the hand-written backward, differentiable in forward mode -------------------------

@functools.partial(jax.custom_jvp, nondiff_argnums=(0,))
def _backward(cfg, q, k, v, bias, mask, q_seg, kv_seg, seed, consts, out, lse, dout, dlse, mod):
  if cfg.out_f32:  # out is float32 (a traced scale); the kernels take dO in the inputs' dtype
    dout = dout.astype(q.dtype)
  dq, dk, dv, dbias, dconsts = _backend(cfg.implementation, cfg.partition).backward(
      cfg, q, k, v, bias, mask, q_seg, kv_seg, seed, consts, out, lse, dout, dlse, mod)
  return dq, dk, dv, dbias, tuple(dconsts)


@_backward.defjvp
def _backward_jvp(cfg, primals, tangents):
  """Forward mode through the backward: JAX autodiff of the blockwise backward (pure JAX),
  bound as one linear primitive (`flashvjp_backward_jvp`) whose transpose is refused.

  Forward-over-reverse (`jax.jvp(jax.grad(f))`) evaluates the primitive. Reverse-over-
  reverse (`jax.grad` of a function of `jax.grad(f)`) would transpose it, i.e. run the
  blockwise backward's loops in reverse mode: O(seq^2) saved state, and impossible for
  the loops with dynamic trip counts (segments, a dense mask, mask_mod). As one staged
  primitive those loops are never linearized; its transpose rule raises a clear error
  naming forward-over-reverse instead.
  """
  q, k, v, bias, mask, q_seg, kv_seg, seed, consts, out, lse, dout, dlse, mod = primals
  tq, tk, tv, tbias, _, _, _, _, tconsts, tout, tlse, tdout, tdlse, _ = tangents
  n = cfg.num_diff_consts
  res = _backward(cfg, *primals)
  ts = (tq, tk, tv, tbias, tuple(tconsts[:n]), tout, tlse, tdout, tdlse)
  p_leaves, ptree = jax.tree_util.tree_flatten(primals)
  t_leaves, ttree = jax.tree_util.tree_flatten(ts)
  r_leaves, rtree = jax.tree_util.tree_flatten(res)
  t_out = _backward_jvp_p.bind(*p_leaves, *t_leaves, cfg=cfg, ptree=ptree, ttree=ttree,
                               n_out=len(r_leaves), levels=())
  return res, jax.tree_util.tree_unflatten(rtree, list(t_out))


def _pure_jax(cfg: AttentionConfig):
  """(cfg, backward, tangent) of the pure-JAX path that forward-mode autodiff differentiates
  (second order): the blockwise backend, or the ring with blockwise pairs."""
  if cfg.ring is not None:
    from flashvjp import ring
    return (dataclasses.replace(cfg, ring=dataclasses.replace(cfg.ring, inner="blockwise")),
            ring.backward, ring.tangent)
  from flashvjp.blockwise import _impl as blockwise
  from flashvjp.blockwise import _tangent as blockwise_tangent
  return dataclasses.replace(cfg, implementation="blockwise"), blockwise.backward, \
      blockwise_tangent.tangent


def _backward_jvp_base(*flat, cfg, ptree, ttree):
  n_p = ptree.num_leaves
  primals = jax.tree_util.tree_unflatten(ptree, list(flat[:n_p]))
  ts = jax.tree_util.tree_unflatten(ttree, list(flat[n_p:]))
  q, k, v, bias, mask, q_seg, kv_seg, seed, consts, out, lse, dout, dlse, mod = primals
  n = cfg.num_diff_consts
  cfg_b, backward_b, _ = _pure_jax(cfg)

  def f(q, k, v, bias, dc, out, lse, dout, dlse):
    dq, dk, dv, dbias, dconsts = backward_b(
        cfg_b, q, k, v, bias, mask, q_seg, kv_seg, seed, tuple(dc) + tuple(consts[n:]), out, lse,
        dout, dlse, mod)
    return dq, dk, dv, dbias, tuple(dconsts)

  _, t_out = jax.jvp(f, (q, k, v, bias, tuple(consts[:n]), out, lse, dout, dlse), ts)
  return jax.tree_util.tree_leaves(t_out)


def _backward_jvp_impl(*flat, cfg, ptree, ttree, n_out, levels):
  del n_out
  base = functools.partial(_backward_jvp_base, cfg=cfg, ptree=ptree, ttree=ttree)
  return list(_over_levels(base, levels, flat))


def _backward_jvp_abstract_eval(*avals, ptree, n_out, levels, **_):
  """The tangents of (dq, dk, dv, dbias, dconsts): shaped as the tangents of (q, k, v, bias,
  diff consts), the first n_out tangent operands, with every vmap level's axis leading."""
  n_p = ptree.num_leaves
  sizes = []
  for li in range(len(levels)):
    for a, lv_a in zip(avals, zip(*levels)):
      if lv_a[li]:
        sizes.append(a.shape[sum(lv_a[:li])])
        break
  outs = []
  for pos in range(n_p, n_p + n_out):
    lead = sum(lv[pos] for lv in levels)
    outs.append(_ac.aval_like(avals[pos], tuple(sizes) + tuple(avals[pos].shape[lead:])))
  return outs


def _backward_jvp_jvp_rule(primals, tangents, **params):
  """Third order (jvp of jvp of grad): JAX forward-mode autodiff of the pure-JAX impl."""
  tangents = [_ac.instantiate(t) for t in tangents]
  outs, t_outs = jax.jvp(functools.partial(_backward_jvp_impl, **params), list(primals),
                         list(tangents))
  return list(outs), list(t_outs)


REVERSE_OVER_REVERSE = (
    "flashvjp: reverse-over-reverse differentiation (jax.grad, jax.vjp or jax.jacrev of a"
    " function that itself calls jax.grad / jax.vjp of flash_attention) is not supported: it"
    " would run the blockwise backward's loops in reverse mode, which is not O(seq) memory"
    " and impossible for loops with dynamic trip counts. Differentiate the gradient in"
    " forward mode instead (forward-over-reverse, fused, O(seq)): jax.jvp(jax.grad(f),"
    " (x,), (v,)) for a Hessian-vector product, jax.jacfwd(jax.grad(f)) or jax.hessian(f)"
    " for a Hessian (docs/forward_mode.md)")


def _backward_jvp_transpose(cts, *flat, **params):
  raise NotImplementedError(REVERSE_OVER_REVERSE)


# ---- the tangent primitives ----------------------------------------------------------
# Operands: the primal leaves of (q, k, v, bias, mask, q_seg, kv_seg, seed, consts, mod,
# out, lse) (treedef `tree`; out and lse are the last two leaves), then the present
# tangents of (q, k, v, bias, *diff_consts) (`present`), then for flashvjp_tangent_jvp the
# present tangents of the primal leaves (`dpresent`). `levels`: one tuple of bools per
# vmap level (outermost first): which operands carry that level's axis (leading, in
# level order).

def tangent(cfg: AttentionConfig, primal, ts):
  """Bind the fused tangent pass: primal = (q, k, v, bias, mask, q_seg, kv_seg, seed, consts,
  mod, out, lse); ts = [t_q, t_k, t_v, t_bias, *t_diff_consts], None for zero."""
  leaves, tree = jax.tree_util.tree_flatten(primal)
  present = tuple(t is not None for t in ts)
  return _tangent_p.bind(*leaves, *[t for t in ts if t is not None], cfg=cfg, tree=tree,
                         present=present, levels=())


def _over_levels(fn, levels, args):
  """fn(*args) with one jax.vmap per level (outermost first), in_axes from the level's mask."""
  if not levels:
    return fn(*args)
  inner = functools.partial(_over_levels, fn, levels[1:])
  return jax.vmap(lambda *a: inner(a), in_axes=[0 if b else None for b in levels[0]])(*args)


def _split(flat, tree, present):
  n_p = tree.num_leaves
  primal = jax.tree_util.tree_unflatten(tree, flat[:n_p])
  it = iter(flat[n_p:n_p + sum(present)])
  ts = [next(it) if p else None for p in present]
  return primal, ts, list(flat[n_p + sum(present):])


def _run_tangent(cfg, primal, ts, fn=None, partition=True):
  q, k, v, bias, mask, q_seg, kv_seg, seed, consts, mod, out, lse = primal
  tq, tk, tv, tbias, *tc = ts
  if fn is None:
    if cfg.implementation in ("blockwise", "pallas_triton", "pallas_tpu", "pallas_mosaic_gpu") and \
        cfg.partition and partition:
      fn = _backend(cfg.implementation, True).tangent  # partitioned under jit like the backward
    else:
      fn = _tangent_kernel(cfg.implementation)[0]
  return fn(cfg, q, k, v, bias, mask, q_seg, kv_seg, seed, consts, out, lse, tq, tk, tv, tbias,
            tuple(tc), mod)


def _tangent_impl(*flat, cfg, tree, present, levels, partition=True):
  def base(*f):
    primal, ts, _ = _split(f, tree, present)
    return _run_tangent(cfg, primal, ts, partition=partition)
  return list(_over_levels(base, levels, flat))


def _tangent_lowering(ctx):
  """The tangent pass, partitioned (flashvjp._partition) where the program has devices."""
  return functools.partial(_tangent_impl, partition=_ac.lowering_has_devices(ctx))


def _tangent_jvp_impl(*flat, cfg, tree, present, dpresent, levels):
  cfg_b, _, tangent_b = _pure_jax(cfg)

  def base(*f):
    primal, ts, dps = _split(f, tree, present)
    leaves = list(f[:tree.num_leaves])
    idx = [n for n, d in enumerate(dpresent) if d]

    def g(*xs):
      new = list(leaves)
      for n, x in zip(idx, xs):
        new[n] = x
      return _run_tangent(cfg_b, jax.tree_util.tree_unflatten(tree, new), ts, fn=tangent_b)
    return jax.jvp(g, [leaves[n] for n in idx], dps)[1]
  return list(_over_levels(base, levels, flat))


def _abstract_eval(*avals, tree, levels, **_):
  n_p = tree.num_leaves
  sizes = []
  for li in range(len(levels)):
    for a, lv_a in zip(avals, zip(*levels)):
      if lv_a[li]:
        sizes.append(a.shape[sum(lv_a[:li])])
        break
  outs = []
  for pos in (n_p - 2, n_p - 1):  # out, lse
    lead = sum(lv[pos] for lv in levels)
    outs.append(_ac.aval_like(avals[pos], tuple(sizes) + tuple(avals[pos].shape[lead:])))
  return outs


def _batch_rule(prim, args, dims, **params):
  mask = tuple(d is not _ac.not_mapped for d in dims)
  args = [a if d is _ac.not_mapped else jnp.moveaxis(a, d, 0) for a, d in zip(args, dims)]
  outs = prim.bind(*args, **dict(params, levels=(mask,) + tuple(params["levels"])))
  return outs, [0] * len(outs)


def _tangent_jvp_rule(primals, tangents, *, cfg, tree, present, levels):
  """d(tangent pass) = tangent pass of the tangents' tangents + d/d(primals) (2nd primitive)."""
  outs = _tangent_p.bind(*primals, cfg=cfg, tree=tree, present=present, levels=levels)
  n_p = tree.num_leaves
  d_primal, d_ts = tangents[:n_p], tangents[n_p:]
  terms = []
  nz = [not _ac.is_zero(t) for t in d_ts]
  if any(nz):
    it = iter(nz)
    new_present = tuple(p and next(it) for p in present)
    lv = tuple(l[:n_p] + tuple(b for b, z in zip(l[n_p:], nz) if z) for l in levels)
    terms.append(_tangent_p.bind(*primals[:n_p], *[t for t, z in zip(d_ts, nz) if z], cfg=cfg,
                                 tree=tree, present=new_present, levels=lv))
  dpresent = tuple(not _ac.is_zero(t) and jnp.issubdtype(jnp.result_type(p), jnp.inexact)
                   for p, t in zip(primals[:n_p], d_primal))
  if any(dpresent):
    lv = tuple(l + tuple(b for b, d in zip(l[:n_p], dpresent) if d) for l in levels)
    terms.append(_tangent_jvp_p.bind(*primals, *[t for t, d in zip(d_primal, dpresent) if d],
                                     cfg=cfg, tree=tree, present=present, dpresent=dpresent,
                                     levels=lv))
  if not terms:
    return outs, [jnp.zeros_like(o) for o in outs]
  t_outs = terms[0]
  for t in terms[1:]:
    t_outs = [a + b for a, b in zip(t_outs, t)]
  return outs, list(t_outs)


def _tangent_transpose(cts, *flat, cfg, tree, present, levels):
  """The transpose of the tangent pass w.r.t. its tangents: the hand-written backward."""
  ct_out, ct_lse = cts
  n_p = tree.num_leaves
  if type(ct_out) is _ac.Zero and type(ct_lse) is _ac.Zero:
    return [None] * len(flat)
  prim = flat[:n_p]
  if any(isinstance(x, _ac.UndefinedPrimal) for x in prim):
    raise NotImplementedError("flashvjp_tangent is linear in its tangent operands only")
  dout = _ac.instantiate(ct_out)
  has_dlse = type(ct_lse) is not _ac.Zero

  def bwd(*f):
    q, k, v, bias, mask, q_seg, kv_seg, seed, consts, mod, out, lse = \
        jax.tree_util.tree_unflatten(tree, f[:n_p])
    dlse = f[n_p + 1] if has_dlse else None
    dq, dk, dv, dbias, dconsts = _backward(cfg, q, k, v, bias, mask, q_seg, kv_seg, seed,
                                           tuple(consts), out, lse, f[n_p], dlse, mod)
    grads = [dq, dk, dv, dbias, *dconsts]
    return [g for g, p in zip(grads, present) if p]

  lv = tuple(tuple(l[:n_p]) + (True,) * (1 + has_dlse) for l in levels)
  grads = _over_levels(bwd, lv, list(prim) + [dout] + ([ct_lse] if has_dlse else []))
  res = [None] * n_p
  for pos, (g, x) in enumerate(zip(grads, flat[n_p:])):
    if not isinstance(x, _ac.UndefinedPrimal):
      res.append(None)
      continue
    axes = tuple(li for li, l in enumerate(levels) if not l[n_p + pos])
    if axes:
      g = g.sum(axis=axes)
    res.append(g.astype(x.aval.dtype))
  return res


def _tangent_jvp_jvp_rule(primals, tangents, **params):
  """Third order and beyond: JAX forward-mode autodiff of the (pure-JAX) second primitive."""
  tangents = [_ac.instantiate(t) for t in tangents]
  outs, t_outs = jax.jvp(functools.partial(_tangent_jvp_impl, **params), list(primals),
                         list(tangents))
  return list(outs), list(t_outs)


def _tangent_jvp_transpose_rule(cts, *flat, cfg, tree, present, dpresent, levels):
  """Reverse mode through a tangent output (grad of a function of jvp's tangent, w.r.t. the
  primals): the transpose of dP -> d(tangent pass)(P, T)[dP], in O(seq).

  By the symmetry of second derivatives, for F = attention and a cotangent c of its
  tangent output, grad_x <c, DF(x)[T]> = d/de grad_x <c, F(x + e T)> = the JVP, in the
  direction T, of x -> backward(x, F(x), c): forward mode through the blockwise backward,
  with out and lse moving along (t_out, t_lse) = the tangent pass. That is the TOTAL
  derivative w.r.t. (q, k, v, bias, score_mod consts), which already includes the paths
  through out and lse; their own cotangents are therefore returned as zero. This is exact
  because the operands out and lse of these primitives are always attention(q, k, v, ...)
  of the same operands (they are only bound by `attention`'s JVP rule).
  """
  ct_out, ct_lse = cts
  n_p = tree.num_leaves
  if type(ct_out) is _ac.Zero and type(ct_lse) is _ac.Zero:
    return [None] * len(flat)
  prim = flat[:n_p + sum(present)]
  if any(isinstance(x, _ac.UndefinedPrimal) for x in prim):
    raise NotImplementedError("flashvjp_tangent_jvp is linear in its last operands only")
  cfg_b, backward_b, _ = _pure_jax(cfg)
  dout = _ac.instantiate(ct_out)
  has_dlse = type(ct_lse) is not _ac.Zero
  n = cfg.num_diff_consts

  def second(*f):
    primal, ts, _ = _split(list(f[:len(prim)]), tree, present)
    q, k, v, bias, mask, q_seg, kv_seg, seed, consts, mod, out, lse = primal
    t_out, t_lse = _run_tangent(cfg, primal, ts)
    dout_, dlse_ = f[len(prim)], (f[len(prim) + 1] if has_dlse else None)
    zero = lambda x, t: jnp.zeros_like(x) if t is None else t.astype(x.dtype)
    tq, tk, tv, tbias, *tc = ts
    dc = tuple(consts[:n])

    def bwd(q, k, v, bias, dc, out, lse):
      dq, dk, dv, dbias, dconsts = backward_b(
          cfg_b, q, k, v, bias, mask, q_seg, kv_seg, seed, tuple(dc) + tuple(consts[n:]), out,
          lse, dout_, dlse_, mod)
      return dq, dk, dv, dbias, tuple(dconsts)
    tb = None if bias is None else zero(bias, tbias)
    _, (gq, gk, gv, gbias, gc) = jax.jvp(
        bwd, (q, k, v, bias, dc, out, lse),
        (zero(q, tq), zero(k, tk), zero(v, tv), tb, tuple(zero(c, t) for c, t in zip(dc, tc)),
         t_out.astype(out.dtype), t_lse.astype(lse.dtype)))
    # cotangents of the primal leaves, in leaf order (None: zero)
    zeros = lambda x: jax.tree_util.tree_map(jnp.zeros_like, x)
    grads = tree.flatten_up_to(
        (gq, gk, gv, gbias, zeros(mask), zeros(q_seg), zeros(kv_seg), zeros(seed),
         tuple(gc) + zeros(tuple(consts[n:])), zeros(mod), None, None))
    return [g for g, d in zip(grads, dpresent) if d]

  lv = tuple(tuple(l[:len(prim)]) + (True,) * (1 + has_dlse) for l in levels)
  grads = _over_levels(second, lv, list(prim) + [dout] + ([ct_lse] if has_dlse else []))
  res = [None] * len(prim)
  for pos, (g, x) in enumerate(zip(grads, flat[len(prim):])):
    if g is None or not isinstance(x, _ac.UndefinedPrimal):
      res.append(None)
      continue
    axes = tuple(li for li, l in enumerate(levels) if not l[len(prim) + pos])
    if axes:
      g = g.sum(axis=axes)
    res.append(g.astype(x.aval.dtype))
  return res


def _tangent_effects(*avals, cfg, **params):
  """The Mosaic-GPU interpreter's ordered callbacks (its tangent kernel in interpret mode);
  none for every other pass."""
  if not (cfg.interpret and cfg.implementation == "pallas_mosaic_gpu"):
    return frozenset()
  return _ac.traced_effects(functools.partial(_tangent_impl, cfg=cfg, partition=False,
                                              **params), avals)


_tangent_p = _ac.define("flashvjp_tangent", _tangent_impl, _abstract_eval, _batch_rule,
                        _tangent_jvp_rule, _tangent_transpose, lowering=_tangent_lowering,
                        effects=_tangent_effects)
_backward_jvp_p = _ac.define("flashvjp_backward_jvp", _backward_jvp_impl,
                             _backward_jvp_abstract_eval, _batch_rule, _backward_jvp_jvp_rule,
                             _backward_jvp_transpose)
_tangent_jvp_p = _ac.define("flashvjp_tangent_jvp", _tangent_jvp_impl, _abstract_eval,
                            _batch_rule, _tangent_jvp_jvp_rule, _tangent_jvp_transpose_rule)
