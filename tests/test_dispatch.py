"""Dispatch: decided before tracing, visible, never a silent substitute."""
import logging as pylogging

import jax
import jax.numpy as jnp
import pytest
from absl import logging

import flashvjp
from flashvjp import _dispatch

x = jax.ShapeDtypeStruct((1, 2, 16, 8), jnp.float32)


def test_default_on_cpu_is_blockwise_with_a_reason():
  if _dispatch.platform() != "cpu":
    pytest.skip("CPU dispatch rule")
  d = flashvjp.explain(x, x, x, causal=True)
  assert d.implementation == "blockwise"
  assert "cpu" in d.reason


@pytest.mark.parametrize("impl", ["naive", "blockwise"])
def test_requested_implementation_is_honoured(impl):
  assert flashvjp.explain(x, x, x, implementation=impl).implementation == impl


def test_the_path_taken_is_logged(caplog):
  q = jnp.zeros((1, 2, 16, 8), jnp.float32)
  old = logging.get_verbosity()
  logging.set_verbosity(logging.DEBUG)
  try:
    with caplog.at_level(pylogging.DEBUG):
      flashvjp.flash_attention(q, q, q, implementation="blockwise")
  finally:
    logging.set_verbosity(old)
  assert any("flashvjp attention path: blockwise" in r.getMessage() for r in caplog.records)


def test_the_named_backend_really_runs(monkeypatch):
  """implementation='blockwise' goes through the blockwise forward (no substitute)."""
  from flashvjp import blockwise
  calls = []
  real = blockwise.forward
  monkeypatch.setattr(blockwise, "forward", lambda *a: calls.append(1) or real(*a))
  # A shape no other test uses: the body is compiled once per static configuration, so a
  # configuration traced before would reuse its executable without calling forward again.
  q = jnp.zeros((1, 2, 19, 8), jnp.float32)
  flashvjp.flash_attention(q, q, q, implementation="blockwise")
  assert calls


# ---- kernel families ---------------------------------------------------------------

def test_pallas_means_this_platforms_family(monkeypatch):
  """"pallas" is Triton on GPU (and CPU, in interpret mode), Mosaic on TPU."""
  monkeypatch.setattr(_dispatch, "platform", lambda: "gpu")
  assert flashvjp.explain(x, x, x, implementation="pallas").implementation == "pallas_triton"
  monkeypatch.setattr(_dispatch, "platform", lambda: "cpu")
  d = flashvjp.explain(x, x, x, implementation="pallas")
  assert (d.implementation, d.interpret, d.family) == ("pallas_triton", True, "triton")


def test_named_family_runs_interpreted_off_its_platform():
  if _dispatch.platform() != "cpu":
    pytest.skip("CPU dispatch rule")
  d = flashvjp.explain(x, x, x, implementation="pallas_triton")
  assert d.implementation == "pallas_triton" and d.interpret


def test_named_family_with_interpret_false_lowers_the_compiled_kernels():
  """How a CPU host exports the GPU path (jax.export(..., platforms=["cuda"])): visible."""
  if _dispatch.platform() != "cpu":
    pytest.skip("CPU dispatch rule")
  d = flashvjp.explain(x, x, x, implementation="pallas_triton", interpret=False)
  assert d.implementation == "pallas_triton" and not d.interpret
  assert "jax.export" in d.reason
  with pytest.raises(ValueError, match="interpret=False"):
    flashvjp.explain(x, x, x, implementation="pallas", interpret=False)
