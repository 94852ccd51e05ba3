"""Kernel microbenchmarks on one GPU at the GDN-1.3B layer shape (B=1, 8 value heads, K = V = 256,
fp32 state, bf16 inputs), against flash-linear-attention, all routes in one run.

Every route is captured in a CUDA graph that runs it ``SETS`` times, each time on a different buffer
set (states alone are 2 MiB each, so consecutive calls do not find their state in L2, as in a layer
stack); a route's time is the median over graph replays divided by ``SETS``. The layer-stack routes
(token replay, factor commit over 24 layers) are one graph of the whole stack.

    python benchmarks/bench_kernels.py --out benchmarks/results [--sections ... sweep]
    SPECLA_PDL=0 python benchmarks/bench_kernels.py --sections sweep --out DIR   # launch shapes, each call waiting
    python benchmarks/bench_kernels.py --plot-only benchmarks/results/bench_kernels.json

Writes ``bench_kernels.json``, ``bench_kernels.md`` and ``bench_kernels.png`` and prints the tables.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import traceback
import warnings
from collections.abc import Callable
from pathlib import Path

import torch

B, H, HV, K, V = 1, 8, 8, 256, 256
SCALE = K**-0.5
SETS = 48
REPLAYS = 30
CHAIN_LENGTHS = (1, 2, 4, 8, 12, 16)
# Table 1 of the paper: (top-k, depth, nodes) -> its hybrid-over-replay speedup. The paper gives six
# ratios over top-k {2, 4}, depth {4, 12, 24} and {16, 32} nodes; this is our reading of which is which.
TABLE1 = [(2, 4, 16, 2.20), (2, 12, 16, 2.55), (2, 12, 32, 5.14), (2, 24, 32, 7.11), (4, 4, 16, 1.80), (4, 4, 32, 2.19)]
LAYERS, HIDDEN, MLP_HIDDEN, CONV_WIDTH = 24, 2048, 5632, 4
ACCEPTED = tuple(range(1, 9))
STATE_BYTES = HV * K * V * 4


# --- topologies -----------------------------------------------------------------------------------


def chain_parents(n: int) -> list[int]:
    return list(range(-1, n - 1))


def beam_tree(topk: int, depth: int, nodes: int) -> list[int]:
    """A beam top-k draft tree in BFS order: each level keeps the best candidates (parent rank + child
    rank) among ``topk`` children of every node of the level above, spreading the node budget evenly
    over the levels still to fill."""
    parents, level, remaining = [-1], [0], nodes - 1
    for d in range(depth):
        take = min(len(level) * topk, math.ceil(remaining / (depth - d)))
        candidates = sorted(((rank + c, rank, c, p) for rank, p in enumerate(level) for c in range(topk)))[:take]
        level = []
        for *_, p in sorted(candidates, key=lambda t: (t[1], t[2])):
            level.append(len(parents))
            parents.append(p)
        remaining -= take
    return parents


def leaves_and_paths(parents: list[int]) -> list[list[int]]:
    has_child = {p for p in parents if p >= 0}
    paths = []
    for leaf in (j for j in range(len(parents)) if j not in has_child):
        path = [leaf]
        while parents[path[-1]] >= 0:
            path.append(parents[path[-1]])
        paths.append(path[::-1])
    return paths


def parked_nodes(parents: list[int]) -> int:
    """States the serial route parks: nodes that a later, non-adjacent child resumes from."""
    return len({p for j, p in enumerate(parents) if p >= 0 and j > p + 1})


def height(parents: list[int]) -> int:
    return max(len(p) for p in leaves_and_paths(parents))


# --- inputs and timing ----------------------------------------------------------------------------


def make_sets(n: int, states: list[torch.Tensor], seed: int) -> list[dict[str, torch.Tensor]]:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    out = []
    for i in range(SETS):
        randn = lambda *s: torch.randn(*s, generator=gen, device="cuda")
        out.append({
            "q": randn(B, n, H, K).bfloat16(), "k": randn(B, n, H, K).bfloat16(), "v": randn(B, n, HV, V).bfloat16(),
            "g": -torch.rand(B, n, HV, generator=gen, device="cuda") * 0.7 - 0.01,
            "beta": (torch.rand(B, n, HV, generator=gen, device="cuda") * 0.9 + 0.05).bfloat16(),
            "state": states[i],
        })
    return out


def records_for(sets: list[dict], accepted: int) -> list:
    """Pending records (normalized keys) of ``accepted`` tokens per set."""
    from specla_compile.kernels.triton_verify import Pending

    out = []
    for s in sets:
        k = torch.nn.functional.normalize(s["k"][:, :accepted].float(), dim=-1)
        num = torch.full((B,), accepted, device="cuda")
        out.append(Pending(k, s["v"][:, :accepted], s["g"][:, :accepted], s["beta"][:, :accepted], num))
    return out


def time_graph(step: Callable[[int], object], calls: int = SETS) -> dict[str, float]:
    """Median (and spread) over graph replays of ``calls`` captured calls, per call, in microseconds.
    A route that fails is reported as ``{"error": ...}`` so the other routes still get measured."""
    try:
        return _time_graph(step, calls)
    except Exception as e:  # noqa: BLE001 (recorded in the results and printed)
        traceback.print_exc()
        torch.cuda.synchronize()
        return {"error": f"{type(e).__name__}: {e}"[:300], "median_us": float("nan")}


def _time_graph(step: Callable[[int], object], calls: int) -> dict[str, float]:
    for i in range(calls):  # compile, autotune, allocate
        step(i)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            step(i)
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(REPLAYS):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / calls)
    del graph
    times.sort()
    return {"median_us": statistics.median(times), "p10_us": times[len(times) // 10], "p90_us": times[-1 - len(times) // 10]}


def copy_bandwidth() -> float:
    """Device-to-device copy of 1 GiB, bytes read plus written per second (GB/s): the best of a captured
    copy and plain stream copies timed with events (after a warm-up, so clocks have ramped)."""
    src = torch.randn(256 * 2**20, device="cuda")
    dst = torch.empty_like(src)
    graphed = time_graph(lambda i: dst.copy_(src), calls=4)["median_us"]
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    plain = []
    for _ in range(10):
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        plain.append(start.elapsed_time(end) * 1e3)
    return 2 * src.numel() * 4 / min(graphed, statistics.median(plain)) / 1e3


# --- routes ---------------------------------------------------------------------------------------


def fla_fns():
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule

    return fused_recurrent_gated_delta_rule, chunk_gated_delta_rule


def verify_bytes(n: int, *, state_writes: int = 0, pending: int = 0) -> int:
    """The fewest bytes a verify of n nodes moves: the state tile once, bf16 q/k/v in, bf16 o and fp32
    k_hat out, plus ``state_writes`` full-state writes (and as many re-reads for parked states)."""
    inputs = n * (2 * H * K * 2 + HV * V * 2 + HV * 8)
    outputs = n * (HV * V * 2 + H * K * 4)
    records = pending * (H * K * 4 + HV * V * 2 + HV * 8)
    return STATE_BYTES + inputs + outputs + records + state_writes * STATE_BYTES


def ours(route: str, parents: torch.Tensor, config=None) -> Callable:
    """Our verify on one buffer set (with pending records: the fused commit), the dispatcher's launch shape
    unless ``config`` is given."""
    from specla_compile.kernels import dispatch, triton_verify

    def run(s: dict, p=None, snap=None):
        cfg = config or dispatch.kernel_config(route, parents.shape[1], p is not None)
        return triton_verify.tree_verify(s["q"], s["k"], s["v"], s["g"], s["beta"], parents, s["state"], SCALE, True,
                                         route=route, pending=p, config=cfg, snapshot=snap)

    return run


def bench_topology(parents_list: list[int], states: list[torch.Tensor], seed: int, *, chain: bool) -> dict[str, dict]:
    """All routes on one topology: fla's and ours (and, for chains, the fused and snapshot routes)."""
    from specla_compile.kernels import dispatch

    fused_recurrent, chunk = fla_fns()
    n = len(parents_list)
    parents = torch.tensor([parents_list], device="cuda")
    sets = make_sets(n, states, seed)
    res: dict[str, dict] = {}
    copy_bw = RESULTS["copy_GBps"]

    def record(name: str, t: dict, nbytes: int | None = None, programs: int | None = None):
        if "error" in t:
            res[name] = t
            return
        if nbytes is not None:
            t["bytes"] = nbytes
            t["GBps"] = nbytes / t["median_us"] / 1e3
            t["of_copy_bw"] = t["GBps"] / copy_bw
        if programs is not None:
            t["programs"] = programs
        res[name] = t
        print(f"    {name:28s} {t['median_us']:9.2f} us", flush=True)

    def fla(q, k, v, g, beta, state, final=False, **kw):
        return fused_recurrent(q=q, k=k, v=v, g=g, beta=beta, scale=SCALE, initial_state=state,
                               output_final_state=final, use_qk_l2norm_in_kernel=True, **kw)

    fields = ("q", "k", "v", "g", "beta")
    if chain:
        def per_token(i):
            s, state = sets[i], sets[i]["state"]
            for t in range(n):
                _, state = fla(*(s[x][:, t:t + 1] for x in fields), state, final=True)
        record("fla_recurrent_per_token", time_graph(per_token))
        record("fla_recurrent_chain", time_graph(lambda i: fla(*(sets[i][x] for x in fields), sets[i]["state"], final=True)))
        record("fla_recurrent_chain_no_state", time_graph(lambda i: fla(*(sets[i][x] for x in fields), sets[i]["state"])))
        record("fla_chunk", time_graph(lambda i: chunk(
            q=sets[i]["q"], k=sets[i]["k"], v=sets[i]["v"], g=sets[i]["g"], beta=sets[i]["beta"], scale=SCALE,
            initial_state=sets[i]["state"], output_final_state=True, use_qk_l2norm_in_kernel=True)))
        snaps = [torch.empty(B, HV, n, K, V, device="cuda") for _ in range(SETS)]
        run = ours("serial", parents)
        record("snapshot_every_node", time_graph(lambda i: run(sets[i], snap=snaps[i])), verify_bytes(n, state_writes=n))
        del snaps
    else:
        paths = leaves_and_paths(parents_list)
        gathered = [[{x: s[x][:, p] for x in fields} for p in paths] for s in sets]
        record("replay_per_leaf", time_graph(lambda i: [fla(**gp, state=sets[i]["state"]) for gp in gathered[i]]))
        lengths = torch.tensor([0] + [len(p) for p in paths], device="cuda").cumsum(0)
        flat = [{x: torch.cat([gp[x] for gp in gathered[i]], 1) for x in gathered[i][0]} for i in range(SETS)]
        starts = [s["state"].expand(len(paths), -1, -1, -1).contiguous() for s in sets]
        record("replay_batched_varlen", time_graph(lambda i: fla(**flat[i], state=starts[i], cu_seqlens=lengths)))
    parked = parked_nodes(parents_list)
    for route in ("serial", "parallel", "hybrid"):
        run = ours(route, parents)
        writes = 2 * parked if route == "serial" else 0  # each parked state is written and read back
        cfg = dispatch.kernel_config(route, n)
        programs = (V // cfg.block_v) * B * HV * (n if route == "hybrid" else 1)
        record(f"ours_{route}", time_graph(lambda i: run(sets[i])), verify_bytes(n, state_writes=writes), programs)
    if chain:
        pending_n = max(1, n // 2)
        pend = records_for(sets, pending_n)
        for route in ("serial", "parallel"):
            run = ours(route, parents)
            record(f"ours_fused_{route}", time_graph(lambda i: run(sets[i], p=pend[i])),
                   verify_bytes(n, state_writes=1, pending=pending_n))
        res["fused_pending"] = {"accepted": pending_n}
    return res


# --- layer stack: token replay vs factor commit ---------------------------------------------------


class LayerStack:
    """A GDN-1.3B-shaped stack with random weights: per layer RMSNorm, fused q/k/v projection, short
    conv (width 4) + SiLU, gate projections, gated delta rule (fla fused_recurrent, state advanced),
    gated output norm, output projection, RMSNorm and a SwiGLU MLP."""

    def __init__(self) -> None:
        gen = torch.Generator(device="cuda").manual_seed(0)
        w = lambda o, i: (torch.randn(o, i, generator=gen, device="cuda") / i**0.5).bfloat16()
        d = 3 * H * K
        self.layers = [{
            "qkv": w(d, HIDDEN), "ab": w(2 * HV, HIDDEN), "gate": w(HV * V, HIDDEN), "out": w(HIDDEN, HV * V),
            "mlp_in": w(2 * MLP_HIDDEN, HIDDEN), "mlp_out": w(HIDDEN, MLP_HIDDEN),
            "conv": (torch.randn(d, CONV_WIDTH, generator=gen, device="cuda") * 0.5).bfloat16(),
            "conv_state": torch.randn(B, d, CONV_WIDTH, generator=gen, device="cuda").bfloat16(),
            "state": torch.randn(B, HV, K, V, generator=gen, device="cuda") * 0.1,
        } for _ in range(LAYERS)]

    def replay(self, h: torch.Tensor) -> torch.Tensor:
        """Run the accepted tokens ``h [B, A, HIDDEN]`` through every layer, advancing its states."""
        from specla_compile.kernels import triton_conv

        fused_recurrent, _ = fla_fns()
        a = h.shape[1]
        chain = torch.arange(-1, a - 1, device="cuda")[None]
        num = torch.full((B,), a, device="cuda")
        rms = lambda x: x * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6).to(x.dtype)
        for layer in self.layers:
            x = rms(h)
            mixed = x @ layer["qkv"].T
            conv = triton_conv.tree_conv(mixed, layer["conv_state"], layer["conv"], None, chain, True)
            triton_conv.conv_state_commit_(layer["conv_state"], mixed, num)
            q, k, v = (t.reshape(B, a, -1, K) for t in conv.split(H * K, -1))
            gates = (x @ layer["ab"].T).float()
            g, beta = -torch.nn.functional.softplus(gates[..., :HV]), gates[..., HV:].sigmoid()
            o, final = fused_recurrent(q=q, k=k, v=v, g=g, beta=beta, scale=SCALE, initial_state=layer["state"],
                                       output_final_state=True, use_qk_l2norm_in_kernel=True)
            layer["state"].copy_(final)
            o = rms(o.reshape(B, a, -1)) * torch.nn.functional.silu(x @ layer["gate"].T)
            h = h + o @ layer["out"].T
            up, gate = (rms(h) @ layer["mlp_in"].T).chunk(2, -1)
            h = h + (torch.nn.functional.silu(gate) * up) @ layer["mlp_out"].T
        return h

    def factor_commit(self, records: list, conv_inputs: list[torch.Tensor], num: torch.Tensor) -> None:
        """Apply the accepted tokens' records to every layer's state and conv state."""
        from specla_compile.kernels import triton_conv, triton_verify

        for layer, rec, x in zip(self.layers, records, conv_inputs):
            triton_verify.commit_(layer["state"], rec.k, rec.v, rec.g, rec.beta, num)
            triton_conv.conv_state_commit_(layer["conv_state"], x, num)


def bench_state_management() -> list[dict]:
    stack = LayerStack()
    out = []
    gen = torch.Generator(device="cuda").manual_seed(1)
    for a in ACCEPTED:
        h = torch.randn(B, a, HIDDEN, generator=gen, device="cuda").bfloat16()
        layer_sets = make_sets(a, [layer["state"] for layer in stack.layers] * 2, seed=a)[:LAYERS]
        records = records_for(layer_sets, a)
        conv_inputs = [torch.randn(B, a, 3 * H * K, generator=gen, device="cuda").bfloat16() for _ in range(LAYERS)]
        num = torch.full((B,), a, device="cuda")
        replay = time_graph(lambda i: stack.replay(h), calls=1)
        commit = time_graph(lambda i: stack.factor_commit(records, conv_inputs, num), calls=1)
        row = {"accepted": a, "token_replay_us": replay["median_us"], "factor_commit_us": commit["median_us"],
               "ratio": replay["median_us"] / commit["median_us"]}
        print(f"    A={a}: replay {row['token_replay_us']:.1f} us, factor commit {row['factor_commit_us']:.1f} us, "
              f"x{row['ratio']:.1f}", flush=True)
        out.append(row)
    return out


def bench_fused(states: list[torch.Tensor], topologies: dict[str, tuple[list[int], str]]) -> list[dict]:
    from specla_compile.kernels import triton_verify

    out = []
    for name, (plist, route) in topologies.items():
        parents = torch.tensor([plist], device="cuda")
        sets = make_sets(len(plist), states, seed=7)
        run = ours(route, parents)
        for a in ACCEPTED:
            pend = records_for(sets, a)

            def separate(i):
                p = pend[i]
                triton_verify.commit_(sets[i]["state"], p.k, p.v, p.g, p.beta, p.num)
                return run(sets[i])

            fused = time_graph(lambda i: run(sets[i], p=pend[i]))["median_us"]
            sep = time_graph(separate)["median_us"]
            out.append({"topology": name, "route": route, "accepted": a, "fused_us": fused, "separate_us": sep,
                        "ratio": sep / fused, "fused_GBps": verify_bytes(len(plist), state_writes=1, pending=a) / fused / 1e3})
            print(f"    {name} {route} A={a}: fused {fused:.2f} us, separate {sep:.2f} us, x{sep / fused:.2f}", flush=True)
    return out


def bench_sweep(states: list[torch.Tensor]) -> list[dict]:
    from specla_compile.kernels.dispatch import KernelConfig

    shapes = {"node1": chain_parents(1), "chain8": chain_parents(8), "chain9": chain_parents(9),
              "tree_2_4_16": beam_tree(2, 4, 16), "tree_2_24_32": beam_tree(2, 24, 32),
              "tree_4_4_32": beam_tree(4, 4, 32)}
    configs = {
        "serial": [KernelConfig(8, 1), KernelConfig(8, 2), KernelConfig(16, 2), KernelConfig(16, 4), KernelConfig(4, 1),
                   KernelConfig(16, 1), KernelConfig(32, 1), KernelConfig(32, 2), KernelConfig(64, 4)],
        "serial+pending": [KernelConfig(8, 1), KernelConfig(4, 1), KernelConfig(16, 1), KernelConfig(16, 2), KernelConfig(32, 2)],
        "hybrid": [KernelConfig(8, 1), KernelConfig(8, 2), KernelConfig(16, 4)],
        "parallel": [KernelConfig(64, 4, 32), KernelConfig(32, 4, 64), KernelConfig(64, 8, 32), KernelConfig(128, 4, 32),
                     KernelConfig(128, 8, 32)],
        "parallel+pending": [KernelConfig(32, 4, 64), KernelConfig(64, 4, 32), KernelConfig(16, 4, 64),
                             KernelConfig(16, 2, 64), KernelConfig(16, 2, 32)],
    }
    out = []
    for shape, plist in shapes.items():
        parents = torch.tensor([plist], device="cuda")
        sets = make_sets(len(plist), states, seed=3)
        pend = records_for(sets, min(4, len(plist)))
        for route, cfgs in configs.items():
            for cfg in cfgs:
                run = ours(route.split("+")[0], parents, config=cfg)
                with_pending = route.endswith("+pending")
                t = time_graph(lambda i: run(sets[i], p=pend[i] if with_pending else None))["median_us"]
                out.append({"shape": shape, "route": route, "block_v": cfg.block_v, "num_warps": cfg.num_warps,
                            "block_k": cfg.block_k, "median_us": t})
                print(f"    {shape} {route} {cfg}: {t:.2f} us", flush=True)
    return out


def fit_cost_model(results: dict) -> dict[str, list[float]]:
    """Least-squares coefficients of dispatch.CostModel from the chain and tree timings."""
    import numpy as np

    from specla_compile.kernels.dispatch import ROUTES, TopologyHint, route_features

    rows = [(TopologyHint.from_parents(torch.tensor([r["parents"]])), r["routes"]) for r in results["chains"] + results["trees"]]
    fits = {}
    for route in ROUTES:
        x = np.array([route_features(route, hint) for hint, _ in rows])
        y = np.array([times[f"ours_{route}"]["median_us"] for _, times in rows])
        ok = np.isfinite(y)
        fits[route] = [round(float(c), 3) for c in np.linalg.lstsq(x[ok], y[ok], rcond=None)[0]]
    return fits


# --- report ---------------------------------------------------------------------------------------


def targets(results: dict) -> list[dict]:
    out = []
    l8 = next(c for c in results["chains"] if c["L"] == 8)["routes"]
    fused = min(l8["ours_fused_serial"]["median_us"], l8["ours_fused_parallel"]["median_us"])
    fla_best = min(l8["fla_recurrent_chain"]["median_us"], l8["fla_recurrent_chain_no_state"]["median_us"])
    out.append({"name": "chain L=8: ours fused (commit + verify + records) / fla fused_recurrent over the chain",
                "value": fused / fla_best, "target": "<= 0.333", "met": fused / fla_best <= 1 / 3})
    for t in results["trees"]:
        best = t["speedup_best"]
        out.append({"name": f"tree top-{t['topk']} depth {t['depth']} {t['nodes']} nodes: replay / ours (best route)",
                    "value": best, "target": f">= {2 * t['paper_ratio']:.2f}", "met": best >= 2 * t["paper_ratio"]})
    worst = min(r["ratio"] for r in results["state_management"])
    out.append({"name": "factor commit vs token replay (24 layers), worst over A=1..8", "value": worst,
                "target": ">= 5", "met": worst >= 5})
    worst = min(r["ratio"] for r in results["fused_vs_separate"])
    out.append({"name": "fused commit-and-verify vs separate, worst over A=1..8", "value": worst, "target": ">= 1.5",
                "met": worst >= 1.5})
    return out


def markdown(results: dict) -> str:
    lines = [f"# Kernel benchmarks ({results['env']['device']})", "",
             f"torch {results['env']['torch']}, triton {results['env']['triton']}, fla {results['env']['fla']}. "
             f"B={B}, H=HV={HV}, K=V={K}, bf16 inputs, fp32 state; CUDA graphs, median of {REPLAYS} replays of "
             f"{SETS} calls on distinct buffers. Copy bandwidth (read+write): {results['copy_GBps']:.0f} GB/s.", "",
             "## Targets", "", "| target | measured | goal | met |", "| --- | --- | --- | --- |"]
    lines += [f"| {t['name']} | {t['value']:.3f} | {t['target']} | {'yes' if t['met'] else 'no'} |" for t in results["targets"]]
    routes = [r for r in results["chains"][0]["routes"] if r != "fused_pending"]
    lines += ["", "## Chains (us per layer call)", "", "| L | " + " | ".join(routes) + " |",
              "| --- " * (len(routes) + 1) + "|"]
    for c in results["chains"]:
        lines.append(f"| {c['L']} | " + " | ".join(f"{c['routes'][r]['median_us']:.2f}" for r in routes) + " |")
    lines += ["", "Fused routes commit L//2 pending records first.", "", "## Table 1 trees (us per layer call)", "",
              "| top-k | depth | nodes | leaves | height | replay per leaf | replay varlen | serial | parallel | hybrid | "
              "replay/hybrid | replay/best | paper | goal |", "| --- " * 14 + "|"]
    for t in results["trees"]:
        r = t["routes"]
        lines.append(f"| {t['topk']} | {t['depth']} | {t['nodes']} | {t['leaves']} | {t['height']} | "
                     + " | ".join(f"{r[x]['median_us']:.2f}" for x in ("replay_per_leaf", "replay_batched_varlen",
                                                                          "ours_serial", "ours_parallel", "ours_hybrid"))
                     + f" | {t['speedup_hybrid']:.2f} | {t['speedup_best']:.2f} | {t['paper_ratio']:.2f} | "
                     f"{2 * t['paper_ratio']:.2f} |")
    lines += ["", "## State management over 24 layers (us)", "", "| accepted | token replay | factor commit | ratio |",
              "| --- | --- | --- | --- |"]
    lines += [f"| {r['accepted']} | {r['token_replay_us']:.1f} | {r['factor_commit_us']:.1f} | {r['ratio']:.1f} |"
              for r in results["state_management"]]
    lines += ["", "## Fused commit-and-verify vs separate (us per layer call)", "",
              "| topology | route | accepted | fused | separate | ratio | fused GB/s |", "| --- " * 7 + "|"]
    lines += [f"| {r['topology']} | {r['route']} | {r['accepted']} | {r['fused_us']:.2f} | {r['separate_us']:.2f} | "
              f"{r['ratio']:.2f} | {r['fused_GBps']:.0f} |" for r in results["fused_vs_separate"]]
    lines += ["", "## Achieved bandwidth of our kernels (fewest bytes / time)", "",
              "| topology | route | us | bytes | GB/s | of copy | programs |", "| --- " * 7 + "|"]
    for c in results["chains"] + results["trees"]:
        name = f"chain {c['L']}" if "L" in c else f"tree {c['topk']}/{c['depth']}/{c['nodes']}"
        for r, t in c["routes"].items():
            if "GBps" in t:
                lines.append(f"| {name} | {r} | {t['median_us']:.2f} | {t['bytes']} | {t['GBps']:.0f} | "
                             f"{t['of_copy_bw']:.1%} | {t.get('programs', '')} |")
    if results.get("sweep"):
        lines += ["", "## Launch-shape sweep (us)", "", "| shape | route | block_v | warps | block_k | us |",
                  "| --- " * 6 + "|"]
        lines += [f"| {s['shape']} | {s['route']} | {s['block_v']} | {s['num_warps']} | {s['block_k']} | "
                  f"{s['median_us']:.2f} |" for s in results["sweep"]]
    lines += ["", f"Cost model fit (dispatch.CostModel): {results['cost_model']}", ""]
    return "\n".join(lines)


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(2, 2, figsize=(13, 9))
    chains = results["chains"]
    for r in [r for r in chains[0]["routes"] if r != "fused_pending"]:
        ax[0, 0].plot([c["L"] for c in chains], [c["routes"][r]["median_us"] for c in chains], marker="o", label=r)
    ax[0, 0].set(xlabel="chain length L", ylabel="us per layer call", yscale="log", title="Chains")
    ax[0, 0].legend(fontsize=7)
    trees = results["trees"]
    names = [f"k{t['topk']} d{t['depth']} n{t['nodes']}" for t in trees]
    xs = range(len(trees))
    for off, key, label in ((-0.3, "paper_ratio", "paper (hybrid/replay)"), (-0.1, "speedup_hybrid", "ours hybrid"),
                            (0.1, "speedup_best", "ours best route")):
        ax[0, 1].bar([x + off for x in xs], [t[key] for t in trees], width=0.2, label=label)
    ax[0, 1].plot(list(xs), [2 * t["paper_ratio"] for t in trees], "k_", markersize=20, label="goal (2x paper)")
    ax[0, 1].set(xticks=list(xs), ylabel="speedup over root-to-leaf replay", title="Table 1 trees")
    ax[0, 1].set_xticklabels(names, fontsize=7)
    ax[0, 1].legend(fontsize=7)
    sm = results["state_management"]
    ax[1, 0].plot([r["accepted"] for r in sm], [r["token_replay_us"] for r in sm], marker="o", label="token replay")
    ax[1, 0].plot([r["accepted"] for r in sm], [r["factor_commit_us"] for r in sm], marker="o", label="factor commit")
    ax[1, 0].set(xlabel="accepted tokens", ylabel="us (24 layers)", yscale="log", title="State management")
    ax[1, 0].legend(fontsize=7)
    for topo in sorted({r["topology"] for r in results["fused_vs_separate"]}):
        rows = [r for r in results["fused_vs_separate"] if r["topology"] == topo]
        ax[1, 1].plot([r["accepted"] for r in rows], [r["ratio"] for r in rows], marker="o", label=f"{topo} ({rows[0]['route']})")
    ax[1, 1].axhline(1.5, color="k", linestyle="--", label="goal")
    ax[1, 1].set(xlabel="accepted (pending) tokens", ylabel="separate / fused", title="Fused commit-and-verify")
    ax[1, 1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


RESULTS: dict = {}
SECTIONS = ("chains", "trees", "state_management", "fused_vs_separate", "sweep")


def run_section(name: str, states: list[torch.Tensor]) -> None:
    print(name, flush=True)
    if name == "chains":
        RESULTS["chains"] = [{"L": n, "parents": chain_parents(n),
                              "routes": bench_topology(chain_parents(n), states, n, chain=True)} for n in CHAIN_LENGTHS]
    elif name == "trees":
        RESULTS["trees"] = []
        for topk, depth, nodes, paper in TABLE1:
            print(f"  top-{topk} depth {depth} nodes {nodes}", flush=True)
            plist = beam_tree(topk, depth, nodes)
            r = bench_topology(plist, states, nodes + depth, chain=False)
            replay = r["replay_per_leaf"]["median_us"]
            best = min(r[f"ours_{x}"]["median_us"] for x in ("serial", "parallel", "hybrid"))
            RESULTS["trees"].append({"topk": topk, "depth": depth, "nodes": nodes, "paper_ratio": paper, "parents": plist,
                                     "leaves": len(leaves_and_paths(plist)), "height": height(plist), "routes": r,
                                     "speedup_hybrid": replay / r["ours_hybrid"]["median_us"], "speedup_best": replay / best})
    elif name == "state_management":
        RESULTS["state_management"] = bench_state_management()
    elif name == "fused_vs_separate":
        best_route = lambda r: min(("serial", "parallel", "hybrid"), key=lambda x: r[f"ours_{x}"]["median_us"])
        l8 = next(c for c in RESULTS["chains"] if c["L"] == 8)["routes"]
        RESULTS["fused_vs_separate"] = bench_fused(states, {
            "chain8": (chain_parents(8), best_route(l8)),
            "tree_2_4_16": (beam_tree(2, 4, 16), best_route(RESULTS["trees"][0]["routes"]))})
    elif name == "sweep":
        RESULTS["sweep"] = bench_sweep(states)


def write(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    if all(k in RESULTS for k in SECTIONS[:4]):
        RESULTS["cost_model"] = fit_cost_model(RESULTS)
        RESULTS["targets"] = targets(RESULTS)
        (out / "bench_kernels.md").write_text(markdown(RESULTS))
    (out / "bench_kernels.json").write_text(json.dumps(RESULTS, indent=1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    parser.add_argument("--sections", nargs="+", choices=SECTIONS, default=SECTIONS[:4],
                        help="what to measure (the sweep is opt-in)")
    parser.add_argument("--merge", type=Path, help="start from an earlier results JSON and replace only --sections")
    parser.add_argument("--plot-only", type=Path, help="re-render markdown and plot from a results JSON")
    args = parser.parse_args()
    if args.plot_only:
        results = json.loads(args.plot_only.read_text())
        args.plot_only.with_suffix(".md").write_text(markdown(results))
        plot(results, args.plot_only.with_suffix(".png"))
        return
    warnings.filterwarnings("ignore")
    import triton

    if args.merge:
        RESULTS.update(json.loads(args.merge.read_text()))
    try:
        from importlib.metadata import version
        fla_version = version("flash-linear-attention")
    except Exception:  # noqa: BLE001 (reported, not fatal)
        fla_version = "unknown"
    RESULTS["env"] = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
                      "fla": fla_version, "sms": torch.cuda.get_device_properties(0).multi_processor_count}
    RESULTS["copy_GBps"] = copy_bandwidth()
    print(f"copy bandwidth {RESULTS['copy_GBps']:.0f} GB/s", flush=True)
    gen = torch.Generator(device="cuda").manual_seed(0)
    states = [torch.randn(B, HV, K, V, generator=gen, device="cuda") * 0.1 for _ in range(SETS)]
    with torch.inference_mode():
        for name in args.sections:
            run_section(name, states)
            write(args.out)  # partial results survive a run cut short
    try:
        plot(RESULTS, args.out / "bench_kernels.png")
    except ImportError as e:  # no matplotlib: plot later with --plot-only
        print(f"no plot: {e}", file=sys.stderr)
    print((args.out / "bench_kernels.md").read_text() if "targets" in RESULTS else json.dumps(RESULTS)[:4000])


if __name__ == "__main__":
    main()
