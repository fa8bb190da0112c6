"""serve.engine.state_cache and its use by the engine: longest-prefix hits on exact ids only, LRU eviction by
bytes, atomic files that survive a restart (a damaged one is skipped), and restored states that equal a
full prefill within fp32 rounding, so the tokens are the same with the cache on and off."""

import dataclasses
import os

import jax
import numpy as np
import pytest
from helpers import serve_fixtures as sf
from helpers.serve_fixtures import GPT2_VOCAB

from laplace_jax import model, sharding
from serve.engine import state_cache
from serve.engine.engine import Request
from serve.engine.state_cache import StateCache


def _state(fill, L=2, n=3):
  return {"gla": np.full((L, n, 4), fill, np.float32), "conv": np.full((L, 2), fill, np.float32)}


ENTRY_BYTES = sum(a.nbytes for a in _state(0).values())


def test_layout_is_the_flat_stored_form_of_one_sequence():
  """The files' array names and shapes: DecodeState.to_dict's keys, each leaf without its sequence axis (the
  layout of files written before the decode state was typed, so they still load)."""
  from laplace_jax.model.config import get_config

  cfg = get_config("tiny", n_layers=4, mixers="GS", window=8)
  L, H, W, hd = 4, cfg.attn_n_heads, cfg.window, cfg.attn_head_dim
  assert state_cache.layout_for(cfg) == {
    "pos": ("int32", ()),
    "conv": ("float32", (L, cfg.conv_size, cfg.d_model)),
    "gla": ("float32", (L // 2, cfg.n_heads, cfg.d_k, cfg.d_v)),
    "ring_k": ("float32", (L // 2, H, W, hd)),
    "ring_v": ("float32", (L // 2, H, W, hd)),
  }


def test_longest_exact_prefix_hits_and_misses():
  c = StateCache("m1", budget_bytes=10 * ENTRY_BYTES)
  ids = list(range(1000, 1300))
  for n in (10, 64, 130, 200):
    c.put(ids[:n], _state(n))
  n, st = c.lookup(ids + [7], max_len=300)
  assert n == 200 and st["gla"][0, 0, 0] == 200
  n, st = c.lookup(ids, max_len=199)  # the longest one fitting under the bound
  assert n == 130
  n, _ = c.lookup(ids[:150] + [5] * 100, max_len=1000)
  assert n == 130
  other = list(ids)
  other[3] = 999  # differs inside the first block: nothing of it is cached
  assert c.lookup(other, max_len=300) == (0, None)
  assert c.lookup(ids[:9], max_len=9) == (0, None)
  assert c.stats.hits == 3 and c.stats.misses == 2 and c.stats.tokens_reused == 200 + 130 + 130


def test_a_hash_match_never_serves_different_ids():
  c = StateCache("m1", budget_bytes=10 * ENTRY_BYTES)
  ids = list(range(100))
  c.put(ids, _state(1))
  e = next(iter(c.entries.values()))
  e.ids = e.ids.copy()
  e.ids[-1] += 1  # same chain position and key, different tokens (what a collision would look like)
  assert c.lookup(ids + [1], max_len=100) == (0, None)


def test_another_model_never_hits():
  a, b = StateCache("model-a", 10 * ENTRY_BYTES), StateCache("model-b", 10 * ENTRY_BYTES)
  ids = list(range(100))
  a.put(ids, _state(1))
  b.entries.update(a.entries)  # even if the other model's entries were in the same table
  b.by_block.update(a.by_block)
  assert b.lookup(ids + [1], max_len=100) == (0, None)


def test_lru_eviction_by_bytes():
  c = StateCache("m", budget_bytes=3 * ENTRY_BYTES)
  seqs = [[i] * 5 for i in range(5)]
  for s in seqs[:3]:
    c.put(s, _state(s[0]))
  assert c.lookup(seqs[0] + [9], 5)[0] == 5  # touch 0: 1 is now the oldest
  c.put(seqs[3], _state(3))
  assert c.bytes == 3 * ENTRY_BYTES and c.stats.evictions == 1
  assert c.lookup(seqs[1] + [9], 5) == (0, None)
  assert all(c.lookup(seqs[i] + [9], 5)[0] == 5 for i in (0, 2, 3))
  big = {"gla": np.zeros((4 * ENTRY_BYTES // 4,), np.float32)}
  assert not c.put([1, 2], big)  # larger than the whole budget: refused, nothing evicted
  assert len(c) == 3


def test_directory_round_trip_and_a_damaged_file_is_skipped(tmp_path, caplog):
  d = str(tmp_path / "cache")
  c = StateCache("m", budget_bytes=10 * ENTRY_BYTES, directory=d)
  for i in range(3):
    c.put([i] * 70, _state(i))
  c.flush()
  files = sorted(f for f in os.listdir(d) if f.endswith(".state"))
  assert len(files) == 3 and not [f for f in os.listdir(d) if ".tmp" in f]
  with open(os.path.join(d, files[0]), "r+b") as f:  # flip one payload byte
    f.seek(-3, os.SEEK_END)
    b = f.read(1)
    f.seek(-3, os.SEEK_END)
    f.write(bytes([b[0] ^ 1]))
  with open(os.path.join(d, files[1]), "r+b") as f:  # truncate another
    f.truncate(os.path.getsize(os.path.join(d, files[1])) - 10)
  again = StateCache("m", budget_bytes=10 * ENTRY_BYTES, directory=d)
  assert len(again) == 1 and again.stats.files_skipped == 2
  assert "skipping" in caplog.text
  ((ids, st),) = [(e.ids, e.state) for e in again.entries.values()]
  i = int(ids[0])
  np.testing.assert_array_equal(st["gla"], _state(i)["gla"])
  assert again.lookup([i] * 71, 70)[0] == 70


def test_bad_directories_are_refused(tmp_path):
  StateCache("model-a", ENTRY_BYTES, directory=str(tmp_path / "a"))
  with pytest.raises(ValueError, match="another model.*--state_cache_dir|--state_cache_dir.*another model"):
    StateCache("model-b", ENTRY_BYTES, directory=str(tmp_path / "a"))
  (tmp_path / "b").mkdir()
  (tmp_path / "b" / "notes.txt").write_text("mine")
  with pytest.raises(ValueError, match="--state_cache_dir.*not a state cache"):
    StateCache("m", ENTRY_BYTES, directory=str(tmp_path / "b"))
  (tmp_path / "file").write_text("x")  # a path under a plain file cannot be created, not even by root
  with pytest.raises(ValueError, match="--state_cache_dir.*writable"):
    StateCache("m", ENTRY_BYTES, directory=str(tmp_path / "file" / "sub"))


# ---- the engine ----


@pytest.fixture(scope="module")
def cfg():
  return sf.tiny(3)[0]


@pytest.fixture(scope="module")
def params():
  return sf.tiny(3)[1]


def _engine(cfg, params, cache, **kw):
  return sf.engine(
    params,
    cfg,
    n_slots=8,
    prefill_batch=2,
    state_cache=cache,
    snapshot_every=2,
    cache_min_tokens=16,
    **{"mesh": sharding.make_mesh(data=1, fsdp=8), **kw},
  )


@pytest.fixture(scope="module")
def engines(cfg, params):
  """An engine with the state cache and one without, over the same compiled slot functions (the cache
  lives in the engine; the functions are pure), so the second compiles nothing."""
  ident = state_cache.model_identity(cfg, params)
  make = sf.reused_slots()
  return (
    _engine(cfg, params, StateCache(ident, 1 << 30), make_slots=make),
    _engine(cfg, params, None, make_slots=make),
  )


def _full_state(params, cfg, ids):
  _, st = model.prefill(params, model.init_state(cfg, 1), np.array([ids]), cfg=cfg)
  axes = st.batch_axes().to_dict()
  return {k: np.take(np.asarray(v), 0, axes[k]) for k, v in st.to_dict().items()}


def _assert_state_close(st, ref, n):
  """A cached state of n consumed tokens against a full prefill's, leaf by leaf. A finished slot stood still
  for its last token (model.decode_step's live_B), which its conv ring still took, in slot n mod W: the slot
  the next token overwrites before any read (laplace_jax/ops/short_conv.py), so it is left out."""
  for k in ref:  # decode steps against 128-token chunks: the same math, different rounding
    got, want = np.array(st[k]), np.array(ref[k])
    if k == "conv":  # [L, W, D]
      got[:, n % got.shape[1]] = want[:, n % want.shape[1]]
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


def test_finished_state_equals_a_full_prefill_of_prompt_and_output(engines, cfg, params):
  cached, _ = engines
  prompt = list(np.random.default_rng(0).integers(0, GPT2_VOCAB, 300))
  r = Request(prompt_ids=prompt, max_tokens=9, temperature=0.0)
  cached.generate([r])
  cached.state_io.collect(block=True)
  ids = prompt + r.progress.output_ids
  n, st = cached.cache.lookup(ids + [0], len(ids))
  assert n == len(ids) - 1  # every output token but the last (a finished slot stands still)
  _assert_state_close(st, _full_state(params, cfg, ids[:n]), n)
  # the long prompt left snapshots on the way (every 2 chunks of 128 tokens)
  assert cached.cache.lookup(prompt, 299)[0] == 256


@pytest.mark.parametrize("kind", ["greedy", "seeded"])
def test_a_conversation_resumes_from_the_cache_with_the_same_tokens(engines, kind):
  cached, plain = engines
  rng = np.random.default_rng(1 if kind == "greedy" else 2)
  sampling = dict(temperature=0.0) if kind == "greedy" else dict(temperature=0.9, top_k=40)
  convs = [list(rng.integers(0, GPT2_VOCAB, int(rng.integers(20, 200)))) for _ in range(3)]
  for turn in range(3):
    specs = [
      dict(prompt_ids=c, max_tokens=int(rng.integers(2, 12)), seed=int(rng.integers(2**32)), **sampling)
      for c in convs
    ]
    before = dataclasses.replace(cached.stats)
    got = cached.generate([Request(**s) for s in specs])
    want = plain.generate([Request(**s) for s in specs])
    assert got == want
    reused = cached.stats.cached_prompt_tokens - before.cached_prompt_tokens
    prefilled = cached.stats.prefill_tokens - before.prefill_tokens
    assert reused + prefilled == sum(len(c) for c in convs)
    if turn:
      assert reused >= sum(len(c) for c in convs) - 3 * 40  # all but the new turn's text
    cached.state_io.collect(block=True)
    convs = [c + g + list(rng.integers(0, GPT2_VOCAB, 30)) for c, g in zip(convs, got)]


def test_restored_then_prefilled_state_equals_a_full_prefill(engines, cfg, params):
  cached, _ = engines
  rng = np.random.default_rng(5)
  first = list(rng.integers(0, GPT2_VOCAB, 150))
  r1 = Request(prompt_ids=first, max_tokens=3, temperature=0.0)
  cached.generate([r1])
  second = (
    first + r1.progress.output_ids + list(rng.integers(0, GPT2_VOCAB, 200))
  )  # restored at 152, not aligned
  r2 = Request(prompt_ids=second, max_tokens=4, temperature=0.0)
  cached.generate([r2])
  assert r2.progress.cached_tokens == 152
  cached.state_io.collect(block=True)
  ids = second + r2.progress.output_ids
  n, st = cached.cache.lookup(ids + [0], len(ids))
  assert n == len(ids) - 1
  _assert_state_close(st, _full_state(params, cfg, ids[:n]), n)


def test_same_tokens_with_the_cache_on_and_off_for_n_choices_and_prompt_lists(engines):
  cached, plain = engines
  rng = np.random.default_rng(9)
  base = list(rng.integers(0, GPT2_VOCAB, 180))
  first = cached.generate([Request(prompt_ids=base, max_tokens=2, temperature=0.0)])[0]
  cached.state_io.collect(block=True)  # base + the 2 tokens are cached
  base = base + first
  hits = cached.cache.stats.hits

  def batch():
    prompts = [base + list(rng2.integers(0, GPT2_VOCAB, 20 + 10 * i)) for i in range(3)]
    return [
      Request(
        prompt_ids=p,
        max_tokens=5,
        temperature=0.8,
        seed=40 + i,
        siblings=[Request(prompt_ids=p, max_tokens=5, temperature=0.8, seed=50 + i)],
      )
      for i, p in enumerate(prompts)
    ]

  outs = []
  for eng in (cached, plain):
    rng2 = np.random.default_rng(10)
    reqs = batch()
    eng.submit_all(reqs)
    eng.run_until_idle()
    outs.append([[m.progress.output_ids for m in (r, *r.siblings)] for r in reqs])
  assert outs[0] == outs[1]
  assert cached.cache.stats.hits - hits == 3  # one per prompt; the choices share its prefill


def test_a_foreign_cache_dir_stops_the_server_at_start(tmp_path):
  from serve.__main__ import main

  (tmp_path / "notes.txt").write_text("not a cache")
  with pytest.raises(SystemExit, match="--state_cache_dir=.*not a state cache"):
    main(["--preset", "tiny", "--random-init", "--state-cache-dir", str(tmp_path)])
  with pytest.raises(SystemExit):  # argparse: a negative budget
    main(["--preset", "tiny", "--random-init", "--state-cache-gb", "-1"])


def test_restores_snapshots_and_copies_compile_nothing_after_warmup(cfg, params):
  # Its own slot functions (not the fixture's): whatever they compile, its warm-up alone compiled. One
  # device, as `python -m serve` runs by default: no mesh, the params placed on it (committed, so are the
  # outputs they touch: a prompt's second chunk must not compile again).
  params = jax.device_put(params, jax.devices()[0])
  eng = _engine(cfg, params, StateCache(state_cache.model_identity(cfg, params), 1 << 30), mesh=None)
  compiles = []
  jax.monitoring.register_event_duration_secs_listener(
    lambda event, d, **kw: (
      compiles.append(event) if event == "/jax/core/compile/backend_compile_duration" and listening else None
    )
  )
  listening = True
  try:
    prompt = list(range(1000, 1600))  # long enough to leave snapshots
    out = eng.generate(
      [
        Request(prompt_ids=prompt, max_tokens=3, logprobs=2),
        Request(prompt_ids=prompt[:300], max_tokens=2, echo=True, logprobs=0),
      ]
    )[0]
    eng.state_io.collect(block=True)
    r = Request(
      prompt_ids=prompt + out + [5, 6, 7],
      max_tokens=2,
      seed=2**50,
      siblings=[Request(prompt_ids=prompt + out + [5, 6, 7], max_tokens=1)],
    )
    eng.generate([r])
    assert r.progress.cached_tokens == len(prompt) + len(out) - 1
  finally:
    listening = False
  assert compiles == []


@pytest.mark.parametrize("resent_as_generated", [True, False])
def test_a_conversation_keeps_a_bounded_number_of_states(resent_as_generated):
  """Twenty turns, each storing where its prompt and its reply end: the reply's state is a prefix of the
  next prompt when the client re-sends the ids the model generated, a dead branch when they re-tokenize
  otherwise. Either way the conversation holds a few states, its newest ones restore, and another
  conversation's states are untouched."""
  c = StateCache("m", budget_bytes=1000 * ENTRY_BYTES)
  other = [7] * 70
  c.put(other, _state(7))
  prompt = list(range(100, 170))
  for turn in range(20):
    c.put(prompt, _state(turn))
    reply = [1000 + turn] * 5
    c.put(prompt + reply, _state(turn))
    resent = reply if resent_as_generated else [2000 + turn] * 6
    prompt = prompt + resent + [3000 + turn] * 30
  assert len(c) - 1 == (3 if resent_as_generated else 4)
  assert c.stats.evictions == 0 and c.stats.superseded > 30
  c.put(prompt, _state(20))
  assert c.lookup(prompt + [1], len(prompt))[0] == len(prompt)
  assert c.lookup(prompt[:-30] + [5], len(prompt))[0] == len(prompt) - 30 - (0 if resent_as_generated else 6)
  assert c.lookup(other + [1], 70)[0] == 70
