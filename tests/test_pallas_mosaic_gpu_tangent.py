"""The Mosaic-GPU tangent kernel (forward mode) under GPU interpret mode on CPU, races checked.

t_out and t_lse of `flashvjp.pallas.mosaic_gpu.tangent` against forward-mode autodiff of
float64 naive attention (out / lse also from that reference): causal GQA with ragged
lengths, window, segment ids (visit lists), a dense mask with a bias and its tangent,
dropout, head_dim_v != head_dim, out=None (the caller's `- t_lse * out`), some tangents
absent, a score_mod with a tangent on its slopes, a mask_mod, a chunk pair at global
offsets. Every run asserts that the interpreter found no race; removing a barrier wait is
reported. Through `jax.jvp` of `flash_attention` it is what forward mode runs
(tests/test_pallas_mosaic_gpu_api.py).
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flashvjp import _dropout
from flashvjp import _mask_mod
from flashvjp import reference
from flashvjp.pallas.mosaic_gpu import _compat
from tests import _util
from tests import test_pallas_mosaic_gpu_backward as _backward_tests

_WHY = _compat.unavailable()
pytestmark = pytest.mark.skipif(_WHY is not None, reason=f"Mosaic-GPU Pallas: {_WHY}")

if _WHY is None:
  from flashvjp.pallas.mosaic_gpu import tangent as mgpu_tangent


_cfg = _backward_tests._cfg  # interpret mode, the caller's mask and features


def _alibi_softcap(s, b, h, q_idx, kv_idx, slopes):
  s = s - slopes[h] * jnp.abs(q_idx - kv_idx).astype(s.dtype)
  return 20.0 * jnp.tanh(s / 20.0)


def _prefix_lm(b, h, q_idx, kv_idx, lengths):
  return (kv_idx <= q_idx) | (kv_idx < lengths[b])


# name: (B, H, Hkv, Sq, Skv, D, Dv, dtype, cfg kwargs, features)
CASES = {
    "causal_gqa_ragged": (1, 4, 2, 200, 136, 64, 64, jnp.bfloat16, dict(causal=True), ""),
    "window_d128_f16_no_tq": (1, 2, 1, 96, 160, 128, 128, jnp.float16,
                              dict(window=(40, 10)), "no_tq"),
    "segments_causal_no_tk": (2, 2, 1, 192, 192, 64, 64, jnp.bfloat16, dict(causal=True),
                              "segments+no_tk"),
    "mask_bias_tbias": (2, 2, 1, 130, 100, 64, 64, jnp.bfloat16, {}, "mask+bias"),
    "dropout_gqa": (1, 4, 2, 130, 130, 64, 64, jnp.bfloat16, dict(dropout_rate=0.2),
                    "dropout"),
    "dv64_d128_causal_out_none": (1, 2, 1, 130, 130, 128, 64, jnp.bfloat16,
                                  dict(causal=True), "out_none"),
    "score_mod_tslopes": (2, 2, 2, 128, 128, 64, 64, jnp.bfloat16,
                          dict(causal=True, score_mod=_alibi_softcap, num_diff_consts=1),
                          "slopes"),
    "mask_mod_window": (2, 2, 1, 100, 100, 64, 64, jnp.bfloat16,
                        dict(window=(60, None), mask_mod=_prefix_lm), "prefix"),
    # head dim 256: two programs per q block, each t_out's half (t_out = a - mu out by chunk)
    "causal_d256_gqa": (1, 2, 1, 130, 100, 256, 256, jnp.bfloat16, dict(causal=True), ""),
    "d256_dv64_out_none": (1, 2, 1, 96, 96, 256, 64, jnp.bfloat16, {}, "out_none"),
}


def _case(name):
  B, H, Hkv, Sq, Skv, D, Dv, dtype, kw, features = CASES[name]
  cfg = _cfg(Sq, Skv, D, **kw)
  seed = sorted(CASES).index(name)
  q, k, v = _util.random_qkv(seed, B, H, Hkv, Sq, Skv, D, Dv, dtype=dtype)
  tq, tk, tv = _util.random_qkv(seed + 50, B, H, Hkv, Sq, Skv, D, Dv, dtype=dtype)
  rng = np.random.default_rng(seed)
  args = dict(bias=None, mask=None, q_seg=None, kv_seg=None, seed=None, consts=(), mod=None)
  tans = dict(tq=None if "no_tq" in features else tq, tk=None if "no_tk" in features else tk,
              tv=tv, tbias=None, tconsts=None)
  if "segments" in features:
    args["q_seg"] = args["kv_seg"] = _util.segment_ids(B, Sq, [[40, 150], [100]])
  if "mask" in features:
    m = rng.random((B, 1, Sq, Skv)) > 0.3
    m[-1, :, 5] = False  # an empty row
    args["mask"] = jnp.asarray(m)
    args["bias"] = jnp.asarray(rng.standard_normal((1, H, Sq, Skv)), jnp.float32)
    tans["tbias"] = jnp.asarray(rng.standard_normal((1, H, Sq, Skv)), jnp.float32)
  if "dropout" in features:
    args["seed"] = _dropout.seed_from_key(jax.random.key(3))
  if "slopes" in features:
    args["consts"] = (jnp.asarray([0.5, 0.125], jnp.float32),)
    tans["tconsts"] = (jnp.asarray([0.3, -0.7], jnp.float32),)
  if "prefix" in features:
    args["mod"] = _mask_mod.ModInputs(None, (jnp.asarray([30, 70], jnp.int32),))
  return cfg, (q, k, v), args, tans, features


def _reference(cfg, qkv, args, tans):
  """(out, lse, t_out, t_lse) of float64 naive attention, forward-mode autodiff."""
  f64 = _util.as64
  n_c = len(args["consts"])

  def f(q, k, v, bias, *consts):
    return reference.attention(cfg, q, k, v, bias, args["mask"], args["q_seg"],
                               args["kv_seg"], args["seed"], consts, args["mod"])

  bias = None if args["bias"] is None else f64(args["bias"])
  primals = tuple(f64(x) for x in qkv) + (bias,) + tuple(f64(c) for c in args["consts"])
  zero = lambda x: None if x is None else jnp.zeros_like(x)
  tq, tk, tv = (f64(t) if t is not None else zero(p) for t, p in
                zip((tans["tq"], tans["tk"], tans["tv"]), primals[:3]))
  tb = None if bias is None else (f64(tans["tbias"]) if tans["tbias"] is not None else zero(bias))
  tc = tuple(f64(t) for t in tans["tconsts"]) if tans["tconsts"] else tuple(
      zero(c) for c in primals[4:4 + n_c])
  (out, lse), (t_out, t_lse) = jax.jvp(f, primals, (tq, tk, tv, tb) + tc)
  return out, lse, t_out, t_lse


def _run(cfg, qkv, out, lse, args, tans, offsets=None):
  _compat.reset_interpret_state()
  q, k, v = qkv
  got = mgpu_tangent.tangent(cfg, q, k, v, args["bias"], args["mask"], args["q_seg"],
                             args["kv_seg"], args["seed"], args["consts"], out, lse,
                             tans["tq"], tans["tk"], tans["tv"], tans["tbias"],
                             tans["tconsts"], args["mod"], offsets)
  got = jax.block_until_ready(got)
  assert not _compat.interpret_races_found(), "GPU interpret mode reported a race"
  return got


@pytest.mark.parametrize("name", sorted(CASES))
def test_tangent_matches_float64_forward_mode(name):
  cfg, qkv, args, tans, features = _case(name)
  out, lse, t_out, t_lse = _reference(cfg, qkv, args, tans)
  dtype = qkv[0].dtype
  out_in = None if "out_none" in features else out.astype(dtype)
  got_out, got_lse = _run(cfg, qkv, out_in, lse.astype(jnp.float32), args, tans)
  assert got_out.shape == t_out.shape and got_lse.shape == t_lse.shape
  assert got_lse.dtype == jnp.float32
  if out_in is None:  # a: t_out before its - t_lse * out term
    got_out = got_out.astype(jnp.float64) - got_lse.astype(jnp.float64)[..., None] * out
  else:
    assert got_out.dtype == dtype
  _util.assert_close((got_out, got_lse), (t_out, t_lse), dtype,
                     what=f"mosaic_gpu tangent {name}")
  if "mask" in features:  # the empty row: zero, finite tangents
    assert bool(jnp.all(got_out[-1, :, 5] == 0)) and bool(jnp.all(got_lse[-1, :, 5] == 0))


def test_chunk_pair_at_global_offsets():
  """A ring chunk pair (batch 1, head 1, q rows 64.. against kv chunk c) with dropout and
  the score_mod: with the global (out, lse), the pairs' t_out before the out term (out=None)
  and t_lse sum to the global tangent of those rows."""
  B, H, S, D, C = 2, 2, 128, 64, 64
  kw = dict(dropout_rate=0.2, score_mod=_alibi_softcap, num_diff_consts=1)
  cfg = _cfg(S, S, D, **kw)
  q, k, v = _util.random_qkv(31, B, H, H, S, S, D, dtype=jnp.bfloat16)
  tq, tk, tv = _util.random_qkv(32, B, H, H, S, S, D, dtype=jnp.bfloat16)
  seed = _dropout.seed_from_key(jax.random.key(9))
  slopes, tslopes = jnp.asarray([0.5, 0.125], jnp.float32), jnp.asarray([0.2, 0.4], jnp.float32)
  args = dict(bias=None, mask=None, q_seg=None, kv_seg=None, seed=seed, consts=(slopes,),
              mod=None)
  out, lse, t_out, t_lse = _reference(cfg, (q, k, v), args, dict(
      tq=tq, tk=tk, tv=tv, tbias=None, tconsts=(tslopes,)))
  rows = (slice(1, 2), slice(1, 2), slice(C, S))
  local = _cfg(C, C, D, **kw)
  a = mu = 0
  for c in range(2):
    cols = (slice(1, 2), slice(1, 2), slice(c * C, (c + 1) * C))
    got = _run(local, (q[rows], k[cols], v[cols]), None, lse[rows].astype(jnp.float32), args,
               dict(tq=tq[rows], tk=tk[cols], tv=tv[cols], tbias=None, tconsts=(tslopes,)),
               offsets=(1, 1, C, c * C))
    a, mu = a + got[0].astype(jnp.float64), mu + got[1].astype(jnp.float64)
  got_out = a - mu[..., None] * out[rows]
  _util.assert_close((got_out, mu), (t_out[rows], t_lse[rows]), jnp.bfloat16,
                     what="mosaic_gpu tangent chunk pairs")


@pytest.mark.parametrize("name", ["skip_loaded_wait", "skip_free_wait"])
def test_mutation_is_caught(monkeypatch, name):
  """The tangent kernel shares the backward's ring protocol: without the consumer's wait
  on a slot's TMA, or the producer's wait for a slot's release, the interpreter reports it."""
  S, D = 192, 64
  cfg = _cfg(S, S, D)
  q = jnp.ones((1, 1, S, D), jnp.bfloat16)
  lse = jnp.zeros((1, 1, S), jnp.float32)
  run = lambda: mgpu_tangent.tangent(cfg, q, q, q, None, None, None, None, None, (), q, lse,
                                     q, q, q, None, None)
  _backward_tests.assert_mutation_caught(monkeypatch, name, run)


def test_shared_memory_limit_is_refused_by_name():
  """A float32 bias and its tangent with a dense mask at head dim 256 need more shared memory
  than a Hopper block has (with kv blocks of 64, and of 32): refused naming the family that
  takes it."""
  S, D = 128, 256
  cfg = _cfg(S, S, D)
  q = jnp.ones((1, 1, S, D), jnp.bfloat16)
  bias = jnp.zeros((1, 1, S, S), jnp.float32)
  with pytest.raises(NotImplementedError, match="shared memory.*pallas_triton"):
    mgpu_tangent.tangent(cfg, q, q, q, bias, jnp.ones((1, 1, S, S), bool), None, None, None,
                         (), q, jnp.zeros((1, 1, S), jnp.float32), q, q, q, bias, None)


# ---- deviceless sm_90a compile (the CUDA plugin's Mosaic compiler and ptxas, no GPU) ----------

_COMPILE = r"""
import sys
import jax
import jax.numpy as jnp
from jax.experimental import topologies
from jax.sharding import NamedSharding, PartitionSpec
from flashvjp._config import AttentionConfig, BlockSizes
from flashvjp.pallas.mosaic_gpu import tangent as T
target, D, features = open(sys.argv[1]).read(), int(sys.argv[2]), sys.argv[3].split("+")
topo = topologies.get_topology_desc(platform="cuda", target_config=target, topology="1x1x1")
sh = NamedSharding(topologies.make_mesh(topo, (1,), ("x",)), PartitionSpec())
B, H, Hkv, S = 1, 4, 2, 1024
def mod(s, b, h, q_idx, kv_idx, slopes):  # ALiBi + tanh softcap
  return 20.0 * jnp.tanh((s - slopes[h] * jnp.abs(q_idx - kv_idx).astype(s.dtype)) / 20.0)
sm = "mod" in features
cfg = AttentionConfig(scale=D ** -0.5, causal=True, window=None, seq_q=S, seq_kv=S,
                      dropout_rate=0.1 if "drop" in features else 0.0, blocks=BlockSizes(),
                      interpret=False, score_mod=mod if sm else None, num_diff_consts=int(sm))
a = lambda shape, dt=jnp.bfloat16: jax.ShapeDtypeStruct(shape, dt, sharding=sh)
consts = (jnp.linspace(0.1, 0.5, H, dtype=jnp.float32),) if sm else ()
tconsts = (jnp.ones((H,), jnp.float32),) if sm else None
if "pos" in features:  # arrays read by position: a per-key bias (with a tangent), a per-query temperature
  cfg = AttentionConfig(scale=D ** -0.5, causal=True, window=None, seq_q=S, seq_kv=S,
                        dropout_rate=0.0, blocks=BlockSizes(), interpret=False,
                        score_mod=lambda s, b, h, q, kv, bv, t: s * t[q] + bv[b, kv],
                        num_diff_consts=2)
  consts = (jnp.zeros((B, S), jnp.float32), jnp.ones((S,), jnp.float32))
  tconsts = (jnp.ones((B, S), jnp.float32), jnp.ones((S,), jnp.float32))
if "rel" in features:  # a table read by kv_idx - q_idx (relative_position_bias), its tangent
  cfg = AttentionConfig(scale=D ** -0.5, causal=True, window=None, seq_q=S, seq_kv=S,
                        dropout_rate=0.0, blocks=BlockSizes(), interpret=False,
                        score_mod=lambda s, b, h, q, kv, t: s + t[h, jnp.clip(kv - q, -64, 64)
                                                                   + 64], num_diff_consts=1)
  consts, tconsts = (jnp.zeros((H, 129), jnp.float32),), (jnp.ones((H, 129), jnp.float32),)
seed = jnp.asarray([1, 2], jnp.uint32) if "drop" in features else None
mask = jnp.tril(jnp.ones((S, S), bool))[None, None] if "mask" in features else None
def f(q, k, v, o, lse, tq, tk, tv, *rest):
  segs, bias = (rest[:2], rest[2:]) if "seg" in features else ((None, None), rest)
  bias = bias[0] if bias else None
  return T.tangent(cfg, q, k, v, bias, mask, *segs, seed, consts, o, lse, tq, tk, tv, bias,
                   tconsts)
extra = (a((B, S), jnp.int32),) * 2 if "seg" in features else ()
extra += (a((1, H, S, S)),) if "bias" in features else ()
jax.jit(f).lower(a((B, H, S, D)), a((B, Hkv, S, D)), a((B, Hkv, S, D)), a((B, H, S, D)),
                 a((B, H, S), jnp.float32), a((B, H, S, D)), a((B, Hkv, S, D)),
                 a((B, Hkv, S, D)), *extra).compile()
print("COMPILED")
"""


def _compile_sm90a(D, features, dump_dir):
  """The tangent kernel compiled for H100 (the backward tests' subprocess recipe): its ptxas
  report, resources and PTX file."""
  _backward_tests._compile_sm90a(D, features, dump_dir, script=_COMPILE)
  (ptxas,) = dump_dir.glob("flashvjp_tangent_*.ptxas")
  (resources,) = dump_dir.glob("flashvjp_tangent_*.resources.txt")
  (ptx,) = dump_dir.glob("flashvjp_tangent_*.ptx")
  return ptxas.read_text(), resources.read_text(), ptx


@pytest.mark.skipif(not _backward_tests._cuda_plugin(), reason="needs jax-cuda12-plugin / -pjrt (deviceless "
                    "sm_90a compile); no GPU needed")
@pytest.mark.parametrize("D,features", [(64, ""), (128, ""), (64, "seg+drop+mask+bias+mod"),
                                        (128, "seg+drop+mod"), (128, "pos"), (128, "rel"),
                                        (256, ""),
                                        (256, "seg+drop+mod")])
def test_sm90a_compile_no_spills(D, features, tmp_path):
  """The tangent kernel (causal, GQA, bf16, S=1024, every tangent; with segment ids, dropout,
  a dense mask, a bf16 bias and its tangent, a score_mod with a tangent on its slopes or on
  arrays it reads by position, or on a table read by kv_idx - q_idx)
  compiles for sm_90a: ptxas reports no spill and shared memory fits a Hopper block; its
  SASS (D=128, causal) has the warpgroup MMAs and the TMA loads of the ring in the loop."""
  import re

  from tests import _sass
  report, resources, ptx = _compile_sm90a(D, features, tmp_path)
  assert "sm_90a" in report, report
  spills = [int(n) for n in re.findall(r"(\d+) bytes spill (?:stores|loads)", report)]
  regs = int(re.search(r"Used (\d+) registers", report)[1])
  smem = int(re.search(r"smem_scratch_bytes=(\d+)", resources)[1])
  print(f"sm_90a flashvjp_tangent D={D} causal {features or 'plain'}: {regs} registers,"
        f" {sum(spills)} spill bytes, {smem} B smem")
  assert spills and not any(spills), report
  assert smem <= mgpu_tangent.SMEM_LIMIT
  if features or D != 128 or _sass.unavailable() is not None:
    return
  listing = _sass.Listing.parse(_sass.sass(str(ptx)))
  mma, tma = listing.count("HGMMA", in_loops=True), listing.count("UTMALDG", in_loops=True)
  print(f"sm_90a flashvjp_tangent D=128 causal SASS: HGMMA {mma} of {listing.count('HGMMA')}"
        f" in main loops, UTMALDG {tma} of {listing.count('UTMALDG')}")
  # s = q k^T, t_s (two), a += (p t_s) v + p t_v: >= 5 wgmmas per step
  assert mma >= 5 and mma >= listing.count("HGMMA") // 2, listing.loops
  assert tma >= 4  # K, V, t_k, t_v of a slot
  assert listing.count("HMMA") == 0
