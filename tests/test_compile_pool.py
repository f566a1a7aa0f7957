"""gaswap.compiled.pool: policies of one partition compiled and timed once, compiles in worker processes
loaded from inductor's caches by the measuring process, and what compare does with them."""
import pytest
import torch

from gaswap.app import compare
from gaswap.compiled import pool
from gaswap.compiled.methods import Method
from gaswap.plan.encoding import Chromosome
from gaswap.plan.policy import Policy
from gaswap.plan.problem import Evaluated


class FakePool:
    """A CompilePool standing in for workers: `partitions` reads each policy's partition from `saves`
    (actions -> key, None: unknown), `compile` records the jobs and takes `seconds` each."""

    def __init__(self, saves: dict, seconds: float = 5.0):
        self.saves, self.seconds, self.jobs, self.lines, self.asked = saves, seconds, [], [], []

    def progress(self, line: str) -> None:
        self.lines.append(line)

    def partitions(self, policies: list) -> list:
        self.asked.append(len(policies))
        return [self.saves.get(p.provenance["actions"]) for p in policies]

    def compile(self, jobs: list) -> list:
        self.jobs += [job.label for job in jobs]
        return [self.seconds] * len(jobs)


def _method(label, e, problem, origin="search"):
    m = Method("gaswap", label, None, None, None, recomputed=sum(e.chromosome.actions), origin=origin)
    return m, Policy("f", (), {}, provenance={"actions": e.chromosome.actions})


def test_policies_whose_partitions_save_the_same_are_one_program_across_calls():
    fake = FakePool({(1,): "x", (2,): "y", (3,): "x", (4,): None, (5,): "y"})
    programs = pool.Programs(fake)
    made = [_method("A", Evaluated(Chromosome((0.0,), (k,)), 1.0, 50), None) for k in (1, 2, 3, 4)]
    same = programs.same(made, "finalist")
    assert same[:2] == [None, None] and same[2] is made[0][0] and same[3] is None  # (3,) saves what (1,) does
    said = "  1 of 4 finalists save the same activations as one made before (the same programs): compiled and timed once"
    assert fake.lines == [said]
    later = [_method("B", Evaluated(Chromosome((0.0,), (5,)), 1.0, 50), None)]
    assert programs.same(later, "finalist")[0] is made[1][0]  # remembered from the call before
    fresh = [made[k] for k in (0, 1, 3)]
    programs.compile(fresh, "finalist")
    assert fake.jobs == ["finalist A (1 recomputed)", "finalist A (2 recomputed)", "finalist A (4 recomputed)"]
    assert [m.precompiled_s for m, _ in fresh] == [5.0] * 3 and made[2][0].precompiled_s is None
    alone = pool.Programs(FakePool({(1,): "x"}))
    assert alone.same(made[:1], "finalist") == [None] and alone.pool.asked == []  # one policy: nothing to ask


def test_one_partition_under_other_inductor_settings_is_other_programs():
    fake = FakePool({(1,): "x", (2,): "x", (3,): "x"})
    made = [_method("A", Evaluated(Chromosome((0.0,), (k,)), 1.0, 50), None) for k in (1, 2, 3)]
    made[1][1].provenance["inductor"] = {"order": "demand_first"}
    made[2][1].provenance["inductor"] = {"order": "demand_first"}
    same = pool.Programs(fake).same(made, "finalist")
    assert same[0] is None and same[1] is None and same[2] is made[1][0]  # (2,) and (3,): one order, one program


def test_a_finalists_round_compiles_and_times_each_partition_once_and_a_torch_partitions_name_passes_on():
    def e(k, peak=50):
        return Evaluated(Chromosome((0.0,), (k,)), 1.0 + k / 10, peak)

    measured = {(1,): (40, 1.0), (2,): (30, 2.0), (4,): (20, 1.5)}  # actions -> (peak above resident, seconds)
    timed = []

    def time_methods(methods, rounds, steps, **options):
        timed.append([m.knob for m in methods])
        return [dict(zip(("peak_bytes", "step_s"), measured[(m.recomputed,)]), knob=m.knob) for m in methods]

    def method(label, e_, problem):
        return _method(label, e_, problem, "torch 0.5" if e_.chromosome.actions == (3,) else "search")

    fake = FakePool({(1,): "x", (2,): "y", (3,): "x", (4,): "z"})
    made, lines = {}, []
    chosen, rows, unfit = compare._finalists_round([("A", [e(1), e(2)]), ("B", [e(2), e(3), e(4)])], 1, "p", made,
                                                   method, {"A": 110, "B": 60}, 10, time_methods, lines.append,
                                                   pool.Programs(fake))
    assert timed == [["A #1", "A #2", "B #3"]]  # (3,) runs (1,)'s programs: not compiled, not timed apart
    assert fake.jobs == ["finalist A #1 (1 recomputed)", "finalist A #2 (2 recomputed)", "finalist B #3 (4 recomputed)"]
    assert made[(3,)] == made[(1,)] and made[(1,)][0].origin == "torch 0.5"  # the programs of torch's partition
    assert rows[(3,)] is rows[(1,)] and rows[(1,)]["round"] == 1
    # B: (3,) fits at (1,)'s 40 above resident and time, the fastest there
    assert {label: e_.chromosome.actions for label, e_ in chosen.items()} == {"A": (1,), "B": (3,)}
    assert lines[-1] == "  at B: finalist #1 of #2, #1, #3" and unfit == {}


def _policy(*actions: str) -> Policy:
    return Policy("f", (), {f"t{k}": a for k, a in enumerate(actions)})


class SyncExecutor:
    """A ProcessPoolExecutor standing in for workers: each job done at once in `seconds` (its label recorded)."""

    def __init__(self, *args, **kwargs):
        self.labels = []
        SyncExecutor.last = self

    def submit(self, fn, job):
        from concurrent.futures import Future

        self.labels.append(job.label)
        done = Future()
        done.set_result(3.0 if job.label.startswith("torch") else 2.0)
        return done

    def shutdown(self, **kwargs):
        pass


def test_a_job_submitted_twice_compiles_once_and_answers_with_the_first(monkeypatch):
    monkeypatch.setattr(pool, "ProcessPoolExecutor", SyncExecutor)
    lines = []
    with pool.CompilePool("unused.yaml", 2, lines.append) as workers:
        workers.submit([pool.Job("torch.compile 1", budget=1.0), pool.Job("calibration policy 1", _policy("keep")),
                        pool.Job("again", _policy("keep"))])  # the same policy twice in one call
        seconds = workers.compile([pool.Job("calibration 1", _policy("keep")), pool.Job("other", _policy("recompute")),
                                   pool.Job("torch.compile 1 again", budget=1.0)])
        assert seconds == [2.0, 2.0, 3.0]
        assert SyncExecutor.last.labels == ["torch.compile 1", "calibration policy 1", "other"]
        assert workers.compile([pool.Job("later", _policy("recompute"))]) == [2.0]  # done before: not compiled again
        assert SyncExecutor.last.labels[-1] == "other"
        varied = _policy("keep")
        varied.provenance["inductor"] = {"order": "demand_first"}  # other settings: other programs
        workers.compile([pool.Job("varied", varied)])
        assert SyncExecutor.last.labels[-1] == "varied"
    assert lines[0] == "  compiling 3 in 2 worker processes: torch.compile 1, calibration policy 1, other"


def test_a_rounds_searches_run_at_once_in_the_workers_where_the_ga_runs_in_one_process(monkeypatch):
    from types import SimpleNamespace

    class Workers:  # stands for a CompilePool: maps in "workers", records what it was given
        def __init__(self, answer=True):
            self.asked, self.answer = [], answer

        def map(self, fn, args):
            self.asked.append(len(args))
            return [("there", a[0], fn.keywords["seeds"]) for a in args] if self.answer else None

    seeds = {"torch_1": "c"}
    one_process = SimpleNamespace(ga=SimpleNamespace(workers=1, executor="processes"), seed=0)
    workers = Workers()
    assert compare._searches(["p", "q"], one_process, seeds, workers) == [("there", "p", seeds), ("there", "q", seeds)]
    assert workers.asked == [2]
    searched_here = []

    def here(problem, ga, seed, seeds):
        searched_here.append(problem)
        return ("here", problem)

    monkeypatch.setattr(compare, "search", here)
    assert compare._searches(["p"], one_process, seeds, workers) == [("here", "p")]  # one: no worker asked
    many = SimpleNamespace(ga=SimpleNamespace(workers=2, executor="processes"), seed=0)
    assert compare._searches(["p", "q"], many, seeds, workers) == [("here", "p"), ("here", "q")]  # the GA's own
    assert compare._searches(["p", "q"], one_process, seeds, Workers(answer=False)) == [("here", "p"), ("here", "q")]
    assert compare._searches(["p", "q"], one_process, seeds, None) == [("here", "p"), ("here", "q")]
    assert workers.asked == [2] and searched_here == ["p", "p", "q", "p", "q", "p", "q"]


def test_work_mapped_in_the_workers_comes_back_in_order_or_is_left_to_the_caller(monkeypatch):
    class Executor(SyncExecutor):
        def submit(self, fn, *args):
            from concurrent.futures import Future

            done = Future()
            try:
                done.set_result(fn(*args))
            except Exception as e:  # noqa: BLE001 - as a worker's failure comes back
                done.set_exception(e)
            return done

    monkeypatch.setattr(pool, "ProcessPoolExecutor", Executor)
    workers = pool.CompilePool("unused.yaml", 2, lambda line: None)
    assert workers.map(divmod, [(7, 2), (9, 4)]) == [(3, 1), (2, 1)]
    assert workers.map(divmod, [(7, 0)]) is None and workers.workers == 2  # failed: the caller runs it (and fails)
    assert pool.CompilePool("unused.yaml", 0).map(divmod, [(7, 2)]) is None


def test_each_worker_compiles_kernels_on_twice_its_share_of_the_cpus(monkeypatch):
    for cpus, workers, threads in ((2, 2, 2), (4, 4, 2), (16, 4, 8), (1, 1, 1), (3, 4, 1), (8, 1, 8)):
        monkeypatch.setattr(pool, "_cpus", lambda: cpus)
        assert pool.kernel_threads(workers) == threads


def test_without_workers_the_pool_compiles_nothing_and_says_nothing():
    lines = []
    nothing = pool.CompilePool("unused.yaml", 0, lines.append)
    nothing.submit([pool.Job("torch.compile 1", budget=1.0)])
    assert nothing.compile([pool.Job("a", policy=_policy("keep"))]) == [None]
    assert nothing.partitions(["p", "q"]) == [None, None]
    assert lines == [] and nothing.seconds == {}
    assert pool.default_workers() in (0, *range(2, pool.MAX_WORKERS + 1))


def test_workers_by_default_one_per_cpu_on_a_cpu_and_none_on_a_gpu(monkeypatch):
    for cpus, workers in ((1, 0), (2, 2), (3, 3), (16, pool.MAX_WORKERS)):
        monkeypatch.setattr(pool, "_cpus", lambda: cpus)
        assert pool.default_workers() == pool.default_workers(torch.device("cpu")) == pool.default_workers("cpu")
        assert pool.default_workers("cpu") == workers and pool.default_workers(torch.device("cuda", 0)) == 0


def test_workers_that_cannot_start_leave_the_compiles_to_the_measuring_process(monkeypatch):
    class NoProcesses:
        def __init__(self, *args, **kwargs):
            pass

        def submit(self, fn, *args):
            raise OSError("no processes here")

    monkeypatch.setattr(pool, "ProcessPoolExecutor", NoProcesses)
    lines = []
    workers = pool.CompilePool("unused.yaml", 2, lines.append)
    assert workers.partitions(["p", "q"]) == [None, None] and workers.workers == 0
    assert workers.compile([pool.Job("a", policy=_policy("keep"))]) == [None]
    assert lines == ["  the compile workers stopped; compiling in this process"]


@pytest.mark.slow
def test_a_worker_compiles_into_the_caches_the_measuring_process_loads(tmp_path, fresh_inductor_cache, monkeypatch):
    from torch._dynamo.utils import counters

    from gaswap.base import config
    from gaswap.compiled import dry_compile, methods, partition
    from gaswap.run import training

    # cold for this MLP (the session's own folder, where no other test compiles it), shared with the worker
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(fresh_inductor_cache))
    path = tmp_path / "tiny.yaml"
    path.write_text("model: {factory: 'gaswap.zoo:mlp', kwargs: {sizes: [12, 32, 32, 5]}}\n"
                    "inputs:\n  - {shape: [batch, 12], dtype: float32}\n"
                    "target: {shape: [batch], dtype: int64, high: 5}\nbatch_size: 8\nloss: cross_entropy\n"
                    "optimizer: sgd\nbudget: 0.5x\nsearch_space: compiled\nseed: 0\n")
    exp = config.load_experiment(path)
    device, model, inputs, target, graph = methods.setup(exp)
    provenance = {"optimizer": exp.optimizer, "counts": sorted(exp.counts)}
    keep = partition.make_policy(graph, {}, provenance=provenance)
    recompute = partition.make_policy(graph, {t: "recompute" for t in graph.candidates()}, provenance=provenance)
    lines = []
    with pool.CompilePool(path, 1, lines.append) as workers:
        keys = workers.partitions([keep, recompute, keep])
        assert keys[0] == keys[2] != keys[1] and keys[0][0]  # keep-all saves activations; the same policy, the same
        output_bytes = graph.tensors[graph.loss].size
        written = workers.program_peaks([recompute], output_bytes)[0].result()  # no kernel compiled
        assert written[0] == dry_compile.policy_peak_and_partition(model, recompute, inputs, output_bytes, exp.loss)[0]
        # the searches of several budgets at once in the workers find what they find here, one after another
        from gaswap.plan.problem import Problem
        from gaswap.plan.search import search
        from helpers import unit_costs

        space = config.load_search_space(partition.space_for(device))
        unbounded = Problem(graph, unit_costs(graph), None, space)
        top = unbounded.simulate(unbounded.encoding.uniform(0)).peak_bytes
        problems = [Problem(graph, unit_costs(graph), int(top * share), space) for share in (1.0, 0.9, 0.7)]
        searched = compare.search_settings(exp)
        there = compare._searches(problems, searched, {}, workers)
        here = [search(p, searched.ga, searched.seed) for p in problems]
        assert [[(e.chromosome, e.objectives) for e in r.front] for r in there] == [
            [(e.chromosome, e.objectives) for e in r.front] for r in here]
        workers.submit([pool.Job("torch.compile 0.5", budget=0.5)])
        seconds = workers.compile([pool.Job("keep-all", keep)])
    assert seconds[0] > 0 and set(workers.seconds) == {"keep-all", "torch.compile 0.5"}
    assert lines[0] == "  compiling 2 in 1 worker processes: torch.compile 0.5, keep-all"
    assert len(lines) == 3 and lines[-1].startswith("  compiled ") and "(2 of 2, 0 to go; " in lines[-1]
    counters.clear()
    for name, run in (("gaswap", lambda m: partition.compile(m, keep)),
                      ("torch.compile", lambda m: methods.torch_compiled(m, 0.5))):
        m, optimizer = training.fresh_copy(model, exp.optimizer)
        method = Method(name, "-", m, run(m), optimizer, precompiled_s=1.0)
        methods.warm_up(method, inputs, target, exp.loss, device, lambda line: None)
        assert len(method.programs) == 2  # forward and backward, read from the cache as from a compile
    assert counters["aot_autograd"]["autograd_cache_hit"] == 2 and not counters["aot_autograd"]["autograd_cache_miss"]
    assert torch.isfinite(next(model.parameters())).all()
