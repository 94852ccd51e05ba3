"""Which verify route (``serial``, ``parallel``, ``hybrid``) runs a draft, and with which launch shape.

The kernels take the topology as device tensors, so the custom op itself only knows the node count;
reading ``parents`` back would synchronize with the host and break CUDA-graph capture. The caller that
built the draft on the host (the runtime) can describe it with :func:`topology_hint`; without a hint
the cost model assumes the deepest tree of that size (a chain), the case where the routes differ most.
:func:`use_route` or the environment variable ``SPECLA_VERIFY_ROUTE`` force a route.

Inside :func:`commits_before_wait` (the engine's capture of a pass) the recurrent kernels launched with PDL on the
cache's states commit a layer's pending records before their PDL wait, while the kernel before them still runs: in a
pass, only a layer's own launch touches its state, and only the end of an earlier pass writes its records.

The cost model's constants are per-layer latencies in microseconds on an H200 at the GDN-1.3B shape,
fitted from ``benchmarks/results/bench_kernels.json`` (``cost_model`` there).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import os
from collections.abc import Iterable, Iterator

import torch

from ..tree import PAD, depth

ROUTES = ("serial", "parallel", "hybrid")


@dataclasses.dataclass(frozen=True)
class KernelConfig:
    """Launch shape of a route: V-tile width, warps per program, K chunk of the parallel route, the launch shape of a
    commit run as its own kernel before the verify (None: fused into it)."""

    block_v: int = 8
    num_warps: int = 1
    block_k: int = 64
    separate_commit: KernelConfig | None = None


@dataclasses.dataclass(frozen=True)
class TopologyHint:
    """What the cost model needs to know about a draft (the largest row of a batch)."""

    num_nodes: int  # real nodes
    height: int  # nodes on the longest root-to-node path
    jumps: int  # nodes that do not continue the node before them (the serial route resumes a parked state)
    chains: int  # heavy-light chains: real nodes minus nodes with a child (one hybrid program each)

    @classmethod
    def from_parents(cls, parents: torch.Tensor) -> TopologyHint:
        """Describe a host ``[B, N]`` parent array (run it where the draft is built, not in the hot path)."""
        parents = parents.cpu()
        real = parents != PAD
        jumps = real & (parents != torch.arange(parents.shape[1]) - 1)
        height = depth(parents).masked_fill(~real, 0).max() + 1
        chains = [int(r.sum()) - len({p for p in row.tolist() if p >= 0}) for row, r in zip(parents, real, strict=True)]
        return cls(int(real.sum(-1).max()), int(height), int(jumps.sum(-1).max()), max(chains))

    @classmethod
    def chain(cls, num_nodes: int) -> TopologyHint:
        return cls(num_nodes, num_nodes, 0, 1)


def route_features(route: str, hint: TopologyHint) -> tuple[float, ...]:
    """What a route's latency grows with: the serial route walks every node and reloads a parked state
    at every jump; the hybrid route's longest program walks the tree's height, and every chain adds
    programs whose on-chip topology analysis grows with the node count; the parallel route's inverse
    takes log2(padded nodes) doubling levels."""
    if route == "serial":
        return (1.0, hint.num_nodes, hint.jumps)
    if route == "hybrid":
        return (1.0, hint.height, hint.chains * hint.num_nodes)
    if route == "parallel":
        return (1.0, max(15, hint.num_nodes - 1).bit_length())
    raise ValueError(f"unknown route {route!r}; expected one of {ROUTES}")


@dataclasses.dataclass(frozen=True)
class CostModel:
    """Latency of a route = its coefficients . :func:`route_features` (microseconds)."""

    coefficients: dict[str, tuple[float, ...]]

    def estimate(self, route: str, hint: TopologyHint) -> float:
        return sum(c * f for c, f in zip(self.coefficients[route], route_features(route, hint), strict=True))


# Fitted on the H200 run committed in benchmarks/results (serial and parallel from the chain and tree
# tables, hybrid from the sweep at its launch shape below). The parallel fit has two sizes (16 and 32
# nodes), so 64 nodes is an extrapolation.
H200_COSTS = CostModel({"serial": (4.497, 0.739, 0.377), "hybrid": (7.345, 0.441, 0.073), "parallel": (-5.967, 3.874)})

_forced: contextvars.ContextVar[str | None] = contextvars.ContextVar("specla_forced_route", default=None)
_hint: contextvars.ContextVar[TopologyHint | None] = contextvars.ContextVar("specla_topology_hint", default=None)
_early_states: contextvars.ContextVar[frozenset[int]] = contextvars.ContextVar("specla_early_states",
                                                                               default=frozenset())


@contextlib.contextmanager
def use_route(route: str) -> Iterator[None]:
    """Force ``route`` for every verify launched inside the block."""
    if route not in ROUTES:
        raise ValueError(f"unknown route {route!r}; expected one of {ROUTES}")
    token = _forced.set(route)
    try:
        yield
    finally:
        _forced.reset(token)


@contextlib.contextmanager
def topology_hint(hint: TopologyHint) -> Iterator[None]:
    """Describe the drafts verified inside the block (e.g. around one target forward pass)."""
    token = _hint.set(hint)
    try:
        yield
    finally:
        _hint.reset(token)


@contextlib.contextmanager
def commits_before_wait(states: Iterable[torch.Tensor]) -> Iterator[None]:
    """Recurrent launches inside on one of ``states`` (by address: a static cache's tensors) commit its pending records
    before their PDL wait. The caller guarantees that in what it runs (a pass) no kernel before such a launch writes
    that state or its records, and that the kernel just before it does not read the state: only the launch itself
    touches the state, and only an earlier pass's end writes the records. A copy of the state (the op's own, for a
    layout the kernels do not take, or inductor's) lies elsewhere, so its launch waits first. Read at launch: a
    captured graph keeps it."""
    token = _early_states.set(frozenset(t.data_ptr() for t in states))
    try:
        yield
    finally:
        _early_states.reset(token)


def early_commit(state: torch.Tensor) -> bool:
    """Whether a recurrent launch on ``state`` now may commit before its PDL wait (:func:`commits_before_wait`)."""
    return state.data_ptr() in _early_states.get()


def choose_route(num_nodes: int, costs: CostModel = H200_COSTS) -> str:
    """The route for a verify of ``num_nodes`` nodes: forced, else the cheapest for the current hint."""
    forced = _forced.get() or os.environ.get("SPECLA_VERIFY_ROUTE")
    if forced:
        if forced not in ROUTES:
            raise ValueError(f"SPECLA_VERIFY_ROUTE={forced!r} is not one of {ROUTES}")
        return forced
    hint = _hint.get() or TopologyHint.chain(num_nodes)
    return min(ROUTES, key=lambda route: costs.estimate(route, hint))


def kernel_config(route: str, num_nodes: int, pending: bool = False, batch: int = 1) -> KernelConfig:
    """Launch shape per route on an H200 at K = V = 256, from the benchmarks' sweeps. The recurrent
    routes are latency-bound, so narrow tiles and few warps keep the K-reductions in-warp; the parallel
    route amortizes its per-program node-matrix work over wide V tiles, narrower when the fused commit
    also holds a full K x BV tile in registers. A one-node pass (plain decoding's step) has no chain to walk:
    two warps per program there (``bench_kernels.md``'s sweep, node1: 4.38 -> 3.81 us, with a pending record
    6.05 -> 5.49 us at 16 columns), where they cost a longer chain 25-40%.

    In a batch the parallel route's programs (V tiles x rows x heads) outnumber the SMs, and every program
    repeats the node matrices, so wide tiles win there: 64 columns from 2 rows, and from 8 rows the commit
    as its own launch so that the verify takes 128 columns a program (``batch_verify_gpu.md``, 16 rows x
    16 nodes with records: 120 -> 46 us a layer; at one row 13.3 us either way). Its fused commit applies a row's
    records one at a time, about 0.6 us each a layer at the 1.3B shape (the 16-node pass 1.759 ms with none, 1.943
    with 13, ``e2e_gpu.json``'s ``fla_b1_4b2a5dc``; a UT form of the commit, flat in the count, was slower at every count
    on an H200: ``docs/kernels.md``). At one row that fused launch takes 16 columns, 2 warps and K chunks of 32: on an
    H100 the 9-node chain's launch 10.4 -> 8.8 us against 4 warps and chunks of 64, and every captured pass of 9 to 32
    nodes faster (``benchmarks/results/parallel_launch_h100``, where 1 warp was slower than either)."""
    if route == "parallel":
        if batch >= 8:
            wide = KernelConfig(128, 4, 32)
            return dataclasses.replace(wide, separate_commit=KernelConfig(32, 4)) if pending else wide
        if pending and batch == 1:
            return KernelConfig(block_v=16, num_warps=2, block_k=32)
        return KernelConfig(64, 4, 32)
    if num_nodes == 1 and route == "serial":
        return KernelConfig(block_v=16 if pending else 8, num_warps=2)
    return KernelConfig(block_v=8, num_warps=1)
