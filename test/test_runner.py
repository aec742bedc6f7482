"""ModelRunner's CUDA-graph bookkeeping that can be checked without a GPU (test_graphs_cuda.py runs the real
captures)."""
from __future__ import annotations

import contextlib
import gc
from types import SimpleNamespace

import pytest
import torch

from infer.runner import StepGraphs


class FakeGraph:
    """torch.cuda.CUDAGraph's capture calls, doing nothing."""

    def capture_begin(self, pool=None, capture_error_mode=None) -> None:
        pass

    def capture_end(self) -> None:
        pass


@pytest.mark.parametrize("fails", [False, True])
@pytest.mark.parametrize("enabled", [True, False])
def test_sampler_capture_runs_with_the_collector_off(enabled, fails, monkeypatch):
    """Python's cyclic collector is off while a sampler graph is captured (a CUDA graph it destroyed then would end
    the capture with an error) and back as it was afterwards, also when the capture fails."""
    seen = []

    def sample(_logits, slots):
        seen.append(gc.isenabled())
        if fails and len(seen) == 2:  # the eager warm-up first, then the captured call
            raise RuntimeError("capture failed")
        return SimpleNamespace(tokens=slots)

    monkeypatch.setattr(torch.cuda, "CUDAGraph", FakeGraph)
    monkeypatch.setattr(torch.cuda, "stream", lambda _stream: contextlib.nullcontext())
    graphs = SimpleNamespace(_graphs={("decode", 2): (None, torch.zeros(2, 8), None)}, _sampler_graphs={},
                             sampler=SimpleNamespace(sample=sample, bias_width=0), scratch=7,
                             slots=torch.arange(4), _capture_stream=None, _pool=None)
    (gc.enable if enabled else gc.disable)()
    try:
        with pytest.raises(RuntimeError) if fails else contextlib.nullcontext():
            StepGraphs._capture_sampler(graphs, 2, (True, False, 0))
        assert seen == [enabled, False]  # the warm-up as the caller had it, the capture without the collector
        assert gc.isenabled() == enabled
        assert (2, (True, False, 0)) in graphs._sampler_graphs or fails
    finally:
        gc.enable()
