"""An experiment's torch side: its model built by its factory, its random inputs, and the gradient of the output
a step with loss "external" is given. Used by workflow (capture and costs), validate and train_with_policy.py.
"""
from __future__ import annotations

from dataclasses import asdict
from pathlib import Path

from gaswap.base import config, signals


def build_model(experiment: config.Experiment, device: str = "meta"):
    """The experiment's model, with parameters on `device` ("meta" allocates nothing). Whatever the factory
    raises (SystemExit, and KeyboardInterrupt without a Ctrl-C, included) becomes a ConfigError naming it; so
    does a factory returning no nn.Module."""
    import torch

    # torch loads when a model is built: `app.workflow` imports this module without it
    from gaswap.zoo import check_model, resolve

    path = experiment.model.factory
    try:
        factory = resolve(path, base=Path(experiment.path).parent)
    except ValueError as err:
        raise config.ConfigError(f"{experiment.path}: model.factory: {err}") from None
    try:
        with torch.device(device):
            model = factory(**experiment.model.kwargs)
    except TypeError as err:
        raise config.ConfigError(f"{experiment.path}: model.kwargs: {path} refused them: {err}") from None
    except (Exception, SystemExit) as err:
        raise config.ConfigError(f"{experiment.path}: model: {path}(**kwargs) failed: {type(err).__name__}: "
                                 f"{_one_line(err)}") from None
    except KeyboardInterrupt as err:
        if not signals.from_code(err):  # Ctrl-C
            raise
        raise config.ConfigError(f"{experiment.path}: model: {path}(**kwargs) failed: it raised KeyboardInterrupt "
                                 f"itself (no Ctrl-C came)") from None
    try:
        return check_model(path, model)
    except ValueError as err:
        raise config.ConfigError(f"{experiment.path}: model.factory: {err}") from None


def _one_line(err: BaseException) -> str:
    """An exception's message on one line, shortened."""
    text = " ".join(str(err).split())
    return text if len(text) <= 300 else text[:297] + "..."


def make_inputs(experiment: config.Experiment, device: str = "meta", generator=None):
    """The experiment's (inputs, target) tensors on `device`."""
    # torch loads when a model is built: `app.workflow` imports this module without it
    from gaswap.run.capture import make_inputs as make

    specs = [asdict(s) for s in experiment.inputs]
    target = asdict(experiment.target) if experiment.target is not None else None
    return make(specs, target, experiment.batch_size, device=device, generator=generator)


def output_gradient(captured, device, seed: int):
    """A random tensor shaped like the model's output: the gradient a step with loss "external" is given."""
    import torch

    (like,) = [n.meta["val"] for n in captured.gm.graph.nodes if n.op == "placeholder" and n.name == "grad_output"]
    return torch.randn(like.shape, dtype=like.dtype, device=device, generator=torch.Generator(device).manual_seed(seed))
