"""Moved to :mod:`mhc_jax.geometry.plots`; this name stays for the studies' scripts that import it."""

from mhc_jax.geometry.plots import *  # noqa: F403
