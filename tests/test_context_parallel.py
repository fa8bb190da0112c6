"""The chunked GLA over a sequence split across devices (laplace_jax/context_parallel.py) equals the unsplit
chunked GLA: outputs, final state and gradients, with segment starts inside a span, at a span's first token and
nowhere, and with an initial state. 4 simulated devices on a `context` axis."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from laplace_jax import gla
from laplace_jax.context_parallel import chunk_simple_gla_context

B, T, H, K, V, N_DEV = 2, 64, 3, 8, 5, 4


def _inputs():
  rng = np.random.default_rng(0)
  q, k, v = (jnp.asarray(rng.normal(size=(B, T, H, d)), jnp.float32) for d in (K, K, V))
  s0 = jnp.asarray(rng.normal(size=(B, H, K, V)), jnp.float32)
  reset = np.zeros((B, T), bool)
  reset[0, [5, 16, 17, 40]] = True  # inside a span, at span 1's first token and the next, inside span 2
  return q, k, v, s0, jnp.asarray(reset)


def test_split_sequence_equals_the_unsplit_gla(form="parallel"):
  """(Each span's own work is gla.chunk_simple_gla in either form; the combination is form-independent.)"""
  q, k, v, s0, reset = _inputs()
  g = jnp.log(jnp.asarray([0.5, 0.9, 0.999]))
  mesh = jax.sharding.Mesh(np.asarray(jax.devices()[:N_DEV]), ("context",))
  seq = P(None, "context")

  @jax.jit
  @functools.partial(
    jax.shard_map, mesh=mesh, in_specs=(seq, seq, seq, P(), seq), out_specs=(seq, P()), check_vma=False
  )
  def split(q, k, v, s0, reset):
    return chunk_simple_gla_context(
      q, k, v, g, axis_name="context", initial_state=s0, reset=reset, chunk_size=8, form=form
    )

  whole = jax.jit(
    lambda q, k, v, s0, r: gla.chunk_simple_gla(
      q, k, v, g, initial_state=s0, reset=r, chunk_size=8, form=form
    )
  )
  o, s = split(q, k, v, s0, reset)
  want_o, want_s = whole(q, k, v, s0, reset)
  np.testing.assert_allclose(o, want_o, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(s, want_s, rtol=1e-5, atol=1e-5)

  w_o = jnp.asarray(np.random.default_rng(1).normal(size=(B, T, H, V)), jnp.float32)
  loss = lambda f: (
    lambda q, k, v, s0: jnp.sum(f(q, k, v, s0, reset)[0] * w_o) + jnp.sum(f(q, k, v, s0, reset)[1])
  )
  got = jax.jit(jax.grad(loss(split), argnums=(0, 1, 2, 3)))(q, k, v, s0)
  want = jax.jit(jax.grad(loss(whole), argnums=(0, 1, 2, 3)))(q, k, v, s0)
  for a, b in zip(got, want):
    assert float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b)) < 1e-5
