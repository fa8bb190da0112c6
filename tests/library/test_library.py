"""The library's path from an export to text (laplace_jax.inference.generate.complete, save_state / load_state), and
README's python blocks run as written."""

import dataclasses
import re

import helpers
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from laplace_jax import model
from laplace_jax.data import tokenizer
from laplace_jax.inference import generate
from laplace_jax.model.config import get_config
from laplace_jax.training import checkpoint

ROOT = helpers.ROOT
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


def test_old_module_paths_are_deprecated_aliases():
  """The paths README and users held before the library was split into tiers still import, with a
  DeprecationWarning naming the new home, and give the same functions."""
  import importlib
  import sys

  import pytest

  from laplace_jax.data import tokenizer
  from laplace_jax.inference import generate
  from laplace_jax.model import config, state
  from laplace_jax.ops import gla
  from laplace_jax.training import checkpoint, muon

  moved = {
    "gla": (gla, "chunk_simple_gla"),
    "config": (config, "get_config"),
    "generate": (generate, "complete"),
  }
  moved |= {"checkpoint": (checkpoint, "load_export"), "tokenizer": (tokenizer, "encode")}
  moved |= {"muon": (muon, "muon"), "state": (state, "DecodeState")}
  for old, (new, name) in moved.items():
    sys.modules.pop(f"laplace_jax.{old}", None)
    with pytest.warns(DeprecationWarning, match=f"laplace_jax.{old} moved to {new.__name__}"):
      alias = importlib.import_module(f"laplace_jax.{old}")
    assert getattr(alias, name) is getattr(new, name)
