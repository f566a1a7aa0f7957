"""The CPU storage tracker that measures real steps."""
import torch

from gaswap.run.step_memory import DeviceMemory, host_memory


def test_tracker_counts_storages_once_until_the_last_reference_goes():
    held = torch.zeros(100)  # 400 bytes made before: counted once held
    with DeviceMemory("cpu") as mem:
        mem.hold([held])
        a = torch.ones(1000)  # 4000 bytes
        view = a[10:20].view(2, 5)  # a view: no new storage
        assert mem.current() == 4400
        del a
        assert mem.current() == 4400  # the view keeps the storage alive
        del view
        assert mem.current() == 400
        b = torch.ones(250) * 2  # ones (1000 B) then the product (1000 B); ones dies at once
        with host_memory():
            c = b.clone()  # host store: not device memory
        assert mem.current() == 1400 and mem.host_bytes() == 1000
    assert mem.peak == 4400  # held + a (its view adds nothing)
    del b, c


class _FakeCuda:
    """A stand-in for torch.cuda's memory statistics: the test moves the counters as a step would."""

    def __init__(self, requested: int, allocated: int, reserved: int):
        self.stats = {"requested_bytes.all.current": requested, "allocated_bytes.all.current": allocated,
                      "reserved_bytes.all.current": reserved}
        self.reset_peak_memory_stats(None)
        self.synced = 0

    def synchronize(self, device):
        self.synced += 1

    def reset_peak_memory_stats(self, device):
        for k in ("requested", "allocated", "reserved"):
            self.stats[f"{k}_bytes.all.peak"] = self.stats[f"{k}_bytes.all.current"]

    def memory_stats(self, device):
        return dict(self.stats)

    def allocate(self, requested: int, allocated: int, reserved: int = 0):
        for k, n in (("requested", requested), ("allocated", allocated), ("reserved", reserved)):
            self.stats[f"{k}_bytes.all.current"] += n
            self.stats[f"{k}_bytes.all.peak"] = max(self.stats[f"{k}_bytes.all.peak"],
                                                    self.stats[f"{k}_bytes.all.current"])


def test_cuda_tracker_counts_held_tensors_and_the_step_beyond_its_baseline():
    # Before the step the device holds 10_000 requested bytes: inputs kept for cloning, uncounted
    # parameters, a cuBLAS workspace... Of those the simulator counts only the held tensors (2 x 400 B).
    api = _FakeCuda(requested=10_000, allocated=10_240, reserved=2 << 20)
    held = [torch.zeros(100), torch.zeros(100)]
    with DeviceMemory("cuda", cuda_api=api) as mem:
        mem.hold(held + [held[0][:10]])  # a view of a held tensor adds nothing
        api.allocate(3000, 3072)  # the step's activations
        api.allocate(-3000, -3072)
        api.allocate(1000, 1024, reserved=2 << 20)
        assert mem.current() == 800 + 1000
    assert mem.peak == 800 + 3000  # never the 10_000 bytes of the baseline
    assert mem.allocated_peak == 800 + 3072
    assert mem.reserved_peak == 4 << 20  # absolute: what the process reserves
    assert api.synced == 2
