"""Tensor-parallel runs: every rank runs the same generation loop on its shard of the model.

A model is tensor-parallel when transformers loaded it with ``tp_plan`` (its ``_device_mesh``) or
:func:`specla_compile.parallel.shard_gdn_heads` sharded it (:func:`mark_tensor_parallel`). Every rank
then drafts, verifies, accepts and commits in lockstep: the compiled graphs hold the collectives
(functional collectives, no graph breaks), and the logits they end with are replicated bit for bit
(the last collective is an all-gather or an all-reduce, whose result every rank receives), so greedy
acceptance is the same everywhere. What the host adds is the draft: :func:`broadcast_draft` makes
every rank verify rank 0's draft, so a drafter whose numbers differ across devices cannot split them.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .drafting import Draft

_MESH = "_specla_tp_mesh"


def mark_tensor_parallel(model: torch.nn.Module, mesh) -> None:
    """Record that ``model`` is sharded over the 1-D device ``mesh`` (for :func:`tensor_parallel_mesh`)."""
    setattr(model, _MESH, mesh)


def tensor_parallel_mesh(model: torch.nn.Module):
    """The 1-D tensor-parallel mesh ``model`` is sharded over, or None (one process, or a mesh of one)."""
    mesh = getattr(model, _MESH, None)
    mesh = mesh if mesh is not None else getattr(model, "_device_mesh", None)
    if mesh is None:
        return None
    if mesh.ndim > 1:
        if "tp" not in (mesh.mesh_dim_names or ()):
            raise ValueError(f"a {mesh.ndim}-D device mesh needs a 'tp' dimension for tensor-parallel decoding")
        mesh = mesh["tp"]
    return mesh if mesh.size() > 1 else None


def _wire_device(group) -> torch.device:
    """Where a collective of ``group`` takes its tensors: the current GPU for NCCL, else the CPU."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def broadcast_draft(draft: Draft, mesh) -> Draft:
    """Rank 0's ``draft`` (rank 0 of the mesh) on every rank, on the device this rank's draft is on."""
    group = mesh.get_group()
    source, wire = dist.get_global_rank(group, 0), _wire_device(group)
    mine = dist.get_rank(group) == 0
    vocab = draft.probs.shape[-1] if draft.probs is not None else 0
    header = torch.tensor([*draft.tokens.shape, vocab], device=wire)
    dist.broadcast(header, source, group=group)
    rows, nodes, vocab = header.tolist()
    topology = torch.stack([draft.tokens, draft.parents]).to(wire, torch.long) if mine else torch.empty(2, rows, nodes, dtype=torch.long, device=wire)
    dist.broadcast(topology, source, group=group)
    probs = None
    if vocab:
        probs = draft.probs.to(wire, torch.float32) if mine else torch.empty(rows, nodes, vocab, device=wire)
        dist.broadcast(probs, source, group=group)
    device = draft.tokens.device
    return Draft(topology[0].to(device), topology[1].to(device), None if probs is None else probs.to(device), draft.chain)
