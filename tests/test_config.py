"""Experiment and search-space loading: strict errors, size units, shipped search spaces, defaults."""
import pytest
import yaml
from hypothesis import given
from hypothesis import strategies as st

from gaswap.base.config import (
    SEARCH_SPACES_DIR,
    Budget,
    ConfigError,
    CostSpec,
    Experiment,
    GASettings,
    ModelSpec,
    SearchSpace,
    TensorSpec,
    format_size,
    load_experiment,
    load_search_space,
    parse_size,
)

EXAMPLE = """\
# AlexNet on ImageNet shapes, planned for a 16 GB PCIe GPU, trained under a 4 GB budget.
model:
  factory: gaswap.zoo:alexnet
  kwargs: {num_classes: 1000}
inputs:
  - {shape: [batch, 3, 224, 224], dtype: float32}
target: {shape: [batch], dtype: int64, high: 1000}
loss: cross_entropy
batch_size: 1024
optimizer: sgd_momentum
budget: 4GB
counts: [parameters, gradients, optimizer_state]
costs: {source: estimate, profile: v100-pcie-16gb}
search_space: hybrid
ga: {population: 64, generations: 60, workers: 1}
seed: 0
"""
VALID = yaml.safe_load(EXAMPLE)
DROP = object()  # removes a key in a patch


def write(tmp_path, text, name="exp.yaml"):
    path = tmp_path / name
    path.write_text(text)
    return path


def load_patched(tmp_path, patch):
    """Load the valid example with top-level keys replaced (or removed with DROP)."""
    raw = {k: v for k, v in (VALID | patch).items() if v is not DROP}
    return load_experiment(write(tmp_path, yaml.safe_dump(raw)))


def test_example_loads(tmp_path):
    path = write(tmp_path, EXAMPLE, "alexnet.yaml")
    assert load_experiment(path) == Experiment(
        name="alexnet",
        path=str(path),
        model=ModelSpec("gaswap.zoo:alexnet", {"num_classes": 1000}),
        inputs=(TensorSpec(("batch", 3, 224, 224), "float32"),),
        target=TensorSpec(("batch",), "int64", 1000),
        loss="cross_entropy",
        batch_size=1024,
        optimizer="sgd_momentum",
        budget=Budget(bytes=4_000_000_000),
        counts=("parameters", "gradients", "optimizer_state"),
        costs=CostSpec("estimate", "v100-pcie-16gb"),
        search_space=load_search_space("hybrid"),
        ga=GASettings(64, 60, 1),
        seed=0,
        given=frozenset({"model", "inputs", "target", "loss", "batch_size", "optimizer", "budget", "counts", "costs",
                         "search_space", "ga", "seed"}),
    )


def test_defaults(tmp_path):
    path = write(tmp_path, "model: {factory: m:f}\ninputs: [{shape: [batch, 8]}]\nbatch_size: 4\nbudget: 0.5x\n")
    exp = load_experiment(path)
    assert exp.name == "exp"
    assert exp.model == ModelSpec("m:f", {})
    assert exp.inputs == (TensorSpec(("batch", 8)),)
    assert (exp.target, exp.loss, exp.optimizer, exp.seed) == (None, "sum", "sgd", 0)
    assert exp.budget == Budget(fraction=0.5)
    assert exp.counts == ("parameters", "gradients", "optimizer_state")
    assert exp.costs == CostSpec("measure", None, "auto")
    assert exp.search_space == load_search_space("hybrid")
    assert exp.ga == GASettings()


def test_name_and_search_space_path(tmp_path):
    (tmp_path / "spaces").mkdir()
    write(tmp_path, "description: mine\norder: false\nactions: [keep, swap]\n", "spaces/mine.yaml")
    exp = load_patched(tmp_path, {"name": "run-1", "search_space": "spaces/mine.yaml"})
    assert exp.name == "run-1"
    assert exp.search_space == SearchSpace("mine", "mine", order=False, actions=("keep", "swap"))


MALFORMED = [
    ({"budjet": "4GB"}, "unknown key 'budjet' (did you mean 'budget'?)"),
    ({"budget": DROP}, "missing required key 'budget'"),
    ({"model": {"factory": "m:f", "kwarg": {}}}, "model: unknown key 'kwarg' (did you mean 'kwargs'?)"),
    ({"model": {"kwargs": {}}}, "model: missing required key 'factory'"),
    ({"model": {"factory": "gaswap.zoo.alexnet"}}, "model.factory: must be 'module:callable'"),
    ({"model": {"factory": "m:f", "kwargs": [1]}}, "model.kwargs: must be a mapping"),
    ({"ga": {"population": 0}}, "ga.population: must be a positive integer, got 0"),
    ({"ga": {"generations": -3}}, "ga.generations: must be a positive integer, got -3"),
    ({"ga": {"workers": 0}}, "ga.workers: must be a positive integer, got 0"),
    ({"ga": {"cx_prob": 1.5}}, "ga.cx_prob: must be a probability in [0, 1], got 1.5"),
    ({"ga": {"patience": 2.5}}, "ga.patience: must be a positive integer, got 2.5"),
    ({"batch_size": True}, "batch_size: must be a positive integer, got True"),
    ({"batch_size": 0}, "batch_size: must be a positive integer, got 0"),
    ({"seed": -1}, "seed: must be a non-negative integer, got -1"),
    ({"budget": "4 gb"}, "budget: invalid size '4 gb'"),
    ({"budget": "-1GB"}, "budget: invalid size '-1GB': must be positive"),
    ({"budget": "0x"}, "budget: invalid size '0x': must be positive"),
    ({"budget": "20x"}, "budget: invalid size '20x': a fraction of the keep-all peak must be at most 10x"),
    ({"budget": 4.0e9}, "budget: invalid size 4000000000.0"),
    ({"loss": "crossentropy"}, "loss: must be one of cross_entropy, mse, sum, external, got 'crossentropy' (did you"),
    ({"optimizer": "adamw"}, "optimizer: must be one of sgd, sgd_momentum, adam, got 'adamw'"),
    ({"inputs": []}, "inputs: must be a non-empty list, got []"),
    ({"inputs": [{"shape": [8], "dtype": "float64"}]}, "inputs[0].dtype: must be one of float32"),
    ({"inputs": [{"shape": ["batch", 0]}]}, "inputs[0].shape[1]: must be a positive integer or 'batch', got 0"),
    ({"inputs": [{"shape": ["btch", 3]}]}, "inputs[0].shape[0]: must be a positive integer or 'batch'"),
    ({"inputs": [{"shape": [4], "dtype": "int32"}]}, "inputs[0].high: required for integer dtype int32"),
    ({"inputs": [{"shape": [4], "high": 5}]}, "inputs[0].high: only applies to integer dtypes"),
    ({"target": {"shape": ["batch"], "dtype": "int64"}}, "target.high: required for integer dtype int64"),
    ({"target": DROP}, "target: required for loss 'cross_entropy'"),
    ({"loss": "sum"}, "target: not used by loss 'sum'"),
    ({"loss": "external"}, "target: not used by loss 'external'"),
    ({"counts": ["params"]}, "counts[0]: must be one of parameters, gradients, optimizer_state, got 'params'"),
    ({"counts": ["gradients", "gradients"]}, "counts[1]: duplicate entry 'gradients'"),
    ({"costs": {"source": "guess"}}, "costs.source: must be one of estimate, measure, got 'guess'"),
    ({"costs": {"source": "estimate"}}, "costs.profile: required when source is 'estimate'"),
    ({"costs": {"source": "measure", "device": "tpu"}}, "costs.device: must be one of auto, cpu, cuda"),
    ({"costs": {"source": "measure", "device": "cpu", "threads": 0}}, "costs.threads: must be a positive integer, got 0"),
    ({"costs": {"source": "measure", "device": "auto", "threads": 1}},
     "costs.threads: only used when measuring on the CPU (source 'measure', device 'cpu')"),
    ({"search_space": "hybird"}, "search_space: unknown search space 'hybird' (did you mean 'hybrid'?) "
                                 "(known: compiled, compiled_swap, hybrid, order_only, recompute_only, swap_only)"),
    ({"search_space": "nowhere/x.yaml"}, "search_space: search space file"),
    ({"name": "a b"}, "name: must be a name of letters"),
    ({"distributed": {"world_size": 1, "units": ["Block"]}}, "distributed.world_size: must be an integer of at least 2"),
    ({"distributed": {"world_size": 8}}, "distributed.units: name the modules to shard"),
    ({"distributed": {"world_size": 8, "strategy": "ddp", "units": ["Block"]}},
     "distributed.units: only used by strategy 'fsdp', not 'ddp'"),
    ({"distributed": {"world_size": 8, "strategy": "zero4"}}, "distributed.strategy: must be one of fsdp, zero2"),
    ({"distributed": {"world_size": 8, "units": ["Block"], "prefetch": {"forwrd": 1}}},
     "distributed.prefetch: unknown key 'forwrd' (did you mean 'forward'?)"),
    ({"distributed": {"world_size": 8, "units": ["Block"], "mixed_precision": {"param_dtype": "int8"}}},
     "distributed.mixed_precision.param_dtype: must be one of float32, float16, bfloat16, got 'int8'"),
    ({"distributed": {"world_size": 8, "units": ["Block"], "mesh": [2, 2]}},
     "distributed.mesh: must be [replicate, shard] with replicate x shard = world_size 8"),
    ({"distributed": {"world_size": 8, "units": ["Block"], "mesh": [2, 2, 2]}}, "distributed.mesh: must be"),
    ({"distributed": {"world_size": 8, "units": ["Block"], "mesh": [2, 4], "reshard_after_forward": 4}},
     "distributed.reshard_after_forward: an integer must divide the shard size 4"),
    ({"distributed": {"world_size": 8, "units": ["Block"], "reshard_after_forward": 1}},
     "distributed.reshard_after_forward: must be true, false or an integer of at least 2"),
    ({"distributed": {"world_size": 8, "units": ["Block"], "reshard_after_forward": "2"}},
     "distributed.reshard_after_forward: must be true, false or an integer"),
    ({"distributed": {"world_size": 8, "units": ["Block"], "reshard_after_forward": 3}},
     "distributed.reshard_after_forward: an integer must divide the shard size 8 and be below it, got 3"),
    ({"distributed": {"world_size": 8, "units": ["Block"], "reshard_after_forward": 8}},
     "distributed.reshard_after_forward: an integer must divide the shard size 8 and be below it, got 8"),
]


@pytest.mark.parametrize("patch, fragment", MALFORMED, ids=[m for _, m in MALFORMED])
def test_malformed_experiment(tmp_path, patch, fragment):
    with pytest.raises(ConfigError) as err:
        load_patched(tmp_path, patch)
    message = str(err.value)
    assert message.startswith(f"{tmp_path / 'exp.yaml'}: ")
    assert fragment in message
    assert "\n" not in message


@pytest.mark.parametrize("text, fragment", [
    ("model: {factory: m:f\nbudget: 4GB\n", "line 2: invalid YAML"),
    ("- a\n- b\n", "top level must be a mapping, got a list"),
    ("", "top level must be a mapping, got nothing (an empty file)"),
    ("budget: 4GB\nseed: 1\nbudget: 8GB\n", "line 3: invalid YAML: key 'budget' is given twice"),
    ("ga: {population: 8, population: 16}\n", "line 1: invalid YAML: key 'population' is given twice"),
])
def test_malformed_file(tmp_path, text, fragment):
    with pytest.raises(ConfigError, match=r"exp\.yaml: ") as err:
        load_experiment(write(tmp_path, text))
    assert fragment in str(err.value)
    assert "\n" not in str(err.value)


def test_a_file_that_is_not_utf8_is_refused(tmp_path):
    path = tmp_path / "exp.yaml"
    path.write_bytes("budget: 4GB  # \u00e9\n".encode("latin-1"))
    with pytest.raises(ConfigError, match=r"exp\.yaml: not a UTF-8 text file \(byte 15: invalid continuation byte\)"):
        load_experiment(path)


def test_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="nope.yaml: no such file"):
        load_experiment(tmp_path / "nope.yaml")


@pytest.mark.parametrize("text, expected", [
    ("4GB", Budget(bytes=4_000_000_000)),
    ("3.5GiB", Budget(bytes=3 * 2**30 + 2**29)),
    ("4096MiB", Budget(bytes=2**32)),
    ("500MB", Budget(bytes=500_000_000)),
    ("1024KiB", Budget(bytes=2**20)),
    ("2 TB", Budget(bytes=2 * 10**12)),
    ("123456", Budget(bytes=123456)),
    (123456, Budget(bytes=123456)),
    ("0.5x", Budget(fraction=0.5)),
    ("10x", Budget(fraction=10.0)),
])
def test_parse_size(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["4 gb", "4gb", "4G", "-1GB", "0x", "0GB", "abc", "", "12.5x3", "1.5B",
                                  "11x", True, 4.0, None, -5])
def test_parse_size_rejects(text):
    with pytest.raises(ConfigError, match="invalid size"):
        parse_size(text)


@given(st.integers(1, 10**6), st.sampled_from([("KB", 10**3), ("KiB", 2**10), ("GB", 10**9), ("TiB", 2**40)]))
def test_parse_size_units(n, unit):
    assert parse_size(f"{n}{unit[0]}").bytes == n * unit[1]


def test_budget():
    assert parse_size("4GB").resolve(10**12) == 4 * 10**9
    assert parse_size("0.5x").resolve(1000) == 500
    assert str(parse_size("4GB")) == "4.00 GB"
    assert str(parse_size("0.5x")) == "0.5x"
    assert format_size(500_000_000) == "500.00 MB" and format_size(12) == "12 B"
    with pytest.raises(ValueError):
        Budget()


@pytest.mark.parametrize("name", ["hybrid", "swap_only", "recompute_only", "order_only"])
def test_shipped_search_spaces(name):
    space = load_search_space(name)
    assert space.name == name and space.description
    assert space == load_search_space(SEARCH_SPACES_DIR / f"{name}.yaml")
    assert "keep" in space.actions


def test_shipped_search_space_semantics():
    assert load_search_space("hybrid").actions == ("keep", "swap", "recompute")
    assert load_search_space("swap_only").actions == ("keep", "swap")
    assert not load_search_space("recompute_only").order
    assert load_search_space("recompute_only").actions == ("keep", "recompute")
    assert load_search_space("order_only").order and load_search_space("order_only").actions == ("keep",)


def test_search_space_root(tmp_path):
    write(tmp_path, "description: d\n", "mine.yaml")
    assert load_search_space("mine", root=tmp_path) == SearchSpace("mine", "d")
    with pytest.raises(ConfigError, match=r"unknown search space 'other' \(known: mine\)"):
        load_search_space("other", root=tmp_path)


@pytest.mark.parametrize("text, fragment", [
    ("order: false\nactions: [keep]\n", "space.yaml: nothing to search"),
    ("actions: [swap]\n", "space.yaml: actions: must include 'keep'"),
    ("actions: [keep, offload]\n", "space.yaml: actions[1]: must be one of keep, swap, recompute"),
    ("actions: []\n", "space.yaml: actions: must be a non-empty list"),
    ("crossover: one_point\n", "space.yaml: crossover: must be one of uniform, two_point"),
    ("key_indpb: 2\n", "space.yaml: key_indpb: must be a probability in [0, 1], got 2"),
    ("key_sigma: -0.1\n", "space.yaml: key_sigma: must be a non-negative number"),
    ("order: 1\n", "space.yaml: order: must be true or false, got 1"),
    ("mutation: 0.1\n", "space.yaml: unknown key 'mutation'"),
    ("name: x\n", "space.yaml: unknown key 'name'"),
])
def test_malformed_search_space(tmp_path, text, fragment):
    with pytest.raises(ConfigError) as err:
        load_search_space(write(tmp_path, text, "space.yaml"))
    assert fragment in str(err.value)


def test_autocast_accepts_the_two_mixed_precision_dtypes(tmp_path):
    from gaswap.base.config import load_experiment

    body = ("model: {factory: gaswap.zoo:mlp}\ninputs: [{shape: [batch, 4]}]\nbatch_size: 2\nbudget: 1GB\n")
    (tmp_path / "a.yaml").write_text(body + "autocast: bfloat16\n")
    assert load_experiment(tmp_path / "a.yaml").autocast == "bfloat16"
    (tmp_path / "b.yaml").write_text(body + "autocast: fp8\n")
    with pytest.raises(ConfigError, match="b.yaml: autocast: "):
        load_experiment(tmp_path / "b.yaml")


def test_external_loss_needs_no_target(tmp_path):
    exp = load_patched(tmp_path, {"loss": "external", "target": DROP})
    assert (exp.loss, exp.target) == ("external", None)


def test_the_committed_key_reference_is_generated_from_the_schema():
    from pathlib import Path

    from gaswap.base.config import reference

    committed = (Path(__file__).resolve().parents[1] / "docs/experiment_keys.md").read_text()
    assert committed == reference() + "\n", "regenerate it: python -m gaswap.base.config > docs/experiment_keys.md"


def test_the_reference_names_every_key_of_the_example():
    from gaswap.base.config import reference

    text = reference()
    for key in VALID:
        assert f"| `{key}" in text
    for key in VALID["ga"]:
        assert f"| `ga.{key}`" in text


def test_distributed_defaults_follow_fsdp2(tmp_path):
    spec = load_patched(tmp_path, {"distributed": {"world_size": 64, "units": ["DecoderLayer"]}}).distributed
    assert (spec.world_size, spec.strategy, spec.units) == (64, "fsdp", ("DecoderLayer",))
    assert spec.reshard_after_forward is True and not spec.offload
    assert (spec.prefetch.forward, spec.prefetch.backward) == (0, 1)
    assert (spec.mixed_precision.param_dtype, spec.mixed_precision.reduce_dtype) == (None, None)
    assert load_patched(tmp_path, {}).distributed is None
    spec = load_patched(tmp_path, {"distributed": {"world_size": 64, "units": ["Block"],
                                                   "reshard_after_forward": 8}}).distributed
    assert spec.reshard_after_forward == 8
    spec = load_patched(tmp_path, {"distributed": {"world_size": 64, "units": ["Block"], "mesh": [8, 8]}}).distributed
    assert spec.mesh == (8, 8)
