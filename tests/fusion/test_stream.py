"""The streaming side of stage fusion, in one process: chunks in completion order with the samples of generate()."""

import queue
import threading

import pytest
import torch

from algorithms.rollout.fusion import merge_chunks, reassemble
from engines import HFGenerationEngine, ModelConfig, SamplingConfig, build_model, build_tokenizer
from engines.rollout.stream import ROW_INDEX, TAIL_STEP, GenerationStream, is_tail
from flowactors import Batch

CFG = ModelConfig(hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=64)
TEXTS = ["sum 17:", "ab", "hello world", "x", "12+7=", "rev abc:", "q", "sum 5:", "xyz", "99+1="]


@pytest.fixture(scope="module")
def tiny():
    tok = build_tokenizer(CFG)
    torch.manual_seed(0)
    return tok, build_model(CFG, "lm", tok), HFGenerationEngine(tok.eos_token_id, tok.pad_token_id)


def prompts(tok, stop_at=None):
    enc = tok(TEXTS, padding=True, return_tensors="pt")
    tensors = {"input_ids": enc.input_ids, "attention_mask": enc.attention_mask, "seed": torch.arange(10) * 7 + 1}
    if stop_at is not None:
        tensors["stop_at"] = torch.tensor(stop_at)
    return Batch(tensors, {"text": TEXTS}, {"note": "kept"})


STOPS = [3, 1, 12, 2, 7, 3, 20, 1, 5, 9]  # a few long rows among short ones


@pytest.mark.parametrize(
    "sampling",
    [
        SamplingConfig(max_new_tokens=20),
        SamplingConfig(max_new_tokens=20, ignore_eos=True, temperature=0.7, top_k=8),
        SamplingConfig(max_new_tokens=20, evict_finished=True),
    ],
    ids=["eos", "ignore_eos", "evict"],
)
@pytest.mark.parametrize("chunk_rows", [1, 3, 10])
def test_stream_yields_generate_rows_in_completion_order(tiny, sampling, chunk_rows):
    tok, model, eng = tiny
    p = prompts(tok, STOPS)
    whole = eng.generate(model, p, sampling)
    chunks = list(eng.stream(model, p, sampling, chunk_rows, row_offset=100))
    assert [len(c) for c in chunks] == [chunk_rows] * (10 // chunk_rows) + [10 % chunk_rows] * bool(10 % chunk_rows)
    stream = Batch.concat(chunks)
    # completion order: a row finishing at step t has t + 1 response tokens; same step -> by row index
    finish = [(int(n), int(i)) for n, i in zip(stream["response_mask"].sum(-1), stream[ROW_INDEX])]
    assert finish == sorted(finish)
    # every chunk row is bit-identical to the same row of generate(), and reassembly restores the order
    rows = stream[ROW_INDEX] - 100
    for name, t in whole.tensors.items():
        assert torch.equal(stream[name], t[rows]), name
    back = reassemble(*(Batch({**c.tensors, ROW_INDEX: c[ROW_INDEX] - 100}, c.rows, c.meta) for c in chunks))
    assert back.equals(whole)


def test_stop_at_ends_each_row_after_its_length(tiny):
    tok, model, eng = tiny
    out = eng.generate(model, prompts(tok, STOPS), SamplingConfig(max_new_tokens=20, ignore_eos=True))
    assert out["response_mask"].sum(-1).tolist() == STOPS
    beyond = torch.arange(20)[None] >= torch.tensor(STOPS)[:, None]
    assert bool((out["responses"][beyond] == tok.pad_token_id).all())
    assert bool((out["rollout_log_probs"][beyond] == 0).all())
    with pytest.raises(ValueError, match="stop_at"):
        eng.generate(model, prompts(tok, [0] * 10), SamplingConfig(max_new_tokens=4))


def test_evicting_finished_rows_keeps_the_samples(tiny):
    tok, model, eng = tiny
    p = prompts(tok, STOPS)
    full = eng.generate(model, p, SamplingConfig(max_new_tokens=20))
    evicted = eng.generate(model, p, SamplingConfig(max_new_tokens=20, evict_finished=True))
    assert torch.equal(full["responses"], evicted["responses"])
    assert torch.allclose(full["rollout_log_probs"], evicted["rollout_log_probs"], atol=1e-5)


def test_generation_stream_hands_out_chunks_in_order_and_joins_its_thread(tiny):
    tok, model, eng = tiny
    sampling = SamplingConfig(max_new_tokens=20)
    p = prompts(tok, STOPS)
    stream = GenerationStream(eng.stream(model, p, sampling, 4), n_chunks=3)
    with pytest.raises(RuntimeError, match="chunk 1 was asked for, but chunk 0 is next"):
        stream.take(1)
    chunks = [stream.take(k) for k in range(3)]
    assert stream.finished and not any(t.name == "flowactors-generation" for t in threading.enumerate())
    assert Batch.concat(chunks).equals(Batch.concat(list(eng.stream(model, p, sampling, 4))))


def test_generation_stream_raises_a_decoding_error_at_take():
    def broken():
        yield Batch({"x": torch.zeros(2)})
        raise RuntimeError("decoder exploded")

    stream = GenerationStream(broken(), n_chunks=3)
    assert len(stream.take(0)) == 2
    for k in (1, 2):  # the failing chunk and every later one report the decoding error
        with pytest.raises(RuntimeError, match="decoder exploded"):
            stream.take(k)
    assert stream.finished


def test_merge_chunks_joins_scores_and_checks_rows():
    chunks = [
        Batch({"a": torch.tensor([2.0, 0.0]), ROW_INDEX: torch.tensor([2, 0])}),
        Batch({"a": torch.tensor([1.0]), ROW_INDEX: torch.tensor([1])}),
    ]
    scores = [[Batch({"s": torch.tensor([20.0, 0.0])}), Batch({"s": torch.tensor([10.0])})]]
    out = merge_chunks(None, chunks, *scores)
    assert out["a"].tolist() == [0.0, 1.0, 2.0] and out["s"].tolist() == [0.0, 10.0, 20.0]
    assert ROW_INDEX not in out
    with pytest.raises(ValueError, match="not all the chunks"):
        reassemble(chunks[0])


@pytest.mark.parametrize(
    "sampling",
    [
        SamplingConfig(max_new_tokens=20),
        SamplingConfig(max_new_tokens=20, ignore_eos=True, temperature=0.7, top_k=8, evict_finished=True),
    ],
    ids=["eos", "ignore_eos_evict"],
)
@pytest.mark.parametrize("polls", [0, 8])
def test_tails_of_two_ranks_join_rank_zero_with_the_same_samples(tiny, sampling, polls):
    """Long-tail migration in one process: 'ranks' 1 (rows 5-7) and 2 (rows 8-9) pause once one row is left,
    at different steps, and hand over their running rows; rank 0 (rows 0-4) admits both into its running batch
    (arriving at its step 0 or 8). Every row equals generate()'s (log-probs to rounding)."""
    tok, model, eng = tiny
    p = prompts(tok, STOPS)
    whole = eng.generate(model, p, sampling)
    sent, inbox = [], _LateQueue(polls)
    for rows in (slice(5, 8), slice(8, 10)):
        *chunks, tail = eng.stream(
            model, p.slice(rows.start, rows.stop), sampling, 2, row_offset=rows.start, pause_below=1
        )
        assert is_tail(tail) and len(tail) == 1 and not any(is_tail(c) for c in chunks)
        sent += chunks
        inbox.put(tail)
    first, second = (int(t[TAIL_STEP][0]) for t in inbox.queue)
    assert first != second  # joined one at a time: each catches up, or waits for rank 0, on its own
    inbox.put(None)
    received = list(eng.stream(model, p.slice(0, 5), sampling, 2, inbox=inbox))
    assert inbox.empty() and sum(len(c) for c in received) == 5 + 2
    out = reassemble(*sent, *received)
    assert sorted(out.keys()) == sorted(whole.keys()) and out.rows == whole.rows and out.meta == whole.meta
    for name, t in whole.tensors.items():
        if name == "rollout_log_probs":  # the moved rows decode in another batch: last-bit rounding
            assert torch.allclose(out[name], t, rtol=0, atol=1e-5)
        else:
            assert torch.equal(out[name], t), name


def test_pause_refuses_a_threshold_outside_the_rows(tiny):
    tok, model, eng = tiny
    p, sampling = prompts(tok, STOPS), SamplingConfig(max_new_tokens=20)
    for bad in (0, 10):
        with pytest.raises(ValueError, match="pause_below must be between 1 and"):
            next(eng.stream(model, p, sampling, 2, pause_below=bad))


class _LateQueue(queue.Queue):
    """A real queue whose items become visible only after `polls` non-blocking looks: a paused decode that
    arrives while the receiver is at a given step (one look per decode step)."""

    def __init__(self, polls: int) -> None:
        super().__init__()
        self.polls = polls

    def get(self, block=True, timeout=None):
        if not block and self.polls > 0:
            self.polls -= 1
            raise queue.Empty
        return super().get(block, timeout)


@pytest.mark.parametrize("polls", [0, 8, 1000], ids=["tail_ahead", "tail_behind", "receiver_done"])
def test_a_receiving_stream_admits_a_tail_at_any_step_with_the_same_samples(tiny, polls):
    """Rank 1 (rows 5-9) pauses at step 5; rank 0 (rows 0-4, up to 12 steps) keeps decoding and admits its tail
    when it arrives: before rank 0 gets to step 5 (the tail waits), at step 8 (the tail catches up alone), or after
    rank 0 has finished (the tail runs alone)."""
    tok, model, eng = tiny
    p, sampling = prompts(tok, STOPS), SamplingConfig(max_new_tokens=20)
    whole = eng.generate(model, p, sampling)
    *sent, tail = list(eng.stream(model, p.slice(5, 10), sampling, 2, row_offset=5, seed_offset=5, pause_below=2))
    assert is_tail(tail) and int(tail[TAIL_STEP][0]) == 5
    inbox = _LateQueue(polls)
    inbox.put(tail)
    inbox.put(None)
    received = list(eng.stream(model, p.slice(0, 5), sampling, 2, inbox=inbox))
    assert not any(is_tail(c) for c in received) and inbox.empty()
    out = reassemble(*sent, *received)
    for name, t in whole.tensors.items():
        if name == "rollout_log_probs":
            assert torch.allclose(out[name], t, rtol=0, atol=1e-5)
        else:
            assert torch.equal(out[name], t), name
