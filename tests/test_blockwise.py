"""The shared test base run against the blockwise pure-JAX path, plus its own structure checks."""
import re

import jax
import jax.numpy as jnp
import pytest

import flashvjp
from tests import _util
from tests.attention_base import AttentionTests


class TestBlockwise(AttentionTests):
  IMPLEMENTATION = "blockwise"


def test_backward_is_hand_written_not_autodiff():
  """The grad jaxpr holds the custom_vjp; blockwise forward has no O(seq^2) residual."""
  q, k, v = _util.random_qkv(0, 1, 2, 2, 64, 64, 8)
  f = lambda q, k, v: flashvjp.flash_attention(q, k, v, implementation="blockwise", block_q=16,
                                               block_kv=16).sum()
  jaxpr = str(jax.make_jaxpr(jax.grad(f, (0, 1, 2)))(q, k, v))
  assert "custom_vjp_call" in jaxpr
  # Residuals saved for the backward: inputs, out and lse only (nothing of size seq^2).
  _, vjp = jax.vjp(lambda q, k, v: flashvjp.flash_attention(
      q, k, v, implementation="blockwise", block_q=16, block_kv=16), q, k, v)
  leaves = jax.tree_util.tree_leaves(vjp)
  assert leaves, "vjp closure holds no residuals"
  assert max(x.size for x in leaves if hasattr(x, "size")) < 64 * 64 * 2


# `%name = f32[8,256,64]{2,1,0} ...`: an instruction's (or fusion parameter's) shape and layout.
_DEF = re.compile(r"%(\S+) = \w+\[([\d,]*)\]\{([\d,]*)")
_DOT = re.compile(r"dot\(%([^,\s)]+), %[^,\s)]+\), lhs_batch_dims=\{[\d,]*\}, "
                  r"lhs_contracting_dims=\{(\d+)\}")


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_every_matmul_is_plain(dtype):
  """Every dot of jit(grad) contracts its left operand's last, minor-most axis.

  XLA:CPU runs a dot that contracts the left operand's other axis (dK = dS^T Q from a
  q-major tile) as a transposed-operand product, 2-2.5x slower in float32 and 8-10x in bfloat16
  (benchmarks/results/cpu_roofline.md, section 1b); the backward is kv-major for this.
  """
  x = jax.ShapeDtypeStruct((1, 4, 512, 64), dtype)
  loss = lambda q, k, v: flashvjp.flash_attention(
      q, k, v, causal=True, implementation="blockwise").astype(jnp.float32).sum()
  text = jax.jit(jax.grad(loss, (0, 1, 2))).lower(x, x, x).compile().as_text()
  shapes = {m.group(1): (m.group(2).split(","), m.group(3)) for m in _DEF.finditer(text)}
  dots = _DOT.findall(text)
  assert len(dots) >= 7, f"expected the forward's 2 and the backward's 5 products: {dots}"
  for lhs, contracting in dots:
    dims, layout = shapes[lhs]
    rank = len(dims)
    assert int(contracting) == rank - 1, f"dot contracts axis {contracting} of {lhs} {dims}"
    assert layout.split(",")[0] == str(rank - 1), f"{lhs} {dims} has layout {{{layout}}}"


@pytest.mark.parametrize("name, blocks", [
    ("causal", (4, 4)), ("causal_square", (4, 8)), ("window", (4, 4)),
    ("window_left_only", (4, 4)), ("causal_window", (8, 4)), ("plain", (4, 4)),
])
def test_carried_pair_walk_against_naive(name, blocks):
  """More than `_impl._MAX_UNROLLED_ROWS` block rows: the static pair list is walked with
  (row, col) in the loop state (`_pairs`' carried walk); forward, lse and gradients match
  naive, and the jvp (the tangent pass walks the same list)."""
  from flashvjp.blockwise import _impl  # pylint: disable=import-outside-toplevel
  from tests import attention_base as base  # pylint: disable=import-outside-toplevel
  # the carried walk runs (in the forward by q blocks, in the backward by kv blocks)
  assert max(-(-base.SQ // blocks[0]), -(-base.SKV // blocks[1])) > _impl._MAX_UNROLLED_ROWS
  got = base.run_case("blockwise", name, jnp.float32, block_q=blocks[0], block_kv=blocks[1])
  ref = base.run_case("naive", name, jnp.float32)
  _util.assert_close(got, ref, jnp.float32, what=f"blockwise/{name}/carried walk")
  q, k, v, _, d, with_diff = base.case_problem(name, jnp.float32, 0)
  tq, tk, tv = _util.random_qkv(5, base.B, base.H, base.HKV, q.shape[2], k.shape[2], base.D,
                                v.shape[3])

  def f(impl, q, k, v, **extra):
    return flashvjp.flash_attention(q, k, v, implementation=impl, return_lse=True,
                                    **with_diff(d, **extra))
  got_t = jax.jvp(lambda *a: f("blockwise", *a, block_q=blocks[0], block_kv=blocks[1]),
                  (q, k, v), (tq, tk, tv))
  ref_t = jax.jvp(lambda *a: f("naive", *a), _util.as64((q, k, v)), _util.as64((tq, tk, tv)))
  _util.assert_close(got_t, ref_t, jnp.float32, what=f"blockwise/{name}/carried walk jvp")
