"""`python -m train.eval --by_position`: loss per position bucket, each document one stream from a zero state,
against a whole-document forward bucketed independently; `train.prepare --corpus kjv-books`."""

import json

import jax
import numpy as np
import pytest

from laplace_jax import model
from laplace_jax.model.config import get_config
from laplace_jax.training import checkpoint
from train import eval as train_eval
from train.prepare import kjv_documents, write_token_dataset

CFG = get_config("tiny", vocab_size=128, chunk_size=16, max_seq_len=64)
EOS = 127


@pytest.fixture(scope="module")
def export(tmp_path_factory):
  root = tmp_path_factory.mktemp("bypos")
  rng = np.random.default_rng(0)
  docs = [rng.integers(0, 127, n) for n in (5, 40, 100)]
  write_token_dataset(
    root,
    [(d, "val") for d in docs] + [(docs[0], "train")],
    sources=[],
    vocab_size=128,
    eos_id=EOS,
    tokenizer="synthetic",
  )
  params = model.init_params(CFG, jax.random.key(0))
  checkpoint.export_params(params, root / "export", config=CFG)
  return root, root / "export", params, docs


def test_buckets_equal_a_whole_document_forward(export, tmp_path):
  data_dir, path, params, docs = export
  out = tmp_path / "bypos.json"
  assert (
    train_eval.main(
      [
        "--by_position",
        "--checkpoint",
        str(path),
        "--data_dir",
        str(data_dir),
        "--segment",
        "16",
        "--json",
        str(out),
      ]
    )
    == 0
  )
  res = json.loads(out.read_text())
  ce_sum, n = {}, {}
  for d in docs:  # reference: one forward over the whole document + EOS, positions bucketed by hand
    s = np.concatenate([d, [EOS]]).astype(np.int32)
    logits = np.asarray(model.forward(params, s[None, :-1], cfg=CFG), np.float64)[0]
    lse = np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1)) + logits.max(-1)
    ce = lse - logits[np.arange(len(s) - 1), s[1:]]
    for p, c in enumerate(ce):
      lo = 0 if p < 2 else 2 ** int(np.log2(p))
      ce_sum[lo], n[lo] = ce_sum.get(lo, 0.0) + c, n.get(lo, 0) + 1
  assert res["longest_document"] == 100 and res["documents"] == 3 and res["tokens"] == 5 + 40 + 100
  got = {b["position_lo"]: (b["loss"], b["tokens"]) for b in res["buckets"]}
  assert sorted(got) == [0, 2, 4, 8, 16, 32, 64]
  for lo in got:
    assert got[lo][1] == n[lo]
    np.testing.assert_allclose(got[lo][0], ce_sum[lo] / n[lo], rtol=1e-5)
  assert (tmp_path / "bypos.png").exists()


def test_reset_every_scores_each_window_on_its_own(export):
  data_dir, path, params, docs = export
  res = train_eval.loss_by_position(path, data_dir, segment=16, reset_every=32)
  ce_sum, n = {}, {}
  for d in docs:  # reference: each 32-token window of the stream its own forward from a zero state
    s = np.concatenate([d, [EOS]]).astype(np.int32)
    for a in range(0, len(s) - 1, 32):
      w = s[a : a + 33]
      logits = np.asarray(model.forward(params, w[None, :-1], cfg=CFG), np.float64)[0]
      lse = np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1)) + logits.max(-1)
      for i, c in enumerate(lse - logits[np.arange(len(w) - 1), w[1:]]):
        p = a + i
        lo = 0 if p < 2 else 2 ** int(np.log2(p))
        ce_sum[lo], n[lo] = ce_sum.get(lo, 0.0) + c, n.get(lo, 0) + 1
  got = {b["position_lo"]: b["loss"] for b in res["buckets"] if b["tokens"]}
  assert res["reset_every"] == 32 and sorted(got) == sorted(ce_sum)
  for lo in got:
    np.testing.assert_allclose(got[lo], ce_sum[lo] / n[lo], rtol=1e-5)
  whole = train_eval.loss_by_position(path, data_dir, segment=16)  # positions past 32 lose their context
  assert abs(whole["buckets"][6]["loss"] - res["buckets"][6]["loss"]) > 1e-4


def test_refusals(export):
  data_dir, path, _, _ = export
  with pytest.raises(ValueError, match="multiple of the chunk"):
    train_eval.loss_by_position(path, data_dir, segment=24)
  with pytest.raises(ValueError, match="--reset_every 24: expected 0 .* multiple of --segment 16"):
    train_eval.loss_by_position(path, data_dir, segment=16, reset_every=24)


def test_kjv_books_are_whole_books():
  chapters, books = kjv_documents(), kjv_documents("book")
  assert len(books) == 66 and books[0].startswith("Genesis 1\n") and "\nGenesis 50\n" in books[0]
  assert sum(len(b) for b in books) == sum(len(c) for c in chapters) + len(chapters) - 66
