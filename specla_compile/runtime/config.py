"""User-facing configuration of speculative decoding."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass
class SpecConfig:
    """How drafts are built and verified.

    ``mode="chain"`` drafts ``depth`` tokens in a line. ``mode="tree"`` rolls out a beam of width
    ``top_k`` for ``depth`` levels, keeps nodes whose cumulative draft log-probability is within
    ``tau`` of the best node at the same depth, and truncates to ``budget`` nodes (every kept node
    keeps its ancestors). Trees are padded to a multiple of ``bucket`` nodes so that trees of similar
    size share one compiled graph.

    ``engine="static"`` (default) runs every pass over static buffers (:mod:`.engine`), replaying CUDA
    graphs on CUDA unless ``cuda_graphs=False``; ``engine="dynamic"`` calls the compiled model on the
    model's own growing cache (no graphs).
    """

    mode: Literal["chain", "tree"] = "chain"
    depth: int = 4
    top_k: int = 2
    budget: int = 16
    tau: float = 4.0
    bucket: int = 8
    engine: Literal["static", "dynamic"] = "static"
    cuda_graphs: bool | None = None

    def __post_init__(self) -> None:
        if self.mode not in ("chain", "tree"):
            raise ValueError(f"mode must be 'chain' or 'tree', got {self.mode!r}")
        for name in ("depth", "top_k", "budget", "bucket"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.engine not in ("static", "dynamic"):
            raise ValueError(f"engine must be 'static' or 'dynamic', got {self.engine!r}")
        if self.tau < 0:
            raise ValueError(f"tau must be >= 0, got {self.tau}")

    @property
    def max_nodes(self) -> int:
        """Largest draft, pending token included."""
        return 1 + (self.depth if self.mode == "chain" else self.budget)
