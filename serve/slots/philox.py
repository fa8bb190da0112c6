"""Philox-4x32-R (Salmon, Moraes, Dror, Shaw: "Parallel random numbers: as easy as 1, 2, 3", SC11), a
counter-based generator: the output is a pure function of (counter, key), computed with 32-bit integer
multiplies, xors and shifts, elementwise over arrays. serve/slots/sampling.py draws each slot's number from it under
the rbg PRNGs, where no Threefry may run (Neuron) and `rng_bit_generator` cannot draw one stream per slot.
Checked against Random123's known-answer vectors (tests/programs/serve/slots/test_sampling_prng.py).
"""

from __future__ import annotations

import jax.numpy as jnp

_PHILOX_M = (0xD2511F53, 0xCD9E8D57)  # Philox-4x32's multipliers and key increments (Salmon et al., SC11)
_PHILOX_W = (0x9E3779B9, 0xBB67AE85)


def _mulhilo(a, m: int):
  """(high, low) 32-bit words of the 64-bit product a·m of uint32 arrays, in 32-bit arithmetic (no x64)."""
  u32 = lambda v: jnp.uint32(v)
  a_lo, a_hi = a & u32(0xFFFF), a >> u32(16)
  m_lo, m_hi = u32(m & 0xFFFF), u32(m >> 16)
  ll, lh, hl, hh = a_lo * m_lo, a_lo * m_hi, a_hi * m_lo, a_hi * m_hi
  mid = (ll >> u32(16)) + (lh & u32(0xFFFF)) + (hl & u32(0xFFFF))
  return hh + (lh >> u32(16)) + (hl >> u32(16)) + (mid >> u32(16)), a * u32(m)


def philox4x32(counter, key, rounds: int = 10):
  """Philox-4x32-R (Random123) on uint32 arrays: counter a 4-tuple, key a 2-tuple, broadcast together.
  Integer multiplies, xors and shifts only: no PRNG primitive."""
  c0, c1, c2, c3 = (jnp.asarray(c, jnp.uint32) for c in counter)
  k0, k1 = (jnp.asarray(k, jnp.uint32) for k in key)
  for r in range(rounds):
    if r:
      k0, k1 = k0 + jnp.uint32(_PHILOX_W[0]), k1 + jnp.uint32(_PHILOX_W[1])
    hi0, lo0 = _mulhilo(c0, _PHILOX_M[0])
    hi1, lo1 = _mulhilo(c2, _PHILOX_M[1])
    c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
  return c0, c1, c2, c3
