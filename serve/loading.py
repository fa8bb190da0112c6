"""What the server loads at start: the GPT-2 tokenizer, the params (Orbax export or random init), the mesh."""
from __future__ import annotations

import dataclasses
from typing import Callable, Sequence

import jax
import jax.numpy as jnp

from laplace_jax import model, sharding
from laplace_jax import tokenizer as gpt2


@dataclasses.dataclass(frozen=True)
class Tokenizer:
  """The two things serving needs from a tokenizer."""
  encode: Callable[[str], list]
  token_bytes: Callable[[Sequence[int]], bytes]
  vocab_size: int
  eos_id: int


def gpt2_tokenizer() -> Tokenizer:
  enc = gpt2.get_tokenizer()
  return Tokenizer(encode=enc.encode_ordinary, token_bytes=lambda ids: enc.decode_bytes(list(ids)),
                   vocab_size=gpt2.VOCAB_SIZE, eos_id=gpt2.EOS_ID)


def make_serving_mesh(n_devices: int | None):
  """A mesh whose devices split the slots (params replicated); None keeps everything on one device."""
  if not n_devices or n_devices == 1:
    return None
  if n_devices > len(jax.devices()):
    raise ValueError(f"--mesh-devices={n_devices} but only {len(jax.devices())} {jax.default_backend()} devices "
                     "are present. Use fewer.")
  return sharding.make_mesh(data=1, fsdp=n_devices)


def cast_params(params, cfg, how: str = "compute"):
  """Serve the weights in the compute dtype ("compute": half the bytes read per step for bf16 presets,
  and no per-step casts) or as stored ("param")."""
  if how not in ("compute", "param"):
    raise ValueError(f"params dtype {how!r}: expected 'compute' or 'param'.")
  if how == "param":
    return params
  dt = jnp.dtype(cfg.compute_dtype)
  return jax.tree.map(lambda x: x.astype(dt) if jnp.issubdtype(x.dtype, jnp.floating) else x, params)


def load_params(cfg, *, checkpoint: str | None, seed: int = 0, mesh=None, dtype: str = "compute"):
  """Params from an `export_params` directory (checked against cfg), else random init from `seed`;
  replicated over `mesh` if given; cast as `cast_params` says."""
  if mesh is None:
    target = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  else:
    target = sharding.replicated(mesh)
  if checkpoint:
    from laplace_jax import checkpoint as ckpt
    abstract = jax.eval_shape(lambda: model.init_params(cfg, jax.random.key(0)))
    abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=target), abstract)
    return cast_params(ckpt.load_params(checkpoint, abstract, config=cfg), cfg, dtype)
  init = jax.jit(model.init_params, static_argnums=0, out_shardings=target)
  return cast_params(init(cfg, jax.random.key(seed)), cfg, dtype)
