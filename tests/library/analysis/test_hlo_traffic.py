"""HLO collective byte counting: hand-written HLO with known volumes, and a compiled loop."""

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from laplace_jax import sharding
from laplace_jax.analysis import hlo_traffic

HLO = """
HloModule m

%body (p: (s32[], f32[4,8])) -> (s32[], f32[4,8]) {
  %p = (s32[], f32[4,8]{1,0}) parameter(0)
  %x = f32[1,8]{1,0} get-tuple-element(%p), index=1
  %ag = f32[4,8]{1,0} all-gather(%x), channel_id=1, replica_groups=[2,4]<=[8], dimensions={0}, metadata={op_name="jit(f)/muon/all_gather"}
  ROOT %t = (s32[], f32[4,8]{1,0}) tuple(%i, %ag)
}

%cond (p: (s32[], f32[4,8])) -> pred[] {
  ROOT %lt = pred[] compare(%a, %b), direction=LT
}

ENTRY %main (a: bf16[8,16]) -> f32[] {
  %a = bf16[8,16]{1,0} parameter(0)
  %ar = bf16[8,16]{1,0} all-reduce(%a), channel_id=2, replica_groups={{0,1,2,3,4,5,6,7}}, to_apply=%add
  %rs = f32[2,16]{1,0} reduce-scatter(%c), channel_id=3, replica_groups={{0,1},{2,3},{4,5},{6,7}}, dimensions={0}
  %a2a = (f32[1,10]{1,0}, f32[1,10]{1,0}) all-to-all(%u, %v), channel_id=4, replica_groups={{0,1}}
  %w = (s32[], f32[4,8]{1,0}) while(%init), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"3"}}
  ROOT %r = f32[] constant(0)
}
"""


def test_counts_each_kind_with_ring_volumes_and_loop_trips():
  by = {c.kind: c for c in hlo_traffic.parse_collectives(HLO, 8)}
  assert by["all-gather"].count == 3 and by["all-gather"].group_size == 4
  assert (by["all-gather"].dtype, by["all-reduce"].dtype) == ("f32", "bf16")
  assert by["all-gather"].sent_bytes == pytest.approx(3 * 4 * 8 * 4 * 3 / 4)  # R·(G−1)/G per trip
  assert by["all-reduce"].sent_bytes == pytest.approx(2 * 8 * 16 * 2 * 7 / 8)  # bf16, 2·S·(G−1)/G
  assert by["reduce-scatter"].buffer_bytes == 2 * 2 * 16 * 4  # operand = G·result
  assert by["all-to-all"].sent_bytes == pytest.approx(2 * 10 * 4 * 1 / 2)
  table = hlo_traffic.traffic_by_kind(list(by.values()), op_name_filter="muon")
  assert list(table) == ["all-gather"] and table["all-gather"]["count"] == 3
  assert hlo_traffic.total_bytes(list(by.values())) == pytest.approx(
    sum(c.sent_bytes + c.received_bytes for c in by.values())
  )


def test_compiled_scan_of_gathers_counts_every_iteration():
  mesh = sharding.make_mesh(fsdp=8)

  def f(w_LxN):
    gather = jax.shard_map(
      lambda a: jax.lax.all_gather(a, "fsdp", axis=1, tiled=True),
      mesh=mesh,
      in_specs=P(None, "fsdp"),
      out_specs=P(),
      check_vma=False,
    )
    return jax.lax.scan(lambda c, w: (c + gather(w[None])[0].sum(), None), 0.0, w_LxN)[0]

  arg = jax.ShapeDtypeStruct((5, 64), jnp.float32, sharding=NamedSharding(mesh, P(None, "fsdp")))
  text = jax.jit(f).lower(arg).compile().as_text()
  gathers = [c for c in hlo_traffic.parse_collectives(text, 8) if c.kind == "all-gather"]
  assert sum(c.count for c in gathers) == 5
  assert hlo_traffic.total_bytes(gathers) == pytest.approx(5 * 2 * 64 * 4 * 7 / 8)


def test_execution_counts_with_and_without_fused_computations():
  # One walker for both counters: hlo_traffic follows every called computation and runs a loop condition
  # once per trip; hlo_bytes leaves out what a fusion or reduction applies and adds the condition's last run.
  text = HLO.replace(
    "  ROOT %r = f32[] constant(0)\n",
    "  %f = f32[4] fusion(%a), kind=kLoop, calls=%fused\n"
    "  %c = f32[4] call(%a), to_apply=%called\n  ROOT %r = f32[] constant(0)\n",
  )
  text += "\n%fused (x: f32[4]) -> f32[4] {\n  ROOT %x = f32[4] parameter(0)\n}\n"
  text += "\n%called (x: f32[4]) -> f32[4] {\n  ROOT %x = f32[4] parameter(0)\n}\n"
  text += "\n%add (x: f32[], y: f32[]) -> f32[] {\n  ROOT %s = f32[] add(%x, %y)\n}\n"
  comps, entry = hlo_traffic.computations(text)
  every = hlo_traffic.execution_counts(comps, entry)
  assert dict(every) == {"main": 1, "body": 3, "cond": 3, "add": 1, "fused": 1, "called": 1}
  run = hlo_traffic.execution_counts(comps, entry, condition_runs_once_more=True, follow_fused=False)
  assert dict(run) == {"main": 1, "body": 3, "cond": 4, "called": 1}
