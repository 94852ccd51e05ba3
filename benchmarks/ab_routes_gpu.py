"""Time a few headline routes with the code of one checkout: for before/after comparisons of a change.

Run it alternately on two checkouts in one call on one machine (old, new, old, new) with one inductor
cache, and compare processes of the same kind (the first one compiles cold; a run-to-run spread of
several percent is normal between machines, so figures from different calls do not compare):

    git archive <commit> specla_compile benchmarks | tar -x -C /tmp/old
    for v in old new old new; do d=/tmp/old; [ $v = new ] && d=.; python benchmarks/ab_routes_gpu.py $d $v; done

Routes on the fla GDN-1.3B shape (bf16, B=1, 4 prompts x 128 tokens, controlled acceptance as in
``e2e_gpu.py``): plain, chain L=12 p=1, chain L=8 p=0.8, tree top-4 16 nodes p=0.8; per route the time
per iteration and its phases, and a call's fixed cost (``generate`` of one token minus its prefill:
the engine's start and finish); replays of the 1- and 16-node chain passes and the 16-node tree pass, and
the 1-node pass's kernels (one layer in launch order). Writes ``$OUT/ab_<label>.json``.
"""

from __future__ import annotations

import json
import os
import sys
import time

ROUTES = (("L12_p1", 12, 1.0, 1), ("L8_p0.8", 8, 0.8, 1), ("tree_k4_n16_p0.8", 3, 0.8, 4))


def main() -> None:
    if len(sys.argv) != 3:
        raise SystemExit("usage: ab_routes_gpu.py <checkout> <label>")
    code, label = os.path.abspath(sys.argv[1]), sys.argv[2]
    sys.path[:0] = [code, os.path.join(code, "benchmarks")]
    import torch
    from e2e_gpu import (
        OracleDrafter,
        bucket_key,
        build,
        chain_config,
        controlled_route,
        kernel_profile,
        make_generator,
        pass_ms,
        prompts_for,
        run_route,
        tree_config,
        truth_of,
    )

    import specla_compile

    if not specla_compile.__file__.startswith(code):
        raise SystemExit(f"specla_compile was imported from {specla_compile.__file__}, not from {code}")
    if not torch.cuda.is_available():
        raise SystemExit("this benchmark needs a CUDA GPU")
    model = build("fla", torch.bfloat16, None)
    prompts = prompts_for(model, 1, 4)
    gen = make_generator(model)
    started = time.perf_counter()
    gen.decode(prompts[0], 8)
    result = {"code": label, "checkout": code, "compile_plain_s": time.perf_counter() - started}
    plain = run_route(gen, prompts, 128, plain=True)
    truths = truth_of(plain, prompts)
    result["plain_ms_per_token"] = plain["ms_per_token"]
    for name, depth, p, top_k in ROUTES:
        config = chain_config(depth) if top_k == 1 else tree_config(top_k, 16)[0]
        gen.drafter, gen.config = OracleDrafter(truths[0], p, depth, top_k), config
        gen.generate(prompts[0], 8)  # compiles and captures the route's bucket outside the timed runs
        route = controlled_route(gen, prompts, 128, plain, truths, p, depth, top_k, config)
        result[name] = {"speedup": route["speedup"], "ms_per_token": route["ms_per_token"], "tokens_per_pass": route["tokens_per_pass"],
                        "ms_per_iteration": 1000 * route["decode_s"] / route["passes"], "ms_per_pass": route["ms_per_pass"],
                        "identical": route["identical"]}
    fixed = []
    for _ in range(20):
        torch.cuda.synchronize()
        started = time.perf_counter()
        out = gen.generate(prompts[0], 1)
        torch.cuda.synchronize()
        fixed.append(time.perf_counter() - started - out.stats.prefill_seconds)
    result["per_call_ms"] = 1000 * sorted(fixed)[len(fixed) // 2]
    result["pass_ms"] = {"1": pass_ms(gen, 1), "16": pass_ms(gen, 16), "16_tree": pass_ms(gen, 16, chain=False)}
    plain_bucket = next(iter(gen._engines.values())).buckets[bucket_key(1)]
    plain_bucket.step.zero_()  # (the plain loop's graph logs its token at this step: keep it in range)
    result["profile_1"] = kernel_profile(plain_bucket.graph)
    plain_bucket.step.zero_()
    print(json.dumps(result, indent=1))
    with open(os.path.join(os.environ.get("OUT", "/tmp"), f"ab_{label}.json"), "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
