"""Tensor-parallel speculative decoding on 2 GPUs (issue 11): Qwen3.5 at its default (9B) text
configuration, random weights with peaked logits (``e2e_gpu.peaked_logits``), bf16, fp32 states.

Launch on one host with ``torchrun``; every rank runs this script, rank 0 writes the report::

    torchrun --nproc-per-node 2 benchmarks/tp_gpu.py --out benchmarks/results
    torchrun --nproc-per-node 2 benchmarks/tp_gpu.py --sections tp2 plans --layers 8   # a quick look
    python benchmarks/tp_gpu.py --plot benchmarks/results/tp_gpu.json               # markdown from a JSON

The model is saved once as a checkpoint (``--checkpoint-dir``) and loaded the way users load it:
``from_pretrained(dir, tp_plan="auto")`` (transformers' plan: GDN projections gathered) for TP=N, on
rank 0 alone for TP=1. Sections: ``tp1`` plain graphed decoding at TP=1 (the other ranks wait);
``tp2`` plain graphed decoding and oracle-drafted chains (p = 1.0 and 0.8, L = 8; ``e2e_gpu.OracleDrafter``)
at TP=N; ``plans`` one captured 16-node verify pass with the gathered plan and with
:func:`specla_compile.parallel.shard_gdn_heads`; ``exact_fp32`` greedy output at TP=N (both plans,
plain and chains) against TP=1 on a reduced-depth fp32 copy. The JSON and markdown are rewritten
after every measurement, with a ``"targets"`` list (unmeasured: ``measured`` null).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist
from e2e_gpu import (
    OracleDrafter,
    bucket_key,
    chain_config,
    kernel_profile,
    controlled_route,
    make_generator,
    pass_ms,
    peaked_logits,
    prompts_for,
    run_route,
    run_sections,
    targets_markdown,
    truth_of,
)

SECTIONS = ("tp1", "tp2", "plans", "exact_fp32")
PASS_NODES = 16  # the bucket of a chain of 8 drafts (9 nodes with the pending token)
TARGETS = (
    ("greedy output at TP=2 identical to TP=1 (fp32, 16 prompts x 64 tokens)", "100%"),
    ("plain graphed decoding, 9B shape: TP=2 ms/token over TP=1", "<= 0.6"),
    ("oracle chain p=0.8 L=8 at TP=2, over graphed plain decoding at TP=2", ">= 2"),
    ("head-sharded GDN plan over the gathered plan, one verify pass", "< 1 (faster)"),
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("--sections", nargs="+", default=list(SECTIONS), choices=SECTIONS)
    parser.add_argument("--layers", type=int, default=None, help="model depth (default: 32, the 9B configuration)")
    parser.add_argument("--prompts", type=int, default=4, help="prompts per timed route (B=1 each)")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--exact-layers", type=int, default=4, help="depth of the fp32 copy")
    parser.add_argument("--exact-prompts", type=int, default=16)
    parser.add_argument("--exact-tokens", type=int, default=64)
    parser.add_argument("--plan", choices=("gathered", "heads"), default="gathered",
                        help="GDN plan of the tp2 section: transformers' (projections gathered) or head-sharded")
    parser.add_argument("--checkpoint-dir", default="/tmp/specla_tp_gpu", help="where the random checkpoints are saved once")
    parser.add_argument("--plot", metavar="JSON", help="only write the markdown from an earlier JSON (no GPU)")
    args = parser.parse_args(argv)
    if args.layers is not None and (args.layers < 4 or args.layers % 4):
        parser.error("--layers must be a positive multiple of 4 (3 GDN layers to 1 attention layer)")
    if args.exact_layers < 4 or args.exact_layers % 4:
        parser.error("--exact-layers must be a positive multiple of 4")
    return args


# --- report (CPU) ---------------------------------------------------------------------------------


def targets(results: dict) -> list[dict]:
    """The issue's targets from whatever ``results`` holds (``measured`` None for what was not run)."""
    measured: dict[str, tuple] = {}
    exact = results.get("exact_fp32", {})
    if exact:
        same, total = (sum(int(v.split("/")[i]) for v in exact.values()) for i in (0, 1))
        measured[TARGETS[0][0]] = (f"{same}/{total}", same == total)
    tp1, tp2 = results.get("tp1", {}).get("plain"), results.get("tp2", {}).get("plain")
    if tp1 and tp2:
        ratio = tp2["ms_per_token"] / tp1["ms_per_token"]
        measured[TARGETS[1][0]] = (round(ratio, 3), ratio <= 0.6)
    chain = results.get("tp2", {}).get("chain_p0.8_L8")
    if chain:
        measured[TARGETS[2][0]] = (round(chain["speedup"], 2), chain["speedup"] >= 2)
    plans = results.get("plans", {})
    if "gathered_ms" in plans and "heads_ms" in plans:
        ratio = plans["heads_ms"] / plans["gathered_ms"]
        measured[TARGETS[3][0]] = (round(ratio, 3), ratio < 1)
    return [
        {"name": name, "measured": measured[name][0] if name in measured else None, "goal": goal, "met": bool(name in measured and measured[name][1])}
        for name, goal in TARGETS
    ]


def write_report(results: dict, out_dir: str) -> None:
    """``tp_gpu.json`` and ``tp_gpu.md`` under ``out_dir``, from partial results too."""
    results["targets"] = targets(results)
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "tp_gpu.json"), "w") as f:
        json.dump(results, f, indent=1, default=str)
    lines = ["# Tensor-parallel speculative decoding (Qwen3.5, 9B shape, random weights, bf16)", "",
             f"device: {results.get('device')} x {results.get('world')}, torch {results.get('torch')}",
             f"command: `{results.get('command')}`", "", *targets_markdown(results["targets"])]
    rows = [(f"TP={results.get('world')}" if section == "tp2" else "TP=1", key, value)
            for section in ("tp1", "tp2") for key, value in results.get(section, {}).items() if isinstance(value, dict)]
    if rows:
        lines += ["", "| run | route | ms/token | tokens/pass | speedup over plain | identical to plain |", "| --- | --- | --- | --- | --- | --- |"]
        lines += [f"| {tp} | {key} | {r['ms_per_token']:.3f} | {r['tokens_per_pass']:.2f} | {r.get('speedup', 1.0):.2f} | {r.get('identical', '-')} |"
                  for tp, key, r in rows]
    plans = results.get("plans", {})
    if plans:
        lines += ["", f"One captured {PASS_NODES}-node verify pass, ms: " + ", ".join(f"{k[:-3]} plan: {v:.3f}" for k, v in plans.items() if k.endswith("_ms"))]
        lines += [f"- {k.split('_')[0]} plan, rank 0: {p['kernels_per_pass']:.0f} kernels, by kind (ms) {p['by_kind_ms']}"
                  for k, p in plans.items() if k.endswith("_profile")]
    steps = [(f"TP={results.get('world')}, {k.split('_')[0]} plan", v["ms"], v["profile"]) for k, v in plans.items() if k.endswith("_plain_step")]
    if "tp1_profile_1" in results:
        steps.insert(0, ("TP=1", None, results["tp1_profile_1"]))
    if steps:
        lines += ["", "One captured 1-node pass (plain decoding), rank 0's kernels:", "",
                  "| run | replay ms | kernels | busy ms | span ms | by kind (ms) |", "| --- | --- | --- | --- | --- | --- |"]
        lines += [f"| {name} | {'-' if ms is None else f'{ms:.3f}'} | {p['kernels_per_pass']:.0f} | {p['busy_ms']:.3f} | {p['span_ms']:.3f} | {p['by_kind_ms']} |"
                  for name, ms, p in steps]
    if results.get("exact_fp32"):
        lines += ["", f"fp32 greedy output at TP={results.get('world')} against TP=1 (identical / prompts): {results['exact_fp32']}"]
    lines += [""] + [f"- run `{name}`: {how}" for name, how in results.get("runs", {}).items()] if results.get("runs") else []
    lines += [f"- {note}" for note in results.get("notes", [])]
    for name, error in results.get("errors", {}).items():
        lines += ["", f"Section `{name}` failed: `{error.strip().splitlines()[-1]}`"]
    with open(os.path.join(out_dir, "tp_gpu.md"), "w") as f:
        f.write("\n".join(lines) + "\n")


# --- models (GPU) ---------------------------------------------------------------------------------


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def checkpoint(args, dtype: torch.dtype, layers: int | None) -> str:
    """Rank 0 saves a random Qwen3.5 of the default text configuration (``layers`` deep) with peaked
    logits once; every rank gets its directory."""
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    config = Qwen3_5TextConfig()  # the default: 32 layers, 3 GDN layers to 1 attention layer
    if layers is not None:
        config = Qwen3_5TextConfig(num_hidden_layers=layers, layer_types=(["linear_attention"] * 3 + ["full_attention"]) * (layers // 4))
    path = os.path.join(args.checkpoint_dir, f"qwen3_5_{config.num_hidden_layers}l_{str(dtype).split('.')[-1]}")
    if rank() == 0 and not os.path.exists(os.path.join(path, "config.json")):
        torch.manual_seed(0)
        with torch.device("cuda"):
            model = Qwen3_5ForCausalLM(config)
        peaked_logits(model)
        model.to(dtype).save_pretrained(path)
        del model
        free()
    dist.barrier()
    return path


def load(path: str, dtype: torch.dtype, parallel: bool) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    import specla_compile  # noqa: F401  (routes the GDN entry points)

    torch._dynamo.reset()  # every model compiles its own graphs
    if parallel:
        return AutoModelForCausalLM.from_pretrained(path, tp_plan="auto", dtype=dtype).eval()
    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype, device_map=f"cuda:{torch.cuda.current_device()}").eval()


def free() -> None:
    gc.collect()
    torch.cuda.empty_cache()


def on_rank0(fn) -> None:
    """Run ``fn`` on rank 0 while the other ranks wait; if it fails, every rank raises (the ranks stay in step)."""
    error = None
    if rank() == 0:
        try:
            fn()
        except Exception as err:  # re-raised below, after the other ranks know
            error = err
        free()
    failed = torch.tensor([int(error is not None)], device="cuda")
    dist.broadcast(failed, 0)
    if error is not None:
        raise error
    if failed.item():
        raise RuntimeError("rank 0 failed in this section")


def plain_step_profile(gen) -> dict:
    """Kernels of one replay of the captured 1-node (plain decoding) pass, this rank's."""
    bucket = next(iter(gen._engines.values())).buckets[bucket_key(1)]
    bucket.step.zero_()  # the loop's graph logs its token at this step: its replays stay within the log
    return kernel_profile(bucket.graph, trace_path=f"/tmp/specla_tp_trace_plain_{rank()}.json")


def measure_plain(model, args) -> tuple[object, dict, list]:
    prompts = prompts_for(model, 1, args.prompts)
    gen = make_generator(model)
    gen.decode(prompts[0], 4)  # compiles and captures the 1-node pass
    plain = run_route(gen, prompts, args.new_tokens, plain=True)
    return gen, plain, prompts


# --- sections (GPU) -------------------------------------------------------------------------------


def tp1(args, results: dict) -> None:
    """Plain graphed decoding on rank 0 alone (the other ranks wait)."""
    path = checkpoint(args, torch.bfloat16, args.layers)

    def run() -> None:
        model = load(path, torch.bfloat16, parallel=False)
        gen, plain, _ = measure_plain(model, args)
        results["tp1"] = {"plain": {k: v for k, v in plain.items() if k != "sequences"}}
        print(f"TP=1 plain graphed: {plain['ms_per_token']:.3f} ms/token", flush=True)
        results["tp1_profile_1"] = plain_step_profile(gen)

    on_rank0(run)


def tp2(args, results: dict) -> None:
    from specla_compile.parallel import shard_gdn_heads

    model = load(checkpoint(args, torch.bfloat16, args.layers), torch.bfloat16, parallel=True)
    if args.plan == "heads":
        shard_gdn_heads(model)
    results["tp2_plan"] = args.plan
    gen, plain, prompts = measure_plain(model, args)
    section = results.setdefault("tp2", {})
    section["plain"] = {k: v for k, v in plain.items() if k != "sequences"}
    print(f"TP={dist.get_world_size()} plain graphed: {plain['ms_per_token']:.3f} ms/token", flush=True)
    report(results, args)
    truths = truth_of(plain, prompts)
    gen.drafter, gen.config = OracleDrafter(truths[0], 1.0, 8), chain_config(8)
    gen.generate(prompts[0], 2)  # compiles and captures the 16-node pass outside the timed runs
    for p in (1.0, 0.8):
        r = section[f"chain_p{p}_L8"] = controlled_route(gen, prompts, args.new_tokens, plain, truths, p, 8)
        print(f"TP={dist.get_world_size()} chain p={p} L=8: {r['speedup']:.2f}x, {r['tokens_per_pass']:.2f} tokens/pass", flush=True)
        report(results, args)
    del gen, model
    free()


def plans(args, results: dict) -> None:
    """One captured verify pass of a chain of 8 drafts, gathered plan then head-sharded plan."""
    from specla_compile.parallel import shard_gdn_heads

    section = results.setdefault("plans", {})
    path = checkpoint(args, torch.bfloat16, args.layers)
    for plan in ("gathered", "heads"):
        model = load(path, torch.bfloat16, parallel=True)
        if plan == "heads":
            shard_gdn_heads(model)
        prompt = prompts_for(model, 1, 1)[0]
        gen = make_generator(model, OracleDrafter([[0] * 64], 1.0, 8), chain_config(8))
        gen.decode(prompt, 4)  # compiles and captures the 1-node pass
        gen.generate(prompt, 2)  # compiles and captures the 16-node pass
        section[f"{plan}_ms"] = pass_ms(gen, PASS_NODES)
        section[f"{plan}_plain_step"] = {"ms": pass_ms(gen, 1), "profile": plain_step_profile(gen)}
        print(f"{plan} plan, one {PASS_NODES}-node pass: {section[f'{plan}_ms']:.3f} ms", flush=True)
        # every rank replays (the collectives need all of them); rank 0's kernels are reported
        graph = next(iter(gen._engines.values())).buckets[bucket_key(PASS_NODES)].graph
        section[f"{plan}_profile"] = kernel_profile(graph, trace_path=f"/tmp/specla_tp_trace_{rank()}.json")
        report(results, args)
        del gen, model
        free()


def exact_fp32(args, results: dict) -> None:
    """Greedy fp32 output at TP=N (both plans; plain and chain p=0.8 L=8) against TP=1 plain decoding."""
    from specla_compile.parallel import shard_gdn_heads

    path = checkpoint(args, torch.float32, args.exact_layers)
    run = argparse.Namespace(prompts=args.exact_prompts, new_tokens=args.exact_tokens)
    reference: list[torch.Tensor] = []

    def tp1_reference() -> None:
        reference.extend(s.cpu() for s in measure_plain(load(path, torch.float32, parallel=False), run)[1]["sequences"])

    on_rank0(tp1_reference)
    section = results.setdefault("exact_fp32", {})
    for plan in ("gathered", "heads"):
        model = load(path, torch.float32, parallel=True)
        if plan == "heads":
            shard_gdn_heads(model)
        gen, plain, prompts = measure_plain(model, run)
        chain = run_route(gen, prompts, run.new_tokens, OracleDrafter(None, 0.8, 8), chain_config(8), truths=truth_of(plain, prompts))
        if rank() == 0:
            for route, out in (("plain", plain), ("chain_p0.8_L8", chain)):
                same = sum(torch.equal(a.cpu(), b) for a, b in zip(out["sequences"], reference))
                section[f"{plan}_{route}"] = f"{same}/{len(reference)}"
                print(f"fp32 {plan} {route}: {section[f'{plan}_{route}']} identical to TP=1", flush=True)
        report(results, args)
        del gen, model
        free()


def report(results: dict, args) -> None:
    if rank() == 0:
        write_report(results, args.out)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.plot:
        with open(args.plot) as f:
            write_report(json.load(f), args.out)
        return
    if not torch.cuda.is_available() or "LOCAL_RANK" not in os.environ:
        sys.exit("run this benchmark on a machine with 2 GPUs: torchrun --nproc-per-node 2 benchmarks/tp_gpu.py")
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl", timeout=timedelta(minutes=30))  # ranks wait while rank 0 runs TP=1 alone
    results = {"device": torch.cuda.get_device_name(), "world": dist.get_world_size(), "torch": torch.__version__,
               "command": " ".join(["torchrun", f"--nproc-per-node {dist.get_world_size()}", *sys.argv])}
    try:
        run_sections(args, results, globals(), lambda: report(results, args), stop_on_error=True)
    except Exception:  # noqa: BLE001  (whatever failed: the report holds it)
        # A rank that failed cannot join the next section's collectives (the others would wait for it until
        # the NCCL timeout, and a CUDA error leaves it no device to join with): exit now, so that torchrun
        # stops the other ranks; the report holds the error.
        os._exit(1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
