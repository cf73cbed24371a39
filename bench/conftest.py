"""pytest-benchmark conventions for this suite.

Every bench records provenance in `benchmark.extra_info` (the `provenance` fixture): machine, GPU, library
versions and the git commit, so a JSON result says what produced it. Run and compare:

    pytest bench -k reference --benchmark-autosave          # .benchmarks/<machine>/0001_<commit>.json
    pytest bench -k reference --benchmark-compare=0001 --benchmark-compare-fail=median:10%
    pytest-benchmark compare 0001 0002 --columns=median,iqr,rounds

GPU benches time with CUDA events (see `cuda_time`) and report derived metrics (TB/s, TFLOP/s, ratio to the
floor, tokens/s) beside the time.
"""
import os
import platform
import subprocess
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "conformance"))
sys.path.insert(0, os.path.dirname(__file__))                    # bench helpers (tree_plot)


def graph_us(fn, calls: int = 20, reps: int = 15) -> float:
    """Microseconds per call of fn: `calls` calls captured in one CUDA graph, the median of `reps` replays
    (conformance/mla_cases.time_graph), as the A/B scripts time every path."""
    import mla_cases
    return mla_cases.time_graph([fn] * calls, reps=reps) * 1e6


def save_rows(path, meta: dict, rows: list) -> None:
    """An A/B script's results as JSON {"meta", "rows"} at `path`: written whole (a temporary file renamed over
    it) or not at all. path None: nothing."""
    import json
    if not path:
        return
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)
    os.replace(tmp, path)


def print_table(title: str, header: list, cells: list) -> None:
    """A markdown table on stdout: the title line, the header, one row per cells entry."""
    print(title)
    print("| " + " | ".join(header) + " |\n|" + " --- |" * len(header))
    for c in cells:
        print("| " + " | ".join(str(x) for x in c) + " |")


def provenance_info() -> dict:
    import torch
    info = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "machine": platform.machine(),
        "cpu_count": os.cpu_count(),
        "host": platform.node(),
    }
    if os.environ.get("DDTREE_COMMIT"):              # set by the GPU runner: its checkout copy has a stale .git
        info["commit"] = os.environ["DDTREE_COMMIT"]
    else:
        try:
            info["commit"] = subprocess.check_output(["git", "rev-parse", "--short=12", "HEAD"],
                                                     cwd=os.path.dirname(__file__), text=True,
                                                     stderr=subprocess.DEVNULL).strip()
            dirty = subprocess.check_output(["git", "status", "--porcelain", "--untracked-files=no"],
                                            cwd=os.path.dirname(__file__), text=True).strip()
            info["dirty"] = bool(dirty)
        except (OSError, subprocess.CalledProcessError):
            info["commit"] = "unknown"
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
        info["cuda"] = torch.version.cuda
        info["compute_capability"] = "%d.%d" % torch.cuda.get_device_capability()
    for mod in ("cupy", "numba", "numba_cuda", "numpy"):
        try:
            info[mod] = __import__(mod).__version__
        except Exception:
            pass
    return info


@pytest.fixture
def provenance(benchmark):
    benchmark.extra_info.update(provenance_info())
    return benchmark.extra_info


@pytest.fixture
def bench_out():
    """The report directory DDTREE_BENCH_OUT (created); the report test is skipped when it is not set."""
    out = os.environ.get("DDTREE_BENCH_OUT")
    if not out:
        pytest.skip("set DDTREE_BENCH_OUT to write the report")
    os.makedirs(out, exist_ok=True)
    return out


def cuda_time(fn, warmup: int = 10, reps: int = 100) -> float:
    """Median seconds of fn() over `reps` CUDA-event-timed runs after `warmup` runs."""
    import torch
    for _ in range(warmup):
        fn()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for s, e in zip(starts, ends):
        s.record()
        fn()
        e.record()
    torch.cuda.synchronize()
    times = sorted(s.elapsed_time(e) / 1e3 for s, e in zip(starts, ends))
    return times[len(times) // 2]
