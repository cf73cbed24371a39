"""Checkpoint loading and saving: sharded and single-file, the K2.5/K2.6 wrapper, and every error naming
the file and the tensor."""
import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from compare import assert_close
from reference import CheckpointError, load_target
from reference.checkpoint import INDEX_FILE
from reference.factory import random_target, tiny_config, write_random_target


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_random_target(str(tmp_path_factory.mktemp("ck") / "t"), seed=11)


def copy_dir(src, dst):
    os.makedirs(dst)
    for f in os.listdir(src):
        with open(os.path.join(src, f), "rb") as a, open(os.path.join(dst, f), "wb") as b:
            b.write(a.read())
    return dst


def edit_tensors(path, fn):
    file = os.path.join(path, "model.safetensors")
    state = load_file(file)
    fn(state)
    save_file(state, file, metadata={"format": "pt"})


IDS = torch.tensor([5, 9, 13, 2, 40])


def test_layout_and_names(ckpt):
    state = load_file(os.path.join(ckpt, "model.safetensors"))
    name = "model.layers.1.mlp.experts.3.down_proj"
    assert state[f"{name}.weight_packed"].dtype == torch.int32
    assert state[f"{name}.weight_packed"].shape == (32, 16 // 8)
    assert state[f"{name}.weight_scale"].dtype == torch.bfloat16
    assert state[f"{name}.weight_shape"].tolist() == [32, 16]
    assert state["model.layers.1.mlp.gate.e_score_correction_bias"].dtype == torch.float32
    assert "model.layers.0.mlp.gate_proj.weight" in state and "model.layers.0.mlp.gate.weight" not in state
    cfg = json.load(open(os.path.join(ckpt, "config.json")))
    assert cfg["quantization_config"]["format"] == "pack-quantized"


def test_sharded_and_wrapped_load_identically(ckpt, tmp_path):
    model = random_target(tiny_config(), seed=11)
    from reference import save_target
    save_target(model, model.cfg, str(tmp_path / "sharded"), dtype=torch.float32, max_shard_bytes=20_000)
    save_target(model, model.cfg, str(tmp_path / "wrapped"), dtype=torch.float32, max_shard_bytes=50_000,
                wrapper=True)
    index = json.load(open(tmp_path / "sharded" / INDEX_FILE))
    assert len(set(index["weight_map"].values())) > 2
    assert all(n.startswith("language_model.") for n in
               json.load(open(tmp_path / "wrapped" / INDEX_FILE))["weight_map"])
    want = load_target(ckpt).logits(IDS)
    for d in ("sharded", "wrapped"):
        assert torch.equal(load_target(str(tmp_path / d)).logits(IDS), want), d


def test_vision_tensors_of_a_k25_checkpoint_are_ignored(ckpt, tmp_path):
    model = random_target(tiny_config(), seed=11)
    from reference import save_target
    save_target(model, model.cfg, str(tmp_path / "w"), dtype=torch.float32, wrapper=True)
    edit_tensors(str(tmp_path / "w"), lambda s: s.update({"vision_tower.patch.weight": torch.zeros(2)}))
    assert torch.equal(load_target(str(tmp_path / "w")).logits(IDS), load_target(ckpt).logits(IDS))


def test_bf16_save_and_dtype(tmp_path):
    path = write_random_target(str(tmp_path / "b"), seed=1, dtype=torch.bfloat16)
    state = load_file(os.path.join(path, "model.safetensors"))
    assert state["lm_head.weight"].dtype == torch.bfloat16
    assert state["model.layers.2.mlp.gate.e_score_correction_bias"].dtype == torch.float32
    model = load_target(path, dtype=torch.float32)
    assert model.lm_head.weight.dtype == torch.float32
    assert model.model.layers[1].mlp.experts[0].up_proj.weight_scale.dtype == torch.bfloat16


def test_save_is_atomic(tmp_path, monkeypatch):
    """A save that dies after writing part of the files leaves neither a half directory nor temp files."""
    import reference.checkpoint as ck
    real = ck.save_file
    calls = []

    def dies_on_second_shard(tensors, file, metadata=None):
        calls.append(file)
        real(tensors, file, metadata=metadata)
        if len(calls) == 2:
            raise OSError("disk full")
    monkeypatch.setattr(ck, "save_file", dies_on_second_shard)
    model = random_target(tiny_config(), seed=2)
    with pytest.raises(OSError, match="disk full"):
        ck.save_target(model, model.cfg, str(tmp_path / "x"), max_shard_bytes=20_000)
    assert len(calls) == 2 and os.listdir(tmp_path) == [], "a failed save must leave nothing behind"


CASES = {
    "missing": (lambda s: s.pop("model.layers.2.self_attn.o_proj.weight"), r"missing tensor 'model\.layers\.2\."),
    "unexpected": (lambda s: s.update({"model.layers.0.extra.weight": torch.zeros(1)}),
                   r"model\.safetensors: unexpected tensor 'model\.layers\.0\.extra\.weight'"),
    "shape": (lambda s: s.update({"model.norm.weight": torch.zeros(31)}),
              r"model\.safetensors: tensor 'model\.norm\.weight' has shape \(31,\), expected \(32,\)"),
    "dtype": (lambda s: s.update({"model.layers.1.mlp.experts.0.up_proj.weight_packed":
                                  torch.zeros(16, 4, dtype=torch.int64)}), r"int64, expected torch\.int32"),
    "float_dtype": (lambda s: s.update({"lm_head.weight": torch.zeros(97, 32, dtype=torch.int8)}),
                    r"'lm_head\.weight' has dtype torch\.int8, expected a float"),
    "weight_shape": (lambda s: s.update({"model.layers.1.mlp.experts.0.up_proj.weight_shape":
                                         torch.tensor([16, 64])}), r"does not match its weight_packed"),
    "packed_outside_experts": (
        lambda s: s.update({"model.layers.1.self_attn.o_proj.weight_packed": torch.zeros(32, 4, dtype=torch.int32)}),
        r"only routed experts"),
    "unquantized_expert": (
        lambda s: s.update({"model.layers.1.mlp.experts.0.up_proj.weight": torch.zeros(16, 32)}),
        r"unquantized routed expert"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_bad_tensors_name_file_and_tensor(ckpt, tmp_path, case):
    fn, match = CASES[case]
    path = copy_dir(ckpt, str(tmp_path / case))
    edit_tensors(path, fn)
    with pytest.raises(CheckpointError, match=match):
        load_target(path)


def test_truncated_file(ckpt, tmp_path):
    path = copy_dir(ckpt, str(tmp_path / "trunc"))
    file = os.path.join(path, "model.safetensors")
    data = open(file, "rb").read()
    open(file, "wb").write(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match=r"model\.safetensors.*(truncated or corrupt)"):
        load_target(path)


def test_garbage_file(ckpt, tmp_path):
    path = copy_dir(ckpt, str(tmp_path / "garbage"))
    open(os.path.join(path, "model.safetensors"), "wb").write(b"\x00" * 100)
    with pytest.raises(CheckpointError, match="truncated or corrupt"):
        load_target(path)


def test_missing_shard_and_bad_index(tmp_path):
    model = random_target(tiny_config(), seed=2)
    from reference import save_target
    save_target(model, model.cfg, str(tmp_path / "s"), dtype=torch.float32, max_shard_bytes=20_000)
    shard = sorted(f for f in os.listdir(tmp_path / "s") if f.endswith(".safetensors"))[1]
    os.remove(tmp_path / "s" / shard)
    with pytest.raises(CheckpointError, match=f"names shard '{shard}', which is missing"):
        load_target(str(tmp_path / "s"))
    (tmp_path / "s" / INDEX_FILE).write_text("{not json")
    with pytest.raises(CheckpointError, match="not a valid safetensors index"):
        load_target(str(tmp_path / "s"))


def test_unsupported_quantization(ckpt, tmp_path):
    path = copy_dir(ckpt, str(tmp_path / "q"))
    cfg = json.load(open(os.path.join(path, "config.json")))
    cfg["quantization_config"]["format"] = "marlin-24"
    json.dump(cfg, open(os.path.join(path, "config.json"), "w"))
    with pytest.raises(CheckpointError, match="format 'marlin-24' unsupported"):
        load_target(path)
    del cfg["quantization_config"]
    json.dump(cfg, open(os.path.join(path, "config.json"), "w"))
    with pytest.raises(CheckpointError, match="no quantization_config"):
        load_target(path)


def test_not_a_directory_and_no_config(tmp_path):
    with pytest.raises(CheckpointError, match="not a directory"):
        load_target(str(tmp_path / "nope"))
    with pytest.raises(CheckpointError, match="config.json"):
        load_target(str(tmp_path))


def test_int4_dequantized_on_use_matches_float_weights(ckpt):
    """The packed expert, dequantized, is what the forward multiplies by (bf16 path == exact q*s rounded)."""
    model = load_target(ckpt, dtype=torch.bfloat16)
    lin = model.model.layers[1].mlp.experts[2].gate_proj
    exact = lin.dequantized(torch.float64)
    assert torch.equal(lin.dequantized(torch.bfloat16), exact.to(torch.bfloat16))
    x = torch.randn(3, 32, dtype=torch.float64)
    assert_close(lin(x), x @ exact.T, "float64_reassoc", "Int4Linear forward")
