"""The model runner: one forward + sample over a batch of state slots. Knows tensors, not requests."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch

from infer.batch import PackedBatch
from infer.model import RWKV7
from infer.sampler import SampleOutput, Sampler, SamplingParams
from infer.state import SlotState


@dataclass
class StepOutput:
    """Host-side results for the rows that sampled this step (in the order they were given)."""

    tokens: list[int]
    logprobs: list[float] | None
    top_ids: list[list[int]] | None
    top_logprobs: list[list[float]] | None
    # row position -> per scored token: (logprob, [(alternative id, logprob), ...])
    scores: dict[int, list[tuple[float, list[tuple[int, float]]]]] = field(default_factory=dict)


class ModelRunner:
    def __init__(self, model: RWKV7, num_slots: int, wkv_dtype: torch.dtype = torch.float32):
        self.model = model
        self.num_slots = num_slots
        self.state = model.new_state_pool(num_slots, wkv_dtype)
        self.sampler = Sampler(model.config.vocab_size, num_slots, model.device)

    def implementations(self) -> dict[str, str]:
        return {**self.model.implementations(), "sampler": getattr(self.sampler, "name", "torch"),
                "state": f"{self.num_slots} slots, wkv {str(self.state.wkv.dtype).removeprefix('torch.')}"}

    def start_row(self, slot: int, params: SamplingParams, initial: SlotState | None = None) -> None:
        """Prepare a slot for a new row: its starting state (empty or imported) and sampler state."""
        if initial is None:
            self.state.reset([slot])
        else:
            self.state.import_slot(slot, initial)
        self.sampler.reset_slot(slot, params)

    def end_row(self, slot: int) -> None:
        self.sampler.release_slot(slot)

    def export_state(self, slot: int) -> SlotState:
        return self.state.export_slot(slot)

    def prefill_only(self, rows: Sequence[Sequence[int]], slots: Sequence[int]) -> None:
        """Advance states without sampling (e.g. replaying kept tokens)."""
        self.model.forward(PackedBatch.from_rows(rows, slots, self.model.device), self.state)

    def step(self, rows: Sequence[Sequence[int]], slots: Sequence[int], sample: Sequence[bool],
             want_logprobs: bool = False, score: dict[int, tuple[Sequence[int], int]] | None = None) -> StepOutput:
        """Feed each row its tokens; sample the next token for rows with ``sample[i]``.

        ``score`` maps a row position to (targets, top_n): the log-probability of ``targets[j]``
        given the row's tokens up to position j (raw model distribution), for prompt logprobs.
        """
        batch = PackedBatch.from_rows(rows, slots, self.model.device)
        logits = self.model.forward(batch, self.state, all_logits=bool(score))
        scores = {}
        if score:
            all_logits, logits = logits, logits[batch.last]
            starts = [0]
            for n in batch.lens[:-1]:
                starts.append(starts[-1] + n)
            for i, (targets, top_n) in score.items():
                scores[i] = self._score(all_logits[starts[i]:starts[i] + len(targets)], targets, top_n)
        picked = [i for i, s in enumerate(sample) if s]
        if not picked:
            return StepOutput([], None, None, None, scores)
        if len(picked) < len(rows):
            index = torch.tensor(picked, dtype=torch.long, device=logits.device)
            logits, sample_slots = logits[index], batch.slots[index]
        else:
            sample_slots = batch.slots
        out: SampleOutput = self.sampler.sample(logits, sample_slots, want_logprob=want_logprobs)
        return StepOutput(
            tokens=out.tokens.tolist(),  # the one host sync of the step
            logprobs=out.logprobs.tolist() if out.logprobs is not None else None,
            top_ids=out.top_ids.tolist() if out.top_ids is not None else None,
            top_logprobs=out.top_logprobs.tolist() if out.top_logprobs is not None else None,
            scores=scores,
        )

    @staticmethod
    def _score(logits: torch.Tensor, targets: Sequence[int], top_n: int) -> list[tuple[float, list[tuple[int, float]]]]:
        if not targets:
            return []
        logp = torch.log_softmax(logits.float(), dim=-1)
        chosen = logp.gather(1, torch.tensor(targets, device=logp.device).unsqueeze(1)).squeeze(1).tolist()
        if top_n <= 0:
            return [(c, []) for c in chosen]
        values, ids = logp.topk(top_n, dim=-1)
        return [(c, list(zip(i, v))) for c, i, v in zip(chosen, ids.tolist(), values.tolist())]
