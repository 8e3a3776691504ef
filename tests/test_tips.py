"""The digest cache behind O(new tokens) ingest: a continuation's digests extend its parent's
state and must equal the digests computed from scratch (issue 12)."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ledger import codec
from ledger.span import Span
from ledger.storage.tips import PrefixHasher, Tip, TipCache

ids = st.lists(st.integers(min_value=0, max_value=2**31 - 1), max_size=60)


def tip_for(tokens: list[int], pk: int = 1) -> Tip:
    packed = codec.pack_ids(tokens)
    state = codec.digest_state()
    state.update(packed)
    return Tip(pk, f"c{pk}", Span.of(packed), state, codec.token_digest(packed))


# Generation slows down on a loaded machine; what is checked does not.
@settings(suppress_health_check=[HealthCheck.too_slow], deadline=None)
@given(ids, ids, st.data())
def test_prefix_digests_from_a_tip_equal_digests_from_scratch(
    parent: list[int], suffix: list[int], data: st.DataObject
) -> None:
    prompt = codec.pack_ids(parent + suffix)
    cache = TipCache()
    cache.remember("r", tip_for(parent))
    base = cache.base_for("r", prompt)
    assert base is not None and base.cumulative_len == len(parent)
    hasher = PrefixHasher(prompt, base)
    lengths = data.draw(st.lists(st.integers(0, len(parent) + len(suffix)), max_size=6))
    hasher.prime(lengths)
    for n in [*lengths, len(parent), len(parent) + len(suffix)]:
        assert hasher.digest_at(n) == codec.token_digest(prompt[: n * 4])


def test_a_prompt_that_does_not_extend_a_tip_hashes_from_scratch() -> None:
    cache = TipCache()
    cache.remember("r", tip_for([1, 2, 3]))
    assert cache.base_for("r", codec.pack_ids([1, 2, 4, 5])) is None
    assert cache.base_for("other", codec.pack_ids([1, 2, 3, 4])) is None
    longest = tip_for([1, 2, 3, 4], pk=2)
    cache.remember("r", longest)
    assert cache.base_for("r", codec.pack_ids([1, 2, 3, 4, 5])) is longest


def test_the_cache_stays_within_its_byte_budget() -> None:
    cache = TipCache(max_bytes=100, per_rollout=2)
    for r in range(10):
        for k in range(3):
            cache.remember(f"r{r}", tip_for(list(range(8)), pk=k))
    assert cache._bytes <= 100
    cache.forget("r9")
    assert cache.base_for("r9", codec.pack_ids(list(range(9)))) is None


@settings(suppress_health_check=[HealthCheck.too_slow], deadline=None)
@given(st.lists(st.tuples(st.integers(0, 50), st.binary(max_size=9)), max_size=30))
def test_spans_read_as_they_were_made_however_they_branch(
    steps: list[tuple[int, bytes]],
) -> None:
    """Extending a span from any earlier one (a chain's latest tip, a retry from an older tip,
    a sibling branch) never changes what an existing span reads."""
    spans = [Span.of(b"root")]
    expected = [b"root"]
    for pick, tail in steps:
        k = pick % len(spans)
        spans.append(spans[k].extended(tail))
        expected.append(expected[k] + tail)
        assert [bytes(s.view()) for s in spans] == expected


def test_a_chain_extends_one_buffer_and_a_branch_copies() -> None:
    a = Span.of(b"ab")
    b = a.extended(b"cd")
    c = b.extended(b"ef")
    assert a.buf is b.buf is c.buf  # each continued the latest: no copy
    sibling = b.extended(b"XY")  # b no longer ends the buffer
    assert sibling.buf is not c.buf
    assert (bytes(c.view()), bytes(sibling.view())) == (b"abcdef", b"abcdXY")
    with c.view():  # a reader holds the buffer: the next extension copies instead of failing
        d = c.extended(b"gh")
    assert d.buf is not c.buf and bytes(d.view()) == b"abcdefgh"
    assert bytes(c.view()) == b"abcdef"
