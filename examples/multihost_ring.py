"""Ring attention across processes (multi-host), runnable on one machine with CPU devices.

Each process owns `--local_devices` CPU devices; together they form one mesh axis "sp"
over which the sequence is sharded. The K/V chunks travel between processes through
XLA's collective-permute (gloo on CPU; NCCL on GPU clusters, where you would drop the
CPU flags and let jax.distributed.initialize() find the cluster).

Run two processes on this machine (in two shells, or as tests/test_multihost.py does):

    python examples/multihost_ring.py --process_id 0 --num_processes 2 \\
        --coordinator 127.0.0.1:12345 --out /tmp/ring.npz
    python examples/multihost_ring.py --process_id 1 --num_processes 2 \\
        --coordinator 127.0.0.1:12345

Process 0 writes the global out, lse and gradients to --out (if given).
"""
from __future__ import annotations

import argparse
import os

import numpy as np

SHAPE = dict(batch=2, heads=4, kv_heads=2, seq=128, head_dim=16)


def make_inputs(seed: int = 0, batch=SHAPE["batch"], heads=SHAPE["heads"],
                kv_heads=SHAPE["kv_heads"], seq=SHAPE["seq"], head_dim=SHAPE["head_dim"]):
  """Deterministic global float32 inputs: q, k, v, dout [batch, heads, seq, dim], dlse [batch, heads, seq]."""
  rng = np.random.default_rng(seed)
  f = lambda *s: rng.standard_normal(s).astype(np.float32)
  return dict(q=f(batch, heads, seq, head_dim), k=f(batch, kv_heads, seq, head_dim),
              v=f(batch, kv_heads, seq, head_dim), dout=f(batch, heads, seq, head_dim),
              dlse=f(batch, heads, seq))


def main():
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--process_id", type=int, required=True)
  p.add_argument("--num_processes", type=int, default=2)
  p.add_argument("--coordinator", default="127.0.0.1:12345")
  p.add_argument("--local_devices", type=int, default=4)
  p.add_argument("--causal", type=int, default=1)
  p.add_argument("--layout", default="zigzag", choices=("contiguous", "zigzag"))
  p.add_argument("--chunk", type=int, default=0,
                 help="> 0: mask_mod=flashvjp.chunked(chunk) (global positions) instead of causal")
  p.add_argument("--out", default=None, help="process 0 writes the results here (.npz)")
  args = p.parse_args()

  # Before jax initialises its CPU backend: virtual devices and cross-process collectives.
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                             + f" --xla_force_host_platform_device_count={args.local_devices}")
  import jax
  import jax.numpy as jnp
  from jax.experimental import multihost_utils
  from jax.sharding import Mesh
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  import flashvjp

  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.distributed.initialize(coordinator_address=args.coordinator,
                             num_processes=args.num_processes, process_id=args.process_id)
  n = jax.device_count()  # global: num_processes * local_devices
  mesh = Mesh(np.asarray(jax.devices()), ("sp",))

  data = make_inputs()
  if args.layout == "zigzag":  # natural order -> zigzag (on the host, before sharding)
    data = {k: np.asarray(flashvjp.to_zigzag(jnp.asarray(x), n, axis=2)) for k, x in data.items()}
  spec = lambda x: P(None, None, "sp") if x.ndim == 3 else P(None, None, "sp", None)

  def global_array(x):  # every process holds the full host array; each puts its own shards
    sharding = NamedSharding(mesh, spec(x))
    return jax.make_array_from_callback(x.shape, sharding, lambda idx: x[idx])

  arrays = {k: global_array(x) for k, x in data.items()}

  def local(q, k, v, dout, dlse):
    mask = ({"mask_mod": flashvjp.chunked(args.chunk)} if args.chunk > 0
            else {"causal": bool(args.causal)})
    f = lambda q, k, v: flashvjp.ring_attention(
        q, k, v, axis_name="sp", layout=args.layout, return_lse=True, **mask)
    (out, lse), vjp = jax.vjp(f, q, k, v)
    return (out, lse) + tuple(vjp((dout, dlse)))

  s4, s3 = P(None, None, "sp", None), P(None, None, "sp")
  step = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(s4, s4, s4, s4, s3),
                               out_specs=(s4, s3, s4, s4, s4)))
  results = step(arrays["q"], arrays["k"], arrays["v"], arrays["dout"], arrays["dlse"])
  names = ("out", "lse", "dq", "dk", "dv")
  # Gather to every host (outside the attention program) and undo the zigzag.
  full = {k: np.asarray(multihost_utils.process_allgather(x, tiled=True))
          for k, x in zip(names, results)}
  if args.layout == "zigzag":
    full = {k: np.asarray(flashvjp.from_zigzag(jnp.asarray(x), n, axis=2)) for k, x in full.items()}
  print(f"process {jax.process_index()}/{jax.process_count()}: {n} devices,"
        f" out {full['out'].shape}, |out| {np.abs(full['out']).mean():.6f}", flush=True)
  if args.out and jax.process_index() == 0:
    np.savez(args.out, **full)
  jax.distributed.shutdown()


if __name__ == "__main__":
  main()
