"""`python -m reference generate`: runs on the committed fixtures, prints ids or text and the acceptance
statistics, traces rounds on request, and turns bad input into one clear error line (exit status 2)."""
import os
import subprocess
import sys

import pytest

ROOT = os.path.join(os.path.dirname(__file__), "..")
TINY = os.path.join(ROOT, "fixtures", "tiny-random")


def cli(*args):
    return subprocess.run([sys.executable, "-m", "reference", "generate", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)


def test_generate_prints_ids_and_statistics():
    r = cli("--target", f"{TINY}/target", "--drafter", f"{TINY}/drafter", "--prompt-ids", "5", "6", "7",
            "--mode", "ddtree", "--budget", "12", "--max-new-tokens", "10", "--no-stop")
    assert r.returncode == 0, r.stderr
    ids = r.stdout.split()
    assert len(ids) == 10 and all(i.isdigit() for i in ids)
    assert "mean tau" in r.stderr and "tau= 1" in r.stderr


def test_same_tokens_in_every_mode():
    outs = []
    for mode in ("ar", "chain", "ddtree"):
        r = cli("--target", f"{TINY}/target", "--drafter", f"{TINY}/drafter", "--prompt-ids", "9", "3",
                "--mode", mode, "--max-new-tokens", "12", "--no-stop")
        assert r.returncode == 0, r.stderr
        outs.append(r.stdout.split())
    assert outs[0] == outs[1] == outs[2]


def test_trace_lists_the_tree():
    r = cli("--target", f"{TINY}/target", "--drafter", f"{TINY}/drafter", "--prompt-ids", "5", "--budget", "3",
            "--max-new-tokens", "3", "--trace", "--no-stop")
    assert r.returncode == 0, r.stderr
    assert "-- round 0" in r.stderr and "node parent depth token" in r.stderr


@pytest.mark.parametrize("args,message", [
    (["--prompt-ids", "1", "500"], "outside the vocabulary"),
    (["--prompt-ids", "1", "--budget", "-2"], "budget"),
    (["--prompt", "hello"], "no tokenizer.json"),
    (["--prompt-ids", "1", "--mode", "chain", "--drafter", "/nonexistent"], "not a directory"),
])
def test_bad_input_is_one_clear_error(args, message):
    base = ["--target", f"{TINY}/target"]
    if "--drafter" not in args:
        base += ["--drafter", f"{TINY}/drafter"]
    r = cli(*base, *args)
    assert r.returncode == 2 and message in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_prompt_ids_with_a_tokenizer_echo_the_decoded_prompt():
    trained = os.path.join(ROOT, "fixtures", "trained")
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(os.path.join(trained, "target", "tokenizer.json"))
    ids = tok.encode("Enter the King").ids
    r = cli("--target", f"{trained}/target", "--drafter", f"{trained}/drafter", "--prompt-ids", *map(str, ids),
            "--max-new-tokens", "4", "--no-stop")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("Enter the King"), r.stdout[:40]
