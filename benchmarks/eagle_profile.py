"""What EAGLE drafting costs on the GPU, at the trained study's shape (random weights: the cost does
not depend on them).

- ``propose``: time per propose with and without its CUDA graph, the graph's replay alone, the host's
  share, and the captured graph's kernels by kind.
- ``loop``: one ``generate`` iteration of the study's routes over a target of the trained shape
  (``benchmarks/results/trained/report.json``), or of the GDN-1.3B shape with ``--target gdn-1.3b`` (where
  the drafting ratio's goal was set: drafting and verifying timed in one run): wall time per iteration against
  the CUDA-event phase times, the GPU's kernel time per iteration (the rest is the GPU waiting for the host),
  the runtime calls per iteration (synchronisations, copies, graph launches) and the host's costliest functions; with
  ``--draft-vocab N``, also the tree drafting from N tokens, as the study's ``_fr`` routes do.

    python benchmarks/eagle_profile.py --out DIR     # writes DIR/eagle_profile.json and prints a table
"""

from __future__ import annotations

import argparse
import cProfile
import dataclasses
import functools
import io
import itertools
import json
import os
import pstats
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from e2e_gpu import FLA_1P3B, build, kernel_profile, literal_pairs, set_inductor_config, summarize_kernels, timed

from specla_compile.runtime.config import SpecConfig
from specla_compile.runtime.drafters import EagleConfig, EagleDrafter, EagleHead
from specla_compile.runtime.drafters.eagle import ATTENTION
from specla_compile.runtime.drafters.eagle_head import DEFAULT_HEAD_GEMMS, HEAD_GEMMS
from specla_compile.runtime.drafting import DraftRequest

CONFIGS = {  # the routes of benchmarks/e2e_trained.py
    "chain_L8": SpecConfig(mode="chain", depth=8, bucket=16),
    "tree_k4_d6_n16": SpecConfig(mode="tree", depth=6, tree_top_k=4, budget=15, bucket=16),
}


def stub_target(hidden: int, vocab: int, dtype: torch.dtype, device: str = "cuda") -> torch.nn.Module:
    """What the drafter reads of its target: input embeddings and LM head (a one-layer Llama, its MLP 4x its width:
    what ``EagleConfig.for_target`` sizes the head's after)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=4 * hidden, num_hidden_layers=1,
                         num_attention_heads=8, num_key_value_heads=8)
    return LlamaForCausalLM(config).to(device, dtype).eval()


def run(drafter: EagleDrafter, config: SpecConfig, prompt: int, iterations: int, hidden: int, dtype: torch.dtype) -> dict:
    """Propose/commit ``iterations`` times (three tokens accepted each time); seconds per propose."""
    gen = torch.Generator().manual_seed(0)
    seq = torch.randint(0, drafter.vocab_size, (prompt,), generator=gen)
    drafter.begin([seq[:-1]], [torch.randn(prompt - 1, hidden, device="cuda", dtype=dtype)])
    times = []
    for i in range(iterations):
        torch.cuda.synchronize()
        started = time.perf_counter()
        draft = drafter.propose(DraftRequest([0], [seq]), config)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - started)
        accepted = draft.tokens[0, 1:3].cpu()
        drafter.commit([0], [torch.cat([seq[-1:], accepted])], [torch.randn(3, hidden, device="cuda", dtype=dtype)])
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


TRAINED_REPORT = Path(__file__).resolve().parent / "results" / "trained" / "report.json"
LOOP_ROUTES = ("plain", "eagle_chain", "eagle_tree", "eagle_tree_host")  # host: SpecConfig(pipelined=False)
RUNTIME_CALLS = ("cudaStreamSynchronize", "cudaMemcpyAsync", "cudaGraphLaunch", "cudaLaunchKernel", "cudaEventRecord")


def trained_shape_target(vocab: int, dtype: torch.dtype, device: str = "cuda", **overrides) -> torch.nn.Module:
    """An fla GDN model of the trained study's config (random weights; ``overrides``: config entries, e.g.
    smaller ones for a CPU check) on ``device``."""
    from fla.models import GatedDeltaNetConfig, GatedDeltaNetForCausalLM

    config = json.loads(TRAINED_REPORT.read_text())["target"]["config"]
    config.update(vocab_size=vocab, fuse_cross_entropy=False, eos_token_id=None, **overrides)
    torch.manual_seed(0)
    model = GatedDeltaNetForCausalLM(GatedDeltaNetConfig.from_dict(config))
    model.generation_config.eos_token_id = None  # random weights: every call decodes its full length
    return model.to(device, dtype).eval()


def loop_target(name: str, vocab: int, dtype: torch.dtype, layers: int | None = None) -> torch.nn.Module:
    """The loop section's target: the trained study's shape (``layers`` deep where given), or e2e_gpu.py's
    GDN-1.3B shape (random weights)."""
    if name == "trained":
        return trained_shape_target(vocab, dtype, **({"num_hidden_layers": layers} if layers else {}))
    return build("fla", dtype, layers)


def target_hidden(name: str) -> int:
    return json.loads(TRAINED_REPORT.read_text())["target"]["config"]["hidden_size"] if name == "trained" else FLA_1P3B["hidden_size"]


def head_config(target: torch.nn.Module, args) -> EagleConfig:
    """The head of both sections: sized after ``target`` (``EagleConfig.for_target``) but where --heads or
    --intermediate say."""
    overrides = {"num_heads": args.heads, "intermediate_size": args.intermediate}
    return EagleConfig.for_target(target, **{k: v for k, v in overrides.items() if v is not None})


def host_profile(call, top: int = 25) -> list[str]:
    """The host's costliest functions over one call (cProfile, by own time): ``top`` lines of pstats."""
    profiler = cProfile.Profile()
    profiler.runcall(call)
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(top)
    return [line for line in text.getvalue().splitlines() if line.strip()][-top - 1 :]


def runtime_profile(call, iterations: int, trace_path: str = "/tmp/specla_loop_trace.json") -> dict:
    """Per iteration of one call: CUDA runtime calls by name and the GPU's busy time (kernels, copies,
    fills), from a torch.profiler chrome trace."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        call()
        torch.cuda.synchronize()
    prof.export_chrome_trace(trace_path)
    with open(trace_path) as f:
        events = json.load(f)["traceEvents"]
    counts = {name: sum(e.get("name") == name for e in events) for name in RUNTIME_CALLS}
    gpu = summarize_kernels(events, iterations)
    return {"per_iteration": {k: round(v / iterations, 2) for k, v in counts.items()},
            "kernel_ms_per_iteration": gpu["busy_ms"], "kernels_per_iteration": gpu["kernels_per_pass"],
            "top_kernels_ms": gpu["top_kernels_ms"]}


def loop_section(args, results: dict) -> None:
    """``generate`` iterations of the study's routes at the trained shape: where an iteration's time goes."""
    import fla  # noqa: F401  (registers fla's models)

    from specla_compile import SpeculativeGenerator

    dtype = getattr(torch, args.dtype)
    model = loop_target(args.target, args.vocab, dtype, args.target_layers)
    hidden = model.config.hidden_size
    head = EagleHead(head_config(model, args)).to("cuda", dtype)
    head.set_token_ranking(torch.randperm(args.vocab, generator=torch.Generator().manual_seed(0)))
    tree_replays = {r["attention"]: r["replay_ms"] for name, r in results["routes"].items()
                    if name.startswith("tree") and "replay_ms" in r and not r.get("draft_vocab")}
    attention = min(tree_replays, key=tree_replays.get) if tree_replays else None
    drafter = EagleDrafter(head, model, attention=attention, head_gemms=args.head_gemms[0],
                           inductor_options=args.propose_inductor, quantize=args.quantize[0])
    configs = {"eagle_chain": CONFIGS["chain_L8"], "eagle_tree": CONFIGS["tree_k4_d6_n16"],
               "eagle_tree_host": dataclasses.replace(CONFIGS["tree_k4_d6_n16"], pipelined=False)}
    gen = SpeculativeGenerator(model, drafter, configs["eagle_tree"], shared_features=True)
    prompt = torch.randint(0, args.vocab, (1, args.prompt), generator=torch.Generator().manual_seed(0)).cuda()
    loop = results["loop"] = {"target": args.target, "target_layers": model.config.num_hidden_layers, "hidden": hidden,
                              "head_intermediate": head.config.intermediate_size, "new_tokens": 128,
                              "attention": attention, "head_gemms": args.head_gemms[0], "quantize": args.quantize[0]}
    # the routes, then the tree drafting from each draft vocabulary (as the study's _fr routes), on its own drafter
    runs = [(route, route, drafter) for route in LOOP_ROUTES if route == "plain" or route in args.loop_routes]
    runs += [(f"eagle_tree, draft vocabulary {vocab}{quantized_name(quantize)}", "eagle_tree", EagleDrafter(
        head, model, attention=attention, head_gemms=args.head_gemms[0], inductor_options=args.propose_inductor,
        draft_vocab=vocab, quantize=quantize))
        for vocab, quantize in itertools.product(args.draft_vocab, args.quantize) if vocab]
    sequences = {}
    for route, kind, route_drafter in runs:
        gen.drafter = route_drafter
        if route != "plain":
            gen.config = configs[kind]
        call = (lambda: gen.decode(prompt, 128)) if route == "plain" else (lambda: gen.generate(prompt, 128))
        print(f"loop {route}: compiling, capturing and warming up (3 calls)", flush=True)
        started = time.perf_counter()
        for _ in range(3):  # compile, capture, warm
            call()
        warm = time.perf_counter() - started
        rows = []
        for _ in range(args.calls):
            out, seconds = timed(call)
            st = out.stats
            rows.append((seconds - st.prefill_seconds, st.iterations, st.draft_seconds, st.verify_seconds,
                         st.commit_seconds, st.new_tokens))
        rows.sort()
        wall, iters, draft, verify, commit, tokens = rows[len(rows) // 2]  # the median call
        sequences[route] = out.sequences[0].tolist()

        def per(seconds: float, iters: int = iters) -> float:
            return 1000 * seconds / iters

        entry = loop[route] = {
            "warm_s": warm, "ms_per_token": 1000 * wall / tokens, "iterations": iters,
            "ms_per_iteration": per(wall), "phase_ms_per_iteration": {"draft": per(draft), "verify": per(verify),
                                                                      "commit": per(commit)},
            "runtime": runtime_profile(call, iters),
        }
        if route in ("eagle_tree", "eagle_tree_host"):
            entry["host_top"] = host_profile(call)
        if route != "plain":  # (a propose that replays no graph launches its kernels from the host, ~10x slower)
            entry["propose_graphs"], entry["propose_graph_error"] = gen.drafter.captured_graphs, gen.drafter.graph_error
        idle = entry["ms_per_iteration"] - entry["runtime"]["kernel_ms_per_iteration"]
        print(f"loop {route}: {entry['ms_per_iteration']:.3f} ms per iteration ({iters} iterations), phases "
              f"{ {k: round(v, 3) for k, v in entry['phase_ms_per_iteration'].items()} }, GPU kernels "
              f"{entry['runtime']['kernel_ms_per_iteration']:.3f} ms (waiting {idle:.3f} ms), "
              f"runtime calls {entry['runtime']['per_iteration']}, propose graphs {entry.get('propose_graphs', '-')} "
              f"{entry.get('propose_graph_error', '')}", flush=True)
        for line in entry.get("host_top", []):
            print("   ", line, flush=True)
        save_json(results, args.out)  # (a call cut short keeps the routes before)
    # pipelined and host-loop drafting run the same passes over the same drafts: the same tokens, bit for bit
    if {"eagle_tree", "eagle_tree_host"} <= sequences.keys():
        loop["identical_to_host_loop"] = sequences["eagle_tree"] == sequences["eagle_tree_host"]
    loop["identical_to_plain"] = {route: tokens == sequences["plain"] for route, tokens in sequences.items() if route != "plain"}
    print(f"loop outputs: pipelined tree == host-loop tree: {loop.get('identical_to_host_loop', '-')}; "
          f"== plain ({args.dtype}, random weights: near-ties may differ): {loop['identical_to_plain']}", flush=True)
    gen.drafter = drafter
    loop["one_token_calls"] = one_token_calls(gen, configs["eagle_tree"], prompt)


def quantized_name(quantize: str) -> str:
    """A route name's word on the head's weights (``--quantize``): none for its own."""
    return "" if quantize == "none" else f", {quantize} head weights"


def median_call(call, times: int = 11):
    """``(output, seconds)`` of the median of ``times`` timed calls."""
    runs = sorted((timed(call) for _ in range(times)), key=lambda run: run[1])
    return runs[len(runs) // 2]


def one_token_calls(gen, tree, prompt: torch.Tensor) -> dict:
    """What a call pays besides its iterations: a call of one new token (the prefill, the engine's start and
    finish, the drafter's begin), plain and tree, on a 16-token prompt and on the whole one, median of 11,
    with its prefill phase (CUDA events). (Longer prefill passes, 32 and 64 tokens, were measured once: no
    cheaper, as a chain pass costs about its token count; see the JSON's notes.)"""
    gen.config = tree
    out = {}
    for route, call in (("plain", gen.decode), ("eagle_tree", gen.generate)):
        for length in sorted({min(16, prompt.shape[1]), prompt.shape[1]}):
            ids = prompt[:, :length]
            result, seconds = median_call(functools.partial(call, ids, 1))
            entry = out[f"{route}, {length}-token prompt"] = {
                "call_ms": 1000 * seconds, "prefill_ms": 1000 * result.stats.prefill_seconds,
                "prefill_passes": result.stats.prefill_passes}
            print(f"one-token call, {route}, {length}-token prompt: {entry}", flush=True)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--sections", nargs="+", choices=("propose", "loop"), default=["propose", "loop"])
    p.add_argument("--calls", type=int, default=3, help="timed generate calls per route (loop)")
    p.add_argument("--loop-routes", nargs="+", choices=LOOP_ROUTES, default=list(LOOP_ROUTES),
                   help="the loop section's routes besides plain decoding, which always runs (every output's reference), "
                        "and each --draft-vocab tree")
    p.add_argument("--target", choices=("trained", "gdn-1.3b"), default="trained",
                   help="the loop section's target: the trained study's shape, or the GDN-1.3B shape of e2e_gpu.py")
    p.add_argument("--target-layers", type=int, default=None,
                   help="the loop section's target depth (default: the trained study's, or 24 for gdn-1.3b): the drafting "
                        "ratio of a deeper trained target, whose verify pass costs more and whose head costs the same")
    p.add_argument("--hidden", type=int, default=None, help="the propose section's head width (default: the target's)")
    p.add_argument("--heads", type=int, default=None, help="the head's attention heads (default: the target's)")
    p.add_argument("--intermediate", type=int, default=None,
                   help="the head's MLP width (default: the target's, 4x its width for an fla target or the stub)")
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--prompt", type=int, default=200)
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"), help="of the target, head and features")
    p.add_argument("--iterations", type=int, default=30)
    p.add_argument("--attention", nargs="+", choices=ATTENTION, default=["pytorch", "specla"],
                   help="the head's attention kernels to time in the propose section; "
                        "the loop section drafts with the one whose tree propose replays fastest")
    p.add_argument("--head-gemms", nargs="+", choices=sorted(HEAD_GEMMS), default=[DEFAULT_HEAD_GEMMS],
                   help="how the head's GEMMs run (EagleDrafter's head_gemms) in the propose section: the fused specla "
                        "ops, or PyTorch code that inductor compiles; the loop section drafts with the first")
    p.add_argument("--quantize", nargs="+", choices=("none", "int8"), default=["none"],
                   help="the head's weights in the propose section (EagleDrafter's quantize), and in the loop section "
                        "for each --draft-vocab tree (its main drafter takes the first): its own, or weight-only int8 "
                        "copies")
    p.add_argument("--draft-vocab", nargs="+", type=int, default=[0],
                   help="draft vocabularies to time in the propose section, and in the loop section each one's tree "
                        "beside the whole vocabulary's (0: the whole vocabulary; a random token ranking: the cost does "
                        "not depend on which tokens)")
    p.add_argument("--inductor", nargs="+", metavar="KEY=VALUE", default=[],
                   help="set torch._inductor.config entries for this process (the proposes' and the loop's compiles), "
                        "e.g. combo_kernels=True: an A/B against a run without (the proposes' own options win: "
                        "--propose-inductor)")
    p.add_argument("--propose-inductor", nargs="*", metavar="KEY=VALUE", default=None,
                   help="the proposes' inductor options (EagleDrafter's inductor_options) in place of the drafter's "
                        "default on CUDA (combo kernels and PDL); with no entries, inductor's defaults")
    args = p.parse_args()
    try:
        set_inductor_config(args.inductor)
        if args.propose_inductor is not None:
            import torch._inductor.config as inductor_config

            args.propose_inductor = literal_pairs("--propose-inductor", args.propose_inductor,
                                                  lambda key: hasattr(inductor_config, key), "torch._inductor.config")
    except ValueError as err:
        p.error(str(err))
    if args.target == "gdn-1.3b" and args.vocab != FLA_1P3B["vocab_size"]:
        p.error(f"--target gdn-1.3b has a vocabulary of {FLA_1P3B['vocab_size']}, not --vocab {args.vocab}")
    if args.target_layers is not None and args.target_layers < 1:
        p.error(f"--target-layers must be >= 1, got {args.target_layers}")
    args.hidden = args.hidden or target_hidden(args.target)
    if not torch.cuda.is_available():
        sys.exit("error: eagle_profile.py needs a CUDA GPU")
    os.makedirs(args.out, exist_ok=True)
    results = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "shape": vars(args), "routes": {}}
    for name, section in (("propose", propose_section), ("loop", loop_section)):
        if name in args.sections:
            try:
                section(args, results)
            except Exception:  # noqa: BLE001 (one GPU call runs both: a failing section keeps the other's results)
                results.setdefault("errors", {})[name] = traceback.format_exc()
                print(results["errors"][name], flush=True)
    save_json(results, args.out)
    write_markdown(results, args.out)


def save_json(results: dict, out: str) -> None:
    with open(os.path.join(out, "eagle_profile.json"), "w") as f:
        json.dump(results, f, indent=1)


def propose_section(args, results: dict) -> None:
    """Each route's propose, graphed and uncaptured, over a stub target (embeddings and LM head)."""
    dtype = getattr(torch, args.dtype)
    target = stub_target(args.hidden, args.vocab, dtype)
    torch.manual_seed(0)
    head = EagleHead(head_config(target, args)).to("cuda", dtype)
    results["propose_head_intermediate"] = head.config.intermediate_size
    head.set_token_ranking(torch.randperm(args.vocab, generator=torch.Generator().manual_seed(0)))
    for (name, config), attention, vocab, gemms, quantize in itertools.product(
            CONFIGS.items(), args.attention, args.draft_vocab, args.head_gemms, args.quantize):
        draft_vocab = vocab or None
        name = (f"{name}, {attention} attention" + (f", draft vocabulary {vocab}" if vocab else "")
                + (f", {gemms} head GEMMs" if len(args.head_gemms) > 1 else "") + quantized_name(quantize))
        route = results["routes"][name] = {"attention": attention, "draft_vocab": draft_vocab, "head_gemms": gemms,
                                           "quantize": quantize}
        for mode, static in (("graphed", None), ("uncaptured", False)):
            if mode == "uncaptured" and (attention, draft_vocab, gemms, quantize) != (
                    args.attention[0], None, args.head_gemms[0], args.quantize[0]):
                continue  # (none of them changes a propose's launch count much)
            drafter = EagleDrafter(head, target, static_shapes=static, attention=attention, draft_vocab=draft_vocab,
                                   head_gemms=gemms, inductor_options=args.propose_inductor,
                                   quantize=quantize)
            route[mode] = run(drafter, config, args.prompt, args.iterations, args.hidden, dtype)
            if mode == "graphed":
                graph = next(iter(drafter._graphs.values())).graph
                route["replay_ms"] = replay_ms(graph)
                trace = os.path.join(args.out, "propose_trace.json")
                profile = kernel_profile(graph, trace_path=trace)
                route["profile"] = {k: v for k, v in profile.items() if k != "one_layer"}
                route["profile"]["kernels_in_order"] = first_replay_kernels(trace, round(profile["kernels_per_pass"]))
                os.remove(trace)
        route["inductor_options"] = drafter.inductor_options  # (the same for both modes)
        route["host_ms"] = route["graphed"]["ms_per_propose"] - route["replay_ms"]
        print(f"{name}: graphed {route['graphed']['ms_per_propose']:.3f} ms per propose (replay {route['replay_ms']:.3f}, "
              f"{route['profile']['kernels_per_pass']:.0f} kernels, busy {route['profile']['busy_ms']:.3f}), "
              f"uncaptured {route.get('uncaptured', {}).get('ms_per_propose', float('nan')):.3f} ms", flush=True)
        print(json.dumps(route["profile"], indent=1), flush=True)
        save_json(results, args.out)


def first_replay_kernels(trace_path: str, count: int) -> list[list]:
    """The first replay's ``count`` GPU events of a ``kernel_profile`` trace in launch order: ``[name, us]``
    each (what one level of a propose runs, for planning fusions)."""
    with open(trace_path) as f:
        events = [e for e in json.load(f)["traceEvents"] if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    return [[e.get("name", "")[:90], round(e["dur"], 2)] for e in sorted(events, key=lambda e: e["ts"])[:count]]


def write_markdown(results: dict, out_dir: str) -> None:
    """``eagle_profile.md``: per route, a propose's time graphed and uncaptured, and the graph's kernels."""
    shape = results["shape"]
    setup = (f"device: {results.get('device')}, torch {results.get('torch')}, head and LM head at hidden {shape['hidden']}, "
             f"head MLP {results.get('propose_head_intermediate', results.get('loop', {}).get('head_intermediate'))} wide, "
             f"vocabulary {shape['vocab']}, "
             f"{shape.get('dtype', 'bfloat16')}, B=1, {shape['prompt']}-token prompt")
    lines = ["# EAGLE drafting on the GPU", "", setup]
    if results.get("routes"):  # (the propose section's)
        lines += ["", "| route | graphed, ms per propose | its replay, ms | host, ms | kernels | GPU busy, ms | GEMM, ms | "
                  "uncaptured, ms |", "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for name, r in results.get("routes", {}).items():
        p = r["profile"]
        uncaptured = f"{r['uncaptured']['ms_per_propose']:.3f}" if "uncaptured" in r else "-"
        lines.append(f"| {name} | {r['graphed']['ms_per_propose']:.3f} | {r['replay_ms']:.3f} | {r['host_ms']:.3f} | "
                     f"{p['kernels_per_pass']:.0f} | {p['busy_ms']:.3f} | {p['by_kind_ms'].get('gemm', 0):.3f} | "
                     f"{uncaptured} |")
    if "loop" in results:
        loop = results["loop"]
        title = (f"## One generate iteration ({loop.get('target', 'trained')}-shaped {loop['target_layers']}-layer target at "
                 f"hidden {loop['hidden']}, head MLP {loop.get('head_intermediate', shape.get('intermediate'))} wide, random "
                 f"weights, {loop['new_tokens']} new tokens, {loop.get('attention') or 'default'} attention"
                 + (f", {loop['head_gemms']} head GEMMs" if "head_gemms" in loop else "") + "; "
                 "eagle_tree_host: SpecConfig(pipelined=False))")
        header = ("| route | ms per iteration | draft / verify / commit phases, ms | GPU kernels, ms | GPU waiting, ms | "
                  "syncs | copies | graph launches | kernel launches |")
        lines += ["", title, "", header, "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
        for route, r in loop.items():
            if not (isinstance(r, dict) and "phase_ms_per_iteration" in r):
                continue
            ph, rt = r["phase_ms_per_iteration"], r["runtime"]
            calls = rt["per_iteration"]
            lines.append(f"| {route} | {r['ms_per_iteration']:.3f} | {ph['draft']:.3f} / {ph['verify']:.3f} / {ph['commit']:.3f} | "
                         f"{rt['kernel_ms_per_iteration']:.3f} | {r['ms_per_iteration'] - rt['kernel_ms_per_iteration']:.3f} | "
                         f"{calls['cudaStreamSynchronize']} | {calls['cudaMemcpyAsync']} | {calls['cudaGraphLaunch']} | "
                         f"{calls['cudaLaunchKernel']} |")
        for name, call in loop.get("one_token_calls", {}).items():
            if isinstance(call, dict):
                # (the sixth session's probe of longer prefill passes, kept in the JSON, also checked the first token)
                same = "" if "same_first_token" not in call else f", same first token: {call['same_first_token']}"
                lines.append(f"- one-token call, {name}: {call['call_ms']:.2f} ms, of which prefill {call['prefill_ms']:.2f} ms "
                             f"({call['prefill_passes']} pass{'es' if call['prefill_passes'] != 1 else ''}{same})")
        if "identical_to_plain" in loop:
            lines.append(f"- outputs: pipelined tree drafting identical to the host loop's: {loop.get('identical_to_host_loop', '-')}; "
                         f"identical to plain decoding ({shape.get('dtype', 'bfloat16')}, random weights): {loop['identical_to_plain']}")
        lines.append("")
    lines += [f"- {note}" for note in results.get("notes", [])]
    with open(os.path.join(out_dir, "eagle_profile.md"), "w") as f:
        f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
