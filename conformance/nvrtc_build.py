"""Compile CUDA C with NVRTC, the compiler CuPy uses at run time, on any machine (no GPU needed): the suite's
build checks of optimized/kernels/*.cu for each target architecture, CI included.

NVRTC and the CUDA headers come from a CUDA toolkit or from the `compile` extra's wheels (nvidia-cuda-nvrtc,
nvidia-cuda-nvcc: `pip install -e '.[test,compile]'`); without them the checks skip and say what to install.
"""
from __future__ import annotations

import os
import re
import uuid

import pytest


def include_dirs() -> list[str]:
    """Directories holding cuda_bf16.h: the nvidia-cuda-nvcc wheel's, then $CUDA_HOME's / /usr/local/cuda's."""
    found = []
    try:
        import nvidia
        found += [os.path.join(p, sub, "include") for p in nvidia.__path__ for sub in ("cu13", "cu12")]
    except ImportError:
        pass
    found += [os.path.join(d, "include") for d in (os.environ.get("CUDA_HOME"), "/usr/local/cuda") if d]
    return [d for d in found if os.path.exists(os.path.join(d, "cuda_bf16.h"))]


def compile_log(source: str, name: str, arch: str, options: tuple = ()) -> str:
    """The ptxas -v report of `source` built for `arch` with `options` (asserting that it builds); skips when
    there is no NVRTC to build with."""
    try:
        from cuda.bindings import nvrtc
        # A fresh empty kernel per call: a repeated build of the same PTX on the H200 box returned no ptxas
        # log (cached below NVRTC), and the ptxas report is what the checks read.
        nonce = f'\nextern "C" __global__ void nvrtc_test_nonce_{uuid.uuid4().hex}() {{}}\n'
        err, prog = nvrtc.nvrtcCreateProgram((source + nonce).encode(), name.encode(), 0, [], [])
    except Exception as e:  # noqa: BLE001 - no bindings or no libnvrtc: nothing to compile with
        pytest.skip(f"no NVRTC (pip install -e '.[test,compile]', or a CUDA toolkit): {type(e).__name__}: {e}")
    if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
        pytest.skip(f"NVRTC unusable here: {err}")
    opts = [o.encode() for o in ("-std=c++17", f"-arch={arch}", "--ptxas-options=-v", *options)]
    res = nvrtc.nvrtcCompileProgram(prog, len(opts), opts)
    _, size = nvrtc.nvrtcGetProgramLogSize(prog)
    log = b" " * size
    nvrtc.nvrtcGetProgramLog(prog, log)
    text = log.decode(errors="replace").rstrip("\x00")
    assert res[0] == nvrtc.nvrtcResult.NVRTC_SUCCESS, f"{name} does not build for {arch}:\n{text[-3000:]}"
    assert "Compiling entry function" in text, f"NVRTC returned no ptxas report for {name}, {arch}: {text!r}"
    return text


def spill_stores(log: str) -> dict:
    """Spill-store bytes per entry function of a ptxas -v report (the nonce kernel left out)."""
    spills = {}
    for part in log.split("Compiling entry function '")[1:]:
        fn, rest = part.split("'", 1)
        if not fn.startswith("nvrtc_test_nonce_"):
            spills[fn] = int(re.search(r"(\d+) bytes spill stores", rest).group(1))
    return spills


def assert_builds_without_spills(source: str, name: str, arch: str, kernels) -> dict:
    """Build `source` for `arch` against the CUDA headers found here (skip when there are none): every kernel in
    `kernels` is present and nothing spills (the message names the kernels that do). Returns the spill table."""
    dirs = include_dirs()
    if not dirs:
        pytest.skip("no cuda_bf16.h to compile with (pip install -e '.[test,compile]', or a CUDA toolkit)")
    spills = spill_stores(compile_log(source, name, arch, (f"-I{dirs[0]}",)))
    missing = set(kernels) - set(spills)
    assert not missing, f"{name}: kernels missing from the {arch} build: {sorted(missing)}"
    spilled = {k: v for k, v in spills.items() if v}
    assert not spilled, f"{name}: spill stores (bytes) for {arch}: {spilled}"
    return spills
