"""Capturing a step as a CUDA graph: warm-up runs on a side stream, then one capture.

The warm-up runs compile and autotune what the step launches (Triton, cuBLAS and cuDNN plans, inductor
graphs) and let the caching allocator settle, which a capture must not do. The step must be safe to
run more than once (its warm-up runs change nothing that its real run would not write again).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch

T = TypeVar("T")


def capture(step: Callable[[], T], warmups: int = 2) -> tuple[torch.cuda.CUDAGraph, T]:
    """Run ``step`` ``warmups`` times, then capture it; returns the graph and the captured call's output
    (tensors that every replay overwrites). The capture itself computes nothing: replay to run it."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(warmups):
            step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    return graph, out
