"""The registration hook: a user's own GDN code, named once, verifies draft trees like the known families."""

from __future__ import annotations

import sys

import pytest
import torch
import torch.nn.functional as F

from specla_compile.kernels.reference import gdn_chain_reference
from specla_compile.lowering.capture import RecurrenceCall, register_recurrence
from specla_compile.lowering.session import VerifySession


def my_gdn(q, k, v, log_decay, beta, state):
    """A user's recurrence with its own argument names; returns (o, new_state) like fla."""
    return gdn_chain_reference(q, k, v, log_decay, beta, state, use_qk_l2norm=True)


class TinyGDN(torch.nn.Module):
    """One GDN layer over token embeddings, with its recurrent state kept in a buffer."""

    def __init__(self, vocab: int = 31, dim: int = 16, heads: int = 2, head_dim: int = 8):
        super().__init__()
        self.heads, self.head_dim = heads, head_dim
        self.embed = torch.nn.Embedding(vocab, dim)
        self.qkv = torch.nn.Linear(dim, 3 * heads * head_dim)
        self.gates = torch.nn.Linear(dim, 2 * heads)
        self.out = torch.nn.Linear(heads * head_dim, vocab)
        self.register_buffer("state", torch.zeros(1, heads, head_dim, head_dim))

    def forward(self, tokens):
        x = self.embed(tokens)
        q, k, v = self.qkv(x).unflatten(-1, (3, self.heads, self.head_dim)).unbind(2)
        a, b = self.gates(x).unflatten(-1, (2, self.heads)).unbind(2)
        o, new_state = my_gdn(q, k, v, -F.softplus(a), b.sigmoid(), self.state)
        self.state.copy_(new_state)
        return self.out(o.flatten(2))


def adapter(q, k, v, log_decay, beta, state):
    return RecurrenceCall(q, k, v, log_decay, beta, initial_state=state, output_final_state=True, use_qk_l2norm=True)


def test_registered_recurrence_verifies_a_chain():
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = TinyGDN().eval()
    register_recurrence(sys.modules[__name__], "my_gdn", adapter)
    tokens = torch.randint(0, 31, (1, 9))
    with torch.no_grad():
        model(tokens[:, :4])
        start = model.state.clone()
        expected = torch.cat([model(tokens[:, t : t + 1]) for t in range(4, 9)], 1)
        after_eager = model.state.clone()
        model.state.copy_(start)
        compiled = torch.compile(model, backend="specla", options={"inner": "aot_eager"})
        session = VerifySession()
        with session.verify(torch.arange(-1, 4)[None]):
            logits = compiled(tokens[:, 4:])
        assert torch.equal(model.state, start)  # drafts never touch the durable state
        assert (logits - expected).abs().max() <= 1e-5
        session.accept(torch.arange(5)[None], torch.tensor([5]))
        session.flush()
        assert (model.state - after_eager).abs().max() <= 1e-5


def test_register_recurrence_rejects_missing_function():
    with pytest.raises(ValueError, match="no callable attribute"):
        register_recurrence(sys.modules[__name__], "not_a_function", adapter)
