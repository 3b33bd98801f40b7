"""The prompts of a run: a seeded dataset visited in a per-epoch shuffled order, with a position checkpoints save.

Everything that decides which prompts a step sees (the epoch's order, the index in it, each row's sampling seed)
is derived from the seed and the saved position, so a resumed run draws exactly the batches an uninterrupted run
would have drawn, across epoch boundaries too.
"""

from __future__ import annotations

import random
from typing import Any

import torch

from algorithms.tasks import Task
from engines.generation import assemble_samples
from flowactors import Batch

__all__ = ["PromptData"]


class PromptData:
    """A fixed, seeded set of task prompts, visited in a per-epoch shuffled order with a saveable position."""

    def __init__(self, task: Task, tokenizer: Any, n_prompts: int, seed: int) -> None:
        rng = random.Random(seed)
        self.task, self.tokenizer, self.seed = task, tokenizer, seed
        self.examples = [task.make_example(rng) for _ in range(n_prompts)]
        self.width = max(len(tokenizer(p).input_ids) for p, _, _ in self.examples)
        self.epoch, self.index = 0, 0

    def _order(self, epoch: int) -> list[int]:
        order = list(range(len(self.examples)))
        random.Random(self.seed * 1000 + epoch).shuffle(order)
        return order

    def encode(self, examples: list[tuple[str, str, dict]]) -> tuple[torch.Tensor, torch.Tensor]:
        enc = self.tokenizer([p for p, _, _ in examples], padding="max_length", max_length=self.width,
                             return_tensors="pt")
        return enc.input_ids, enc.attention_mask

    def next_batch(self, prompts: int, samples_per_prompt: int) -> Batch:
        """`prompts` prompts, each repeated `samples_per_prompt` times with its own sampling seed."""
        picked = []
        while len(picked) < prompts:
            order = self._order(self.epoch)
            take = min(prompts - len(picked), len(order) - self.index)
            picked += [(self.epoch, i) for i in order[self.index:self.index + take]]
            self.index += take
            if self.index == len(order):
                self.epoch, self.index = self.epoch + 1, 0
        rows = [(e, i, k) for e, i in picked for k in range(samples_per_prompt)]
        examples = [self.examples[i] for _, i, _ in rows]
        ids, mask = self.encode(examples)
        seeds = torch.tensor([hash((self.seed, e, i, k)) % (2**62) for e, i, k in rows])
        groups = torch.tensor([g for g in range(len(picked)) for _ in range(samples_per_prompt)])
        return Batch({"input_ids": ids, "attention_mask": mask, "seed": seeds, "group": groups},
                     {"target": [ex[2]["target"] for ex in examples], "prompt_index": [i for _, i, _ in rows]})

    def sft_batch(self, samples: int, max_new_tokens: int, seed: int) -> Batch:
        """Demonstrations laid out like generated samples (prompt | response + EOS), for the NLL update."""
        rng = random.Random(seed)
        examples = [self.examples[rng.randrange(len(self.examples))] for _ in range(samples)]
        ids, mask = self.encode(examples)
        eos = self.tokenizer.eos_token_id
        resp = torch.full((samples, max_new_tokens), self.tokenizer.pad_token_id, dtype=torch.long)
        for r, (_, demo, _) in enumerate(examples):
            toks = (self.tokenizer(demo, add_special_tokens=False).input_ids + [eos])[:max_new_tokens]
            resp[r, :len(toks)] = torch.tensor(toks)
        return assemble_samples(Batch({"input_ids": ids, "attention_mask": mask}), resp, torch.zeros(resp.shape),
                                eos=eos, pad=self.tokenizer.pad_token_id)

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "index": self.index, "seed": self.seed}

    def load_state_dict(self, state: dict) -> None:
        if state["seed"] != self.seed:
            raise ValueError(f"data state was saved with seed {state['seed']} but this run uses {self.seed}")
        self.epoch, self.index = state["epoch"], state["index"]
