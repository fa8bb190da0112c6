"""Inference over the model's explicit state: text completion with saved states, and the speculative
(draft-verifying) forward. Above the model; never imported by training."""
