"""What an EAGLE propose costs on the GPU, at the trained study's shape (random weights: the cost does
not depend on them): time per propose with and without its CUDA graph, the graph's replay alone, the
host's share, and the captured graph's kernels by kind.

    python benchmarks/eagle_profile.py --out DIR     # writes DIR/eagle_profile.json and prints a table
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from e2e_gpu import kernel_profile

from specla_compile.runtime.config import SpecConfig
from specla_compile.runtime.drafters import EagleConfig, EagleDrafter, EagleHead
from specla_compile.runtime.drafting import DraftRequest

CONFIGS = {  # the routes of benchmarks/e2e_trained.py
    "chain_L8": SpecConfig(mode="chain", depth=8, bucket=16),
    "tree_k4_d6_n16": SpecConfig(mode="tree", depth=6, tree_top_k=4, budget=15, bucket=16),
}


def stub_target(hidden: int, vocab: int, dtype: torch.dtype) -> torch.nn.Module:
    """What the drafter reads of its target: input embeddings and LM head (a one-layer Llama)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=hidden, num_hidden_layers=1,
                         num_attention_heads=8, num_key_value_heads=8)
    return LlamaForCausalLM(config).to("cuda", dtype).eval()


def run(drafter: EagleDrafter, config: SpecConfig, prompt: int, iterations: int, hidden: int) -> dict:
    """Propose/commit ``iterations`` times (three tokens accepted each time); seconds per propose."""
    gen = torch.Generator().manual_seed(0)
    seq = torch.randint(0, drafter.vocab_size, (prompt,), generator=gen)
    drafter.begin([seq[:-1]], [torch.randn(prompt - 1, hidden, device="cuda", dtype=torch.bfloat16)])
    times = []
    for i in range(iterations):
        torch.cuda.synchronize()
        started = time.perf_counter()
        draft = drafter.propose(DraftRequest([0], [seq]), config)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - started)
        accepted = draft.tokens[0, 1:3].cpu()
        drafter.commit([0], [torch.cat([seq[-1:], accepted])], [torch.randn(3, hidden, device="cuda", dtype=torch.bfloat16)])
        seq = torch.cat([seq, accepted, torch.randint(0, drafter.vocab_size, (1,), generator=gen)])
    steady = sorted(times[3:])
    return {"ms_per_propose": 1000 * steady[len(steady) // 2], "first_ms": 1000 * times[0]}


def replay_ms(graph, replays: int = 50) -> float:
    graph.replay()
    torch.cuda.synchronize()
    started = time.perf_counter()
    for _ in range(replays):
        graph.replay()
    torch.cuda.synchronize()
    return 1000 * (time.perf_counter() - started) / replays


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--intermediate", type=int, default=4096)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--prompt", type=int, default=200)
    p.add_argument("--iterations", type=int, default=30)
    args = p.parse_args()
    if not torch.cuda.is_available():
        sys.exit("error: eagle_profile.py needs a CUDA GPU")
    os.makedirs(args.out, exist_ok=True)
    target = stub_target(args.hidden, args.vocab, torch.bfloat16)
    torch.manual_seed(0)
    head = EagleHead(EagleConfig(args.hidden, args.vocab, args.heads, args.intermediate)).to("cuda", torch.bfloat16)
    results = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "shape": vars(args), "routes": {}}
    for name, config in CONFIGS.items():
        route = results["routes"][name] = {}
        for mode, static in (("graphed", None), ("uncaptured", False)):
            drafter = EagleDrafter(head, target, static_shapes=static)
            route[mode] = run(drafter, config, args.prompt, args.iterations, args.hidden)
            if mode == "graphed":
                graph = next(iter(drafter._graphs.values())).graph
                route["replay_ms"] = replay_ms(graph)
                profile = kernel_profile(graph)
                route["profile"] = {k: v for k, v in profile.items() if k != "one_layer"}
        route["host_ms"] = route["graphed"]["ms_per_propose"] - route["replay_ms"]
        print(f"{name}: graphed {route['graphed']['ms_per_propose']:.3f} ms per propose (replay {route['replay_ms']:.3f}, "
              f"{route['profile']['kernels_per_pass']:.0f} kernels, busy {route['profile']['busy_ms']:.3f}), "
              f"uncaptured {route['uncaptured']['ms_per_propose']:.3f} ms", flush=True)
        print(json.dumps(route["profile"], indent=1), flush=True)
    with open(os.path.join(args.out, "eagle_profile.json"), "w") as f:
        json.dump(results, f, indent=1)
    write_markdown(results, args.out)


def write_markdown(results: dict, out_dir: str) -> None:
    """``eagle_profile.md``: per route, a propose's time graphed and uncaptured, and the graph's kernels."""
    shape = results["shape"]
    setup = (f"device: {results.get('device')}, torch {results.get('torch')}, head and LM head at hidden {shape['hidden']}, "
             f"vocabulary {shape['vocab']}, bf16, B=1, {shape['prompt']}-token prompt")
    lines = ["# EAGLE propose on the GPU", "", setup, "",
             "| route | graphed, ms per propose | its replay, ms | host, ms | kernels | GPU busy, ms | GEMM, ms | uncaptured, ms |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for name, r in results["routes"].items():
        p = r["profile"]
        lines.append(f"| {name} | {r['graphed']['ms_per_propose']:.3f} | {r['replay_ms']:.3f} | {r['host_ms']:.3f} | "
                     f"{p['kernels_per_pass']:.0f} | {p['busy_ms']:.3f} | {p['by_kind_ms'].get('gemm', 0):.3f} | "
                     f"{r['uncaptured']['ms_per_propose']:.3f} |")
    lines += [f"- {note}" for note in results.get("notes", [])]
    with open(os.path.join(out_dir, "eagle_profile.md"), "w") as f:
        f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
