import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))  # tests import their shared helpers modules
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))  # and the benchmarks they check

# One intra-op thread: the tests' tensors are tiny, and on a small shared CPU machine torch's thread pool
# waits on busy cores (measured on the 2-core CI machine: a tiny depthwise conv1d took 46 ms with 2
# threads and 0.4 ms with 1; tests/test_reliability.py took 207 s instead of 38 s).
torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def fresh_dynamo():
    """Every test compiles its own models: start from an empty Dynamo cache so that earlier tests'
    graphs do not count towards the recompile limit of the same model code."""
    torch._dynamo.reset()
    yield
