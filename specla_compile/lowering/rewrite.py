"""FX pass: turn a captured model graph into its tree-verification twin.

Per GDN layer (found by :func:`~.graph_analysis.find_gdn_layers`):

* the recurrence becomes ``specla::gdn_commit_verify_``: it first commits the layer's pending accepted
  factor records into the durable state in place (delayed update), then verifies the draft tree from
  it; whatever the model wrote back as its "final state" is now that committed state;
* each short convolution commits its pending accepted inputs into the conv state and then runs the
  tree conv over the draft, one op (``specla::commit_tree_conv_``; fla's q, k and v convs of a layer
  share one, ``specla::commit_three_tree_convs_``: one launch); the model's own conv-state writes are
  dropped;
* the layer's new factor records ``(k_hat, v, g, beta)`` and conv inputs become extra graph outputs.

Full-attention layers (``scaled_dot_product_attention``) get the tree mask instead of the causal mask.
New inputs, appended after the model's own: ``parents [B, N]``, ``num_pending [B]``, the tree mask
``[B, 1, N, L]`` (hybrid models only), then per layer its pending tensors ``[B, N, ...]`` in record order.
Draft tokens never reach a durable-state write: the only remaining writes are the commits of pending
(already accepted) records.
"""

from __future__ import annotations

import copy
import operator
from dataclasses import dataclass

import torch
import torch.fx as fx

from .graph_analysis import (
    ConvSite,
    GDNLayer,
    find_gdn_layers,
    getitem_users,
    is_sdpa,
)


@dataclass(frozen=True)
class RecordSpec:
    """One per-node record tensor ``[B, N, *feature_shape]`` that a layer emits and takes back pending."""

    name: str
    feature_shape: tuple[int, ...]
    dtype: torch.dtype


@dataclass(frozen=True)
class LayerSpec:
    """Run-time facts of one rewritten layer: where its durable states are among the graph inputs,
    how to view its recurrent state as the op sees it, and its records."""

    state_input: int
    state_views: tuple[tuple[str, tuple, dict], ...]
    conv_state_inputs: tuple[int, ...]
    conv_kinds: tuple[str, ...]
    records: tuple[RecordSpec, ...]


@dataclass
class VerifyProgram:
    graph_module: fx.GraphModule
    num_model_inputs: int
    num_model_outputs: int
    layers: list[LayerSpec]
    needs_tree_mask: bool


def _feature_shape(node: fx.Node, drop: int = 2) -> tuple[int, ...]:
    value = node.meta.get("example_value")
    if value is None:
        raise ValueError(f"{node.name} carries no example value; was the graph captured by Dynamo?")
    return tuple(int(s) for s in value.shape[drop:])


def _dtype(node: fx.Node) -> torch.dtype:
    return node.meta["example_value"].dtype


def _erase_unused(graph: fx.Graph, node: fx.Node) -> None:
    """Erase ``node`` and then its inputs that this leaves unused (never placeholders or writes)."""
    frontier = [node]
    while frontier:
        n = frontier.pop()
        if n.users or n.op in ("placeholder", "output"):
            continue
        inputs = n.all_input_nodes
        graph.erase_node(n)
        frontier.extend(inputs)


class _Rewriter:
    def __init__(self, gm: fx.GraphModule):
        self.gm = gm
        self.graph = gm.graph
        self.placeholders = [n for n in self.graph.nodes if n.op == "placeholder"]
        self._last_input = self.placeholders[-1]

    def add_input(self, name: str) -> fx.Node:
        with self.graph.inserting_after(self._last_input):
            node = self.graph.placeholder(f"specla_{name}")
        self._last_input = node
        return node

    def call(self, target, *args, **kwargs) -> fx.Node:
        return self.graph.call_function(target, args, kwargs)

    def rewrite_recurrence(self, layer: GDNLayer, parents: fx.Node, num_pending: fx.Node, pending: list[fx.Node]) -> list[fx.Node]:
        r = layer.recurrence
        q, k, v, g, beta, state, scale, use_qk_l2norm = r.args
        with self.graph.inserting_before(r):
            verify = self.call(
                torch.ops.specla.gdn_commit_verify_.default,
                state, *pending, num_pending, q, k, v, g, beta, parents, scale, use_qk_l2norm,
            )
            o, k_hat = self.call(operator.getitem, verify, 0), self.call(operator.getitem, verify, 1)
            # v's record keeps v's dtype (bf16 values are exact in bf16: no cast kernel per layer and pass);
            # g and beta are float32 already in the models' code, the cast a no-op
            records = [k_hat, self.graph.call_method("contiguous", (v,)),
                       *(self.graph.call_method("to", (t, torch.float32)) for t in (g, beta))]
        for index, users in getitem_users(r).items():
            for user in users:
                user.replace_all_uses_with(o if index == 0 else state)
                self.graph.erase_node(user)
        self.graph.erase_node(r)
        for write in layer.writes:  # the model's copy of its "final state" is now a self-copy
            if write.target != "copy_" or write.args[1] not in (state, layer.state):
                raise ValueError(f"unexpected write {write.format_node()} into the recurrent state")
            write.replace_all_uses_with(write.args[0])
            self.graph.erase_node(write)
        return records

    def rewrite_conv(self, conv: ConvSite, parents: fx.Node, num_pending: fx.Node, pending_x: fx.Node) -> fx.Node:
        node = conv.node
        if conv.kind == "short_conv":
            x, state, weight, bias, silu = node.args
            with self.graph.inserting_before(node):
                fused = self.call(torch.ops.specla.commit_tree_conv_.default, state, pending_x, num_pending, x, weight, bias, parents, silu)
                y, record = (self.call(operator.getitem, fused, i) for i in range(2))
            self._replace_short_conv(node, y, state)
            return record
        # transformers: window = cat([state, x [B, D, N]], -1); y_window = causal_conv1d(window, ...)
        _, weight, bias, silu = node.args
        with self.graph.inserting_before(node):
            x_rows = self.graph.call_method("transpose", (conv.x, 1, 2))
            fused = self.call(torch.ops.specla.commit_tree_conv_.default, conv.state, pending_x, num_pending, x_rows, weight, bias, parents, silu)
            y, record = (self.call(operator.getitem, fused, i) for i in range(2))
            # keep the window's shape so the model's own slice of the last N columns still applies
            y_window = self.call(torch.cat, [self.call(torch.zeros_like, conv.state), self.graph.call_method("transpose", (y, 1, 2))], -1)
        node.replace_all_uses_with(y_window)
        self.graph.erase_node(node)
        for write in conv.writes:
            write.replace_all_uses_with(write.args[0])
            source = write.args[1]
            self.graph.erase_node(write)
            _erase_unused(self.graph, source)  # the window's tail, then the window itself
        return record

    def rewrite_three_convs(self, convs: list[ConvSite], parents: fx.Node, num_pending: fx.Node, pending_xs: list[fx.Node]) -> list[fx.Node] | None:
        """fla's q, k and v convs (bias-free, one ``silu``) as one op (one launch on GPUs), placed at the
        last conv: None, and nothing changed, when they do not fit that (another layout, or an output of
        one used before the last conv)."""
        nodes = [c.node for c in convs]
        if len(convs) != 3 or any(c.kind != "short_conv" or n.args[3] is not None for c, n in zip(convs, nodes)):
            return None
        if len({n.args[4] for n in nodes}) != 1:
            return None
        order = {n: i for i, n in enumerate(self.graph.nodes)}
        last = max(nodes, key=order.__getitem__)
        if any(order[use] < order[last] for n in nodes for item in n.users for use in item.users):
            return None
        xs, states, weights = ([n.args[i] for n in nodes] for i in range(3))
        with self.graph.inserting_before(last):
            fused = self.call(torch.ops.specla.commit_three_tree_convs_.default, *states, *pending_xs, num_pending, *xs, *weights,
                              parents, nodes[0].args[4])
            ys, records = ([self.call(operator.getitem, fused, i) for i in range(j, j + 3)] for j in (0, 3))
        for node, y, state in zip(nodes, ys, states):
            self._replace_short_conv(node, y, state)
        return records

    def _replace_short_conv(self, node: fx.Node, y: fx.Node, state: fx.Node) -> None:
        """fla's ``short_conv`` call returns ``(y, new state)``: its users now read ``y`` and the state the
        commit updated in place; the call goes."""
        for index, users in getitem_users(node).items():
            for user in users:
                user.replace_all_uses_with(y if index == 0 else state)
                self.graph.erase_node(user)
        self.graph.erase_node(node)

    def give_tree_mask(self, tree_mask: fx.Node) -> int:
        count = 0
        for node in self.graph.nodes:
            if is_sdpa(node):
                args = list(node.args)
                kwargs = dict(node.kwargs)
                if len(args) > 3:
                    args[3] = tree_mask
                else:
                    kwargs["attn_mask"] = tree_mask
                if len(args) > 5:
                    args[5] = False
                kwargs["is_causal"] = False
                node.args, node.kwargs = tuple(args), kwargs
                count += 1
        return count


def rewrite_for_verify(gm: fx.GraphModule) -> VerifyProgram:
    """Return the verification twin of a captured graph (``gm`` itself is left untouched)."""
    gm = fx.GraphModule(gm, copy.deepcopy(gm.graph))
    layers = find_gdn_layers(gm.graph)
    if not layers:
        raise ValueError("graph has no GDN recurrence to verify through")
    if any(layer.state is None or any(c.state is None for c in layer.convs) for layer in layers):
        raise ValueError("its GDN layers read no cache (a prefill without past state); verify after a plain prefill")
    rw = _Rewriter(gm)
    index_of = {p: i for i, p in enumerate(rw.placeholders)}
    num_model_inputs = len(rw.placeholders)
    parents = rw.add_input("parents")
    num_pending = rw.add_input("num_pending")
    has_attention = any(is_sdpa(n) for n in gm.graph.nodes)
    tree_mask = rw.add_input("tree_mask") if has_attention else None

    specs, extra_outputs = [], []
    for i, layer in enumerate(layers):
        _, k, v, g, beta = layer.recurrence.args[:5]
        records = [
            RecordSpec("k", _feature_shape(k), torch.float32),
            RecordSpec("v", _feature_shape(v), _dtype(v)),
            RecordSpec("g", _feature_shape(g), torch.float32),
            RecordSpec("beta", _feature_shape(beta), torch.float32),
        ]
        for c, conv in enumerate(layer.convs):
            channel_dim = 2 if conv.kind == "short_conv" else 1  # fla: [B, N, D]; transformers: [B, D, N]
            channels = int(conv.x.meta["example_value"].shape[channel_dim])
            records.append(RecordSpec(f"conv{c}", (channels,), _dtype(conv.x)))
        pending = [rw.add_input(f"layer{i}_pending_{r.name}") for r in records]
        outputs = rw.rewrite_recurrence(layer, parents, num_pending, pending[:4])
        conv_inputs = rw.rewrite_three_convs(layer.convs, parents, num_pending, pending[4:])
        if conv_inputs is None:
            conv_inputs = [rw.rewrite_conv(conv, parents, num_pending, p) for conv, p in zip(layer.convs, pending[4:])]
        outputs += conv_inputs
        extra_outputs += outputs
        specs.append(
            LayerSpec(
                state_input=index_of[layer.state],
                state_views=tuple((v.target, tuple(v.args[1:]), dict(v.kwargs)) for v in layer.state_views),
                conv_state_inputs=tuple(index_of[c.state] for c in layer.convs),
                conv_kinds=tuple(c.kind for c in layer.convs),
                records=tuple(records),
            )
        )
    if tree_mask is not None:
        rw.give_tree_mask(tree_mask)

    output = next(n for n in gm.graph.nodes if n.op == "output")
    model_outputs = output.args[0]
    if not isinstance(model_outputs, (tuple, list)):
        raise ValueError("expected a Dynamo graph returning a tuple")
    output.args = (tuple(model_outputs) + tuple(extra_outputs),)
    gm.graph.lint()
    gm.recompile()
    return VerifyProgram(gm, num_model_inputs, len(model_outputs), specs, has_attention)
