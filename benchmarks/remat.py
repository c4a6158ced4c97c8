"""A checkpointed layer's attention forward runs once with `flashvjp.checkpoint_policy`.

The issue's layer (x -> q, k, v named -> causal flash_attention -> "context" -> out
projection), `jit(grad)` compiled without the hardware for one H100 (Triton and Mosaic-GPU
kernels, XLA's GPU compiler from the CUDA plugin), one TPU v5e (Mosaic-TPU, libtpu) and the
CPU (blockwise), under three policies: no remat; `save_only_these_names("q", "k", "v",
"context")` (MaxText's); and that policy passed through `flashvjp.checkpoint_policy`. Counts
the attention kernels (custom calls) or the blockwise forward / backward loops in the
compiled program, and the compiled temp memory (`memory_analysis()`).

    python benchmarks/remat.py            # prints the table, writes benchmarks/results/remat.md
"""
from __future__ import annotations

import os
import re
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
os.environ.setdefault("XLA_FLAGS", "--xla_cpu_experimental_ynn_fusion_type=individual_dot")

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import flashvjp
from flashvjp import _plan

B, S, E, H = 2, 8192, 1024, 8
USER = jax.checkpoint_policies.save_only_these_names("q", "k", "v", "context")
POLICIES = {"no remat": None, "save q, k, v, context": USER,
            "flashvjp.checkpoint_policy(same)": flashvjp.checkpoint_policy(USER)}
ROWS = [  # (target, implementation, what to count)
    ("h100", "pallas_triton", "__gpu$xla.gpu.triton"),
    ("h100", "pallas_mosaic_gpu", 'custom_call_target="mosaic_gpu'),
    ("v5e", "pallas_tpu", "tpu_custom_call"),
    ("cpu", "blockwise", None),
]


def layer(x, w, implementation):
  D = E // H
  heads = lambda t: t.reshape(B, S, H, D).transpose(0, 2, 1, 3)
  q, k, v = (checkpoint_name(heads(x @ w[i]), n) for i, n in enumerate("qkv"))
  o = flashvjp.flash_attention(q, k, v, causal=True, implementation=implementation)
  o = checkpoint_name(o, "context")
  return o.transpose(0, 2, 1, 3).reshape(B, S, E) @ w[3]


def _mesh(target):
  if target == "cpu":
    return None
  from jax.experimental import topologies
  _, platform, what, n, _ = _plan._resolve_target(target, None)
  _plan._need_compiler(platform, target)
  return topologies.make_mesh(_plan._topology(platform, what, n), (n,), ("d",))


def _count(hlo, call):
  if call is not None:
    return str(hlo.count(call))
  ops = re.findall(r"\swhile\([^\n]*?op_name=\"([^\"]*)\"", hlo)
  n = lambda w: sum(f"flashvjp_blockwise_{w}/" in o for o in ops)
  return f"{n('fwd')} fwd + {n('bwd')} bwd loops"


def _inputs(mesh):
  dt = jnp.bfloat16 if mesh is not None else jnp.float32
  kw = {} if mesh is None else {"sharding": NamedSharding(mesh, P())}
  return (jax.ShapeDtypeStruct((B, S, E), dt, **kw), jax.ShapeDtypeStruct((4, E, E), dt, **kw))


def _grad(impl, policy):
  def f(x, w):
    return layer(x, w, impl)
  g = f if policy is None else jax.checkpoint(f, policy=policy)
  return jax.jit(jax.grad(lambda x, w: g(x, w).astype(jnp.float32).sum(), argnums=(0, 1)))


def main():
  lines = ["| target | implementation | policy | attention passes in the compiled program |"
           " temp (MiB) |", "|---|---|---|---|---:|"]
  for target, impl, call in ROWS:
    try:
      mesh = _mesh(target)
    except RuntimeError as e:
      print(f"skip {target}: {e}")
      continue
    x, w = _inputs(mesh)
    for name, policy in POLICIES.items():
      compiled = _grad(impl, policy).lower(x, w).compile()
      temp = compiled.memory_analysis().temp_size_in_bytes / 2**20
      row = (f"| {target} | {impl} | {name} | {_count(compiled.as_text(), call)} |"
             f" {temp:.1f} |")
      print(row, flush=True)
      lines.append(row)
  text = (f"# A checkpointed layer's attention passes (benchmarks/remat.py)\n\n"
          f"jax {jax.__version__}; B={B} S={S} E={E} H={H} causal, `jit(grad)` of the layer"
          " in `benchmarks/remat.py`, compiled without the hardware (bf16 for H100 / v5e,"
          " float32 on the CPU). Kernel counts are custom calls of the attention kernels"
          " (forward, dK/dV, dQ); blockwise counts its loops.\n\n" + "\n".join(lines) + "\n")
  out = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "remat.md")
  with open(out, "w") as fh:
    fh.write(text)
  print(f"wrote {out}")


if __name__ == "__main__":
  main()
