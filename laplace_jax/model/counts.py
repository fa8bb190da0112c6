"""Counts derived from a config and the model's own parameter declarations: parameter shapes and counts
(split as the optimizer splits them), decode-state bytes per sequence, FLOPs per token.

Above the model in the layering (it reads laplace_jax.model's declarations), so that config depends on nothing.
"""

from __future__ import annotations

import math

import numpy as np

from laplace_jax import model
from laplace_jax.model.config import LaplaceConfig
from laplace_jax.param_names import ATTENTION_MUON_NAMES, MUON_PARAM_NAMES


def layer_shapes(cfg: LaplaceConfig, mixer: str = "G") -> dict[str, tuple[int, ...]]:
  """One layer's parameter shapes (unstacked) for mixer 'G' (GLA), 'A' or 'S' (attention, full or windowed: the
  same weights), keyed by leaf name: read from the parameters the layer declares and makes
  (laplace_jax.model.layer_param_specs), not written here a second time."""
  return model.layer_param_shapes(cfg, mixer)


def param_shapes(cfg: LaplaceConfig) -> dict[str, dict[str, tuple[int, ...]]]:
  """The GLA layer's parameter shapes (unstacked) plus the model-level ones, keyed by leaf name, from the
  model's declarations (laplace_jax.model.layer_param_specs, model_param_specs)."""
  return {"layer": layer_shapes(cfg, "G"), "model": model.model_param_shapes(cfg)}


def param_counts(cfg: LaplaceConfig) -> dict[str, int]:
  """Parameters split the way the optimizer splits them: Muon (2-D hidden matrices) and AdamW."""
  muon_names = MUON_PARAM_NAMES + ATTENTION_MUON_NAMES
  muon = adamw = 0
  for letter in cfg.mixers:
    shapes = layer_shapes(cfg, letter)
    muon += cfg.n_groups * sum(math.prod(s) for n, s in shapes.items() if n in muon_names)
    adamw += cfg.n_groups * sum(math.prod(s) for n, s in shapes.items() if n not in muon_names)
  adamw += sum(math.prod(s) for s in param_shapes(cfg)["model"].values())
  return {"total": muon + adamw, "muon": muon, "adamw": adamw}


def _compute_itemsize(cfg: LaplaceConfig) -> int:
  return 2 if cfg.compute_dtype == "bfloat16" else np.dtype(cfg.compute_dtype).itemsize


def kv_cache_bytes_per_token(cfg: LaplaceConfig) -> int:
  """Keys and values that the attention layers keep per token of context, in the compute dtype."""
  return cfg.n_mixer_layers("A") * 2 * cfg.attn_width * _compute_itemsize(cfg)


def window_ring_bytes(cfg: LaplaceConfig) -> int:
  """Keys and values that the sliding-window layers keep per sequence: a ring of `window` tokens each."""
  return cfg.n_mixer_layers("S") * cfg.window * 2 * cfg.attn_width * _compute_itemsize(cfg)


def state_bytes_per_sequence(cfg: LaplaceConfig, context: int | None = None) -> int:
  """Decode state per sequence: fp32 GLA matrices [H, d_k, d_v] per GLA layer, an fp32 conv ring
  [conv, D] per layer, for sliding-window layers a ring of `window` keys and values, and for attention
  layers a KV cache of `context` tokens; + a 4-byte position (tokens consumed)."""
  gla = cfg.n_mixer_layers("G") * cfg.n_heads * cfg.d_k * cfg.d_v * 4
  conv = cfg.n_layers * cfg.conv_size * cfg.d_model * 4
  fixed = gla + conv + window_ring_bytes(cfg) + 4
  if "A" not in cfg.mixers:
    return fixed
  if context is None:
    raise ValueError(
      f"mixers={cfg.mixers!r} has attention layers, whose KV cache grows with the context: "
      "pass context=N tokens."
    )
  return fixed + context * kv_cache_bytes_per_token(cfg)


def flops_per_token(cfg: LaplaceConfig, *, training: bool = True, seq_len: int | None = None) -> float:
  """Model FLOPs per token: 2·(matmul params) plus the chunked GLA and attention, ×3 for forward+backward.
  `seq_len`: the sequences' length (default max_seq_len); GLA chunks are min(chunk_size, seq_len) long."""
  T = cfg.max_seq_len if seq_len is None else seq_len
  counts = param_counts(cfg)
  matmul_params = counts["muon"] + cfg.d_model * cfg.vocab_size  # LM head; the embedding is a gather
  C, K, V = min(cfg.chunk_size, T), cfg.d_k, cfg.d_v
  gla = cfg.n_mixer_layers("G") * cfg.n_heads * (2 * C * (K + V) + 4 * K * V)
  # causal attention over a training sequence of T: QKᵀ and PV, half of them masked on average
  attn = cfg.n_mixer_layers("A") * 2 * T * cfg.attn_width
  # windowed attention: QKᵀ and PV over the keys each query sees, min(t + 1, window), averaged over the sequence
  seen = np.minimum(np.arange(1, T + 1), cfg.window).mean()
  attn += cfg.n_mixer_layers("S") * 4 * seen * cfg.attn_width
  fwd = 2 * matmul_params + gla + attn
  return 3 * fwd if training else fwd
