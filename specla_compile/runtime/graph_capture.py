"""Capturing a step as a CUDA graph: warm-up runs on a side stream, then one capture.

The warm-up runs compile and autotune what the step launches (Triton, cuBLAS and cuDNN plans, inductor
graphs) and let the caching allocator settle, which a capture must not do. The step must be safe to
run more than once (its warm-up runs change nothing that its real run would not write again).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TypeVar

import torch

T = TypeVar("T")
log = logging.getLogger("specla_compile")


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


def capturable_experts(model: torch.nn.Module) -> None:
    """Switch a transformers mixture-of-experts model (Qwen3-Next) to experts a CUDA graph can hold.
    Its default kernel, ``grouped_mm``, falls back outside bf16 under torch.compile to a loop that reads
    the experts' token offsets on the host, and the ``eager`` kernel finds the hit experts on the host: a
    capture fails on either. ``batched_mm`` (each token's experts gathered, one batched GEMM) reads
    nothing on the host. bf16 ``grouped_mm`` (torch's grouped GEMM, offsets on the device) is kept."""
    current = getattr(getattr(model, "config", None), "_experts_implementation", None)
    settable = getattr(model, "_can_set_experts_implementation", None)
    if current in (None, "batched_mm") or settable is None or not settable():
        return
    if current == "grouped_mm" and model.dtype == torch.bfloat16:
        return
    log.warning("specla: experts_implementation %r reads on the host, which a CUDA graph cannot hold: "
                "switched to 'batched_mm' (or pass SpecConfig(cuda_graphs=False))", current)
    model.set_experts_implementation("batched_mm")
