"""Plan a run on a laptop: compile one attention layer for a named target without its hardware.

Room: the top floor, beside `_bench` and `cli`. `plan(target, ...)` builds
jax.ShapeDtypeStructs with NamedShardings on a `jax.experimental.topologies` mesh of the
target (8 H100s, one v5e, ...), lowers and compiles jit(value_and_grad) and jit(jvp) of
`flash_attention` with the real compiler (the CUDA plugin's XLA GPU pipeline with its
embedded Triton and ptxas, or libtpu), and reads back what that compiler says: per-device
memory (`compiled.memory_analysis()`), the collectives in the compiled HLO with their
bytes, the kernels in the program and, on GPU, their launch shape, shared memory, registers
and spills. Nothing here chooses the implementation or the strategy: the op decides from
the inputs' shardings, exactly as it would under jit on the target, and `explain` says
what it decided.

Where the GPU figures come from (XLA's embedded Triton, found by trying the dump flags):
- grid, threads and shared memory per kernel: the thunk sequence XLA writes with
  `xla_dump_to` (`*.thunk_sequence.txt`; a `compiler_options` entry of this one compile);
- registers, stack frame and spill stores / loads: ptxas's own `-v` report, which XLA
  passes on only as a VLOG line of `subprocess_compilation.cc` (level 2) when ptxas runs
  as a program. `TF_CPP_MIN_LOG_LEVEL=0` and `TF_CPP_VMODULE=subprocess_compilation=2` must be
  in the environment before jax starts its backends (`import jax` sets the first to 1 when
  unset; `python -m flashvjp plan` sets both);
  otherwise they are "not reported". Neither the HLO, the backend config nor
  `memory_analysis()` carries them, and `xla_gpu_dump_llvmir` writes no PTX in a deviceless
  compile (tried).
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib.metadata
import importlib.util
import os
import pathlib
import re
import tempfile
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from flashvjp import _api
from flashvjp import _target

_TARGET_DIR = pathlib.Path(__file__).parent / "targets"

# name -> (GPU target config file or TPU topology, HBM bytes per device); the platform and
# the device count are the named target's (`flashvjp._target.NAMED`, which explain reads).
# HBM: the GPU configs' device_memory_size; TPU v5e 16 GiB, v6e 32 GiB per chip.
_COMPILE: dict[str, tuple[str, int | None]] = {
    "h100": ("h100_sxm.txtpb", None), "h100x8": ("h100_sxm.txtpb", None),
    "h200": ("h200.txtpb", None), "h200x8": ("h200.txtpb", None),
    "b200": ("b200.txtpb", None), "b200x8": ("b200.txtpb", None),
    "h100x32": ("h100_sxm.txtpb", None), "b200x64": ("b200.txtpb", None),
    "v5e": ("v5e:1x1", 16 * 2**30), "v5ex4": ("v5e:2x2", 16 * 2**30),
    "v6e": ("v6e:1x1", 32 * 2**30), "v6ex4": ("v6e:2x2", 32 * 2**30),
}
# name -> (platform, GPU target config file or TPU topology, devices, HBM bytes per device)
TARGETS: dict[str, tuple[str, str, int, int | None]] = {
    name: (_target.NAMED[name][0], what, _target.NAMED[name][1], hbm)
    for name, (what, hbm) in _COMPILE.items()}
MODES = ("value_and_grad", "jvp")
_COLLECTIVES = ("all-gather", "collective-permute", "all-to-all", "reduce-scatter",
                "all-reduce", "ragged-all-to-all", "collective-broadcast")
_GPU_KERNEL_TARGETS = {"__gpu$xla.gpu.triton": "triton", "mosaic_gpu": "mosaic_gpu",
                       "mosaic_gpu_v2": "mosaic_gpu"}
_GPU_EXTRA = "pip install 'flashvjp[aot-gpu]'"
_TPU_EXTRA = "pip install 'flashvjp[aot-tpu]'"
_DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4,
                "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16,
                "f8e4m3fn": 1, "f8e5m2": 1, "token": 0}


@dataclasses.dataclass(frozen=True)
class Collective:
  """One collective of the compiled program: its result as the HLO states it."""

  op: str  # "all-gather", "collective-permute", ...
  shapes: tuple[str, ...]  # result arrays, e.g. ("bf16[1,8,8192,64]",)
  bytes: int  # result bytes per device of one execution
  count: int  # executions per step: HLO occurrences x trip counts of enclosing loops
  whole_sequence: bool  # an all-gather whose result holds the whole (sharded) sequence

  @property
  def total_bytes(self) -> int:
    return self.bytes * self.count


@dataclasses.dataclass(frozen=True)
class Kernel:
  """A kernel custom call of the compiled program and what the compiler reports of it."""

  name: str  # the kernel's name (GPU: as launched; TPU: the custom call's name)
  kind: str  # "triton", "mosaic_gpu" or "tpu_custom_call"
  grid: tuple[int, ...] | None = None
  threads: tuple[int, ...] | None = None
  shared_memory: int | None = None  # bytes, from XLA's thunk sequence
  registers: int | None = None  # per thread, from ptxas -v
  stack_frame: int | None = None  # bytes, from ptxas -v
  spill_stores: int | None = None
  spill_loads: int | None = None


@dataclasses.dataclass(frozen=True)
class ModePlan:
  """One compiled function (value_and_grad or jvp) of the layer on the target."""

  mode: str
  decision: Any  # flashvjp.Decision of explain() on the same ShapeDtypeStructs
  compile_seconds: float
  argument_bytes: int
  output_bytes: int
  temp_bytes: int
  generated_code_bytes: int
  collectives: tuple[Collective, ...]
  kernels: tuple[Kernel, ...]
  resources_note: str = ""
  ops: tuple[str, ...] = ()  # `entry_ops`: the program's top-level ops, kernels included
  # `link_bytes` of the compiled program: ((link class, bytes sent by the busiest device), ...)
  # when the devices span more than one node
  links: tuple = ()

  @property
  def total_bytes(self) -> int:
    """Arguments + outputs + temporaries per device (generated code not counted)."""
    return self.argument_bytes + self.output_bytes + self.temp_bytes


@dataclasses.dataclass(frozen=True)
class Plan:
  """What the target's compiler says about one attention layer (`str()`: the report)."""

  target: str
  platform: str  # "gpu" or "tpu"
  device_kind: str
  num_devices: int
  hbm_bytes: int | None
  nodes: int
  mesh: dict
  spec: tuple
  problem: dict  # batch, num_heads, num_kv_heads, seq_len, head_dim, dtype, causal, ...
  modes: tuple[ModePlan, ...]

  def mode(self, name: str) -> ModePlan:
    for m in self.modes:
      if m.mode == name:
        return m
    raise KeyError(name)

  def __str__(self) -> str:
    return _report(self)


def _mib(b: float) -> str:
  if b >= 2**40:
    return f"{b / 2**40:,.1f} TiB"
  return f"{b / 2**20:,.1f} MiB" if b < 2**30 else f"{b / 2**30:,.2f} GiB"


def _report(p: Plan) -> str:
  pr = p.problem
  mesh = ", ".join(f"{k}={v}" for k, v in p.mesh.items())
  spec = "P(" + ", ".join(repr(s) for s in p.spec) + ")"
  feats = [f for f in ("causal",) if pr["causal"]]
  if pr["window"] is not None:
    feats.append(f"window={tuple(pr['window'])}")
  if pr["segments"]:
    feats.append("segment_ids")
  lines = [
      f"plan: {p.target} ({p.num_devices} x {p.device_kind}"
      + (f" in {p.nodes} nodes of {p.num_devices // p.nodes}" if p.nodes > 1 else "")
      + f", platform {p.platform}), mesh {mesh},"
      f" q/k/v sharded {spec} over [B, H, S, D]",
      f"layer: batch {pr['batch']}, heads {pr['num_heads']} (kv {pr['num_kv_heads']}), seq"
      f" {pr['seq_len']:,}, head_dim {pr['head_dim']}, {pr['dtype']}"
      + (f", {', '.join(feats)}" if feats else "")
      + f"; implementation={pr['implementation']!r}, context_parallel={pr['context_parallel']!r}"
      + (f", ring_head_groups={pr['ring_head_groups']}"
         if pr.get("ring_head_groups", 1) != 1 else ""),
  ]
  for m in p.modes:
    lines.append("")
    lines.append(f"[{m.mode}] compiled in {m.compile_seconds:.1f} s")
    lines.append(f"  decision: {m.decision}")
    hbm = (f" of {_mib(p.hbm_bytes)} HBM ({100 * m.total_bytes / p.hbm_bytes:.1f}%)"
           if p.hbm_bytes else "")
    lines.append(f"  memory per device: arguments {_mib(m.argument_bytes)}, outputs"
                 f" {_mib(m.output_bytes)}, temp {_mib(m.temp_bytes)}, generated code"
                 f" {_mib(m.generated_code_bytes)}; total {_mib(m.total_bytes)}{hbm}")
    if m.collectives:
      total = sum(c.total_bytes for c in m.collectives)
      lines.append(f"  collectives per device (compiled HLO; result bytes x executions):"
                   f" {_mib(total)} in all")
      width = min(70, max(len(" ".join(c.shapes)) for c in m.collectives))
      for c in m.collectives:
        flag = "  <- WHOLE SEQUENCE gathered" if c.whole_sequence else ""
        lines.append(f"    {c.op:<18} x{c.count:<4} {' '.join(c.shapes)[:width]:<{width}}"
                     f"  {_mib(c.bytes)} each{flag}")
    else:
      lines.append("  collectives: none")
    if m.links:
      lines.append("  per link class (compiled HLO; bytes the busiest device sends): "
                   + ", ".join(f"{k.replace('_', ' ')} {_mib(b)}" for k, b in m.links))
    if m.kernels:
      groups: dict[Kernel, int] = {}
      for k in m.kernels:  # identical launches (a ring's steps) once, with their count
        groups[k] = groups.get(k, 0) + 1
      lines.append(f"  kernels ({len(m.kernels)} launches in the program):")
      for k, times in groups.items():
        parts = []
        if k.grid is not None:
          parts.append(f"grid {list(k.grid)}")
        if k.threads is not None:
          parts.append(f"threads {k.threads[0]}")
        if k.shared_memory is not None:
          parts.append(f"smem {k.shared_memory / 1024:.0f} KiB")
        if k.registers is not None:
          parts.append(f"{k.registers} registers")
        if k.spill_stores is not None:
          parts.append(f"spills {k.spill_stores} B stored / {k.spill_loads} B loaded,"
                       f" stack {k.stack_frame} B")
        count = f"x{times}"
        lines.append(f"    {k.kind:<16} {k.name:<24} {count:<4} {', '.join(parts)}".rstrip())
    else:
      lines.append("  kernels: none (no Pallas / Mosaic custom call in the program)")
    if m.ops:
      n_calls = sum(o == "custom-call" for o in m.ops)
      others: dict[str, int] = {}
      for o in m.ops:
        if o != "custom-call":
          others[o] = others.get(o, 0) + 1
      rest = ", ".join(f"{o} x{c}" for o, c in sorted(others.items()))
      lines.append(f"  program: {len(m.ops)} top-level ops, {n_calls} of them custom calls"
                   + (f"; the others: {rest}" if rest else ""))
    if m.resources_note:
      lines.append(f"  note: {m.resources_note}")
  return "\n".join(lines)


# ------------------------------------------------------------------ the target


def _resolve_target(target: str, num_devices: int | None):
  """(name, platform, config text or TPU topology name, devices, hbm)."""
  if not isinstance(target, str):
    raise TypeError(f"target must be a str, got {type(target).__name__}")
  key = target.lower()
  if key in TARGETS:
    platform, what, n, hbm = TARGETS[key]
    if platform == "gpu":
      what = (_TARGET_DIR / what).read_text()
    elif num_devices not in (None, n):
      raise ValueError(f"target {target!r} has {n} chips; num_devices={num_devices} needs a"
                       f" TPU topology of that size (one of {', '.join(TARGETS)})")
  elif os.path.isfile(target):
    platform, what, n, hbm = "gpu", pathlib.Path(target).read_text(), 1, None
    if "gpu_device_info" not in what:
      raise ValueError(f"target {target!r} is a file but not an XLA GPU target config (a text"
                       " proto with gpu_device_info)")
  else:
    raise ValueError(f"unknown target {target!r}: choose one of {', '.join(TARGETS)}, or the"
                     " path of an XLA GPU target config (.txtpb)")
  if platform == "gpu":
    n = num_devices or n
    m = re.search(r"device_memory_size:\s*(\d+)", what)
    hbm = int(m.group(1)) if m else None
  return key, platform, what, n, hbm


def _version(dist: str) -> str | None:
  try:
    return importlib.metadata.version(dist)
  except importlib.metadata.PackageNotFoundError:
    return None


def _release(version: str) -> tuple[int, ...]:
  """The dotted numeric prefix of a version, as jaxlib compares plugins (0.12.0.1 -> (0, 12, 0, 1))."""
  m = re.match(r"[0-9]+(?:\.[0-9]+)*", version)
  return tuple(int(x) for x in m.group(0).split(".")) if m else ()


def compiler_problem(platform: str) -> str | None:
  """Why this environment cannot compile for `platform` ("gpu" / "tpu") without the device,
  or None when it can. Read from the installed packages' metadata; imports nothing.

  GPU: the CUDA plugin (jax-cuda12-plugin with jax-cuda12-pjrt), which jaxlib loads only at its
  own exact version (`jaxlib.plugin_support.check_plugin_version`): jax often reaches the index
  before its plugin, and a newer jax beside the older plugin compiles nothing (the test
  command's test-constraints.txt pins a matching set). TPU: libtpu.
  """
  if platform == "gpu":
    plugin = _version("jax-cuda12-plugin")
    if plugin is None or importlib.util.find_spec("jax_plugins") is None:
      return ("the CUDA compiler plugin is not installed (jax-cuda12-plugin and jax-cuda12-pjrt"
              f" at jaxlib's version): {_GPU_EXTRA}")
    jaxlib = _version("jaxlib") or "?"
    pjrt = _version("jax-cuda12-pjrt")
    if _release(plugin) != _release(jaxlib):
      return (f"jax-cuda12-plugin {plugin} is installed but jaxlib is {jaxlib}: jax loads the CUDA"
              " plugin only at jaxlib's exact version. Install jax and jaxlib at the plugin's"
              f" version (pip install 'jax=={plugin}' 'jaxlib=={plugin}'), or the plugin at"
              f" jaxlib's once it is published (pip install 'jax-cuda12-plugin=={jaxlib}'"
              f" 'jax-cuda12-pjrt=={jaxlib}')")
    if pjrt is None or _release(pjrt) != _release(plugin):
      return (f"jax-cuda12-pjrt {pjrt or '(not installed)'} does not match jax-cuda12-plugin"
              f" {plugin}: pip install 'jax-cuda12-pjrt=={plugin}'")
    return None
  if platform == "tpu" and importlib.util.find_spec("libtpu") is None:
    return f"the TPU compiler (libtpu) is not installed: {_TPU_EXTRA}"
  return None


def _need_compiler(platform: str, target: str) -> None:
  problem = compiler_problem(platform)
  if problem is not None:
    raise RuntimeError(f"target {target!r} needs a compiler this environment lacks: {problem}")


@contextlib.contextmanager
def _capture_stderr():
  """Collects what C++ writes to file descriptor 2 (ptxas's report, libtpu's warnings)."""
  out: list[str] = []
  import sys
  sys.stderr.flush()
  saved = os.dup(2)
  with tempfile.TemporaryFile() as tmp:
    os.dup2(tmp.fileno(), 2)
    try:
      yield out
    finally:
      sys.stderr.flush()
      os.dup2(saved, 2)
      os.close(saved)
      tmp.seek(0)
      out.append(tmp.read().decode(errors="replace"))


def _topology(platform: str, what: str, n: int, nodes: int = 1):
  from jax.experimental import topologies
  if platform == "gpu":  # slices x hosts (one process each) x devices per host
    return topologies.get_topology_desc(platform="cuda", target_config=what,
                                        topology=f"1x{nodes}x{n // nodes}")
  return topologies.get_topology_desc(topology_name=what, platform="tpu")


# ------------------------------------------------------------------ reading the compiled HLO


_SHAPE = re.compile(r"\b([a-z]+[0-9]*(?:e[0-9]m[0-9][a-z]*)?)\[([0-9,]*)\]")


def _shapes(type_text: str) -> list[tuple[str, tuple[int, ...]]]:
  out = []
  for dt, dims in _SHAPE.findall(type_text):
    if dt in _DTYPE_BYTES:
      out.append((dt, tuple(int(d) for d in dims.split(",") if d)))
  return out


def _computations(hlo: str) -> dict[str, list[str]]:
  comps: dict[str, list[str]] = {}
  cur: list[str] | None = None
  for line in hlo.splitlines():
    if line and not line[0].isspace() and line.rstrip().endswith("{"):
      head = line.split()
      name = head[1] if head[0] == "ENTRY" else head[0]
      cur = comps.setdefault(name.lstrip("%"), [])
      if head[0] == "ENTRY":
        comps["__entry__"] = cur
    elif line.rstrip() == "}":  # not "}}, metadata=...": a multi-line backend_config's end
      cur = None
    elif cur is not None:
      cur.append(line)
  return comps


def _multiplicity(comps: dict[str, list[str]]) -> dict[str, int]:
  """Executions of each computation per program run (while bodies x known trip counts)."""
  entry = comps.get("__entry__")
  if entry is None:
    return {}
  entry_name = next(k for k, v in comps.items() if v is entry and k != "__entry__")
  mult: dict[str, int] = {}

  def visit(name: str, times: int, depth: int = 0):
    if depth > 50 or name not in comps:
      return
    mult[name] = mult.get(name, 0) + times
    for line in comps[name]:
      trip = re.search(r'"known_trip_count":\{"n":"(\d+)"', line)
      body = re.search(r"\bbody=%?([\w.\-]+)", line)
      if body:
        visit(body.group(1), times * (int(trip.group(1)) if trip else 1), depth + 1)
      for m in re.finditer(r"\b(?:calls|to_apply|true_computation|false_computation)=%?([\w.\-]+)",
                           line):
        visit(m.group(1), times, depth + 1)
      br = re.search(r"branch_computations=\{([^}]*)\}", line)
      if br:
        for b in br.group(1).split(","):
          visit(b.strip().lstrip("%"), times, depth + 1)

  visit(entry_name, 1)
  return mult


def _instructions(hlo: str):
  """(computation multiplicity, instruction name, result type text, opcode, line)."""
  comps = _computations(hlo)
  mult = _multiplicity(comps)
  pat = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*?)\s([a-z][a-z0-9\-]*)\(")
  for name, lines in comps.items():
    if name == "__entry__":
      continue
    times = mult.get(name, 1)
    for line in lines:
      m = pat.match(line)
      if m:
        yield times, m.group(1), m.group(2), m.group(3), line


# Entry-computation instructions that are not work of their own: arguments, literals, tuple
# plumbing, free reinterpretations, and the asynchronous copies and slices XLA:TPU's
# memory-space assignment adds to prefetch operands (splash attention's programs have them too).
_BOOKKEEPING = frozenset({"parameter", "constant", "tuple", "get-tuple-element", "bitcast",
                          "copy-start", "copy-done", "slice-start", "slice-done"})
# Custom calls that are XLA's own plumbing, not kernels (v6e's prefetch splits a copy in two
# slices and rejoins them with one).
_PLUMBING_CALLS = ("ConcatBitcast",)


def entry_ops(hlo: str, computation: str = "__entry__") -> tuple[str, ...]:
  """The opcodes of the compiled program's top-level instructions (its entry computation,
  or the named one: a conditional's branch), bookkeeping aside (`_BOOKKEEPING`): on a TPU
  each runs in sequence, with a fixed cost, so the ops around the kernels (a block list
  computed on the device, a layout copy) are time a short sequence or a ring step pays.
  Kernels are custom-calls."""
  entry = _computations(hlo).get(computation, [])
  pat = re.compile(r"^\s+(?:ROOT\s+)?%?[\w.\-]+\s*=\s*.*?[\s)}]([a-z][a-z0-9\-]*)\(")
  ops = []
  for line in entry:
    m = pat.match(line)
    if m is None or m.group(1) in _BOOKKEEPING:
      continue
    if m.group(1) == "custom-call" and any(f'custom_call_target="{t}"' in line
                                           for t in _PLUMBING_CALLS):
      continue
    ops.append(m.group(1))
  return tuple(ops)


def collectives(hlo: str, seq_len: int, seq_sharded: bool) -> tuple[Collective, ...]:
  """The collectives of a compiled HLO text, grouped by op and result shapes."""
  found: dict[tuple, list] = {}
  for times, _name, rtype, op, _line in _instructions(hlo):
    base = op[:-5] if op.endswith("-done") else op
    if base not in _COLLECTIVES or op.endswith("-start"):
      continue
    arrays = _shapes(rtype)
    if not arrays:
      continue
    nbytes = sum(_DTYPE_BYTES[dt] * int(np.prod(dims)) for dt, dims in arrays)
    shapes = tuple(f"{dt}[{','.join(map(str, dims))}]" for dt, dims in arrays)
    whole = base == "all-gather" and seq_sharded and any(
        seq_len in dims and int(np.prod(dims)) >= seq_len for _, dims in arrays)
    key = (base, shapes)
    if key in found:
      found[key][1] += times
    else:
      found[key] = [nbytes, times, whole]
  return tuple(Collective(op, shapes, b, c, w) for (op, shapes), (b, c, w) in found.items())


def _iota_groups(text: str):
  """XLA's iota replica groups `[G,N]<=[dims]T(perm)` as a [G, N] array of device ids."""
  m = re.match(r"\[(\d+),(\d+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", text)
  if m is None:
    return None
  dims = [int(d) for d in m.group(3).split(",")]
  ids = np.arange(int(np.prod(dims))).reshape(dims)
  if m.group(4):
    ids = ids.transpose([int(d) for d in m.group(4).split(",")])
  return ids.reshape(int(m.group(1)), int(m.group(2)))


def replica_groups(line: str, num_devices: int):
  """The device groups of a collective's HLO line (lists of partition ids), in any of the
  spellings XLA prints: explicit ``{{0,1},{2,3}}``, iota ``[2,2]<=[4]``, or Shardy's
  ``mesh['a'=2,'b'=4] {'b'}`` (groups along the named axes); None: not stated (every
  device, or a spelling this does not read)."""
  m = re.search(r"replica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}", line)
  if m:
    axes = re.findall(r"'([^']+)'=(\d+)", m.group(1))
    over = set(re.findall(r"'([^']+)'", m.group(2)))
    ids = np.arange(int(np.prod([int(n) for _, n in axes]))).reshape([int(n) for _, n in axes])
    keep = [i for i, (a, _) in enumerate(axes) if a not in over]
    move = [i for i, (a, _) in enumerate(axes) if a in over]
    size = int(np.prod([int(axes[i][1]) for i in move])) if move else 1
    return ids.transpose(keep + move).reshape(-1, size).tolist()
  m = re.search(r"replica_groups=(\[[^\s,]*?\][^\s,]*|\[\d+,\d+\]<=\[[\d,]+\](?:T\([\d,]+\))?)",
                line)
  if m:
    g = _iota_groups(m.group(1))
    if g is not None:
      return g.tolist()
  m = re.search(r"replica_groups=\{((?:\{[\d,]*\},?)*)\}", line)
  if m and m.group(1):
    return [[int(x) for x in grp.split(",") if x] for grp in re.findall(r"\{([\d,]*)\}",
                                                                        m.group(1))]
  return None


def _pairs(line: str):
  m = re.search(r"source_target_pairs=\{((?:\{\d+,\d+\},?)*)\}", line)
  return [tuple(int(x) for x in p) for p in re.findall(r"\{(\d+),(\d+)\}", m.group(1))] if m else []


def link_bytes(hlo: str, nodes) -> dict:
  """Bytes each device sends per link class in a compiled program, for the busiest device:
  {"in_node": b, "across_nodes": b}. `nodes`: the node of each partition (device) id.

  From each collective's result bytes, execution count and groups: a collective-permute
  sends its result to its target; an all-to-all or all-gather sends (n - 1) / n of its
  result to the n - 1 peers of its group, each peer's part on the link to that peer; a
  reduce-scatter or all-reduce (ring algorithm) about (n - 1) times / 2 (n - 1) / n of its
  result's bytes, counted as an all-to-all's. An estimate of the traffic, as the compiler
  placed it: the links each collective crosses.
  """
  nodes = np.asarray(nodes)
  n_dev = len(nodes)
  sent = {k: np.zeros(n_dev) for k in ("in_node", "across_nodes")}
  starts: dict[str, str] = {}
  for times, name, rtype, op, line in _instructions(hlo):
    if op.endswith("-start"):
      starts[name] = line  # its line names the groups; the -done's type is the result
      continue
    base = op[:-5] if op.endswith("-done") else op
    if base not in _COLLECTIVES:
      continue
    if op.endswith("-done"):
      m = re.search(r"-done\(%?([\w.\-]+)", line)
      line = starts.get(m.group(1), line) if m else line
    arrays = _shapes(rtype)
    if not arrays:
      continue
    nbytes = sum(_DTYPE_BYTES[dt] * int(np.prod(dims)) for dt, dims in arrays)
    if base == "collective-permute":
      for src, dst in _pairs(line):
        if src < n_dev and dst < n_dev and src != dst:
          cls = "in_node" if nodes[src] == nodes[dst] else "across_nodes"
          sent[cls][src] += times * nbytes
      continue
    groups = replica_groups(line, n_dev) or [list(range(n_dev))]
    factor = 2 if base == "all-reduce" else 1
    for grp in groups:
      n = len(grp)
      if n <= 1:
        continue
      for d in grp:
        if d >= n_dev:
          continue
        same = sum(1 for e in grp if e < n_dev and nodes[e] == nodes[d]) - 1
        part = factor * times * nbytes / n
        sent["in_node"][d] += part * same
        sent["across_nodes"][d] += part * (n - 1 - same)
  return {k: int(np.max(v)) if v.size else 0 for k, v in sent.items()}


def _kernel_calls(hlo: str, platform: str) -> list[tuple[str, str, str]]:
  """(HLO instruction name, kind, line) of the kernel custom calls."""
  out = []
  for _times, name, _rtype, op, line in _instructions(hlo):
    if op != "custom-call":
      continue
    m = re.search(r'custom_call_target="([^"]+)"', line)
    target = m.group(1) if m else ""
    if platform == "gpu" and target in _GPU_KERNEL_TARGETS:
      out.append((name, _GPU_KERNEL_TARGETS[target], line))
    elif platform == "tpu" and target == "tpu_custom_call":
      out.append((name, "tpu_custom_call", line))
  return out


_THUNK = re.compile(r"^\s*(\d+):\s+\w+\s+\[[^\]]*\]\s+(\S+)\s+grid:\s*\[([\d, ]+)\]\s+threads:"
                    r"\s*\[([\d, ]+)\]\s+shared_memory:\s*(\d+)\s*bytes")


def _thunks(dump_dir: str) -> dict[str, tuple[str, tuple, tuple, int]]:
  """HLO instruction name -> (kernel name, grid, threads, shared memory) from XLA's dump."""
  d = pathlib.Path(dump_dir)
  out: dict[str, tuple[str, tuple, tuple, int]] = {}
  for seq in sorted(d.glob("*.thunk_sequence.txt")):
    meta = seq.with_name(seq.name.replace("thunk_sequence", "thunk_metadata"))
    ids: dict[int, str] = {}
    if meta.exists():
      for ann, tid in re.findall(r'profile_annotation:\s*"([^"]*)"\s*thunk_id:\s*(\d+)',
                                 meta.read_text()):
        ids[int(tid)] = ann
    for line in seq.read_text().splitlines():
      m = _THUNK.match(line)
      if not m:
        continue
      tid, kname = int(m.group(1)), m.group(2)
      grid = tuple(int(x) for x in m.group(3).split(","))
      threads = tuple(int(x) for x in m.group(4).split(","))
      out[ids.get(tid, kname)] = (kname, grid, threads, int(m.group(5)))
  return out


_PTXAS = re.compile(
    r"Compiling entry function '([^']+)'.*?(\d+) bytes stack frame, (\d+) bytes spill stores,"
    r" (\d+) bytes spill loads.*?Used (\d+) registers", re.S)


def ptxas_report(log: str) -> dict[str, tuple[int, int, int, int]]:
  """kernel name -> (registers, stack frame, spill stores, spill loads) from ptxas -v lines."""
  out = {}
  for m in _PTXAS.finditer(log):
    out[m.group(1)] = (int(m.group(5)), int(m.group(2)), int(m.group(3)), int(m.group(4)))
  return out


# ------------------------------------------------------------------ plan


def _spec_tuple(spec) -> tuple:
  spec = tuple(spec) if spec is not None else (None, None, "sp", None)
  if len(spec) != 4:
    raise ValueError(f"spec must name the mesh axes of the 4 dimensions [B, H, S, D], got {spec}")
  return spec


def _axes(entry) -> tuple:
  if entry is None:
    return ()
  return tuple(entry) if isinstance(entry, (tuple, list)) else (entry,)


def plan(target: str = "h100x8", *, batch: int = 1, num_heads: int = 32,
         num_kv_heads: int | None = None, seq_len: int = 8192, head_dim: int = 128,
         dtype: str = "bfloat16", causal: bool = False,
         window: tuple[int | None, int | None] | None = None, segment_ids: bool = False,
         mesh: dict[str, int] | None = None, spec=None, num_devices: int | None = None,
         implementation: str | None = None, context_parallel: str = "auto",
         modes: tuple[str, ...] | list[str] = MODES, ring_head_groups: int = 1,
         nodes: int | None = None) -> Plan:
  """Compiles one attention layer for `target` on this machine and reports what the compiler says.

  No target hardware is needed: the compile runs deviceless (`jax.experimental.topologies`)
  with the real compiler of the target, which must be installed: the CUDA plugin for GPU
  targets (``pip install 'flashvjp[aot-gpu]'``), libtpu for TPU targets
  (``pip install 'flashvjp[aot-tpu]'``). Run it where jax uses the CPU
  (``JAX_PLATFORMS=cpu``; ``python -m flashvjp plan`` sets it when unset).

  Args:
    target: "h100", "h100x8", "h200", "h200x8", "b200", "b200x8" (GPU, one device or an
      8-GPU node), "h100x32" (4 nodes of 8 H100s), "b200x64" (8 nodes of 8 B200s), "v5e",
      "v6e" (one TPU chip), "v5ex4", "v6ex4" (2x2 TPU; the deviceless
      TPU compile of a partitioned flashvjp op fails in libtpu, see docs/plan.md), or the
      path of an XLA GPU target config text proto.
    batch, num_heads, num_kv_heads, seq_len, head_dim, dtype: the layer; q is
      [batch, num_heads, seq_len, head_dim], k and v [batch, num_kv_heads, ...]
      (num_kv_heads None: num_heads).
    causal, window, segment_ids: the mask (segment_ids=True adds int32 [batch, seq_len]
      document ids, sharded as the sequence).
    mesh: mesh axis name -> size, in order (default: {"sp": all the target's devices};
      on several nodes {"node": nodes, "gpu": devices per node}).
    spec: the mesh axes of q/k/v's [B, H, S, D] dimensions, a PartitionSpec or 4-tuple
      (default: P(None, None, "sp", None), the sequence over "sp"; on several nodes over
      ("node", "gpu")).
    num_devices: GPU targets only: devices of the topology (default: the target's).
    nodes: GPU targets only: the devices spread over this many nodes (hosts: one process
      each, NVLink inside, InfiniBand between), e.g. ``target="h100x8", nodes=4`` for 4
      nodes of 8 (default: the target's, `flashvjp._target.NODES`; 1 for the others).
    implementation, context_parallel, ring_head_groups: passed to flash_attention
      (defaults: the op decides; one ring for every head).
    modes: of "value_and_grad" (jit(value_and_grad) of sum(out) w.r.t. q, k, v) and "jvp"
      (jit(jvp) in q, k, v).

  Returns:
    A Plan; ``print(plan)`` shows the report: per mode the decision (explain() on the same
    ShapeDtypeStructs), per-device memory, collectives, kernels and their resources.

  Raises:
    ValueError: an unknown target or mode, or a mesh / spec that does not fit.
    RuntimeError: the target's compiler is not installed, or it cannot compile deviceless.
  """
  name, platform, what, n, hbm = _resolve_target(target, num_devices)
  unknown = [m for m in modes if m not in MODES]
  if unknown or not modes:
    raise ValueError(f"modes must be a non-empty subset of {MODES}, got {list(modes)}")
  n_nodes = _target.NODES.get(name, 1)
  if nodes is not None:
    if isinstance(nodes, bool) or not isinstance(nodes, int) or nodes < 1:
      raise ValueError(f"nodes must be a positive int, got {nodes!r}")
    if platform != "gpu" and nodes != 1:
      raise ValueError(f"nodes applies to GPU targets; {target!r} is a TPU topology")
    if num_devices is None:  # nodes of the target's node size
      n = n // n_nodes * nodes
    n_nodes = nodes
  if n % n_nodes:
    raise ValueError(f"{n} devices cannot be spread evenly over {n_nodes} nodes")
  if spec is None and not mesh and n_nodes > 1:
    mesh, spec = {"node": n_nodes, "gpu": n // n_nodes}, (None, None, ("node", "gpu"), None)
  spec_t = _spec_tuple(spec)
  mesh = dict(mesh) if mesh else {"sp": n}
  if int(np.prod(list(mesh.values()))) != n:
    raise ValueError(f"mesh {mesh} has {int(np.prod(list(mesh.values())))} devices; target"
                     f" {target!r} has {n}")
  for e in spec_t:
    for a in _axes(e):
      if a not in mesh:
        raise ValueError(f"spec {spec_t} names mesh axis {a!r}, not in mesh {mesh}")
  _need_compiler(platform, target)
  _cpu_host()
  from jax.experimental import topologies
  with _capture_stderr() as noise:
    try:
      topo = _topology(platform, what, n, n_nodes)
      jmesh = topologies.make_mesh(topo, tuple(mesh.values()), tuple(mesh.keys()))
    except Exception as e:  # the plugin is there but does not start
      hint = ""
      if "not implemented" in str(e):
        hint = (" (jax started its backends without JAX_PLATFORMS=cpu: the compiler plugin"
                " gives a deviceless topology only while jax runs on the CPU; set"
                " JAX_PLATFORMS=cpu before the first jax computation)")
      raise RuntimeError(f"cannot build the {target!r} topology with the installed compiler:"
                         f" {e}{hint}") from e
  del noise
  device_kind = topo.devices[0].device_kind
  hkv = num_kv_heads or num_heads
  dt = jnp.dtype(dtype)
  sharding = NamedSharding(jmesh, P(*spec_t))
  q = jax.ShapeDtypeStruct((batch, num_heads, seq_len, head_dim), dt, sharding=sharding)
  kv = jax.ShapeDtypeStruct((batch, hkv, seq_len, head_dim), dt, sharding=sharding)
  kw: dict[str, Any] = dict(causal=causal, window=window, implementation=implementation,
                            context_parallel=context_parallel,
                            ring_head_groups=ring_head_groups)
  seg = None
  if segment_ids:
    seg = jax.ShapeDtypeStruct((batch, seq_len), jnp.int32,
                               sharding=NamedSharding(jmesh, P(spec_t[0], spec_t[2])))
  seq_shards = int(np.prod([mesh[a] for a in _axes(spec_t[2])])) if _axes(spec_t[2]) else 1
  problem = dict(batch=batch, num_heads=num_heads, num_kv_heads=hkv, seq_len=seq_len,
                 head_dim=head_dim, dtype=dt.name, causal=causal, window=window,
                 segments=segment_ids, implementation=implementation,
                 context_parallel=context_parallel, ring_head_groups=ring_head_groups)
  # the node of each partition id (the mesh's devices in order: the program's assignment)
  node_of = ([d.process_index for d in np.asarray(jmesh.devices).flat] if n_nodes > 1
             else None)
  results = []
  for mode in modes:
    results.append(_compile_mode(mode, q, kv, seg, kw, platform, target, n, seq_len,
                                 seq_shards > 1, node_of))
  return Plan(target=name if name in TARGETS else target, platform=platform,
              device_kind=device_kind, num_devices=n, hbm_bytes=hbm, nodes=n_nodes, mesh=mesh,
              spec=spec_t, problem=problem, modes=tuple(results))


def _functions(mode: str, seg, kw):
  def attn(q, k, v, s):
    return _api.flash_attention(q, k, v, segment_ids=s, **kw)

  if mode == "value_and_grad":
    def loss(q, k, v, s):
      return jnp.sum(attn(q, k, v, s).astype(jnp.float32))

    def f(q, k, v, s):
      return jax.value_and_grad(loss, argnums=(0, 1, 2))(q, k, v, s)
    return f, 3

  def g(q, k, v, s, tq, tk, tv):
    return jax.jvp(lambda a, b, c: attn(a, b, c, s), (q, k, v), (tq, tk, tv))
  return g, 6


def _cpu_host() -> None:
  """JAX_PLATFORMS=cpu when nothing chose the platforms and no backend has started yet.

  The plugins compile deviceless only when jax runs on the CPU: with the platforms unset jax
  would start (and fail to start) the CUDA and TPU backends of this host. Once a backend
  runs, the choice is left as it is.
  """
  from jax._src import xla_bridge
  if not jax.config.jax_platforms and not xla_bridge.backends_are_initialized():
    jax.config.update("jax_platforms", "cpu")


def _compile_mode(mode, q, kv, seg, kw, platform, target, n, seq_len, seq_sharded,
                  node_of=None) -> ModePlan:
  decision = _api.explain(q, kv, kv, segment_ids=seg, **kw)
  fn, _ = _functions(mode, seg, kw)
  args = (q, kv, kv, seg) if mode == "value_and_grad" else (q, kv, kv, seg, q, kv, kv)
  with tempfile.TemporaryDirectory(prefix="flashvjp_plan_") as dump:
    options: dict[str, Any] = {}
    if platform == "gpu":
      options = {"xla_dump_to": dump, "xla_gpu_ptx_compiler_extra_flags": "-v"}
    start = time.perf_counter()
    with _capture_stderr() as log:
      try:
        compiled = jax.jit(fn).lower(*args).compile(compiler_options=options or None)
      except Exception as e:
        raise _compile_error(e, platform, target, n) from e
    seconds = time.perf_counter() - start
    thunks = _thunks(dump) if platform == "gpu" else {}
  stderr = log[0] if log else ""
  _replay(stderr)
  mem = compiled.memory_analysis()
  if mem is None:
    raise RuntimeError(f"the {target!r} compiler reported no memory analysis")
  hlo = compiled.as_text() or ""
  ptxas = ptxas_report(stderr)
  kernels = []
  for inst, kind, _line in _kernel_calls(hlo, platform):
    kname, grid, threads, smem = thunks.get(inst, (inst, None, None, None))
    regs = ptxas.get(kname)
    kernels.append(Kernel(kname, kind, grid, threads, smem,
                          *(regs if regs else (None, None, None, None))))
  note = ""
  if platform == "gpu" and kernels and all(k.registers is None for k in kernels):
    note = ("registers / spills not reported: ptxas's -v report reaches flashvjp as a VLOG"
            " line only when TF_CPP_MIN_LOG_LEVEL=0 and TF_CPP_VMODULE=subprocess_compilation=2"
            " are in os.environ before jax starts its backends (import jax sets the first to 1"
            " when unset; python -m flashvjp plan sets them), and"
            " only for kernels not compiled before in this process")
  elif platform == "tpu" and kernels:
    note = ("no per-kernel resources (VMEM, registers) for TPU kernels: none found in libtpu's"
            " deviceless compile")
  return ModePlan(mode=mode, decision=decision, compile_seconds=seconds,
                  argument_bytes=int(mem.argument_size_in_bytes),
                  output_bytes=int(mem.output_size_in_bytes),
                  temp_bytes=int(mem.temp_size_in_bytes),
                  generated_code_bytes=int(mem.generated_code_size_in_bytes),
                  collectives=collectives(hlo, seq_len, seq_sharded), kernels=tuple(kernels),
                  resources_note=note, ops=entry_ops(hlo),
                  links=(tuple(link_bytes(hlo, node_of).items()) if node_of is not None
                         else ()))


_NOISE = re.compile(r"ptxas info|^\s+\d+ bytes stack frame|subprocess_compilation\.cc|"
                    r"^[IW]\d{4} |TPU_ACCELERATOR_TYPE|TPU_WORKER_HOSTNAMES|"
                    r"Source Location Trace|libtpu_init_utils|^\s*$|^=+")


def _replay(stderr: str) -> None:
  """Passes on what the compile wrote to stderr, less the ptxas report and INFO lines."""
  import sys
  keep = [l for l in stderr.splitlines() if not _NOISE.search(l)]
  if keep:
    print("\n".join(keep), file=sys.stderr)


def _compile_error(e: Exception, platform: str, target: str, n: int) -> Exception:
  msg = str(e)
  if platform == "tpu" and isinstance(e, NotImplementedError) and "deviceless" in msg:
    return RuntimeError(f"target {target!r} ({n} TPU chips): {msg}. To plan: target 'v5e' or"
                        " 'v6e' (one chip).")
  if platform == "tpu" and "CustomSPMDPartitioning" in msg:
    return RuntimeError(
        f"target {target!r} ({n} TPU chips): libtpu cannot compile a partitioned flashvjp op"
        " without a TPU (deviceless TPU compile: 'Custom emitter for CustomSPMDPartitioning"
        " not found'; jax.experimental.custom_partitioning needs the TPU runtime). Plan one"
        " chip ('v5e', 'v6e'), or run the plan on a TPU host.")
  if platform == "gpu" and "ptxas" in msg.lower():
    return RuntimeError(f"target {target!r}: the CUDA compiler needs ptxas (a CUDA toolkit on"
                        f" PATH, or the nvidia-cuda-nvcc wheel: {_GPU_EXTRA}): {msg[:500]}")
  return RuntimeError(f"compiling for target {target!r} failed: {msg[:2000]}")


# ------------------------------------------------------------------ python -m flashvjp plan


_PLAN_DESCRIPTION = """\
Compile one attention layer's forward+backward (jit(value_and_grad)) and jvp for a named
target WITHOUT that hardware, and print what the target's real compiler says: per-device
memory (arguments, outputs, temporaries, generated code), the implementation and the
context-parallel strategy flashvjp chose (explain), the collectives of the compiled program
with their bytes (an all-gather of the whole sequence is flagged), the kernels with their
launch grid, shared memory, registers and spills (GPU; ptxas's report), and the compile time.

GPU targets need the CUDA compiler plugin (pip install 'flashvjp[aot-gpu]'), TPU targets
libtpu (pip install 'flashvjp[aot-tpu]'). jax runs on the CPU here: this command sets
JAX_PLATFORMS=cpu (when unset), TF_CPP_MIN_LOG_LEVEL=0 and adds subprocess_compilation=2
to TF_CPP_VMODULE: these two let ptxas's register report through; the other log lines are
dropped. A 128k-token layer on h100x8 compiles in under a minute on a laptop.

Example: python -m flashvjp plan --target h100x8 --seq-len 131072 --num-heads 32
         --num-kv-heads 8 --head-dim 128 --causal
"""


def _mesh_arg(text: str) -> dict:
  out = {}
  for part in text.split(","):
    name, sep, size = part.partition("=")
    if not sep or not name or not size.isdigit():
      raise argparse.ArgumentTypeError(f"mesh must be NAME=SIZE[,NAME=SIZE...], got {text!r}")
    out[name.strip()] = int(size)
  return out


def _spec_arg(text: str) -> tuple:
  parts = [p.strip() for p in text.split(",")]
  if len(parts) != 4:
    raise argparse.ArgumentTypeError(
        f"spec must give the mesh axes of [B, H, S, D], 4 comma-separated entries (None or"
        f" an axis, a+b for several), got {text!r}")
  out: list = []
  for p in parts:
    if p in ("", "None", "none", "-"):
      out.append(None)
    elif "+" in p:
      out.append(tuple(p.split("+")))
    else:
      out.append(p)
  return tuple(out)


def add_plan_parser(subparsers):
  """Adds `plan` to the subparsers of `python -m flashvjp`; returns the parser."""
  p = subparsers.add_parser(
      "plan", help="compile a layer for a named GPU/TPU target without it: memory, strategy,"
      " collectives, kernels", formatter_class=argparse.RawDescriptionHelpFormatter,
      description=_PLAN_DESCRIPTION)
  p.add_argument("--target", default="h100x8",
                 help=f"one of {', '.join(TARGETS)}, or the path of an XLA GPU target config"
                 " text proto (default: h100x8)")
  p.add_argument("--batch", type=int, default=1, help="batch size (default 1)")
  p.add_argument("--num-heads", type=int, default=32, help="query heads (default 32)")
  p.add_argument("--num-kv-heads", type=int, help="key/value heads (default: --num-heads)")
  p.add_argument("--seq-len", type=int, default=8192, help="sequence length (default 8192)")
  p.add_argument("--head-dim", type=int, default=128, help="head dim (default 128)")
  p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"),
                 help="q/k/v dtype (default bfloat16)")
  p.add_argument("--causal", action="store_true", help="causal mask")
  p.add_argument("--window", type=int, nargs=2, metavar=("LEFT", "RIGHT"),
                 help="local window: q_pos - LEFT <= kv_pos <= q_pos + RIGHT")
  p.add_argument("--segment-ids", action="store_true",
                 help="add int32 [batch, seq] document ids (packed sequences)")
  p.add_argument("--mesh", type=_mesh_arg,
                 help="mesh axes NAME=SIZE[,NAME=SIZE] (default: sp=<all the target's devices>)")
  p.add_argument("--spec", type=_spec_arg,
                 help="mesh axes of q/k/v's [B, H, S, D], e.g. None,None,sp,None (the default)"
                 " or dp,None,sp,None")
  p.add_argument("--num-devices", type=int, help="GPU targets: devices (default: the target's)")
  p.add_argument("--nodes", type=int,
                 help="GPU targets: spread the devices over N nodes (NVLink inside, InfiniBand"
                      " between; default: the target's, e.g. 4 for h100x32); --target h100x8"
                      " --nodes 4 is 4 nodes of 8")
  p.add_argument("--implementation", help="force an implementation (default: flashvjp decides)")
  p.add_argument("--context-parallel", default="auto",
                 choices=("auto", "ring", "ulysses", "usp", "all_gather"),
                 help="context-parallel strategy (default auto)")
  p.add_argument("--ring-head-groups", type=int, default=1,
                 help="ring / all_gather: run it once per group of kv heads, one group after"
                      " the other (1/N of its per-device state; default 1)")
  p.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES),
                 help="what to compile (default: value_and_grad jvp)")
  return p


def run_plan(args) -> int:
  """`python -m flashvjp plan`: prints the report; 0, or 2 on an error it can explain."""
  import sys

  from jax._src import xla_bridge
  if not xla_bridge.backends_are_initialized():
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    # jax's import set it to 1 (setdefault) unless it was set; the lines it lets through are
    # read or dropped by the plan (_replay), never shown.
    os.environ["TF_CPP_MIN_LOG_LEVEL"] = "0"
    if "subprocess_compilation" not in os.environ.get("TF_CPP_VMODULE", ""):
      os.environ["TF_CPP_VMODULE"] = ",".join(
          v for v in (os.environ.get("TF_CPP_VMODULE"), "subprocess_compilation=2") if v)
    _cpu_host()
  window = tuple(args.window) if args.window else None
  try:
    result = plan(args.target, batch=args.batch, num_heads=args.num_heads,
                  num_kv_heads=args.num_kv_heads, seq_len=args.seq_len, head_dim=args.head_dim,
                  dtype=args.dtype, causal=args.causal, window=window,
                  segment_ids=args.segment_ids, mesh=args.mesh, spec=args.spec,
                  num_devices=args.num_devices, implementation=args.implementation,
                  context_parallel=args.context_parallel, modes=tuple(args.modes),
                  ring_head_groups=args.ring_head_groups, nodes=args.nodes)
  except (ValueError, RuntimeError) as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  print(result)
  return 0
