"""How the served weights may be held, apart from the loader so that the command line's flags (their choices)
import no JAX."""

PARAMS_DTYPES = (
  "compute",
  "param",
)  # the preset's compute dtype, or as stored (serve.slots.loading.cast_params)
