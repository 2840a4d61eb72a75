"""GPU check suite (``tests/gpu``): skipped on machines without CUDA. Run it with ``bash scripts/gpu_check.sh``."""
import pytest
import torch


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA device (tests/gpu, run by scripts/gpu_check.sh)")


def pytest_collection_modifyitems(config, items):
    skip = pytest.mark.skip(reason="no CUDA device: the GPU suite runs on a GPU machine (scripts/gpu_check.sh)")
    for item in items:
        if "tests/gpu/" in str(item.fspath).replace("\\", "/"):
            item.add_marker(pytest.mark.gpu)
            if not torch.cuda.is_available():
                item.add_marker(skip)
