"""Compiled once per static configuration: eager calls reuse one executable, jit traces once.

Compilations are counted with jax's monitoring event for backend compiles (one event per
XLA compile, eager op-by-op dispatch included); traces with a Python side effect in the
traced function and the jit cache size.
"""
import pathlib
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import flashvjp
from tests import _util


@pytest.fixture(scope="module")
def counter():
  return _util.CompileCounter()


def _three_calls(counter, fn):
  return [counter.count(fn) for _ in range(3)]


@pytest.mark.parametrize("impl", ["blockwise", "naive"])
def test_eager_flash_attention_compiles_once(counter, impl):
  q, k, v = _util.random_qkv(0, 1, 4, 2, 40, 40, 16)
  counts = _three_calls(counter, lambda: flashvjp.flash_attention(
      q, k, v, causal=True, implementation=impl, block_q=16, block_kv=16))
  assert counts[0] >= 1, counts  # the counter sees compiles at all
  assert counts[1:] == [0, 0], counts
  # Another static configuration compiles again (the cache is keyed on the config).
  assert counter.count(lambda: flashvjp.flash_attention(
      q, k, v, causal=False, implementation=impl, block_q=16, block_kv=16)) >= 1


def test_eager_grad_compiles_once(counter):
  q, k, v = _util.random_qkv(1, 1, 2, 2, 24, 24, 8)
  g = lambda: jax.grad(lambda q: jnp.sum(flashvjp.flash_attention(
      q, k, v, causal=True, implementation="blockwise", block_q=8, block_kv=8) ** 2))(q)
  counts = _three_calls(counter, g)
  assert counts[1:] == [0, 0], counts


def test_eager_dot_product_attention_compiles_once(counter):
  q, k, v = (jnp.swapaxes(x, 1, 2) for x in _util.random_qkv(2, 2, 4, 4, 32, 32, 16))
  lengths = jnp.asarray([32, 20], jnp.int32)
  counts = _three_calls(counter, lambda: flashvjp.dot_product_attention(
      q, k, v, is_causal=True, key_value_seq_lengths=lengths))
  assert counts[1:] == [0, 0], counts


def test_eager_score_mod_compiles_once(counter):
  """A score_mod defined once, one rebuilt on every call, and one closing over an array."""
  q, k, v = _util.random_qkv(3, 1, 4, 4, 24, 24, 8)
  run = lambda sm: flashvjp.flash_attention(q, k, v, score_mod=sm, implementation="blockwise",
                                            block_q=8, block_kv=8)
  once = lambda s, b, h, qi, ki: s * 0.5 + jnp.where(ki > qi, -1.0, 0.0).astype(s.dtype)
  assert _three_calls(counter, lambda: run(once))[1:] == [0, 0]
  assert _three_calls(counter, lambda: run(flashvjp.softcap(20.0)))[1:] == [0, 0]
  slopes = flashvjp.alibi_slopes(4)
  counts = _three_calls(counter, lambda: run(flashvjp.alibi(slopes)))
  assert counts[1:] == [0, 0], counts
  # New slope values reuse the executable, and are used (the result changes).
  a, slopes2 = run(flashvjp.alibi(slopes)), 2.0 * slopes
  assert counter.count(lambda: run(flashvjp.alibi(slopes2))) == 0
  assert not np.allclose(np.asarray(a), np.asarray(run(flashvjp.alibi(slopes2))))
  # A different softcap value is a different computation: compiled (and correct).
  assert counter.count(lambda: run(flashvjp.softcap(3.0))) >= 1


def test_eager_traced_scale_compiles_once(counter):
  q, k, v = _util.random_qkv(4, 1, 2, 2, 16, 16, 8)
  counts = [counter.count(lambda i=i: flashvjp.flash_attention(
      q, k, v, scale=jnp.float32(0.1 * (i + 1)), implementation="blockwise")) for i in range(3)]
  assert counts[1:] == [0, 0], counts


_RETRACE = textwrap.dedent("""
    import jax, jax.numpy as jnp
    import flashvjp
    traces = []
    def f(q, k, v):
      traces.append(1)
      return flashvjp.flash_attention(q, k, v, causal=True, implementation="pallas",
                                      block_q=16, block_kv=16)
    jf = jax.jit(f)
    q = jax.random.normal(jax.random.key(0), (1, 2, 32, 16), jnp.float32)
    for _ in range(3):
      jf(q, q, q).block_until_ready()
    g = jax.jit(jax.grad(lambda q: jnp.sum(f(q, q, q))))
    for _ in range(2):
      g(q).block_until_ready()
    print("TRACES", len(traces), jf._cache_size(), g._cache_size())
""")


def test_jitted_pallas_traces_once():
  """A fresh process (Pallas not yet imported): the first jitted call must not change jit's key.

  Pallas defines jax config states (part of jit's cache key) when it is imported; imported
  lazily inside the first trace they made the second call retrace.
  """
  out = subprocess.run([sys.executable, "-c", _RETRACE], capture_output=True, text=True,
                       timeout=600, check=False)
  assert out.returncode == 0, out.stderr[-3000:]
  line = [l for l in out.stdout.splitlines() if l.startswith("TRACES")][-1]
  n_traces, jf_cache, g_cache = map(int, line.split()[1:])
  assert (n_traces, jf_cache, g_cache) == (2, 1, 1), line  # one trace for jf, one for g


# Tracing and lowering flash_attention must run no jax op: every static bound, block range,
# pair list, trip count and list width is computed in numpy / Python (`_mask.is_static`),
# and an elementwise mask_mod / score_mod is proven so without evaluating it. Checked in a
# fresh process, where any eager jax op compiles (so the backend-compile count is 0 only
# when none runs), and under jax.transfer_guard("disallow"), where an eager op on host
# values raises. Dynamic parts (segment ids, a BlockMask's classes, mask_mod arrays) are
# jit arguments and stay traced.
_NO_DISPATCH = textwrap.dedent("""
    import sys
    import jax, jax.numpy as jnp
    import flashvjp
    compiles = []
    def on_event(event, duration, **kw):
      if event == "/jax/core/compile/backend_compile_duration":
        compiles.append(event)
    jax.monitoring.register_event_duration_secs_listener(on_event)
    B, H, S, D = 1, 2, 256, 16
    x = jax.ShapeDtypeStruct((B, H, S, D), jnp.float32)
    ids = jax.ShapeDtypeStruct((B, S), jnp.int32)
    blk = dict(block_q=64, block_kv=64)
    chunk = flashvjp.chunked(64)
    def grad_of(impl, **kw):
      interp = dict(interpret=True) if impl.startswith("pallas") else {}
      def loss(q, k, v, *dyn):
        extra = {}
        if "seg" in kw:
          extra["segment_ids"] = dyn[0]
        if "doc" in kw:
          extra["mask_mod"] = flashvjp.document_causal(dyn[0])
        if "block_mask" in kw:
          extra["mask_mod"], extra["block_mask"] = chunk, dyn[0]
        opts = {n: o for n, o in kw.items()
                if n not in ("seg", "doc", "block_mask", "jvp", "rows16")}
        blocks = dict(block_q=16, block_kv=16) if kw.get("rows16") else blk
        f = lambda q_: flashvjp.flash_attention(q_, k, v, implementation=impl, **blocks,
                                               **interp, **opts, **extra)
        if kw.get("jvp"):
          return jnp.sum(jax.jvp(f, (q,), (q,))[1])
        return jnp.sum(f(q))
      dyn = ()
      if "seg" in kw or "doc" in kw:
        dyn = (ids,)
      if "block_mask" in kw:
        dyn = (flashvjp.make_block_mask(chunk, B, H, S, S, 64, 64),)
      fn = jax.jit(loss) if kw.get("jvp") else jax.jit(jax.grad(loss))
      return fn, (x, x, x) + dyn
    cases = [
        ("blockwise", dict(causal=True)), ("blockwise", dict(window=(70, 0))),
        ("blockwise", dict(window=(40, 40))), ("blockwise", dict(causal=True, seg=True)),
        ("blockwise", dict(mask_mod=chunk)), ("blockwise", dict(doc=True)),
        ("blockwise", dict(block_mask=True)),
        ("blockwise", dict(causal=True, score_mod=flashvjp.softcap(20.0))),
        ("blockwise", dict(causal=True, jvp=True)), ("blockwise", dict(causal=True, rows16=True)),
        ("blockwise", dict(window=(40, 0), rows16=True, jvp=True)),
        ("pallas_triton", dict(causal=True)), ("pallas_triton", dict(causal=True, seg=True)),
        ("pallas_triton", dict(mask_mod=chunk)), ("pallas_triton", dict(causal=True, jvp=True)),
        ("pallas_tpu", dict(causal=True)), ("pallas_tpu", dict(window=(70, 0), seg=True)),
        ("pallas_tpu", dict(mask_mod=chunk)), ("pallas_tpu", dict(causal=True, jvp=True)),
    ]
    for impl, kw in cases:
      fn, args = grad_of(impl, **kw)  # (make_block_mask compiles here, outside the trace)
      before = len(compiles)
      try:
        with jax.transfer_guard("disallow"):
          fn.lower(*args)
        err = ""
      except Exception as e:  # an eager op on host values
        err = type(e).__name__ + ": " + str(e).splitlines()[0][:160]
      name = impl + " " + ",".join(sorted(k for k in kw if k not in ("mask_mod", "score_mod"))
                                   + [k for k in ("mask_mod", "score_mod") if k in kw])
      print("CASE", name, "|", len(compiles) - before, "|", err, flush=True)
""")


def test_tracing_runs_no_jax_op():
  """jit(grad) (and jit(jvp)) of flash_attention with static masks: trace + lower run no
  eager jax op and compile nothing (blockwise, both Pallas families in interpret mode)."""
  out = subprocess.run([sys.executable, "-c", _NO_DISPATCH], capture_output=True, text=True,
                       timeout=900, check=False, cwd=pathlib.Path(__file__).resolve().parents[1])
  assert out.returncode == 0, out.stderr[-3000:]
  cases = [l.split("|") for l in out.stdout.splitlines() if l.startswith("CASE")]
  assert len(cases) == 19, out.stdout + out.stderr[-2000:]
  bad = [f"{name.strip()}: {n.strip()} XLA compiles {err.strip()}" for name, n, err in cases
         if n.strip() != "0" or err.strip()]
  assert not bad, "\n".join(bad)
