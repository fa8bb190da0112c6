"""Compiling for the tests that read bytes moved from optimised HLO (laplace_jax/analysis/hlo_bytes.py): with XLA's own
CPU fusion emitters, which the suite's FAST_COMPILE (tests/conftest.py) turns off to compile faster, so the
HLO these tests check is the one benchmarks/ measure. Collectives (hlo_traffic) do not depend on them."""

XLA_DEFAULTS = {"xla_cpu_use_fusion_emitters": True}


def compile_as_benchmarks(lowered):
  """`lowered.compile()` with XLA's default CPU emitters, whatever XLA_FLAGS says."""
  return lowered.compile(compiler_options=XLA_DEFAULTS)
