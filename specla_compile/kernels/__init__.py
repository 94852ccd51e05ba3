"""Verify / commit / conv ops: PyTorch references, custom ops, and (on CUDA) Triton kernels."""

import importlib.util

import torch

from . import ops
from .reference import (
    FactorRecords,
    conv_state_commit_reference,
    gdn_commit_reference,
    gdn_commit_verify_reference,
    gdn_tree_factorized,
    gdn_tree_reference,
    tree_conv_reference,
)


def _register_cuda_kernels() -> bool:
    """Put the Triton kernels behind the ops on CUDA; CPU-only installs keep the references."""
    if not torch.cuda.is_available() or importlib.util.find_spec("triton") is None:
        return False
    from . import cuda  # noqa: F401  (importing registers the CUDA implementations)

    return True


TRITON_KERNELS = _register_cuda_kernels()

__all__ = [
    "TRITON_KERNELS",
    "FactorRecords",
    "conv_state_commit_reference",
    "gdn_commit_reference",
    "gdn_commit_verify_reference",
    "gdn_tree_factorized",
    "gdn_tree_reference",
    "ops",
    "tree_conv_reference",
]
