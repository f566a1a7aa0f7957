"""gaswap: fit neural-network training into a memory budget (keep / swap / recompute, operator order)."""


def apply(model, policy_path, example_inputs, **kwargs):
    """`model` as a drop-in module training under a policy searched with `loss: external` (see
    `gaswap.runtime.apply`). Warns when this device or thread count is not the one the policy was planned for."""
    from gaswap.runtime import apply as apply_policy

    module = apply_policy(model, policy_path, example_inputs, **kwargs)
    _warn_if_elsewhere(policy_path, kwargs.get("device") or next(model.parameters()).device)
    return module


def apply_step(model, policy_path, example_inputs, example_target, **kwargs):
    """The training step of `model`, loss included, under a policy file (see `gaswap.runtime.apply_step`).
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
