"""SpecLA compile: a ``torch.compile`` backend and speculative-decoding runtime for Gated DeltaNet models."""

import warnings

# fla warns on import on any machine without a Triton GPU; on CPU we route its kernels to our references.
warnings.filterwarnings("ignore", message="Triton is not supported on current platform", category=UserWarning)

from .lowering.capture import install as _install_capture  # noqa: E402

_install_capture()

from . import backend  # noqa: E402,F401  (registers backend="specla" by name)
from .runtime.config import SpecConfig  # noqa: E402
from .runtime.drafters import EagleDrafter, ModelDrafter, NgramDrafter  # noqa: E402
from .runtime.generator import GenerationStats, SpeculativeGenerator, SpeculativeOutput  # noqa: E402

__all__ = [
    "EagleDrafter",
    "GenerationStats",
    "ModelDrafter",
    "NgramDrafter",
    "SpecConfig",
    "SpeculativeGenerator",
    "SpeculativeOutput",
]

__version__ = "0.1.0"
