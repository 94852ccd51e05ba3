"""A Triton GEMV for up to 32 rows against cuBLAS, at the GEMM shapes of one pass of the GDN-1.3B model
(``--preset gdn_1.3b``) or of one level of the EAGLE head at the trained study's size (``--preset eagle_head``).

The GEMMs of a plain pass take about 1.0 of its 1.64 ms of kernel time (``e2e_gpu.md``), at 1.4-3.5 TB/s
against a copy rate of 4.1 TB/s. This asks whether a GEMV written for these shapes (y = x W^T, x of
M <= 32 rows, W bf16 [N, K] read once) streams the weights faster than what ``F.linear`` runs (cuBLAS).
Each shape is timed as the model runs it: 24 distinct weights (one per layer, more than the 50 MB L2
holds) called back to back inside one CUDA graph, median of 10-20 replays. The Triton kernel is swept
over tile sizes, split-K factors and pipeline depths; its output is checked against ``F.linear``. A
split-K configuration adds fp32 partial sums into a zeroed output (the zeroing is timed; a conversion
back to bf16, which a bf16 consumer would need unless fused into it, is not).

    python benchmarks/gemv_gpu.py --out benchmarks/results          # H200, about 2 minutes
    python benchmarks/gemv_gpu.py --out benchmarks/results --preset eagle_head
    python benchmarks/gemv_gpu.py --out benchmarks/results --kernel tma --rows 1 16   # the weight through the TMA
    python benchmarks/gemv_gpu.py --plot benchmarks/results/gemv_gpu.json

The head's GEMMs with 1024 output columns (its fuse, o_proj and down) ran cuBLAS kernels at 0.3-1 TB/s in a
replay of a tree propose on the H200 (``eagle_profile.json``, ``kernels_in_order``): the question for them is
whether more programs per weight (narrow N tiles, split K) stream a 2-8 MB weight faster.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import time

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from specla_compile.runtime.graph_capture import capture

# (N, K) of each weight: the fused q/k/v/gate/a/b projection, o_proj, the fused MLP gate/up, down_proj, LM head
PRESETS = {  # (N, K) of each weight, the rows timed, and what one set of these GEMMs is
    "gdn_1.3b": {"title": "the GDN-1.3B pass's GEMM shapes", "unit": "layer", "per": (24, "layers", "pass"), "rows": (1, 16, 32),
                 "shapes": {"qkvg": (8208, 2048), "o_proj": (2048, 2048), "gate_up": (11264, 2048), "down": (2048, 5632),
                            "lm_head": (32000, 2048)}},
    # (the fuse's feature half: the token table gives the embedding half, EagleHead.pack_projections)
    "eagle_head": {"title": "the EAGLE head's GEMM shapes (hidden 1024, vocabulary 32000)", "unit": "draft level",
                   "per": (7, "head calls", "depth-6 tree propose"), "rows": (1, 4, 8, 16),
                   "shapes": {"fuse": (1024, 1024), "qkv": (3072, 1024), "o_proj": (1024, 1024), "gate_up": (8192, 1024),
                              "down": (1024, 4096), "lm_head": (32000, 1024)}},
}
LAYERS = 24  # distinct weights per shape (the LM head: one), more than the L2 holds: each call reads from HBM
# (BLOCK_N, BLOCK_K, SPLIT, num_warps, num_stages) of gemv, and of tma_gemv (which does not split K)
CONFIGS = list(itertools.product((16, 32, 64, 128), (128, 256, 512), (1, 2, 4), (4,), (2, 4)))
TMA_CONFIGS = list(itertools.product((16, 32, 64), (64, 128, 256), (1,), (4,), (3, 4, 6, 8)))


@triton.jit
def gemv_kernel(x_ptr, w_ptr, y_ptr, M, N, K, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                SPLIT: tl.constexpr):
    """y[:, n-tile] (+)= x @ W[n-tile]^T over one of SPLIT slices of K. x [M, K] and W [N, K] row-major;
    SPLIT > 1 adds fp32 partial sums into a zeroed y."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    k_per_split = tl.cdiv(K, SPLIT * BLOCK_K) * BLOCK_K
    k_start = pid_k * k_per_split
    for k0 in range(k_start, k_start + k_per_split, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + offs_m[:, None] * K + offs_k[None, :], mask=(offs_m[:, None] < M) & (offs_k[None, :] < K), other=0.0)
        w = tl.load(w_ptr + offs_n[:, None] * K + offs_k[None, :], mask=(offs_n[:, None] < N) & (offs_k[None, :] < K), other=0.0)
        acc += tl.dot(x, tl.trans(w))  # (tensor cores need 16 rows: x's missing rows load as zeros)
    mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    out = y_ptr + offs_m[:, None] * N + offs_n[None, :]
    if SPLIT == 1:
        tl.store(out, acc.to(y_ptr.dtype.element_ty), mask=mask)
    else:
        tl.atomic_add(out, acc, mask=mask, sem="relaxed")


@triton.jit
def tma_gemv_kernel(x_ptr, w_desc, y_ptr, M, N, K, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """y[:, n-tile] = x @ W[n-tile]^T with W's tiles brought by the TMA (Hopper's bulk tensor copies, through a
    host-built descriptor; Triton's pipeliner keeps ``num_stages`` of them in flight). Reads past W's edges are
    zeros."""
    pid_n = tl.program_id(0)
    offs_m = tl.arange(0, BLOCK_M)
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + offs_m[:, None] * K + offs_k[None, :], mask=(offs_m[:, None] < M) & (offs_k[None, :] < K), other=0.0)
        acc += tl.dot(x, tl.trans(w_desc.load([pid_n * BLOCK_N, k0])))
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    tl.store(y_ptr + offs_m[:, None] * N + offs_n[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=(offs_m[:, None] < M) & (offs_n[None, :] < N))


def tma_gemv(x: torch.Tensor, w_desc, y: torch.Tensor, warps: int = 4, stages: int = 4) -> None:
    """``y = x @ w.T`` for ``w_desc = TensorDescriptor.from_tensor(w, [BLOCK_N, BLOCK_K])`` (built once per weight,
    outside a CUDA graph). Reference: ``F.linear``."""
    m, k = x.shape
    n = w_desc.shape[0]
    block_n, block_k = w_desc.block_shape
    if m > 32 or x.stride(-1) != 1:
        raise ValueError("tma_gemv takes at most 32 contiguous rows")
    tma_gemv_kernel[(triton.cdiv(n, block_n),)](x, w_desc, y, m, n, k, BLOCK_M=16 if m <= 16 else 32, BLOCK_N=block_n,
                                                BLOCK_K=block_k, num_warps=warps, num_stages=stages)


def gemv(x: torch.Tensor, w: torch.Tensor, y: torch.Tensor, block_n: int, block_k: int, split: int,
         warps: int = 4, stages: int = 2) -> None:
    """``y = x @ w.T`` (``split`` > 1: ``y += ...``, fp32 ``y`` zeroed by the caller). Reference: ``F.linear``."""
    m, k = x.shape
    n = w.shape[0]
    if m > 32 or x.stride(-1) != 1 or w.stride(-1) != 1:
        raise ValueError("gemv takes at most 32 contiguous rows and a row-major weight")
    gemv_kernel[(triton.cdiv(n, block_n), split)](x, w, y, m, n, k, BLOCK_M=16 if m <= 16 else 32, BLOCK_N=block_n,
                                                  BLOCK_K=block_k, SPLIT=split, num_warps=warps, num_stages=stages)


def graph_ms(fn, replays: int = 20) -> float:
    """Median CUDA-event time of one replay of ``fn`` captured as a CUDA graph."""
    graph, _ = capture(fn)
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def sweep_shape(n: int, k: int, rows: int, copies: int, kernel: str = "gemv") -> dict:
    """cuBLAS and the best configuration of the Triton ``kernel`` ("gemv" or "tma") for ``copies`` distinct [n, k]
    weights at ``rows`` rows."""
    weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / 50 for _ in range(copies)]
    x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
    total_bytes = n * k * 2 * copies
    reference = torch.nn.functional.linear(x, weights[0]).float()
    row = {}
    ms = graph_ms(lambda: [torch.nn.functional.linear(x, w) for w in weights])
    row["cublas"] = {"us": 1000 * ms / copies, "TBps": total_bytes / ms / 1e9}
    best = unsplit = None
    row["wrong_configs"] = []  # (beyond bf16 rounding against F.linear: none expected)
    for block_n, block_k, split, warps, stages in TMA_CONFIGS if kernel == "tma" else CONFIGS:
        if block_k * split > 2 * k or triton.cdiv(n, block_n) * split < 64:  # (too few programs to stream from HBM)
            continue
        outs = [torch.zeros(rows, n, device="cuda", dtype=torch.float32 if split > 1 else torch.bfloat16) for _ in range(copies)]
        descriptors = [TensorDescriptor.from_tensor(w, [block_n, block_k]) for w in weights] if kernel == "tma" else []

        def run(outs=outs, block_n=block_n, block_k=block_k, split=split, warps=warps, stages=stages, descriptors=descriptors):
            for i, (w, y) in enumerate(zip(weights, outs)):
                if descriptors:
                    tma_gemv(x, descriptors[i], y, warps, stages)
                    continue
                if split > 1:
                    y.zero_()  # (counted: a split-K GEMV needs it, as cuBLAS's split-K needs its reduction kernel)
                gemv(x, w, y, block_n, block_k, split, warps, stages)

        try:
            run()
        except triton.runtime.errors.OutOfResources as err:  # (shared memory of the deeper pipelines)
            row.setdefault("failed_configs", []).append([block_n, block_k, split, warps, stages, str(err)[:80]])
            continue
        torch.cuda.synchronize()
        error = (outs[0].float() - reference).abs().max().item()
        if error > 0.05 * reference.abs().max().item() + 1e-2:
            row["wrong_configs"].append([block_n, block_k, split, warps, stages, error])
            continue
        ms = graph_ms(run, 10)
        if best is None or ms < best[0]:
            best = (ms, [block_n, block_k, split, warps, stages])
        if split == 1 and (unsplit is None or ms < unsplit[0]):
            unsplit = (ms, [block_n, block_k, split, warps, stages])
    row["triton_best"] = {"us": 1000 * best[0] / copies, "TBps": total_bytes / best[0] / 1e9, "config": best[1]}
    if unsplit is not None:  # (no zeroing, no atomics: deterministic, and what a fused epilogue can follow)
        row["triton_best_unsplit"] = {"us": 1000 * unsplit[0] / copies, "config": unsplit[1]}
    return row


def report_name(preset: str, kernel: str = "gemv") -> str:
    return ("gemv_gpu" if preset == "gdn_1.3b" else f"gemv_gpu_{preset}") + ("_tma" if kernel == "tma" else "")


def write_report(results: dict, out_dir: str) -> None:
    preset = PRESETS[results.get("preset", "gdn_1.3b")]
    kernel = results.get("kernel", "gemv")
    stem = report_name(results.get("preset", "gdn_1.3b"), kernel)
    what = "A Triton GEMV with TMA loads" if kernel == "tma" else "A Triton GEMV"
    lines = save_results(results, out_dir, stem, f"{what} against cuBLAS at {preset['title']}",
                         f"; bf16 weights, {LAYERS} distinct weights per shape (the LM head: one) in one CUDA graph, median replay") + [
        "| weight [N, K] | rows | cuBLAS us | cuBLAS TB/s | Triton best us | Triton TB/s | Triton / cuBLAS | best config (BLOCK_N, BLOCK_K, SPLIT, warps, stages) | best without split-K, us |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for key, row in results["results"].items():
        name, rows = key.rsplit("_M", 1)
        cublas, best = row["cublas"], row["triton_best"]
        unsplit = f"{row['triton_best_unsplit']['us']:.2f}" if "triton_best_unsplit" in row else "-"
        lines.append(f"| {name} {list(preset['shapes'][name])} | {rows} | {cublas['us']:.2f} | {cublas['TBps']:.2f} | {best['us']:.2f} | "
                     f"{best['TBps']:.2f} | {best['us'] / cublas['us']:.3f} | {best['config']} | {unsplit} |")
    lines.append("")
    for rows in preset["rows"]:
        unit = [results["results"].get(f"{name}_M{rows}") for name in preset["shapes"] if name != "lm_head"]
        if None in unit:
            continue
        cublas, best = sum(r["cublas"]["us"] for r in unit), sum(r["triton_best"]["us"] for r in unit)
        times, units, whole = preset["per"]
        lines.append(f"- one {preset['unit']}'s GEMMs but the LM head at {rows} rows: cuBLAS {cublas:.1f} us, the best Triton "
                     f"configuration of each {best:.1f} us ({times} {units}: {times * abs(cublas - best) / 1000:.3f} ms per {whole} "
                     f"{'less' if best <= cublas else 'more'})")
    with open(os.path.join(out_dir, f"{stem}.md"), "w") as f:
        f.write("\n".join(lines) + "\n")


def start_run(parser: argparse.ArgumentParser, args: argparse.Namespace, write_report) -> dict | None:
    """``--plot``: write the markdown from the JSON and return None; else the results' header for a run on this
    GPU (an error without one)."""
    if args.plot:
        with open(args.plot) as f:
            write_report(json.load(f), args.out)
        return None
    if not torch.cuda.is_available():
        parser.error("this benchmark needs a CUDA GPU")
    return {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
            "command": " ".join(["python", *sys.argv]), "results": {}}


def save_results(results: dict, out_dir: str, stem: str, title: str, setup: str = "") -> list[str]:
    """Write ``results`` (a :func:`start_run` header with its figures) to ``out_dir/stem.json``; returns the first
    lines of its markdown: the title, the machine with ``setup`` after it, and the command."""
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, f"{stem}.json"), "w") as f:
        json.dump(results, f, indent=1)
    return [f"# {title}", "", f"device: {results['device']}, torch {results['torch']}, triton {results['triton']}{setup}",
            f"command: `{results['command']}`", ""]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("--plot", metavar="JSON", help="only write the markdown from an earlier JSON")
    parser.add_argument("--preset", choices=sorted(PRESETS), default="gdn_1.3b", help="which model's GEMM shapes")
    parser.add_argument("--kernel", choices=("gemv", "tma"), default="gemv",
                        help="the Triton GEMV swept: pointer loads (split-K too), or the TMA's bulk copies (Hopper)")
    parser.add_argument("--rows", type=int, nargs="+", help="rows to time (default: the preset's)")
    parser.add_argument("--shapes", nargs="+", help="weights to time (default: all of the preset's)")
    args = parser.parse_args()
    results = start_run(parser, args, write_report)
    if results is None:
        return
    started = time.perf_counter()
    results.update(preset=args.preset, kernel=args.kernel)
    preset = PRESETS[args.preset]
    for name in args.shapes or preset["shapes"]:
        n, k = preset["shapes"][name]
        for rows in args.rows or preset["rows"]:
            row = results["results"][f"{name}_M{rows}"] = sweep_shape(n, k, rows, 1 if name == "lm_head" else LAYERS,
                                                                      args.kernel)
            print(name, rows, json.dumps({side: row.get(side) for side in ("cublas", "triton_best", "triton_best_unsplit")}),
                  f"{time.perf_counter() - started:.0f} s", flush=True)
            write_report(results, args.out)


if __name__ == "__main__":
    main()
