"""The one jax.custom_vjp, wired once for every backend.

Room: differentiation. Residuals are the inputs plus (out, lse); the backward is
the backend's hand-written one. Only the "naive" reference bypasses this and is
differentiated by autodiff.
"""
from __future__ import annotations

import functools

import jax
# Importing Pallas (and its interpret mode) defines jax config states that are part of
# jit's cache key. Imported lazily, inside the first traced call, they would change that
# key after the caller's jit computed it, so a jitted Pallas call retraced on its second
# call. Imported here, before any user jit (about 0.07 s).
from jax.experimental import pallas as _pallas  # noqa: F401
from jax.experimental.pallas import tpu as _pallas_tpu  # noqa: F401

from flashvjp._config import AttentionConfig


def _backend(name: str):
  if name == "blockwise":
    from flashvjp import blockwise as backend
  elif name == "pallas_triton":
    from flashvjp.pallas import triton as backend
  elif name == "pallas_tpu":
    from flashvjp.pallas import tpu as backend
  else:
    raise ValueError(f"no custom_vjp backend named {name!r}")
  # Under jit with inputs sharded over batch/heads, each device runs the backend on its
  # own slice, with no collective (a custom_partitioning rule). With one device there is
  # nothing to partition: the rule would only trace and lower the backend a second time
  # (about a third of jit(grad)'s trace+lower time; benchmarks/results/compile_time.md).
  if jax.device_count() == 1:
    return backend
  from flashvjp.distributed import _partition
  return _partition.wrap(backend)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def attention(cfg: AttentionConfig, q, k, v, bias, mask, q_seg, kv_seg, seed,
              diff_consts, fixed_consts, mod=None):
  """(out [B, H, Sq, Dv], lse [B, H, Sq]) with a hand-written backward.

  `mod`: None, or the mask_mod's inputs (`flashvjp._mask_mod.ModInputs`: its block
  classes and the arrays it closes over); not differentiable.
  """
  return _backend(cfg.implementation).forward(
      cfg, q, k, v, bias, mask, q_seg, kv_seg, seed, tuple(diff_consts) + tuple(fixed_consts),
      mod)


def _fwd(cfg, q, k, v, bias, mask, q_seg, kv_seg, seed, diff_consts, fixed_consts, mod=None):
  out, lse = attention(cfg, q, k, v, bias, mask, q_seg, kv_seg, seed, diff_consts, fixed_consts,
                       mod)
  res = (q, k, v, bias, mask, q_seg, kv_seg, seed, diff_consts, fixed_consts, mod, out, lse)
  return (out, lse), res


def _bwd(cfg, res, cts):
  q, k, v, bias, mask, q_seg, kv_seg, seed, diff_consts, fixed_consts, mod, out, lse = res
  dout, dlse = cts
  dq, dk, dv, dbias, dconsts = _backend(cfg.implementation).backward(
      cfg, q, k, v, bias, mask, q_seg, kv_seg, seed,
      tuple(diff_consts) + tuple(fixed_consts), out, lse, dout, dlse, mod)
  none = lambda xs: None if xs is None else jax.tree_util.tree_map(lambda _: None, xs)
  return (dq, dk, dv, dbias, none(mask), none(q_seg), none(kv_seg), none(seed),
          tuple(dconsts), tuple(None for _ in fixed_consts), none(mod))


attention.defvjp(_fwd, _bwd)
