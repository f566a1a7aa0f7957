"""The torch.compile path: `partition` (keep / recompute / swap decisions on the joint graph inductor
partitions, and the backend that applies them), `step_model` (a torch-free model of the compiled step's cost
and memory, for the simulator), `programs` (the memory of the programs inductor generates), `dry_compile` (those programs written without
compiling their kernels), `order` (the partitioned graphs re-ordered), `methods`, `pool` and
`calibration_run` (compiled runs head to head, compiled in workers, calibrated) and `graph_breaks` (why
torch.compile cannot compile a model as one graph, in words).

Until gaswap 0.3, names of the former module `gaswap.compiled` (now `gaswap.compiled.partition`) are still
found here, with a DeprecationWarning."""
import importlib
import warnings


def __getattr__(name: str):
    if name.startswith("__"):
        raise AttributeError(name)
    if name in ("partition", "step_model", "programs", "graph_breaks", "methods", "offload_ops", "dry_compile",
                "order", "pool", "calibration_run"):
        return importlib.import_module(f"gaswap.compiled.{name}")
    partition = importlib.import_module("gaswap.compiled.partition")
    if not hasattr(partition, name):
        raise AttributeError(f"module 'gaswap.compiled' has no attribute {name!r}")
    warnings.warn(f"gaswap.compiled.{name} moved to gaswap.compiled.partition.{name}; the old path goes in "
                  "gaswap 0.3", DeprecationWarning, stacklevel=2)
    return getattr(partition, name)
