"""The verify recurrence at batch 1, 4, 8 and 16 on one GPU: every route and launch shape, fused commit or not.

``e2e_gpu.py``'s B=16 profile puts half of a 16-node pass in ``_parallel_kernel`` (2.5 of 4.8 ms, 104 us a
layer, against a state-traffic floor near 16 us), at the launch shape chosen at B=1. This sweep times each
candidate over a 24-layer stack of distinct buffers (one CUDA graph, as in a pass: no state is found in
L2) with the pending records of a p=0.8 step (1-8 accepted per row), so that ``dispatch.kernel_config``
can pick by batch from a measurement.

    python benchmarks/batch_verify_gpu.py --out benchmarks/results

Writes ``batch_verify_gpu.json`` and ``batch_verify_gpu.md`` and prints the table.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
from collections.abc import Callable
from pathlib import Path

import torch

from specla_compile.kernels import triton_verify
from specla_compile.kernels.dispatch import KernelConfig, choose_route, kernel_config

H, HV, K, V, LAYERS = 8, 8, 256, 256, 24
BATCHES, NODES = (1, 4, 8, 16), (1, 9, 16)
REPLAYS = 20


def layer_inputs(batch: int, nodes: int, gen: torch.Generator) -> dict:
    """One layer's verify inputs at random values: a chain draft and the pending records of the last step."""
    dev = gen.device

    def rand(*shape, dtype=torch.bfloat16):
        return torch.randn(*shape, generator=gen, device=dev).to(dtype)

    pending = triton_verify.Pending(
        torch.nn.functional.normalize(rand(batch, nodes, H, K, dtype=torch.float32), dim=-1),
        rand(batch, nodes, HV, V, dtype=torch.float32),
        -torch.rand(batch, nodes, HV, generator=gen, device=dev) * 0.1,
        torch.rand(batch, nodes, HV, generator=gen, device=dev),
        torch.randint(1, 9, (batch,), generator=gen, device=dev),
    )
    return dict(
        q=rand(batch, nodes, H, K), k=rand(batch, nodes, H, K), v=rand(batch, nodes, HV, V),
        g=-torch.rand(batch, nodes, HV, generator=gen, device=dev) * 0.1,
        beta=torch.rand(batch, nodes, HV, generator=gen, device=dev),
        parents=torch.arange(-1, nodes - 1, device=dev).expand(batch, nodes).contiguous(),
        state=torch.randn(batch, HV, K, V, generator=gen, device=dev) * 0.05, pending=pending,
    )


def fused(route: str, config: KernelConfig) -> Callable[[dict], None]:
    def call(x: dict) -> None:
        triton_verify.tree_verify(x["q"], x["k"], x["v"], x["g"], x["beta"], x["parents"], x["state"], K**-0.5, True,
                                  route=route, pending=x["pending"], config=config)
    return call


def commit_only(config: KernelConfig) -> Callable[[dict], None]:
    def call(x: dict) -> None:
        p = x["pending"]
        triton_verify.commit_(x["state"], p.k, p.v, p.g, p.beta, p.num, config=config)
    return call


def verify_only(config: KernelConfig) -> Callable[[dict], None]:
    def call(x: dict) -> None:
        triton_verify.tree_verify(x["q"], x["k"], x["v"], x["g"], x["beta"], x["parents"], x["state"], K**-0.5, True,
                                  route="parallel", config=config)
    return call


def split(commit: KernelConfig, verify: KernelConfig) -> Callable[[dict], None]:
    """The commit as its own launch, then a parallel verify with no records (free to take wide V tiles)."""
    first, then = commit_only(commit), verify_only(verify)

    def call(x: dict) -> None:
        first(x)
        then(x)
    return call


def dispatch_choice(x: dict) -> None:
    """What a compiled pass launches: the route and shape ``dispatch`` picks for this batch and node count."""
    batch, nodes = x["parents"].shape
    route = choose_route(nodes)
    fused(route, kernel_config(route, nodes, pending=True, batch=batch))(x)


VARIANTS: dict[str, Callable[[dict], None]] = {
    "dispatch's choice": dispatch_choice,
    "serial fused bv8 w1": fused("serial", KernelConfig(8, 1)),
    "serial fused bv16 w2": fused("serial", KernelConfig(16, 2)),
    "serial fused bv32 w4": fused("serial", KernelConfig(32, 4)),
    "parallel fused bv16 w2 bk32 (B=1 choice)": fused("parallel", KernelConfig(16, 2, 32)),
    "parallel fused bv16 w4 bk64": fused("parallel", KernelConfig(16, 4, 64)),
    "parallel fused bv32 w4 bk64": fused("parallel", KernelConfig(32, 4, 64)),
    "parallel fused bv64 w4 bk32": fused("parallel", KernelConfig(64, 4, 32)),
    "parallel fused bv64 w8 bk32": fused("parallel", KernelConfig(64, 8, 32)),
    "parallel fused bv64 w8 bk64": fused("parallel", KernelConfig(64, 8, 64)),
    "split commit bv16 w2 + parallel bv128 w8 bk32": split(KernelConfig(16, 2), KernelConfig(128, 8, 32)),
    "split commit bv32 w4 + parallel bv128 w8 bk32": split(KernelConfig(32, 4), KernelConfig(128, 8, 32)),
    "commit only bv8 w1": commit_only(KernelConfig(8, 1)),
    "commit only bv16 w2": commit_only(KernelConfig(16, 2)),
    "commit only bv32 w4": commit_only(KernelConfig(32, 4)),
    "commit only bv64 w8": commit_only(KernelConfig(64, 8)),
    "verify only bv64 w4 bk32": verify_only(KernelConfig(64, 4, 32)),
    "verify only bv128 w4 bk32": verify_only(KernelConfig(128, 4, 32)),
    "verify only bv128 w8 bk32": verify_only(KernelConfig(128, 8, 32)),
    "verify only bv128 w8 bk64": verify_only(KernelConfig(128, 8, 64)),
    "verify only bv256 w8 bk32": verify_only(KernelConfig(256, 8, 32)),
    "verify only bv256 w16 bk32": verify_only(KernelConfig(256, 16, 32)),
}


def time_stack(variant: Callable[[dict], None], layers: list[dict]) -> float:
    """Microseconds per layer: the stack captured in one CUDA graph, median over replays."""
    for x in layers:  # compile and warm outside the capture
        variant(x)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for x in layers:
            variant(x)
    times = []
    for _ in range(REPLAYS):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000 / len(layers))
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    parser.add_argument("--only", default="", help="time only the variants whose name matches this regular expression")
    args = parser.parse_args()
    variants = {name: v for name, v in VARIANTS.items() if re.search(args.only, name)}
    if not variants:
        parser.error(f"--only {args.only!r} matches no variant")
    if not torch.cuda.is_available():
        parser.error("this benchmark needs a CUDA GPU")
    gen = torch.Generator(device="cuda").manual_seed(0)
    results: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "us_per_layer": {}}
    for batch in BATCHES:
        for nodes in NODES:
            layers = [layer_inputs(batch, nodes, gen) for _ in range(LAYERS)]
            state_mb = batch * HV * K * V * 4 / 1e6
            row = results["us_per_layer"][f"B{batch}_N{nodes}"] = {
                "state_rw_floor_us": 2 * state_mb / 4.2e6 * 1e6}  # read + write at 4.2 TB/s
            for name, variant in variants.items():
                try:
                    row[name] = time_stack(variant, layers)
                except Exception as err:  # a launch shape that does not fit (registers, shared memory)
                    row[name] = f"{type(err).__name__}: {str(err).splitlines()[0][:120]}"
                print(f"B={batch} N={nodes} {name}: {row[name]}", flush=True)
            del layers
            torch.cuda.empty_cache()
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "batch_verify_gpu.json").write_text(json.dumps(results, indent=1))
    keys = list(results["us_per_layer"])
    lines = ["# Verify recurrence by batch (us per layer, 24-layer stack in one CUDA graph)", "",
             f"device: {results['device']}, torch {results['torch']}", "",
             "| variant | " + " | ".join(keys) + " |", "| --- |" + " --- |" * len(keys)]
    for name in ["state_rw_floor_us", *variants]:
        cells = [results["us_per_layer"][k][name] for k in keys]
        lines.append(f"| {name} | " + " | ".join(f"{c:.1f}" if isinstance(c, float) else str(c) for c in cells) + " |")
    (args.out / "batch_verify_gpu.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
