"""laplace-jax: the Laplace simple-GLA language model in JAX/Flax.

The library in tiers, each importing only those before it (tests/library/test_layering.py checks it):
  platform, sharding, fsdp, cli   the root: backends and simulated devices, the one mesh and its layouts, the
                                  FSDP collectives, the command lines' flag style
  analysis/                       instruments over compiled programs (HLO bytes and traffic, Neuron check)
  data/                           tokenizer, grain pipeline, synthetic recall tasks
  ops/                            kernels: chunked / single-step GLA, attention, short conv, segments,
                                  context parallelism
  model/                          config and presets, mixers, decode state, the decoder, counts
  inference/, training/           completion and speculative forward; optimizers, train step, checkpoints
The modules gla, config, generate, checkpoint, tokenizer, state and muon at this level are deprecated aliases
of their new homes (ops.gla, model.config, inference.generate, training.checkpoint, data.tokenizer,
model.state, training.muon).
"""

from laplace_jax.model.config import PRESETS, LaplaceConfig, get_config  # noqa: F401

__version__ = "0.1.0"
