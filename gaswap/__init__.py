"""gaswap: fit neural-network training into a memory budget (keep / swap / recompute, operator order)."""


def apply(model, policy_path, example_inputs, example_target, **kwargs):
    """The training step of `model` under a policy file (see `gaswap.runtime.apply`)."""
    from gaswap.runtime import apply as apply_policy

    return apply_policy(model, policy_path, example_inputs, example_target, **kwargs)
