"""A residual mixer outside mhc_jax (examples/my_mixer/README.md)."""

__version__ = "0.1.0"
