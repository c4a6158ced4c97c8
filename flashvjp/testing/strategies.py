"""Hypothesis strategies that draw valid attention problems, to fuzz your own functions.

Room: testing (public gradient checks). Needs hypothesis (``pip install flashvjp[testing]``).
`problems()` draws the keyword arguments of `flashvjp.testing.check` (query, key, value
and flash_attention's options), so a property test is one line::

  from hypothesis import given, settings
  from flashvjp import testing
  from flashvjp.testing import strategies

  @settings(max_examples=20, deadline=None)
  @given(strategies.problems())
  def test_my_attention(problem):
    testing.assert_close(my_attention, **problem)

Shapes include odd sequence lengths, seq_q != seq_kv, GQA/MQA and head_dim_v != head_dim;
features: causal, windows, segment ids, dense masks with an empty row, bias, the
built-in score_mods (softcap, ALiBi, a learned relative-position table), mask_mods
(prefix-LM, chunked, sliding window with global tokens), sinks, a learned (array) scale
and dropout. Arrays are drawn from a seeded numpy generator (hypothesis shrinks the seed).
"""
from __future__ import annotations

from collections.abc import Sequence

try:
  from hypothesis import strategies as st
except ImportError as e:  # pragma: no cover - exercised by a subprocess test
  raise ImportError(
      "flashvjp.testing.strategies needs hypothesis: pip install 'flashvjp[testing]'"
      " (or pip install hypothesis); flashvjp.testing.check and assert_close work without it"
  ) from e

import jax
import jax.numpy as jnp
import numpy as np

from flashvjp import _mask_mod
from flashvjp import _score_mod

FEATURES = ("causal", "window", "segment_ids", "mask", "bias", "softcap", "alibi",
            "relative_position_bias", "prefix_lm", "chunked", "sliding_window_with_global",
            "sinks", "scale", "array_scale", "dropout")


@st.composite
def shapes(draw, max_batch: int = 2, max_heads: int = 4, max_seq: int = 80,
           head_dims: Sequence[int] = (8, 16, 32)):
  """dict(B, H, Hkv, Sq, Skv, D, Dv): GQA/MQA (H a multiple of Hkv), odd lengths."""
  hkv = draw(st.integers(1, max(1, max_heads // 2)))
  h = hkv * draw(st.integers(1, max(1, max_heads // hkv)))
  sq = draw(st.integers(1, max_seq))
  skv = draw(st.one_of(st.just(sq), st.integers(1, max_seq)))
  d = draw(st.sampled_from(list(head_dims)))
  dv = draw(st.sampled_from([d] + [x for x in head_dims if x != d]))
  return dict(B=draw(st.integers(1, max_batch)), H=h, Hkv=hkv, Sq=sq, Skv=skv, D=d, Dv=dv)


@st.composite
def problems(draw, dtypes: Sequence = (jnp.float32,), features: Sequence[str] = FEATURES,
             max_features: int = 3, **shape_kwargs):
  """The keyword arguments of `flashvjp.testing.check` for one random attention problem.

  Args:
    dtypes: input dtypes to draw from (float32, bfloat16, float16).
    features: the options to draw from (a subset of `FEATURES`).
    max_features: at most this many options at once.
    **shape_kwargs: passed to `shapes` (max_batch, max_heads, max_seq, head_dims).

  Returns (a strategy of) dict(query=..., key=..., value=..., **flash_attention options);
  pass it on with ``check(fn, **problem)``.
  """
  unknown = sorted(set(features) - set(FEATURES))
  if unknown:
    raise ValueError(f"features must be among {FEATURES}, got unknown {unknown}")
  s = draw(shapes(**shape_kwargs))
  B, H, Hkv, Sq, Skv, D, Dv = (s[n] for n in ("B", "H", "Hkv", "Sq", "Skv", "D", "Dv"))
  dtype = jnp.dtype(draw(st.sampled_from(list(dtypes))))
  rng = np.random.default_rng(draw(st.integers(0, 2**31 - 1)))
  arr = lambda *shape: jnp.asarray(rng.standard_normal(shape), dtype)
  out: dict = dict(query=arr(B, H, Sq, D), key=arr(B, Hkv, Skv, D), value=arr(B, Hkv, Skv, Dv))
  chosen = draw(st.lists(st.sampled_from(list(features)), max_size=max_features, unique=True))
  # Features that are mutually exclusive as options: one score_mod, one mask_mod, one scale.
  mods = [f for f in chosen if f in ("softcap", "alibi", "relative_position_bias")]
  mask_mods = [f for f in chosen if f in ("prefix_lm", "chunked", "sliding_window_with_global")]
  for f in chosen:
    if f == "causal":
      out["causal"] = True
    elif f == "window":
      out["window"] = (draw(st.one_of(st.none(), st.integers(0, Skv))),
                       draw(st.one_of(st.none(), st.integers(0, Skv))))
    elif f == "segment_ids":
      ids = lambda n: jnp.asarray(np.sort(rng.integers(0, 3, (B, n)), axis=1), jnp.int32)
      out["segment_ids"] = (ids(Sq), ids(Skv))
    elif f == "mask":
      m = rng.random((B, 1, Sq, Skv)) < 0.7
      m[:, :, rng.integers(0, Sq)] = False  # an empty row
      out["mask"] = jnp.asarray(m)
    elif f == "bias":
      out["bias"] = jnp.asarray(rng.standard_normal((1, H, Sq, Skv)), dtype)
    elif f == "sinks":
      out["sinks"] = jnp.asarray(rng.standard_normal(H), dtype)
    elif f == "scale" and "scale" not in out:
      out["scale"] = float(draw(st.floats(0.05, 1.0)))
    elif f == "array_scale" and "scale" not in out:
      out["scale"] = jnp.asarray(draw(st.floats(0.05, 1.0)), jnp.float32)
    elif f == "dropout":
      out.update(dropout_rate=draw(st.sampled_from([0.1, 0.3])),
                 dropout_rng=jax.random.key(int(rng.integers(0, 2**31))), deterministic=False)
  if mods:
    m = mods[0]
    if m == "softcap":
      out["score_mod"] = _score_mod.softcap(float(draw(st.floats(1.0, 20.0))))
    elif m == "alibi":
      out["score_mod"] = _score_mod.alibi(_score_mod.alibi_slopes(H).astype(dtype))
    else:
      dist = draw(st.integers(1, 8))
      table = jnp.asarray(0.3 * rng.standard_normal((H, 2 * dist + 1)), dtype)
      out["score_mod"] = _score_mod.relative_position_bias(table, max_distance=dist)
  if mask_mods:
    m = mask_mods[0]
    if m == "prefix_lm":
      out["mask_mod"] = _mask_mod.prefix_lm(jnp.asarray(rng.integers(0, Sq + 1, B), jnp.int32))
    elif m == "chunked":
      out["mask_mod"] = _mask_mod.chunked(draw(st.integers(1, 32)), causal=draw(st.booleans()))
    else:
      out["mask_mod"] = _mask_mod.sliding_window_with_global(draw(st.integers(1, 16)),
                                                            draw(st.integers(0, 4)))
  return out


__all__ = ["FEATURES", "problems", "shapes"]
