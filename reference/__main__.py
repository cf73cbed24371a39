"""Command line: `python -m reference generate --target DIR [--drafter DIR] (--prompt TEXT | --prompt-ids ...)`.

Streams the text as rounds commit it (or the ids when the target directory has no tokenizer.json) and ends
with acceptance statistics: rounds, mean tau (tokens per round, bonus counted), a histogram, tokens/s.
`--trace` prints every round: the tree (node, parent, depth, token, score), the target's choice per row, the
accepted path and the bonus.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16}


def load_tokenizer(target_dir: str):
    """The fixture's tokenizer (tokenizer.json beside config.json), or None when there is none."""
    path = os.path.join(target_dir, "tokenizer.json")
    if not os.path.exists(path):
        return None
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise SystemExit(f"{path} needs the `tokenizers` package: pip install tokenizers") from None
    return Tokenizer.from_file(path)


def stop_ids_of(target_dir: str, cfg) -> list[int]:
    ids = list(cfg.eos_token_id)
    gen = os.path.join(target_dir, "generation_config.json")
    if os.path.exists(gen):
        eos = json.load(open(gen)).get("eos_token_id")
        ids += eos if isinstance(eos, list) else ([eos] if eos is not None else [])
    return sorted(set(ids))


def prompt_ids_of(args, tok):
    """The prompt's token ids (--prompt through the tokenizer, or --prompt-ids); None, with the error printed,
    when --prompt is given and the target directory has no tokenizer."""
    if args.prompt is None:
        return args.prompt_ids
    if tok is None:
        print(f"error: {args.target} has no tokenizer.json; pass --prompt-ids", file=sys.stderr)
        return None
    return tok.encode(args.prompt).ids


def add_generate_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", required=True, help="HF-format target directory (config.json + safetensors)")
    p.add_argument("--drafter", help="HF-format DFlash drafter directory (needed for chain and ddtree)")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="prompt text (needs tokenizer.json in the target directory)")
    src.add_argument("--prompt-ids", type=int, nargs="+", help="prompt token ids")
    p.add_argument("--mode", choices=["ar", "chain", "ddtree"], default="ddtree")
    p.add_argument("--budget", type=int, default=None, help="DDTree node budget (default: block_size - 1)")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--no-stop", action="store_true", help="ignore the EOS ids of config/generation_config")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    p.add_argument("--device", default="cpu")
    p.add_argument("--trace", action="store_true", help="print every round's tree, choices and accepted path")


def print_trace(rounds) -> None:
    for r, t in enumerate(rounds):
        print(f"\n-- round {r}: start {t.start}, {t.tree.n} nodes, accepted {t.accepted} -> "
              f"emitted {t.emitted}, bonus {t.bonus}", file=sys.stderr)
        print("   node parent depth token  score     target", file=sys.stderr)
        print(f"   {0:4d} {'-':>6} {0:5d} {int(t.compiled.ids[0]):6d} {'':9} {t.target_choices[0]:6d}"
              f"{'  *' if 0 in t.accepted else ''}", file=sys.stderr)
        for i in range(t.tree.n):
            print(f"   {i + 1:4d} {int(t.tree.parents[i]):6d} {int(t.tree.depths[i]):5d} "
                  f"{int(t.tree.tokens[i]):6d} {float(t.tree.scores[i]):9.4f} {t.target_choices[i + 1]:6d}"
                  f"{'  *' if i + 1 in t.accepted else ''}", file=sys.stderr)


def summary(out, seconds: float) -> str:
    lengths = out.acceptance_lengths
    lines = [f"{len(out.tokens)} tokens in {seconds:.2f} s ({len(out.tokens) / max(seconds, 1e-9):.1f} tokens/s), "
             f"{len(lengths)} rounds, mean tau {out.mean_acceptance:.3f} (tokens per round, bonus counted)"]
    if lengths:
        top = max(lengths)
        hist = [lengths.count(k) for k in range(1, top + 1)]
        width = max(hist)
        for k, c in enumerate(hist, 1):
            lines.append(f"  tau={k:2d} {c:5d} {'#' * max(1 if c else 0, round(30 * c / width))}")
    return "\n".join(lines)


def run_generate(args, tier) -> int:
    """Shared by `python -m reference` and `python -m optimized` (tier = the package with the public API)."""
    dtype = DTYPES[args.dtype]
    target = tier.load_target(args.target, dtype=dtype, device=args.device)
    drafter = tier.load_drafter(args.drafter, target=target) if args.drafter else None
    if args.mode != "ar" and drafter is None:
        print(f"error: --mode {args.mode} needs --drafter", file=sys.stderr)
        return 2
    tok = load_tokenizer(args.target)
    prompt = prompt_ids_of(args, tok)
    if prompt is None:
        return 2
    stops = [] if args.no_stop else stop_ids_of(args.target, target.cfg)
    emitted: list[int] = []

    def stream(new):
        if tok is None:
            print(" ".join(map(str, new)), end=" ", flush=True)
            return
        before = tok.decode(emitted)
        emitted.extend(new)
        print(tok.decode(emitted)[len(before):], end="", flush=True)

    if tok is not None:
        print(args.prompt if args.prompt is not None else tok.decode(prompt), end="", flush=True)
    t0 = time.perf_counter()
    out = tier.generate(target, drafter, prompt, max_new_tokens=args.max_new_tokens, mode=args.mode,
                        budget=args.budget, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                        seed=args.seed, stop_token_ids=stops, trace=args.trace, on_tokens=stream)
    seconds = time.perf_counter() - t0
    print()
    if args.trace:
        print_trace(out.trace)
    print("\n" + summary(out, seconds), file=sys.stderr)
    return 0


def main(argv=None) -> int:
    import reference
    parser = argparse.ArgumentParser(prog="python -m reference", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    add_generate_args(sub.add_parser("generate", help="decode with the reference DDTree decoder"))
    args = parser.parse_args(argv)
    try:
        return run_generate(args, reference)
    except (ValueError, OSError) as e:          # bad input: one clear line, no traceback
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
