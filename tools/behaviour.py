"""What the zero-argument runs write, as hashes: run before a refactor and after it, and compare.

    python tools/behaviour.py > before.txt      # from a clean checkout; about an hour on 2 cores
    python tools/behaviour.py --only dpo,grpo   # a subset, by the names below
    python tools/behaviour.py --rev HEAD~3      # another commit's runs, to set beside these

Each command runs in a fresh clone of HEAD (or --rev; so nothing in the working tree's out/ is
reused), one thread per process, and prints the sha256 of the weights in the model.safetensors it
wrote (each tensor's name and bytes, in name order: the file's own bytes also hold its metadata,
whose key order may vary) and of the eval.json, without its timing fields (they differ run to run
by the clock alone). A refactor that keeps behaviour prints the same lines.
"""
import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile

from safetensors.numpy import load_file

RUNS = {  # name: (command, the folder it writes)
    "dpo": ("python dpo.py", "out/dpo"),
    "ppo": ("python ppo.py", "out/ppo"),
    "grpo": ("python grpo.py", "out/grpo"),
    "online_dpo": ("python online_dpo.py", "out/online_dpo"),
    "iterative_dpo": ("python iterative_dpo.py --rounds 2", "out/iterative_dpo"),
    "dpo_2ranks": ("torchrun --nproc_per_node=2 dpo.py", "out/dpo"),
    "dpo_2ranks_fsdp": ("torchrun --nproc_per_node=2 dpo.py --fsdp", "out/dpo"),
}
TIMING = ("time", "ms", "sec", "mfu", "tokens_per_sec", "wall")  # keys that hold the clock


def untimed(x):
    """x without the keys whose values are measured by the clock, at any depth."""
    if isinstance(x, dict):
        return {k: untimed(v) for k, v in x.items() if not any(t in k for t in TIMING)}
    if isinstance(x, list):
        return [untimed(v) for v in x]
    return x


def sha(b):
    return hashlib.sha256(b).hexdigest()[:16]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--only", default=",".join(RUNS), help="comma-separated names of RUNS")
    ap.add_argument("--rev", default="HEAD", help="the commit whose runs to hash")
    args = ap.parse_args()
    names = args.only.split(",")
    root = subprocess.run(["git", "rev-parse", "--show-toplevel"], capture_output=True, text=True,
                          check=True).stdout.strip()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    for name in names:
        cmd, folder = RUNS[name]
        with tempfile.TemporaryDirectory() as tmp:
            clone = os.path.join(tmp, "clone")
            subprocess.run(["git", "clone", "-q", root, clone], check=True)
            subprocess.run(["git", "-C", clone, "checkout", "-q", args.rev], check=True)
            done = subprocess.run(cmd, shell=True, cwd=clone, env=env, capture_output=True,
                                  text=True)
            if done.returncode:
                sys.exit(f"{name}: `{cmd}` exited {done.returncode}:\n{done.stderr[-2000:]}")
            tensors = load_file(os.path.join(clone, folder, "model.safetensors"))
            model = b"".join(k.encode() + v.tobytes() for k, v in sorted(tensors.items()))
            ev = json.load(open(os.path.join(clone, folder, "eval.json")))
            ev = json.dumps(untimed(ev), sort_keys=True).encode()
            print(f"{name:16} model {sha(model)}  eval {sha(ev)}  ({cmd})", flush=True)


if __name__ == "__main__":
    main()
