"""Shared pytest setup: `gpu` tests are skipped without CUDA, `fp8` tests on GPUs without FP8 (compute capability
< 8.9); seeds are fresh per test unless a test fixes one."""
import os

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        if torch.cuda.get_device_capability() < (8, 9):
            skip_fp8 = pytest.mark.skip(reason="needs FP8 in Triton: compute capability >= 8.9 (Ada, Hopper)")
            for item in items:
                if item.get_closest_marker("fp8") is not None:
                    item.add_marker(skip_fp8)
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU; run `pytest -m gpu` on a GPU machine")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(scope="session")
def shared_data_dir():
    """../shared/data when present (developer machines); tests that need full datasets skip otherwise."""
    here = os.path.dirname(os.path.abspath(__file__))
    for cand in (os.environ.get("QUARL_DATA_DIR"), os.path.join(here, "..", "..", "shared", "data")):
        if cand and os.path.isdir(cand):
            return os.path.abspath(cand)
    pytest.skip("full datasets not found (set QUARL_DATA_DIR to a folder with gsm8k/, math500/, aime24/)")


@pytest.fixture
def one_thread():
    """One intra-op thread for tests of tiny ops: on a shared 2-core machine torch's thread pool spinning against
    other processes makes them up to 100x slower. Use with `pytestmark = pytest.mark.usefixtures("one_thread")`."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
