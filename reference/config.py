"""Model configs read from HF `config.json`: the Kimi K2 / DeepSeek-V3 target and the DFlash drafter.

Field names equal the JSON keys (DeepSeek-V3 `ModelArgs(**json)` style), so a config file maps onto a
dataclass with no rename table.  Loading a config never allocates weights: a K2.6-sized config is a few
hundred bytes of Python.

Accepted target layouts:
  * `model_type` "deepseek_v3" or "kimi_k2" at the top level (tensor names `model.*`, `lm_head.*`);
  * K2.5 / K2.6 nesting: a wrapper (`kimi_k25`) whose `text_config` holds the text model; tensor names then
    carry the `language_model.` prefix and the wrapper's `quantization_config` applies.
Both the classic `rope_scaling` + `rope_theta` keys and transformers >= 5's `rope_parameters` are read.
Anything this reference does not implement raises `ConfigError` naming the field, never a guess.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import dataclass
from typing import Any, Optional

__all__ = ["ConfigError", "RopeScaling", "QuantizationConfig", "TargetConfig", "DrafterConfig",
           "load_config", "load_drafter_config", "yarn_mscale"]


class ConfigError(ValueError):
    """A config.json this reference cannot run, with the file and field named."""


def _unfold_rope_parameters(d: dict) -> None:
    """transformers >= 5 folds rope_theta and rope_scaling into rope_parameters: read them back out."""
    rp = d.get("rope_parameters")
    if rp is not None:
        d.setdefault("rope_theta", rp.get("rope_theta"))
        if (rp.get("rope_type") or rp.get("type")) not in (None, "default"):
            d.setdefault("rope_scaling", rp)


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN magnitude correction `0.1 * mscale * ln(scale) + 1` (1.0 when not extending)."""
    return 1.0 if scale <= 1.0 else 0.1 * mscale * math.log(scale) + 1.0


@dataclass(frozen=True)
class RopeScaling:
    """YaRN `rope_scaling` (the only scaling K2 uses). Defaults are HF's for missing keys."""
    type: str = "yarn"
    factor: float = 1.0
    original_max_position_embeddings: int = 4096
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 0.0
    truncate: bool = True                 # floor/ceil the correction range (HF default)
    attention_factor: Optional[float] = None  # explicit cos/sin amplitude; None -> mscale/mscale_all_dim ratio

    @classmethod
    def from_json(cls, rs: dict, where: str) -> "RopeScaling":
        kind = rs.get("type") or rs.get("rope_type")
        if kind != "yarn":
            raise ConfigError(f"{where}: rope_scaling type {kind!r} unsupported (K2 and its drafters use 'yarn')")
        names = {f.name for f in dataclasses.fields(cls)} - {"type"}
        return cls(**{k: v for k, v in rs.items() if k in names and v is not None})

    @property
    def amplitude(self) -> float:
        """cos/sin multiplier (HF `attention_scaling`): 1.0 for Kimi, whose mscale == mscale_all_dim."""
        if self.attention_factor is not None:
            return float(self.attention_factor)
        if self.mscale and self.mscale_all_dim:
            return yarn_mscale(self.factor, self.mscale) / yarn_mscale(self.factor, self.mscale_all_dim)
        return yarn_mscale(self.factor)


@dataclass(frozen=True)
class QuantizationConfig:
    """compressed-tensors `pack-quantized` INT4 weights (the only format this suite reads)."""
    quant_method: str = "compressed-tensors"
    format: str = "pack-quantized"
    num_bits: int = 4
    type: str = "int"
    symmetric: bool = True
    strategy: str = "group"
    group_size: int = 32
    targets: tuple = ("Linear",)
    ignore: tuple = ()

    def to_json(self) -> dict:
        """The compressed-tensors block as Kimi ships it (what `save_target` writes)."""
        return {
            "quant_method": self.quant_method, "format": self.format, "quantization_status": "compressed",
            "kv_cache_scheme": None,
            "config_groups": {"group_0": {
                "targets": list(self.targets), "input_activations": None, "output_activations": None,
                "weights": {"num_bits": self.num_bits, "type": self.type, "symmetric": self.symmetric,
                            "strategy": self.strategy, "group_size": self.group_size, "dynamic": False,
                            "actorder": None, "observer": "minmax", "observer_kwargs": {},
                            "block_structure": None}}},
            "ignore": list(self.ignore),
        }

    @classmethod
    def from_json(cls, q: dict, where: str) -> "QuantizationConfig":
        def need(cond, what):
            if not cond:
                raise ConfigError(f"{where}: quantization_config: {what}; this suite reads only compressed-tensors "
                                  "pack-quantized symmetric INT4 with group strategy (Kimi K2-Thinking/K2.5/K2.6)")
        need(q.get("quant_method") == "compressed-tensors", f"quant_method {q.get('quant_method')!r} unsupported")
        need(q.get("format") == "pack-quantized", f"format {q.get('format')!r} unsupported")
        groups = q.get("config_groups") or {}
        need(len(groups) == 1, f"expected exactly one config group, found {len(groups)}")
        (group,) = groups.values()
        w = group.get("weights") or {}
        need(w.get("num_bits") == 4, f"num_bits {w.get('num_bits')!r} unsupported")
        need(w.get("type", "int") == "int", f"type {w.get('type')!r} unsupported")
        need(w.get("symmetric") is True, "asymmetric (zero-point) weights unsupported")
        need(w.get("strategy") == "group", f"strategy {w.get('strategy')!r} unsupported")
        need(w.get("actorder") in (None, False), "activation-ordered (g_idx) weights unsupported")
        need(isinstance(w.get("group_size"), int) and w["group_size"] > 0, "group_size must be a positive int")
        need(group.get("input_activations") is None, "quantized activations unsupported (W4A16 only)")
        return cls(num_bits=4, group_size=int(w["group_size"]), symmetric=True,
                   targets=tuple(group.get("targets") or ()), ignore=tuple(q.get("ignore") or ()))


@dataclass(frozen=True)
class TargetConfig:
    """The Kimi K2 / DeepSeek-V3 text model. Names are the config.json keys."""
    vocab_size: int
    hidden_size: int
    intermediate_size: int                # dense-layer SwiGLU width (layers < first_k_dense_replace)
    moe_intermediate_size: int            # per routed / shared expert width
    num_hidden_layers: int
    num_attention_heads: int
    n_routed_experts: int
    num_experts_per_tok: int
    n_shared_experts: int
    kv_lora_rank: int
    q_lora_rank: Optional[int]            # None: a plain q_proj (DeepSeek-V2-Lite style)
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    first_k_dense_replace: int = 0
    norm_topk_prob: bool = True
    scoring_func: str = "sigmoid"
    topk_method: str = "noaux_tc"
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: Optional[RopeScaling] = None
    max_position_embeddings: int = 4096
    rope_interleave: bool = True                # GPT-J pairs (x[2i], x[2i+1]); False: NeoX halves
    num_key_value_heads: Optional[int] = None   # a config field only; MLA ignores it
    moe_layer_freq: int = 1
    hidden_act: str = "silu"
    attention_bias: bool = False
    tie_word_embeddings: bool = False
    bos_token_id: Optional[int] = None
    eos_token_id: tuple = ()                    # K2 ships one or several; stop on all of them
    pad_token_id: Optional[int] = None
    model_type: str = "deepseek_v3"
    torch_dtype: str = "bfloat16"
    quantization_config: Optional[QuantizationConfig] = None
    tensor_prefix: str = ""                     # "language_model." for K2.5/K2.6 wrappers

    # ---- derived -------------------------------------------------------------------------------
    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_dim(self) -> int:
        """Values cached per token per layer: kv_lora_rank + qk_rope_head_dim (576 for K2)."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def softmax_scale(self) -> float:
        """qk_head_dim^-0.5, times mscale(factor, mscale_all_dim)^2 under YaRN (0.1446796 for K2.6)."""
        scale = self.qk_head_dim ** -0.5
        rs = self.rope_scaling
        if rs is not None and rs.mscale_all_dim:
            m = yarn_mscale(rs.factor, rs.mscale_all_dim)
            scale *= m * m
        return scale

    def is_moe_layer(self, layer: int) -> bool:
        return self.n_routed_experts > 0 and layer >= self.first_k_dense_replace \
            and layer % self.moe_layer_freq == 0

    # ---- parsing ---------------------------------------------------------------------------------
    @classmethod
    def from_dict(cls, d: dict, where: str = "config.json") -> "TargetConfig":
        d = dict(d)
        prefix = ""
        quant = d.get("quantization_config")
        if "text_config" in d:                              # K2.5 / K2.6 multimodal wrapper
            d = dict(d["text_config"])
            prefix = "language_model."
            quant = d.get("quantization_config", quant)
            where = f"{where}: text_config"
        mt = d.get("model_type")
        if mt not in ("deepseek_v3", "kimi_k2"):
            raise ConfigError(f"{where}: model_type {mt!r} is not a Kimi K2 / DeepSeek-V3 text model "
                              "(expected 'deepseek_v3' or 'kimi_k2', or a wrapper with text_config)")
        _unfold_rope_parameters(d)
        names = {f.name for f in dataclasses.fields(cls)}
        missing = [f.name for f in dataclasses.fields(cls)
                   if f.default is dataclasses.MISSING and f.name not in d]
        if missing:
            raise ConfigError(f"{where}: missing required field(s) {missing}")
        kw: dict[str, Any] = {k: d[k] for k in names if k in d and k not in
                              ("rope_scaling", "quantization_config", "tensor_prefix", "eos_token_id")}
        if kw.get("torch_dtype") is None:
            kw["torch_dtype"] = str(d.get("dtype") or "bfloat16").replace("torch.", "")
        kw["tensor_prefix"] = prefix
        eos = d.get("eos_token_id")
        kw["eos_token_id"] = tuple(eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (eos,))
        if d.get("rope_scaling") is not None:
            kw["rope_scaling"] = RopeScaling.from_json(d["rope_scaling"], where)
        if quant is not None:
            kw["quantization_config"] = QuantizationConfig.from_json(quant, where)
        cfg = cls(**kw)
        cfg._validate(where)
        return cfg

    def _validate(self, where: str) -> None:
        def need(cond, msg):
            if not cond:
                raise ConfigError(f"{where}: {msg}")
        need(self.scoring_func == "sigmoid", f"scoring_func {self.scoring_func!r} unsupported (K2: 'sigmoid')")
        need(self.topk_method == "noaux_tc", f"topk_method {self.topk_method!r} unsupported (K2: 'noaux_tc')")
        need(self.hidden_act == "silu", f"hidden_act {self.hidden_act!r} unsupported (K2: 'silu')")
        need(not self.attention_bias, "attention_bias=true unsupported (K2: false)")
        need(self.moe_layer_freq == 1, f"moe_layer_freq {self.moe_layer_freq} unsupported (K2: 1)")
        need(self.n_routed_experts % self.n_group == 0, "n_routed_experts must be divisible by n_group")
        need(1 <= self.topk_group <= self.n_group, "topk_group must be in 1..n_group")
        need(self.num_experts_per_tok <= self.n_routed_experts, "num_experts_per_tok > n_routed_experts")
        if self.n_group > 1:
            need(self.n_routed_experts // self.n_group >= 2, "group-limited routing needs >= 2 experts per group")
            need(self.num_experts_per_tok <= self.topk_group * self.n_routed_experts // self.n_group,
                 "num_experts_per_tok exceeds the experts of topk_group groups")
        need(self.qk_rope_head_dim % 2 == 0, "qk_rope_head_dim must be even (rotary pairs)")
        q = self.quantization_config
        if q is not None:
            for inner in (self.moe_intermediate_size, self.hidden_size):
                need(inner % q.group_size == 0 and inner % 8 == 0,
                     f"expert input dims must be divisible by group_size {q.group_size} and by 8 (int32 packing)")

    def to_dict(self) -> dict:
        """config.json for a top-level (non-wrapped) checkpoint, as `save_target` writes it."""
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
             if f.name not in ("rope_scaling", "quantization_config", "tensor_prefix", "eos_token_id")}
        d["architectures"] = ["DeepseekV3ForCausalLM"]
        eos = list(self.eos_token_id)
        d["eos_token_id"] = eos[0] if len(eos) == 1 else (eos or None)
        if self.rope_scaling is not None:
            d["rope_scaling"] = {"type": "yarn", **{k: v for k, v in dataclasses.asdict(self.rope_scaling).items()
                                                   if k != "type" and v is not None}}
        if self.quantization_config is not None:
            d["quantization_config"] = self.quantization_config.to_json()
        return d


@dataclass(frozen=True)
class DrafterConfig:
    """A DFlash drafter (`DFlashDraftModel`): Qwen3 layers + `dflash_config`. Names are the JSON keys."""
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int
    vocab_size: int
    block_size: int
    target_layer_ids: tuple
    mask_token_id: int
    head_dim: Optional[int] = None
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: Optional[RopeScaling] = None
    max_position_embeddings: int = 32768
    attention_bias: bool = False
    hidden_act: str = "silu"
    num_target_layers: Optional[int] = None
    input_embedding_scale: float = 1.0
    output_multiplier: float = 1.0
    final_logit_softcapping: Optional[float] = None
    torch_dtype: str = "bfloat16"

    @property
    def dim_head(self) -> int:
        return self.head_dim or self.hidden_size // self.num_attention_heads

    @classmethod
    def from_dict(cls, d: dict, where: str = "config.json") -> "DrafterConfig":
        d = dict(d)
        dc = dict(d.get("dflash_config") or {})
        if "target_layer_ids" not in dc or "mask_token_id" not in dc:
            raise ConfigError(f"{where}: a DFlash drafter needs dflash_config.target_layer_ids and "
                              "dflash_config.mask_token_id")
        _unfold_rope_parameters(d)
        if "block_size" not in d and "block_size" not in dc:
            raise ConfigError(f"{where}: missing block_size")
        names = {f.name for f in dataclasses.fields(cls)}
        kw = {k: d[k] for k in names if k in d and d[k] is not None and k != "rope_scaling"}
        for k in ("block_size", "input_embedding_scale", "output_multiplier", "final_logit_softcapping"):
            if dc.get(k) is not None:
                kw[k] = dc[k]
        kw["target_layer_ids"] = tuple(int(i) for i in dc["target_layer_ids"])
        kw["mask_token_id"] = int(dc["mask_token_id"])
        if "dtype" in d and "torch_dtype" not in d and d["dtype"] is not None:
            kw["torch_dtype"] = str(d["dtype"]).replace("torch.", "")
        if d.get("rope_scaling") is not None:
            kw["rope_scaling"] = RopeScaling.from_json(d["rope_scaling"], where)
        missing = [f.name for f in dataclasses.fields(cls) if f.default is dataclasses.MISSING and f.name not in kw]
        if missing:
            raise ConfigError(f"{where}: missing required field(s) {missing}")
        if any(t != "full_attention" for t in (d.get("layer_types") or ())) or d.get("use_sliding_window"):
            raise ConfigError(f"{where}: sliding-window drafter layers are unsupported (layer_types must all be "
                              "'full_attention')")
        cfg = cls(**kw)
        if cfg.hidden_act != "silu":
            raise ConfigError(f"{where}: hidden_act {cfg.hidden_act!r} unsupported (DFlash: 'silu')")
        if cfg.attention_bias:
            raise ConfigError(f"{where}: attention_bias=true unsupported")
        if cfg.num_attention_heads % cfg.num_key_value_heads:
            raise ConfigError(f"{where}: num_attention_heads must be a multiple of num_key_value_heads")
        return cfg

    def to_dict(self) -> dict:
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
             if f.name not in ("rope_scaling", "target_layer_ids", "mask_token_id", "input_embedding_scale",
                               "output_multiplier", "final_logit_softcapping")}
        d["architectures"] = ["DFlashDraftModel"]
        d["model_type"] = "qwen3"
        d["dflash_config"] = {"target_layer_ids": list(self.target_layer_ids), "mask_token_id": self.mask_token_id,
                              "block_size": self.block_size,
                              "input_embedding_scale": self.input_embedding_scale,
                              "output_multiplier": self.output_multiplier,
                              "final_logit_softcapping": self.final_logit_softcapping}
        if self.rope_scaling is not None:
            d["rope_scaling"] = {"type": "yarn", **{k: v for k, v in dataclasses.asdict(self.rope_scaling).items()
                                                   if k != "type" and v is not None}}
        return d


def _read_json(path: str) -> tuple[dict, str]:
    file = os.path.join(path, "config.json") if os.path.isdir(path) else path
    try:
        with open(file) as f:
            return json.load(f), file
    except FileNotFoundError:
        raise ConfigError(f"{file}: not found (a checkpoint directory needs config.json)") from None
    except json.JSONDecodeError as e:
        raise ConfigError(f"{file}: not valid JSON ({e})") from None


def load_config(path: str) -> TargetConfig:
    """TargetConfig from a checkpoint directory or a config.json path. Allocates no weights."""
    d, file = _read_json(path)
    return TargetConfig.from_dict(d, file)


def load_drafter_config(path: str) -> DrafterConfig:
    d, file = _read_json(path)
    return DrafterConfig.from_dict(d, file)
