"""The geometry room: the wind-tunnel papers' Bayesian geometry and its nulls (docs/windtunnel_results.md).

``probes`` (numpy arithmetic on extracted arrays), ``readout`` (a model's intermediates and
weights into the project's probes and the papers' definitions), ``frame`` (the authors' formation
statistics: entropy MAE, Jacobian-lens frame overlap, the learned gate), ``series`` (one row per
checkpoint, and the formation rule), ``plots`` (the figures). ``mhc-jax eval`` drives them.
"""
