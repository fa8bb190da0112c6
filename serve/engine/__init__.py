"""The serving engine: the compiled slot-table programs, sampling, drafting, the state cache and the
continuous-batching loop. Knows nothing of HTTP; serve/api sits on it."""
