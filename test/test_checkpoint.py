"""Checkpoint loading: formats, path forms, and a clear error for every bad input."""
from __future__ import annotations


import pytest
import torch

from conftest import MODEL_SHAPES, make_model_file
from infer.checkpoint import CheckpointError, open_checkpoint, infer_config
from infer.model import RWKV7
from infer.random_model import make_config, random_state_dict, save_checkpoint

NAME = "L2-C128-V1024"


@pytest.fixture(scope="module")
def reference_logits(model_dir):
    model = RWKV7.load(str(make_model_file(model_dir, NAME, torch.float32)), device="cpu")
    return model.prefill([[1, 2, 3, 4, 5]], [0], model.new_state_pool(1))


def small_sd() -> dict[str, torch.Tensor]:
    return random_state_dict(make_config(2, 128, 256), seed=5, dtype=torch.float32)


def load_error(tmp_path, sd_or_bytes, name="bad.pth") -> str:
    path = tmp_path / name
    if isinstance(sd_or_bytes, bytes):
        path.write_bytes(sd_or_bytes)
    else:
        save_checkpoint(sd_or_bytes, path)
    with pytest.raises(CheckpointError) as info:
        RWKV7.load(str(path), device="cpu")
    return str(info.value)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("suffix", [".pth", ".safetensors"])
def test_formats_and_dtypes_load(model_dir, reference_logits, dtype, suffix):
    path = make_model_file(model_dir, NAME, dtype, suffix)
    model = RWKV7.load(str(path), device="cpu")
    shape = MODEL_SHAPES[NAME]
    assert (model.config.n_layer, model.config.n_embd, model.config.vocab_size) == \
        (shape["n_layer"], shape["n_embd"], shape["vocab_size"])
    assert model.config.n_head == 2 and model.config.head_size == 64 and model.config.ffn_dim == 512
    logits = model.prefill([[1, 2, 3, 4, 5]], [0], model.new_state_pool(1))
    tol = 0 if dtype == torch.float32 else 0.5  # stored precision differs; same model
    assert (logits - reference_logits).abs().max().item() <= tol


def test_path_without_extension(model_dir):
    path = make_model_file(model_dir, NAME, torch.float32)
    assert RWKV7.load(str(path)[:-4], device="cpu").config.n_layer == 2


def test_key_order_does_not_matter(tmp_path, model_dir, reference_logits):
    sd = torch.load(make_model_file(model_dir, NAME, torch.float32))
    shuffled = dict(reversed(list(sd.items())))
    save_checkpoint(shuffled, tmp_path / "rev.pth")
    model = RWKV7.load(str(tmp_path / "rev.pth"), device="cpu")
    assert torch.equal(model.prefill([[1, 2, 3, 4, 5]], [0], model.new_state_pool(1)), reference_logits)


def test_layer0_value_residual_keys_are_optional(tmp_path):
    sd = small_sd()
    sd["blocks.0.att.v0"] = torch.zeros(1, 1, 128)
    sd["blocks.0.att.v1"] = torch.zeros(128, 32)
    sd["blocks.0.att.v2"] = torch.zeros(32, 128)
    save_checkpoint(sd, tmp_path / "with_v.pth")
    assert RWKV7.load(str(tmp_path / "with_v.pth"), device="cpu").config.rank_v == 32


def test_loading_consumes_the_source_one_tensor_at_a_time(tmp_path):
    """No second full copy: the loader drops each source tensor once converted."""
    save_checkpoint(small_sd(), tmp_path / "m.pth")
    src = open_checkpoint(str(tmp_path / "m.pth"))
    RWKV7.from_source(src, device="cpu", progress=False)
    assert src.keys() == []


def test_missing_file(tmp_path):
    with pytest.raises(CheckpointError, match="checkpoint not found.*nope"):
        RWKV7.load(str(tmp_path / "nope"), device="cpu")


def test_directory_is_not_a_checkpoint(tmp_path):
    with pytest.raises(CheckpointError, match="is a directory"):
        RWKV7.load(str(tmp_path), device="cpu")


def test_not_a_checkpoint(tmp_path):
    assert "not a PyTorch checkpoint" in load_error(tmp_path, b"hello, I am a text file\n" * 10)


def test_pickle_of_wrong_object(tmp_path):
    torch.save([1, 2, 3], tmp_path / "list.pth")
    with pytest.raises(CheckpointError, match="not a checkpoint: expected a dict"):
        RWKV7.load(str(tmp_path / "list.pth"), device="cpu")


def test_bad_safetensors(tmp_path):
    (tmp_path / "x.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{broken json...")
    with pytest.raises(CheckpointError, match="not a readable .safetensors"):
        RWKV7.load(str(tmp_path / "x.safetensors"), device="cpu")


def test_missing_keys_are_named(tmp_path):
    sd = small_sd()
    del sd["blocks.1.att.k_a"], sd["ln_out.bias"]
    msg = load_error(tmp_path, sd)
    assert "missing key(s)" in msg and "blocks.1.att.k_a" in msg and "ln_out.bias" in msg


def test_missing_layer_is_named(tmp_path):
    sd = {k: v for k, v in small_sd().items() if not k.startswith("blocks.0.ffn.")}
    assert "blocks.0.ffn.key.weight" in load_error(tmp_path, sd)


def test_misshapen_keys_are_named(tmp_path):
    sd = small_sd()
    sd["blocks.1.att.key.weight"] = torch.zeros(128, 64)
    msg = load_error(tmp_path, sd)
    assert "misshapen" in msg and "blocks.1.att.key.weight [128, 64]" in msg and "want [128, 128]" in msg


def test_head_size_other_than_64(tmp_path):
    sd = small_sd()
    for i in range(2):
        sd[f"blocks.{i}.att.r_k"] = torch.zeros(4, 32)
    assert "head size 32 is not supported" in load_error(tmp_path, sd)


def test_non_float_tensor(tmp_path):
    sd = small_sd()
    sd["blocks.1.att.x_r"] = torch.zeros(1, 1, 128, dtype=torch.int32)
    assert "non-float" in load_error(tmp_path, sd)


@pytest.mark.parametrize("extra,needle", [
    ({"blocks.0.ffn.s_emb.weight": torch.zeros(256, 32)}, "DeepEmbed"),
    ({"blocks.0.att.x_x": torch.zeros(6, 128)}, "legacy fused"),
    ({"blocks.0.att.time_decay": torch.zeros(128)}, "RWKV-4/5/6"),
    ({"blocks.1.att.q_proj.weight": torch.zeros(128, 128)}, "unexpected key(s)"),
])
def test_unsupported_variants(tmp_path, extra, needle):
    sd = small_sd()
    sd.update(extra)
    assert needle in load_error(tmp_path, sd)


def test_hf_layout_rejected(tmp_path):
    sd = {"model.embeddings.weight": torch.zeros(10, 64), "model.layers.0.attn.r_proj.weight": torch.zeros(64, 64)}
    assert "Hugging Face" in load_error(tmp_path, sd)


def test_unrelated_dict_rejected(tmp_path):
    assert "not an RWKV-7 checkpoint" in load_error(tmp_path, {"conv1.weight": torch.zeros(3, 3)})


def test_infer_config_reads_lora_ranks(model_dir):
    config = infer_config(open_checkpoint(str(make_model_file(model_dir, "L4-C192-V65536", torch.float32))))
    assert (config.n_layer, config.n_head, config.rank_w, config.rank_g) == (4, 3, 32, 64)
