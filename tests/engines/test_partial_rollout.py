"""Partial rollouts on one replica rank (engines.rollout.partial) with the transformers engine and a tiny model:
sequences that span policy versions carry each token's version and that version's log-prob, whole groups come out
in a fixed order, a sequence that finishes in one segment is the plain generate's, and the held state survives a
checkpoint round trip."""

import copy

import pytest
import torch

from engines import HFGenerationEngine, ModelConfig, SamplingConfig, build_model, build_tokenizer
from engines.fields import POLICY_VERSIONS, RESPONSE_MASK, ROLLOUT_LOG_PROBS
from engines.rollout.partial import PROMPT_UID, SEGMENTS, PartialRollouts
from engines.rollout.stream import STOP_AT
from flowactors import Batch

pytestmark = pytest.mark.fast


@pytest.fixture(scope="module")
def setup():
    cfg = ModelConfig(hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=64)
    tok = build_tokenizer(cfg)
    torch.manual_seed(0)
    old = build_model(cfg, "lm", tok).eval()
    new = copy.deepcopy(old)
    with torch.no_grad():
        for p in new.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return tok, old, new


def prompts(tok, groups: int, n: int, first_uid: int, stop: list[int] | None = None) -> Batch:
    texts = [f"question {first_uid + g}:" for g in range(groups) for _ in range(n)]
    enc = tok(texts, padding=True, return_tensors="pt")
    tensors = {
        "input_ids": enc.input_ids,
        "attention_mask": enc.attention_mask,
        "seed": torch.arange(len(texts)) * 7919 + 11 * first_uid,
        "group": torch.arange(groups).repeat_interleave(n),
        PROMPT_UID: (first_uid + torch.arange(groups)).repeat_interleave(n),
    }
    if stop is not None:
        tensors[STOP_AT] = torch.tensor(stop)
    return Batch(tensors, {"text": texts})


def generator(tok, model, sampling):
    eng = HFGenerationEngine(tok.eos_token_id, tok.pad_token_id)
    return lambda b: eng.generate(model, b, sampling)


def token_log_probs(model, batch: Batch) -> torch.Tensor:
    """Teacher-forced log-probs of every response token (temperature 1)."""
    with torch.no_grad():
        logits = model(
            input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], position_ids=batch["position_ids"]
        ).logits.float()
    width = batch["responses"].shape[1]
    lp = torch.log_softmax(logits[:, -width - 1 : -1], -1)
    return lp.gather(-1, batch["responses"][:, :, None])[:, :, 0]


def test_one_segment_is_the_plain_generate(setup):
    tok, old, _ = setup
    sampling = SamplingConfig(max_new_tokens=10)
    p = prompts(tok, 3, 2, 0)
    part = PartialRollouts(sampling, eos=tok.eos_token_id, pad=tok.pad_token_id)
    part.admit(p)
    out = part.run(generator(tok, old, sampling), 0, quota=3, segment=10)
    plain = generator(tok, old, sampling)(p)
    for k in ("responses", RESPONSE_MASK, ROLLOUT_LOG_PROBS, "input_ids", "attention_mask", "position_ids"):
        assert torch.equal(out[k], plain[k]), k
    assert out.rows["text"] == p.rows["text"]
    assert out[SEGMENTS].tolist() == [1] * 6 and not part.held()


def test_sequences_span_versions_with_each_tokens_version_and_log_prob(setup):
    tok, old, new = setup
    sampling = SamplingConfig(max_new_tokens=12, ignore_eos=True)
    # group 0 stops after 2 tokens, group 1 after 12 (it spans the version change), group 2 after 3
    part = PartialRollouts(sampling, eos=tok.eos_token_id, pad=tok.pad_token_id)
    part.admit(prompts(tok, 3, 2, 0, stop=[2, 2, 12, 11, 3, 1]))
    first = part.run(generator(tok, old, sampling), 0, quota=1, segment=4)
    # one segment ran: groups 0 and 2 finished (in admission order), the first is handed out, group 1 runs on
    assert first["prompt_uid"].tolist() == [0, 0] and first["group"].tolist() == [0, 0]
    assert part.ready == [2] and sorted(part.held()) == [1, 2]
    part.admit(prompts(tok, 1, 2, 3, stop=[5, 5]))
    second = part.run(generator(tok, new, sampling), 1, quota=2, segment=4)
    # group 2 was ready first; group 1 needs 2 more segments, group 3 finishes in its second one (with group 1)
    assert second["prompt_uid"].tolist() == [2, 2, 1, 1] and second["group"].tolist() == [0, 0, 1, 1]
    assert part.held() == [3]
    span = second.take([2, 3])
    assert span[RESPONSE_MASK].sum(-1).tolist() == [12, 11]
    assert span[SEGMENTS].tolist() == [3, 3]
    versions = span[POLICY_VERSIONS]
    assert versions[0].tolist() == [0] * 4 + [1] * 8 and versions[1].tolist() == [0] * 4 + [1] * 7 + [0]
    # every token's recorded log-prob is the one its version's weights give it over the whole sequence so far
    mask = span[RESPONSE_MASK].bool()
    by_version = torch.where(versions == 0, token_log_probs(old, span), token_log_probs(new, span))
    assert torch.allclose(span[ROLLOUT_LOG_PROBS][mask], by_version[mask], atol=1e-5)
    # and under the old weights alone they would differ (the continuation really ran on the new ones)
    later = mask & (versions == 1)
    assert not torch.allclose(span[ROLLOUT_LOG_PROBS][later], token_log_probs(old, span)[later], atol=1e-3)


def test_eos_ends_a_sequence_across_segments(setup):
    tok, old, _ = setup
    sampling = SamplingConfig(max_new_tokens=16, temperature=1.5)
    run = []
    for segment in (3, 16):
        part = PartialRollouts(sampling, eos=tok.eos_token_id, pad=tok.pad_token_id)
        part.admit(prompts(tok, 4, 2, 0))
        run.append(part.run(generator(tok, old, sampling), 0, quota=4, segment=segment))
    seg, whole = run
    for out in run:  # every response ends at its first EOS or at the cap, and nothing follows the end
        for r, m in zip(out["responses"], out[RESPONSE_MASK]):
            n = int(m.sum())
            assert (r[: n - 1] != tok.eos_token_id).all() and (n == 16 or r[n - 1] == tok.eos_token_id)
            assert (r[n:] == tok.pad_token_id).all()
    assert seg[SEGMENTS].max() > 1 and whole[SEGMENTS].max() == 1


def test_state_round_trip_continues_exactly(setup):
    tok, old, new = setup
    sampling = SamplingConfig(max_new_tokens=12, ignore_eos=True)

    def calls(part, state_after_first=False):
        outs = []
        part.admit(prompts(tok, 2, 2, 0, stop=[12, 3, 2, 2]))
        outs.append(part.run(generator(tok, old, sampling), 0, quota=1, segment=4))
        if state_after_first:
            state = copy.deepcopy(part.state_dict())
            part = PartialRollouts(sampling, eos=tok.eos_token_id, pad=tok.pad_token_id)
            part.load_state_dict(state)
        part.admit(prompts(tok, 1, 2, 2, stop=[4, 4]))
        outs.append(part.run(generator(tok, new, sampling), 1, quota=2, segment=4))
        return outs

    a = calls(PartialRollouts(sampling, eos=tok.eos_token_id, pad=tok.pad_token_id))
    b = calls(PartialRollouts(sampling, eos=tok.eos_token_id, pad=tok.pad_token_id), state_after_first=True)
    for x, y in zip(a, b):
        assert x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x.keys() if k in x.tensors)
        assert x.rows == y.rows


def test_a_call_that_cannot_fill_its_quota_says_so(setup):
    tok, old, _ = setup
    sampling = SamplingConfig(max_new_tokens=4)
    part = PartialRollouts(sampling, eos=tok.eos_token_id, pad=tok.pad_token_id)
    part.admit(prompts(tok, 1, 2, 0))
    with pytest.raises(ValueError, match="give it at least as many prompt groups"):
        part.run(generator(tok, old, sampling), 0, quota=2, segment=4)


# -- streaming: the decode loop (engines.rollout.decode_loop) ---------------------------------------------------------


def test_a_decode_loop_switches_versions_only_between_segments(setup):
    """The replica's decode loop runs segments in its own thread; a weight change made inside `paused()` waits for
    the segment in progress, so every token's recorded version and log-prob are its own version's."""
    import threading

    from engines.rollout.decode_loop import DecodeLoop

    tok, old, new = setup
    sampling = SamplingConfig(max_new_tokens=12, ignore_eos=True)
    part = PartialRollouts(sampling, eos=tok.eos_token_id, pad=tok.pad_token_id)
    policy = {"model": old, "version": 0}
    eng = HFGenerationEngine(tok.eos_token_id, tok.pad_token_id)
    main = threading.get_ident()
    threads = set()

    def generate(batch):
        threads.add(threading.get_ident())
        return eng.generate(policy["model"], batch, sampling)

    loop = DecodeLoop(lambda: part.decode(generate, policy["version"], 2))
    try:
        with loop.paused():
            part.admit(prompts(tok, 3, 2, 0))
            loop.progress.clear()
        assert loop.progress.wait(60)  # a segment ran, by itself
        with loop.paused():
            assert part.running()  # 6 segments of 2 tokens: at most a few ran before this block
            policy.update(model=new, version=1)
        while True:
            with loop.paused():
                if not part.running():
                    out = part.hand_out()
                    break
                loop.progress.clear()
            loop.progress.wait(60)
    finally:
        loop.stop()
    assert not loop.alive and main not in threads and len(threads) == 1
    versions, mask = out[POLICY_VERSIONS], out[RESPONSE_MASK].bool()
    assert (versions[mask] == 0).any() and (versions[mask] == 1).any()  # every sequence spans the change
    per_row_change = [(v[m] == 1).nonzero()[0, 0].item() for v, m in zip(versions, mask)]
    assert all(c % 2 == 0 for c in per_row_change)  # at a segment boundary
    by_version = torch.where(versions == 0, token_log_probs(old, out), token_log_probs(new, out))
    assert torch.allclose(out[ROLLOUT_LOG_PROBS][mask], by_version[mask], atol=1e-5)


def test_a_decode_loop_that_fails_says_so_at_the_next_call():
    from engines.rollout.decode_loop import DecodeLoop

    def step() -> bool:
        raise OSError("the model is gone")

    loop = DecodeLoop(step)
    assert loop.progress.wait(30)
    with pytest.raises(RuntimeError, match="decode loop failed: OSError: the model is gone"):
        with loop.paused():
            pass
    assert not loop.alive  # (a replica's weight sync then runs without waiting for it: ReplicaEndpoints._quiet)
    loop.stop()
    assert not loop.alive


def test_an_idle_decode_loop_waits_for_work_and_stops():
    from engines.rollout.decode_loop import DecodeLoop

    work, done = [3], []

    def step() -> bool:
        if not work[0]:
            return False
        work[0] -= 1
        done.append(1)
        return True

    def wait_for(n: int) -> None:
        for _ in range(100):
            with loop.paused():
                if len(done) == n:
                    return
                loop.progress.clear()
            loop.progress.wait(5)

    loop = DecodeLoop(step)
    wait_for(3)
    calls = len(done)
    with loop.paused():
        work[0] = 2  # admitted: the idle loop takes it up after this block
    wait_for(5)
    loop.stop()
    assert calls == 3 and len(done) == 5 and not loop.alive
