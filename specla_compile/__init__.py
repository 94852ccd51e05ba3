"""SpecLA compile: a ``torch.compile`` backend and speculative-decoding runtime for Gated DeltaNet models.

Importing the package routes fla's and transformers' GDN entry points (now, or when they are imported:
:mod:`.import_routing`) and loads nothing heavy; the public names below load on first use.
``backend="specla"`` is registered through the ``torch_dynamo_backends`` entry point.
"""

from __future__ import annotations

import importlib
import warnings
from typing import TYPE_CHECKING, Any

from .import_routing import route_on_import

# fla warns on import on any machine without a Triton GPU; on CPU we route its kernels to our references.
warnings.filterwarnings("ignore", message="Triton is not supported on current platform", category=UserWarning)
route_on_import()

if TYPE_CHECKING:  # (for type checkers: the names __getattr__ loads)
    from .runtime.config import SpecConfig
    from .runtime.drafters import EagleDrafter, ModelDrafter, NgramDrafter
    from .runtime.generator import GenerationStats, SpeculativeGenerator, SpeculativeOutput

_PUBLIC = {
    "EagleDrafter": ".runtime.drafters",
    "GenerationStats": ".runtime.generator",
    "ModelDrafter": ".runtime.drafters",
    "NgramDrafter": ".runtime.drafters",
    "SpecConfig": ".runtime.config",
    "SpeculativeGenerator": ".runtime.generator",
    "SpeculativeOutput": ".runtime.generator",
}
__all__ = ["EagleDrafter", "GenerationStats", "ModelDrafter", "NgramDrafter", "SpecConfig", "SpeculativeGenerator", "SpeculativeOutput"]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    if name not in _PUBLIC:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(_PUBLIC[name], __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_PUBLIC])
