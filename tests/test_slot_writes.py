"""Inserting a prefilled sequence writes only its slot's rows of the donated slot table: no instruction of
the compiled insert reads or writes as much as one layer of the state table."""
import jax
import numpy as np

from laplace_jax import hlo_bytes, model
from laplace_jax.config import get_config
from serve.slots import N_TOP, SlotFunctions, host_settings


def test_insert_moves_the_slot_rows_not_the_table():
  cfg = get_config("tiny")
  slots, prefill_batch = 2048, 2
  fns = SlotFunctions(model, cfg, n_slots=slots, prefill_batch=prefill_batch, n_stop=4,
                      valid_vocab=cfg.vocab_size)
  params = jax.eval_shape(lambda: model.init_params(cfg, jax.random.key(0)))
  table, pf = jax.eval_shape(fns._empty_table), jax.eval_shape(fns._empty_prefill)
  compiled = fns.insert.lower(params, table, pf, np.array([0, 1], np.int32), np.array([3, slots], np.int32),
                              host_settings([], prefill_batch, 4)).compile()
  layer_bytes = sum(x.size * 4 for x in jax.tree.leaves(table["model"])) // cfg.n_layers
  ops = hlo_bytes.memory_traffic(compiled.as_text())
  biggest = max(ops, key=lambda o: max(o.read_bytes, o.written_bytes))
  assert max(biggest.read_bytes, biggest.written_bytes) < layer_bytes / 4, biggest
  assert compiled.memory_analysis().temp_size_in_bytes < layer_bytes  # sampling temporaries, no state copy
  assert compiled.memory_analysis().alias_size_in_bytes >= 2 * layer_bytes  # the state is updated in place


def test_decode_over_a_serving_mesh_leaves_the_kernel_to_xla(monkeypatch, caplog):
  import logging
  from laplace_jax import gla_decode, sharding
  cfg = get_config("tiny")
  monkeypatch.setattr(gla_decode, "resolve_impl", lambda impl, backend=None: "interpret")  # as on a GPU
  gla_decode._logged.clear()
  fns = SlotFunctions(model, cfg, n_slots=8, prefill_batch=1, n_stop=2, valid_vocab=cfg.vocab_size,
                      mesh=sharding.make_mesh(fsdp=8))
  params = model.init_params(cfg, jax.random.key(0))
  with caplog.at_level(logging.WARNING, logger="laplace_jax.gla_decode"):
    table, out = fns.generate(params, fns.empty_table())
  assert out.shape == (3 + 2 * N_TOP, 8)  # tokens, finished flags, logprob rows (serve.slots)
  assert [r.getMessage() for r in caplog.records if "8-device mesh" in r.getMessage()]
