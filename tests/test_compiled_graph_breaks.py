"""A model torch.compile compiles only in pieces (an nn.LSTM, a graph break, data-dependent control flow) or with
a shape the data decides is refused by `gaswap compare` as bad input (exit 2): the experiment file, the cause,
the module and line, and what to do."""
import pytest

from gaswap.app.cli import main

EXPERIMENT = """model: {{factory: "graph_break_models:{factory}"}}
inputs: [{{shape: [batch, 8]}}]
target: {{shape: [batch], dtype: int64, high: 4}}
batch_size: 4
budget: 0.5x
loss: cross_entropy
search_space: compiled
costs: {{source: measure, device: cpu, threads: 1}}
"""


@pytest.mark.parametrize("factory, said", [
    ("LstmNet", [("(Attempted to wrap RNN, GRU, or LSTM), lstm (LSTM) called from the model (LstmNet.forward, "
                  "graph_break_models.py:"), "unroll it over time with nn.LSTMCell"]),
    ("Branchy", ["(data-dependent control flow) in gate (Gate.forward, graph_break_models.py:",
                 "`if x.mean().item() > 0:", "neither of gaswap's paths plans a step whose ops or shapes depend"]),
    ("Breaks", ["(Call to `torch._dynamo.graph_break()`) in the model (Breaks.forward",
                "set `search_space: hybrid` and run `gaswap search`"]),
    ("DataShaped", [("cannot compile the model with static shapes: index (index.Tensor) has a shape that depends "
                     "on the data (graph_break_models.py:"), "`return h[h > 0].sum()", "mask with torch.where"]),
])
def test_compare_refuses_a_model_torch_compile_cannot_compile_whole_as_bad_input(capsys, tmp_path, factory, said):
    path = tmp_path / f"{factory}.yaml"
    path.write_text(EXPERIMENT.format(factory=factory))
    assert main(["compare", str(path), "--results", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err
    assert f"{path}: torch.compile cannot compile" in err and "internal error" not in err, err
    for part in said:
        assert part in err, (part, err)
    assert len(err.strip().splitlines()) == 1, err  # one line, the reason whole
