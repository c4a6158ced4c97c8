"""How a score_mod / mask_mod reads the arrays it closes over, from its scalar jaxpr.

Room: foundations (the mod model). FlexAttention's canonical mods index captured arrays by
position: `bias[b, kv_idx]` (a per-key vector), `t[q_idx]` (per-query temperature),
`table[h, bucket(kv_idx - q_idx)]` (relative positions), `doc[q_idx] == doc[kv_idx]`
(documents). From a tile's point of view most are not gathers: an array indexed by the kv
position alone is a `[block_kv]` slice per tile, by the q position a `[block_q]` slice, by
(b, h) a scalar; only a function of both positions needs a lookup, and for `kv_idx - q_idx`
it touches a strip of `block_q + block_kv - 1` diagonals. `classify` says which class each
operand falls in (static, once per configuration; no array op): what a compiled form per
class needs to know, and what `explain` and the kernels' refusals name.

Classes (`CLASSES`): "per (b, h)" (indices depend on b / h only), "by q position", "by kv
position", "by kv_idx - q_idx" (through their difference only, with b / h allowed), "whole"
(never indexed: read elementwise, or reduced, e.g. a scalar), "otherwise" (one read indexed
by both positions separately, by the scores, or in a way not followed here). An operand read
several ways gets them joined ("by q position and by kv position": document ids).
"""
from __future__ import annotations

import dataclasses

import jax
import numpy as np

CLASSES = ("per (b, h)", "by q position", "by kv position", "by kv_idx - q_idx", "whole",
           "otherwise")
_RANK = {c: i for i, c in enumerate(CLASSES)}  # a later class is "worse" (harder to compile)
# "whole" is what an operand gets when nothing indexes it; any indexing replaces it
_INDEXING = ("gather", "dynamic_slice")
# ops that move an array without reading it at computed positions (its identity is kept)
_SHAPE_OPS = ("convert_element_type", "reshape", "squeeze", "broadcast_in_dim", "transpose",
              "expand_dims", "copy", "copy_p")


@dataclasses.dataclass(frozen=True)
class Operand:
  """One array a mod closes over: its position among the mod's arrays, shape, dtype, and
  how the mod reads it (one of CLASSES)."""

  mod: str  # "score_mod" or "mask_mod"
  index: int
  shape: tuple
  dtype: str
  how: str
  # explain() of a sequence-sharded call: "q" / "kv" / "q and kv" when the array is split
  # like the sequence (`flashvjp._aligned`: read at exactly that position), else ""
  split: str = ""

  def __str__(self) -> str:
    dims = ",".join(str(d) for d in self.shape)
    split = {"": "", "q": ", split like the queries", "kv": ", split like the keys",
             "q and kv": ", split like the queries and (a copy) like the keys"}[self.split]
    return f"{self.mod}[{self.index}] {self.dtype}[{dims}]: {self.how}{split}"


def _deps_class(deps: frozenset) -> str:
  if "s" in deps:
    return "otherwise"  # indexed by a score value
  pos = deps & {"q", "kv", "rel"}
  if not pos:
    return "per (b, h)"
  if pos == {"q"}:
    return "by q position"
  if pos == {"kv"}:
    return "by kv position"
  if pos == {"rel"}:
    return "by kv_idx - q_idx"
  return "otherwise"


def _sub_jaxprs(eqn):
  """(jaxpr, consts) pairs of an equation's sub-computations (jit, custom_jvp, cond ...)."""
  out = []
  for v in eqn.params.values():
    for x in (v if isinstance(v, (tuple, list)) else (v,)):
      if hasattr(x, "jaxpr") and hasattr(x, "consts"):  # ClosedJaxpr
        out.append((x.jaxpr, x.consts))
      elif hasattr(x, "eqns"):  # Jaxpr
        out.append((x, ()))
  return out


class _Walk:
  """Dataflow over a jaxpr: for every variable, the position symbols its value depends on
  (`deps`: s, b, h, q, kv, rel) and, for values that are (slices of) an operand array, which
  operand (`owner`) and the index symbols used to reach it so far (`reach`)."""

  def __init__(self):
    self.found: dict[int, set] = {}  # operand -> the classes of its reads

  def note(self, op: int, how: str):
    self.found.setdefault(op, set()).add(how)

  def how(self, op: int) -> str:
    """One description: "otherwise" if any read is; the index-based reads joined (a
    document id array is read "by q position and by kv position"); else "whole"."""
    found = self.found.get(op, set())
    if "otherwise" in found:
      return "otherwise"
    reads = sorted(found - {"whole"}, key=lambda c: _RANK[c])
    return " and ".join(reads) if reads else "whole"

  def run(self, jaxpr, in_info):
    """in_info: per invar (deps, owner, reach); returns the same per outvar."""
    env: dict = {}

    def read(v):
      if not hasattr(v, "aval") or type(v).__name__ == "Literal":
        return (frozenset(), None, frozenset())
      return env.get(v, (frozenset(), None, frozenset()))

    for var, info in zip(jaxpr.invars, in_info):
      env[var] = info
    for eqn in jaxpr.eqns:
      ins = [read(v) for v in eqn.invars]
      name = eqn.primitive.name
      subs = _sub_jaxprs(eqn)
      if subs:
        outs = None
        for sub, _ in subs:
          # operands map to the sub-jaxpr's trailing invars (cond: after the predicate)
          k = len(sub.invars)
          res = self.run(sub, ins[len(ins) - k:] if k <= len(ins) else ins)
          outs = res if outs is None else [
              (a[0] | b[0], a[1] if a[1] == b[1] else None, a[2] | b[2])
              for a, b in zip(outs, res)]
        outs = outs or []
        for var, info in zip(eqn.outvars, outs):
          env[var] = info
        for var in eqn.outvars[len(outs):]:
          env[var] = (frozenset().union(*(i[0] for i in ins)), None, frozenset())
        continue
      if name in _INDEXING and ins and ins[0][1] is not None:
        owner, reach = ins[0][1], ins[0][2]
        idx = frozenset().union(*(i[0] for i in ins[1:])) | reach
        # the slice is still (part of) the operand: a further index adds to the reach
        for var in eqn.outvars:
          env[var] = (ins[0][0] | idx, owner, idx)
        continue
      if name in _SHAPE_OPS and ins and ins[0][1] is not None:
        for var in eqn.outvars:
          env[var] = ins[0]
        continue
      # a value leaves the operand: where it came from is settled
      for i in ins:
        if i[1] is not None:
          self.note(i[1], _deps_class(i[2]) if i[2] else "whole")
      deps = frozenset().union(*(i[0] for i in ins)) if ins else frozenset()
      if name == "sub" and len(ins) == 2:
        a, b = ins[0][0] - {"b", "h"}, ins[1][0] - {"b", "h"}
        if {a, b} == {frozenset({"kv"}), frozenset({"q"})}:
          deps = (deps - {"q", "kv"}) | {"rel"}
      for var in eqn.outvars:
        env[var] = (deps, None, frozenset())
    outs = [read(v) for v in jaxpr.outvars]
    for o in outs:
      if o[1] is not None:
        self.note(o[1], _deps_class(o[2]) if o[2] else "whole")
    return outs


@dataclasses.dataclass
class _View:
  """A jaxpr's equations with the constvars as leading invars (what `_Walk.run` reads)."""
  invars: list
  eqns: list
  outvars: list


def classify(jaxpr, positions: tuple[str, ...], shapes, dtypes, mod: str,
             order=None) -> tuple[Operand, ...]:
  """The class of each operand array of a scalar mod's `jaxpr`.

  jaxpr: the mod traced on scalars, its `constvars` the operand arrays (their order),
    its invars the scalars named by `positions` ("s", "b", "h", "q", "kv").
  shapes, dtypes: of the operands, in the constvars' order.
  order: the operands' order as the caller numbers them (a permutation of the constvars:
    entry i is the constvar index of operand i); None: the constvars' order.
  """
  return _classify_vars(list(jaxpr.constvars), list(jaxpr.invars), jaxpr.eqns, jaxpr.outvars,
                        positions, shapes, dtypes, mod, order)


def _classify_vars(operand_vars, position_vars, eqns, outvars, positions, shapes, dtypes,
                   mod, order) -> tuple[Operand, ...]:
  n = len(operand_vars)
  walk = _Walk()
  in_info: list[tuple] = [(frozenset({p}), None, frozenset()) for p in positions]
  # the operands own themselves, reached by no index yet
  walk.run(_View(list(operand_vars) + list(position_vars), eqns, outvars),
           [(frozenset(), i, frozenset()) for i in range(n)] + in_info)
  order = list(range(n)) if order is None else list(order)
  return tuple(Operand(mod, k, tuple(shapes[c]), str(dtypes[c]), walk.how(c))
               for k, c in enumerate(order))


def of_mod(fn, mod: str, consts=None) -> tuple[Operand, ...]:
  """The operands of a scalar score_mod (`_score_mod.ScalarScoreMod`, mod="score_mod") or
  mask_mod (`_mask_mod.ScalarMaskMod`, mod="mask_mod"), numbered as the call's consts.

  A plain function taking its arrays as trailing arguments (``fn(s, b, h, q, kv, *consts)``,
  the kernels' internal form) is traced here on scalars and `consts`' shapes.
  """
  positions = ("s", "b", "h", "q", "kv") if mod == "score_mod" else ("b", "h", "q", "kv")
  if not hasattr(fn, "_jaxpr"):
    consts = tuple(consts or ())
    scalars = [jax.ShapeDtypeStruct((), np.float32 if p == "s" else np.int32)
               for p in positions]
    avals = [jax.ShapeDtypeStruct(np.shape(c), c.dtype) for c in consts]
    closed = jax.make_jaxpr(fn)(*scalars, *avals)
    jaxpr, k = closed.jaxpr, len(positions)
    return _classify_vars(list(jaxpr.invars[k:]), list(jaxpr.invars[:k]), jaxpr.eqns,
                          jaxpr.outvars, positions, [a.shape for a in avals],
                          [a.dtype for a in avals], mod, None)
  jaxpr = fn._jaxpr  # pylint: disable=protected-access
  shapes = [v.aval.shape for v in jaxpr.constvars]
  dtypes = [v.aval.dtype for v in jaxpr.constvars]
  return classify(jaxpr, positions, shapes, dtypes, mod, order=getattr(fn, "_perm", None))


def compile_hint(op: Operand) -> str:
  """What a refusal says about an operand the kernels cannot read on a tile."""
  if op.how == "otherwise":
    return (f"{op}: make each read depend on one position (q_idx or kv_idx), on"
            " kv_idx - q_idx, or on (b, h) only")
  return (f"{op}: this family's kernels do not read arrays indexed this way yet (the"
          " Pallas-Triton and Mosaic-TPU kernels do)")
