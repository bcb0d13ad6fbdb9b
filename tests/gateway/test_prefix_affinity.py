"""Prefix affinity (remote/affinity.py) and how a remote model picks a replica (remote.py)."""

from __future__ import annotations

import httpx
import msgspec
import pytest
from switchyard.remote.affinity import BLOCK_BYTES, PrefixAffinity, prefix_chain
from switchyard.remote.model import RemoteModel
from switchyard.remote.config import RemoteEntry
from switchyard.remote.upstream import Replica
from switchyard.remote.forward import _prompt_bytes

SYSTEM = bytes(range(256)) * 8  # 8 whole blocks


def test_chains_agree_exactly_as_far_as_the_bytes_do():
    a = prefix_chain(SYSTEM + b"first question")
    b = prefix_chain(SYSTEM + b"second question, longer" * 20)
    assert len(a) == len(SYSTEM) // BLOCK_BYTES  # the partial last block is not hashed
    assert b[: len(a)] == a and len(b) > len(a)
    changed = bytearray(SYSTEM)
    changed[3 * BLOCK_BYTES + 7] ^= 1
    c = prefix_chain(bytes(changed))
    assert c[:3] == a[:3] and all(x != y for x, y in zip(c[3:], a[3:], strict=True))
    assert prefix_chain(b"short") == []


def test_the_replica_that_has_the_longest_prefix_gets_the_prompt():
    one, two = Replica("http://one"), Replica("http://two")
    affinity = PrefixAffinity()
    assert affinity.choose([one, two], [], prefix_chain(SYSTEM)) is False  # nothing seen yet
    affinity.record(one, prefix_chain(SYSTEM[: 2 * BLOCK_BYTES]))
    affinity.record(two, prefix_chain(SYSTEM[: 5 * BLOCK_BYTES]))
    chain = prefix_chain(SYSTEM + b"question")
    assert affinity.matched(one, chain) == 2 and affinity.matched(two, chain) == 5
    assert affinity.choose([one, two], [], chain) is two
    assert affinity.choose([one, two], [two], chain) is one  # tried already: the next best
    two.out_until = 1.0
    assert affinity.choose([one, two], [], chain) is one  # out: never chosen
    assert affinity.choose([two], [], chain) is None


def test_load_wins_over_affinity_past_the_spread():
    one, two = Replica("http://one"), Replica("http://two")
    affinity = PrefixAffinity(max_spread=3)
    chain = prefix_chain(SYSTEM)
    affinity.record(one, chain)
    one.in_flight, two.in_flight = 3, 0
    assert affinity.choose([one, two], [], chain) is one  # spread 3: still balanced
    one.queue = 1
    assert affinity.choose([one, two], [], chain) is two  # spread 4: the least loaded


def test_a_remembered_block_implies_every_block_before_it():
    replica = Replica("http://one")
    affinity = PrefixAffinity(entries_per_replica=6)
    old, new = prefix_chain(SYSTEM), prefix_chain(bytes(reversed(SYSTEM)))
    affinity.record(replica, old)
    affinity.record(replica, new[:2])  # pushes out the oldest entries: old's longest blocks
    assert affinity.matched(replica, old) == 4 and affinity.matched(replica, new) == 2


def _model(balancing: str) -> RemoteModel:
    entry = RemoteEntry(served_model_name="m", upstreams=("http://one", "http://two"),
                        max_concurrent_requests=8, balancing=balancing)  # type: ignore[arg-type]
    return RemoteModel(entry, httpx.AsyncClient())


def test_a_model_records_where_each_prefix_went_and_follows_it():
    model = _model("prefix")
    chains = [prefix_chain(bytes([i]) * 1024) for i in range(6)]
    first = [model.choose([], chain) for chain in chains]
    assert [model.choose([], chain) for chain in chains] == first  # each prefix sticks


def test_round_robin_takes_the_replicas_in_turn():
    model = _model("round-robin")
    chosen = [model.choose([], []) for _ in range(4)]
    assert chosen[0] is not chosen[1] and chosen[:2] == chosen[2:]


@pytest.mark.parametrize(("body", "text"), [
    ({"messages": [{"role": "system", "content": "be brief"},
                   {"role": "user", "content": [{"type": "text", "text": "hi"}]}]},
     b"system\x1fbe brief\x1euser\x1fhi\x1e"),
    ({"prompt": "def f():"}, b"def f():"),
    ({"prompt": ["one", "two"]}, b"one"),
    ({"inputs": "tgi prompt", "parameters": {}}, b"tgi prompt"),
])
def test_the_prompt_bytes_of_each_api(body, text):
    raw = msgspec.json.encode(body)
    api_document = body if "inputs" not in body else None
    assert _prompt_bytes(api_document, raw) == text
