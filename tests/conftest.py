import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))  # tests import their shared helpers modules


@pytest.fixture(autouse=True)
def fresh_dynamo():
    """Every test compiles its own models: start from an empty Dynamo cache so that earlier tests'
    graphs do not count towards the recompile limit of the same model code."""
    torch._dynamo.reset()
    yield
