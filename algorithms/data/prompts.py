"""The prompts of a run: a seeded dataset visited in a per-epoch shuffled order, with a position checkpoints save.

Everything that decides which prompts a step sees (the epoch's order, the index in it, each row's sampling seed)
is derived from the seed and the saved position, so a resumed run draws exactly the batches an uninterrupted run
would have drawn, across epoch boundaries too.
"""

from __future__ import annotations

import random
from typing import Any

import torch

from algorithms.data.datasets import Example
from algorithms.data.tasks import Task
from engines.rollout.stream import assemble_samples
from flowactors import Batch

__all__ = ["PromptData"]


class PromptData:
    """A fixed, seeded set of prompts, visited in a per-epoch shuffled order with a saveable position.

    The prompts are `n_prompts` synthetic examples of `task`, or `examples` when given (a dataset from files,
    `algorithms.data.datasets`); the task still supplies the rule reward and the default response length. Per-row values
    that every example has (a task's `target`, a dataset's extra columns) travel with the prompts."""

    def __init__(
        self, task: Task | None, tokenizer: Any, n_prompts: int, seed: int, examples: list[Example] | None = None
    ) -> None:
        self.task, self.tokenizer, self.seed = task, tokenizer, seed
        if examples is None:
            rng = random.Random(seed)
            examples = [task.make_example(rng) for _ in range(n_prompts)]
        self.examples = examples
        self.width = max(len(tokenizer(p).input_ids) for p, _, _ in self.examples)
        self.row_keys = sorted(set.intersection(*(set(values) for _, _, values in self.examples)))
        self.epoch, self.index = 0, 0

    @property
    def has_demonstrations(self) -> bool:
        return all(demo is not None for _, demo, _ in self.examples)

    def _order(self, epoch: int) -> list[int]:
        order = list(range(len(self.examples)))
        random.Random(self.seed * 1000 + epoch).shuffle(order)
        return order

    def encode(self, examples: list[Example]) -> tuple[torch.Tensor, torch.Tensor]:
        enc = self.tokenizer(
            [p for p, _, _ in examples], padding="max_length", max_length=self.width, return_tensors="pt"
        )
        return enc.input_ids, enc.attention_mask

    def next_batch(self, prompts: int, samples_per_prompt: int) -> Batch:
        """`prompts` prompts, each repeated `samples_per_prompt` times with its own sampling seed."""
        picked = []
        while len(picked) < prompts:
            order = self._order(self.epoch)
            take = min(prompts - len(picked), len(order) - self.index)
            picked += [(self.epoch, i) for i in order[self.index : self.index + take]]
            self.index += take
            if self.index == len(order):
                self.epoch, self.index = self.epoch + 1, 0
        rows = [(e, i, k) for e, i in picked for k in range(samples_per_prompt)]
        examples = [self.examples[i] for _, i, _ in rows]
        seeds = torch.tensor([hash((self.seed, e, i, k)) % (2**62) for e, i, k in rows])
        groups = torch.tensor([g for g in range(len(picked)) for _ in range(samples_per_prompt)])
        return self._batch(examples, seeds, groups, [i for _, i, _ in rows])

    def eval_batch(self, limit: int | None = None) -> Batch:
        """The first `limit` prompts (all by default) in dataset order, one sample each, seeded by position (the same
        prompts and seeds at every evaluation, so evaluations compare)."""
        n = len(self.examples) if limit is None else min(limit, len(self.examples))
        seeds = torch.tensor([hash((self.seed, -1, i)) % (2**62) for i in range(n)])
        return self._batch(self.examples[:n], seeds, torch.arange(n), list(range(n)))

    def _batch(self, examples: list[Example], seeds: torch.Tensor, groups: torch.Tensor, index: list[int]) -> Batch:
        ids, mask = self.encode(examples)
        rows = {k: [ex[2][k] for ex in examples] for k in self.row_keys}
        return Batch(
            {"input_ids": ids, "attention_mask": mask, "seed": seeds, "group": groups}, {**rows, "prompt_index": index}
        )

    def sft_batch(self, samples: int, max_new_tokens: int, seed: int) -> Batch:
        """Demonstrations laid out like generated samples (prompt | response + EOS), for the NLL update."""
        if not self.has_demonstrations:
            raise ValueError("these prompts have no demonstrations (a `response` column) for supervised steps")
        rng = random.Random(seed)
        return self.demonstrations(
            [self.examples[rng.randrange(len(self.examples))] for _ in range(samples)], max_new_tokens
        )

    def demonstrations(self, examples: list[Example], max_new_tokens: int) -> Batch:
        """`examples` with their demonstrations as responses (cut to `max_new_tokens`, EOS included), laid out
        like generated samples: prompts left-padded to the dataset's width, responses right-padded. A multi-turn
        demonstration (segments, algorithms.data.tasks) is laid out as an episode: tool outputs are context, not loss."""
        ids, mask = self.encode(examples)
        eos, pad = self.tokenizer.eos_token_id, self.tokenizer.pad_token_id
        if any(isinstance(demo, tuple) for _, demo, _ in examples):
            from engines.rollout.agent import episode_samples

            tokens, owned = [], []
            for _, demo, _ in examples:
                segments = demo if isinstance(demo, tuple) else ((demo, True),)
                toks, own = [], []
                for text, model in segments:
                    piece = self.tokenizer(text, add_special_tokens=False).input_ids
                    toks, own = toks + piece, own + [int(model)] * len(piece)
                tokens.append(toks + [eos])
                owned.append(own + [1])
            return episode_samples(
                Batch({"input_ids": ids, "attention_mask": mask}),
                tokens,
                owned,
                [[0.0] * len(t) for t in tokens],
                max_new_tokens,
                pad=pad,
            )
        resp = torch.full((len(examples), max_new_tokens), pad, dtype=torch.long)
        for r, (_, demo, _) in enumerate(examples):
            toks = (self.tokenizer(demo, add_special_tokens=False).input_ids + [eos])[:max_new_tokens]
            resp[r, : len(toks)] = torch.tensor(toks)
        return assemble_samples(
            Batch({"input_ids": ids, "attention_mask": mask}), resp, torch.zeros(resp.shape), eos=eos, pad=pad
        )

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "index": self.index, "seed": self.seed}

    def load_state_dict(self, state: dict) -> None:
        if state["seed"] != self.seed:
            raise ValueError(f"data state was saved with seed {state['seed']} but this run uses {self.seed}")
        self.epoch, self.index = state["epoch"], state["index"]
