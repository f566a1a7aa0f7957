"""`validate`'s step time is the training step's alone: the meter's entry and exit (a warm-up matmul, a
synchronization, the allocator's statistics) are outside the timed region (gaswap.run.training.runtime_step)."""
import pytest
import torch

from gaswap.run import training
from gaswap.run.step_memory import DeviceMemory


@pytest.mark.parametrize("metered", [True, False])
def test_a_runtime_steps_time_is_the_step_alone(monkeypatch, metered):
    now = [0.0]

    class SlowMeter(DeviceMemory):  # entry and exit take time, as on a GPU
        def __enter__(self):
            now[0] += 10.0
            return super().__enter__()

        def __exit__(self, *exc):
            now[0] += 100.0
            return super().__exit__(*exc)

    def runner(args):
        now[0] += 1.0  # the step itself
        return torch.tensor(0.5), torch.ones(2)

    monkeypatch.setattr(training, "DeviceMemory", SlowMeter)
    params = [torch.nn.Parameter(torch.zeros(2))]
    optimizer = torch.optim.SGD(params, lr=0.1)
    done = training.runtime_step(runner, [], [], optimizer, params, "cpu", metered=metered, clock=lambda: now[0])
    assert done.seconds == 1.0  # not 111: the meter's entry and exit are outside
    assert (done.memory is not None) == metered and torch.equal(params[0].detach(), torch.full((2,), -0.1))


def test_a_runtime_step_says_how_long_the_host_took_to_issue_it(monkeypatch):
    """On a GPU the runner returns once the host has issued the step; the synchronization after waits for the
    device to run it. `issued` is the first, `seconds` both."""
    now = [0.0]

    def runner(args):
        now[0] += 1.0  # issuing the step
        return torch.tensor(0.5), torch.ones(2)

    def sync(device):  # the device finishing what was issued
        now[0] += 5.0

    monkeypatch.setattr(training, "sync", sync)
    params = [torch.nn.Parameter(torch.zeros(2))]
    done = training.runtime_step(runner, [], [], torch.optim.SGD(params, lr=0.1), params, "cpu", metered=False,
                                 clock=lambda: now[0])
    assert (done.issued, done.seconds) == (1.0, 6.0)
