"""Does prefetching the next GEMM's weight into L2, on a side stream, while the GDN layer's small kernels run,
shorten a plain pass of the GDN-1.3B shape?

A 1-node pass takes 1.63 ms, of which its GEMMs about 1.0 ms at 1.4-3.5 TB/s (``e2e_gpu.json`` ``fla_passes``).
Between them the layer runs small kernels (conv, recurrence, norms, gates: about 0.6 ms a pass) that leave
the HBM nearly idle. A side stream, forked after a GEMM, can stream the weights that come next into the 50 MB L2
(the TMA's bulk L2 prefetch, ``cp.async.bulk.prefetch.L2``, issued by every thread of a few programs), so
that the next GEMM reads part of its weight from L2. This probe measures:

- ``l2``: one cuBLAS GEMM of each weight read from HBM (the L2 flushed), after the prefetch of its weight (the
  L2 flushed first), and read from L2 (the same GEMM just before): whether the prefetch lands, and the most it
  can save.
- ``prefetch_rate``: the prefetch kernel alone over 24 weights (HBM bandwidth it reaches) by program count.
- ``layers``: 24 synthetic layers of the pass's GEMM shapes (cuBLAS ``F.linear``, distinct weights) with the
  small kernels between them as tiny elementwise launches, in one CUDA graph: time per layer for prefetch
  schedules (what is prefetched after which GEMM).

    python benchmarks/l2_prefetch_gpu.py --out DIR      # H200, under a minute; DIR/l2_prefetch_gpu.json and .md
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gemv_gpu import graph_ms, save_results, start_run

SHAPES = {"qkvg": (8208, 2048), "o_proj": (2048, 2048), "gate_up": (11264, 2048), "down": (2048, 5632)}
LAYERS = 24
THREADS = 128  # (4 warps: one lane of the prefetch per thread)


@triton.jit
def bulk_prefetch_l2(pointers, sizes):
    """One ``cp.async.bulk.prefetch.L2`` per lane: ``sizes`` bytes (a multiple of 16; none where <= 0) from
    16-byte aligned ``pointers`` start streaming into L2 (nothing is read back)."""
    tl.inline_asm_elementwise(
        "{ .reg .pred p; setp.gt.s32 p, $2, 0; @p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
        "=r,l,r", [pointers, sizes], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def l2_prefetch_kernel(ptr, nbytes, CHUNK: tl.constexpr, THREADS: tl.constexpr):
    """Bulk-prefetch bytes [0, nbytes) of ``ptr`` (a uint8 view) into L2: each thread issues one prefetch of
    CHUNK bytes per step; programs stride over the range."""
    lanes = tl.arange(0, THREADS)
    stride = tl.num_programs(0) * THREADS * CHUNK
    for base in range(tl.program_id(0) * THREADS * CHUNK, nbytes, stride):
        offs = base + lanes * CHUNK
        bulk_prefetch_l2(ptr + offs, tl.minimum(nbytes - offs, CHUNK))


def prefetch(t: torch.Tensor, nbytes: int, programs: int, chunk: int = 4096) -> None:
    """Start streaming the first ``nbytes`` of contiguous ``t`` into L2 (nothing is read back)."""
    nbytes = min(nbytes, t.numel() * t.element_size()) // 16 * 16  # (the bulk copy's 16-byte granule)
    if nbytes > 0:
        l2_prefetch_kernel[(programs,)](t.view(torch.uint8), nbytes, CHUNK=chunk, THREADS=THREADS, num_warps=THREADS // 32)


def event_us(fn, before, repeats: int = 20) -> float:
    """Median time of ``fn`` alone (CUDA events around it), ``before`` run first each time. A spin on the GPU
    before the first event lets the host queue the event, ``fn`` and the second event ahead of the GPU."""
    times = []
    for _ in range(repeats):
        before()
        torch.cuda._sleep(200_000)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(1000 * start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def l2_section(programs: int) -> dict:
    flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    out = {}
    for name, (n, k) in SHAPES.items():
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        def gemm(x=x, w=w):
            return F.linear(x, w)

        cold = event_us(gemm, flush.zero_)

        def prefetched(w=w):
            flush.zero_()
            prefetch(w, w.numel() * 2, programs)
            torch.cuda._sleep(100_000)  # (the bulk prefetch returns before its bytes land)

        out[name] = {"hbm_us": cold, "after_prefetch_us": event_us(gemm, prefetched), "l2_us": event_us(gemm, gemm),
                     "MB": w.numel() * 2 / 1e6}
    return out


def rate_section() -> dict:
    n, k = SHAPES["gate_up"]
    weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) for _ in range(LAYERS)]
    total = sum(w.numel() * 2 for w in weights)
    out = {}
    for programs in (4, 8, 16, 32, 66, 132):
        ms = graph_ms(lambda programs=programs: [prefetch(w, w.numel() * 2, programs) for w in weights])
        out[programs] = {"TBps": total / ms / 1e9, "us_per_weight": 1000 * ms / LAYERS}
    return out


class Layers:
    """24 layers of the pass's GEMMs with tiny launches between them (``middle`` after q/k/v/gates: the conv,
    recurrence and output norm; one before each other GEMM: the norms and silu*up)."""

    def __init__(self, middle: int):
        self.w = [{name: torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / (4 * k ** 0.5) for name, (n, k) in SHAPES.items()}
                  for _ in range(LAYERS)]
        self.x = torch.randn(1, 2048, device="cuda", dtype=torch.bfloat16)
        self.middle = middle
        self.side = torch.cuda.Stream()  # (the prefetches' stream, forked from and joined to the caller's)

    def run(self, schedule: dict, programs: int) -> torch.Tensor:
        """``schedule``: after which GEMM (name) to prefetch which bytes of which later weights: a list of
        (layer offset, weight name, fraction)."""
        main = torch.cuda.current_stream()
        side = self.side
        forked = []

        def fork(layer: int, after: str) -> None:
            jobs = [(layer + d, name, f) for d, name, f in schedule.get(after, ()) if layer + d < LAYERS]
            if not jobs:
                return
            forked.append(after)
            side.wait_stream(main)
            with torch.cuda.stream(side):
                for i, name, f in jobs:
                    w = self.w[i][name]
                    prefetch(w, int(f * w.numel() * 2), programs)

        x = self.x
        for i, w in enumerate(self.w):
            h = x * 1.0001  # (the attention norm)
            qkvg = F.linear(h, w["qkvg"])
            fork(i, "qkvg")
            h = qkvg[:, :2048]
            for _ in range(self.middle):
                h = h * 1.0001
            o = F.linear(h, w["o_proj"])
            fork(i, "o_proj")
            h = o + x  # (the residual add and MLP norm)
            gu = F.linear(h, w["gate_up"])
            fork(i, "gate_up")
            h = F.silu(gu[:, :5632]) * gu[:, 5632:]
            x = F.linear(h, w["down"]) + x
            fork(i, "down")
        if forked:  # (a capture must join every stream it forked)
            main.wait_stream(side)
        return x


SCHEDULES = {  # after GEMM: [(layer offset, weight, fraction of it)]
    "none": {},
    "o_proj": {"qkvg": [(0, "o_proj", 1.0)]},
    "o_proj+gate_up/4": {"qkvg": [(0, "o_proj", 1.0), (0, "gate_up", 0.25)]},
    "o_proj+gate_up/2": {"qkvg": [(0, "o_proj", 1.0), (0, "gate_up", 0.5)]},
    "o_proj+gate_up": {"qkvg": [(0, "o_proj", 1.0), (0, "gate_up", 1.0)]},
    "o_proj+gate_up/2, down/4": {"qkvg": [(0, "o_proj", 1.0), (0, "gate_up", 0.5)], "gate_up": [(0, "down", 0.25)]},
    "o_proj+gate_up/2, next qkvg/4": {"qkvg": [(0, "o_proj", 1.0), (0, "gate_up", 0.5)], "down": [(1, "qkvg", 0.25)]},
    "each next weight": {"qkvg": [(0, "o_proj", 1.0)], "o_proj": [(0, "gate_up", 1.0)], "gate_up": [(0, "down", 1.0)],
                         "down": [(1, "qkvg", 1.0)]},
}


def layers_section(middle: int) -> dict:
    model = Layers(middle)
    reference = model.run({}, 8).float()
    out = {}
    for name, schedule in SCHEDULES.items():
        for programs in ((8,) if name == "none" else (8, 32)):
            got = model.run(schedule, programs).float()
            error = ((got - reference).abs().max() / reference.abs().max()).item()
            assert error < 1e-2, f"{name}: output off by {error:.3g}"  # (cuBLAS may pick other kernels run to run)
            ms = graph_ms(lambda schedule=schedule, programs=programs: model.run(schedule, programs))
            out[f"{name}, {programs} programs" if name != "none" else name] = 1000 * ms / LAYERS
            print(f"middle {middle}: {name} ({programs} programs): {1000 * ms / LAYERS:.2f} us per layer", flush=True)
    return out


def write_report(results: dict, out_dir: str) -> None:
    r = results["results"]
    lines = save_results(results, out_dir, "l2_prefetch_gpu",
                         "The next GEMM's weight prefetched into L2 on a side stream (GDN-1.3B shapes)", "; bf16, 1 row")
    if "l2" in r:
        lines += ["One cuBLAS GEMM (CUDA events around it, median of 20), us:", "",
                  "| weight | MB | from HBM (L2 flushed) | after the prefetch of its weight | from L2 |", "| --- | --- | --- | --- | --- |"]
        lines += [f"| {k} | {v['MB']:.1f} | {v['hbm_us']:.2f} | {v['after_prefetch_us']:.2f} | {v['l2_us']:.2f} |" for k, v in r["l2"].items()]
        lines.append("")
    if "prefetch_rate" in r:
        lines += ["The prefetch alone, 24 gate/up weights (1.1 GB) in one graph:", "", "| programs | TB/s | us per weight |",
                  "| --- | --- | --- |"]
        lines += [f"| {k} | {v['TBps']:.2f} | {v['us_per_weight']:.2f} |" for k, v in r["prefetch_rate"].items()]
        lines.append("")
    for key, rows in r.items():
        if key.startswith("layers_"):
            base = rows["none"]
            lines += [f"24 synthetic layers ({key.split('_', 1)[1]} tiny launches after q/k/v/gates), us per layer:", "",
                      "| schedule | us per layer | against none |", "| --- | --- | --- |"]
            lines += [f"| {k} | {v:.2f} | {v / base:.3f} |" for k, v in rows.items()]
            lines.append("")
    with open(os.path.join(out_dir, "l2_prefetch_gpu.md"), "w") as f:
        f.write("\n".join(lines) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("--plot", metavar="JSON", help="only write the markdown from an earlier JSON")
    parser.add_argument("--middle", type=int, nargs="+", default=[4, 8], help="tiny launches after q/k/v/gates")
    args = parser.parse_args()
    results = start_run(parser, args, write_report)
    if results is None:
        return
    started = time.perf_counter()
    r = results["results"]
    r["l2"] = l2_section(32)
    print(json.dumps(r["l2"]), flush=True)
    r["prefetch_rate"] = rate_section()
    print(json.dumps(r["prefetch_rate"]), flush=True)
    write_report(results, args.out)
    for middle in args.middle:
        r[f"layers_{middle}"] = layers_section(middle)
        write_report(results, args.out)
    print(f"done in {time.perf_counter() - started:.0f} s", flush=True)


if __name__ == "__main__":
    main()
