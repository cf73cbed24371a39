"""Expert parallelism (optimized.distributed) against the single-process reference decoder.

CPU (CI): 2, 3 and 4 processes with gloo, each holding its block of the routed experts of a tiny float64 target
written in the sharded on-disk format (several safetensors files + index): the torch-backend engine's tokens AND
acceptance lengths on every rank equal reference.generate's, for ar, chain and ddtree at two budgets; rounds do
accept more than the bonus. Each rank reads only its experts' tensors (checked by recording every tensor asked of
the safetensors files). A rank that raises, or hangs, ends the whole job within a bounded time with an error
naming what happened. `torchrun --nproc-per-node 2 -m optimized generate` prints the single-process CLI's tokens.

GPU (marked gpu, needs 2 GPUs): NCCL + the cuda backend on the trained pair equals the single-GPU engine (bf16:
equal, or a first divergence at a near-tie of the reference, as in test_engine).

The worker is this file run as a script (`python conformance/test_distributed.py SPEC.json`), started once per
rank with torchrun's environment variables (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT).
"""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import traceback

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
if __name__ == "__main__":
    sys.path.insert(0, ROOT)

import pytest  # noqa: E402
import torch  # noqa: E402

import optimized  # noqa: E402
import reference  # noqa: E402
from optimized import distributed  # noqa: E402

VOCAB = 12                       # small: the random drafter's guesses are right often enough to be accepted
NEW = 20
RUNS = [("ar", None), ("chain", None), ("ddtree", 4), ("ddtree", 16)]
PROMPTS = [[3, 1, 4, 1, 5], [9, 2, 6, 5, 3, 5, 8, 9, 7]]
DTYPES = {"float64": torch.float64, "bfloat16": torch.bfloat16}
TRAINED = os.path.join(ROOT, "fixtures", "trained")


# ---- the worker (one per rank) ---------------------------------------------------------------------------------

def worker(spec_path: str) -> int:
    spec = json.load(open(spec_path))
    d = distributed.init(timeout_s=spec["timeout_s"], device=spec["device"])
    try:
        with distributed.failure_guard():
            target = distributed.load_target_shard(spec["target"], d.rank, d.world, DTYPES[spec["dtype"]], d.device)
            drafter = optimized.load_drafter(spec["drafter"], target=target)
            fail = spec.get("fail") or {}
            engine = distributed.engine_for_rank(target, drafter, backend=spec["backend"], max_seq_len=64)
            if spec.get("skew_auto"):
                skew_auto_budget(engine.auto_budget, d.rank)
            results = []
            for prompt, mode, budget in spec["runs"]:
                def on_tokens(new, first=[True]):
                    if d.rank == fail.get("rank") and not first[0]:     # after a round: the peers are waiting
                        if fail["how"] == "raise":
                            raise RuntimeError(f"injected failure on rank {d.rank}")
                        time.sleep(3600)
                    first[0] = False
                h0 = len(engine.auto_budget.history)
                out = distributed.generate_distributed(target, drafter, prompt, max_new_tokens=spec["new"],
                                                       mode=mode, budget=budget, backend=spec["backend"],
                                                       max_seq_len=64, on_tokens=on_tokens)
                results.append({"tokens": out.tokens, "acceptance": out.acceptance_lengths, "backend": out.backend,
                                "auto_history": engine.auto_budget.history[h0:]})
        shard = target.expert_shard
        with open(f"{spec['out']}.{d.rank}.json", "w") as f:
            json.dump({"results": results, "experts": list(shard.experts), "tensors_read": sorted(shard.tensors_read),
                       "files_opened": sorted(shard.files_opened)}, f)
        return 0
    except Exception:
        traceback.print_exc()       # handled here, so that no frame keeps the process group alive at exit
        return 1
    finally:
        distributed.shutdown()


def skew_auto_budget(auto, rank: int) -> None:
    """Past warm-up, with measurements that make each rank prefer a different budget (rank r: the r-th
    candidate): left to their own timings the ranks would build different trees."""
    for b in auto.candidates:
        auto.count[b], auto.tokens[b], auto.seconds[b] = auto.warmup, 1.0, 1.0
    auto.seconds[auto.candidates[rank % len(auto.candidates)]] = 1e-3


# ---- launching a job --------------------------------------------------------------------------------------------

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def env(**extra):
    e = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1")
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        e.pop(k, None)
    e.update({k: str(v) for k, v in extra.items()})
    return e


def launch(tmp, world: int, spec: dict, deadline_s: float = 100, grace_s: float = 5):
    """Start `world` worker processes as torchrun would; like torchrun, once a rank has failed the others get
    grace_s to end and are then killed. Returns (return codes, stderr per rank, seconds, rank outputs)."""
    spec = dict(spec, out=str(tmp / "out"))
    path = tmp / "spec.json"
    path.write_text(json.dumps(spec))
    port, procs, errs = free_port(), [], []
    t0 = time.monotonic()
    for r in range(world):
        errs.append(open(tmp / f"stderr.{r}", "w+"))
        procs.append(subprocess.Popen([sys.executable, __file__, str(path)], cwd=ROOT, stdout=subprocess.DEVNULL,
                                      stderr=errs[-1], env=env(RANK=r, WORLD_SIZE=world, LOCAL_RANK=r,
                                                               LOCAL_WORLD_SIZE=world, MASTER_ADDR="127.0.0.1",
                                                               MASTER_PORT=port)))
    failed_at = None
    try:
        while any(p.poll() is None for p in procs) and time.monotonic() - t0 < deadline_s:
            if failed_at is None and any(p.poll() not in (None, 0) for p in procs):
                failed_at = time.monotonic()
            if failed_at is not None and time.monotonic() - failed_at > grace_s:
                break
            time.sleep(0.05)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
    seconds = time.monotonic() - t0
    stderr = []
    for f in errs:
        f.seek(0)
        stderr.append(f.read())
        f.close()
    outs = [json.load(open(f"{spec['out']}.{r}.json")) if os.path.exists(f"{spec['out']}.{r}.json") else None
            for r in range(world)]
    return [p.returncode for p in procs], stderr, seconds, outs


# ---- CPU: a sharded tiny float64 pair -------------------------------------------------------------------------

@pytest.fixture(scope="module")
def pair_dirs(tmp_path_factory):
    from reference.factory import random_drafter, tiny_config, tiny_drafter_config, write_random_target
    base = tmp_path_factory.mktemp("ep")
    cfg = tiny_config(vocab_size=VOCAB)
    tdir = write_random_target(str(base / "target"), cfg, seed=0, max_shard_bytes=24_000)
    target = reference.load_target(tdir, dtype=torch.float64)
    ddir = str(base / "drafter")
    reference.save_drafter(random_drafter(tiny_drafter_config(cfg), target, seed=100), ddir, dtype=torch.float32)
    assert len([f for f in os.listdir(tdir) if f.endswith(".safetensors")]) >= 3
    assert os.path.exists(os.path.join(tdir, reference.checkpoint.INDEX_FILE))
    return tdir, ddir


@pytest.fixture(scope="module")
def reference_outputs(pair_dirs):
    tdir, ddir = pair_dirs
    target = reference.load_target(tdir, dtype=torch.float64)
    drafter = reference.load_drafter(ddir, target=target)
    return [reference.generate(target, drafter, p, max_new_tokens=NEW, mode=m, budget=b)
            for p in PROMPTS for m, b in RUNS]


def cpu_spec(pair_dirs, **kw):
    tdir, ddir = pair_dirs
    return dict(target=tdir, drafter=ddir, dtype="float64", device="cpu", backend="torch", timeout_s=60, new=NEW,
                runs=[(p, m, b) for p in PROMPTS for m, b in RUNS], **kw)


_jobs: dict = {}


@pytest.fixture(params=[2, 3, 4], ids=lambda w: f"world{w}")
def job(request, pair_dirs, tmp_path_factory):
    world = request.param
    if world not in _jobs:
        codes, stderr, seconds, outs = launch(tmp_path_factory.mktemp(f"world{world}"), world, cpu_spec(pair_dirs))
        assert codes == [0] * world, f"world {world}: exit codes {codes}\n" + "\n".join(s[-3000:] for s in stderr)
        _jobs[world] = (outs, seconds)
    return world, _jobs[world][0]


def test_tokens_and_acceptance_equal_the_reference(job, reference_outputs):
    from compare import assert_tokens_equal
    world, outs = job
    cases = [(p, m, b) for p in PROMPTS for m, b in RUNS]
    for rank, out in enumerate(outs):
        for (prompt, mode, budget), ref, got in zip(cases, reference_outputs, out["results"]):
            what = f"world {world} rank {rank} {mode}/{budget} prompt {prompt}"
            assert got["backend"] == "torch"
            assert_tokens_equal(got["tokens"], ref.tokens, what)
            assert got["acceptance"] == ref.acceptance_lengths, f"{what}: acceptance lengths differ"
    accepted = [a for r in outs[0]["results"] for a in r["acceptance"]]
    assert max(accepted) >= 2, "the comparison would be vacuous: no round accepted a drafted token"
    assert min(len(set(r["tokens"])) for r in outs[0]["results"]) >= 3, "degenerate output (one repeated token)"


def test_each_rank_reads_only_its_experts(job, pair_dirs):
    """The recorded tensors of the job's ranks: the replicated part on every rank, each expert on exactly one."""
    world, outs = job
    tdir, _ = pair_dirs
    cfg = reference.load_config(tdir)
    weight_map = json.load(open(os.path.join(tdir, reference.checkpoint.INDEX_FILE)))["weight_map"]
    experts = [e for out in outs for e in out["experts"]]
    assert sorted(experts) == list(range(cfg.n_routed_experts))
    for rank, out in enumerate(outs):
        held = distributed.expert_shard(cfg.n_routed_experts, rank, world)
        assert out["experts"] == held
        want = {n for n in weight_map if ".mlp.experts." not in n or int(n.split(".mlp.experts.")[1].split(".")[0])
                in held}
        assert set(out["tensors_read"]) == want
        assert set(out["files_opened"]) == {os.path.join(tdir, weight_map[n]) for n in want}


def test_load_target_shard_asks_the_files_for_its_tensors_only(pair_dirs, monkeypatch):
    """In process, independent of the loader's own record: every get_tensor call is logged. The shard's weights
    equal the full load's; the other experts are on the meta device."""
    tdir, _ = pair_dirs
    asked = []
    real_open = distributed._open

    class Logged:
        def __init__(self, file):
            self.f = real_open(file)

        def __enter__(self):
            self.inner = self.f.__enter__()
            return self

        def __exit__(self, *a):
            return self.f.__exit__(*a)

        def get_tensor(self, name):
            asked.append(name)
            return self.inner.get_tensor(name)

    monkeypatch.setattr(distributed, "_open", Logged)
    full = reference.load_target(tdir, dtype=torch.float64)
    shard = distributed.load_target_shard(tdir, 1, 3, torch.float64, "cpu")
    held = distributed.expert_shard(full.cfg.n_routed_experts, 1, 3)
    assert held == [3, 4, 5] and shard.expert_shard.experts == (3, 4, 5)
    assert len(asked) == len(set(asked)) and set(asked) == shard.expert_shard.tensors_read
    full_state = dict(full.named_parameters()) | dict(full.named_buffers())
    for name, t in list(shard.named_parameters()) + list(shard.named_buffers()):
        e = int(name.split(".experts.")[1].split(".")[0]) if ".mlp.experts." in name else None
        if e is None or e in held:
            assert name in asked or name == "inv_freq"
            assert t.device.type == "cpu" and torch.equal(t, full_state[name]), name
        else:
            assert t.device.type == "meta" and name not in asked, name


def test_expert_shard_blocks():
    for n in (0, 1, 7, 8, 384):
        for world in (1, 2, 3, 4, 8):
            blocks = [distributed.expert_shard(n, r, world) for r in range(world)]
            assert [e for b in blocks for e in b] == list(range(n))
            assert max(map(len, blocks)) - min(map(len, blocks)) <= 1
    assert distributed.expert_shard(384, 7, 8) == list(range(336, 384))
    with pytest.raises(ValueError, match="rank 2 of world 2"):
        distributed.expert_shard(8, 2, 2)


@pytest.mark.parametrize("how", ["raise", "hang"])
def test_a_failing_rank_ends_the_job(how, pair_dirs, tmp_path):
    """Rank 1 raises (or hangs) after its first round while rank 0 goes on into the next round's all-reduce:
    rank 0 ends on its own, with DistributedError naming rank 1's error (raise) or the timeout (hang), in bounded
    time; nothing waits forever."""
    timeout_s = 8
    spec = cpu_spec(pair_dirs, fail={"rank": 1, "how": how})
    spec.update(timeout_s=timeout_s, runs=spec["runs"][-1:])
    codes, stderr, seconds, _ = launch(tmp_path, 2, spec, deadline_s=90, grace_s=30 if how == "raise" else 2)
    assert seconds < 60, f"the job took {seconds:.0f} s to fail"
    assert codes[0] not in (0, None) and codes[1] != 0, codes
    assert "DistributedError" in stderr[0], stderr[0][-3000:]
    if how == "raise":
        assert codes[1] == 1 and "RuntimeError: injected failure on rank 1" in stderr[1]
        assert "rank 1 of 2 failed: RuntimeError: injected failure on rank 1" in stderr[0], stderr[0][-3000:]
    else:
        assert "no error recorded by another rank" in stderr[0] and "Timed out" in stderr[0], stderr[0][-3000:]


def test_cli_under_torchrun_prints_the_single_process_tokens(pair_dirs):
    tdir, ddir = pair_dirs
    args = ["-m", "optimized", "generate", "--target", tdir, "--drafter", ddir, "--prompt-ids", "3", "1", "4", "1",
            "--mode", "ddtree", "--budget", "8", "--max-new-tokens", "16", "--no-stop", "--backend", "torch",
            "--device", "cpu", "--dtype", "float64"]
    one = subprocess.run([sys.executable, *args], cwd=ROOT, env=env(), capture_output=True, text=True, timeout=120)
    assert one.returncode == 0, one.stderr
    run = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", *args,
           "--dist-timeout", "60"]
    two = subprocess.run(run, cwd=ROOT, env=env(), capture_output=True, text=True, timeout=120)
    assert two.returncode == 0, two.stderr[-3000:]
    assert len(one.stdout.split()) == 16 and two.stdout.split() == one.stdout.split()
    assert two.stderr.count("mean tau") == 1 and "expert parallel over 2 ranks (gloo" in two.stderr, two.stderr


def test_budget_auto_follows_rank_0(pair_dirs, reference_outputs, tmp_path):
    """budget="auto" under expert parallelism: each rank's cost model is skewed to prefer a different budget, yet
    every rank runs rank 0's choice each round (same budget history, same acceptance lengths: the job's own
    agreement check passes) and the greedy tokens are the reference's."""
    spec = cpu_spec(pair_dirs, skew_auto=True)
    spec["runs"] = [(p, "ddtree", "auto") for p in PROMPTS]
    codes, stderr, _, outs = launch(tmp_path, 2, spec)
    assert codes == [0, 0], f"exit codes {codes}\n" + "\n".join(s[-3000:] for s in stderr)
    ar = [o for o, (m, _) in zip(reference_outputs, RUNS * len(PROMPTS)) if m == "ar"]
    for i, (r0, r1) in enumerate(zip(outs[0]["results"], outs[1]["results"])):
        assert r0["auto_history"] == r1["auto_history"] and len(r0["auto_history"]) == len(r0["acceptance"])
        assert r0["acceptance"] == r1["acceptance"] and r0["tokens"] == r1["tokens"] == ar[i].tokens
    first = outs[0]["results"][0]["auto_history"]
    assert first[0] == 4, f"rank 0 prefers budget 4 (its skew), the job ran {first}"


def test_cli_budget_auto_under_torchrun_prints_the_greedy_tokens(pair_dirs, reference_outputs):
    tdir, ddir = pair_dirs
    run = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m", "optimized",
           "generate", "--target", tdir, "--drafter", ddir, "--prompt-ids", *map(str, PROMPTS[0]), "--budget-auto",
           "--max-new-tokens", str(NEW), "--no-stop", "--backend", "torch", "--device", "cpu", "--dtype", "float64",
           "--dist-timeout", "60"]
    r = subprocess.run(run, cwd=ROOT, env=env(), capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    assert [int(x) for x in r.stdout.split()] == reference_outputs[0].tokens      # RUNS[0] is ar on PROMPTS[0]


# ---- GPU: NCCL, the cuda backend -----------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_nccl_cuda_engine_equals_the_single_gpu_engine(tmp_path):
    from test_engine import compare_tokens, golden, margins_of
    g = golden()
    cases = g["cases"][:4]
    spec = dict(target=os.path.join(TRAINED, "target"), drafter=os.path.join(TRAINED, "drafter"), dtype="bfloat16",
                device="cuda", backend="cuda", timeout_s=300, new=g["max_new_tokens"],
                runs=[(c["prompt_ids"], "ddtree", 32) for c in cases])
    codes, stderr, seconds, outs = launch(tmp_path, 2, spec, deadline_s=300)
    assert codes == [0, 0], "\n".join(s[-3000:] for s in stderr)
    bf = optimized.load_target(spec["target"])
    bf_d = optimized.load_drafter(spec["drafter"], target=bf)
    ties = 0
    for j, (case, got) in enumerate(zip(cases, outs[0]["results"])):
        assert got["backend"] == "cuda" and outs[1]["results"][j] == got
        one = optimized.generate(bf, bf_d, case["prompt_ids"], max_new_tokens=g["max_new_tokens"], mode="ddtree",
                                 budget=32)
        tie = compare_tokens(got["tokens"], one.tokens, margins_of(bf, case["prompt_ids"], one.tokens),
                             f"2-GPU vs 1-GPU case {j}")
        ties += tie
        if not tie:
            assert got["acceptance"] == one.acceptance_lengths, f"case {j}: acceptance lengths differ"
    print(f"2-GPU expert parallel vs 1 GPU: {len(cases) - ties}/{len(cases)} equal, {ties} near-tie divergence(s); "
          f"job {seconds:.1f} s")


if __name__ == "__main__":
    sys.exit(worker(sys.argv[1]))
