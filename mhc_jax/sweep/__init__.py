"""Sweeps: grid expansion, the resumable runner, populations and the report."""
