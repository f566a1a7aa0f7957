"""Train an experiment's model on synthetic data with and without a policy; print both loss curves.

    python experiments/train_with_policy.py results/tiny_cnn_cpu/policy.yaml --steps 300

Both runs start from the same weights and see the same batches. The plain run is eager PyTorch
(`criterion(model(x), y).backward()`). With a policy searched with `loss: external` the other run is the
same loop with the model replaced by `gaswap.apply(model, policy, inputs)`, the criterion being mean
squared error to random targets shaped like the output (the experiment has no target); with any other
policy `gaswap.apply_step` replaces forward, loss and backward.
The peaks are measured on one step of each (CUDA: the allocator; CPU: gaswap's storage tracker).
"""
from __future__ import annotations

import argparse
import sys

import torch
import torch.nn.functional as F

import gaswap
from gaswap import zoo
from gaswap.app.validate import OPTIMIZERS
from gaswap.base import config
from gaswap.base.config import format_size  # decimal units (MB); GASWAP_UNITS=binary for MiB
from gaswap.base.locate import experiment_file
from gaswap.plan import policy as policies
from gaswap.run import experiment
from gaswap.run.measure import resolve_device
from gaswap.run.step_memory import DeviceMemory

LOSSES = {
    "cross_entropy": lambda out, y: F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1)),
    "mse": F.mse_loss,
    "sum": lambda out, y: out.sum(),
    "external": F.mse_loss,  # the criterion is the user's: here, regression onto random targets
}


def batches(exp, device, count: int):
    """`count` fixed synthetic batches (inputs, target), cycled through by both runs."""
    gen = torch.Generator(device).manual_seed(exp.seed)
    data = [experiment.make_inputs(exp, str(device), gen) for _ in range(count)]
    if exp.loss == "external":
        shape = experiment.build_model(exp)(*experiment.make_inputs(exp)[0]).shape  # on the meta device
        data = [(inputs, torch.randn(shape, device=device, generator=gen)) for inputs, _ in data]
    return data


def train(exp, device, data, steps, step_fn):
    """Train a fresh copy of the model (same seed) for `steps`; return (losses, peak bytes of step 2)."""
    torch.manual_seed(exp.seed)
    model = experiment.build_model(exp, device=str(device))
    optimizer = OPTIMIZERS[exp.optimizer]([p for p in model.parameters() if p.requires_grad])
    run = step_fn(model, data[0])
    losses, peak = [], None
    for k in range(steps):
        inputs, target = data[k % len(data)]
        if k == 2:  # the batch is copied inside the measured step, so both runs count it the same way
            with DeviceMemory(device) as memory:
                memory.hold([*model.parameters(), *model.buffers(),
                             *[t for s in optimizer.state.values() for t in s.values() if isinstance(t, torch.Tensor)]])
                loss = run([x.clone() for x in inputs], target.clone())
            peak = memory.peak
        else:
            loss = run([x.clone() for x in inputs], target.clone())
        losses.append(float(loss))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return losses, peak


def eager(exp):
    def make(model, example):
        def run(inputs, target):
            loss = LOSSES[exp.loss](model(*inputs), target)
            loss.backward()
            return loss.detach()
        return run
    return make


def with_policy(exp, policy_path):
    def make(model, example):
        inputs, target = example
        if exp.loss == "external":  # the module form: the eager loop, with the model replaced
            return eager(exp)(gaswap.apply(model, policy_path, inputs), example)
        step = gaswap.apply_step(model, policy_path, inputs, target)
        return lambda inputs, target: step(*inputs, target)
    return make


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("policy", help="a policy file, e.g. results/tiny_cnn_cpu/policy.yaml")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--every", type=int, default=25, help="print the losses every this many steps")
    parser.add_argument("--trust-factory", action="store_true",
                        help="build the model the policy's experiment names even when it is not one of gaswap's zoo")
    args = parser.parse_args()
    policy = policies.load(args.policy)
    exp = config.load_experiment(experiment_file(policy.provenance, args.policy, f"{args.policy}: experiment_file"))
    if not zoo.shipped(exp.model.factory) and not args.trust_factory:  # a shared policy must not pick code to run
        sys.exit(f"error: {args.policy}: its experiment builds the model with {exp.model.factory}, code named only "
                 f"by the policy file; pass --trust-factory if you trust it")
    device = resolve_device("auto")
    data = batches(exp, device, 4)
    plain, plain_peak = train(exp, device, data, args.steps, eager(exp))
    ours, our_peak = train(exp, device, data, args.steps, with_policy(exp, args.policy))
    print(f"{exp.name} on {device}: {args.steps} steps, {exp.optimizer}, batch {exp.batch_size}")
    print(f"{'step':>6}  {'eager loss':>11}  {'policy loss':>11}")
    for k in range(0, args.steps, args.every):
        print(f"{k:>6}  {plain[k]:>11.5f}  {ours[k]:>11.5f}")
    print(f"{args.steps - 1:>6}  {plain[-1]:>11.5f}  {ours[-1]:>11.5f}")
    budget = policy.provenance.get("budget_bytes")
    print(f"peak memory: eager {format_size(plain_peak)}, with the policy {format_size(our_peak)} "
          f"(predicted {format_size(policy.predicted['peak_bytes'])}, budget {format_size(budget)})")
    swapped = [t for t, a in policy.actions.items() if a == "swap" and t.startswith("input")]
    if swapped:
        print(f"note: the policy swaps {', '.join(swapped)} out, but this loop still holds the batch while the step "
              f"runs, so that memory stays; `python -m gaswap validate` hands the batch over to the step")


if __name__ == "__main__":
    main()
