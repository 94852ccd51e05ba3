"""A one-row GEMV in CUDA C (``specla_compile/kernels/cuda_gemv.cu``) against cuBLAS at the GDN-1.3B pass's GEMM shapes.

Plain decoding at the 1.3B shape takes 1.42 ms a pass, of which cuBLAS's 96 GEMMs alone take 0.97 ms (2.74 TB/s
against a copy rate of 4.2 TB/s; ``docs/speed.md``), and no Triton GEMV tried so far streams faster than about
3.4 TB/s on the wide weights and half that on o_proj and down (``gemv_gpu.md``, ``gemv_gpu_tma.md``). This asks
whether a GEMV written in CUDA C does: every lane issues all of its 16-byte weight loads first (all of a row's
bytes in flight at once), and with programmatic dependent launch (PDL) it issues them before waiting for the
kernel before, so that a GEMV's weights stream in while the one before finishes.

Each shape is timed as ``gemv_gpu.py`` times it: 24 distinct weights (the LM head: one) back to back in one CUDA
graph, median replay; then one layer's four GEMMs in order, 24 layers in one graph, each GEMV with its shape's best
configuration, against cuBLAS: a bound on what the pass could gain (back to back, with none of the pass's kernels
between them). Every configuration's output is checked against ``F.linear`` before it is timed, and the best ones'
captured graphs after. Last, what the one-token twin's folds leave (down with the MLP's product and o_proj with the
gated norm in Triton GEMVs; the residual add and norm before q/k/v/gates and gate/up in inductor's kernel) against
the CUDA GEMV doing that work in its prologue. The library is built with the machine's ``nvcc`` (``-arch=sm_90``, about 30 s; the backend's ``cuda_gemvs``
option runs the same kernels in the plain step).

    python benchmarks/gemv_cuda_gpu.py --out benchmarks/results          # H200, about a minute
    python benchmarks/gemv_cuda_gpu.py --plot benchmarks/results/gemv_cuda_gpu.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import time

import torch
from gemv_gpu import LAYERS, PRESETS, graph_ms, save_results, start_run

from specla_compile.kernels.cuda_gemv import gemv, library
from specla_compile.runtime.graph_capture import capture

SHAPES = PRESETS["gdn_1.3b"]["shapes"]
LAYER = ("qkvg", "o_proj", "gate_up", "down")  # a layer's GEMMs in the order the pass runs them
# (rows per warp, warps per block, streaming loads, PDL); the library refuses rows * K / 256 > 32 (-1)
CONFIGS = list(itertools.product((1, 2, 4, 8), (4, 8), (0, 1), (0, 1)))


def time_shape(name: str) -> dict:
    """cuBLAS and every configuration of the CUDA GEMV for 24 distinct weights of shape ``name`` (the LM head: one)
    at one row. The best configuration with and without PDL is timed a second time (the figure reported: the first
    timing picked it) and its captured graph's outputs are checked against ``F.linear`` for every weight."""
    n, k = SHAPES[name]
    copies = 1 if name == "lm_head" else LAYERS
    weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / 50 for _ in range(copies)]
    x = torch.randn(k, device="cuda", dtype=torch.bfloat16)
    outs = [torch.empty(n, device="cuda", dtype=torch.bfloat16) for _ in range(copies)]
    references = [torch.nn.functional.linear(x, w).float() for w in weights]
    total = n * k * 2 * copies

    def close(out: torch.Tensor, reference: torch.Tensor) -> float | None:
        """The largest error, or None within bf16 rounding of F.linear's own."""
        error = (out.float() - reference).abs().max().item()
        return None if error <= 0.02 * reference.abs().max().item() + 1e-2 else error

    def chain(config: tuple) -> None:
        for w, y in zip(weights, outs):
            gemv(w, x, y, *config)

    ms = graph_ms(lambda: [torch.nn.functional.linear(x, w) for w in weights])
    row = {"cublas": {"us": 1000 * ms / copies, "TBps": total / ms / 1e9}, "configs": {}, "wrong_configs": []}
    for config in CONFIGS:
        try:
            gemv(weights[0], x, outs[0], *config)
        except ValueError:
            continue
        torch.cuda.synchronize()
        error = close(outs[0], references[0])
        if error is not None:
            row["wrong_configs"].append([*config, error])
            continue
        ms = graph_ms(lambda config=config: chain(config))
        row["configs"][str(list(config))] = {"us": 1000 * ms / copies, "TBps": total / ms / 1e9}
    for pdl in (0, 1):
        timed = {key: value for key, value in row["configs"].items() if json.loads(key)[3] == pdl}
        if not timed:
            continue
        config = tuple(json.loads(min(timed, key=lambda key: timed[key]["us"])))
        graph, _ = capture(lambda config=config: chain(config))
        for y in outs:
            y.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        errors = [close(y, reference) for y, reference in zip(outs, references)]
        ms = graph_ms(lambda config=config: chain(config))
        row[f"best_pdl{pdl}"] = {"us": 1000 * ms / copies, "TBps": total / ms / 1e9, "config": list(config),
                                 "replay_matches": all(e is None for e in errors)}
    return row


def time_layers(best: dict[int, dict[str, list[int]]]) -> dict:
    """One layer's four GEMMs in order, 24 layers in one graph: cuBLAS, and the CUDA GEMV with each shape's best
    configuration without PDL and with it (``best[pdl][shape]``). Back to back, with nothing between them: in the
    pass each GEMV follows norm or conv kernels, so this bounds what the pass could gain, it does not measure it."""
    layers = [{name: torch.randn(*SHAPES[name], device="cuda", dtype=torch.bfloat16) / 50 for name in LAYER}
              for _ in range(LAYERS)]
    xs = {name: torch.randn(SHAPES[name][1], device="cuda", dtype=torch.bfloat16) for name in LAYER}
    ys = {name: torch.empty(SHAPES[name][0], device="cuda", dtype=torch.bfloat16) for name in LAYER}
    total = sum(w.numel() * 2 for layer in layers for w in layer.values())

    def ours(pdl: int) -> None:
        for layer in layers:
            for name in LAYER:
                gemv(layer[name], xs[name], ys[name], *best[pdl][name])

    times = {"cublas": graph_ms(lambda: [torch.nn.functional.linear(xs[name], layer[name]) for layer in layers
                                         for name in LAYER]),
             "cuda_gemv": graph_ms(lambda: ours(0)), "cuda_gemv_pdl": graph_ms(lambda: ours(1))}
    return {side: {"ms_per_pass": ms, "us_per_layer": 1000 * ms / LAYERS, "TBps": total / ms / 1e9} for side, ms in times.items()}


def time_prologues() -> dict:
    """What each fold of the one-token twin leaves against the CUDA GEMV doing that work in its prologue, 24 distinct
    weights in one graph, PDL on both sides as in the pass: down with the MLP's ``silu(gate) * up`` (``fold_swiglu``'s
    Triton GEMV, ``"swiglu"``), o_proj with the gated output norm of 8 heads of 256 (``fold_gated_norms``',
    ``"gated_norm"``), and q/k/v/gates, gate/up and the LM head with the residual add and RMS norm before them
    (inductor's kernel of them, then the CUDA GEMV; ``fold_row_norms``, ``"add_norm"``). Each side's outputs are
    checked against the op's reference first."""
    cases = (("down", "swiglu"), ("o_proj", "gated_norm"), ("qkvg", "add_norm"), ("gate_up", "add_norm"),
             ("lm_head", "add_norm"))  # (the LM head's 4,000 blocks each form x again: the most prologues of a pass)
    return {f"{name}_{prologue}": time_prologue(name, prologue) for name, prologue in cases}


def time_prologue(name: str, prologue: str) -> dict:
    """One row of :func:`time_prologues`: 24 weights of shape ``name``, x formed by ``prologue``; the CUDA GEMV with
    the configuration the op picks (``cuda_gemv.config``) and with the best of every (rows per warp, warps, streaming)
    it has an instance of, PDL on: every block forms x again, so fewer, larger blocks may pay (they take more
    registers)."""
    from specla_compile.kernels import ops, pdl, triton_gemv
    from specla_compile.kernels import reference as ref
    from specla_compile.kernels.cuda_gemv import config, row_gemv

    n, k = SHAPES[name]
    weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / 50 for _ in range(LAYERS)]
    x = torch.randn(*((1, 1, 2 * k) if prologue == "swiglu" else (1, 1, k // 256, 256) if prologue == "gated_norm"
                      else (1, 1, k)), device="cuda", dtype=torch.bfloat16)
    extras = ()
    if prologue != "swiglu":  # (the gate, or the skip; the norm weight; eps)
        extras = (torch.randn_like(x), 1 + torch.randn(x.shape[-1], device="cuda", dtype=torch.bfloat16) / 4, 1e-6)
    # (fla's prenorm, compiled as the pass compiles it: its kernel launched with PDL)
    add_norm = torch.compile(lambda a, b: (a + b, ref.rms_norm_reference(a, b, extras[1], 1e-6)),
                             options=pdl.launch_bound_inductor_options(x.device)) if prologue == "add_norm" else None
    y, summed = torch.empty(n, device="cuda", dtype=torch.bfloat16), torch.empty(k, device="cuda", dtype=torch.bfloat16)

    def before(w: torch.Tensor) -> torch.Tensor:
        if prologue == "add_norm":
            return row_gemv(add_norm(x, extras[0])[1], w, "none", True)
        return triton_gemv.swiglu_gemv(x, w) if prologue == "swiglu" else triton_gemv.gated_norm_gemv(x, *extras, w)

    def cuda(w: torch.Tensor, setting: tuple) -> torch.Tensor:
        gemv(w, x.view(-1), y, *setting, pdl=1, prologue=prologue, gate=extras[0].view(-1) if extras else None,
             norm_weight=extras[1] if extras else None, eps=1e-6, sum_out=summed if prologue == "add_norm" else None)
        return y

    wide = [e.float() if torch.is_tensor(e) else e for e in extras]
    if prologue == "add_norm":
        reference = ops.add_norm_row_gemv._init_fn(x.float(), *wide, weights[0].float(), False)[0].view(-1)
    else:
        reference = ops.row_gemv._init_fn(x.float(), weights[0].float(), prologue, *wide).view(-1)

    def timed(fn) -> dict:
        error = (fn(weights[0]).float().view(-1) - reference).abs().max().item()
        ms = graph_ms(lambda: [fn(w) for w in weights])
        return {"us": 1000 * ms / LAYERS, "TBps": n * k * 2 * LAYERS / ms / 1e9,
                "matches": error <= 0.02 * reference.abs().max().item() + 1e-2}

    row = {"before": timed(before), "cuda_gemv": {**timed(lambda w: cuda(w, config(n, k))), "config": list(config(n, k))}}
    for setting in itertools.product((1, 2, 4, 8), (4, 8), (0, 1)):
        try:
            cuda(weights[0], setting)
        except ValueError:
            continue  # (no instance: too many rows for the depth)
        result = {**timed(lambda w, setting=setting: cuda(w, setting)), "config": list(setting)}
        best = row.get("cuda_gemv_best")
        if result["matches"] and (best is None or result["us"] < best["us"]):
            row["cuda_gemv_best"] = result
    return row


def write_report(results: dict, out_dir: str) -> None:
    lines = save_results(results, out_dir, "gemv_cuda_gpu", "A one-row GEMV in CUDA C against cuBLAS at the GDN-1.3B "
                         "pass's GEMM shapes", f"; bf16 weights, {LAYERS} distinct weights per shape (the LM head: one) "
                         "in one CUDA graph, median replay") + [
        "| weight [N, K] | cuBLAS us | cuBLAS TB/s | CUDA GEMV us | TB/s | over cuBLAS | config | with PDL us | TB/s | config |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for name, row in results["shapes"].items():
        cublas, plain, pdl = row["cublas"], row.get("best_pdl0"), row.get("best_pdl1")
        cells = [f"{name} {list(SHAPES[name])}", f"{cublas['us']:.2f}", f"{cublas['TBps']:.2f}"]
        cells += [f"{plain['us']:.2f}", f"{plain['TBps']:.2f}", f"{plain['us'] / cublas['us']:.3f}", str(plain["config"][:3])] if plain else ["-"] * 4
        cells += [f"{pdl['us']:.2f}", f"{pdl['TBps']:.2f}", str(pdl["config"][:3])] if pdl else ["-"] * 3
        lines.append("| " + " | ".join(cells) + " |")
    lines.append("")
    for name, row in results["shapes"].items():
        for pdl in (0, 1):
            best = row.get(f"best_pdl{pdl}")
            if best and not best["replay_matches"]:
                lines.append(f"- {name}: the captured graph of {best['config']} gave outputs other than F.linear's: its "
                             "time does not count")
        if row["wrong_configs"]:
            lines.append(f"- {name}: configurations whose output differs from F.linear (rows per warp, warps, streaming, "
                         f"PDL, error): {row['wrong_configs']}")
    layers = results.get("layers")
    if layers:
        lines += ["", (f"One layer's four GEMMs in order ({', '.join(LAYER)}), {LAYERS} layers in one graph, each GEMV "
                       "with its shape's best configuration:"), "", "| GEMMs | ms per pass | us per layer | TB/s |",
                  "| --- | --- | --- | --- |"]
        for side, label in (("cublas", "cuBLAS"), ("cuda_gemv", "CUDA GEMV"), ("cuda_gemv_pdl", "CUDA GEMV, PDL")):
            t = layers[side]
            lines.append(f"| {label} | {t['ms_per_pass']:.3f} | {t['us_per_layer']:.1f} | {t['TBps']:.2f} |")
    prologues = results.get("prologues")
    if prologues:
        lines += ["", ("What the one-token twin's folds leave (the fold's one-row Triton GEMV; for the add and norm, "
                       "inductor's kernel of them and then the CUDA GEMV) against the CUDA GEMV with that work as its "
                       "prologue (24 weights in one graph, PDL on both):"), "",
                  ("| GEMV | before, us | CUDA GEMV with the prologue, us | ratio | its best configuration, us | config "
                   "(rows, warps, streaming) | outputs as the reference |"),
                  "| --- | --- | --- | --- | --- | --- | --- |"]
        labels = {"down_swiglu": "down with silu(gate) * up (fold's Triton GEMV)",
                  "o_proj_gated_norm": "o_proj with the gated norm (fold's Triton GEMV)",
                  "qkvg_add_norm": "q/k/v/gates with the add and norm (inductor's kernel, then the CUDA GEMV)",
                  "gate_up_add_norm": "gate/up with the add and norm (inductor's kernel, then the CUDA GEMV)",
                  "lm_head_add_norm": "LM head with the add and norm (inductor's kernel, then the CUDA GEMV)"}
        for name, row in prologues.items():
            old, cuda = row["before"], row["cuda_gemv"]
            matches = "yes" if old["matches"] and cuda["matches"] else "no: its time does not count"
            best = row.get("cuda_gemv_best")
            swept = f"{best['us']:.2f} | {best['config']}" if best else "- | -"
            lines.append(f"| {labels.get(name, name)} | {old['us']:.2f} | {cuda['us']:.2f} | {cuda['us'] / old['us']:.3f} "
                         f"| {swept} | {matches} |")
    with open(os.path.join(out_dir, "gemv_cuda_gpu.md"), "w") as f:
        f.write("\n".join(lines) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("--plot", metavar="JSON", help="only write the markdown from an earlier JSON")
    args = parser.parse_args()
    results = start_run(parser, args, write_report)
    if results is None:
        return
    started = time.perf_counter()
    library()
    print(f"built the GEMV library in {time.perf_counter() - started:.0f} s", flush=True)
    results.update(shapes={}, layers=None)
    for name in SHAPES:
        row = results["shapes"][name] = time_shape(name)
        print(name, json.dumps({side: row.get(side) for side in ("cublas", "best_pdl0", "best_pdl1")}),
              f"{time.perf_counter() - started:.0f} s", flush=True)
        write_report(results, args.out)
    rows = [results["shapes"][name] for name in LAYER]
    if not all(f"best_pdl{pdl}" in row for row in rows for pdl in (0, 1)):
        print("no layer timing: a shape of the layer has no configuration that matched F.linear", flush=True)
        return
    results["layers"] = time_layers({pdl: {name: row[f"best_pdl{pdl}"]["config"] for name, row in zip(LAYER, rows)}
                                          for pdl in (0, 1)})
    print(json.dumps(results["layers"]), flush=True)
    write_report(results, args.out)
    results["prologues"] = time_prologues()
    print(json.dumps(results["prologues"]), flush=True)
    write_report(results, args.out)


if __name__ == "__main__":
    main()
