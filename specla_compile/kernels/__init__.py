"""Verify / commit / conv ops: PyTorch references, custom ops, and (on CUDA) Triton kernels."""

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

__all__ = [
    "FactorRecords",
    "conv_state_commit_reference",
    "gdn_commit_reference",
    "gdn_commit_verify_reference",
    "gdn_tree_factorized",
    "gdn_tree_reference",
    "ops",
    "tree_conv_reference",
]
