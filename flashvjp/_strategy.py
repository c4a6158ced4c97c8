"""Which context-parallel strategy a sequence-sharded call runs under plain jit, and why.

Room: partitioning / cost model. Python and numpy only (no jax op): every figure is
known from the mesh axis size, the local shapes, the dtype and the mask's static
structure (the ring's own schedule, `flashvjp.ring._schedule`). One place, unit-tested
(tests/test_partition_seq.py), used by the partitioning rule (`flashvjp._partition`) and by
`flashvjp.explain`.

Strategies, per device, P = devices on the sequence axes, local shapes after the batch /
head sharding (see ../shared/CP.md):

* ``"ring"``: K/V chunks travel with ``ppermute``; only the steps some device needs are
  taken (a window or chunked mask moves only the chunks attended). Memory O(S / P).
* ``"ulysses"``: ``all_to_all`` trades the sequence for heads (needs num_heads and
  num_kv_heads divisible by P), then the one-device op runs on the whole sequence for
  H / P heads, and ``all_to_all`` trades back. Memory O(S / P) (the same element count);
  balanced work whatever the mask; moves the same bytes whatever the mask.
* ``"all_gather"``: K/V all-gathered once (Llama 3), dK/dV reduce-scattered. Memory O(S)
  for K/V: never chosen by ``"auto"``, only when asked.

``"auto"`` takes the eligible strategy (ring or Ulysses) that moves the fewest bytes
(forward + backward), the ring on a tie. Byte counts are estimates from the shapes (what
the compiled HLO's collectives carry; `benchmarks/cp_strategies.py` checks them against
the HLO).
"""
from __future__ import annotations

import dataclasses
import typing
from collections.abc import Callable

import numpy as np

from flashvjp.ring import _schedule

REQUESTS = ("auto", "ring", "ulysses", "usp", "all_gather")
LINKS = ("in_node", "across_nodes")

# Per-device link bandwidths (bytes / s, one direction) by device kind: the in-node fabric
# (NVLink / ICI) and the links between nodes (InfiniBand / DCN), for the time on the slowest
# link (`Strategy.link_seconds`). Estimates from the vendors' figures: H100 / H200 NVLink 4
# 450 GB/s and one 400 Gb/s NIC per GPU; B200 NVLink 5 900 GB/s, 400 Gb/s NICs; TPU v5e /
# v6e ICI 200 / 400 GB/s a chip, DCN ~25 GB/s a chip. Other kinds: the H100's (the ratio is
# what a choice reads).
BANDWIDTHS: dict[str, tuple[float, float]] = {
    "H100": (450e9, 50e9), "H200": (450e9, 50e9), "B200": (900e9, 50e9),
    "GB200": (900e9, 50e9), "TPU v5": (200e9, 25e9), "TPU v6": (400e9, 25e9),
}
DEFAULT_BANDWIDTHS = BANDWIDTHS["H100"]


def bandwidths(device_kind: str | None) -> tuple[float, float]:
  """(in-node, across-nodes) bytes / s per device for a device kind (`BANDWIDTHS`)."""
  for name, bw in sorted(BANDWIDTHS.items(), key=lambda kv: -len(kv[0])):
    if device_kind and name in device_kind:
      return bw
  return DEFAULT_BANDWIDTHS


@dataclasses.dataclass(frozen=True)
class Problem:
  """The static facts of one sequence-sharded call (local = after batch / head sharding)."""

  num_shards: int  # P: devices on the sequence axes
  batch: int  # local batch
  heads: int  # local num_heads
  kv_heads: int  # local num_kv_heads
  seq_q: int  # global
  seq_kv: int  # global
  head_dim: int
  head_dim_v: int
  itemsize: int  # of q / k / v
  causal: bool = False
  window: tuple | None = None
  mask_mod_hint: Callable | None = None
  # bias / mask Ulysses cannot split by heads: full in exactly one of heads and rows
  pairs_not_split_by_heads: tuple[str, ...] = ()
  pair_bytes: int = 0  # bytes of the local rows of a bias / mask with a q dim (Ulysses moves them)
  has_segments: bool = False
  head_groups: int = 1  # ring_head_groups: the ring / all-gather run per group of kv heads
  # The sequence's mesh axes, major to minor, with their sizes and their links ("in_node",
  # "across_nodes", or None: unknown): the hierarchical splits and the time per link class.
  axes: tuple = ()  # ((name, size, link), ...); () : one group of num_shards, links unknown
  bandwidth: tuple = DEFAULT_BANDWIDTHS  # (in-node, across-nodes) bytes / s per device

  @property
  def local_q(self) -> int:
    return self.seq_q // self.num_shards

  @property
  def local_kv(self) -> int:
    return self.seq_kv // self.num_shards

  @property
  def links_known(self) -> bool:
    return bool(self.axes) and all(a[2] in LINKS for a in self.axes)


@dataclasses.dataclass(frozen=True)
class Strategy:
  """The choice: `name` runs over `seq_axes`; bytes are per device, estimated.

  For "usp", `ulysses_axes` (the inner, minor axes) run Ulysses and `ring_axes` the ring.
  `link_bytes`: {"in_node" / "across_nodes" / "unknown": bytes} on the busiest device
  (forward + backward); `link_seconds`: the time on the slowest link class (None when a
  link is unknown).
  """

  name: str  # "ring" | "ulysses" | "usp" | "all_gather"
  seq_axes: tuple
  num_shards: int
  reason: str
  bytes_forward: int
  bytes_backward: int
  memory: str
  candidates: tuple = ()  # ((name, total bytes or None, note), ...) as weighed
  head_groups: int = 1  # the ring run once per group of kv heads, one after the other
  ulysses_axes: tuple = ()
  ring_axes: tuple = ()
  ulysses_shards: int = 1  # usp: devices on ulysses_axes (the ring's: num_shards / this)
  link_bytes: tuple = ()  # ((link class, bytes), ...)
  link_seconds: float | None = None

  def __str__(self) -> str:
    mib = lambda b: f"{b / 2**20:.2f} MiB"
    groups = (f", in {self.head_groups} head groups one after the other"
              if self.head_groups > 1 else "")
    split = ""
    if self.name == "usp":
      split = f" (Ulysses over {self.ulysses_axes}, the ring over {self.ring_axes})"
    links = ""
    if self.link_bytes:
      links = "; per link class " + ", ".join(f"{k} {mib(b)}" for k, b in self.link_bytes)
      if self.link_seconds is not None:
        links += f" ({_time(self.link_seconds)} on the slowest link)"
    return (f"{self.name} over {self.seq_axes}{split} ({self.num_shards} shards{groups}):"
            f" {self.reason}; moves ~{mib(self.bytes_forward)} forward +"
            f" {mib(self.bytes_backward)} backward per device{links}; holds {self.memory}")


def ring_moves(p: Problem) -> tuple[int, int]:
  """(K/V chunk moves, dK/dV accumulator moves) of the ring's static schedule.

  K/V move before each taken step but a first one at shift 0; the backward's dK/dV
  accumulators travel with them and return to their owner after the last step, except
  that the own chunk's gradient (a first step at shift 0) stays home
  (`flashvjp.ring._backend.backward`).
  """
  n = p.num_shards
  steps = _schedule._steps(n, "contiguous", bool(p.causal), p.window, p.local_q, p.local_kv,
                           p.mask_mod_hint)
  if not steps:
    return 0, 0
  moves = sum(1 for a, b in zip(steps, steps[1:]) if b.shift != a.shift)
  home_first = steps[0].shift % n == 0
  moves += not home_first
  back = steps[-1].shift % n != 0  # the travelling accumulator returns to its owner
  return moves, moves - (home_first and len(steps) > 1) + back


def _ring_bytes(p: Problem) -> tuple[int, int] | str:
  if p.causal and p.seq_q != p.seq_kv:
    return "causal with seq_q != seq_kv: the chunks of q and kv differ"
  it, acc = p.itemsize, max(p.itemsize, 4)
  kv_chunk = p.batch * p.kv_heads * p.local_kv * (p.head_dim + p.head_dim_v) * it
  seg_chunk = p.batch * p.local_kv * 4 if p.has_segments else 0
  dkv_chunk = p.batch * p.kv_heads * p.local_kv * (p.head_dim + p.head_dim_v) * acc
  kv_moves, dkv_moves = ring_moves(p)
  # backward: K/V (and ids) move as in the forward, the dK/dV accumulators (float32) too
  return (kv_moves * (kv_chunk + seg_chunk),
          kv_moves * (kv_chunk + seg_chunk) + dkv_moves * dkv_chunk)


def _ulysses_bytes(p: Problem, n: int, what: str) -> tuple[int, int] | str:
  """Ulysses over n of the P shards (n = P: over all), per device (local rows S / P)."""
  if p.heads % n or p.kv_heads % n:
    return (f"num_heads ({p.heads}) and num_kv_heads ({p.kv_heads}) per device must"
            f" be divisible by the {n} {what}")
  if p.pairs_not_split_by_heads:
    return (f"{', '.join(p.pairs_not_split_by_heads)} cannot be split by heads (it"
            " needs both its head and query dims full, or neither)")
  it = p.itemsize
  # every all_to_all keeps 1/n of its operand and sends the rest
  share = (n - 1) / n
  q_b = p.batch * p.heads * p.local_q * p.head_dim * it
  o_b = p.batch * p.heads * p.local_q * p.head_dim_v * it
  lse_b = p.batch * p.heads * p.local_q * 4
  kv_b = p.batch * p.kv_heads * p.local_kv * (p.head_dim + p.head_dim_v) * it
  seg_b = (n - 1) * p.batch * (p.local_q + p.local_kv) * 4 if p.has_segments else 0
  fwd = share * (q_b + kv_b + o_b + lse_b + p.pair_bytes) + seg_b
  # backward: q k v dO lse and dlse - rowsum(dO * O) (O stays: `flashvjp._delta`), then
  # dq dk dv (dbias) back, in the inputs' dtype
  bwd = share * (q_b + kv_b + o_b + 2 * lse_b + p.pair_bytes
                 + q_b + kv_b + p.pair_bytes) + seg_b
  return int(fwd), int(bwd)


def _prod(xs) -> int:
  return int(np.prod([x for x in xs], dtype=np.int64)) if xs else 1


def _split_of(p: Problem, k: int):
  """(outer axes, inner axes, outer size, inner size) of split k of the sequence's axes."""
  outer, inner = p.axes[:k], p.axes[k:]
  return (tuple(a[0] for a in outer), tuple(a[0] for a in inner), _prod([a[1] for a in outer]),
          _prod([a[1] for a in inner]))


def usp_splits(p: Problem) -> tuple[int, ...]:
  """The hierarchical splits: k outer axes run the ring, the minor rest Ulysses."""
  return tuple(range(1, len(p.axes)))


def _usp_bytes(p: Problem, k: int):
  """((fwd, bwd) of the Ulysses part, (fwd, bwd) of the ring part) of split k, or why not."""
  _, inner, n_out, n_in = _split_of(p, k)
  u = _ulysses_bytes(p, n_in, f"shards of the inner axes {inner}")
  if isinstance(u, str):
    return u
  ring_p = dataclasses.replace(p, num_shards=n_out, heads=p.heads // n_in,
                               kv_heads=p.kv_heads // n_in, axes=p.axes[:k])
  if p.head_groups != 1 and (ring_p.heads % p.head_groups or ring_p.kv_heads % p.head_groups):
    return (f"ring_head_groups={p.head_groups} must divide the ring's num_heads"
            f" ({ring_p.heads}) and num_kv_heads ({ring_p.kv_heads}) after Ulysses")
  r = _ring_bytes(ring_p)
  if isinstance(r, str):
    return r
  return u, r


def _link_of(axes) -> str:
  """The link class a collective over `axes` ((name, size, link), ...) crosses on the busiest
  device: across nodes if any axis is, unknown if any is."""
  links = [a[2] for a in axes if a[1] > 1]
  if any(l not in LINKS for l in links):
    return "unknown"
  return "across_nodes" if "across_nodes" in links else "in_node"


def _a2a_links(axes, total: int) -> dict:
  """An all-to-all over `axes`: of the bytes a device sends, those to its node's peers and
  those to other nodes."""
  if _link_of(axes) == "unknown":
    return {"unknown": total}
  n = _prod([a[1] for a in axes])
  n_in = _prod([a[1] for a in axes if a[2] == "in_node"])
  if n <= 1:
    return {}
  return {"in_node": total * (n_in - 1) // (n - 1),
          "across_nodes": total * (n - n_in) // (n - 1)}


def _add(d: dict, e: dict) -> dict:
  out = dict(d)
  for k, v in e.items():
    if v:
      out[k] = out.get(k, 0) + int(v)
  return out


def _seconds(p: Problem, links: dict) -> float | None:
  if "unknown" in links or not p.links_known:
    return None
  bw = dict(zip(LINKS, p.bandwidth))
  return max((b / bw[k] for k, b in links.items()), default=0.0)


def _axes_or_group(p: Problem) -> tuple:
  return p.axes or (("?", p.num_shards, None),)


def costs(p: Problem) -> dict:
  """{name: (forward bytes, backward bytes) or a string saying why it cannot run}; the
  hierarchical splits as "usp:k" (k outer axes)."""
  n = p.num_shards
  it, acc = p.itemsize, max(p.itemsize, 4)
  out: dict[str, tuple[int, int] | str] = {}
  out["ring"] = _ring_bytes(p)
  out["ulysses"] = _ulysses_bytes(p, n, "sequence shards")
  for k in usp_splits(p):
    b = _usp_bytes(p, k)
    out[f"usp:{k}"] = b if isinstance(b, str) else (b[0][0] + b[1][0], b[0][1] + b[1][1])
  kv_chunk = p.batch * p.kv_heads * p.local_kv * (p.head_dim + p.head_dim_v) * it
  seg_chunk = p.batch * p.local_kv * 4 if p.has_segments else 0
  dkv_chunk = p.batch * p.kv_heads * p.local_kv * (p.head_dim + p.head_dim_v) * acc
  gather = (n - 1) * (kv_chunk + seg_chunk)
  out["all_gather"] = (gather, gather + (n - 1) * dkv_chunk)
  if p.causal and p.seq_q != p.seq_kv:
    out["all_gather"] = out["ring"]
  return out


def link_bytes(p: Problem, name: str) -> dict:
  """{link class: bytes} (forward + backward) of an eligible candidate on the busiest device."""
  axes = _axes_or_group(p)
  c = costs(p)[name]
  assert isinstance(c, tuple)
  if name in ("ring", "all_gather"):
    return {_link_of(axes): sum(c)}
  if name == "ulysses":
    return _a2a_links(axes, sum(c))
  k = int(name.split(":")[1])
  u, r = typing.cast(tuple, _usp_bytes(p, k))
  return _add(_a2a_links(p.axes[k:], sum(u)), {_link_of(p.axes[:k]): sum(r)})


def choose(request: str | None, p: Problem, seq_axes: tuple) -> Strategy:
  """The strategy for `request` ("auto" / None, "ring", "ulysses", "usp", "all_gather").

  Raises ValueError when the requested strategy cannot run this problem (naming
  `context_parallel` and why).
  """
  request = "auto" if request is None else request
  if request not in REQUESTS:
    raise ValueError(f"context_parallel must be one of {REQUESTS}, got {request!r}")
  c = costs(p)
  total: dict[str, int] = {k: v[0] + v[1] for k, v in c.items() if isinstance(v, tuple)}
  cands = tuple((k, total.get(k), c[k] if isinstance(c[k], str) else "") for k in c)
  memory = {"ring": "O(seq / P): its own chunk plus the chunk in hand",
            "ulysses": "O(seq / P): the whole sequence for num_heads / P heads",
            "usp": "O(seq / P): a chunk of seq / P_ring for num_heads / P_ulysses heads, plus"
                   " the chunk in hand",
            "all_gather": "O(seq) for K/V: every chunk of K and V (and dK, dV)"}
  usp_keys = [k for k in c if k.startswith("usp:")]

  G = p.head_groups
  if G != 1:
    if request not in ("ring", "all_gather", "usp"):
      raise ValueError(f"ring_head_groups={G} runs the ring (or all-gather) once per group of"
                       " kv heads: it needs context_parallel='ring', 'usp' or 'all_gather',"
                       f" got {request!r}")
    if request != "usp":
      _schedule.check_head_groups(G, p.heads, p.kv_heads, " on each device")
    memory = {k: v + (f", for 1/{G} of the heads at a time" if k != "ulysses" else "")
              for k, v in memory.items()}
  links = {k: link_bytes(p, k) for k in total}
  secs = {k: _seconds(p, v) for k, v in links.items()}
  # with every link in the node, time and bytes rank alike: the reason says bytes
  timed = p.links_known and any(a[2] == "across_nodes" for a in p.axes if a[1] > 1)

  def make(key, reason):
    cost = c[key]
    assert isinstance(cost, tuple)  # eligible
    f, b = cost
    name, ua, ra, nu = key, (), (), 1
    if key.startswith("usp:"):
      name = "usp"
      ra, ua, _, nu = _split_of(p, int(key.split(":")[1]))
    lb = tuple((k, v) for k, v in links[key].items() if v)
    return Strategy(name, tuple(seq_axes), p.num_shards, reason, f, b, memory[name], cands,
                    head_groups=G if name != "ulysses" else 1, ulysses_axes=ua, ring_axes=ra,
                    ulysses_shards=nu, link_bytes=lb, link_seconds=secs[key])

  def metric(k):
    return secs[k] if timed else total[k]

  def best_usp():
    ok = [k for k in usp_keys if k in total]
    return min(ok, key=metric) if ok else None

  if request == "usp":
    if not usp_keys:
      raise ValueError("context_parallel='usp' needs the sequence sharded over two or more mesh"
                       f" axes (Ulysses over the inner ones, the ring over the outer ones), got"
                       f" {tuple(seq_axes)}; use context_parallel='ulysses' or 'ring'")
    k = best_usp()
    if k is None:
      why = "; ".join(f"{_split_of(p, int(key.split(':')[1]))[1]}: {c[key]}"
                      for key in usp_keys)
      raise ValueError(f"context_parallel='usp' cannot run this sequence-sharded call: Ulysses"
                       f" over {why}; use context_parallel='auto'")
    return make(k, "requested (context_parallel)"
                + (f"; the split with the least {'time on the slowest link' if timed else 'bytes'}"
                   if len(usp_keys) > 1 else ""))
  if request != "auto":
    if isinstance(c[request], str):
      raise ValueError(f"context_parallel={request!r} cannot run this sequence-sharded call:"
                       f" {c[request]}; use context_parallel='auto'")
    return make(request, "requested (context_parallel)")
  eligible = [k for k in ("ring", "ulysses") if k in total]
  if p.has_segments and "ring" in eligible and "ulysses" in eligible:
    eligible.remove("ulysses")  # the ring moves each chunk's ids with it (Ulysses would
    # gather every device's ids)
  k = best_usp()
  if k is not None:
    eligible.append(k)
  if not eligible:
    raise ValueError(f"the sequence is sharded over {tuple(seq_axes)} but no context-parallel"
                     f" strategy can run it: ring: {c['ring']}; ulysses: {c['ulysses']}."
                     " Shard the sequence of query and key/value alike, or replicate it")
  best = min(eligible, key=lambda k: (metric(k), k != "ring"))  # a tie goes to the ring
  what = "the least time on the slowest link" if timed else "the fewest bytes"
  others = [f"{_label(o, p)}: {_fmt(o, secs, total, timed)}" for o in eligible if o != best]
  refused = [f"{o}: {c[o]}" for o in ("ring", "ulysses") if isinstance(c[o], str)]
  if p.has_segments and "ulysses" in total and best == "ring" and "ulysses" not in eligible:
    refused.append("ulysses: segment ids (the ring moves each chunk's ids with it; Ulysses"
                   " would gather every device's ids)")
  reason = f"{what} of the eligible strategies ({_fmt(best, secs, total, timed)}"
  reason += "; " + "; ".join(others) if others else ""
  reason += ")"
  if refused:
    reason += "; " + "; ".join(refused)
  if not p.links_known and len(p.axes) > 1:
    reason += "; links unknown: weighed by bytes"
  return make(best, reason)


def _label(key: str, p: Problem) -> str:
  if not key.startswith("usp:"):
    return key
  ra, ua, _, _ = _split_of(p, int(key.split(":")[1]))
  return f"usp (Ulysses over {ua}, ring over {ra})"


def _time(seconds: float) -> str:
  return f"~{seconds * 1e3:.2f} ms" if seconds >= 1e-3 else f"~{seconds * 1e6:.1f} us"


def _fmt(key: str, secs: dict, total: dict, timed: bool) -> str:
  if timed and secs[key] is not None:
    return _time(secs[key])
  return f"{total[key] / 2**20:.2f} MiB"


def bytes_of(shape, dtype) -> int:
  return int(np.prod(shape)) * np.dtype(dtype).itemsize
