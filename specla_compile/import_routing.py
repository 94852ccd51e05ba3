"""Where the known GDN entry points live, and routing them as their modules are imported.

``import specla_compile`` must route fla's and transformers' GDN entry points (the capture), whichever
is imported first, yet stay light: the command line's ``--help`` should not load torch, fla or Triton.
So the package only watches the modules below: one already imported is routed at once, any other is
routed right after it executes (a ``sys.meta_path`` finder wraps its loader). The routing itself,
:func:`specla_compile.lowering.capture.route`, loads torch when it first runs. This module imports
nothing heavy.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from types import ModuleType
from typing import Any

FLA_GDN_LAYER = "fla.layers.gated_deltanet"
FLA_MODULES = "fla.modules"
FLA_MLP = "fla.modules.mlp"
TRANSFORMERS_GDN_FAMILIES = ("qwen3_next", "qwen3_5", "qwen3_5_moe", "olmo_hybrid")


def transformers_modeling(family: str) -> str:
    return f"transformers.models.{family}.modeling_{family}"


ROUTED_MODULES = frozenset({FLA_GDN_LAYER, FLA_MODULES, FLA_MLP, *map(transformers_modeling, TRANSFORMERS_GDN_FAMILIES)})


def _route(name: str) -> None:
    from .lowering.capture import route

    route(name)


class _RoutingLoader(importlib.abc.Loader):
    """The module's own loader, then the routing of its entry points."""

    def __init__(self, loader: importlib.abc.Loader):
        self.loader = loader

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self.loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self.loader.exec_module(module)
        _route(module.__name__)

    def __getattr__(self, name: str) -> Any:  # get_source, get_filename, ... of the wrapped loader
        return getattr(self.loader, name)


class _RoutingFinder(importlib.abc.MetaPathFinder):
    """Finds a watched module with the other finders and wraps its loader."""

    def find_spec(self, name: str, path, target=None) -> importlib.machinery.ModuleSpec | None:
        if name not in ROUTED_MODULES:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None:
                if spec.loader is not None:
                    spec.loader = _RoutingLoader(spec.loader)
                return spec
        return None


def route_on_import() -> None:
    """Route the watched modules already imported, and the others when they are imported (once)."""
    if not any(isinstance(finder, _RoutingFinder) for finder in sys.meta_path):
        sys.meta_path.insert(0, _RoutingFinder())
    for name in sorted(ROUTED_MODULES & set(sys.modules)):
        _route(name)
