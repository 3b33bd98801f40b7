import pickle

import pytest
import torch
from distributed.protocol import deserialize, serialize
from hypothesis import given, settings
from hypothesis import strategies as st

from flowactors import Batch


def make(n: int, seed: int = 0) -> Batch:
    g = torch.Generator().manual_seed(seed)
    return Batch(
        {
            "ids": torch.randint(0, 100, (n, 5), generator=g),
            "logp": torch.randn(n, 5, generator=g),
            "mask": torch.rand(n, 5, generator=g) > 0.5,
            "half": torch.randn(n, 3, generator=g).to(torch.bfloat16),
        },
        {"text": [f"row{i}" for i in range(n)], "score": [float(i) for i in range(n)]},
        {"step": 3, "note": "x"},
    )


@given(n=st.integers(1, 40), parts=st.integers(1, 8))
@settings(max_examples=60, deadline=None)
def test_split_concat_round_trip(n, parts):
    b = make(n * parts)
    pieces = b.split(parts)
    assert [len(p) for p in pieces] == [n] * parts
    assert Batch.concat(pieces).equals(b)
    assert pieces[-1]["text"][0] == f"row{n * (parts - 1)}"


@given(n=st.integers(1, 30), size=st.integers(1, 9))
@settings(max_examples=40, deadline=None)
def test_chunk_and_pad(n, size):
    b = make(n)
    chunks = b.chunk(size)
    assert sum(len(c) for c in chunks) == n and all(len(c) == size for c in chunks[:-1])
    assert Batch.concat(chunks).equals(b)
    padded, added = b.pad_to_multiple(size)
    assert len(padded) % size == 0 and added == (-n) % size
    assert padded.slice(0, n).equals(b)
    if added:
        assert torch.equal(padded["ids"][-1], b["ids"][-1])


@given(n=st.integers(0, 20), seed=st.integers(0, 1000))
@settings(max_examples=40, deadline=None)
def test_serialization_round_trips_exactly(n, seed):
    b = make(n, seed)
    h, frames = serialize(b, serializers=["dask"])
    assert h["serializer"] == "dask"  # our msgpack family, not pickle
    assert deserialize(h, frames).equals(b)
    assert pickle.loads(pickle.dumps(b, protocol=5)).equals(b)
    assert pickle.loads(pickle.dumps(b, protocol=4)).equals(b)


def test_frames_are_not_copied_on_send():
    b = make(4)
    _, frames = serialize(b, serializers=["dask"])
    # frame 1 is the first tensor's memory itself, not a copy
    assert memoryview(frames[1]).obj is not None
    assert torch.frombuffer(bytearray(frames[1]), dtype=torch.int64).view(4, 5).equal(b["ids"])


def test_take_reorders_and_union_joins():
    b = make(6)
    r = b.take([5, 0, 3])
    assert r["text"] == ["row5", "row0", "row3"] and torch.equal(r["ids"][1], b["ids"][0])
    u = b.select("ids").union(Batch({"v": torch.arange(6.0)}))
    assert u.keys() == ["ids", "v"] and len(u) == 6


def test_bad_input_errors_say_the_fix():
    with pytest.raises(ValueError, match=r"30 rows cannot be split into 4 .*pad_to_multiple\(4\)"):
        make(30).split(4)
    with pytest.raises(ValueError, match="cannot union batches of 6 and 4 rows"):
        make(6).union(make(4).select("ids").union(Batch({"w": torch.zeros(4)})))
    with pytest.raises(ValueError, match="disagree on the number of rows"):
        Batch({"a": torch.zeros(3)}, {"t": ["x"]})
    with pytest.raises(ValueError, match="different fields"):
        Batch.concat([make(2), make(2).select("ids")])
    with pytest.raises(TypeError, match="msgpack cannot encode"):
        pickle.dumps(Batch({"a": torch.zeros(2)}, meta={"obj": object()}), protocol=5)
    with pytest.raises(KeyError, match="has no field 'nope'"):
        make(2)["nope"]


def test_dask_counts_a_batch_and_a_tensor_by_their_bytes():
    """Dask's memory accounting, transfer logs and dashboard size a Batch and a tensor by their tensors' bytes in host
    memory (and a Batch's rows' and meta's objects), not as the few dozen bytes of a Python object, which Dask
    would otherwise count (it has no rule for torch)."""
    from dask.sizeof import sizeof

    import flowactors.serialization  # noqa: F401  (registers Batch with Dask)

    bare = Batch({"x": torch.zeros(1000, 8, dtype=torch.float32), "m": torch.ones(1000, dtype=torch.bool)})
    assert bare.nbytes == 33_000 and 33_000 <= sizeof(bare) < 34_000
    with_rows = Batch(dict(bare.tensors), {"id": [f"sample-{i}" for i in range(1000)]})
    assert sizeof(with_rows) - sizeof(bare) >= 1000 * len("sample-999")
    on_meta = Batch({"x": torch.zeros(1000, 8, device="meta"), "m": bare["m"]})  # a device's memory is not the host's
    assert 1_000 <= sizeof(on_meta) < 2_000
    assert 4 << 20 <= sizeof(torch.zeros(1 << 20)) < (4 << 20) + 1_000
    weights = {f"layer{i}": torch.zeros(256, 256) for i in range(4)}  # (Dask samples a dict of more than 10)
    assert 4 * (256 << 10) <= sizeof(weights) < 4 * (256 << 10) + 2_000
