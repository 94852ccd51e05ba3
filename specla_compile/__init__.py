"""SpecLA compile: a ``torch.compile`` backend and speculative-decoding runtime for Gated DeltaNet models."""

from .lowering.capture import install as _install_capture

_install_capture()

__version__ = "0.1.0"
