"""A Flax nnx decoder LM trained through flashvjp: scanned layers, remat, bf16, a (data,
sequence) mesh under plain `jax.jit`, Muon with QK-clip from the kernels' max logits.

Every piece is what a training run at scale uses, at a size a CPU runs in seconds:

* layers stacked with `nnx.vmap` and applied with `nnx.scan`, each under `nnx.remat` with
  `flashvjp.checkpoint_policy()`: the backward re-runs the layer's projections and MLP but
  not attention's forward (its output and logsumexp are saved, O(seq * head_dim));
* bf16 compute (float32 parameters, optimizer state and loss);
* tokens sharded `P("data", "seq")` over a 2 x 4 mesh of (virtual) devices, parameters
  replicated, plain `jax.jit`: inside, flash_attention sees q / k / v sharded along the
  sequence and runs a context-parallel strategy (ring or Ulysses, `flashvjp.explain`);
* `optax.contrib.muon` (Adam for the embeddings and norms), then QK-clip (MuonClip): a head
  whose max logit passed `tau` has its query and key projections scaled by
  `sqrt(tau / max_logit)` each, so its logits shrink by `tau / max_logit`;
* `--plan`: the same model's per-device memory for a 128k-token step on 8 H100s, from XLA's
  GPU compiler, without a GPU (`flashvjp.plan`'s machinery, docs/plan.md).

    python examples/train_lm.py                 # sharded vs one device, vs jax.nn attention
    python examples/train_lm.py --plan          # + the 128k-token 8 x H100 memory plan

The docs page docs/training.md shows its output; tests/test_train_lm.py runs it.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import re
import sys
import time

if __name__ == "__main__":  # 8 virtual CPU devices for the mesh (before jax is imported)
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  flags = os.environ.get("XLA_FLAGS", "")
  if "xla_force_host_platform_device_count" not in flags:
    os.environ["XLA_FLAGS"] = flags + " --xla_force_host_platform_device_count=8"
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import flashvjp


@dataclasses.dataclass(frozen=True)
class Config:
  vocab: int = 64
  dim: int = 64
  heads: int = 4
  layers: int = 2
  mlp: int = 128
  seq: int = 128
  batch: int = 4
  tau: float = 3.0  # QK-clip threshold (Kimi K2 used 100 at scale; small here so it acts)
  attention: str = "flashvjp"  # or "jax.nn" (the baseline)
  compute: jnp.dtype = jnp.bfloat16


def _init(rngs, *shape, scale=None):
  scale = shape[-2] ** -0.5 if scale is None else scale
  return nnx.Param(jax.random.normal(rngs.params(), shape, jnp.float32) * scale)


class Block(nnx.Module):
  """Pre-norm decoder block: causal self-attention and a GELU MLP."""

  def __init__(self, cfg: Config, rngs: nnx.Rngs):
    self.cfg = cfg
    d = cfg.dim
    self.norm1 = nnx.RMSNorm(d, rngs=rngs)
    self.norm2 = nnx.RMSNorm(d, rngs=rngs)
    self.wq, self.wk, self.wv = (_init(rngs, d, d) for _ in range(3))
    self.wo = _init(rngs, d, d)
    self.w1, self.w2 = _init(rngs, d, cfg.mlp), _init(rngs, cfg.mlp, d)

  def __call__(self, x):
    cfg, c = self.cfg, self.cfg.compute
    B, S, _ = x.shape
    h = self.norm1(x).astype(c)
    heads = lambda w: (h @ w[...].astype(c)).reshape(B, S, cfg.heads, cfg.dim // cfg.heads)
    q, k, v = heads(self.wq), heads(self.wk), heads(self.wv)
    if cfg.attention == "flashvjp":
      t = lambda a: a.transpose(0, 2, 1, 3)  # [B, H, S, D]
      o, max_logits = flashvjp.flash_attention(t(q), t(k), t(v), causal=True,
                                               return_max_logits=True)
      o = t(o)
      max_logits = max_logits.max(axis=0)  # [H]: the max over the batch, what QK-clip reads
    else:
      o = jax.nn.dot_product_attention(q, k, v, is_causal=True)
      max_logits = jnp.zeros((cfg.heads,), jnp.float32)  # jax.nn cannot report them
    x = x + (o.reshape(B, S, cfg.dim) @ self.wo[...].astype(c)).astype(x.dtype)
    h = self.norm2(x).astype(c)
    h = jax.nn.gelu(h @ self.w1[...].astype(c)) @ self.w2[...].astype(c)
    return x + h.astype(x.dtype), max_logits


class LM(nnx.Module):
  def __init__(self, cfg: Config, rngs: nnx.Rngs):
    self.cfg = cfg
    self.embed = nnx.Embed(cfg.vocab, cfg.dim, rngs=rngs)

    @nnx.split_rngs(splits=cfg.layers)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def stack(rngs):
      return Block(cfg, rngs)
    self.blocks = stack(rngs)  # every weight gets a leading [layers] axis
    self.norm = nnx.RMSNorm(cfg.dim, rngs=rngs)

  def __call__(self, tokens):
    """(logits [B, S, vocab] float32, max logits [layers, heads])."""
    x = self.embed(tokens)

    @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=(nnx.Carry, 0))
    @nnx.remat(policy=flashvjp.checkpoint_policy())
    def layers(x, block):
      return block(x)

    x, max_logits = layers(x, self.blocks)
    x = self.norm(x).astype(self.cfg.compute)
    logits = x @ self.embed.embedding[...].T.astype(self.cfg.compute)
    return logits.astype(jnp.float32), max_logits


def optimizer(model: LM) -> nnx.Optimizer:
  """Muon on the stacked [layers, in, out] matrices (layers a batch axis); Adam for the
  embedding and the norms (optax's default for what Muon does not take)."""
  dims = optax.contrib.MuonDimensionNumbers(reduction_axis=1, output_axis=2)
  spec = lambda params: jax.tree_util.tree_map_with_path(
      lambda path, p: dims if p.ndim == 3 else None, params)
  tx = optax.contrib.muon(learning_rate=0.02, adam_learning_rate=0.01,
                          muon_weight_dimension_numbers=spec)
  return nnx.Optimizer(model, tx, wrt=nnx.Param)


def qk_clip(model: LM, max_logits, tau: float):
  """MuonClip: heads whose max logit exceeds tau get W_q and W_k scaled by sqrt(tau / max)
  each (their logits by tau / max); the others are untouched."""
  cfg = model.cfg
  gamma = jnp.minimum(1.0, tau / jnp.maximum(max_logits, 1e-6))  # [layers, heads]
  per_col = jnp.repeat(jnp.sqrt(gamma), cfg.dim // cfg.heads, axis=1)[:, None, :]
  for w in (model.blocks.wq, model.blocks.wk):
    w[...] = w[...] * per_col  # [layers, dim, heads * head_dim] columns by head


def batches(cfg: Config, steps: int, seed: int = 0):
  """A learnable stream: x[t+1] = (5 x[t] + 3) mod vocab, random starts."""
  rng = np.random.default_rng(seed)
  for _ in range(steps):
    x0 = rng.integers(0, cfg.vocab, (cfg.batch, 1))
    seq = [x0]
    for _ in range(cfg.seq):
      seq.append((5 * seq[-1] + 3) % cfg.vocab)
    tok = np.concatenate(seq, axis=1).astype(np.int32)
    yield tok[:, :-1], tok[:, 1:]


@nnx.jit
def train_step(model: LM, opt: nnx.Optimizer, inputs, targets):
  def loss_fn(model):
    logits, max_logits = model(inputs)
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()
    return loss, max_logits
  (loss, max_logits), grads = nnx.value_and_grad(loss_fn, has_aux=True)(model)
  opt.update(model, grads)
  if model.cfg.attention == "flashvjp":
    qk_clip(model, max_logits, model.cfg.tau)
  return loss, max_logits


def train(cfg: Config, steps: int, mesh: Mesh | None = None, seed: int = 0):
  """Losses and max logits per step; on `mesh`: tokens P("data", "seq"), params replicated."""
  model = LM(cfg, nnx.Rngs(seed))
  opt = optimizer(model)
  if mesh is not None:
    state = nnx.state((model, opt))
    nnx.update((model, opt), jax.device_put(state, NamedSharding(mesh, P())))
  put = ((lambda x: jax.device_put(x, NamedSharding(mesh, P("data", "seq"))))
         if mesh is not None else jnp.asarray)
  losses, maxes, times = [], [], []
  for inputs, targets in batches(cfg, steps, seed):
    t0 = time.perf_counter()
    loss, ml = train_step(model, opt, put(inputs), put(targets))
    loss = float(loss)
    times.append(time.perf_counter() - t0)
    losses.append(loss)
    maxes.append(np.asarray(ml))
  return np.array(losses), np.array(maxes), np.array(times)


def make_mesh(data: int = 2, seq: int = 4) -> Mesh:
  return Mesh(np.array(jax.devices()[: data * seq]).reshape(data, seq), ("data", "seq"))


def plan_128k(target: str = "h100x8", layers: int = 4):
  """Per-device memory of one training step (loss, grads) at 128k tokens on `target`,
  compiled without the hardware; the sequence sharded over all its devices."""
  from jax.experimental import topologies

  from flashvjp import _plan
  _, platform, what, n, _ = _plan._resolve_target(target, None)
  _plan._need_compiler(platform, target)
  topo = _plan._topology(platform, what, n)
  mesh = topologies.make_mesh(topo, (1, n), ("data", "seq"))
  cfg = Config(vocab=32768, dim=2048, heads=16, layers=layers, mlp=8192, seq=131072, batch=1)
  abstract = nnx.eval_shape(lambda: LM(cfg, nnx.Rngs(0)))
  graphdef, state = nnx.split(abstract)
  rep = NamedSharding(mesh, P())
  state = jax.tree_util.tree_map(
      lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=rep), state)
  tok = jax.ShapeDtypeStruct((cfg.batch, cfg.seq), jnp.int32,
                             sharding=NamedSharding(mesh, P("data", "seq")))

  def loss(state, inputs, targets):
    logits, _ = nnx.merge(graphdef, state)(inputs)
    return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()

  compiled = jax.jit(jax.grad(loss)).lower(state, tok, tok).compile()
  mem = compiled.memory_analysis()
  hlo = compiled.as_text()
  q = jax.ShapeDtypeStruct((cfg.batch, cfg.heads, cfg.seq, cfg.dim // cfg.heads), cfg.compute,
                           sharding=NamedSharding(mesh, P("data", None, "seq", None)))
  d = flashvjp.explain(q, q, q, causal=True)
  count = lambda op: len(re.findall(rf"\s{op}(?:-start)?\(", hlo))
  return cfg, {
      "attention": f"{d.implementation} ({'interpret' if d.interpret else 'compiled'}),"
                   f" {d.context_parallel.name if d.context_parallel else 'no'} context"
                   " parallelism",
      "arguments_MiB": mem.argument_size_in_bytes / 2**20,
      "outputs_MiB": mem.output_size_in_bytes / 2**20,
      "temp_MiB": mem.temp_size_in_bytes / 2**20,
      "collective-permutes": count("collective-permute"),
      "all-to-alls": count("all-to-all"),
      "all-gathers": count("all-gather"),
      "all-reduces": count("all-reduce"),
  }


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--steps", type=int, default=20)
  ap.add_argument("--plan", action="store_true", help="also the 128k-token 8 x H100 memory plan")
  ap.add_argument("--compute", choices=["bfloat16", "float32"], default="bfloat16")
  args = ap.parse_args(argv)
  cfg = Config(compute=jnp.dtype(args.compute))
  mesh = make_mesh()
  q = jax.ShapeDtypeStruct((cfg.batch, cfg.heads, cfg.seq, cfg.dim // cfg.heads), cfg.compute,
                           sharding=NamedSharding(mesh, P("data", None, "seq", None)))
  d = flashvjp.explain(q, q, q, causal=True)
  print(f"attention on the (data=2, seq=4) mesh: {d.implementation},"
        f" context parallel: {d.context_parallel.name if d.context_parallel else None}")
  sharded, maxes, t_sh = train(cfg, args.steps, mesh)
  single, _, t_one = train(cfg, args.steps)
  base, _, t_nn = train(dataclasses.replace(cfg, attention="jax.nn"), args.steps)
  print("step  loss (2x4 mesh)  loss (1 device)  max logit (layer 0, mesh)")
  for i in range(args.steps):
    print(f"{i:4d}  {sharded[i]:15.4f}  {single[i]:15.4f}  {maxes[i, 0].max():8.3f}")
  print(f"max |loss difference| sharded vs one device: {np.abs(sharded - single).max():.2e}")
  med = lambda t: float(np.median(t[2:])) if len(t) > 3 else float(np.median(t))
  print(f"step time on one CPU device (median after compile): flashvjp {med(t_one) * 1e3:.1f} ms,"
        f" jax.nn.dot_product_attention {med(t_nn) * 1e3:.1f} ms"
        f" ({med(t_one) / med(t_nn):.2f}x); loss after {args.steps} steps: flashvjp"
        f" {single[-1]:.4f}, jax.nn {base[-1]:.4f}")
  if args.plan:
    pcfg, mem = plan_128k()
    print(f"128k-token step on 8 x H100 (deviceless): {pcfg.layers} layers, dim {pcfg.dim},"
          f" {pcfg.heads} heads, vocab {pcfg.vocab}: " + ", ".join(
              f"{k} {v:.1f}" if isinstance(v, float) else f"{k} {v}" for k, v in mem.items()))
  return sharded, single


if __name__ == "__main__":
  main()
