"""What the test files share: the pin to the CPU, the harness that runs a torchrun job whole, the
tiny task and π_ref with the DPO cache, r_φ and test prompts built on them (fixtures: test_all.py
imports them by name, tests/conftest.py for tests/*.py), and the configs of tiny runs. A file
imports the helpers it calls from here; a helper one file alone calls stays in that file."""
import os

# The suite runs on the CPU whatever the machine: its tolerances are fp32 CPU numerics', and its
# torchrun children are gloo ranks, two of them on one machine. CUDA_VISIBLE_DEVICES="" is set
# here, before torch is imported (test_all.py and tests/conftest.py import this module first), so
# CUDA is hidden from this process and from every child it starts (they inherit os.environ). The
# tests that need CUDA (ids with "on_cuda") are run by test_cuda_tests_in_a_child, in a child
# pytest given the environment as it was and TEST_CUDA=1, which leaves CUDA visible there.
ENV_AS_GIVEN = dict(os.environ)
if os.environ.get("TEST_CUDA") != "1":
    os.environ["CUDA_VISIBLE_DEVICES"] = ""

import contextlib
import itertools
import json
import signal
import subprocess
import sys
import tempfile
import time
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file

import data
import dpo
import iterative_dpo
import ppo
import precompute
import reward
import sft
import task as tasks  # the built-in task (`task` is a fixture's name)
from model import GPT, GPTConfig
from plumbing import Dist

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository


# ==================================================================================================
# the harness: torchrun on the CPU, a run killed whole
# ==================================================================================================

# Every process a spawned run starts carries RUN_TAG=<its tag> in its environment, so that the
# run can be killed whole: torchrun starts each rank in a session of its own, out of reach of the
# launcher's process group, and a rank whose launcher was killed is nobody's child.
RUN_TAG = "TEST_RUN_TAG"
RUNS = itertools.count()


def run_processes(tag):
    """The pids of the live processes of the run `tag`, found by their environment in /proc; a run
    started inside it (by a child pytest) tags its own processes `tag`/..., and they count too."""
    mark = f"{RUN_TAG}={tag}".encode()
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = f.read().split(b"\0")
        except OSError:  # exited meanwhile, or not ours to read
            continue
        if any(v == mark or v.startswith(mark + b"/") for v in env):
            found.append(int(pid))
    return found


def kill_run(tag):
    """SIGKILL the processes of the run `tag` until none is left; returns those found alive."""
    alive = left = run_processes(tag)
    while left:
        for pid in left:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.1)
        left = run_processes(tag)
    return alive


def run_whole(cmds, timeout, env, cwd=ROOT):
    """Run the commands side by side (the launches of one job), each in a process group of its
    own, and wait for them all; returns their CompletedProcesses. Output goes through files, so a
    rank that outlives its launcher cannot block the wait on a pipe. Past `timeout` seconds every
    process they started is killed and the test fails with their output; a process still alive
    after its launcher returned fails the test too."""
    tag = f"{env.get(RUN_TAG, '')}/{os.getpid()}-{next(RUNS)}"
    logs = [[tempfile.TemporaryFile("w+", encoding="utf-8", errors="replace") for _ in "oe"]
            for _ in cmds]
    procs = [subprocess.Popen(c, cwd=cwd, env={**env, RUN_TAG: tag}, stdout=o, stderr=e,
                              start_new_session=True) for c, (o, e) in zip(cmds, logs)]
    end, timed_out = time.monotonic() + timeout, False
    try:
        for p in procs:
            p.wait(timeout=max(end - time.monotonic(), 0))
    except subprocess.TimeoutExpired:
        timed_out = True
    finally:  # a timeout, or the test interrupted: nothing of the run outlives it
        left = kill_run(tag)
        for p in procs:
            p.wait()
    for log in logs:
        for f in log:
            f.seek(0)
    done = [subprocess.CompletedProcess(c, p.returncode, o.read(), e.read())
            for c, p, (o, e) in zip(cmds, procs, logs)]
    said = "\n".join(f"$ {' '.join(r.args)}\n{r.stdout[-4000:]}\n{r.stderr[-4000:]}" for r in done)
    if timed_out:
        pytest.fail(f"still running after {timeout} s: killed, with the {len(left)} processes it "
                    f"started\n{said}")
    assert not left, f"{len(left)} processes outlived their launcher\n{said}"
    return done


def torchrun(script, args, launch):
    """The command `torchrun LAUNCH script args`. script: a file under the repo root, or
    "-m package.module" (as `torchrun -m study.compare` runs it)."""
    target = script.split() if script.startswith("-m ") else [os.path.join(ROOT, script)]
    return [sys.executable, "-m", "torch.distributed.run", *launch, *target, *args]


def torchrun_env(timeout):
    """The ranks' environment: one thread each, and a collective that waits a third of the test's
    `timeout` fails (plumbing's DIST_TIMEOUT_S) and names itself, while the test has time left."""
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT,
            "DIST_TIMEOUT_S": str(timeout // 3)}


def run_torchrun(script, args, nproc=2, cwd=ROOT, timeout=300):
    """`torchrun --nproc_per_node=nproc --standalone script args` on the CPU (gloo), run whole
    (run_whole); returns the CompletedProcess, failing the test with its output if it exits
    non-zero."""
    (p,) = run_whole([torchrun(script, args, [f"--nproc_per_node={nproc}", "--standalone"])],
                     timeout, torchrun_env(timeout), cwd)
    assert p.returncode == 0, f"{' '.join(p.args)} failed:\n{p.stdout[-4000:]}\n{p.stderr[-4000:]}"
    return p


# ==================================================================================================
# the tiny stack: the task, π_ref, the DPO cache, r_φ and test prompts (fixtures, each built
# once for test_all.py and once for tests/)
# ==================================================================================================

TINY_MODEL = dict(n_layer=2, n_head=2, n_embd=32, block_size=64)


@pytest.fixture(scope="session")
def tiny(tmp_path_factory):
    """The built-in task and a tiny π_ref trained on it for a few steps, shared by the whole
    session. Paths: tiny.task (folder with pairs_*.jsonl, prompts_*.jsonl, tokenizer.json),
    tiny.sft (folder with model.safetensors and tokenizer.json), tiny.root (a folder to put further
    stages in: use a subfolder of your own, e.g. tiny.root / 'dpo-test-x', never write into
    tiny.task or tiny.sft)."""
    root = tmp_path_factory.mktemp("stack")
    task = str(root / "task")
    tasks.build_task(task, seed=0)
    sft.main(sft.Config(out_dir=str(root / "sft"), train_text=f"{task}/sft_train.txt",
                        val_text=f"{task}/sft_val.txt", tokenizer=f"{task}/tokenizer.json",
                        **TINY_MODEL,
                        steps=30, batch_size=32, micro_batch_size=16, eval_every=30, ckpt_every=30))
    return SimpleNamespace(root=root, task=task, sft=str(root / "sft"))


@pytest.fixture(scope="session")
def task(tmp_path_factory):
    """The built-in task for seed 0, built by ensure_task in a folder of its own."""
    d = str(tmp_path_factory.mktemp("task") / "task")
    logs = []
    assert tasks.ensure_task(d, seed=0, log=logs.append) == d
    assert len(logs) == 1 and "built the task" in logs[0]
    return d


@pytest.fixture(scope="session")
def tok(task):
    return data.load_tokenizer(os.path.join(task, "tokenizer.json"))


def dpo_pcfg(tiny, out="dpo-cache", pairs=None, ref_model=None):
    return precompute.Config(out_dir=str(tiny.root / out),
                             ref_model=ref_model or f"{tiny.sft}/model.safetensors",
                             train_pairs=pairs or str(tiny.root / "dpo-data/pairs_train.jsonl"),
                             val_pairs=pairs or str(tiny.root / "dpo-data/pairs_val.jsonl"))


@pytest.fixture(scope="session")
def dpo_cache(tiny):
    """A slice of the task (256 train pairs, 64 val pairs, 8 validation and 8 test prompts), so each
    run takes a second, and the tiny π_ref's log-prob cache of it, computed by one process. Once a
    session, as `tiny`: the files of every test that uses it read the same folders."""
    own = tiny.root / "dpo-data"
    os.makedirs(own)
    for name, n in (("pairs_train.jsonl", 256), ("pairs_val.jsonl", 64), ("prompts_val.jsonl", 8),
                    ("prompts_test.jsonl", 8)):
        (own / name).write_text("".join(open(f"{tiny.task}/{name}").readlines()[:n]))
    precompute.main(dpo_pcfg(tiny))
    return str(tiny.root / "dpo-cache")


def reward_args(tiny, out):
    return dict(out_dir=str(out), sft=f"{tiny.sft}/model.safetensors",
                train_pairs=f"{tiny.task}/pairs_train.jsonl",
                val_pairs=f"{tiny.task}/pairs_val.jsonl",
                prompts=f"{tiny.task}/prompts_train.jsonl",
                steps=4, batch_size=8, micro_batch_size=2, eval_every=4, offset_samples=16)


@pytest.fixture(scope="session")
def tiny_rm(tiny):
    """reward.py on two gloo ranks, a few steps on the tiny stack; returns its folder. Once a
    session, as `tiny`."""
    out = tiny.root / "ppo-test" / "reward"
    run_torchrun("reward.py", as_flags(reward_args(tiny, out)))
    return out


@pytest.fixture(scope="session")
def ppo_test_prompts(tiny):
    path = tiny.root / "ppo-test" / "test_prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt": p}) + "\n"
                            for p in data.read_prompts(f"{tiny.task}/prompts_test.jsonl")[:8]))
    return str(path)


# ==================================================================================================
# tiny models, inputs and run configs
# ==================================================================================================

def tiny_gpt(head="lm", seed=0, **kw):
    torch.manual_seed(seed)
    cfg = GPTConfig(**{**dict(block_size=32, vocab_size=13, n_layer=2, n_head=2, n_embd=16), **kw,
                       "head": head})
    return GPT(cfg).double().eval()


def constant_gpt(vocab_size, favourite, block_size=64):
    """A GPT whose next-token distribution ignores its input: ln_f's gain is 0, so every position's
    logits are ln_f.bias · wte^T, here coordinate 0 of each token's embedding: +20 for
    `favourite`, -20 for the others. It emits `favourite` (any other token: probability ~e^-40)."""
    torch.manual_seed(0)
    m = GPT(GPTConfig(block_size=block_size, vocab_size=vocab_size, n_layer=1, n_head=1,
                      n_embd=4)).double()
    with torch.no_grad():
        m.transformer.ln_f.weight.zero_()
        m.transformer.ln_f.bias.copy_(torch.tensor([1.0, 0.0, 0.0, 0.0]))
        m.transformer.wte.weight[:, 0] = -20.0
        m.transformer.wte.weight[favourite, 0] = 20.0
    return m.eval()


CPU = Dist(0, 0, 1, torch.device("cpu"), True, False)  # one process


def msgs(*turns):
    """[{"role", "content"}] from (role, content) pairs, as TRL's conversational rows."""
    return [{"role": r, "content": c} for r, c in turns]


EXAMPLE = os.path.join(ROOT, "examples", "dialogue_pairs.jsonl")


# sha256 of the default task's data files for seed 0, made by main at a1dd8eb, before regimes
# existed: the regimes must leave the default data, and every result computed from it, as they
# were. (Python's random streams are stable across versions; tokenizer.json and task.json depend on
# the tokenizers version, so they are checked by other means.)
DEFAULT_SHA256 = {
    "pairs_train.jsonl": "98bf2c985e658a73365772141f201fabae2fdc6c1c4e665b893414f3472cc7fa",
    "pairs_val.jsonl": "ad740172d5e26f57e88b493cbecce69e0a39b1618930a94771bb82ac0862ff14",
    "prompts_test.jsonl": "3d3b56ee4c8e6c6560ed0f3d4425337e9a2d7b531c207cc7add64ae769c60641",
    "prompts_train.jsonl": "4ce7a29d8d29c6a829032feb91eb650beec236e1f23edb2a8c13a5a9f3077ba1",
    "sft_train.txt": "b81da323ef97ac7f64d2d30486fa10ac2f82a4cda87027232475488a964bca10",
    "sft_val.txt": "95e48e9d728eb8c3d6c06f892072a22c4d0d494d1fec2da08cc9efb28f716df3",
}


def sft_args(tiny, out, steps=8, **kw):
    cfg = dict(out_dir=str(out), train_text=f"{tiny.task}/sft_train.txt",
               val_text=f"{tiny.task}/sft_val.txt",
               tokenizer=f"{tiny.task}/tokenizer.json", **TINY_MODEL, steps=steps, batch_size=16,
               micro_batch_size=4, eval_every=steps, ckpt_every=100, warmup=2, **kw)
    return cfg


def as_flags(cfg):
    return [x for k, v in cfg.items()
            for x in ((f"--{k}" if v else f"--no-{k}",) if isinstance(v, bool)
                      else (f"--{k}", str(v)))]


def read_metrics(out_dir):
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def saved_weights(out):
    return load_file(os.path.join(out, "model.safetensors"))


# Equivalent DPO runs differ only in the order of fp32 sums: a cache computed in batches of 64
# against live micro-batches of 8 (other padding), one rank against two. Their per-step losses,
# margins and gradient norms agree to <= 8e-7 (measured at 1 and 2 threads); the bugs these tests
# guard against (a misaligned cache row, a missing x world, a dropped micro-batch) move them by
# > 1e-3. Weights are not compared: Adam's lr·m/√v turns the rounding noise of a near-zero gradient
# into a step of up to ~lr (1.1e-4 measured), on weights that barely move the outputs. The val loss
# after the last update pins the final weights' function instead. Adam is blind to a gradient's
# scale, so the gradient's normalisation is checked through grad_norm.
DPO_TOL = 1e-5


def dpo_cfg(tiny, name, **kw):
    base = dict(out_dir=str(tiny.root / name), ref_model=f"{tiny.sft}/model.safetensors",
                train_pairs=str(tiny.root / "dpo-data/pairs_train.jsonl"),
                val_pairs=str(tiny.root / "dpo-data/pairs_val.jsonl"),
                test_prompts=str(tiny.root / "dpo-data/prompts_test.jsonl"),
                ref_logps=str(tiny.root / "dpo-cache"),
                steps=3, batch_size=16, micro_batch_size=8, lr=1e-3, warmup=1, eval_every=1000,
                ckpt_every=1000, eval_k=1)
    return dpo.Config(**{**base, **kw})


dpo_metrics, dpo_weights = read_metrics, saved_weights  # the DPO tests' names for the same reads


def iterative_cfg(tiny, name, **kw):
    """iterative_dpo.py on the tiny stack (after the dpo_cache fixture): 2 rounds of 32 pairs and 2
    steps each."""
    base = dict(out_dir=str(tiny.root / name), sft=f"{tiny.sft}/model.safetensors",
                prompts=f"{tiny.task}/prompts_train.jsonl",
                val_pairs=str(tiny.root / "dpo-data/pairs_val.jsonl"),
                test_prompts=str(tiny.root / "dpo-data/prompts_test.jsonl"),
                rounds=2, pairs=32, steps=2, batch_size=16, micro_batch_size=16, eval_k=1,
                beta=0.1)
    return iterative_dpo.Config(**{**base, **kw})


# Two ranks against one process, reward.py and ppo.py alike: the same global batches and the same
# token normalisation, so the runs differ only in the order of fp32 sums (all-reduce, accumulation,
# batch shapes) and, after the first update, in Adam's lr·m/√v turning that rounding noise on
# near-zero gradients into steps of up to ~lr (see test_sft_two_ranks_equal_...). Compared where
# that leaves the math tight: each logged step's losses and gradient norm, and what the final
# weights compute. Measured differences, one process at 1 and 2 threads: <= 7e-7 (reward: the
# offset's correlation, from a std of 9e-4; ppo: explained_variance, 4.8e-7); the bugs these tests
# guard against (a missing x world, the all-reduce on the wrong micro-step, per-rank whitening or
# sampling, a metric divided by the world size) move them by > 1e-3.
TWO_RANK_TOL = 1e-5


def tiny_ppo_config(tiny, rm, out, test_prompts, **kw):
    base = dict(out_dir=str(out), sft=f"{tiny.sft}/model.safetensors", reward_model=rm,
                prompts=f"{tiny.task}/prompts_train.jsonl", test_prompts=test_prompts, iterations=3,
                rollout_batch=8, mini_batch=4, micro_batch_size=2, ppo_epochs=2, eval_k=1)
    return ppo.Config(**{**base, **kw})


def tiny_reward_config(tiny, out, **kw):
    return reward.Config(**{**dict(out_dir=str(out), sft=f"{tiny.sft}/model.safetensors",
                                   train_pairs=f"{tiny.root}/dpo-data/pairs_train.jsonl",
                                   val_pairs=f"{tiny.root}/dpo-data/pairs_val.jsonl",
                                   prompts=f"{tiny.task}/prompts_test.jsonl", steps=12,
                                   batch_size=8, micro_batch_size=8, eval_every=100,
                                   offset_samples=8), **kw})
