"""What the runtime needs to know about a model cache (fla ``Cache``, transformers ``DynamicCache``).

GDN states (recurrent and conv) are handled through the verify ops and never touched here beyond
copies; full-attention K/V of hybrid models are appended by every verification and compacted here to
the accepted nodes. One walker, :func:`cache_slots`, knows where each family keeps its tensors.
"""

from __future__ import annotations

import copy
import functools
import inspect
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from ..tree import gather_nodes


class _TupleField:
    """Item access to ``owner[name]``, a tuple, replacing the tuple on writes (its type stays a tuple:
    compiled graphs guard on it)."""

    def __init__(self, owner: dict, name: str):
        self.owner, self.name = owner, name

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.owner[self.name][i]

    def __setitem__(self, i: int, value: torch.Tensor) -> None:
        items = list(self.owner[self.name])
        items[i] = value
        self.owner[self.name] = type(self.owner[self.name])(items)


@dataclass
class Slot:
    """One tensor of a cache: ``holder[key]`` (dict, list, tuple field) or ``getattr(holder, key)``."""

    holder: Any
    key: Any
    kind: str  # "state" (recurrent or conv, batch-first) or "kv" (attention K/V [B, H, L, D])

    def get(self) -> torch.Tensor:
        return self.holder[self.key] if isinstance(self.holder, (dict, list, _TupleField)) else getattr(self.holder, self.key)

    def set(self, value: torch.Tensor) -> None:
        if isinstance(self.holder, (dict, list, _TupleField)):
            self.holder[self.key] = value
        else:
            setattr(self.holder, self.key, value)


def _sequence_slots(holder, kind: str) -> Iterator[Slot]:
    keys = sorted(holder) if isinstance(holder, dict) else range(len(holder))
    for key in keys:
        if isinstance(holder[key], torch.Tensor):
            yield Slot(holder, key, kind)


def _tuple_slots(owner: dict, name: str, kind: str) -> Iterator[Slot]:
    field = _TupleField(owner, name)
    for i, value in enumerate(owner[name]):
        if isinstance(value, torch.Tensor):
            yield Slot(field, i, kind)


def cache_argument(model: torch.nn.Module) -> str:
    """The name of the cache argument of ``model``'s forward: ``cache`` (transformers >= 5.24, where
    ``past_key_values`` is deprecated) or ``past_key_values`` (fla models, older transformers)."""
    forward = getattr(model, "_orig_mod", model).forward  # (a compiled model: the wrapped one's signature)
    return _cache_argument_of(getattr(forward, "__func__", forward))


def returned_cache(output):
    """The cache a forward returned: its ``cache`` (transformers >= 5.24 names it so, and from 5.25 reading
    ``past_key_values`` logs a deprecation), else its ``past_key_values`` (None: it returned none)."""
    cache = getattr(output, "cache", None)
    return cache if cache is not None else getattr(output, "past_key_values", None)


@functools.cache
def _cache_argument_of(forward) -> str:  # (once per forward: reading a signature costs 0.2 ms, every call did)
    return "cache" if "cache" in inspect.signature(forward).parameters else "past_key_values"


def cache_slots(cache) -> list[Slot]:
    """Every tensor of ``cache``. Raises ``TypeError`` for a cache layout this runtime does not know."""
    layers = getattr(cache, "layers", None)
    if layers is None:
        raise TypeError(f"unsupported cache type {type(cache).__name__}: expected an fla Cache or a transformers DynamicCache")
    slots: list[Slot] = []
    for layer in layers:
        state = getattr(layer, "state", None)
        if isinstance(state, dict):  # fla
            for name in ("recurrent_state", "conv_state", "ffn_state"):
                value = state.get(name)
                if isinstance(value, torch.Tensor):
                    slots.append(Slot(state, name, "state"))
                elif isinstance(value, (tuple, list)):
                    slots += _tuple_slots(state, name, "state")
            if state.get("attn_state") is not None:
                raise NotImplementedError("fla models with attention layers are not supported by the runtime yet")
            continue
        for name in ("recurrent_states", "conv_states"):  # transformers linear-attention layers
            holder = getattr(layer, name, None)
            if holder:
                slots += _sequence_slots(holder, "state")
        for name in ("keys", "values"):
            if isinstance(getattr(layer, name, None), torch.Tensor) and getattr(layer, name).numel():
                slots.append(Slot(layer, name, "kv"))
    return slots


def snapshot(cache) -> list[torch.Tensor]:
    """Copies of every cache tensor, for :func:`restore` after a failure."""
    return [slot.get().clone() for slot in cache_slots(cache)]


def restore(cache, saved: list[torch.Tensor]) -> None:
    for slot, value in zip(cache_slots(cache), saved):
        if slot.get().shape == value.shape:
            slot.get().copy_(value)  # in place: compiled graphs may hold the tensor's address
        else:
            slot.set(value)


def stack_rows(caches: list, lengths: list[int]):
    """One batched cache from single-row caches; attention K/V of shorter rows are left-padded with
    zeros (the runtime masks them). ``lengths`` are the rows' token counts."""
    merged = copy.copy(caches[0])
    merged.layers = copy.deepcopy(caches[0].layers)
    longest = max(lengths)
    per_row = [cache_slots(c) for c in caches]
    for i, slot in enumerate(cache_slots(merged)):
        rows = [slots[i].get() for slots in per_row]
        if slot.kind == "kv":
            rows = [torch.nn.functional.pad(r, (0, 0, longest - r.shape[-2], 0)) for r in rows]
        slot.set(torch.cat(rows, dim=0))
    set_seen_tokens(merged, longest)
    return merged


def left_padding_mask(lengths: torch.Tensor) -> torch.Tensor:
    """``[B, longest]``: which attention columns of a :func:`stack_rows` cache hold tokens (``lengths [B]``)."""
    longest = int(lengths.max())
    return torch.arange(longest, device=lengths.device)[None] >= (longest - lengths)[:, None]


def past_columns_inputs(valid: torch.Tensor, new: int) -> dict[str, torch.Tensor]:
    """Model inputs for ``new`` tokens per row appended to a cache whose attention columns ``valid [B, W]``
    mark each row's tokens: the ``attention_mask`` over past and new columns, and each row's own
    ``position_ids`` (its token count goes on, whatever the padding or gaps before)."""
    mask = torch.cat([valid, valid.new_ones(valid.shape[0], new)], dim=1)
    positions = valid.sum(-1, keepdim=True) + torch.arange(new, device=valid.device)
    return {"attention_mask": mask.long(), "position_ids": positions}


def split_rows(cache, lengths: list[int]) -> list:
    """The inverse of :func:`stack_rows`: one single-row cache per row of ``cache`` (attention K/V
    left-padded; row ``b`` keeps its last ``lengths[b]`` columns)."""
    slots = cache_slots(cache)
    rows = []
    for b, length in enumerate(lengths):
        # Seeding deepcopy's memo with each row's tensors copies the cache's structure, not its batch.
        memo = {}
        for slot in slots:
            t = slot.get()
            memo[id(t)] = (t[b : b + 1, ..., t.shape[-2] - length :, :] if slot.kind == "kv" else t[b : b + 1]).clone()
        row = copy.deepcopy(cache, memo)
        set_seen_tokens(row, length)
        rows.append(row)
    return rows


def compact_attention(cache, past: int, path: torch.Tensor, width: int) -> None:
    """After a verification appended N draft nodes to every attention layer: keep positions ``:past``
    and then, per row, the nodes ``path[b, :width]`` (the caller masks entries past a row's count)."""
    for slot in cache_slots(cache):
        if slot.kind != "kv":
            continue
        kv = slot.get()
        drafted = kv[..., past:, :].transpose(1, 2)  # [B, N, H, D]: nodes second, as gather_nodes wants
        kept = gather_nodes(drafted, path[:, :width]).transpose(1, 2)
        slot.set(torch.cat([kv[..., :past, :], kept], dim=-2))


def set_seen_tokens(cache, count: int) -> None:
    """Keep the token counters in line with what the cache holds (drafts are not 'seen'): fla's, and the
    linear-attention layers' of transformers >= 5.25 (``get_seq_length()`` reads layer 0, a GDN layer)."""
    set_fla_seen_tokens(cache, count)
    for layer in getattr(cache, "layers", ()):
        linear_count = getattr(layer, "cumulative_length_linear", None)
        if isinstance(linear_count, torch.Tensor):
            linear_count.fill_(count)  # (in place: a compiled graph may hold its address)


def set_fla_seen_tokens(cache, count: int) -> None:
    """fla's token counters only: host integers, free to set before every pass (transformers' are tensors,
    a kernel each)."""
    for owner in (cache, *getattr(cache, "layers", ())):
        if hasattr(owner, "_seen_tokens"):
            owner._seen_tokens = count


def has_attention(cache) -> bool:
    return any(slot.kind == "kv" for slot in cache_slots(cache))


def attention_width(cache) -> int:
    """Attention columns the cache's K/V hold (0 without attention), read from the attention layers: a
    hybrid cache's ``get_seq_length()`` may count a GDN layer's tokens instead (transformers >= 5.25)."""
    return max((_attention_width(layer) for layer in getattr(cache, "layers", ()) if _is_attention_layer(layer)), default=0)


def _is_attention_layer(layer) -> bool:
    return isinstance(getattr(layer, "keys", None), torch.Tensor) and layer.keys.numel() > 0


def _attention_width(layer) -> int:
    """Columns of K/V a layer holds: all of a dynamic layer's, the written ones of a static layer's."""
    length = getattr(layer, "cumulative_length", None)
    return int(length) if length is not None and getattr(layer, "max_cache_len", None) else layer.keys.shape[-2]


def static_twin(cache, config, capacity: int):
    """A cache of the same layout whose tensors never move: GDN states are copies, attention layers
    become transformers ``StaticLayer``s of ``capacity`` columns. Fill it with :func:`load_static`."""
    if not has_attention(cache):
        return copy.deepcopy(cache)
    from transformers import StaticCache

    twin = StaticCache(config=config, max_cache_len=capacity)
    for i, layer in enumerate(cache.layers):
        if _is_attention_layer(layer):
            twin.layers[i].lazy_initialization(layer.keys, layer.values)
        else:
            twin.layers[i] = copy.deepcopy(layer)
    return twin


def zeroed_copy(cache):
    """A cache of ``cache``'s layout whose GDN states are zeros (what a prompt starts from), for a model without
    attention layers. Only the layers and the containers of their states are copied: a deepcopy walks every
    object of the cache (1.4 ms for 8 fla layers on the CI CPU, once per ``generate`` call)."""
    out = copy.copy(cache)
    out.layers = [copy.copy(layer) for layer in cache.layers]
    for layer in out.layers:  # every container of a layer its own (fla's state dict; transformers' state and flag dicts)
        for name, value in vars(layer).items():
            if isinstance(value, (dict, list)):
                setattr(layer, name, copy.copy(value))
    slots = cache_slots(out)  # (one walk: the check, then the states)
    if any(slot.kind == "kv" for slot in slots):
        raise NotImplementedError("zeroed_copy takes caches without attention layers")
    for slot in slots:
        slot.set(torch.zeros_like(slot.get()))
    return out


def gdn_states(cache) -> list[torch.Tensor]:
    """Every GDN state (recurrent and conv) of ``cache``, layer by layer."""
    return [slot.get() for slot in cache_slots(cache) if slot.kind == "state"]


def same_layout(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    """Whether two caches' :func:`gdn_states` have the same shapes and dtypes, one by one."""
    return len(a) == len(b) and all(x.shape == y.shape and x.dtype == y.dtype for x, y in zip(a, b))


def load_static(twin, cache, twin_states: list[torch.Tensor], states: list[torch.Tensor]) -> int:
    """Copy ``cache`` (its GDN ``states``) into its :func:`static_twin` (``twin_states``) in place;
    returns the attention width (0 without). The states go in one multi-tensor copy rather than a
    launch per state from Python."""
    width = 0
    for mine, theirs in zip(twin.layers, cache.layers):
        if _is_attention_layer(mine):
            width = _attention_width(theirs)
            for name in ("keys", "values"):
                getattr(mine, name)[..., :width, :].copy_(getattr(theirs, name)[..., :width, :])
            mine.cumulative_length.fill_(width)
    if states:  # (a model without GDN layers has none; the verify pass then says so)
        torch._foreach_copy_(twin_states, states)
    return width


def store_static(twin, cache, width: int, twin_states: list[torch.Tensor], states: list[torch.Tensor]) -> None:
    """Write a static twin's tensors back into ``cache`` (``states``; attention: its first ``width`` columns)."""
    for mine, theirs in zip(twin.layers, cache.layers):
        if _is_attention_layer(mine):
            if getattr(theirs, "max_cache_len", None):  # a static cache given by the caller
                theirs.keys.copy_(mine.keys)
                theirs.values.copy_(mine.values)
                theirs.cumulative_length.fill_(width)
            else:
                theirs.keys, theirs.values = mine.keys[..., :width, :].clone(), mine.values[..., :width, :].clone()
    if states:
        torch._foreach_copy_(states, twin_states)
