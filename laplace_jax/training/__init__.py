"""Training: the optimizers (Muon distributed by all_to_all, AdamW), the sharded train step and its state,
and Orbax checkpoints and exports. Above the model; never imported by inference."""
