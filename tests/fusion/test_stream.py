"""The streaming side of stage fusion, in one process: chunks in completion order with the samples of generate()."""

import threading

import pytest
import torch

from algorithms.fusion import merge_chunks, reassemble
from engines import HFGenerationEngine, ModelConfig, SamplingConfig, build_model, build_tokenizer
from engines.generation import ROW_INDEX, TAIL_STEP, GenerationStream, is_tail
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


@pytest.mark.parametrize("sampling", [
    SamplingConfig(max_new_tokens=20),
    SamplingConfig(max_new_tokens=20, ignore_eos=True, temperature=0.7, top_k=8),
    SamplingConfig(max_new_tokens=20, evict_finished=True),
], ids=["eos", "ignore_eos", "evict"])
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
    chunks = [Batch({"a": torch.tensor([2.0, 0.0]), ROW_INDEX: torch.tensor([2, 0])}),
              Batch({"a": torch.tensor([1.0]), ROW_INDEX: torch.tensor([1])})]
    scores = [[Batch({"s": torch.tensor([20.0, 0.0])}), Batch({"s": torch.tensor([10.0])})]]
    out = merge_chunks(None, chunks, *scores)
    assert out["a"].tolist() == [0.0, 1.0, 2.0] and out["s"].tolist() == [0.0, 10.0, 20.0]
    assert ROW_INDEX not in out
    with pytest.raises(ValueError, match="not all the chunks"):
        reassemble(chunks[0])


@pytest.mark.parametrize("sampling", [
    SamplingConfig(max_new_tokens=20),
    SamplingConfig(max_new_tokens=20, ignore_eos=True, temperature=0.7, top_k=8, evict_finished=True),
], ids=["eos", "ignore_eos_evict"])
def test_paused_tails_resume_on_another_rank_with_the_same_samples(tiny, sampling):
    """Long-tail migration in one process: two 'ranks' (rows 0-4, 5-9) pause at different steps, hand over their
    running rows' state, and one batch finishes both; every row equals generate()'s (log-probs to rounding)."""
    tok, model, eng = tiny
    p = prompts(tok, STOPS)
    whole = eng.generate(model, p, sampling)
    finished, tails = [], []
    for rank, keep in ((0, 1), (1, 2)):  # rank 0 keeps running until 1 row is left, rank 1 until 2
        for item in eng.stream(model, p.slice(5 * rank, 5 * rank + 5), sampling, 2, row_offset=5 * rank,
                               pause_below=keep):
            (tails if is_tail(item) else finished).append(item)
    assert [len(t) for t in tails] == [1, 2]
    steps = [int(t[TAIL_STEP][0]) for t in tails]
    assert steps[0] != steps[1]  # the earlier tail catches up before the two decode together
    resumed = eng.resume(model, tails, sampling)
    assert sorted(resumed[ROW_INDEX].tolist()) == sorted(torch.cat([t[ROW_INDEX] for t in tails]).tolist())
    out = reassemble(*finished, resumed)
    assert sorted(out.keys()) == sorted(whole.keys()) and out.rows == whole.rows and out.meta == whole.meta
    for name, t in whole.tensors.items():
        if name == "rollout_log_probs":  # the moved rows decode in a smaller batch: last-bit rounding
            assert torch.allclose(out[name], t, rtol=0, atol=1e-5)
        else:
            assert torch.equal(out[name], t), name


def test_pause_and_resume_refuse_bad_input(tiny):
    tok, model, eng = tiny
    p, sampling = prompts(tok, STOPS), SamplingConfig(max_new_tokens=20)
    for bad in (0, 10):
        with pytest.raises(ValueError, match="pause_below must be between 1 and"):
            next(eng.stream(model, p, sampling, 2, pause_below=bad))
    with pytest.raises(ValueError, match="at least one paused decode"):
        eng.resume(model, [], sampling)
