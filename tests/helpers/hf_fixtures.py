"""What the Hugging Face tests share (tests/programs/train/test_hf_export.py, tests/programs/train/test_hf_transformers.py): an export of a
random-init model as `python -m train` writes one, and a comparison of two exports' params and configs."""

import jax
import numpy as np

from laplace_jax import model
from laplace_jax.model.config import get_config
from laplace_jax.training import checkpoint

# Leaves that start as ones or zeros: moved off them, so that a misplaced one (a tier's norm weight on the
# wrong heads, say) changes the outputs.
CONSTANT_AT_INIT = {
  "ln1_scale",
  "ln2_scale",
  "final_norm_scale",
  "head_norm_scale",
  "aug_balance",
  "conv_bias",
}


def make_export(path, seed: int = 0, **overrides):
  """An export (params + config) of the tiny preset with `overrides`, weights from `seed` (the leaves that
  start constant drawn at random too); its path, params."""
  cfg = get_config("tiny", **overrides)
  params = jax.tree.map(np.asarray, model.init_params(cfg, jax.random.key(seed)))
  rng = np.random.default_rng(seed)
  params = jax.tree_util.tree_map_with_path(
    lambda p, x: (x + rng.normal(0, 0.3, x.shape)).astype(x.dtype) if p[-1].key in CONSTANT_AT_INIT else x,
    params,
  )
  checkpoint.export_params(params, path, config=cfg)
  return path, params


def assert_same_export(a, b):
  """The two exports hold the same config and the same params, bit for bit, dtypes included."""
  assert checkpoint.export_config(a) == checkpoint.export_config(b)
  pa, pb = checkpoint.load_params(a), checkpoint.load_params(b)
  assert jax.tree.structure(pa) == jax.tree.structure(pb)
  for (path, x), y in zip(jax.tree_util.tree_leaves_with_path(pa), jax.tree.leaves(pb)):
    assert x.dtype == y.dtype and x.shape == y.shape, path
    assert np.array_equal(x.view(np.uint8), y.view(np.uint8)), path
