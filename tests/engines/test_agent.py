"""Multi-turn, tool-using episodes (engines.rollout.agent and .tools): stop sequences, the episode layout and
its loss mask, tool errors of every kind counted without ending the episode, turn and token limits, tools running
while the batch decodes, and code execution under limits.

The model that writes tool calls here is a real transformers Llama whose weights are set to follow a fixed chain of
characters (each token's successor: one-hot embeddings, identity layers, a permutation in the head), so episodes
are known in advance without training one.
"""

import copy
import time

import pytest
import torch

from algorithms.data.tasks import calculator
from algorithms.environments.sandbox import run_python
from engines import ModelConfig, SamplingConfig, build_model, build_tokenizer
from engines.rollout.agent import AgentConfig, EpisodeEngine, ToolCall, episode_samples
from engines.rollout.hf import HFGenerationEngine
from engines.rollout.tools import CompactFormat, Tool, ToolEnvironment
from engines.training.common import OptimConfig
from engines.training.torch_native import TrainEngine
from flowactors import Batch
from tests.algorithms.test_sandbox import needs_bwrap

CFG = ModelConfig(hidden_size=64, num_layers=1, num_heads=4, num_kv_heads=2, intermediate_size=64, seed=3)
TOK = build_tokenizer(CFG)


def chain_model(chain: dict[str, str]) -> torch.nn.Module:
    """A Llama that, greedily, writes `chain[c]` after character c (and EOS after '$')."""
    model = build_model(CFG, "lm", TOK)
    vocab, hidden = model.lm_head.weight.shape
    assert hidden >= vocab
    with torch.no_grad():
        model.model.embed_tokens.weight.copy_(torch.eye(vocab, hidden))
        for layer in model.model.layers:  # every layer adds nothing to the residual stream
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        head = torch.zeros(vocab, hidden)
        for a, b in chain.items():
            src = TOK.convert_tokens_to_ids(a)
            dst = TOK.eos_token_id if b == "$" else TOK.convert_tokens_to_ids(b)
            head[dst, src] = 1.0
        model.lm_head.weight.copy_(head)
    return model.eval()


def chain(text: str) -> dict[str, str]:
    """Successors that write `text` (distinct characters) after '?'; '$' stands for EOS."""
    return dict(zip("?" + text[:-1], text))


# "?" -> "sum:2+3!"  (a call; the tool answers "=5.") then "." -> "ok" EOS
CALL_THEN_ANSWER = {**chain("sum:2+3!"), ".": "o", "o": "k", "k": "$"}


def prompts(n: int = 2) -> Batch:
    enc = TOK(["go?"] * n, return_tensors="pt")
    return Batch({"input_ids": enc.input_ids, "attention_mask": enc.attention_mask}, {"target": [5] * n})


def engine(env_tools, **agent) -> EpisodeEngine:
    def environment(tokenizer):
        return ToolEnvironment(env_tools, CompactFormat(), tokenizer)

    inner = HFGenerationEngine(TOK.eos_token_id, TOK.pad_token_id, CFG.max_position_embeddings)
    return EpisodeEngine(inner, TOK, AgentConfig(environment, **{"max_turns": 3, **agent}))


def text(ids: torch.Tensor) -> str:
    return TOK.decode(ids, skip_special_tokens=False).replace("<pad>", "")


def slow_calc(expression: str) -> str:
    time.sleep(0.05)
    return calculator(expression)


# -- stop sequences ------------------------------------------------------------------------------------------------


def test_stop_sequence_ends_a_row_and_stays_in_its_response():
    model = chain_model(CALL_THEN_ANSWER)
    gen = HFGenerationEngine(TOK.eos_token_id, TOK.pad_token_id)
    plain = gen.generate(model, prompts(1), SamplingConfig(max_new_tokens=12), greedy=True)
    stop = (tuple(TOK("3!", add_special_tokens=False).input_ids),)  # a two-token stop sequence
    stopped = gen.generate(model, prompts(1), SamplingConfig(max_new_tokens=12, stop_sequences=stop), greedy=True)
    assert text(plain["responses"][0]).startswith("sum:2+3!")
    assert text(stopped["responses"][0]) == "sum:2+3!"
    assert stopped["response_mask"][0].tolist() == [1] * 8 + [0] * 4
    assert torch.equal(stopped["rollout_log_probs"][0, :8], plain["rollout_log_probs"][0, :8])


# -- episodes ------------------------------------------------------------------------------------------------------


def test_episode_layout_tool_output_is_context_not_loss():
    model = chain_model(CALL_THEN_ANSWER)
    out = engine([Tool(calculator, name_="sum")]).generate(
        model, prompts(2), SamplingConfig(max_new_tokens=20), greedy=True
    )
    resp = out["responses"][0]
    assert text(resp) == "sum:2+3!=5.ok<eos>"
    n_call, n_obs, n_answer = 8, 3, 3
    assert out["response_mask"][0].tolist() == [1] * n_call + [0] * n_obs + [1] * n_answer + [0] * 6
    p = out["prompts"].shape[1]
    assert out["attention_mask"][0, p:].tolist() == [1] * 14 + [0] * 6  # every episode token is attended
    assert torch.equal(out["input_ids"][:, p:], out["responses"])
    lp = out["rollout_log_probs"][0]
    assert (lp[n_call : n_call + n_obs] == 0).all() and (lp[:n_call] < 0).all()
    assert out["turns"].tolist() == [2, 2] and out["tool_calls"].tolist() == [1, 1]
    assert out["tool_errors"].tolist() == [0, 0]
    assert out["model_tokens"].tolist() == [11, 11] and out["tool_tokens"].tolist() == [3, 3]


def test_rollout_log_probs_of_model_tokens_equal_a_forward_over_the_episode():
    model = chain_model(CALL_THEN_ANSWER)
    out = engine([Tool(calculator, name_="sum")]).generate(model, prompts(1), SamplingConfig(max_new_tokens=20))
    from engines.ops import response_logits, token_log_probs

    with torch.no_grad():
        logits = model(
            input_ids=out["input_ids"], attention_mask=out["attention_mask"], position_ids=out["position_ids"]
        ).logits
    lp = token_log_probs(response_logits(logits, out["responses"].shape[1]), out["responses"])
    mask = out["response_mask"].bool()
    assert torch.allclose(lp[mask], out["rollout_log_probs"][mask], atol=1e-5)


def boom(expression: str) -> str:
    raise ValueError("boom")


def hang(expression: str) -> str:
    time.sleep(30)
    return "never"


@pytest.mark.parametrize("case", ["raises", "hangs", "malformed", "unknown"])
def test_a_bad_call_becomes_an_error_observation_and_the_episode_goes_on(case):
    calls = {"raises": "sum:2+3!", "hangs": "sum:2+3!", "malformed": "sum2+3!", "unknown": "sum:2+3!"}[case]
    model = chain_model({**chain(calls), ".": "o", "o": "k", "k": "$"})
    tools = {
        "raises": [Tool(boom, name_="sum")],
        "hangs": [Tool(hang, name_="sum")],
        "malformed": [Tool(calculator, name_="sum")],
        "unknown": [Tool(calculator, name_="add")],
    }[case]
    t0 = time.perf_counter()
    out = engine(tools, tool_timeout_s=0.5).generate(model, prompts(2), SamplingConfig(max_new_tokens=48), greedy=True)
    seconds = time.perf_counter() - t0
    expected = {
        "raises": "=error valueerror: boom.",
        "hangs": "=error timed out after 05 s.",
        "malformed": "=error bad call.",
        "unknown": "=error no tool sum.",
    }[case]
    assert text(out["responses"][0]) == f"{calls}{expected}ok<eos>"
    assert out["tool_errors"].tolist() == [1, 1] and out["tool_calls"].tolist() == [1, 1]
    assert out["turns"].tolist() == [2, 2]
    if case == "hangs":
        assert seconds < 5 and out["tool_seconds"].min() >= 0.5  # both timed out together, not one after another


def test_max_turns_ends_an_episode_that_keeps_calling():
    model = chain_model({**chain("sum:2+3!"), ".": "s"})  # after each answer, another call
    out = engine([Tool(calculator, name_="sum")], max_turns=3).generate(
        model, prompts(1), SamplingConfig(max_new_tokens=64), greedy=True
    )
    assert text(out["responses"][0]) == "sum:2+3!=5.sum:2+3!=5.sum:2+3!"
    assert out["turns"].tolist() == [3] and out["tool_calls"].tolist() == [2]


def test_the_token_budget_covers_the_whole_episode():
    model = chain_model({**chain("sum:2+3!"), ".": "s"})
    out = engine([Tool(calculator, name_="sum")], max_turns=10).generate(
        model, prompts(1), SamplingConfig(max_new_tokens=15), greedy=True
    )
    assert text(out["responses"][0]) == "sum:2+3!=5.sum:"  # cut at 15 tokens, mid-turn
    assert out["response_mask"][0].tolist() == [1] * 8 + [0] * 3 + [1] * 4


def test_streamed_episodes_are_the_generated_ones():
    model = chain_model(CALL_THEN_ANSWER)
    eng = engine([Tool(slow_calc, name_="sum")])
    whole = eng.generate(model, prompts(5), SamplingConfig(max_new_tokens=20))
    chunks = list(eng.stream(model, prompts(5), SamplingConfig(max_new_tokens=20), 2, row_offset=10))
    assert [len(c) for c in chunks] == [2, 2, 1]
    got = Batch.concat(chunks)
    order = torch.argsort(got["row_index"])
    assert got["row_index"][order].tolist() == [10, 11, 12, 13, 14]
    for key in ("responses", "response_mask", "attention_mask", "turns", "tool_calls"):
        assert torch.equal(got[key][order], whole[key]), key


def _most_at_once(spans: list[tuple[float, float]]) -> int:
    """The most of `spans` (start, end) in progress at one moment."""
    edges = sorted([(t0, 1) for t0, _ in spans] + [(t1, -1) for _, t1 in spans])
    running = most = 0
    for _, step in edges:
        running += step
        most = max(most, running)
    return most


def test_tools_run_while_the_batch_decodes():
    """8 episodes, one 200 ms tool call each: overlapped on 8 threads, the calls are in progress together; turn by
    turn on one thread, one after another (each call's start and end recorded, not the run's wall time)."""
    model = chain_model(CALL_THEN_ANSWER)
    cfg = SamplingConfig(max_new_tokens=20)
    at_once = {}
    for overlap in (True, False):
        spans: list[tuple[float, float]] = []

        def slower_calc(expression: str) -> str:
            t0 = time.monotonic()
            time.sleep(0.2)
            spans.append((t0, time.monotonic()))
            return calculator(expression)

        eng = engine([Tool(slower_calc, name_="sum")], overlap=overlap, tool_workers=8 if overlap else 1)
        out = eng.generate(model, prompts(8), cfg, greedy=True)
        assert out["tool_calls"].tolist() == [1] * 8 and text(out["responses"][3]) == "sum:2+3!=5.ok<eos>"
        assert len(spans) == 8
        at_once[overlap] = _most_at_once(spans)
    assert at_once[False] == 1 and at_once[True] >= 4, at_once


def test_a_call_is_bound_to_the_tools_signature():
    env = ToolEnvironment([Tool(calculator, name_="calc")], CompactFormat())
    (ok,) = env.step("calc:2*21!")
    assert ok.error is None and ok.run() == "42"
    (bad,) = env.step("nothing here")
    assert bad.run is None and bad.error == "bad call"
    assert Tool(calculator).schema["function"]["parameters"]["required"] == ["expression"]


# -- training on episodes ------------------------------------------------------------------------------------------


def episode_batch() -> Batch:
    model = chain_model(CALL_THEN_ANSWER)
    out = engine([Tool(calculator, name_="sum")]).generate(
        model, prompts(4), SamplingConfig(max_new_tokens=20), greedy=True
    )
    return Batch({**out.tensors, "advantages": torch.ones(out["responses"].shape)}, out.rows)


def loss_fn(outputs, mb):
    return -(outputs["log_probs"] * mb["advantages"]), mb["response_mask"].float(), {}


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_tool_tokens_get_no_gradient(packed):
    """The loss mask: anything at the tool outputs' positions (here huge advantages) changes no gradient."""
    batch = episode_batch()
    tool = (batch["attention_mask"][:, batch["prompts"].shape[1] :] == 1) & (batch["response_mask"] == 0)
    assert tool.sum() == 12
    poisoned = Batch({**batch.tensors, "advantages": torch.where(tool, 1e6, batch["advantages"])}, batch.rows)
    base = build_model(CFG, "lm", TOK)
    grads = []
    for b in (batch, poisoned):
        eng = TrainEngine(
            copy.deepcopy(base),
            OptimConfig(lr=1e-3, micro_batch_tokens=4096, grad_clip=0.0),
            pack_sequences=packed,
            pad_token_id=TOK.pad_token_id,
        )
        eng.update([b], loss_fn, lambda mb, e=eng: e.policy_outputs(mb, 1.0, with_entropy=False))
        grads.append({k: p.detach().clone() for k, p in eng.model.named_parameters()})
    for k in grads[0]:
        assert torch.equal(grads[0][k], grads[1][k]), k
    # and the control: the same poison on the model's own tokens does change the update
    poisoned_model = Batch(
        {**batch.tensors, "advantages": torch.where(batch["response_mask"].bool(), 1e6, 1.0)}, batch.rows
    )
    eng = TrainEngine(copy.deepcopy(base), OptimConfig(lr=1e-3, micro_batch_tokens=4096, grad_clip=0.0))
    eng.update([poisoned_model], loss_fn, lambda mb: eng.policy_outputs(mb, 1.0, with_entropy=False))
    assert any(not torch.equal(p, grads[0][k]) for k, p in eng.model.named_parameters())


def test_gae_carries_the_final_reward_across_tool_outputs():
    from algorithms.objectives.losses import gae, token_rewards

    mask = torch.tensor([[1, 1, 0, 0, 1, 1, 0]], dtype=torch.float32)
    values = torch.tensor([[0.1, 0.2, 9.0, 9.0, 0.3, 0.4, 9.0]])
    rewards = token_rewards(torch.tensor([1.0]), mask)
    assert rewards.tolist() == [[0, 0, 0, 0, 0, 1.0, 0]]  # at the model's last token
    adv, ret = gae(rewards, values, mask, 1.0, 1.0)
    compact, _ = gae(rewards[:, [0, 1, 4, 5]], values[:, [0, 1, 4, 5]], torch.ones(1, 4), 1.0, 1.0)
    assert torch.allclose(adv[:, [0, 1, 4, 5]], compact) and adv[0, 2] == adv[0, 3] == adv[0, 6] == 0
    assert torch.allclose(ret[0, [0, 1, 4, 5]], torch.ones(4))  # γ = λ = 1: every model token's return is 1


def test_multi_turn_demonstrations_train_only_the_models_segments():
    from algorithms.data.prompts import PromptData
    from algorithms.data.tasks import get_task

    data = PromptData(get_task("tool_arith"), TOK, 64, 0)
    with_tool = next(ex for ex in data.examples if len(ex[1]) == 3)
    b = data.demonstrations([with_tool], 24)
    call, obs, answer = (seg for seg, _ in with_tool[1])
    assert text(b["responses"][0]) == f"{call}{obs}{answer}<eos>"
    n = len(call), len(obs), len(answer) + 1
    assert b["response_mask"][0].tolist() == [1] * n[0] + [0] * n[1] + [1] * n[2] + [0] * (24 - sum(n))


def test_episode_samples_keep_prompt_fields():
    p = prompts(2)
    p = Batch({**p.tensors, "seed": torch.tensor([4, 5])}, p.rows)
    out = episode_samples(p, [[5, 6], [7]], [[1, 0], [1]], [[-0.5, 0.0], [-0.1]], 4, pad=TOK.pad_token_id)
    assert out["seed"].tolist() == [4, 5] and out.rows["target"] == [5, 5]
    assert out["response_mask"].tolist() == [[1, 0, 0, 0], [1, 0, 0, 0]]
    assert out["tool_tokens"].tolist() == [1, 0]


# -- code execution (the sandbox's own tests: tests/algorithms/test_sandbox.py) -------------------------------


@needs_bwrap
def test_a_code_tool_that_times_out_is_an_error_observation():
    call = ToolCall("run_python", run=lambda: run_python("import time; time.sleep(10)", wall_s=0.3))
    from engines.rollout.agent import _Tools

    out, err, seconds = _Tools(1, 5.0).run(call)
    assert out is None and err.startswith("TimeoutError") and seconds < 3


# -- the Hermes call format ----------------------------------------------------------------------------------------

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def test_hermes_calls_parse_with_every_kind_of_mistake_an_observation():
    from engines.rollout.tools import HermesFormat

    env = ToolEnvironment([Tool(calculator)], HermesFormat())
    two = env.step(
        '<tool_call>\n{"name": "calculator", "arguments": {"expression": "6*7"}}\n</tool_call>'
        '<tool_call>{"name": "calculator", "arguments": "{\\"expression\\": \\"1+1\\"}"}</tool_call>'
    )
    assert [c.run() for c in two] == ["42", "2"]
    (bad_json,) = env.step("<tool_call>{name: calculator}</tool_call>")
    (unknown,) = env.step('<tool_call>{"name": "search", "arguments": {}}</tool_call>')
    (bad_args,) = env.step('<tool_call>{"name": "calculator", "arguments": {"expr": "1+1"}}</tool_call>')
    (nothing,) = env.step("I will just answer.")
    assert bad_json.error.startswith("the call is not JSON") and "unknown tool 'search'" in unknown.error
    assert "bad arguments for calculator" in bad_args.error and "no <tool_call>" in nothing.error
    assert all(c.run is None for c in (bad_json, unknown, bad_args, nothing))


def test_hermes_outputs_are_rendered_as_the_chat_template_renders_a_tool_turn():
    from engines.rollout.tools import HermesFormat

    tok = build_tokenizer(CFG)
    tok.chat_template = CHATML
    env = ToolEnvironment([Tool(calculator)], HermesFormat(), tok)
    (call,) = env.step('<tool_call>{"name": "calculator", "arguments": {"expression": "6*7"}}</tool_call>')
    text = env.observe([(call, "42", None), (call, None, "timed out after 5 s")])
    assert text == (
        "<|im_end|>\n<|im_start|>tool\n42<|im_end|>\n<|im_start|>assistant\n"
        "<|im_end|>\n<|im_start|>tool\nerror: timed out after 5 s<|im_end|>\n<|im_start|>assistant\n"
    )
    plain = build_tokenizer(CFG)  # no chat template: refused, naming why
    with pytest.raises(ValueError, match="does not render tool messages"):
        ToolEnvironment([Tool(calculator)], HermesFormat(), plain).observe([(call, "42", None)])


def test_chatml_task_demonstrations_are_calls_the_environment_runs_and_the_reward_reads():
    import random

    from algorithms.data.tasks import get_task

    task = get_task("tool_arith_chatml")
    rng = random.Random(0)
    prompt, demo, row = next(ex for ex in (task.make_example(rng) for _ in range(20)) if len(ex[1]) == 3)
    tok = build_tokenizer(CFG)
    tok.chat_template = CHATML
    env = task.environment(tok)
    env.reset(prompt, row)
    (call_text, _), (output, _), (answer, _) = demo
    (call,) = env.step(call_text)
    assert call.run() == str(row["target"]) and output == env.observe([(call, call.run(), None)])
    transcript = f"{call_text}\ntool\n{row['target']}\nassistant\n{answer}"  # as decoded without special tokens
    assert task.success(prompt, transcript, row) and task.reward(prompt, transcript, row) == 1.0
    wrong = f"{call_text}\ntool\n{row['target']}\nassistant\nThe answer is 12."
    assert not task.success(prompt, wrong, row) and task.reward(prompt, wrong, row) < 1.0


def test_partial_rollouts_advance_episodes_a_turn_at_a_time_across_versions_and_a_checkpoint():
    """Partial rollouts of episodes (engines.rollout.partial): a segment is one turn of every running episode (and
    its tools); an episode continued call by call, through a checkpoint of its state, is the episode `generate`
    samples, and its tokens record the version of the call that wrote them."""
    from engines.fields import POLICY_VERSIONS
    from engines.rollout.partial import SEGMENTS, PartialRollouts

    model = chain_model(CALL_THEN_ANSWER)
    eng = engine([Tool(slow_calc, name_="sum")])
    cfg = SamplingConfig(max_new_tokens=20)
    p = prompts(4)
    p = Batch({**p.tensors, "group": torch.tensor([0, 0, 1, 1]), "seed": torch.arange(4)}, p.rows)
    whole = eng.generate(model, p, cfg, greedy=True)

    def advance(eps):
        eng.advance(model, eps, cfg, greedy=True)

    part = PartialRollouts(cfg, eos=TOK.eos_token_id, pad=TOK.pad_token_id, episodes=eng)
    part.admit(p)
    assert len(part.run(advance, 0, quota=0, segment=1)) == 0  # turn 1: the call, and the tool's answer
    state = copy.deepcopy(part.state_dict())
    part = PartialRollouts(cfg, eos=TOK.eos_token_id, pad=TOK.pad_token_id, episodes=eng)
    part.load_state_dict(state)  # fresh environments, reset from the prompt rows
    out = part.run(advance, 1, quota=2, segment=1)
    for key in ("responses", "response_mask", "attention_mask", "turns", "tool_calls", "rollout_log_probs"):
        assert torch.equal(out[key], whole[key]), key
    assert out[SEGMENTS].tolist() == [2] * 4 and out["group"].tolist() == [0, 0, 1, 1]
    model_tokens = out["response_mask"][0].bool()
    versions = out[POLICY_VERSIONS][0][model_tokens].tolist()
    assert versions == [0] * len("sum:2+3!") + [1] * (len(versions) - len("sum:2+3!")), versions
    assert text(out["responses"][0]).startswith("sum:2+3!=5.ok")
