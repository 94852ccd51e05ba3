"""What programmatic dependent launch (PDL) can give a GEMM of the GDN-1.3B pass, in a synthetic pass.

In a CUDA graph each kernel waits for the one before it to finish, then launches and ramps up. With PDL
(Hopper) a kernel launches early and waits in ``griddepcontrol.wait`` (``specla_compile/kernels/pdl.py``).
cuBLAS's GEMMs launch without PDL; a Triton GEMV can take it, and could also start streaming its weight (which
no kernel before it writes) into L2 before its wait. This times 24 synthetic layers of the pass's four GEMM
shapes (distinct bf16 weights, 1 row) in one CUDA graph, with ``--small`` tiny elementwise kernels before each
GEMM standing for the layer's small kernels, as:

- ``cublas``: ``F.linear``; ``cublas_small_pdl``: the same with the tiny kernels launched with PDL;
- ``triton``: a plain Triton GEMV (one program per 32 output columns over 256-deep steps, three stages);
- ``triton_pdl``: the GEMV and the tiny kernels launched with PDL;
- ``triton_pdl_prefetch``: and each GEMV program bulk-prefetches its weight slice into L2 before its wait.

    python benchmarks/pdl_gpu.py --out DIR     # H200, under a minute; DIR/pdl_gpu.json and .md
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gemv_gpu import save_results, start_run
from l2_prefetch_gpu import LAYERS, SHAPES, bulk_prefetch_l2

from specla_compile.runtime.graph_capture import capture

VARIANTS = {  # name -> (GEMV: "cublas" or "triton", PDL, weight prefetch before the wait)
    "cublas": ("cublas", False, False),
    "cublas_small_pdl": ("cublas", True, False),
    "triton": ("triton", False, False),
    "triton_pdl": ("triton", True, False),
    "triton_pdl_prefetch": ("triton", True, True),
}


@triton.jit
def tiny_kernel(x, y, n, USE_PDL: tl.constexpr, BLOCK: tl.constexpr):
    """A small kernel of the layer: 16 dependent multiply-adds per element of a 4,096-element vector."""
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    v = tl.load(x + offs, mask=offs < n)
    for _ in range(16):
        v = v * 1.0001 + 0.5
    tl.store(y + offs, v, mask=offs < n)


@triton.jit
def gemv_kernel(x, w, y, N, K, USE_PDL: tl.constexpr, PREFETCH: tl.constexpr, BLOCK_N: tl.constexpr,
                BLOCK_K: tl.constexpr, LANES: tl.constexpr):
    """``y [1, N] = x [1, K] @ w [N, K]^T``; with PREFETCH, the program's rows of ``w`` (contiguous) start streaming
    into L2 before the wait for the kernel before it, one bulk prefetch per lane (LANES: the program's threads)."""
    pid = tl.program_id(0)
    if PREFETCH:
        lanes = tl.arange(0, LANES)
        chunk = (BLOCK_N * K + LANES - 1) // LANES
        chunk = (chunk + 7) // 8 * 8  # (elements: 16-byte granules of bf16)
        start = pid * BLOCK_N * K + lanes * chunk
        size = tl.minimum(tl.maximum(N * K - start, 0), chunk)
        size = tl.minimum(size, tl.maximum(BLOCK_N * K - lanes * chunk, 0))
        bulk_prefetch_l2(w + start, size * 2)
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, 16)  # (tensor cores take 16 rows: one real)
    acc = tl.zeros((16, BLOCK_N), tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        xv = tl.load(x + offs_m[:, None] * K + offs_k[None, :], mask=(offs_m[:, None] < 1) & (offs_k[None, :] < K), other=0.0)
        wv = tl.load(w + offs_n[:, None] * K + offs_k[None, :], mask=(offs_n[:, None] < N) & (offs_k[None, :] < K), other=0.0)
        acc += tl.dot(xv, tl.trans(wv))
    tl.store(y + offs_m[:, None] * N + offs_n[None, :], acc.to(tl.bfloat16), mask=(offs_m[:, None] < 1) & (offs_n[None, :] < N))


class Pass:
    """24 layers of the four GEMMs, ``small`` tiny kernels before each."""

    def __init__(self):
        make = lambda *shape: torch.randn(*shape, device="cuda", dtype=torch.bfloat16)
        self.weights = [[make(n, k) / 50 for n, k in SHAPES.values()] for _ in range(LAYERS)]
        self.rows = {k: make(1, k) for _, k in SHAPES.values()}
        self.tiny_in, self.tiny_out = torch.randn(4096, device="cuda"), torch.empty(4096, device="cuda")

    def gemv(self, w: torch.Tensor, pdl: bool, prefetch: bool) -> torch.Tensor:
        (n, k), launch = w.shape, {"launch_pdl": True} if pdl else {}
        y = torch.empty(1, n, device="cuda", dtype=torch.bfloat16)
        gemv_kernel[(triton.cdiv(n, 32),)](self.rows[k], w, y, n, k, USE_PDL=pdl, PREFETCH=prefetch, BLOCK_N=32,
                                           BLOCK_K=256, LANES=128, num_warps=4, num_stages=3, **launch)
        return y

    def run(self, variant: str, small: int) -> None:
        gemm, pdl, prefetch = VARIANTS[variant]
        for layer in self.weights:
            for w in layer:
                for _ in range(small):
                    tiny_kernel[(4,)](self.tiny_in, self.tiny_out, 4096, USE_PDL=pdl, BLOCK=1024, num_warps=4,
                                      **({"launch_pdl": True} if pdl else {}))
                if gemm == "cublas":
                    torch.nn.functional.linear(self.rows[w.shape[1]], w)
                else:
                    self.gemv(w, pdl, prefetch)


def back_to_back_ms(fn, replays: int = 20, repeats: int = 5) -> float:
    """Fastest of ``repeats`` means of ``replays`` back-to-back replays of ``fn`` captured as a CUDA graph."""
    graph, _ = capture(fn)
    best = float("inf")
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(replays):
            graph.replay()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / replays)
    return best


def write_report(results: dict, out_dir: str) -> None:
    r = results["results"]
    smalls = sorted({int(key.rsplit("small", 1)[1]) for key in r})
    lines = save_results(results, out_dir, "pdl_gpu",
                         "What PDL can give a GEMM: 24 synthetic layers of the GDN-1.3B pass's four GEMMs (bf16, 1 row)") + [
             "ms per pass (one CUDA graph, fastest of 5 means of 20 back-to-back replays):", "",
             "| variant | " + " | ".join(f"{s} tiny kernels before each GEMM" for s in smalls) + " |",
             "| --- | " + " | ".join("---" for _ in smalls) + " |"]
    for variant in VARIANTS:
        lines.append(f"| {variant} | " + " | ".join(f"{r[f'{variant}_small{s}']:.3f}" for s in smalls) + " |")
    with open(os.path.join(out_dir, "pdl_gpu.md"), "w") as f:
        f.write("\n".join(lines) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("--small", type=int, nargs="+", default=[0, 2], help="tiny kernels before each GEMM")
    parser.add_argument("--plot", metavar="JSON", help="only write the markdown from an earlier JSON")
    args = parser.parse_args()
    results = start_run(parser, args, write_report)
    if results is None:
        return
    model = Pass()
    x, w = model.rows[2048], model.weights[0][0]
    error = (model.gemv(w, True, True).float() - x.float() @ w.float().T).abs().max().item()
    assert error < 0.05, f"the GEMV is off by {error:.3g}"
    for small in args.small:
        for variant in VARIANTS:
            ms = back_to_back_ms(lambda variant=variant, small=small: model.run(variant, small))
            results["results"][f"{variant}_small{small}"] = ms
            print(f"{variant}, {small} tiny kernels per GEMM: {ms:.3f} ms", flush=True)
    write_report(results, args.out)


if __name__ == "__main__":
    main()
