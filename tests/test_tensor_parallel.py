"""Tensor-parallel speculative decoding on CPU: 2 processes, gloo, a tiny Qwen3.5 loaded with
transformers' ``tp_plan="auto"`` (gathered GDN plan) or then head-sharded (:func:`shard_gdn_heads`).
Every rank must emit exactly the tokens of single-process plain decoding, chains and trees, with no
graph break and the collectives inside the verification graphs."""

from __future__ import annotations

import json
import os
import socket
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from models import VOCAB, tiny_model

from specla_compile import SpecConfig
from specla_compile.parallel import shard_gdn_heads
from specla_compile.runtime.baseline import autoregressive_generate

pytestmark = pytest.mark.skipif(not (dist.is_available() and dist.is_gloo_available()), reason="needs torch.distributed with gloo")

WORLD = 2
PLANS = ("gathered", "heads")
INNER = {"gathered": "eager", "heads": "aot_eager"}  # both inner compilers, within the file's time budget
NEW_TOKENS = 12
PROMPTS = [[3, 17, 5, 60, 2], [44, 9]]
CONFIGS = {
    "chain": SpecConfig(mode="chain", depth=4, bucket=8),
    "tree": SpecConfig(mode="tree", depth=3, tree_top_k=2, budget=7, bucket=8),
}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _decode_with_plan(rank: int, checkpoint: str, plan: str, references: list[list[int]]) -> dict:
    """Load with transformers' plan (then head-shard for ``plan="heads"``) and decode every prompt with
    every config; what the test checks, as JSON."""
    from test_generator import OracleDrafter
    from transformers import AutoModelForCausalLM

    from specla_compile import SpeculativeGenerator, backend

    torch._dynamo.reset()
    torch._dynamo.config.automatic_dynamic_shapes = False  # a 1-node pass: a static graph, quicker to trace
    collectives = []  # functional collectives in each verification twin the backend builds
    rewrite = backend.rewrite_for_verify

    def counting_rewrite(gm):
        program = rewrite(gm)
        collectives.append(sum("_c10d_functional" in str(n.target) for n in program.graph_module.graph.nodes))
        return program

    backend.rewrite_for_verify = counting_rewrite
    try:
        model = AutoModelForCausalLM.from_pretrained(checkpoint, tp_plan="auto", dtype=torch.float32).eval()
        if plan == "heads":
            shard_gdn_heads(model)
        result: dict = {"tokens": {}, "iterations": {}}
        for mode, config in CONFIGS.items():
            # rank 1's drafter is always wrong: every rank must still verify rank 0's (good) draft
            drafter = OracleDrafter([], error_rate=0.2 if rank == 0 else 1.0, seed=1)
            gen = SpeculativeGenerator(model, drafter, config, compile_options={"inner": INNER[plan]})
            for i, prompt in enumerate(PROMPTS):
                drafter.continuations = [references[i] + [0] * 16]
                run = gen.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS)
                result["tokens"][f"{mode}{i}"] = run.sequences[0, len(prompt) :].tolist()
                result["iterations"][f"{mode}{i}"] = run.stats.iterations
        layers = run.past_key_values.layers
        result["state_heads"] = [s.shape[1] for layer in layers for s in (getattr(layer, "recurrent_states", None) or {}).values()]
        result["plain"] = gen.decode(torch.tensor([PROMPTS[0]]), max_new_tokens=NEW_TOKENS).sequences[0, len(PROMPTS[0]) :].tolist()
        result["collectives"] = collectives
        result["graph_breaks"] = sum(torch._dynamo.utils.counters["graph_break"].values())
        return result
    finally:
        backend.rewrite_for_verify = rewrite


def _broadcast_a_draft(rank: int) -> list:
    """Each rank drafts a different tree with draft probabilities; what every rank gets back."""
    from torch.distributed.device_mesh import init_device_mesh

    from specla_compile.runtime.distributed import broadcast_draft
    from specla_compile.runtime.drafting import Draft

    nodes = 3 + rank  # even the shapes differ
    mine = Draft(torch.full((1, nodes), 10 + rank), torch.arange(nodes)[None] - 1, torch.full((1, nodes, VOCAB), 0.5 + rank))
    got = broadcast_draft(mine, init_device_mesh("cpu", (WORLD,)))
    return [got.tokens.tolist(), got.parents.tolist(), got.probs[0, :, 0].tolist()]


def _sharded_whole_models(rank: int) -> dict:
    """Whole tiny models on every rank, head-sharded over a gloo mesh: the largest logit difference
    to the unsharded model over a prefill and two cached steps, per family."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (WORLD,))
    ids = torch.tensor([PROMPTS[0]])
    errors = {}
    for family in ("qwen3_5", "qwen3_next"):
        whole, sharded = tiny_model(family, layers=2), shard_gdn_heads(tiny_model(family, layers=2), mesh)
        worst, caches = 0.0, [None, None]
        for step in (ids, ids[:, :1], ids[:, 1:2]):
            outs = [m(input_ids=step, past_key_values=c, use_cache=True) for m, c in zip((whole, sharded), caches)]
            caches = [o.past_key_values for o in outs]
            worst = max(worst, (outs[0].logits - outs[1].logits).abs().max().item())
        errors[family] = worst
    return errors


def _worker(rank: int, checkpoint: str, references: list[list[int]], port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(WORLD), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD, timeout=timedelta(seconds=60))
    try:
        results = {plan: _decode_with_plan(rank, checkpoint, plan, references) for plan in PLANS}
        results["draft"] = _broadcast_a_draft(rank)
        with torch.no_grad():
            results["whole"] = _sharded_whole_models(rank)
        Path(out, f"rank{rank}.json").write_text(json.dumps(results))
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> tuple[list[dict], list[list[int]], int]:
    """Both plans decoded on 2 gloo ranks (one launch for the whole file); the single-process references."""
    pytest.importorskip("accelerate")  # transformers loads tp_plan models through it
    tmp_path = tmp_path_factory.mktemp("tp")
    model = tiny_model("qwen3_5", layers=2)  # one GDN layer, one attention layer
    checkpoint = str(tmp_path / "ckpt")
    model.save_pretrained(checkpoint)
    references = [autoregressive_generate(model, torch.tensor([p]), NEW_TOKENS)[0][0, len(p) :].tolist() for p in PROMPTS]
    context = mp.get_context("spawn")
    port = _free_port()
    procs = [context.Process(target=_worker, args=(r, checkpoint, references, port, str(tmp_path))) for r in range(WORLD)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=300)
    for p in procs:
        if p.is_alive():
            p.kill()
    assert [p.exitcode for p in procs] == [0] * WORLD, "a rank failed or hung (see its traceback above)"
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(WORLD)]
    return ranks, references, model.config.linear_num_value_heads


@pytest.mark.parametrize("plan", PLANS)
def test_every_rank_emits_plain_decodings_tokens(two_ranks, plan):
    ranks, references, value_heads = two_ranks
    ranks = [r[plan] for r in ranks]
    for rank in ranks:
        for mode in CONFIGS:
            for i, reference in enumerate(references):
                assert rank["tokens"][f"{mode}{i}"] == reference, (mode, i)
        assert rank["plain"] == references[0]
        assert rank["graph_breaks"] == 0
        assert rank["collectives"] and all(c > 0 for c in rank["collectives"])  # inside the verify graphs
        heads = value_heads // WORLD if plan == "heads" else value_heads
        assert rank["state_heads"] and set(rank["state_heads"]) == {heads}
    assert ranks[0]["iterations"] == ranks[1]["iterations"]  # the same drafts verified on both ranks
    assert max(ranks[0]["iterations"].values()) < NEW_TOKENS  # and they were rank 0's good drafts


def test_head_sharding_a_whole_model_keeps_its_logits(two_ranks):
    for rank in two_ranks[0]:
        assert set(rank["whole"]) == {"qwen3_5", "qwen3_next"}
        assert max(rank["whole"].values()) < 1e-5


def test_every_rank_gets_rank_0s_draft(two_ranks):
    ranks, _, _ = two_ranks
    assert ranks[0]["draft"] == ranks[1]["draft"] == [[[10, 10, 10]], [[-1, 0, 1]], [0.5, 0.5, 0.5]]


class _Mesh:
    """A 1-D mesh of two ranks, seen from rank 0 (input checks run before any collective)."""

    ndim = 1

    def size(self) -> int:
        return 2

    def get_local_rank(self) -> int:
        return 0


def _qwen3_5_with_heads(key_heads: int, value_heads: int) -> torch.nn.Module:
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    cfg = Qwen3_5TextConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=2, head_dim=16, linear_num_key_heads=key_heads, linear_num_value_heads=value_heads,
        linear_key_head_dim=8, linear_value_head_dim=8, layer_types=["linear_attention", "full_attention"],
    )
    return Qwen3_5ForCausalLM(cfg)


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda: tiny_model("fla", layers=2), "its GDN layers (GatedDeltaNet) have another layout"),
        (lambda: _qwen3_5_with_heads(3, 6), "3 key heads and 6 value heads cannot be split evenly over 2 ranks"),
    ],
)
def test_head_sharding_rejects_what_it_cannot_split(make, message):
    with pytest.raises(ValueError, match=r"^shard_gdn_heads") as err:
        shard_gdn_heads(make(), _Mesh())
    assert message in str(err.value) and "\n" not in str(err.value)


def test_head_sharding_needs_gdn_layers_and_a_mesh():
    from tiny_lm import tiny_lm

    with pytest.raises(ValueError, match="LlamaForCausalLM: it has no GDN layer"):
        shard_gdn_heads(tiny_lm("llama"), _Mesh())
    with pytest.raises(ValueError, match="needs a device mesh"):
        shard_gdn_heads(tiny_model("qwen3_5", layers=2))


class _Mesh2D:
    ndim = 2
    mesh_dim_names = ("dp", "fsdp")


def test_tensor_parallel_mesh_of_a_model():
    from specla_compile.runtime.distributed import mark_tensor_parallel, tensor_parallel_mesh

    model = tiny_model("qwen3_5", layers=2)
    assert tensor_parallel_mesh(model) is None  # transformers' _device_mesh is None outside tp_plan
    mark_tensor_parallel(model, _Mesh())
    assert isinstance(tensor_parallel_mesh(model), _Mesh)
    mark_tensor_parallel(model, _Mesh2D())
    with pytest.raises(ValueError, match="2-D device mesh needs a 'tp' dimension"):
        tensor_parallel_mesh(model)
