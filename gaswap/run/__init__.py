"""What executes on torch: capture of a training step, op timing, the eager runtime and its streams, the one
training step (optimizers, warm-up, peak meter) and the meters of real memory. Imports `base`, `plan`, `run`
and `gaswap.zoo`."""
