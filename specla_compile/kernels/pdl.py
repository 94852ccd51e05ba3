"""Programmatic dependent launch (PDL) on Hopper and newer GPUs.

A GDN pass at B=1 is hundreds of short kernels in one CUDA graph; between two dependent kernels the GPU
idles while the second one launches and ramps up. Launched with PDL, a kernel may start while the kernel
before it in the stream still runs: it waits (``griddepcontrol.wait``) for that kernel to finish, and its
memory to be visible, before it reads or writes anything a kernel before it may write, then lets the kernel after it
launch in turn (``griddepcontrol.launch_dependents``). (The recurrent launches of a captured pass read their state and
pending records before the wait: no kernel of the pass before them writes those, ``dispatch.commits_before_wait``.)

Every specla Triton kernel takes ``USE_PDL`` and calls :func:`wait_upstream` before its first load of anything a
kernel before it may write (the one-row GEMV of ``triton_gemv.py`` loads a tile of its weight, a parameter, first);
:func:`launch_args` sets both for a launch. Inductor's own kernels do the same when its
``triton.enable_pdl`` is on, which the backend sets where :func:`enabled` (``backend.py``).
``SPECLA_PDL=0`` turns it off for an A/B (read once per process).
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl


@functools.cache
def _cuda_device_enabled(index: int) -> bool:
    return os.environ.get("SPECLA_PDL", "1") != "0" and torch.cuda.get_device_capability(index)[0] >= 9


def enabled(device: torch.device) -> bool:
    """Whether kernels on ``device`` launch with PDL: a CUDA GPU of compute capability 9.0 or newer, unless
    ``SPECLA_PDL=0``."""
    if device.type != "cuda":
        return False
    return _cuda_device_enabled(torch.cuda.current_device() if device.index is None else device.index)


def launch_args(device: torch.device) -> dict:
    """Keyword arguments of a Triton launch on ``device``: the kernel's ``USE_PDL`` and the launch attribute."""
    return {"USE_PDL": True, "launch_pdl": True} if enabled(device) else {"USE_PDL": False}


def launch_bound_inductor_options(device: torch.device) -> dict:
    """``torch._inductor.config`` entries for a launch-bound program on the CUDA ``device`` (a pass or a propose
    at B=1, replayed from a CUDA graph): one launch for independent kernels (``combo_kernels``), and inductor's
    kernels launched with PDL where specla's are (:func:`enabled`)."""
    return {"combo_kernels": True, "triton.enable_pdl": enabled(device)}


@triton.jit
def wait_upstream(USE_PDL: tl.constexpr):
    """With PDL: wait for the kernel before this one (and so for all before it), then let the next one launch."""
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
