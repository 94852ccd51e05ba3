"""How fast the EAGLE head trains, by ``--head-precision``: milliseconds per optimizer step of
``examples/train_eagle.py``'s ``train_step`` at the trained study's shape (a random target of the config in
``benchmarks/results/trained/report.json``, in bf16 as the pipeline loads it; batches of 16 blocks of 512 tokens;
``--unroll 2``), with and without ``--cache-features`` (the distilled rows' features known: the pipeline's 12 of
16 rows), next to the target's forward alone (the features and logits every step needs), so that a reader sees
what bounds a step. Random weights: a step's cost does not depend on them.

    python benchmarks/eagle_train_speed.py --out DIR     # DIR/eagle_train_speed.{json,md}, a table on stdout
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "examples"))
import train_eagle  # noqa: E402
from eagle_profile import median_call, trained_shape_target  # noqa: E402

from specla_compile.runtime.drafters import EagleConfig, EagleHead  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--device", default="cuda")
    p.add_argument("--precisions", nargs="+", choices=train_eagle.HEAD_PRECISIONS, default=list(train_eagle.HEAD_PRECISIONS))
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--unroll", type=int, default=2)
    p.add_argument("--known-rows", type=int, default=12,
                   help="rows of a batch whose features are cached in the --cache-features variants (the distilled ones)")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first, per precision")
    p.add_argument("--steps", type=int, default=10, help="timed steps per precision")
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--layers", type=int, default=None, help="target layers (default: the trained config's)")
    p.add_argument("--hidden", type=int, default=None, help="target hidden size (default: the trained config's)")
    args = p.parse_args(argv)
    if min(args.batch_size, args.seq_len - 2, args.unroll, args.warmup + 1, args.steps, args.known_rows) < 1:
        p.error("--batch-size, --unroll, --known-rows and --steps must be >= 1, --warmup >= 0 and --seq-len >= 3")
    if args.known_rows > args.batch_size:
        p.error(f"--known-rows {args.known_rows} is more than the batch's {args.batch_size} rows")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA GPU here (pass --device cpu for a small-shape check)")
    return args


def median_ms(step, warmup: int, steps: int) -> float:
    for _ in range(warmup):
        step()
    return 1e3 * median_call(step, steps)[1]


def measure(args: argparse.Namespace) -> dict:
    device = torch.device(args.device)
    overrides = {k: v for k, v in (("num_hidden_layers", args.layers), ("hidden_size", args.hidden)) if v}
    target = trained_shape_target(args.vocab, torch.bfloat16, args.device, **overrides)
    target.requires_grad_(False)
    ids = torch.randint(args.vocab, (args.batch_size, args.seq_len), generator=torch.Generator().manual_seed(0)).to(device)
    step_args = train_eagle.parse_args(["--target", "-", "--out", "-", "--data", "-", "--device", args.device,
                                        "--seq-len", str(args.seq_len), "--unroll", str(args.unroll)])
    results = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu", "torch": torch.__version__,
               "command": "python benchmarks/eagle_train_speed.py " + " ".join(sys.argv[1:]),
               "shape": {"batch_size": args.batch_size, "seq_len": args.seq_len, "unroll": args.unroll,
                         "target_layers": target.config.num_hidden_layers, "hidden": target.config.hidden_size,
                         "vocab": args.vocab, "known_rows": args.known_rows}, "variants": {}}
    with train_eagle.features_backend(step_args), torch.no_grad():
        results["target_forward_ms"] = median_ms(lambda: target(input_ids=ids, output_hidden_states=True),
                                                 args.warmup, args.steps)
    known = train_eagle.block_features(target, ids[args.batch_size - args.known_rows :], step_args)
    for precision, cached in itertools.product(args.precisions, (False, True)):
        step_args.head_precision = precision
        name = precision + (", cached features" if cached else "")
        torch.manual_seed(0)
        head = EagleHead(EagleConfig.for_target(target)).to(device)
        optimizer = train_eagle.head_optimizer(head, step_args.lr)
        losses = []

        def step():
            loss, _ = train_eagle.train_step(head, target, optimizer, ids, step_args, known if cached else None)
            losses.append(loss.item())

        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        with train_eagle.features_backend(step_args):
            ms = median_ms(step, args.warmup, args.steps)
        results["variants"][name] = {"head_precision": precision, "cache_features": cached,
            "ms_per_step": ms, "steps_per_second": 1e3 / ms, "target_share": results["target_forward_ms"] / ms,
            "first_loss": losses[0], "last_loss": losses[-1],
            "peak_gib": torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None}
        print(f"{name}: {ms:.1f} ms per step ({1e3 / ms:.2f} steps/s), the target's forward "
              f"{results['target_forward_ms']:.1f} ms of it; loss {losses[0]:.4f} -> {losses[-1]:.4f}", flush=True)
    return results


def write_report(results: dict, out: str) -> None:
    os.makedirs(out, exist_ok=True)
    Path(out, "eagle_train_speed.json").write_text(json.dumps(results, indent=1))
    s = results["shape"]
    lines = ["# EAGLE head training speed", "",
             f"device: {results['device']}, torch {results['torch']}; random {s['target_layers']}-layer GDN target at hidden "
             f"{s['hidden']} in bf16, vocabulary {s['vocab']}; {s['batch_size']} blocks of {s['seq_len']} tokens a step, "
             f"--unroll {s['unroll']}", f"command: `{results['command']}`", "",
             f"The target's forward alone (features and logits, plain PyTorch as in training): "
             f"{results['target_forward_ms']:.1f} ms", "",
             "| --head-precision, features | ms per step | steps per second | target's forward on every row, over a step | peak memory, GiB |",
             "| --- | --- | --- | --- | --- |"]
    for name, r in results["variants"].items():
        peak = "-" if r["peak_gib"] is None else f"{r['peak_gib']:.1f}"
        lines.append(f"| {name} | {r['ms_per_step']:.1f} | {r['steps_per_second']:.2f} | {r['target_share']:.0%} | {peak} |")
    Path(out, "eagle_train_speed.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines[-2 - len(results["variants"]):]))


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    results = measure(args)
    write_report(results, args.out)
    return results


if __name__ == "__main__":
    main()
