"""The model runner: one forward + sample over a batch of state slots. Knows tensors, not requests."""
from __future__ import annotations

import gc
import logging
import os
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from infer.batch import PackedBatch, to_device, to_device_parts
from infer.model import RWKV7
from infer.sampler import SampleOutput, Sampler, SamplingParams
from infer.state import SlotState, StatePool

log = logging.getLogger(__name__)


@dataclass
class StepOutput:
    """Host-side results for the rows that sampled this step (in the order they were given)."""

    tokens: list[int]
    logprobs: list[float] | None
    top_ids: list[list[int]] | None
    top_logprobs: list[list[float]] | None
    # row position -> per scored token: (logprob, [(alternative id, logprob), ...])
    scores: dict[int, list[tuple[float, list[tuple[int, float]]]]] = field(default_factory=dict)


@dataclass
class LaunchedStep:
    """A step whose work is queued on the device and whose results the host has not read yet."""

    slots: list[int]                 # the rows' slots, in order
    sampled: SampleOutput | None     # device tensors of the rows that sampled (None: none did)
    want_logprobs: bool
    scores: dict[int, list[tuple[float, list[tuple[int, float]]]]] = field(default_factory=dict)
    # The results' copy to the host, queued right behind the step: a step queued after this one (launch_next)
    # does not delay it. None: the tensors are on the CPU already.
    _host: SampleOutput | None = field(default=None, init=False, repr=False)
    _ready: "torch.cuda.Event | None" = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        out = self.sampled
        if out is None or out.tokens.device.type != "cuda":
            return
        pinned = {name: None if t is None else t.to("cpu", non_blocking=True)  # pinned, asynchronous
                  for name, t in vars(out).items()}
        self._host = SampleOutput(**pinned)
        self._ready = torch.cuda.Event()
        self._ready.record()

    def result(self) -> StepOutput:
        """The host copy of the results: the one host sync of the step."""
        out = self.sampled
        if out is None:
            return StepOutput([], None, None, None, self.scores)
        if self._ready is not None:
            self._ready.synchronize()
            out = self._host
        return StepOutput(
            tokens=out.tokens.tolist(),
            logprobs=out.logprobs.tolist() if out.logprobs is not None else None,
            top_ids=out.top_ids.tolist() if out.top_ids is not None else None,
            top_logprobs=out.top_logprobs.tolist() if out.top_logprobs is not None else None,
            scores=self.scores,
        )


GRAPH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
# One row's prompt of 2 to this many tokens in a step of its own replays a graph captured for its length: such a step
# (a request arriving while nothing decodes) is bound by the host's launches, a 7.2B forward of 19 tokens issuing
# ~10 ms of them for ~5 ms of GPU work; longer prompts keep the GPU busier than the host.
PROMPT_GRAPH_MAX_TOKENS = 64
# Graphs captured while serving (a bucket or a sampler configuration first met) must not fail because another thread
# touches the device meanwhile (the session store's copies between VRAM and RAM run in worker threads).
CAPTURE_MODE = "thread_local"


def graph_covers(rows: Sequence[Sequence[int]], prompt_lengths: range = range(2, PROMPT_GRAPH_MAX_TOKENS + 1),
                 mixed_steps: bool = True) -> bool:
    """Whether StepGraphs replays a step feeding ``rows``: every row one token; or one row a prompt of a length in
    ``prompt_lengths``, alone or (``mixed_steps``) last after rows of one token (the engine puts decoding rows
    first). Any other step runs its forward op by op."""
    if not all(len(r) == 1 for r in rows[:-1]):
        return False
    last = len(rows[-1]) if rows else 1
    return last == 1 or (last in prompt_lengths and (len(rows) == 1 or mixed_steps))


class StepGraphs:
    """Model forwards captured as CUDA graphs: decode steps at bucketed batch sizes, and steps that feed
    one row a short prompt, one graph per length.

    A decode step of B rows replays the graph of the smallest bucket >= B after copying the
    token and slot ids into static buffers; padding rows use a scratch slot that no row owns.
    This removes the per-kernel launch cost that dominates small-batch decode. A prompt step
    replays the graph of exactly its length (padding would change the recurrence). A step of
    decoding rows and one short prompt (a request arriving while others stream) replays both:
    the weights are read twice, but the host launches nothing per layer. A decode step in which every row samples
    replays the sampler from a graph too (its ~20 launches cost the host ~0.5-1.3 ms a step, more than the GPU's
    0.2-0.4 ms), one per bucket and per configuration of the live slots (``Sampler.graph_key``); its padding rows
    sample the scratch slot (the sampler has a row for it). On an H200
    (bench/bench_mixed_steps.py) that is 1.4-2.6x faster than the eager step at 1.5B whatever the
    decoding rows, and at 7.2B 0.88-1.23x of it alone but faster in the server, whose other
    threads slow the eager step's launches (7.2B, 32 streams arriving 20 ms apart: the server's
    TTFT 19-23 ms against 26-37; 1.5B, 128 streams 4 ms apart: 46-62 against 66-85). All graphs
    share one memory pool: they run one at a time, on one stream.
    """

    def __init__(self, model: RWKV7, state: StatePool, scratch_slot: int, max_rows: int,
                 prompt_tokens: int = PROMPT_GRAPH_MAX_TOKENS, mixed_steps: bool = True,
                 sampler: Sampler | None = None):
        self.model, self.state, self.scratch = model, state, scratch_slot
        # None: decode steps sample eagerly (the sampler needs a row for the scratch slot: padding rows sample it)
        self.sampler = sampler if sampler is not None and sampler.max_slots > scratch_slot else None
        self.buckets = sorted({b for b in GRAPH_BUCKETS if b < max_rows} | {max_rows})
        self.prompt_lengths = range(2, prompt_tokens + 1)
        self.mixed_steps = mixed_steps  # whether decoding rows beside a short prompt replay graphs too
        device = model.device
        self.tokens = torch.zeros(max(max_rows, prompt_tokens), dtype=torch.long, device=device)
        self.slots = torch.full((max_rows,), scratch_slot, dtype=torch.long, device=device)
        self._rows = torch.arange(max_rows, dtype=torch.long, device=device)
        # (kind, size) -> (graph, its logits, its batch: kept alive, the graph reads the batch's buffers)
        self._graphs: dict[tuple[str, int], tuple[torch.cuda.CUDAGraph, torch.Tensor, PackedBatch]] = {}
        # (bucket, Sampler.graph_key) -> (graph, its outputs over the bucket's rows)
        self._sampler_graphs: dict[tuple[int, tuple], tuple[torch.cuda.CUDAGraph, SampleOutput]] = {}
        self._pool = torch.cuda.graph_pool_handle()
        self._capture_stream = torch.cuda.Stream(device)
        self._decoded: int | None = None  # the bucket of the decode graph replayed last (None: a prompt's was)

    def warmup(self) -> None:
        for bucket in reversed(self.buckets):  # largest first, so smaller graphs reuse its memory
            self._capture("decode", bucket)
        for length in reversed(self.prompt_lengths):
            self._capture("prompt", length)

    def _capture(self, kind: str, size: int) -> tuple[torch.cuda.CUDAGraph, torch.Tensor, PackedBatch]:
        self.slots[:size if kind == "decode" else 1].fill_(self.scratch)  # warm-up runs write only the scratch slot
        if kind == "decode":
            batch = PackedBatch.decode(self.tokens[:size], self.slots[:size], self._rows[:size])
        else:
            batch = PackedBatch(tokens=self.tokens[:size], slots=self.slots[:1], lens=[size], starts=self._rows[:1],
                                last=torch.full((1,), size - 1, dtype=torch.long, device=self.tokens.device))
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # also builds the batch's cached index tensors outside the capture
            for _ in range(2):
                self.model.forward(batch, self.state)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool, capture_error_mode=CAPTURE_MODE):
            logits = self.model.forward(batch, self.state)
        self._graphs[kind, size] = (graph, logits, batch)
        return self._graphs[kind, size]

    def covers(self, rows: Sequence[Sequence[int]]) -> bool:
        """Whether a step feeding ``rows`` replays graphs (``graph_covers`` with this object's prompt lengths)."""
        return graph_covers(rows, self.prompt_lengths, self.mixed_steps)

    def run(self, rows: Sequence[Sequence[int]] | torch.Tensor, slots: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Logits [B, V] and the slot-id tensor [B] of a step that ``covers`` (``rows`` may also be a tensor of one
        token per row, on the device)."""
        if isinstance(rows, torch.Tensor):
            return self._replay("decode", rows, slots)
        if not rows or len(rows[-1]) == 1:  # covered: a decode step
            return self._replay("decode", torch.tensor([r[0] for r in rows], dtype=torch.long), slots)
        if len(rows) == 1:
            return self._replay("prompt", torch.tensor(rows[0], dtype=torch.long), slots)
        # Both graphs' inputs in one copy to the device, before either is queued: the host queues the second graph's
        # inputs from the device then, not from its own memory after the first graph.
        tokens, prompt, slot_ids = to_device_parts([[r[0] for r in rows[:-1]], rows[-1], slots], self.slots.device)
        # The decode graph first: the prompt graph was captured while the decode graphs' logits were held, so its
        # replay leaves them alone; the other way round, the decode graph's scratch memory may hold the prompt's.
        decoded, _ = self._replay("decode", tokens, slot_ids[:-1])
        prompted, _ = self._replay("prompt", prompt, slot_ids[-1:])
        return torch.cat([decoded, prompted]), slot_ids  # not the static slot ids: they hold the prompt's now

    def _replay(self, kind: str, tokens: torch.Tensor, slots: Sequence[int] | torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        count = len(slots)
        size = next(b for b in self.buckets if b >= count) if kind == "decode" else len(tokens)
        graph, logits, batch = self._graphs.get((kind, size)) or self._capture(kind, size)
        self.tokens[:len(tokens)].copy_(tokens, non_blocking=True)
        self.slots[:count].copy_(slots if isinstance(slots, torch.Tensor) else torch.tensor(slots, dtype=torch.long),
                                 non_blocking=True)
        self.slots[count:batch.num_rows].fill_(self.scratch)
        graph.replay()
        self._decoded = size if kind == "decode" else None
        return logits[:count], self.slots[:count]

    def capture_sampling(self) -> None:
        """Capture the sampler's graph of every decode bucket for the sampler's current configuration (see
        ``Sampler.graph_key``) where it is not captured yet."""
        if self.sampler is None:
            return
        for size in self.buckets:
            logits = (self._graphs.get(("decode", size)) or self._capture("decode", size))[1]
            key = self.sampler.graph_key(logits)
            if key is not None and (size, key) not in self._sampler_graphs:
                self._capture_sampler(size, key)

    def sample_decoded(self, count: int, want_logprob: bool = False) -> SampleOutput | None:
        """Sample the ``count`` rows of the decode graph replayed last (the last step ``run`` replayed was a decode
        step) from a graph of the sampler's launches; None where the sampler cannot run from one (no sampler, a
        step that was not a decode step alone, ``Sampler.graph_key``): then sample eagerly. Its tensors are the
        graph's: the next replay of that graph overwrites them, so they are read (copied) before it, in stream
        order."""
        if self.sampler is None or self._decoded is None:
            return None
        size = self._decoded
        key = self.sampler.graph_key(self._graphs["decode", size][1], want_logprob)
        if key is None:
            return None
        captured = self._sampler_graphs.get((size, key))
        if captured is None:
            try:
                captured = self._capture_sampler(size, key)
            except RuntimeError:  # a capture that fails leaves nothing queued: sample eagerly from now on
                log.exception("capturing the sampler's graph (bucket %d, %s) failed; decode steps sample eagerly",
                              size, key)
                self.sampler = None
                return None
        graph, out = captured
        graph.replay()
        return SampleOutput(**{name: None if t is None else t[:count] for name, t in vars(out).items()})

    def _capture_sampler(self, size: int, key: tuple) -> tuple[torch.cuda.CUDAGraph, SampleOutput]:
        logits = self._graphs["decode", size][1]
        # Bias tables of another width were reallocated: graphs reading them are dead.
        for old in [k for k in self._sampler_graphs if k[1][2] not in (0, self.sampler.bias_width)]:
            del self._sampler_graphs[old]
        # The warm-up (kernels' first launches outside the capture) samples the scratch slot only: the static slot
        # ids may hold a step's rows now, whose penalties and RNG steps only the replays advance.
        self.sampler.sample(logits, torch.full((size,), self.scratch, dtype=torch.long, device=logits.device))
        graph = torch.cuda.CUDAGraph()
        # Not torch.cuda.graph, which waits for the device first: a capture launches nothing, so the steps queued
        # before it (decode ahead) keep running. It needs a stream other than the default one. Python's collector
        # stays off meanwhile (torch.cuda.graph collects before instead, which can wait): a CUDA graph it destroyed
        # during the capture (an old runner's, in a cycle) would make CUDA calls not allowed in one, ending it with
        # an error (cudaErrorStreamCaptureInvalidated, seen once in the GPU tests).
        collecting = gc.isenabled()
        gc.disable()
        try:
            with torch.cuda.stream(self._capture_stream):
                graph.capture_begin(pool=self._pool, capture_error_mode=CAPTURE_MODE)
                try:
                    out = self.sampler.sample(logits, self.slots[:size])
                finally:
                    graph.capture_end()
        finally:
            if collecting:
                gc.enable()
        self._sampler_graphs[size, key] = graph, out
        return graph, out


class ModelRunner:
    def __init__(self, model: RWKV7, num_slots: int, wkv_dtype: torch.dtype = torch.float32,
                 cuda_graphs: bool = False):
        self.model = model
        self.num_slots = num_slots
        # one extra slot pads graph batches (their padding rows also sample it); rows never own it
        self.state = model.new_state_pool(num_slots + 1, wkv_dtype)
        self.sampler = Sampler(model.config.vocab_size, num_slots + 1, model.device)
        sampler_graphs = os.environ.get("RWKV_SAMPLER_GRAPHS", "1") != "0"  # 0: decode steps sample eagerly
        self.graphs = StepGraphs(model, self.state, num_slots, num_slots,
                                 sampler=self.sampler if sampler_graphs else None) if cuda_graphs else None

    def warm_up_graphs(self) -> None:
        """Capture the decode and prompt graphs, and the sampler's decode graphs for what requests usually ask
        (greedy or sampled, with or without penalties; other configurations are captured when first met), through
        slot 0, which is left empty again. Call before any row is started."""
        if self.graphs is None:
            return
        self.graphs.warmup()
        for temperature in (0.0, 1.0):
            for presence in (0.0, 0.5):
                self.start_row(0, SamplingParams(temperature=temperature, alpha_presence=presence))
                self.graphs.capture_sampling()
                self.end_row(0)
        self.state.reset([0])

    def warm_up_prompts(self, lengths: Sequence[int]) -> None:
        """Run a prompt step of each length in ``lengths`` (one row, sampled), then one mixed step (a decoding row
        and a prompt row), through slots 0 and 1, which are left empty again: the first forward of a shape loads
        what the first request would otherwise wait for (kernel modules the CUDA driver loads lazily, cuBLAS's
        choice of kernel for the shape, the sampler's kernels: 15-25 ms of a 7.2B model's first TTFT on an H200).
        Call before any row is started."""
        warm = SamplingParams(temperature=1.0, top_p=0.9)
        slots = list(range(min(2, self.num_slots)))
        for slot in slots:
            self.start_row(slot, warm)
        for n in lengths:
            self.step([[0] * n], slots[:1], [True])
        if len(slots) == 2:  # the prompt row first: an eager step with graphs on too (the graphs warmed at capture)
            self.step([[0] * min(lengths, default=1), [0]], slots, [True, True])
        for slot in slots:
            self.end_row(slot)
            self.state.reset([slot])

    def implementations(self) -> dict[str, str]:
        return {**self.model.implementations(), "sampler": getattr(self.sampler, "name", "torch"),
                "state": f"{self.num_slots} slots, wkv {str(self.state.wkv.dtype).removeprefix('torch.')}",
                "decode": f"CUDA graphs{' with the sampler' if self.graphs.sampler else ''}, buckets "
                          f"{self.graphs.buckets}; one-row prompts of 2-"
                          f"{self.graphs.prompt_lengths[-1]} tokens too, alone or beside decoding rows"
                          if self.graphs else "eager"}

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

    def step(self, rows: Sequence[Sequence[int]], slots: Sequence[int], sample: Sequence[bool],
             want_logprobs: bool = False, score: dict[int, tuple[Sequence[int], int]] | None = None,
             on_launched: Callable[[], None] | None = None) -> StepOutput:
        """Feed each row its tokens; sample the next token for rows with ``sample[i]``.

        ``score`` maps a row position to (targets, top_n): the log-probability of ``targets[j]``
        given the row's tokens up to position j (raw model distribution), for prompt logprobs.
        ``on_launched`` is called once, when the host may hand the previous step's events to the
        event loop without slowing this step down: after the decode graph and the sampler are
        queued (the device is busy for the whole forward, the host only waits), or, for an eager
        forward (long to launch, or run by the host on the CPU), before it starts.
        """
        return self.launch(rows, slots, sample, want_logprobs, score, on_launched).result()

    def launch(self, rows: Sequence[Sequence[int]], slots: Sequence[int], sample: Sequence[bool],
               want_logprobs: bool = False, score: dict[int, tuple[Sequence[int], int]] | None = None,
               on_launched: Callable[[], None] | None = None) -> LaunchedStep:
        """``step`` without reading its results: they come from ``LaunchedStep.result``."""
        graphed = self.graphs is not None and not score and self.graphs.covers(rows)
        if on_launched is not None and not graphed:
            on_launched()
            on_launched = None
        if graphed:
            logits, slot_ids = self.graphs.run(rows, slots)
        else:
            batch = PackedBatch.from_rows(rows, slots, self.model.device)
            logits = self.model.forward(batch, self.state, all_logits=bool(score))
            slot_ids = batch.slots
        scores = {}
        if score:
            all_logits, logits = logits, logits[batch.last]
            starts = [0]
            for n in batch.lens[:-1]:
                starts.append(starts[-1] + n)
            for i, (targets, top_n) in score.items():
                scores[i] = self._score(all_logits[starts[i]:starts[i] + len(targets)], targets, top_n)
        picked = [i for i, s in enumerate(sample) if s]
        sampled = None
        if graphed and len(picked) == len(rows):
            sampled = self.graphs.sample_decoded(len(rows), want_logprobs)
        if picked and sampled is None:
            if len(picked) < len(rows):
                index = to_device(picked, logits.device)
                logits, slot_ids = logits[index], slot_ids[index]
            sampled = self.sampler.sample(logits, slot_ids, want_logprob=want_logprobs)
        if on_launched is not None:
            on_launched()
        return LaunchedStep(list(slots), sampled, want_logprobs, scores)

    def launch_next(self, step: LaunchedStep) -> LaunchedStep:
        """The decode step that feeds every row of ``step`` the token ``step`` sampled for it, queued
        before the host has read those tokens (``step`` is a step in which every row sampled): the
        device computes it while the host handles ``step``'s results. The same results as the
        next ``step`` call of those rows would give."""
        if step.sampled is None or len(step.sampled.tokens) != len(step.slots):
            raise ValueError("launch_next follows a step in which every row sampled")
        tokens = step.sampled.tokens
        if self.graphs is not None:
            logits, slot_ids = self.graphs.run(tokens, step.slots)
            sampled = self.graphs.sample_decoded(len(step.slots), step.want_logprobs)
            if sampled is not None:
                return LaunchedStep(list(step.slots), sampled, step.want_logprobs)
        else:
            device = self.model.device
            batch = PackedBatch.decode(tokens, to_device(step.slots, device),
                                       torch.arange(len(step.slots), dtype=torch.long, device=device))
            logits = self.model.forward(batch, self.state)
            slot_ids = batch.slots
        sampled = self.sampler.sample(logits, slot_ids, want_logprob=step.want_logprobs)
        return LaunchedStep(list(step.slots), sampled, step.want_logprobs)

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
