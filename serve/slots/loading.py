"""What the server loads at start: the GPT-2 tokenizer, the params (Orbax export or random init), the mesh."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp

from laplace_jax import model, sharding
from laplace_jax.data import tokenizer as gpt2
from laplace_jax.model.config import get_config
from laplace_jax.training import checkpoint as ckpt
from serve.slots.dtypes import PARAMS_DTYPES


@dataclasses.dataclass(frozen=True)
class Tokenizer:
  """The two things serving needs from a tokenizer."""

  encode: Callable[[str], list]
  token_bytes: Callable[[Sequence[int]], bytes]
  vocab_size: int
  eos_id: int


def gpt2_tokenizer() -> Tokenizer:
  enc = gpt2.get_tokenizer()
  return Tokenizer(
    encode=enc.encode_ordinary,
    token_bytes=lambda ids: enc.decode_bytes(list(ids)),
    vocab_size=gpt2.VOCAB_SIZE,
    eos_id=gpt2.EOS_ID,
  )


def make_serving_mesh(n_devices: int | None):
  """A mesh whose devices split the slots (params replicated); None keeps everything on one device."""
  if not n_devices or n_devices == 1:
    return None
  if n_devices > len(jax.devices()):
    raise ValueError(
      f"--mesh_devices={n_devices} but only {len(jax.devices())} {jax.default_backend()} devices "
      "are present. Use fewer."
    )
  return sharding.make_mesh(data=1, fsdp=n_devices)


def cast_params(params, cfg, how: str = PARAMS_DTYPES[0]):
  """Serve the weights in the compute dtype ("compute": half the bytes read per step for bf16 presets,
  and no per-step casts) or as stored ("param")."""
  if how not in PARAMS_DTYPES:
    raise ValueError(f"params dtype {how!r}: expected one of {PARAMS_DTYPES}.")
  if how == "param":
    return params
  dt = jnp.dtype(cfg.compute_dtype)
  return jax.tree.map(lambda x: x.astype(dt) if jnp.issubdtype(x.dtype, jnp.floating) else x, params)


def load_model(
  *,
  checkpoint: str | None = None,
  preset: str | None = None,
  seed: int = 0,
  mesh=None,
  dtype: str = PARAMS_DTYPES[0],
):
  """(params, config): an export of `python -m train` built from the config saved with it (`preset`, if
  given, must match it), else `preset`'s model with random weights from `seed`; replicated over `mesh` if
  given; cast as `cast_params` says."""
  if mesh is None:
    target: jax.sharding.Sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  else:
    target = sharding.replicated(mesh)
  if checkpoint:
    params, cfg = ckpt.load_export(checkpoint, target, preset=preset)
    return cast_params(params, cfg, dtype), cfg
  if preset is None:
    raise ValueError("random weights need a model: pass --preset NAME with --random_init.")
  cfg = get_config(preset)
  init = jax.jit(model.init_params, static_argnums=0, out_shardings=target)
  return cast_params(init(cfg, jax.random.key(seed)), cfg, dtype), cfg
