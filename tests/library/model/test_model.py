"""The model: shapes, counts, forward == prefill + decode_step, one compile across prompt lengths."""

import helpers
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from laplace_jax import model
from laplace_jax.model.config import LaplaceConfig, get_config, gla_form_for_backend
from laplace_jax.model.counts import layer_shapes, param_counts, param_shapes, state_bytes_per_sequence

CFG = get_config("tiny")


@pytest.fixture(scope="module")
def params():
  return model.init_params(CFG, jax.random.key(0))


def test_laplace_3b_counts_match_published():
  cfg = get_config("laplace-3b")
  c = param_counts(cfg)
  assert c["muon"] == 2_717_908_992
  assert f"{c['total'] / 1e9:.3f}" == "3.028"
  assert f"{c['adamw'] / 1e6:.1f}" == "309.6"
  assert state_bytes_per_sequence(cfg) == 29_491_200 + 4  # GLA matrices and conv rings; the position
  assert cfg.qkvg_width == 9216


def test_param_tree_matches_declared_shapes_and_counts(params):
  shapes = param_shapes(CFG)
  for name, shape in shapes["layer"].items():
    assert params["layers"][name].shape == (CFG.n_layers, *shape), name
  for name, shape in shapes["model"].items():
    assert params[name].shape == shape, name
  assert sum(x.size for x in jax.tree.leaves(params)) == param_counts(CFG)["total"]
  assert float(jnp.abs(params["layers"]["aug_balance"]).max()) == 0.0


@pytest.mark.parametrize("ffn", [True, False])
def test_shape_table_is_init_params_leaves_for_every_mixer(ffn):
  """config.layer_shapes / param_shapes / param_counts (derived from the blocks' own declarations) against the
  leaves init_params makes, for each mixer letter in a hybrid and alone, with and without the FFN."""
  cfg = CFG.replace(n_layers=3, mixers="GAS", window=8, ffn=ffn)
  leaves = lambda c: jax.eval_shape(lambda: model.init_params(c, jax.random.key(0)))
  params = leaves(cfg)
  for i, letter in enumerate(cfg.mixers):
    stacked = {n: x.shape for n, x in params["layers"][f"block{i}"].items()}
    assert layer_shapes(cfg, letter) == {n: s[1:] for n, s in stacked.items()}, letter
    assert {s[0] for s in stacked.values()} == {cfg.n_groups}
    alone = leaves(cfg.replace(mixers=letter))["layers"]
    assert layer_shapes(cfg, letter) == {n: x.shape[1:] for n, x in alone.items()}, letter
    assert ({"ln2_scale", "w1", "w2", "w3"} <= set(layer_shapes(cfg, letter))) == ffn
  assert param_shapes(cfg)["model"] == {n: x.shape for n, x in params.items() if n != "layers"}
  assert param_shapes(cfg)["layer"] == layer_shapes(cfg, "G")
  assert param_counts(cfg)["total"] == sum(x.size for x in jax.tree.leaves(params))
  with pytest.raises(ValueError, match="mixer 'X'"):
    layer_shapes(cfg, "X")


def test_small_preset_size():
  assert 100e6 <= param_counts(get_config("small"))["total"] <= 150e6


@pytest.mark.parametrize(
  "bad, match",
  [
    (dict(n_decay_tiers=3), "divisor of n_heads"),
    (dict(decay_t_min=10.0, decay_t_max=2.0), "reversed"),
    (dict(decay_t_min=0.0), "positive half-lives"),
    (dict(d_model=0), "positive integer"),
    (dict(compute_dtype="int8"), "floating dtype"),
    (dict(max_seq_len=100), "multiple of chunk_size"),
    (dict(gla_form="fused"), "gla_form"),
    (dict(attn_heads=5), "divisor of the attention width"),
    (dict(attn_heads=-1), "attn_heads"),
    (dict(ffn="no"), "ffn"),
  ],
)
def test_invalid_configs_rejected(bad, match):
  with pytest.raises(ValueError, match=match):
    LaplaceConfig(**bad)


@pytest.mark.parametrize(
  "form, backend, want",
  [
    ("auto", "cpu", ("scan", False)),
    ("auto", "gpu", ("parallel", False)),
    ("auto", "tpu", ("parallel", False)),
    ("auto", "neuron", ("scan", True)),
    ("parallel", "cpu", ("parallel", False)),
    ("scan", "gpu", ("scan", False)),
  ],
)
def test_gla_form_default_per_backend(form, backend, want):
  assert gla_form_for_backend(CFG.replace(gla_form=form), backend) == want


def test_forward_shapes_and_causality(params):
  toks = jax.random.randint(jax.random.key(1), (2, 40), 0, CFG.vocab_size)
  logits = model.forward(params, toks, cfg=CFG)
  assert logits.shape == (2, 40, CFG.vocab_size) and logits.dtype == jnp.float32
  toks2 = toks.at[:, 30:].set(7)
  logits2 = model.forward(params, toks2, cfg=CFG)
  np.testing.assert_allclose(logits[:, :30], logits2[:, :30], atol=1e-5)
  assert not np.allclose(logits[:, 30:], logits2[:, 30:])


def _check_prefill_then_decode(params, cfg, B, T, P, **state_kw):
  """Logits of the full forward == prefill of P tokens then decode_step token by token to T (fp32); returns
  the final state."""
  toks = jax.random.randint(jax.random.key(2), (B, T), 0, cfg.vocab_size)
  full = model.forward(params, toks, cfg=cfg)
  state = model.init_state(cfg, B, **state_kw)
  logits, state = model.prefill(params, state, toks[:, :P], cfg=cfg)
  np.testing.assert_allclose(logits, full[:, P - 1], atol=1e-4, rtol=1e-4)
  step = jax.jit(model.decode_step, static_argnames="cfg")
  for t in range(P, T):
    logits, state = step(params, state, toks[:, t], cfg=cfg)
    np.testing.assert_allclose(logits, full[:, t], atol=1e-4, rtol=1e-4)
  return state


def test_forward_equals_prefill_then_decode(params):
  # the prefix crosses a chunk boundary; decode crosses another
  _check_prefill_then_decode(params, CFG, B=2, T=300, P=150)


def test_prefill_ragged_rows_match_separate_prefills(params):
  toks = jax.random.randint(jax.random.key(3), (2, 200), 0, CFG.vocab_size)
  lengths = np.array([200, 61])
  logits, state = model.prefill(params, model.init_state(CFG, 2), toks, lengths, cfg=CFG)
  l1, s1 = model.prefill(params, model.init_state(CFG, 1), toks[1:, :61], cfg=CFG)
  np.testing.assert_allclose(logits[1], l1[0], atol=1e-4, rtol=1e-4)
  axes = state.batch_axes().to_dict()
  state, s1 = state.to_dict(), s1.to_dict()
  for k in state:
    np.testing.assert_allclose(
      np.take(np.asarray(state[k]), 1, axes[k]), np.take(np.asarray(s1[k]), 0, axes[k]), atol=1e-5, rtol=1e-5
    )


def test_prefill_in_odd_pieces_then_decode_equals_forward(params):
  """Pieces of 37 and (per row) 0 or 54 tokens, off the chunk and conv grids, then decode: the conv rings,
  GLA states and positions carry over exactly as one forward pass sees them; a 0-token piece keeps the row."""
  toks = jax.random.randint(jax.random.key(7), (2, 96), 0, CFG.vocab_size)
  full = model.forward(params, toks, cfg=CFG)
  _, state = model.prefill(params, model.init_state(CFG, 2), toks[:, :37], cfg=CFG)
  _, kept = model.prefill(params, state, toks[:, 37:91], np.array([54, 0]), cfg=CFG)
  axes = state.batch_axes().to_dict()
  for k, x in state.to_dict().items():
    np.testing.assert_array_equal(
      np.take(np.asarray(kept.to_dict()[k]), 1, axes[k]), np.take(np.asarray(x), 1, axes[k])
    )
  _, state = model.prefill(params, state, toks[:, 37:91], cfg=CFG)
  assert state.pos.tolist() == [91, 91]
  step = jax.jit(model.decode_step, static_argnames="cfg")
  for t in range(91, 96):
    logits, state = step(params, state, toks[:, t], cfg=CFG)
    np.testing.assert_allclose(logits, full[:, t], atol=1e-4, rtol=1e-4)


def test_state_size_independent_of_context(params):
  sizes = []
  for T in (1, 129, 700):
    toks = jnp.ones((1, T), jnp.int32)
    _, s = model.prefill(params, model.init_state(CFG, 1), toks, cfg=CFG)
    sizes.append(sum(x.nbytes for x in jax.tree.leaves(s)))
  assert sizes[0] == sizes[1] == sizes[2] == state_bytes_per_sequence(CFG)


def test_one_compile_across_prompt_lengths_1_to_1000(params):
  compiles = []
  jax.monitoring.register_event_duration_secs_listener(
    lambda ev, _d, **kw: compiles.append(ev) if ev == "/jax/core/compile/backend_compile_duration" else None
  )
  rng = np.random.default_rng(0)
  B = 8
  model.prefill(params, model.init_state(CFG, B), np.ones((B, 1), np.int32), cfg=CFG)  # warm-up
  before = len(compiles)
  lengths = np.arange(1, 1001)
  zero = model.init_state(CFG, B)  # every call starts from it (prefill returns a new state)
  for i in range(0, 1000, B):  # every length 1…1,000 appears once, 8 prompts per call
    n = lengths[i : i + B]
    toks = rng.integers(0, CFG.vocab_size, (B, int(n.max())))
    model.prefill(params, zero, toks, n, cfg=CFG)
  assert len(compiles) - before == 0


def test_bad_inputs(params):
  state = model.init_state(CFG, 2)
  with pytest.raises(ValueError, match="token ids"):
    model.decode_step(params, state, jnp.array([0, CFG.vocab_size]), cfg=CFG)
  with pytest.raises(ValueError, match="expected \\[B\\]"):
    model.decode_step(params, state, jnp.zeros((2, 3), jnp.int32), cfg=CFG)
  other = model.init_state(CFG.replace(d_model=32), 2)
  with pytest.raises(ValueError, match="another config"):
    model.decode_step(params, other, jnp.zeros((2,), jnp.int32), cfg=CFG)
  with pytest.raises(ValueError, match="batch"):
    model.decode_step(params, state, jnp.zeros((3,), jnp.int32), cfg=CFG)
  with pytest.raises(ValueError, match="integer"):
    model.forward(params, jnp.zeros((1, 4), jnp.float32), cfg=CFG)


def test_scan_form_model_matches_parallel(params):
  toks = jax.random.randint(jax.random.key(5), (2, 200), 0, CFG.vocab_size)
  np.testing.assert_allclose(
    model.forward(params, toks, cfg=CFG.replace(gla_form="scan")),
    model.forward(params, toks, cfg=CFG),
    atol=1e-5,
    rtol=1e-5,
  )


def test_bf16_compute_close_to_fp32(params):
  toks = jax.random.randint(jax.random.key(4), (1, 64), 0, CFG.vocab_size)
  l32 = model.forward(params, toks, cfg=CFG)
  l16 = model.forward(params, toks, cfg=CFG.replace(compute_dtype="bfloat16", remat=True))
  assert l16.dtype == jnp.float32
  assert np.linalg.norm(l16 - l32) / np.linalg.norm(l32) < 3e-2


# ---- mixer patterns: attention and hybrids -------------------------------------------------------

HYBRID = CFG.replace(n_layers=4, mixers="GA")
ATTN = CFG.replace(mixers="A")
WINDOWED = CFG.replace(n_layers=4, mixers="GGGS", window=16)


@pytest.mark.parametrize(
  "cfg",
  [
    ATTN,
    HYBRID,
    WINDOWED,
    CFG.replace(mixers="S", window=16),
    CFG.replace(mixers="GS", window=160),
    WINDOWED.replace(scan_layers="false"),
  ],
  ids=["A", "GA", "GGGS", "S", "GS-prompt-shorter-than-window", "GGGS-unrolled"],
)
def test_pattern_forward_equals_prefill_then_decode(cfg):
  """The prompt (140 tokens: two prefill chunks with the state carried) then 60 decode steps; windowed
  layers with W = 16 (the window wraps many times) and W = 160 (the prompt fills part of the ring)."""
  # The unrolled form's parameters are the scanned form's, leaf for leaf and bit for bit (test_scan_layers):
  # GGGS-unrolled reuses GGGS's compiled initialisation.
  params = model.init_params(cfg.replace(scan_layers=CFG.scan_layers), jax.random.key(0))
  state = _check_prefill_then_decode(params, cfg, B=2, T=200, P=140, max_len=200)
  assert state.pos.tolist() == [200, 200]


def test_windowed_prefill_in_pieces_equals_one_prefill():
  """Chunked prefill with an explicit carried state (split at 70, off the chunk grid; ragged rows) equals one
  prefill of the whole prompt: logits and every state entry, the rings included."""
  params = model.init_params(WINDOWED, jax.random.key(1))
  toks = jax.random.randint(jax.random.key(3), (2, 150), 0, WINDOWED.vocab_size)
  lengths = np.array([150, 90])
  want_logits, want = model.prefill(params, model.init_state(WINDOWED, 2), toks, lengths, cfg=WINDOWED)
  _, state = model.prefill(params, model.init_state(WINDOWED, 2), toks[:, :70], cfg=WINDOWED)
  logits, state = model.prefill(params, state, toks[:, 70:], lengths - 70, cfg=WINDOWED)
  np.testing.assert_allclose(logits, want_logits, atol=1e-4, rtol=1e-4)
  assert sorted(state.to_dict()) == ["conv", "gla", "pos", "ring_k", "ring_v"]
  assert state.kv is None
  for k, x in state.to_dict().items():
    np.testing.assert_allclose(x, want.to_dict()[k], atol=1e-5, rtol=1e-5)


def test_windowed_state_bytes_independent_of_context():
  params = model.init_params(WINDOWED, jax.random.key(0))
  sizes = []
  for T in (1, 129, 300):
    _, s = model.prefill(params, model.init_state(WINDOWED, 1), jnp.ones((1, T), jnp.int32), cfg=WINDOWED)
    sizes.append(sum(x.nbytes for x in jax.tree.leaves(s)))
  assert sizes[0] == sizes[1] == sizes[2] == state_bytes_per_sequence(WINDOWED)
  assert state_bytes_per_sequence(WINDOWED.replace(window=32)) > sizes[0]


def test_hybrid_ragged_prefill_matches_separate_prefills():
  params = model.init_params(HYBRID, jax.random.key(1))
  toks = jax.random.randint(jax.random.key(3), (2, 150), 0, HYBRID.vocab_size)
  logits, state = model.prefill(
    params, model.init_state(HYBRID, 2, 160), toks, np.array([150, 61]), cfg=HYBRID
  )
  l1, s1 = model.prefill(params, model.init_state(HYBRID, 1, 160), toks[1:, :61], cfg=HYBRID)
  np.testing.assert_allclose(logits[1], l1[0], atol=1e-4, rtol=1e-4)
  for k in ("gla", "conv", "k", "v"):
    np.testing.assert_allclose(state.to_dict()[k][:, 1], s1.to_dict()[k][:, 0], atol=1e-5, rtol=1e-5)


def test_hybrid_param_tree_one_block_per_pattern_letter():
  cfg = CFG.replace(n_layers=6, mixers="GGA")
  params = jax.eval_shape(lambda: model.init_params(cfg, jax.random.key(0)))
  assert sorted(params["layers"]) == ["block0", "block1", "block2"]
  assert params["layers"]["block0"]["w_qkvg"].shape == (2, 64, cfg.qkvg_width)
  assert params["layers"]["block2"]["w_qkv"].shape == (2, 64, 3 * cfg.n_heads * cfg.attn_head_dim)
  assert sum(x.size for x in jax.tree.leaves(params)) == param_counts(cfg)["total"]
  from laplace_jax.training.optimizer import param_labels

  labels = param_labels(params)
  assert labels["layers"]["block2"]["w_qkv"] == labels["layers"]["block2"]["w_o"] == "muon"
  assert labels["layers"]["block2"]["ln1_scale"] == "adamw"


def test_mixer_only_layers_with_one_attention_head():
  """Zoology's MQAR models: no FFN (the tree drops exactly its leaves, which a zero W3 makes a no-op in the
  FFN model) and one attention head over the whole attention width (its KV cache: one head, same bytes)."""
  cfg = CFG.replace(mixers="GS", window=8, ffn=False, attn_heads=1)
  with_ffn = cfg.replace(ffn=True)
  params, full = (model.init_params(c, jax.random.key(0)) for c in (cfg, with_ffn))
  ffn_leaves = {"ln2_scale", "w1", "w2", "w3"}
  for b in ("block0", "block1"):
    assert set(full["layers"][b]) - set(params["layers"][b]) == ffn_leaves
  assert params["layers"]["block1"]["w_qkv"].shape == (1, 64, 3 * 64) and cfg.attn_head_dim == 64
  assert sum(x.size for x in jax.tree.leaves(params)) == param_counts(cfg)["total"]
  per_layer_ffn = 64 + 3 * 64 * CFG.d_ff  # ln2_scale, w1, w2, w3
  assert param_counts(with_ffn)["total"] - param_counts(cfg)["total"] == 2 * per_layer_ffn
  toks = jax.random.randint(jax.random.key(2), (2, 40), 0, cfg.vocab_size)
  zero_w3 = jax.tree_util.tree_map_with_path(
    lambda path, x: jnp.zeros_like(x) if path[-1].key == "w3" else x, full
  )
  mixer_only = {
    **full,
    "layers": {b: {n: w for n, w in ws.items() if n not in ffn_leaves} for b, ws in full["layers"].items()},
  }
  np.testing.assert_allclose(
    model.forward(zero_w3, toks, cfg=with_ffn), model.forward(mixer_only, toks, cfg=cfg), atol=1e-5, rtol=1e-5
  )
  state = _check_prefill_then_decode(params, cfg, B=2, T=40, P=20)
  assert state.ring.k.shape == (1, 2, 1, 8, 64)
  assert sum(x.nbytes for x in jax.tree.leaves(state)) // 2 == state_bytes_per_sequence(cfg)
  attn = CFG.replace(mixers="A", ffn=False)
  sharp = jax.tree_util.tree_map_with_path(  # peaked attention, where the head split shows
    lambda path, x: 30 * x if path[-1].key == "w_qkv" else x, model.init_params(attn, jax.random.key(0))
  )
  one, four = (model.forward(sharp, toks, cfg=attn.replace(attn_heads=h)) for h in (1, 0))
  assert np.abs(one - four).max() > 0.05  # the same weights read as 1 head or as 4


@pytest.mark.parametrize("preset", ["laplace-3b", "small", "tiny"])
@pytest.mark.parametrize("mixers", ["A", "GGGA", "GA", "GGGS"])
def test_attention_patterns_spend_the_same_parameter_budget(preset, mixers):
  base = get_config(preset)
  if base.n_layers % len(mixers):
    base = base.replace(n_layers=len(mixers) * 2)
  cfg = base.replace(mixers=mixers)
  want, got = param_counts(base)["total"], param_counts(cfg)["total"]
  assert abs(got - want) / want < 0.01, (got, want)
  assert (
    get_config("laplace-3b").mixers == "G" and param_counts(get_config("laplace-3b"))["muon"] == 2_717_908_992
  )


def test_attention_state_bytes_grow_with_context():
  cfg = CFG.replace(n_layers=4, mixers="GGGA")
  s = model.init_state(cfg, 1, max_len=300)
  assert sum(x.nbytes for x in jax.tree.leaves(s)) == state_bytes_per_sequence(cfg, context=300)
  assert state_bytes_per_sequence(cfg, 600) > state_bytes_per_sequence(cfg, 300)
  with pytest.raises(ValueError, match="context"):
    state_bytes_per_sequence(cfg)


@pytest.mark.parametrize(
  "bad, match",
  [
    (dict(mixers="GX"), "letters"),
    (dict(mixers=""), "letters"),
    (dict(mixers="GGG"), "divides n_layers"),
    (dict(mixers="GS", window=0), "window"),
  ],
)
def test_invalid_mixer_patterns_rejected(bad, match):
  with pytest.raises(ValueError, match=match):
    CFG.replace(**bad)


def test_kv_cache_overflow_is_a_clear_error():
  params = model.init_params(ATTN, jax.random.key(0))
  with pytest.raises(ValueError, match="max_len"):
    model.init_state(ATTN, 1)
  state = model.init_state(ATTN, 1, max_len=10)
  with pytest.raises(ValueError, match="max_len=10"):
    model.prefill(params, state, np.ones((1, 11), np.int32), cfg=ATTN)
  _, state = model.prefill(params, state, np.ones((1, 10), np.int32), cfg=ATTN)
  with pytest.raises(ValueError, match="does not fit"):
    model.decode_step(params, state, jnp.ones((1,), jnp.int32), cfg=ATTN)
  logits, _ = jax.jit(model.decode_step, static_argnames="cfg")(
    params, state, jnp.ones((1,), jnp.int32), cfg=ATTN
  )
  assert np.isnan(np.asarray(logits)).all()  # under jit: NaN, never a silently truncated context


def test_forward_at_positions_equals_full_logits_gathered(params):
  toks = jax.random.randint(jax.random.key(6), (2, 40), 0, CFG.vocab_size)
  pos = jnp.array([[0, 5, 39], [7, 7, 12]])
  full = model.forward(params, toks, cfg=CFG)
  np.testing.assert_allclose(
    model.forward(params, toks, cfg=CFG, positions_BxJ=pos),
    np.take_along_axis(np.asarray(full), np.asarray(pos)[..., None], 1),
    atol=1e-5,
  )


def test_laplace_3b_window_rings_cost_what_a_kv_cache_of_w_tokens_does():
  """GGGS at W = 2,048 holds, at every context, what GGGA holds at 2,048 tokens (init_state's own shapes)."""
  gggs = get_config("laplace-3b", mixers="GGGS", window=2048)
  gggs_bytes = sum(
    x.size * x.dtype.itemsize for x in jax.tree.leaves(jax.eval_shape(lambda: model.init_state(gggs, 1)))
  )
  assert (
    gggs_bytes
    == state_bytes_per_sequence(gggs)
    == state_bytes_per_sequence(gggs.replace(mixers="GGGA"), 2048)
  )
  assert state_bytes_per_sequence(gggs.replace(window=512)) < gggs_bytes


@pytest.mark.parametrize("mixers", ["G", "GS", "GA"])
def test_state_batch_axes_name_every_leafs_sequence_axis(mixers):
  """The layout contract the engine's slot table and the train step's carry rely on."""
  cfg = get_config("tiny", mixers=mixers)
  state = jax.eval_shape(lambda: model.init_state(cfg, 3, 5))
  axes = state.batch_axes()
  assert jax.tree.structure(axes) == jax.tree.structure(state)
  assert jax.tree.leaves(jax.tree.map(lambda x, a: x.shape[a], state, axes)) == [3] * len(
    jax.tree.leaves(state)
  )
  flat, flat_axes = state.to_dict(), axes.to_dict()
  assert {name: flat[name].shape[a] for name, a in flat_axes.items()} == {name: 3 for name in flat}


@pytest.mark.parametrize("mixers", ["G", "GS", "GA"])
def test_param_tree_and_init_values_pinned(mixers):
  """Paths, shapes, dtypes and init values (bitwise, seed 0) of tiny G / GS / GA as collected before the
  mixer refactor (tests/data/param_tree_tiny.json): checkpoints, FSDP shardings and Muon's 2-D selection
  depend on them. A change here is a checkpoint-format change."""
  import hashlib
  import json

  pinned = json.loads((helpers.DATA / "param_tree_tiny.json").read_text())[mixers]
  params = model.init_params(get_config("tiny", mixers=mixers, window=16), jax.random.key(0))
  got = {
    jax.tree_util.keystr(path): f"{np.asarray(x).dtype}{list(x.shape)} "
    + hashlib.sha256(np.asarray(x).tobytes()).hexdigest()[:16]
    for path, x in jax.tree_util.tree_leaves_with_path(params)
  }
  assert got == pinned
