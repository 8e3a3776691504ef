"""Token codec: packed arrays round-trip bit-exactly; bad values are refused."""

from __future__ import annotations

import math
import struct

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ledger import codec
from ledger.errors import InvalidRecord

int32 = st.integers(min_value=-(2**31), max_value=2**31 - 1)
finite_or_neg_inf = st.one_of(
    st.floats(allow_nan=False, allow_infinity=False),
    st.floats(width=32, allow_nan=False, allow_infinity=False),
    st.sampled_from([-9999.0, float("-inf"), -0.0, 0.0, -1e-45, -3.4028234663852886e38]),
)


@given(st.lists(int32, max_size=300))
def test_ids_round_trip(ids: list[int]) -> None:
    packed = codec.pack_ids(ids)
    assert len(packed) == 4 * len(ids)
    assert codec.unpack_ids(packed) == ids


@given(st.lists(finite_or_neg_inf, max_size=300))
def test_log_probs_round_trip_bit_exact(values: list[float]) -> None:
    tag, packed = codec.pack_log_probs(values)
    back = codec.unpack_log_probs(tag, packed)
    assert [struct.pack("<d", v) for v in back] == [struct.pack("<d", v) for v in values]


def test_float32_is_used_only_when_exact() -> None:
    exact = [-0.5, -9999.0, float("-inf"), struct.unpack("<f", struct.pack("<f", -3.0727))[0]]
    assert codec.pack_log_probs(exact)[0] == codec.LOGPROB_F32
    assert codec.pack_log_probs([*exact, -0.1])[0] == codec.LOGPROB_F64


@pytest.mark.parametrize("bad", [2**31, -(2**31) - 1, 2**40])
def test_ids_outside_int32_are_refused(bad: int) -> None:
    with pytest.raises(InvalidRecord, match="int32"):
        codec.pack_ids([1, bad])


@given(st.lists(int32, max_size=300))
def test_ids_pack_as_int32_little_endian(ids: list[int]) -> None:
    # The packed form is the digests' and the stored rows' format: fixed, whatever packs it.
    assert codec.pack_ids(ids) == b"".join(struct.pack("<i", i) for i in ids)
    assert codec.pack_ids(tuple(ids)) == codec.pack_ids(ids)


@pytest.mark.parametrize("bad", [1.0, "7", None, [3]])
def test_ids_that_are_not_integers_are_refused(bad: object) -> None:
    with pytest.raises(InvalidRecord, match="integers"):
        codec.pack_ids([1, bad, 2])  # type: ignore[list-item]


@pytest.mark.parametrize("nan_at", [0, 1, 2])
def test_nan_is_refused_wherever_it_sits(nan_at: int) -> None:
    values = [-0.5, -0.25, -0.125]
    values[nan_at] = math.nan
    with pytest.raises(InvalidRecord, match="NaN"):
        codec.pack_log_probs(values)
    with pytest.raises(InvalidRecord, match="NaN"):
        codec.pack_log_probs([-0.1, *values])  # on the float64 path too


def test_log_probs_that_are_not_numbers_are_refused() -> None:
    with pytest.raises(InvalidRecord, match="numbers"):
        codec.pack_log_probs([-0.5, "x"])  # type: ignore[list-item]


def test_nan_log_prob_is_refused() -> None:
    with pytest.raises(InvalidRecord, match="NaN"):
        codec.pack_log_probs([-0.1, math.nan])


@given(st.lists(int32, max_size=200), st.lists(st.integers(0, 200), max_size=10))
def test_prefix_digests_equal_digests_of_prefixes(ids: list[int], cuts: list[int]) -> None:
    packed = codec.pack_ids(ids)
    got = codec.prefix_digests(packed, cuts)
    for n in cuts:
        if n <= len(ids):
            assert got[n] == codec.token_digest(ids[:n])
        else:
            assert n not in got


def test_running_digest_matches_whole_sequence() -> None:
    running = codec.RunningDigest()
    seq: list[int] = []
    for part in ([1, 2, 3], [], [4], [5, 6]):
        running.update(codec.pack_ids(part))
        seq += part
        assert running.hexdigest() == codec.token_digest(seq)


def test_digest_distinguishes_sequences_and_lengths() -> None:
    assert codec.token_digest([]) != codec.token_digest([0])
    assert codec.token_digest([1, 2]) != codec.token_digest([2, 1])


# --------------------------------------------------------------------------- stored encodings


@given(st.lists(int32, max_size=600), st.lists(int32, max_size=600))
def test_stored_ids_round_trip(prompt: list[int], generation: list[int]) -> None:
    p, g = codec.pack_ids(prompt), codec.pack_ids(generation)
    tag, sp, sg = codec.store_ids(p, g)
    assert codec.load_ids(tag, sp) == p and codec.load_ids(tag, sg) == g
    small = len(p) + len(g) < codec.MIN_DEFLATE_BYTES
    assert tag == (codec.IDS_TAG if small else codec.IDS_PLANES)


@given(st.lists(finite_or_neg_inf, max_size=600))
def test_stored_log_probs_round_trip_bit_exact(values: list[float]) -> None:
    tag, stored = codec.store_log_probs(values)
    back = codec.unpack_log_probs(tag, stored)
    assert [struct.pack("<d", v) for v in back] == [struct.pack("<d", v) for v in values]
    plain_tag, plain = codec.pack_log_probs(values)
    if len(plain) < codec.MIN_DEFLATE_BYTES:
        assert (tag, stored) == (plain_tag, plain)
    else:
        assert tag == {codec.LOGPROB_F32: "f4pz", codec.LOGPROB_F64: "f8pz"}[plain_tag]


def test_vocabulary_ids_and_sampler_log_probs_take_less_room() -> None:
    """Ids of a 151k vocabulary leave the high byte planes nearly constant, and so do the sign
    and exponent bytes of float32 log-probs: the stored forms are smaller than the raw arrays."""
    import random
    from array import array

    rng = random.Random(7)
    ids = codec.pack_ids([rng.randrange(151_000) for _ in range(500)])
    tag, stored, _ = codec.store_ids(ids, b"")
    assert tag == codec.IDS_PLANES and len(stored) < 0.7 * len(ids)
    lps = array("f", [-rng.expovariate(1.5) for _ in range(300)]).tolist()
    tag, stored = codec.store_log_probs(lps)
    assert tag == codec.LOGPROB_F32_PLANES and len(stored) < 0.9 * 4 * len(lps)


def test_incompressible_ids_cost_at_most_a_few_bytes_more() -> None:
    import random

    rng = random.Random(3)
    ids = codec.pack_ids([rng.randrange(-(2**31), 2**31) for _ in range(400)])
    tag, stored, _ = codec.store_ids(ids, b"")
    assert tag == codec.IDS_PLANES and len(stored) <= len(ids) + 32
    assert codec.load_ids(tag, stored) == ids


@pytest.mark.parametrize(
    ("shape", "n"),
    [
        ("uniform", 16_000),
        ("uniform", 40_000),
        ("skewed", 16_000),
        ("repeats", 16_000),
        ("uniform", 1_100),
        ("uniform", 3),
        ("uniform", 0),
    ],
)
def test_plane_streams_round_trip_whether_low_planes_are_stored_or_coded(
    shape: str, n: int
) -> None:
    """Near-uniform low planes of a long array go into the stream as stored blocks (coding them
    costs time and saves nothing), skewed ones are coded, a short array's are always stored;
    either way the stream inflates to the exact bytes, and a long array's stored form is never
    much bigger than coding everything would be."""
    import random
    import zlib
    from array import array

    rng = random.Random(n)
    if shape == "uniform":
        ids = [rng.randrange(151_000) for _ in range(n)]
    elif shape == "skewed":
        ids = [min(151_000, int(rng.paretovariate(0.8))) for _ in range(n)]
    else:
        ids = [rng.randrange(151_000) for _ in range(100)] * (n // 100)
    data = array("i", ids).tobytes()
    stream = codec.deflate_planes(data, 4)
    assert codec.inflate_planes(stream, 4) == data
    low = b"".join([data[0::4], data[1::4]])
    if low:  # the low planes appear verbatim only when stored: always in a short array
        assert (low[:60_000] in stream) == (n * 4 <= 16 * 1024 or shape == "uniform")
    everything = zlib.compressobj(1, zlib.DEFLATED, -12, 4)
    coded = len(everything.compress(b"".join(data[p::4] for p in range(4)))) + len(
        everything.flush()
    )
    assert len(stream) <= coded * 1.05 + 16
    for width, values in (
        (4, array("f", [-rng.expovariate(1.5) for _ in range(n)])),
        (8, array("d", [-rng.expovariate(1.5) for _ in range(n)])),
    ):
        raw = values.tobytes()
        stream = codec.deflate_planes(raw, width, floats=True)
        assert codec.inflate_planes(stream, width) == raw


def test_unknown_or_damaged_stored_arrays_are_refused() -> None:
    with pytest.raises(InvalidRecord):
        codec.load_ids("i9xx", b"")
    with pytest.raises(InvalidRecord):
        codec.load_ids(codec.IDS_PLANES, b"\xff\xfe not deflate")
    with pytest.raises(InvalidRecord):
        codec.unpack_log_probs(codec.LOGPROB_F32_PLANES, b"\x00\x01")
    # A valid stream of 6 bytes is not a whole number of int32 values.
    import zlib

    z = zlib.compressobj(1, zlib.DEFLATED, -15)
    with pytest.raises(InvalidRecord):
        codec.load_ids(codec.IDS_PLANES, z.compress(b"abcdef") + z.flush())
