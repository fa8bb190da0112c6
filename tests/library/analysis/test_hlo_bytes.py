"""HLO memory-traffic counting: hand-written HLO with known bytes, and small compiled programs."""

import jax
import jax.numpy as jnp
import pytest
from helpers.hlo_compile import compile_as_benchmarks

from laplace_jax.analysis import hlo_bytes

# A loop of 3 trips over a [4, 256] f32 table (4 KiB) carried in place: each trip reads row i through a
# fused dynamic-slice (1 KiB), writes row i through an in-place dynamic-update-slice (1 KiB) and also
# copies the whole table (4 KiB read + 4 KiB written). The entry adds two [256] vectors (3 KiB).
HLO = """
HloModule m

%fused_update (param_0: f32[4,256], param_1: s32[]) -> f32[4,256] {
  %param_0 = f32[4,256]{1,0} parameter(0)
  %param_1 = s32[] parameter(1)
  %zero = s32[] constant(0)
  %row = f32[1,256]{1,0} dynamic-slice(%param_0, %param_1, %zero), dynamic_slice_sizes={1,256}
  %twice = f32[1,256]{1,0} add(%row, %row)
  ROOT %dus = f32[4,256]{1,0} dynamic-update-slice(%param_0, %twice, %param_1, %zero)
}

%body (p: (s32[], f32[4,256])) -> (s32[], f32[4,256]) {
  %p = (s32[], f32[4,256]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %t = f32[4,256]{1,0} get-tuple-element(%p), index=1
  %u = f32[4,256]{1,0} fusion(%t, %i), kind=kLoop, calls=%fused_update, metadata={op_name="jit(f)/update"}
  %c = f32[4,256]{1,0} copy(%u)
  ROOT %r = (s32[], f32[4,256]{1,0}) tuple(%i, %c)
}

%cond (p: (s32[], f32[4,256])) -> pred[] {
  %p = (s32[], f32[4,256]{1,0}) parameter(0)
  ROOT %lt = pred[] constant(true)
}

ENTRY %main (a: f32[256], b: f32[256], t: f32[4,256]) -> f32[256] {
  %a = f32[256]{0} parameter(0)
  %b = f32[256]{0} parameter(1)
  %t = f32[4,256]{1,0} parameter(2)
  %init = (s32[], f32[4,256]{1,0}) tuple(%a, %t)
  %w = (s32[], f32[4,256]{1,0}) while(%init), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"3"}}
  ROOT %sum = f32[256]{0} add(%a, %b)
}
"""


def test_hand_written_module_counts_slices_in_place_updates_and_loop_trips():
  ops = {o.name: o for o in hlo_bytes.memory_traffic(HLO)}
  assert set(ops) == {"u", "c", "sum"}  # free ops (tuple, gte, while, parameter, constant) move nothing
  assert (ops["u"].read_bytes, ops["u"].written_bytes, ops["u"].count) == (1024 + 4, 1024, 3)
  assert ops["u"].op_name == "jit(f)/update"
  assert (ops["c"].read_bytes, ops["c"].written_bytes, ops["c"].count) == (4096, 4096, 3)
  assert (ops["sum"].read_bytes, ops["sum"].written_bytes, ops["sum"].count) == (2048, 1024, 1)
  assert hlo_bytes.total_bytes(list(ops.values())) == 3 * (1028 + 1024 + 8192) + 3072


def _compiled_bytes(f, *args, donate=()):
  return hlo_bytes.total_bytes(
    hlo_bytes.memory_traffic(compile_as_benchmarks(jax.jit(f, donate_argnums=donate).lower(*args)).as_text())
  )


def test_compiled_elementwise_reads_inputs_and_writes_output_once():
  x = jax.ShapeDtypeStruct((1000,), jnp.float32)
  assert _compiled_bytes(lambda a, b: jnp.sin(a) * b, x, x) == 3 * 4000


def test_compiled_in_place_row_update_touches_only_the_row():
  table, row = jax.ShapeDtypeStruct((100, 64), jnp.float32), jax.ShapeDtypeStruct((64,), jnp.float32)
  i = jax.ShapeDtypeStruct((), jnp.int32)
  moved = _compiled_bytes(
    lambda t, r, i: jax.lax.dynamic_update_index_in_dim(t, r * 2, i, 0), table, row, i, donate=(0,)
  )
  assert moved == pytest.approx(2 * 64 * 4, abs=16)  # the row read and written (+ the index)


def test_compiled_scan_counts_its_body_per_iteration():
  c, xs = jax.ShapeDtypeStruct((256,), jnp.float32), jax.ShapeDtypeStruct((5, 256), jnp.float32)
  moved = _compiled_bytes(
    lambda c, xs: jax.lax.scan(lambda c, x: (jnp.sin(c) * x, None), c, xs)[0], c, xs, donate=(0,)
  )
  # Per trip: read the carry and one row of xs, write the carry (1 KiB each); small loop counters aside.
  assert 5 * 3 * 1024 <= moved <= 5 * 3 * 1024 + 512


def test_rejects_text_without_an_entry():
  with pytest.raises(ValueError, match="ENTRY"):
    hlo_bytes.memory_traffic("HloModule m\n")


def test_async_wrapped_work_counts_once_in_its_computation():
  text = """
HloModule m

%wrapped (p: f32[256]) -> f32[256] {
  %p = f32[256]{0} parameter(0)
  ROOT %n = f32[256]{0} negate(%p)
}

ENTRY %main (a: f32[256]) -> f32[256] {
  %a = f32[256]{0} parameter(0)
  %s = ((f32[256]{0}), f32[256]{0}, s32[]) async-start(%a), calls=%wrapped
  ROOT %d = f32[256]{0} async-done(%s)
}
"""
  ops = hlo_bytes.memory_traffic(text)
  assert [(o.name, o.read_bytes, o.written_bytes, o.count) for o in ops] == [("n", 1024, 1024, 1)]
