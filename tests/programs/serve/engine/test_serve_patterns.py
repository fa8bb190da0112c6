"""The engine serves every mixer pattern: GLA (G), sliding-window (S) and attention (A) layers. Its greedy
tokens equal laplace_jax.inference.generate's (an independent loop, one sequence, a fresh state) for several sequences
of different lengths decoding together in slots that earlier, longer sequences used; attention's per-slot
context bound refuses a prompt that does not fit (400) and ends a reply that reaches it with 'length'; the
state cache restores sliding-window states with the same tokens as a full prefill."""

import functools

import jax
import numpy as np
import pytest
from helpers import serve_fixtures as sf
from helpers.serve_fixtures import GPT2_VOCAB

from laplace_jax import model
from laplace_jax.inference import generate
from serve.engine import state_cache
from serve.engine.engine import Engine, Request
from serve.engine.engine_config import EngineConfig
from serve.engine.state_cache import StateCache

CONTEXT = 170  # the attention engine's --max_context; every reference call spans it (one compile each)
WINDOW = 16  # sliding window: far shorter than the prompts, so the rings wrap many times


@functools.lru_cache
def _model(pattern):
  """(cfg, params) of the tiny preset with this mixer pattern (each pattern has its own parameter tree)."""
  cfg = sf.tiny(7)[0].replace(mixers=pattern, window=WINDOW)
  return cfg, model.init_params(cfg, jax.random.key(7))


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
  """One warmed-up engine per pattern, built when first used: 2 slots (so later requests reuse slots
  while others decode), prefill batch 2; the GS engine keeps a state cache in a directory."""
  built = {}

  def get(pattern):
    if pattern not in built:
      cfg, params = _model(pattern)
      kw = dict(n_slots=2, prefill_batch=2, cache_min_tokens=16, snapshot_every=1)
      if "A" in pattern:
        kw["max_context"] = CONTEXT
      if pattern == "GS":
        kw["state_cache"] = StateCache(
          state_cache.model_identity(cfg, params),
          1 << 30,
          str(tmp_path_factory.mktemp("gs-cache")),
          layout=state_cache.layout_for(cfg),
        )
      built[pattern] = sf.engine(params, cfg, **kw)
    return built[pattern]

  return get


def _reference(pattern, prompt, n):
  """generate.generate's greedy tokens: prefill + decode_step of one sequence in a fresh state."""
  cfg, params = _model(pattern)
  return generate.generate(params, list(prompt), n, cfg=cfg, temperature=0.0, valid_vocab=GPT2_VOCAB)


@pytest.mark.parametrize("pattern", ["G", "GS", "GA"])
def test_greedy_tokens_equal_generate_with_slots_reused(engines, pattern):
  eng = engines(pattern)
  rng = np.random.default_rng(1)
  # Prompt + output spans CONTEXT tokens each (one reference compile per pattern); the first two fill both
  # slots, the next two are inserted into slots a longer sequence used (its position, rings, KV cache).
  lengths = [150, 131, 7, 40, 3]
  prompts = [rng.integers(0, GPT2_VOCAB, n).tolist() for n in lengths]
  reqs = [Request(prompt_ids=p, max_tokens=CONTEXT - len(p), temperature=0.0) for p in prompts]
  for r in reqs[:4]:
    eng.submit(r)
  for _ in range(5):
    eng.step()
  eng.submit(reqs[4])  # arrives while the others decode
  eng.run_until_idle()
  assert {r.progress.slot for r in reqs} == {0, 1}
  for p, r in zip(prompts, reqs):
    assert r.progress.finish_reason == "length"
    assert r.progress.output_ids == _reference(pattern, p, CONTEXT - len(p)), (pattern, len(p))


def test_attention_context_bound_refuses_long_prompts_and_ends_with_length(engines):
  eng = engines("GA")
  rng = np.random.default_rng(2)
  with pytest.raises(ValueError, match=f"--max_context={CONTEXT}"):
    eng.submit(Request(prompt_ids=rng.integers(0, GPT2_VOCAB, CONTEXT).tolist(), max_tokens=1))
  scored = Request(
    prompt_ids=rng.integers(0, GPT2_VOCAB, CONTEXT).tolist(), max_tokens=0, echo=True, logprobs=0
  )  # scoring only: the whole context fits
  eng.generate([scored])
  assert len(scored.progress.prompt_logprobs) == CONTEXT and np.isfinite(
    scored.progress.prompt_logprobs[-1][0]
  )
  prompt = rng.integers(0, GPT2_VOCAB, 60).tolist()
  r = Request(prompt_ids=prompt, max_tokens=1000, temperature=0.0, logprobs=1)
  eng.generate([r])
  assert r.progress.finish_reason == "length" and len(r.progress.output_ids) == CONTEXT - 60
  assert r.progress.output_ids == _reference("GA", prompt, CONTEXT - 60)
  assert all(np.isfinite(lp) for lp, _ in r.progress.token_logprobs)  # never a logit past the KV cache


def test_the_context_bound_is_a_400_naming_the_flag(engines):
  eng = engines("GA")
  tok = sf.gpt2_tokenizer()
  with sf.serving(
    eng,
    tok,
    sf.limits(
      tok,
      eng,
      max_tokens=4096,
      max_prompt_tokens=4096,
      max_choices=4,
      max_reply_entries=1 << 20,
      max_prompts=4,
    ),
    api_key=sf.KEY,
  ) as (url, _):
    status, body = sf.call(url, body={"prompt": [5] * CONTEXT, "max_tokens": 4})
    assert status == 400 and "--max_context" in body["error"]["message"], body
    # Greedy and ignore_eos: a sampled EOS at the last position would end the reply with 'stop' instead
    # (seen once in CI: the server's default temperature is 1 and its default seed random).
    status, body = sf.call(
      url, body={"prompt": [5] * (CONTEXT - 3), "max_tokens": 50, "temperature": 0, "ignore_eos": True}
    )
    assert status == 200 and body["choices"][0]["finish_reason"] == "length", body
    assert body["usage"]["completion_tokens"] == 3
    status, info = sf.call(url, method="GET", path="/tokenizer_info")
    assert info["model_max_length"] == CONTEXT  # what harnesses truncate prompts to
    status, text = sf.call(url, method="GET", path="/metrics")
  per_slot = dict(l.split(" ") for l in text.splitlines() if not l.startswith("#"))
  cfg = eng.cfg
  kv = 2 * cfg.n_mixer_layers("A") * CONTEXT * cfg.attn_width * 4  # fp32 keys and values
  assert int(per_slot["laplace_serve_state_bytes_per_slot"]) == eng.fns.state_bytes_per_slot
  assert eng.fns.state_bytes_per_slot == _state_bytes(cfg, CONTEXT) and eng.fns.state_bytes_per_slot > kv
  assert int(per_slot["laplace_serve_slot_table_bytes"]) >= 2 * eng.fns.state_bytes_per_slot


def _state_bytes(cfg, context):
  from laplace_jax.model.counts import state_bytes_per_sequence

  return state_bytes_per_sequence(cfg, context)


def test_a_cached_sliding_window_state_gives_the_tokens_of_a_full_prefill(engines):
  eng = engines("GS")
  rng = np.random.default_rng(3)
  first = rng.integers(0, GPT2_VOCAB, 70).tolist()
  r1 = Request(prompt_ids=first, max_tokens=5, temperature=0.0)
  eng.generate([r1])
  eng.state_io.collect(block=True)
  second = first + r1.progress.output_ids + rng.integers(0, GPT2_VOCAB, 30).tolist()
  r2 = Request(prompt_ids=second, max_tokens=12, temperature=0.0)
  eng.generate([r2])
  # restored: the first turn and its output but the last token (ring, pos and all)
  assert r2.progress.cached_tokens == 74
  assert r2.progress.output_ids == _reference("GS", second, 12)
  # The files hold every leaf of the layout (rings and pos too): a restart loads them, another layout not.
  cache = eng.cache
  assert cache.flush(30) and {"ring_k", "ring_v", "pos"} <= set(cache.layout)
  again = StateCache(cache.model_id, 1 << 30, cache.dir, layout=state_cache.layout_for(eng.cfg))
  assert len(again) == len(cache) > 0
  other = StateCache(
    cache.model_id, 1 << 30, cache.dir, layout=state_cache.layout_for(eng.cfg.replace(window=8))
  )
  assert len(other) == 0 and other.stats.files_skipped == len(cache)


def test_patterns_are_checked_at_start():
  cfg, params = _model("G")  # refused before any parameter is read
  with pytest.raises(ValueError, match="--max_context N"):
    Engine(params, cfg.replace(mixers="GA"), EngineConfig(n_slots=2))
  with pytest.raises(ValueError, match="leave --max_context unset"):
    Engine(params, cfg.replace(mixers="GS", window=WINDOW), EngineConfig(n_slots=2, max_context=64))
  with pytest.raises(ValueError, match="state cache"):
    Engine(
      params,
      cfg.replace(mixers="GA"),
      EngineConfig(n_slots=2, max_context=64),
      state_cache=StateCache("m", 1 << 20),
    )


def test_the_server_refuses_max_context_without_attention_before_loading_weights():
  from serve.__main__ import main

  with pytest.raises(SystemExit, match="leave --max_context unset"):
    main(["--preset", "tiny", "--random_init", "--max-context", "64"])  # the dashed spelling is accepted too
