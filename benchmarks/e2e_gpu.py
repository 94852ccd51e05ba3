"""End-to-end speed of the static, CUDA-graphed engine on an H200 (random weights, controlled acceptance).

Every speedup is a ratio measured in the same process against plain decoding through the same engine
(``SpeculativeGenerator.decode``: same static buffers, CUDA graphs and kernels, one token per pass),
next to the eager model's own token-by-token loop. Acceptance is controlled as in the SpecLA paper's
Figure 12: the drafter proposes the target's own greedy continuation (known from the plain run) and
replaces each token by a wrong one with probability 1 - p. Trees are chains with wrong siblings: at
every depth the chain token comes first and ``top_k - 1`` sibling leaves follow; when the chain token
is wrong, each sibling holds the true token with probability p in turn (a drafter's second choices).

    python benchmarks/e2e_gpu.py --out $OUT                      # every section (H200, about 10 minutes)
    python benchmarks/e2e_gpu.py --sections fla_b1 --layers 4    # a quick look
    python benchmarks/e2e_gpu.py --sections fold_ab --out $OUT   # the folds not yet timed against the defaults
    python benchmarks/e2e_gpu.py --sections fla_sampling --out $OUT   # sampled chains over plain sampling
    python benchmarks/e2e_gpu.py --plot benchmarks/results/e2e_gpu.json   # markdown + PNG from a JSON

Decode figures exclude the prompt's prefill (the same eager call for every route); ``e2e`` figures
include it.
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import json
import logging
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
import traceback

import numpy as np
import torch

from specla_compile.runtime.drafting import Draft, Drafter

FLA_1P3B = dict(hidden_size=2048, num_hidden_layers=24, num_heads=8, head_dim=256, expand_v=1, vocab_size=32000)
QWEN3_5_SMALL = dict(  # a Qwen3.5 0.8B-class text config: 3 GDN layers to 1 full-attention layer
    vocab_size=248320, hidden_size=1024, intermediate_size=3584, num_hidden_layers=24, num_attention_heads=8,
    num_key_value_heads=2, head_dim=256, linear_num_key_heads=16, linear_num_value_heads=16,
    linear_key_head_dim=128, linear_value_head_dim=128, tie_word_embeddings=False,
)
P_VALUES = (0.5, 0.6, 0.7, 0.8, 0.9, 1.0)
CHAIN_LENGTHS = (2, 4, 8, 12)
TREES = ((2, 16), (4, 16), (2, 32), (4, 32))  # (top_k, nodes)
BACKEND_OPTIONS: dict = {}  # --backend: the specla backend's options for every compile of this process
ORACLE = {"device": True}  # --oracle: the controlled routes' drafts made on the device (else on the host)
SECTIONS = ("fla_b1", "fla_batch", "qwen", "exact_fp32", "warm_start", "fla_quick", "fla_profile", "fla_passes", "fold_ab",
            "fla_sampling")


def build(family: str, dtype: torch.dtype, layers: int | None = None) -> torch.nn.Module:
    import specla_compile  # noqa: F401  (routes the GDN entry points)

    torch.manual_seed(0)
    if family == "fla":
        from fla.models import GatedDeltaNetConfig, GatedDeltaNetForCausalLM

        shape = {**FLA_1P3B, "num_hidden_layers": layers or FLA_1P3B["num_hidden_layers"]}
        model = GatedDeltaNetForCausalLM(GatedDeltaNetConfig(**shape, fuse_cross_entropy=False))
    else:
        from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

        n = layers or QWEN3_5_SMALL["num_hidden_layers"]
        config = Qwen3_5TextConfig(**{**QWEN3_5_SMALL, "num_hidden_layers": n},
                                   layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"] * (n // 4))
        model = Qwen3_5ForCausalLM(config)
    peaked_logits(model)
    model.generation_config.eos_token_id = None  # random weights: every run decodes its full length
    return model.cuda().to(dtype).eval()


def peaked_logits(model: torch.nn.Module, seed: int = 1) -> None:
    """Random weights give near-tied logits: at the 1.3B shape bf16 and fp32 logits differ by up to 4
    where the top-2 margin is about 2.7 (CPU, 64 positions: 56/64 argmax agree), so rounding, not the
    model, picks many tokens, and the plain and the speculative runs part ways at the first such flip;
    after that the oracle's continuation no longer fits either history. Make the output peaked, as a
    trained model's is: larger input embeddings, layer outputs (o_proj, down_proj) scaled by 0.1, and an
    output head whose row for token sigma(t) is token t's embedding (sigma a fixed permutation). Every
    layer still runs (the cost is unchanged) and still shapes the logits."""
    embedding = model.get_input_embeddings().weight
    head = model.get_output_embeddings().weight
    perm = torch.randperm(embedding.shape[0], generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        embedding.mul_(8.0)
        head.copy_(embedding[perm] * 20.0 / embedding.norm(dim=-1, keepdim=True)[perm])
        for name, module in model.named_modules():
            if name.endswith(("o_proj", "down_proj")) and isinstance(module, torch.nn.Linear):
                module.weight.mul_(0.1)


# --- controlled drafts -----------------------------------------------------------------------------


class OracleDrafter(Drafter):
    """Drafts the known greedy continuation of every row, each token wrong with probability 1 - p
    (see the module docstring for trees): the first draft of a call on the host, and with ``device`` every
    later one on the device, from the pass's outputs (``propose_after``), as a drafter on the GPU does: the
    generator then queues each pass before it reads the one before."""

    vocab_size = None
    needs_features = False

    def __init__(self, truth: list[list[int]], p: float, depth: int, top_k: int = 1, vocab: int = 32000, seed: int = 0,
                 device: bool = False):
        self.truth, self.p, self.depth, self.top_k, self.vocab = truth, p, depth, top_k, vocab
        self.rng = random.Random(seed)
        self.device = device
        self.generator: torch.Generator | None = None  # the device's draws, seeded from ``seed``

    def check_vocab(self, vocab_size: int) -> None:
        self.vocab = vocab_size

    def begin(self, sequences, features=None):
        self.prompt_lengths = [s.numel() for s in sequences]
        self.done = [0] * len(sequences)  # per row, tokens emitted when its last host draft was made
        self.truth_on_device: torch.Tensor | None = None

    def propose_after(self, last, config, max_length):
        if not self.device:
            return None
        rows, device = last.tokens.shape[0], last.tokens.device
        if self.truth_on_device is None:  # the first draft after the host's: each row's truth, padded, and its position
            width = max(len(t) for t in self.truth) + self.depth
            def upload(rows) -> torch.Tensor:  # (on CUDA from page-locked memory: no wait for the pass queued before)
                host = torch.as_tensor(rows)
                return (host.pin_memory() if device.type == "cuda" else host).to(device, non_blocking=True)

            self.truth_on_device = upload([t + [0] * (width - len(t)) for t in self.truth])
            self.emitted = upload(self.done)
            self.parents_on_device = upload(_sibling_chain_parents(self.depth, self.top_k))
            if self.generator is None or self.generator.device != device:
                self.generator = torch.Generator(device).manual_seed(self.rng.randrange(1 << 62))
        self.emitted += last.counts  # tokens emitted once this pass is committed, the new pending one included
        columns = (self.emitted[:, None] + torch.arange(self.depth, device=device)).clamp(max=self.truth_on_device.shape[1] - 1)
        truth = self.truth_on_device.gather(1, columns)[..., None]  # [B, depth, 1]
        hit = torch.rand(rows, self.depth, self.top_k, device=device, generator=self.generator) < self.p
        right = hit & (hit.cumsum(-1) == 1)  # the chain token, else the first sibling that drew the truth
        wrong = (truth + 1 + torch.randint(self.vocab - 1, right.shape, device=device, generator=self.generator)) % self.vocab
        nodes = torch.where(right, truth, wrong).flatten(1)
        tokens = torch.cat([last.next_token[:, None], nodes], dim=1)
        return Draft(tokens, self.parents_on_device.expand(rows, -1), chain=self.top_k == 1)

    def commit(self, rows, tokens, features=None):
        pass

    def _wrong(self, token: int) -> int:
        return (token + 1 + self.rng.randrange(self.vocab - 1)) % self.vocab

    def propose(self, request, config):
        rows = []
        for b, seq in zip(request.rows, request.sequences):
            done = self.done[b] = seq.numel() - self.prompt_lengths[b]  # tokens emitted so far, the pending one included
            truth = self.truth[b][done : done + self.depth] + [0] * self.depth
            nodes = [int(seq[-1])]
            for d in range(self.depth):
                right = self.rng.random() < self.p
                nodes.append(truth[d] if right else self._wrong(truth[d]))
                for _ in range(self.top_k - 1):  # siblings: the drafter's next choices at this depth
                    hit = not right and self.rng.random() < self.p
                    right = right or hit
                    nodes.append(truth[d] if hit else self._wrong(truth[d]))
            rows.append(nodes)
        return _pack(rows, self.depth, self.top_k)


def _pack(rows: list[list[int]], depth: int, top_k: int):
    """Tokens of sibling-augmented chains -> Draft: node 0, then per depth the chain node (parent: the
    previous chain node) and its ``top_k - 1`` siblings (same parent, leaves)."""
    parents = _sibling_chain_parents(depth, top_k)
    # (numpy builds the tensor from nested lists 4x faster than torch.tensor; a chain says so, and the engine need not read parents)
    return Draft(torch.from_numpy(np.array(rows, dtype=np.int64)), parents.expand(len(rows), -1), chain=top_k == 1)


@functools.cache
def _sibling_chain_parents(depth: int, top_k: int) -> torch.Tensor:
    """``[1, 1 + depth * top_k]``: one row's parents in :func:`_pack`'s layout (built once: 16 rows' nested lists
    to a tensor cost the benchmark's host 20 us an iteration)."""
    parents = [-1]
    chain = 0
    for _ in range(depth):
        first = len(parents)
        parents += [chain] * top_k
        chain = first
    return torch.tensor([parents])


# --- timing ---------------------------------------------------------------------------------------


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(fn):
    sync()
    start = time.perf_counter()
    out = fn()
    sync()
    return out, time.perf_counter() - start


def warm_gpu(gen, prompt, tokens: int = 512) -> None:
    """Get the machine to a steady state before a timed route: inductor's compile workers spawned and
    idle, then plain decoding of ``tokens`` tokens (about a second at the 1.3B shape). In a process that
    loaded its graphs from a warm cache, inductor's worker pool spawned during the first timed run (a
    child process at 215% CPU on the 16-core H200 host) and that run's 16-pass device loops took 14%
    longer by CUDA events, which count the GPU waiting for launches (33.9 against 29.7 ms; 2.14
    against 1.88 ms/token); later runs, and a process without the pool, did not. A token count, not a
    duration: tensor-parallel ranks must run the same passes."""
    from torch._inductor.async_compile import AsyncCompile

    AsyncCompile.wait_pool_ready()
    for _ in range(tokens // 128):
        gen.decode(prompt, 128)
    sync()


def decode_seconds(out, wall: float) -> float:
    return wall - out.stats.prefill_seconds


def run_route(gen, prompts, new_tokens: int, drafter=None, config=None, plain: bool = False, truths=None,
              sample: dict | None = None) -> dict:
    """Greedy runs of every prompt row-batch (``sample``: sampled with these settings, each call on its own seeded
    CUDA generator); returns time, tokens, acceptance and the sequences. The benchmark swaps the generator's
    drafter and config between routes, so that every route shares one compiled model and one engine."""
    warm_gpu(gen, prompts[0])
    if drafter is not None:
        gen.drafter, gen.config = drafter, config
        drafter.truth = truths[0]
        gen.generate(prompts[0], 16, **sampled(sample, -1))  # the route's own first use (a device drafter's first draws took 0.1 s), untimed
    elif sample is not None:
        gen.decode(prompts[0], 16, **sampled(sample, -1))  # (its sampling bucket's capture, untimed)
    decode, e2e, tokens, passes, accepted, sequences = 0.0, 0.0, 0, 0, [], []
    phases = dict.fromkeys(("draft_seconds", "verify_seconds", "commit_seconds"), 0.0)
    for i, prompt in enumerate(prompts):
        if drafter is not None:
            drafter.truth = truths[i]
        settings = sampled(sample, i)
        out, wall = timed(lambda: gen.decode(prompt, new_tokens, **settings) if plain else gen.generate(prompt, new_tokens, **settings))
        decode += decode_seconds(out, wall)
        e2e += wall
        tokens += out.stats.new_tokens
        passes += out.stats.iterations
        accepted += out.stats.accepted_drafts
        for phase in phases:
            phases[phase] += getattr(out.stats, phase)
        sequences.append(out.sequences)
    return {
        "decode_s": decode, "e2e_s": e2e, "calls": len(prompts), "new_tokens": tokens, "passes": passes,
        "ms_per_token": 1000 * decode / tokens, "tokens_per_s": tokens / decode,
        "tokens_per_pass": tokens / max(passes, 1), "mean_accepted": sum(accepted) / max(len(accepted), 1),
        "ms_per_pass": {phase.split("_")[0]: 1000 * t / max(passes, 1) for phase, t in phases.items()},
        "sequences": sequences,
    }


def sampled(sample: dict | None, seed: int) -> dict:
    """``generate``'s keywords for one sampled call (a CUDA generator seeded with ``seed``), or none (greedy)."""
    return {} if sample is None else {**sample, "generator": torch.Generator("cuda").manual_seed(seed)}


def bucket_key(nodes: int, chain: bool = True) -> tuple:
    """The engine's key of a bucket: plain decoding's 1-node pass loops on the device, drafts accept greedily."""
    return (nodes, chain, "loop" if nodes == 1 else "accept", None)


def pass_ms(gen, nodes: int, pending: int = 0, repeats: int = 50, chain: bool = True) -> float:
    """Median replay time of one captured pass of the ``nodes``-node chain (or tree) bucket that first
    commits ``pending`` records (CUDA events; the records' values do not matter for the time, and the
    next call's ``start`` reloads the cache)."""
    engine = next(iter(gen._engines.values()))
    bucket = engine.buckets[bucket_key(nodes, chain)]
    graph = bucket.graph
    times = []
    for _ in range(repeats):
        if bucket.session.num_pending is not None:
            bucket.session.num_pending.fill_(pending)
        bucket.step.zero_()  # (the plain loop's graph logs its token at this step: keep it in range)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


RECURRENCE_KERNELS = ("_recurrent_kernel", "_parallel_kernel", "_one_token_gates_kernel",  # specla's, one a layer
                      "_one_token_conv_gates_kernel")
KERNEL_KINDS = (  # kernel name fragment -> kind, first match wins (inductor's names hold op names such as _to_copy)
    ("gemm", "gemm"), ("gemv", "gemm"), ("nvjet", "gemm"), ("cutlass", "gemm"), ("xmma", "gemm"), ("triton_", "inductor"),
    ("nccl", "collective"), ("recurrent", "recurrence"), *((name, "recurrence") for name in RECURRENCE_KERNELS), ("chunk", "recurrence"), ("delta", "recurrence"),
    ("conv", "conv"), ("copy", "copy"), ("memcpy", "copy"), ("memset", "copy"),
)


def kernel_profile(graph, replays: int = 5, trace_path: str | None = None) -> dict:
    """What one captured pass spends its GPU time on: kernels per replay and their busy time by kind
    (GEMM, recurrence, conv, copies, inductor's fused elementwise, other), from a profiler trace of
    ``replays`` replays. Busy time below the replay's wall time is launch gaps inside the graph."""
    from torch.profiler import ProfilerActivity, profile

    graph.replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        for _ in range(replays):
            graph.replay()
        torch.cuda.synchronize()
    path = trace_path or "/tmp/specla_pass_trace.json"
    prof.export_chrome_trace(path)
    with open(path) as f:
        return summarize_kernels(json.load(f)["traceEvents"], replays)


def op_profile(engine, bucket, top: int = 20) -> list[dict]:
    """Which operators launch a pass's GPU work: one uncaptured run of ``bucket``'s step (the same
    kernels its graph replays) under the profiler, grouped by operator and input shapes, costliest
    first (``specla::`` ops own the Triton kernels they launch). Attributes the copies of a profile."""
    from torch.profiler import ProfilerActivity, profile

    with torch.no_grad(), profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU], record_shapes=True) as prof:
        engine._step(bucket)
        torch.cuda.synchronize()
    rows = sorted(prof.key_averages(group_by_input_shape=True), key=lambda e: -e.self_device_time_total)[:top]
    return [{"op": e.key, "shapes": str(e.input_shapes)[:160], "calls": e.count, "device_ms": round(e.self_device_time_total / 1000, 4)}
            for e in rows]


def replay_costs(graph, replays: int = 32) -> dict:
    """Host time of one ``replay()`` call (launching the graph) against the wall time per replay of
    ``replays`` back-to-back replays: if the launch costs more than the GPU work, the loop is host-bound."""
    graph.replay()
    torch.cuda.synchronize()
    started = time.perf_counter()
    for _ in range(replays):
        graph.replay()
    launched = time.perf_counter()
    torch.cuda.synchronize()
    done = time.perf_counter()
    return {"launch_ms": 1000 * (launched - started) / replays, "wall_ms_per_replay": 1000 * (done - started) / replays}


def kernel_kind(event: dict) -> str:
    """A trace event's kind (``KERNEL_KINDS``: the first fragment its name holds), else ``"other"``."""
    return next((k for frag, k in KERNEL_KINDS if frag in event.get("name", "").lower()), "other")


def summarize_kernels(trace_events: list[dict], replays: int) -> dict:
    """A chrome trace's GPU events (kernels, copies, fills) per replay: count, busy time, first-start to
    last-end span, time by kind (``KERNEL_KINDS``) and on the critical path by kind, and the costliest kernels with
    their calls."""
    events = [e for e in trace_events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    kinds, names, calls = {}, {}, {}
    for e in events:
        kind = kernel_kind(e)
        name = e.get("name", "")[:80]
        kinds[kind] = kinds.get(kind, 0.0) + e["dur"] / 1000 / replays
        names[name] = names.get(name, 0.0) + e["dur"] / 1000 / replays
        calls[name] = calls.get(name, 0) + 1 / replays
    span = (max(e["ts"] + e["dur"] for e in events) - min(e["ts"] for e in events)) / 1000 / replays if events else 0.0
    top = sorted(names.items(), key=lambda kv: -kv[1])[:12]
    ordered = sorted(events, key=lambda e: e["ts"])
    # what each kernel adds to its replay's span: its end past every end before it. Under PDL a kernel starts early
    # and waits (its duration counts the wait); these increments sum to each replay's span (first start to last end)
    # and say what the pass waits for. Replays are told apart at the widest idle gaps (the host launching the next).
    critical: dict[str, float] = {}
    adds: dict[int, float] = {}  # (each event's own increment, us)
    last_end, idle = None, []
    for i, e in enumerate(ordered):
        if last_end is not None and e["ts"] > last_end:
            idle.append((e["ts"] - last_end, i))
        last_end = e["ts"] + e["dur"] if last_end is None else max(last_end, e["ts"] + e["dur"])
    starts = {i for _, i in sorted(idle, reverse=True)[: max(replays - 1, 0)]}
    last_end = None
    for i, e in enumerate(ordered):
        end = e["ts"] + e["dur"]
        added = e["dur"] if last_end is None or i in starts else max(0.0, end - last_end)
        last_end = end if last_end is None or i in starts else max(last_end, end)
        adds[id(e)] = added
        kind = kernel_kind(e)
        critical[kind] = critical.get(kind, 0.0) + added / 1000 / replays
    # one layer's kernels in launch order: from one recurrence kernel to the next
    marks = [i for i, e in enumerate(ordered) if any(f in e.get("name", "") for f in RECURRENCE_KERNELS)]
    layer = ordered[marks[0] : marks[1]] if len(marks) > 1 else []
    return {
        "one_layer": [[e.get("name", "")[:60], round(e["dur"], 2)] for e in layer],
        "one_layer_added_us": [round(adds[id(e)], 2) for e in layer],
        "kernels_per_pass": len(events) / replays, "busy_ms": sum(kinds.values()), "span_ms": span,
        "by_kind_ms": {k: round(v, 4) for k, v in sorted(kinds.items(), key=lambda kv: -kv[1])},
        "critical_by_kind_ms": {k: round(v, 4) for k, v in sorted(critical.items(), key=lambda kv: -kv[1])},
        "top_kernels_ms": {k: round(v, 4) for k, v in top},
        "top_kernels_calls": {k: round(calls[k]) for k, _ in top},
    }


def eager_ms_per_token(model, prompt, tokens: int = 16) -> float:
    from specla_compile.runtime.baseline import autoregressive_generate

    autoregressive_generate(model, prompt, 2)
    _, wall = timed(lambda: autoregressive_generate(model, prompt, tokens + 1))
    _, prefill = timed(lambda: autoregressive_generate(model, prompt, 1))
    return 1000 * (wall - prefill) / tokens


def prompts_for(model, batch: int, count: int, length: int = 64, seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    vocab = model.get_output_embeddings().weight.shape[0]
    return [torch.randint(0, vocab, (batch, length), generator=gen).cuda() for _ in range(count)]


def weight_bytes(model) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


# --- sections -------------------------------------------------------------------------------------


def make_generator(model, drafter=None, config=None):
    """A generator over ``model`` (it compiles the model once, however many generators share it)."""
    from specla_compile import SpecConfig, SpeculativeGenerator

    return SpeculativeGenerator(model, drafter or OracleDrafter([[0]], 1.0, 1), config or SpecConfig(bucket=16),
                                compile_options=BACKEND_OPTIONS)


def chain_config(depth: int, bucket: int | None = 16):
    """A chain of ``depth`` drafted tokens, verified in the smallest multiple of ``bucket`` nodes that holds it
    (None: ``SpecConfig``'s default, which depends on the batch)."""
    from specla_compile import SpecConfig

    return SpecConfig(mode="chain", depth=depth, bucket=bucket)


def tree_config(top_k: int, nodes: int):
    from specla_compile import SpecConfig

    depth = (nodes - 1) // top_k
    return SpecConfig(mode="tree", depth=depth, tree_top_k=top_k, budget=depth * top_k, bucket=16), depth


def truth_of(plain: dict, prompts) -> list[list[list[int]]]:
    """Per prompt, per row: the plain run's new tokens (the oracle's continuation)."""
    return [[row[prompt.shape[1]:].tolist() for row in seq] for seq, prompt in zip(plain["sequences"], prompts)]


def controlled_route(gen, prompts, new_tokens: int, plain: dict, truths, p: float, depth: int, top_k: int = 1, config=None,
                     device: bool | None = None) -> dict:
    """One controlled-acceptance route on ``gen`` (its bucket already captured), timed and checked
    against the ``plain`` run of the same prompts: adds ``identical`` and ``speedup``. ``device``: the oracle
    drafts on the device (None: ``--oracle``)."""
    config = config or chain_config(depth)
    device = ORACLE["device"] if device is None else device
    r = run_route(gen, prompts, new_tokens, OracleDrafter(None, p, depth, top_k, device=device), config, truths=truths)
    r["identical"] = all(torch.equal(a, b) for a, b in zip(r.pop("sequences"), plain["sequences"]))
    r["speedup"] = plain["decode_s"] / r["decode_s"]
    return r


def first_compile_of_process() -> bool:
    """Whether nothing was compiled in this process yet: a cold-start figure only means that then."""
    return not torch._dynamo.utils.counters["stats"]["unique_graphs"]


def note_compile_caches(section: dict) -> None:
    """How many inductor and AOTAutograd cache hits the section's compiles had: its ``cold_plain_s`` and
    ``cold_buckets_s`` are compile times from nothing only without any (the cold-start target is
    ``warm_start``'s: a child process on empty caches, the AR step and three buckets)."""
    section["compile_cache_hits"] = disk_cache_hits(compile_cache_counters())


def fla_b1(args, results: dict) -> None:
    model = build("fla", torch.bfloat16, args.layers)
    prompts = prompts_for(model, 1, args.prompts)
    section = results.setdefault("fla_b1", {"weights_gb": weight_bytes(model) / 1e9})
    gen = make_generator(model)
    section["cold_process"] = first_compile_of_process()
    started = time.perf_counter()
    gen.decode(prompts[0], 4)  # compiles and captures the 1-node pass
    section["cold_plain_s"] = time.perf_counter() - started
    plain = run_route(gen, prompts, args.new_tokens, plain=True)
    truths = truth_of(plain, prompts)
    section["plain"] = {k: v for k, v in plain.items() if k != "sequences"}
    print(f"plain graphed: {plain['ms_per_token']:.3f} ms/token", flush=True)
    section["eager_ms_per_token"] = eager_ms_per_token(model, prompts[0])
    print(f"eager: {section['eager_ms_per_token']:.2f} ms/token", flush=True)
    started = time.perf_counter()
    for bucket in (16, 32):  # compile + capture, timed for the cold-start figure
        gen.drafter, gen.config = OracleDrafter(truths[0], 1.0, bucket - 1), chain_config(bucket - 1)
        gen.generate(prompts[0], 2)
    section["cold_buckets_s"] = time.perf_counter() - started
    note_compile_caches(section)
    section["pass_ms"] = {str(n): pass_ms(gen, n) for n in (1, 16, 32)}
    print("pass ms", section["pass_ms"], flush=True)
    heat = section.setdefault("chain", {})
    for depth in CHAIN_LENGTHS:
        for p in P_VALUES:
            r = heat[f"L{depth}_p{p}"] = controlled_route(gen, prompts, args.new_tokens, plain, truths, p, depth)
            print(f"chain L={depth} p={p}: {r['speedup']:.2f}x, {r['tokens_per_pass']:.2f} tok/pass", flush=True)
    trees = section.setdefault("tree", {})
    for top_k, nodes in TREES:
        config, depth = tree_config(top_k, nodes)
        gen.drafter, gen.config = OracleDrafter(truths[0], 0.8, depth, top_k), config
        gen.generate(prompts[0], 2)  # compiles and captures the tree bucket outside the timed routes
        for p in P_VALUES:
            r = trees[f"k{top_k}_n{nodes}_p{p}"] = controlled_route(gen, prompts, args.new_tokens, plain, truths, p, depth, top_k, config)
            print(f"tree k={top_k} n={nodes} p={p}: {r['speedup']:.2f}x", flush=True)
    section["pass_ms_tree"] = {str(n): pass_ms(gen, n, chain=False) for n in (16, 32)}
    exact = [r["identical"] for r in [*heat.values(), *trees.values()]]
    section["bf16_identical_runs"] = f"{sum(exact)}/{len(exact)}"
    section["compile_seconds"] = {str(k): v for k, v in next(iter(gen._engines.values())).compile_seconds.items()}


def fla_quick(args, results: dict) -> None:
    """The headline routes of ``fla_b1`` in about four minutes (the 1-, 16- and 32-node buckets, a 16- and
    a 32-node tree), writing the JSON after every route: for a short lease."""
    model = build("fla", torch.bfloat16, args.layers)
    prompts = prompts_for(model, 1, args.prompts)
    section = results.setdefault("fla_b1", {"weights_gb": weight_bytes(model) / 1e9, "quick": True})
    gen = make_generator(model)
    section["cold_process"] = first_compile_of_process()
    started = time.perf_counter()
    gen.decode(prompts[0], 2)
    section["cold_plain_s"] = time.perf_counter() - started
    plain = run_route(gen, prompts, args.new_tokens, plain=True)
    truths = truth_of(plain, prompts)
    section["plain"] = {k: v for k, v in plain.items() if k != "sequences"}
    print(f"plain graphed: {plain['ms_per_token']:.3f} ms/token", flush=True)
    write_report(results, args.out)
    started = time.perf_counter()
    gen.drafter, gen.config = OracleDrafter(truths[0], 1.0, 12), chain_config(12)
    gen.generate(prompts[0], 2)
    section["cold_buckets_s"] = time.perf_counter() - started
    note_compile_caches(section)
    section["pass_ms"] = {str(n): pass_ms(gen, n) for n in (1, 16)}
    section["pass_ms_by_pending"] = {str(a): pass_ms(gen, 16, a) for a in (0, 4, 8, 13, 16)}
    print("pass ms", section["pass_ms"], "16 nodes by pending records", section["pass_ms_by_pending"], flush=True)
    heat = section.setdefault("chain", {})
    for depth, p in ((12, 1.0), (8, 0.8), (8, 1.0), (4, 0.6), (8, 0.6), (2, 0.6), (12, 0.6), (4, 0.8), (12, 0.8)):
        r = heat[f"L{depth}_p{p}"] = controlled_route(gen, prompts, args.new_tokens, plain, truths, p, depth)
        print(f"chain L={depth} p={p}: {r['speedup']:.2f}x, {r['tokens_per_pass']:.2f} tok/pass, identical {r['identical']}", flush=True)
        write_report(results, args.out)
    for nodes in (16, 32):  # (the 32-node bucket compiles here, outside the timed route's first pass: its warm-up)
        config, depth = tree_config(4, nodes)
        gen.drafter, gen.config = OracleDrafter(truths[0], 0.8, depth, 4), config
        gen.generate(prompts[0], 2)
        r = section.setdefault("tree", {})[f"k4_n{nodes}_p0.8"] = controlled_route(gen, prompts, args.new_tokens, plain, truths, 0.8, depth, 4, config)
        section.setdefault("pass_ms_tree", {})[str(nodes)] = pass_ms(gen, nodes, chain=False)
        print(f"tree k=4 n={nodes} p=0.8: {r['speedup']:.2f}x; tree pass {section['pass_ms_tree'][str(nodes)]:.3f} ms", flush=True)
        write_report(results, args.out)
    engine = next(iter(gen._engines.values()))
    try:  # what bounds a pass (a failure here keeps the figures above)
        for n in (1, 16):
            bucket = engine.buckets[bucket_key(n)]
            bucket.step.zero_()  # (the plain loop's graph logs its token at this step: keep it in range)
            section.setdefault("profile", {})[f"{n}_chain"] = kernel_profile(bucket.graph)
            bucket.step.zero_()
            section.setdefault("op_profile", {})[f"{n}_chain"] = op_profile(engine, bucket)
        print("profile", json.dumps(section["profile"], indent=1), "op profile", json.dumps(section["op_profile"], indent=1), flush=True)
    except Exception:
        section["profile_error"] = traceback.format_exc()


def fla_passes(args, results: dict) -> None:
    """Only the captured passes, in about two minutes of a cold process: plain decoding's time per token (also
    with 0, 2 and 8 passes queued behind each block the host reads), replay times of the 1-, 9- and 16-node chain
    passes and the 16- and 32-node tree passes, the kernels of the 16-node tree pass and of the 1-node pass (each with
    one layer in launch order)."""
    from specla_compile.kernels import pdl
    from specla_compile.runtime import generator as generator_module

    model = build("fla", torch.bfloat16, args.layers)
    prompts = prompts_for(model, 1, args.prompts)
    prompt = prompts[0]
    section = results.setdefault("fla_passes", {"pdl": pdl.enabled(torch.device("cuda"))})
    gen = make_generator(model)
    gen.decode(prompt, 2)
    plain = run_route(gen, prompts, args.new_tokens, plain=True)
    section["plain_ms_per_token"], section["plain_tokens_sha1"] = plain["ms_per_token"], tokens_sha1(plain["sequences"])
    print(f"plain graphed: {section['plain_ms_per_token']:.3f} ms/token", flush=True)
    default = generator_module.PLAIN_LOOKAHEAD
    for ahead in (0, 2, default, 8):  # passes queued behind a block while the host reads it (0: the GPU waits)
        generator_module.PLAIN_LOOKAHEAD = ahead
        section.setdefault("plain_ms_per_token_by_lookahead", {})[str(ahead)] = run_route(gen, prompts, args.new_tokens, plain=True)["ms_per_token"]
    generator_module.PLAIN_LOOKAHEAD = default
    print("plain ms/token by lookahead", section["plain_ms_per_token_by_lookahead"], flush=True)
    gen.drafter, gen.config = OracleDrafter([[0]], 1.0, 15), chain_config(15)
    gen.generate(prompt, 2)
    section["pass_ms"] = {str(n): pass_ms(gen, n) for n in (1, 16)}
    # the chain of 9 nodes (L = 8) in a bucket of its own size, beside the default bucket's 16 nodes
    gen.drafter, gen.config = OracleDrafter([[0]], 1.0, 8), chain_config(8, bucket=9)
    gen.generate(prompt, 2)
    section["pass_ms"]["9"] = pass_ms(gen, 9)
    print("pass ms", section["pass_ms"], flush=True)
    write_report(results, args.out)
    for nodes in (16, 32):
        config, depth = tree_config(4, nodes)
        gen.drafter, gen.config = OracleDrafter([[0]], 1.0, depth, 4), config
        gen.generate(prompt, 2)
        section.setdefault("pass_ms_tree", {})[str(nodes)] = pass_ms(gen, nodes, chain=False)
        print("pass ms", section["pass_ms"], "trees", section["pass_ms_tree"], flush=True)
        write_report(results, args.out)
    engine = next(iter(gen._engines.values()))
    profile = kernel_profile(engine.buckets[bucket_key(16, False)].graph)
    section["profile_16_tree"] = profile  # (one layer in launch order too: where the drafted pass's extra time goes)
    section["profile_9"] = kernel_profile(engine.buckets[bucket_key(9)].graph)  # (what bounds the chain-of-9 ratio)
    plain = engine.buckets[bucket_key(1)]
    plain.step.zero_()
    section["profile_1"] = kernel_profile(plain.graph)  # (with one layer in launch order: what an A/B fused)
    plain.step.zero_()


def tokens_sha1(sequences: list[torch.Tensor]) -> str:
    """A short digest of generated token ids: equal runs, equal digests (how ``fold_ab`` compares option sets)."""
    return hashlib.sha1(b"".join(s.cpu().numpy().astype(np.int64).tobytes() for s in sequences)).hexdigest()[:12]


FOLD_AB = {  # option sets fold_ab times against the defaults: the folds off by default, the newest default without
    # its fold, and the CUDA C GEMV, with the down projections through it or through fold_swiglu's Triton GEMV
    "defaults": [], "without_fold_swiglu": ["fold_swiglu=False"], "fold_convs": ["fold_convs=True"],
    "fold_gates_drafted": ["fold_gates_drafted=True"], "both": ["fold_convs=True", "fold_gates_drafted=True"],
    "cuda_gemvs": ["cuda_gemvs=True"], "cuda_gemvs_without_fold_swiglu": ["cuda_gemvs=True", "fold_swiglu=False"],
    "cuda_gemvs_fold_convs": ["cuda_gemvs=True", "fold_convs=True"],  # (one launch a layer fewer where the convs fold)
    "fold_gated_norms_drafted": ["fold_gated_norms_drafted=True"],
    "drafted_folds": ["fold_gates_drafted=True", "fold_gated_norms_drafted=True"],  # (the drafted passes' two)
    "cuda_gemvs_drafted_folds": ["cuda_gemvs=True", "fold_gates_drafted=True", "fold_gated_norms_drafted=True"],
    # every drafted pass on the serial route (trees too): whether a chain's walk, its state committed before the PDL
    # wait, beats the parallel route inside a pass (the cost model was fitted on kernels timed alone)
    "serial_route": ["verify_kernel='serial'"],
    # the drafted passes' MLP product and down projection in three kernels, as before the split launch
    "without_fold_swiglu_drafted": ["fold_swiglu_drafted=False"],
}


def fold_ab(args, results: dict) -> None:
    """``fla_passes`` in a child process for each of ``FOLD_AB``'s option sets (with ``--backend``'s options first):
    each compiles its own twins, on the machine's warm caches where they hold them; about 1.5 minutes a set."""
    section = results.setdefault("fold_ab", {})
    for name in args.ab_sets or FOLD_AB:  # (the defaults first: the table divides by them)
        options = FOLD_AB[name]
        backend = [*args.backend, *options]
        with tempfile.TemporaryDirectory() as out:
            command = [sys.executable, __file__, "--sections", "fla_passes", "--layers", str(args.layers or 24),
                       "--prompts", str(args.prompts), "--out", out] + (["--backend", *backend] if backend else [])
            print(f"fold_ab: {name} ({' '.join(backend) or 'the defaults'})", flush=True)
            run = subprocess.run(command, capture_output=True, text=True, timeout=400)
            path = os.path.join(out, "e2e_gpu.json")
            passes = {}
            if os.path.exists(path):
                with open(path) as f:
                    passes = json.load(f).get("fla_passes", {})
        keep = ("plain_ms_per_token", "plain_tokens_sha1", "pass_ms", "pass_ms_tree")
        profiles = {key: {k: v for k, v in passes[key].items() if not k.startswith("one_layer")}  # (what bounds each pass)
                    for key in ("profile_1", "profile_9", "profile_16_tree") if key in passes}
        section[name] = {"backend": backend, **{k: passes[k] for k in keep if k in passes},
                         "kernels_1": profiles.get("profile_1", {}).get("kernels_per_pass"), **profiles}
        if "pass_ms" not in passes:
            section[name]["error"] = run.stderr[-2000:]
        print(name, section[name], flush=True)
        write_report(results, args.out)


def weight_floor_ms(b1: dict) -> float:
    """The weight-streaming floor of one pass, ms: a run's bf16 weights (the 1.3B shape's 2.93 GB where it recorded
    none) at the H200's measured 4.2 TB/s copy rate."""
    return b1.get("weights_gb", 2.93) / 4.2


PASS_PROFILES = {"profile_1": "the 1-node pass", "profile_9": "the 9-node chain pass",  # (fla_passes' kernel profiles)
                 "profile_16_tree": "the 16-node tree pass"}


def fold_ab_markdown(section: dict) -> list[str]:
    """``fold_ab``'s table: each option set's plain decoding and passes, and their ratio to the defaults'."""
    base = section.get("defaults", {})
    if "pass_ms" not in base:
        return []

    def cell(value, reference) -> str:
        return f"{value:.3f} ({value / reference:.3f})" if value and reference else "-"

    lines = ["", "Folds against the defaults (`fold_ab`; ms, and the ratio to the defaults' in one call):", "",
             "| options | plain ms/token | 1-node pass | 9-node chain | 16-node chain | 16-node tree | 32-node tree | kernels, "
             "1-node | plain tokens as the defaults' |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for name, run in section.items():
        if "pass_ms" not in run:
            lines.append(f"| {name} | failed: see the JSON | | | | | | | |")
            continue
        values = [(run.get("plain_ms_per_token"), base.get("plain_ms_per_token"))]
        values += [(run["pass_ms"].get(n), base["pass_ms"].get(n)) for n in ("1", "9", "16")]
        values += [(run.get("pass_ms_tree", {}).get(n), base.get("pass_ms_tree", {}).get(n)) for n in ("16", "32")]
        same = run.get("plain_tokens_sha1") == base.get("plain_tokens_sha1") is not None
        lines.append(f"| {name} | " + " | ".join(cell(v, r) for v, r in values) + f" | {run.get('kernels_1')} | "
                     + ("yes" if same else "no") + " |")
    for key, what in PASS_PROFILES.items():
        table = profile_markdown({name: run[key] for name, run in section.items() if key in run}, weight_floor_ms({}))
        lines += table[:2] + [f"Of {what}, an option set a column:"] + table[2:] if table else []
    return lines


def fla_profile(args, results: dict) -> None:
    """What bounds plain decoding and a 16-node pass, in about two minutes: the plain loop's time per
    token, its blocks, graph launch against replay time, and kernel and operator profiles."""
    model = build("fla", torch.bfloat16, args.layers)
    prompts = prompts_for(model, 1, args.prompts)
    section = results.setdefault("fla_profile", {})
    gen = make_generator(model)
    gen.decode(prompts[0], 2)
    section["plain"] = {k: v for k, v in run_route(gen, prompts, args.new_tokens, plain=True).items() if k != "sequences"}
    gen.drafter, gen.config = OracleDrafter([[0] * 64], 1.0, 8), chain_config(8)
    gen.generate(prompts[0], 2)
    engine = next(iter(gen._engines.values()))
    loop, chain = engine.buckets[bucket_key(1)], engine.buckets[bucket_key(16)]
    section["pass_ms"] = {"1": pass_ms(gen, 1), "16": pass_ms(gen, 16)}
    for name, bucket in (("1_chain", loop), ("16_chain", chain)):
        bucket.step.zero_()
        section.setdefault("replay", {})[name] = replay_costs(bucket.graph, 8 if bucket.loop else 32)
        bucket.step.zero_()
        section.setdefault("profile", {})[name] = kernel_profile(bucket.graph)
        bucket.step.zero_()
        section.setdefault("op_profile", {})[name] = op_profile(engine, bucket)
    print(json.dumps(section, indent=1), flush=True)


def fla_batch(args, results: dict) -> None:
    """B=4 and B=16, p=0.8 L=8 against plain decoding of the same rows: the chains in the pass size ``SpecConfig``
    gives by default (the target's route: 16 nodes at 4 rows, 9 from 8 rows, see ``SpecConfig.pass_nodes``) and
    in the other of 9 (the pending token and 8 drafts, no padding) and 16 nodes, the target's route with the oracle
    drafting where ``--oracle`` does not say, the passes' replay times and what the batch x 16-node pass spends its
    time on."""
    model = build("fla", torch.bfloat16, args.layers)
    section = results.setdefault("fla_batch", {})
    for batch in (4, 16):
        prompts = prompts_for(model, batch, 2, seed=batch)
        gen = make_generator(model)
        gen.decode(prompts[0], 2)
        plain = run_route(gen, prompts, args.new_tokens, plain=True)
        truths = truth_of(plain, prompts)
        figures = section[f"B{batch}"] = {"plain": plain}
        other = 16 if chain_config(8, None).pass_nodes(batch) == 9 else 9
        elsewhere = "host" if ORACLE["device"] else "device"  # (the oracle drafting where --oracle does not say)
        routes = (("p0.8_L8", None, None), (f"p0.8_L8_{elsewhere}_drafts", None, not ORACLE["device"]),
                  (f"p0.8_L8_bucket{other}", other, None))
        for key, bucket, device in routes:
            config = chain_config(8, bucket)
            gen.drafter, gen.config = OracleDrafter(truths[0], 1.0, 8), config
            gen.generate(prompts[0], 2)  # compiles and captures the bucket outside the timed runs
            spec = figures[key] = controlled_route(gen, prompts, args.new_tokens, plain, truths, 0.8, 8, config=config, device=device)
            print(f"B={batch}: plain {plain['tokens_per_s']:.0f} tok/s, {key} {spec['tokens_per_s']:.0f} tok/s = {spec['speedup']:.2f}x",
                  flush=True)
        plain.pop("sequences")
        target = figures["p0.8_L8"]  # the target's route: the default pass size
        figures["speedup"], figures["identical"] = target["speedup"], target["identical"]
        figures["pass_ms"] = {str(n): pass_ms(gen, n) for n in (1, 9, 16)}
        # the same passes committing 4 records a row first (p=0.8 L=8 accepts 3.2 drafts a pass, plus the pending token)
        figures["pass_ms_4_pending"] = {str(n): pass_ms(gen, n, pending=4) for n in (9, 16)}
        wide = next(iter(gen._engines.values())).buckets[bucket_key(16)]  # what a pass of batch x 16 nodes spends its time on
        figures["profile_16"] = {k: v for k, v in kernel_profile(wide.graph).items() if not k.startswith("one_layer")}


def qwen(args, results: dict) -> None:
    model = build("qwen", torch.bfloat16, args.qwen_layers)
    prompts = prompts_for(model, 1, args.prompts)
    section = results.setdefault("qwen", {"weights_gb": weight_bytes(model) / 1e9})
    gen = make_generator(model)
    gen.decode(prompts[0], 2)
    plain = run_route(gen, prompts, args.new_tokens, plain=True)
    truths = truth_of(plain, prompts)
    section["plain"] = {k: v for k, v in plain.items() if k != "sequences"}
    section["eager_ms_per_token"] = eager_ms_per_token(model, prompts[0])
    gen.drafter, gen.config = OracleDrafter(truths[0], 1.0, 8), chain_config(8)
    gen.generate(prompts[0], 2)  # compiles and captures the 16-node pass outside the timed runs
    for p in (1.0, 0.8):
        r = section[f"p{p}_L8"] = controlled_route(gen, prompts, args.new_tokens, plain, truths, p, 8)
        print(f"qwen p={p} L=8: {r['speedup']:.2f}x", flush=True)


SAMPLING = {"do_sample": True, "temperature": 1.0, "top_k": 50, "top_p": 0.9}


def fla_sampling(args, results: dict) -> None:
    """Sampling (``SAMPLING``) through the engine at the GDN-1.3B shape, in about three minutes: plain sampling
    (the device loop of 1-node passes, as greedy plain decoding runs) against chains of L=8 from the oracle at
    p = 1.0 and 0.8 (the peaked logits sample their argmax nearly always, so the greedy continuation stays the
    likeliest draft), every pass accepting by rejection sampling inside its CUDA graph; greedy plain decoding
    (the device loop) beside them."""
    model = build("fla", torch.bfloat16, args.layers)
    prompts = prompts_for(model, 1, args.prompts)
    gen = make_generator(model)
    gen.decode(prompts[0], 2)
    greedy = run_route(gen, prompts, args.new_tokens, plain=True)
    truths = truth_of(greedy, prompts)
    plain = run_route(gen, prompts, args.new_tokens, plain=True, sample=SAMPLING)
    section = results.setdefault("fla_sampling", {"sampling": SAMPLING})
    section["greedy_plain_ms_per_token"], section["plain_ms_per_token"] = greedy["ms_per_token"], plain["ms_per_token"]
    section["plain_ms_per_pass"] = plain["ms_per_pass"]
    print(f"plain sampling {plain['ms_per_token']:.3f} ms/token (greedy {greedy['ms_per_token']:.3f})", flush=True)
    for p in (1.0, 0.8):
        r = run_route(gen, prompts, args.new_tokens, OracleDrafter(None, p, 8), chain_config(8), truths=truths, sample=SAMPLING)
        section[f"p{p}_L8"] = {"ms_per_token": r["ms_per_token"], "tokens_per_pass": r["tokens_per_pass"],
                               "ms_per_pass": r["ms_per_pass"], "speedup": plain["decode_s"] / r["decode_s"]}
        print(f"sampled p={p} L=8: {section[f'p{p}_L8']['speedup']:.2f}x, {r['tokens_per_pass']:.2f} tokens a pass", flush=True)


def fla_sampling_markdown(section: dict) -> list[str]:
    """``fla_sampling``'s table: sampled chains over plain sampling through the same engine."""
    if "plain_ms_per_token" not in section:
        return []
    lines = ["", f"Sampling ({section['sampling']}), B=1: plain sampling {section['plain_ms_per_token']:.3f} ms/token "
             f"(greedy plain decoding {section['greedy_plain_ms_per_token']:.3f}):", "",
             "| route | ms/token | tokens per pass | speedup over plain sampling |", "| --- | --- | --- | --- |"]
    for p in (1.0, 0.8):
        r = section.get(f"p{p}_L8")
        if r:
            lines.append(f"| oracle chain L=8, p={p} | {r['ms_per_token']:.3f} | {r['tokens_per_pass']:.2f} | {r['speedup']:.2f}x |")
    return lines


def exact_fp32(args, results: dict) -> None:
    """fp32 greedy output of chains and trees against graphed plain decoding (reduced depth)."""
    section = results.setdefault("exact_fp32", {})
    for family, layers in (("fla", 4), ("qwen", 4)):
        model = build(family, torch.float32, layers)
        prompts = prompts_for(model, 1, 16)
        gen = make_generator(model)
        plain = run_route(gen, prompts, 128, plain=True)
        truths = truth_of(plain, prompts)
        for name, drafter, config in (
            ("chain_L8_p0.8", OracleDrafter(None, 0.8, 8), chain_config(8)),
            ("tree_k2_n16_p0.8", OracleDrafter(None, 0.8, 7, 2), tree_config(2, 16)[0]),
        ):
            r = run_route(gen, prompts, 128, drafter, config, truths=truths)
            same = sum(torch.equal(a, b) for a, b in zip(r["sequences"], plain["sequences"]))
            section[f"{family}_{name}"] = f"{same}/{len(prompts)}"
            print(f"fp32 {family} {name}: {same}/{len(prompts)} identical", flush=True)


def compile_cache_counters() -> dict:
    """This process's inductor FX-graph and AOTAutograd cache counters. Hits are a reload, not a compile
    (AOTAutograd's cache, when it hits, also skips the AOT trace: on CPU that trace is a third of a warm
    compile, Dynamo's trace of the model the rest)."""
    from torch._dynamo.utils import counters

    return {k: v for group in ("inductor", "aot_autograd") for k, v in counters[group].items() if "cache" in k}


def compile_phases(at_least: float = 0.5) -> dict:
    """Where this process's compile time went, by Dynamo's and inductor's timed phases (seconds summed over
    every compile, nested phases inside their callers), those of ``at_least`` seconds."""
    from torch._dynamo.utils import compile_times

    names, seconds = compile_times(repr="csv", aggregate=True)
    return {name: round(float(value), 2) for name, value in zip(names, seconds) if float(value) >= at_least}


def disk_cache_hits(caches: dict) -> int:
    """Hits of the on-disk caches among ``compile_cache_counters()``: FX graphs and AOTAutograd. Inductor's
    ``async_compile_cache`` hits are one process reusing a kernel it compiled a moment before (a cold
    process on empty caches has dozens), not a warm start."""
    return sum(v for k, v in caches.items() if k in ("fxgraph_cache_hit", "autograd_cache_hit"))


def warm_start(args, results: dict) -> None:
    """Cold and warm start, whatever the machine compiled before: a child process on empty inductor and Triton
    caches of its own, then a second child on the caches the first filled, each timed to the first generated
    token through the 1-node pass and three draft buckets: the 16- and 32-node chains and the 16-node tree
    (``cold_start`` and ``warm_start`` in the JSON)."""
    if args.child:
        model = build("fla", torch.bfloat16, args.layers)
        prompt = prompts_for(model, 1, 1)[0]
        gen = make_generator(model)
        started = time.perf_counter()
        gen.decode(prompt, 2)
        stages = {"decode (1-node pass, 16-node chain for the prompt)": time.perf_counter() - started}
        tree, depth = tree_config(4, 16)
        for name, drafter, config in (("16-node chain", OracleDrafter([[0] * 64], 1.0, 15), chain_config(15)),
                                      ("32-node chain", OracleDrafter([[0] * 64], 1.0, 31), chain_config(31)),
                                      ("16-node tree", OracleDrafter([[0] * 64], 1.0, depth, 4), tree)):  # the three buckets
            gen.drafter, gen.config = drafter, config
            begun = time.perf_counter()
            gen.generate(prompt, 2)
            stages[name] = time.perf_counter() - begun
        print(json.dumps({"warm_start_s": time.perf_counter() - started, "stages_s": stages,
                          "compile_caches": compile_cache_counters(), "compile_phases_s": compile_phases(),
                          "compile_seconds": next(iter(gen._engines.values())).compile_seconds}))
        return
    command = [sys.executable, __file__, "--sections", "warm_start", "--child", "--layers", str(args.layers or 24)] + (
        ["--inductor", *args.inductor] if args.inductor else []) + (["--backend", *args.backend] if args.backend else [])
    with tempfile.TemporaryDirectory() as caches:
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": os.path.join(caches, "inductor"), "TRITON_CACHE_DIR": os.path.join(caches, "triton")}
        runs = {}
        for name in ("cold", "warm"):
            print(f"{name} start: a child process on {'empty' if name == 'cold' else 'its'} caches", flush=True)
            started = time.perf_counter()
            out = subprocess.run(command, capture_output=True, text=True, timeout=600, env=env)
            line = [l for l in out.stdout.splitlines() if l.startswith("{")]
            runs[name] = {"process_s": time.perf_counter() - started, **(json.loads(line[-1]) if line else {"error": out.stderr[-2000:]})}
            runs[name]["log"] = [l.split("specla: ", 1)[1] for l in out.stderr.splitlines() if "specla: " in l][:60]  # what compiled, how long
            print(name, "start", runs[name], flush=True)
    results["warm_start"] = {**runs["warm"], "cold_child": runs["cold"]}
    hits = disk_cache_hits(runs["cold"].get("compile_caches", {}))
    if "warm_start_s" in runs["cold"] and not hits:
        results["cold_start"] = {"s": runs["cold"]["warm_start_s"], "section": "warm_start"}


# --- report ---------------------------------------------------------------------------------------


def plain_figure(results: dict) -> dict | None:
    """The plain decoding run the targets report: ``fla_b1``'s (warmed up by ``run_route``, in its own
    process), else ``fla_profile``'s (a process of its own on an otherwise idle machine)."""
    for section in ("fla_b1", "fla_profile"):
        if "plain" in results.get(section, {}):
            return results[section]["plain"]
    return None


def targets(results: dict) -> list[dict]:
    out = []

    def add(name, measured, goal, met):
        out.append({"name": name, "measured": measured, "goal": goal, "met": bool(met)})

    b1 = results.get("fla_b1", {})
    plain = plain_figure(results)
    if plain:
        add("plain graphed decoding, ms/token", round(plain["ms_per_token"], 3), "<= 1.0", plain["ms_per_token"] <= 1.0)
    for kind, sizes, what, goal in (("pass_ms", ("9", "16"), "chain of 9", 1.25),
                                    ("pass_ms_tree", ("16",), "tree of 16", 1.4),
                                    ("pass_ms_tree", ("32",), "tree of 32", 1.8)):
        # a ratio within one run: the pass-only run's where it timed this pass, else fla_b1's; the chain of 9 in a
        # bucket of its size where one was timed, else in the default bucket of 16 nodes
        found = [(run, nodes) for nodes in sizes for run in (results.get("fla_passes", {}), b1)
                 if "1" in run.get("pass_ms", {}) and nodes in run.get(kind, {})]
        if found:
            run, nodes = found[0]
            ratio = run[kind][nodes] / run["pass_ms"]["1"]
            bucket = f" ({nodes}-node bucket)" if kind == "pass_ms" else ""
            add(f"verify pass over plain step, {what}{bucket}", round(ratio, 3), f"<= {goal}", ratio <= goal)
    chain = b1.get("chain", {})
    if "L12_p1.0" in chain:
        add("oracle chain L=12 p=1.0 speedup", round(chain["L12_p1.0"]["speedup"], 2), ">= 6", chain["L12_p1.0"]["speedup"] >= 6)
    if "L8_p0.8" in chain:
        add("p=0.8 L=8 speedup", round(chain["L8_p0.8"]["speedup"], 2), ">= 2.5", chain["L8_p0.8"]["speedup"] >= 2.5)
    if any(f"L{d}_p0.6" in chain for d in CHAIN_LENGTHS):
        best = max(chain[f"L{d}_p0.6"]["speedup"] for d in CHAIN_LENGTHS if f"L{d}_p0.6" in chain)
        add("p=0.6 best L speedup", round(best, 2), ">= 1.6", best >= 1.6)
    batch = results.get("fla_batch", {}).get("B16")
    if batch:
        add("p=0.8 L=8 B=16 tokens/s over plain", round(batch["speedup"], 2), ">= 2", batch["speedup"] >= 2)
    q = results.get("qwen", {})
    for key, name, goal in (("p1.0_L8", "Qwen3.5 oracle L=8 speedup", 4), ("p0.8_L8", "Qwen3.5 p=0.8 L=8 speedup", 2)):
        if key in q:
            add(name, round(q[key]["speedup"], 2), f">= {goal}", q[key]["speedup"] >= goal)
    exact = results.get("exact_fp32", {})
    if exact:
        ok = all(v.split("/")[0] == v.split("/")[1] for v in exact.values())
        add("fp32 greedy identical to graphed plain decoding (4-layer models)", exact, "100%", ok)
    if "cold_start" in results:
        cold = results["cold_start"]["s"]
        add("cold start, AR step + 3 buckets, s", round(cold, 1), "<= 90", cold <= 90)
    warm = results.get("warm_start", {})
    if "warm_start_s" in warm:
        add("second process, warm cache, AR step + 3 buckets, s", round(warm["warm_start_s"], 1), "<= 20", warm["warm_start_s"] <= 20)
    out += [{"name": name, "measured": None, "goal": goal, "met": False} for name, goal in ALL_TARGETS
            if not any(t["name"].startswith(name) for t in out)]  # (the chain's name says its bucket)
    return out


ALL_TARGETS = (  # every target of the benchmark, so that the ones a run did not reach are listed as such
    ("plain graphed decoding, ms/token", "<= 1.0"),
    ("verify pass over plain step, chain of 9", "<= 1.25"),
    ("verify pass over plain step, tree of 16", "<= 1.4"),
    ("verify pass over plain step, tree of 32", "<= 1.8"),
    ("oracle chain L=12 p=1.0 speedup", ">= 6"),
    ("p=0.8 L=8 speedup", ">= 2.5"),
    ("p=0.6 best L speedup", ">= 1.6"),
    ("p=0.8 L=8 B=16 tokens/s over plain", ">= 2"),
    ("Qwen3.5 oracle L=8 speedup", ">= 4"),
    ("Qwen3.5 p=0.8 L=8 speedup", ">= 2"),
    ("fp32 greedy identical to graphed plain decoding (4-layer models)", "100%"),
    ("cold start, AR step + 3 buckets, s", "<= 90"),
    ("second process, warm cache, AR step + 3 buckets, s", "<= 20"),
)


def targets_markdown(targets: list[dict]) -> list[str]:
    """The ``targets`` list as markdown table lines (also used by ``e2e_trained.py`` and ``tp_gpu.py``); a target
    this run did not measure reads "not measured" and "-", not "no"."""
    return ["| target | measured | goal | met |", "| --- | --- | --- | --- |"] + [
        f"| {t['name']} | {'not measured' if t['measured'] is None else t['measured']} | {t['goal']} | "
        f"{'-' if t['measured'] is None else 'yes' if t['met'] else 'no'} |"
        for t in targets
    ]


def end_to_end_markdown(b1: dict) -> list[str]:
    """Whole calls (prefill, start and finish included) next to the decode phase the heatmap times."""
    plain, chain = b1.get("plain", {}), b1.get("chain", {})
    if "e2e_s" not in plain:
        return []
    calls = plain.get("calls", 4)  # (runs before the field: 4 prompts, the default)
    outside = 1e3 * (plain["e2e_s"] - plain["decode_s"]) / calls
    lines = [f"- end to end, plain decoding: {1e3 * plain['e2e_s'] / plain['new_tokens']:.3f} ms/token; "
             + f"{outside:.1f} ms per call outside the decode phase (prefill, start, finish)"]
    for name in ("L12_p1.0", "L8_p0.8"):
        if "e2e_s" in chain.get(name, {}):
            lines.append(f"- end to end, chain {name}: {plain['e2e_s'] / chain[name]['e2e_s']:.2f}x "
                         f"(decode phase {chain[name]['speedup']:.2f}x)")
    return lines


def differs(route: dict) -> str:
    """What a report says after a route whose output was not plain decoding's."""
    return "" if route.get("identical", True) else " (output differs from plain decoding's)"


def write_report(results: dict, out_dir: str, stem: str = "e2e_gpu") -> None:
    """``{stem}.json``, ``.md`` and ``.png`` under ``out_dir``."""
    results["targets"] = targets(results)
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, f"{stem}.json"), "w") as f:
        json.dump(results, f, indent=1, default=str)
    lines = ["# End-to-end speed, static CUDA-graphed engine", "", f"device: {results.get('device')}, torch {results.get('torch')}",
             f"command: `{results.get('command')}`", ""]
    lines += targets_markdown(results["targets"])
    if "setup" in results:
        lines += ["", f"Setup: {results['setup']}."]
    passes = results.get("fla_passes", {})
    for key, value in passes.items():
        if key in ("pass_ms", "pass_ms_tree"):
            lines.append(f"- `fla_passes` `{key}`: {value}")
    lines += profile_markdown({what: passes[key] for key, what in PASS_PROFILES.items() if key in passes}, weight_floor_ms({}))
    for key, value in results.get("fla_b1", {}).items():
        if key in ("eager_ms_per_token", "pass_ms", "pass_ms_tree", "pass_ms_by_pending", "host_ms_per_pass", "compile_seconds"):
            lines.append(f"- `{key}`: {value}")
    for name, how in results.get("runs", {}).items():
        lines.append(f"- run `{name}`: `{how}`")
    for batch, r in results.get("fla_batch", {}).items():
        lines.append(f"- fla {batch}, p=0.8 L=8: plain {r['plain']['tokens_per_s']:.0f} tok/s, speculative "
                     f"{r['p0.8_L8']['tokens_per_s']:.0f} tok/s" + (f" (not valid: {r['invalid']})" if "invalid" in r else f" = {r['speedup']:.2f}x")
                     + "".join(f"; in a {key.split('bucket')[1]}-node bucket {r[key]['speedup']:.2f}x{differs(r[key])}" for key in r if key.startswith("p0.8_L8_bucket"))
                     + "".join(f"; the oracle's drafts on the {key.split('_')[2]} {r[key]['speedup']:.2f}x{differs(r[key])}" for key in r if key.endswith("_drafts")))
    routes = [r for section in ("fla_b1", "qwen") for r in [*results.get(section, {}).get("chain", {}).values(),
                                                           *results.get(section, {}).get("tree", {}).values(), *results.get(section, {}).values()]
              if isinstance(r, dict) and "identical" in r]
    if routes:
        lines.append(f"- bf16 speculative output identical to graphed plain decoding: {sum(r['identical'] for r in routes)}/{len(routes)} routes "
                     "(every prompt of a route)")
    if "invalid" in results:
        lines += ["", f"Not reported: {results['invalid']['what']}. Why: {results['invalid']['why']}."]
    b1 = results.get("fla_b1", {})
    lines += end_to_end_markdown(b1)
    lines += profile_markdown(b1.get("profile"), weight_floor_ms(b1))
    lines += op_profile_markdown(results.get("fla_profile", {}))
    lines += layer_markdown(results)
    lines += fold_ab_markdown(results.get("fold_ab", {}))
    lines += fla_sampling_markdown(results.get("fla_sampling", {}))
    lines += ["", b1["profile_note"]] if b1.get("profile_note") else []
    if b1.get("chain"):
        lines += ["", "Chain speedup over graphed plain decoding (B=1, 128 new tokens, decode phase):", "",
                  "| L \\ p | " + " | ".join(str(p) for p in P_VALUES) + " |", "| --- |" + " --- |" * len(P_VALUES)]
        for d in CHAIN_LENGTHS:
            cells = [b1["chain"].get(f"L{d}_p{p}") for p in P_VALUES]
            lines.append(f"| {d} | " + " | ".join(f"{c['speedup']:.2f}" if c else "-" for c in cells) + " |")
    if b1.get("tree"):
        lines += ["", "Tree speedup (top_k, nodes):", "", "| tree \\ p | " + " | ".join(str(p) for p in P_VALUES) + " |",
                  "| --- |" + " --- |" * len(P_VALUES)]
        for k, n in TREES:
            cells = [b1["tree"].get(f"k{k}_n{n}_p{p}") for p in P_VALUES]
            lines.append(f"| k={k}, {n} nodes | " + " | ".join(f"{c['speedup']:.2f}" if c else "-" for c in cells) + " |")
    with open(os.path.join(out_dir, f"{stem}.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    plot(results, os.path.join(out_dir, f"{stem}.png"))
    print("\n".join(lines))


def profile_markdown(profile: dict | None, floor_ms: float) -> list[str]:
    """The passes' GPU time by kernel kind as a table (``kernel_profile``), against the weight-streaming floor."""
    if not profile:
        return []
    passes = list(profile)
    kinds = sorted({k for p in profile.values() for k in p["by_kind_ms"]}, key=lambda k: -profile[passes[0]]["by_kind_ms"].get(k, 0))
    lines = ["", f"What one captured pass spends on the GPU (ms; profiler, bf16, B=1; weight-streaming floor {floor_ms:.2f} ms):", "",
             "| | " + " | ".join(passes) + " |", "| --- |" + " --- |" * len(passes)]
    lines += [f"| {k} | " + " | ".join(f"{profile[p]['by_kind_ms'].get(k, 0):.3f}" for p in passes) + " |" for k in kinds]
    if any("critical_by_kind_ms" in p for p in profile.values()):  # (older runs have no critical path)
        lines += [f"| {k}, on the critical path | " + " | ".join(
            f"{profile[p]['critical_by_kind_ms'].get(k, 0):.3f}" if "critical_by_kind_ms" in profile[p] else "-"
            for p in passes) + " |" for k in kinds]
    for key, name in (("busy_ms", "busy (sum of kernels)"), ("span_ms", "first kernel start to last kernel end"), ("kernels_per_pass", "kernels")):
        lines.append(f"| {name} | " + " | ".join(f"{profile[p][key]:.3f}" if key != "kernels_per_pass" else f"{profile[p][key]:.0f}" for p in passes) + " |")
    return lines


def op_profile_markdown(section: dict) -> list[str]:
    """``fla_profile``'s operators of the 1-node pass (the kernels named by the op that launched them)
    and its launch-against-replay times."""
    if not section.get("op_profile"):
        return []
    lines = ["", "Operators of the 1-node pass, by GPU time (`fla_profile`: one uncaptured step under the profiler):", "",
             "| operator | input shapes | calls | GPU ms |", "| --- | --- | --- | --- |"]
    lines += [f"| `{r['op'][:60]}` | {r['shapes'][:70]} | {r['calls']} | {r['device_ms']:.3f} |"
              for r in section["op_profile"]["1_chain"] if r["op"].startswith(("aten::", "specla::"))]
    for name, r in section.get("replay", {}).items():
        lines.append(f"- {name} graph: launch {r['launch_ms']:.3f} ms of host time, {r['wall_ms_per_replay']:.3f} ms per back-to-back replay")
    return lines


def layer_markdown(results: dict) -> list[str]:
    """One GDN layer of the 1-node pass, kernel by kernel: ``fla_b1``'s profile, else ``fla_profile``'s."""
    for section in ("fla_b1", "fla_profile"):
        profile = results.get(section, {}).get("profile", {}).get("1_chain", {})
        layer, added = profile.get("one_layer"), profile.get("one_layer_added_us")
        if layer:
            lines = ["", f"One GDN layer of the 1-node pass (`{section}`), kernels in launch order (from one recurrence kernel "
                         f"to the next; {len(layer)} kernels, {sum(us for _, us in layer):.1f} us of kernel time"
                         + (f", {sum(added):.1f} us of the pass's span" if added else "") + "):", "",
                     "| kernel | us | adds to the span, us |", "| --- | --- | --- |"]
            return lines + [f"| `{name}` | {us:.2f} | " + (f"{added[i]:.2f}" if added else "-") + " |"
                            for i, (name, us) in enumerate(layer)]
    return []


def plot(results: dict, path: str) -> None:
    """The chain heatmap (speedup over graphed plain decoding, as the paper's Figure 12) when measured,
    and the cost of one pass by node count next to the weight-streaming floor."""
    b1 = results.get("fla_b1", {})
    chain, passes, profile = b1.get("chain"), b1.get("pass_ms"), b1.get("profile")
    panels = sum(bool(x) for x in (chain, passes, profile))
    if not panels:
        return
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, panels, figsize=(5.5 * panels, 3.6), squeeze=False)
    axes = list(axes[0])
    if chain:
        ax = axes.pop(0)
        grid = [[chain[f"L{d}_p{p}"]["speedup"] if f"L{d}_p{p}" in chain else float("nan") for p in P_VALUES] for d in CHAIN_LENGTHS]
        top = max((v for row in grid for v in row if v == v), default=1.0)
        image = ax.imshow(grid, cmap="RdYlGn", vmin=0.5, vmax=max(top, 1.0), aspect="auto")
        ax.set_xticks(range(len(P_VALUES)), [str(p) for p in P_VALUES])
        ax.set_yticks(range(len(CHAIN_LENGTHS)), [str(d) for d in CHAIN_LENGTHS])
        ax.set_xlabel("acceptance p (each draft token right with probability p)")
        ax.set_ylabel("chain length L")
        for i, row in enumerate(grid):
            for j, v in enumerate(row):
                ax.text(j, i, f"{v:.2f}" if v == v else "-", ha="center", va="center", fontsize=8)
        fig.colorbar(image, ax=ax, label="speedup over graphed plain decoding")
        ax.set_title("GDN-1.3B shape, H200, bf16, B=1")
    if passes:
        ax = axes.pop(0)
        nodes = sorted(passes, key=int)
        ax.bar(nodes, [passes[n] for n in nodes], color="tab:blue", label="one captured pass (GPU)")
        floor = weight_floor_ms(b1)
        ax.axhline(floor, color="tab:green", ls="--", label=f"weight-streaming floor {floor:.2f} ms")
        plain = plain_figure(results)
        if plain:
            ax.axhline(plain["ms_per_token"], color="tab:red", ls=":", label="plain decoding per token (pass + host)")
        ax.set_xlabel("nodes verified in the pass")
        ax.set_ylabel("ms")
        ax.set_title("Cost of one pass, GDN-1.3B shape, H200, bf16")
        ax.legend(fontsize=7)
    if profile:
        ax = axes.pop(0)
        names = list(profile)
        kinds = sorted({k for p in profile.values() for k in p["by_kind_ms"]}, key=lambda k: -profile[names[0]]["by_kind_ms"].get(k, 0))
        bottom = [0.0] * len(names)
        for kind in kinds:
            heights = [profile[n]["by_kind_ms"].get(kind, 0.0) for n in names]
            ax.bar(names, heights, bottom=bottom, label=kind)
            bottom = [b + h for b, h in zip(bottom, heights)]
        ax.axhline(weight_floor_ms(b1), color="black", ls="--", label="weight-streaming floor")
        ax.set_ylabel("GPU busy ms per pass")
        ax.set_title(f"Where a pass goes ({profile[names[0]]['kernels_per_pass']:.0f} kernels)")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def literal_pairs(flag: str, pairs: list[str], known, where: str) -> dict:
    """``KEY=VALUE`` entries of ``flag`` (values as Python literals); a key that ``known(key)`` denies is an error
    (``where``: what has none)."""
    import ast

    entries = {}
    for pair in pairs:
        key, _, text = pair.partition("=")
        if not known(key):
            raise ValueError(f"{flag} {pair}: {where} has no entry {key!r}")
        try:
            entries[key] = ast.literal_eval(text)
        except (ValueError, SyntaxError):
            raise ValueError(f"{flag} {pair}: the value must be a Python literal (True, 8, 'name')") from None
    return entries


def set_inductor_config(pairs: list[str]) -> None:
    """Set ``KEY=VALUE`` entries of ``torch._inductor.config`` (values as Python literals) for the process."""
    import torch._inductor.config as config

    for key, value in literal_pairs("--inductor", pairs, lambda key: hasattr(config, key), "torch._inductor.config").items():
        setattr(config, key, value)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("--sections", nargs="+", choices=SECTIONS,
                        default=[s for s in SECTIONS if s not in ("fla_passes", "fold_ab", "fla_sampling")],
                        help="default: all but fla_passes (the passes alone, which fla_b1 times too), fold_ab "
                        "(fla_passes under each fold not yet timed) and fla_sampling (sampled chains)")
    parser.add_argument("--layers", type=int, default=None, help="fla model depth (default: 24, the 1.3B shape)")
    parser.add_argument("--qwen-layers", type=int, default=None)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--inductor", nargs="+", metavar="KEY=VALUE", default=[],
                        help="set torch._inductor.config entries for this process, e.g. combo_kernels=True (one launch "
                             "for independent pointwise kernels): an A/B of inductor's options against a run without")
    parser.add_argument("--backend", nargs="+", metavar="KEY=VALUE", default=[],
                        help="options of the specla backend for every compile, e.g. fold_norms=True: an A/B against a run without")
    parser.add_argument("--ab-sets", nargs="+", choices=list(FOLD_AB), default=None,
                        help="fold_ab's option sets to run (default: all, about 1.5 minutes each on a warm machine; the table "
                        "divides by the defaults' figures, so keep them)")
    parser.add_argument("--oracle", choices=("device", "host"), default="device",
                        help="where the controlled routes' oracle drafts after a call's first pass (default: the device, "
                             "as a GPU drafter does; fla_batch also times the host's at its target route)")
    parser.add_argument("--plot", metavar="JSON", help="only write markdown and PNG from an earlier JSON, beside it under its name")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    ORACLE["device"] = args.oracle == "device"
    try:
        set_inductor_config(args.inductor)
        from specla_compile.backend_options import OPTIONS

        BACKEND_OPTIONS.update(literal_pairs("--backend", args.backend, OPTIONS.__contains__,
                                              f"the specla backend's options {sorted(OPTIONS)}"))
    except ValueError as err:
        parser.error(str(err))
    if args.plot:  # (beside the JSON, under its name: another run's JSON never overwrites --out's)
        with open(args.plot) as f:
            write_report(json.load(f), os.path.dirname(args.plot) or ".", os.path.splitext(os.path.basename(args.plot))[0])
        return
    if not torch.cuda.is_available():
        parser.error("this benchmark needs a CUDA GPU")
    logging.basicConfig(format="%(asctime)s %(message)s")
    logging.getLogger("specla_compile").setLevel(logging.INFO)  # compile times of every graph
    results = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "command": " ".join(["python", *sys.argv]),
               "oracle": args.oracle}
    run_sections(args, results, globals(), lambda: None if args.child else write_report(results, args.out))


def run_sections(args, results: dict, sections: dict, after_each, stop_on_error: bool = False) -> None:
    """Run every section named in ``args.sections``; one that raises leaves its traceback in
    ``results["errors"]`` and the other sections' figures in place. ``after_each()`` writes the report.
    With ``stop_on_error`` the error is raised again after the report is written (the sections after it
    do not run)."""
    for name in args.sections:
        try:
            sections[name](args, results)
        except Exception:
            results.setdefault("errors", {})[name] = traceback.format_exc()
            print(traceback.format_exc(), flush=True)
            if stop_on_error:
                after_each()
                raise
        after_each()


if __name__ == "__main__":
    main()
