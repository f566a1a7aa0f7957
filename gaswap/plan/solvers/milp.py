"""The exact keep/recompute optimum of a small graph: a MILP solved by HiGHS (scipy), and brute force.

Policy class: the captured op order and one action per candidate, KEEP or RECOMPUTE (the `recompute_only`
search space). The formulation is the simulator run symbolically, so its optimum is the simulator's:

- a binary x_k per candidate that may be recomputed (1 = RECOMPUTE);
- every "is tensor t on the device" of the simulator becomes a literal (a constant, or a [0, 1] variable
  tied to the x by exact AND/OR linearisations: z <= a, z <= b, z >= a + b - 1), updated where the simulator
  updates it: allocation when an op runs, the free after the last forward reader (when x_t), the free after
  the last reader, and the frees of a recomputation;
- every `rematerialize` the simulator could reach becomes an event guarded by a literal g (g = parent guard
  AND t absent), explored with its inputs as the simulator explores them; events that provably cannot
  happen are pruned;
- at each op run (event), memory after its outputs are allocated <= budget + M (1 - g);
- objective: the compute time of all op runs, sum of op_time * g (recompute-only steps have no copies, so
  the step time is the compute time), handed to HiGHS in microseconds and solved to a zero relative gap:
  in seconds, HiGHS's absolute gap tolerance (1e-6) and its default relative gap (1e-4) let it declare
  "optimal" a policy slower than the optimum (tests/test_milp.py shows such a case). The result reports
  the proven lower bound and the gap to it; a warm start (say, the GA's best policy) bounds the objective
  from above so the search only looks for better.

Only the x are integer: every other variable is forced by them. The returned policy is simulated again and
the result says whether the simulator agrees (`verified`). Swapping is not formulated: its just-in-time
prefetch depends on continuous start times and on waiting for room, which no linear model states exactly;
`brute_force` covers keep/swap/recompute on tiny graphs. No torch here.
"""
from __future__ import annotations

import itertools
import math
import time
from dataclasses import dataclass

from gaswap.base.errors import GaswapError
from gaswap.plan.costs import Costs
from gaswap.plan.encoding import Action, Chromosome, Encoding
from gaswap.plan.graph import Graph
from gaswap.plan.problem import Problem
from gaswap.plan.simulator import SimResult, liveness

MAX_EVENTS = 20000  # op runs the formulation may hold before it is declared too large
SCALE = 1e6  # objective units per second handed to the solver (microseconds)


@dataclass(frozen=True)
class MilpResult:
    """The best policy the MILP found, how it was solved and what the simulator says of it."""

    status: str  # "optimal", "time limit", "infeasible", "too large"
    chromosome: Chromosome | None
    step_time: float  # the MILP's objective (inf when no policy)
    seconds: float  # formulation and solve
    binaries: int
    variables: int
    constraints: int
    simulated: SimResult | None = None  # the returned policy, simulated
    bound: float = 0.0  # proven lower bound on the step time (s)
    warm_start: bool = False  # the returned policy is the warm start: the solver found none better

    @property
    def gap(self) -> float:
        """(step time - bound) / step time: 0 when proven optimal; inf when no policy."""
        if self.chromosome is None or self.step_time <= 0:
            return math.inf if self.chromosome is None else 0.0
        return max(0.0, (self.step_time - self.bound) / self.step_time)

    @property
    def verified(self) -> bool:
        """The simulator reproduces the MILP's step time for the policy it returned."""
        s = self.simulated
        return s is not None and s.valid and abs(s.step_time - self.step_time) <= 1e-9 * max(1.0, s.step_time)


class TooLarge(GaswapError):
    """The symbolic simulation needs more events than MAX_EVENTS."""


def solve(graph: Graph, costs: Costs, budget: int, *, time_limit: float = 60.0,
          warm_start: Chromosome | None = None, node_limit: int | None = None, rel_gap: float = 0.0) -> MilpResult:
    """The fastest keep/recompute policy in the captured order whose peak fits `budget` bytes.

    `warm_start`: a known policy (e.g. the GA's best); where it is a keep/recompute policy in the captured
    order that fits, the solver looks only for policies at least as fast, and it is returned when the solver
    finds none (within the time limit) — `warm_start` True in the result. `node_limit` (branch-and-bound
    nodes) and `rel_gap` (relative MIP gap) stop the solver earlier, status "time limit" when it stopped short.
    """
    started = time.perf_counter()
    problem = Problem(graph, costs, budget, actions=(Action.KEEP, Action.RECOMPUTE))
    encoding = problem.encoding
    try:
        model = _Model(problem)
    except TooLarge:
        return MilpResult("too large", None, float("inf"), time.perf_counter() - started, 0, 0, 0)
    sizes = (len(model.x), len(model.defs), len(model.rows))
    incumbent = _usable(problem, warm_start)
    cutoff = None if incumbent is None else incumbent.step_time - model.constant
    if model.impossible:
        status, values, objective, bound = "infeasible", None, 0.0, math.inf
    else:
        status, values, objective, bound = _highs(model, time_limit, cutoff=cutoff, rel_gap=rel_gap,
                                                  node_limit=node_limit)
    bound += model.constant
    if values is None:
        if incumbent is not None:  # nothing at least as fast found: the warm start stands
            return MilpResult("optimal" if status == "infeasible" else status, incumbent.chromosome,
                              incumbent.step_time, time.perf_counter() - started, *sizes,
                              simulated=problem.simulate(incumbent.chromosome),
                              bound=incumbent.step_time if status == "infeasible" else bound, warm_start=True)
        return MilpResult(status, None, math.inf, time.perf_counter() - started, *sizes)
    actions = [Action.KEEP] * len(encoding.candidates)
    for k, v in model.x.items():
        actions[k] = Action.RECOMPUTE if values[v] > 0.5 else Action.KEEP
    chromosome = Chromosome(encoding.captured_keys(), tuple(int(a) for a in actions))
    return MilpResult(status, chromosome, model.constant + objective, time.perf_counter() - started, *sizes,
                      simulated=problem.simulate(chromosome), bound=min(bound, model.constant + objective))


def _usable(problem: Problem, c: Chromosome | None):
    """`c` evaluated, when it is a keep/recompute policy in the captured order that fits; else None."""
    if c is None or c.keys != problem.encoding.captured_keys() or len(c.actions) != len(problem.encoding.allowed):
        return None
    if any(a not in allowed for a, allowed in zip(c.actions, problem.encoding.allowed)):
        return None
    e = problem.evaluate(c)
    return e if problem.violation(e) == 0 else None


def _highs(model: "_Model", time_limit: float, *, scale: float = SCALE, rel_gap: float = 0.0,
           cutoff: float | None = None, node_limit: int | None = None):
    """(status, variable values or None, objective, lower bound) of the model's variable part, in seconds,
    solved by HiGHS with the objective in units of 1/`scale` s to a relative gap `rel_gap` (None: HiGHS's
    default); `cutoff` bounds the objective from above (status "infeasible" when nothing is that good)."""
    from scipy.optimize import Bounds, LinearConstraint, milp
    from scipy.sparse import coo_array

    n, rows = len(model.defs), list(model.rows)
    if n == 0:
        return "optimal", [], 0.0, 0.0
    objective = [model.objective.get(v, 0.0) * scale for v in range(n)]
    if cutoff is not None:  # a little slack: the warm start itself must stay feasible
        rows.append(({v: c for v, c in enumerate(objective) if c}, -math.inf, cutoff * scale * (1 + 1e-9) + 1e-6))
    entries = [(r, v, c) for r, (coefs, _, _) in enumerate(rows) for v, c in coefs.items()]
    row_ids, cols, data = zip(*entries) if entries else ((), (), ())
    matrix = coo_array((data, (row_ids, cols)), shape=(len(rows), n)).tocsr()
    constraints = [LinearConstraint(matrix, [r[1] for r in rows], [r[2] for r in rows])] if rows else []
    integrality = [1 if d is None else 0 for d in model.defs]
    options = {"time_limit": time_limit, "disp": False}
    if rel_gap is not None:
        options["mip_rel_gap"] = rel_gap
    if node_limit is not None:
        options["node_limit"] = node_limit
    res = milp(objective, constraints=constraints, integrality=integrality, bounds=Bounds(0, 1), options=options)
    bound = getattr(res, "mip_dual_bound", None)
    bound = -math.inf if bound is None or not math.isfinite(bound) else bound / scale
    if res.x is None:
        return ("infeasible" if res.status == 2 else "time limit"), None, 0.0, bound
    return ("optimal" if res.status == 0 else "time limit"), res.x, res.fun / scale, bound


def brute_force(graph: Graph, costs: Costs, budget: int, actions=(Action.KEEP, Action.RECOMPUTE),
                *, limit: int = 1 << 16) -> tuple[Chromosome, SimResult] | None:
    """The fastest policy (then the lowest peak) in the captured order under `budget`, trying every
    combination of `actions` the candidates allow; None when none fits. Refuses more than `limit` policies."""
    encoding = Encoding(graph, actions)
    count = 1
    for allowed in encoding.allowed:
        count *= len(allowed)
    if count > limit:
        raise ValueError(f"{count} policies to enumerate, more than the limit {limit}")
    problem = Problem(graph, costs, budget, actions=actions)
    sim = problem.simulator
    keys = encoding.captured_keys()
    order = problem.order(Chromosome(keys, ()))
    best = None
    for combo in itertools.product(*encoding.allowed):
        r = sim.run(order, combo)
        if r.valid and r.peak_bytes <= budget and (best is None or (r.step_time, r.peak_bytes) <
                                                   (best[1].step_time, best[1].peak_bytes)):
            best = (Chromosome(keys, tuple(int(a) for a in combo)), r)
    return best


class _Model:
    """The simulator's captured-order run, symbolically: literals, events and the MILP rows they imply.

    A literal is True, False, or an int: 2 v for variable v, 2 v + 1 for (1 - v). `defs[v]` is None for an
    x variable and (a, b) for v = a AND b. `rows` are (coefficients by variable, lower, upper).
    """

    def __init__(self, problem: Problem):
        self.sim = sim = problem.simulator
        self.budget = problem.budget
        encoding = problem.encoding
        self.defs: list[tuple[int, int] | None] = []
        self.rows: list[tuple[dict[int, float], float, float]] = []
        self.objective: dict[int, float] = {}
        self.constant = 0.0  # compute time of the op runs that always happen
        self.impossible = False  # some op runs over the budget (or is unrealizable) whatever the policy
        self.events = 0
        self._and: dict[tuple[int, int], int] = {}
        self._implied: dict = {}
        tid = {t: k for k, t in enumerate(sim.tensor_names)}
        self.x: dict[int, int] = {}  # candidate index -> variable
        self.x_lit: dict[int, int] = {}  # tensor id -> literal of its x
        for k, (name, allowed) in enumerate(zip(encoding.candidates, encoding.allowed)):
            if Action.RECOMPUTE in allowed:
                self.x[k] = len(self.defs)
                self.x_lit[tid[name]] = 2 * len(self.defs)
                self.defs.append(None)
        self.run_order(encoding.decode(encoding.captured_keys()))

    # --- literals ---
    def AND(self, a, b):
        if a is False or b is False:
            return False
        if a is True:
            return b
        if b is True or a == b:
            return a
        if a == b ^ 1:
            return False
        key = (min(a, b), max(a, b))
        if key not in self._and:
            z = 2 * len(self.defs)
            self.defs.append(key)
            self._and[key] = z
            self.row([(1, z), (-1, a)], hi=0)
            self.row([(1, z), (-1, b)], hi=0)
            self.row([(1, z), (-1, a), (-1, b)], lo=-1)
        return self._and[key]

    def OR(self, a, b):
        return _neg(self.AND(_neg(a), _neg(b)))

    def row(self, terms, lo=-float("inf"), hi=float("inf")) -> None:
        """lo <= sum of coef * literal <= hi, as a row over variables."""
        coefs, constant = _linear(terms)
        self.rows.append((coefs, lo - constant, hi - constant))

    def implied(self, lit) -> frozenset:
        """Literals true whenever `lit` is: itself and, for an AND, its operands (recursively)."""
        if isinstance(lit, bool):
            return frozenset()
        if lit not in self._implied:
            out = {lit}
            d = None if lit & 1 else self.defs[lit >> 1]
            if d is not None:
                out |= self.implied(d[0]) | self.implied(d[1])
            self._implied[lit] = frozenset(out)
        return self._implied[lit]

    def value(self, lit, assume, depth: int = 8):
        """True or False when `assume` (literals known true) decides `lit`, else None."""
        if isinstance(lit, bool):
            return lit
        if lit in assume:
            return True
        if lit ^ 1 in assume:
            return False
        d = self.defs[lit >> 1]
        if d is None or depth == 0:
            return None
        a, b = self.value(d[0], assume, depth - 1), self.value(d[1], assume, depth - 1)
        v = False if a is False or b is False else (True if a and b else None)
        return v if v is None or not lit & 1 else not v

    def decide(self, lit, assume):
        """`value`, or the value both cases of one nearby variable agree on (catches a OR (NOT a AND g))."""
        v = self.value(lit, assume)
        if v is not None or isinstance(lit, bool):
            return v
        for p in self._nearby(lit):
            yes, no = self.value(lit, assume | {2 * p}), self.value(lit, assume | {2 * p + 1})
            if yes is not None and yes == no:
                return yes
        return None

    def _nearby(self, lit) -> list[int]:
        """Variables in the definition of `lit`, two levels deep."""
        out, level = [], [lit]
        for _ in range(2):
            level = [x for y in level if (d := self.defs[y >> 1]) is not None for x in d if not isinstance(x, bool)]
            out += [x >> 1 for x in level]
        return list(dict.fromkeys(out))

    # --- the simulator, symbolically ---
    def run_order(self, order) -> None:
        sim = self.sim
        nt, n = len(sim.size), len(order)
        last_use, last_fwd, _ = liveness(sim, order)
        self.last_use = last_use
        self.needed = [0] * nt  # inputs of the recomputations under way (nested)
        made = [0] * nt
        for p, i in enumerate(order):
            for t in sim.op_out[i]:
                made[t] = p
        free_if_recomputed: list[list[int]] = [[] for _ in range(n)]
        free: list[list[int]] = [[] for _ in range(n)]
        for t in range(nt):
            if t in self.x_lit:
                free_if_recomputed[max(last_fwd[t], made[t])].append(t)
            if t in self.x_lit or not sim.persistent[t]:
                free[max(last_use[t], made[t])].append(t)
        self.res = [p < 0 for p in sim.producer]
        for p, i in enumerate(order):
            self.pos = p
            for t in sim.op_in[i]:
                g = self.absent(t, True)
                if g is not False:
                    self.rematerialize(t, g)
            self.run_op(i, True)
            for t in free_if_recomputed[p]:
                self.res[t] = self.AND(self.res[t], _neg(self.x_lit[t]))
            for t in free[p]:
                self.res[t] = False

    def absent(self, t: int, guard):
        """The literal "guard and t is not on the device", or False when that cannot happen."""
        present = self.decide(self.res[t], self.implied(guard))
        if present is True:
            return False
        return guard if present is False else self.AND(guard, _neg(self.res[t]))

    def rematerialize(self, t: int, guard) -> None:
        """Simulator._Run.rematerialize, under `guard`."""
        sim = self.sim
        i = sim.producer[t]
        if i < 0 or not sim.op_recomputable[i]:
            self.forbid(guard)
            return
        for u in sim.op_in[i]:
            self.needed[u] += 1
        for u in sim.op_in[i]:
            g = self.absent(u, guard)
            if g is not False:
                self.rematerialize(u, g)
        self.run_op(i, guard)
        for u in sim.op_in[i]:
            self.needed[u] -= 1
        for u in sim.op_in[i] + sim.op_out[i]:
            if self.last_use[u] < self.pos and not sim.persistent[u] and u != t and not self.needed[u]:
                self.res[u] = self.AND(self.res[u], _neg(guard))

    def run_op(self, i: int, guard) -> None:
        """An op run under `guard`: its time, its memory after allocation, its outputs on the device."""
        sim = self.sim
        self.events += 1
        if self.events > MAX_EVENTS:
            raise TooLarge
        coefs, constant = _linear([(sim.op_time[i], guard)])
        self.constant += constant
        for v, c in coefs.items():
            self.objective[v] = self.objective.get(v, 0.0) + c
        fixed = sim.base_bytes + sim.out_bytes[i]
        terms = []
        for t, lit in enumerate(self.res):
            if sim.producer[t] >= 0 and sim.size[t] and lit is not False:
                if lit is True:
                    fixed += sim.size[t]
                else:
                    terms.append((sim.size[t], lit))
        most = fixed + sum(size for size, _ in terms)
        if most > self.budget:
            if guard is True:
                self.row(terms, hi=self.budget - fixed)
                self.impossible |= fixed > self.budget
            else:
                self.row(terms + [(most - self.budget, guard)], hi=most - fixed)
        for t in sim.op_out[i]:
            self.res[t] = self.OR(self.res[t], guard)

    def forbid(self, guard) -> None:
        """The policy is invalid when `guard` holds (a tensor is needed but cannot be brought back)."""
        if guard is True:
            self.impossible = True
        else:
            self.row([(1, guard)], hi=0)


def _linear(terms) -> tuple[dict[int, float], float]:
    """sum of coef * literal as (coefficient by variable, constant)."""
    coefs: dict[int, float] = {}
    constant = 0.0
    for c, lit in terms:
        if isinstance(lit, bool):
            constant += c * lit
        elif lit & 1:  # c (1 - v)
            constant += c
            coefs[lit >> 1] = coefs.get(lit >> 1, 0.0) - c
        else:
            coefs[lit >> 1] = coefs.get(lit >> 1, 0.0) + c
    return coefs, constant


def _neg(lit):
    return (not lit) if isinstance(lit, bool) else lit ^ 1
