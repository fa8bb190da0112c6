"""The one-pass decode step: the Pallas kernel (interpret mode, on the CPU) and the XLA fallback against
gla.recurrent_simple_gla_step; backend selection and fallbacks; the compiled decode step's memory."""

import functools
import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers.hlo_compile import compile_as_benchmarks

from laplace_jax import model, platform
from laplace_jax.analysis import hlo_bytes, neuron_check
from laplace_jax.model.config import get_config
from laplace_jax.ops import gla, gla_decode


def _inputs(B, dtype, L=3, H=4, K=48, V=96, seed=0):
  r = np.random.default_rng(seed)
  table = jnp.asarray(r.normal(size=(L, B, H, K, V)), jnp.float32)
  q, k = (jnp.asarray(r.normal(size=(B, H, K)), dtype) for _ in range(2))
  v = jnp.asarray(r.normal(size=(B, H, V)), dtype)
  g = jnp.log(jnp.linspace(0.5, 0.999, H)).astype(jnp.float32)
  return q, k, v, g, table


@pytest.mark.parametrize("impl", ["interpret", "xla", "xla-neuron"])  # xla-neuron: the XLA step as on Neuron
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("B", [8, 6, 5])  # fills the 8-slot block; a 2-slot block; odd: 1-slot blocks
def test_equals_reference_step_and_leaves_other_layers(impl, dtype, B):
  q, k, v, g, table = _inputs(B, dtype)
  layer = 1
  o_ref, s_ref = gla.recurrent_simple_gla_step(q, k, v, g, table[layer])
  target = "neuron" if impl == "xla-neuron" else platform.backend()
  with platform.lowering_for(target):
    o, new = gla_decode.gla_decode_layer(
      q, k, v, g, table, layer, impl=impl.removesuffix("-neuron"), block_b=8
    )
  assert o.dtype == v.dtype and new.shape == table.shape
  tol = 1e-5 if dtype == jnp.float32 else 1e-2  # bf16: o is rounded to bf16 on the way out
  np.testing.assert_allclose(
    np.asarray(o, np.float32),
    np.asarray(o_ref, np.float32),
    rtol=tol,
    atol=tol * float(jnp.abs(o_ref.astype(jnp.float32)).max()),
  )
  np.testing.assert_allclose(new[layer], s_ref, rtol=1e-5, atol=1e-5 * float(jnp.abs(s_ref).max()))
  for other in (0, 2):
    np.testing.assert_array_equal(new[other], table[other])


@pytest.mark.parametrize("impl", ["xla", "xla-neuron", "interpret"])
def test_rows_not_live_keep_their_state_exactly(impl):
  """live_B: live rows as without it, the others' state bit for bit as it was (the kernel asked for with
  live_B takes the XLA step)."""
  q, k, v, g, table = _inputs(5, jnp.float32)
  live = jnp.asarray([True, False, True, True, False])
  o_ref, s_ref = gla.recurrent_simple_gla_step(q, k, v, g, table[1])
  with platform.lowering_for("neuron" if impl == "xla-neuron" else platform.backend()):
    o, new = gla_decode.gla_decode_layer(q, k, v, g, table, 1, impl=impl.removesuffix("-neuron"), live_B=live)
  for b in (0, 2, 3):
    np.testing.assert_allclose(o[b], o_ref[b], rtol=1e-5, atol=1e-5 * float(jnp.abs(o_ref).max()))
    np.testing.assert_allclose(new[1, b], s_ref[b], rtol=1e-5, atol=1e-5 * float(jnp.abs(s_ref).max()))
  np.testing.assert_array_equal(new[1, 1], table[1, 1])
  np.testing.assert_array_equal(new[1, 4], table[1, 4])
  np.testing.assert_array_equal(new[0], table[0])


def test_kernel_under_jit_with_traced_layer_and_donated_table():
  q, k, v, g, table = _inputs(8, jnp.float32)
  f = jax.jit(functools.partial(gla_decode.gla_decode_layer, impl="interpret", block_b=4), donate_argnums=4)
  expect = [gla.recurrent_simple_gla_step(q, k, v, g, table[i]) for i in range(3)]
  for layer in (2, 0):
    o, table = f(q, k, v, g, table, jnp.int32(layer))
    np.testing.assert_allclose(o, expect[layer][0], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(table[layer], expect[layer][1], rtol=1e-5, atol=1e-5)


def test_power_of_two_tiling():
  assert gla_decode.pow2_pieces(96) == [(0, 64), (64, 32)]
  assert gla_decode.pow2_pieces(192) == [(0, 128), (128, 64)]
  assert gla_decode.pow2_pieces(48) == [(0, 32), (32, 16)]
  assert [gla_decode.slot_block(b, 16) for b in (1280, 64, 6, 5, 8)] == [16, 16, 2, 1, 8]
  assert gla_decode.kernel_slot_block(1280, 96, 192, 16) == 2  # laplace-3b: 2 x 64 x 128 values per tile
  assert gla_decode.kernel_slot_block(1280, 48, 96, 16) == 8  # small: 8 x 32 x 64
  assert gla_decode.kernel_slot_block(6, 8, 16, 16) == 2


def test_kernel_asked_for_on_the_cpu_falls_back_with_one_log_line(caplog):
  q, k, v, g, table = _inputs(4, jnp.float32)
  gla_decode._logged.clear()
  with caplog.at_level(logging.WARNING, logger="laplace_jax.ops.gla_decode"):
    for _ in range(2):
      o, new = gla_decode.gla_decode_layer(q, k, v, g, table, 0, impl="pallas")
  assert len(caplog.records) == 1 and "'cpu'" in caplog.records[0].getMessage()
  o_ref, s_ref = gla.recurrent_simple_gla_step(q, k, v, g, table[0])
  np.testing.assert_allclose(o, o_ref, rtol=1e-6, atol=1e-6)


def test_kernel_that_does_not_compile_falls_back_with_one_log_line(caplog, monkeypatch):
  # Pretend to be a GPU: the (non-interpret) kernel cannot compile for the CPU, so the XLA step runs.
  monkeypatch.setattr(gla_decode.jax, "default_backend", lambda: "gpu")
  q, k, v, g, table = _inputs(4, jnp.float32)
  gla_decode._logged.clear()
  with caplog.at_level(logging.WARNING, logger="laplace_jax.ops.gla_decode"):
    for _ in range(2):
      o, _ = gla_decode.gla_decode_layer(q, k, v, g, table, 0)
  assert len(caplog.records) == 1 and "does not compile" in caplog.records[0].getMessage()
  np.testing.assert_allclose(o, gla.recurrent_simple_gla_step(q, k, v, g, table[0])[0], rtol=1e-6, atol=1e-6)


def test_bad_inputs_name_the_value():
  q, k, v, g, table = _inputs(4, jnp.float32)
  with pytest.raises(ValueError, match="impl='cuda'"):
    gla_decode.gla_decode_layer(q, k, v, g, table, 0, impl="cuda")
  with pytest.raises(ValueError, match="float32"):
    gla_decode.gla_decode_layer(q, k, v, g, table.astype(jnp.bfloat16), 0)
  with pytest.raises(ValueError, match=r"v \[B, H, V\]"):
    gla_decode.gla_decode_layer(q, k, v[:, :, :8], g, table, 0)
  with pytest.raises(ValueError, match="block_b=0"):
    gla_decode.gla_decode_layer(q, k, v, g, table, 0, block_b=0)


@functools.cache
def _compiled_tiny_decode(slots=256):
  """(cfg, abstract state, compiled decode step with the state donated) for `tiny`, from abstract shapes."""
  cfg = get_config("tiny")
  params = jax.eval_shape(lambda: model.init_params(cfg, jax.random.key(0)))
  state = jax.eval_shape(lambda: model.init_state(cfg, slots))
  tokens = jax.ShapeDtypeStruct((slots,), jnp.int32)
  compiled = compile_as_benchmarks(
    jax.jit(functools.partial(model.decode_step, cfg=cfg), donate_argnums=1).lower(params, state, tokens)
  )
  return cfg, state, compiled


def test_compiled_decode_step_keeps_one_state_table_and_copies_none_of_it():
  cfg, state, compiled = _compiled_tiny_decode()
  state_bytes = sum(x.size * 4 for x in jax.tree.leaves(state))
  mem = compiled.memory_analysis()
  assert mem.alias_size_in_bytes == state_bytes  # the whole state is updated in place
  assert mem.temp_size_in_bytes < state_bytes / cfg.n_layers  # no second table, not even one layer's
  ops = hlo_bytes.memory_traffic(compiled.as_text())
  layer_state = state_bytes // cfg.n_layers
  assert not [o for o in ops if o.opcode == "copy" and o.read_bytes >= layer_state // 4]


def test_compiled_xla_step_reads_the_state_twice_and_writes_it_once_per_layer():
  # Per GLA layer of the compiled CPU decode step: the readout reads the old rows, the in-place update reads
  # and writes them (3 state-sized passes; 5 when S' was a temporary read by a dot and copied into the table).
  _, state, compiled = _compiled_tiny_decode()
  L, B, H, K, V = state.gla.shape
  layer_state = B * H * K * V * 4
  per_layer = [o for o in hlo_bytes.memory_traffic(compiled.as_text()) if o.count == L]
  passes = sum(
    (o.read_bytes >= 0.75 * layer_state) + (o.written_bytes >= 0.75 * layer_state) for o in per_layer
  )
  assert passes == 3, [
    (o.name, o.read_bytes, o.written_bytes) for o in per_layer if o.read_bytes >= layer_state / 2
  ]


@pytest.mark.parametrize("mixers", ["G", "GS", "GA"])
def test_decode_with_slots_split_over_devices_needs_no_collective(mixers):
  # The serving engine splits the slots over its devices; nothing in a slot's step may read another slot
  # (the write is ordered after the readout per row: ordering on one element made one all-reduce per layer;
  # the conv and window rings' and the KV caches' one-row writes with an explicit row index all-gathered
  # indices and updates).
  from laplace_jax import sharding
  from laplace_jax.analysis import hlo_traffic

  cfg = get_config("tiny", mixers=mixers, window=16)
  mesh = sharding.make_mesh(data=1, fsdp=8)
  with_sharding = lambda tree, sh: jax.tree.map(
    lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, sh
  )
  params = jax.eval_shape(lambda: model.init_params(cfg, jax.random.key(0)))
  params = with_sharding(params, jax.tree.map(lambda _: jax.sharding.NamedSharding(mesh, jax.P()), params))
  state = jax.eval_shape(lambda: model.init_state(cfg, 64, max_len=32))
  state = with_sharding(state, sharding.decode_state_shardings(state, mesh))
  tokens = jax.ShapeDtypeStruct(
    (64,), jnp.int32, sharding=jax.sharding.NamedSharding(mesh, jax.P(sharding.BATCH_AXES))
  )
  with jax.set_mesh(mesh):
    compiled = (
      jax.jit(functools.partial(model.decode_step, cfg=cfg), donate_argnums=1)
      .lower(params, state, tokens)
      .compile()
    )
  assert hlo_traffic.parse_collectives(compiled.as_text(), 8) == []


def test_model_decode_with_the_kernel_equals_the_xla_decode(monkeypatch):
  cfg = get_config("tiny")
  params = model.init_params(cfg, jax.random.key(0))
  _, state = model.prefill(params, model.init_state(cfg, 3), np.arange(30).reshape(3, 10) % 97, cfg=cfg)
  tokens = jnp.array([5, 7, 11], jnp.int32)
  step = lambda s: model.decode_step(params, s, tokens, cfg=cfg)  # not jitted: one trace per impl
  logits_xla, state_xla = step(state)
  monkeypatch.setattr(gla_decode, "resolve_impl", lambda impl, backend=None: "interpret")
  logits_k, state_k = step(state)
  np.testing.assert_allclose(logits_k, logits_xla, rtol=1e-5, atol=1e-5)
  for name in ("gla", "conv"):
    np.testing.assert_allclose(getattr(state_k, name), getattr(state_xla, name), rtol=1e-5, atol=1e-6)


def test_kernel_under_a_multi_device_mesh_falls_back_with_one_log_line(caplog):
  from laplace_jax import sharding

  q, k, v, g, table = _inputs(8, jnp.float32)
  gla_decode._logged.clear()
  with (
    caplog.at_level(logging.WARNING, logger="laplace_jax.ops.gla_decode"),
    jax.set_mesh(sharding.make_mesh(fsdp=8)),
  ):
    o, new = gla_decode.gla_decode_layer(q, k, v, g, table, 1, impl="interpret")
  assert len(caplog.records) == 1 and "8-device mesh" in caplog.records[0].getMessage()
  o_ref, s_ref = gla.recurrent_simple_gla_step(q, k, v, g, table[1])
  np.testing.assert_allclose(o, o_ref, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(new[1], s_ref, rtol=1e-5, atol=1e-5)


def _decode_text(target, mixers="G"):
  """StableHLO of `tiny`'s decode step lowered with the choices made on `target` (a fresh function object)."""
  cfg = get_config("tiny", mixers=mixers, window=16)
  params = jax.eval_shape(lambda: model.init_params(cfg, jax.random.key(0)))
  state = jax.eval_shape(lambda: model.init_state(cfg, 4, max_len=32))
  with platform.lowering_for(target):
    step = jax.jit(lambda p, s, t: model.decode_step(p, s, t, cfg=cfg))
    return step.lower(params, state, jax.ShapeDtypeStruct((4,), jnp.int32)).as_text()


def _multi_operand_reduces(text):
  # A StableHLO reduce of n operands reads `stablehlo.reduce(%a init: %i), (%b init: %j) ...`.
  return [line for line in text.splitlines() if "stablehlo.reduce(" in line and line.count(" init: ") > 1]


@pytest.mark.parametrize("mixers", ["G", "GA"])
def test_neuron_lowered_decode_has_no_variadic_reduce(mixers):
  # the GLA layers' and the KV caches' CPU decode read the state with two-operand reduces;
  # Neuron's lowering keeps their matmul forms, and the whole step breaks none of its rules
  assert _multi_operand_reduces(_decode_text("cpu", mixers))  # the check sees the CPU forms' readouts
  neuron = _decode_text("neuron", mixers)
  assert _multi_operand_reduces(neuron) == [] and neuron_check.violations(neuron) == []


def test_compiled_decode_step_writes_one_row_of_each_conv_ring_and_copies_none():
  # The conv window is a ring (laplace_jax/ops/short_conv.py): one row per sequence written in place, then read
  # once with the taps rotated. The shifted window (concatenate(win[:, 1:], h)) wrote two ring-sized buffers
  # per layer: the old window copied out, and the new one written over it from that copy.
  _, state, compiled = _compiled_tiny_decode()
  L, B, W, D = state.conv.shape
  ring = B * W * D * 4
  per_layer = [o for o in hlo_bytes.memory_traffic(compiled.as_text()) if o.count == L]
  assert not [o.name for o in per_layer if 0.9 * ring <= o.written_bytes <= 1.1 * ring]
  assert [o.written_bytes for o in per_layer if "scatter" in o.name] == [B * D * 4]
