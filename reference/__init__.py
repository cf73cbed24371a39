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
from .decode import GenerateOutput, generate
from .drafter import Drafter, load_drafter, save_drafter
from .target import LatentCache, Target
from .tree import CompiledTree, Tree, build_tree, compile_tree, follow_verified_tree

__all__ = ["load_target", "save_target", "load_drafter", "save_drafter", "generate", "GenerateOutput",
           "load_config", "load_drafter_config", "TargetConfig", "DrafterConfig", "Target", "Drafter",
           "LatentCache", "Tree", "CompiledTree", "build_tree", "compile_tree", "follow_verified_tree",
           "CheckpointError", "ConfigError"]
