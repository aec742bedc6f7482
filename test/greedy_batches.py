"""A row's greedy tokens when it shares its steps with other rows: the batch-invariance checks of the GPU tests."""
from __future__ import annotations

from infer.model import RWKV7
from infer.runner import ModelRunner
from infer.sampler import SamplingParams


def greedy_in_batch(model: RWKV7, prompt: list[int], batch_size: int, steps: int = 16,
                    cuda_graphs: bool = True) -> list[int]:
    """Greedy tokens of ``prompt``'s row over ``steps`` decode steps, fed in one runner with ``batch_size - 1`` other
    rows (one-token prompts, then their own greedy tokens)."""
    runner = ModelRunner(model, 64, cuda_graphs=cuda_graphs)
    others = [[(i * 37 + 5) % 1024] for i in range(batch_size - 1)]
    slots = list(range(batch_size))
    for s in slots:
        runner.start_row(s, SamplingParams(temperature=0))
    out = runner.step([prompt] + others, slots, [True] * batch_size)
    mine = [out.tokens[0]]
    for _ in range(steps):
        out = runner.step([[mine[-1]]] + [[t] for t in out.tokens[1:]], slots, [True] * batch_size)
        mine.append(out.tokens[0])
    return mine
