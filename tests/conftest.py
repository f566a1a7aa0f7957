import os
import sys
from pathlib import Path

import pytest

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # deterministic cuBLAS for the bitwise CUDA tests

sys.path.insert(0, str(Path(__file__).parent))


@pytest.fixture(scope="session")
def fresh_inductor_cache(tmp_path_factory):
    """An inductor cache folder of this session's own, empty when the session starts, for the tests that count
    inductor's cache hits and misses (`TORCHINDUCTOR_CACHE_DIR`): each compiles a model no other test compiles
    there, so the graphs it finds are its own, and what any first compile writes besides (C++ checks and the
    like: about 9 s on 2 cores) is written once for all of them."""
    return tmp_path_factory.mktemp("inductor")


@pytest.fixture(autouse=True, scope="module")
def forget_compiled_code():
    """Each test module starts with dynamo's compiled code forgotten: dynamo counts a function's compiles across the
    process against its `recompile_limit` (8), so a module that compiles a model the modules before it compiled
    passed or failed by the order the modules ran in (in reverse order, test_compiled's CNN was its ninth)."""
    yield
    if "torch._dynamo" in sys.modules:
        sys.modules["torch._dynamo"].reset()
