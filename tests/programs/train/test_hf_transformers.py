"""The exported directory through transformers (needs the `hf` extra: torch, transformers), on the CPU in fp32:
`AutoModelForCausalLM.from_pretrained(DIR, trust_remote_code=True)` gives the logits of laplace_jax's
`model.forward` over a 600-token prompt, greedy `generate` the tokens of the explicit-state decode
(laplace_jax/inference/generate.py) one token per step, left-padded rows those of each row alone, and
`save_pretrained` a directory that imports back to the same export."""

import numpy as np
import pytest
from helpers.hf_fixtures import assert_same_export, make_export

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from laplace_jax import model  # noqa: E402
from laplace_jax.data import tokenizer  # noqa: E402
from laplace_jax.inference import generate  # noqa: E402
from laplace_jax.training import checkpoint  # noqa: E402
from train import export_hf, import_hf  # noqa: E402


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
  """(export path, JAX params, config, the HF model loaded from its exported directory)."""
  root = tmp_path_factory.mktemp("hf_torch")
  # lm_head scaled up: greedy decoding of random weights then has clear winners, not fp32 near-ties.
  src, _ = make_export(root / "export", seed=3, init_std=0.1)
  out = export_hf.export(src, root / "hf")
  params, cfg = checkpoint.load_export(src)
  hf_model = transformers.AutoModelForCausalLM.from_pretrained(
    str(out), trust_remote_code=True, dtype=torch.float32
  )
  return src, out, params, cfg, hf_model.eval()


def _logits(hf_model, ids, **kw):
  with torch.no_grad():
    return hf_model(torch.as_tensor(ids), **kw)


def test_logits_equal_jax_forward_over_600_tokens(exported):
  _, _, params, cfg, hf_model = exported
  ids = np.random.default_rng(0).integers(0, tokenizer.VOCAB_SIZE, (2, 600))
  want = np.asarray(model.forward(params, ids, cfg=cfg))
  got = _logits(hf_model, ids).logits.numpy()
  assert got.shape == want.shape == (2, 600, cfg.vocab_size)
  assert np.abs(got - want).max() <= 1e-4 * np.abs(want).max()


def test_a_prompt_in_pieces_continues_the_state(exported):
  """Any lengths (not multiples of 128): 250 + 1 + 349 tokens through the cache = the 600 at once."""
  _, _, _, _, hf_model = exported
  ids = np.random.default_rng(1).integers(0, tokenizer.VOCAB_SIZE, (1, 600))
  whole = _logits(hf_model, ids).logits[0].numpy()
  out = _logits(hf_model, ids[:, :250])
  cache = out.past_key_values
  parts = [out.logits[0]]
  for piece in (ids[:, 250:251], ids[:, 251:]):
    out = _logits(hf_model, piece, past_key_values=cache)
    parts.append(out.logits[0])
  assert cache.seen == 600 and cache.gla[0].shape == (1, 4, 8, 16)
  np.testing.assert_allclose(torch.cat(parts).numpy(), whole, atol=1e-5 * np.abs(whole).max())


def test_greedy_generate_equals_the_explicit_state_decode_one_token_per_step(exported):
  _, _, params, cfg, hf_model = exported
  prompt = np.random.default_rng(2).integers(0, tokenizer.VOCAB_SIZE, 150).tolist()
  want = generate.generate(params, prompt, 64, cfg=cfg, temperature=0.0, valid_vocab=tokenizer.VOCAB_SIZE)
  lengths = []
  hook = hf_model.model.register_forward_pre_hook(
    lambda mod, args, kw: lengths.append(kw["input_ids"].shape[1]), with_kwargs=True
  )
  try:
    got = hf_model.generate(torch.tensor([prompt]), max_new_tokens=64, do_sample=False)
  finally:
    hook.remove()
  assert got[0, len(prompt) :].tolist() == want and len(want) == 64
  assert lengths == [150] + [1] * 63  # the prompt once, then one token per step from the state


def test_left_padded_rows_equal_each_row_alone(exported):
  _, _, _, _, hf_model = exported
  rng = np.random.default_rng(4)
  short, long = rng.integers(0, 50257, 20).tolist(), rng.integers(0, 50257, 33).tolist()
  pad = tokenizer.EOS_ID
  ids = torch.tensor([[pad] * 13 + short, long])
  mask = torch.tensor([[0] * 13 + [1] * 20, [1] * 33])
  got = hf_model.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False)
  for row, prompt in enumerate((short, long)):
    alone = hf_model.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False)
    assert got[row, 33:].tolist() == alone[0, len(prompt) :].tolist()
  with pytest.raises(ValueError, match="left padding only"):
    _logits(hf_model, ids.flip(1), attention_mask=mask.flip(1))


def test_save_pretrained_imports_back_to_the_same_export(exported, tmp_path):
  src, _, _, _, hf_model = exported
  hf_model.save_pretrained(tmp_path / "saved")
  assert_same_export(src, import_hf.import_directory(tmp_path / "saved", tmp_path / "back"))


def test_auto_tokenizer_is_gpt2s_bpe(exported):
  _, out, _, _, _ = exported
  tok = transformers.AutoTokenizer.from_pretrained(str(out), trust_remote_code=True)
  assert type(tok).__name__ == "GPT2Tokenizer"
  text = "And God said, Let there be light: and there was light.\n\n  Hello world"
  assert tok("Hello world")["input_ids"] == [15496, 995]
  assert tok(text)["input_ids"] == tokenizer.encode(text)
  assert tok.eos_token_id == tokenizer.EOS_ID


def test_beam_search_reorders_the_state(exported):
  """Beams carried in the state (reordered each step) = beams recomputed from their whole prefixes."""
  _, _, _, _, hf_model = exported
  ids = torch.tensor([np.random.default_rng(5).integers(0, tokenizer.VOCAB_SIZE, 12).tolist()])
  kw = dict(max_new_tokens=10, num_beams=4, early_stopping=False)
  assert torch.equal(hf_model.generate(ids, **kw), hf_model.generate(ids, use_cache=False, **kw))
