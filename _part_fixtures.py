"""Shared test fixtures (merged into test_all.py by the lead). Import them into a part file with
`from _part_fixtures import tiny, run_torchrun`."""
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest

import data
import sft

HERE = os.path.dirname(os.path.abspath(__file__))
TINY_MODEL = dict(n_layer=2, n_head=2, n_embd=32, block_size=64)


@pytest.fixture(scope="session")
def tiny(tmp_path_factory):
    """The built-in task and a tiny π_ref trained on it for a few steps, shared by the whole session.
    Paths: tiny.task (folder with pairs_*.jsonl, prompts_*.jsonl, tokenizer.json), tiny.sft (folder with
    model.safetensors and tokenizer.json), tiny.root (a folder to put further stages in: use a subfolder
    of your own, e.g. tiny.root / 'dpo-test-x', never write into tiny.task or tiny.sft)."""
    root = tmp_path_factory.mktemp("stack")
    task = str(root / "task")
    data.build_task(task, seed=0)
    sft.main(sft.Config(out_dir=str(root / "sft"), train_text=f"{task}/sft_train.txt",
                        val_text=f"{task}/sft_val.txt", tokenizer=f"{task}/tokenizer.json", **TINY_MODEL,
                        steps=30, batch_size=32, micro_batch_size=16, eval_every=30, ckpt_every=30))
    return SimpleNamespace(root=root, task=task, sft=str(root / "sft"))


def run_torchrun(script, args, nproc=2, cwd=HERE, timeout=300):
    """`torchrun --nproc_per_node=nproc script args` on the CPU (gloo); returns the CompletedProcess,
    failing the test with its output if it exits non-zero."""
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", "--standalone",
           os.path.join(HERE, script), *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": HERE}
    p = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert p.returncode == 0, f"{' '.join(cmd)} failed:\n{p.stdout[-4000:]}\n{p.stderr[-4000:]}"
    return p
