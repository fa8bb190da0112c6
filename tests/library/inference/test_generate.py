"""laplace_jax.inference.generate: batched greedy generation and greedy next tokens at positions agree with one prompt's."""

import jax
import numpy as np

from laplace_jax import model
from laplace_jax.inference import generate
from laplace_jax.model.config import get_config


def test_batched_and_positional_greedy_match_one_prompt_generation():
  cfg = get_config("tiny", vocab_size=8192).replace(mixers="GS", window=8, max_seq_len=64, chunk_size=16)
  params = model.init_params(cfg, jax.random.key(0))
  prompts = np.asarray(jax.random.randint(jax.random.key(1), (3, 20), 0, cfg.vocab_size))
  got = generate.generate_batch(params, prompts, 4, cfg=cfg)
  assert got.shape == (3, 4)
  for r in range(3):
    assert got[r].tolist() == generate.generate(params, prompts[r].tolist(), 4, cfg=cfg, temperature=0.0)
  nxt = generate.greedy_next(params, prompts, np.array([[5, 19]] * 3), cfg=cfg)  # one forward, no state
  assert nxt[:, 1].tolist() == got[:, 0].tolist()
  assert nxt[1, 0] == generate.generate(params, prompts[1, :6].tolist(), 1, cfg=cfg, temperature=0.0)[0]
