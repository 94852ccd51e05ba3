"""Worst errors of the reference ops against independent oracles over many random trees (CPU).

For 200 random batches of trees (up to 16 nodes, grouped heads, l2norm on and off): the sequential
and factorized verify against a per-path matrix recurrence, commit of a node's path against that
node's state, fused commit-then-verify against commit followed by verify, and the tree conv against a
plain causal conv along each path; fp64 absolute and fp32 relative errors. Writes JSON.

    python benchmarks/reference_errors.py --out benchmarks/results
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys

import torch
import torch.nn.functional as F

from specla_compile.kernels import (
    gdn_commit_reference,
    gdn_commit_verify_reference,
    gdn_tree_factorized,
    gdn_tree_reference,
    tree_conv_reference,
)
from specla_compile.runtime.topology import PAD, path_to

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
NAMES = ("q", "k", "v", "g", "beta")


def random_parents(rng: random.Random) -> torch.Tensor:
    rows = []
    for _ in range(rng.randint(1, 3)):
        n = rng.randint(1, 16)
        rows.append([-1] + [rng.randint(-1, j - 1) for j in range(1, n)])
    size = max(map(len, rows))
    return torch.tensor([r + [PAD] * (size - len(r)) for r in rows])


def error(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> float:
    diff = (got.double() - want.double()).norm() if dtype == torch.float32 else (got.double() - want.double()).abs().max()
    return (diff / want.double().norm()).item() if dtype == torch.float32 else diff.item()


def main() -> None:
    from helpers import path_recurrence, random_gdn_inputs  # tests/helpers.py: the independent oracle

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("--trials", type=int, default=200)
    args = parser.parse_args()
    rng = random.Random(0)
    worst: dict[str, float] = {}

    def note(name: str, value: float) -> None:
        worst[name] = max(worst.get(name, 0.0), value)

    for trial in range(args.trials):
        parents = random_parents(rng)
        l2 = trial % 2 == 0
        for dtype, tag in ((torch.float64, "fp64 abs"), (torch.float32, "fp32 rel")):
            x = random_gdn_inputs(parents, heads=2, value_heads=4, dk=8, dv=8, dtype=dtype, seed=trial)
            args_ = [x[n] for n in NAMES]
            o_seq, states = gdn_tree_reference(*args_, parents, x["initial_state"], scale=0.3, use_qk_l2norm=l2)
            o_fac, records = gdn_tree_factorized(*args_, parents, x["initial_state"], scale=0.3, use_qk_l2norm=l2)
            for b, row in enumerate(parents.tolist()):
                for j, p in enumerate(row):
                    if p == PAD:
                        continue
                    path = path_to(parents[b], j)
                    o_path, s_path = path_recurrence(x, path, b, 0.3, l2)
                    note(f"sequential verify vs path recurrence ({tag})", error(o_seq[b, j], o_path, dtype))
                    note(f"factorized verify vs path recurrence ({tag})", error(o_fac[b, j], o_path, dtype))
                    index = torch.tensor(path)[None].expand(parents.shape[0], -1)
                    committed = gdn_commit_reference(x["initial_state"], records.select(index), torch.full((parents.shape[0],), len(path)))
                    note(f"commit of a path vs its last state ({tag})", error(committed[b], s_path, dtype))
            num = torch.tensor([rng.randint(0, parents.shape[1]) for _ in range(parents.shape[0])])
            fresh = random_gdn_inputs(parents, heads=2, value_heads=4, dk=8, dv=8, dtype=dtype, seed=trial + 10_000)
            o, _, state = gdn_commit_verify_reference(
                x["initial_state"], records, num, *(fresh[n] for n in NAMES), parents, scale=0.3, use_qk_l2norm=l2
            )
            separate_state = gdn_commit_reference(x["initial_state"], records, num)
            separate_o, _ = gdn_tree_factorized(*(fresh[n] for n in NAMES), parents, separate_state, scale=0.3, use_qk_l2norm=l2)
            note(f"fused commit-then-verify vs separate ({tag})", error(o, separate_o, dtype))
            gen = torch.Generator().manual_seed(trial)
            xs = torch.randn(parents.shape[0], parents.shape[1], 6, generator=gen, dtype=dtype)
            conv_state = torch.randn(parents.shape[0], 6, 3, generator=gen, dtype=dtype)
            weight = torch.randn(6, 4, generator=gen, dtype=dtype)
            y = tree_conv_reference(xs, conv_state, weight, None, parents)
            for b, row in enumerate(parents.tolist()):
                for j, p in enumerate(row):
                    if p != PAD:
                        seq = torch.cat([conv_state[b], xs[b, path_to(parents[b], j)].T], -1)[None]
                        want = F.silu(F.conv1d(seq, weight[:, None], groups=6)[0, :, -1])
                        note(f"tree conv vs causal conv along the path ({tag})", error(y[b, j], want, dtype))
    for name, value in sorted(worst.items()):
        print(f"{value:10.3e}  {name}")
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "reference_errors.json"), "w") as f:
        json.dump({"trials": args.trials, "worst": worst}, f, indent=2)


if __name__ == "__main__":
    main()
