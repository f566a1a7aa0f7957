"""gaswap: fit neural-network training into a memory budget (keep / swap / recompute, operator order)."""


def apply(model, policy_path, example_inputs, **kwargs):
    """`model` as a drop-in module training under a policy searched with `loss: external` (see
    `gaswap.runtime.apply`)."""
    from gaswap.runtime import apply as apply_policy

    return apply_policy(model, policy_path, example_inputs, **kwargs)


def apply_step(model, policy_path, example_inputs, example_target, **kwargs):
    """The training step of `model`, loss included, under a policy file (see `gaswap.runtime.apply_step`)."""
    from gaswap.runtime import apply_step as apply_policy_step

    return apply_policy_step(model, policy_path, example_inputs, example_target, **kwargs)
