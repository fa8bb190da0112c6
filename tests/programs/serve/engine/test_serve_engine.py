"""serve.engine.engine / serve.slots.sampling over the compiled model: batching never changes a request's tokens, nothing
recompiles after warm-up, sampling draws from the exact filtered distribution. Scheduling alone (the queue
bound, cancels): tests/programs/serve/engine/test_serve_scheduler.py, over the fake."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import serve_fixtures as sf
from helpers.serve_fixtures import GPT2_VOCAB

from laplace_jax import model, sharding
from serve.engine.engine import Request
from serve.slots import sampling


@pytest.fixture(scope="module")
def cfg():
  return sf.tiny(0)[0]


@pytest.fixture(scope="module")
def params():
  return sf.tiny(0)[1]


@pytest.fixture(scope="module")
def engine(cfg, params):
  """8 slots split over the 8 simulated devices, prefill batch 2, warmed up."""
  return sf.engine(
    params, cfg, n_slots=8, prefill_batch=2, max_queue=64, mesh=sharding.make_mesh(data=1, fsdp=8)
  )


_COUNTER = sf.CompileCounter()


def _requests(seed, n, **fixed):
  rng = np.random.default_rng(seed)
  settings = [
    dict(temperature=0.0),
    dict(temperature=0.9, top_k=20),
    dict(temperature=1.0),
    dict(temperature=0.8, top_p=0.95, top_k=40),
  ]
  out = []
  for i in range(n):
    spec = dict(
      prompt_ids=rng.integers(0, GPT2_VOCAB, int(rng.integers(1, 300))).tolist(),
      max_tokens=int(rng.integers(1, 20)),
      seed=int(rng.integers(0, 2**32)),
      **settings[i % len(settings)],
    )
    spec.update(fixed)
    out.append(spec)
  return out


def _run_in_two_waves(eng, reqs, first: int, steps: int):
  """Arrivals spread over time: the first `first` requests, `steps` engine steps, then the rest join while
  those decode; run to the end. Returns reqs."""
  for r in reqs[:first]:
    eng.submit(r)
  for _ in range(steps):
    eng.step()
  for r in reqs[first:]:
    eng.submit(r)
  eng.run_until_idle()
  return reqs


@pytest.mark.parametrize("kind", ["greedy", "seeded"])
def test_concurrent_requests_match_each_decoded_alone_without_compiling(engine, kind):
  fixed = dict(temperature=0.0) if kind == "greedy" else {}
  specs = _requests(1 if kind == "greedy" else 2, 10, **fixed)
  _COUNTER.n, _COUNTER.on = 0, True
  try:
    alone = [engine.generate([Request(**s)])[0] for s in specs]
    reqs = _run_in_two_waves(engine, [Request(**s) for s in specs], 6, 3)
  finally:
    _COUNTER.on = False
  assert _COUNTER.n == 0, f"{_COUNTER.n} compiles after warm-up"
  for s, r, a in zip(specs, reqs, alone):
    assert r.progress.output_ids == a, s
    assert len(a) <= s["max_tokens"] and r.progress.finish_reason in ("stop", "length")
    assert all(0 <= t < GPT2_VOCAB for t in a)
  assert engine.active_slots == 0 and engine.queue_depth == 0


def test_several_steps_a_call_give_the_same_tokens_logprobs_and_ends(engine, cfg, params):
  """An engine that generates 4 tokens a call while no prompt waits (over the same compiled functions, so
  only that call compiles) gives every request the tokens, logprobs and finish reasons of one step a call,
  with arrivals that make it mix both kinds of call, stop ids ending requests inside a call and logprobs."""
  multi = sf.engine(
    params,
    cfg,
    n_slots=8,
    prefill_batch=2,
    max_queue=64,
    decode_steps=4,
    make_slots=lambda *a, **kw: engine.fns,
  )
  specs = _requests(3, 10)
  for i, s in enumerate(specs):
    s["max_tokens"] = 6 + 2 * i
    if i % 3 == 1:
      s["logprobs"] = 2
  first = engine.generate([Request(**specs[4])])[0]
  specs[4]["stop_ids"] = [first[2]]  # ends at its third token (or earlier), inside a call
  runs = []
  for eng in (engine, multi):
    runs.append(_run_in_two_waves(eng, [Request(**s) for s in specs], 5, 6))
  assert multi.stats.tokens > multi.stats.steps  # some calls gave several tokens
  for one, many in zip(*runs):
    assert many.progress.output_ids == one.progress.output_ids
    assert many.progress.finish_reason == one.progress.finish_reason
    assert len(many.progress.token_logprobs) == len(one.progress.token_logprobs)
    for (lp_a, top_a), (lp_b, top_b) in zip(one.progress.token_logprobs, many.progress.token_logprobs):
      np.testing.assert_allclose(lp_b, lp_a, rtol=1e-4, atol=1e-5)
      assert [t for t, _ in top_b] == [t for t, _ in top_a]
  assert runs[0][4].progress.finish_reason == "stop"


def test_greedy_matches_the_model_called_directly(engine, cfg, params):
  """The engine's greedy tokens against argmax over model.prefill / decode_step logits (an independent
  loop); compared where the reference's top-2 margin is clear of float noise."""
  prompt = list(range(1000, 1150))
  got = engine.generate([Request(prompt_ids=prompt, max_tokens=8, temperature=0.0)])[0]
  logits, state = model.prefill(params, model.init_state(cfg, 1), np.array([prompt]), cfg=cfg)
  step = jax.jit(functools.partial(model.decode_step, cfg=cfg))
  for t in got:
    row = np.asarray(logits[0, :GPT2_VOCAB])
    top2 = np.sort(row)[-2:]
    if top2[1] - top2[0] > 1e-4:
      assert t == int(row.argmax())
    logits, state = step(params, state, jnp.array([t]))


def test_stop_ids_and_max_tokens(engine):
  base = engine.generate([Request(prompt_ids=[5, 6, 7], max_tokens=6, temperature=0.0)])[0]
  assert len(base) == 6
  req = Request(prompt_ids=[5, 6, 7], max_tokens=6, temperature=0.0, stop_ids=[base[3]])
  engine.generate([req])
  first = base.index(base[3])
  assert req.progress.output_ids == base[: first + 1] and req.progress.finish_reason == "stop"
  one = Request(prompt_ids=[5, 6, 7], max_tokens=1, temperature=0.0)
  engine.generate([one])
  assert one.progress.output_ids == base[:1] and one.progress.finish_reason == "length"


def test_seed_reproducible_and_matters(engine):
  p = list(range(40))
  a, b, c = engine.generate(
    [Request(prompt_ids=p, max_tokens=12, temperature=1.0, seed=s) for s in (7, 7, 8)]
  )
  assert a == b and a != c


@pytest.mark.parametrize(
  "bad, message",
  [
    (dict(prompt_ids=[]), "empty"),
    (dict(prompt_ids=[GPT2_VOCAB]), "expected ids in"),
    (dict(prompt_ids=[1], max_tokens=-1), "max_tokens"),
    (dict(prompt_ids=[1], top_p=0.0), "top_p"),
    (dict(prompt_ids=[1], seed=2**64), "seed"),
    (dict(prompt_ids=[1], stop_ids=list(range(9))), "stop ids"),
    (dict(prompt_ids=[1], logprobs=6), "logprobs"),
    (dict(prompt_ids=[1], siblings=8), "--n_slots"),
  ],
)
def test_bad_requests_are_refused(engine, bad, message):
  if "siblings" in bad:  # built here: a Request held by the parameter list would outlive the test
    bad = dict(bad, siblings=[Request(prompt_ids=[1]) for _ in range(bad["siblings"])])
  with pytest.raises(ValueError, match=message):
    engine.submit(Request(**bad))


def _reference_probs(logits, valid, temperature, top_k, top_p):
  """Sort-based filtering in float64: top-k, then the top-p nucleus of the renormalised top-k."""
  z = np.asarray(logits, np.float64)[:valid] / temperature
  p = np.exp(z - z.max())
  p /= p.sum()
  order = np.argsort(-p, kind="stable")
  ps = p[order]
  if top_k:
    ps[top_k:] = 0
    ps /= ps.sum()
  keep = (np.cumsum(ps) - ps) < top_p
  ps = np.where(keep, ps, 0)
  q = np.zeros(len(logits))
  q[order] = ps / ps.sum()
  return q


def test_sampling_draws_from_the_filtered_distribution():
  V, valid, N = 200, 190, 3000
  rng = np.random.default_rng(0)
  rows = [
    (1.0, 0, 1.0),
    (0.7, 0, 1.0),
    (1.0, 5, 1.0),
    (1.0, 0, 0.5),  # plain, temperature, top-k, top-p
    (1.0, 100, 0.8),
    (1.0, 0, 0.97),
  ]  # past the cap: the bisection path
  logits = jnp.asarray(rng.normal(size=(len(rows), V)) * 2.0, jnp.float32)
  t, k, p = (jnp.asarray(c, dt) for c, dt in zip(zip(*rows), (jnp.float32, jnp.int32, jnp.float32)))
  draw = jax.jit(
    jax.vmap(functools.partial(sampling.sample, logits, t, k, p, jnp.arange(len(rows)), valid_vocab=valid))
  )
  toks = np.asarray(draw(jnp.broadcast_to(jnp.arange(N)[:, None], (N, len(rows)))))  # [N, rows]
  for i, (temp, top_k, top_p) in enumerate(rows):
    q = _reference_probs(np.asarray(logits[i]), valid, temp, top_k, top_p)
    emp = np.bincount(toks[:, i], minlength=V) / N
    assert np.all(emp[q == 0] == 0), f"row {i} drew tokens outside its kept set"
    sd = np.sqrt(q * (1 - q) / N)
    assert np.all(np.abs(emp - q) <= 5 * sd + 2e-3), f"row {i}: frequencies off the reference"
  greedy = sampling.sample(
    logits,
    jnp.zeros(len(rows)),
    k,
    p,
    jnp.arange(len(rows)),
    jnp.zeros(len(rows), jnp.int32),
    valid_vocab=valid,
  )
  np.testing.assert_array_equal(greedy, np.argmax(np.asarray(logits)[:, :valid], -1))


def test_exported_params_load_onto_the_serving_mesh(cfg, params, tmp_path):
  from laplace_jax.training import checkpoint
  from serve.slots import loading

  checkpoint.export_params(params, tmp_path / "export", config=cfg)
  mesh = loading.make_serving_mesh(8)
  got, got_cfg = loading.load_model(checkpoint=str(tmp_path / "export"), mesh=mesh, dtype="param")
  assert got_cfg == cfg
  for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(got)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert b.sharding.is_fully_replicated and len(b.sharding.device_set) == 8
  with pytest.raises(ValueError, match="preset small"):  # --preset with --checkpoint only checks the config
    loading.load_model(checkpoint=str(tmp_path / "export"), preset="small")
