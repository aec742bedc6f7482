"""bench/experiment_blas_algos.py and bench/cublaslt.py: the experiment's GEMMs are the model's, its torch calls compute
what the fused forward's do, and their column-major cuBLASLt problems compute the same products, checked on the CPU by
an emulation of cuBLASLt's layout rules and, on a CUDA machine, through the real library."""
from __future__ import annotations

import ctypes

import pytest
import torch
import torch.nn.functional as F

from bench import experiment_blas_algos as exp
from bench import cublaslt
from infer.random_model import make_config, random_state_dict

LAYERS, WIDTH, VOCAB = 2, 64, 256


def lt_emulated(p: cublaslt.LtProblem, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """D = op(A) op(B) + beta C as cuBLASLt reads and writes column-major buffers: element (i, j) of a matrix of
    leading dimension ld at i + j * ld, batch item t at t * stride; op(B) = B (this experiment's transb is N)."""
    a, b, d = a.reshape(-1), b.reshape(-1), c.reshape(-1).clone()

    def matrix(flat: torch.Tensor, start: int, rows: int, cols: int, ld: int) -> torch.Tensor:
        return flat[start:start + ld * cols].reshape(cols, ld)[:, :rows].t()

    for t in range(p.batch):
        stored_a = matrix(a, t * p.stride_a, p.rows_a, p.cols_a, p.lda)
        op_a = stored_a.t() if p.trans_a == cublaslt.CUBLAS_OP_T else stored_a
        assert op_a.shape == (p.m, p.k)
        op_b = matrix(b, t * p.stride_b, p.k, p.n, p.k)
        out = op_a @ op_b + p.beta * matrix(d, t * p.stride_d, p.m, p.n, p.m)
        d[t * p.stride_d:t * p.stride_d + p.m * p.n] = out.t().reshape(-1)
    return d.reshape(c.shape)


def model_weights() -> dict[str, torch.Tensor]:
    config = make_config(LAYERS, WIDTH, VOCAB)
    sd = random_state_dict(config, seed=3, dtype=torch.float32, device="cpu")
    blk = "blocks.0."
    return {"rkv": torch.stack([sd[blk + f"att.{m}.weight"] for m in ("receptance", "key", "value")]),
            "output": sd[blk + "att.output.weight"], "ffn_key": sd[blk + "ffn.key.weight"],
            "ffn_value": sd[blk + "ffn.value.weight"], "head": sd["head.weight"]}


def test_heuristic_result_matches_the_header_layout():
    # cublasLtMatmulHeuristicResult_t: algo (8 x uint64), size_t workspaceSize, status, float wavesCount, int[4]
    assert ctypes.sizeof(cublaslt.LtAlgo) == 64
    assert ctypes.sizeof(cublaslt.LtHeuristic) == 96
    assert cublaslt.LtHeuristic.waves_count.offset == 76


@pytest.mark.parametrize("rows", [1, 5])
def test_gemms_are_the_models_products(rows):
    """Every GEMM has the shape of the model matrix it stands for; its torch call and its cuBLASLt problem both give
    x W^T (+ y for the residual adds) with the weights stored as the fused forward stores them."""
    weights = model_weights()
    gemms = exp.decode_gemms(LAYERS, WIDTH, VOCAB)
    assert [g.name for g in gemms] == list(weights)
    assert sum(g.per_step for g in gemms) == 4 * LAYERS + 1
    variants = {"output_beta0": "output", "ffn_value_nk": "ffn_value"}
    assert [g.name for g in exp.variant_gemms(WIDTH)] == list(variants)
    gen = torch.Generator().manual_seed(rows)
    for gemm in gemms + exp.variant_gemms(WIDTH):
        w = weights[variants.get(gemm.name, gemm.name)]  # nn.Linear layout [out, in] (stacked for r/k/v)
        assert w.shape[-2:] == (gemm.n, gemm.k), gemm.name
        stored = w.transpose(-1, -2).contiguous() if gemm.layout == "kn" else w  # the K-major FFN value
        lead = (gemm.batch,) if gemm.batch > 1 else ()
        x = torch.randn(*lead, rows, gemm.k, generator=gen)
        y0 = torch.randn(*lead, rows, gemm.n, generator=gen)
        want = F.linear(x, w) + gemm.beta * y0 if gemm.batch == 1 else \
            torch.stack([F.linear(x[i], w[i]) for i in range(gemm.batch)])
        got = y0.clone()
        exp.torch_call(gemm)(stored, x, got)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        problem = cublaslt.lt_problem(gemm.shape(rows))
        torch.testing.assert_close(lt_emulated(problem, stored, x, y0), want, rtol=1e-5, atol=1e-5)


def test_the_emulation_rejects_a_wrong_layout():
    """The check above can fail: the r/k/v problem with its operand read as not transposed gives other values."""
    gemm = exp.decode_gemms(LAYERS, WIDTH, VOCAB)[0]
    w = model_weights()["rkv"]
    x, y0 = torch.randn(3, 4, WIDTH), torch.zeros(3, 4, WIDTH)
    right = cublaslt.lt_problem(gemm.shape(4))
    wrong = cublaslt.LtProblem(**{**right.__dict__, "trans_a": cublaslt.CUBLAS_OP_N})
    assert torch.allclose(lt_emulated(right, w, x, y0), torch.bmm(x, w.transpose(1, 2)), atol=1e-5)
    assert not torch.allclose(lt_emulated(wrong, w, x, y0), torch.bmm(x, w.transpose(1, 2)), atol=1e-3)


def test_unknown_layout_is_an_error():
    with pytest.raises(ValueError):
        cublaslt.lt_problem(cublaslt.GemmShape(2, 4, 4, layout="mn"))


@pytest.mark.parametrize("shape", [(64, 96, 128, "nk", 1, False), (64, 96, 128, "kn", 1, True),
                                   (64, 96, 128, "nk", 3, False), (48, 64, 256, "nk", 1, True)])
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (cuBLASLt)")
def test_cublaslt_algorithms_compute_torchs_product(shape):
    """bench/cublaslt.py's ctypes calls into cuBLASLt: every algorithm the heuristic offers (up to 8) for the
    column-major problem of a row-major product gives torch's result (the layouts as the fused forward stores them:
    nn.Linear's, K-major, r/k/v's strided batch, added into the output)."""
    rows, n, k, layout, batch, add = shape
    gemm = exp.Gemm("product", n, k, layout, batch, beta=1.0 if add else 0.0)
    lead = (batch,) if batch > 1 else ()
    gen = torch.Generator().manual_seed(rows)
    w = (torch.randn(*lead, *((n, k) if layout == "nk" else (k, n)), generator=gen) * k ** -0.5).half().cuda()
    x = torch.randn(*lead, rows, k, generator=gen).half().cuda()
    y0 = torch.randn(*lead, rows, n, generator=gen).half().cuda()
    want = y0.clone()
    exp.torch_call(gemm)(w, x, want)
    plan = cublaslt.CublasLt(w.device).plan(cublaslt.lt_problem(gemm.shape(rows)), 8)
    assert plan.algos, "cuBLASLt offered no algorithm"
    for index in range(len(plan.algos)):
        got = y0.clone()
        plan.run(index, w, x, got)
        torch.cuda.synchronize()
        assert (got.float() - want.float()).abs().max().item() <= 1e-2 * want.float().abs().max().item(), index
