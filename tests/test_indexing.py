"""How a mod reads the arrays it closes over (flashvjp/_indexing.py, issue 32's first step):
each FlexAttention-style operand falls in its class, explain says so, and a kernel family's
refusal names the operand and what would make it compile."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import flashvjp
from flashvjp import _indexing
from flashvjp import _mask_mod
from flashvjp import _score_mod

TABLE = jnp.ones((4, 13), jnp.float32)
VEC = jnp.ones((64,), jnp.float32)
BKV = jnp.ones((2, 64), jnp.float32)
T5 = jnp.ones((4, 32), jnp.float32)
DOC = jnp.zeros((2, 64), jnp.int32)


def _t5(s, b, h, q, kv):
  """A T5-style bucketed relative position (exact near, log-spaced far, signed)."""
  rel = kv - q
  near = jnp.abs(rel)
  far = 8 + jnp.minimum(jnp.log(near.astype(jnp.float32) + 1.0).astype(jnp.int32), 7)
  bucket = jnp.where(near < 8, near, far) + jnp.where(rel > 0, 16, 0)
  return s + T5[h, bucket]


SCORE_MODS = {
    "relative_position_bias": (flashvjp.relative_position_bias(TABLE, 6), "by kv_idx - q_idx"),
    "t5 buckets": (_t5, "by kv_idx - q_idx"),
    "alibi": (flashvjp.alibi(jnp.ones((4,))), "per (b, h)"),
    "per-key bias": (lambda s, b, h, q, kv: s + VEC[kv], "by kv position"),
    "per-batch key padding": (lambda s, b, h, q, kv: s + BKV[b, kv], "by kv position"),
    "per-query temperature": (lambda s, b, h, q, kv: s * VEC[q], "by q position"),
    "both positions": (lambda s, b, h, q, kv: s + TABLE[q % 4, kv % 13], "otherwise"),
    "by the score": (lambda s, b, h, q, kv: s + VEC[jnp.clip(s, 0, 63).astype(jnp.int32)],
                     "otherwise"),
    "reduced whole": (lambda s, b, h, q, kv: s + jnp.sum(TABLE), "whole"),
}


@pytest.mark.parametrize("name", list(SCORE_MODS))
def test_score_mod_operands(name):
  mod, want = SCORE_MODS[name]
  fn, consts, _ = _score_mod.convert(mod, jnp.float32)
  ops = _indexing.of_mod(fn, "score_mod")
  arrays = [o for o in ops if np.prod(o.shape) > 1]
  assert [o.how for o in arrays] == [want], [str(o) for o in ops]
  assert len(ops) == len(consts)


def test_mask_mod_operands_and_numbering():
  fn, _ = _mask_mod.convert(flashvjp.document_causal(DOC))
  (op,) = _indexing.of_mod(fn, "mask_mod")
  assert op.how == "by q position and by kv position" and op.shape == (2, 64)
  fn, _ = _mask_mod.convert(flashvjp.prefix_lm(jnp.asarray([3, 5])))
  assert [o.how for o in _indexing.of_mod(fn, "mask_mod")] == ["per (b, h)"]
  # numbered as the call passes them: the score_mod's inexact operands first
  ids = jnp.arange(64, dtype=jnp.int32)
  fn, consts, _ = _score_mod.convert(
      lambda s, b, h, q, kv: s + VEC[ids[kv] % 64] * TABLE[h, 0], jnp.float32)
  ops = _indexing.of_mod(fn, "score_mod")
  assert [(o.shape, o.dtype) for o in ops] == [(tuple(c.shape), str(c.dtype)) for c in consts]
  got = {(o.shape, o.dtype): o.how for o in ops}
  assert got == {((64,), "float32"): "by kv position", ((4, 13), "float32"): "per (b, h)",
                 ((64,), "int32"): "by kv position"}, got


def test_explain_names_the_classes_and_the_refusal_names_the_operand():
  q = jax.ShapeDtypeStruct((2, 4, 64, 32), jnp.float32)
  d = flashvjp.explain(q, q, q, score_mod=SCORE_MODS["per-key bias"][0],
                       mask_mod=flashvjp.document_causal(DOC))
  assert [o.how for o in d.operands] == ["by kv position", "by q position and by kv position"]
  assert "score_mod[0] float32[64]: by kv position" in str(d)
  for impl, target in (("pallas_triton", "h100"), ("pallas_tpu", "v5e")):  # compiled
    d = flashvjp.explain(q, q, q, score_mod=SCORE_MODS["relative_position_bias"][0],
                         implementation=impl, interpret=False, target=target)
    assert [o.how for o in d.operands] == ["by kv_idx - q_idx"]
  with pytest.raises(ValueError, match="make each read depend on one position"):
    flashvjp.explain(q, q, q, score_mod=SCORE_MODS["both positions"][0],
                     implementation="pallas_tpu", interpret=False, target="v5e")
