"""The trained-model study (benchmarks/e2e_trained.py): prompt schedule, bootstrap, summaries, targets and
report on synthetic records; and the whole pipeline (benchmarks/trained_pipeline.py) on CPU at tiny sizes."""

from __future__ import annotations

import gzip
import json
import os
import random
import re
from pathlib import Path

import e2e_trained as E
import numpy as np
import pytest
import trained_pipeline as P

from specla_compile.training.corpus import format_prompt

ROOT = Path(__file__).resolve().parents[1]

WORDS = "the cat sat on a mat and then def return x print what is two plus three".split()


@pytest.fixture(scope="module")
def prompt_files(tmp_path_factory):
    """The six files of the mixed suite (3 prompts each, gsm8k 5) and a HumanEval.jsonl.gz of 4 problems."""
    root = tmp_path_factory.mktemp("prompts")
    rng = random.Random(0)
    for stem in E.MIXED:
        with open(root / f"{stem}.jsonl", "w") as f:
            for i in range(5 if stem == "gsm8k" else 3):
                f.write(json.dumps({"question_id": i, "turns": [f"{stem} {i} " + " ".join(rng.choices(WORDS, k=8))]}) + "\n")
    with gzip.open(root / "HumanEval.jsonl.gz", "wt") as f:
        for i in range(4):
            f.write(json.dumps({"task_id": f"HumanEval/{i}", "prompt": f"def f{i}(x):\n    return x + {i}\n\ndef g(x):\n"}) + "\n")
    return root


def test_schedule_spreads_over_categories_and_suites_and_runs_shared_prompts_once(prompt_files):
    prompts = E.load_prompts(prompt_files, prompt_files / "HumanEval.jsonl.gz", E.SUITES, limit=7)
    by_suite = {s: [p for p in prompts if s in p.suites] for s in E.SUITES}
    assert {s: len(v) for s, v in by_suite.items()} == {"mixed": 7, "gsm8k": 5, "humaneval": 4}
    assert len({p.category for p in by_suite["mixed"][:6]}) == 6  # the first six: one of each category
    assert len({p.key for p in prompts}) == len(prompts)
    shared = [p for p in prompts if len(p.suites) == 2]
    assert [p.key for p in shared] == ["gsm8k:0"] and shared[0].suites == {"mixed": 2, "gsm8k": 0}  # (its places)
    assert prompts[0].text == format_prompt(json.loads((prompt_files / "mt_bench.jsonl").read_text().splitlines()[0])["turns"][0])
    code = by_suite["humaneval"][0]
    assert code.text.startswith("def f0(x):") and "ASSISTANT" not in code.text  # code to continue, as trained
    assert [p.key for p in prompts[:3]] == ["mt_bench:0", "gsm8k:0", "HumanEval:HumanEval/0"]  # suites in turn


def test_a_study_cut_short_reports_each_suite_over_the_prefix_of_its_own_order(prompt_files):
    """The GSM8K suite's turns measure GSM8K prompts that the mixed suite holds far down its order (as its math):
    cut short, the mixed suite is summarised over the prefix of its order that was measured (its categories
    balanced), not skewed to math by those; a gap in a suite's order ends its prefix there."""
    prompts = E.load_prompts(prompt_files, prompt_files / "HumanEval.jsonl.gz", E.SUITES, limit=None)
    measured = prompts[:12]  # (the schedule's first twelve: mixed, GSM8K and HumanEval in turn)
    records = [_record(p.key, p.suites, p.category, {"eagle_tree": 2.0}) for p in measured]
    mixed = E.suite_records(records, "mixed")
    assert 0 < len(mixed) < sum("mixed" in r["suites"] for r in records)  # GSM8K's later prompts left out
    assert sorted(r["suites"]["mixed"] for r in mixed) == list(range(len(mixed)))
    assert len({r["category"] for r in mixed}) == len(mixed)  # (fewer than six: one of each category so far)
    gsm8k = E.suite_records(records, "gsm8k")
    assert sorted(r["suites"]["gsm8k"] for r in gsm8k) == list(range(len(gsm8k))) and len(gsm8k) >= 4
    gap = [r for r in records if r["suites"].get("gsm8k") != 1]  # the second GSM8K prompt not measured
    assert [r["suites"]["gsm8k"] for r in E.suite_records(gap, "gsm8k")] == [0]
    summary, _ = E.summaries({"records": records})
    assert summary["mixed"]["plain"]["prompts"] == len(mixed)
    old = [{**r, "suites": list(r["suites"])} for r in records]  # an earlier study's records: no places, all count
    assert len(E.suite_records(old, "mixed")) == sum("mixed" in r["suites"] for r in records)


def test_bootstrap_ratio_is_the_ratio_of_sums_with_a_covering_interval():
    rng = np.random.default_rng(1)
    num, den = rng.uniform(1, 2, 40), rng.uniform(0.5, 1, 40)
    r = E.bootstrap_ratio(num, den, samples=500, seed=3)
    assert r["value"] == pytest.approx(num.sum() / den.sum())
    assert r["ci"][0] < r["value"] < r["ci"][1]
    assert r == E.bootstrap_ratio(num, den, samples=500, seed=3)  # seeded
    narrow = E.bootstrap_ratio(np.tile(num, 10), np.tile(den, 10), samples=500)
    assert narrow["ci"][1] - narrow["ci"][0] < r["ci"][1] - r["ci"][0]  # more prompts, a tighter interval
    assert E.bootstrap_ratio([2.0] * 5, [1.0] * 5)["ci"] == [2.0, 2.0]
    assert E.bootstrap_ratio([], [])["value"] is None


def _record(key: str, suites: list[str], category: str, speed: dict[str, float], accepted: float = 3.0, same: bool = True,
            draft: float = 0.1) -> dict:
    routes = {"plain": {"seconds": 1.0, "tokens": 65, "hash": key}}  # (each prompt its own output)
    for route, s in speed.items():
        passes = round(64 / accepted)
        routes[route] = {"seconds": 1.0 / s, "tokens": 65, "hash": key if same else "x", "passes": passes,
                         "first_hits": passes // 2, "draft_s": draft / s, "verify_s": 0.5 / s}
    return {"prompt": key, "suites": suites, "category": category, "routes": routes}


def test_summary_and_targets_from_records():
    records = [_record(f"m{i}", ["mixed"], "math" if i % 2 else "qa", {"eagle_tree": 2.5, "eagle_chain": 2.0}, accepted=4.0 + i % 2)
               for i in range(6)]
    records += [_record("g0", ["mixed", "gsm8k"], "math", {"eagle_tree": 1.5, "eagle_chain": 1.8}, same=False, draft=0.2)]
    results = {"dtype": "bfloat16", "records": records, "bootstrap_samples": 200,
               "mismatches": [{"route": "eagle_tree", "prompt": "g0", "position": 3, "fp32_margin": 0.01, "near_tie": True},
                              {"route": "eagle_chain", "prompt": "g0", "position": 5, "fp32_margin": 2.0, "near_tie": False},
                              {"route": "eager", "prompt": "g0", "position": 1, "fp32_margin": 9.0, "near_tie": False}]}
    results["summary"], results["categories"] = E.summaries(results)
    mixed = results["summary"]["mixed"]
    assert set(mixed) == {"plain", "eagle_tree", "eagle_chain"} and mixed["eagle_tree"]["prompts"] == 7
    assert mixed["eagle_tree"]["speedup"]["value"] == pytest.approx(7 / (6 / 2.5 + 1 / 1.5))
    assert mixed["eagle_tree"]["identical"] == 6 and 0.2 < mixed["eagle_tree"]["draft_over_verify"] < 0.4
    passes = [round(64 / (4.0 + i % 2)) for i in range(6)] + [round(64 / 3.0)]
    assert mixed["eagle_tree"]["accepted_length"]["value"] == pytest.approx(7 * 64 / sum(passes))
    draft_s = [0.1 / 2.5] * 6 + [0.2 / 1.5]  # (the phases' mean per iteration, over every prompt's iterations)
    assert mixed["eagle_tree"]["draft_ms"] == pytest.approx(1000 * sum(draft_s) / sum(passes))
    assert mixed["eagle_tree"]["verify_ms"] == pytest.approx(1000 * (6 * 0.5 / 2.5 + 0.5 / 1.5) / sum(passes))
    assert "draft_ms" not in mixed["plain"]
    assert set(results["categories"]["mixed"]) == {"math", "qa"} and "gsm8k" not in results["categories"]  # one category

    targets = {t["name"]: t for t in E.targets(results)}
    assert len(targets) == 9 and all(set(t) == {"name", "measured", "goal", "met"} for t in targets.values())
    exact = targets["exact output vs graphed plain decoding, speculative routes, all prompts (bfloat16)"]
    assert exact["measured"] == "12/14 identical; 1/2 mismatches near-ties (7 prompts, 2 routes)" and not exact["met"]  # the chain's mismatch is no near-tie
    assert targets["exact output vs graphed plain decoding, speculative routes, all prompts (float32)"]["measured"] is None
    assert targets["EAGLE tree (eagle_tree) speedup over graphed plain decoding, mixed"]["met"]
    assert not targets["EAGLE tree (eagle_tree) speedup over graphed plain decoding, gsm8k"]["met"]
    assert targets["EAGLE tree (eagle_tree) speedup over graphed plain decoding, humaneval"]["measured"] is None
    tree_chain = targets["EAGLE tree (eagle_tree) over chain (eagle_chain), accepted length and speedup [tree, chain], every suite"]
    assert set(tree_chain["measured"]) == {"mixed", "gsm8k"} and not tree_chain["met"]  # gsm8k: chain faster; humaneval missing
    assert targets["EAGLE tree (eagle_tree) accepted length, mixed"]["met"]
    draft = targets["EAGLE tree (eagle_tree) drafting time per iteration over one verify pass (worst suite)"]
    assert draft["measured"] == pytest.approx(0.4) and not draft["met"]  # gsm8k: 0.2 / 0.5
    assert targets["the whole pipeline from a fresh GPU machine"]["measured"] is None
    assert not any(t["met"] for t in targets.values() if t["measured"] is None)

    assert "whole_depth" not in mixed["eagle_tree"]  # (records without histograms, as before the seventeenth study)

    results["mismatches"] = results["mismatches"][:1] + results["mismatches"][2:]  # the eager loop's mismatch does not count
    for r in records:
        r["routes"]["eagle_chain"]["hash"] = r["prompt"]
    results["summary"], _ = E.summaries(results)
    assert {t["name"]: t for t in E.targets(results)}[exact["name"]]["met"]  # the one mismatch left is a near-tie

    results["target_routes"] = {"tree": "eagle_chain", "chain": "eagle_tree"}  # (--tree-route, --chain-route)
    swapped = {t["name"]: t for t in E.targets(results)}
    assert swapped["EAGLE tree (eagle_chain) speedup over graphed plain decoding, gsm8k"]["measured"] == pytest.approx(1.8)
    over = swapped["EAGLE tree (eagle_chain) over chain (eagle_tree), accepted length and speedup [tree, chain], every suite"]
    assert over["measured"]["gsm8k"]["speedup"] == [1.8, 1.5]


def test_share_of_passes_accepting_the_whole_depth():
    records = [_record(f"m{i}", ["mixed"], "qa", {"eagle_tree": 2.0, "eagle_chain": 1.5}) for i in range(2)]
    hists = {"eagle_tree": ([1, 0, 2, 3], [0, 1, 0, 2]), "eagle_chain": ([4, 1], [2, 2, 1])}  # passes by accepted drafts
    for route, (first, second) in hists.items():
        records[0]["routes"][route]["accepted_histogram"], records[1]["routes"][route]["accepted_histogram"] = first, second
    results = {"records": records, "bootstrap_samples": 50,
               "routes": {"plain": None, "eagle_tree": {"mode": "tree", "depth": 3}, "eagle_chain": {"mode": "chain", "depth": 2}}}
    results["summary"], _ = E.summaries(results)
    tree, chain = results["summary"]["mixed"]["eagle_tree"], results["summary"]["mixed"]["eagle_chain"]
    assert tree["accepted_histogram"] == [1, 1, 2, 5] and tree["whole_depth"] == pytest.approx(5 / 9)  # all 3 of depth 3
    assert chain["accepted_histogram"] == [6, 3, 1] and chain["whole_depth"] == pytest.approx(1 / 10)
    assert "whole_depth" not in results["summary"]["mixed"]["plain"]
    results["targets"] = E.targets(results)
    row = next(line for line in E.markdown(results).splitlines() if line.startswith("| eagle_tree |"))
    assert row.endswith("| 0.56 |")


def test_drafting_time_splits_into_a_cost_per_pass_and_one_per_prompt():
    records = [_record(f"m{i}", ["mixed"], "qa", {"eagle_tree": 2.0}, accepted=a) for i, a in enumerate((2.0, 4.0, 8.0))]
    for r in records:  # 0.5 ms per pass and 3 ms per prompt
        r["routes"]["eagle_tree"]["draft_s"] = (0.5 * r["routes"]["eagle_tree"]["passes"] + 3.0) / 1000
    results = {"records": records, "bootstrap_samples": 50}
    results["summary"], _ = E.summaries(results)
    fit = results["summary"]["mixed"]["eagle_tree"]["draft_fit_ms"]
    assert fit["per_pass"] == pytest.approx(0.5) and fit["per_prompt"] == pytest.approx(3.0)
    assert "draft_fit_ms" not in results["summary"]["mixed"]["plain"]
    results["targets"] = E.targets(results)
    assert "eagle_tree 0.50 ms per pass + 3.0 ms per prompt" in E.markdown(results)


def test_a_narrow_spread_of_passes_gives_no_drafting_fit():
    """Prompts whose pass counts barely differ (64 and 65) would extrapolate the per-prompt cost from far away."""
    records = [_record(f"m{i}", ["mixed"], "qa", {"ngram_chain": 1.2}, accepted=a) for i, a in enumerate((1.0, 0.985))]
    results = {"records": records, "bootstrap_samples": 50}
    results["summary"], _ = E.summaries(results)
    assert [r["routes"]["ngram_chain"]["passes"] for r in records] == [64, 65]
    assert "draft_fit_ms" not in results["summary"]["mixed"]["ngram_chain"]


def test_a_collapsed_target_fails_the_acceptance_targets_and_the_report_says_why():
    """An undertrained target that repeats one continuation whatever the prompt accepts every draft: its speedups
    measure the engine, not the drafter. Drafting over verify is a property of the shapes and still counts."""
    records = [_record(f"{suite[0]}{i}", [suite], "qa", {"eagle_tree": 3.3, "eagle_chain": 3.0}, accepted=6.0 + (i < 2))
               for suite in E.SUITES for i in range(4)]
    for r in records:  # the chain accepts less than the tree
        r["routes"]["eagle_chain"]["passes"] += 3
    results = {"dtype": "bfloat16", "records": records, "bootstrap_samples": 50,
               "target_routes": {"tree": "eagle_tree", "chain": "eagle_chain"}}
    results["summary"], _ = E.summaries(results)
    acceptance = ("speedup over", "over chain", "accepted length, mixed")
    healthy = [t for t in E.targets(results) if any(k in t["name"] for k in acceptance)]
    assert len(healthy) == 5 and all(t["met"] for t in healthy) and E.collapsed(results) is None

    for i, r in enumerate(records):  # five distinct outputs over twelve prompts
        for run in r["routes"].values():
            run["hash"] = f"same{min(i, 4)}"
    results["targets"] = E.targets(results)
    found = {t["name"]: t for t in results["targets"]}
    void = [t for name, t in found.items() if any(k in name for k in acceptance)]
    assert len(void) == 5 and not any(t["met"] for t in void) and all(t["measured"] is not None for t in void)
    assert found["EAGLE tree (eagle_tree) drafting time per iteration over one verify pass (worst suite)"]["met"]
    assert found["exact output vs graphed plain decoding, speculative routes, all prompts (bfloat16)"]["met"]
    assert "Collapsed target: plain decoding gave 5 distinct outputs over 12 prompts" in E.markdown(results)

    records[5]["routes"]["plain"]["hash"] = records[5]["routes"]["eagle_tree"]["hash"] = "other"  # six of twelve: half
    assert E.collapsed(results) is None


def test_a_retired_route_of_an_earlier_study_is_still_reported():
    """A study's JSON from before a route was retired (``RETIRED_ROUTES``: the twentieth run's eagle_tree_fr_int8)
    keeps that route in its summary, its exactness count and its per-category table when its report is written again;
    the route can no longer be asked for."""
    records = [_record(f"m{i}", ["mixed"], category, {"eagle_tree_fr": 2.0, "eagle_tree_fr_int8": 2.5})
               for i, category in enumerate(("qa", "math"))]
    records[1]["routes"]["eagle_tree_fr_int8"]["hash"] = "x"
    results = {"records": records, "bootstrap_samples": 50}
    results["summary"], categories = E.summaries(results)
    assert all("eagle_tree_fr_int8" in by_route for by_route in categories["mixed"].values())
    retired = results["summary"]["mixed"]["eagle_tree_fr_int8"]
    assert retired["speedup"]["value"] == pytest.approx(2.5) and "accepted_length" in retired and retired["identical"] == 1
    assert E.exactness(results)[0].startswith("3/4 identical; 0/0 mismatches near-ties (2 prompts, 2 routes)")
    assert "eagle_tree_fr_int8" in E.RETIRED_ROUTES and "eagle_tree_fr_int8" not in E.ROUTES


def test_exactness_of_the_other_dtype_from_another_study(tmp_path):
    fp32 = {"dtype": "float32", "records": [_record(f"m{i}", ["mixed"], "qa", {"eagle_tree": 2.0}) for i in range(3)],
            "bootstrap_samples": 50}
    fp32["records"][0]["routes"]["eagle_tree"]["hash"] = "x"  # one output differs, not examined: not a near-tie
    (tmp_path / "fp32.json").write_text(json.dumps(fp32))
    bf16 = {"dtype": "bfloat16", "records": [_record("m0", ["mixed"], "qa", {"eagle_tree": 2.0})], "bootstrap_samples": 50}
    (tmp_path / "bf16.json").write_text(json.dumps(bf16))
    E.add_exactness_from(bf16, str(tmp_path / "fp32.json"))
    bf16["summary"], _ = E.summaries(bf16)
    exact = {t["name"]: t for t in E.targets(bf16)}
    other = exact["exact output vs graphed plain decoding, speculative routes, all prompts (float32)"]
    assert other["measured"] == "2/3 identical; 0/0 mismatches near-ties (3 prompts, 1 routes), in fp32.json" and not other["met"]
    assert exact["exact output vs graphed plain decoding, speculative routes, all prompts (bfloat16)"]["met"]
    with pytest.raises(SystemExit, match="measured in bfloat16 too"):
        E.add_exactness_from(bf16, str(tmp_path / "bf16.json"))


def test_report_files_from_partial_results_and_again_from_the_json(tmp_path):
    pytest.importorskip("matplotlib")
    results = {"dtype": "float32", "device": "cpu", "records": [_record("m0", ["mixed"], "qa", {"eagle_tree": 2.0})],
               "stopped": "--max-minutes 1 reached after 1 of 9 prompts"}
    E.write_report(results, str(tmp_path))
    written = json.loads((tmp_path / "e2e_trained.json").read_text())
    assert written["summary"]["mixed"]["eagle_tree"]["speedup"]["value"] == pytest.approx(2.0)
    table = (tmp_path / "e2e_trained.md").read_text()
    assert "| eagle_tree | 1 | 2.00 [2.00, 2.00] |" in table and "Stopped early" in table
    assert (tmp_path / "e2e_trained.png").stat().st_size > 1000
    again = E.main(["--plot", str(tmp_path / "e2e_trained.json"), "--out", str(tmp_path / "again")])
    assert again["targets"] == written["targets"] and (tmp_path / "again" / "e2e_trained.png").is_file()
    baseline_only = {"dtype": "float32", "device": "cpu", "records": [_record("m0", ["mixed"], "qa", {})]}
    E.write_report(baseline_only, str(tmp_path / "plain"))  # (no route but the baseline: a plot without a legend)
    assert (tmp_path / "plain" / "e2e_trained.png").is_file()


def test_bad_arguments_fail_with_one_line_before_loading(prompt_files, tmp_path):
    target = tmp_path / "target"
    target.mkdir()
    (target / "config.json").write_text("{}")
    base = ["--target", str(target), "--eagle", str(target), "--prompts-dir", str(prompt_files),
            "--humaneval", str(prompt_files / "HumanEval.jsonl.gz")]
    assert E.parse_args(base).routes == list(E.DEFAULT_ROUTES)
    assert E.parse_args(base + ["--routes", "ngram_tree", "eager"]).routes == ["plain", "eager", "ngram_tree"]
    for bad, message in (([], "error: --target"), (["--routes", "eagle_tree", "--eagle", str(tmp_path)], "error: --eagle"),
                         (["--prompts-dir", str(tmp_path)], "error: --prompts-dir"), (["--limit-prompts", "0"], "error: --limit-prompts"),
                         (["--humaneval", str(tmp_path / "none.gz")], "error: --humaneval"),
                         (["--routes", "eagle_chain", "--tree-route", "eagle_tree_d4_fr"], "error: --tree-route / --chain-route eagle_tree_d4_fr"),
                         (["--exactness-from", str(tmp_path / "none.json")], "error: --exactness-from")):
        with pytest.raises(SystemExit, match=f"^{message}"):
            E.parse_args((base if bad else base[2:]) + bad)
    with pytest.raises(SystemExit, match="^error: --minutes 5.0 leaves 0.00 min for the benchmark's measuring"):
        P.parse_args(["--out", str(tmp_path), "--minutes", "5", "--prompts-dir", str(prompt_files),
                      "--humaneval", str(prompt_files / "HumanEval.jsonl.gz")])


def _pipeline_args(prompt_files, work, *extra):
    return ["--out", str(work.parent / "out"), "--work", str(work), "--prompts-dir", str(prompt_files),
            "--humaneval", str(prompt_files / "HumanEval.jsonl.gz"), *extra]


def test_pipeline_plans_compilation_apart_and_refuses_a_plan_that_does_not_fit(prompt_files, tmp_path):
    work = tmp_path / "work"
    one = P.parse_args(_pipeline_args(prompt_files, work))  # (a) one call, every stage, the default budgets
    assert one.stages == list(P.STAGES) and sum(p["total"] for p in one.plan.values()) <= one.minutes - P.RESERVE_MINUTES
    assert one.plan["target"]["total"] == pytest.approx(P.overhead("target") + one.target_minutes)  # compile on top
    # the head's stage generates its distilled blocks first: their minutes are in its plan and its wall cap
    assert one.plan["eagle"]["total"] == pytest.approx(P.overhead("eagle") + one.distill_minutes + one.eagle_minutes)
    assert "0.25 self-distillation" in P.describe_plan(one)
    assert one.plan["bench"]["budget"] >= P.MIN_BENCH_MINUTES
    call1 = P.parse_args(_pipeline_args(prompt_files, work, "--stages", "eagle", "target", "--target-minutes", "3.5",
                                        "--eagle-minutes", "0.9"))  # (b) call 1
    assert call1.stages == ["target", "eagle"] and set(call1.plan) == {"target", "eagle"}
    with pytest.raises(SystemExit, match="^error: --minutes 8.75 is short of the 8.90 min planned for target.*pass --minutes 9.15 or more"):
        P.parse_args(_pipeline_args(prompt_files, work, "--stages", "target", "--target-minutes", "6"))
    # (b) call 2 needs the checkpoints of call 1 in --work: a cold machine is a clear error, not a retraining
    with pytest.raises(SystemExit, match="^error: --stages bench: no trained target in"):
        P.parse_args(_pipeline_args(prompt_files, work, "--stages", "bench"))
    for folder in ("target", "eagle"):
        (work / folder).mkdir(parents=True)
        (work / folder / "config.json").write_text("{}")
    call2 = P.parse_args(_pipeline_args(prompt_files, work, "--stages", "bench", "--bench-resume"))
    assert call2.plan["bench"]["budget"] == pytest.approx(8.75 - P.RESERVE_MINUTES - P.overhead("bench"))

    commands = P.stage_commands(one, bench_minutes=2.0, bench_wall=3.5)
    target = commands["target"]
    o = P.OVERHEAD_MINUTES["target"]
    assert target[target.index("--max-minutes") + 1] == "1.5"  # training time after the first step ...
    assert float(target[target.index("--max-wall-minutes") + 1]) == pytest.approx(o["prepare"] + o["compile"] + 1.5)  # ... capped
    eagle = commands["eagle"]
    assert eagle[eagle.index("--distill-minutes") + 1] == "0.25" and eagle[eagle.index("--distill-blocks") + 1] == "8192"
    o = P.OVERHEAD_MINUTES["eagle"]
    assert float(eagle[eagle.index("--max-wall-minutes") + 1]) == pytest.approx(o["prepare"] + 0.25 + o["compile"] + 0.75, abs=0.01)
    plain = P.parse_args(_pipeline_args(prompt_files, work, "--distill-minutes", "0"))
    assert "--distill-blocks" not in P.stage_commands(plain)["eagle"] and plain.plan["eagle"]["total"] == pytest.approx(P.overhead("eagle") + 0.75)
    bench = commands["bench"]
    assert bench[bench.index("--out") + 1] == str(work / "bench") and "--limit-prompts" not in bench and "--resume" not in bench
    assert bench[bench.index("--max-minutes") + 1] == "2.00" and bench[bench.index("--max-wall-minutes") + 1] == "3.50"
    assert "--resume" in P.stage_commands(call2)["bench"]
    env = P.stage_env(work)
    assert env["TORCHINDUCTOR_CACHE_DIR"].startswith(str(work)) and env["TRITON_CACHE_DIR"].startswith(str(work))


def test_pipeline_trains_an_earlier_head_on_with_its_own_blocks(prompt_files, tmp_path):
    """--eagle-resume: a later call trains call 1's head on (its optimizer state and distilled blocks), plans no new
    distillation, and refuses at once without that head or next to a new target."""
    work = tmp_path / "work"
    resume = ("--stages", "eagle", "--eagle-resume", "--eagle-minutes", "7.4", "--minutes", "9.35")
    for folder in ("target", "eagle"):
        (work / folder).mkdir(parents=True)
    (work / "target" / "config.json").write_text("{}")
    with pytest.raises(SystemExit, match="^error: --eagle-resume: no head to train on in .*trainer_state.pt missing"):
        P.parse_args(_pipeline_args(prompt_files, work, *resume))
    (work / "eagle" / "trainer_state.pt").write_bytes(b"")
    with pytest.raises(SystemExit, match="^error: --eagle-resume needs the eagle stage without the target stage"):
        P.parse_args(_pipeline_args(prompt_files, work, *resume, "--stages", "target", "eagle", "--target-minutes", "0.5",
                                    "--eagle-minutes", "0.5"))
    args = P.parse_args(_pipeline_args(prompt_files, work, *resume))
    assert args.plan["eagle"]["total"] == pytest.approx(P.overhead("eagle") + 7.4)  # no distillation planned
    eagle = P.stage_commands(args)["eagle"]
    assert "--resume" in eagle and "--distill-blocks" not in eagle and "--distill-minutes" not in eagle  # (trained without)
    (work / "eagle" / "distill_blocks.pt").write_bytes(b"")
    eagle = P.stage_commands(args)["eagle"]
    assert eagle[eagle.index("--distill-blocks") + 1] == "8192" and "--distill-minutes" not in eagle  # reused, not generated
    assert eagle[eagle.index("--max-minutes") + 1] == "7.4"


def test_pipeline_warns_of_a_target_whose_loss_is_still_near_the_unigrams(prompt_files, tmp_path):
    """The forty-seventh session's 24-layer target (6.77 nats/token against the unigram's 7.31) collapsed; the
    pipeline's report says so as soon as the target is trained, the 8-layer target's 3.85 passes."""
    def target_report(loss: float) -> dict:
        return {"steps": 46, "heldout": {"all": {"nats_per_token": loss}}, "unigram": {"entropy_nats_per_token": 7.31}}

    warning = P.undertrained(target_report(6.77))
    assert warning.startswith("the target's held-out loss, 6.77 nats/token after 46 steps, is 93% of the unigram's 7.31")
    assert P.undertrained(target_report(3.85)) is None and P.undertrained(None) is None
    args = P.parse_args(["--out", str(tmp_path / "out"), "--work", str(tmp_path / "work"), "--stages", "target",
                         "--prompts-dir", str(prompt_files), "--humaneval", str(prompt_files / "HumanEval.jsonl.gz")])
    (tmp_path / "work" / "target").mkdir(parents=True)
    (tmp_path / "work" / "target" / "report.json").write_text(json.dumps(target_report(6.77)))
    assert P.collect(args, [{"command": "c", "plan": {}, "stages": {}}])["target_warning"] == warning
    assert json.loads((tmp_path / "out" / "report.json").read_text())["target_warning"] == warning


def test_pipeline_carries_compiler_caches_from_one_machine_to_the_next(prompt_files, tmp_path):
    """--caches-to packs --work's caches; --caches-from unpacks them into a fresh --work (never over a warm one's own
    programs), and refuses at once a missing file or a pack with anything outside cache/."""
    import tarfile

    first, fresh, warm = tmp_path / "first", tmp_path / "fresh", tmp_path / "warm"
    programs = {"inductor/fx/ab/graph.py": "print('fx')", "triton/XYZ/kernel.cubin": "\x7fELF"}
    for name, text in programs.items():
        (first / "cache" / name).parent.mkdir(parents=True, exist_ok=True)
        (first / "cache" / name).write_text(text)
    pack = tmp_path / "packs" / "caches.tgz"
    P.pack_caches(first, str(pack))
    P.seed_caches(fresh, str(pack))
    unpacked = {str(f.relative_to(fresh / "cache")): f.read_text() for f in (fresh / "cache").rglob("*") if f.is_file()}
    assert unpacked == programs
    (warm / "cache" / "triton").mkdir(parents=True)
    (warm / "cache" / "triton" / "own.cubin").write_text("newer")
    P.seed_caches(warm, str(pack))
    assert [f.name for f in (warm / "cache").rglob("*") if f.is_file()] == ["own.cubin"]

    stray = tmp_path / "stray.tgz"
    with tarfile.open(stray, "w:gz") as archive:
        archive.add(first / "cache", arcname="cache")
        archive.add(first / "cache" / "triton" / "XYZ" / "kernel.cubin", arcname="target/model.safetensors")
    base = _pipeline_args(prompt_files, tmp_path / "work", "--stages", "target")
    not_tar = first / "cache" / "inductor" / "fx" / "ab" / "graph.py"
    for bad, message in ((stray, "'target/model.safetensors' is outside cache/"), (tmp_path / "none.tgz", "no such file"),
                         (not_tar, "not a tar archive")):
        with pytest.raises(SystemExit, match=f"^error: --caches-from {bad}: {message}"):
            P.parse_args([*base, "--caches-from", str(bad)])
    assert P.parse_args([*base, "--caches-from", str(pack)]).caches_from == str(pack)


def test_default_work_folder_is_git_ignored_inside_the_repository(prompt_files, tmp_path):
    import subprocess

    work = Path(P.DEFAULT_WORK)
    args = ["--out", str(tmp_path), "--stages", "target", "--prompts-dir", str(prompt_files),
            "--humaneval", str(prompt_files / "HumanEval.jsonl.gz")]
    assert work.is_relative_to(ROOT) and P.parse_args(args).work == str(work)
    if not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    assert subprocess.run(["git", "check-ignore", "-q", str(work / "target" / "model.safetensors")], cwd=ROOT).returncode == 0


def test_two_calls_share_the_work_folder_and_complete_the_pipeline(prompt_files, tmp_path, monkeypatch):
    """Call 1 trains (target, eagle), call 2 benchmarks from its checkpoints; stages stubbed."""
    work, out = tmp_path / "work", tmp_path / "out"
    ran = []

    def fake_stage(name, command, timeout_minutes, env):
        ran.append((name, command, timeout_minutes))
        folder = Path(command[command.index("--out") + 1])
        folder.mkdir(parents=True, exist_ok=True)
        if name == "bench":
            (folder / "e2e_trained.json").write_text(json.dumps({"dtype": "bfloat16", "records": [_record(
                "m0", ["mixed"], "qa", {"eagle_tree": 2.0})], "calls": [{"load_s": 1.0, "warmup_s": {"plain": 2.0}}]}))
        else:
            (folder / "config.json").write_text("{}")
            (folder / "report.json").write_text(json.dumps({"steps": 3}))
            (folder / P.TRAINER_STATE).write_text("")  # what --eagle-resume looks for
        return {"returncode": 0, "seconds": 1.0, "command": " ".join(command)}

    monkeypatch.setattr(P, "run_stage", fake_stage)
    first = P.main(_pipeline_args(prompt_files, work, "--stages", "target", "eagle", "--target-minutes", "3.5", "--eagle-minutes", "0.9"))
    assert [r[0] for r in ran] == ["target", "eagle"] and set(first["stages"]) == {"target", "eagle"}
    assert ran[0][2] == pytest.approx(P.overhead("target") + 3.5 + P.GRACE_MINUTES)
    assert not (out / "e2e_trained.json").exists() and first["target"] == {"steps": 3}
    second = P.main(_pipeline_args(prompt_files, work, "--stages", "bench"))
    assert [r[0] for r in ran] == ["target", "eagle", "bench"] and set(second["stages"]) == {"bench"}
    assert [set(c["stages"]) for c in second["calls"]] == [{"target", "eagle"}, {"bench"}]
    assert second["eagle"] == {"steps": 3}  # the training reports of call 1 in call 2's report
    results = json.loads((out / "e2e_trained.json").read_text())
    assert results["pipeline"]["completed"] and results["pipeline"]["calls"] == 2
    assert results["pipeline"]["command"].count("trained_pipeline.py") == 2
    assert results["pipeline"]["stages"] == {"target": 1.0, "eagle": 1.0, "bench": 1.0}
    # the head trained on (call 1b) and the study run again: each stage's time is summed over its calls
    P.main(_pipeline_args(prompt_files, work, "--stages", "eagle", "--eagle-resume", "--eagle-minutes", "0.9"))
    P.main(_pipeline_args(prompt_files, work, "--stages", "bench"))
    results = json.loads((out / "e2e_trained.json").read_text())
    assert results["pipeline"]["stages"] == {"target": 1.0, "eagle": 2.0, "bench": 1.0 + 1.0} and results["pipeline"]["calls"] == 4
    assert {t["name"]: t for t in second["benchmark_targets"]}["the whole pipeline from a fresh GPU machine"]["met"]
    # a new target starts a new history: a bench-only call then no longer counts the old training calls
    P.main(_pipeline_args(prompt_files, work, "--stages", "target"))
    assert [set(c["stages"]) for c in json.loads((work / P.CALLS_NAME).read_text())] == [{"target"}]


def test_warm_bench_warms_the_next_calls_study_up_while_the_head_trains(prompt_files, tmp_path, monkeypatch):
    """--warm-bench: next to a resumed eagle stage, the bench stage's command (with --bench-args) runs with its own
    --out in --work and a measuring budget that ends at once; its exit and warm-up time are in the call's stages,
    and the pipeline still counts as complete once the study has run. Autotuning choices timed meanwhile are deleted;
    a warm-up past its time is killed, one left by a failing eagle stage too. Refused without --eagle-resume or next
    to a bench stage."""
    work = tmp_path / "work"
    for folder in ("target", "eagle"):
        (work / folder).mkdir(parents=True)
        (work / folder / "config.json").write_text("{}")
    (work / "eagle" / P.TRAINER_STATE).write_bytes(b"")
    order, started = [], []
    choice = work / "cache" / "inductor" / "ab" / "kernel.best_config"  # (an autotuning choice timed next to the training)
    behaviour = {"finishes": True, "stage_fails": False}

    class FakeProcess:
        def __init__(self, command, env, stdout, stderr):
            started.append((command, env))
            order.append("warm started")
            choice.parent.mkdir(parents=True, exist_ok=True)
            choice.write_text("{}")
            if behaviour["finishes"]:
                out = Path(command[command.index("--out") + 1])
                out.mkdir(parents=True)
                (out / "e2e_trained.json").write_text(json.dumps({"warmup_total_s": 12.5, "records": []}))

        def wait(self, timeout=None):
            order.append("warm waited")
            if not behaviour["finishes"] and timeout is not None:
                raise P.subprocess.TimeoutExpired("e2e_trained.py", timeout)
            self.done = True
            return 0

        def poll(self):
            return 0 if getattr(self, "done", False) else None

        def kill(self):
            order.append("warm killed")

    def fake_stage(name, command, timeout_minutes, env):
        order.append(name)
        if behaviour["stage_fails"]:
            raise KeyboardInterrupt
        if name == "bench":
            (work / "bench").mkdir(exist_ok=True)
            (work / "bench" / "e2e_trained.json").write_text(json.dumps({"dtype": "bfloat16", "records": [_record(
                "m0", ["mixed"], "qa", {"eagle_tree": 2.0})], "calls": [{"load_s": 1.0, "warmup_s": {"plain": 2.0}}]}))
        return {"returncode": 0, "seconds": 1.0, "command": " ".join(command)}

    monkeypatch.setattr(P.subprocess, "Popen", FakeProcess)
    monkeypatch.setattr(P, "run_stage", fake_stage)
    call = ("--stages", "eagle", "--eagle-resume", "--eagle-minutes", "5.5", "--minutes", "7.2", "--warm-bench",
            "--bench-args", "--routes plain eagle_tree_fr")
    with pytest.raises(SystemExit, match="^error: --warm-bench needs .* no bench stage"):
        P.parse_args(_pipeline_args(prompt_files, work, *call, "--stages", "eagle", "bench", "--minutes", "20"))
    with pytest.raises(SystemExit, match="^error: --warm-bench needs --eagle-resume"):
        P.parse_args(_pipeline_args(prompt_files, work, "--stages", "eagle", "--warm-bench"))
    P.main(_pipeline_args(prompt_files, work, "--stages", "target", "--target-minutes", "1"))  # (call 1, its head aside)
    report = P.main(_pipeline_args(prompt_files, work, *call))
    assert order == ["target", "warm started", "eagle", "warm waited"]
    (command, env), = started
    assert Path(command[command.index("--out") + 1]) == work / P.WARM_NAME  # (not the study's bench/ folder)
    assert float(command[command.index("--max-wall-minutes") + 1]) < 1e-3 and command[-3:] == ["--routes", "plain", "eagle_tree_fr"]
    assert env["TORCHINDUCTOR_CACHE_DIR"] == str(work / "cache" / "inductor")  # the caches the next call reads
    assert report["stages"]["warm_bench"]["returncode"] == 0 and report["stages"]["warm_bench"]["warmup_total_s"] == 12.5
    assert not choice.exists()  # the study times its kernels' configurations again, alone on the GPU
    P.main(_pipeline_args(prompt_files, work, "--stages", "bench", "--bench-args", "--routes plain eagle_tree_fr"))
    results = json.loads((work.parent / "out" / "e2e_trained.json").read_text())
    assert results["pipeline"]["completed"] and "warm_bench" not in results["pipeline"]["stages"]  # (it ran beside the eagle stage)

    behaviour["finishes"] = False  # past its time: killed, and the earlier call's warm-up time is not reported as its own
    order.clear()
    report = P.main(_pipeline_args(prompt_files, work, *call))
    assert order == ["warm started", "eagle", "warm waited", "warm killed", "warm waited"]
    assert report["stages"]["warm_bench"]["returncode"] is None and report["stages"]["warm_bench"]["warmup_total_s"] is None
    behaviour["stage_fails"] = True  # the eagle stage interrupted: the warm-up goes with it
    order.clear()
    with pytest.raises(KeyboardInterrupt):
        P.main(_pipeline_args(prompt_files, work, *call))
    assert order == ["warm started", "eagle", "warm killed", "warm waited"]


def test_fp32_check_runs_beside_the_head_training_and_the_next_study_reports_it(prompt_files, tmp_path, monkeypatch):
    """--fp32-check: a float32 study on a copy of the head's weights, over plain decoding and the routes --bench-args
    names for the targets, waited for until the call's budget ends; its JSON and markdown reach --out, and the next
    bench stage reads its exact-output check (--exactness-from) and copies it into its own --out. A check cut off
    (killed while writing, or its call interrupted), still warming up, or of an earlier target is handled; a float32
    study is not given a float32 check. Refused without --eagle-resume."""
    pytest.importorskip("matplotlib")
    work, out = tmp_path / "work", tmp_path / "out"
    for folder in ("target", "eagle"):
        (work / folder).mkdir(parents=True)
        (work / folder / "config.json").write_text("{}")
    (work / "eagle" / P.TRAINER_STATE).write_bytes(b"")
    started, benches, waits, killed = [], [], [], []
    behaviour = {"fp32_json": None, "eagle_raises": False}

    class FakeProcess:
        def __init__(self, command, env, stdout, stderr):
            started.append(command)
            self.fp32, self.done = "float32" in command, False
            folder = Path(command[command.index("--out") + 1])
            folder.mkdir(parents=True)
            if self.fp32 and behaviour["fp32_json"] is not None:
                (folder / "e2e_trained.json").write_text(behaviour["fp32_json"])

        def wait(self, timeout=None):
            if self.fp32 and timeout is not None:
                waits.append(timeout)
                if behaviour["fp32_json"] == "{":
                    raise P.subprocess.TimeoutExpired("e2e_trained.py", timeout)
            self.done = True
            return 0

        def poll(self):
            return 0 if self.done else None

        def kill(self):
            killed.append("float32" if self.fp32 else "warm-up")
            self.done = True

    def fake_stage(name, command, timeout_minutes, env):
        if name == "eagle" and behaviour["eagle_raises"]:
            raise KeyboardInterrupt
        if name == "bench":
            benches.append(command)
            (work / "bench").mkdir(exist_ok=True)
            results = {"dtype": "bfloat16", "records": [_record("m0", ["mixed"], "qa", {"eagle_tree_fr": 2.0})],
                       "calls": [{"load_s": 1.0, "warmup_s": {"plain": 2.0}}]}
            if "--exactness-from" in command:  # (as e2e_trained.add_exactness_from records it)
                results["exactness_from"] = {"float32": {"file": "e2e_trained.json", "measured": "4/4 identical", "met": True}}
            (work / "bench" / "e2e_trained.json").write_text(json.dumps(results))
        return {"returncode": 0, "seconds": 1.0, "command": " ".join(command)}

    def bench_call(*extra):
        for copy in out.glob("e2e_trained_fp32.*"):
            copy.unlink()  # (the next call's --out, on the GPU machine: a new empty folder)
        P.main(_pipeline_args(prompt_files, work, "--stages", "bench", "--bench-args", bench_args, *extra))
        return benches[-1]

    monkeypatch.setattr(P.subprocess, "Popen", FakeProcess)
    monkeypatch.setattr(P, "run_stage", fake_stage)
    bench_args = "--routes plain eagle_chain_fr eagle_tree_fr eagle_tree_n32_fr --tree-route=eagle_tree_fr --chain-route eagle_chain_fr"
    call = ("--stages", "eagle", "--eagle-resume", "--eagle-minutes", "5.5", "--minutes", "9", "--warm-bench", "--fp32-check",
            "--bench-args", bench_args)  # (the call ends 2 minutes after the eagle stage's planned end)
    with pytest.raises(SystemExit, match="^error: --fp32-check needs --eagle-resume"):
        P.parse_args(_pipeline_args(prompt_files, work, "--stages", "eagle", "--fp32-check"))
    short = ("--stages", "eagle", "--eagle-resume", "--eagle-minutes", "1.0", "--fp32-check")
    with pytest.raises(SystemExit, match=r"^error: --fp32-check: --minutes 4.0 leaves it 2.95 min.* pass --minutes (\S+) ") as e:
        P.parse_args(_pipeline_args(prompt_files, work, *short, "--minutes", "4"))
    suggested = re.search(r"pass --minutes (\S+) ", str(e.value)).group(1)
    assert P.fp32_minutes(P.parse_args(_pipeline_args(prompt_files, work, *short, "--minutes", suggested))) >= P.FP32_MIN_MINUTES
    records = [_record(f"m{i}", ["mixed"], "qa", {"eagle_chain_fr": 1.0, "eagle_tree_fr": 1.0}) for i in range(2)]
    measured = json.dumps({"dtype": "float32", "records": records, "bootstrap_samples": 50})
    behaviour["fp32_json"] = measured
    report = P.main(_pipeline_args(prompt_files, work, *call))
    warm, fp32 = started
    assert "float32" not in warm and Path(fp32[fp32.index("--out") + 1]) == work / P.FP32_NAME
    head = Path(fp32[fp32.index("--eagle") + 1])
    assert head == work / P.FP32_HEAD and (head / "config.json").is_file() and not (head / P.TRAINER_STATE).exists()
    last_routes = len(fp32) - fp32[::-1].index("--routes")  # (the last --routes wins: the one after --bench-args')
    assert fp32[last_routes:last_routes + 3] == ["plain", "eagle_chain_fr", "eagle_tree_fr"] and fp32.count("--caveat") == 2
    cap = float(fp32[fp32.index("--max-wall-minutes") + 1])
    assert 7.5 < cap < 9 - P.RESERVE_MINUTES - P.FP32_STARTUP_MINUTES
    assert 60 * (9 - P.RESERVE_MINUTES) - 10 < waits[-1] <= 60 * (9 - P.RESERVE_MINUTES)  # (the call's end, not the stage's)
    assert report["stages"]["fp32_check"]["prompts"] == 2 and report["stages"]["fp32_check"]["returncode"] == 0
    assert json.loads((out / "e2e_trained_fp32.json").read_text())["dtype"] == "float32"
    assert (out / "e2e_trained_fp32.md").is_file()
    command = bench_call()
    assert command[-2:] == ["--exactness-from", str(work / P.FP32_NAME / "e2e_trained.json")]
    assert "4/4 identical, in e2e_trained_fp32.json" in (out / "e2e_trained.md").read_text()
    assert (out / "e2e_trained_fp32.md").is_file()
    assert "--exactness-from" not in bench_call("--bench-args", bench_args + " --dtype float32")

    behaviour["fp32_json"] = "{"  # killed while writing its JSON: no check passed on
    report = P.main(_pipeline_args(prompt_files, work, *call))
    assert report["stages"]["fp32_check"]["returncode"] is None and report["stages"]["fp32_check"]["prompts"] == 0
    assert "--exactness-from" not in bench_call()
    behaviour["fp32_json"] = json.dumps({"dtype": "float32", "records": []})  # still warming up: nothing to pass on
    P.main(_pipeline_args(prompt_files, work, *call))
    assert "--exactness-from" not in bench_call() and not (out / "e2e_trained_fp32.json").exists()
    behaviour.update(fp32_json=measured, eagle_raises=True)  # the call interrupted: the check's JSON has no markdown yet
    killed.clear()
    with pytest.raises(KeyboardInterrupt):
        P.main(_pipeline_args(prompt_files, work, *call))
    assert killed == ["warm-up", "float32"] and not (work / P.FP32_NAME / "e2e_trained.md").exists()
    assert "--exactness-from" in bench_call() and (out / "e2e_trained_fp32.md").is_file()
    behaviour["eagle_raises"] = False
    P.main(_pipeline_args(prompt_files, work, *call))
    assert (out / "e2e_trained_fp32.json").exists()
    P.main(_pipeline_args(prompt_files, work, "--stages", "target", "--target-minutes", "1"))  # a new target
    assert not (work / P.FP32_NAME).exists() and not (out / "e2e_trained_fp32.json").exists()


def test_caveats_reach_the_report_once_and_stay(tmp_path):
    pytest.importorskip("matplotlib")
    results = {"dtype": "float32", "records": [_record("m0", ["mixed"], "qa", {"eagle_tree": 2.0})], "bootstrap_samples": 50,
               "caveats": ["earlier"]}
    (tmp_path / "e2e_trained.json").write_text(json.dumps(results))
    E.main(["--plot", str(tmp_path / "e2e_trained.json"), "--out", str(tmp_path), "--caveat", "new", "--caveat", "earlier"])
    assert json.loads((tmp_path / "e2e_trained.json").read_text())["caveats"] == ["earlier", "new"]
    assert "Read with care:\n\n- earlier\n- new" in (tmp_path / "e2e_trained.md").read_text()


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """A tiny fla GDN target with a byte-level BPE tokenizer, and an untrained EAGLE head for it."""
    import torch
    from fla.models import GatedDeltaNetConfig, GatedDeltaNetForCausalLM

    from specla_compile.runtime.drafters.eagle_head import EagleConfig, EagleHead
    from specla_compile.training.tokenizer import train_bpe_tokenizer

    root = tmp_path_factory.mktemp("checkpoints")
    rng = random.Random(0)
    tokenizer = train_bpe_tokenizer([" ".join(rng.choices(WORDS, k=30)) for _ in range(50)], 300)
    tokenizer.save_pretrained(root / "target")
    torch.manual_seed(0)
    config = GatedDeltaNetConfig(hidden_size=32, num_hidden_layers=1, num_heads=2, head_dim=16, expand_v=1, vocab_size=len(tokenizer),
                                 fuse_cross_entropy=False, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    model = GatedDeltaNetForCausalLM(config)
    model.save_pretrained(root / "target")
    head = EagleHead(EagleConfig.for_target(model))
    head.save_pretrained(root / "eagle_unranked")  # (as heads trained before the token ranking)
    head.set_token_ranking(torch.randperm(len(tokenizer)))
    head.save_pretrained(root / "eagle")
    return root


def test_every_route_runs_and_matches_plain_decoding_in_fp32(checkpoints, prompt_files, tmp_path, monkeypatch):
    calls, lengths, tokens, run = [], [], [], E.Bench.run

    def failing_run(self, route, ids, n):  # ngram_tree fails on its fourth call: 2 warm-ups, prompt 1, prompt 2
        calls.append(route)
        tokens.append(n)
        lengths.append(ids.shape[1])
        if route == "ngram_tree" and calls.count(route) == 4:
            raise RuntimeError("a route that fails")
        return run(self, route, ids, n)

    monkeypatch.setattr(E.Bench, "run", failing_run)
    results = E.main(["--target", str(checkpoints / "target"), "--eagle", str(checkpoints / "eagle"), "--out", str(tmp_path),
                      "--prompts-dir", str(prompt_files), "--humaneval", str(prompt_files / "HumanEval.jsonl.gz"),
                      "--suites", "gsm8k", "humaneval", "--limit-prompts", "1", "--eager-prompts", "1", "--new-tokens", "5",
                      "--warmup-tokens", "2", "--device", "cpu", "--dtype", "float32", "--inner", "eager",
                      "--routes", *E.ROUTES, "--draft-vocab", "60"])
    assert set(results["errors"]) == {"ngram_tree"} and "a route that fails" in results["errors"]["ngram_tree"]
    assert set(results["warmup_s"]) == {*E.ROUTES, "fp32_check"}  # (the fp32 twin explaining mismatches: warmed too)
    # every EAGLE route says whether it replayed propose graphs: none on the CPU, and no capture error for that
    assert results["propose_graphs"] == {r: {"graphs": 0, "capture_error": "", "catch_up_graphs": 0, "catch_up_error": ""}
                                         for r in E.ROUTES if r.startswith("eagle")}
    # and what it drafted with: the draft vocabulary on the _fr routes, PyTorch's GEMMs on _pytorch, the CPU's weights
    drafters = results["drafters"]
    assert set(drafters) == {r for r in E.ROUTES if r.startswith("eagle")}
    assert {r for r, d in drafters.items() if d["draft_vocab"] == 60} == set(E.FR_ROUTES)
    assert drafters["eagle_tree_fr_pytorch"]["head_gemms"] == "pytorch" and {d["quantize"] for d in drafters.values()} == {"none"}
    assert "EAGLE drafters: " in (tmp_path / "e2e_trained.md").read_text()
    assert [r["suites"] for r in results["records"]] == [{"gsm8k": 0}, {"humaneval": 0}]
    assert set(results["records"][1]["routes"]) == set(E.ROUTES) - {"ngram_tree"}  # dropped, the others went on
    for record in results["records"]:
        assert {r["tokens"] for r in record["routes"].values()} == {5}  # (EOS ignored by default) every route makes 5 tokens
        assert all(r["passes"] >= 1 and r["seconds"] > 0 for name, r in record["routes"].items() if name in E.SPEC_ROUTES)
        for name, r in record["routes"].items():  # every pass in the histogram: the prefill's token, then per pass
            if name in E.SPEC_ROUTES:                 # its accepted drafts and the target's own (the budget may cut some)
                hist = r["accepted_histogram"]
                assert sum(hist) == r["passes"] and 1 + sum((k + 1) * n for k, n in enumerate(hist)) >= r["tokens"]
        assert all(0 < r["prefill_s"] < r["seconds"] for name, r in record["routes"].items() if name != "eager")
    assert not results.get("mismatches")  # greedy fp32: every route emits plain decoding's tokens
    targets = {t["name"]: t for t in results["targets"]}
    assert targets["exact output vs graphed plain decoding, speculative routes, all prompts (float32)"]["measured"].startswith(
        f"{2 * len(E.SPEC_ROUTES) - 1}/{2 * len(E.SPEC_ROUTES) - 1} ")  # (ngram_tree's second prompt failed)
    assert (tmp_path / "e2e_trained.md").is_file() and (tmp_path / "e2e_trained.png").is_file()
    # warm-up apart from measuring, on the shortest and the longest prompt (prefill's two fla paths)
    measured = [r["prompt_tokens"] for r in results["records"]]
    assert calls[:2] == ["plain", "plain"] and lengths[:2] == [min(measured), max(measured)] and min(measured) < max(measured)
    # each prompt's timed runs come after an untimed plain call (1 token) and one (2 tokens) of the first route of each
    # EAGLE drafter: the whole vocabulary's, and the draft vocabulary's with the default, specla, PyTorch and mixed GEMMs,
    # T = 1 and the head's own weights
    warm_ups = [i for i, (route, n) in enumerate(zip(calls, tokens)) if (route, n) == ("plain", 1)]
    assert len(warm_ups) == 2
    for i in warm_ups:
        timed = next(j for j in range(i + 1, len(calls)) if tokens[j] != 2)
        warmed = calls[i + 1 : timed]
        assert warmed[0] == "eagle_chain" and len(set(warmed)) == len(warmed) == 7
        assert calls[timed] == "plain" and tokens[timed] == 5 and lengths[i] == lengths[timed]
    assert results["warmup_total_s"] == pytest.approx(sum(results["warmup_s"].values()))
    assert [c["prompts"] for c in results["calls"]] == [2] and results["calls"][0]["measure_s"] > 0
    assert "warm-ups" in (tmp_path / "e2e_trained.md").read_text()


def test_a_route_failing_its_untimed_prompt_warm_up_is_dropped_and_the_study_goes_on(checkpoints, prompt_files, tmp_path,
                                                                                   monkeypatch):
    """The first EAGLE route fails in the untimed call before the first prompt's timed runs: that route is dropped
    (its error kept), the next EAGLE route takes over the warm-up, and every prompt is measured."""
    calls, run = [], E.Bench.run

    def failing_run(self, route, ids, n):  # eagle_chain's third call: two route warm-ups, then the prompt's warm-up
        calls.append((route, n))
        if route == "eagle_chain" and calls.count(("eagle_chain", 2)) == 3:
            raise RuntimeError("fails on this prompt")
        return run(self, route, ids, n)

    monkeypatch.setattr(E.Bench, "run", failing_run)
    results = E.main(["--target", str(checkpoints / "target"), "--eagle", str(checkpoints / "eagle"), "--out", str(tmp_path),
                      "--prompts-dir", str(prompt_files), "--suites", "gsm8k", "--limit-prompts", "2", "--new-tokens", "4",
                      "--warmup-tokens", "2", "--device", "cpu", "--dtype", "float32", "--inner", "eager",
                      "--routes", "plain", "eagle_chain", "eagle_tree"])
    assert set(results["errors"]) == {"eagle_chain"} and "fails on this prompt" in results["errors"]["eagle_chain"]
    assert [set(r["routes"]) for r in results["records"]] == [{"plain", "eagle_tree"}] * 2
    assert calls[-4:] == [("plain", 1), ("eagle_tree", 2), ("plain", 4), ("eagle_tree", 4)]


def test_resume_measures_only_the_prompts_left_and_keeps_every_call(checkpoints, prompt_files, tmp_path, monkeypatch):
    engines = []
    real_init = E.Bench.__init__

    def init(self, args):
        real_init(self, args)
        engines.append(self.gen)

    monkeypatch.setattr(E.Bench, "__init__", init)
    base = ["--target", str(checkpoints / "target"), "--eagle", str(checkpoints / "eagle"), "--out", str(tmp_path),
            "--prompts-dir", str(prompt_files), "--humaneval", str(prompt_files / "HumanEval.jsonl.gz"), "--suites", "gsm8k",
            "--routes", "plain", "eagle_chain", "ngram_chain", "--new-tokens", "4", "--warmup-tokens", "2", "--device", "cpu",
            "--dtype", "float32", "--inner", "eager"]
    first = E.main(base + ["--limit-prompts", "3", "--max-wall-minutes", "1e-6"])  # no prompt fits: all warm-up
    assert first["records"] == [] and "--max-wall-minutes" in first["stopped"] and set(first["warmup_s"]) == {
        "plain", "eagle_chain", "ngram_chain", "fp32_check"}
    assert set(engines[0]._engines) == {True}  # one engine (and graph) for plain decoding and both speculative routes
    second = E.main(base + ["--limit-prompts", "1", "--resume"])
    third = E.main(base + ["--limit-prompts", "3", "--resume"])
    assert [r["prompt"] for r in second["records"]] == [r["prompt"] for r in third["records"]][:1]
    assert len(third["records"]) == 3 and len({r["prompt"] for r in third["records"]}) == 3  # none measured twice
    assert [c["prompts"] for c in third["calls"]] == [0, 1, 2] and "stopped" not in third
    with pytest.raises(SystemExit, match="^error: --resume: .* another new_tokens"):
        E.main([*base, "--resume", "--new-tokens", "5"])


@pytest.mark.skipif(not os.environ.get("SPECLA_SLOW_TESTS"), reason="three processes, about a minute of CPU: SPECLA_SLOW_TESTS=1")
def test_pipeline_end_to_end_on_cpu_at_tiny_sizes(prompt_files, tmp_path):
    """Train a tiny target and head, then the study: every stage exits 0, six small files come out, and
    the speculative routes' fp32 outputs equal plain decoding's."""
    from test_train_target import write_corpus  # (the training tests' tiny ShareGPT file and code folder)

    (tmp_path / "corpus").mkdir()
    corpus = write_corpus(tmp_path / "corpus")
    data = f"--device cpu --sharegpt {corpus / 'sharegpt.json'} --code-dirs {corpus / 'code'} --heldout-fraction 0.1 --eval-blocks 2"
    target = f"{data} --vocab-size 300 --hidden-size 32 --num-layers 1 --num-heads 2 --head-dim 16 --seq-len 32 --batch-size 4 " \
             "--gdn-chunk 8 --warmup 2 --stop-after 12"
    eagle = f"{data} --seq-len 32 --batch-size 4 --steps 6 --dtype float32 --distill-batch 64"
    bench = "--device cpu --dtype float32 --inner eager --new-tokens 6 --warmup-tokens 2 --eager-prompts 1 " \
            "--suites gsm8k humaneval --routes plain eager eagle_tree ngram_chain"
    out = tmp_path / "out"
    report = P.main(["--out", str(out), "--work", str(tmp_path / "work"), "--minutes", "10", "--target-minutes", "1",
                     "--eagle-minutes", "1", "--limit-prompts", "1", "--prompts-dir", str(prompt_files),
                     "--humaneval", str(prompt_files / "HumanEval.jsonl.gz"),
                     "--target-args", target, "--eagle-args", eagle, "--bench-args", bench])
    assert {k: v["returncode"] for k, v in report["stages"].items()} == {"target": 0, "eagle": 0, "bench": 0}
    assert sorted(p.name for p in out.iterdir()) == sorted(["report.json", "loss_curve.png", "tokenizer.json",
                                                            "e2e_trained.json", "e2e_trained.md", "e2e_trained.png"])
    saved = json.loads((out / "report.json").read_text())
    assert saved["target"]["steps"] == 12 and saved["target"]["config"]["hidden_size"] == 32
    assert saved["eagle"]["steps"] == 6 and 0 <= saved["eagle"]["heldout_top1"]["all"]["top1"] <= 1
    assert saved["eagle"]["self_distillation"]["blocks"] >= 64  # (the pipeline's default: a time cap, at least one batch)
    results = json.loads((out / "e2e_trained.json").read_text())
    assert [r["suites"] for r in results["records"]] == [{"gsm8k": 0}, {"humaneval": 0}]
    assert all(set(r["routes"]) == {"plain", "eager", "eagle_tree", "ngram_chain"} for r in results["records"])
    targets = {t["name"]: t for t in results["targets"]}
    assert targets["exact output vs graphed plain decoding, speculative routes, all prompts (float32)"]["met"]
    assert targets["the whole pipeline from a fresh GPU machine"]["met"]
    assert "trained_pipeline.py" in targets["the whole pipeline from a fresh GPU machine"]["measured"]


def test_fp32_margins_come_from_the_pytorch_recurrence(checkpoints, prompt_files, monkeypatch):
    """A mismatch's fp32 logits come from an fp32 copy of the bf16 target run by PyTorch code alone (fla's
    recurrence swapped for the chunked one: no Triton kernel to autotune), equal to the fp32 model's own."""
    import torch

    from specla_compile.training import chunked_gdn

    entered = []
    real = chunked_gdn.plain_torch_fla
    monkeypatch.setattr(chunked_gdn, "plain_torch_fla", lambda *a: entered.append(a) or real(*a))
    args = E.parse_args(["--target", str(checkpoints / "target"), "--eagle", str(checkpoints / "eagle"), "--out", "unused",
                         "--prompts-dir", str(prompt_files), "--suites", "gsm8k", "--device", "cpu", "--dtype", "bfloat16",
                         "--inner", "eager"])
    bench = E.Bench(args)
    ids = torch.randint(0, bench.model.config.vocab_size, (1, 37), generator=torch.Generator().manual_seed(3))
    logits = bench.fp32_logits(ids)
    assert entered and logits.dtype == torch.float32 and bench.model.dtype == torch.bfloat16
    reference = bench.model.float()(input_ids=ids).logits[0, -1]  # fla's own path (the CPU references)
    torch.testing.assert_close(logits, reference, rtol=1e-4, atol=1e-4)

    # routes parting from plain decoding at one position share its fp32 forward; another position has its own
    forwards = []
    monkeypatch.setattr(bench, "fp32_logits", lambda prefix: forwards.append(prefix.shape[1]) or logits)
    plain, seen = [5, 6, 7, 8], {}
    first, again = (bench.near_tie(ids, plain, other, seen) for other in ([5, 6, 9, 9], [5, 6, 1, 2]))
    later = bench.near_tie(ids, plain, [5, 6, 7, 3], seen)
    assert forwards == [37 + 2, 37 + 3] and first["position"] == again["position"] == 2 and later["position"] == 3
    assert first["fp32_margin"] == pytest.approx(float((logits[7] - logits[9]).abs()))
    assert again["fp32_margin"] == pytest.approx(float((logits[7] - logits[1]).abs()))


def test_the_draft_vocabulary_route_needs_a_ranked_head(checkpoints, prompt_files):
    """The draft-vocabulary routes and the other tree shapes run only when named; the draft-vocabulary routes
    refuse at once, in one line, a head without a token ranking."""
    base = ["--target", str(checkpoints / "target"), "--prompts-dir", str(prompt_files), "--suites", "gsm8k",
            "--device", "cpu"]
    assert {*E.FR_ROUTES, *E.TREE_SHAPES}.isdisjoint(E.parse_args([*base, "--eagle", str(checkpoints / "eagle")]).routes)
    named = E.parse_args([*base, "--eagle", str(checkpoints / "eagle"), "--routes", "eagle_tree_fr"])
    assert named.routes == ["plain", "eagle_tree_fr"]
    with pytest.raises(SystemExit, match="^error: --routes eagle_tree_fr: the head in .* has no token ranking"):
        E.parse_args([*base, "--eagle", str(checkpoints / "eagle_unranked"), "--routes", "eagle_tree_fr"])
    with pytest.raises(SystemExit, match="^error: --routes eagle_tree_fr eagle_tree_d4_fr: the head in .* has no token"):
        E.parse_args([*base, "--eagle", str(checkpoints / "eagle_unranked"), "--routes", "eagle_tree_d4_fr", "eagle_tree_fr"])
    with pytest.raises(SystemExit, match="^error: --draft-vocab must be positive"):
        E.parse_args([*base, "--eagle", str(checkpoints / "eagle"), "--draft-vocab", "0"])


def test_route_suffixes_pick_the_drafters_options(checkpoints, prompt_files, tmp_path):
    """The draft-vocabulary routes share a drafter per option set: ``_specla`` / ``_pytorch`` / ``_mixed`` draft with
    the fused head GEMMs / PyTorch code / the default before ``"triton"``, ``_t1`` ranks its tree by the head's raw probabilities,
    ``_unquantized`` drafts with the head's own weights (the default: int8 on CUDA); the others take the head's calibrated temperature, the default GEMMs and the default weights. Each drafter's first route runs untimed before a prompt."""
    import shutil

    calibrated = tmp_path / "eagle"
    shutil.copytree(checkpoints / "eagle", calibrated)
    config = json.loads((calibrated / "config.json").read_text())
    (calibrated / "config.json").write_text(json.dumps({**config, "acceptance_temperature": 0.5}))
    args = E.parse_args(["--target", str(checkpoints / "target"), "--eagle", str(calibrated), "--prompts-dir", str(prompt_files),
                         "--suites", "gsm8k", "--device", "cpu", "--inner", "eager", "--routes", "eagle_tree_fr",
                         "eagle_tree_d4_fr", "eagle_tree_fr_t1", "eagle_tree_d4_fr_t1", "eagle_tree_d4_fr_specla",
                         "eagle_tree_fr_pytorch", "eagle_tree_fr_mixed", "eagle_tree_fr_unquantized"])
    bench = E.Bench(args)
    drafters = bench.drafters
    assert drafters["eagle_tree_fr"] is drafters["eagle_tree_d4_fr"] and drafters["eagle_tree_fr_t1"] is drafters["eagle_tree_d4_fr_t1"]
    options = {r: (drafters[r].head_gemms, drafters[r].acceptance_temperature, drafters[r].quantize) for r in args.routes[1:]}
    assert options == {"eagle_tree_fr": ("triton", 0.5, "none"), "eagle_tree_d4_fr": ("triton", 0.5, "none"),
                       "eagle_tree_fr_t1": ("triton", 1.0, "none"), "eagle_tree_d4_fr_t1": ("triton", 1.0, "none"),
                       "eagle_tree_d4_fr_specla": ("specla", 0.5, "none"), "eagle_tree_fr_pytorch": ("pytorch", 0.5, "none"),
                       "eagle_tree_fr_mixed": ("mixed", 0.5, "none"), "eagle_tree_fr_unquantized": ("triton", 0.5, "none")}
    assert drafters["eagle_tree_fr_unquantized"] is not drafters["eagle_tree_fr"]  # (on CUDA the default is int8)
    warmups = bench.prompt_warmups(args.routes)  # (plain's, then one route of each drafter)
    assert warmups[0] == ("plain", 1) and all(tokens == 2 for _, tokens in warmups[1:])
    assert sorted(id(drafters[r]) for r, _ in warmups[1:]) == sorted({id(drafters[r]) for r in args.routes[1:]})
    assert len(warmups) == 7
