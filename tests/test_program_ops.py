"""The ops a compiled program runs around its kernels (issue 47), deviceless: TPU v5e / v6e
(libtpu) and H100 (the CUDA plugin).

On a TPU each top-level op runs in sequence with a fixed cost. Block lists of static masks
(none, causal, window) are built in numpy at trace time, so their programs hold the
kernels and little else; segment ids are data, and on TPU one small kernel builds their
lists (`flashvjp.pallas.tpu._lists`; no sort, no gather). The ceilings and the counting are `benchmarks/program_ops.py`'s
(which records the table beside splash attention's); `flashvjp._plan.entry_ops` counts.
"""
from __future__ import annotations

import importlib.util
import pathlib

import pytest

from flashvjp import _plan
from tests import _aot

_SPEC = importlib.util.spec_from_file_location(
    "program_ops", pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "program_ops.py")
assert _SPEC is not None and _SPEC.loader is not None
program_ops = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(program_ops)

# What a block list built on the device compiles to (jnp.argsort, take_along_axis, iotas):
# never in the program of a static mask.
_LIST_OPS = {"sort", "gather", "iota", "scatter", "reduce-window"}


def _needs(target):
  return _aot.needs_cuda if target == "h100" else _aot.needs_tpu


@pytest.mark.parametrize("mode", ["forward", "value_and_grad"])
@pytest.mark.parametrize("mask", ["none", "causal", "window"])
@pytest.mark.parametrize("target", [pytest.param(t, marks=_needs(t)) for t in
                                    ("v5e", "v6e", "h100")])
def test_static_masks_compute_no_block_list_on_the_device(target, mask, mode):
  ops = program_ops.ours(target, mask, mode)
  kernels = ops.count("custom-call")
  assert kernels == (1 if mode == "forward" else 3), ops
  assert not _LIST_OPS & set(ops), ops
  assert len(ops) <= program_ops.CEILING[("static", mode)], ops


@pytest.mark.parametrize("target", [pytest.param(t, marks=_needs(t)) for t in
                                    ("v5e", "v6e", "h100")])
def test_segment_ids_lists_take_one_kernel_not_a_sort(target):
  """TPU: the lists kernel (`flashvjp.pallas.tpu._lists`) and the attention kernel, beside the
  ids' two layouts; H100: the Triton kernel and a few fusions."""
  ops = program_ops.ours(target, "segment_ids", "forward")
  assert ops.count("custom-call") == (1 if target == "h100" else 2), ops
  assert not {"sort", "gather"} & set(ops), ops
  if target != "h100":
    assert not set(ops) - {"custom-call", "broadcast"}, ops
  assert len(ops) <= program_ops.ceiling(target, "segment_ids", "forward"), ops


def test_entry_ops_reads_multiline_backend_configs():
  """A backend_config spread over lines (TPU kernels' xprof metadata starts lines with "}}")
  does not end the entry computation early (it did: splash's value_and_grad read as 3 ops)."""
  hlo = """HloModule m

%f (p: f32[4]) -> f32[4] {
  %p = f32[4]{0} parameter(0)
  ROOT %n = f32[4]{0} negate(%p)
}

ENTRY %main (a: f32[4]) -> f32[4] {
  %a = f32[4]{0} parameter(0)
  %k = f32[4]{0} custom-call(%a), custom_call_target="tpu_custom_call", backend_config={"a":
"b"
}}, metadata={op_name="x"}
  %c = f32[4]{0} copy-start(%k)
  %d = f32[4]{0} copy-done(%c)
  %s = f32[4]{0} custom-call(%d), custom_call_target="ConcatBitcast"
  %e = f32[4]{0} fusion(%s), kind=kLoop, calls=%f
  ROOT %r = (f32[4]{0}) tuple(%e)
}
"""
  assert _plan.entry_ops(hlo) == ("custom-call", "fusion")
