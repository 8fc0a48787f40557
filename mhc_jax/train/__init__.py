"""Training: config, optimiser, state, sharding (mesh + logical axis rules), step, loop, checkpoints."""
