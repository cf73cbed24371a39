"""Comparators for the conformance suite: errors that say where and by how much, never a bare allclose.

The tolerance policy lives in TOLERANCES.md beside this file; each named tolerance here has a row there.
"""
from __future__ import annotations

import torch

# name -> (relative-to-scale tolerance, reason). Scale = max |expected| (so near-zero entries do not
# dominate).  See TOLERANCES.md.
TOLERANCES = {
    # transformers computes RMSNorm (and RoPE angles, the router) in float32 even inside a float64 model.
    "hf_float64": 1e-5,
    # Two float64 evaluations of the same math in a different association order (naive vs absorbed MLA,
    # tree vs chain, incremental vs prefill).
    "float64_reassoc": 1e-10,
    # float32 runs of the same math in different orders.
    "float32_reassoc": 2e-5,
}


def assert_close(actual: torch.Tensor, expected: torch.Tensor, tol: float | str, what: str = "") -> float:
    """|actual - expected| <= tol * max|expected| everywhere; returns the relative error. On failure the
    message names the worst index, both values and the tolerance."""
    rel_tol = TOLERANCES[tol] if isinstance(tol, str) else tol
    if actual.shape != expected.shape:
        raise AssertionError(f"{what}: shape {tuple(actual.shape)} != expected {tuple(expected.shape)}")
    a, e = actual.detach().double().cpu(), expected.detach().double().cpu()
    if not torch.isfinite(a).all():
        bad = (~torch.isfinite(a)).nonzero()[0].tolist()
        raise AssertionError(f"{what}: non-finite value at index {bad}: {a[tuple(bad)].item()}")
    scale = e.abs().max().clamp(min=1e-30)
    err = (a - e).abs()
    rel = (err.max() / scale).item()
    if rel > rel_tol:
        idx = tuple(torch.unravel_index(err.argmax(), err.shape))
        idx = tuple(int(i) for i in idx)
        raise AssertionError(
            f"{what}: relative error {rel:.3e} > {rel_tol:.1e} (tolerance {tol!r}); worst at index {idx}: "
            f"actual {a[idx].item():.10g}, expected {e[idx].item():.10g}, scale {scale.item():.4g}")
    return rel


def assert_tokens_equal(actual, expected, what: str = "") -> None:
    """Exact equality of token id sequences; the message names the first diverging position."""
    a, e = [int(x) for x in actual], [int(x) for x in expected]
    for i, (x, y) in enumerate(zip(a, e)):
        if x != y:
            raise AssertionError(f"{what}: first divergence at token {i}: {x} != expected {y} "
                                 f"(context {e[max(0, i - 3):i]})")
    if len(a) != len(e):
        raise AssertionError(f"{what}: length {len(a)} != expected {len(e)} (equal up to {min(len(a), len(e))})")
