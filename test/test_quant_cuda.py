"""Quantized engines on a GPU: the W8A16 kernels (cuda/w8a16_gemm.cu) against the dequantizing reference,
and GemLite export -> load -> logits. Skipped without CUDA (and the GemLite tests without gemlite)."""
from __future__ import annotations

import importlib.util
import math

import pytest
import torch

from conftest import make_model_file
from infer.checkpoint import SCALE_SUFFIX
from infer.model import RWKV7
from infer.ops.linear_w8a16 import (W8A16Linear, cutlass_include_dir, dequantize_matmul, load_w8a16_kernels,
                                   random_uint4, uint4_weights, w8a16_kernels_error)
from infer.quant import export_quant, export_quant_gemlite
from infer.quant.engines import warm_up
from infer.quant.gemlite_linear import W8A16_ABOVE_ROWS, load_tuning, save_tuning
from infer.quant.quantize import quantize_int8
from infer.random_model import make_config, random_state_dict

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
needs_gemlite = pytest.mark.skipif(importlib.util.find_spec("gemlite") is None, reason="needs gemlite 0.6.x")
ROWS = [1, 2, 3, 5, 8, 9, 16, 33, 128, 300]
# fp16 output: one rounding (2^-11 relative) on top of fp32 sums that differ only in order
KERNEL_TOL = 2e-3


@pytest.fixture(scope="module")
def kernels():
    loaded = load_w8a16_kernels()
    assert loaded is not None, f"W8A16 kernels unavailable: {w8a16_kernels_error()}"
    return loaded


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want.float()).abs().max() / want.float().abs().max()).item()


@pytest.mark.parametrize("n_out,n_in", [(256, 256), (768, 3072), (3072, 768), (4096, 4096), (65536, 2048)])
@pytest.mark.parametrize("rows", ROWS)
def test_kernels_match_the_dequantizing_reference(kernels, n_out, n_in, rows):
    if rows > kernels.gemv_max_rows and not kernels.gemm_available:
        pytest.skip("this build has no CUTLASS GEMM (nvidia-cutlass not installed)")
    gen = torch.Generator(device="cuda").manual_seed(rows * 7 + n_in)
    q, scale = quantize_int8(torch.randn(n_out, n_in, generator=gen, device="cuda"))
    layer = W8A16Linear(q, scale)
    assert "cuda gemv" in layer.kind
    x = torch.randn(rows, n_in, generator=gen, device="cuda").half()
    assert relative_error(layer(x), dequantize_matmul(x.float(), q, scale.float())) <= KERNEL_TOL


@pytest.mark.parametrize("n_out,n_in", [(264, 720), (4096, 16384)])
@pytest.mark.parametrize("rows", [9, 40, 256, 300])
def test_every_cutlass_gemm_matches_the_reference(kernels, n_out, n_in, rows):
    """The GEMM the layers use, the SM80 one it falls back to (the same op off Hopper) and each tile of the
    Hopper GEMM, on shapes that are not multiples of the tiles (264 channels, K 720, 9 or 300 rows)."""
    if not kernels.gemm_available:
        pytest.skip("this build has no CUTLASS GEMM (nvidia-cutlass not installed)")
    gen = torch.Generator(device="cuda").manual_seed(rows + n_out)
    q = torch.randint(-127, 128, (n_out, n_in), generator=gen, device="cuda", dtype=torch.int8)
    scale = (torch.rand(n_out, generator=gen, device="cuda") * 0.01 + 1e-3).half()
    x = torch.randn(rows, n_in, generator=gen, device="cuda").half()
    want = dequantize_matmul(x.float(), q, scale.float())
    ops = [kernels.gemm, kernels.gemm_sm80] + [lambda *a, tile=tile: kernels.gemm_sm90(*a, tile)
                                               for tile in range(len(kernels.sm90_tiles))]
    for op in ops:
        y = torch.full((rows, n_out), float("nan"), dtype=torch.float16, device="cuda")
        op(x, q, scale, y, torch.cuda.current_stream().cuda_stream)
        assert relative_error(y, want) <= KERNEL_TOL


@pytest.mark.parametrize("n_out,n_in,group", [(264, 704, 64), (4096, 4096, 64), (4096, 16384, 128)])
@pytest.mark.parametrize("rows", [9, 40, 256, 300])
def test_w4_hopper_gemm_matches_the_reference(kernels, n_out, n_in, group, rows):
    """The 4-bit Hopper GEMM in each tile on random words, scales and zeros (groups of one K step and of two)
    against the fp32 product of the rebuilt fp16 weights."""
    if kernels.gemm_w4 is None:
        pytest.skip("the 4-bit Hopper GEMM is built for compute capability 9.0 with the CUTLASS headers")
    gen = torch.Generator(device="cuda").manual_seed(rows + n_in)
    words, scale, zero = random_uint4(gen, n_out, n_in, group)
    x = torch.randn(rows, n_in, generator=gen, device="cuda").half()
    want = x.float() @ uint4_weights(words, scale, zero).float().T
    for tile in [-1, *range(len(kernels.sm90_tiles))]:
        y = torch.full((rows, n_out), float("nan"), dtype=torch.float16, device="cuda")
        kernels.gemm_w4(x, words, scale, zero, group, y, torch.cuda.current_stream().cuda_stream, tile)
        assert relative_error(y, want) <= KERNEL_TOL, tile


@pytest.mark.parametrize("n_out,n_in,group,splits", [(264, 768, 64, 2), (4096, 16384, 64, 2), (2048, 8192, 128, 4)])
@pytest.mark.parametrize("rows,partial_rows", [(9, 9), (128, 128), (300, 128)])
def test_w4_hopper_gemm_split_k_matches_the_reference(kernels, n_out, n_in, group, splits, rows, partial_rows):
    """Split K (fp32 partial products summed in split order) in each tile, the rows in one pass or in chunks of
    partial_rows, against the fp32 product of the rebuilt weights and bit for bit the same in every tile (each
    slice sums its K in the same order whatever the tile, so the tile a batch size picks cannot change a row)."""
    if kernels.gemm_w4 is None:
        pytest.skip("the 4-bit Hopper GEMM is built for compute capability 9.0 with the CUTLASS headers")
    gen = torch.Generator(device="cuda").manual_seed(rows + n_in + splits)
    words, scale, zero = random_uint4(gen, n_out, n_in, group)
    x = torch.randn(rows, n_in, generator=gen, device="cuda").half()
    want = x.float() @ uint4_weights(words, scale, zero).float().T
    stream = torch.cuda.current_stream().cuda_stream
    results = []
    for tile in [-1, *range(len(kernels.sm90_tiles))]:
        partials = torch.full((splits, partial_rows, n_out), float("nan"), device="cuda")
        y = torch.full((rows, n_out), float("nan"), dtype=torch.float16, device="cuda")
        kernels.gemm_w4(x, words, scale, zero, group, y, stream, tile, partials)
        assert relative_error(y, want) <= KERNEL_TOL, tile
        results.append(y)
    assert all(torch.equal(results[0], y) for y in results[1:])
    # the last chunk's partial products (packed: [splits, last, N] at the buffer's start), summed here in split
    # order: what the kernel rounded to fp16
    last = rows - (rows - 1) // partial_rows * partial_rows
    parts = partials.flatten()[:splits * last * n_out].view(splits, last, n_out)
    total = parts[0].clone()
    for part in parts[1:]:
        total += part
    assert torch.equal(results[-1][rows - last:], total.half())
    unsplit = torch.empty_like(y)
    kernels.gemm_w4(x, words, scale, zero, group, unsplit, stream)
    assert relative_error(unsplit, want) <= KERNEL_TOL


@pytest.mark.parametrize("n_out,n_in,splits", [(264, 768, 2), (2048, 8192, 4), (4096, 16384, 2)])
@pytest.mark.parametrize("rows,partial_rows", [(9, 9), (128, 128), (300, 128)])
def test_w8a16_hopper_gemm_split_k_matches_the_reference(kernels, n_out, n_in, splits, rows, partial_rows):
    """The int8 Hopper GEMM with split K (each slice's product scaled per channel in fp32, the slices summed in
    order) in each tile, whole or in chunks of partial_rows rows: against the dequantized product, the same bits in
    every tile, and W8A16Linear splitting the matrices its rule picks."""
    if not kernels.hopper_gemm:
        pytest.skip("the Hopper GEMM is built for compute capability 9.0 with the CUTLASS headers")
    from infer.ops.linear_w8a16 import SPLIT_MAX_ROWS, SPLIT_STEP, gemm_splits
    gen = torch.Generator(device="cuda").manual_seed(rows + n_in + splits)
    q = torch.randint(-127, 128, (n_out, n_in), generator=gen, device="cuda", dtype=torch.int8)
    scale = (torch.rand(n_out, generator=gen, device="cuda") * 0.01 + 1e-3).half()
    x = torch.randn(rows, n_in, generator=gen, device="cuda").half()
    want = dequantize_matmul(x.float(), q, scale.float())
    stream = torch.cuda.current_stream().cuda_stream
    results = []
    for tile in [-1, *range(len(kernels.sm90_tiles))]:
        partials = torch.full((splits, partial_rows, n_out), float("nan"), device="cuda")
        y = torch.full((rows, n_out), float("nan"), dtype=torch.float16, device="cuda")
        kernels.gemm_sm90(x, q, scale, y, stream, tile, partials)
        assert relative_error(y, want) <= KERNEL_TOL, tile
        results.append(y)
    assert all(torch.equal(results[0], y) for y in results[1:])
    layer = W8A16Linear(q, scale)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    assert layer._splits == gemm_splits(n_out, n_in, SPLIT_STEP, sms)
    if layer._splits > 1 and rows <= SPLIT_MAX_ROWS:
        assert relative_error(layer(x), want) <= KERNEL_TOL


def test_w4_hopper_gemm_rejects_bad_operands(kernels):
    if kernels.gemm_w4 is None:
        pytest.skip("the 4-bit Hopper GEMM is built for compute capability 9.0 with the CUTLASS headers")
    words = torch.zeros(64, 16, dtype=torch.int32, device="cuda")
    meta = torch.zeros(2, 64, dtype=torch.float16, device="cuda")
    x, y = torch.zeros(9, 128, dtype=torch.float16, device="cuda"), torch.empty(9, 64, dtype=torch.float16, device="cuda")
    stream = torch.cuda.current_stream().cuda_stream
    kernels.gemm_w4(x, words, meta, meta, 64, y, stream)
    with pytest.raises(RuntimeError, match="must divide K"):
        kernels.gemm_w4(x, words, meta, meta, 48, y, stream)
    with pytest.raises(RuntimeError, match="scale and zero must have shape"):
        kernels.gemm_w4(x, words, meta[:1], meta, 64, y, stream)
    with pytest.raises(RuntimeError, match=r"\[N, K / 8\]"):
        kernels.gemm_w4(x[:, :64].contiguous(), words, meta, meta, 64, y, stream)
    with pytest.raises(RuntimeError):  # a group that is not a multiple of the K step: CUTLASS refuses it
        kernels.gemm_w4(x, words, torch.zeros(4, 64, dtype=torch.float16, device="cuda"),
                        torch.zeros(4, 64, dtype=torch.float16, device="cuda"), 32, y, stream)
    partials = torch.empty(2, 9, 64, device="cuda")
    kernels.gemm_w4(x, words, meta, meta, 64, y, stream, -1, partials)  # K = 128: two slices of one group
    with pytest.raises(RuntimeError, match="cannot be split in 4 slices"):
        kernels.gemm_w4(x, words, meta, meta, 64, y, stream, -1, torch.empty(4, 9, 64, device="cuda"))
    with pytest.raises(RuntimeError, match="partials must be Float"):
        kernels.gemm_w4(x, words, meta, meta, 64, y, stream, -1, partials.half())
    with pytest.raises(RuntimeError, match="partials must have shape"):
        kernels.gemm_w4(x, words, meta, meta, 64, y, stream, -1, torch.empty(1, 9, 64, device="cuda"))


def test_hopper_uses_the_wgmma_gemm(kernels):
    if torch.cuda.get_device_capability() != (9, 0) or cutlass_include_dir() is None:
        pytest.skip("the Hopper GEMM is built for compute capability 9.0 with the CUTLASS headers")
    assert kernels.gemm_name == "cutlass sm90 wgmma"
    assert kernels.gemm is not kernels.gemm_sm80 and kernels.hopper_gemm
    assert kernels.sm90_tiles == [(64, 256), (128, 128), (64, 128), (64, 64)]
    assert "sm90 wgmma" in W8A16Linear(*quantize_int8(torch.randn(256, 256, device="cuda"))).kind


def test_unaligned_rows_are_copied_not_misread(kernels):
    q, scale = quantize_int8(torch.randn(512, 256, device="cuda"))
    layer = W8A16Linear(q, scale)
    flat = torch.randn(3 * 256 + 1, device="cuda").half()
    x = flat[1:].view(3, 256)  # 2-byte offset: not 16-byte aligned
    assert x.data_ptr() % 16
    assert relative_error(layer(x), dequantize_matmul(x.float(), q, scale.float())) <= KERNEL_TOL


@pytest.mark.parametrize("rows", [1, 64])
def test_kernels_replay_in_a_cuda_graph(kernels, rows):
    q, scale = quantize_int8(torch.randn(1024, 512, device="cuda"))
    layer = W8A16Linear(q, scale)
    x = torch.randn(rows, 512, device="cuda").half()
    layer(x)  # warm up outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = layer(x)
    x.copy_(torch.randn_like(x))
    graph.replay()
    torch.cuda.synchronize()
    assert relative_error(y, dequantize_matmul(x.float(), q, scale.float())) <= KERNEL_TOL


def test_w8a16_model_on_cuda_tracks_fp16(kernels):
    """The cutlass engine against the fp16 engine on the same weights, within the derived int8 tolerance
    of test_quant.py (relative logit error <= sqrt(sum of squared per-matrix weight errors))."""
    config = make_config(2, 256, 65536)
    sd = random_state_dict(config, seed=21, dtype=torch.float16)
    w8 = dict(sd)
    eps = []
    for name in config.linear_keys():
        w8.update(export_quant.quantize_matrix(name, sd[name]))
        deq = w8[name].float() * w8[name + SCALE_SUFFIX].float()[:, None]
        eps.append(((sd[name].float() - deq).norm() / sd[name].float().norm()).item())
    fp16 = RWKV7.from_state_dict(dict(sd), device="cuda", dtype="fp16")
    quant = RWKV7.from_state_dict(w8, device="cuda", dtype="fp16", engine="cutlass")
    assert "cuda gemv" in quant.implementations()["linear"]
    prompt = torch.randint(1, 65536, (40,), generator=torch.Generator().manual_seed(3)).tolist()
    want = fp16.prefill([prompt], [0], fp16.new_state_pool(1), all_logits=True)
    got = quant.prefill([prompt], [0], quant.new_state_pool(1), all_logits=True)
    relative = ((got - want).norm(dim=-1) / want.norm(dim=-1)).max().item()
    # fp16 activations add their own rounding on both sides: allow it on top of the int8 bound
    assert 0 < relative <= math.sqrt(sum(e * e for e in eps)) + 5e-3, relative


@needs_gemlite
@pytest.mark.parametrize("fmt,tolerance", [("A16W8_INT8", 0.05), ("A16W8_FP8", 0.15), ("A16W4_HQQ_INT", 0.5)])
def test_gemlite_export_load_and_logits(tmp_path, fmt, tolerance):
    """Tolerances: relative logit error of the format's weight error (int8 ~0.7 %, e4m3 ~2.5 %, 4-bit
    group 64 ~9 % per matrix) summed in quadrature over 13 matrices, with room for fp16."""
    path = make_model_file(tmp_path, "L2-C128-V1024", torch.float16)
    out = tmp_path / f"{fmt}.pth"
    export_quant_gemlite.main([str(path), str(out), "--format", fmt])
    fp16 = RWKV7.load(str(path), device="cuda", dtype="fp16", progress=False)
    quant = RWKV7.load(str(out), device="cuda", dtype="fp16", engine="gemlite", progress=False)
    assert "gemlite" in quant.implementations()["linear"]
    warm_up(quant.projections(), [1, 8, 64])  # one of each GemLite kernel kind (GEMV, split-K GEMM, GEMM)
    tuning = tmp_path / "tuning.json"
    save_tuning(tuning)  # the configurations just tuned, for the next start
    assert tuning.stat().st_size > 2 and load_tuning(tuning)
    prompt = torch.randint(1, 1024, (40,), generator=torch.Generator().manual_seed(4)).tolist()
    want = fp16.prefill([prompt], [0], fp16.new_state_pool(1), all_logits=True)
    got = quant.prefill([prompt], [0], quant.new_state_pool(1), all_logits=True)
    relative = ((got - want).norm(dim=-1) / want.norm(dim=-1)).max().item()
    assert 0 < relative <= tolerance, relative
    decoded = quant.decode([5, 6, 7], [0, 1, 2], quant.new_state_pool(3))
    assert torch.isfinite(decoded).all()


@needs_gemlite
@pytest.mark.parametrize("fmt,tolerance", [("A16W8_INT8", 0.02), ("A16W8_FP8", 0.08)])
def test_gemlite_8bit_layers_stay_finite_for_large_activations(tmp_path, fmt, tolerance):
    """Activations scaled so each product's largest output is ~2,000 (well inside fp16) while its sum over
    the quantized codes before the per-channel scale is far past fp16's 65,504: GemLite's post-scaled kernels
    rounded that sum to fp16 first (inf, then NaN; bench/results/experiment_gemlite_fp8_range_first_h200.json),
    so GemLiteLinear reads 8-bit layers pre-scaled. Batches of 1 (GEMV), 16 (split-K GEMM) and 64 (GEMM; int8
    on Hopper: the W8A16 GEMM) against the fp16 weights; tolerances: the format's weight error."""
    path = make_model_file(tmp_path, "L2-C128-V1024", torch.float16)
    out = tmp_path / f"{fmt}.pth"
    export_quant_gemlite.main([str(path), str(out), "--format", fmt])
    fp16 = RWKV7.load(str(path), device="cuda", dtype="fp16", progress=False)
    quant = RWKV7.load(str(out), device="cuda", dtype="fp16", engine="gemlite", progress=False)
    gen = torch.Generator(device="cuda").manual_seed(7)
    for dense, lin in zip(fp16.projections(), quant.projections()):
        weight = dense.weight.float()
        for rows in (1, 16, 64):
            x = torch.randn(rows, lin.in_features, generator=gen, device="cuda")
            x *= 2000.0 / (x @ weight.T).abs().max()
            want = x @ weight.T
            got = lin(x.half()).float()
            assert torch.isfinite(got).all(), f"{fmt}, {rows} rows: non-finite outputs"
            assert relative_error(got, want) <= tolerance, (fmt, rows, relative_error(got, want))


@needs_gemlite
def test_gemlite_int8_decode_runs_on_the_fused_gemv(tmp_path):
    """A16W8_INT8 layers hand their int8 rows and scales to the fused GEMV (no copy): a batch-1 step takes
    it for every matrix and agrees with the same step through GemLite's own kernels."""
    from infer.ops.fused import select_fused
    path = make_model_file(tmp_path, "L2-C128-V1024", torch.float16)
    out = tmp_path / "w8.pth"
    export_quant_gemlite.main([str(path), str(out), "--format", "A16W8_INT8"])
    quant = RWKV7.load(str(out), device="cuda", dtype="fp16", engine="gemlite", progress=False)
    fused = select_fused(quant, "on")
    assert fused.gemv_covers(quant) == fused.quantized_gemv_rows == 8  # int8 models: the GEMV up to 8 rows
    assert all(lin.int8_rows[0].data_ptr() == lin._args[0].data_ptr() for lin in quant.projections())
    prompt = torch.randint(1, 1024, (24,), generator=torch.Generator().manual_seed(5)).tolist()
    pools = [quant.new_state_pool(1) for _ in range(2)]
    for pool in pools:
        quant.prefill([prompt], [0], pool)
    on_gemv = quant.decode([9], [0], pools[0])
    rows, fused.quantized_gemv_rows = fused.quantized_gemv_rows, 0  # the same step through GemLite's kernels
    try:
        on_gemlite = quant.decode([9], [0], pools[1])
    finally:
        fused.quantized_gemv_rows = rows
    assert 0 < relative_error(on_gemv, on_gemlite) <= 1e-2


@needs_gemlite
def test_gemlite_int8_batches_take_the_hopper_gemm(tmp_path):
    """On Hopper, A16W8_INT8 layers run batches above W8A16_ABOVE_ROWS on the W8A16 kernels, reading GemLite's
    own int8 memory, and agree with GemLite's kernels on the same layer."""
    if torch.cuda.get_device_capability() != (9, 0) or cutlass_include_dir() is None:
        pytest.skip("the Hopper GEMM is built for compute capability 9.0 with the CUTLASS headers")
    path = make_model_file(tmp_path, "L2-C128-V1024", torch.float16)
    out = tmp_path / "w8.pth"
    export_quant_gemlite.main([str(path), str(out), "--format", "A16W8_INT8"])
    quant = RWKV7.load(str(out), device="cuda", dtype="fp16", engine="gemlite", progress=False)
    gen = torch.Generator(device="cuda").manual_seed(6)
    for lin in quant.projections():
        assert lin._w8a16 is not None and "sm90" in lin.kind
        assert lin._w8a16.qweight.data_ptr() == lin._args[0].data_ptr()  # no copy
        x = torch.randn(W8A16_ABOVE_ROWS + 8, lin.in_features, generator=gen, device="cuda").half()
        ours = lin(x)
        routed, lin._w8a16 = lin._w8a16, None  # the same layer through GemLite's kernels
        try:
            theirs = lin(x)
        finally:
            lin._w8a16 = routed
        assert relative_error(ours, theirs) <= KERNEL_TOL * 2
