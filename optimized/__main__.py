"""Command line: `python -m optimized generate --target DIR [--drafter DIR] (--prompt TEXT | --prompt-ids ...)`.

The reference CLI's options (reference/__main__.py, shared code) with the engine's defaults (bf16 on cuda) and
its options: --backend cuda|torch, --eager (no CUDA graphs), --max-seq-len, --budget auto, and --timing (per-round
device time by stage: draft, tree, verify, commit, from one CUDA graph per stage). Streams the text as rounds
commit it; a progress line on stderr (tokens, tokens/s, tau) while it runs.

`python -m optimized compare` (same options) decodes the prompt with the engine AND the reference decoder (same
dtype and device), both traced, and prints the first round and stage where they part (optimized.debug), with
the reference's top-1/top-2 margin when it is the target's choice; exit status 1 when they part.

Expert parallel over several GPUs (optimized.distributed): `torchrun --nproc-per-node N -m optimized generate ...`.
Each rank loads its share of the routed experts and the replicated rest; rank 0 prints the text and the summary,
the other ranks print only their errors (prefixed with the rank). --dist-timeout bounds every collective.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
import traceback

from reference.__main__ import add_generate_args, run_generate


class _Progress:
    """Wraps the on_tokens stream: the text goes to stdout, a refreshed progress line to stderr (tty only)."""

    def __init__(self, total: int):
        self.total, self.count, self.rounds, self.t0 = total, 0, 0, time.perf_counter()
        self.tty = sys.stderr.isatty()

    def __call__(self, new):
        self.count += len(new)
        self.rounds += 1
        if self.tty:
            dt = max(time.perf_counter() - self.t0, 1e-9)
            print(f"\r\x1b[2K[{self.count}/{self.total} tokens, {self.count / dt:.0f} tok/s, "
                  f"tau {self.count / max(self.rounds - 1, 1):.2f}]", end="", file=sys.stderr, flush=True)

    def done(self):
        if self.tty:
            print("\r\x1b[2K", end="", file=sys.stderr, flush=True)


class _Tier:
    """The optimized API with the CLI's engine options bound (run_generate calls load_target/generate)."""

    def __init__(self, args, dist=None):
        import optimized
        self.args, self.optimized, self.dist = args, optimized, dist
        self.timing = optimized.RoundTiming() if args.timing else None
        self.progress = None

    def load_target(self, path, dtype, device):
        if self.dist is not None:
            from optimized.distributed import load_target_shard
            return load_target_shard(path, self.dist.rank, self.dist.world, dtype=dtype, device=self.dist.device)
        return self.optimized.load_target(path, dtype=dtype, device=device)

    def load_drafter(self, path, target):
        return self.optimized.load_drafter(path, target=target)

    def generate(self, target, drafter, prompt, on_tokens=None, trace=False, budget=None, **kw):
        a = self.args
        if a.budget_auto:
            budget = "auto"
        self.progress = _Progress(kw["max_new_tokens"])

        def stream(new):
            on_tokens(new)
            self.progress(new)

        run = self.optimized.generate
        if self.dist is not None:
            from optimized.distributed import generate_distributed as run
        out = run(target, drafter, prompt, on_tokens=stream, budget=budget, backend=a.backend, eager=a.eager,
                  max_seq_len=a.max_seq_len, timing=self.timing, **kw)
        self.progress.done()
        if self.timing is not None:
            per = self.timing.per_round()
            print("\nper round (device ms): " + ", ".join(f"{k} {v:.3f}" for k, v in per.items()) +
                  f" over {self.timing.rounds} rounds", file=sys.stderr)
        ep = "" if self.dist is None else \
            f", expert parallel over {self.dist.world} ranks ({self.dist.backend}, {len(target.expert_shard.experts)}" \
            f" of {target.cfg.n_routed_experts} experts on rank 0)"
        print(f"backend {out.backend}, {out.graphs} CUDA graph(s){ep}", file=sys.stderr)
        return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m optimized", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="decode with the optimized engine")
    add_generate_args(g)
    g.set_defaults(dtype="bfloat16", device="cuda")
    g.add_argument("--backend", choices=["cuda", "torch"], default="cuda")
    g.add_argument("--eager", action="store_true", help="run rounds without CUDA graphs")
    g.add_argument("--max-seq-len", type=int, default=None, help="prompt + new tokens the buffers hold")
    g.add_argument("--budget-auto", action="store_true", help="pick each round's budget from the measured "
                   "cost model (overrides --budget)")
    g.add_argument("--timing", action="store_true", help="print per-round device time by stage")
    g.add_argument("--dist-timeout", type=float, default=None, help="under torchrun: seconds any collective may "
                   "wait (rendezvous and the slowest rank's load included) before the job fails; default 600")
    c = sub.add_parser("compare", help="find the first round and stage where the engine departs from the "
                       "reference decoder")
    add_generate_args(c)
    c.set_defaults(dtype="bfloat16", device="cuda")
    c.add_argument("--backend", choices=["cuda", "torch"], default="cuda")
    c.add_argument("--eager", action="store_true", help="run rounds without CUDA graphs")
    c.add_argument("--max-seq-len", type=int, default=None, help="prompt + new tokens the buffers hold")
    args = parser.parse_args(argv)
    if args.command == "compare":
        try:
            return _compare(args)
        except (ValueError, OSError, RuntimeError) as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
    if args.trace:
        print("error: --trace is the reference decoder's tool: python -m reference generate --trace", file=sys.stderr)
        return 2
    from optimized.distributed import is_torchrun
    if is_torchrun():
        return _main_distributed(args)
    try:
        return run_generate(args, _Tier(args))
    except (ValueError, OSError, RuntimeError) as e:        # bad input or a missing GPU stack: one clear line
        print(f"error: {e}", file=sys.stderr)
        return 2


def _compare(args) -> int:
    import optimized
    import reference
    from optimized.debug import compare_runs
    from optimized.engine import Engine
    from reference.__main__ import DTYPES, load_tokenizer, prompt_ids_of, stop_ids_of
    dtype = DTYPES[args.dtype]
    if args.mode != "ar" and not args.drafter:
        print(f"error: --mode {args.mode} needs --drafter", file=sys.stderr)
        return 2
    fast_t = optimized.load_target(args.target, dtype=dtype, device=args.device)
    fast_d = optimized.load_drafter(args.drafter, target=fast_t) if args.drafter else None
    ref_t = reference.load_target(args.target, dtype=dtype, device=args.device)
    ref_d = reference.load_drafter(args.drafter, target=ref_t) if args.drafter else None
    prompt = prompt_ids_of(args, load_tokenizer(args.target) if args.prompt is not None else None)
    if prompt is None:
        return 2
    engine = Engine(fast_t, fast_d, backend=args.backend, eager=args.eager,
                    max_seq_len=args.max_seq_len or len(prompt) + args.max_new_tokens)
    cmp = compare_runs(engine, ref_t, ref_d, prompt, max_new_tokens=args.max_new_tokens, mode=args.mode,
                       budget=args.budget, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                       seed=args.seed, stop_token_ids=[] if args.no_stop else stop_ids_of(args.target, ref_t.cfg))
    same = cmp.fast.tokens == cmp.reference.tokens
    print(f"{args.mode} budget {args.budget}, {args.dtype} on {args.device}, backend {args.backend}: "
          f"{len(cmp.reference.tokens)} reference tokens, {len(cmp.fast.tokens)} engine tokens, "
          f"{'identical' if same else 'different'}; {cmp.rounds} round(s) compared")
    print(cmp)
    return 0 if cmp.divergence is None else 1


def _main_distributed(args) -> int:
    """Under torchrun: one process per rank, expert parallel; only rank 0 writes the text and the summary."""
    from optimized import distributed
    rank = os.environ.get("RANK", "?")
    try:
        d = distributed.init(timeout_s=args.dist_timeout or distributed.DEFAULT_TIMEOUT_S, device=args.device)
        quiet = d.rank != 0
        with open(os.devnull, "w") as null, contextlib.redirect_stdout(null if quiet else sys.stdout), \
                contextlib.redirect_stderr(null if quiet else sys.stderr), distributed.failure_guard():
            return run_generate(args, _Tier(args, d))
    except (ValueError, OSError, RuntimeError) as e:
        print(f"error: rank {rank}: {e}", file=sys.stderr)
        return 2
    except Exception:                   # handled (not left to the interpreter) so that shutdown frees the group
        print(f"error: rank {rank}:", file=sys.stderr)
        traceback.print_exc()
        return 1
    finally:
        distributed.shutdown()


if __name__ == "__main__":
    sys.exit(main())
