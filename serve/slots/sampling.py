"""Per-slot sampling inside the compiled step: greedy, temperature, top-k, top-p, seeded per slot.

Every setting is an array over slots, so no request changes a compiled shape. A slot's random numbers for its
n-th generated token are uniforms of (seed, n) alone (`slot_uniforms`: Threefry's fold_in, or Philox under
the rbg PRNGs), never of which other requests share the batch.

One rule in every path: weights exp((x - max) / t) over the valid ids; top-k keeps the tokens with fewer
than k strictly larger logits (a tie at the k-th place is kept whole), the nucleus the kept tokens whose
top-k-renormalised mass of strictly larger logits is < top_p (the largest always). The token is a draw from
exactly that distribution (up to fp32 rounding of the weights), by these paths:
- temperature alone: inverse CDF with the slot's first uniform, in two levels: the masses of blocks of
  BLOCK ids (one pass over the logits), then the cumulative masses inside the chosen block.
- top-p without top-k: rejection. CANDIDATES tokens are drawn that way (a uniform each); the token is the
  first whose mass above is < top_p · total (a pass over the logits per candidate tested, run only while
  some slot still needs it). Each candidate lies in the nucleus with probability the nucleus's mass,
  >= top_p, and the first that does is a draw from the nucleus distribution; a row whose candidates all miss
  (probability at most (1 - top_p)^CANDIDATES) takes the bisection with a uniform of its own, so the mixture
  is exactly the nucleus distribution.
- top-k <= TOPK_CAP, with or without top-p: the rule among the TOPK_CAP + 1 largest logits (found in the
  blocks with the largest maxima), exact unless a tie at the k-th place reaches past them.
- the bisection (top-k > TOPK_CAP, such ties, candidates all outside the nucleus): the cut-offs by
  bisection over the logits' 32 key bits (32 passes each, nothing of the vocabulary's size kept), then the
  two-level draw. Rarely needed, so rarely run.

Batch-level `lax.cond`s skip the work no slot needs: an all-greedy batch costs one blocked argmax, and a later
candidate's test or the bisection runs on the few rows that need it, gathered (FEW_ROWS). The engine samples
only its live slots' rows (serve.slots.slot_functions.step_rows), so a few sampling requests are a batch of a few rows. Neuron does not support
`cond`, so there (`branch_free`, by default when `platform.backend()` is "neuron") both sides of each are
computed over every row and the same predicate selects: the tokens are the conds' (tests/test_sampling_*.py),
at the cost of every path on every step, the bisection's ~70 passes over the logits included
(docs/BENCHMARKS.md, "Decisions"). What sampling costs against greedy decoding on a CPU:
docs/BENCHMARKS.md, "What sampling costs".
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from laplace_jax import platform
from serve.slots import philox

F32 = jnp.float32
TOPK_CAP = 64  # the largest top_k the capped path serves (from TOPK_CAP + 1 candidates: a static shape)
BLOCK = 64  # columns per block of the blocked reductions and of the two-level inverse CDF
CANDIDATES = 4  # tokens drawn per top-p row before the bisection fallback (one more uniform for that)
FEW_ROWS = 8  # a later candidate's test or the bisection needed by at most this many rows runs on those alone
CHUNK_BYTES = 1 << 21  # about the logits one step of a pass over the vocabulary reads (they stay in cache)


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


def slot_uniforms(seed_S, pos_S, seed_hi_S=None, n: int | None = None):
  """U[0, 1) draws per slot from (seed, position): [S], or with n, [S, n] whose first column is the [S] draw;
  a 64-bit seed is (seed_hi << 32) | seed.

  Under the default Threefry PRNG: uniform(fold_in(key(seed), position)), the high seed word folded in first
  only when non-zero (seeds below 2**32 keep their streams); draw i > 0 is uniform(fold_in(that position's
  key, i)). Under rbg / unsafe_rbg (Neuron, which does not fully support Threefry): draw i is word i % 4 of
  Philox-4x32-10 with key (seed, seed_hi) and counter (position, i // 4, 0, 0), in plain integer arithmetic.
  Not `rng_bit_generator` per slot: vmapped, it draws every slot's bits from the first slot's key (jax
  0.10.0), so a slot's draw would depend on its neighbours; and rbg's fold_in is still Threefry. The streams
  differ from Threefry's (docs/NEURON.md)."""
  seed, pos = seed_S.astype(jnp.uint32), pos_S.astype(jnp.uint32)
  hi = jnp.zeros_like(seed) if seed_hi_S is None else seed_hi_S.astype(jnp.uint32)
  cols = 1 if n is None else n
  if counter_based():
    words = []
    for c in range(-(-cols // 4)):
      words += philox.philox4x32((pos, c, 0, 0), (seed, hi))
    bits = jnp.stack(words[:cols], -1)
    u = jax.lax.bitcast_convert_type((bits >> jnp.uint32(9)) | jnp.uint32(0x3F800000), F32) - 1.0
  else:

    def one(seed, pos, hi):
      key = jax.random.key(seed)
      key = jax.lax.cond(hi != 0, lambda: jax.random.fold_in(key, hi), lambda: key)
      key = jax.random.fold_in(key, pos)
      more = [jax.random.uniform(jax.random.fold_in(key, i), (), F32) for i in range(1, cols)]
      return jnp.stack([jax.random.uniform(key, (), F32), *more])

    u = jax.vmap(one)(seed, pos, hi)
  return u[:, 0] if n is None else u


def _first_max(x):
  """argmax over the last axis (the first maximum) as two plain reductions, a max and then the least index
  holding it: XLA:CPU runs its argmax (a reduce over value-index pairs) far slower than either. A NaN
  counts as a maximum, so the index is always in range."""
  hit = (x == x.max(-1, keepdims=True)) | jnp.isnan(x)
  return jnp.where(hit, jnp.arange(x.shape[-1], dtype=jnp.int32), x.shape[-1]).min(-1)


def _blocked(x_SxY, valid: int):
  """x as [S, n, BLOCK] blocks of columns (the last padded with -inf) and each of the first ceil(valid /
  BLOCK) blocks' max over its valid columns [S, n_valid_blocks]."""
  S, Y = x_SxY.shape
  if Y % BLOCK:
    x_SxY = jnp.pad(x_SxY, ((0, 0), (0, -Y % BLOCK)), constant_values=-jnp.inf)
  xb = x_SxY.reshape(S, -1, BLOCK)
  n_blocks = -(-valid // BLOCK)
  col = jnp.arange(BLOCK)
  last = jnp.where((n_blocks - 1) * BLOCK + col < valid, xb[:, n_blocks - 1], -jnp.inf)
  return xb, xb.max(-1)[:, :n_blocks].at[:, n_blocks - 1].set(last.max(-1))


def _argmax_blocked(xb, block_max, valid: int):
  """The first maximum over the valid columns, from `_blocked`'s output: the winning block, then inside it."""
  b = _first_max(block_max)
  inner = jnp.take_along_axis(xb, b[:, None, None], 1)[:, 0]
  inner = jnp.where(b[:, None] * BLOCK + jnp.arange(BLOCK) < valid, inner, -jnp.inf)
  return (b * BLOCK + _first_max(inner)).astype(jnp.int32)


def masked(x_SxY, allowed_SxG):
  """x with the tokens a row's bitmask forbids at -inf: token t is allowed when bit t % 32 of word t // 32
  is set (serve/api/grammar.py's rows); None: x. The bits are unpacked by shifts, elementwise, and XLA fuses the
  select into the passes that read the logits: on a CPU, 64 rows of tiny's vocabulary fed by the LM head's
  matmul sample about as fast with an all-ones mask as with none (docs/BENCHMARKS.md, "Grammar masks"). A
  cond skipping it for free batches costs more (its output copies the logits)."""
  if allowed_SxG is None:
    return x_SxY
  S, Y = x_SxY.shape
  G = allowed_SxG.shape[1]
  if G * 32 < Y:
    raise ValueError(f"allowed_SxG has {G} words a row: {Y} logits need at least {-(-Y // 32)}.")
  bits = (allowed_SxG.astype(jnp.int32)[:, :, None] >> jnp.arange(32, dtype=jnp.int32)) & 1
  return jnp.where(bits.reshape(S, G * 32)[:, :Y] != 0, x_SxY, -jnp.inf)


def argmax_rows(x_SxY, valid: int, allowed_SxG=None, branch_free: bool | None = None):
  """argmax over the first `valid` columns (first maximum), among the tokens `allowed_SxG` allows (int32
  [S, G] bitmask, see `masked`; None: all; all ones: the unmasked path, as in `sample`). A plain max over
  contiguous blocks of the raw logits, then the first maximum inside the winning block: on a CPU, XLA's
  argmax (or any reduce fed by a fused elementwise op) over [1280, 50304] takes ~150-280 ms, this ~14 ms;
  elsewhere it is no slower."""
  if allowed_SxG is not None and not (branch_free_default() if branch_free is None else branch_free):
    return jax.lax.cond(
      (allowed_SxG == -1).all(),
      lambda: argmax_rows(x_SxY, valid, None, True),
      lambda: argmax_rows(x_SxY, valid, allowed_SxG, True),
    )
  xb, block_max = _blocked(masked(x_SxY, allowed_SxG), valid)
  return _argmax_blocked(xb, block_max, valid)


def _last_nonzero(w):
  """Index of the last positive entry along the last axis (0 when none)."""
  return jnp.where(w > 0, jnp.arange(w.shape[-1], dtype=jnp.int32), 0).max(-1)


def _inverse_cdf(w, u_S):
  """Index of the first cumulative weight above u·total (a token of positive weight when the total is),
  over the last axis of the weights w [S, n]."""
  cdf = jnp.cumsum(w, -1)
  j = (cdf <= (u_S * cdf[:, -1])[:, None]).sum(-1)
  return jnp.minimum(j, _last_nonzero(w)).astype(jnp.int32)


def _bcast(v_S, like):
  """A per-row value shaped to broadcast against `like` [S, ...]."""
  return v_S.reshape(v_S.shape + (1,) * (like.ndim - v_S.ndim))


def _weight(x, m_S, r_S):
  """The unnormalised probability exp((x - m) · r) of logits x (m: the row's largest, r: 1 / temperature)."""
  return jnp.exp((x - _bcast(m_S, x)) * _bcast(r_S, x))


def _block_sums(f, xb, valid: int, rows_args):
  """Per row and block of columns holding valid ids, the sum of f(x, args) over its valid columns [S, n]; args
  is a tuple of per-row arrays [S, ...]. f runs unmasked over whole blocks (no per-column select in the long
  pass), and the last block is summed again without its invalid columns (the model's padded vocabulary rows,
  whatever their logits).

  A loop over groups of blocks (the vocabulary axis: the slot axis may be split over devices): XLA:CPU writes
  f(x) out before it reduces it, and a buffer of the vocabulary's size per pass costs more than the pass (a
  fresh allocation on each call, even in a branch not taken); a group's stays in cache. The last group starts
  early enough to end at the last block, recomputing (and rewriting) a few sums of the one before."""
  S, _, B = xb.shape
  n_blocks = -(-valid // B)
  g = min(n_blocks, max(16, CHUNK_BYTES // (S * B * 4)))
  if g == n_blocks:
    sums = f(xb[:, :n_blocks], rows_args).sum(-1)
  else:

    def group(i, out):
      start = jnp.minimum(i * g, n_blocks - g)
      part = f(jax.lax.dynamic_slice_in_dim(xb, start, g, 1), rows_args).sum(-1)
      return jax.lax.dynamic_update_slice_in_dim(out, part, start, 1)

    sums = jax.lax.fori_loop(0, -(-n_blocks // g), group, jnp.zeros((S, n_blocks), F32))
  col = (n_blocks - 1) * B + jnp.arange(B)
  last = jnp.where(col < valid, f(xb[:, n_blocks - 1], rows_args), 0.0)
  return sums.at[:, n_blocks - 1].set(last.sum(-1))


def _total(f, xb, valid: int, rows_args):
  """Per row, the sum of f(x, args) over the valid columns (one pass, see `_block_sums`)."""
  return _block_sums(f, xb, valid, rows_args).sum(-1)


def _draw(xb, weight, rows_args, valid: int, u_SxT):
  """T tokens per row drawn in proportion to weight(x, args) over the valid columns by inverse CDF, in two
  levels: block masses (one pass over the logits), then the cumulative masses inside the chosen block.
  Returns the tokens [S, T], their logits [S, T] and each row's total weight [S]."""
  S = xb.shape[0]
  mass = _block_sums(weight, xb, valid, rows_args)  # [S, n_blocks]
  cum = jnp.cumsum(mass, -1)
  target = u_SxT * cum[:, -1:]  # [S, T]
  b = jnp.minimum((cum[:, None, :] <= target[:, :, None]).sum(-1), _last_nonzero(mass)[:, None])
  rest = target - jnp.where(b > 0, jnp.take_along_axis(cum, jnp.maximum(b - 1, 0), 1), 0.0)
  blk = xb[jnp.arange(S)[:, None], b]  # [S, T, BLOCK]
  w = jnp.where(b[..., None] * BLOCK + jnp.arange(BLOCK) < valid, weight(blk, rows_args), 0.0)
  j = jnp.minimum((jnp.cumsum(w, -1) <= rest[..., None]).sum(-1), _last_nonzero(w))
  return b * BLOCK + j, jnp.take_along_axis(blk, j[..., None], -1)[..., 0], cum[:, -1]


def _probs(x, a):
  """`_weight` with args (m, r)."""
  return _weight(x, a[0], a[1])


def _probs_above(x, a):
  """`_weight` of the logits above y, args (m, r, y)."""
  return jnp.where(x > _bcast(a[2], x), _weight(x, a[0], a[1]), 0.0)


def _capped(x_SxY, xb, block_max, valid: int, m_S, r_S, u_S, top_k_S, top_p_S):
  """Sample among the TOPK_CAP + 1 largest logits: the top-k (the tokens with fewer than k larger logits),
  then its nucleus (those whose top-k-renormalised mass above is < top_p; the largest always).
  Returns (token_S, exact_S): exact when no token outside the candidates can be in the top-k (the last
  candidate has at least k above it). The candidates are the largest of the blocks with the largest maxima."""
  S, Y = x_SxY.shape
  n = min(TOPK_CAP + 1, valid)  # candidates
  if block_max.shape[1] > n:
    _, bid = jax.lax.top_k(block_max, n)  # the n largest logits lie in these blocks
    cid = (bid[..., None] * BLOCK + jnp.arange(BLOCK)).reshape(S, n * BLOCK)
    cand = jnp.where(cid < valid, xb[jnp.arange(S)[:, None], bid].reshape(S, n * BLOCK), -jnp.inf)
    vals, j = jax.lax.top_k(cand, n)
    ids = jnp.take_along_axis(cid, j, -1)
  else:
    vals, ids = jax.lax.top_k(jnp.where(jnp.arange(Y) < valid, x_SxY, -jnp.inf), n)
  e = _weight(vals, m_S, r_S)
  gt = vals[:, None, :] > vals[:, :, None]  # [S, j, i]: candidate i's logit is above candidate j's
  n_above = gt.sum(-1)
  in_k = n_above < top_k_S[:, None]
  ek = jnp.where(in_k, e, 0.0)
  above = jnp.where(gt, ek[:, None, :], 0.0).sum(-1)
  top_p = top_p_S[:, None]
  keep = in_k & ((above < top_p * ek.sum(-1, keepdims=True)) | (n_above == 0) | (top_p >= 1.0))
  j = _inverse_cdf(jnp.where(keep, ek, 0.0), u_S)
  return jnp.take_along_axis(ids, j[:, None], -1)[:, 0].astype(jnp.int32), n_above[:, -1] >= top_k_S


def _sortable(x):
  """uint32 keys that order like the float32 values."""
  i = jax.lax.bitcast_convert_type(x, jnp.int32)
  i = jnp.where(i < 0, i ^ jnp.int32(0x7FFFFFFF), i)
  return jax.lax.bitcast_convert_type(i, jnp.uint32) ^ jnp.uint32(0x80000000)


def _key(x):
  """uint32 keys that order like the float32 values, -0.0 as +0.0 (as float comparisons have it)."""
  return _sortable(jnp.where(x == 0, 0.0, x))


def _cutoff(xb, valid: int, w, rows_args, target_S):
  """Per row, the smallest key t with sum(w(x, args)[key(x) > t]) < target, by bisection over the 32 key
  bits: 32 passes over the logits, the keys recomputed in each (nothing of the vocabulary's size is kept)."""
  S = xb.shape[0]
  above = lambda x, a: jnp.where(_key(x) > _bcast(a[-1], x), w(x, a[:-1]), 0.0)

  def halve(_, lohi):
    lo, hi = lohi
    mid = lo + (hi - lo) // 2
    ok = _total(above, xb, valid, (*rows_args, mid)) < target_S
    return jnp.where(ok, lo, mid), jnp.where(ok, mid, hi)

  init = (jnp.zeros((S,), jnp.uint32), jnp.full((S,), 0xFFFFFFFF, jnp.uint32))
  return jax.lax.fori_loop(0, 32, halve, init)[1]


def _in_top_k(x, a):
  """`_weight` of the logits whose key is at least the top-k cut-off, args (m, r, k_cut)."""
  return jnp.where(_key(x) >= _bcast(a[2], x), _weight(x, a[0], a[1]), 0.0)


def _kept(x, a):
  """`_in_top_k`'s weight of the logits whose key is at least the nucleus cut-off, args (m, r, k_cut, p_cut)."""
  return jnp.where(_key(x) >= _bcast(a[3], x), _in_top_k(x, a[:3]), 0.0)


def _filtered_full(xb, valid: int, m_S, r_S, u_S, top_k_S, top_p_S, branch_free: bool):
  """The same rule as `_capped` over the whole vocabulary, by bisection on the logits' bits: token i is in
  the top-k when fewer than k tokens have a larger logit (a cut-off found only when some row asks for it),
  in the nucleus when the top-k-renormalised mass above it is < top_p. Then one inverse-CDF draw."""
  S = xb.shape[0]
  k_on = top_k_S > 0
  k_cut = when_any(
    k_on,
    lambda: _cutoff(
      xb, valid, lambda x, a: jnp.ones_like(x), (), jnp.where(k_on, top_k_S, valid + 1).astype(F32)
    ),
    lambda: jnp.zeros((S,), jnp.uint32),
    branch_free,
  )
  args = (m_S, r_S, k_cut)
  p_cut = _cutoff(xb, valid, _in_top_k, args, top_p_S * _total(_in_top_k, xb, valid, args))
  p_cut = jnp.where(top_p_S >= 1.0, 0, jnp.minimum(p_cut, _key(m_S)))  # the largest always kept
  return _draw(xb, _kept, (*args, p_cut), valid, u_S[:, None])[0][:, 0].astype(jnp.int32)


def _on_rows(need_S, f, rows_args, otherwise, branch_free: bool):
  """f(*rows_args) for the rows that need it (rows_args: arrays [S, ...]; f acts per row): `when_any`, and
  when at most FEW_ROWS rows need it, over those rows alone, gathered. Other rows get `otherwise`."""
  S, H = need_S.shape[0], FEW_ROWS
  if branch_free or S <= H:
    return when_any(need_S, lambda: f(*rows_args), otherwise, branch_free)

  def few():
    _, idx = jax.lax.top_k(jnp.where(need_S, S - jnp.arange(S), 0), H)  # the rows that need it first
    out = f(*(a[idx] for a in rows_args))
    return jax.tree.map(lambda o, v: o.at[idx].set(v, mode="promise_in_bounds"), otherwise(), out)

  n = need_S.sum()
  return jax.lax.cond(n == 0, otherwise, lambda: jax.lax.cond(n <= H, few, lambda: f(*rows_args)))


def _sample_rows(
  x, xb, block_max, greedy, temperature_S, top_k_S, top_p_S, u_SxN, valid: int, branch_free: bool
):
  """`sample`'s tokens for rows x [S, Y] (`_blocked` of them, their greedy tokens and uniforms given)."""
  S = x.shape[0]
  hot = temperature_S > 0
  top_k = jnp.where(top_k_S >= valid, 0, top_k_S)
  r = 1.0 / jnp.where(hot, temperature_S, 1.0).astype(F32)
  m = jnp.take_along_axis(block_max, (greedy // BLOCK)[:, None], 1)[:, 0]  # the row's largest logit
  u = u_SxN
  drawn = hot & (top_k == 0)  # temperature alone, or top-p: drawn from the whole distribution
  nucleus = drawn & (top_p_S < 1.0)
  capped = hot & (top_k > 0) & (top_k <= TOPK_CAP)

  tok_d, y_d, z_d = when_any(
    drawn,
    lambda: _draw(xb, _probs, (m, r), valid, u[:, :CANDIDATES]),
    lambda: (jnp.zeros((S, CANDIDATES), jnp.int32), jnp.zeros((S, CANDIDATES), F32), jnp.ones((S,), F32)),
    branch_free,
  )
  # Rejection: the first candidate inside the nucleus (mass above it < top_p · Z, or the largest logit)
  # is a draw from the nucleus distribution; each is accepted with probability the nucleus mass, >= top_p.
  accepted, choice = ~nucleus, jnp.zeros((S,), jnp.int32)
  for i in range(CANDIDATES):
    test = nucleus & ~accepted
    member = _on_rows(
      test,
      lambda xb, m, r, y, top_p, z: (_total(_probs_above, xb, valid, (m, r, y)) < top_p * z) | (y >= m),
      (xb, m, r, y_d[:, i], top_p_S, z_d),
      lambda: jnp.zeros((S,), bool),
      branch_free,
    )
    choice = jnp.where(test & member, i, choice)
    accepted = accepted | (test & member)
  tok_drawn = jnp.take_along_axis(tok_d, choice[:, None], 1)[:, 0]

  tok_cap, exact = when_any(
    capped,
    lambda: _capped(x, xb, block_max, valid, m, r, u[:, 0], top_k, top_p_S),
    lambda: (greedy, jnp.ones((S,), bool)),
    branch_free,
  )
  # The bisection: a top-k past the candidates, and the rows whose candidates all fell outside the nucleus
  # (with their own uniform, independent of those candidates: the mixture is still the nucleus's law).
  need_full = hot & jnp.isfinite(m) & ((top_k > TOPK_CAP) | (capped & ~exact) | (nucleus & ~accepted))
  tok_full = _on_rows(
    need_full,
    lambda xb, m, r, u, top_k, top_p: _filtered_full(xb, valid, m, r, u, top_k, top_p, branch_free),
    (xb, m, r, u[:, CANDIDATES], top_k, top_p_S),
    lambda: greedy,
    branch_free,
  )
  tok = jnp.where(need_full, tok_full, jnp.where(capped, tok_cap, jnp.where(drawn, tok_drawn, greedy)))
  return jnp.where(jnp.isfinite(m) & hot, tok, greedy).astype(jnp.int32)


def sample(
  logits_SxY,
  temperature_S,
  top_k_S,
  top_p_S,
  seed_S,
  pos_S,
  *,
  valid_vocab: int,
  seed_hi_S=None,
  branch_free: bool | None = None,
  allowed_SxG=None,
  free_path: bool = True,
):
  """Next token per slot. temperature 0 → greedy; top_k 0 → off; top_p 1 → off. Ids >= valid_vocab
  (the model's padded vocabulary rows) are never produced. branch_free: no `cond` (None: on Neuron only).
  allowed_SxG: int32 [S, G] per-row bitmask of the tokens a row may produce (`masked`; all ones: free,
  None: no mask): every path samples the settings' distribution renormalised over the allowed tokens (a row
  must allow at least one). Where the logits come in as an argument, as in the engine's sampling call,
  masking costs a pass of its own over them (docs/BENCHMARKS.md, "Constrained decoding"), so unless
  branch_free a batch whose rows all allow every token takes the unmasked sampler (a row's token depends on
  its own row alone: the same tokens either way). The engine's steps run only the live rows, so a few
  constrained requests are a small batch. free_path=False: always the masked sampler (one sampler to compile,
  for calls that are rare or small: insert's entries, a verify's positions)."""
  if branch_free is None:
    branch_free = branch_free_default()
  args = (logits_SxY, temperature_S, top_k_S, top_p_S, seed_S, pos_S, seed_hi_S)
  rows = lambda allowed: _sample(*args[:6], valid_vocab, args[6], branch_free, allowed)
  if allowed_SxG is None or branch_free or not free_path:
    return rows(allowed_SxG)
  constrained = (allowed_SxG != -1).any()
  return jax.lax.cond(constrained, lambda: rows(allowed_SxG), lambda: rows(None))


def _sample(
  logits_SxY, temperature_S, top_k_S, top_p_S, seed_S, pos_S, valid_vocab, seed_hi_S, branch_free, allowed_SxG
):
  """`sample`'s body (branch_free decided)."""
  x = masked(logits_SxY.astype(F32), allowed_SxG)
  xb, block_max = _blocked(x, valid_vocab)
  greedy = _argmax_blocked(xb, block_max, valid_vocab)
  hot = temperature_S > 0
  settings = (temperature_S, top_k_S, top_p_S)

  def all_rows():
    u = slot_uniforms(seed_S, pos_S, seed_hi_S, n=CANDIDATES + 1)
    return _sample_rows(x, xb, block_max, greedy, *settings, u, valid_vocab, branch_free)

  # A batch-level cond skips the work no slot needs: an all-greedy batch costs one blocked argmax. (The
  # engine's steps run only the live slots' rows, serve.slots.slot_functions.step_rows: a lone sampling request is a batch
  # of one.) Each row's result depends on its own row alone, whichever branch runs. Branch-free, both.
  return when_any(hot, all_rows, lambda: greedy, branch_free)


TOP_LOGPROBS = 5  # the most `logprobs` a request may ask for (OpenAI's bound)


def logprobs(logits_SxY, tok_S, *, valid_vocab: int):
  """log-softmax of the raw logits over the valid vocabulary: (the chosen token's [S], the top
  TOP_LOGPROBS values [S, N] and ids [S, N]). Temperature and filters do not change them."""
  lg = logits_SxY[:, :valid_vocab].astype(F32)
  lse = jax.nn.logsumexp(lg, -1)
  chosen = jnp.take_along_axis(lg, tok_S[:, None].astype(jnp.int32), -1)[:, 0] - lse
  vals, ids = jax.lax.top_k(lg, TOP_LOGPROBS)
  return chosen, vals - lse[:, None], ids.astype(jnp.int32)
