"""The CPU storage tracker that measures real steps."""
import torch

from gaswap.memory import DeviceMemory, host_memory


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
