"""serve.engine.engine's completion fields: logprobs computed in the compiled step equal log-softmax of
`model.forward`'s logits, echo scores every prompt token (also with max_tokens 0), n choices share one
prefill and each follows its own seed, 64-bit seeds, nothing recompiles."""

import jax
import numpy as np
import pytest
from helpers import serve_fixtures as sf
from helpers.serve_fixtures import GPT2_VOCAB as V
from helpers.serve_fixtures import call

from laplace_jax import model
from serve.engine.engine import Request


@pytest.fixture(scope="module")
def cfg():
  return sf.tiny(7)[0]


@pytest.fixture(scope="module")
def params():
  return sf.tiny(7)[1]


@pytest.fixture(scope="module")
def engine(cfg, params):
  return sf.engine(params, cfg, n_slots=4, prefill_batch=2)


@pytest.fixture(scope="module")
def tok():
  return sf.gpt2_tokenizer()


@pytest.fixture(scope="module")
def served(engine, tok):
  """The engine behind the server (its other tests run over the fake engine: tests/programs/serve/api/test_serve_http.py)."""
  with sf.serving(engine, tok, sf.limits(tok, engine, max_tokens=64, max_prompt_tokens=1000)) as served:
    yield served


def _reference(params, cfg, ids):
  """log-softmax over the valid vocabulary of forward's logits: row t scores token t + 1."""
  logits = np.asarray(model.forward(params, np.array([ids]), cfg=cfg))[0, :, :V].astype(np.float64)
  return (
    logits
    - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True))
    - logits.max(-1, keepdims=True)
  )


def _check_top(top, ref_row, n):
  assert len(top) == 5
  ids = [t for t, _ in top]
  np.testing.assert_allclose([v for _, v in top], ref_row[ids], atol=1e-4)
  order = np.sort(ref_row)[::-1]
  assert np.all(np.diff([v for _, v in top]) <= 0)
  np.testing.assert_allclose([v for _, v in top[:n]], order[:n], atol=1e-4)


@pytest.mark.parametrize("sampled", [False, True])
def test_logprobs_equal_log_softmax_of_forward(engine, cfg, params, sampled):
  prompt = np.random.default_rng(0).integers(0, V, 140).tolist()
  kw = dict(temperature=0.9, top_k=30, seed=3) if sampled else dict(temperature=0.0)
  r = Request(prompt_ids=prompt, max_tokens=7, logprobs=3, **kw)
  engine.generate([r])
  ref = _reference(params, cfg, prompt + r.progress.output_ids)
  assert len(r.progress.token_logprobs) == len(r.progress.output_ids) == 7
  for k, (tok, (lp, top)) in enumerate(zip(r.progress.output_ids, r.progress.token_logprobs)):
    row = ref[len(prompt) - 1 + k]
    assert abs(lp - row[tok]) < 1e-4
    _check_top(top, row, 3)


def test_echo_scores_every_prompt_token_even_with_max_tokens_0(engine, cfg, params):
  prompt = np.random.default_rng(1).integers(0, V, 300).tolist()  # three chunks: the borders are scored too
  plain = Request(prompt_ids=prompt[:50], max_tokens=3, temperature=0.0)  # shares the prefill batch
  scored = Request(prompt_ids=prompt, max_tokens=0, echo=True, logprobs=1, temperature=0.0)
  engine.generate([plain, scored])
  assert (
    scored.progress.output_ids == []
    and scored.progress.finish_reason == "length"
    and len(plain.progress.output_ids) == 3
  )
  ref = _reference(params, cfg, prompt)
  assert scored.progress.prompt_logprobs[0] is None and len(scored.progress.prompt_logprobs) == len(prompt)
  for t in range(1, len(prompt)):
    lp, top = scored.progress.prompt_logprobs[t]
    assert abs(lp - ref[t - 1, prompt[t]]) < 1e-4, t
    _check_top(top, ref[t - 1], 1)
  one = Request(prompt_ids=prompt, max_tokens=1, echo=True, logprobs=1, temperature=0.0)
  engine.generate([one])  # what lm-evaluation-harness sends: the generated token's logprob follows
  assert one.progress.prompt_logprobs[0] is None
  np.testing.assert_allclose(
    [x[0] for x in one.progress.prompt_logprobs[1:]],
    [x[0] for x in scored.progress.prompt_logprobs[1:]],
    atol=1e-5,
  )
  assert abs(one.progress.token_logprobs[0][0] - ref[-1][one.progress.output_ids[0]]) < 1e-4


def test_n_choices_share_a_prefill_and_follow_their_own_seeds(engine):
  prompt = list(range(500, 700))
  seeds = [11, 12, 13]
  alone = [
    engine.generate([Request(prompt_ids=prompt, max_tokens=8, temperature=1.0, seed=s)])[0] for s in seeds
  ]
  before = engine.stats.prefill_tokens
  lead = Request(
    prompt_ids=prompt,
    max_tokens=8,
    temperature=1.0,
    seed=seeds[0],
    siblings=[Request(prompt_ids=prompt, max_tokens=8, temperature=1.0, seed=s) for s in seeds[1:]],
  )
  engine.generate([lead])
  assert engine.stats.prefill_tokens - before == len(prompt)  # one prefill for three choices
  assert [lead.progress.output_ids] + [s.progress.output_ids for s in lead.siblings] == alone
  assert len({tuple(a) for a in alone}) > 1


def test_64_bit_seeds(engine):
  p = list(range(30))
  big = 2**40 + 7
  a, b, c = engine.generate(
    [Request(prompt_ids=p, max_tokens=12, temperature=1.0, seed=s) for s in (big, big, 7)]
  )
  assert a == b and a != c
  d = engine.generate([Request(prompt_ids=p, max_tokens=12, temperature=1.0, seed=2**64 - 1)])[0]
  assert d != a


def test_no_request_shape_compiles_after_warmup(engine):
  compiles = []

  def listen(event, duration, **kw):
    if event == "/jax/core/compile/backend_compile_duration":
      compiles.append(event)

  jax.monitoring.register_event_duration_secs_listener(listen)
  p = list(range(200, 461))
  engine.generate(
    [
      Request(prompt_ids=p, max_tokens=3, logprobs=5, echo=True, temperature=0.5, top_p=0.9),
      Request(prompt_ids=p[:10], max_tokens=0, echo=True, logprobs=0),
      Request(
        prompt_ids=p[:99],
        max_tokens=4,
        seed=2**63,
        siblings=[Request(prompt_ids=p[:99], max_tokens=2, logprobs=2) for _ in range(3)],
      ),
    ]
  )
  assert compiles == []


def test_lm_eval_loglikelihood_request_and_echo_over_http(served, tok):
  """The request lm-evaluation-harness's local-completions sends for loglikelihood, scored against
  log-softmax of model.forward's logits."""
  url, server = served
  ids = tok.encode("The quick brown fox jumps over the lazy dog")
  st, out = call(
    url, body={"prompt": [ids], "max_tokens": 1, "logprobs": 1, "echo": True, "temperature": 0, "seed": 1234}
  )
  assert st == 200, out
  lp = out["choices"][0]["logprobs"]
  assert len(lp["token_logprobs"]) == len(ids) + 1 and lp["token_logprobs"][0] is None
  assert lp["top_logprobs"][0] is None and all(len(t) == 1 for t in lp["top_logprobs"][1:])
  logits = np.asarray(model.forward(server.engine.params, np.array([ids]), cfg=server.engine.cfg))[
    0, :, : tok.vocab_size
  ]
  ref = (
    logits
    - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True))
    - logits.max(-1, keepdims=True)
  )
  np.testing.assert_allclose(
    lp["token_logprobs"][1 : len(ids)], [ref[t - 1, ids[t]] for t in range(1, len(ids))], atol=1e-4
  )
  assert out["choices"][0]["text"].startswith("The quick brown fox jumps over the lazy dog")
  assert lp["text_offset"][:3] == [0, 3, 9]  # "The", " quick", " brown"
  st, zero = call(url, body={"prompt": "The quick brown fox", "max_tokens": 0, "echo": True, "logprobs": 0})
  assert st == 200 and zero["choices"][0]["text"] == "The quick brown fox"
  assert zero["usage"]["completion_tokens"] == 0 and len(zero["choices"][0]["logprobs"]["tokens"]) == 4
