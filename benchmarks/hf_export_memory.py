"""Peak host memory of `python -m train.export_hf` (and optionally `train.import_hf`) on random weights.

    python -m benchmarks hf_export_memory --preset laplace-3b --work /tmp/hfmem [--dtype float32]
    python -m benchmarks hf_export_memory --preset small --work /tmp/hfsmall --round_trip

Writes an export of random weights (N(0, 0.02²) everywhere, in the preset's shapes) as `python -m train` lays
one out, each leaf drawn into a file-backed array (np.memmap) so that making a 12 GB export needs no 12 GB of
memory; then runs the export (and with --round_trip the import, then compares the two exports leaf by leaf,
bit for bit) as child processes under `/usr/bin/time -v`, and prints each one's peak RSS and wall time beside
the model's bytes and its largest leaf's.
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np

from laplace_jax import model
from laplace_jax.model.config import get_config
from laplace_jax.training import checkpoint


def random_export(path: Path, cfg, scratch: Path, seed: int = 0) -> dict:
  """An export of random weights in cfg's shapes; leaves drawn into memmaps under `scratch`."""
  abstract = jax.eval_shape(lambda: model.init_params(cfg, jax.random.key(0)))
  rng = np.random.default_rng(seed)
  scratch.mkdir(parents=True, exist_ok=True)

  def leaf(p, a):
    name = ".".join(str(k.key) for k in p)
    mm = np.lib.format.open_memmap(scratch / f"{name}.npy", "w+", a.dtype, a.shape)
    rows = mm.reshape(a.shape[0], -1)
    step = max(1, 2**24 // rows.shape[1])  # ~16M values drawn at a time
    for i in range(0, rows.shape[0], step):
      block = rows[i : i + step]
      block[...] = (rng.standard_normal(block.shape, np.float32) * np.float32(0.02)).astype(a.dtype)
    mm.flush()
    return np.asarray(mm)

  params = jax.tree_util.tree_map_with_path(leaf, abstract)
  largest = max(a.nbytes for a in jax.tree.leaves(params))
  checkpoint.export_params(params, path, config=cfg, save_concurrent_gb=-(-largest // 10**9))
  return jax.tree.map(lambda a: a.nbytes, params)


def timed(cmd: list[str]) -> tuple[float, float]:
  """(peak RSS in GiB, wall seconds) of a child process, read from /usr/bin/time -v."""
  t0 = time.perf_counter()
  out = subprocess.run(["/usr/bin/time", "-v", *cmd], capture_output=True, text=True)
  wall = time.perf_counter() - t0
  if out.returncode:
    sys.exit(f"{' '.join(cmd)} failed:\n{out.stdout}\n{out.stderr}")
  m = re.search(r"Maximum resident set size \(kbytes\): (\d+)", out.stderr)
  assert m, out.stderr
  return int(m.group(1)) / 2**20, wall


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--preset", default="laplace-3b")
  ap.add_argument("--dtype", default="float32", help="param_dtype of the random export")
  ap.add_argument("--work", required=True, help="a scratch directory (removed first)")
  ap.add_argument("--round_trip", action="store_true", help="also import back and compare bit for bit")
  args = ap.parse_args()
  work = Path(args.work)
  shutil.rmtree(work, ignore_errors=True)
  cfg = get_config(args.preset, param_dtype=args.dtype)
  t0 = time.perf_counter()
  sizes = random_export(work / "export", cfg, work / "scratch")
  shutil.rmtree(work / "scratch")
  total, largest = sum(jax.tree.leaves(sizes)), max(jax.tree.leaves(sizes))
  print(
    f"{args.preset} {args.dtype}: {total / 2**30:.2f} GiB of params, largest leaf {largest / 2**30:.2f} GiB"
  )
  print(f"random export written in {time.perf_counter() - t0:.0f} s")
  py = sys.executable
  rss, wall = timed(
    [py, "-m", "train.export_hf", "--checkpoint", str(work / "export"), "-o", str(work / "hf")]
  )
  files = sorted(p.name for p in (work / "hf").glob("*.safetensors"))
  print(f"export_hf: peak RSS {rss:.2f} GiB, {wall:.0f} s; {len(files)} safetensors file(s)")
  if args.round_trip:
    rss, wall = timed([py, "-m", "train.import_hf", str(work / "hf"), "-o", str(work / "back")])
    print(f"import_hf: peak RSS {rss:.2f} GiB, {wall:.0f} s")
    a, b = checkpoint.load_params(work / "export"), checkpoint.load_params(work / "back")
    same = jax.tree.map(
      lambda x, y: x.dtype == y.dtype and np.array_equal(x.view(np.uint8), y.view(np.uint8)), a, b
    )
    cfg_same = checkpoint.export_config(work / "export") == checkpoint.export_config(work / "back")
    print(f"round trip bit-identical: {all(jax.tree.leaves(same)) and cfg_same}")


if __name__ == "__main__":
  main()
