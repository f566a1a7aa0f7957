"""gaswap: fit neural-network training into a memory budget (keep / swap / recompute, operator order).

One flat package in three layers; a module imports only from its own layer or those below
(tests/test_layers.py checks it, and that the floors below the torch side never import torch):

- the floor: `program` (Action, Verb, Instruction: the vocabulary every module speaks), `step` (losses,
  optimizers, autocast dtypes and their defaults), `files` (bounded reading, atomic writing), `units` (how
  sizes are shown) and `locate` (experiment files and factory modules from any folder);
- the torch-free planning core: `graph`, `costs`, `encoding`, `simulator`, `problem` (Problem, Evaluated,
  SearchResult), `parallel`, `checkpoint`, `search`, `baselines`, `milp`, `policy`, `costfile` (the costs a
  search used), `planned` (whether a policy runs on the device it was planned for), `allocator` (the CUDA
  caching allocator's model), `blocks` (identical blocks sharing one policy), `mincut` (torch-style minimum-cut
  policies, a seed of the search);
- the torch side: `capture`, `dropout` (masks drawn as eager draws them), `measure`, `memory`, `runtime`,
  `streams` (the runtime's copy streams), `zoo`, `arena`, `arena_runtime`, `compiled` (policies inside
  torch.compile), `compiled_costs` (the compiled step's cost and memory model), `compiled_program` (the
  memory of inductor's generated programs), `meter` (peak memory measured independently of gaswap) (and any
  module not named here);
- the application: `config`, `experiment` (an experiment's model and inputs), `results`, `signals`, `workflow`,
  `validate`, `compiled_validate`, `report`, `bench`, `speed`, `compare`, `gpu_memory`, `gpu_check`, `cli`.

A flat package rather than sub-packages: every import path users and notebooks know (`gaswap.search`,
`gaswap.policy`, ...) stays, and the layers are enforced by a test instead of by folders.
"""


def apply(model, policy_path, example_inputs, **kwargs):
    """`model` as a drop-in module training under a policy searched with `loss: external` (see
    `gaswap.runtime.apply`).

    `example_inputs` is one batch of what the model's forward takes: a tensor, or a tuple of tensors for a
    forward with several positional inputs, with the shapes and dtypes the policy was searched for (the
    experiment's `inputs` at its `batch_size`; values do not matter, device is the model's). They are used to
    capture the step and are refused, saying what differs, if they are not those of the policy. Warns when
    this device or thread count is not the one the policy was planned for."""
    from gaswap.runtime import apply as apply_policy

    module = apply_policy(model, policy_path, example_inputs, **kwargs)
    _warn_if_elsewhere(policy_path, kwargs.get("device") or next(model.parameters()).device)
    return module


def apply_step(model, policy_path, example_inputs, example_target, **kwargs):
    """The training step of `model`, loss included, under a policy file (see `gaswap.runtime.apply_step`).
    `example_inputs` (a tensor or a tuple of tensors: one batch of the forward's positional inputs) and
    `example_target` (one batch of the loss target) have the shapes and dtypes the policy was searched for.
    Warns when this device or thread count is not the one the policy was planned for."""
    from gaswap.runtime import apply_step as apply_policy_step

    step = apply_policy_step(model, policy_path, example_inputs, example_target, **kwargs)
    _warn_if_elsewhere(policy_path, kwargs.get("device") or next(model.parameters()).device)
    return step


def _warn_if_elsewhere(policy_path, device) -> None:
    import warnings

    from gaswap import planned, policy
    from gaswap.measure import device_name

    message = planned.mismatch(policy.load(policy_path).provenance, device_name(device))
    if message:
        warnings.warn(message, stacklevel=3)
