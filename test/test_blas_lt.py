"""GemmTuner (infer/ops/blas_lt.py) on the CPU, with a stand-in for cuBLASLt and for the GPU timer: which candidate it
keeps, what it rejects, when it tunes, and that tuning leaves the caller's output alone. The real library and timer
run on a GPU (bench/experiment_blas_algos.py, the blas-ab part of bench/h200_pending.sh)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from infer.ops import blas_lt
from infer.ops.blas_lt import GemmShape, GemmTuner
from infer.ops.fused import torch_matmul

SHAPE = GemmShape(16, 24, 32, accumulate=True)


class FakePlan:
    """Algorithms that behave as `kinds` say: "right" (the product), "wrong" (off by far more than rounding),
    "flaky" (a different rounding each run), "fails" (a cuBLAS error)."""

    def __init__(self, shape: GemmShape, kinds: list[str]):
        self.shape, self.kinds = shape, kinds
        self.algos = [SimpleNamespace(algo=i) for i in range(len(kinds))]
        self.ran: list[int] = []
        self.last: int | None = None
        self._flaky = 0

    def run(self, index: int, w, x, y) -> None:
        self.ran.append(index)
        self.last = index
        kind = self.kinds[index]
        if kind == "fails":
            raise RuntimeError("cublasLtMatmul: cuBLAS status 15")
        product = (x.float() @ (w.float().t() if self.shape.layout == "nk" else w.float()))
        if kind == "wrong":
            product = product + 1.0
        elif kind == "flaky":
            self._flaky += 1
            product = product + 1e-3 * self._flaky
        y.copy_((y.float() if self.shape.accumulate else 0) + product)


class FakeLt:
    def __init__(self, kinds: list[str], fail: bool = False):
        self.kinds, self.fail = kinds, fail
        self.plans: list[FakePlan] = []

    def __call__(self, device):  # the tuner makes its library with the device
        return self

    def plan(self, problem, max_algos):
        if self.fail:
            raise RuntimeError("cublasLtMatmulAlgoGetHeuristic: cuBLAS status 15")
        shape = GemmShape(problem.n, problem.m, problem.k,
                          "nk" if problem.trans_a == blas_lt.CUBLAS_OP_T else "kn", problem.batch, bool(problem.beta))
        self.plans.append(FakePlan(shape, self.kinds[:max_algos]))
        return self.plans[-1]

    def config(self, algo):
        return {"tile": algo}


def fake_timer(lt: FakeLt, seconds: dict):
    """A timer that runs the candidate once and reports seconds[index] for algorithm `index`, seconds["torch"] for
    torch's call (the last plan's last run tells which ran)."""
    def make(device, reps):
        def timed(product, out):
            plan = lt.plans[-1] if lt.plans else None
            before = len(plan.ran) if plan else 0
            product(out)
            ran = plan is not None and len(plan.ran) > before
            return seconds[plan.last] if ran else seconds["torch"]
        return timed
    return make


def operands(seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(SHAPE.n, SHAPE.k, generator=gen).half()
    x = torch.randn(SHAPE.rows, SHAPE.k, generator=gen).half()
    y = torch.randn(SHAPE.rows, SHAPE.n, generator=gen).half()
    return w, x, y


def torch_call(w, x, y):
    torch_matmul(w, x, y, "nk", add=True)


def tuner(kinds, seconds, capturing=lambda: False, fail=False, rows=(16,), margin=0.03) -> tuple[GemmTuner, FakeLt]:
    lt = FakeLt(kinds, fail)
    return GemmTuner(rows, lt=lt, timer=fake_timer(lt, seconds), capture_check=capturing, margin=margin), lt


def test_keeps_the_fastest_algorithm_that_gives_torchs_result():
    t, lt = tuner(["right", "right", "right"], {"torch": 10e-6, 0: 9e-6, 1: 6e-6, 2: 8e-6})
    w, x, y = operands()
    want = y.clone()
    torch_call(w, x, want)
    got = y.clone()
    t.run(SHAPE, torch_call, w, x, got)
    plan, index = t.choices[SHAPE]
    assert index == 1 and plan is lt.plans[0]
    assert float((got.float() - want.float()).abs().max()) <= 1e-2 * float(want.float().abs().max())
    assert t.report[SHAPE]["best_us"] == 6.0 and t.report[SHAPE]["torch_us"] == 10.0
    assert t.describe(16) == {"16x24x32 nk +": {**t.report[SHAPE], "chosen": "cublaslt"}} and t.describe(8) == {}
    # later calls run the choice, once each, with no tuning
    plan.ran.clear()
    again = y.clone()
    t.run(SHAPE, torch_call, w, x, again)
    assert plan.ran == [1] and len(lt.plans) == 1
    assert torch.equal(again, got)


def test_tuning_adds_the_product_into_the_output_once():
    """The candidates run on copies: the caller's output gets one product added, whichever is chosen."""
    for seconds in ({"torch": 10e-6, 0: 5e-6}, {"torch": 5e-6, 0: 10e-6}):
        t, _ = tuner(["right"], seconds)
        w, x, y = operands(1)
        want = y.clone()
        torch_call(w, x, want)
        got = y.clone()
        t.run(SHAPE, torch_call, w, x, got)
        assert float((got.float() - want.float()).abs().max()) <= 1e-2 * float(want.float().abs().max()), seconds


def test_keeps_torch_unless_an_algorithm_is_faster_by_the_margin():
    t, lt = tuner(["right"], {"torch": 10e-6, 0: 9.8e-6})
    w, x, y = operands()
    t.run(SHAPE, torch_call, w, x, y.clone())
    assert t.choices[SHAPE] is None and t.describe()["16x24x32 nk +"]["chosen"] == "torch"
    lt.plans[0].ran.clear()
    t.run(SHAPE, torch_call, w, x, y.clone())
    assert lt.plans[0].ran == []  # torch's call, no algorithm


def test_rejects_wrong_nondeterministic_and_failing_algorithms():
    t, _ = tuner(["wrong", "flaky", "fails", "right"], {"torch": 10e-6, 0: 1e-6, 1: 1e-6, 2: 1e-6, 3: 8e-6})
    w, x, y = operands()
    t.run(SHAPE, torch_call, w, x, y.clone())
    assert t.choices[SHAPE][1] == 3
    assert t.report[SHAPE]["algos"] == 4 and t.report[SHAPE]["rejected"] == 3
    t, _ = tuner(["wrong", "flaky", "fails"], {"torch": 10e-6, 0: 1e-6, 1: 1e-6, 2: 1e-6})
    t.run(SHAPE, torch_call, w, x, y.clone())
    assert t.choices[SHAPE] is None and "best_us" not in t.report[SHAPE]


def test_no_tuning_while_a_graph_is_captured_or_for_other_shapes():
    capturing = [True]
    t, lt = tuner(["right"], {"torch": 10e-6, 0: 1e-6}, capturing=lambda: capturing[0])
    w, x, y = operands()
    t.run(SHAPE, torch_call, w, x, y.clone())  # captured: torch's call, nothing timed, nothing decided
    assert not lt.plans and SHAPE not in t.choices
    capturing[0] = False
    other_rows = GemmShape(17, SHAPE.n, SHAPE.k, accumulate=True)  # a prompt of 17 tokens: not a tuned row count
    t.run(other_rows, torch_call, w, x.new_zeros(17, SHAPE.k), y.new_zeros(17, SHAPE.n))
    assert not lt.plans and other_rows not in t.choices
    t.run(SHAPE, torch_call, w.float(), x.float(), y.float())  # not fp16: torch's call
    t.run(SHAPE, torch_call, w, x, y.t().contiguous().t())  # not contiguous
    assert not lt.plans and SHAPE not in t.choices
    t.run(SHAPE, torch_call, w, x, y.clone())
    assert t.choices[SHAPE][1] == 0


def test_a_problem_without_algorithms_keeps_torch():
    t, _ = tuner(["right"], {"torch": 10e-6}, fail=True)
    w, x, y = operands()
    got = y.clone()
    t.run(SHAPE, torch_call, w, x, got)
    assert t.choices[SHAPE] is None and "status 15" in t.report[SHAPE]["error"]
    want = y.clone()
    torch_call(w, x, want)
    assert torch.equal(got, want)


def test_a_missing_library_keeps_torch_and_stops_tuning():
    def no_library(device):
        raise OSError("libcublasLt.so.13: cannot open shared object file")
    t = GemmTuner((16,), lt=no_library, timer=fake_timer(FakeLt([]), {"torch": 1e-6}), capture_check=lambda: False)
    w, x, y = operands()
    got, want = y.clone(), y.clone()
    t.run(SHAPE, torch_call, w, x, got)
    torch_call(w, x, want)
    assert torch.equal(got, want) and t.choices[SHAPE] is None and "unavailable" in t.report[SHAPE]["error"]
    other = GemmShape(16, SHAPE.k, SHAPE.k, accumulate=True)
    t.run(other, torch_call, w.new_zeros(SHAPE.k, SHAPE.k), x, x.clone())
    assert other not in t.choices  # no further attempts


def test_tuned_rows_are_the_decode_graph_buckets_above_the_gemv():
    from infer.runner import GRAPH_BUCKETS
    assert set(blas_lt.TUNED_ROWS) == {b for b in GRAPH_BUCKETS if b > 2}


@pytest.mark.parametrize("layout", ["nk", "kn"])
def test_fits_checks_the_operands_against_the_shape(layout):
    shape = GemmShape(4, 6, 8, layout)
    w = torch.zeros((6, 8) if layout == "nk" else (8, 6), dtype=torch.float16)
    x, y = torch.zeros(4, 8, dtype=torch.float16), torch.zeros(4, 6, dtype=torch.float16)
    assert blas_lt._fits(shape, w, x, y)
    assert not blas_lt._fits(shape, w.t(), x, y)
    assert not blas_lt._fits(GemmShape(4, 6, 8, layout, batch=3), w, x, y)
