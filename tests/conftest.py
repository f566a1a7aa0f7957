import os
import sys
from pathlib import Path

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # deterministic cuBLAS for the bitwise CUDA tests

sys.path.insert(0, str(Path(__file__).parent))
