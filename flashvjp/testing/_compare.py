"""The comparison of results with a float64 reference: per-quantity errors and the Report.

Room: testing (public gradient checks). One criterion everywhere (`flashvjp.testing.check`,
the test suite's `tests/_util.assert_close`, `python -m flashvjp check`): a quantity
passes when, over every entry i,

    |got_i - ref_i| <= tol * (max |ref| + |ref_i|)

that is `numpy.testing.assert_allclose(got, ref, rtol=tol, atol=tol * max |ref|)`: the
tolerance is relative to the scale of the whole tensor (attention gradients have many
entries near zero, where elementwise relative error means nothing). The reported error
is the left side divided by ``max |ref| + |ref_i|``, its maximum over the entries, so
that a quantity passes exactly when ``error <= tolerance``. `check` floors ``max |ref|`` at
``SCALE_FLOOR`` (10%) of the problem's scale (the largest of max |ref| over out, dq, dk and
dv): a gradient that is exactly zero in exact arithmetic (one key: softmax is constant)
is rounding noise in float32, and is judged against the scale of the problem it came from
rather than against zero (below that floor the rounding of the problem's own magnitudes is
what would be measured). A 1% error, a wrong row or a missing gradient still fails. NaN never passes; an inf
must sit where the reference has the same inf (an empty row's lse = -inf).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np


@dataclasses.dataclass(frozen=True)
class Quantity:
  """One compared quantity (``out``, ``lse``, ``dq``, ``d score_mod[0]``, ...).

  error: max over entries of |got - ref| / (max |ref| + |ref|) (inf for NaN or a
    misplaced inf); passes when ``error <= tolerance``.
  worst_index: the entry where that maximum is reached (() for a scalar).
  got, ref: the values there (float64).
  scale: max |ref| over the reference's finite entries (before any floor).
  label: what the quantity is the gradient of, where its name does not say (an array a
    score_mod / mask_mod closes over: its name in the closure, where it has one, and its
    shape, e.g. ``"table (4, 16)"``); shown next to the name in the table.
  """

  name: str
  error: float
  tolerance: float
  worst_index: tuple[int, ...]
  got: float
  ref: float
  scale: float
  shape: tuple[int, ...]
  note: str = ""
  label: str = ""

  @property
  def title(self) -> str:
    """The name, with the label when there is one: ``d score_mod[0] (table (4, 16))``."""
    return f"{self.name} ({self.label})" if self.label else self.name

  @property
  def passed(self) -> bool:
    return bool(self.error <= self.tolerance)


SCALE_FLOOR = 0.1

# The pass rule in words: `check`'s docs, `python -m flashvjp check`'s banner and --help, and
# docs/testing.md state exactly this sentence (tests/test_cli.py compares them).
PASS_RULE = ("a quantity passes when |got - ref| <= tolerance x (max |ref| + |ref|) at every"
             f" entry, where max |ref| of a gradient is at least {SCALE_FLOOR:.0%} of the problem's scale (the"
             " largest max |ref| of out, dq, dk and dv); the error shown is the largest"
             " |got - ref| / (max |ref| + |ref|), so a quantity passes when error <= tolerance")


def compare(name: str, got, ref, tolerance: float, floor: float = 0.0) -> Quantity:
  """Compare one array with its float64 reference (shapes must match).

  floor: a lower bound on the scale ``max |ref|`` the error is relative to (see the module
  docstring; 0 by default).
  """
  g = np.asarray(got, np.float64)
  r = np.asarray(ref, np.float64)
  if g.shape != r.shape:
    return Quantity(name, float("inf"), tolerance, (), float("nan"), float("nan"), float("nan"),
                    tuple(r.shape), note=f"shape {g.shape} != reference {r.shape}")
  fin = np.isfinite(r)
  scale = float(np.abs(r[fin]).max()) if fin.any() else 0.0
  nan = np.isnan(g)
  bad_inf = (np.isfinite(g) != fin) | (~fin & ~nan & (g != r))
  if nan.any() or bad_inf.any():
    where = np.argwhere(nan | bad_inf)[0]
    idx = tuple(int(i) for i in where)
    note = "NaN" if nan[idx] else "inf where the reference differs"
    return Quantity(name, float("inf"), tolerance, idx, float(g[idx]), float(r[idx]), scale,
                    tuple(r.shape), note=note)
  if not fin.any():
    return Quantity(name, 0.0, tolerance, (), float("nan"), float("nan"), 0.0, tuple(r.shape))
  with np.errstate(invalid="ignore"):  # inf - inf where both are inf: masked out below
    diff = np.where(fin, np.abs(g - r), 0.0)
  err = diff / (max(scale, floor, 1e-30) + np.where(fin, np.abs(r), 0.0))
  flat = int(np.argmax(err))
  idx = tuple(int(i) for i in np.unravel_index(flat, r.shape)) if r.ndim else ()
  return Quantity(name, float(err.reshape(-1)[flat]), tolerance, idx, float(g[idx]),
                  float(r[idx]), scale, tuple(r.shape))


@dataclasses.dataclass(frozen=True)
class Report:
  """The result of `flashvjp.testing.check`: one `Quantity` per compared array.

  ``report.passed`` is True when every quantity passes; ``report["dk"]`` is one
  quantity; ``report.failed`` names the failing ones; ``str(report)`` is a table.
  """

  quantities: tuple[Quantity, ...]
  title: str = ""

  @property
  def passed(self) -> bool:
    return all(q.passed for q in self.quantities)

  @property
  def failed(self) -> tuple[str, ...]:
    return tuple(q.name for q in self.quantities if not q.passed)

  @property
  def names(self) -> tuple[str, ...]:
    return tuple(q.name for q in self.quantities)

  def __getitem__(self, name: str) -> Quantity:
    for q in self.quantities:
      if q.name == name:
        return q
    raise KeyError(f"no quantity {name!r} in this report; it has {list(self.names)}")

  def to_dict(self) -> dict:
    """A JSON-serialisable form (what ``python -m flashvjp check --json`` prints)."""
    def num(x):
      return None if x != x else (str(x) if x in (float("inf"), float("-inf")) else x)
    return {
        "title": self.title, "passed": self.passed, "failed": list(self.failed),
        "quantities": [dict(name=q.name, error=num(q.error), tolerance=q.tolerance,
                            passed=q.passed, worst_index=list(q.worst_index), got=num(q.got),
                            ref=num(q.ref), scale=num(q.scale), shape=list(q.shape),
                            note=q.note, label=q.label) for q in self.quantities]}

  def __str__(self) -> str:
    w = max([18] + [len(q.title) + 2 for q in self.quantities])
    head = f"{'quantity':<{w}}{'error':>10}{'tolerance':>11}  {'result':<6}  worst at (got vs ref)"
    lines = []
    if self.title:
      lines.append(f"{self.title}: {'PASSED' if self.passed else 'FAILED ' + ', '.join(self.failed)}")
    lines += [head, "-" * len(head)]
    for q in self.quantities:
      where = f"{list(q.worst_index)} ({q.got:.6g} vs {q.ref:.6g})" if q.got == q.got else ""
      if q.note:
        where = f"{where} {q.note}".strip()
      lines.append(f"{q.title:<{w}}{q.error:>10.2e}{q.tolerance:>11.1e}  "
                   f"{'ok' if q.passed else 'FAIL':<6}  {where}")
    lines.append("error = max |got - ref| / (max |ref| + |ref|), against float64 naive attention;"
                 " a quantity passes when error <= tolerance")
    return "\n".join(lines)

  __repr__ = __str__


def compare_trees(got, ref, tolerance: float, names: Sequence[str] | None = None,
                  title: str = "") -> Report:
  """A Report comparing each leaf of `got` with the same leaf of the float64 `ref`."""
  import jax
  g_l, r_l = jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(ref)
  if len(g_l) != len(r_l):
    raise ValueError(f"got has {len(g_l)} arrays, the reference {len(r_l)}")
  names = list(names) if names is not None else [f"leaf {n}" for n in range(len(g_l))]
  return Report(tuple(compare(n, np.asarray(g), np.asarray(r), tolerance)
                      for n, g, r in zip(names, g_l, r_l)), title)
