"""Find the GDN pieces of a captured FX graph: recurrence, conv windows, durable state and its writes.

Works on Dynamo's torch-level graphs, where capture (:mod:`.capture`) left one ``specla::`` node per
recurrence and per short convolution. Model caches enter as placeholders; a model writes them either
in place (``copy_`` into the placeholder, transformers) or by returning the new tensor for Dynamo to
store back (fla).
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field

import torch
import torch.fx as fx

from ..kernels import ops

RECURRENCE = (ops.gdn_recurrence, torch.ops.specla.gdn_recurrence, torch.ops.specla.gdn_recurrence.default)
SHORT_CONV = (ops.short_conv, torch.ops.specla.short_conv, torch.ops.specla.short_conv.default)
CAUSAL_CONV = (ops.causal_conv1d, torch.ops.specla.causal_conv1d, torch.ops.specla.causal_conv1d.default)
VIEW_METHODS = {"transpose", "permute", "t", "view", "reshape", "unsqueeze", "squeeze", "contiguous", "mT"}
INPLACE_WRITE_METHODS = {"copy_", "fill_", "zero_", "index_copy_", "index_put_", "scatter_", "masked_fill_", "add_", "mul_"}


def is_call(node: fx.Node, targets: tuple) -> bool:
    return node.op == "call_function" and node.target in targets


def is_sdpa(node: fx.Node) -> bool:
    return node.op == "call_function" and getattr(node.target, "__name__", "") == "scaled_dot_product_attention"


def getitem_users(node: fx.Node) -> dict[int, list[fx.Node]]:
    """Users ``node[i]`` of a tuple-returning node, by index."""
    out: dict[int, list[fx.Node]] = {}
    for user in node.users:
        if not (user.op == "call_function" and user.target is operator.getitem):
            raise ValueError(f"unexpected use {user.format_node()} of {node.name}")
        out.setdefault(user.args[1], []).append(user)
    return out


def view_chain(node: fx.Node) -> tuple[fx.Node | None, list[fx.Node]]:
    """Follow ``node`` back through view-only method calls to its placeholder: ``(placeholder, views)``,
    views root-side first; ``(None, [])`` when ``node`` is not a view of a graph input (no cache)."""
    views = []
    while node.op != "placeholder":
        if not (node.op == "call_method" and node.target in VIEW_METHODS):
            return None, []
        views.append(node)
        node = node.args[0]
    return node, views[::-1]


def replay_views(tensor: torch.Tensor, views: list[fx.Node]) -> torch.Tensor:
    """Apply the view calls of :func:`view_chain` to a real tensor (giving a view of the same memory)."""
    for view in views:
        tensor = getattr(tensor, view.target)(*view.args[1:], **view.kwargs)
    return tensor


@dataclass
class ConvSite:
    """One short convolution of a GDN layer.

    ``kind="short_conv"`` (fla): ``node = short_conv(x [B, T, D], state, w, b, silu)``.
    ``kind="causal_conv1d"`` (transformers): ``window = cat([state, x [B, D, T]], -1)`` feeds
    ``node = causal_conv1d(window, w, b, silu)`` and ``writes`` copy the window's tail into ``state``.
    """

    kind: str
    node: fx.Node
    state: fx.Node | None  # the cache placeholder; None when the call reads no cache
    x: fx.Node
    window: fx.Node | None = None
    writes: list[fx.Node] = field(default_factory=list)


@dataclass
class GDNLayer:
    """One GDN layer: its recurrence node, the placeholder of its recurrent state (and the view chain
    from it to the recurrence's state argument), the in-place writes of that state, and its convs."""

    recurrence: fx.Node
    state: fx.Node | None  # the cache placeholder; None when the call reads no cache
    state_views: list[fx.Node]
    writes: list[fx.Node]
    convs: list[ConvSite]


def _inplace_writes(placeholder: fx.Node) -> list[fx.Node]:
    """Nodes writing ``placeholder`` (or a view of it) in place."""
    out, frontier = [], [placeholder]
    while frontier:
        node = frontier.pop()
        for user in node.users:
            if user.op == "call_method" and user.target in VIEW_METHODS and user.args[0] is node:
                frontier.append(user)
            elif user.op == "call_method" and user.target in INPLACE_WRITE_METHODS and user.args[0] is node:
                out.append(user)
    return out


def _cache_tensor(node: fx.Node) -> fx.Node | None:
    placeholder, views = view_chain(node)
    return placeholder if not views else None


def _conv_site(node: fx.Node) -> ConvSite:
    if is_call(node, SHORT_CONV):
        return ConvSite("short_conv", node, _cache_tensor(node.args[1]), node.args[0])
    window = node.args[0]
    if not (window.op == "call_function" and window.target is torch.cat and len(window.args[0]) == 2):
        return ConvSite("causal_conv1d", node, None, window)  # a window without cached history
    state, x = window.args[0]
    placeholder = _cache_tensor(state)
    writes = _inplace_writes(placeholder) if placeholder is not None else []
    return ConvSite("causal_conv1d", node, placeholder, x, window, writes)


def find_gdn_layers(graph: fx.Graph) -> list[GDNLayer]:
    """Every GDN layer of ``graph`` in graph order. Convs belong to the next recurrence that reads them."""
    layers: list[GDNLayer] = []
    pending_convs: list[fx.Node] = []
    for node in graph.nodes:
        if is_call(node, SHORT_CONV) or is_call(node, CAUSAL_CONV):
            pending_convs.append(node)
        elif is_call(node, RECURRENCE):
            placeholder, views = view_chain(node.args[5])
            writes = _inplace_writes(placeholder) if placeholder is not None else []
            layers.append(GDNLayer(node, placeholder, views, writes, [_conv_site(c) for c in pending_convs]))
            pending_convs = []
    if pending_convs:
        raise ValueError(f"short convolutions {[c.name for c in pending_convs]} feed no GDN recurrence")
    return layers


def depends_on(node: fx.Node, sources: set[fx.Node]) -> bool:
    """Whether ``node``'s value is computed from any of ``sources`` (through data edges)."""
    seen, frontier = set(), [node]
    while frontier:
        n = frontier.pop()
        if n in sources:
            return True
        if n in seen:
            continue
        seen.add(n)
        frontier.extend(n.all_input_nodes)
    return False


def example_value(node) -> torch.Tensor | None:
    """The fake tensor Dynamo (or a pass, :func:`fill_example_values`) recorded for a tensor node, else None."""
    value = node.meta.get("example_value") if isinstance(node, fx.Node) else None
    return value if isinstance(value, torch.Tensor) else None


def graph_fake_mode(graph: fx.Graph):
    """The fake mode of the graph's example values (new nodes get theirs in it)."""
    return torch._guards.detect_fake_mode([example_value(n) for n in graph.nodes if example_value(n) is not None])


def recompiled(gm: fx.GraphModule, rewrites: int) -> int:
    """Check and recompile ``gm`` if a pass rewrote anything; returns ``rewrites``."""
    if rewrites:
        gm.graph.lint()
        gm.recompile()
    return rewrites


def written_tensors(node: fx.Node) -> list[fx.Node]:
    """The tensors ``node`` may write in place: a custom op's mutable arguments (Dynamo's graphs call the op's
    packet, whose default overload has the schema), an in-place method's or function's first argument, the target
    of ``x[i] = y``, an ``out=`` argument."""
    out = [node.kwargs["out"]] if isinstance(node.kwargs.get("out"), fx.Node) else []
    if node.op == "call_method":
        return out + ([node.args[0]] if node.target.endswith("_") else [])
    if node.op != "call_function":
        return out
    if node.target is operator.setitem:
        return [node.args[0]]
    target = node.target
    if isinstance(target, torch._ops.OpOverloadPacket) and "default" in target.overloads():
        target = target.default
    if isinstance(target, torch._ops.OpOverload):
        schema = target._schema
        if not schema.is_mutable:
            return []
        named = dict(zip((a.name for a in schema.arguments), node.args)) | node.kwargs
        args = [named.get(a.name) for a in schema.arguments if a.alias_info is not None and a.alias_info.is_write]
        return [t for arg in args for t in (arg if isinstance(arg, (list, tuple)) else [arg]) if isinstance(t, fx.Node)]
    return out + ([node.args[0]] if getattr(target, "__name__", "").endswith("_") and node.args else [])


def fill_example_values(graph: fx.Graph, fake_mode) -> None:
    """Give the nodes a pass added (the rewrite, the fold of the norms) the example value Dynamo gives its own
    (run on their inputs' fake values): AOTAutograd's cache refuses a graph that calls a tensor method on a node
    without one, and without its cache a warm process re-traces every graph with AOTAutograd."""
    if fake_mode is None:
        return

    def value(n: fx.Node):
        return n.meta["example_value"]

    with fake_mode:
        for node in graph.nodes:
            if node.op not in ("call_function", "call_method") or "example_value" in node.meta:
                continue
            args, kwargs = fx.node.map_arg((node.args, node.kwargs), value)
            if node.op == "call_method":
                node.meta["example_value"] = getattr(args[0], node.target)(*args[1:], **kwargs)
            else:
                node.meta["example_value"] = node.target(*args, **kwargs)
