"""Command line: `python -m optimized generate --target DIR [--drafter DIR] (--prompt TEXT | --prompt-ids ...)`.

The reference CLI's options (reference/__main__.py, shared code) with the engine's defaults (bf16 on cuda) and
its options: --backend cuda|torch, --eager (no CUDA graphs), --max-seq-len, --budget auto, and --timing (per-round
device time by stage: draft, tree, verify, commit, from one CUDA graph per stage). Streams the text as rounds
commit it; a progress line on stderr (tokens, tokens/s, tau) while it runs.
"""
from __future__ import annotations

import argparse
import sys
import time

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

    def __init__(self, args):
        import optimized
        self.args, self.optimized = args, optimized
        self.timing = optimized.RoundTiming() if args.timing else None
        self.progress = None

    def load_target(self, path, dtype, device):
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

        out = self.optimized.generate(target, drafter, prompt, on_tokens=stream, trace=False, budget=budget,
                                      backend=a.backend, eager=a.eager, max_seq_len=a.max_seq_len,
                                      timing=self.timing, **kw)
        self.progress.done()
        if self.timing is not None:
            per = self.timing.per_round()
            print("\nper round (device ms): " + ", ".join(f"{k} {v:.3f}" for k, v in per.items()) +
                  f" over {self.timing.rounds} rounds", file=sys.stderr)
        print(f"backend {out.backend}, {out.graphs} CUDA graph(s)", file=sys.stderr)
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
    args = parser.parse_args(argv)
    if args.trace:
        print("error: --trace is the reference decoder's tool: python -m reference generate --trace", file=sys.stderr)
        return 2
    try:
        return run_generate(args, _Tier(args))
    except (ValueError, OSError, RuntimeError) as e:        # bad input or a missing GPU stack: one clear line
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
