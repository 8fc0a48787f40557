"""mhc_jax: a JAX/Flax testbed for training stability of residual-connection designs."""

__version__ = "0.1.0"
