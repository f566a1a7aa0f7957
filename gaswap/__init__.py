"""gaswap: fit neural-network training into a memory budget (keep / swap / recompute, operator order).

The packages are the architecture; a package imports only from those above it in this list
(tests/test_layers.py reads every import, relative and inside functions, and fails on one that breaks it):

- `base`: the torch-free floor (program vocabulary, files, units, signals, training options, the experiment
  schema, the exception hierarchy);
- `plan`: the torch-free planning core (graph, costs, encoding, simulator, problem, search, policy files,
  checkpoints), with `plan.solvers` (baselines, minimum cut, MILP) and `plan.memory` (allocator model, arena);
- `zoo`: the built-in models (experiment files name `gaswap.zoo:`);
- `run`: what executes on torch (capture, op timing, the eager runtime, the training step, meters);
- `compiled`: the torch.compile path (partition; `step_model` is torch-free);
- `app`: the verbs, results folders and reports.

The flat paths of gaswap 0.1 (`gaswap.search`, `gaswap.policy`, ...) still import, with a DeprecationWarning,
until gaswap 0.3 (`gaswap._moved`).
"""
import importlib

from gaswap import _moved



def apply(model, policy_path, example_inputs, **kwargs):
    """`model` as a drop-in module training under a policy searched with `loss: external` (see
    `gaswap.run.runtime.apply`).

    `example_inputs` is one batch of what the model's forward takes: a tensor, or a tuple of tensors for a
    forward with several positional inputs, with the shapes and dtypes the policy was searched for (the
    experiment's `inputs` at its `batch_size`; values do not matter, device is the model's). They are used to
    capture the step and are refused, saying what differs, if they are not those of the policy. Warns when
    this device or thread count is not the one the policy was planned for."""
    # imported when called: `import gaswap` loads no torch
    from gaswap.run.runtime import apply as apply_policy

    module = apply_policy(model, policy_path, example_inputs, **kwargs)
    _warn_if_elsewhere(policy_path, kwargs.get("device") or next(model.parameters()).device)
    return module


def apply_step(model, policy_path, example_inputs, example_target, **kwargs):
    """The training step of `model`, loss included, under a policy file (see `gaswap.run.runtime.apply_step`).
    `example_inputs` (a tensor or a tuple of tensors: one batch of the forward's positional inputs) and
    `example_target` (one batch of the loss target) have the shapes and dtypes the policy was searched for.
    Warns when this device or thread count is not the one the policy was planned for."""
    # imported when called: `import gaswap` loads no torch
    from gaswap.run.runtime import apply_step as apply_policy_step

    step = apply_policy_step(model, policy_path, example_inputs, example_target, **kwargs)
    _warn_if_elsewhere(policy_path, kwargs.get("device") or next(model.parameters()).device)
    return step


def _warn_if_elsewhere(policy_path, device) -> None:
    import warnings

    # imported when called: `import gaswap` loads no torch
    from gaswap.plan import planned, policy
    from gaswap.run.measure import device_name

    message = planned.mismatch(policy.load(policy_path).provenance, device_name(device))
    if message:
        warnings.warn(message, stacklevel=3)


def __getattr__(name: str):
    """`gaswap.<old flat module>` as an attribute (see `gaswap._moved`)."""
    if name in _moved.MOVED:
        return importlib.import_module(_moved.new_home(name))
    raise AttributeError(f"module 'gaswap' has no attribute {name!r}")


_moved.install()
