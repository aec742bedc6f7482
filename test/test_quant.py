"""Quantized engines on CPU: the quantization math, the exports, loading per engine, accuracy and invariance.

W8A16 (``--inference-engine cutlass``) runs on CPU through its dequantizing path, so export -> load ->
generate is tested end to end here. GemLite packing and kernels need a GPU; on CPU they must fail
clearly, and the checkpoint layout GemLite exports is validated with hand-made packed entries.
"""
from __future__ import annotations

import math
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from conftest import MODEL_SHAPES, ROOT, make_model_file
from infer.checkpoint import (GEMLITE_FORMAT_KEY, GEMLITE_GROUP_SIZE_KEY, GEMLITE_INFIX, GEMLITE_VERSION_KEY,
                              SCALE_SUFFIX, W8A16_MARKER, CheckpointError, infer_config, open_checkpoint)
from infer.model import RWKV7
from infer.ops.linear_w8a16 import W8A16Linear
from infer.quant import export_quant, export_quant_gemlite
from infer.quant.engines import ENGINES
from infer.quant.quantize import SCALE_FLOOR, quantize_fp8, quantize_int8, quantize_uint4_groups
from infer.random_model import make_config, random_state_dict, save_checkpoint

GREEDY_TOKENS = 64
GREEDY_FLOOR = 0.90   # teacher-forced agreement with the fp32 model (measured 0.95 and 0.98)


def random_tokens(n: int, vocab: int, seed: int) -> list[int]:
    return torch.randint(1, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module")
def exported(model_path, tmp_path_factory):
    """(float checkpoint, its W8A16 export written by the CLI)."""
    out = tmp_path_factory.mktemp("w8a16") / (model_path.stem + "-w8a16.pth")
    export_quant.main([str(model_path), str(out), "--bits", "8"])
    return model_path, out


@pytest.fixture(scope="module")
def pair(exported):
    """The fp32 model and its W8A16 model (cutlass engine, CPU)."""
    float_path, w8_path = exported
    return (RWKV7.load(str(float_path), device="cpu", progress=False),
            RWKV7.load(str(w8_path), device="cpu", engine="cutlass", progress=False))


# --------------------------------------------------------------------------- quantization math
def test_int8_math_matches_a_direct_reference():
    torch.manual_seed(0)
    rows = [torch.randn(32) * 0.05,
            torch.zeros(32),                                   # all zero: scale at the floor, q = 0
            torch.cat([torch.randn(31) * 1e-3, torch.tensor([-2.5])]),  # one outlier sets the scale
            torch.randn(32) * 1e-5,                            # below the floor: scale = fp16 tiny
            (torch.arange(32) - 16 + 0.5) * 2.0 ** -4]         # exact ties at scale 2^-4 (see below)
    rows[4][0] = 127 * 2.0 ** -4                               # max |w| = 127 * 2^-4 -> scale exactly 2^-4
    weight = torch.stack(rows)
    q, scale = quantize_int8(weight)
    assert q.dtype == torch.int8 and scale.dtype == torch.float16 and q.shape == weight.shape
    for n, row in enumerate(weight.tolist()):
        want_scale = max(max(abs(v) for v in row) / 127, SCALE_FLOOR)
        assert scale[n].item() == torch.tensor(want_scale).half().item()
        s = scale[n].item()
        want_q = [max(-127, min(127, round(v / s))) for v in row]  # Python's round: half to even, like torch
        assert q[n].tolist() == want_q, n
    assert q[1].abs().max() == 0 and scale[3].item() == SCALE_FLOOR
    assert q[2, -1] == -127                                    # the outlier maps to the end of the range
    assert q[4, 16] == 0 and q[4, 17] == 2 and q[4, 18] == 2   # 0.5 -> 0, 1.5 -> 2, 2.5 -> 2
    assert int(q.min()) >= -127                                # -128 is never used


def test_int8_error_is_at_most_half_a_step():
    weight = torch.randn(64, 256)
    q, scale = quantize_int8(weight)
    err = (weight - q.float() * scale.float()[:, None]).abs()
    assert (err <= scale.float()[:, None] / 2 * (1 + 1e-6)).all()


def test_fp8_math():
    weight = torch.randn(64, 256) * 0.02
    q, scale = quantize_fp8(weight)
    assert q.dtype == torch.float8_e4m3fn and scale.dtype == torch.float16
    assert torch.equal(scale, (weight.abs().amax(1) / 448).half())
    deq = q.float() * scale.float()[:, None]
    # e4m3: 3 mantissa bits (relative rounding <= 2^-4); subnormals below 2^-6 step by 2^-9 (absolute)
    assert ((weight - deq).abs() <= 2 ** -4 * weight.abs() + 2 ** -10 * scale.float()[:, None]).all()
    assert (deq.abs().amax(1) - weight.abs().amax(1)).abs().max() <= 2 ** -4 * weight.abs().max()


def test_uint4_round_to_nearest_matches_a_direct_reference():
    torch.manual_seed(1)
    weight = torch.randn(6, 128)
    weight[2, :64] = 0.3                                       # a constant group: hi == lo, scale at the floor
    q, scale, zero = quantize_uint4_groups(weight, group_size=64, optimize=False)
    assert q.dtype == torch.uint8 and q.shape == (6, 128) and scale.shape == zero.shape == (6, 2)
    assert scale.dtype == zero.dtype == torch.float16
    for n in range(6):
        for g in range(2):
            group = weight[n, g * 64:(g + 1) * 64]
            lo, hi = group.min().item(), group.max().item()
            s = torch.tensor(max((hi - lo) / 15, SCALE_FLOOR)).half().item()
            z = torch.tensor(-lo / s).half().item()
            assert scale[n, g].item() == s and zero[n, g].item() == z
            want = [max(0, min(15, round(v / s + z))) for v in group.tolist()]
            assert q[n, g * 64:(g + 1) * 64].tolist() == want
            deq = (q[n, g * 64:(g + 1) * 64].float() - z) * s
            # Half a step, unless rounding the zero point to fp16 moved it by more (|dz| <= |z| 2^-11 steps,
            # only for a far-off zero: the constant group's -4915 moves by 0.8; then q clamps by up to |dz|).
            assert (group - deq).abs().max().item() <= s * (max(0.5, abs(z) * 2 ** -11) + 1e-3)
    assert q.max() <= 15


def test_uint4_hqq_refinement_never_worse_and_helps_on_gaussian_weights():
    weight = torch.randn(256, 512, generator=torch.Generator().manual_seed(2)) * 0.03

    def mean_error(optimize: bool) -> float:
        q, scale, zero = quantize_uint4_groups(weight, 64, optimize)
        groups = lambda t: t.float().reshape(-1, 1)  # noqa: E731
        deq = (q.float().reshape(-1, 64) - groups(zero)) * groups(scale)
        return (weight.reshape(-1, 64) - deq).abs().mean().item()

    rtn, hqq = mean_error(False), mean_error(True)
    assert hqq < rtn * 0.99, (hqq, rtn)  # measured about 4 % lower


def test_uint4_group_size_must_divide_the_width():
    with pytest.raises(ValueError, match="not a multiple of the group size"):
        quantize_uint4_groups(torch.randn(8, 96), group_size=64)


# --------------------------------------------------------------------------- the W8A16 linear layer
@pytest.mark.parametrize("n_out,n_in", [(128, 128), (512, 128), (768, 192), (192, 768), (65536, 192)])
def test_w8a16_linear_rows_are_batch_invariant(n_out, n_in):
    """The CPU path dequantizes slices of output channels; every row's bits are independent of the batch."""
    gen = torch.Generator().manual_seed(n_out + n_in)
    q, scale = quantize_int8(torch.randn(n_out, n_in, generator=gen))
    layer = W8A16Linear(q, scale.float())
    x = torch.randn(40, n_in, generator=gen)
    full = layer(x)
    reference = x @ (q.float() * scale.float()[:, None]).T
    assert torch.allclose(full, reference, atol=1e-4, rtol=1e-4)
    for rows in range(1, 40):
        assert torch.equal(layer(x[:rows]), full[:rows]), f"{rows} rows differ from the same rows in a batch of 40"
        assert torch.equal(layer(x[rows:rows + 1])[0], full[rows])


def test_w8a16_linear_rejects_wrong_tensors():
    with pytest.raises(ValueError, match="int8"):
        W8A16Linear(torch.zeros(8, 16), torch.ones(8))
    with pytest.raises(ValueError, match="scale"):
        W8A16Linear(torch.zeros(8, 16, dtype=torch.int8), torch.ones(16))


# --------------------------------------------------------------------------- export
def test_export_writes_the_w8a16_layout(exported):
    float_path, w8_path = exported
    src, out = torch.load(float_path), torch.load(w8_path)
    config = infer_config(open_checkpoint(str(float_path)))
    matrices = config.linear_keys()
    assert len(matrices) == 6 * config.n_layer + 1
    for name in matrices:
        want_q, want_scale = quantize_int8(src[name])
        assert torch.equal(out[name], want_q) and torch.equal(out[name + SCALE_SUFFIX], want_scale)
    others = set(src) - set(matrices)
    assert all(torch.equal(out[k], src[k]) and out[k].dtype == src[k].dtype for k in others)
    assert set(out) == set(src) | {n + SCALE_SUFFIX for n in matrices} | {W8A16_MARKER}
    assert int(out[W8A16_MARKER]) == 1


def test_export_reports_the_compression_ratio(tmp_path, capsys):
    path = make_model_file(tmp_path, "L2-C128-V1024", torch.bfloat16)
    export_quant.main([str(path), str(tmp_path / "q.pth")])
    printed = capsys.readouterr().out
    in_bytes, out_bytes = path.stat().st_size, (tmp_path / "q.pth").stat().st_size
    assert f"compression ratio {in_bytes / out_bytes:.2f}x" in printed
    # bf16 matrices become int8 + one fp16 scale per row: the matrix bytes shrink 2x (minus the scales);
    # embeddings and small tensors stay bf16, and the file has some fixed overhead.
    sd = torch.load(path)
    config = make_config(**{k: v for k, v in MODEL_SHAPES["L2-C128-V1024"].items() if k != "seed"})
    matrix_bytes = sum(sd[k].nbytes for k in config.linear_keys())
    other_bytes = sum(t.nbytes for k, t in sd.items()) - matrix_bytes
    expected = matrix_bytes / 2 + sum(sd[k].shape[0] * 2 for k in config.linear_keys()) + other_bytes
    assert abs(out_bytes - expected) < 0.05 * expected + 64 * 1024


def test_export_refuses_a_quantized_or_invalid_input(exported, tmp_path):
    _, w8_path = exported
    with pytest.raises(SystemExit, match="already a W8A16 .* export from the original float checkpoint"):
        export_quant.main([str(w8_path), str(tmp_path / "again.pth")])
    bad = random_state_dict(make_config(2, 128, 256), seed=3, dtype=torch.float32)
    del bad["blocks.1.att.key.weight"]
    save_checkpoint(bad, tmp_path / "bad.pth")
    with pytest.raises(SystemExit, match="missing key.*blocks.1.att.key.weight"):
        export_quant.main([str(tmp_path / "bad.pth"), str(tmp_path / "out.pth")])
    with pytest.raises(SystemExit, match="is the input checkpoint"):
        export_quant.main([str(exported[0]), str(exported[0])])
    assert not (tmp_path / "again.pth").exists() and not (tmp_path / "out.pth").exists()


# --------------------------------------------------------------------------- W8A16 model on CPU
def test_cutlass_engine_builds_w8a16_layers_on_cpu(pair):
    _, w8 = pair
    impl = w8.implementations()
    assert impl["linear"] == impl["head"] == "w8a16 int8 (dequantize + matmul)"
    assert all(isinstance(lin, W8A16Linear) for lin in w8.projections())
    assert w8.blocks[0].w1.kind == "dense float32"  # the LoRA factors stay in the activation dtype


def test_logits_within_the_derived_int8_tolerance(pair, exported):
    """Each matrix's rounding error is a relative error eps_i = |W - Q|_F / |W|_F on its output; such
    independent errors add in quadrature and the normalisations do not amplify them, so the logits'
    relative error should stay below sqrt(sum eps_i^2) (about 2.5 % for L2, 3.5 % for L4 at eps ~ 0.7 %)."""
    ref, w8 = pair
    float_sd, w8_sd = torch.load(exported[0]), torch.load(exported[1])
    eps = [((float_sd[k].float() - w8_sd[k].float() * w8_sd[k + SCALE_SUFFIX].float()[:, None]).norm()
            / float_sd[k].float().norm()).item() for k in ref.config.linear_keys()]
    tolerance = math.sqrt(sum(e * e for e in eps))
    prompt = random_tokens(24, ref.config.vocab_size, seed=1)
    want = ref.prefill([prompt], [0], ref.new_state_pool(1), all_logits=True)
    got = w8.prefill([prompt], [0], w8.new_state_pool(1), all_logits=True)
    relative = ((got - want).norm(dim=-1) / want.norm(dim=-1)).max().item()
    assert 0 < relative <= tolerance, (relative, tolerance)
    print(f"\n{ref.config.describe()}: W8A16 logits relative error max {relative:.4f} "
          f"(tolerance {tolerance:.4f}), max |diff| {(got - want).abs().max().item():.3f}")


def test_greedy_agreement_with_the_fp32_model(pair):
    """Teacher-forced: both models read the fp32 model's greedy tokens; count equal argmaxes."""
    ref, w8 = pair
    prompt = random_tokens(16, ref.config.vocab_size, seed=2)
    ref_pool, w8_pool = ref.new_state_pool(1), w8.new_state_pool(1)
    a, b = ref.prefill([prompt], [0], ref_pool)[0], w8.prefill([prompt], [0], w8_pool)[0]
    tokens, agree = [], 0
    for _ in range(GREEDY_TOKENS):
        token = int(a.argmax())
        tokens.append(token)
        agree += token == int(b.argmax())
        a, b = ref.decode([token], [0], ref_pool)[0], w8.decode([token], [0], w8_pool)[0]
    assert len(set(tokens)) > GREEDY_TOKENS // 2, "degenerate continuation proves little"
    print(f"\n{ref.config.describe()}: W8A16 greedy agreement {agree}/{GREEDY_TOKENS}")
    assert agree >= GREEDY_FLOOR * GREEDY_TOKENS


def test_w8a16_model_is_batch_and_state_invariant(pair):
    """Mixed batches, chunked prefill and a state exported mid-stream give bit-identical results."""
    _, model = pair
    V = model.config.vocab_size
    prompts = [random_tokens(n, V, seed=10 + n) for n in (1, 9, 23, 4)]
    slots = [3, 0, 2, 5]
    pool = model.new_state_pool(6)
    batch = model.prefill(prompts, slots, pool, chunk_size=5)
    steps = [random_tokens(len(prompts), V, seed=100 + s) for s in range(4)]
    decoded = [model.decode(step, slots, pool) for step in steps]
    for row, prompt in enumerate(prompts):
        alone = model.new_state_pool(2)
        assert torch.equal(model.prefill([prompt], [1], alone)[0], batch[row])
        saved = alone.export_slot(1)
        resumed = model.new_state_pool(1)
        resumed.import_slot(0, saved)
        for s, step in enumerate(steps):
            assert torch.equal(model.decode([step[row]], [0], resumed)[0], decoded[s][row])


# --------------------------------------------------------------------------- engines and layouts
def w8a16_dict(seed: int = 5) -> dict[str, torch.Tensor]:
    sd = random_state_dict(make_config(2, 128, 256), seed=seed, dtype=torch.float32)
    for name in make_config(2, 128, 256).linear_keys():
        sd.update(export_quant.quantize_matrix(name, sd[name]))
    return sd


def gemlite_dict(**overrides: torch.Tensor) -> dict[str, torch.Tensor]:
    """A plain model with every matrix replaced by GemLite-shaped packed entries (values are dummies)."""
    config = make_config(2, 128, 256)
    sd = random_state_dict(config, seed=6, dtype=torch.float32)
    for name in config.linear_keys():
        n_out, n_in = sd.pop(name).shape
        packed = {"W_q": torch.zeros(n_in // 8, n_out, dtype=torch.int32), "scales": torch.ones(n_in // 64, n_out),
                  "zeros": torch.zeros(n_in // 64, n_out), "metadata": torch.zeros(12, dtype=torch.int32),
                  "orig_shape": torch.tensor([n_out, n_in], dtype=torch.int32), "meta_scale": torch.tensor(0.0)}
        sd.update({name + GEMLITE_INFIX + k: v for k, v in packed.items()})
    sd.update({GEMLITE_FORMAT_KEY: torch.tensor(2, dtype=torch.int32),
               GEMLITE_GROUP_SIZE_KEY: torch.tensor(64, dtype=torch.int32),
               GEMLITE_VERSION_KEY: torch.tensor(2, dtype=torch.int32)})
    sd.update(overrides)
    return sd


def load_error(tmp_path, sd, engine: str, error=CheckpointError) -> str:
    save_checkpoint(sd, tmp_path / "m.pth")
    with pytest.raises(error) as info:
        RWKV7.load(str(tmp_path / "m.pth"), device="cpu", engine=engine, progress=False)
    return str(info.value)


def test_wrong_engine_names_the_right_one(tmp_path):
    float_sd = random_state_dict(make_config(2, 128, 256), seed=5, dtype=torch.float32)
    msg = load_error(tmp_path, w8a16_dict(), "fp16")
    assert "W8A16" in msg and "serve it with --inference-engine cutlass" in msg
    msg = load_error(tmp_path, float_sd, "cutlass")
    assert "plain float" in msg and "--inference-engine fp16" in msg
    assert f"python -m infer.quant.export_quant {tmp_path / 'm.pth'} OUT.pth --bits 8" in msg
    msg = load_error(tmp_path, float_sd, "gemlite")
    assert "python -m infer.quant.export_quant_gemlite" in msg and "--format" in msg
    msg = load_error(tmp_path, gemlite_dict(), "cutlass")
    assert "GemLite" in msg and "serve it with --inference-engine gemlite" in msg
    assert "from the original float checkpoint" in msg
    msg = load_error(tmp_path, w8a16_dict(), "gemlite")
    assert "serve it with --inference-engine cutlass" in msg
    with pytest.raises(ValueError, match="unknown inference engine 'int4'"):
        RWKV7.from_state_dict(float_sd, device="cpu", engine="int4")


def test_w8a16_without_marker_loads(tmp_path):
    """rwkv_lightning's W8A16 exports carry no marker; the head's scale identifies the layout."""
    sd = w8a16_dict()
    model = RWKV7.from_state_dict(dict(sd), device="cpu", engine="cutlass")
    sd.pop(W8A16_MARKER, None)
    unmarked = RWKV7.from_state_dict(sd, device="cpu", engine="cutlass")
    pools = model.new_state_pool(1), unmarked.new_state_pool(1)
    assert torch.equal(model.prefill([[1, 2, 3]], [0], pools[0]), unmarked.prefill([[1, 2, 3]], [0], pools[1]))


def test_w8a16_layout_validation(tmp_path):
    sd = w8a16_dict()
    del sd["blocks.1.ffn.value.weight" + SCALE_SUFFIX]
    assert "missing key(s): blocks.1.ffn.value.weight.scale" in load_error(tmp_path, sd, "cutlass")
    sd = w8a16_dict()
    sd["blocks.0.att.key.weight"] = sd["blocks.0.att.key.weight"].float()
    msg = load_error(tmp_path, sd, "cutlass")
    assert "wrong dtype" in msg and "blocks.0.att.key.weight (torch.float32, want int8)" in msg
    sd = w8a16_dict()
    sd["head.weight" + SCALE_SUFFIX] = torch.ones(7, dtype=torch.float16)
    assert "misshapen key(s): head.weight.scale [7] (want [256])" in load_error(tmp_path, sd, "cutlass")
    sd = w8a16_dict()
    sd[W8A16_MARKER] = torch.tensor(9, dtype=torch.int32)
    assert "W8A16 format version 9" in load_error(tmp_path, sd, "cutlass")


def test_gemlite_layout_validation(tmp_path):
    save_checkpoint(gemlite_dict(), tmp_path / "g.pth")
    config = infer_config(open_checkpoint(str(tmp_path / "g.pth")))
    assert (config.n_layer, config.n_embd, config.ffn_dim, config.vocab_size) == (2, 128, 512, 256)
    wrong = {"blocks.1.ffn.value.weight" + GEMLITE_INFIX + "orig_shape": torch.tensor([128, 256], dtype=torch.int32)}
    assert "blocks.1.ffn.value.weight [128, 256] (want [128, 512])" in load_error(tmp_path, gemlite_dict(**wrong),
                                                                                  "gemlite")
    assert "GemLite checkpoint version 1" in load_error(
        tmp_path, gemlite_dict(**{GEMLITE_VERSION_KEY: torch.tensor(1, dtype=torch.int32)}), "gemlite")
    assert "unknown GemLite format code 7" in load_error(
        tmp_path, gemlite_dict(**{GEMLITE_FORMAT_KEY: torch.tensor(7, dtype=torch.int32)}), "gemlite")
    sd = gemlite_dict()
    del sd["head.weight" + GEMLITE_INFIX + "W_q"]
    assert "missing key(s): head.weight.gemlite.W_q" in load_error(tmp_path, sd, "gemlite")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only failure")
def test_gemlite_engine_fails_clearly_without_a_gpu(tmp_path):
    msg = load_error(tmp_path, gemlite_dict(), "gemlite", RuntimeError)
    assert "--inference-engine gemlite needs a CUDA GPU" in msg and "--inference-engine cutlass" in msg


class FakeGemLiteLayer:
    """The attributes and methods of gemlite.GemLiteLinearTriton that GemLiteLinear reads (gemlite itself needs
    a GPU), as GemLite's loader sets them; ``SETTINGS`` is what the next loaded layer gets."""
    SETTINGS: dict = {}

    def load_state_dict(self, packed: dict) -> None:
        self.W_q, self.scales, self.zeros = packed["W_q"], packed["scales"], packed.get("zeros")
        self.__dict__.update(scaled_activations=False, compute_dtype=torch.float16, unpack_mask=255,
                             elements_per_sample=1, input_dtype=SimpleNamespace(value=0), data_contiguous=True,
                             **self.SETTINGS)

    def get_tensor_args(self) -> list:
        return [self.W_q, self.scales, self.zeros, None]

    def get_meta_args(self) -> list:  # GemLite's order
        return [0, self.W_nbits, self.group_size, self.unpack_mask, self.elements_per_sample, 0, 0, 1, 0,
                self.channel_scale_mode, self.W_group_mode, 1]


@pytest.fixture
def fake_gemlite(monkeypatch):
    """gemlite stubbed with FakeGemLiteLayer and a kernel that records its arguments."""
    from infer.quant import gemlite_linear
    calls = []
    kernel = SimpleNamespace(forward=lambda x, *args, meta_scale: calls.append(args) or x.new_zeros(x.shape[0], 8))
    module = SimpleNamespace(GemLiteLinearTriton=FakeGemLiteLayer,
                             DType=SimpleNamespace(FP16=SimpleNamespace(value=0), BF16=SimpleNamespace(value=1)))
    core = SimpleNamespace(GEMLITE_TRITON_MAPPING={"GEMV": kernel, "GEMM": kernel},
                           get_matmul_type=lambda rows, nbits: "GEMV")
    monkeypatch.setitem(sys.modules, "gemlite", module)
    monkeypatch.setitem(sys.modules, "gemlite.core", core)
    monkeypatch.setattr(gemlite_linear, "hopper_gemm_buildable", lambda device: False)
    return gemlite_linear.GemLiteLinear, calls


@pytest.mark.parametrize("codes", [torch.int8, torch.float8_e4m3fn])
def test_gemlite_8bit_layers_run_pre_scaled(fake_gemlite, codes):
    """A post-scaled 8-bit layer (as exported) reaches GemLite's kernels as pre-scaled (channel_scale_mode 0,
    W_group_mode 2: GemLite's post-scaled kernels round the unscaled sum to fp16 and overflow), while an int8
    one still hands its post-scaled rows to the fused GEMV and the W8A16 GEMM."""
    GemLiteLinear, calls = fake_gemlite
    rows = torch.zeros(8, 16).to(codes)  # [out, in]; GemLite keeps the [in, out] view
    FakeGemLiteLayer.SETTINGS = dict(in_features=16, out_features=8, W_nbits=8, group_size=16, channel_scale_mode=1,
                                     W_group_mode=0)
    layer = GemLiteLinear({"W_q": rows.t(), "scales": torch.ones(1, 8, dtype=torch.float16)})
    layer(torch.zeros(1, 16, dtype=torch.float16))
    assert calls[-1][12:14] == (0, 2)  # (channel_scale_mode, W_group_mode): after W_q, scales, zeros, None and 8 meta values
    assert (layer.int8_rows is not None) == (codes == torch.int8)


def test_gemlite_4bit_and_pre_scaled_layers_keep_their_modes(fake_gemlite):
    GemLiteLinear, calls = fake_gemlite
    for settings in (dict(W_nbits=4, group_size=64, channel_scale_mode=0, W_group_mode=4),
                     dict(W_nbits=8, group_size=16, channel_scale_mode=0, W_group_mode=2)):
        FakeGemLiteLayer.SETTINGS = dict(in_features=16, out_features=8, **settings)
        layer = GemLiteLinear({"W_q": torch.zeros(16, 8, dtype=torch.int8), "scales": torch.ones(1, 8).half()})
        layer(torch.zeros(1, 16, dtype=torch.float16))
        assert calls[-1][12:14] == (settings["channel_scale_mode"], settings["W_group_mode"])
        assert layer.int8_rows is None


def test_gemlite_4bit_layers_take_gemlite_gemm_at_every_batch(fake_gemlite, monkeypatch):
    """4-bit layers run GemLite's GEMM kernel whatever GemLite would pick for the batch (its split-K and GEMV
    kernels gave NaN intermittently on the H200); 8-bit layers keep GemLite's choice."""
    GemLiteLinear, _ = fake_gemlite
    core, used = sys.modules["gemlite.core"], []
    monkeypatch.setattr(core, "GEMLITE_TRITON_MAPPING", {
        kind: SimpleNamespace(forward=lambda x, *args, meta_scale, kind=kind: used.append(kind) or x.new_zeros(
            x.shape[0], 8)) for kind in ("GEMV_REVSPLITK", "GEMM_SPLITK", "GEMM")})
    monkeypatch.setattr(core, "get_matmul_type", lambda rows, nbits: "GEMV_REVSPLITK" if rows <= 2 else
                        "GEMM_SPLITK" if rows < 64 else "GEMM")
    for settings, expect in ((dict(W_nbits=4, group_size=8, channel_scale_mode=0, W_group_mode=4), ["GEMM"] * 3),
                             (dict(W_nbits=8, group_size=16, channel_scale_mode=0, W_group_mode=2),
                              ["GEMV_REVSPLITK", "GEMM_SPLITK", "GEMM"])):
        FakeGemLiteLayer.SETTINGS = dict(in_features=16, out_features=8, **settings)
        layer = GemLiteLinear({"W_q": torch.zeros(16, 8, dtype=torch.int8), "scales": torch.ones(1, 8).half()})
        used.clear()
        for rows in (1, 13, 100):
            assert layer(torch.zeros(rows, 16, dtype=torch.float16)).shape == (rows, 8)
        assert used == expect
    monkeypatch.setenv("RWKV_W4_GEMM_ONLY", "0")  # the A/B knob: GemLite's own choice
    FakeGemLiteLayer.SETTINGS = dict(in_features=16, out_features=8, W_nbits=4, group_size=8, channel_scale_mode=0,
                                     W_group_mode=4)
    layer = GemLiteLinear({"W_q": torch.zeros(16, 8, dtype=torch.int8), "scales": torch.ones(1, 8).half()})
    used.clear()
    layer(torch.zeros(13, 16, dtype=torch.float16))
    assert used == ["GEMM_SPLITK"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only failure")
@pytest.mark.parametrize("fmt", ["A16W8_INT8", "A16W8_FP8", "A16W4_HQQ_INT"])
def test_gemlite_export_fails_clearly_without_a_gpu(tmp_path, fmt):
    path = make_model_file(tmp_path, "L2-C128-V1024")
    with pytest.raises(SystemExit, match="GemLite export .* needs a CUDA GPU and gemlite 0.6.x"):
        export_quant_gemlite.main([str(path), str(tmp_path / "g.pth"), "--format", fmt])
    assert not (tmp_path / "g.pth").exists()


def test_gemlite_export_validates_before_needing_a_gpu(tmp_path, exported):
    path = make_model_file(tmp_path, "L2-C128-V1024")
    with pytest.raises(SystemExit, match="--group-size 48 does not divide the input widths"):
        export_quant_gemlite.main([str(path), str(tmp_path / "g.pth"), "--format", "A16W4_HQQ_INT",
                                   "--group-size", "48"])
    with pytest.raises(SystemExit, match="multiple of 8 and at least 16"):
        export_quant_gemlite.main([str(path), str(tmp_path / "g.pth"), "--format", "A16W4_HQQ_INT",
                                   "--group-size", "12"])
    with pytest.raises(SystemExit, match="already a W8A16"):
        export_quant_gemlite.main([str(exported[1]), str(tmp_path / "g.pth"), "--format", "A16W8_INT8"])


def test_the_cli_offers_exactly_the_engines_that_exist():
    import app  # the CLI keeps its own tuple so that --help does not import torch
    assert app.INFERENCE_ENGINES == ENGINES


def test_cpu_engines_never_import_gemlite(tmp_path):
    """gemlite (and our wrapper) must stay off the fp16 and cutlass paths: it cannot import without a GPU."""
    sd = w8a16_dict()
    save_checkpoint(sd, tmp_path / "w8.pth")
    code = ("import sys; from infer.model import RWKV7; from infer.quant import export_quant; "
            f"RWKV7.load({str(tmp_path / 'w8.pth')!r}, device='cpu', engine='cutlass', progress=False); "
            "bad = [m for m in sys.modules if 'gemlite' in m]; assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True, timeout=120)


@pytest.mark.parametrize("tiles", [[(64, 256), (64, 64)], []])
def test_w8a16_kernels_choose_the_gemm_and_the_gemv_rows(tiles, monkeypatch):
    """W8A16Kernels over a stand-in module: with Hopper tiles the Hopper GEMM serves batches above 4 rows
    until its self-test switches it back to the SM80 one; without them the GEMV keeps all 8 rows."""
    from types import SimpleNamespace

    from infer.ops.linear_w8a16 import SM90_GEMV_ROWS, W8A16Kernels
    monkeypatch.delenv("RWKV_W8A16_GEMV_ROWS", raising=False)
    module = SimpleNamespace(gemv=object(), gemm=object(), gemm_sm90=object(), gemm_w4_sm90=object(),
                             gemv_max_rows=lambda: 8, gemm_available=lambda: True, gemm_sm90_tiles=lambda: tiles)
    kernels = W8A16Kernels(module)
    assert kernels.hopper_gemm == bool(tiles)
    assert kernels.gemm_w4 is (module.gemm_w4_sm90 if tiles else None)  # 4-bit layers: only the Hopper GEMM
    assert kernels.gemm is (module.gemm_sm90 if tiles else module.gemm)
    assert kernels.gemm_name == ("cutlass sm90 wgmma" if tiles else "cutlass sm80")
    assert kernels.gemv_rows == (SM90_GEMV_ROWS if tiles else 8)
    kernels.gemm = kernels.gemm_sm80  # what a failed Hopper self-test does
    assert not kernels.hopper_gemm and kernels.gemm_name == "cutlass sm80"


@pytest.mark.parametrize("n_out,n_in,group,splits", [
    (4096, 16384, 64, 2),   # 7.2B FFN value: 64 tiles of 64 channels, two slices give 128 of 132 SMs one each
    (4096, 4096, 64, 2),    # 7.2B r/k/v/output
    (16384, 4096, 64, 1),   # 7.2B FFN key: 256 tiles already
    (65536, 4096, 64, 1),   # head
    (2048, 8192, 64, 4),    # 1.5B FFN value: 32 tiles, four slices of 2,048
    (2048, 2048, 64, 1),    # 1.5B r/k/v: a slice would be shorter than SPLIT_MIN_K
    (768, 3072, 64, 1),     # 0.1B FFN value: likewise
    (4096, 16384, 4096, 2),  # groups as long as a slice
    (4096, 16384, 8192, 2),
    (4096, 16384, 16384, 1),  # one group: no whole-group slice
])
def test_gemm_splits_depend_on_the_matrix_only(n_out, n_in, group, splits):
    from infer.ops.linear_w8a16 import SPLIT_MIN_K, gemm_splits
    got = gemm_splits(n_out, n_in, group, sms=132)
    assert got == splits
    assert n_in % (got * group) == 0 and (got == 1 or n_in // got >= SPLIT_MIN_K)


@pytest.mark.parametrize("n_out,n_in,splits", [
    (2048, 2048, 2),    # 1.5B r/k/v/output: two slices of 1,024 (the only matrix the shorter slice changes)
    (2048, 8192, 4),    # 1.5B FFN value: four, as for int8
    (4096, 4096, 2),    # 7.2B r/k/v/output: two, as for int8
    (4096, 16384, 2),   # 7.2B FFN value
    (768, 768, 1),      # 0.1B: shorter than a slice
])
def test_w4_gemm_splits_take_slices_of_1024(n_out, n_in, splits):
    from infer.ops.linear_w8a16 import gemm_splits
    from infer.quant.gemlite_linear import W4_SPLIT_MIN_K
    assert gemm_splits(n_out, n_in, 64, sms=132, min_k=W4_SPLIT_MIN_K) == splits
