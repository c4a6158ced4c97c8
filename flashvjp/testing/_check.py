"""`check` / `assert_close`: an attention function against autodiff of float64 naive attention.

Room: testing (public gradient checks). Calls the public API (`flashvjp.flash_attention`,
`flashvjp.dot_product_attention` with implementation="naive" as the reference), imported
from the modules that define them (`flashvjp._api`, `flashvjp._jax_nn`: the package's
`__init__` imports this one), and the score_mod / mask_mod closure conversion
(`flashvjp._score_mod.convert`, `flashvjp._mask_mod.convert`) to find the arrays a mod
closes over; the tolerances are the one table in `flashvjp._check`.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import numbers
from collections.abc import Callable
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from flashvjp import _api
from flashvjp import _check as _tables
from flashvjp import _jax_nn
from flashvjp import _mask_mod
from flashvjp import _score_mod
from flashvjp.testing._compare import SCALE_FLOOR
from flashvjp.testing._compare import Report
from flashvjp.testing._compare import compare

LAYOUTS = ("BHSD", "BSHD")
# Arguments of the function under test that only choose how it runs: not given to the reference.
_HOW = {"BHSD": ("implementation", "block_q", "block_kv", "interpret"),
        "BSHD": ("implementation",)}


def _x64():
  """A context with float64 enabled (the reference's dtype), whatever the user's setting."""
  if jax.config.jax_enable_x64:
    return contextlib.nullcontext()
  enable: Any = getattr(jax, "enable_x64", None)
  if enable is None:  # jax < 0.11
    from jax import experimental as jax_experimental
    enable = jax_experimental.enable_x64  # type: ignore[attr-defined]  # jax < 0.11
  return enable(True)


def _is_inexact_array(x) -> bool:
  return (isinstance(x, (jax.Array, np.ndarray)) and not isinstance(x, (bool, numbers.Number))
          and jnp.issubdtype(x.dtype, jnp.inexact))


class _Rebound:
  """`mod` with the inexact arrays it closes over replaced by `consts` (same order).

  Traced again at the dtype of each call (so the float64 reference traces the user's
  function in float64), then applied elementwise: the function under test and the
  reference both see an ordinary score_mod / mask_mod whose arrays are the ones being
  differentiated.
  """

  def __init__(self, mod, kind, consts):
    self.mod, self.kind, self.consts = mod, kind, tuple(consts)

  def __call__(self, *args):
    if self.kind == "score_mod":
      fn, consts, n = _score_mod.convert(self.mod, jnp.result_type(args[0]))
      consts = _replace(consts, [i for i in range(n)], self.consts, "score_mod")
      return _score_mod.apply(fn, consts, *args)
    fn, consts = _mask_mod.convert(self.mod)
    idx = [i for i, c in enumerate(consts) if jnp.issubdtype(jnp.result_type(c), jnp.inexact)]
    consts = _replace(consts, idx, self.consts, "mask_mod")
    return jnp.broadcast_to(_mask_mod.apply(fn, consts, *args),
                            jnp.broadcast_shapes(*(jnp.shape(a) for a in args)))


def _replace(consts, idx, new, kind):
  consts = list(consts)
  if len(idx) != len(new):
    raise ValueError(f"{kind} closes over {len(idx)} float arrays when traced again, {len(new)}"
                     " the first time: flashvjp.testing cannot match them")
  for i, c in zip(idx, new):
    if jnp.shape(consts[i]) != jnp.shape(c):
      raise ValueError(f"{kind}'s closed-over arrays changed shape between traces")
    consts[i] = c
  return tuple(consts)


def _mod_arrays(kwargs) -> dict[str, tuple]:
  """{"score_mod": (its inexact closed-over arrays), "mask_mod": (...)}, found by tracing."""
  found = {}
  if kwargs.get("score_mod") is not None:
    _, consts, n = _score_mod.convert(kwargs["score_mod"], jnp.float32)
    found["score_mod"] = tuple(consts[:n])
  if kwargs.get("mask_mod") is not None:
    _, consts = _mask_mod.convert(kwargs["mask_mod"])
    found["mask_mod"] = tuple(c for c in consts
                              if jnp.issubdtype(jnp.result_type(c), jnp.inexact))
  return {k: v for k, v in found.items() if v}


def _closure_names(fn, depth: int = 3) -> dict:
  """{id(array): (its name, the array)} for the arrays `fn` reaches by name: a Python closure's free
  variables (`fn.__code__.co_freevars` / `fn.__closure__`), globals it reads, a
  functools.partial's keywords, a callable object's attributes; nested closures (a
  factory's inner function calling another) to `depth`. First name found wins."""
  names: dict = {}
  seen: set = set()

  def visit(obj, prefix: str, d: int):
    if d < 0 or id(obj) in seen:
      return
    seen.add(id(obj))
    items: list = []
    code = getattr(obj, "__code__", None)
    if code is not None:
      cells = getattr(obj, "__closure__", None) or ()
      for var, cell in zip(code.co_freevars, cells):
        try:
          items.append((var, cell.cell_contents))
        except ValueError:  # an empty cell
          pass
      glob = getattr(obj, "__globals__", {})
      items += [(n, glob[n]) for n in code.co_names if n in glob]
    elif isinstance(obj, functools.partial):
      items += list(obj.keywords.items()) + [(f"args[{i}]", a) for i, a in enumerate(obj.args)]
      items.append(("", obj.func))
    elif callable(obj) and hasattr(obj, "__dict__") and not isinstance(obj, type):
      items += list(vars(obj).items())
      items.append(("", type(obj).__call__))  # what it reads by name (globals)
    for var, val in items:
      name = f"{prefix}.{var}" if prefix and var else (var or prefix)
      if isinstance(val, (jax.Array, np.ndarray)):
        names.setdefault(id(val), (name, val))
      elif isinstance(val, (list, tuple)) and len(val) <= 64:
        for i, x in enumerate(val):
          if isinstance(x, (jax.Array, np.ndarray)):
            names.setdefault(id(x), (f"{name}[{i}]", x))
      elif callable(val) and not isinstance(val, type) and not _is_library(val):
        visit(val, "", d - 1)

  visit(fn, "", depth)
  return names


def _is_library(fn) -> bool:
  """jax / numpy / flashvjp-internal functions: not searched for the user's arrays."""
  mod = getattr(fn, "__module__", None) or ""
  return mod.split(".")[0] in ("jax", "jaxlib", "numpy", "builtins", "functools")


def _same_values(x, a) -> bool:
  if isinstance(x, jax.core.Tracer) or isinstance(a, jax.core.Tracer):
    return False
  return np.shape(x) == np.shape(a) and bool(np.array_equal(np.asarray(x), np.asarray(a)))


def _labels(kwargs, found) -> dict:
  """{"d score_mod[0]": "table (4, 16)", ...}: each closed-over array's name and shape."""
  labels = {}
  for kind, arrays in found.items():
    names = _closure_names(kwargs[kind])
    for i, a in enumerate(arrays):
      name = names[id(a)][0] if id(a) in names else None
      if name is None:  # converted on the way (a numpy array becomes a jax array): by value
        name = next((n for n, x in names.values() if _same_values(x, a)), None)
      shape = tuple(np.shape(a))
      labels[f"d {kind}[{i}]"] = f"{name} {shape}" if name else f"shape {shape}"
  return labels


def _names(diff) -> list:
  """Names of the gradients of `diff`'s leaves, in pytree (sorted key) order."""
  out = []
  for key in sorted(diff):
    val = diff[key]
    if isinstance(val, tuple):
      out += [f"d {key}[{i}]" for i in range(len(val))]
    else:
      out.append(f"d{key}")
  return out


def _names_in_order(diff) -> list:
  """dq, dk, dv, then bias, sinks, scale, score_mod, mask_mod's gradients (the report's order)."""
  order = [n for n in ("bias", "sinks", "scale", "score_mod", "mask_mod") if n in diff]
  return ["dq", "dk", "dv"] + [x for n in order for x in _names({n: diff[n]})]


def _tolerance_for(fn, dtype, kwargs, layout, query, key, value) -> float:
  impl = kwargs.get("implementation")
  if not isinstance(impl, str) or impl not in ("naive", "blockwise", "pallas", "pallas_triton",
                                               "pallas_tpu", "pallas_mosaic_gpu"):
    impl = None
  if impl is None and fn is _api.flash_attention and layout == "BHSD":
    try:
      impl = _api.explain(query, key, value, **kwargs).implementation
    except (TypeError, ValueError):
      impl = None
  return _tables.tolerance(dtype, impl or "naive")


def check(fn: Callable | None = None, *, query, key, value, layout: str = "BHSD",
          tolerance: None | float | Mapping[str, float] = None, seed: int = 0,
          jit: bool = True, **kwargs) -> Report:
  """Compare `fn` and its gradients with autodiff of naive attention in float64.

  Calls ``fn(query, key, value, **kwargs)`` and naive attention (`flashvjp.reference`,
  through ``flashvjp.flash_attention(..., implementation="naive")``, or
  ``flashvjp.dot_product_attention`` for ``layout="BSHD"``) on the same arguments cast to
  float64, and compares the outputs and the gradients of a random weighting of them
  (one `jax.vjp`) w.r.t. every differentiable input:

  * ``out``, and ``lse`` when `fn` returns ``(out, lse)`` (return_lse=True);
  * ``dq``, ``dk``, ``dv``;
  * ``dbias``, ``dsinks``, and ``dscale`` when `scale` is an array (a learned temperature);
  * ``d score_mod[i]`` / ``d mask_mod[i]``: every float array the score_mod / mask_mod
    closes over (a relative-position table, ALiBi slopes), found by tracing the mod on
    scalars (the closure conversion flash_attention itself does); both functions are
    then given the mod with those arrays re-bound as inputs.

  Args:
    fn: the function under test (default `flashvjp.flash_attention`); any function with
      its signature, or, with ``layout="BSHD"``, `jax.nn.dot_product_attention`'s.
    query, key, value: the inputs, in `fn`'s layout and dtype (float32, bfloat16, ...).
    layout: "BHSD" ([batch, heads, seq, head_dim], flash_attention's keyword arguments)
      or "BSHD" ([batch, seq, heads, head_dim], dot_product_attention's: bias, mask,
      scale, is_causal, local_window_size, query/key_value_seq_lengths).
    tolerance: None (the table `flashvjp._check.tolerance(dtype, implementation)`: per
      input dtype and matmul precision), a float for every quantity, or a dict
      {quantity name: tolerance} overriding some.
    seed: of the random cotangents.
    jit: run `fn` and its vjp under `jax.jit` (False: eagerly).
    **kwargs: passed to `fn` (and, except implementation / block_q / block_kv /
      interpret, to the reference).

  Returns:
    a `Report`: ``report.passed``, ``report["dk"].error``, ``str(report)`` a table.

  Example::

    import jax, jax.numpy as jnp, flashvjp
    from flashvjp import testing
    q, k, v = (jax.random.normal(jax.random.key(i), (1, 2, 40, 16)) for i in range(3))
    table = 0.1 * jnp.arange(2 * 9.0).reshape(2, 9)
    mod = flashvjp.relative_position_bias(table, max_distance=4)
    report = testing.check(query=q, key=k, value=v, score_mod=mod, causal=True,
                           implementation="blockwise")
    assert report.passed, report   # compares out, dq, dk, dv and d score_mod[0]
  """
  if layout not in LAYOUTS:
    raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
  fn = _api.flash_attention if fn is None else fn
  if not callable(fn):
    raise TypeError(f"fn must be callable, got {type(fn).__name__}")
  for name, x in (("query", query), ("key", key), ("value", value)):
    if not _is_inexact_array(x):
      raise TypeError(f"{name} must be a float jax or numpy array, got {type(x).__name__}"
                      f"{'' if not hasattr(x, 'dtype') else ' of dtype ' + str(x.dtype)}")
  dtype = jnp.dtype(query.dtype)
  diff: dict = {}
  for n in ("bias", "sinks", "scale"):
    if n in kwargs and _is_inexact_array(kwargs[n]):
      diff[n] = kwargs[n]
  found = _mod_arrays(kwargs)
  diff.update(found)
  names = ["dq", "dk", "dv"] + _names(diff)  # the order of the vjp's leaves
  labels = _labels(kwargs, found)

  def call(f, base, q, k, v, d):
    kw = dict(base)
    for n in ("bias", "sinks", "scale"):
      if n in d:
        kw[n] = d[n]
    for n in ("score_mod", "mask_mod"):
      if n in d:
        kw[n] = _Rebound(base[n], n, d[n])
    return f(q, k, v, **kw)

  def vjp_of(f, base):
    def run(q, k, v, d, cts):
      res, pull = jax.vjp(lambda q, k, v, d: call(f, base, q, k, v, d), q, k, v, d)
      return res, pull(jax.tree_util.tree_map(lambda c, r: jnp.asarray(c, r.dtype), cts, res))
    return run

  shapes = jax.eval_shape(lambda q, k, v, d: call(fn, kwargs, q, k, v, d), query, key, value,
                          diff)
  with_lse = isinstance(shapes, (tuple, list))
  if with_lse and len(shapes) != 2:
    raise ValueError(f"fn must return out or (out, lse), got {len(shapes)} outputs")
  out_shape = shapes[0] if with_lse else shapes
  rng = np.random.default_rng(seed)
  # Cotangents drawn in float64, rounded to the output's dtype: both sides see the same values.
  w_out = np.asarray(jnp.asarray(rng.standard_normal(out_shape.shape), out_shape.dtype))

  # The reference: autodiff of naive attention in float64, always with lse.
  ref_fn = _api.flash_attention if layout == "BHSD" else _jax_nn.dot_product_attention
  ref_base = {n: x for n, x in kwargs.items() if n not in _HOW[layout]}
  ref_base.update({"return_lse" if layout == "BHSD" else "return_residual": True},
                  implementation="naive")
  with _x64():
    to64 = lambda x: jnp.asarray(x, jnp.float64) if _is_inexact_array(x) else x
    q64, k64, v64 = (to64(x) for x in (query, key, value))
    d64 = jax.tree_util.tree_map(to64, diff)
    ref_run = jax.jit(vjp_of(ref_fn, ref_base))
    ref_lse_shape = jax.eval_shape(lambda *a: call(ref_fn, ref_base, *a)[1], q64, k64, v64, d64)
    w_lse = rng.standard_normal(ref_lse_shape.shape)
    (_, ref_lse0), _ = ref_run(q64, k64, v64, d64, (np.asarray(w_out, np.float64),
                                                     np.zeros(ref_lse_shape.shape)))
    w_lse = np.where(np.isfinite(np.asarray(ref_lse0)), w_lse, 0.0)  # no cotangent on -inf
    if with_lse:
      w_lse = np.asarray(jnp.asarray(w_lse, shapes[1].dtype))
    else:
      w_lse = np.zeros_like(w_lse)
    (ref_out, ref_lse), ref_grads = ref_run(
        q64, k64, v64, d64, (np.asarray(w_out, np.float64), np.asarray(w_lse, np.float64)))
    ref_out, ref_lse = np.asarray(ref_out), np.asarray(ref_lse)
    ref_grads = [np.asarray(g) for g in jax.tree_util.tree_leaves(ref_grads)]

  run = vjp_of(fn, kwargs)
  cts = (w_out, w_lse) if with_lse else w_out
  got, got_grads = (jax.jit(run) if jit else run)(query, key, value, diff, cts)
  got_out, got_lse = got if with_lse else (got, None)
  got_grads = jax.tree_util.tree_leaves(got_grads)

  if tolerance is None or isinstance(tolerance, Mapping):
    base = _tolerance_for(fn, dtype, kwargs, layout, query, key, value)
  else:
    base = float(tolerance)
  overrides = dict(tolerance) if isinstance(tolerance, Mapping) else {}
  all_names = ["out"] + (["lse"] if with_lse else []) + names
  unknown = sorted(set(overrides) - set(all_names))
  if unknown:
    raise ValueError(f"tolerance names unknown quantities {unknown}; this check compares"
                     f" {all_names}")
  tol = lambda n: float(overrides.get(n, base))
  main = [ref_out] + [r for n, r in zip(names, ref_grads) if n in ("dq", "dk", "dv")]
  floor = SCALE_FLOOR * max((float(np.abs(r[np.isfinite(r)]).max(initial=0.0)) for r in main),
                            default=0.0)
  quantities = [compare("out", got_out, ref_out, tol("out"))]
  if with_lse:
    quantities.append(compare("lse", got_lse, ref_lse, tol("lse")))
  grads = {n: dataclasses.replace(compare(n, g, r, tol(n), floor), label=labels.get(n, ""))
           for n, g, r in zip(names, got_grads, ref_grads)}
  quantities += [grads[n] for n in _names_in_order(diff)]
  title = (f"flashvjp.testing.check of {getattr(fn, '__name__', type(fn).__name__)}"
           f" ({dtype.name}, {layout} {tuple(query.shape)}) vs float64 naive attention")
  return Report(tuple(quantities), title)


def assert_close(fn: Callable | None = None, **kwargs) -> Report:
  """`check(fn, **kwargs)`, raising AssertionError with the report's table when it fails.

  For a test suite (pytest prints the table, which names the failing quantity)::

    def test_my_attention():
      flashvjp.testing.assert_close(my_attention, query=q, key=k, value=v, causal=True)

  Returns the (passing) Report.
  """
  report = check(fn, **kwargs)
  if not report.passed:
    raise AssertionError("\n" + str(report))
  return report
