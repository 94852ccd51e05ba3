"""Cases and checks shared by the Triton kernel tests: on CPU under the interpreter (small shapes) and
on CUDA (real shapes). Each check runs a kernel with poisoned (NaN) allocations and compares every
output element with the fp64 reference."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from specla_compile.kernels import reference as ref
from specla_compile.runtime.topology import PAD

NAMES = ("q", "k", "v", "g", "beta")


def random_parents(rows: int, nodes: int, *, seed: int, kind: str = "tree", padding: int = 0) -> torch.Tensor:
    """``[rows, nodes + padding]``: ``chain``, ``tree`` (random parent among earlier nodes, biased to
    recent ones so trees get deep), ``forest`` (some extra roots) or ``star``; PAD tail of ``padding``."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(rows):
        row = [-1]
        for j in range(1, nodes):
            if kind == "chain":
                row.append(j - 1)
            elif kind == "star":
                row.append(0)
            elif kind == "forest" and torch.rand((), generator=gen) < 0.2:
                row.append(-1)
            elif torch.rand((), generator=gen) < 0.7:
                row.append(max(0, j - int(torch.randint(1, 4, (), generator=gen))))
            else:
                row.append(int(torch.randint(0, j, (), generator=gen)))
        out.append(row + [PAD] * padding)
    return torch.tensor(out, dtype=torch.long)


def random_inputs(
    parents: torch.Tensor, *, heads: int, value_heads: int, dk: int, dv: int, seed: int,
    dtype: torch.dtype, device: str | torch.device = "cpu",
) -> dict[str, torch.Tensor]:
    """Unnormalized q, k (the kernels normalize), v, gates, fp32 state: random, never zero."""
    gen = torch.Generator().manual_seed(seed)
    batch, n = parents.shape
    randn = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)
    x = {
        "q": randn(batch, n, heads, dk).to(dtype),
        "k": randn(batch, n, heads, dk).to(dtype),
        "v": randn(batch, n, value_heads, dv).to(dtype),
        "g": (-torch.rand(batch, n, value_heads, generator=gen, dtype=torch.float64) * 0.7 - 0.01).float(),
        "beta": (torch.rand(batch, n, value_heads, generator=gen, dtype=torch.float64) * 0.9 + 0.05).float(),
        "state": randn(batch, value_heads, dk, dv).float(),
    }
    return {name: t.to(device) for name, t in x.items()}


def accepted_records(x: dict[str, torch.Tensor], parents: torch.Tensor, max_accepted: int, seed: int):
    """Records of a root path of each row (what a commit applies) and a random accepted count per row
    (0 included), from the fp64 reference's records of ``x``."""
    _, records = ref.gdn_tree_factorized(*(x[n].double() for n in NAMES), parents, None, use_qk_l2norm=True)
    paths = [_deepest_path(row) for row in parents.tolist()]
    width = min(max_accepted, min(len(p) for p in paths))
    index = torch.tensor([p[:width] for p in paths], device=parents.device)
    gen = torch.Generator().manual_seed(seed)
    num = torch.randint(0, width + 1, (parents.shape[0],), generator=gen).to(parents.device)
    return ref.FactorRecords(*(t.float() for t in records.select(index))), num


def _deepest_path(row: list[int]) -> list[int]:
    real = [j for j, p in enumerate(row) if p != PAD]
    last = max(real, key=lambda j: (_depth(row, j), -j))
    path = [last]
    while row[path[-1]] >= 0:
        path.append(row[path[-1]])
    return path[::-1]


def _depth(row: list[int], j: int) -> int:
    return 0 if row[j] < 0 else 1 + _depth(row, row[j])


@contextlib.contextmanager
def poisoned_allocations() -> Iterator[None]:
    """Inside the block, ``torch.empty``/``empty_like`` return NaN-filled floats, so an element a kernel
    never writes shows up as NaN instead of leftover memory that might happen to be right."""
    empty, empty_like = torch.empty, torch.empty_like

    def poison(t: torch.Tensor) -> torch.Tensor:
        return t.fill_(float("nan")) if t.is_floating_point() else t

    torch.empty = lambda *a, **kw: poison(empty(*a, **kw))
    torch.empty_like = lambda *a, **kw: poison(empty_like(*a, **kw))
    try:
        yield
    finally:
        torch.empty, torch.empty_like = empty, empty_like


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """Relative Frobenius error; NaN (an unwritten element) never passes."""
    a, b = a.double(), b.double().to(a.device)
    if not torch.isfinite(a).all():
        return float("inf")
    return ((a - b).norm() / b.norm()).item()


def reference_verify(x: dict[str, torch.Tensor], parents: torch.Tensor, scale: float, use_qk_l2norm: bool,
                     pending: tuple[ref.FactorRecords, torch.Tensor] | None = None):
    """fp64 oracle on the inputs' device: (o, k_hat, state after the pending commit)."""
    x64 = {n: t.double() for n, t in x.items()}
    state = x64["state"]
    if pending is not None:
        records, num = pending
        state = ref.gdn_commit_reference(state, ref.FactorRecords(*(t.double() for t in records)), num)
    o, _ = ref.gdn_tree_reference(*(x64[n] for n in NAMES), parents, state, scale=scale, use_qk_l2norm=use_qk_l2norm)
    k_hat = ref.l2norm(x64["k"]) if use_qk_l2norm else x64["k"]
    return o, k_hat, state


def random_gate_projections(rows: int, nodes: int, value_heads: int, *, seed: int, dtype: torch.dtype,
                            device: str | torch.device = "cpu") -> tuple[torch.Tensor, ...]:
    """A GDN layer's gate inputs as a pass reads them: ``a, b [rows, nodes, HV]`` as strided column slices of one
    wider projection output, and ``A_log, dt_bias [HV]``; one ``a + dt_bias`` far past softplus's threshold of 20
    (where ``log(1 + e^x)`` overflows) and one far below zero (where ``log1p`` matters)."""
    gen = torch.Generator().manual_seed(seed)
    wide = 2 * torch.randn(rows, nodes, 3 * value_heads + 5, generator=gen, dtype=torch.float64)
    a_log, dt_bias = 0.5 * torch.randn(value_heads, generator=gen), torch.randn(value_heads, generator=gen)
    wide[0, 0, 1], wide[-1, 0, value_heads] = 100.0, -40.0  # (a's first and last gate; e^100 overflows float32)
    wide = wide.to(dtype).to(device)
    return (wide[..., 1 : 1 + value_heads], wide[..., 2 * value_heads + 3 : 3 * value_heads + 3],
            a_log.to(device), dt_bias.to(device))


def gates_commit_verify_oracle(x: dict[str, torch.Tensor], gates: tuple[torch.Tensor, ...], parents: torch.Tensor,
                               scale: float, use_qk_l2norm: bool, pending=None):
    """fp64 oracle of ``gdn_gates_commit_verify_``: (o, k_hat, state after the commit, g, beta)."""
    g, beta = ref.gdn_gates_reference(*(t.double() for t in gates))
    o, k_hat, state = reference_verify({**x, "g": g, "beta": beta}, parents, scale, use_qk_l2norm, pending)
    return o, k_hat, state, g, beta


def random_conv_gates_pass(rows: int, heads: int, value_heads: int, dim: int, nums: tuple[int, ...], *, seed: int,
                           dtype: torch.dtype, device: str | torch.device = "cpu", width: int = 4,
                           capacity: int = 3) -> dict:
    """A one-node pass of a GDN layer from its projection, as ``specla::gdn_conv_gates_commit_verify_`` takes it: q/k/v
    inputs ``xs`` as strided slices of one ``dtype`` output, their conv states, weights and pending inputs (``nums``
    of them a row), the recurrent state (float32) with pending records, the gate projections and the root's parents."""
    gen = torch.Generator().manual_seed(seed)
    widths = (heads * dim, heads * dim, value_heads * dim)
    proj = torch.randn(rows, 1, sum(widths) + 3, generator=gen)
    make = lambda *shape, scale=1.0: (scale * torch.randn(*shape, generator=gen)).to(dtype).to(device)
    records = (torch.nn.functional.normalize(torch.randn(rows, capacity, heads, dim, generator=gen), dim=-1),
               torch.randn(rows, capacity, value_heads, dim, generator=gen),
               -torch.rand(rows, capacity, value_heads, generator=gen), torch.rand(rows, capacity, value_heads, generator=gen))
    proj = proj.to(dtype).to(device)
    return {
        "xs": [proj[..., 1 : 1 + widths[0]], proj[..., 1 + widths[0] : 1 + 2 * widths[0]], proj[..., 3 + 2 * widths[0] :]],
        "conv_states": [make(rows, d, width) for d in widths],
        "weights": [make(d, width, scale=0.5) for d in widths],
        "conv_pending": [make(rows, capacity, d) for d in widths],
        "num": torch.tensor(nums, device=device),
        "records": tuple(r.to(device) for r in records),
        "gates": random_gate_projections(rows, 1, value_heads, seed=seed + 1, dtype=dtype, device=device),
        "state": (0.3 * torch.randn(rows, value_heads, dim, dim, generator=gen)).to(device),
        "parents": torch.full((rows, 1), -1, device=device),
    }


def conv_gates_oracle(case: dict, scale: float, use_qk_l2norm: bool) -> tuple[tuple, list, torch.Tensor]:
    """fp64 composition of ``gdn_conv_gates_commit_verify_`` (its reference): (outputs, conv states, state) after it."""
    d = lambda ts: [t.double() for t in ts]
    state, conv_states = case["state"].double(), d(case["conv_states"])
    outputs = torch.ops.specla.gdn_conv_gates_commit_verify_(
        conv_states, d(case["conv_pending"]), d(case["xs"]), d(case["weights"]), True, state, *d(case["records"]),
        case["num"], *d(case["gates"]), case["parents"], scale, use_qk_l2norm)
    return outputs, conv_states, state
