"""Two processes x 4 CPU devices run ring attention fwd+bwd as one 8-device ring (gloo).

Starts examples/multihost_ring.py twice on a free local port, time-bound, and checks the
global results process 0 writes against float64 naive attention on the same inputs.
"""
from __future__ import annotations

import importlib.util
import os
import pathlib
import socket
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest

import flashvjp
from tests import _util

EXAMPLE = pathlib.Path(__file__).resolve().parents[1] / "examples" / "multihost_ring.py"
TIMEOUT_S = 240


def _load_example():
  spec = importlib.util.spec_from_file_location("multihost_ring", EXAMPLE)
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  return mod


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


@pytest.mark.parametrize("layout,chunk", [("zigzag", 0), ("contiguous", 24)])
def test_two_process_ring_matches_naive(tmp_path, layout, chunk):
  """Causal zigzag, and a mask_mod at global positions (chunked(24): chunks straddle the
  devices' chunk boundaries)."""
  out_file = tmp_path / "ring.npz"
  port = _free_port()
  env = dict(os.environ)
  env["XLA_FLAGS"] = ""  # the example sets its own device count (4 per process)
  env["JAX_PLATFORMS"] = "cpu"
  procs = []
  for pid in range(2):
    cmd = [sys.executable, str(EXAMPLE), "--process_id", str(pid), "--num_processes", "2",
           "--coordinator", f"127.0.0.1:{port}", "--local_devices", "4", "--causal", "1",
           "--layout", layout, "--chunk", str(chunk)]
    if pid == 0:
      cmd += ["--out", str(out_file)]
    procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                  text=True))
  logs = []
  try:
    for p in procs:
      logs.append(p.communicate(timeout=TIMEOUT_S)[0])
  except subprocess.TimeoutExpired:
    for p in procs:
      p.kill()
    pytest.fail(f"multi-process ring did not finish in {TIMEOUT_S}s")
  for pid, (p, log) in enumerate(zip(procs, logs)):
    assert p.returncode == 0, f"process {pid} failed:\n{log[-4000:]}"
    assert f"process {pid}/2: 8 devices" in log, log[-2000:]

  got = dict(jnp.load(out_file))
  data = _load_example().make_inputs()

  mask = {"mask_mod": flashvjp.chunked(chunk)} if chunk else {"causal": True}

  def f(q, k, v):
    return flashvjp.flash_attention(q, k, v, return_lse=True, implementation="naive", **mask)
  q, k, v, dout, dlse = _util.as64(tuple(jnp.asarray(data[n]) for n in ("q", "k", "v", "dout", "dlse")))
  (out, lse), vjp = jax.vjp(f, q, k, v)
  ref = dict(zip(("out", "lse", "dq", "dk", "dv"), (out, lse) + tuple(vjp((dout, dlse)))))
  for name, r in ref.items():
    _util.assert_close(got[name], r, jnp.float32, f"two-process {name}")
