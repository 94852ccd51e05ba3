"""A draft head's GEMMs with weight-only int8 against bf16, on the GPU: what ``EagleDrafter(quantize="int8")`` buys
per GEMM, and the tiles it takes (``triton_linear._tiles``'s int8 rule, ``ops.linear_split``'s int8 width).

Each shape of the head at hidden 2048 and 1024 (the fuse's feature half and o_proj, q/k/v, gate/up with its gate,
down; 4 rows, as a tree level's frontier), 24 distinct weights per shape replayed in one CUDA graph (the weights do
not stay in L2), microseconds per call: cuBLAS in bf16, specla's kernel in bf16, and in int8 at bf16's tiles (and
bf16's split rule), with steps twice as deep, with blocks twice as wide, as the op picks (the int8 rules), and at the
op's tiles with 8 warps a program instead of 4 (more threads to widen the integers: measured slower, see the results' notes); then a draft
vocabulary's LM head with its top-k (16 rows).

    python benchmarks/int8_gemm_gpu.py --out DIR     # DIR/int8_gemm_gpu.{json,md}
"""

from __future__ import annotations

import argparse
import functools
import os

import torch
from gemv_gpu import graph_ms, save_results, start_run

from specla_compile.kernels import ops, triton_linear
from specla_compile.kernels.reference import quantize_rows

COPIES = 24
VARIANTS = ("cublas", "bf16", "int8 at bf16's tiles", "int8 deeper steps", "int8 wider blocks", "int8 as the op picks",
            "int8, 8 warps")


def head_shapes(hidden: int) -> dict[str, tuple[int, int]]:
    return {"fuse / o_proj": (hidden, hidden), "q/k/v": (3 * hidden, hidden), "gate/up": (8 * hidden, hidden),
            "down": (hidden, 4 * hidden)}


def call(variant: str, x: torch.Tensor, weight: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, gated: bool) -> None:
    """One GEMM of ``variant``: through the op (a weight its rule splits, in bf16 or int8), or specla's kernel at
    explicit tiles (bf16's, deeper or wider)."""
    op = ops.gated_linear if gated else ops.linear
    if variant == "cublas":
        torch.nn.functional.linear(x, weight)
    elif variant == "bf16":
        op(x, weight)
    elif variant == "int8 as the op picks" or (variant == "int8 at bf16's tiles" and not gated
                                                and ops.linear_split(weight) > 1):
        op(x, q, scale)
    elif variant == "int8, 8 warps":
        tiles = triton_linear._tiles(*weight.shape, gated=gated, int8=True)
        (triton_linear.gated_linear if gated else triton_linear.linear)(x, q, tiles=tiles, weight_scale=scale, warps=8)
    else:
        block_n, block_k, stages = triton_linear._tiles(*weight.shape, gated=gated)
        tiles = {"int8 at bf16's tiles": (block_n, block_k, stages), "int8 deeper steps": (block_n, 2 * block_k, stages),
                 "int8 wider blocks": (2 * block_n, block_k, stages)}[variant]
        (triton_linear.gated_linear if gated else triton_linear.linear)(x, q, tiles=tiles, weight_scale=scale)


def run_all(variant: str, x: torch.Tensor, weights: list, quantized: list, gated: bool) -> None:
    for weight, (q, scale) in zip(weights, quantized):
        call(variant, x, weight, q, scale, gated)


def sweep(hidden: int, rows: int) -> dict:
    out = {}
    for name, (n, k) in head_shapes(hidden).items():
        weights = [(torch.randn(n, k, device="cuda") / k**0.5).bfloat16() for _ in range(COPIES)]
        quantized = [quantize_rows(w) for w in weights]
        x = torch.randn(rows, k, device="cuda").bfloat16()
        gated = name == "gate/up"
        row = {variant: round(1000 * graph_ms(functools.partial(run_all, variant, x, weights, quantized, gated)) / COPIES, 2)
               for variant in VARIANTS}
        out[f"{name} [{n}, {k}]"] = row
        print(hidden, name, row, flush=True)
    return out


def lm_top_k(hidden: int, rows: int = 16, vocab: int = 8192) -> dict:
    weights = [(torch.randn(vocab, hidden, device="cuda") / hidden**0.5).bfloat16() for _ in range(COPIES)]
    quantized = [quantize_rows(w) for w in weights]
    x = torch.randn(rows, hidden, device="cuda").bfloat16()
    bf16 = lambda: [ops.linear_top_k(x, w, None, 4) for w in weights]
    int8 = lambda: [ops.linear_top_k(x, q, None, 4, scale) for q, scale in quantized]
    out = {name: round(1000 * graph_ms(run) / COPIES, 2) for name, run in (("bf16", bf16), ("int8", int8))}
    print(hidden, "LM head top-k", out, flush=True)
    return out


def write_report(results: dict, out_dir: str) -> None:
    lines = save_results(results, out_dir, "int8_gemm_gpu", "A draft head's GEMMs, int8 weights against bf16",
                         f", {results['rows']} rows, {COPIES} weights per shape in one CUDA graph, us per call")
    lines += ["| hidden | GEMM | " + " | ".join(VARIANTS) + " |", "| --- | --- |" + " --- |" * len(VARIANTS)]
    for hidden, shapes in results["results"].items():
        for name, row in shapes["gemms"].items():
            lines.append(f"| {hidden} | {name} | " + " | ".join(str(row.get(v, "-")) for v in VARIANTS) + " |")
        top = shapes["lm_top_k"]
        lines.append(f"| {hidden} | LM head [8192, {hidden}] with top-4, 16 rows | - | {top['bf16']} | - | - | - | "
                     f"{top['int8']} | - |")
    lines += ["", *[f"- {note}" for note in results.get("notes", [])]]
    with open(os.path.join(out_dir, "int8_gemm_gpu.md"), "w") as f:
        f.write("\n".join(lines) + "\n")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--rows", type=int, default=4)
    p.add_argument("--plot", help="write the markdown from this JSON instead of measuring")
    args = p.parse_args()
    results = start_run(p, args, write_report)
    if results is None:
        return
    results["rows"] = args.rows
    for hidden in (2048, 1024):
        results["results"][hidden] = {"gemms": sweep(hidden, args.rows), "lm_top_k": lm_top_k(hidden)}
        save_results(results, args.out, "int8_gemm_gpu", "")
    write_report(results, args.out)


if __name__ == "__main__":
    main()
