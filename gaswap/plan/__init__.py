"""The torch-free planning core: the step graph, costs, chromosomes, the simulator, the problem, the search,
policy files and checkpoints; `solvers/` (baselines, minimum cut, MILP) and `memory/` (the caching allocator's
model, address planning). Imports only `base` and `plan`, never torch."""
