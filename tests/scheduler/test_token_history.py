"""TokenHistory: a list's reads over a chain that forks share."""

import pytest

from services.scheduler.token_history import TokenHistory


def test_reads_like_a_list_and_forks_share_the_past():
    h = TokenHistory([1, 2, 3])
    child = h.fork()
    h.append(4)
    child.append(40)
    child.append(41)
    assert list(h) == [1, 2, 3, 4] and list(child) == [1, 2, 3, 40, 41]
    assert len(h) == 4 and len(child) == 5
    assert child[-1] == 41 and child[0] == 1 and child[3] == 40
    assert child[1:4] == [2, 3, 40] and child[:0] == [] and child[3:] == [40, 41] and child[::2] == [1, 3, 41]
    assert h == [1, 2, 3, 4] and h != child and h == TokenHistory([1, 2, 3, 4])
    with pytest.raises(IndexError):
        h[4]
    assert child._node[1][1] is h._node[1]  # the shared past is one chain, not a copy
