"""Shared pytest set-up: hypothesis profiles, the GPU probe, and the comparators' home.

Profiles (choose with HYPOTHESIS_PROFILE=dev|ci|soak; CI=true selects ci):
  dev   few examples, random: quick local iteration
  ci    derandomized, moderate: the same examples on every run, so a CI failure reproduces
  soak  many examples: run by hand before a release or after touching a kernel
"""
import os

import pytest
from hypothesis import HealthCheck, settings

settings.register_profile("dev", max_examples=15, deadline=None)
settings.register_profile(
    "ci", max_examples=25, deadline=None, derandomize=True, print_blob=True,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile("soak", max_examples=500, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci" if os.environ.get("CI") else "dev"))


def cuda_available() -> bool:
    """A real CUDA device (numba's cuda.is_available() is True under the simulator, so ask CuPy/torch)."""
    try:
        import cupy
        return bool(cupy.cuda.is_available())
    except Exception:
        try:
            import torch
            return torch.cuda.is_available()
        except Exception:
            return False


def pytest_collection_modifyitems(config, items):
    if cuda_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU; none here (run on the H200: see README 'GPU runs')")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
