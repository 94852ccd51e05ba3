"""User-facing configuration of speculative decoding."""

from __future__ import annotations

import numbers
from dataclasses import dataclass
from typing import Literal

from .topology import bucket_size

BATCH_WITHOUT_PADDING = 8  # from this many rows the default bucket pads no draft (SpecConfig.pass_nodes)


@dataclass
class SpecConfig:
    """How drafts are built and verified.

    ``mode="chain"`` drafts ``depth`` tokens in a line. ``mode="tree"`` rolls out a beam of width
    ``tree_top_k`` for ``depth`` levels, keeps nodes whose cumulative draft log-probability is within
    ``tau`` of the best node at the same depth, and truncates to ``budget`` nodes (every kept node
    keeps its ancestors). Every verify pass of a call has the largest draft's size padded to a multiple of
    ``bucket`` nodes, so that configurations of similar size share one compiled graph; None (default): 8
    below ``BATCH_WITHOUT_PADDING`` rows, where a pass costs about the same whatever its size, and no
    padding from there, where padded nodes cost GEMM compute (:meth:`pass_nodes`). Wrong types raise
    ``TypeError`` and out-of-range values ``ValueError`` here, not deep inside generation.

    ``engine="static"`` (default) runs every pass over static buffers (:mod:`.engine`), replaying CUDA
    graphs on CUDA unless ``cuda_graphs=False``; ``engine="dynamic"`` calls the compiled model on the
    model's own growing cache (no graphs). ``prefill="engine"`` runs the prompts of models without
    attention layers through the static engine: the model's own forward over chunks of 32-256 tokens, then
    16-token chain passes (with CUDA graphs a few replays instead of an eager forward's hundreds of launches);
    ``"eager"`` prefills with the eager model (fla's chunk kernels), as hybrids and calls that continue a cache
    always do; None (default): the engine where it replays CUDA graphs. ``pipelined``: in static runs
    (greedy or sampled), a drafter that can (:meth:`~.drafting.Drafter.propose_after`: ``EagleDrafter``) drafts the
    next iteration from the verify pass's device outputs, queued behind the pass, and the next pass is
    queued behind that draft before the host reads the pass's result (the device stops rows at EOS and at
    their budgets itself); None (default) or True: wherever the drafter can; False: never (the drafter waits
    for the host's commit, as in tensor-parallel runs).
    """

    mode: Literal["chain", "tree"] = "chain"
    depth: int = 4
    tree_top_k: int = 2
    budget: int = 16
    tau: float = 4.0
    bucket: int | None = None
    engine: Literal["static", "dynamic"] = "static"
    cuda_graphs: bool | None = None
    prefill: Literal["engine", "eager"] | None = None
    pipelined: bool | None = None

    def __post_init__(self) -> None:
        if self.mode not in ("chain", "tree"):
            raise ValueError(f"SpecConfig.mode must be 'chain' or 'tree', got {self.mode!r}")
        for name in ("depth", "tree_top_k", "budget", "bucket"):
            value = getattr(self, name)
            if name == "bucket" and value is None:
                continue
            # bool is an int subclass, but depth=True is a mistake, not 1
            if isinstance(value, bool) or not isinstance(value, numbers.Integral):
                raise TypeError(f"SpecConfig.{name} must be an int, got {value!r} ({type(value).__name__})")
            if value < 1:
                raise ValueError(f"SpecConfig.{name} must be >= 1, got {value}")
            setattr(self, name, int(value))  # (numpy and torch integers become plain ints)
        if isinstance(self.tau, bool) or not isinstance(self.tau, numbers.Real):
            raise TypeError(f"SpecConfig.tau must be a number, got {self.tau!r} ({type(self.tau).__name__})")
        if not self.tau >= 0:  # (also rejects NaN)
            raise ValueError(f"SpecConfig.tau must be >= 0, got {self.tau}")
        self.tau = float(self.tau)
        if self.engine not in ("static", "dynamic"):
            raise ValueError(f"SpecConfig.engine must be 'static' or 'dynamic', got {self.engine!r}")
        if self.prefill not in (None, "engine", "eager"):
            raise ValueError(f"SpecConfig.prefill must be None, 'engine' or 'eager', got {self.prefill!r}")
        for name in ("cuda_graphs", "pipelined"):
            if getattr(self, name) not in (None, True, False):
                raise TypeError(f"SpecConfig.{name} must be None, True or False, got {getattr(self, name)!r}")

    @property
    def max_nodes(self) -> int:
        """Largest draft, pending token included."""
        return 1 + (self.depth if self.mode == "chain" else self.budget)

    def pass_nodes(self, batch: int) -> int:
        """Nodes of every verify pass of a call over ``batch`` rows: :attr:`max_nodes` padded to a multiple of
        the bucket. (On an H200 at the GDN-1.3B shape, 16 rows x p=0.8 L=8: a 16-node pass 3.38 ms, a 9-node
        one 3.20 ms; at one row a pass's cost barely grows with its nodes.)"""
        bucket = self.bucket or (1 if batch >= BATCH_WITHOUT_PADDING else 8)
        return bucket_size(self.max_nodes, bucket)
