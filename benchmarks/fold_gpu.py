"""The norms folded into the GEMMs after them, against what inductor and cuBLAS run, at the GDN-1.3B shapes.

A static twin of up to 32 tokens runs each ``h = a + b; y = rms_norm(h); out = y @ W^T`` of the model (and
the MLP's ``silu(gate) * up`` after its gate/up GEMM) as one ``specla::`` linear op (``lowering/fold_norms.py``,
``kernels/triton_linear.py``). This times, for each folded site, 24 distinct weights (one per layer, more than
the L2 holds) back to back in one CUDA graph, median replay:

- ``unfolded``: the add and the norm compiled by inductor (one fused kernel, as in the model's pass), then
  ``F.linear`` (cuBLAS), then for the MLP inductor's ``silu(gate) * up``;
- ``folded``: the op, over a sweep of its tiles (BLOCK_N, BLOCK_K, stages); the best, and the default's.

Outputs are checked against the unfolded ones (bf16 rounding apart).

``bare``: the same kernels without a norm, against cuBLAS (and inductor's ``silu(gate) * up``), at every GEMM
of a layer: whether the Triton kernel alone pays where the norm's fold did not.

``gated_norm`` (not in the default): a GDN layer's gated output norm and o_proj (8 heads of 256 -> 2048), inductor's
norm kernel then cuBLAS against ``specla::gated_norm_linear``'s few-row kernel (``triton_linear.gated_norm_linear``,
the backend's ``fold_gated_norms_drafted``) over its program widths and warps, and at one row its one-row GEMV (the
plain step's ``fold_gated_norms``).

``swiglu_down`` (not in the default): a GDN-1.3B layer's MLP product and down projection ([2048, 5632]) at a drafted
pass's rows, inductor's ``silu(gate) * up`` then cuBLAS (its split-K GEMM and reduction) against
``specla::swiglu_linear``'s split few-row kernel (``triton_linear.swiglu_linear``, the backend's
``fold_swiglu_drafted``) over its splits and tiles.

``head`` (not in the default): the norm GEMMs of an EAGLE head sized for the GDN-1.3B target (q/k/v, gate/up with
``silu(gate) * up``; a norm, no skip) at a draft level's rows (``--head-rows``), as ``folded``; ``head_bare``: the
same weights without a norm, against cuBLAS. (A third sweep, the norm's weight folded into W beforehand and only
the rows' ``rsqrt`` in the kernel, ran at ``aa5cc75``: ``fold_gpu_head.md``; it did not pay and is gone.)

    python benchmarks/fold_gpu.py --out benchmarks/results      # H200, about a minute
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import time

import torch
import triton
from gemv_gpu import graph_ms, save_results, start_run

from specla_compile.kernels import reference as ref
from specla_compile.kernels import triton_gemv, triton_linear

SITES = {  # weight [N, K] of each folded GEMM, and whether silu(gate) * up follows it
    "qkvg": ((8208, 2048), False), "gate_up": ((11264, 2048), True), "lm_head": ((32000, 2048), False)}
BARE_SITES = {"qkvg": ((8208, 2048), False), "o_proj": ((2048, 2048), False), "gate_up": ((11264, 2048), True),
              "down": ((2048, 5632), False)}
# an EAGLE head sized for the GDN-1.3B target (EagleConfig.for_target): its norm GEMMs, a norm and no skip
HEAD_SITES = {"head_qkv": ((6144, 2048), False), "head_gate_up": ((16384, 2048), True)}
KINDS = {"folded": SITES, "bare": BARE_SITES, "head": HEAD_SITES, "head_bare": HEAD_SITES}  # which sites, what around
PREFIXES = {"bare": "bare_", "head_bare": "bare_"}  # the sweeps' rows' keys (the head's sites: head_*)
LAYERS = 24
TILES = list(itertools.product((16, 32, 64), (128, 256), (3, 4)))
EPS = 1e-6


def unfolded(x, skip, norm, weight, gated):
    """What the model runs without the fold: the add and the norm (where given), ``F.linear``, silu(gate) * up."""
    h = x if skip is None else x + skip
    out = torch.nn.functional.linear(h if norm is None else ref.rms_norm_reference(h, None, norm, EPS), weight)
    if gated:
        gate, up = out.chunk(2, dim=-1)
        out = torch.nn.functional.silu(gate) * up
    return out, h


def sweep_site(name: str, rows: int, kind: str = "folded") -> dict:
    """One site at ``rows`` rows: inductor and cuBLAS (``unfolded``) against the linear kernels over TILES, with
    the add and the norm folded in (``folded``: ``SITES``), the norm alone (``head``: ``HEAD_SITES``) or neither
    (``bare``: ``BARE_SITES``)."""
    (n, k), gated = KINDS[kind][name]
    folded = kind == "folded"
    copies = 1 if name == "lm_head" else LAYERS
    make = lambda *shape, scale=1.0: (scale * torch.randn(*shape, device="cuda")).bfloat16()
    weights = [make(n, k, scale=k**-0.5) for _ in range(copies)]
    x = make(rows, k)
    skip, summed = (make(rows, k), torch.empty_like(x)) if folded else (None, None)
    norm = None if kind.endswith("bare") else 1 + make(k, scale=0.2)
    compiled = torch.compile(unfolded, dynamic=False)
    want = compiled(x, skip, norm, weights[0], gated)
    row = {"unfolded_us": 1000 * graph_ms(lambda: [compiled(x, skip, norm, w, gated) for w in weights]) / copies}
    project = triton_linear.gated_linear if gated else triton_linear.linear
    timings = {}
    for tiles in [None, *TILES]:
        run = lambda w, tiles=tiles: project(x, w, norm_weight=norm, eps=EPS, skip=skip, skip_sum=summed, tiles=tiles)
        try:
            got = run(weights[0])
        except triton.runtime.errors.OutOfResources:
            continue
        error = (got.float() - want[0].float()).abs().max().item() / want[0].float().abs().max().item()
        if error > 2e-2 or (folded and not torch.equal(summed, want[1])):
            row.setdefault("wrong_tiles", []).append([tiles, error])
            continue
        timings[tiles] = 1000 * graph_ms(lambda: [run(w) for w in weights], 10) / copies
    best = min((t for t in timings if t is not None), key=timings.get)
    row.update(default_us=timings[None], default_tiles=list(triton_linear._tiles(n, k, gated, normed=norm is not None)), best_us=timings[best], best_tiles=list(best))
    return row


GATED_NORM_HEADS, GATED_NORM_OUT = (8, 256), 2048  # the GDN-1.3B layer's output heads and o_proj's columns
GATED_NORM_CONFIGS = list(itertools.product((16, 32, 64), (4, 8)))  # the few-row kernel's (BLOCK_N, warps)


def unfolded_gated_norm(x, gate, norm, weight):
    """The pass without the fold: the gated norm (inductor's kernel, compiled) flattened into o_proj (cuBLAS)."""
    return torch.nn.functional.linear(ref.rms_norm_gated_reference(x, gate, norm, EPS).flatten(-2), weight)


def sweep_gated_norm(rows: int) -> dict:
    """The gated norm and o_proj at ``rows`` rows over ``LAYERS`` distinct weights: unfolded (inductor and cuBLAS)
    against the few-row kernel over ``GATED_NORM_CONFIGS`` and, at one row, the one-row GEMV."""
    heads, dim = GATED_NORM_HEADS
    make = lambda *shape, scale=1.0: (scale * torch.randn(*shape, device="cuda")).bfloat16()
    weights = [make(GATED_NORM_OUT, heads * dim, scale=(heads * dim) ** -0.5) for _ in range(LAYERS)]
    x, gate, norm = make(rows, heads, dim), make(rows, heads, dim), 1 + make(dim, scale=0.2)
    compiled = torch.compile(unfolded_gated_norm, dynamic=False)
    want = compiled(x, gate, norm, weights[0]).float()
    us = lambda fn: 1000 * graph_ms(lambda: [fn(w) for w in weights], 10) / LAYERS
    row = {"unfolded_us": us(lambda w: compiled(x, gate, norm, w)), "configs_us": {}}
    runs = {"default": lambda w: triton_linear.gated_norm_linear(x, gate, norm, EPS, w)}
    runs.update({f"{block_n}x{warps}": lambda w, b=block_n, n=warps: triton_linear.gated_norm_linear(
        x, gate, norm, EPS, w, block_n=b, warps=n) for block_n, warps in GATED_NORM_CONFIGS})
    if rows == 1:
        runs["gemv"] = lambda w: triton_gemv.gated_norm_gemv(x, gate, norm, EPS, w)
    return timed_configs(row, runs, weights[0], want, us, unswept=("default", "gemv"))


def timed_configs(row: dict, runs: dict, weight: torch.Tensor, want: torch.Tensor, us, unswept: tuple[str, ...]) -> dict:
    """``row`` with each of ``runs``' time (``us(run)``) under ``configs_us``, where its output for ``weight`` matches
    ``want`` (else listed under ``wrong``; out of resources: left out), and the fastest of those not ``unswept`` as
    ``best``."""
    for name, run in runs.items():
        try:
            error = (run(weight).float() - want).abs().max().item() / want.abs().max().item()
        except triton.runtime.errors.OutOfResources:
            continue
        if error > 2e-2:
            row.setdefault("wrong", []).append([name, error])
            continue
        row["configs_us"][name] = us(run)
    swept = {k: v for k, v in row["configs_us"].items() if k not in unswept}
    row["best"] = min(swept, key=swept.get, default=None)
    return row


SWIGLU_DOWN = (2048, 5632)  # the GDN-1.3B layer's down projection [N, I]
SWIGLU_CONFIGS = list(itertools.product((4, 6, 8), (32, 64), (128, 256), (4, 8)))  # (split, BLOCK_N, BLOCK_K, warps)


def unfolded_swiglu(gate_up, weight):
    """The pass without the fold: inductor's ``silu(gate) * up`` (compiled), then ``F.linear`` (cuBLAS)."""
    gate, up = gate_up.chunk(2, dim=-1)
    return torch.nn.functional.linear(torch.nn.functional.silu(gate) * up, weight)


def sweep_swiglu_down(rows: int) -> dict:
    """The MLP product and down projection at ``rows`` rows over ``LAYERS`` distinct weights: unfolded (inductor and
    cuBLAS) against the split few-row kernel over ``SWIGLU_CONFIGS`` and its default."""
    n, i = SWIGLU_DOWN
    make = lambda *shape, scale=1.0: (scale * torch.randn(*shape, device="cuda")).bfloat16()
    weights = [make(n, i, scale=i**-0.5) for _ in range(LAYERS)]
    gate_up = make(rows, 2 * i, scale=2.0)
    compiled = torch.compile(unfolded_swiglu, dynamic=False)
    want = compiled(gate_up, weights[0]).float()
    us = lambda fn: 1000 * graph_ms(lambda: [fn(w) for w in weights], 10) / LAYERS
    row = {"unfolded_us": us(lambda w: compiled(gate_up, w)), "configs_us": {}}
    runs = {"default": lambda w: triton_linear.swiglu_linear(gate_up, w)}
    runs.update({f"{split}x{block_n}x{block_k}x{warps}w": lambda w, s=split, b=block_n, k=block_k, n=warps:
                 triton_linear.swiglu_linear(gate_up, w, split=s, tiles=(b, k, 4), warps=n)
                 for split, block_n, block_k, warps in SWIGLU_CONFIGS})
    return timed_configs(row, runs, weights[0], want, us, unswept=("default",))


@contextlib.contextmanager
def prefetching(on: bool):
    """The linear kernels with (or without) the rows loaded a step ahead, for the probe's A/B."""
    before, triton_linear.PREFETCH = triton_linear.PREFETCH, on
    try:
        yield
    finally:
        triton_linear.PREFETCH = before


def probe() -> dict:
    """What slows the folded kernel: q/k/v/gate at 1 and 16 rows, plain GEMV (gemv_gpu's kernel) against the
    linear kernel without and with the norm and the skip, with and without the rows prefetched a step ahead,
    over a few tiles."""
    from gemv_gpu import gemv

    (n, k), _ = SITES["qkvg"]
    make = lambda *shape, scale=1.0: (scale * torch.randn(*shape, device="cuda")).bfloat16()
    weights = [make(n, k, scale=k**-0.5) for _ in range(LAYERS)]
    out = {}
    for rows, tiles in itertools.product((1, 16), ((64, 256, 4), (32, 256, 3), (64, 128, 3), (32, 128, 4))):
        x, skip, norm, summed = make(rows, k), make(rows, k), 1 + make(k, scale=0.2), make(rows, k)
        y = torch.empty(rows, n, device="cuda", dtype=torch.bfloat16)
        us = lambda fn: 1000 * graph_ms(lambda: [fn(w) for w in weights], 10) / LAYERS
        row = out[f"M{rows}_{tiles}"] = {"gemv": us(lambda w: gemv(x, w, y, tiles[0], tiles[1], 1, 4, tiles[2])),
                                         "plain": us(lambda w: triton_linear.linear(x, w, tiles=tiles))}
        for prefetch in (False, True):
            with prefetching(prefetch):
                for name, kwargs in (("norm", {"norm_weight": norm, "eps": EPS}),
                                     ("norm_skip", {"norm_weight": norm, "eps": EPS, "skip": skip, "skip_sum": summed})):
                    row[f"{name}_prefetch{int(prefetch)}"] = us(lambda w: triton_linear.linear(x, w, tiles=tiles, **kwargs))
        print("probe", rows, tiles, json.dumps(row), flush=True)
    for (n, k), gated, rows in itertools.product(((3072, 1024), (8192, 1024)), (False, True), (1, 4, 16)):  # the head's
        if gated != (n == 8192):
            continue
        head_weights = [make(n, k, scale=k**-0.5) for _ in range(LAYERS)]
        x, norm = make(rows, k), 1 + make(k, scale=0.2)
        project = triton_linear.gated_linear if gated else triton_linear.linear
        row = out[f"head_{n}x{k}_M{rows}"] = {}
        for prefetch in (False, True):
            with prefetching(prefetch):
                row[f"norm_prefetch{int(prefetch)}"] = 1000 * graph_ms(
                    lambda: [project(x, w, norm_weight=norm, eps=EPS) for w in head_weights], 10) / LAYERS
        print("probe head", n, k, rows, json.dumps(row), flush=True)
    return out


def sweep_rows(section: dict, extra: str | None = None) -> list[str]:
    """A kernel sweep's table rows, one per row count: the unfolded time, the default configuration's, the best one's
    (named) and ``extra``'s where given ("-" where none ran), then the configurations left out as wrong."""
    shown = lambda us: "-" if us is None else f"{us:.2f}"
    lines = []
    for rows, r in section.items():
        timed = r["configs_us"]
        best = "-" if r["best"] is None else f"{timed[r['best']]:.2f} ({r['best']})"
        cells = [rows, f"{r['unfolded_us']:.2f}", shown(timed.get("default")), best] + ([shown(timed.get(extra))] if extra else [])
        lines.append(f"| {' | '.join(cells)} |")
    wrong = {rows: r["wrong"] for rows, r in section.items() if r.get("wrong")}
    return lines + (["", f"Configurations whose output differs from the unfolded one's (left out): {wrong}"] if wrong else [])


def write_report(results: dict, out_dir: str) -> None:
    lines = save_results(results, out_dir, "fold_gpu", "Norms folded into the GEMMs after them, at the GDN-1.3B shapes",
                         f"; bf16; {LAYERS} distinct weights per site (the LM head: one) in one CUDA graph, median replay, us per call") + [
             "| site [N, K] | rows | unfolded (inductor add+norm (head_*: norm), cuBLAS, silu*up) | folded, default tiles | folded, best | best tiles (BLOCK_N, BLOCK_K, stages) |",
             "| --- | --- | --- | --- | --- | --- |"]
    for key, row in results["results"].items():
        name, rows = key.rsplit("_M", 1)
        if name.startswith(("bare_", "prefolded_")):  # (prefolded_*: aa5cc75's sweep, in fold_gpu_head.json)
            continue
        lines.append(f"| {name} {list({**SITES, **HEAD_SITES}[name][0])} | {rows} | {row['unfolded_us']:.2f} | {row['default_us']:.2f} "
                     f"{row['default_tiles']} | {row['best_us']:.2f} | {row['best_tiles']} |")
    bare = {k[5:]: v for k, v in results["results"].items() if k.startswith("bare_")}
    if bare:
        lines += ["", "The same kernels without a norm (`bare`), against cuBLAS and inductor's silu(gate) * up, us per call"
                  + (f" (`{results['command_bare']}`)" if "command_bare" in results else "") + ":", "",
                  "| site [N, K] | rows | cuBLAS (+ silu*up) | Triton, default tiles | Triton, best | best tiles |",
                  "| --- | --- | --- | --- | --- | --- |"]
        for key, row in bare.items():
            name, rows = key.rsplit("_M", 1)
            lines.append(f"| {name} {list({**BARE_SITES, **HEAD_SITES}[name][0])} | {rows} | {row['unfolded_us']:.2f} | {row['default_us']:.2f} "
                         f"{row['default_tiles']} | {row['best_us']:.2f} | {row['best_tiles']} |")
    prefolded = {k[10:]: v for k, v in results["results"].items() if k.startswith("prefolded_")}
    if prefolded:
        lines += ["", "The head's norm GEMMs with the norm's weight folded into W (`row_rms` at `aa5cc75`, since removed: "
                  "only the rows' rsqrt in the kernel), against inductor's norm and cuBLAS, us per call:", "",
                  "| site [N, K] | rows | inductor norm, cuBLAS (+ silu*up) | Triton, default tiles | Triton, best | best tiles |",
                  "| --- | --- | --- | --- | --- | --- |"]
        for key, row in prefolded.items():
            name, rows = key.rsplit("_M", 1)
            lines.append(f"| {name} {list(HEAD_SITES[name][0])} | {rows} | {row['unfolded_us']:.2f} | {row['default_us']:.2f} "
                         f"{row['default_tiles']} | {row['best_us']:.2f} | {row['best_tiles']} |")
    probe = results.get("probe", {})
    model = {k: v for k, v in probe.items() if not k.startswith("head_")}
    if model:
        lines += ["", "What slows the folded kernel (q/k/v/gate [8208, 2048], us per call; `prefetch`: the rows a step ahead):", "",
                  "| rows, tiles | gemv_gpu's GEMV | linear kernel | + norm | + norm, prefetch | + norm + skip | + norm + skip, prefetch |",
                  "| --- | --- | --- | --- | --- | --- | --- |"]
        lines += [f"| {k} | {r['gemv']:.2f} | {r['plain']:.2f} | {r['norm_prefetch0']:.2f} | {r['norm_prefetch1']:.2f} | "
                  f"{r['norm_skip_prefetch0']:.2f} | {r['norm_skip_prefetch1']:.2f} |" for k, r in model.items()]
    head = {k: v for k, v in probe.items() if k.startswith("head_")}
    if head:
        lines += ["", "The EAGLE head's norm GEMMs (q/k/v [3072, 1024] with its norm, gate/up [8192, 1024] with its norm and "
                  "silu(gate) * up; us per call):", "", "| weight, rows | norm | norm, prefetch |", "| --- | --- | --- |"]
        lines += [f"| {k[5:]} | {r['norm_prefetch0']:.2f} | {r['norm_prefetch1']:.2f} |" for k, r in head.items()]
    if results.get("gated_norm"):
        lines += ["", "A GDN layer's gated output norm and o_proj (8 heads of 256 -> 2048; `gated_norm`"
                  + (f", `{results['command_gated_norm']}`" if "command_gated_norm" in results else "") + "), us per call:",
                  "", "| rows | inductor norm, cuBLAS | few-row kernel, default | best (BLOCK_N x warps) | one-row GEMV |",
                  "| --- | --- | --- | --- | --- |"] + sweep_rows(results["gated_norm"], "gemv")
    if results.get("swiglu_down"):
        lines += ["", f"A GDN layer's MLP product and down projection ({list(SWIGLU_DOWN)}, `swiglu_down`), us per call:",
                  "", "| rows | inductor silu*up, cuBLAS split-K | split kernel, default | best (split x BLOCK_N x BLOCK_K x warps) |",
                  "| --- | --- | --- | --- |"] + sweep_rows(results["swiglu_down"])
    with open(os.path.join(out_dir, "fold_gpu.md"), "w") as f:
        f.write("\n".join(lines) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 16, 32])
    parser.add_argument("--head-rows", type=int, nargs="+", default=[1, 4, 16], help="rows of the head section")
    parser.add_argument("--sections", nargs="+", choices=("probe", *KINDS, "gated_norm", "swiglu_down"),
                        default=["probe", "folded", "bare"],
                        help="head, head_bare: the norm GEMMs of an EAGLE head at hidden 2048, with the norm and "
                             "without it; gated_norm: a GDN layer's gated output norm and o_proj; swiglu_down: its MLP "
                             "product and down projection (neither in the default)")
    parser.add_argument("--plot", metavar="JSON", help="only write the markdown from an earlier JSON")
    args = parser.parse_args()
    results = start_run(parser, args, write_report)
    if results is None:
        return
    started = time.perf_counter()
    if "probe" in args.sections:
        results["probe"] = probe()
    if "gated_norm" in args.sections:
        section = results.setdefault("gated_norm", {})
        for rows in sorted({1, 9, *(r for r in args.rows if r <= triton_linear.MAX_ROWS)}):  # (9: a chain of 9)
            section[str(rows)] = sweep_gated_norm(rows)
            print("gated_norm", rows, json.dumps(section[str(rows)]), f"{time.perf_counter() - started:.0f} s", flush=True)
            write_report(results, args.out)
    if "swiglu_down" in args.sections:
        section = results.setdefault("swiglu_down", {})
        for rows in sorted({9, *(r for r in args.rows if 1 < r <= triton_linear.MAX_ROWS)}):  # (9: a chain of 9)
            section[str(rows)] = sweep_swiglu_down(rows)
            print("swiglu_down", rows, json.dumps(section[str(rows)]), f"{time.perf_counter() - started:.0f} s", flush=True)
            write_report(results, args.out)
    for kind in (kind for kind in KINDS if kind in args.sections):
        prefix = PREFIXES.get(kind, "")
        for name in KINDS[kind]:
            for rows in args.head_rows if kind.startswith("head") else args.rows:
                row = results["results"][f"{prefix}{name}_M{rows}"] = sweep_site(name, rows, kind)
                print(prefix + name, rows, json.dumps(row), f"{time.perf_counter() - started:.0f} s", flush=True)
                write_report(results, args.out)


if __name__ == "__main__":
    main()
