"""The worked recipe (examples/train_lm.py) at its CI size: a Flax nnx decoder LM with scanned,
rematerialised layers trained with Muon + QK-clip from the max logits, on a (data=2, seq=4)
mesh of virtual devices under plain jax.jit, equal to the same model on one device."""
from __future__ import annotations

import dataclasses
import importlib.util
import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import flashvjp

nnx = pytest.importorskip("flax.nnx")
pytest.importorskip("optax")

_PATH = pathlib.Path(__file__).resolve().parent.parent / "examples" / "train_lm.py"


@pytest.fixture(scope="module")
def recipe():
  spec = importlib.util.spec_from_file_location("train_lm", _PATH)
  mod = importlib.util.module_from_spec(spec)
  sys.modules["train_lm"] = mod  # its dataclasses look their module up
  spec.loader.exec_module(mod)
  return mod


def test_sharded_training_equals_one_device_and_learns(recipe):
  cfg = recipe.Config(compute=jnp.float32)  # float32: equality to rounding, not to bf16
  mesh = recipe.make_mesh()
  q = jax.ShapeDtypeStruct((cfg.batch, cfg.heads, cfg.seq, cfg.dim // cfg.heads), jnp.float32,
                           sharding=jax.sharding.NamedSharding(
                               mesh, jax.sharding.PartitionSpec("data", None, "seq", None)))
  d = flashvjp.explain(q, q, q, causal=True)
  assert d.context_parallel is not None, str(d)  # the sequence really is sharded
  sharded, maxes, _ = recipe.train(cfg, 4, mesh)
  single, maxes1, _ = recipe.train(cfg, 4)
  assert np.isfinite(sharded).all() and sharded[-1] < sharded[0] - 0.5
  np.testing.assert_allclose(sharded, single, rtol=2e-4)
  np.testing.assert_allclose(maxes, maxes1, rtol=2e-4)
  assert maxes.shape == (4, cfg.layers, cfg.heads)


def test_qk_clip_bounds_the_next_max_logits(recipe):
  cfg = dataclasses.replace(recipe.Config(compute=jnp.float32), layers=1)
  model = recipe.LM(cfg, nnx.Rngs(1))
  inputs, _ = next(recipe.batches(cfg, 1))
  _, ml = model(jnp.asarray(inputs))
  ml = np.asarray(ml)
  tau = float(np.median(ml))  # half the heads are clipped
  recipe.qk_clip(model, jnp.asarray(ml), tau)
  _, ml2 = model(jnp.asarray(inputs))
  # logits are bilinear in (W_q, W_k): each clipped head's max logit lands on tau exactly
  np.testing.assert_allclose(np.asarray(ml2), np.minimum(ml, tau), rtol=1e-5)
