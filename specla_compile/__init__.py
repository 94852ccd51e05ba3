"""SpecLA compile: a ``torch.compile`` backend and speculative-decoding runtime for Gated DeltaNet models."""

__version__ = "0.1.0"
