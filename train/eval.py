"""`python -m train.eval`: held-out loss, perplexity and bits per byte of an exported checkpoint.

    python -m train.eval --checkpoint RUN/export/step_N --data_dir DIR [--split val] [--json FILE]
                         [--seq_len T] [--global_batch B] [--mesh_data D --mesh_fsdp F] [--simulate_devices N]
                         [--max_batches N] [--preset NAME]

The split is packed exactly as the training loop's held-out eval packs it (documents in stored order,
EOS-joined, cut into (T+1)-token windows, B windows per batch), and the same compiled loss (token-weighted
cross-entropy) runs over it, so with --max_batches equal to the run's --eval_batches it reports the loop's
held-out loss. Without --max_batches it covers the whole split: the last, partial batch is padded and its
padding weighted 0. Bits per byte = Σ loss / ln 2 over the UTF-8 bytes of the scored tokens' text (EOS
separators excluded; GPT-2 data only). The model's config is the one saved with the export; --preset
checks it against a preset and refuses a checkpoint of another config. Documents are scored apart, each as if
alone in its window (segment ids, as a run trains by default; --no_segment_ids reads a window as one stream, as
a run trained with --no_segment_ids evaluates), and the loss is also split by whether a token's document is
the first of its window or a later one (`loss_first_document`, `loss_later_documents`).

    python -m train.eval --by_position --checkpoint RUN/export/step_N --data_dir DIR [--json F] [--png F]

Loss by position instead: every document of the split scored as one stream from a zero state (its tokens
then EOS, walked in segments through the explicit state, so any length fits in constant memory), the loss of
predicting the token after position p pooled into buckets [0, 2), [2, 4), [4, 8), … up to the longest
document; printed, in the JSON and as a PNG. GLA-only models (an attention layer would need the whole
document's KV cache). `python -m train.prepare --corpus kjv-books` keeps whole books as documents.
"""

# What loads JAX is imported inside the functions, once the flags are read: --simulate_devices must come before
# anything could start a JAX backend, and --help answers without loading JAX.

from __future__ import annotations

import argparse
import functools
import json
import math
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

from laplace_jax import cli  # loads no JAX

if TYPE_CHECKING:
  from laplace_jax.data.batch import Batch


def build_parser() -> argparse.ArgumentParser:
  ap = cli.FlagParser(
    prog="python -m train.eval", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
  )
  ap.add_argument("--checkpoint", required=True, help="an exported params directory (RUN/export/step_N)")
  ap.add_argument("--data_dir", required=True, help="prepared data (python -m train.prepare)")
  ap.add_argument("--split", default="val", help="split to evaluate (default: val)")
  ap.add_argument("--json", help="also write the result to this file (never overwritten)")
  ap.add_argument("--seq_len", type=int, default=0, help="tokens per window (0: the model's max_seq_len)")
  ap.add_argument("--global_batch", type=int, default=8, help="windows per batch, over all devices")
  ap.add_argument(
    "--max_batches", type=int, default=0, help="only the first N full batches (0: the whole split)"
  )
  ap.add_argument("--mesh_data", type=int, default=1, help="data-parallel axis size of the device mesh")
  ap.add_argument("--mesh_fsdp", type=int, default=0, help="0: all devices left after mesh_data")
  ap.add_argument("--simulate_devices", type=int, default=0, help="CPU only: simulate this many devices")
  ap.add_argument("--preset", help="refuse the checkpoint unless its config is this preset's")
  ap.add_argument(
    "--segment_ids",
    action=cli.Toggle,
    default=True,
    help="score each document of a window as if alone (--no_segment_ids: a window is one stream)",
  )
  ap.add_argument(
    "--by_position",
    action="store_true",
    help="held-out loss per position bucket (powers of two), one stream per document",
  )
  ap.add_argument(
    "--png", help="--by_position: the plot's file (default: beside --json, else by_position.png)"
  )
  ap.add_argument(
    "--reset_every",
    type=int,
    default=0,
    help="--by_position: zero the state every N tokens (a multiple of --segment), so no position "
    "sees more than N tokens back: the same positions with a bounded context (0: never)",
  )
  ap.add_argument(
    "--segment",
    type=int,
    default=1024,
    help="--by_position: tokens per forward call through the explicit state",
  )
  return ap


class SplitBatch(NamedTuple):
  """A held-out batch and which of its inputs' documents are their window's first (the loss split by
  document order)."""

  batch: Batch  # weights: 1 where scored (padding: 0); segment_ids only with --segment_ids
  first_document: Any  # bool [B, T]: the input's document is its window's first (no start before it)


def split_batches(
  data_dir, split: str, *, seq_len: int, global_batch: int, max_batches: int, segment_ids: bool = True
) -> tuple[list[SplitBatch], dict]:
  """(batches, manifest): the loop's held-out packing; with max_batches 0 the tail too, as a padded batch with
  zero weights. The batches are built with their inputs' document ids (laplace_jax/data/pipeline.py's convention;
  padding: −1), dropped again without `segment_ids` once the split by document order is taken from them."""
  import numpy as np

  from laplace_jax.data import pipeline as data
  from laplace_jax.data.batch import Batch

  manifest = data.load_manifest(data_dir)
  if split not in manifest["splits"]:
    raise ValueError(
      f"--split {split!r}: {data_dir} has no such split (it has {sorted(manifest['splits'])}). "
      "Prepare held-out data with `python -m train.prepare ... --val_fraction F`, or pass "
      "--split with one of those."
    )
  if max_batches:
    full = data.make_eval_batches(
      data_dir,
      seq_len=seq_len,
      global_batch_size=global_batch,
      split=split,
      max_batches=max_batches,
      process_index=0,
      process_count=1,
      segment_ids=True,
    )
    batches = [b.replace(weights=np.ones(b.targets.shape, np.float32)) for b in full]
  else:
    docs = data.split_documents(data_dir, manifest, split)
    tokens, ids = data.joined_documents(docs, int(manifest["eos_id"]))
    width = seq_len + 1
    n_windows = -(-len(tokens) // width)
    n_batches = -(-n_windows // global_batch)
    total = n_batches * global_batch * width
    padded, seg = np.zeros(total, np.int32), np.full(total, -1, np.int32)
    padded[: len(tokens)], seg[: len(tokens)] = tokens, ids
    valid = np.zeros(total, bool)
    valid[: len(tokens)] = True
    x, s = padded.reshape(n_batches, global_batch, width), seg.reshape(n_batches, global_batch, width)
    v = valid.reshape(n_batches, global_batch, width)
    batches = [
      Batch(
        inputs=x[i, :, :-1],
        targets=x[i, :, 1:],
        weights=v[i, :, 1:].astype(np.float32),
        segment_ids=s[i, :, :-1],
      )
      for i in range(n_batches)
    ]
  # the scored token's document is its window's first (no start before it) or a later one
  seg_ids = [np.asarray(b.segment_ids) for b in batches]
  return [
    SplitBatch(batch=b if segment_ids else b.replace(segment_ids=None), first_document=d == d[:, :1])
    for b, d in zip(batches, seg_ids)
  ], manifest


def loss_by_position(checkpoint, data_dir, *, split="val", preset=None, segment=1024, reset_every=0) -> dict:
  """Loss per position bucket over the split's documents, each one stream (tokens + EOS) from a zero state;
  with `reset_every` N the state is zeroed every N tokens, so no position sees more than N tokens back (the
  context a model trained at N without state passing had): the same positions' loss with a bounded context."""
  import jax
  import jax.numpy as jnp
  import numpy as np

  from laplace_jax import model
  from laplace_jax.data import pipeline as data
  from laplace_jax.training import checkpoint as ckpt

  path = Path(checkpoint)
  cfg = ckpt.export_config(path, preset=preset)
  if set("AS") & set(cfg.mixers):  # the training carry holds no KV cache or window rings
    raise ValueError(
      f"--by_position: the model has attention layers (mixers={cfg.mixers!r}); scoring "
      "book-length streams in constant memory needs a GLA-only model. Use the plain eval."
    )
  if segment < 1 or segment % min(cfg.chunk_size, segment):
    raise ValueError(f"--segment {segment}: expected a positive multiple of the chunk size {cfg.chunk_size}")
  if reset_every < 0 or (reset_every and reset_every % segment):
    raise ValueError(
      f"--reset_every {reset_every}: expected 0 (never) or a multiple of --segment {segment}; "
      f"e.g. --segment {min(segment, reset_every) if reset_every > 0 else segment} "
      f"--reset_every {reset_every}"
    )
  manifest = data.load_manifest(data_dir)
  data.check_vocab(manifest, cfg.vocab_size)
  docs = data.split_documents(data_dir, manifest, split)
  params = ckpt.load_params(path, config=cfg)

  @jax.jit
  def seg_ce(p, carry, x, y):
    logits, carry = model.forward_carry(p, x, carry, cfg=cfg)
    lse = jax.nn.logsumexp(logits, -1)
    return (lse - jnp.take_along_axis(logits, y[..., None], -1)[..., 0])[0], carry

  streams = [np.concatenate([docs[i].astype(np.int32), [int(manifest["eos_id"])]]) for i in range(len(docs))]
  longest = max(len(s) - 1 for s in streams)
  n_buckets = max(1, int(np.ceil(np.log2(max(longest, 2)))))
  ce_sum, count = np.zeros(n_buckets), np.zeros(n_buckets, np.int64)
  for s in streams:
    n = len(s) - 1  # positions 0..n-1 each predict the next token
    padded = np.zeros(-(-n // segment) * segment + 1, np.int32)
    padded[: len(s)] = s
    carry = model.init_carry(cfg, 1)
    pieces = []
    for a in range(0, n, segment):  # the zero padding sits after the last real token: causal, never read
      if reset_every and a and a % reset_every == 0:
        carry = model.init_carry(cfg, 1)
      c, carry = seg_ce(params, carry, padded[None, a : a + segment], padded[None, a + 1 : a + segment + 1])
      pieces.append(np.asarray(c, np.float64))
    ce = np.concatenate(pieces)[:n]
    bucket = np.maximum(np.floor(np.log2(np.maximum(np.arange(n), 1))).astype(int), 0)
    np.add.at(ce_sum, bucket, ce)
    np.add.at(count, bucket, 1)
  buckets = [
    {
      "position_lo": 0 if k == 0 else 2**k,
      "position_hi": 2 ** (k + 1),
      "loss": ce_sum[k] / count[k] if count[k] else None,
      "tokens": int(count[k]),
    }
    for k in range(n_buckets)
  ]
  return {
    "checkpoint": str(path),
    "data_dir": str(data_dir),
    "split": split,
    "documents": len(streams),
    "longest_document": longest,
    "tokens": int(count.sum()),
    "loss": float(ce_sum.sum() / count.sum()),
    "buckets": buckets,
    "mixers": cfg.mixers,
    "segment": segment,
    "reset_every": reset_every,
  }


def plot_by_position(res: dict, png) -> None:
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  b = [x for x in res["buckets"] if x["tokens"]]
  fig, ax = plt.subplots(figsize=(6.5, 4))
  ax.plot([x["position_hi"] for x in b], [x["loss"] for x in b], "o-")
  ax.set_xscale("log", base=2)
  ax.set_xlabel("position in the document (bucket's upper end)")
  ax.set_ylabel("held-out loss (nats/token)")
  ax.set_title(
    f"{Path(res['checkpoint']).parent.parent.name}: {res['documents']} documents, "
    f"longest {res['longest_document']:,} tokens",
    fontsize=9,
  )
  ax.grid(alpha=0.3)
  fig.tight_layout()
  fig.savefig(png, dpi=100)
  plt.close(fig)


def evaluate(
  checkpoint,
  data_dir,
  *,
  split="val",
  seq_len=0,
  global_batch=8,
  max_batches=0,
  mesh_data=1,
  mesh_fsdp=0,
  preset=None,
  segment_ids=True,
) -> dict:
  import jax
  import numpy as np

  from laplace_jax import sharding
  from laplace_jax.data import pipeline as data
  from laplace_jax.training import checkpoint as ckpt
  from laplace_jax.training import train_step as ts
  from train.hooks import flat_key

  path = Path(checkpoint)
  mesh = sharding.make_mesh(data=mesh_data, fsdp=mesh_fsdp or None)
  params, cfg = ckpt.load_export(
    path, lambda abstract: sharding.param_shardings(abstract, mesh), preset=preset
  )
  seq_len = seq_len or cfg.max_seq_len
  if global_batch % mesh.devices.size:
    raise ValueError(
      f"--global_batch {global_batch} does not split over the mesh's {mesh.devices.size} "
      f"devices; use a multiple of {mesh.devices.size}."
    )
  batches, manifest = split_batches(
    data_dir,
    split,
    seq_len=seq_len,
    global_batch=global_batch,
    max_batches=max_batches,
    segment_ids=segment_ids,
  )
  data.check_vocab(manifest, cfg.vocab_size)
  shards = jax.tree.map(lambda a: a.sharding, params)
  abstract = ts.abstract_batch(global_batch, seq_len, mesh, weighted=True, segmented=segment_ids)
  batch_sh = jax.tree.map(lambda s: s.sharding, abstract)

  fn = _split_sums(cfg, *flat_key(shards), *flat_key(batch_sh))
  ce = tok = 0.0
  n_bytes = 0
  by_order = {True: [0.0, 0.0], False: [0.0, 0.0]}  # first document of its window or not: [Σ ce, Σ tokens]
  byte_len = _byte_counter(manifest)
  with jax.set_mesh(mesh):
    for b, first_document in batches:
      first = jax.device_put(first_document, batch_sh.inputs)
      for sums, aux in zip(by_order.values(), fn(params, jax.device_put(b, batch_sh), first)):
        sums[0], sums[1] = sums[0] + float(aux.ce), sums[1] + float(aux.tokens)
      if byte_len:
        n_bytes += byte_len(b.targets[np.asarray(b.weights) > 0])
  ce, tok = by_order[True][0] + by_order[False][0], by_order[True][1] + by_order[False][1]
  loss = ce / max(tok, 1.0)
  order_loss = {k: s[0] / s[1] if s[1] else None for k, s in by_order.items()}
  return {
    "checkpoint": str(path),
    "data_dir": str(data_dir),
    "split": split,
    "tokens": int(tok),
    "loss": loss,
    "perplexity": math.exp(loss),
    "bytes": n_bytes or None,
    "bits_per_byte": ce / math.log(2) / n_bytes if n_bytes else None,
    "seq_len": seq_len,
    "global_batch": global_batch,
    "batches": len(batches),
    "mixers": cfg.mixers,
    "mesh": dict(mesh.shape),
    "segment_ids": segment_ids,
    "loss_first_document": order_loss[True],
    "loss_later_documents": order_loss[False],
    "tokens_later_documents": int(by_order[False][1]),
  }


@functools.lru_cache(maxsize=8)  # one jitted loss per model and layout: later calls reuse the executable
def _split_sums(cfg, shards: tuple, shards_def, batch_sh: tuple, batch_def):
  import jax

  from laplace_jax.training import train_step as ts

  def split_sums(p, b, first):  # one forward (the two losses differ only in their weights), two sums
    return [ts.loss_sums(p, b.replace(weights=b.weights * (first == f)), cfg=cfg)[1] for f in (True, False)]

  batch = jax.tree.unflatten(batch_def, batch_sh)
  return jax.jit(split_sums, in_shardings=(jax.tree.unflatten(shards_def, shards), batch, batch.inputs))


def _byte_counter(manifest):
  """ids -> UTF-8 bytes of their text (EOS excluded), for GPT-2 data; None for other tokenizers."""
  from laplace_jax.data import tokenizer

  if manifest.get("tokenizer") != tokenizer.TOKENIZER_NAME:
    return None
  enc = tokenizer.get_tokenizer()
  eos = int(manifest["eos_id"])
  return lambda ids: len(enc.decode_bytes([int(i) for i in ids if i != eos]))


def main(argv=None) -> int:
  args = build_parser().parse_args(argv)
  if args.simulate_devices:
    import jax

    from laplace_jax import platform

    platform.simulate_cpu_devices(args.simulate_devices)
    jax.config.update("jax_platforms", "cpu")
  if args.json and Path(args.json).exists():
    print(
      f"error: --json {args.json} exists; results are never overwritten, pick a new file.", file=sys.stderr
    )
    return 2
  if args.by_position:
    try:
      res = loss_by_position(
        args.checkpoint,
        args.data_dir,
        split=args.split,
        preset=args.preset,
        segment=args.segment,
        reset_every=args.reset_every,
      )
    except (ValueError, FileNotFoundError) as e:
      print(f"error: {e}", file=sys.stderr)
      return 2
    for b in res["buckets"]:
      if b["tokens"]:
        print(
          f"positions [{b['position_lo']:>6}, {b['position_hi']:>6}): loss {b['loss']:.4f} "
          f"({b['tokens']:,} tokens)"
        )
    png = args.png or (str(Path(args.json).with_suffix(".png")) if args.json else "by_position.png")
    plot_by_position(res, png)
    res["png"] = png
    print(json.dumps(res))
    if args.json:
      Path(args.json).write_text(json.dumps(res, indent=1))
    return 0
  try:
    res = evaluate(
      args.checkpoint,
      args.data_dir,
      split=args.split,
      seq_len=args.seq_len,
      global_batch=args.global_batch,
      max_batches=args.max_batches,
      mesh_data=args.mesh_data,
      mesh_fsdp=args.mesh_fsdp,
      preset=args.preset,
      segment_ids=args.segment_ids,
    )
  except (ValueError, FileNotFoundError) as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  print(
    f"{res['split']}: {res['tokens']:,} tokens, loss {res['loss']:.4f} nats/token, perplexity "
    f"{res['perplexity']:.2f}" + (f", {res['bits_per_byte']:.4f} bits/byte" if res["bits_per_byte"] else "")
  )
  print(json.dumps(res))
  if args.json:
    Path(args.json).write_text(json.dumps(res, indent=1))
  return 0


if __name__ == "__main__":
  sys.exit(main())
