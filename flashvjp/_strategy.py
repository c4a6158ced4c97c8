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
from collections.abc import Callable

import numpy as np

from flashvjp.ring import _schedule

REQUESTS = ("auto", "ring", "ulysses", "all_gather")


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

  @property
  def local_q(self) -> int:
    return self.seq_q // self.num_shards

  @property
  def local_kv(self) -> int:
    return self.seq_kv // self.num_shards


@dataclasses.dataclass(frozen=True)
class Strategy:
  """The choice: `name` runs over `seq_axes`; bytes are per device, estimated."""

  name: str  # "ring" | "ulysses" | "all_gather"
  seq_axes: tuple
  num_shards: int
  reason: str
  bytes_forward: int
  bytes_backward: int
  memory: str
  candidates: tuple = ()  # ((name, total bytes or None, note), ...) as weighed
  head_groups: int = 1  # the ring run once per group of kv heads, one after the other

  def __str__(self) -> str:
    mib = lambda b: f"{b / 2**20:.2f} MiB"
    groups = (f", in {self.head_groups} head groups one after the other"
              if self.head_groups > 1 else "")
    return (f"{self.name} over {self.seq_axes} ({self.num_shards} shards{groups}):"
            f" {self.reason}; moves ~{mib(self.bytes_forward)} forward +"
            f" {mib(self.bytes_backward)} backward per device; holds {self.memory}")


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


def costs(p: Problem) -> dict:
  """{name: (forward bytes, backward bytes) or a string saying why it cannot run}."""
  n = p.num_shards
  it = p.itemsize
  acc = max(it, 4)
  kv_chunk = p.batch * p.kv_heads * p.local_kv * (p.head_dim + p.head_dim_v) * it
  seg_chunk = p.batch * p.local_kv * 4 if p.has_segments else 0
  dkv_chunk = p.batch * p.kv_heads * p.local_kv * (p.head_dim + p.head_dim_v) * acc
  out: dict[str, tuple[int, int] | str] = {}
  kv_moves, dkv_moves = ring_moves(p)
  # backward: K/V (and ids) move as in the forward, the dK/dV accumulators (float32) too
  out["ring"] = (kv_moves * (kv_chunk + seg_chunk),
                 kv_moves * (kv_chunk + seg_chunk) + dkv_moves * dkv_chunk)
  if p.causal and p.seq_q != p.seq_kv:
    out["ring"] = "causal with seq_q != seq_kv: the chunks of q and kv differ"
  # Ulysses: every all_to_all keeps 1/n of its operand and sends the rest.
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
  if p.heads % n or p.kv_heads % n:
    out["ulysses"] = (f"num_heads ({p.heads}) and num_kv_heads ({p.kv_heads}) per device must"
                      f" be divisible by the {n} sequence shards")
  elif p.pairs_not_split_by_heads:
    out["ulysses"] = (f"{', '.join(p.pairs_not_split_by_heads)} cannot be split by heads (it"
                      " needs both its head and query dims full, or neither)")
  else:
    out["ulysses"] = (int(fwd), int(bwd))
  gather = (n - 1) * (kv_chunk + seg_chunk)
  out["all_gather"] = (gather, gather + (n - 1) * dkv_chunk)
  if p.causal and p.seq_q != p.seq_kv:
    out["all_gather"] = out["ring"]
  return out


def choose(request: str | None, p: Problem, seq_axes: tuple) -> Strategy:
  """The strategy for `request` ("auto" / None, "ring", "ulysses", "all_gather").

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
            "all_gather": "O(seq) for K/V: every chunk of K and V (and dK, dV)"}

  G = p.head_groups
  if G != 1:
    if request not in ("ring", "all_gather"):
      raise ValueError(f"ring_head_groups={G} runs the ring (or all-gather) once per group of"
                       " kv heads: it needs context_parallel='ring' or 'all_gather', got"
                       f" {request!r}")
    _schedule.check_head_groups(G, p.heads, p.kv_heads, " on each device")
    memory = {k: v + (f", for 1/{G} of the heads at a time" if k != "ulysses" else "")
              for k, v in memory.items()}

  def make(name, reason):
    cost = c[name]
    assert isinstance(cost, tuple)  # eligible
    f, b = cost
    return Strategy(name, tuple(seq_axes), p.num_shards, reason, f, b, memory[name], cands,
                    head_groups=G if name != "ulysses" else 1)

  if request != "auto":
    if isinstance(c[request], str):
      raise ValueError(f"context_parallel={request!r} cannot run this sequence-sharded call:"
                       f" {c[request]}; use context_parallel='auto'")
    return make(request, "requested (context_parallel)")
  if isinstance(c["ring"], str):
    if isinstance(c["ulysses"], str):
      raise ValueError(f"the sequence is sharded over {tuple(seq_axes)} but no context-parallel"
                       f" strategy can run it: ring: {c['ring']}; ulysses: {c['ulysses']}."
                       " Shard the sequence of query and key/value alike, or replicate it")
    return make("ulysses", f"ring cannot run ({c['ring']})")
  if isinstance(c["ulysses"], str):
    return make("ring", f"fewest bytes of the eligible strategies (ulysses: {c['ulysses']})")
  if p.has_segments:
    return make("ring", "segment ids: the ring moves each chunk's ids with it (Ulysses would"
                        " gather every device's ids)")
  if total["ulysses"] < total["ring"]:
    return make("ulysses", f"moves {total['ulysses'] / max(total['ring'], 1):.2f}x the ring's"
                           " bytes")
  ratio = total["ring"] / max(total["ulysses"], 1)
  return make("ring", f"moves {ratio:.2f}x Ulysses' bytes" if ratio < 1
              else "as few bytes as Ulysses (a tie goes to the ring)")


def bytes_of(shape, dtype) -> int:
  return int(np.prod(shape)) * np.dtype(dtype).itemsize
