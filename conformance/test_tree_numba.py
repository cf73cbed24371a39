"""optimized/tree_numba.py (Numba CUDA) against reference/tree.py: exact integer equality of the tree (node
set and order, ties included), the compiled verify inputs and packed visibility, the acceptance walk and the
KV commit.

Two backends, and every test asserts which one ran:
  - the Numba CUDA simulator, in CI: `test_simulator_suite` re-runs this file in a subprocess with
    NUMBA_ENABLE_CUDASIM=1 (it must be set before numba is imported, so it cannot share a process with tests
    that use numba for real); there the `test_sim_*` tests run at tiny shapes (the simulator costs
    milliseconds per simulated thread and barrier);
  - a real GPU (`gpu` marker): the same checks at full shapes (V = 163,840, L = 7 and 15, budgets to 1024),
    plus the speed check against the reference path measured in the same run.
"""
import dataclasses
import math
import os
import subprocess
import sys
import time

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings, strategies as st

from reference import tree as ref

SIM_CHILD = os.environ.get("DDTREE_NUMBA_SIM_CHILD") == "1"
SOAK = os.environ.get("HYPOTHESIS_PROFILE") == "soak"
KINDS = ("normal", "integer", "equal", "peaked", "masked", "collapse")


def logits(kind: str, depth: int, vocab: int, seed: int, device="cpu") -> torch.Tensor:
    """[L, V] draft logits; the tie-heavy kinds are those of test_tree.py."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(depth, vocab, generator=g) * 3
    if kind == "integer":
        x = torch.randint(0, 3, (depth, vocab), generator=g).float()
    elif kind == "equal":
        x = torch.zeros(depth, vocab)
    elif kind == "peaked":
        x = torch.zeros(depth, vocab)
        x[torch.arange(depth), torch.randint(0, vocab, (depth,), generator=g)] = 200.0
    elif kind == "masked":
        x[torch.rand(depth, vocab, generator=g) < 0.5] = float("-inf")
        x[:, -1] = 1.0
    elif kind == "collapse":              # distinct logits whose log-probs round to one fp32 value: ties in lp
        x = torch.randn(depth, vocab, generator=g) * 1e-6   # (|x - lse| ~ 12.7: an fp32 ulp there is ~1e-6)
        x[:, : max(1, vocab // 8)] = 12.0
    elif kind == "draftlike":             # one favourite per depth, top-1 probability ~0.6 to ~0.995
        top = torch.randint(0, vocab, (depth,), generator=g)
        x[torch.arange(depth), top] += 17 + 5 * torch.rand(depth, generator=g)
    return x.to(device)


TREE_FIELDS = ("tokens", "depths", "parents", "scores")


def same_tree(a: ref.Tree, b: ref.Tree) -> bool:
    """Exact equality of every field, on the tensors' own device (the benches record it, they do not assert)."""
    return all(torch.equal(getattr(a, f), getattr(b, f)) for f in TREE_FIELDS)


def cpu_tree(tree: ref.Tree) -> ref.Tree:
    """The same tree with every field on the host (the reference's compile and follow take host tensors)."""
    return ref.Tree(*(getattr(tree, f).cpu() for f in TREE_FIELDS))


def assert_same_tree(got: ref.Tree, want: ref.Tree, what: str) -> None:
    """Exact equality; the message names the first differing node and field."""
    assert got.n == want.n, f"{what}: {got.n} nodes, reference {want.n}"
    for field in TREE_FIELDS:
        a, b = getattr(got, field).cpu().tolist(), getattr(want, field).cpu().tolist()
        for i, (x, y) in enumerate(zip(a, b)):
            if x != y:
                raise AssertionError(f"{what}: node {i + 1} {field} {x!r} != reference {y!r} "
                                     f"(tokens {a[max(0, i - 2):i + 3]} vs {b[max(0, i - 2):i + 3]})")


def assert_same_topk(opt, draft: torch.Tensor, budget: int, what: str) -> None:
    """The per-depth candidates the GPU selected (its workspace) equal reference.tree.ranked_candidates."""
    k = min(budget, draft.shape[1])
    ws = [w for key, w in opt._workspaces.items() if key[1:5] == (draft.shape[0], draft.shape[1], k, budget)][-1]
    lp, ids = ref.ranked_candidates(draft.cpu(), k)
    got_ids, got_lp = ws.top_id.cpu(), ws.top_lp.cpu()
    bad = (got_ids != ids).nonzero()
    assert bad.numel() == 0, f"{what}: top-K ids differ first at (depth, rank) {bad[0].tolist()}: " \
                             f"{got_ids[tuple(bad[0])].item()} != {ids[tuple(bad[0])].item()}"
    assert torch.equal(got_lp, lp), f"{what}: top-K log-probs differ"


def check_compile(opt, tree: ref.Tree, root: int, start: int) -> None:
    got = opt.compile_tree(tree, root, start)
    want = ref.compile_tree(cpu_tree(tree), root, start)
    for field in ("ids", "positions", "parents", "depths", "visibility"):
        a, b = getattr(got, field).cpu(), getattr(want, field)
        assert torch.equal(a, b), f"compile_tree {field} differs at {(a != b).nonzero()[0].tolist()}"
    assert got.start == start
    rows = tree.n + 1
    bits = got.visibility_bits.cpu().long() & 0xFFFFFFFF                     # uint32 words
    assert bits.shape == (rows, (rows + 31) // 32)
    col = torch.arange(bits.shape[1] * 32)
    unpacked = ((bits[:, col // 32] >> (col % 32)) & 1).bool()               # [rows, 32 W]
    assert torch.equal(unpacked[:, :rows], want.visibility), "packed visibility != visibility"
    assert not unpacked[:, rows:].any(), "packed visibility has bits past column n"
    assert torch.equal(got.attention_visibility().cpu(), want.attention_visibility())


def check_follow_and_commit(opt, tree: ref.Tree, seed: int) -> None:
    """Choices that follow a random drafted path for a while, then leave it; then commit on a random cache."""
    device = tree.tokens.device
    g = torch.Generator().manual_seed(seed)
    compiled = opt.compile_tree(tree, 5, 3)
    rows = tree.n + 1
    ids, par = compiled.ids.cpu().tolist(), compiled.parents.cpu().tolist()
    choices = torch.randint(0, 50, (rows,), generator=g)
    leaf = int(torch.randint(0, rows, (1,), generator=g))
    j = leaf
    while j > 0:                                   # make the walk reach `leaf` (if the draws allow)
        choices[par[j]] = ids[j]
        j = par[j]
    want = ref.follow_verified_tree(ref.compile_tree(cpu_tree(tree), 5, 3), choices)
    got = opt.follow_verified_tree(compiled, choices.to(device))
    assert got.to_host() == want, f"follow: {got.to_host()} != reference {want}"
    assert got.indices.cpu().tolist()[len(want[0]):] == [-1] * (rows - len(want[0]))
    # commit: kv rows start + acc[j] -> start + j, in place; features[acc]
    for dtype in (torch.float32, torch.bfloat16):
        kv = torch.randn(3 + rows + 2, 6, generator=g).to(dtype)
        feats = torch.randn(rows, 4, generator=g).to(dtype)
        acc = want[0]
        expect_kv = kv.clone()
        expect_kv[3:3 + len(acc)] = kv[3 + torch.tensor(acc)]
        kv_dev = kv.to(device)
        out = opt.commit(kv_dev, 3, got, feats.to(device))
        assert torch.equal(kv_dev.cpu()[:3 + len(acc)], expect_kv[:3 + len(acc)]), "commit: kv rows differ"
        assert torch.equal(kv_dev.cpu()[3 + rows:], kv[3 + rows:]), "commit touched rows past the tree"
        assert torch.equal(out.cpu()[:len(acc)], feats[torch.tensor(acc)]), "commit: gathered features differ"
        assert (out.cpu()[len(acc):] == 0).all()


# ---- timing (shared with bench/test_bench_tree.py) ----------------------------------------------------------

def event_median(fn, warmup: int = 10, reps: int = 100, ahead: bool = False) -> float:
    """Median seconds of fn() between CUDA events. ahead=True first enqueues a spin kernel so the CPU
    finishes launching before the GPU starts (~4 ms of slack): the events then see device execution only (no launch gaps)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        if ahead:
            torch.cuda._sleep(8_000_000)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return sorted(times)[len(times) // 2]


def graph_median(fn, reps: int = 100) -> float:
    """Median seconds of one replay of fn captured in a CUDA graph (raises if capture fails)."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, capture_error_mode="thread_local"):
        fn()
    return event_median(graph.replay, warmup=5, reps=reps)


def device_path(opt, x: torch.Tensor, budget: int, start: int = 1000, config=None):
    """Draft logits on the device -> compiled tree on the device."""
    return lambda: opt.compile_tree(opt.build_tree(x, budget, config=config), 0, start)


def reference_path_time(x: torch.Tensor, budget: int, reps: int = 15) -> float:
    """reference build_tree + compile_tree on the same device logits (sort + copy to host + heap + copy
    back); host-synchronous, so timed with a host clock around a device sync."""
    times = []
    for i in range(reps + 2):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        c = ref.compile_tree(ref.build_tree(x, budget), 0, 1000)
        torch.cuda.synchronize()
        if i >= 2:
            times.append(time.perf_counter() - t0)
    assert c.ids.is_cuda
    return sorted(times)[len(times) // 2]


# ---- simulator (runs in the subprocess started by test_simulator_suite) --------------------------------------

def test_simulator_suite():
    """Run the test_sim_* tests of this file under NUMBA_ENABLE_CUDASIM=1 in a fresh interpreter."""
    if SIM_CHILD:
        pytest.skip("this is the simulator subprocess itself")
    pytest.importorskip("numba_cuda", reason="numba-cuda is not installed (pip install numba-cuda)")
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="1", DDTREE_NUMBA_SIM_CHILD="1")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    t0 = time.time()
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k", "test_sim_",
                           os.path.abspath(__file__)], cwd=root, env=env, capture_output=True, text=True,
                          timeout=900)
    tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-40:])
    assert proc.returncode == 0, f"simulator suite failed (rc {proc.returncode}):\n{tail}"
    assert " passed" in tail and "skipped" not in tail.splitlines()[-1], tail
    print(f"simulator suite: {tail.splitlines()[-1]} ({time.time() - t0:.0f} s)")


PTX_CHECK = r"""
import subprocess, sys, types as _t
import numba.cuda.dispatcher as D
D.get_current_device = lambda: _t.SimpleNamespace(compute_capability=(9, 0))   # no GPU needed to compile
from numba import cuda, types
from optimized.kernels import tree_beam as B, tree_list as Lst, tree_thresh as Th, tree_topk as K, tree_verify as V
from optimized.kernels import tree_segment as Sg, tree_shallow as Sh
A = lambda dt, nd: types.Array(dt, nd, "C")
i64, f32, f64, i32, i16 = types.int64, types.float32, types.float64, types.int32, types.int16
kernels = {
    "topk_stats": (K.topk_stats, (A(f32, 2), i64, i64, A(f64, 2), A(f64, 2), A(i32, 2))),
    "topk_filter": (K.topk_filter, (A(f32, 2), i64, i64, i64, A(f64, 2), A(f64, 2), A(i32, 2), A(i32, 2),
                                    A(i64, 2), A(f32, 2), A(i64, 2))),
    "compile_rows": (V.compile_rows, (A(i64, 1),) * 4 + (i64, i64) + (A(i64, 1),) * 4
                     + (A(types.boolean, 2), A(i32, 2))),
    "follow": (V.follow, (A(i64, 1),) * 6),
    "commit_kv": (V.commit_kv, (A(i16, 2), i64, A(i64, 1), A(i64, 1))),
    "gather_rows": (V.gather_rows, (A(i16, 2), A(i64, 1), A(i64, 1), A(i16, 2))),
}
beam_sig = (A(f32, 2), A(i64, 2), i64, i64) + (A(i64, 1),) * 3 + (A(f64, 1), A(i64, 1))
for budget in (16, 32, 64, 128, 256, 512, 1024):       # every beam variant the launcher picks
    kernel, threads = B.beam_for(budget, 1024)
    kernels[f"beam_T{threads}"] = (kernel, beam_sig)
for budget in (64, 128, 256):                          # every warp-list variant: 1, 2, 4 register rows
    kernels[f"beam_list_B{budget}"] = (Lst.list_for(budget)[0], beam_sig)
kernels["beam_auto"] = (Lst.auto_for(32)[0], beam_sig)
for budget in (32, 64, 128, 256):                      # every two-level variant (tree_shallow.shallow_for)
    kernels[f"beam_shallow_B{budget}"] = (Sh.shallow_for(budget, 1024)[0], beam_sig)
    assert Sh.shallow_for(budget, 1024)[2] + 13500 <= 48 * 1024, budget     # beside the static 13,008 B (ptxas, 256)
for budget in (512, 1024):                             # the segment's own launch and tree_beam after it
    kernels[f"segment_B{budget}"] = (Sg.segment_kernel_for(budget, 1024)[0], beam_sig)
    kernels[f"beam_unless_B{budget}"] = (Sg.beam_unless_for(budget, 1024)[0], beam_sig)
for budget in (32, 64, 128, 256, 512):                 # every threshold-beam variant (32 to 512 threads)
    kernels[f"beam_thresh_B{budget}"] = (Th.thresh_for(budget, 1024)[0],
                                         beam_sig + (A(i32, 2), A(i32, 1)))
for name, (kernel, sig) in kernels.items():
    ptx, _ = cuda.compile_ptx(kernel.py_func, sig, cc=(9, 0))
    print(name, "ok", len(ptx))
"""


def test_kernels_compile_for_sm90_without_a_gpu():
    """Type-check every kernel for the real CUDA target (the simulator does not type anything): compile to
    PTX for sm_90 in a subprocess. Needs NVVM and NVRTC (CUDA toolkit or the nvidia-cuda-nvrtc wheel)."""
    if SIM_CHILD:
        pytest.skip("runs in the parent process")
    pytest.importorskip("numba_cuda", reason="numba-cuda is not installed (pip install numba-cuda)")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run([sys.executable, "-c", PTX_CHECK], cwd=root, env=env, capture_output=True, text=True,
                          timeout=600)
    out = proc.stdout + proc.stderr
    missing = ("nvrtc", "nvvm", "cudasupporterror", "dynamiclibnotfounderror")
    if proc.returncode != 0 and any(s in out.lower() for s in missing):
        pytest.skip("no NVVM/NVRTC to compile with (install the CUDA toolkit or nvidia-cuda-nvrtc): "
                    + out.strip().splitlines()[-1][:200])
    assert proc.returncode == 0, out[-3000:]
    assert out.count(" ok ") == 29, out


@pytest.mark.parametrize("value, ok", [("1024", True), ("256", True), ("300", False), ("2048", False)])
def test_topk_threads_knob(value, ok):
    """DDTREE_TOPK_THREADS (the top-K block size, read at import) takes 256, 512 or 1024 and rejects anything else
    with a message that names it. Under the simulator (no GPU needed), in a fresh interpreter."""
    if SIM_CHILD:
        pytest.skip("runs in the parent process")
    pytest.importorskip("numba_cuda", reason="numba-cuda is not installed (pip install numba-cuda)")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="1", DDTREE_TOPK_THREADS=value,
               PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    code = "from optimized.kernels import tree_topk as K; print(K.TOPK_T, K.WAVE_BLOCKS, K.TOPK_T * K.WAVE_BLOCKS)"
    proc = subprocess.run([sys.executable, "-c", code], cwd=root, env=env, capture_output=True, text=True,
                          timeout=300)
    if ok:
        assert proc.returncode == 0, proc.stderr[-2000:]
        t, _, per_sm = proc.stdout.split()
        assert (int(t), int(per_sm)) == (int(value), 1024)
    else:
        assert proc.returncode != 0 and "DDTREE_TOPK_THREADS must be 256, 512 or 1024" in proc.stderr, proc.stderr


sim_only = pytest.mark.skipif(not SIM_CHILD, reason="runs inside test_simulator_suite's subprocess")


@pytest.fixture
def sim():
    from optimized import tree_numba as opt
    assert opt.backend() == "cudasim", "the simulator subprocess must run on the Numba CUDA simulator"
    return opt


@sim_only
@settings(max_examples=40 if SOAK else 5, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(kind=st.sampled_from(KINDS), depth=st.integers(1, 3), vocab=st.integers(1, 16),
       budget=st.integers(1, 20), seed=st.integers(0, 2 ** 31 - 1), chunk=st.sampled_from([8, 64]),
       threads=st.sampled_from([8, 16]))
@example(kind="equal", depth=3, vocab=6, budget=20, seed=0, chunk=4, threads=8)     # all ties, across chunks
@example(kind="peaked", depth=4, vocab=5, budget=12, seed=1, chunk=8, threads=16)  # lp == 0: child ties parent
@example(kind="integer", depth=3, vocab=9, budget=24, seed=2, chunk=64, threads=8)
def test_sim_build_matches_reference(sim, kind, depth, vocab, budget, seed, chunk, threads):
    cfg = sim.Config(threads, chunk, threads, threads)
    x = logits(kind, depth, vocab, seed)
    got = sim.build_tree(x, budget, config=cfg, check_values=True)
    assert_same_topk(sim, x, budget, f"{kind} L={depth} V={vocab} B={budget}")
    assert_same_tree(got, ref.build_tree(x, budget), f"{kind} L={depth} V={vocab} B={budget}")


@sim_only
def test_sim_beam_batches_and_whole_row_select(sim, monkeypatch):
    """Small batch and candidate capacities force the paths that full shapes rarely take: several batches of
    parents per depth (a batch of NEW_FACTOR * 8 = 8 new candidates at budget 8), and the whole-row select when the
    candidates overflow CAP (the simulator reads module constants at run time, so they can be made tiny here)."""
    from optimized.kernels import tree_beam, tree_topk
    monkeypatch.setattr(tree_beam, "NEW_FACTOR", 1)
    monkeypatch.setattr(tree_topk, "CAP", 8)
    for kind, seed in (("normal", 3), ("equal", 0), ("peaked", 1), ("integer", 2)):
        x = logits(kind, 3, 7, seed)
        got = sim.build_tree(x, 8, config=sim.Config(8, 64, 8, 8), check_values=True)
        assert_same_topk(sim, x, 8, kind)
        assert_same_tree(got, ref.build_tree(x, 8), kind)


def composite_key(lp: float, token: int) -> int:
    """tree_topk's composite key of a token on the host: (sortable(lp) - 2^31) << 32 | (2^32 - 1 - id)."""
    import struct
    b = struct.unpack("<i", struct.pack("<f", lp))[0]
    sortable = 0x7FFFFFFF - (b & 0x7FFFFFFF) if b < 0 else 0x80000000 + b
    return ((sortable - 0x80000000) << 32) | (0xFFFFFFFF - token)


@sim_only
@settings(max_examples=60 if SOAK else 25, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(pattern=st.sampled_from(["spread", "ties", "one", "outlier", "two"]), n=st.integers(1, 64),
       kfrac=st.floats(0.0, 1.0), seed=st.integers(0, 2 ** 31 - 1), threads=st.sampled_from([4, 8, 16]))
@example(pattern="one", n=64, kfrac=1.0, seed=0, threads=4)          # one log-prob: buckets by token id
@example(pattern="outlier", n=64, kfrac=0.5, seed=1, threads=8)     # one far key, the rest in a narrow band
@example(pattern="ties", n=4, kfrac=1.0, seed=2, threads=16)        # count_rank: WARP threads a key
@pytest.mark.parametrize("ranker", ["bucket_rank", "count_rank"])
def test_sim_candidate_rank(sim, ranker, pattern, n, kfrac, seed, threads):
    """The last block's two ways to rank the candidates, each on its own (tree_topk.bucket_rank; count_rank, at
    least a thread a key, so its block has at least n threads, and up to WARP where the block has room: small n
    at 8-16 threads): every rank < k of n distinct composite keys lands where a sort puts it, for key sets that
    stress the buckets (equal log-probs, one log-prob for all, one outlier and a narrow band, two values), at every
    block size the simulator runs."""
    import numpy as np
    from optimized.kernels import tree_topk as K
    from optimized.kernels.tree_device import WARP
    src = """
def rank(cand, n, k, top_lp, top_id):
    grp = cuda.shared.array(K.CAP, np.int64)
    cnt = cuda.shared.array(K.NBK, np.int32)
    tmp = cuda.shared.array(32, np.int64)
    buf = cuda.shared.array(64, np.int64)
    shr = cuda.shared.array(2, np.int64)
    if BUCKET:
        K.bucket_rank(cand, 0, n, k, grp, cnt, tmp, buf, shr, top_lp, top_id)
    else:
        K.count_rank(cand, 0, n, k, grp, buf, top_lp, top_id)
"""
    rank = sim_kernel(src, "rank", K=K, BUCKET=ranker == "bucket_rank")   # buf: a slot a thread (64 at most)
    if ranker == "count_rank":
        threads = max(threads, -(-n // WARP) * WARP)    # a key a thread, whole warps
    g = torch.Generator().manual_seed(seed)
    if pattern == "spread":
        lps = (-30 * torch.rand(n, generator=g)).tolist()
    elif pattern == "ties":
        lps = torch.tensor([-1.5, -2.0, -7.25])[torch.randint(0, 3, (n,), generator=g)].tolist()
    elif pattern == "one":
        lps = [-3.0] * n
    elif pattern == "outlier":
        lps = [-0.001] + (-23 - 2.5 * torch.rand(n - 1, generator=g)).tolist()
    else:
        lps = [-1.0 if i % 2 else -1e-6 for i in range(n)]
    lps = [float(np.float32(v)) for v in lps]
    ids = torch.randperm(100_000, generator=g)[:n].tolist()
    keys = [composite_key(v, t) for v, t in zip(lps, ids)]
    k = max(1, min(n, round(kfrac * n)))

    cand = np.array([keys], dtype=np.int64)
    top_lp = np.full((1, k), np.nan, dtype=np.float32)
    top_id = np.full((1, k), -1, dtype=np.int64)
    rank[1, threads](cand, n, k, top_lp, top_id)
    order = sorted(range(n), key=lambda i: keys[i], reverse=True)[:k]
    assert top_id[0].tolist() == [ids[i] for i in order], f"{pattern} n={n} k={k} T={threads}"
    assert top_lp[0].tolist() == [lps[i] for i in order], f"{pattern} n={n} k={k} T={threads}"


@sim_only
@pytest.mark.parametrize("runs_max", [1, 1000])
def test_sim_beam_orders_new_candidates_by_sort_and_by_rank(sim, monkeypatch, runs_max):
    """Both ways the beam orders a batch of new candidates give the reference tree on their own: RUNS_MAX = 1
    sorts every batch that is not one row or one column (pair_sort), RUNS_MAX = 1000 ranks every batch by binary
    searches in its runs (rows or columns, whichever are fewer)."""
    from optimized.kernels import tree_beam
    monkeypatch.setattr(tree_beam, "RUNS_MAX", runs_max)
    for kind, depth, vocab, budget, seed in (("normal", 3, 16, 20, 4), ("equal", 3, 6, 20, 0), ("peaked", 4, 5, 12, 1),
                                              ("integer", 3, 9, 20, 2), ("normal", 2, 16, 16, 5)):
        x = logits(kind, depth, vocab, seed)
        got = sim.build_tree(x, budget, config=sim.Config(8, 64, 8, 8), check_values=True)
        assert_same_tree(got, ref.build_tree(x, budget), f"{kind} RUNS_MAX={runs_max}")


@sim_only
@pytest.mark.parametrize("kind, depth, vocab, budget", [
    ("normal", 3, 16, 8),        # 1 row of 4 lanes (capacity 4 = budget / 2): the frontier overflows, drops
    ("equal", 3, 6, 12),         # 2 rows: all ties, ordered by rank tuples
    ("peaked", 4, 5, 12),        # lp == 0: a child ties its parent
    ("integer", 3, 9, 16),       # 2 rows, sibling ties across parents
    ("draftlike", 6, 9, 20),     # 4 rows (moves from the rows above and below), a deep tree
    ("masked", 2, 12, 7),
    ("normal", 2, 3, 16)])       # fewer nodes than the budget: the frontier empties
def test_sim_list_beam_matches_reference(sim, kind, depth, vocab, budget):
    """The warp-list beam (tree_list.py, Config.list_max) gives the reference tree on its own, node for node; the
    simulator's warp has 4 lanes, so these budgets run 1, 2 and 4 register rows."""
    from optimized.kernels import tree_list
    cfg = sim.Config(8, 64, 8, 8, list_max=tree_list.LIST_BMAX)
    x = logits(kind, depth, vocab, 11)
    got = sim.build_tree(x, budget, config=cfg, check_values=True)
    assert_same_tree(got, ref.build_tree(x, budget), f"list beam {kind} L={depth} V={vocab} B={budget}")


THRESH_CASES = [
    ("normal", 3, 16, 20),       # one enumeration
    ("equal", 3, 6, 20),         # all ties, ordered by rank tuples
    ("peaked", 4, 5, 12),        # lp == 0: a child ties its parent
    ("integer", 3, 9, 20),       # sibling ties across parents
    ("draftlike", 6, 9, 20),     # a deep tree: several enumerations
    ("masked", 2, 12, 7),        # floor log-probs
    ("collapse", 3, 16, 30),     # distinct logits, equal log-probs
    ("normal", 2, 3, 16),        # fewer nodes than the budget (K < B: the first threshold admits everything)
    ("normal", 1, 40, 33)]       # one depth, a block of several chunks


def thresh_stats(opt, depth: int, vocab: int, budget: int) -> list:
    """The threshold beam's counters from the last build's workspace: rounds, tuple thresholds, nodes, levels,
    routes (bit 0: the order needed the preorder, equal scores across depths; bit 1: ties at rank B of one depth
    were cut by breadth-first index)."""
    return [w for key, w in opt._workspaces.items() if key[1:3] == (depth, vocab) and key[4] == budget][-1] \
        .thresh_stats.tolist()


@sim_only
@pytest.mark.parametrize("kind, depth, vocab, budget", THRESH_CASES)
def test_sim_threshold_beam_matches_reference(sim, kind, depth, vocab, budget):
    """The threshold beam (tree_thresh.py, Config.beam) gives the reference tree on its own, node for node."""
    cfg = sim.Config(8, 64, 8, 8, beam="threshold")
    x = logits(kind, depth, vocab, 11)
    got = sim.build_tree(x, budget, config=cfg, check_values=True)
    assert_same_tree(got, ref.build_tree(x, budget), f"threshold beam {kind} L={depth} V={vocab} B={budget}")


@sim_only
def test_sim_threshold_beam_refines_through_ties(sim, monkeypatch):
    """A buffer of 2 C nodes (CAP_FACTOR = 2, the least that still moves the threshold) makes the enumeration
    overflow and the threshold move: by the buffer's B-th score, and -- where equal scores straddle rank B, as on
    peaked rows (lp == 0 chains: the ties at -200 outnumber the buffer) -- by the B-th node in tuple order. The
    counters say both paths ran, and that the final order took every route: breadth-first (equal scores within a
    depth; ties at rank B of one depth cut by index) and the preorder (equal scores across depths, lp == 0); the
    trees are the reference's."""
    from optimized.kernels import tree_thresh
    monkeypatch.setattr(tree_thresh, "CAP_FACTOR", 2)
    cfg = sim.Config(8, 64, 8, 8, beam="threshold")
    seen = []
    for kind, depth, vocab, budget in (("peaked", 6, 5, 20), ("equal", 6, 2, 20), ("integer", 5, 4, 24),
                                       ("draftlike", 6, 9, 20), ("peaked", 5, 3, 30)):
        x = logits(kind, depth, vocab, 5)
        got = sim.build_tree(x, budget, config=cfg, check_values=True)
        assert_same_tree(got, ref.build_tree(x, budget), f"threshold beam {kind} L={depth} V={vocab} B={budget}")
        seen.append((kind, thresh_stats(sim, depth, vocab, budget)))
    assert any(rounds > 1 for _, (rounds, _, _, _, _) in seen), seen
    assert any(ties > 0 for _, (_, ties, _, _, _) in seen), seen
    routes = [r for _, (_, _, _, _, r) in seen]
    assert any(r & 1 == 0 for r in routes) and any(r & 1 for r in routes), seen   # breadth-first order, preorder
    assert any(r & 2 for r in routes), seen                # ties at rank B of one depth, cut by breadth-first index


@sim_only
@pytest.mark.parametrize("kind, depth, vocab, budget", [("normal", 3, 8, 10), ("peaked", 4, 3, 9),
                                                        ("equal", 2, 4, 20), ("normal", 1, 40, 33),
                                                        ("draftlike", 5, 40, 64)])   # 195 (row, word) pairs: 4 blocks
def test_sim_compile_follow_commit(sim, kind, depth, vocab, budget):
    tree = ref.build_tree(logits(kind, depth, vocab, 7), budget)
    check_compile(sim, tree, root=9, start=4)
    for seed in range(3):
        check_follow_and_commit(sim, tree, seed)
    by_tensor = sim.compile_tree(tree, torch.tensor([9]), 4)     # the engine's form: the root on the device
    assert torch.equal(by_tensor.ids, sim.compile_tree(tree, 9, 4).ids)
    rows, words = tree.n + 1, (tree.n + 32) // 32                 # the engine's static buffer: bits in place
    buf = torch.full((rows + 3, words), -7, dtype=torch.int32)
    into = sim.compile_tree(tree, 9, 4, bits_out=buf[1:rows + 1])
    assert into.visibility_bits.data_ptr() == buf[1].data_ptr()
    assert torch.equal(buf[1:rows + 1], by_tensor.visibility_bits)
    assert (buf[0] == -7).all() and (buf[rows + 1:] == -7).all()  # nothing written outside the rows
    for bad in (buf[:rows + 1], buf[:rows].long()):                # a row too many; int64
        with pytest.raises(ValueError, match="bits_out must be a contiguous int32"):
            sim.compile_tree(tree, 9, 4, bits_out=bad)


@sim_only
def test_sim_exp_le0_accuracy():
    """The top-K's fp64 exp (tree_device.exp_le0, the GPU's code but for a clamp at -700 that only the simulator
    runs) against 50-digit decimals: within 2 ulp (4.5e-16 relative) over [-700, 0], exactly 1 at 0 and 0 below -700
    (also -inf: masked tokens, padding)."""
    import decimal
    from optimized.kernels.tree_device import EXP_TAB_BITS, exp_le0
    decimal.getcontext().prec = 50
    g = torch.Generator().manual_seed(5)
    ds = torch.cat([-torch.rand(3000, generator=g, dtype=torch.float64) * 700,
                    -torch.rand(3000, generator=g, dtype=torch.float64) * 3,
                    torch.tensor([-0.0, -1e-300, -0.5 * math.log(2) / 64, -math.log(2) / 64, -699.99])]).tolist()
    worst = 0.0
    for d in ds:
        want = float(decimal.Decimal(d).exp())
        worst = max(worst, abs(exp_le0(d, EXP_TAB_BITS) - want) / want)
    assert worst <= 4.5e-16, worst
    assert exp_le0(0.0, EXP_TAB_BITS) == 1.0
    assert exp_le0(-700.5, EXP_TAB_BITS) == 0.0 and exp_le0(-math.inf, EXP_TAB_BITS) == 0.0


def sim_kernel(src: str, name: str, **names):
    """A test kernel defined by `src`, built in a namespace of its own with numba's cuda, numpy as np and `names` as
    globals: the simulator swaps a kernel's *global* `cuda` for its fake module, which a local import would hide."""
    import numpy as np
    from numba import cuda
    ns = dict(names, cuda=cuda, np=np)
    exec(src, ns)
    return cuda.jit(ns[name])


@sim_only
@pytest.mark.parametrize("kind", ["normal", "peaked", "draftlike"])
def test_sim_auto_beam_picks_by_depth(sim, kind):
    """Budgets up to a warp (4 lanes here) run tree_list.auto_for: `shallow` (read by a one-warp kernel) is true
    exactly when the reference tree is at most 2 deep (tie-free logits: the ties are only a speed matter), and the
    tree is the reference's on either branch."""
    import numpy as np
    from optimized.kernels import tree_list
    from optimized.kernels.tree_device import TBUF, WARP
    src = """
def probe(top_lp, k, budget, out):
    buf = cuda.shared.array(TBUF, np.int64)
    v = L.shallow(top_lp, k, budget, buf)
    if cuda.threadIdx.x == 0:
        out[0] = 1 if v else 0
"""
    probe = sim_kernel(src, "probe", L=tree_list, TBUF=TBUF)
    built = {}
    for seed in range(6):
        for depth in (1, 3, 5):
            x = logits(kind, depth, 9, seed)
            for budget in range(1, WARP + 1):
                want = ref.build_tree(x, budget)
                top_lp, _ = ref.ranked_candidates(x, budget)
                out = np.zeros(1, np.int64)
                probe[1, WARP](top_lp.numpy(), top_lp.shape[1], budget, out)
                deep = int(want.depths.max()) > 2
                assert bool(out[0]) == (not deep), (kind, seed, depth, budget)
                if deep not in built and budget == WARP:      # the whole build, once on each branch
                    built[deep] = True
                    assert_same_tree(sim.build_tree(x, budget), want, f"{kind} seed={seed} L={depth} B={budget}")
    assert set(built) == {True, False}, built


@sim_only
@pytest.mark.parametrize("kind", ["normal", "draftlike", "integer", "equal", "peaked", "collapse", "masked"])
def test_sim_two_level_decides_exactly(sim, kind):
    """tree_shallow.two_level takes a tree exactly when the reference tree is at most 2 deep (its count of the
    prefixes before (0, 0, 0) is exact on every kind; "masked" rows spread past the key's 2^42 span, so there it may
    decline), and then writes the reference tree node for node; when it declines it writes nothing. Budgets 1-64
    in blocks of 4-16 threads (several ranks a thread), depths 1-4, vocabularies from 1 to 40; rows whose lp 0
    makes (0) or (0, 0) tie s3 (peaked rows; a peaked third row under normal ones)."""
    import numpy as np
    from optimized.kernels import tree_shallow
    from optimized.kernels.tree_device import WARP
    src = """
def probe(top_lp, top_id, k, budget, tok, dep, par, score, n, took):
    v = two_level(top_lp, top_id, k, budget, tok, dep, par, score, n)
    if cuda.threadIdx.x == 0:
        took[0] = 1 if v else 0
"""
    seen = set()
    cases = [(1, 9, 7, 4), (2, 3, 16, 4), (2, 9, 64, 16), (3, 9, 16, 8), (3, 40, 64, 16), (4, 9, 33, 16),
             (3, 1, 5, 4), (4, 40, 16, 4), (3, 9, 1, 4), (3, 9, 2, 4)]
    if kind == "normal":        # the third row peaked (lp 0 at rank 0): (0, 0) ties s3 and may be taken or not
        cases += [(-3, 9, b, 4) for b in range(1, 13)]
    for i, (depth, vocab, budget, threads) in enumerate(cases):
        cap = WARP
        while cap < budget:
            cap *= 2
        ga = max(1, cap // threads)
        probe = sim_kernel(src, "probe", two_level=tree_shallow.two_level_for(threads, ga))
        x = logits(kind, abs(depth), vocab, i)
        if depth < 0:
            x = logits(kind, 3, vocab, 0)
            x[2] = logits("peaked", 1, vocab, 0)[0]
            depth = 3
        want = ref.build_tree(x, budget)
        top_lp, top_id = ref.ranked_candidates(x, budget)
        outs = [np.full(budget, -7, np.int64), np.full(budget, -7, np.int64), np.full(budget, -7, np.int64),
                np.full(budget, -7.0, np.float64), np.full(1, -7, np.int64), np.zeros(1, np.int64)]
        smem = tree_shallow.two_level_bytes(threads, ga)
        probe[1, threads, 0, smem](top_lp.numpy(), top_id.numpy(), top_lp.shape[1], budget, *outs)
        shallow = int(want.depths.max()) <= 2
        what = f"{kind} L={depth} V={vocab} B={budget} T={threads}"
        if kind != "masked":
            assert bool(outs[5][0]) == shallow, what
        if outs[5][0]:
            n = int(outs[4][0])
            got = ref.Tree(*(torch.from_numpy(o[:n]) for o in outs[:4]))
            assert_same_tree(got, want, what)
        else:
            assert all((o == -7).all() for o in outs[:5]), f"{what}: declined but wrote"
        seen.add(bool(outs[5][0]))
    assert kind == "masked" or seen == {True, False}, (kind, seen)


def alternating_logits(depth: int, vocab: int) -> torch.Tensor:
    """Two near-equal favourites at depths 1, 3, 5, ... and one at 2, 4, ...: from budget 20 the tree holds nodes 3
    deviations off the rank-0 chain (budget 16: 2), which the segment selection must decline."""
    x = torch.full((depth, vocab), -30.0)
    x[0::2, 0], x[0::2, 1], x[1::2, 0] = 0.0, -0.1, 0.0
    return x


@sim_only
@pytest.mark.parametrize("kind", ["normal", "draftlike", "integer", "equal", "peaked", "collapse", "masked",
                                  "alternating"])
def test_sim_segment_selection_exact(sim, kind):
    """tree_segment.segment (the tree grown a deviation at a time) writes the reference tree node for node whenever it
    takes one, and nothing when it declines (a node 3 deviations off the chain could enter, or its capacities
    overflow); on normal and draft-like rows it takes trees of every depth. Budgets 1-64, blocks of 4-16 threads,
    depths 1-8 (draft-like: trees as deep as the logits). "alternating": two near-equal favourites at depths 1, 3, 5
    and one at 2 and 4, so that from budget 20 the tree holds nodes 3 deviations off the chain (budget 16: 2), which
    only the bound U on such nodes (a DP that must follow the chain between deviations) can exclude."""
    import numpy as np
    from optimized.kernels import tree_segment
    from optimized.kernels.tree_device import WARP
    src = """
def probe(top_lp, top_id, k, budget, tok, dep, par, score, n, took):
    v = seg(top_lp, top_id, k, budget, tok, dep, par, score, n)
    if cuda.threadIdx.x == 0:
        took[0] = 1 if v else 0
"""
    taken_depths = set()
    cases = [(1, 9, 7, 4), (2, 9, 40, 16), (3, 9, 16, 4), (5, 40, 64, 16), (8, 9, 16, 4), (8, 40, 33, 16),
             (3, 2, 64, 16), (6, 40, 3, 4), (8, 40, 64, 16)]
    if kind == "alternating":
        cases = [(5, 12, 16, 4), (5, 12, 20, 4), (5, 12, 24, 8)]
    for i, (depth, vocab, budget, threads) in enumerate(cases):
        cap = WARP
        while cap < budget:
            cap *= 2
        ga = max(1, cap // threads)
        probe = sim_kernel(src, "probe", seg=tree_segment.segment_for(threads, ga))
        if kind == "alternating":
            x = alternating_logits(depth, vocab)
        else:
            x = logits(kind, depth, vocab, 31 * i + depth)
        want = ref.build_tree(x, budget)
        top_lp, top_id = ref.ranked_candidates(x, budget)
        outs = [np.full(budget, -7, np.int64), np.full(budget, -7, np.int64), np.full(budget, -7, np.int64),
                np.full(budget, -7.0, np.float64), np.full(1, -7, np.int64), np.zeros(1, np.int64)]
        smem = tree_segment.segment_layout(threads, ga)["bytes"]
        probe[1, threads, 0, smem](top_lp.numpy(), top_id.numpy(), top_lp.shape[1], budget, *outs)
        what = f"{kind} L={depth} V={vocab} B={budget} T={threads}"
        if outs[5][0]:
            n = int(outs[4][0])
            assert_same_tree(ref.Tree(*(torch.from_numpy(o[:n]) for o in outs[:4])), want, what)
            taken_depths.add(int(want.depths.max()))
        else:
            assert all((o == -7).all() for o in outs[:5]), f"{what}: declined but wrote"
    if kind in ("normal", "draftlike", "alternating"):
        assert taken_depths and (kind == "normal" or max(taken_depths) >= 5), (kind, taken_depths)


@sim_only
@pytest.mark.parametrize("kind", ["draftlike", "normal", "equal", "alternating"])
def test_sim_segment_own_launch_then_beam(sim, kind):
    """The path of budgets above 256 on the GPU (tree_segment.segment_kernel_for, then beam_unless_for), here at
    small budgets in blocks of 4-16 threads with the same node capacity (BIG_CAPN): the pair writes the reference
    tree whether the segment takes it (out_n = n) or declines (out_n = -1, nothing else written, tree_beam's body
    runs); it must decline trees at most 2 deep (at_most_two_deep, left to tree_beam) and, at budget 20, the
    "alternating" rows, whose trees hold nodes 3 deviations off the chain. And beam_unless_for's kernel writes
    nothing when the count on entry says a tree was taken."""
    import numpy as np
    from optimized.kernels import tree_segment
    cases = {"draftlike": [(8, 40, 16, 4), (6, 9, 33, 16), (8, 40, 64, 16)],
             "normal": [(3, 40, 16, 4), (5, 9, 48, 16), (2, 40, 16, 4)],
             "equal": [(4, 40, 16, 4), (3, 9, 33, 16), (5, 9, 64, 16)],
             "alternating": [(5, 12, 16, 4), (5, 12, 20, 4)]}[kind]
    ran = set()
    shallow_seen = False
    for i, (depth, vocab, budget, threads) in enumerate(cases):
        if kind == "alternating":
            x = alternating_logits(depth, vocab)
        else:
            x = logits(kind, depth, vocab, 7 * i + depth)
        want = ref.build_tree(x, budget)
        top_lp, top_id = (t.numpy() for t in ref.ranked_candidates(x, budget))
        outs = [np.full(budget, -7, np.int64), np.full(budget, -7, np.int64), np.full(budget, -7, np.int64),
                np.full(budget, -7.0, np.float64), np.full(1, -7, np.int64)]
        seg, t, smem = tree_segment.segment_kernel_for(budget, threads)
        seg[1, t, 0, smem](top_lp, top_id, top_lp.shape[1], budget, *outs)
        took = int(outs[4][0]) >= 0
        what = f"{kind} L={depth} V={vocab} B={budget} T={threads}"
        if not took:
            assert outs[4][0] == -1 and all((o == -7).all() for o in outs[:4]), f"{what}: declined but wrote"
        if int(want.depths.max()) <= 2:
            assert not took, f"{what}: a tree at most 2 deep was not left to tree_beam"
            shallow_seen = True
        ran.add(took)
        beam, tb = tree_segment.beam_unless_for(budget, threads)
        beam[1, tb](top_lp, top_id, top_lp.shape[1], budget, *outs)
        n = int(outs[4][0])
        assert_same_tree(ref.Tree(*(torch.from_numpy(o[:n]) for o in outs[:4])), want, f"{what} (took {took})")
        if took:
            fresh = [np.full(budget, -7, np.int64) for _ in range(3)] + [np.full(budget, -7.0), np.zeros(1, np.int64)]
            beam[1, tb](top_lp, top_id, top_lp.shape[1], budget, *fresh)
            assert all((o == -7).all() for o in fresh[:4]), f"{what}: tree_beam ran after a taken tree"
    if kind == "draftlike":
        assert ran == {True}, ran
    if kind == "alternating":
        assert False in ran, ran
    if kind in ("normal", "equal"):
        assert shallow_seen and (kind == "equal" or True in ran), (shallow_seen, ran)


def rel_of(ps: int, d: int, r: int, tm: int, tdig) -> int:
    """Child (p, r)'s place against tau's rank tuple (-1 before, 0 a prefix of it or tau, +1 after), p of depth d
    in place ps; the definition tree_thresh.child_state implements."""
    if ps != 0:
        return ps
    if d == tm:
        return 1                                              # an extension of tau: after it
    return -1 if r < tdig[d] else (0 if r == tdig[d] else 1)


@sim_only
def test_sim_threshold_children_count_by_brute_force():
    """tree_thresh.n_children (the count of a parent's children that enter E(tau)) and child_state (a child's place
    against tau's tuple), against the definitions: child (p, r) enters iff its score > tq, or == tq and its rank
    tuple is at or before tau's (before tau, or a prefix of it). Random sorted rows with many equal values, every
    parent state (before / on tau's path at each depth / after), every tau depth, parent scores around the
    threshold; the entering ranks must also be a prefix. (Dropping the max(t + 1, b) branch, or merging "on the
    path" into "before", fails here; the whole-tree tests did not catch either.)"""
    import numpy as np
    from optimized.kernels import tree_thresh
    src = """
def probe(rows, k, sps, pss, ds, tq, tm, tdig, out):
    i = cuda.threadIdx.x + cuda.blockIdx.x * cuda.blockDim.x
    if i < sps.shape[0]:
        out[i] = Th.n_children(rows[i], k, sps[i], pss[i], ds[i], tq, tm, tdig)
"""
    probe = sim_kernel(src, "probe", Th=tree_thresh)
    src_state = """
def probe_state(pss, ds, rs, tm, tdig, out):
    i = cuda.threadIdx.x + cuda.blockIdx.x * cuda.blockDim.x
    if i < pss.shape[0]:
        out[i] = Th.child_state(pss[i], ds[i], rs[i], tm, tdig)
"""
    probe_state = sim_kernel(src_state, "probe_state", Th=tree_thresh)
    rng = np.random.default_rng(7)
    checked = 0
    for trial in range(40):
        k = int(rng.integers(1, 9))
        tm = int(rng.integers(1, 5))
        tdig = rng.integers(0, k, 8).astype(np.int32)
        tq = int(rng.integers(-6, 1))
        rows, sps, pss, ds, want = [], [], [], [], []
        for _ in range(16):
            row = np.sort(-rng.integers(0, 4, k).astype(np.int64))[::-1].copy()   # <= 0, descending, with ties
            ps = int(rng.integers(-1, 2))
            d = int(rng.integers(0, tm + 1)) if ps == 0 else int(rng.integers(0, 6))
            sp = tq + int(rng.integers(-1, 4))
            enter = [sp + row[r] > tq or (sp + row[r] == tq and rel_of(ps, d, r, tm, tdig) <= 0) for r in range(k)]
            assert enter == sorted(enter, reverse=True), "entering ranks are not a prefix"
            rels = np.zeros(k, np.int64)
            probe_state[1, 8](np.full(k, ps, np.int64), np.full(k, d, np.int64), np.arange(k, dtype=np.int64),
                              tm, tdig, rels)
            assert rels.tolist() == [rel_of(ps, d, r, tm, tdig) for r in range(k)]
            rows.append(np.pad(row, (0, 8 - k)))
            sps.append(sp)
            pss.append(ps)
            ds.append(d)
            want.append(sum(enter))
        out = np.zeros(16, np.int64)
        probe[4, 4](np.array(rows), k, np.array(sps, np.int64), np.array(pss, np.int64), np.array(ds, np.int64),
                    tq, tm, tdig, out)
        assert out.tolist() == want, (trial, k, tm, tdig.tolist(), tq, list(zip(sps, pss, ds)))
        checked += 16
    assert checked == 640


@sim_only
def test_sim_root_only_and_limits(sim):
    assert sim.build_tree(torch.randn(3, 5), 0).n == 0
    assert sim.build_tree(torch.zeros(0, 5), 4).n == 0
    root_only = sim.build_tree(torch.randn(2, 5), 0)
    check_compile(sim, root_only, root=3, start=0)
    assert sim.follow_verified_tree(sim.compile_tree(root_only, 3, 0), torch.tensor([8])).to_host() == ([0], 8)
    with pytest.raises(ValueError, match="budget"):
        sim.build_tree(torch.randn(2, 5), 1025)
    with pytest.raises(ValueError, match="L = 16"):
        sim.build_tree(torch.randn(16, 5), 4)
    with pytest.raises(ValueError, match="budget"):
        sim.build_tree(torch.randn(2, 5), -1)
    with pytest.raises(ValueError, match="NaN"):
        sim.build_tree(torch.tensor([[0.0, float("nan")]]), 2, check_values=True)
    for bad in (-1, 65, True):
        with pytest.raises(ValueError, match="list_max"):
            sim.build_tree(torch.randn(2, 5), 4, config=sim.Config(8, 64, 8, 8, list_max=bad))
    with pytest.raises(ValueError, match="beam must be one of"):
        sim.build_tree(torch.randn(2, 5), 4, config=sim.Config(8, 64, 8, 8, beam="heap"))
    # the simulator's threshold beam holds budgets up to 64 (16 C in shared memory); the GPU's up to 512
    assert sim.build_tree(torch.randn(2, 70), 64, config=sim.Config(8, 64, 8, 8, beam="threshold")).n == 64


# ---- real GPU -----------------------------------------------------------------------------------------------

@pytest.fixture
def gpu():
    if SIM_CHILD:
        pytest.skip("the simulator subprocess has no real GPU")
    from optimized import tree_numba as opt
    assert opt.backend() == "cuda", "NUMBA_ENABLE_CUDASIM is set: unset it to test on the GPU"
    return opt


FULL_V = 163_840


@pytest.mark.gpu
@pytest.mark.parametrize("depth", [7, 15])
@pytest.mark.parametrize("budget", [16, 64, 256, 1024])
@pytest.mark.parametrize("kind", ["normal", "integer", "peaked"])
def test_gpu_full_shapes_match_reference(gpu, depth, budget, kind):
    x = logits(kind, depth, FULL_V, depth * 1000 + budget, device="cuda")
    got = gpu.build_tree(x, budget, check_values=True)
    assert got.tokens.is_cuda
    assert_same_topk(gpu, x, budget, f"{kind} L={depth} B={budget}")
    assert_same_tree(got, ref.build_tree(x, budget), f"{kind} L={depth} B={budget}")


@pytest.mark.gpu
@settings(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(kind=st.sampled_from(KINDS + ("equal",)), depth=st.integers(1, 15), vocab=st.integers(1, 5000),
       budget=st.integers(1, 1024), seed=st.integers(0, 2 ** 31 - 1),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]), list_max=st.sampled_from([0, None]),
       beam=st.sampled_from(["tree", "threshold"]), shallow=st.booleans())
@example(kind="equal", depth=15, vocab=FULL_V, budget=1024, seed=0, dtype=torch.float32, list_max=None, beam="tree",
         shallow=True)
@example(kind="peaked", depth=15, vocab=3, budget=1024, seed=0, dtype=torch.float32, list_max=None, beam="tree",
         shallow=True)
@example(kind="equal", depth=15, vocab=FULL_V, budget=32, seed=0, dtype=torch.float32, list_max=0, beam="tree",
         shallow=True)
@example(kind="peaked", depth=15, vocab=3, budget=512, seed=0, dtype=torch.float32, list_max=0, beam="threshold",
         shallow=True)
@example(kind="equal", depth=15, vocab=FULL_V, budget=512, seed=0, dtype=torch.float32, list_max=0,
         beam="threshold", shallow=True)
@example(kind="normal", depth=3, vocab=FULL_V, budget=256, seed=0, dtype=torch.float32, list_max=0, beam="tree",
         shallow=True)
def test_gpu_build_matches_reference(gpu, kind, depth, vocab, budget, seed, dtype, list_max, beam, shallow):
    """The default config (the two-level selection on trees at most 2 deep, the warp-list beam up to budget 32,
    tree_beam above), the beams above the list alone (list_max=0), each with tree_beam or the threshold beam
    (budgets up to BMAX_THRESH) above list_max, with and without the two-level selection (Config.shallow)."""
    cfg = gpu.DEFAULT_CONFIG if list_max is None else dataclasses.replace(gpu.DEFAULT_CONFIG, list_max=list_max)
    cfg = dataclasses.replace(cfg, beam=beam, shallow=shallow)
    if beam == "threshold":
        budget = min(budget, gpu.BMAX_THRESH)
    x = logits(kind, depth, vocab, seed, device="cuda").to(dtype)
    got = gpu.build_tree(x, budget, check_values=True, config=cfg)
    assert_same_tree(got, ref.build_tree(x, budget), f"{kind} L={depth} V={vocab} B={budget} {dtype}")


SELECTION_PROBE = """
def probe(top_lp, top_id, k, budget, tok, dep, par, score, n, took):
    v = select(top_lp, top_id, k, budget, tok, dep, par, score, n)
    if cuda.threadIdx.x == 0:
        took[0] = 1 if v else 0
"""


def probe_selection(gpu, make, kind: str, depth: int, budget: int):
    """Run a selection device function (tree_shallow.two_level_for / tree_segment.segment_for, built by make(T, GA))
    alone on full-shape logits, in the geometry the launcher gives it. Returns (taken, the reference tree), having
    checked that a taken tree is the reference's node for node and that a declined call wrote nothing."""
    from optimized.kernels import tree_shallow
    _, threads, smem = tree_shallow.shallow_for(budget, gpu.DEFAULT_CONFIG.beam_threads)
    probe = sim_kernel(SELECTION_PROBE, "probe", select=make(threads, max(1, max(budget, 32) // threads)))
    x = logits(kind, depth, FULL_V, depth * 1000 + budget, device="cuda")
    want = ref.build_tree(x, budget)
    top_lp, top_id = (t.cuda() for t in ref.ranked_candidates(x.cpu(), budget))
    outs = [torch.full((budget,), -7, dtype=torch.long, device="cuda") for _ in range(3)]
    outs += [torch.full((budget,), -7.0, dtype=torch.float64, device="cuda"),
             torch.full((1,), -7, dtype=torch.long, device="cuda"), torch.zeros(1, dtype=torch.long, device="cuda")]
    probe[1, threads, 0, smem](gpu._arr(top_lp), gpu._arr(top_id), top_lp.shape[1], budget,
                               *(gpu._arr(o) for o in outs))
    took = bool(outs[5].item())
    if took:
        n = int(outs[4].item())
        assert_same_tree(ref.Tree(*(o[:n] for o in outs[:4])), want, f"{kind} L={depth} B={budget}")
    else:
        assert all(bool((o == -7).all()) for o in outs[:5]), f"{kind} L={depth} B={budget}: declined but wrote"
    return took, want


@pytest.mark.gpu
@pytest.mark.parametrize("depth", [7, 15])
@pytest.mark.parametrize("budget", [16, 32, 64, 128, 256])
@pytest.mark.parametrize("kind", ["normal", "draftlike", "integer", "equal"])
def test_gpu_segment_full_shapes(gpu, depth, budget, kind):
    """tree_segment.segment alone at full shapes: whenever it takes a tree it is the reference tree node for node
    (draft-like rows up to budget 32, trees 5-15 deep, must be taken); when it declines it writes nothing. Budgets
    128-256: the dynamic pool at C = 128 / 256."""
    from optimized.kernels import tree_segment
    took, want = probe_selection(gpu, tree_segment.segment_for, kind, depth, budget)
    if kind == "draftlike" and budget <= 32:
        assert took, f"draft-like L={depth} B={budget} (tree depth {int(want.depths.max())}) was declined"
    print(f"segment {kind} L={depth} B={budget}: {'taken' if took else 'declined'}, tree depth "
          f"{int(want.depths.max())}")


@pytest.mark.gpu
@pytest.mark.parametrize("depth", [7, 15])
@pytest.mark.parametrize("budget", [512, 1024])
@pytest.mark.parametrize("kind", ["draftlike", "normal", "equal"])
def test_gpu_segment_own_launch_full_shapes(gpu, depth, budget, kind):
    """Budgets above 256: the segment selection's own launch (its pool of up to 176 KB needs the raised dynamic
    shared-memory limit, tree_numba._launch_big), then tree_beam's launch that runs only if it declined. A taken
    tree is the reference's node for node (draft-like rows, up to 6,416 nodes in E, must be taken; trees at most 2
    deep must be left to tree_beam), a declined call writes only out_n = -1, and the pair gives the reference tree
    either way."""
    from optimized.kernels import tree_segment
    x = logits(kind, depth, FULL_V, depth * 1000 + budget, device="cuda")
    want = ref.build_tree(x, budget)
    top_lp, top_id = (t.cuda() for t in ref.ranked_candidates(x.cpu(), budget))
    outs = [torch.full((budget,), -7, dtype=torch.long, device="cuda") for _ in range(3)]
    outs += [torch.full((budget,), -7.0, dtype=torch.float64, device="cuda"),
             torch.full((1,), -7, dtype=torch.long, device="cuda")]
    args = (gpu._arr(top_lp), gpu._arr(top_id), top_lp.shape[1], budget) + tuple(gpu._arr(o) for o in outs)
    seg, threads, smem = tree_segment.segment_kernel_for(budget, gpu.DEFAULT_CONFIG.beam_threads)
    assert smem > 48 * 1024
    gpu._launch_big(seg, threads, smem, 0, args)
    took = int(outs[4].item()) >= 0
    what = f"{kind} L={depth} B={budget}"
    if took:
        assert_same_tree(ref.Tree(*(o[:int(outs[4].item())] for o in outs[:4])), want, what)
    else:
        assert int(outs[4].item()) == -1 and all(bool((o == -7).all()) for o in outs[:4]), f"{what}: declined but wrote"
    if kind == "draftlike":
        assert took, f"draft-like L={depth} B={budget} (tree depth {int(want.depths.max())}) was declined"
    if int(want.depths.max()) <= 2:
        assert not took, f"{what}: a tree {int(want.depths.max())} deep was not left to tree_beam"
    beam, tb = tree_segment.beam_unless_for(budget, gpu.DEFAULT_CONFIG.beam_threads)
    beam[1, tb](*args)
    assert_same_tree(ref.Tree(*(o[:int(outs[4].item())] for o in outs[:4])), want, f"{what} (took {took})")
    print(f"segment (own launch) {what}: {'taken' if took else 'declined'}, tree depth {int(want.depths.max())}")


@pytest.mark.gpu
@pytest.mark.parametrize("depth", [7, 15])
@pytest.mark.parametrize("budget", [16, 32, 64, 256])
@pytest.mark.parametrize("kind", ["normal", "draftlike", "integer", "equal"])
def test_gpu_two_level_full_shapes(gpu, depth, budget, kind):
    """tree_shallow.two_level alone at full shapes: it takes the tree exactly when the reference tree is at most 2
    deep (draft-like rows: declined; normal ones: mostly taken, but e.g. L = 15, budget 32 of this seed makes a
    3-deep tree), and then writes the reference tree node for node."""
    from optimized.kernels import tree_shallow
    took, want = probe_selection(gpu, tree_shallow.two_level_for, kind, depth, budget)
    shallow = int(want.depths.max()) <= 2
    assert took == shallow, f"{kind} L={depth} B={budget}: took {took}, reference depth {int(want.depths.max())}"


@pytest.mark.gpu
@pytest.mark.parametrize("depth", [7, 15])
@pytest.mark.parametrize("budget", [16, 64, 256])
@pytest.mark.parametrize("kind", ["normal", "integer", "peaked", "equal", "draftlike"])
def test_gpu_list_beam_full_shapes_match_reference(gpu, depth, budget, kind):
    """The warp-list beam (Config.list_max), at full shapes: the reference tree, node for node."""
    cfg = dataclasses.replace(gpu.DEFAULT_CONFIG, list_max=gpu.LIST_BMAX)
    x = logits(kind, depth, FULL_V, depth * 1000 + budget, device="cuda")
    got = gpu.build_tree(x, budget, config=cfg, check_values=True)
    assert got.tokens.is_cuda
    assert_same_tree(got, ref.build_tree(x, budget), f"list beam {kind} L={depth} B={budget}")


@pytest.mark.gpu
@pytest.mark.parametrize("depth", [7, 15])
@pytest.mark.parametrize("budget", [16, 64, 256, 512])
@pytest.mark.parametrize("kind", ["normal", "integer", "peaked", "equal", "draftlike"])
def test_gpu_threshold_beam_full_shapes_match_reference(gpu, depth, budget, kind):
    """The threshold beam (Config.beam, list_max=0) at full shapes: the reference tree, node for node."""
    cfg = dataclasses.replace(gpu.DEFAULT_CONFIG, list_max=0, beam="threshold")
    x = logits(kind, depth, FULL_V, depth * 1000 + budget, device="cuda")
    got = gpu.build_tree(x, budget, config=cfg, check_values=True)
    assert got.tokens.is_cuda
    assert_same_tree(got, ref.build_tree(x, budget), f"threshold beam {kind} L={depth} B={budget}")
    print(f"threshold beam {kind} L={depth} B={budget}: rounds, tuple thresholds, nodes, levels, routes = "
          f"{thresh_stats(gpu, depth, FULL_V, budget)}")


@pytest.mark.gpu
@settings(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(kind=st.sampled_from(KINDS + ("draftlike",)), depth=st.integers(1, 15), vocab=st.integers(1, 5000),
       budget=st.integers(1, 256), seed=st.integers(0, 2 ** 31 - 1))
@example(kind="equal", depth=15, vocab=FULL_V, budget=256, seed=0)
@example(kind="peaked", depth=15, vocab=3, budget=256, seed=0)
def test_gpu_list_beam_matches_reference(gpu, kind, depth, vocab, budget, seed):
    cfg = dataclasses.replace(gpu.DEFAULT_CONFIG, list_max=gpu.LIST_BMAX)
    x = logits(kind, depth, vocab, seed, device="cuda")
    got = gpu.build_tree(x, budget, config=cfg, check_values=True)
    assert_same_tree(got, ref.build_tree(x, budget), f"list beam {kind} L={depth} V={vocab} B={budget}")


@pytest.mark.gpu
@pytest.mark.parametrize("budget", [1, 64, 1024])
def test_gpu_compile_follow_commit(gpu, budget):
    tree = gpu.build_tree(logits("normal", 15, 5000, budget, device="cuda"), budget)
    check_compile(gpu, tree, root=9, start=100)
    for seed in range(5):
        check_follow_and_commit(gpu, tree, seed)


GOAL_NOT_MET = ("issue 5 goal not met on the H200 (2026-12-06, f5a8a48, bench/results/tree_run12): 55-175 us at "
                "L = 15, budget <= 256 (goal 40); 110-348 us at budget 1024 (goal 100); bench/results/tree_2026-12-02.md")
NOMINAL_BW = 4.24e12    # the H200's measured copy bandwidth (GPU.md), against which the goal's times are set


SHALLOW = ("not met on the H200 (2026-12-06, f5a8a48, bench/results/tree_run12): 46.6 us (goal 40); it was at the "
           "edge (40.3-40.6 us, fec7ca0) before the warp-list beam became the default up to budget 32, which costs "
           "~6 us more than tree_beam on a one-depth tree and saves 4-15 us on deep (draft-like) ones; on an H100 it "
           "passes at 8a8cc1e (39.3 us, bench/results/tree_run19), which no H200 has measured yet")


@pytest.mark.gpu
@pytest.mark.speed
@pytest.mark.parametrize("depth, budget, kind", [
    pytest.param(7, 16, "normal", marks=pytest.mark.xfail(reason=SHALLOW, strict=False, raises=AssertionError)),
    pytest.param(15, 256, "draftlike", marks=pytest.mark.xfail(reason=GOAL_NOT_MET, strict=False, raises=AssertionError)),
    pytest.param(15, 1024, "draftlike", marks=pytest.mark.xfail(reason=GOAL_NOT_MET, strict=False, raises=AssertionError))])
def test_gpu_speed_goal(gpu, depth, budget, kind):
    """The issue's goal (<= 40 us at budget <= 256, <= 100 us at 1024, on one H200) as a ratio to the floor measured
    in this run: reading the logits once at the copy bandwidth of this GPU (bytes read + written per second of a
    1 GiB device copy). The allowed ratio is the goal's time over the floor at the H200's 4.24 TB/s."""
    x = logits(kind, depth, FULL_V, depth * 7 + budget, device="cuda")
    a = torch.empty(1 << 28, dtype=torch.float32, device="cuda")
    b = torch.empty_like(a)
    bandwidth = 2 * a.numel() * 4 / event_median(lambda: b.copy_(a), warmup=3, reps=20)
    nbytes = x.numel() * 4
    allowed = (40e-6 if budget <= 256 else 100e-6) / (nbytes / NOMINAL_BW)
    ours = event_median(device_path(gpu, x, budget), ahead=True)
    ratio = ours / (nbytes / bandwidth)
    print(f"L={depth} B={budget} {kind}: {ours * 1e6:.1f} us = {ratio:.1f}x the floor at {bandwidth / 1e12:.2f} TB/s "
          f"(allowed {allowed:.1f}x)")
    assert ratio <= allowed, f"{ours * 1e6:.1f} us = {ratio:.1f}x the floor, goal <= {allowed:.1f}x"


@pytest.mark.gpu
@pytest.mark.speed
@pytest.mark.parametrize("budget", [64, 1024])
def test_gpu_speed_vs_reference_path(gpu, budget):
    """Regression check (not the issue's goal: test_gpu_speed_goal is): the device path (logits -> compiled tree,
    device execution time) stays >= 10x faster than the reference path on the same device logits (torch sort +
    host heap + copies), measured in this run; it measures 24-97x (bench/results/tree_run10)."""
    x = logits("normal", 15, FULL_V, 0, device="cuda")
    ours = event_median(device_path(gpu, x, budget), ahead=True)       # device execution
    theirs = reference_path_time(x, budget)
    assert theirs / ours >= 10.0, f"device path {ours * 1e6:.1f} us vs reference {theirs * 1e6:.1f} us"
