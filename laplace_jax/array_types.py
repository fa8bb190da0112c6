"""The one array alias of the project's signatures: a jax.Array, a numpy array, a ShapeDtypeStruct (eval_shape)
or, where a pytree of axes stands in for arrays, an int."""

from typing import Any

Array = Any
