"""One frozen config for the Laplace model and its presets (the counts derived from it: laplace_jax/model/counts.py).

Names follow the published description (REFERENCE.md): D = d_model, H = n_heads, d_k / d_v per head,
a fixed geometric decay schedule between half-lives `decay_t_min` and `decay_t_max` tokens.
"""

from __future__ import annotations

import dataclasses
import math
from typing import NoReturn

import numpy as np

from laplace_jax.data.tokenizer import VOCAB_SIZE

MIXERS = {
  "G": "simple GLA (the Laplace layer)",
  "A": "causal softmax attention with RoPE",
  "S": "causal sliding-window softmax attention with RoPE over the last `window` tokens",
}
PADDED_VOCAB = -(-VOCAB_SIZE // 64) * 64  # GPT-2's 50,257 ids padded to a multiple of 64: 50,304


GLA_FORMS = ("auto", "parallel", "scan")
SCAN_LAYERS = ("auto", "true", "false")
# Fields that change how the program runs but neither the parameters nor the math: a checkpoint (or a cached
# state) saved under one value loads under any other, and those from before the field existed load too.
LAYOUT_NEUTRAL = frozenset({"scan_layers"})


def _bad(field: str, value, expect: str, fix: str) -> NoReturn:
  """A LaplaceConfig field refused: the field, the value, the expectation and the fix."""
  raise ValueError(f"LaplaceConfig.{field}={value!r}: expected {expect}. {fix}")


@dataclasses.dataclass(frozen=True)
class LaplaceConfig:
  vocab_size: int = PADDED_VOCAB
  """vocabulary rows (GPT-2's 50,257 padded to 50,304)"""
  d_model: int = 3072
  """hidden width D"""
  n_layers: int = 24
  """decoder layers"""
  n_heads: int = 16
  """GLA heads H"""
  d_k: int = 96
  """query/key width per head (published ratio: half of d_model / n_heads)"""
  d_v: int = 192
  """value width per head (published ratio: d_model / n_heads)"""
  d_ff: int = 8192
  """GLU inner width"""
  ffn: bool = True
  """each layer's GLU FFN after its mixer (true/false); false: mixer-only layers, as Zoology's MQAR models
  (no ln2_scale, w1, w2, w3; d_ff unused)"""
  conv_size: int = 4
  """causal depth-wise conv kernel; the decode state keeps this many inputs"""
  decay_t_min: float = 1.0
  """shortest head half-life in tokens"""
  decay_t_max: float = 2048.0
  """longest head half-life in tokens"""
  n_decay_tiers: int = 4
  """heads are grouped into this many tiers; each tier shares one Head RMSNorm weight"""
  chunk_size: int = 128
  """GLA chunk length (training and prefill)"""
  max_seq_len: int = 2048
  """training sequence length (the default --seq_len)"""
  norm_eps: float = 1e-5
  """LayerNorm / RMSNorm epsilon"""
  init_std: float = 0.02
  """std of the normal initialisation of matrices"""
  param_dtype: str = "float32"
  """parameter dtype (float32 | bfloat16)"""
  compute_dtype: str = "bfloat16"
  """matmul dtype (float32 | bfloat16)"""
  remat: bool = True
  """rematerialise each layer in the backward pass (true/false)"""
  unroll_chunks: bool = False
  """statically unroll the chunk scan, as the Trainium port compiled it (true/false)"""
  gla_form: str = "auto"
  """chunked GLA form: auto (parallel on GPU/TPU, scan on CPU, unrolled scan on Neuron) | parallel (faster on
  GPUs) | scan (constant time per token on CPUs)"""
  mixers: str = "G"
  """per-layer mixer pattern repeated over the layers: G = GLA, A = softmax attention, S = sliding-window
  softmax attention (e.g. GGGA, GGGS)"""
  rope_base: float = 10000.0
  """RoPE base of the attention layers"""
  attn_heads: int = 0
  """heads of the attention layers (A, S); 0: n_heads. Any count splits the same width, n_heads times the
  head width at n_heads (Zoology's MQAR attention: 1 head)"""
  window: int = 2048
  """tokens a sliding-window attention layer (S) sees, itself included; its decode state is a ring of this many
  keys and values"""
  scan_layers: str = "auto"
  """layer stack as one scanned body (true) or unrolled (false), same parameters and outputs: auto (unrolled
  on Neuron, as AXLearn runs trn2; scanned elsewhere, which compiles faster)"""

  def __post_init__(self):
    """Every field checked (each error names the field, the value, the expectation and the fix)."""
    self._check_sizes()
    self._check_decays()
    self._check_choices()
    self._check_layer_pattern()
    self._check_attention()

  def _check_sizes(self):
    """The counts and widths: positive integers that split as the model needs."""
    for f in (
      "vocab_size",
      "d_model",
      "n_layers",
      "n_heads",
      "d_k",
      "d_v",
      "d_ff",
      "conv_size",
      "n_decay_tiers",
      "chunk_size",
      "max_seq_len",
      "window",
    ):
      v = getattr(self, f)
      if not isinstance(v, (int, np.integer)) or isinstance(v, bool) or v <= 0:
        _bad(f, v, "a positive integer", "Set it to a positive integer.")
    if self.n_heads % self.n_decay_tiers:
      _bad(
        "n_decay_tiers",
        self.n_decay_tiers,
        f"a divisor of n_heads={self.n_heads}",
        "Choose a tier count that splits the heads evenly.",
      )
    if self.max_seq_len % self.chunk_size:
      _bad(
        "max_seq_len",
        self.max_seq_len,
        f"a multiple of chunk_size={self.chunk_size}",
        "Training sequences are split into whole chunks.",
      )

  def _check_decays(self):
    """The decay half-lives: positive and in order."""
    if not (self.decay_t_min > 0 and self.decay_t_max > 0):
      _bad(
        "decay_t_min/decay_t_max",
        (self.decay_t_min, self.decay_t_max),
        "positive half-lives",
        "Half-lives are in tokens and must be > 0.",
      )
    if self.decay_t_max < self.decay_t_min:
      _bad(
        "decay_t_max",
        self.decay_t_max,
        f">= decay_t_min={self.decay_t_min} (a non-reversed range)",
        "Swap the two values.",
      )

  def _check_choices(self):
    """The dtypes and the per-platform choices (`scan_layers`'s booleans normalised to its flag's spelling)."""
    for f in ("param_dtype", "compute_dtype"):
      v = getattr(self, f)
      if v not in ("float32", "bfloat16", "float16"):
        _bad(f, v, "one of 'float32', 'bfloat16', 'float16'", "Use a floating dtype name.")
    if isinstance(self.scan_layers, bool):  # Python and TOML booleans, kept in the flag's spelling
      object.__setattr__(self, "scan_layers", "true" if self.scan_layers else "false")
    if self.scan_layers not in SCAN_LAYERS:
      _bad(
        "scan_layers",
        self.scan_layers,
        f"one of {SCAN_LAYERS}",
        "auto scans the layers (one compiled body) except on Neuron, which unrolls them.",
      )
    if self.gla_form not in GLA_FORMS:
      _bad(
        "gla_form",
        self.gla_form,
        f"one of {GLA_FORMS}",
        "auto picks per backend; parallel is faster on GPUs, scan on CPUs.",
      )

  def _check_layer_pattern(self):
    """The mixer letters, their pattern's length and the FFN switch."""
    if not self.mixers or set(self.mixers) - set(MIXERS):
      _bad(
        "mixers",
        self.mixers,
        f"a non-empty pattern of the letters {sorted(MIXERS)} "
        f"({', '.join(f'{k} = {v}' for k, v in MIXERS.items())})",
        "E.g. 'G' (Laplace), 'A' (attention), "
        "'GGGA' (three GLA layers, then attention, repeated), 'GGGS' (the same with windowed attention).",
      )
    if self.n_layers % len(self.mixers):
      _bad(
        "mixers",
        self.mixers,
        f"a pattern whose length {len(self.mixers)} divides n_layers={self.n_layers}",
        "Layers are scanned in repeating groups: choose a pattern length that divides n_layers.",
      )
    if not isinstance(self.ffn, (bool, np.bool_)):
      _bad("ffn", self.ffn, "true or false", "true keeps each layer's GLU FFN; false drops it.")

  def _check_attention(self):
    """The attention layers' heads: a count that splits their width into even (RoPE) head widths."""
    if (
      not isinstance(self.attn_heads, (int, np.integer))
      or isinstance(self.attn_heads, bool)
      or self.attn_heads < 0
    ):
      _bad("attn_heads", self.attn_heads, "an integer >= 0", "0 uses n_heads; e.g. 1 for one attention head.")
    if self.attn_width % self.attn_n_heads:
      _bad(
        "attn_heads",
        self.attn_heads,
        f"a divisor of the attention width {self.attn_width} (n_heads · {self._attn_base_head_dim})",
        "Choose a head count that splits the width evenly, or 0 for n_heads.",
      )
    if set("AS") & set(self.mixers) and self.attn_head_dim % 2:
      _bad(
        "mixers",
        self.mixers,
        f"an even attention head width for RoPE (got {self.attn_head_dim})",
        "Change d_k / d_v so that (2·d_k + 3·d_v) / 4 rounds to an even width, or attn_heads.",
      )

  # Derived widths of the fused projection W_qkvg: [q | k | v | g].
  @property
  def qk_width(self) -> int:
    return self.n_heads * self.d_k

  @property
  def v_width(self) -> int:
    return self.n_heads * self.d_v

  @property
  def qkvg_width(self) -> int:
    return 2 * self.qk_width + 2 * self.v_width

  @property
  def _attn_base_head_dim(self) -> int:
    """Head width at n_heads heads: W_qkv [D, 3·H·hd] + W_o [H·hd, D] spend W_qkvg + W_out's budget, 4·D·H·hd."""
    return max(2, round((2 * self.d_k + 3 * self.d_v) / 4))

  @property
  def attn_width(self) -> int:
    """Width of the attention layers' queries (keys, values): n_heads · the head width at n_heads heads."""
    return self.n_heads * self._attn_base_head_dim

  @property
  def attn_n_heads(self) -> int:
    """Heads of the attention layers (A, S): attn_heads, or n_heads when it is 0."""
    return self.attn_heads or self.n_heads

  @property
  def attn_head_dim(self) -> int:
    """Attention head width: the attention width split over attn_n_heads heads."""
    return self.attn_width // self.attn_n_heads

  @property
  def n_groups(self) -> int:
    """Repeats of the mixer pattern: the layer scan's length."""
    return self.n_layers // len(self.mixers)

  def n_mixer_layers(self, letter: str) -> int:
    return self.mixers.count(letter) * self.n_groups

  def replace(self, **changes) -> LaplaceConfig:
    unknown = set(changes) - {f.name for f in dataclasses.fields(self)}
    if unknown:
      raise ValueError(
        f"unknown config field(s) {sorted(unknown)}; valid fields: "
        f"{[f.name for f in dataclasses.fields(self)]}"
      )
    return dataclasses.replace(self, **changes)


def gla_form_for_backend(cfg: LaplaceConfig, backend: str) -> tuple[str, bool]:
  """(form, unroll) for chunk_simple_gla. "auto": parallel on GPUs/TPUs (2x scan on an H200), scan on CPUs
  (constant time per token), and on Neuron the statically unrolled scan the published port compiled."""
  if cfg.gla_form != "auto":
    return cfg.gla_form, cfg.unroll_chunks
  if backend == "neuron":
    return "scan", True
  return ("scan" if backend == "cpu" else "parallel"), cfg.unroll_chunks


def layers_scanned(cfg: LaplaceConfig, backend: str) -> bool:
  """Whether the layer stack runs as one scanned body (a loop over stacked weights) or unrolled (each layer
  its own straight-line code, same weights, same math). "auto": unrolled on Neuron, as AXLearn runs trn2
  (neuronx-cc finds the repeated blocks itself, and the published port compiled a fixed graph), scanned
  elsewhere (one body compiles faster). docs/NEURON.md has the measured costs."""
  if cfg.scan_layers != "auto":
    return cfg.scan_layers == "true"
  return backend != "neuron"


def decay_half_lives(cfg: LaplaceConfig) -> np.ndarray:
  """Half-life T_h in tokens of each head: geometric from decay_t_min to decay_t_max."""
  h = np.arange(cfg.n_heads, dtype=np.float64)
  frac = h / max(cfg.n_heads - 1, 1)
  return cfg.decay_t_min * (cfg.decay_t_max / cfg.decay_t_min) ** frac


def log_decays(cfg: LaplaceConfig) -> np.ndarray:
  """g_gamma = ln λ_h with λ_h = 2^(−1/T_h): the fixed (not learned) per-head log decay, [H] fp32."""
  return (-math.log(2.0) / decay_half_lives(cfg)).astype(np.float32)


PRESETS: dict[str, LaplaceConfig] = {
  "laplace-3b": LaplaceConfig(),
  # ≈148M parameters: the published ratios (d_k = D/2H, d_v = D/H) at GPT-2-small width.
  "small": LaplaceConfig(
    d_model=768, n_layers=10, n_heads=8, d_k=48, d_v=96, d_ff=2048, n_decay_tiers=4, compute_dtype="float32"
  ),
  # Tests and demos: compiles in seconds on a CPU.
  "tiny": LaplaceConfig(
    d_model=64,
    n_layers=2,
    n_heads=4,
    d_k=8,
    d_v=16,
    d_ff=128,
    n_decay_tiers=2,
    max_seq_len=256,
    compute_dtype="float32",
    remat=False,
  ),
}


def get_config(name: str, **overrides) -> LaplaceConfig:
  if name not in PRESETS:
    raise ValueError(f"unknown preset {name!r}; choose one of {sorted(PRESETS)}")
  return PRESETS[name].replace(**overrides) if overrides else PRESETS[name]


# Names of the leaves the optimizer gives to Muon (sharding and the counts read them).
