"""The ``specla`` backend's options (``torch.compile(..., options={...})``) and their defaults.

Torch-free, so that the command line offers them without loading torch (``specla-generate --help``).
"""

from __future__ import annotations

INNER_COMPILERS = ("inductor", "aot_eager", "eager")  # option ``inner``
PLAIN_PROGRAMS = ("compiled", "eager")  # option ``plain``: how plain calls run
SWITCHES = {  # the bool options and their defaults
    "fuse_projections": True, "combo_kernels": True, "fold_norms": False, "fold_gated_norms": True,
    "fold_gated_norms_drafted": False, "fold_gates": True, "fold_gates_drafted": False, "fold_convs": False,
    "fold_swiglu": True, "fold_swiglu_drafted": True, "triton_linears": False, "cuda_gemvs": False,
    "regional": True,
}
OPTIONS = {"inner", "verify_kernel", "plain", *SWITCHES}
