"""The walker on 5-op graphs written as text: exact traces of hooks and bytes, and the faults it names."""
import pytest

from gaswap.base.program import Verb, parse_program
from gaswap.plan.encoding import Action, Encoding
from gaswap.plan.graph import Graph, Op, Tensor
from gaswap.plan.simulator import Simulator
from gaswap.plan.walker import Hooks, ProgramFault, Walker
from helpers import unit_costs

K, S, R = Action.KEEP, Action.SWAP, Action.RECOMPUTE

# x -> f1 -> a (1 B) -> f2 -> b (10 B) -> f3 -> loss; backward b3(loss, b) -> gb, b2(gb, a) -> ga.
# "f2!" is random: it may not be recomputed.
TEXT = """
f1: x -> a
f2!: a -> b
f3: b -> loss
b3: loss b -> gb
b2: gb a -> ga
"""
SIZES = {"x": 100, "a": 1, "b": 10, "loss": 1000, "gb": 10000, "ga": 100000}


def graph_of(text: str, sizes: dict[str, int]) -> Graph:
    """A graph from lines `op: inputs -> outputs` (an op named b... is backward; a trailing ! is random); the
    tensors no op makes are inputs, what a backward op makes and no op reads a gradient, the last forward
    output the loss."""
    ops, tensors = [], {}
    for line in text.strip().splitlines():
        name, _, body = line.partition(":")
        inputs, outputs = (part.split() for part in body.split("->"))
        random_op, name = name.endswith("!"), name.rstrip("!")
        phase = "bwd" if name.startswith("b") else "fwd"
        ops.append(Op(name, name, tuple(inputs), tuple(outputs), phase, recomputable=not random_op, signature=name))
        for t in outputs:
            tensors[t] = Tensor(t, sizes[t], "activation", name)
    read = {t for op in ops for t in op.inputs}
    for op in ops:
        for t in op.inputs:
            tensors.setdefault(t, Tensor(t, sizes[t], "input"))
        for t in op.outputs:
            if op.phase == "bwd" and t not in read:
                tensors[t] = Tensor(t, sizes[t], "grad", op.name)
    loss = [t for op in ops if op.phase == "fwd" for t in op.outputs][-1]
    return Graph(tuple(ops), tensors, loss=loss)


class Recorder(Hooks):
    """Every hook call as a line, with the walker's bytes after it."""

    def __init__(self):
        self.walker, self.lines = None, []

    def record(self, k, what):
        self.lines.append((k, what, self.walker.level))

    def on_run(self, k, op, made):
        self.record(k, f"run {op.name} made {' '.join(made)}")

    def on_recompute(self, k, op, made):
        self.record(k, f"recompute {op.name} made {' '.join(made)}")

    def on_swap_out(self, k, tensor):
        self.record(k, f"swap_out {tensor}")

    def on_retire(self, k, tensor):
        self.record(k, f"retire {tensor}")

    def on_swap_in(self, k, tensor):
        self.record(k, f"swap_in {tensor}")

    def on_free(self, k, tensor, retired):
        self.record(k, f"free {tensor}{' (retired copy)' if retired else ''}")


def walk(program: str, graph=None):
    recorder = Recorder()
    recorder.walker = Walker(graph or graph_of(TEXT, SIZES), recorder)
    recorder.walker.walk(parse_program(program.strip().splitlines()))
    return recorder


def test_a_program_with_a_swap_and_a_recompute_gives_this_trace():
    r = walk("""
run f1
run f2
swap_out b
run f3
retire b
free a
free b
swap_in b
run b3
recompute f1
run b2
free gb
free b
free a
""")
    assert r.lines == [
        (0, "run f1 made a", 101), (1, "run f2 made b", 111), (2, "swap_out b", 111), (3, "run f3 made loss", 1111),
        (4, "retire b", 1111), (5, "free a", 1110), (6, "free b (retired copy)", 1100), (7, "swap_in b", 1110),
        (8, "run b3 made gb", 11110), (9, "recompute f1 made a", 11111), (10, "run b2 made ga", 111111),
        (11, "free gb", 101111), (12, "free b", 101101), (13, "free a", 101100)]
    assert (r.walker.peak, r.walker.ran, r.walker.unfreed()) == (111111, ["f1", "f2", "f3", "b3", "b2"], [])


def test_a_tensor_retired_twice_holds_two_copies_freed_oldest_first():
    r = walk("""
run f1
swap_out a
retire a
recompute f1
retire a
free a
free a
""")
    assert [what for _, what, _ in r.lines[3:]] == ["recompute f1 made a", "retire a", "free a (retired copy)",
                                                    "free a (retired copy)"]
    assert [level for *_, level in r.lines] == [101, 101, 101, 102, 102, 101, 100]
    assert r.walker.retired == {} and r.walker.device == {"x"}


@pytest.mark.parametrize("program, line, problem", [
    ("run f2", 1, "reads a, which the program has not kept, swapped in or recomputed"),
    ("run f1\nrun f1", 2, "runs f1 a second time"),
    ("run f1\nrun f2\nrecompute f2", 3, "f2 cannot be recomputed there (not yet run, a backward op, random or stateful)"),
    ("recompute f1", 1, "f1 cannot be recomputed there"),
    ("run f1\nswap_in a", 2, "'a' is not where this instruction needs it"),
    ("run f1\nretire a", 2, "'a' is not where this instruction needs it"),
    ("run f1\nfree a\nfree a", 3, "'a' is not where this instruction needs it"),
    ("run f1\nswap_out a\nretire a\nrun f2", 4, "reads a, which the program has not kept"),
    ("run g7", 1, "this graph has no op 'g7'"),
])
def test_an_instruction_that_does_not_fit_is_refused_by_line(program, line, problem):
    with pytest.raises(ProgramFault, match=f"^program line {line} \\(") as fault:
        walk(program)
    assert fault.value.line == line and fault.value.problem.startswith(problem)


def test_what_a_program_never_frees_is_named():
    walker = walk("run f1\nrun f2\nrun f3").walker
    assert walker.unfreed() == ["a", "b"]  # the loss lives to the end of the step


def chain_of_five() -> Graph:
    return graph_of("""
f1: x -> a
f2: a -> b
f3: b -> loss
b3: loss b -> gb
b2: gb a -> ga
""", SIZES)


@pytest.mark.parametrize("actions", [(K, K), (S, S), (R, K), (K, R), (S, R), (R, S)])
def test_the_simulator_builds_its_program_through_the_walker_and_both_count_the_same_bytes(actions):
    graph = chain_of_five()
    enc = Encoding(graph)
    result = Simulator(graph, unit_costs(graph)).run(enc.decode(enc.captured_keys()), actions, trace=True)
    walker = Walker(graph).walk(result.program)
    assert result.valid and walker.peak == result.peak_bytes and walker.unfreed() == []
    swapped = {t for t, a in zip(enc.candidates, actions) if a == S}
    assert {name for verb, name in result.program if verb == Verb.SWAP_OUT} == swapped


def test_every_verb_has_its_step_and_its_hook():
    walker = Walker(chain_of_five())
    assert set(walker.verbs) == set(Verb)
    assert all(callable(getattr(Hooks, "on_" + verb.value)) for verb in Verb)
