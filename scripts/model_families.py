"""Real model families as users get them: searched with `gaswap search`, run with `gaswap validate`, checked bit for bit.

    PYTHONPATH=. python scripts/model_families.py [--only llama,bert] [--out results/model_families] [--compiled]

Each family is a Hugging Face transformers class built from a small configuration (fresh weights, nothing
downloaded; `gaswap.zoo:huggingface`) with the library's defaults otherwise (attention implementation, dropout),
written as an experiment file (`<out>/experiments/<family>.yaml`: a short search, 16 individuals for 5
generations, the MILP seed off, costs measured on this CPU with one thread). For each it runs, in this
process, the verbs a user runs:

- `gaswap search` (its CPU seconds, capture and cost measurement included) and `gaswap validate --steps 3`
  (the policy's peak measured by the storage tracker against the simulator's prediction);
- a bitwise check: one step under the searched policy's program (`StepRunner`) against the captured step
  without a policy (`gm`), and against eager PyTorch (`loss.backward()`), loss and every gradient, from the
  same model, batch and random seed (dropout masks included);
- with `--compiled`: whether `torch.compile` traces the model into one graph for gaswap's compiled path
  (`gaswap.compiled.partition.capture`, joint graph ops), and the step under torch's own partition read
  back as a policy (`partition.compile`) against plain `torch.compile`, bit for bit.

Writes `<out>/<family>/` (the search's results folder, validation.json beside its policy), `<out>/families.json`
and `<out>/table.md` (the table of docs/models.md).
"""
from __future__ import annotations

import argparse
import json
import platform
import tempfile
import time
from pathlib import Path

import torch
import yaml

from gaswap.app import cli
from gaswap.base import config
from gaswap.plan import policy as policies
from gaswap.run.capture import capture, loss_fn, output_tensor
from gaswap.run.experiment import build_model, make_inputs
from gaswap.run.runtime import StepRunner

SEQ, VOCAB, BATCH = 64, 512, 4
DECODER = {"vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
           "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": SEQ, "use_cache": False}
TOKENS = [{"shape": ["batch", SEQ], "dtype": "int64", "high": VOCAB}]
MASK = {"shape": ["batch", SEQ], "dtype": "int64", "high": 2}  # random 0/1: every sequence padded somewhere
PIXELS = [{"shape": ["batch", 3, 64, 64]}]
LABELS = {"shape": ["batch"], "dtype": "int64", "high": 10}
# family -> (architecture, config, inputs, target)
FAMILIES = {
    "llama": ("LlamaForCausalLM", DECODER, TOKENS, TOKENS[0]),
    "qwen2": ("Qwen2ForCausalLM", DECODER, TOKENS, TOKENS[0]),
    "mistral": ("MistralForCausalLM", DECODER, TOKENS, TOKENS[0]),
    "gpt2": ("GPT2LMHeadModel", {"vocab_size": VOCAB, "n_positions": SEQ, "n_embd": 64, "n_layer": 2, "n_head": 4,
                                 "use_cache": False, "bos_token_id": 0, "eos_token_id": 0}, TOKENS, TOKENS[0]),
    "bert_masked": ("BertForMaskedLM", {"vocab_size": VOCAB, "max_position_embeddings": SEQ, "hidden_size": 64,
                                        "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 128},
                    [*TOKENS, MASK], TOKENS[0]),
    "vit": ("ViTForImageClassification", {"image_size": 64, "patch_size": 8, "hidden_size": 64, "num_hidden_layers": 2,
                                          "num_attention_heads": 4, "intermediate_size": 128, "num_labels": 10},
            PIXELS, LABELS),
    "resnet": ("ResNetForImageClassification", {"embedding_size": 16, "hidden_sizes": [16, 32, 64], "depths": [1, 1, 1],
                                                "layer_type": "basic", "num_labels": 10}, PIXELS, LABELS),
    "convnext": ("ConvNextForImageClassification", {"hidden_sizes": [16, 32], "depths": [1, 1], "num_stages": 2,
                                                    "num_labels": 10, "image_size": 64}, PIXELS, LABELS),
}
GA = {"population": 16, "generations": 5, "patience": None, "milp_seed_ops": 0, "workers": 1}


def experiment_file(family: str, folder: Path) -> Path:
    """The family's experiment file, written to `folder`."""
    architecture, kwargs, inputs, target = FAMILIES[family]
    body = {"name": family, "model": {"factory": "gaswap.zoo:huggingface",
                                      "kwargs": {"architecture": architecture, **kwargs}},
            "inputs": inputs, "target": target, "batch_size": BATCH, "loss": "cross_entropy", "optimizer": "adam",
            "budget": "0.8x", "costs": {"source": "measure", "device": "cpu", "threads": 1}, "ga": GA, "seed": 0}
    body = json.loads(json.dumps(body))  # shared specs would be YAML aliases, which gaswap files refuse
    path = folder / f"{family}.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"# {architecture} from a small configuration, no weights downloaded "
                    f"(scripts/model_families.py)\n" + yaml.safe_dump(body, sort_keys=False, width=120))
    return path


def _step(model, inputs, target, exp):
    """Loss and parameter gradients of one eager step (`loss.backward()`), zeros for a parameter left without one."""
    model.zero_grad(set_to_none=True)
    loss = loss_fn(exp.loss, output_tensor(model(*inputs)), target)
    loss.backward()
    params = [p for p in model.parameters() if p.requires_grad]
    return [loss.detach(), *(torch.zeros_like(p) if p.grad is None else p.grad for p in params)]


def _same(a: list, b: list) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def bitwise(exp: config.Experiment, policy_path: Path) -> dict:
    """One step under the policy against the captured step without one and against eager PyTorch, bit for bit."""
    torch.manual_seed(exp.seed)
    model = build_model(exp, device="cpu")
    inputs, target = make_inputs(exp, "cpu", torch.Generator().manual_seed(exp.seed))
    c = capture(model, inputs, target, exp.loss, optimizer=exp.optimizer, counted=exp.counts)
    runner = StepRunner(c, policies.load(policy_path, c.graph).program)
    results = []
    for run in (lambda: runner(c.arguments(model, [x.clone() for x in inputs], target)),
                lambda: c.gm(*c.arguments(model, [x.clone() for x in inputs], target)),
                lambda: _step(model, inputs, target, exp)):
        torch.manual_seed(1)
        with torch.no_grad() if len(results) < 2 else torch.enable_grad():
            results.append([t.detach() for t in run()])
    policy, plain, eager = results
    worst = max(float((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30))
                for a, b in zip(policy, eager))
    return {"equals_captured_step": _same(policy, plain), "equals_eager": _same(policy, eager),
            "max_rel_diff_eager": worst, "specialized": [list(s) for s in c.graph.specialized]}


def compiled(exp: config.Experiment) -> dict:
    """torch.compile's joint graph of the family (gaswap's compiled capture), and one step under torch's own
    partition at activation_memory_budget 0.5, read back as a gaswap policy, against torch.compile's at that
    budget, bit for bit; the error where it fails."""
    from gaswap.compiled import partition

    torch.manual_seed(exp.seed)
    model = build_model(exp, device="cpu")
    inputs, target = make_inputs(exp, "cpu", torch.Generator().manual_seed(exp.seed))
    started = time.process_time()
    try:
        graph, actions = partition.torch_partition(model, *inputs, budget=0.5, optimizer=exp.optimizer,
                                                   counted=exp.counts)
        torch._dynamo.reset()
        results = []
        with torch._functorch.config.patch(activation_memory_budget=0.5):
            plain = torch.compile(model, fullgraph=True, dynamic=False)
        policy = partition.make_policy(graph, actions, provenance={"optimizer": exp.optimizer, "counts": list(exp.counts)})
        for fn in (plain, partition.compile(model, policy)):
            torch.manual_seed(1)
            results.append(_step(_Calls(fn, model), inputs, target, exp))
            torch._dynamo.reset()
    except Exception as err:  # noqa: BLE001 - reported in the table: where torch.compile does not trace the model
        while err.__cause__ is not None:  # the backend's own error, not torch.compile's wrapper of it
            err = err.__cause__
        return {"traced": False, "error": f"{type(err).__name__}: {str(err).strip().splitlines()[0][:200]}"}
    return {"traced": True, "ops": len(graph.ops), "cpu_seconds": round(time.process_time() - started, 1),
            "equals_torch_compile": _same(*results)}


class _Calls:
    """A compiled callable with its model's parameters (what `_step` reads the gradients from)."""

    def __init__(self, fn, model):
        self.fn, self.model = fn, model

    def __call__(self, *inputs):
        return self.fn(*inputs)

    def zero_grad(self, set_to_none=True):
        self.model.zero_grad(set_to_none=set_to_none)

    def parameters(self):
        return self.model.parameters()


def run(family: str, out: Path, with_compiled: bool) -> dict:
    """Search, validate and check one family; its row of the table."""
    path = experiment_file(family, out / "experiments")
    exp = config.load_experiment(path)
    started = time.process_time()
    with tempfile.TemporaryDirectory() as cache:  # costs measured afresh: the search's time includes them
        code = cli.main(["search", str(path), "--results", str(out), "--force", "--cache", cache])
    row = {"family": family, "architecture": FAMILIES[family][0], "search_exit": code,
           "search_cpu_seconds": round(time.process_time() - started, 1)}
    if code != 0:
        return row
    summary = json.loads((out / family / "summary.json").read_text())
    policy = out / family / "policy.yaml"
    code = cli.main(["validate", str(policy), "--steps", "3", "--device", "cpu"])
    validation = json.loads((out / family / "validation.json").read_text()) if code == 0 else {}
    row |= {"ops": summary["graph"]["ops"], "validate_exit": code,
            "keep_all_peak_bytes": summary["keep_all"]["peak_bytes"],
            "predicted_peak_bytes": validation.get("predicted", {}).get("peak_bytes"),
            "measured_peak_bytes": validation.get("measured", {}).get("peak_bytes")}
    row |= bitwise(exp, policy)
    if with_compiled:
        row["compiled"] = compiled(exp)
    return row


def _mb(n) -> str:
    return "–" if n is None else f"{n / 1e6:.2f} MB"


def table(rows: list[dict]) -> str:
    """The markdown table of docs/models.md."""
    header = ("| family (transformers class) | ops | search (CPU s) | keep-all peak | predicted peak | measured peak "
              "| bitwise: captured step / eager | specialized on | compiled (joint-graph ops, = torch.compile) |")
    lines = [header, "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if r["search_exit"] != 0:
            lines.append(f"| {r['family']} ({r['architecture']}) | search exit {r['search_exit']} |" + " |" * 7)
            continue
        yes = {True: "yes", False: "no"}
        eager = yes[r["equals_eager"]] + ("" if r["equals_eager"] else f" ({r['max_rel_diff_eager']:.0e} rel.)")
        special = "; ".join(f"`{where.split(' in ')[0]}` = {value}" for _, where, value in r["specialized"]) or "–"
        c = r.get("compiled")
        comp = ("not run" if c is None else f"{c['ops']}, {yes[c['equals_torch_compile']]}" if c["traced"]
                else f"no: {c['error'][:80]}")
        lines.append(f"| {r['family']} ({r['architecture']}) | {r['ops']} | {r['search_cpu_seconds']} "
                     f"| {_mb(r['keep_all_peak_bytes'])} | {_mb(r['predicted_peak_bytes'])} "
                     f"| {_mb(r['measured_peak_bytes'])} | {yes[r['equals_captured_step']]} / {eager} | {special} "
                     f"| {comp} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", default=",".join(FAMILIES), help="comma-separated families")
    parser.add_argument("--out", default="results/model_families", type=Path)
    parser.add_argument("--compiled", action="store_true", help="also torch.compile's path (slow: inductor compiles)")
    args = parser.parse_args()
    import transformers

    rows = [run(family, args.out, args.compiled) for family in args.only.split(",")]
    about = {"torch": torch.__version__, "transformers": transformers.__version__, "python": platform.python_version(),
             "machine": platform.processor() or platform.machine()}
    (args.out / "families.json").write_text(json.dumps({"about": about, "rows": rows}, indent=2) + "\n")
    (args.out / "table.md").write_text(table(rows))
    print(table(rows))


if __name__ == "__main__":
    main()
