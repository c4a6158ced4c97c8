"""The program's target: which platform and how many devices the attention call compiles for.

Room: foundations (read by dispatch, the differentiation rules and the API). The target is
read from the program being built, not from the host that traces it, so that an
ahead-of-time compile for hardware this host does not have (a
`jax.experimental.topologies` mesh of 8 H100s, a TPU slice, with `jax.ShapeDtypeStruct`
inputs) gets what that hardware will run. In order:

1. the devices of the inputs' shardings: a concrete array's or a ShapeDtypeStruct's
   sharding, or, inside `jax.jit`, the abstract mesh of the tracer's type (jax >= 0.11
   carries the mesh of the jit's input shardings there, with its abstract device:
   platform and device kind);
2. the abstract mesh in context (`jax.sharding.use_abstract_mesh` / `jax.set_mesh`);
3. the default backend and its device count (what an unsharded program on this host uses).

`Target.num_devices > 1` is what makes the op partition under jit (`flashvjp._partition`);
with one device the partitioning rule is skipped (it would only trace the backend twice).
Everything here is static Python over shardings and meshes: no jnp op runs.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax

_GPU = ("gpu", "cuda", "rocm")

SOURCES = ("the inputs' shardings", "the abstract mesh in context", "the default backend",
           "a named target")

# Targets by name (`flashvjp.explain(..., target=...)`; `flashvjp.plan` compiles for the same
# names): platform, devices, device kind as XLA's deviceless topologies report it.
NAMED: dict[str, tuple[str, int, str | None]] = {
    "cpu": ("cpu", 1, None),
    "h100": ("gpu", 1, "NVIDIA H100 80GB HBM3"), "h100x8": ("gpu", 8, "NVIDIA H100 80GB HBM3"),
    "h200": ("gpu", 1, "NVIDIA H200"), "h200x8": ("gpu", 8, "NVIDIA H200"),
    "b200": ("gpu", 1, "NVIDIA B200"), "b200x8": ("gpu", 8, "NVIDIA B200"),
    # clusters: nodes of 8 GPUs (NVLink inside a node, InfiniBand between: `NODES`)
    "h100x32": ("gpu", 32, "NVIDIA H100 80GB HBM3"), "b200x64": ("gpu", 64, "NVIDIA B200"),
    "v5e": ("tpu", 1, "TPU v5 lite"), "v5ex4": ("tpu", 4, "TPU v5 lite"),
    "v6e": ("tpu", 1, "TPU v6 lite"), "v6ex4": ("tpu", 4, "TPU v6 lite"),
}


# Nodes of the cluster targets (the others are one node)
NODES: dict[str, int] = {"h100x32": 4, "b200x64": 8}


def named(target) -> Target:
  """A Target from a name in NAMED (or a Target, returned as is); no compiler needed."""
  if isinstance(target, Target):
    return target
  if not isinstance(target, str) or target.lower() not in NAMED:
    raise ValueError(f"target must be one of {', '.join(NAMED)} (or a flashvjp Target), got"
                     f" {target!r}")
  platform, n, kind = NAMED[target.lower()]
  return Target(platform, n, kind, SOURCES[3])


def home(platform: str) -> str:
  """"gpu" for any GPU spelling ("cuda", "rocm"), else the platform as given."""
  return "gpu" if platform in _GPU else platform


@dataclasses.dataclass(frozen=True)
class Target:
  """The hardware one attention call is compiled for."""
  platform: str  # "cpu", "gpu" or "tpu"
  num_devices: int  # devices of the program's mesh (1: nothing to partition)
  device_kind: str | None  # e.g. "NVIDIA H100 80GB HBM3", "TPU v5 lite"; None when unknown
  source: str  # one of SOURCES
  # every axis of the mesh is Manual: traced inside shard_map (each device's own part)
  manual: bool = False

  @property
  def local(self) -> bool:
    """Whether this host has devices of the target's platform (False: a deviceless compile)."""
    return _host_has(self.platform)

  @property
  def partition(self) -> bool:
    """Whether the op partitions under jit (more than one device in the program's mesh)."""
    return self.num_devices > 1

  def __str__(self) -> str:
    what = self.device_kind or self.platform
    where = "" if self.local else ", compiled without one (deviceless)"
    return f"{self.num_devices} x {what} ({self.platform}, from {self.source}{where})"


@functools.cache
def _host_has(platform: str) -> bool:
  if home(jax.default_backend()) == platform:
    return True
  try:
    return bool(jax.devices(platform))
  except RuntimeError:  # jax raises RuntimeError for an unknown / uninitialisable backend
    return False


def deviceless_partition_problem(target: Target) -> str | None:
  """Why this host cannot compile the op partitioned for `target`, or None.

  libtpu's deviceless (topology-only) compiler has no emitter for custom_partitioning
  ("Custom emitter for CustomSPMDPartitioning not found"), which the op needs under jit
  on a mesh of more than one TPU chip. XLA's GPU compiler (the CUDA plugin) has one.
  """
  if target.platform != "tpu" or not target.partition or target.manual or target.local:
    return None
  return (f"ahead-of-time compile for {target.num_devices} TPU chips"
          f" ({target.device_kind or 'tpu'}) on a host without a TPU: libtpu's deviceless"
          " compiler cannot compile a custom_partitioning op (\"Custom emitter for"
          " CustomSPMDPartitioning not found\"), which flash_attention under jit on a"
          " multi-chip mesh needs. Compile for one chip (e.g. 'v5e:1x1'), compile on a TPU"
          " host, or call flashvjp.sharded_attention(..., mesh=mesh, seq_axis=...) (shard_map:"
          " no custom_partitioning) inside the jit")


def _from_devices(devices, source: str) -> Target | None:
  devices = list(devices)
  if not devices:
    return None
  d = devices[0]
  return Target(home(d.platform), len(devices), getattr(d, "device_kind", None), source)


def _from_abstract_mesh(mesh, source: str) -> Target | None:
  if mesh is None or getattr(mesh, "empty", True):
    return None
  dev = getattr(mesh, "abstract_device", None)
  manual = bool(getattr(mesh, "are_all_axes_manual", False))
  if dev is None:
    return Target(home(jax.default_backend()), int(mesh.size), None, source, manual)
  return Target(home(dev.platform), int(mesh.size), dev.device_kind, source, manual)


def _from_sharding(sharding) -> Target | None:
  if sharding is None:
    return None
  mesh = getattr(sharding, "mesh", None)
  if mesh is not None and isinstance(mesh, jax.sharding.AbstractMesh):
    return _from_abstract_mesh(mesh, SOURCES[0])
  try:
    devices = sharding._device_assignment  # ordered; device_set is not
  except (AttributeError, ValueError, TypeError):
    devices = getattr(sharding, "device_set", None)
  if devices is None:
    return None
  return _from_devices(devices, SOURCES[0])


def _sharding_of(x):
  if isinstance(x, jax.core.Tracer):
    aval = getattr(x, "aval", None)
    return getattr(aval, "sharding", None)
  if isinstance(x, (jax.Array, jax.ShapeDtypeStruct)):
    try:
      return x.sharding
    except (AttributeError, ValueError, RuntimeError):
      return None
  return None


def _context_abstract_mesh():
  get = getattr(jax.sharding, "get_abstract_mesh", None)
  if get is None:
    return None
  try:
    return get()
  except (AttributeError, RuntimeError, ValueError):
    return None


def of(*xs: Any) -> Target:
  """The target of a call whose array inputs are `xs` (None entries are skipped).

  The input whose sharding spans the most devices decides; inputs without a sharding
  (numpy arrays, tracers of jax versions whose types carry no mesh) say nothing.
  """
  found = [t for t in (_from_sharding(_sharding_of(x)) for x in xs if x is not None)
           if t is not None]
  if found:
    return max(found, key=lambda t: t.num_devices)
  t = _from_abstract_mesh(_context_abstract_mesh(), SOURCES[1])
  if t is not None:
    return t
  plat = jax.default_backend()
  return Target(home(plat), jax.device_count(), jax.devices()[0].device_kind, SOURCES[2])
