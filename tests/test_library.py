"""The library's path from an export to text (laplace_jax.generate.complete, save_state / load_state), and
README's python blocks run as written."""

import dataclasses
import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from laplace_jax import checkpoint, generate, model, tokenizer
from laplace_jax.config import get_config

ROOT = Path(__file__).resolve().parents[1]
CFG = get_config("tiny")


@pytest.fixture(scope="module")
def params():
  return model.init_params(CFG, jax.random.key(0))


def test_padded_vocabulary_ids_are_never_drawn():
  V, valid = CFG.vocab_size, tokenizer.VOCAB_SIZE
  logits = jnp.zeros((4, V)).at[:, valid:].set(50.0)  # the padded rows would win every draw
  for how in (dict(temperature=0.0, top_k=0), dict(temperature=1.0, top_k=0), dict(temperature=1.0, top_k=5)):
    for top_p in (1.0, 0.5):
      ids = generate.sample_logits(logits, jax.random.key(1), valid_vocab=valid, top_p=top_p, **how)
      assert int(ids.max()) < valid, (how, top_p)


def test_top_p_keeps_the_smallest_set_reaching_p():
  probs = np.array([[0.5, 0.3, 0.15, 0.05]])
  draws = {
    int(generate.sample_logits(jnp.log(probs), k, temperature=1.0, top_k=0, valid_vocab=4, top_p=0.7)[0])
    for k in jax.random.split(jax.random.key(0), 64)
  }
  assert draws == {0, 1}  # 0.5 < 0.7 <= 0.5 + 0.3


def test_saved_state_continues_as_one_uninterrupted_sequence(params, tmp_path):
  first = generate.complete(params, CFG, "In the beginning", 6, stop_ids=())
  assert first.stop == "length" and len(first.ids) == 6
  generate.save_state(tmp_path / "s.npz", first.state, CFG)
  state = generate.load_state(tmp_path / "s.npz", CFG)
  more = generate.complete(params, CFG, " And", 5, state=state, stop_ids=())
  whole = tokenizer.encode("In the beginning") + first.ids + tokenizer.encode(" And")
  assert more.ids == generate.complete(params, CFG, whole, 5, stop_ids=()).ids
  with pytest.raises(ValueError, match="another model"):
    generate.load_state(tmp_path / "s.npz", dataclasses.replace(CFG, d_ff=256))


def test_stops_at_a_stop_id(params):
  greedy = generate.complete(params, CFG, [1, 2, 3], 4, stop_ids=())
  cut = generate.complete(params, CFG, [1, 2, 3], 4, stop_ids=(greedy.ids[2],))
  assert cut.stop == "stop" and cut.ids == greedy.ids[:2] and cut.text == tokenizer.decode(greedy.ids[:2])
  with pytest.raises(ValueError, match="prompt is empty"):
    generate.complete(params, CFG, "", 4)


def test_readme_python_blocks_run_as_written(params, tmp_path, monkeypatch, capsys):
  blocks = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), re.S)
  assert len(blocks) == 2 and "load_export" in blocks[0] and "save_state" in blocks[0]
  export = tmp_path / "runs" / "demo" / "export" / "step_120"  # the path README names, relative to its cwd
  checkpoint.export_params(params, export, config=dataclasses.asdict(CFG))
  monkeypatch.chdir(tmp_path)
  for block in blocks:
    exec(compile(block, "README.md", "exec"), {})
  assert (tmp_path / "said.npz").exists() and capsys.readouterr().out.strip()
