"""Regional compilation of the static twins (the backend's ``regional`` option, ``lowering/regions.py``): the
same tokens and caches as the whole-graph twin, one program per distinct layer, and the splitting rules."""

from __future__ import annotations

import logging
import re

import torch
import torch.fx as fx
from cache_utils import max_cache_diff
from models import left_padded_batch, tiny_model
from test_generator import COMPILE, OracleDrafter, plain

from specla_compile import SpecConfig, SpeculativeGenerator
from specla_compile.lowering.regions import compile_by_layer, layer_regions, structure_key

CHAIN = SpecConfig(mode="chain", depth=5, bucket=8)


def test_twins_compiled_by_layer_give_the_whole_twins_tokens_and_cache(caplog):
    """fla's GDN-only model: the engine's static twins (a hybrid's growing attention cache keeps its one
    dynamic twin, compiled whole)."""
    model = tiny_model("fla", layers=4)
    prompts, input_ids, mask = left_padded_batch((4, 6), seed=5)
    refs = [plain(model, p, 10)[0][0, p.numel() :].tolist() for p in prompts]
    runs = {}
    for regional in (False, True):
        drafter = OracleDrafter([r + [0] * 16 for r in refs], error_rate=0.3, seed=4)
        gen = SpeculativeGenerator(model, drafter, CHAIN, compile_options={**COMPILE, "regional": regional})
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="specla_compile"):
            runs[regional] = gen.generate(input_ids, max_new_tokens=10, attention_mask=mask, pad_token_id=0)
    assert runs[True].sequences.tolist() == runs[False].sequences.tolist()
    assert max_cache_diff(runs[True].past_key_values, runs[False].past_key_values) <= 1e-5
    counts = [tuple(map(int, m)) for m in re.findall(r"'s (\d+) regions: (\d+) compiled in [\d.]+ s, (\d+) calling", caplog.text)]
    # every twin: the embedding, layers 0-2 (one program; each with the next layer's input norm), layer 3
    # (with the final norm: it outputs no residual), the head
    assert counts and all(c == (6, 4, 2) for c in counts), caplog.text


def _two_layer_graph() -> fx.GraphModule:
    """A graph whose nodes carry the module paths Dynamo records: embed, two layers, a head."""
    graph = fx.Graph()
    x = graph.placeholder("x")
    w0, w1 = graph.placeholder("w0"), graph.placeholder("w1")
    paths = {}

    def op(fn, *args, path=None):
        node = graph.call_function(fn, args)
        if path is not None:
            node.meta["nn_module_stack"] = {"m": ("model", object), **({"p": (path, object)} if path else {})}
        paths[node] = path
        return node

    h = op(torch.neg, x, path="model.embed")
    for i, w in enumerate((w0, w1)):
        y = op(torch.mul, h, w, path=f"model.layers.{i}.mlp")
        y = op(torch.relu, y)  # (no module: joins the layer before it)
        h = op(torch.add, h, y, path=f"model.layers.{i}")
    graph.output(op(torch.tanh, h, path="model.norm"))
    return fx.GraphModule(torch.nn.Module(), graph)


def test_layer_regions_follow_the_layers_and_never_decrease():
    gm = _two_layer_graph()
    regions = [layer_regions(gm)[n] for n in gm.graph.nodes if n.op == "call_function"]
    # a layer's first module (mlp) and what follows it untagged (relu) join the region before it; the final
    # norm joins the last layer's
    assert regions == [0, 0, 0, 1, 1, 1, 2, 2]


def test_structure_key_tells_layouts_and_constants_apart():
    gm = _two_layer_graph()
    a, b = torch.randn(4, 6), torch.randn(4, 6)
    c = torch.randn(4, 6)
    assert structure_key(gm, [a, b, c]) == structure_key(gm, [c, a, b])  # other values, same layout
    assert structure_key(gm, [a, b, b]) != structure_key(gm, [a, b, c])  # two inputs sharing memory
    assert structure_key(gm, [a, b, b]) != structure_key(gm, [a, b.t().contiguous().t(), b])  # another stride
    assert structure_key(gm, [a, b, b]) != structure_key(gm, [a, b[:, 1:], b])  # another shape
    gm.register_buffer("c", torch.ones(1))
    gm.graph.inserting_before(next(iter(gm.graph.find_nodes(op="output"))))
    gm.graph.get_attr("c")
    assert structure_key(gm, [a, b, b]) is None  # a region holding a constant is never shared


def test_regions_returning_one_value_compile_as_tuples_and_return_it_bare():
    """Inductor compiles graphs that return a tuple; this graph's last region returns one tensor, which
    split_module leaves bare (torch 2.11's has no ``tuple_return``). The split module still computes the graph."""
    gm = _two_layer_graph()
    returned = []

    def compile_region(region: fx.GraphModule, inputs: list):
        returned.append(region.graph.output_node().args[0])
        return region.forward

    split = compile_by_layer(gm, compile_region)
    inputs = [torch.randn(3, 5) for _ in range(3)]
    torch.testing.assert_close(split(*inputs), gm(*inputs))
    assert all(isinstance(r, tuple) for r in returned) and len(returned[-1]) == 1, returned
