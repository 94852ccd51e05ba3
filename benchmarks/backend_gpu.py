"""The specla backend on a GDN-1.3B-shaped fla model on the GPU (bf16, random weights).

Checks capture and rewrite (graphs, graph breaks, recurrence nodes), compares a chain verification
against token-by-token eager decoding, and times one verification pass against one decode step
(CUDA events, median of repeats) for chains and trees of several sizes. Writes JSON and a markdown
table under ``--out``.

    python benchmarks/backend_gpu.py --out benchmarks/results
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import traceback

import torch

import specla_compile  # noqa: F401  (routes fla entry points, registers ops)
from specla_compile.lowering.graph_analysis import RECURRENCE, find_gdn_layers, is_call
from specla_compile.lowering.rewrite import rewrite_for_verify
from specla_compile.lowering.session import VerifySession
from specla_compile.runtime.topology import ROOT

SHAPE = dict(hidden_size=2048, num_hidden_layers=24, num_heads=8, head_dim=256, expand_v=1, vocab_size=32000)


def gdn_1p3b(layers: int) -> torch.nn.Module:
    from fla.models import GatedDeltaNetConfig, GatedDeltaNetForCausalLM

    torch.manual_seed(0)
    config = GatedDeltaNetConfig(**{**SHAPE, "num_hidden_layers": layers}, fuse_cross_entropy=False)
    return GatedDeltaNetForCausalLM(config).cuda().to(torch.bfloat16).eval()


def median_ms(fn, repeats: int = 20) -> float:
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def tree_parents(nodes: int, top_k: int) -> torch.Tensor:
    """A complete top_k-ary tree in BFS order, cut to ``nodes`` nodes."""
    return torch.tensor([[ROOT] + [(j - 1) // top_k for j in range(1, nodes)]], device="cuda")


def capture_report(model, prompt) -> dict:
    graphs = []

    def record(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    with torch.no_grad():
        cache = model(prompt, use_cache=True).past_key_values
        explanation = torch._dynamo.explain(model)(input_ids=prompt[:, :8], past_key_values=cache, use_cache=True)
        torch._dynamo.reset()
        torch.compile(model, backend=record, fullgraph=True)(input_ids=prompt[:, :8], past_key_values=cache, use_cache=True)
    gm = graphs[0]
    program = rewrite_for_verify(gm)
    return {
        "graphs": explanation.graph_count,
        "graph_breaks": explanation.graph_break_count,
        "recurrence_nodes": sum(is_call(n, RECURRENCE) for n in gm.graph.nodes),
        "gdn_layers_found": len(find_gdn_layers(gm.graph)),
        "verify_nodes_after_rewrite": sum("gdn_commit_verify_" in str(n.target) for n in program.graph_module.graph.nodes),
        "recurrence_nodes_after_rewrite": sum(is_call(n, RECURRENCE) for n in program.graph_module.graph.nodes),
    }


def chain_check(model, compiled, prompt, chain) -> dict:
    with torch.no_grad():
        eager = model(prompt, use_cache=True)
        steps = []
        for t in range(chain.shape[1]):
            eager = model(chain[:, t : t + 1], past_key_values=eager.past_key_values, use_cache=True)
            steps.append(eager.logits.float())
        expected = torch.cat(steps, 1)
        cache = model(prompt, use_cache=True).past_key_values
        session = VerifySession()
        parents = torch.arange(-1, chain.shape[1] - 1, device="cuda")[None]
        with session.verify(parents):
            got = compiled(input_ids=chain, past_key_values=cache, use_cache=True).logits.float()
    diff = (got - expected).abs()
    top2 = expected.topk(2, dim=-1).values
    gap = (top2[..., 0] - top2[..., 1])[0]  # eager's margin between its best and second-best token
    disagree = (got.argmax(-1) != expected.argmax(-1))[0]
    return {
        "positions": chain.shape[1],
        "max_abs_logit_diff": diff.max().item(),
        "mean_abs_logit_diff": diff.mean().item(),
        "logit_scale (max |logit|)": expected.abs().max().item(),
        "argmax_agreement": 1 - disagree.float().mean().item(),
        # a divergence is a near-tie when eager's top-2 margin is below the logit error at that position
        "divergences": [
            {"position": i, "eager_top2_margin": gap[i].item(), "max_abs_logit_diff_there": diff[0, i].max().item()}
            for i in disagree.nonzero().flatten().tolist()
        ],
        "median_eager_top2_margin": gap.median().item(),
    }


def timings(model, compiled, prompt) -> list[dict]:
    rows = []
    with torch.no_grad():
        cache = model(prompt, use_cache=True).past_key_values
        token = prompt[:, -1:]
        decode = median_ms(lambda: model(token, past_key_values=cache, use_cache=True))
        rows.append({"route": "eager fla decode step (1 token)", "nodes": 1, "ms": decode})
        # two sizes only: every size is an inductor compile of the 24-layer verification twin
        for shape, nodes, top_k in (("chain", 8, 1), ("tree", 16, 2)):
            parents = tree_parents(nodes, top_k) if shape == "tree" else torch.arange(-1, nodes - 1, device="cuda")[None]
            tokens = torch.randint(0, SHAPE["vocab_size"], (1, nodes), device="cuda")
            session = VerifySession()

            def verify():
                with session.verify(parents):
                    compiled(input_ids=tokens, past_key_values=cache, use_cache=True)
                session.records = {}

            ms = median_ms(verify)
            rows.append({"route": f"specla verify {shape} (top-k {top_k})", "nodes": nodes, "ms": ms, "x_decode_step": ms / decode})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--chain", type=int, default=8, help="tokens in the chain compared with eager decoding")
    parser.add_argument("--sections", default="capture,chain_vs_eager_bf16,timings")
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    report: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "shape": {**SHAPE, "num_hidden_layers": args.layers}}
    model = gdn_1p3b(args.layers)
    gen = torch.Generator(device="cuda").manual_seed(0)
    prompt = torch.randint(0, SHAPE["vocab_size"], (1, 64), device="cuda", generator=gen)
    chain = torch.randint(0, SHAPE["vocab_size"], (1, args.chain), device="cuda", generator=gen)
    compiled = torch.compile(model, backend="specla")
    for name, section in (
        ("capture", lambda: capture_report(model, prompt)),
        ("chain_vs_eager_bf16", lambda: chain_check(model, compiled, prompt, chain)),
        ("timings", lambda: timings(model, compiled, prompt)),
    ):
        if name not in args.sections.split(","):
            continue
        try:
            report[name] = section()
        except Exception:  # keep the other sections' results: one GPU run has to tell as much as it can
            report[name] = {"error": traceback.format_exc()[-3000:]}
        print(name, json.dumps(report[name], indent=1)[:3000], flush=True)
    stem = "backend_gpu" if args.sections == parser.get_default("sections") else "backend_gpu_" + args.sections.replace(",", "_")
    with open(os.path.join(args.out, stem + ".json"), "w") as f:
        json.dump(report, f, indent=2)
    lines = ["| route | nodes | ms | x decode step |", "| --- | --- | --- | --- |"]
    for row in report.get("timings", []) if isinstance(report.get("timings"), list) else []:
        lines.append(f"| {row['route']} | {row['nodes']} | {row['ms']:.3f} | {row.get('x_decode_step', 1.0):.2f} |")
    with open(os.path.join(args.out, stem + ".md"), "w") as f:
        f.write(f"# specla backend on a GDN-1.3B-shaped fla model ({report['device']}, bf16, random weights)\n\n")
        f.write("```\n" + json.dumps({k: report.get(k) for k in ("capture", "chain_vs_eager_bf16")}, indent=2) + "\n```\n\n")
        f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
