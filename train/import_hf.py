"""`python -m train.import_hf`: a Hugging Face Laplace model directory as an export of `python -m train`.

    python -m train.import_hf DIR -o OUT [--overwrite]

DIR: one written by `python -m train.export_hf`, or saved by transformers from its LaplaceForCausalLM
(`save_pretrained`). OUT is an export as `python -m train` writes RUN/export/step_N (`OUT/params`, Orbax, and
`OUT/config/metadata`), which `python -m serve --checkpoint OUT`, `python -m train.eval --checkpoint OUT` and
`laplace_jax.training.checkpoint.load_export` take; export then import gives the same bits and config. config.json must
describe the architecture (every field docs/HUGGING_FACE.md lists) and the tensors must be exactly those it
implies, of one float dtype (the params' dtype); anything else is refused with the field or tensor named.
Host memory: the model once (each tensor read from its file, then placed into its stacked leaf).
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
import tempfile
from pathlib import Path

from laplace_jax import cli  # loads no JAX
from train import hf


def build_parser() -> argparse.ArgumentParser:
  ap = cli.FlagParser(
    prog="python -m train.import_hf",
    description=__doc__,
    formatter_class=argparse.RawDescriptionHelpFormatter,
  )
  ap.add_argument("directory", help="the Hugging Face model directory to read")
  ap.add_argument("-o", "--out", required=True, help="the export directory to write (as RUN/export/step_N)")
  ap.add_argument("--overwrite", action="store_true", help="replace OUT if it is an existing export")
  return ap


def read_directory(directory: str | Path):
  """(params as a nested dict of host arrays in the JAX layout, LaplaceConfig) of a Hugging Face directory;
  HFDirectoryError naming what does not fit."""
  import jax
  import numpy as np

  from laplace_jax import model

  src = Path(directory).absolute()
  config_path = src / "config.json"
  if not config_path.exists():
    raise hf.HFDirectoryError(f"{src} has no config.json: not a Hugging Face model directory.")
  try:
    config = json.loads(config_path.read_text())
  except ValueError as e:
    raise hf.HFDirectoryError(f"{config_path} is not JSON ({e}).") from e
  cfg = hf.config_from_json(config, str(config_path))
  table = hf.tensor_table(cfg)
  files = hf.open_tensors(src)
  dtype = hf.check_tensors(files, table, str(src))
  dtype_name = hf.DTYPE_NAMES[hf.dtype_name(dtype)]
  if dtype_name != cfg.param_dtype:  # e.g. saved by transformers after model.to(torch.bfloat16)
    print(
      f"note: the tensors are {dtype_name}, config.json's param_dtype {cfg.param_dtype}: using {dtype_name}"
    )
    cfg = cfg.replace(param_dtype=dtype_name)
  expect = jax.eval_shape(lambda: model.init_params(cfg, jax.random.key(0)))
  by_leaf: dict[tuple[str, ...], list[hf.TensorSpec]] = {}
  for spec in table:
    by_leaf.setdefault(spec.leaf, []).append(spec)
  params: dict = {}
  for leaf, specs in by_leaf.items():
    want = expect
    for key in leaf:
      want = want[key]
    x = np.empty(want.shape, dtype)
    for spec in specs:
      y = hf.from_hf(files[spec.name].tensor(spec.name), spec.layout)
      if spec.layer is None:
        x[...] = y
      else:
        x[spec.layer] = y
    node = params
    for key in leaf[:-1]:
      node = node.setdefault(key, {})
    node[leaf[-1]] = jax.device_put(x)  # as python -m train exports them: jax.Arrays
    del x
  return params, cfg


def import_directory(directory: str | Path, out: str | Path, *, overwrite: bool = False) -> Path:
  """Writes the export `out` of the Hugging Face directory `directory`; returns its path."""
  import jax

  from laplace_jax.training import checkpoint as ckpt

  out = Path(out).absolute()
  if out.exists():
    if not overwrite:
      raise FileExistsError(f"{out} already exists. Pick a new directory, or pass --overwrite to replace it.")
    hf.check_replaceable(out, "params")
  params, cfg = read_directory(directory)
  out.parent.mkdir(parents=True, exist_ok=True)
  tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
  try:
    largest = max(x.nbytes for x in jax.tree.leaves(params))  # one big leaf in flight at a time
    ckpt.export_params(params, tmp / "export", config=cfg, save_concurrent_gb=math.ceil(largest / 1e9))
    hf.publish(tmp / "export", out)
  finally:
    shutil.rmtree(tmp, ignore_errors=True)
  return out


def main(argv=None) -> int:
  args = build_parser().parse_args(argv)
  try:
    out = import_directory(args.directory, args.out, overwrite=args.overwrite)
  except (ValueError, FileExistsError) as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  print(f"wrote {out}: python -m serve --checkpoint {out}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
