"""What one EAGLE propose launches: the device calls of the program inductor compiles for it, counted on a CPU.

On the H200 a graphed propose is bound by its kernel count (about 4 us per kernel, see
``eagle_profile.md``). This counts the device calls of inductor's CPU code for the same propose per route
(the study's chain and tree) at a small head, with the head's attention as ``specla::draft_attention`` (the
CUDA default), and lists each call, in order: a quick check on a CPU of what a change to the propose does
to its structure. It is not the GPU's count: inductor fuses differently there (560434e's cut
from 116 to 95 calls here took the H200's tree propose from 169 to 166 kernels only).

    python benchmarks/eagle_kernels_cpu.py --out benchmarks/results   # eagle_kernels_cpu.{json,md}

A count is a floor of the GPU's: cuBLAS may add a split-K reduction to a GEMM, and some custom ops are two
kernels each on CUDA (``linear_top_k``, ``draft_attention``).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import re

import torch
from eagle_profile import CONFIGS, stub_target
from torch._inductor.utils import run_and_get_code

from specla_compile.runtime.config import SpecConfig
from specla_compile.runtime.drafters import EagleConfig, EagleDrafter, EagleHead
from specla_compile.runtime.drafting import DraftRequest

# a device call in inductor's generated ``call``: a fused kernel, an extern GEMM, an op it does not lower
CALL = re.compile(r"^(?:\w+ = )?(cpp_fused_\w+|extern_kernels\.\w+|torch\.ops\.\w+\.\w+)(?=[.(])")


def device_calls(config: SpecConfig, vocab: int = 1000, hidden: int = 128) -> list[str]:
    """The device calls of one compiled propose (the catch-up of ``depth + 1`` pairs, then the levels)."""
    torch.manual_seed(0)
    head = EagleHead(EagleConfig(hidden, vocab, 4, 2 * hidden)).eval()
    target = stub_target(hidden, vocab, torch.float32, "cpu")
    # (the head's GEMMs as the fused specla ops, as the committed counts were taken; the default, PyTorch code,
    # leaves them to inductor's GEMMs and fusions)
    drafter = EagleDrafter(head, target, static_shapes=True, compiled=True, attention="specla", head_gemms="specla")
    seq = torch.randint(0, vocab, (40,))
    drafter.begin([seq[:-1]], [torch.randn(39, hidden)])
    torch._dynamo.reset()
    _, code = run_and_get_code(functools.partial(drafter.propose, DraftRequest([0], [seq]), config))
    body = code[-1][code[-1].index("def call("):]
    return [m.group(1) for m in map(CALL.match, (line.strip() for line in body.splitlines())) if m]


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    results = {"torch": torch.__version__, "routes": {}}
    lines = ["# Device calls of one compiled EAGLE propose (inductor's CPU code, specla attention)", "",
             f"torch {torch.__version__}; `python benchmarks/eagle_kernels_cpu.py --out DIR`", "",
             "| route | calls | GEMMs | custom ops | fused kernels |", "| --- | --- | --- | --- | --- |"]
    for name, config in CONFIGS.items():  # (the routes of benchmarks/e2e_trained.py)
        calls = device_calls(config)
        kinds = {kind: sum(c.startswith(prefix) for c in calls)
                 for kind, prefix in (("gemm", "extern_kernels"), ("custom", "torch.ops"), ("fused", "cpp_fused"))}
        results["routes"][name] = {"calls": len(calls), **kinds, "sequence": calls}
        lines.append(f"| {name} | {len(calls)} | {kinds['gemm']} | {kinds['custom']} | {kinds['fused']} |")
        print(f"{name}: {len(calls)} device calls ({kinds})", flush=True)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "eagle_kernels_cpu.json"), "w") as f:
        json.dump(results, f, indent=1)
    with open(os.path.join(args.out, "eagle_kernels_cpu.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    return results


if __name__ == "__main__":
    main()
