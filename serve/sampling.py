"""Per-slot sampling inside the compiled step: greedy, temperature, top-k, top-p, seeded per slot.

Every setting is an array over slots, so no request changes a compiled shape. A slot's random number for
its n-th generated token is uniform(fold_in(key(seed), n)) (Philox of (seed, n) under the rbg PRNGs, see
`slot_uniforms`): the draw depends only on the slot's own seed and position, never on which other requests
share the batch. Sampling is by inverse CDF with that one
uniform, over the exact (renormalised) distribution. top-k / top-p look at the TOPK_CAP most likely
tokens; rows whose kept set does not fit in them find their cut-offs by bisection over the whole
vocabulary instead (32 passes, no sort: a full sort costs ~10x more on a CPU).

Batch-level `lax.cond`s skip the paths no slot needs (an all-greedy batch costs one blocked argmax). Neuron does
not support `cond`, so there (`branch_free`, by default when `platform.backend()` is "neuron") both sides of
each are computed and the same predicate selects: the tokens are the conds' (tests/test_sampling_branch_free.py),
at the cost of the full-vocabulary paths on every step (docs/BENCHMARKS.md, "Sampling without cond").
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from laplace_jax import platform
from serve import philox

F32 = jnp.float32
TOPK_CAP = 64  # candidates examined by the fast top-k / top-p path (a static shape)


def branch_free_default() -> bool:
  """Whether sampling runs without `cond` when not told: on Neuron (jax-neuronx does not support it)."""
  return platform.backend() == "neuron"


def when_any(need_S, f, otherwise, branch_free: bool):
  """`lax.cond(need_S.any(), f, otherwise)`; branch-free, both computed and the same predicate selects (a
  scalar select: the result is the cond's, without skipping f's work)."""
  if branch_free:
    return jax.tree.map(lambda a, b: jnp.where(need_S.any(), a, b), f(), otherwise())
  return jax.lax.cond(need_S.any(), f, otherwise)


def counter_based() -> bool:
  """Whether per-slot draws come from Philox (`slot_uniforms`): under JAX's rbg and unsafe_rbg PRNGs (`--prng`,
  the Neuron default). Read when traced."""
  return platform.current_prng() in ("rbg", "unsafe_rbg")


def slot_uniforms(seed_S, pos_S, seed_hi_S=None):
  """One U[0, 1) draw per slot from (seed, position); a 64-bit seed is (seed_hi << 32) | seed.

  Under the default Threefry PRNG: uniform(fold_in(key(seed), position)), the high seed word folded in first
  only when non-zero (seeds below 2**32 keep their streams). Under rbg / unsafe_rbg (Neuron, which does not
  fully support Threefry): the first word of Philox-4x32-10 with key (seed, seed_hi) and counter (position,
  0, 0, 0), in plain integer arithmetic. Not `rng_bit_generator` per slot: vmapped, it draws every slot's bits
  from the first slot's key (jax 0.10.0), so a slot's draw would depend on its neighbours; and rbg's
  fold_in is still Threefry. The streams differ from Threefry's (docs/NEURON.md)."""
  seed, pos = seed_S.astype(jnp.uint32), pos_S.astype(jnp.uint32)
  hi = jnp.zeros_like(seed) if seed_hi_S is None else seed_hi_S.astype(jnp.uint32)
  if counter_based():
    bits = philox.philox4x32((pos, 0, 0, 0), (seed, hi))[0]
    return jax.lax.bitcast_convert_type((bits >> jnp.uint32(9)) | jnp.uint32(0x3F800000), F32) - 1.0

  def one(seed, pos, hi):
    key = jax.random.key(seed)
    key = jax.lax.cond(hi != 0, lambda: jax.random.fold_in(key, hi), lambda: key)
    return jax.random.uniform(jax.random.fold_in(key, pos), (), F32)

  return jax.vmap(one)(seed, pos, hi)


def _first_max(x):
  """argmax over the last axis (the first maximum) as two plain reductions, a max and then the least index
  holding it: XLA:CPU runs its argmax (a reduce over value-index pairs) far slower than either. A NaN
  counts as a maximum, so the index is always in range."""
  hit = (x == x.max(-1, keepdims=True)) | jnp.isnan(x)
  return jnp.where(hit, jnp.arange(x.shape[-1], dtype=jnp.int32), x.shape[-1]).min(-1)


def argmax_rows(x_SxV, valid: int, block: int = 64):
  """argmax over the first `valid` columns (first maximum). A plain max over contiguous blocks of the raw
  logits, then the first maximum inside the winning block: on a CPU, XLA's argmax (or any reduce fed by a
  fused elementwise op) over [1280, 50304] takes ~150-280 ms, this ~14 ms; elsewhere it is no slower."""
  S, V = x_SxV.shape
  if V % block:
    x_SxV = jnp.pad(x_SxV, ((0, 0), (0, -V % block)), constant_values=-jnp.inf)
  xb = x_SxV.reshape(S, -1, block)
  n_blocks = -(-valid // block)
  col = jnp.arange(block)
  last = jnp.where((n_blocks - 1) * block + col < valid, xb[:, n_blocks - 1], -jnp.inf)
  block_max = xb.max(-1)[:, :n_blocks].at[:, n_blocks - 1].set(last.max(-1))
  b = _first_max(block_max)
  inner = jnp.take_along_axis(xb, b[:, None, None], 1)[:, 0]
  inner = jnp.where(b[:, None] * block + col < valid, inner, -jnp.inf)
  return (b * block + _first_max(inner)).astype(jnp.int32)


def _pick(weights_SxW, u_S):
  """Index of the first cumulative weight above u·total (inverse CDF); argmax where all weights vanish."""
  cdf = jnp.cumsum(weights_SxW, axis=-1)
  above = cdf > (u_S * cdf[:, -1])[:, None]
  return jnp.where(above.any(-1), jnp.argmax(above, -1), jnp.argmax(weights_SxW, -1))


def _filtered(sorted_logits_SxW, sorted_ids_SxW, lse_S, u_S, top_k_S, top_p_S):
  """Sample from candidates sorted by descending logit: keep the top-k, then the top-p nucleus of the
  renormalised top-k distribution (as vLLM and HF do). Returns (token_S, mass_S) where mass is the
  renormalised probability the W candidates hold (< top_p means the nucleus runs past them)."""
  W = sorted_logits_SxW.shape[-1]
  probs = jnp.exp(sorted_logits_SxW - lse_S[:, None])
  rank = jnp.arange(W)[None, :]
  k_on = (top_k_S > 0)[:, None]
  in_k = ~k_on | (rank < top_k_S[:, None])
  z = jnp.where(k_on[:, 0], jnp.sum(jnp.where(in_k, probs, 0.0), -1), 1.0)  # top-k renormaliser
  p = jnp.where(in_k, probs, 0.0) / z[:, None]
  before = jnp.cumsum(p, -1) - p
  keep = in_k & ((before < top_p_S[:, None]) | (rank == 0))
  j = _pick(jnp.where(keep, p, 0.0), u_S)
  return jnp.take_along_axis(sorted_ids_SxW, j[:, None], -1)[:, 0], jnp.sum(p, -1)


def _sortable(x):
  """uint32 keys that order like the float32 values."""
  i = jax.lax.bitcast_convert_type(x, jnp.int32)
  i = jnp.where(i < 0, i ^ jnp.int32(0x7FFFFFFF), i)
  return jax.lax.bitcast_convert_type(i, jnp.uint32) ^ jnp.uint32(0x80000000)


def _cutoff(key_SxV, w_SxV, target_S):
  """Per row, the smallest key t with sum(w[key > t]) < target, by bisection over the 32 key bits."""
  S = key_SxV.shape[0]

  def halve(_, lohi):
    lo, hi = lohi
    mid = lo + (hi - lo) // 2
    ok = jnp.sum(jnp.where(key_SxV > mid[:, None], w_SxV, 0.0), -1) < target_S
    return jnp.where(ok, lo, mid), jnp.where(ok, mid, hi)

  init = (jnp.zeros((S,), jnp.uint32), jnp.full((S,), 0xFFFFFFFF, jnp.uint32))
  return jax.lax.fori_loop(0, 32, halve, init)[1]


def _filtered_full(scaled_SxV, lse_S, u_S, top_k_S, top_p_S):
  """The same rule as `_filtered` over the whole vocabulary: token i is in the top-k when fewer than k
  tokens have a larger logit, in the nucleus when the (renormalised) mass above it is < top_p."""
  S, V = scaled_SxV.shape
  key = _sortable(scaled_SxV)
  probs = jnp.exp(scaled_SxV - lse_S[:, None])
  k_cut = _cutoff(key, jnp.ones_like(probs), jnp.where(top_k_S > 0, top_k_S, V + 1).astype(F32))
  in_k = key >= k_cut[:, None]
  p = jnp.where(in_k, probs, 0.0)
  p = p / jnp.sum(p, -1, keepdims=True)
  keep = in_k & (key >= _cutoff(key, p, top_p_S)[:, None])
  return _pick(jnp.where(keep, p, 0.0), u_S)


def sample(
  logits_SxV,
  temperature_S,
  top_k_S,
  top_p_S,
  seed_S,
  pos_S,
  *,
  valid_vocab: int,
  seed_hi_S=None,
  branch_free: bool | None = None,
):
  """Next token per slot. temperature 0 → greedy; top_k 0 → off; top_p 1 → off. Ids >= valid_vocab
  (the model's padded vocabulary rows) are never produced. branch_free: no `cond` (None: on Neuron only)."""
  if branch_free is None:
    branch_free = branch_free_default()
  greedy = argmax_rows(logits_SxV.astype(F32), valid_vocab)
  hot = temperature_S > 0

  def sampled():
    logits = logits_SxV[:, :valid_vocab].astype(F32)  # the model's padded vocabulary rows are never drawn
    S, V = logits.shape
    top_k = jnp.where(top_k_S >= V, 0, top_k_S)
    filt = hot & ((top_k > 0) | (top_p_S < 1.0))
    plain = hot & ~filt
    cap = min(TOPK_CAP, V)
    scaled = logits / jnp.where(hot, temperature_S, 1.0)[:, None]
    u = slot_uniforms(seed_S, pos_S, seed_hi_S)

    def full_dist():
      return _pick(jax.nn.softmax(scaled, -1), u).astype(jnp.int32)

    def filtered():
      lse = jax.nn.logsumexp(scaled, -1)
      vals, ids = jax.lax.top_k(scaled, cap)
      tok_cap, mass = _filtered(vals, ids, lse, u, top_k, top_p_S)
      # The capped pass is exact when the top-k set lies inside the cap, or (top-k off) the nucleus
      # closes in it; other rows bisect over the whole vocabulary.
      need_full = filt & ~jnp.where(top_k > 0, top_k <= cap, mass >= top_p_S)
      tok_full = when_any(
        need_full,
        lambda: _filtered_full(scaled, lse, u, top_k, top_p_S).astype(jnp.int32),
        lambda: greedy,
        branch_free,
      )
      return jnp.where(need_full, tok_full, tok_cap).astype(jnp.int32)

    tok_plain = when_any(plain, full_dist, lambda: greedy, branch_free)
    tok_filt = when_any(filt, filtered, lambda: greedy, branch_free)
    return jnp.where(filt, tok_filt, jnp.where(plain, tok_plain, greedy)).astype(jnp.int32)

  # Batch-level conds skip the work no slot needs (an all-greedy batch costs one blocked argmax); each
  # row's result depends on its own row alone, whichever branches run.
  return when_any(hot, sampled, lambda: greedy, branch_free)


TOP_LOGPROBS = 5  # the most `logprobs` a request may ask for (OpenAI's bound)


def logprobs(logits_SxV, tok_S, *, valid_vocab: int):
  """log-softmax of the raw logits over the valid vocabulary: (the chosen token's [S], the top
  TOP_LOGPROBS values [S, N] and ids [S, N]). Temperature and filters do not change them."""
  lg = logits_SxV[:, :valid_vocab].astype(F32)
  lse = jax.nn.logsumexp(lg, -1)
  chosen = jnp.take_along_axis(lg, tok_S[:, None].astype(jnp.int32), -1)[:, 0] - lse
  vals, ids = jax.lax.top_k(lg, TOP_LOGPROBS)
  return chosen, vals - lse[:, None], ids.astype(jnp.int32)
