"""Which layout inductor gives the ConvNeXt-style net's backward convolutions, policy by policy (issue 34, item 1;
`step_model.CompiledProblem.plain_backward`): keep-all, then each candidate whose recomputation runs a forward
convolution recomputed alone (everything else kept), each written by inductor without compiling its kernels
(`dry_compile.programs_of`); per policy, the layout term's value and the strides of the gradient each of the
backward's `convolution_backward` calls takes, in program order ((1024, 16, 4, 1): laid out plainly; (1024, 1, 256,
64): channels-last). Run from the repository root, one thread:
    PYTHONPATH=. python results/compare_new_models/backward_layout_probe.py > results/compare_new_models/backward_layout_probe.txt
"""
import re

from gaswap.base import config
from gaswap.compiled import dry_compile, methods, partition, step_model
from gaswap.plan.encoding import Action, Chromosome
from gaswap.run.measure import measure

FOLDER = "results/compare_new_models"


def gradient_strides(problem, model, graph, inputs, provenance, chromosome) -> list[str]:
    """The strides of the gradient each `convolution_backward` call of the backward program takes."""
    policy = partition.make_policy(graph, problem.actions_of(chromosome), provenance=provenance)
    backward = next(p for p in dry_compile.programs_of(model, partition.backend(policy), *inputs) if p.is_backward)
    strides = []
    for line in backward.body:
        m = re.search(r"convolution_backward\.default\((?:reinterpret_tensor\((\w+), \([\d, ]+\), (\([\d, ]+\))|(\w+))",
                      line)
        if m:
            strides.append(m.group(2) or str(backward.layouts[m.group(3)].stride))
    return strides


def main() -> None:
    exp = config.load_experiment(f"{FOLDER}/convnext.yaml")
    device, model, inputs, target, graph = methods.setup(exp, "cpu")
    costs = measure(graph, device, f"{FOLDER}/convnext_13b4ea4/costs", threads=1)
    problem = step_model.CompiledProblem(graph, costs, None, config.load_search_space(partition.space_for(device)),
                                         loss=exp.loss)
    provenance = {"optimizer": exp.optimizer, "counts": sorted(exp.counts)}
    keep = problem.encoding.uniform(Action.KEEP)
    policies = [("keep-all", keep)]
    for k in problem._convolutions:
        actions = list(keep.actions)
        actions[k] = int(Action.RECOMPUTE)
        policies.append((f"{problem.encoding.candidates[k]} recomputed",
                         problem.canonical(Chromosome(keep.keys, tuple(actions)))))
    for name, chromosome in policies:
        strides = gradient_strides(problem, model, graph, inputs, provenance, chromosome)
        print(f"{name}: plain_backward {problem.plain_backward(chromosome):g}; the backward's convolution gradients "
              + "; ".join(strides), flush=True)


if __name__ == "__main__":
    main()
