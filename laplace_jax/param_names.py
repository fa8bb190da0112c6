"""The parameter names the sharding layout, the optimizer split and the counts key on: which leaves are the
2-D hidden matrices Muon takes. Imports nothing, so the model config can name them without JAX."""

MUON_PARAM_NAMES = ("w_qkvg", "w_out", "w1", "w2", "w3")  # the 2-D hidden matrices of each GLA layer
ATTENTION_MUON_NAMES = ("w_qkv", "w_o")  # an attention layer's instead of w_qkvg, w_out
