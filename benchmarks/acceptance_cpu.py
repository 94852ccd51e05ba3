"""Acceptance statistics and target passes saved on small models (CPU, fp32, greedy).

Rows: the example's embedded byte-level GDN (trained in-process on a rhyme) with prompt lookup in
chain and tree mode, and tiny random models of the three families drafted by prompt lookup and by
themselves (ModelDrafter on the target: the acceptance ceiling). Every run is checked
token-identical to plain decoding. Writes JSON and a markdown table.

    python benchmarks/acceptance_cpu.py --out benchmarks/results
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

from specla_compile import ModelDrafter, NgramDrafter, SpecConfig, SpeculativeGenerator
from specla_compile.runtime.baseline import autoregressive_generate

sys.path[:0] = [os.path.join(os.path.dirname(__file__), "..", "examples"), os.path.join(os.path.dirname(__file__), "..", "tests")]
CONFIGS = {"chain d4": SpecConfig(mode="chain", depth=4), "tree k2 d4 T12": SpecConfig(mode="tree", depth=4, tree_top_k=2, budget=12)}


def run(name: str, model, drafter_name: str, drafter, prompt: torch.Tensor, new: int) -> list[dict]:
    rows = []
    expected, _ = autoregressive_generate(model, prompt, new)
    for label, config in CONFIGS.items():
        out = SpeculativeGenerator(model, drafter, config, compile_options={"inner": "aot_eager"}).generate(prompt, max_new_tokens=new)
        stats = out.stats
        rows.append(
            {
                "model": name,
                "drafter": drafter_name,
                "config": label,
                "identical": out.sequences.tolist() == expected.tolist(),
                "new_tokens": stats.new_tokens,
                "target_passes": stats.target_passes,
                "plain_passes": new,
                "passes_saved": new - stats.target_passes,
                "tokens_per_target_pass": round(stats.tokens_per_target_pass, 2),
                "mean_accepted": round(stats.mean_accepted, 2),
                "first_token_match_rate": round(stats.first_token_match_rate, 2),
                "mean_tree_size": round(sum(stats.tree_sizes) / max(len(stats.tree_sizes), 1), 2),
            }
        )
        print(rows[-1], flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("--new-tokens", type=int, default=64)
    args = parser.parse_args()
    import generate  # examples/generate.py
    from models import FAMILIES, VOCAB, tiny_model  # tests/models.py

    rows = []
    rhyme_model = generate.embedded_model().eval()
    rhyme_prompt = torch.tensor([list(generate.DEFAULT_PROMPT.encode("utf-8"))])
    rows += run("embedded rhyme GDN", rhyme_model, "ngram", NgramDrafter(), rhyme_prompt, args.new_tokens)
    prompt = torch.randint(0, VOCAB, (1, 16), generator=torch.Generator().manual_seed(0))
    for family in FAMILIES:
        model = tiny_model(family)
        rows += run(f"tiny random {family}", model, "ngram", NgramDrafter(), prompt, args.new_tokens)
        rows += run(f"tiny random {family}", model, "model (itself)", ModelDrafter(model), prompt, args.new_tokens)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "acceptance_cpu.json"), "w") as f:
        json.dump(rows, f, indent=2)
    keys = list(rows[0])
    lines = ["| " + " | ".join(keys) + " |", "|" + " --- |" * len(keys)]
    lines += ["| " + " | ".join(str(r[k]) for k in keys) + " |" for r in rows]
    with open(os.path.join(args.out, "acceptance_cpu.md"), "w") as f:
        f.write("# Acceptance on small models (CPU, fp32, greedy, 64 new tokens)\n\n" + "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
