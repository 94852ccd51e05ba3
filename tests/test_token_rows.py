"""The host's token history of a static run: appends, the pending token, views that stay valid, refusals."""

import pytest
import torch

from specla_compile.runtime.token_rows import TokenRows


def test_rows_grow_by_their_commits_and_show_the_pending_token_last():
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 1000, (n,), generator=gen) for n in (3, 7)]
    rows = TokenRows(prompts, width=12)
    expected = [p.tolist() for p in prompts]
    held = []  # what a drafter may keep between iterations
    for step, (pending, commits) in enumerate([((11, 12), ([11, 5], [12])), ((6, 13), ([6], [13, 14, 15]))]):
        for b in (0, 1):
            seq = rows.with_pending(b, pending[b])
            assert seq.dtype == torch.int64 and seq.tolist() == expected[b] + [pending[b]]
            held.append((seq, seq.tolist()))
        for b in (0, 1):
            new = rows.append(b, list(commits[b]))
            assert new.tolist() == list(commits[b])
            expected[b] += commits[b]
            held.append((new, list(commits[b])))
    assert rows.lengths == [len(e) for e in expected]
    for view, seen in held:  # written positions never change, so earlier views still read what they read
        assert view.tolist() == seen


def test_a_row_past_its_width_and_a_width_without_room_are_refused():
    rows = TokenRows([torch.arange(4)], width=6)
    rows.append(0, [1, 2])
    with pytest.raises(ValueError, match="more than its 6"):
        rows.append(0, [3])
    with pytest.raises(ValueError, match="no room for a pending token"):
        TokenRows([torch.arange(4)], width=4)
