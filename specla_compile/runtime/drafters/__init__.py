"""Drafters: prompt lookup, an EAGLE-style head on the target's features, and a small causal LM."""

from .eagle import EagleDrafter
from .eagle_head import EagleConfig, EagleHead
from .model import ModelDrafter
from .ngram import NgramDrafter

__all__ = ["EagleConfig", "EagleDrafter", "EagleHead", "ModelDrafter", "NgramDrafter"]
