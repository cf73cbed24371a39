"""ddtree reference tier: a readable pure-PyTorch DDTree decoder for Kimi K2-class models (ground truth).

Public API (ARCHITECTURE.md):
    target  = load_target(path, dtype=torch.float32, device="cpu")
    logits  = target.logits(input_ids)                 # [T] -> [T, V]
    drafter = load_drafter(path, target=target)
    out     = generate(target, drafter, prompt_ids, max_new_tokens=N, mode="ddtree", budget=B)
This package never imports `optimized`.
"""
from .checkpoint import CheckpointError, load_target, save_target
from .config import ConfigError, DrafterConfig, TargetConfig, load_config, load_drafter_config
from .target import LatentCache, Target

__all__ = ["load_target", "save_target", "load_config", "load_drafter_config", "TargetConfig",
           "DrafterConfig", "Target", "LatentCache", "CheckpointError", "ConfigError"]

try:  # the drafter and decoder are added by later modules of this package
    from .drafter import Drafter, load_drafter, save_drafter  # noqa: F401
    from .decode import GenerateOutput, generate  # noqa: F401
    __all__ += ["load_drafter", "save_drafter", "Drafter", "generate", "GenerateOutput"]
except ImportError as _e:  # pragma: no cover - only while the decoder is being written
    if not any(m in str(_e) for m in ("drafter", "decode", "tree")):
        raise
