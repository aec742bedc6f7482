"""GPTQ (infer/quant/gptq.py): the column-by-column error feedback against round-to-nearest, Hessian
collection through the model's readable forward, the pass planner, and the export CLI's checks."""
from __future__ import annotations

import pytest
import torch

from conftest import make_model_file
from infer.model import RWKV7
from infer.quant import export_quant_gemlite
from infer.quant.gptq import HessianCache, calibrated_quantizer, calibration_rows, collect_hessians, quantize_uint4_gptq
from infer.quant.quantize import dequantize_uint4_groups, quantize_uint4_groups
from infer.random_model import make_config, random_state_dict

CALIBRATION = ("Rivers carry silt to the delta, where it settles into new land year after year. The farmers "
               "plant rice on it and watch the tides. for i in range(10):\n    total += weights[i] * x[i]\n") * 6


def correlated_inputs(seed: int, rows: int, width: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    mixing = torch.eye(width) + torch.randn(width, width, generator=torch.Generator().manual_seed(99)) / width ** 0.5
    return (torch.randn(rows, width, generator=gen) @ mixing) * torch.linspace(0.2, 3.0, width)


def symmetric_rtn(weight: torch.Tensor, group_size: int) -> torch.Tensor:
    groups = weight.reshape(-1, group_size)
    scale = (2 * groups.abs().amax(dim=1, keepdim=True) / 15).half().float()
    codes = torch.round(groups / scale + 8).clamp(0, 15)
    return ((codes - 8) * scale).reshape(weight.shape)


@pytest.mark.parametrize("symmetric", [True, False])
def test_identity_hessian_is_round_to_nearest(symmetric):
    """Uncorrelated inputs of equal size leave no error to move: GPTQ is then exactly round-to-nearest."""
    weight = torch.randn(48, 256, generator=torch.Generator().manual_seed(1)) * 0.05
    q, scale, zero = quantize_uint4_gptq(weight, torch.eye(256), 64, symmetric)
    if symmetric:
        assert torch.equal(dequantize_uint4_groups(q, scale, zero), symmetric_rtn(weight, 64))
        assert (zero == 8).all()
    else:
        for got, want in zip((q, scale, zero), quantize_uint4_groups(weight, 64, optimize=False)):
            assert torch.equal(got, want)


@pytest.mark.parametrize("symmetric", [True, False])
def test_gptq_lowers_output_error_on_held_out_inputs(symmetric):
    weight = torch.randn(192, 512, generator=torch.Generator().manual_seed(2)) * 0.05
    calibration, held_out = correlated_inputs(3, 4096, 512), correlated_inputs(4, 2048, 512)
    q, scale, zero = quantize_uint4_gptq(weight, calibration.T @ calibration / len(calibration), 64, symmetric)
    assert q.dtype == torch.uint8 and int(q.max()) <= 15 and scale.dtype == zero.dtype == torch.float16
    assert scale.shape == zero.shape == (192, 8)
    rtn = symmetric_rtn(weight, 64) if symmetric else dequantize_uint4_groups(*quantize_uint4_groups(weight, 64, False))

    def output_error(w: torch.Tensor) -> float:
        return ((held_out @ (weight - w).T) ** 2).mean().item()

    assert output_error(dequantize_uint4_groups(q, scale, zero)) < 0.85 * output_error(rtn)


def test_unused_input_columns_are_zeroed_not_fatal():
    weight = torch.randn(32, 128, generator=torch.Generator().manual_seed(5))
    x = correlated_inputs(6, 512, 128)
    x[:, 7] = 0.0  # a column no calibration token uses: its Hessian row and column are zero
    q, scale, zero = quantize_uint4_gptq(weight, x.T @ x / len(x), 64)
    assert torch.isfinite(scale.float()).all()
    assert (q[:, 7] == 8).all()  # quantized as zero


def test_bad_shapes_are_clear_errors():
    with pytest.raises(ValueError, match="multiple of the group size"):
        quantize_uint4_gptq(torch.zeros(4, 96), torch.eye(96), 64)
    with pytest.raises(ValueError, match="Hessian of shape"):
        quantize_uint4_gptq(torch.zeros(4, 128), torch.eye(64), 64)


@pytest.fixture(scope="module")
def tiny_model():
    config = make_config(2, 128, 1024)
    return config, random_state_dict(config, seed=7, dtype=torch.float32)


def token_rows(text: str, rows: int, tokens: int) -> list[list[int]]:
    from infer.tokenizer import load_world_tokenizer
    encode = load_world_tokenizer().encode
    return calibration_rows(text, lambda t: [i % 1024 for i in encode(t)], rows, tokens)


def test_hessians_are_the_inputs_gram_matrix_and_the_model_is_restored(tiny_model):
    config, sd = tiny_model
    model = RWKV7.from_state_dict(dict(sd), device="cpu", dtype="fp32")
    rows = token_rows(CALIBRATION, 3, 40)
    head = model.head
    seen = []
    model.head = lambda x: (seen.append(x.clone()), head(x))[1]  # the head's inputs, captured directly
    model.prefill(rows, [0, 1, 2], model.new_state_pool(3), all_logits=True)
    model.head = head
    x = torch.cat(seen)
    keys = ["head.weight", "blocks.1.ffn.value.weight", "blocks.0.att.key.weight"]
    hessians = collect_hessians(model, keys, rows)
    assert model.head is head and model.blocks[1].ffn_value.in_features == config.ffn_dim
    torch.testing.assert_close(hessians["head.weight"], x.T @ x / len(x), rtol=1e-5, atol=1e-6)
    assert hessians["blocks.1.ffn.value.weight"].shape == (config.ffn_dim, config.ffn_dim)
    # one pass per key gives the same matrices as one pass for all
    for key in keys:
        torch.testing.assert_close(collect_hessians(model, [key], rows)[key], hessians[key], rtol=1e-6, atol=0)


def test_hessian_cache_plans_passes_by_memory():
    widths = {"a": 8, "b": 8, "c": 16, "d": 8}
    passes: list[list[str]] = []

    def collect(keys: list[str]) -> dict[str, torch.Tensor]:
        passes.append(keys)
        return {k: torch.full((widths[k], widths[k]), float(len(passes))) for k in keys}

    cache = HessianCache(collect, ["a", "b", "c", "d"], widths, memory_bytes=4 * (8 * 8 + 8 * 8))
    assert [float(cache.pop(k)[0, 0]) for k in "abcd"] == [1.0, 1.0, 2.0, 3.0]
    assert passes == [["a", "b"], ["c"], ["d"]] and cache.passes == 3  # c alone exceeds the budget: still one pass


@pytest.mark.parametrize("symmetric", [True, False])
def test_calibrated_model_tracks_the_float_model_better_than_rounding(tiny_model, symmetric):
    """The whole model with GPTQ weights against round-to-nearest in the same format, on held-out tokens
    from the calibration's distribution: logits closer to the float model's. (A random model's layer
    inputs are essentially its tokens' embeddings, so held-out *text* with other tokens would be another
    distribution; random token rows keep calibration and evaluation alike.)"""
    config, sd = tiny_model
    model = RWKV7.from_state_dict(dict(sd), device="cpu", dtype="fp32")
    keys = config.linear_keys()
    tokens = torch.randint(0, config.vocab_size, (33, 128), generator=torch.Generator().manual_seed(8)).tolist()
    quantize = calibrated_quantizer(model, keys, tokens[:32], 64, symmetric, memory_bytes=1 << 20)
    gptq = {k: dequantize_uint4_groups(*quantize(k, sd[k])) for k in keys}
    rtn = {k: symmetric_rtn(sd[k], 64) if symmetric else dequantize_uint4_groups(*quantize_uint4_groups(sd[k], 64, False))
           for k in keys}

    def logits(weights: dict[str, torch.Tensor]) -> torch.Tensor:
        m = RWKV7.from_state_dict({**sd, **weights}, device="cpu", dtype="fp32")
        return m.prefill([tokens[32]], [0], m.new_state_pool(1), all_logits=True)

    reference = logits({})
    error = {name: (logits(w) - reference).abs().mean().item() for name, w in (("gptq", gptq), ("rtn", rtn))}
    assert error["gptq"] < 0.97 * error["rtn"], error


def test_calibration_rows_split_the_text():
    ids = list(range(10))
    assert calibration_rows("x", lambda _: ids, 3, 4) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    assert calibration_rows("x", lambda _: ids, 2, 4) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    with pytest.raises(ValueError, match="no tokens"):
        calibration_rows("", lambda _: [], 2, 4)


def test_export_checks_gptq_arguments_before_reading_weights(tmp_path):
    path = make_model_file(tmp_path, "L2-C128-V1024", torch.float32)
    text = tmp_path / "calibration.txt"
    text.write_text(CALIBRATION)
    cases = [(["--format", "A16W8_INT8", "--gptq", str(text)], "4-bit format only"),
             (["--format", "A16W4_HQQ_INT", "--gptq", str(tmp_path / "missing.txt")], "cannot read the calibration"),
             (["--format", "A16W4_HQQ_INT", "--gptq", str(text), "--calibration-rows", "0"], "must be positive")]
    empty = tmp_path / "empty.txt"
    empty.write_text("  \n")
    cases.append((["--format", "A16W4_HQQ_INT", "--gptq", str(empty)], "calibration text is empty"))
    for extra, message in cases:
        with pytest.raises(SystemExit) as exc:
            export_quant_gemlite.main([str(path), str(tmp_path / "out.pth"), *extra])
        assert message in str(exc.value), (extra, exc.value)
    assert not (tmp_path / "out.pth").exists()


def test_export_quantizer_calibrates_on_the_text_file(tmp_path):
    """The export's GPTQ glue (text -> World tokens -> float model -> Hessians -> codes), on CPU; the
    GemLite packing that follows it on a GPU is the same call as for round-to-nearest 4-bit."""
    import argparse
    args = argparse.Namespace(input=str(make_model_file(tmp_path, "L2-C128-V1024")), gptq="calibration.txt",
                              calibration_rows=4, calibration_tokens=32, device="cpu", group_size=64, gptq_zero_points=False,
                              gptq_memory_gb=0.001)
    with pytest.raises(ValueError, match="vocabulary has 1024 tokens"):
        export_quant_gemlite.gptq_quantizer(args, CALIBRATION, ["head.weight"])
    path = make_model_file(tmp_path, "L4-C192-V65536")
    args.input = str(path)
    keys = ["blocks.0.att.receptance.weight", "blocks.3.ffn.value.weight", "head.weight"]
    quantize = export_quant_gemlite.gptq_quantizer(args, CALIBRATION, keys)
    weights = torch.load(path)
    for key in keys:
        q, scale, zero = quantize(key, weights[key])
        assert q.shape == weights[key].shape and (zero == 8).all() and torch.isfinite(scale.float()).all()
        deq = dequantize_uint4_groups(q, scale, zero)
        assert (deq - weights[key].float()).abs().max() <= 16 * scale.float().max()
