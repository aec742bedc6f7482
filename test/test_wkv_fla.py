"""FlaWKV (infer/ops/wkv_fla.py): fla-core's chunked chunk_rwkv7 behind our WKV contract.

Three layers of tests:
- everywhere (no fla needed): the adapter with a pure-torch stand-in for fla's function that
  checks fla's calling convention strictly and runs the recurrence in fla's [K, V] state layout:
  gather/transpose/scatter, cu_seqlens, log decay, dtypes, loading without CUDA or without fla;
- CPU with fla-core + triton installed: fla's real Triton kernels under Triton's interpreter, in a
  subprocess (test/fla_interpret.py), against TorchWKV;
- CUDA with fla-core: the compiled kernels against TorchWKV, and inside a small model.
"""
from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from infer.batch import PackedBatch
from infer.ops import wkv_fla
from infer.ops.wkv import TorchWKV
from infer.ops.wkv_fla import (LOG_DECAY_FLOOR, FlaWKV, SplitWKV, cu_seqlens_of, fla_wkv_error, load_fla_wkv,
                               log_decay)

ROOT = Path(__file__).resolve().parent.parent
N = 64
HAS_FLA = importlib.util.find_spec("fla") is not None and importlib.util.find_spec("triton") is not None
needs_cuda_fla = pytest.mark.skipif(not (torch.cuda.is_available() and HAS_FLA),
                                    reason="needs a CUDA device and fla-core")


# --------------------------------------------------------------------------- a stand-in for fla
class ReferenceChunk:
    """fla's ``chunk_rwkv7`` contract in plain torch (fp64 math, state [N, H, K, V]); asserts the
    calling convention FlaWKV must follow and records every call."""

    def __init__(self):
        self.calls: list[dict] = []

    def __call__(self, r, w, k, v, a, b, scale=1.0, initial_state=None, output_final_state=False,
                 cu_seqlens=None, cu_seqlens_cpu=None, safe_gate=False, chunk_size=None,
                 disable_recompute=False, cp_context=None, lower_bound=None):
        B, T, H, K = r.shape
        assert B == 1 and cu_seqlens is not None, "varlen rows go packed with batch 1"
        for t in (w, k, v, a, b):
            assert t.shape == (1, T, H, K)
        assert all(t.dtype == r.dtype for t in (k, v, a, b)) and w.dtype == torch.float32
        assert scale == 1.0 and output_final_state and not safe_gate and cp_context is None
        assert bool((w <= 0).all()), "w is a log decay"
        if lower_bound is not None:
            assert bool((w >= lower_bound).all())
        assert cu_seqlens.dtype == torch.int32 and cu_seqlens.device == r.device
        assert cu_seqlens_cpu.device.type == "cpu" and torch.equal(cu_seqlens_cpu, cu_seqlens.cpu())
        cu = cu_seqlens_cpu.tolist()
        assert cu[0] == 0 and cu[-1] == T and all(x <= y for x, y in zip(cu, cu[1:]))
        assert initial_state.shape == (len(cu) - 1, H, K, K) and initial_state.is_contiguous()
        self.calls.append(dict(r=r, w=w, k=k, v=v, a=a, b=b, h0=initial_state.clone(), cu=cu_seqlens,
                               cu_cpu=cu_seqlens_cpu, chunk_size=chunk_size, lower_bound=lower_bound))
        q, g, kk, vv, aa, bb = (t[0].double() for t in (r, w, k, v, a, b))
        o = torch.empty(T, H, K, dtype=torch.float64, device=r.device)
        ht = torch.empty(len(cu) - 1, H, K, K, dtype=torch.float32, device=r.device)
        for n in range(len(cu) - 1):
            S = initial_state[n].double()                              # [H, K, V]
            for t in range(cu[n], cu[n + 1]):
                sa = torch.einsum("hk,hkv->hv", aa[t], S)
                S = g[t].exp()[:, :, None] * S + bb[t][:, :, None] * sa[:, None, :] \
                    + kk[t][:, :, None] * vv[t][:, None, :]
                o[t] = torch.einsum("hk,hkv->hv", q[t], S)
            ht[n] = S.float()
        return o.unsqueeze(0).to(r.dtype), ht


def make_inputs(T: int, H: int, act: torch.dtype, seed: int, device="cpu", w_low: float = 0.545):
    """The model's value ranges: w in (0.545, 1), a = -kk, b = kk * gate, kk unit-norm per head."""
    gen = torch.Generator(device=device).manual_seed(seed)
    C = H * N
    r, k, v = (torch.randn(T, C, generator=gen, device=device) for _ in range(3))
    w = w_low + (1 - w_low) * torch.rand(T, C, generator=gen, device=device)
    kk = F.normalize(torch.randn(T, H, N, generator=gen, device=device), dim=-1).view(T, C)
    gate = torch.rand(T, C, generator=gen, device=device)
    return r.to(act), w, k.to(act), v.to(act), (-kk).to(act), (kk * gate).to(act)


def random_pool(num_slots: int, H: int, dtype: torch.dtype, seed: int, device="cpu") -> torch.Tensor:
    gen = torch.Generator(device=device).manual_seed(seed)
    return (torch.randn(num_slots, H, N, N, generator=gen, device=device) * 0.3).to(dtype)


def rel(got: torch.Tensor, want: torch.Tensor) -> float:
    """max |got - want| / max |want|."""
    return ((got.float() - want.float()).abs().max() / want.float().abs().max()).item()


LENS = [5, 1, 17, 3, 64, 2, 16, 65]
SLOTS = [7, 2, 9, 0, 4, 11, 12, 5]               # unordered, with gaps; 1, 3, 6, 8, 10 stay untouched


# --------------------------------------------------------------------------- adapter (any machine)
@pytest.mark.parametrize("chunk_size", [64, 16])
@pytest.mark.parametrize("state_dtype", [torch.float32, torch.float16], ids=["state32", "state16"])
@pytest.mark.parametrize("act", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_adapter_matches_reference(chunk_size, state_dtype, act):
    H = 2
    batch = PackedBatch.from_rows([[0] * n for n in LENS], SLOTS, "cpu")
    pool = random_pool(13, H, state_dtype, seed=1)
    inputs = make_inputs(sum(LENS), H, act, seed=2)
    ref_pool, got_pool = pool.clone(), pool.clone()
    ref_y = TorchWKV()(ref_pool, batch, *inputs)
    fake = ReferenceChunk()
    got_y = FlaWKV(chunk_size=chunk_size, chunk_fn=fake)(got_pool, batch, *inputs)
    assert got_y.dtype == torch.float32 and got_y.shape == ref_y.shape
    # fp16 activations: y is rounded to fp16 once (as fla returns it in the input dtype)
    assert rel(got_y, ref_y) <= (1e-6 if act == torch.float32 else 1e-3)
    assert rel(got_pool[SLOTS], ref_pool[SLOTS]) <= (1e-6 if state_dtype == torch.float32 else 1e-3)
    untouched = [s for s in range(13) if s not in SLOTS]
    assert torch.equal(got_pool[untouched], pool[untouched]), "a slot outside the batch changed"
    assert len(fake.calls) == 1 and fake.calls[0]["r"].dtype == act


def test_adapter_hands_fla_its_layout():
    H = 3
    batch = PackedBatch.from_rows([[0] * n for n in LENS], SLOTS, "cpu")
    pool = random_pool(13, H, torch.float32, seed=3)
    inputs = make_inputs(sum(LENS), H, torch.float16, seed=4)
    fake = ReferenceChunk()
    FlaWKV(chunk_size=64, chunk_fn=fake)(pool.clone(), batch, *inputs)
    call = fake.calls[0]
    T = sum(LENS)
    assert call["cu_cpu"].tolist() == [0] + [sum(LENS[:i + 1]) for i in range(len(LENS))]
    assert call["cu"].dtype == torch.int32
    # initial states: the batch's slots in row order, transposed to [K, V]
    assert torch.equal(call["h0"], pool[SLOTS].transpose(-1, -2))
    # tensors [1, T, H, K], activations keep their dtype, the decay is log(w) in fp32
    r, w = inputs[0], inputs[1]
    assert torch.equal(call["r"], r.view(1, T, H, N))
    assert torch.equal(call["w"], torch.log(w).view(1, T, H, N))
    assert call["chunk_size"] == 64 and call["lower_bound"] == LOG_DECAY_FLOOR
    FlaWKV(chunk_size=16, chunk_fn=fake)(pool.clone(), batch, *inputs)
    assert fake.calls[1]["chunk_size"] == 16 and fake.calls[1]["lower_bound"] is None


def test_final_state_is_transposed_back_in_pool_dtype():
    H, lens, slots = 2, [3, 4], [2, 0]
    ht = torch.randn(2, H, N, N)

    def fixed(r, w, k, v, a, b, **kw):
        return torch.zeros_like(r), ht.clone()

    for dtype in (torch.float32, torch.float16):
        pool = torch.zeros(3, H, N, N, dtype=dtype)
        batch = PackedBatch.from_rows([[0] * n for n in lens], slots, "cpu")
        FlaWKV(chunk_fn=fixed)(pool, batch, *make_inputs(7, H, torch.float32, seed=5))
        assert torch.equal(pool[2], ht[0].transpose(-1, -2).to(dtype))
        assert torch.equal(pool[0], ht[1].transpose(-1, -2).to(dtype))
        assert not pool[1].any()


def test_log_decay():
    w = torch.tensor([1.0, 0.9, 0.545, 0.1, 1e-3, 0.0])
    g = log_decay(w)
    assert g.dtype == torch.float32 and bool(torch.isfinite(g).all())
    assert torch.equal(g[:4], torch.log(w[:4]))
    assert g[4].item() == g[5].item() == LOG_DECAY_FLOOR
    assert g[0].item() == 0.0
    assert math.exp(LOG_DECAY_FLOOR) < math.exp(-math.exp(-0.5)), "RWKV-7's decays are never floored"
    assert log_decay(torch.tensor([0.7], dtype=torch.float16)).dtype == torch.float32


def test_cu_seqlens():
    cu, host = cu_seqlens_of([5, 1, 17], "cpu")
    assert host.tolist() == [0, 5, 6, 23] and cu.dtype == host.dtype == torch.int32


def test_cu_seqlens_are_reused_across_layers_of_one_batch():
    """The model calls the WKV once per layer with the same batch; fla caches its chunk indices
    by the identity of cu_seqlens, so the same tensors must come back."""
    H = 2
    fake = ReferenceChunk()
    wkv = FlaWKV(chunk_fn=fake)
    batch = PackedBatch.from_rows([[0] * 3, [0] * 2], [0, 1], "cpu")
    pool = random_pool(2, H, torch.float32, seed=6)
    for _ in range(3):
        wkv(pool, batch, *make_inputs(5, H, torch.float32, seed=7))
    assert fake.calls[0]["cu"] is fake.calls[1]["cu"] is fake.calls[2]["cu"]
    other = PackedBatch.from_rows([[0] * 4, [0] * 1], [0, 1], "cpu")
    wkv(pool, other, *make_inputs(5, H, torch.float32, seed=8))
    assert fake.calls[3]["cu_cpu"].tolist() == [0, 4, 5]


def test_chunked_calls_continue_the_state():
    """Prefill in two calls (the engine's --prefill-chunk-size) = one call."""
    H, lens = 2, [40, 9]
    inputs = make_inputs(sum(lens) * 2, H, torch.float32, seed=9)
    first = [t[:49] for t in inputs]
    second = [t[49:] for t in inputs]
    pool = random_pool(2, H, torch.float32, seed=10)
    wkv = FlaWKV(chunk_fn=ReferenceChunk())
    split_pool, whole_pool = pool.clone(), pool.clone()
    b1 = PackedBatch.from_rows([[0] * n for n in lens], [1, 0], "cpu")
    y1 = wkv(split_pool, b1, *first)
    y2 = wkv(split_pool, b1, *second)
    # the same tokens as one call per row: row 0 = its two halves, row 1 likewise
    idx0 = list(range(0, 40)) + list(range(49, 89))
    idx1 = list(range(40, 49)) + list(range(89, 98))
    whole = [torch.cat([t[idx0], t[idx1]]) for t in inputs]
    yw = wkv(whole_pool, PackedBatch.from_rows([[0] * 80, [0] * 18], [1, 0], "cpu"), *whole)
    y_split = torch.cat([y1, y2])[idx0 + idx1]
    assert rel(y_split, yw) <= 1e-6 and rel(split_pool, whole_pool) <= 1e-6


def test_pool_view_of_one_layer():
    """The model passes ``StatePool.wkv[layer]``, a view into [L, S, H, N, N]."""
    L, S, H = 3, 5, 2
    full = torch.randn(L, S, H, N, N) * 0.3
    before = full.clone()
    batch = PackedBatch.from_rows([[0] * 4, [0] * 2], [4, 1], "cpu")
    inputs = make_inputs(6, H, torch.float32, seed=11)
    ref_layer = full[1].clone()
    ref_y = TorchWKV()(ref_layer, batch, *inputs)
    got_y = FlaWKV(chunk_fn=ReferenceChunk())(full[1], batch, *inputs)
    assert rel(got_y, ref_y) <= 1e-6 and rel(full[1], ref_layer) <= 1e-6
    assert torch.equal(full[0], before[0]) and torch.equal(full[2], before[2])


def test_compute_dtype():
    H = 1
    batch = PackedBatch.from_rows([[0] * 3], [0], "cpu")
    pool = random_pool(1, H, torch.float32, seed=12)
    r, w, k, v, a, b = make_inputs(3, H, torch.float16, seed=13)
    fake = ReferenceChunk()
    FlaWKV(chunk_fn=fake)(pool.clone(), batch, r.float(), w, k, v, a, b)          # mixed -> fp32
    FlaWKV(chunk_fn=fake)(pool.clone(), batch, r, w, k, v, a, b)                  # fp16 stays
    FlaWKV(chunk_fn=fake, compute_dtype=torch.bfloat16)(pool.clone(), batch, r, w, k, v, a, b)
    assert [c["r"].dtype for c in fake.calls] == [torch.float32, torch.float16, torch.bfloat16]


def test_rejects_bad_arguments():
    fake = ReferenceChunk()
    batch = PackedBatch.from_rows([[0]], [0], "cpu")
    inputs = make_inputs(1, 2, torch.float16, seed=14)
    with pytest.raises(ValueError, match="float32 or float16"):
        FlaWKV(chunk_fn=fake)(torch.zeros(1, 2, N, N, dtype=torch.bfloat16), batch, *inputs)
    with pytest.raises(ValueError, match="heads"):
        FlaWKV(chunk_fn=fake)(torch.zeros(1, 3, N, N), batch, *inputs)           # 3 heads, inputs have 2
    with pytest.raises(ValueError, match="chunk_size"):
        FlaWKV(chunk_size=8, chunk_fn=fake)
    with pytest.raises(ValueError, match="compute_dtype"):
        FlaWKV(compute_dtype=torch.int32, chunk_fn=fake)
    assert not fake.calls


def test_split_wkv_dispatches_on_the_longest_row():
    seen = []

    class Tag:
        def __init__(self, name):
            self.name = name

        def __call__(self, *args):
            seen.append(self.name)

    split = SplitWKV(Tag("short"), Tag("long"), min_len=64)
    for lens in ([1, 1, 1], [63, 1], [64], [1, 200, 3]):
        split(None, PackedBatch.from_rows([[0] * n for n in lens], list(range(len(lens))), "cpu"),
              *[None] * 6)
    assert seen == ["short", "short", "long", "long"]
    assert "below 64" in split.name


def test_importing_the_module_imports_neither_fla_nor_triton():
    code = ("import sys; import infer.ops.wkv_fla as m; "
            "assert 'fla' not in sys.modules and 'triton' not in sys.modules, sorted(sys.modules)")
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True, timeout=120)


@pytest.fixture
def fresh_loader():
    wkv_fla._loader.reset()
    yield wkv_fla._loader
    wkv_fla._loader.reset()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the fallback without a CUDA device")
def test_load_without_cuda_returns_none(fresh_loader):
    assert load_fla_wkv() is None
    assert "CUDA" in fla_wkv_error()


def test_load_reports_missing_fla(fresh_loader, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)

    def missing():
        raise ModuleNotFoundError("No module named 'fla'", name="fla")

    monkeypatch.setattr(wkv_fla, "import_chunk_rwkv7", missing)
    assert load_fla_wkv() is None
    assert "fla is not installed" in fla_wkv_error()
    assert load_fla_wkv() is None                      # remembered, not retried


def test_load_reports_import_errors(fresh_loader, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)

    def broken():
        raise RuntimeError("triton: no ptxas")

    monkeypatch.setattr(wkv_fla, "import_chunk_rwkv7", broken)
    assert load_fla_wkv() is None
    assert "importing fla-core failed: RuntimeError: triton: no ptxas" in fla_wkv_error()


def test_load_reports_a_failed_self_test(fresh_loader, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(wkv_fla, "import_chunk_rwkv7", lambda: ReferenceChunk())
    monkeypatch.setattr(wkv_fla, "_self_test", lambda wkv, heads, dtype: "self-test failed: 1.0")
    assert load_fla_wkv() is None and fla_wkv_error() == "self-test failed: 1.0"
    fresh_loader.reset()

    def raises(wkv, heads, dtype):
        raise RuntimeError("boom")

    monkeypatch.setattr(wkv_fla, "_self_test", raises)
    assert load_fla_wkv() is None and "self-test raised RuntimeError: boom" in fla_wkv_error()


# --------------------------------------------------------------------------- fla's kernels on CPU (interpreter)
@pytest.mark.skipif(not HAS_FLA, reason="needs fla-core and triton (pip install --no-deps fla-core==0.6.0 einops triton)")
@pytest.mark.skipif(torch.cuda.is_available(), reason="the CUDA tests below run the compiled kernels")
def test_fla_kernels_under_the_triton_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1", FLA_CACHE_RESULTS="0")
    proc = subprocess.run([sys.executable, str(ROOT / "test" / "fla_interpret.py")], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    results = {r["case"]: r for r in json.loads(proc.stdout.strip().splitlines()[-1])}
    # Seen here (Triton 3.9 interpreter, numpy fp32 dots): chunk 16 ~2e-7, chunk 64 ~6e-6 (its
    # tensor-core path inverts in fp16 steps), fp16 state pool ~2e-4 (one rounding), fp16 ~5e-4.
    limits = {"fp32-chunk64": 1e-4, "fp32-chunk16": 1e-5, "fp32-chunk64-state16": 1e-4,
              "fp16-chunk64": 3e-3, "fp32-chunk64-onerow": 1e-4, "fp32-chunk64-strongdecay": 1e-4,
              "fp32-chunk16-strongdecay": 1e-5}
    assert set(results) == set(limits)
    for name, limit in limits.items():
        res = results[name]
        state_limit = 1e-3 if name.endswith("state16") else limit
        assert res["finite"] and res["untouched_equal"], res
        assert res["y_dtype"] == "torch.float32", res
        assert res["y_rel"] <= limit and res["state_rel"] <= state_limit, res


# --------------------------------------------------------------------------- compiled kernels (CUDA)
# Tolerances, relative to the reference's max |value|: TorchWKV is fp32; fla rounds y and its
# per-chunk states to the compute dtype and runs fp32 dots (incl. the log-decay cumsum) in TF32.
CUDA_TOL = {torch.float16: 1e-2, torch.float32: 1e-2, torch.bfloat16: 4e-2}


@pytest.fixture(scope="module")
def fla_loaded() -> FlaWKV:
    wkv = load_fla_wkv(heads=4)
    if wkv is None:
        pytest.fail(f"fla-core WKV did not load on a CUDA machine: {fla_wkv_error()}")
    return wkv


@needs_cuda_fla
def test_cuda_load(fla_loaded):
    assert isinstance(fla_loaded, FlaWKV) and fla_wkv_error() is None


@needs_cuda_fla
@pytest.mark.parametrize("state_dtype", [torch.float32, torch.float16], ids=["state32", "state16"])
@pytest.mark.parametrize("act,chunk_size", [(torch.float16, 64), (torch.float16, 16), (torch.float32, 64),
                                            (torch.bfloat16, 64)], ids=["fp16-c64", "fp16-c16", "fp32-c64", "bf16-c64"])
def test_cuda_matches_reference(fla_loaded, act, chunk_size, state_dtype):
    H = 4
    lens = LENS + [200, 129]
    slots = SLOTS + [13, 14]
    batch = PackedBatch.from_rows([[0] * n for n in lens], slots, "cuda")
    pool = random_pool(16, H, state_dtype, seed=21, device="cuda")
    inputs = make_inputs(sum(lens), H, act, seed=22, device="cuda")
    ref_pool, got_pool = pool.clone(), pool.clone()
    ref_y = TorchWKV()(ref_pool, batch, *inputs)
    got_y = FlaWKV(chunk_size=chunk_size)(got_pool, batch, *inputs)
    torch.cuda.synchronize()
    err_y, err_s = rel(got_y, ref_y), rel(got_pool[slots], ref_pool[slots])
    print(f"\n{act} chunk {chunk_size} {state_dtype}: y {err_y:.2e}, state {err_s:.2e}")
    assert got_y.dtype == torch.float32
    assert err_y <= CUDA_TOL[act] and err_s <= CUDA_TOL[act]
    untouched = [s for s in range(16) if s not in slots]
    assert torch.equal(got_pool[untouched], pool[untouched])


@needs_cuda_fla
@pytest.mark.parametrize("lens", [[4096], [1024, 1024, 1000, 1]], ids=["1x4096", "4x~1024"])
def test_cuda_long_rows(fla_loaded, lens):
    H = 4
    slots = list(range(len(lens)))
    batch = PackedBatch.from_rows([[0] * n for n in lens], slots, "cuda")
    pool = random_pool(len(lens), H, torch.float32, seed=23, device="cuda")
    inputs = make_inputs(sum(lens), H, torch.float16, seed=24, device="cuda")
    ref_pool, got_pool = pool.clone(), pool.clone()
    ref_y = TorchWKV()(ref_pool, batch, *inputs)
    got_y = fla_loaded(got_pool, batch, *inputs)
    torch.cuda.synchronize()
    err_y, err_s = rel(got_y, ref_y), rel(got_pool, ref_pool)
    print(f"\nlong rows {lens}: y {err_y:.2e}, state {err_s:.2e}")
    assert err_y <= CUDA_TOL[torch.float16] and err_s <= CUDA_TOL[torch.float16]


@needs_cuda_fla
def test_cuda_pool_view_and_inference_mode(fla_loaded):
    L, S, H = 3, 5, 2
    full = torch.randn(L, S, H, N, N, device="cuda") * 0.3
    before = full.clone()
    batch = PackedBatch.from_rows([[0] * 70, [0] * 2], [4, 1], "cuda")
    inputs = make_inputs(72, H, torch.float16, seed=25, device="cuda")
    ref_layer = full[1].clone()
    ref_y = TorchWKV()(ref_layer, batch, *inputs)
    with torch.inference_mode():
        got_y = fla_loaded(full[1], batch, *inputs)
    torch.cuda.synchronize()
    assert rel(got_y, ref_y) <= CUDA_TOL[torch.float16] and rel(full[1], ref_layer) <= CUDA_TOL[torch.float16]
    assert torch.equal(full[0], before[0]) and torch.equal(full[2], before[2])


@needs_cuda_fla
def test_cuda_model_prefill_with_fla(fla_loaded):
    """A small random model in fp16: logits with FlaWKV vs with the torch reference WKV."""
    from infer.model import RWKV7
    from infer.random_model import make_config, random_state_dict

    sd = random_state_dict(make_config(2, 256, 1024), seed=31, dtype=torch.float32)
    model = RWKV7.from_state_dict(sd, device="cuda", dtype="fp16")
    forward = getattr(model, "forward_reference", model.forward)     # the path that calls model.wkv
    g = torch.Generator().manual_seed(2)
    rows = [torch.randint(1, 1000, (n,), generator=g).tolist() for n in (300, 1, 77)]
    logits = {}
    for name, wkv in (("torch", TorchWKV()), ("fla", fla_loaded)):
        model.wkv = wkv
        pool = model.new_state_pool(3)
        logits[name] = forward(PackedBatch.from_rows(rows, [2, 0, 1], "cuda"), pool, all_logits=True).float()
    diff = (logits["fla"] - logits["torch"]).abs().max().item()
    scale = logits["torch"].abs().max().item()
    print(f"\nmodel logits: max |diff| {diff:.3g} of max |logit| {scale:.3g}")
    assert diff <= 2e-2 * scale


def test_cuda_select_fla_splits_by_row_length():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from infer.ops.wkv_cuda import CudaWKV, LONG_ROW, select_wkv
    from infer.ops.wkv_fla import SplitWKV, load_fla_wkv
    if load_fla_wkv(heads=2) is None:
        pytest.skip("fla-core unavailable")
    chosen = select_wkv("cuda", "fla", heads=2)
    assert isinstance(chosen, SplitWKV) and isinstance(chosen.short, CudaWKV) and chosen.min_len == LONG_ROW
    assert isinstance(select_wkv("cuda", "auto", heads=2), CudaWKV)  # fla stays opt-in
