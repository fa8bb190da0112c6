"""The Laplace model (i14's Laplace 3B architecture) in PyTorch for transformers, as laplace-jax computes it.

Shipped inside each directory `python -m train.export_hf` writes (loaded with trust_remote_code=True); the
laplace-jax project never imports it. Tensor names and layouts: docs/HUGGING_FACE.md.

One layer: x → LayerNorm → causal depth-wise conv (k = conv_size) + SiLU → W_qkvg → q, k, v, g per head →
simple GLA with a fixed geometric per-head decay → + σ(q·(a⊙k))·v → Head RMSNorm per decay tier → ⊙ SiLU(g)
→ W_out → + x; then LayerNorm → GLU(SiLU) FFN → + x. The GLA state and the conv window are the whole decode
state (`LaplaceCache`, fixed size): `generate` feeds one token per step after the prompt.

The chunked GLA runs in plain PyTorch (fp32 state and accumulations); on a GPU with flash-linear-attention
installed, its `chunk_simple_gla` kernel runs instead (unpadded inputs).
"""

import math

import torch
import torch.nn.functional as F
from torch import nn
from transformers import GenerationMixin, PreTrainedModel
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast

from .configuration_laplace import LaplaceConfig

try:
  from fla.ops.simple_gla import chunk_simple_gla as fla_chunk_simple_gla
except ImportError:  # fla is optional: the PyTorch form below computes the same
  fla_chunk_simple_gla = None


def log_decays(config, device) -> torch.Tensor:
  """g_gamma [H] fp32: ln λ_h, λ_h = 2^(−1/T_h), half-lives T_h geometric from decay_t_min to decay_t_max."""
  n = config.n_heads
  ratio = config.decay_t_max / config.decay_t_min
  half_lives = [config.decay_t_min * ratio ** (h / max(n - 1, 1)) for h in range(n)]
  return torch.tensor([-math.log(2.0) / t for t in half_lives], dtype=torch.float64, device=device).float()


def chunk_simple_gla(q, k, v, g, scale, state, chunk_size):
  """Simple GLA in chunks, fla's layout: q, k [B,T,H,K], v [B,T,H,V], per-token log decays g [B,T,H] (0 at
  skipped positions), state [B,H,K,V] fp32 → (o [B,T,H,V] fp32, state after the last token).

      S_t = exp(g_t) S_{t−1} + k_t v_tᵀ,   o_t = scale · q_tᵀ S_t

  Inside a chunk with cumulative log decays b: o_i = e^{b_i} q_iᵀ S_prev + Σ_{j≤i} e^{b_i−b_j} (q_i·k_j) v_j;
  the exponent is masked before exp, so the upper triangle never overflows."""
  q, k, v, g = (x.transpose(1, 2).float() for x in (q, k, v, g))  # head-major [B, H, T, ·]
  q = q * scale
  T = q.shape[2]
  outs = []
  for start in range(0, T, chunk_size):
    end = min(start + chunk_size, T)
    qc, kc, vc = q[:, :, start:end], k[:, :, start:end], v[:, :, start:end]
    b = g[:, :, start:end].cumsum(-1)  # [B, H, C]
    C = end - start
    causal = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
    decay = torch.exp((b[..., :, None] - b[..., None, :]).masked_fill(~causal, -math.inf))
    o = ((qc @ kc.transpose(-1, -2)) * decay) @ vc + (qc * b.exp()[..., None]) @ state
    b_last = b[..., -1:]
    state = b_last.exp()[..., None] * state + (kc * (b_last - b).exp()[..., None]).transpose(-1, -2) @ vc
    outs.append(o)
  return torch.cat(outs, 2).transpose(1, 2), state


class LaplaceCache:
  """The decode state, fixed in size whatever the context: per layer `conv[i]` [B, conv_size, D] (the layer's
  last conv inputs, oldest first, fp32) and `gla[i]` [B, H, d_k, d_v] fp32; `seen` positions consumed."""

  def __init__(self, n_layers: int):
    self.conv: list = [None] * n_layers
    self.gla: list = [None] * n_layers
    self.seen = 0

  def get_seq_length(self, layer_idx: int = 0) -> int:
    return self.seen

  def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
    """Rows reordered (beam search)."""
    for table in (self.conv, self.gla):
      for i, x in enumerate(table):
        if x is not None:
          table[i] = x.index_select(0, beam_idx.to(x.device))


class LaplaceNorm(nn.Module):
  """Weight-only LayerNorm, statistics in fp32."""

  def __init__(self, dim: int, eps: float):
    super().__init__()
    self.weight = nn.Parameter(torch.ones(dim))
    self.eps = eps

  def forward(self, x):
    x32 = x.float()
    mu = x32.mean(-1, keepdim=True)
    var = (x32 - mu).square().mean(-1, keepdim=True)
    return ((x32 - mu) * torch.rsqrt(var + self.eps) * self.weight.float()).to(x.dtype)


class LaplaceHeadNorm(nn.Module):
  """RMSNorm over each head's d_v outputs, one weight per decay tier (heads h·tiers/H share one), fp32."""

  def __init__(self, config):
    super().__init__()
    self.weight = nn.Parameter(torch.ones(config.n_decay_tiers, config.d_v))
    self.eps = config.norm_eps
    self.heads_per_tier = config.n_heads // config.n_decay_tiers

  def forward(self, o_BxTxHxV):
    scale_HxV = self.weight.float().repeat_interleave(self.heads_per_tier, 0)
    return o_BxTxHxV * torch.rsqrt(o_BxTxHxV.square().mean(-1, keepdim=True) + self.eps) * scale_HxV


class LaplaceGLA(nn.Module):
  """W_qkvg → simple GLA → self-augmentation σ(q·(a⊙k))·v → Head RMSNorm per tier → ⊙ SiLU(g) → W_out."""

  def __init__(self, config):
    super().__init__()
    self.config = config
    H, K, V, D = config.n_heads, config.d_k, config.d_v, config.d_model
    self.split = [H * K, H * K, H * V, H * V]
    self.qkvg_proj = nn.Linear(D, sum(self.split), bias=False)
    self.aug_balance = nn.Parameter(torch.zeros(H, K))
    self.head_norm = LaplaceHeadNorm(config)
    self.out_proj = nn.Linear(H * V, D, bias=False)

  def forward(self, u_BxTxD, state, mask_BxT):
    cfg = self.config
    B, T, _ = u_BxTxD.shape
    H, K, V = cfg.n_heads, cfg.d_k, cfg.d_v
    q, k, v, g = self.qkvg_proj(u_BxTxD).split(self.split, -1)
    q, k, v = q.view(B, T, H, K), k.view(B, T, H, K), v.view(B, T, H, V)
    g_gamma = log_decays(cfg, u_BxTxD.device)
    if state is None:
      state = torch.zeros(B, H, K, V, dtype=torch.float32, device=u_BxTxD.device)
    if mask_BxT is None and fla_chunk_simple_gla is not None and q.is_cuda:
      o, state = fla_chunk_simple_gla(
        q, k, v, g_gamma=g_gamma, scale=K**-0.5, initial_state=state, output_final_state=True
      )
    else:
      k_in, g_BxTxH = k, g_gamma.expand(B, T, H)
      if mask_BxT is not None:  # skipped positions neither feed nor decay the state
        k_in = k * mask_BxT[:, :, None, None].to(k.dtype)
        g_BxTxH = g_BxTxH * mask_BxT[:, :, None].float()
      o, state = chunk_simple_gla(q, k_in, v, g_BxTxH, K**-0.5, state, cfg.chunk_size)
    gate_BxTxH = torch.sigmoid(
      torch.einsum("bthk,hk,bthk->bth", q.float(), self.aug_balance.float(), k.float())
    )
    o = o.to(v.dtype).float() + gate_BxTxH[..., None] * v.float()
    o = self.head_norm(o).reshape(B, T, H * V).to(u_BxTxD.dtype) * F.silu(g)
    return self.out_proj(o), state.float()


class LaplaceGLU(nn.Module):
  """w3(SiLU(w1 h) ⊙ w2 h)."""

  def __init__(self, config):
    super().__init__()
    self.w1 = nn.Linear(config.d_model, config.d_ff, bias=False)
    self.w2 = nn.Linear(config.d_model, config.d_ff, bias=False)
    self.w3 = nn.Linear(config.d_ff, config.d_model, bias=False)

  def forward(self, h):
    return self.w3(F.silu(self.w1(h)) * self.w2(h))


class LaplaceBlock(nn.Module):
  def __init__(self, config, layer_idx: int):
    super().__init__()
    self.layer_idx = layer_idx
    D, W = config.d_model, config.conv_size
    self.mixer_norm = LaplaceNorm(D, config.norm_eps)
    # Depth-wise causal conv, weight [D, 1, W]: tap W−1 applies to the newest input (applied by hand below,
    # over the cached window, so a prefill and a one-token step compute alike).
    self.conv = nn.Conv1d(D, D, W, groups=D, bias=True)
    self.mixer = LaplaceGLA(config)
    if config.ffn:
      self.ffn_norm = LaplaceNorm(D, config.norm_eps)
      self.ffn = LaplaceGLU(config)

  def causal_conv(self, h_BxTxD, window_BxWxD):
    B, T, D = h_BxTxD.shape
    W = self.conv.weight.shape[-1]
    if window_BxWxD is None:
      window_BxWxD = h_BxTxD.new_zeros(B, W, D)
    ext = torch.cat([window_BxWxD.to(h_BxTxD.dtype), h_BxTxD], 1)  # position p of the chunk at p + W
    kernel_WxD = self.conv.weight[:, 0, :].T.to(h_BxTxD.dtype)
    out = sum(ext[:, 1 + i : 1 + i + T] * kernel_WxD[i] for i in range(W)) + self.conv.bias.to(h_BxTxD.dtype)
    return out, ext[:, -W:].float()

  def forward(self, x, cache, mask_BxT):
    i = self.layer_idx
    h = self.mixer_norm(x)
    if mask_BxT is not None:  # left padding reads as the zeros a sequence starts from
      h = h * mask_BxT[..., None].to(h.dtype)
    u, window = self.causal_conv(h, None if cache is None else cache.conv[i])
    mixed, state = self.mixer(F.silu(u), None if cache is None else cache.gla[i], mask_BxT)
    if cache is not None:
      cache.conv[i], cache.gla[i] = window, state
    x = x + mixed.to(x.dtype)
    if hasattr(self, "ffn"):
      x = x + self.ffn(self.ffn_norm(x)).to(x.dtype)
    return x


class LaplacePreTrainedModel(PreTrainedModel):
  config_class = LaplaceConfig
  base_model_prefix = "model"
  _no_split_modules = ["LaplaceBlock"]
  _is_stateful = True  # no assisted decoding or cache cropping: the state cannot be rolled back

  @torch.no_grad()
  def _init_weights(self, module):
    """laplace-jax's initialisation: matrices N(0, init_std²), W_out and w3 scaled by 1/√(2L); norms 1; conv
    U(±1/√k), bias 0; aug_balance 0."""
    std = self.config.init_std
    if isinstance(module, LaplaceGLA):
      nn.init.normal_(module.qkvg_proj.weight, std=std)
      nn.init.normal_(module.out_proj.weight, std=std / math.sqrt(2 * self.config.n_layers))
      nn.init.zeros_(module.aug_balance)
    elif isinstance(module, LaplaceGLU):
      nn.init.normal_(module.w1.weight, std=std)
      nn.init.normal_(module.w2.weight, std=std)
      nn.init.normal_(module.w3.weight, std=std / math.sqrt(2 * self.config.n_layers))
    elif isinstance(module, (LaplaceNorm, LaplaceHeadNorm)):
      nn.init.ones_(module.weight)
    elif isinstance(module, nn.Conv1d):
      bound = 1 / math.sqrt(module.weight.shape[-1])
      nn.init.uniform_(module.weight, -bound, bound)
      nn.init.zeros_(module.bias)
    elif isinstance(module, nn.Embedding):
      nn.init.normal_(module.weight, std=std)
    elif isinstance(module, nn.Linear) and module.weight.shape[0] == self.config.vocab_size:
      nn.init.normal_(module.weight, std=std)  # lm_head

  @classmethod
  def _supports_default_dynamic_cache(cls) -> bool:
    return False  # generate keeps the LaplaceCache the forward returns


class LaplaceModel(LaplacePreTrainedModel):
  def __init__(self, config: LaplaceConfig):
    super().__init__(config)
    self.embed_tokens = nn.Embedding(config.vocab_size, config.d_model)
    self.layers = nn.ModuleList(LaplaceBlock(config, i) for i in range(config.n_layers))
    self.norm = LaplaceNorm(config.d_model, config.norm_eps)
    self.post_init()

  def get_input_embeddings(self):
    return self.embed_tokens

  def set_input_embeddings(self, value):
    self.embed_tokens = value

  def forward(
    self,
    input_ids=None,
    attention_mask=None,
    past_key_values=None,
    inputs_embeds=None,
    use_cache=None,
    **kwargs,
  ):
    if (input_ids is None) == (inputs_embeds is None):
      raise ValueError("pass exactly one of input_ids and inputs_embeds.")
    x = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
    T = x.shape[1]
    use_cache = self.config.use_cache if use_cache is None else use_cache
    cache = past_key_values
    if cache is not None and not isinstance(cache, LaplaceCache):
      raise ValueError(
        f"past_key_values is a {type(cache).__name__}: this model's state is a LaplaceCache (the one its forward "
        "returns), not a key-value cache; pass that, or None."
      )
    if cache is None and use_cache:
      cache = LaplaceCache(self.config.n_layers)
    mask = None
    if attention_mask is not None:
      mask = attention_mask[:, -T:].to(torch.bool)
      if bool(mask.all()):
        mask = None
      elif bool((mask[:, :-1] & ~mask[:, 1:]).any()) or (cache is not None and cache.seen > 0):
        raise ValueError(
          "attention_mask has a 0 after a 1 (or on a token after the prompt): this model takes left padding "
          "only (the pads are read as the zeros a sequence starts from). Pad on the left "
          "(tokenizer.padding_side = 'left'), or run the sequences one at a time."
        )
    for layer in self.layers:
      x = layer(x, cache, mask)
    if cache is not None:
      cache.seen += T
    return BaseModelOutputWithPast(last_hidden_state=self.norm(x), past_key_values=cache)


class LaplaceForCausalLM(LaplacePreTrainedModel, GenerationMixin):
  def __init__(self, config: LaplaceConfig):
    super().__init__(config)
    self.model = LaplaceModel(config)
    self.lm_head = nn.Linear(config.d_model, config.vocab_size, bias=False)
    self.post_init()

  def get_output_embeddings(self):
    return self.lm_head

  def set_output_embeddings(self, value):
    self.lm_head = value

  def forward(
    self, input_ids=None, attention_mask=None, past_key_values=None, labels=None, logits_to_keep=0, **kwargs
  ):
    """LaplaceModel.forward's arguments (inputs_embeds and use_cache in kwargs), and `labels` for the
    shifted cross-entropy, `logits_to_keep` > 0 for the last positions' logits only."""
    return_dict = kwargs.pop("return_dict", None)
    model_args = {k: kwargs[k] for k in ("inputs_embeds", "use_cache") if k in kwargs}
    out = self.model(
      input_ids=input_ids, attention_mask=attention_mask, past_key_values=past_key_values, **model_args
    )
    x = out.last_hidden_state
    if isinstance(logits_to_keep, int) and logits_to_keep > 0:
      x = x[:, -logits_to_keep:]
    logits = self.lm_head(x).float()
    loss = None
    if labels is not None:
      loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1))
    if return_dict is False:
      return tuple(t for t in (loss, logits, out.past_key_values) if t is not None)
    return CausalLMOutputWithPast(loss=loss, logits=logits, past_key_values=out.past_key_values)

  def prepare_inputs_for_generation(
    self, input_ids, past_key_values=None, attention_mask=None, inputs_embeds=None, use_cache=True, **kwargs
  ):
    """Only the positions the state has not consumed: the whole prompt first, then one token per step."""
    if inputs_embeds is not None:
      raise ValueError("generate takes input_ids here (the state counts the positions it consumed).")
    seen = 0 if past_key_values is None else past_key_values.seen
    return {
      "input_ids": input_ids[:, seen:],
      "past_key_values": past_key_values,
      "attention_mask": attention_mask,
      "use_cache": use_cache,
    }
