"""Time to the first speculative pass on CPU: a cold process, then a second process on the same
inductor cache (the warm start users pay on every restart). A tiny fla model of ``--layers`` layers,
its 1-node pass (plain decoding) and its 16-node pass (chains of 15 drafts), compiled by the
generator with ``--inner``, each twin as one graph and then one decoder layer at a time (the backend's
``regional`` option); each process reports its compile seconds, how many graphs Dynamo traced, the
caches' hits and its tokens (the two ways must agree). Writes ``compile_start_cpu.{json,md}``::

    python benchmarks/compile_start_cpu.py --out benchmarks/results
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
WAYS = {"whole graph": False, "by layer": True}  # the backend's regional option


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--inner", choices=("inductor", "aot_eager"), default="inductor")
    parser.add_argument("--regional", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.layers < 1:
        parser.error("--layers must be at least 1")
    return args


def child(args: argparse.Namespace) -> dict:
    """One process: compile and run the 1-node and the 16-node pass; their seconds and the counters."""
    import torch
    from e2e_gpu import OracleDrafter, chain_config, compile_cache_counters
    from models import VOCAB, tiny_model
    from torch._dynamo.utils import counters

    from specla_compile import SpecConfig, SpeculativeGenerator

    model = tiny_model("fla", layers=args.layers)
    prompt = torch.randint(0, VOCAB, (1, 16), generator=torch.Generator().manual_seed(0))
    gen = SpeculativeGenerator(model, OracleDrafter([[0] * 64], 1.0, 1), SpecConfig(bucket=16), compile_options={"inner": args.inner, "regional": args.regional})
    started = time.perf_counter()
    gen.decode(prompt, 2)
    one = time.perf_counter() - started
    gen.drafter, gen.config = OracleDrafter([[0] * 64], 1.0, 15), chain_config(15)
    started = time.perf_counter()
    out = gen.generate(prompt, 2)
    sixteen = time.perf_counter() - started
    return {"1_node_s": one, "16_node_s": sixteen, "total_s": one + sixteen, "tokens": out.sequences.tolist(),
            "dynamo_graphs": counters["stats"]["unique_graphs"], "caches": compile_cache_counters()}


def run_process(args: argparse.Namespace, cache_dir: str, regional: bool) -> dict:
    command = [sys.executable, __file__, "--child", "--layers", str(args.layers), "--inner", args.inner]
    command += ["--regional"] if regional else []
    out = subprocess.run(command, capture_output=True, text=True, env={**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache_dir},
                         timeout=1800, check=False)
    lines = [line for line in out.stdout.splitlines() if line.startswith("{")]
    if out.returncode != 0 or not lines:
        raise RuntimeError(f"the timed process failed:\n{out.stderr[-3000:]}")
    return json.loads(lines[-1])


def write_report(results: dict, out_dir: str) -> None:
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "compile_start_cpu.json"), "w") as f:
        json.dump(results, f, indent=1)
    setup = (f"{results['layers']}-layer tiny fla model, inner compiler `{results['inner']}`, torch {results['torch']}, "
             "the 1-node and the 16-node pass; the second process reuses the first one's inductor cache. "
             f"Both ways emit the same tokens: {results['same_tokens']}.")
    lines = ["# Compile time to the first speculative passes, CPU", "", setup, "",
             "| twins compiled | process | 1-node pass, s | 16-node pass, s | total, s | Dynamo graphs | cache counters |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    lines += [f"| {way} | {name} | {r['1_node_s']:.1f} | {r['16_node_s']:.1f} | {r['total_s']:.1f} | {r['dynamo_graphs']} | {r['caches']} |"
              for way in WAYS for name, r in results[way].items()]
    with open(os.path.join(out_dir, "compile_start_cpu.md"), "w") as f:
        f.write("\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.child:
        print(json.dumps(child(args)), flush=True)
        return
    import torch

    results = {"layers": args.layers, "inner": args.inner, "torch": torch.__version__}
    for way, regional in WAYS.items():
        results[way] = {}
        with tempfile.TemporaryDirectory() as cache_dir:
            for name in ("cold", "warm"):
                print(f"{name} process, {way}: compiling the 1- and 16-node passes of a {args.layers}-layer model ...", flush=True)
                results[way][name] = run_process(args, cache_dir, regional)
                print(f"{name}: {results[way][name]['total_s']:.1f} s", flush=True)
    results["same_tokens"] = len({str(r["tokens"]) for way in WAYS for r in results[way].values()}) == 1
    write_report(results, args.out)
    with open(os.path.join(args.out, "compile_start_cpu.md")) as f:
        print(f.read())


if __name__ == "__main__":
    main()
