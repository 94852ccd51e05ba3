"""Verify a random draft tree with the GDN tree op and check it against the sequential oracle.

Runs offline on CPU (or GPU with --device cuda): builds a random tree, verifies it with the
``specla::gdn_tree_verify`` op in one call, and compares every node's output with the sequential
recurrence along its own root-to-node path.
"""

from __future__ import annotations

import argparse

import torch

from specla_compile.kernels import gdn_tree_reference, ops
from specla_compile.runtime.topology import chain_decomposition, depth


def random_tree(num_nodes: int, generator: torch.Generator) -> torch.Tensor:
    parents = [-1] + [int(torch.randint(0, j, (1,), generator=generator)) for j in range(1, num_nodes)]
    return torch.tensor([parents])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=16)
    parser.add_argument("--heads", type=int, default=2)
    parser.add_argument("--value-heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=32)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    gen = torch.Generator().manual_seed(args.seed)
    parents = random_tree(args.nodes, gen)
    b, n, h, hv, d = 1, args.nodes, args.heads, args.value_heads, args.head_dim
    q, k = torch.randn(b, n, h, d, generator=gen), torch.randn(b, n, h, d, generator=gen)
    v = torch.randn(b, n, hv, d, generator=gen)
    g = -torch.rand(b, n, hv, generator=gen)
    beta = torch.rand(b, n, hv, generator=gen)
    state = torch.randn(b, hv, d, d, generator=gen)
    tensors = [t.to(args.device) for t in (q, k, v, g, beta, parents, state)]

    o, _ = ops.gdn_tree_verify(*tensors, d**-0.5, True)
    expected, _ = gdn_tree_reference(*(t.double() if t.is_floating_point() else t for t in tensors), use_qk_l2norm=True)
    err = (o.double() - expected).abs().max().item()

    chains = chain_decomposition(parents[0])
    print(f"tree of {n} nodes, parents = {parents[0].tolist()}")
    print(f"depth {depth(parents).max().item() + 1}, {len(chains.chains)} heavy-light chains: {list(chains.chains)}")
    print(f"outputs {tuple(o.shape)}; max |verify - sequential path recurrence (fp64)| = {err:.2e}")
    if err > 1e-4:
        raise SystemExit("verification disagrees with the sequential oracle")


if __name__ == "__main__":
    main()
