"""`python -m train.export_hf`: an export of `python -m train` as a Hugging Face model directory.

    python -m train.export_hf --checkpoint RUN/export/step_N -o DIR [--max_shard_size 5GB] [--overwrite]

DIR gets config.json (model_type "laplace", auto_map for trust_remote_code), model.safetensors (or shards of at
most --max_shard_size with model.safetensors.index.json), generation_config.json, GPT-2's tokenizer files and
the PyTorch code (configuration_laplace.py, modeling_laplace.py), so that

    AutoModelForCausalLM.from_pretrained(DIR, trust_remote_code=True)

loads it. The tensors are read one JAX leaf at a time from the Orbax export and written one layer's tensor at a
time: host memory follows the largest leaf, never the model (laplace-3b: 5.27 GiB for 11.28 GiB of params,
docs/BENCHMARKS.md). Layout: docs/HUGGING_FACE.md. The
directory is written under a temporary name and renamed when complete; an existing DIR is refused unless
--overwrite.
"""

from __future__ import annotations

import argparse
import re
import shutil
import sys
import tempfile
from pathlib import Path

from laplace_jax import cli  # loads no JAX
from train import hf


def build_parser() -> argparse.ArgumentParser:
  ap = cli.FlagParser(
    prog="python -m train.export_hf",
    description=__doc__,
    formatter_class=argparse.RawDescriptionHelpFormatter,
  )
  ap.add_argument("--checkpoint", required=True, help="an exported params directory (RUN/export/step_N)")
  ap.add_argument("-o", "--out", required=True, help="the Hugging Face model directory to write")
  ap.add_argument(
    "--max_shard_size",
    default="5GB",
    help="most bytes of tensor data per safetensors file, e.g. 5GB, 500MB, 2GiB (default 5GB, as transformers)",
  )
  ap.add_argument("--overwrite", action="store_true", help="replace DIR if it exists")
  return ap


def parse_size(text: str) -> int:
  """'5GB' -> 5e9, '2GiB' -> 2·2³⁰, '1000' -> 1000 bytes."""
  m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(i?)B?\s*", text, re.IGNORECASE)
  if not m:
    raise ValueError(f"--max_shard_size {text!r}: expected a size such as 5GB, 500MB or 2GiB.")
  base = 1024 if m.group(3) else 1000
  n = float(m.group(1)) * base ** " KMGT".index(m.group(2).upper() or " ")
  if n < 1:
    raise ValueError(f"--max_shard_size {text!r}: expected at least one byte.")
  return int(n)


def _orbax_leaves(params_dir: Path):
  """A reader of one leaf of an Orbax params tree as a host numpy array (a partial restore: nothing else is
  read), and the checkpointer to close after."""
  import numpy as np
  import orbax.checkpoint as ocp

  ckptr = ocp.PyTreeCheckpointer()

  def nest(path, value):
    for key in reversed(path):
      value = {key: value}
    return value

  def read(leaf: tuple[str, ...]) -> np.ndarray:
    restored = ckptr.restore(
      params_dir,
      args=ocp.args.PyTreeRestore(
        item=nest(leaf, 0),
        restore_args=nest(leaf, ocp.RestoreArgs(restore_type=np.ndarray)),
        partial_restore=True,
      ),
    )
    for key in leaf:
      restored = restored[key]
    return restored

  return read, ckptr


def export(
  checkpoint: str | Path, out: str | Path, *, max_shard_bytes: int = hf.DEFAULT_SHARD_BYTES, overwrite=False
):
  """Writes the Hugging Face directory `out` of the export `checkpoint`; returns its path."""
  import jax

  from laplace_jax import model
  from laplace_jax.training import checkpoint as ckpt

  src, out = Path(checkpoint).absolute(), Path(out).absolute()
  if out.exists():
    if not overwrite:
      raise FileExistsError(f"{out} already exists. Pick a new directory, or pass --overwrite to replace it.")
    hf.check_replaceable(out, "config.json")
  cfg = ckpt.export_config(src)
  hf.check_exportable(cfg)
  table = hf.tensor_table(cfg)
  dtype = jax.numpy.dtype(cfg.param_dtype)
  expect = jax.eval_shape(lambda: model.init_params(cfg, jax.random.key(0)))
  read_leaf, ckptr = _orbax_leaves(src / "params")

  def checked_leaf(leaf):
    x = read_leaf(leaf)
    want = expect
    for key in leaf:
      want = want[key]
    if x.shape != want.shape or x.dtype != dtype:
      raise ValueError(
        f"{src}: params leaf {'.'.join(leaf)} is {x.dtype}{list(x.shape)}, expected {dtype}{list(want.shape)} "
        f"for its saved config. The export does not match its own config; export it again from its run."
      )
    return x

  out.parent.mkdir(parents=True, exist_ok=True)
  tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
  try:
    shards = hf.plan_shards(table, dtype, max_shard_bytes)
    names = hf.shard_names(len(shards))
    tensors = hf.leaf_reader(checked_leaf, table)
    total = sum(hf.write_safetensors(tmp / name, specs, dtype, tensors) for name, specs in zip(names, shards))
    if len(shards) > 1:
      weight_map = {s.name: name for name, specs in zip(names, shards) for s in specs}
      hf.write_json(tmp / hf.INDEX_FILE, {"metadata": {"total_size": total}, "weight_map": weight_map})
    hf.write_json(tmp / "config.json", hf.config_json(cfg))
    hf.write_json(tmp / "generation_config.json", hf.generation_config_json(cfg))
    hf.write_tokenizer(tmp, cfg.max_seq_len)
    for code in sorted(hf.HF_FILES.glob("*.py")):
      shutil.copyfile(code, tmp / code.name)
    hf.publish(tmp, out)
  finally:
    ckptr.close()
    shutil.rmtree(tmp, ignore_errors=True)
  return out


def main(argv=None) -> int:
  args = build_parser().parse_args(argv)
  try:
    max_bytes = parse_size(args.max_shard_size)
    out = export(args.checkpoint, args.out, max_shard_bytes=max_bytes, overwrite=args.overwrite)
  except (ValueError, FileExistsError, FileNotFoundError) as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  files = sorted(p.name for p in out.iterdir())
  print(f"wrote {out}: {', '.join(files)}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
