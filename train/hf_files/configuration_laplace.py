"""transformers config of the Laplace model (laplace-jax's LaplaceConfig, under the same field names).

Shipped inside each directory `python -m train.export_hf` writes (loaded with trust_remote_code=True); the
laplace-jax project never imports it. Field meanings: laplace_jax/model/config.py and docs/HUGGING_FACE.md.
"""

from transformers import PretrainedConfig


class LaplaceConfig(PretrainedConfig):
  model_type = "laplace"
  keys_to_ignore_at_inference = ["past_key_values"]
  attribute_map = {
    "hidden_size": "d_model",
    "num_hidden_layers": "n_layers",
    "num_attention_heads": "n_heads",
    "intermediate_size": "d_ff",
  }

  # laplace-jax's LaplaceConfig fields that shape the model, at laplace-3b's values. Its other fields
  # (param_dtype, compute_dtype, remat, gla_form, ...) arrive in kwargs and stay attributes, so a config saved
  # back holds them for the import.
  architecture = {
    "vocab_size": 50304,
    "d_model": 3072,
    "n_layers": 24,
    "n_heads": 16,
    "d_k": 96,
    "d_v": 192,
    "d_ff": 8192,
    "ffn": True,
    "conv_size": 4,
    "decay_t_min": 1.0,
    "decay_t_max": 2048.0,
    "n_decay_tiers": 4,
    "chunk_size": 128,
    "max_seq_len": 2048,
    "norm_eps": 1e-5,
    "init_std": 0.02,
    "mixers": "G",
  }

  def __init__(
    self, use_cache=True, bos_token_id=50256, eos_token_id=50256, tie_word_embeddings=False, **kwargs
  ):
    for name, default in self.architecture.items():
      setattr(self, name, kwargs.pop(name, default))
    if self.mixers != "G":
      raise ValueError(f"mixers={self.mixers!r}: this model implements the Laplace layer only (mixers='G').")
    if self.n_heads % self.n_decay_tiers:
      raise ValueError(f"n_decay_tiers={self.n_decay_tiers}: expected a divisor of n_heads={self.n_heads}.")
    self.use_cache = use_cache
    super().__init__(
      bos_token_id=bos_token_id, eos_token_id=eos_token_id, tie_word_embeddings=tie_word_embeddings, **kwargs
    )
