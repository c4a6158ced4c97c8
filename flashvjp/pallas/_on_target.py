"""Compiled GPU kernels lowered for the program's GPU, not the host's.

Room: Pallas compatibility. JAX's Pallas-Triton lowering asks "which GPU?" through the
abstract mesh in context (`jax.sharding.use_abstract_mesh`), else the host's default
device; on a CPU host compiling ahead of time for a `jax.experimental.topologies` GPU
(H100, B200) there is neither, and it fails with "No supported GPU devices found". The
program's device assignment knows the GPU: this module wraps a compiled kernel call in a
call primitive (`flashvjp_on_target`) whose lowering rule reads the device from the
lowering context (the jit's devices, or the mesh of a partitioned call) and lowers the
kernel inside `use_abstract_mesh` of an axis-less mesh carrying that device. So the user
enters nothing, and the target decides.

Only used where the host has no GPU (`on_target` returns the call itself on a GPU host:
the programs a GPU runs are unchanged). The primitive is a plain call: its impl and
lowering trace the kernel again (in the target's abstract mesh), its batching rule vmaps it. It is never
differentiated (the kernels sit inside the op's custom_vjp / tangent primitive).
"""
from __future__ import annotations

import functools

import jax
from jax.extend.core import Primitive
from jax.interpreters import batching
from jax.interpreters import mlir

_GPU = ("gpu", "cuda", "rocm")


def _abstract_mesh_api():
  """(use_abstract_mesh, AbstractMesh, AbstractDevice), or None where this jax lacks them."""
  use = getattr(jax.sharding, "use_abstract_mesh", None)
  mesh_cls = getattr(jax.sharding, "AbstractMesh", None)
  try:
    from jax._src.mesh import AbstractDevice  # jax 0.10.2-0.12: not public
  except ImportError:  # pragma: no cover
    return None
  if use is None or mesh_cls is None:  # pragma: no cover
    return None
  return use, mesh_cls, AbstractDevice


def _context_device():
  get = getattr(jax.sharding, "get_abstract_mesh", None)
  mesh = None if get is None else get()
  return getattr(mesh, "abstract_device", None)


def _lowering_devices(ctx):
  """The devices of the program being lowered (jit's device assignment or the mesh)."""
  ac = getattr(ctx.module_context, "axis_context", None)
  devices = getattr(ac, "device_assignment", None)
  if devices:
    return tuple(devices)
  mesh = getattr(ac, "mesh", None)
  flat = getattr(mesh, "_flat_devices_tuple", None)
  if flat:
    return tuple(flat)
  devs = getattr(mesh, "devices", None)
  if devs is not None and hasattr(devs, "flat"):
    return tuple(devs.flat)
  # a one-device jit has no device assignment in its context: the compile client's devices
  # (a deviceless topology's client holds only the target's devices)
  backend = getattr(ctx.module_context, "backend", None)
  try:
    return tuple(backend.devices()) if backend is not None else ()
  except (AttributeError, RuntimeError):  # pragma: no cover
    return ()


def lowering_abstract_device(ctx):
  """An AbstractDevice for the GPU the lowering context targets, or None (not a GPU, or
  the context mesh already names one)."""
  api = _abstract_mesh_api()
  if api is None or _context_device() is not None:
    return None
  devices = _lowering_devices(ctx)
  if not devices or devices[0].platform not in _GPU:
    return None
  d = devices[0]
  return api[2](device_kind=d.device_kind, num_cores=getattr(d, "core_count", None),
                platform="gpu")


def _impl(*args, call, jaxpr):
  del jaxpr
  return call(*args)


def _abstract_eval(*avals, call, jaxpr):
  del avals, call
  return list(jaxpr.out_avals)


def _lowering(ctx, *args, call, jaxpr):
  # The kernel is traced again here, inside the target's abstract mesh: a jaxpr equation
  # keeps the abstract mesh of the context it was traced in, and Pallas-Triton lowers its
  # pallas_call under that mesh (so re-evaluating an already traced jaxpr would not do).
  dev = lowering_abstract_device(ctx)
  lower = mlir.lower_fun(functools.partial(_impl, call=call, jaxpr=jaxpr),
                         multiple_results=True)
  if dev is None:
    return lower(ctx, *args)
  api = _abstract_mesh_api()
  assert api is not None  # a device was found through it
  use, mesh_cls, _ = api
  with use(mesh_cls((), (), abstract_device=dev)):
    return lower(ctx, *args)


def _batch(args, dims, *, call, jaxpr):
  del jaxpr
  unmapped = lambda d: d is None or d is getattr(batching, "not_mapped", None)
  moved = [a if unmapped(d) else jax.numpy.moveaxis(a, d, 0) for a, d in zip(args, dims)]
  in_axes = [None if unmapped(d) else 0 for d in dims]
  size = next(a.shape[0] for a, ax in zip(moved, in_axes) if ax == 0)
  outs = _bind(jax.vmap(call, in_axes=in_axes, axis_size=size), moved)
  return outs, [0] * len(outs)


on_target_p = Primitive("flashvjp_on_target")
on_target_p.multiple_results = True
on_target_p.def_impl(_impl)
on_target_p.def_abstract_eval(_abstract_eval)
mlir.register_lowering(on_target_p, _lowering)
batching.primitive_batchers[on_target_p] = _batch


def _bind(call, flat):
  """call(*flat) -> a flat list of arrays, as one on_target_p equation. The call's jaxpr
  rides along as a parameter: its out_avals are the equation's, and a jaxpr walk (tests that
  read the kernels' dot precisions) sees the pallas_call inside it."""
  jaxpr = jax.make_jaxpr(lambda *f: list(call(*f)))(*flat)
  return on_target_p.bind(*flat, call=call, jaxpr=jaxpr)


def _needed() -> bool:
  """Whether lowering may lack the GPU: the host is not one (a deviceless compile)."""
  return jax.default_backend() not in _GPU and _abstract_mesh_api() is not None


def on_target(call):
  """`call` (a compiled GPU kernel: arrays in, a pytree of arrays out), lowered for the
  program's GPU. On a GPU host, `call` itself."""
  if not _needed():
    return call

  @functools.wraps(call)
  def wrapped(*args):
    flat, in_tree = jax.tree_util.tree_flatten(args)
    out_tree: list = []

    def flat_call(*f):
      outs, tree = jax.tree_util.tree_flatten(call(*jax.tree_util.tree_unflatten(in_tree, f)))
      out_tree[:] = [tree]
      return outs
    outs = _bind(flat_call, flat)
    return jax.tree_util.tree_unflatten(out_tree[0], outs)
  return wrapped


__all__ = ["on_target", "on_target_p", "lowering_abstract_device"]
