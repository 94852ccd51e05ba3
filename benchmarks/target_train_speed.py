"""How fast the GDN target trains, and what bounds a step: seconds per optimizer step of
``examples/train_target.py``'s ``train_step`` (random tokens, random weights: a step's cost does not depend on
them), by variant of the torch backend's recurrence, next to the forward alone and to the recurrence alone
(``chunked_gdn`` forward and backward at one layer's shapes, times the layers), so that a reader sees whether the
recurrence or the rest of the model bounds the target's training.

    python benchmarks/target_train_speed.py --out DIR                   # the 24-layer target, every variant
    python benchmarks/target_train_speed.py --out DIR --num-layers 8 --no-gradient-checkpointing

Variants (``--variants``): ``chunks_compiled`` (train_target's default on CUDA: the chunk-parallel part compiled by
inductor, the pass over chunks with its backward written out), ``autograd_scan`` (``--gdn-scan autograd``: autograd
through that pass), ``scan_compiled`` (``--gdn-scan compiled``: the pass over chunks compiled too),
``chunk_128`` (``--gdn-chunk 128``: half the sequential steps, twice the triangular solve; on an H100 one layer's
recurrence 24.2 ms, 27.8 with autograd through the pass, the 24-layer step about 1.27 s), ``chunk_256``
(inductor's split scan failed to compile its cumsum on an H100), ``inverse`` (``--gdn-triangular inverse``: each
chunk's triangular system by its inverse in small matmuls, no batched triangular solve), ``chunk_128_inverse``,
``chunk_128_autograd``, ``chunk_128_scan``; each with
``--gradient-checkpointing`` unless ``--no-gradient-checkpointing`` (a 24-layer target at the default width needs it
on an H100: without it, batch 8 ran out of 80 GB). ``--profile`` adds, for the
first variant, the kernels that take most of a step's GPU time (``torch.profiler``; with ``--recurrence-only``, of
one layer's recurrence), their busy time beside the wall time. Writes
``DIR/target_train_speed.{json,md}`` and prints the table; a variant that fails (out of memory) is reported as
such and the others go on, as does one that fails to compile.

``--recurrence-only`` times one layer's recurrence (forward and backward) per variant instead of whole steps, and
compares its output and gradients with the first variant's: seconds where a 24-layer step's compilation takes
minutes. ``--pick-within TOL`` then writes ``DIR/fastest_options.txt``, the train_target options of the fastest
variant whose difference is within TOL, so that one GPU call can measure and train with the winner::

    python benchmarks/target_train_speed.py --out runs/speed --recurrence-only --pick-within 1e-2
    python examples/train_target.py --out runs/target --num-layers 24 $(cat runs/speed/fastest_options.txt)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch
from fla.models import GatedDeltaNetForCausalLM

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))
sys.path.insert(0, str(ROOT / "benchmarks"))
import train_target  # noqa: E402
from e2e_gpu import timed  # noqa: E402
from eagle_profile import median_call  # noqa: E402

from specla_compile.training.chunked_gdn import chunked_gdn  # noqa: E402

VARIANTS = {  # train_target options of each variant, over its defaults
    "chunks_compiled": [],
    "autograd_scan": ["--gdn-scan", "autograd"],
    "scan_compiled": ["--gdn-scan", "compiled"],
    "chunk_128": ["--gdn-chunk", "128"],
    "inverse": ["--gdn-triangular", "inverse"],
    "chunk_256": ["--gdn-chunk", "256"],
    "chunk_128_inverse": ["--gdn-chunk", "128", "--gdn-triangular", "inverse"],
    "chunk_128_autograd": ["--gdn-chunk", "128", "--gdn-scan", "autograd"],
    "chunk_128_scan": ["--gdn-chunk", "128", "--gdn-scan", "compiled"],  # (it did not compile within 95 s at
    # chunk 64, each chunk's factors then indexed one by one; 16 chunks now, unbound once)
}
PROFILE_ROWS = 15


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--device", default="cuda")
    p.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=list(VARIANTS))
    p.add_argument("--num-layers", type=int, default=24)
    p.add_argument("--hidden-size", type=int, default=1024)
    p.add_argument("--vocab-size", type=int, default=32000)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--warmup", type=int, default=2, help="untimed steps first, per variant (the first compiles)")
    p.add_argument("--steps", type=int, default=5, help="timed steps per variant")
    p.add_argument("--gradient-checkpointing", action=argparse.BooleanOptionalAction, default=True,
                   help="recompute each layer in the backward pass, in every variant")
    p.add_argument("--profile", action="store_true",
                   help="profile one step (with --recurrence-only: one recurrence) of the first variant")
    p.add_argument("--recurrence-only", action="store_true",
                   help="time only one layer's recurrence (forward and backward) per variant, and compare its output and "
                        "gradients with the first variant's: seconds, not the minutes a step's compilation takes")
    p.add_argument("--pick-within", type=float, default=None, metavar="TOL",
                   help="with --recurrence-only: write the fastest variant within TOL of the first one's output and "
                        "gradients to DIR/fastest_options.txt (its train_target options)")
    args = p.parse_args(argv)
    if args.pick_within is not None and not args.recurrence_only:
        p.error("--pick-within compares the recurrence's outputs: it needs --recurrence-only")
    if min(args.num_layers, args.hidden_size, args.vocab_size, args.batch_size, args.seq_len, args.steps) < 1 or args.warmup < 0:
        p.error("--num-layers, --hidden-size, --vocab-size, --batch-size, --seq-len and --steps must be >= 1, --warmup >= 0")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA GPU here (pass --device cpu for a small-shape check)")
    return args


def step_args(args: argparse.Namespace, variant: str) -> argparse.Namespace:
    """train_target's options for ``variant`` at this benchmark's shape (its corpus options only pass its checks:
    the batches here are random tokens)."""
    return train_target.parse_args([
        "--out", "-", "--sharegpt", "none", "--code-dirs", str(ROOT), "--exclude-prompts", "none", "--device",
        args.device, "--gdn-backend", "torch", "--compile", "--num-layers", str(args.num_layers),
        "--hidden-size", str(args.hidden_size), "--vocab-size", str(args.vocab_size), "--batch-size",
        str(args.batch_size), "--seq-len", str(args.seq_len), *VARIANTS[variant],
        *(["--gradient-checkpointing"] if args.gradient_checkpointing else [])])


def recurrence_run(opts: argparse.Namespace, device: torch.device, repeats: int,
                   profile: bool = False) -> tuple[float, list[torch.Tensor], dict | None, float | None]:
    """One layer's ``chunked_gdn`` forward and backward at the step's shapes: the median seconds of ``repeats``, the
    output and input gradients of one clean call (the same random inputs for every variant), with ``profile``
    the kernels of one call (:func:`top_kernels`), and on CUDA the clean call's peak memory above what was allocated
    before it, GiB (what a variant adds to a step's peak: a layer's recurrence runs alone in its backward)."""
    b, n, h, d = opts.batch_size, opts.seq_len, opts.num_heads, opts.head_dim
    gen = torch.Generator(device=device).manual_seed(0)

    def rand(*shape):
        return torch.randn(*shape, generator=gen, device=device).requires_grad_()

    q, k, v = rand(b, n, h, d), rand(b, n, h, d), rand(b, n, h, d)
    g = (-torch.rand(b, n, h, generator=gen, device=device)).requires_grad_()
    beta = torch.rand(b, n, h, generator=gen, device=device).requires_grad_()
    inputs = (q, k, v, g, beta)

    def once():
        for x in inputs:
            x.grad = None
        o, _ = chunked_gdn(q, k, v, g, beta, use_qk_l2norm=True, chunk_size=opts.gdn_chunk, compile=opts.compile,
                           scan=opts.gdn_scan, triangular=opts.gdn_triangular)
        o.sum().backward()
        return o

    once()  # (compiles)
    seconds = median_call(once, repeats)[1]
    kernels = top_kernels(once, device) if profile else None
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
    tensors = [once().detach(), *(x.grad for x in inputs)]
    peak = (torch.cuda.max_memory_allocated(device) - before) / 2**30 if device.type == "cuda" else None
    return seconds, tensors, kernels, peak


def relative_difference(results: list[torch.Tensor], reference: list[torch.Tensor]) -> float:
    """The largest difference of any output or gradient from the reference's, over that tensor's largest magnitude."""
    return max(((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30)).item()
               for a, b in zip(results, reference))


def top_kernels(call, device: torch.device) -> dict:
    """The kernels (or, on CPU, operators) with most self time in one ``call()``, their share of its total, and that
    total (``busy_s``: GPU busy time on CUDA, to set beside the call's wall time) and kernel count."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CUDA] if device.type == "cuda" else [ProfilerActivity.CPU]
    with profile(activities=activities) as prof:
        call()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    key = "self_device_time_total" if device.type == "cuda" else "self_cpu_time_total"
    events = [e for e in prof.key_averages() if getattr(e, key) > 0]
    total = sum(getattr(e, key) for e in events) or 1.0
    events.sort(key=lambda e: getattr(e, key), reverse=True)
    return {"busy_s": total / 1e6, "kernels": sum(e.count for e in events),
            "top": [{"name": e.key[:90], "ms": getattr(e, key) / 1e3, "calls": e.count, "share": getattr(e, key) / total}
                    for e in events[:PROFILE_ROWS]]}


def measure_variant(args: argparse.Namespace, variant: str, profile: bool) -> dict:
    opts = step_args(args, variant)
    device = torch.device(args.device)
    torch.manual_seed(0)
    model = GatedDeltaNetForCausalLM(train_target.model_config(opts)).to(device).train()
    if opts.gradient_checkpointing:
        train_target.checkpoint_layers(model)
    optimizer, _ = train_target.make_optimizer(model, opts)
    tokens = torch.randint(args.vocab_size, (args.batch_size, args.seq_len + 1), generator=torch.Generator().manual_seed(0))
    batch = tokens.to(device)
    losses = []

    def step():
        loss, _ = train_target.train_step(model, optimizer, batch, opts.grad_clip)
        losses.append(loss.item())

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    with train_target.recurrence(opts):
        first = timed(step)[1]
        for _ in range(args.warmup - 1):
            step()
        seconds = median_call(step, args.steps)[1]
        with torch.no_grad(), train_target.autocast(device):
            model(input_ids=batch[:, :-1])  # (without autograd the compiled parts compile again)
            forward = median_call(lambda: model(input_ids=batch[:, :-1]), args.steps)[1]
        recurrence = args.num_layers * recurrence_run(opts, device, args.steps)[0]
        kernels = None
        if profile:
            kernels = top_kernels(lambda: train_target.train_step(model, optimizer, batch, opts.grad_clip), device)
    tokens_per_step = args.batch_size * args.seq_len
    return {"options": VARIANTS[variant], "first_step_s": first, "s_per_step": seconds,
            "tokens_per_second": tokens_per_step / seconds, "forward_s": forward, "recurrence_s": recurrence,
            "recurrence_share": recurrence / seconds, "first_loss": losses[0], "last_loss": losses[-1],
            "peak_gib": torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None,
            "top_kernels": kernels}


def measure_recurrence(args: argparse.Namespace, variant: str, reference: list[torch.Tensor] | None,
                       profile: bool) -> dict:
    """``--recurrence-only``: one layer's recurrence, timed, and its difference from the reference variant's."""
    opts = step_args(args, variant)
    seconds, tensors, kernels, peak = recurrence_run(opts, torch.device(args.device), args.steps, profile)
    return {"options": VARIANTS[variant], "layer_s": seconds, "recurrence_s": args.num_layers * seconds,
            "peak_gib": peak,
            "difference": 0.0 if reference is None else relative_difference(tensors, reference),
            "top_kernels": kernels, "tensors": tensors}


def measure(args: argparse.Namespace) -> dict:
    """Every variant in turn; the report is written after each (a call cut by its time limit keeps what it measured)."""
    device = torch.device(args.device)
    results = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu", "torch": torch.__version__,
               "command": "python benchmarks/target_train_speed.py " + " ".join(sys.argv[1:]),
               "shape": {k: getattr(args, k) for k in ("num_layers", "hidden_size", "vocab_size", "batch_size", "seq_len",
                                                       "gradient_checkpointing")},
               "recurrence_only": args.recurrence_only, "variants": {}}
    reference = None
    for i, variant in enumerate(args.variants):
        try:
            if args.recurrence_only:
                r = results["variants"][variant] = measure_recurrence(args, variant, reference, args.profile and i == 0)
                tensors = r.pop("tensors")
                reference = tensors if reference is None else reference
            else:
                r = results["variants"][variant] = measure_variant(args, variant, args.profile and i == 0)
        except torch.OutOfMemoryError as e:  # (the others go on: a variant that does not fit is a finding too)
            results["variants"][variant] = {"options": VARIANTS[variant], "error": f"out of memory: {str(e).splitlines()[0]}"}
            print(f"{variant}: out of GPU memory", flush=True)
            continue
        except torch._dynamo.exc.BackendCompilerFailed as e:  # (so is one the compiler fails on: inductor's split
            # scan asserted "Unexpected tiling" on chunk_256's cumsum on the H100)
            inner = getattr(e, "inner_exception", None) or e
            error = f"compilation failed: {type(inner).__name__}: {str(inner).splitlines()[0]}"
            results["variants"][variant] = {"options": VARIANTS[variant], "error": error}
            print(f"{variant}: {results['variants'][variant]['error']}", flush=True)
            continue
        finally:
            if device.type == "cuda":
                torch.cuda.empty_cache()
            if args.pick_within is not None and reference is not None:
                pick_fastest(results, args.pick_within, args.out)
            write_report(results, args.out, echo=False)
        if args.recurrence_only:
            print(f"{variant}: recurrence {1e3 * r['layer_s']:.1f} ms a layer (forward and backward), "
                  f"x{args.num_layers} = {r['recurrence_s']:.3f} s; largest difference from {args.variants[0]}: "
                  f"{r['difference']:.1e}", flush=True)
        else:
            print(f"{variant}: {r['s_per_step']:.3f} s per step ({r['tokens_per_second']:.0f} tokens/s), forward "
                  f"{r['forward_s']:.3f} s, recurrence {r['recurrence_s']:.3f} s ({r['recurrence_share']:.0%}); first step "
                  f"{r['first_step_s']:.1f} s", flush=True)
    return results


def write_report(results: dict, out: str, echo: bool = True) -> None:
    """``target_train_speed.{json,md}`` in ``out``; ``echo``: the table on stdout too."""
    os.makedirs(out, exist_ok=True)
    Path(out, "target_train_speed.json").write_text(json.dumps(results, indent=1))
    s = results["shape"]
    recompute = ", each layer recomputed in the backward pass" if s["gradient_checkpointing"] else ""
    lines = ["# GDN target training speed", "",
             (f"device: {results['device']}, torch {results['torch']}; random {s['num_layers']}-layer target at hidden "
              f"{s['hidden_size']}, vocabulary {s['vocab_size']}; {s['batch_size']} blocks of {s['seq_len']} tokens a step, "
              f"bf16 autocast, fp32 weights, AdamW{recompute}"), f"command: `{results['command']}`", ""]
    if results.get("recurrence_only"):
        first = next(iter(results["variants"]))
        lines += [("| variant | recurrence fwd + bwd, one layer, ms | x layers, s | largest difference of output and "
                   f"gradients from {first}'s | peak memory above the inputs, GiB |"), "| --- | --- | --- | --- | --- |"]
        lines += [f"| {name} | {r['error']} | | | |" if "error" in r else
                  (f"| {name} | {1e3 * r['layer_s']:.1f} | {r['recurrence_s']:.3f} | {r['difference']:.1e} | "
                   f"{'-' if r['peak_gib'] is None else format(r['peak_gib'], '.2f')} |")
                  for name, r in results["variants"].items()]
    else:
        lines += [("| variant | s per step | tokens/s | forward alone, s | recurrence fwd + bwd x layers, s (share of a step) | "
                   "first step, s | peak memory, GiB |"), "| --- | --- | --- | --- | --- | --- | --- |"]
        for name, r in results["variants"].items():
            if "error" in r:
                lines.append(f"| {name} | {r['error']} | | | | | |")
                continue
            peak = "-" if r["peak_gib"] is None else f"{r['peak_gib']:.1f}"
            lines.append(f"| {name} | {r['s_per_step']:.3f} | {r['tokens_per_second']:.0f} | {r['forward_s']:.3f} | "
                         f"{r['recurrence_s']:.3f} ({r['recurrence_share']:.0%}) | {r['first_step_s']:.1f} | {peak} |")
    table_end = len(lines)
    if s["gradient_checkpointing"] and not results.get("recurrence_only"):
        lines += ["", "(With each layer recomputed, a step runs the recurrence's forward twice: its share is a lower bound.)"]
    for name, r in results["variants"].items():
        if r.get("top_kernels"):
            profiled = "one layer's recurrence" if results.get("recurrence_only") else "one step"
            busy = "GPU busy" if results["device"] != "cpu" else "CPU self time"
            wall = r["layer_s"] if results.get("recurrence_only") else r["s_per_step"]
            lines += ["", (f"Most of the {'GPU ' * (results['device'] != 'cpu')}time of {profiled}, {name} ({busy} "
                           f"{1e3 * r['top_kernels']['busy_s']:.1f} ms in {r['top_kernels']['kernels']} kernels, against "
                           f"{1e3 * wall:.1f} ms of wall time):"), "", "| kernel | ms | calls | share |",
                      "| --- | --- | --- | --- |"]
            lines += [f"| `{k['name']}` | {k['ms']:.2f} | {k['calls']} | {k['share']:.1%} |" for k in r["top_kernels"]["top"]]
    Path(out, "target_train_speed.md").write_text("\n".join(lines) + "\n")
    if echo:
        print("\n".join(lines[table_end - 2 - len(results["variants"]):table_end]))


def pick_fastest(results: dict, tolerance: float, out: str) -> None:
    """``results["fastest"]``: the fastest variant measured so far whose output and gradients are within
    ``tolerance`` of the first variant's; its train_target options in ``out/fastest_options.txt`` (rewritten after
    every variant, so that a call cut by its time limit keeps the best it measured)."""
    agreeing = {name: r for name, r in results["variants"].items() if "error" not in r and r["difference"] <= tolerance}
    results["fastest"] = min(agreeing, key=lambda name: agreeing[name]["recurrence_s"])
    os.makedirs(out, exist_ok=True)
    Path(out, "fastest_options.txt").write_text(" ".join(VARIANTS[results["fastest"]]) + "\n")


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    torch.backends.cuda.matmul.allow_tf32 = True  # as train_target.main: the recurrence's fp32 matmuls
    results = measure(args)
    write_report(results, args.out)
    if "fastest" in results:
        print(f"fastest within {args.pick_within:g} of {args.variants[0]}'s output and gradients: {results['fastest']}")
    return results


if __name__ == "__main__":
    main()
