"""Tensor-parallel plans for the GDN layers of transformers' Qwen3.5 and Qwen3-Next models.

transformers' own plan (``from_pretrained(..., tp_plan="auto")`` under ``torchrun``) shards attention
and MLPs by heads and columns but gathers every GDN projection (``colwise_gather_output``): every rank
runs every GDN head and holds every recurrent and conv state. :func:`shard_gdn_heads` switches the GDN
layers to a head-sharded plan, the way attention is sharded: rank ``r`` of ``W`` keeps key heads
``r*H/W .. (r+1)*H/W`` and the value heads that read them (value head ``h`` reads key head
``h // (HV/H)``), i.e. its rows of ``in_proj_qkv`` (q, k and v blocks), ``in_proj_z``, ``in_proj_b``,
``in_proj_a`` (Qwen3.5) or of ``in_proj_qkvz`` and ``in_proj_ba`` (Qwen3-Next, grouped by key head),
its channels of the short convolution, its ``A_log`` and ``dt_bias``, and its columns of ``out_proj``; recurrent and conv states hold only its heads, and one all-reduce after ``out_proj``
sums the ranks' parts. The all-reduce is a functional collective, so it stays inside compiled graphs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed import _functional_collectives as funcol
from torch.distributed.tensor import DTensor

from .runtime.distributed import mark_tensor_parallel

_COMMON = ("conv1d", "out_proj", "A_log", "dt_bias", "num_k_heads", "num_v_heads")
_SEPARATE = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")  # Qwen3.5: [q | k | v], z, b, a by value head
_GROUPED = ("in_proj_qkvz", "in_proj_ba")  # Qwen3-Next: rows grouped by key head, (q, k, v, z) and (b, a) per group


class AllReduceLinear(nn.Linear):
    """A row-parallel linear layer: this rank's input columns, then the sum over ``mesh`` (bias added once)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, mesh):
        super().__init__(weight.shape[1], weight.shape[0], bias=bias is not None, device="meta")
        self.weight = _param(weight)
        self.bias = None if bias is None else _param(bias)
        self.mesh = mesh

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = funcol.all_reduce(F.linear(x, self.weight), "sum", self.mesh)
        return out if self.bias is None else out + self.bias


def _full(t: torch.Tensor) -> torch.Tensor:
    """A parameter's whole value (a DTensor of transformers' plan is gathered: every rank calls this)."""
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach()


def _param(t: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(t.contiguous(), requires_grad=False)


def _has(module: nn.Module, parts: tuple[str, ...]) -> bool:
    return all(hasattr(module, part) for part in parts)


def _is_gdn_layer(module: nn.Module) -> bool:
    return _has(module, _COMMON) and (_has(module, _SEPARATE) or _has(module, _GROUPED))


def _shard_layer(layer: nn.Module, rank: int, world: int, mesh) -> None:
    hk, hv = layer.num_k_heads // world, layer.num_v_heads // world
    dk, dv = layer.head_k_dim, layer.head_v_dim
    key_dim, value_dim = layer.key_dim, layer.value_dim
    k_rows = slice(rank * hk * dk, (rank + 1) * hk * dk)
    v_rows = slice(rank * hv * dv, (rank + 1) * hv * dv)
    heads = slice(rank * hv, (rank + 1) * hv)

    def qkv(t: torch.Tensor) -> torch.Tensor:  # rows (or channels) [q | k | v] -> this rank's heads of each
        q, k, v = t.split([key_dim, key_dim, value_dim])
        return torch.cat([q[k_rows], k[k_rows], v[v_rows]])

    def linear(weight: torch.Tensor) -> nn.Linear:
        new = nn.Linear(weight.shape[1], weight.shape[0], bias=False, device="meta")
        new.weight = _param(weight)
        return new

    grouped = hasattr(layer, "in_proj_qkvz")
    projections = _GROUPED if grouped else _SEPARATE
    if any(getattr(layer, name).bias is not None for name in projections):
        raise NotImplementedError("shard_gdn_heads: GDN input projections with a bias are not supported")
    if grouped:  # a block of key heads is a block of rows
        for name in projections:
            weight = _full(getattr(layer, name).weight)
            per_rank = weight.shape[0] // world
            setattr(layer, name, linear(weight[rank * per_rank : (rank + 1) * per_rank]))
    else:
        layer.in_proj_qkv = linear(qkv(_full(layer.in_proj_qkv.weight)))
        layer.in_proj_z = linear(_full(layer.in_proj_z.weight)[v_rows])
        layer.in_proj_b = linear(_full(layer.in_proj_b.weight)[heads])
        layer.in_proj_a = linear(_full(layer.in_proj_a.weight)[heads])
    conv = layer.conv1d
    weight = qkv(_full(conv.weight))
    channels = weight.shape[0]
    new_conv = nn.Conv1d(channels, channels, conv.kernel_size[0], groups=channels, padding=conv.padding[0],
                         bias=conv.bias is not None, device="meta")
    new_conv.weight = _param(weight)
    if conv.bias is not None:
        new_conv.bias = _param(qkv(_full(conv.bias)))
    layer.conv1d = new_conv
    layer.A_log = _param(_full(layer.A_log)[heads])
    layer.dt_bias = _param(_full(layer.dt_bias)[heads])
    out = layer.out_proj
    layer.out_proj = AllReduceLinear(_full(out.weight)[:, v_rows], None if out.bias is None else _full(out.bias), mesh)
    layer.num_k_heads, layer.num_v_heads = hk, hv
    layer.key_dim, layer.value_dim = hk * dk, hv * dv
    layer.conv_dim = channels


def shard_gdn_heads(model: nn.Module, mesh=None) -> nn.Module:
    """Shard the GDN layers of ``model`` by heads over the 1-D device ``mesh`` (default: the mesh
    transformers loaded the model with, ``tp_plan="auto"``), in place; returns ``model``.

    Every rank of the mesh calls it with the same model. Works on a model loaded with transformers'
    plan (its gathered GDN projections are replaced) or on a whole model on every rank (then pass
    ``mesh``, e.g. ``init_device_mesh("cuda", (world,))``). Raises ``ValueError`` when the model has no
    Qwen3.5 / Qwen3-Next GDN layer or the mesh size does not divide its key and value heads.
    """
    mesh = mesh if mesh is not None else getattr(model, "_device_mesh", None)
    if mesh is None:
        raise ValueError("shard_gdn_heads needs a device mesh: load the model with tp_plan='auto' under torchrun, or pass mesh=")
    if mesh.ndim != 1:
        mesh = mesh["tp"]
    layers = [m for m in model.modules() if _is_gdn_layer(m)]
    if not layers:
        other = [type(m).__name__ for m in model.modules() if type(m).__name__ == "GatedDeltaNet"]
        what = f"its GDN layers ({other[0]}) have another layout" if other else "it has no GDN layer"
        raise ValueError(f"shard_gdn_heads supports the GDN layers of transformers' Qwen3.5 and Qwen3-Next; {type(model).__name__}: {what}")
    world, rank = mesh.size(), mesh.get_local_rank()
    heads = (layers[0].num_k_heads, layers[0].num_v_heads)
    if any(h % world for h in heads):
        raise ValueError(f"shard_gdn_heads: {heads[0]} key heads and {heads[1]} value heads cannot be split evenly over {world} ranks")
    with torch.no_grad():
        for layer in layers:
            _shard_layer(layer, rank, world, mesh)
    mark_tensor_parallel(model, mesh)
    return model
