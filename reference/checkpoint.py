"""Load and save HF-format target directories exactly as Kimi ships them.

A directory holds `config.json` and either one `*.safetensors` file or shards listed in
`model.safetensors.index.json` (`weight_map`: tensor name -> shard file). Tensor names are the module
names of `reference.target.Target` (plus `language_model.` for K2.5/K2.6 wrappers). Routed experts under a
compressed-tensors `quantization_config` are stored as `weight_packed` int32 / `weight_scale` / `weight_shape`
and stay packed in memory; every other tensor is a float (bf16 in real checkpoints; the router's
`e_score_correction_bias` float32).

Every failure raises `CheckpointError` naming the file and the tensor: a missing or unexpected tensor, a wrong
shape or dtype, a truncated or corrupt safetensors file, a shard the index names but the directory lacks, a
quantized tensor where the format allows none.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from typing import Optional

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from .config import ConfigError, TargetConfig, load_config
from .target import Target, rope_inv_freq

__all__ = ["CheckpointError", "load_target", "save_target", "target_state_dict", "INDEX_FILE"]

INDEX_FILE = "model.safetensors.index.json"
_EXPERT = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate|up|down)_proj\.")
# Tensors a Kimi checkpoint may carry that the text model does not use.
_IGNORED = re.compile(r"^(vision_tower\.|mm_projector\.|multi_modal_projector\.)|rotary_emb\.inv_freq$")


class CheckpointError(ValueError):
    """A checkpoint this reference cannot load, with the file and tensor named."""


def _shard_map(path: str) -> dict[str, str]:
    """tensor name -> absolute shard path, from the index if present, else from the one safetensors file."""
    index = os.path.join(path, INDEX_FILE)
    if os.path.exists(index):
        try:
            with open(index) as f:
                weight_map = json.load(f)["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise CheckpointError(f"{index}: not a valid safetensors index ({e!r})") from None
        for shard in sorted(set(weight_map.values())):
            if not os.path.exists(os.path.join(path, shard)):
                raise CheckpointError(f"{index}: names shard {shard!r}, which is missing from {path}")
        return {name: os.path.join(path, shard) for name, shard in weight_map.items()}
    files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    if len(files) != 1:
        raise CheckpointError(f"{path}: expected one .safetensors file or {INDEX_FILE}, found {files or 'none'}")
    file = os.path.join(path, files[0])
    with _open(file) as f:
        return {name: file for name in f.keys()}


def _open(file: str):
    try:
        return safe_open(file, framework="pt")
    except Exception as e:  # safetensors raises its own SafetensorError / OSError
        raise CheckpointError(f"{file}: truncated or corrupt safetensors file ({e})") from None


def expected_tensors(cfg: TargetConfig) -> dict[str, tuple[tuple, str]]:
    """name (without the wrapper prefix) -> (shape, kind) where kind is "float", "int32" or "shape"."""
    model = _meta_model(cfg)
    out = {}
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        if name == "inv_freq":
            continue
        kind = "int32" if name.endswith("weight_packed") else "shape" if name.endswith("weight_shape") else "float"
        out[name] = (tuple(t.shape), kind)
    return out


def _meta_model(cfg: TargetConfig) -> Target:
    with torch.device("meta"):
        return Target(cfg)


def _check(file: str, name: str, t: torch.Tensor, shape: tuple, kind: str) -> None:
    if kind == "int32" and t.dtype != torch.int32:
        raise CheckpointError(f"{file}: tensor {name!r} has dtype {t.dtype}, expected torch.int32 (packed INT4)")
    if kind == "shape" and t.dtype not in (torch.int32, torch.int64):
        raise CheckpointError(f"{file}: tensor {name!r} has dtype {t.dtype}, expected int32 or int64")
    if kind == "float" and not t.dtype.is_floating_point:
        raise CheckpointError(f"{file}: tensor {name!r} has dtype {t.dtype}, expected a float dtype")
    if tuple(t.shape) != shape:
        raise CheckpointError(f"{file}: tensor {name!r} has shape {tuple(t.shape)}, expected {shape}")


def checkpoint_config(path: str):
    """The TargetConfig of a checkpoint directory; CheckpointError when it is not one or its config is bad."""
    if not os.path.isdir(path):
        raise CheckpointError(f"{path}: not a directory (a target checkpoint is an HF-format directory)")
    try:
        return load_config(path)
    except ConfigError as e:
        raise CheckpointError(str(e)) from None


def load_target(path: str, dtype: torch.dtype = torch.float32, device="cpu") -> Target:
    """Load an HF-format K2 / DeepSeek-V3 directory. Float weights are cast to `dtype`; routed INT4 experts
    stay packed (int32 words + their stored scales) and are dequantized when used."""
    cfg = checkpoint_config(path)
    where = _shard_map(path)
    prefix = cfg.tensor_prefix
    quantized = cfg.quantization_config is not None
    expected = expected_tensors(cfg)

    # Names in the file -> names in the model; anything not accounted for is reported.
    file_names = {}
    for name, file in where.items():
        if _IGNORED.search(name):
            continue
        if prefix and not name.startswith(prefix):
            raise CheckpointError(f"{file}: unexpected tensor {name!r} (K2.5/K2.6 text tensors carry the "
                                  f"{prefix!r} prefix)")
        file_names[name[len(prefix):]] = (name, file)
    for short, (name, file) in file_names.items():
        if short.endswith(("weight_packed", "weight_scale", "weight_shape")) and not quantized:
            raise CheckpointError(f"{file}: tensor {name!r} is packed INT4 but config.json has no "
                                  "quantization_config (unsupported quantization format)")
        if short.endswith("weight_packed") and not _EXPERT.match(short):
            raise CheckpointError(f"{file}: tensor {name!r} is packed INT4; only routed experts "
                                  "(mlp.experts.*) may be quantized in this format")
        if short not in expected:
            if quantized and _EXPERT.match(short) and short.endswith(".weight"):
                raise CheckpointError(f"{file}: tensor {name!r} is an unquantized routed expert, but "
                                      "quantization_config says routed experts are pack-quantized INT4")
            raise CheckpointError(f"{file}: unexpected tensor {name!r}")
    for short in expected:
        if short not in file_names:
            raise CheckpointError(f"{path}: missing tensor {prefix + short!r}")

    model = _meta_model(cfg)          # filled by assignment below: nothing is allocated twice
    state = {}
    by_file: dict[str, list[str]] = {}
    for short, (name, file) in file_names.items():
        by_file.setdefault(file, []).append(short)
    for file, shorts in sorted(by_file.items()):
        with _open(file) as f:
            for short in shorts:
                name = file_names[short][0]
                try:
                    t = f.get_tensor(name)
                except Exception as e:
                    raise CheckpointError(f"{file}: tensor {name!r} cannot be read: truncated or corrupt "
                                          f"file ({e})") from None
                shape, kind = expected[short]
                _check(file, name, t, shape, kind)
                if kind == "shape":
                    want = list(_module(model, short).weight_packed.shape)
                    want[1] *= 8
                    if t.tolist()[0] != want[0] or not want[1] - 8 < t.tolist()[1] <= want[1]:
                        raise CheckpointError(f"{file}: tensor {name!r} = {t.tolist()} does not match its "
                                              f"weight_packed shape")
                    t = t.to(torch.int64)
                elif kind == "float" and not short.endswith(("weight_scale", "e_score_correction_bias")):
                    t = t.to(dtype)
                state[short] = t.to(device)
    model.load_state_dict(state, strict=True, assign=True)
    model.inv_freq = rope_inv_freq(cfg.qk_rope_head_dim, cfg.rope_theta, cfg.rope_scaling).to(device)
    return model.eval()


def _module(model: Target, tensor_name: str):
    return model.get_submodule(tensor_name.rsplit(".", 1)[0])


def target_state_dict(model: Target) -> dict[str, torch.Tensor]:
    """The checkpoint tensors of `model` under their file names (wrapper prefix included)."""
    prefix = model.cfg.tensor_prefix
    out = {}
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        if name == "inv_freq":
            continue
        out[prefix + name] = t.detach()
    return out


def save_target(model_or_state, cfg: TargetConfig, path: str, dtype: Optional[torch.dtype] = torch.bfloat16,
                max_shard_bytes: Optional[int] = None, wrapper: bool = False) -> None:
    """Write an HF-format directory: config.json, safetensors (sharded with an index past
    `max_shard_bytes`). Float tensors are cast to `dtype` (bf16 as Kimi ships; None keeps them), the router
    bias stays float32, INT4 tensors as they are. `wrapper=True` writes the K2.5/K2.6 layout (text_config +
    `language_model.` names). The directory appears whole or not at all (written aside, then renamed)."""
    state = target_state_dict(model_or_state) if isinstance(model_or_state, Target) else dict(model_or_state)
    prefix = "language_model." if wrapper else ""
    out = {}
    for name, t in state.items():
        short = name[len(cfg.tensor_prefix):] if cfg.tensor_prefix and name.startswith(cfg.tensor_prefix) else name
        t = t.detach().cpu().contiguous()
        if dtype is not None and t.dtype.is_floating_point and not short.endswith(
                ("e_score_correction_bias", "weight_scale")):
            t = t.to(dtype)
        out[prefix + short] = t
    config = cfg.to_dict()
    if dtype is not None:
        config["torch_dtype"] = str(dtype).replace("torch.", "")
    if wrapper:
        q = config.pop("quantization_config", None)
        config = {"architectures": ["KimiK25ForConditionalGeneration"], "model_type": "kimi_k25",
                  "text_config": {**config, "model_type": "kimi_k2"}}
        if q is not None:
            config["quantization_config"] = q

    def write(tmp: str) -> None:
        with open(os.path.join(tmp, "config.json"), "w") as f:
            json.dump(config, f, indent=2)
        shards: list[dict] = [{}]
        size = 0
        for name in sorted(out):
            nbytes = out[name].numel() * out[name].element_size()
            if max_shard_bytes is not None and shards[-1] and size + nbytes > max_shard_bytes:
                shards.append({})
                size = 0
            shards[-1][name] = out[name]
            size += nbytes
        if len(shards) == 1:
            save_file(shards[0], os.path.join(tmp, "model.safetensors"), metadata={"format": "pt"})
            return
        n = len(shards)
        weight_map = {}
        for i, shard in enumerate(shards, 1):
            file = f"model-{i:05d}-of-{n:06d}.safetensors"   # Kimi names shards ...-of-000062
            save_file(shard, os.path.join(tmp, file), metadata={"format": "pt"})
            weight_map.update({name: file for name in shard})
        total = sum(t.numel() * t.element_size() for t in out.values())
        with open(os.path.join(tmp, INDEX_FILE), "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)

    write_directory_atomically(path, write)


def write_directory_atomically(path: str, write) -> None:
    """Call write(tmp_dir) on a fresh directory beside `path`, then rename it to `path` (replacing an old
    one): readers see the old directory or the whole new one, never a half-written one."""
    parent = os.path.dirname(os.path.abspath(path))
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".tmp-", dir=parent)
    try:
        write(tmp)
        if os.path.exists(path):
            shutil.rmtree(path)
        os.replace(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
