"""The test suite: closed forms, gradients against analytic forms, and equivalences (fast path vs
obvious path, cached vs live, world size 2 vs 1, resumed vs uninterrupted), plus smoke runs of every
script, `torchrun --nproc_per_node=2` on the CPU included.

    pytest test_all.py            # these checks, in sections named by the promise they keep
    pytest test_all.py -k dpo     # one area
    pytest                        # everything: these and tests/*.py (the studies)
"""
import contextlib
import copy
import dataclasses
import os

# The suite runs on the CPU whatever the machine: its tolerances are fp32 CPU numerics', and its
# torchrun children are gloo ranks, two of them on one machine. CUDA_VISIBLE_DEVICES="" is set
# before torch is imported, so CUDA is hidden from this process and from every child it starts
# (they inherit os.environ). The tests that need CUDA (ids with "on_cuda") are run by
# test_cuda_tests_in_a_child, in a child pytest given the environment as it was and TEST_CUDA=1,
# which leaves CUDA visible there.
ENV_AS_GIVEN = dict(os.environ)
if os.environ.get("TEST_CUDA") != "1":
    os.environ["CUDA_VISIBLE_DEVICES"] = ""

import hashlib
import inspect
import itertools
import json
import math
import random
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, replace
from types import SimpleNamespace

import pytest
import torch
import torch.multiprocessing as mp
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from torch.utils import flop_counter

import checkpoint
import data
import dpo
import evaluate
import grpo
import iterative_dpo
import meter
import online_dpo
import plumbing
import ppo
import precompute
import reward
import sft
import task as tasks  # the built-in task (`task` is a fixture's name here)
from checkpoint import tokenizer_beside
from evaluate import evaluate_policy
from hf import export_gpt2, import_gpt2
from meter import (anatomy, count_flops, estimate_flops, format_anatomy, generate_flops,
                   model_flops)
from meter import matmul_shapes as model_matmul_shapes
from model import (GPT, GPTConfig, freeze, generate, load_model, new_kv_cache, pair_logps,
                   read_meta, save_model, score_at_last, sequence_logprobs, token_logprobs)
from plumbing import Dist, init_distributed


# ==================================================================================================
# shared fixtures
# ==================================================================================================

HERE = os.path.dirname(os.path.abspath(__file__))
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


def run_whole(cmds, timeout, env, cwd=HERE):
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
    target = script.split() if script.startswith("-m ") else [os.path.join(HERE, script)]
    return [sys.executable, "-m", "torch.distributed.run", *launch, *target, *args]


def torchrun_env(timeout):
    """The ranks' environment: one thread each, and a collective that waits a third of the test's
    `timeout` fails (plumbing's DIST_TIMEOUT_S) and names itself, while the test has time left."""
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": HERE,
            "DIST_TIMEOUT_S": str(timeout // 3)}


def run_torchrun(script, args, nproc=2, cwd=HERE, timeout=300):
    """`torchrun --nproc_per_node=nproc --standalone script args` on the CPU (gloo), run whole
    (run_whole); returns the CompletedProcess, failing the test with its output if it exits
    non-zero."""
    (p,) = run_whole([torchrun(script, args, [f"--nproc_per_node={nproc}", "--standalone"])],
                     timeout, torchrun_env(timeout), cwd)
    assert p.returncode == 0, f"{' '.join(p.args)} failed:\n{p.stdout[-4000:]}\n{p.stderr[-4000:]}"
    return p


# ==================================================================================================
# the model: causal, padding-invariant, log-probs and KV-cache generation equal to the full
# forward, save/load and GPT-2 round trips, FLOP counts against FlopCounterMode (model, hf, meter)
# ==================================================================================================

def tiny_gpt(head="lm", seed=0, **kw):
    torch.manual_seed(seed)
    cfg = GPTConfig(**{**dict(block_size=32, vocab_size=13, n_layer=2, n_head=2, n_embd=16), **kw,
                       "head": head})
    return GPT(cfg).double().eval()


def left_pad(rows, pad):
    P = max(map(len, rows))
    idx = torch.tensor([[pad] * (P - len(r)) + r for r in rows])
    mask = torch.tensor([[False] * (P - len(r)) + [True] * len(r) for r in rows])
    return idx, mask


def test_causality():
    m = tiny_gpt()
    idx = torch.randint(0, 13, (3, 10))
    idx2 = idx.clone()
    idx2[:, 6] = (idx[:, 6] + 1) % 13
    for mask in (None, torch.ones(3, 10, dtype=torch.bool)):  # the is_causal path and the mask path
        a, b = m(idx, mask=mask), m(idx2, mask=mask)
        assert torch.allclose(a[:, :6], b[:, :6], atol=1e-12, rtol=0)
        assert not torch.allclose(a[:, 6:], b[:, 6:])


def naive_sdpa(q, k, v, attn_mask=None, is_causal=False, dropout_p=0.0):
    """softmax(q k^T / sqrt(d)) v written out: a fully masked row is NaN here, as in older SDPA
    kernels."""
    if is_causal:
        attn_mask = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool).tril()
    s = (q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])).masked_fill(~attn_mask, float("-inf"))
    return s.softmax(-1) @ v


def test_left_padding_invariance_and_no_nan(monkeypatch):
    m = tiny_gpt()
    rows = [[1, 2, 3, 4, 5, 6], [7, 8], [9, 10, 11, 12]]
    idx, mask = left_pad(rows, pad=0)
    targets = torch.where(mask, idx, -100).roll(-1, dims=1)
    targets[:, -1] = -100
    targets[~mask] = -100  # a pad does not predict the first prompt token
    logits = m(idx, mask=mask)
    # left-pad queries see only themselves, never an all -inf row
    assert torch.isfinite(logits).all()
    lp = token_logprobs(logits, targets)
    # explicit position ids give the same numbers as the default derived from the mask
    pos = (mask.long().cumsum(1) - 1).clamp(min=0)
    assert torch.allclose(m(idx, mask=mask, pos=pos), logits, atol=0, rtol=0)
    for b, r in enumerate(rows):
        x = torch.tensor([r])
        alone = token_logprobs(m(x), torch.tensor([r[1:] + [-100]]))
        assert torch.allclose(lp[b, -len(r):], alone[0], atol=1e-10, rtol=0)
        assert (lp[b, :-len(r)] == 0).all()
    # the attention written out (NaN on a fully masked row) agrees with SDPA, pads included: no NaN
    monkeypatch.setattr(F, "scaled_dot_product_attention", naive_sdpa)
    assert torch.allclose(m(idx, mask=mask), logits, atol=1e-10, rtol=0)


def test_gpt2_init():
    m = tiny_gpt(n_layer=8, n_embd=64)
    for name, p in m.named_parameters():
        if name.endswith("c_proj.weight"):  # residual projections: 0.02 / sqrt(2 * n_layer) = 0.005
            assert p.std().item() == pytest.approx(0.02 / math.sqrt(16), rel=0.05)
        elif name.endswith(("c_attn.weight", "c_fc.weight", "wte.weight", "wpe.weight")):
            assert p.std().item() == pytest.approx(0.02, rel=0.05)
        elif name.endswith(".bias"):
            assert (p == 0).all()


def test_token_logprobs_matches_naive_gather():
    torch.manual_seed(0)
    logits = torch.randn(2, 5, 7, dtype=torch.bfloat16)
    targets = torch.randint(0, 7, (2, 5))
    targets[0, 1] = targets[1, 4] = -100
    for temp in (1.0, 0.7):
        lp = token_logprobs(logits, targets, temperature=temp)
        assert lp.dtype == torch.float32
        ref = torch.log_softmax(logits.float() / temp, -1)
        for b in range(2):
            for t in range(5):
                want = 0.0 if targets[b, t] == -100 else ref[b, t, targets[b, t]].item()
                assert lp[b, t].item() == pytest.approx(want, abs=1e-6)
    assert lp[0, 1].item() == 0.0 and lp[1, 4].item() == 0.0  # exactly zero, not just small


def test_kv_cache_steps_equal_full_forward():
    m = tiny_gpt()
    idx, mask = left_pad([[1, 2, 3, 4, 5], [6, 7], [8, 9, 10]], pad=0)
    full = m(idx, mask=mask)
    cache = new_kv_cache(m, 3, 5, "cpu", torch.float64)
    steps = [m(idx[:, :2], mask=mask[:, :2], kv_cache=cache)]  # prefill 2, then one token at a time
    steps += [m(idx[:, t:t + 1], mask=mask[:, :t + 1], kv_cache=cache) for t in range(2, 5)]
    assert torch.allclose(torch.cat(steps, 1)[mask], full[mask], atol=1e-10, rtol=0)


def test_generate_logprobs_equal_full_forward():
    m = tiny_gpt()
    prompts = [[1, 2, 3, 4, 5], [6], [7, 8, 9]]
    m.train()  # generate must switch to eval itself and switch back
    out = generate(m, prompts, 12, eos_id=0, pad_id=12, temperature=0.8, top_k=5,
                   generator=torch.Generator().manual_seed(1))
    assert m.training
    tok, mask, resp = out["tokens"], out["mask"], out["response_mask"]
    targets = torch.where(resp[:, 1:], tok[:, 1:], -100)
    lp = token_logprobs(m.eval()(tok, mask=mask)[:, :-1], targets, temperature=0.8)
    # generate stores logprobs in fp32: its rounding (~2e-7 at |lp| ~ 3) sets the tolerance
    assert torch.allclose(lp.float(), out["logprobs"][:, 1:], atol=1e-6, rtol=0)
    assert (out["logprobs"][~resp] == 0).all() and (out["logprobs"][resp] < 0).all()
    again = generate(m, prompts, 12, eos_id=0, pad_id=12, temperature=0.8, top_k=5,
                     generator=torch.Generator().manual_seed(1))
    assert torch.equal(again["tokens"], tok)  # a seeded generator reproduces the samples


def test_batched_generation_equals_alone():
    # top_k=1 is greedy: no sampling noise, and in float64 an argmax cannot flip on rounding, so the
    # tokens must be identical and the log-probs equal up to their fp32 storage (1e-6)
    m = tiny_gpt()
    prompts = [[1, 2, 3, 4, 5, 6], [7], [8, 9, 10]]
    kw = dict(eos_id=0, pad_id=12, top_k=1)
    batch = generate(m, prompts, 10, **kw)
    P = 6
    for b, p in enumerate(prompts):
        alone = generate(m, [p], 10, **kw)
        n = alone["tokens"].shape[1] - len(p)
        assert torch.equal(batch["tokens"][b, P:P + n], alone["tokens"][0, len(p):])
        assert torch.allclose(batch["logprobs"][b, P:P + n], alone["logprobs"][0, len(p):],
                              atol=1e-6, rtol=0)
        assert not batch["response_mask"][b, P + n:].any()


def test_generate_stops_at_eos():
    m = tiny_gpt(vocab_size=4)  # near-uniform logits over 4 tokens: EOS comes soon in every row
    eos, pad = 1, 3
    out = generate(m, [[2, 2], [0], [2, 0, 2]], 28, eos_id=eos, pad_id=pad,
                   generator=torch.Generator().manual_seed(0))
    tok, mask, resp = out["tokens"], out["mask"], out["response_mask"]
    P = 3
    assert tok.shape[1] < P + 28  # stopped early: every row ended
    assert torch.equal(mask[:, :P],
                       torch.tensor([[0, 1, 1], [0, 0, 1], [1, 1, 1]], dtype=torch.bool))
    assert not resp[:, :P].any() and torch.equal(mask[:, P:], resp[:, P:])
    for b in range(3):
        ends = (tok[b, P:] == eos).nonzero()
        e = P + int(ends[0])  # first EOS
        assert resp[b, P:e + 1].all() and not resp[b, e + 1:].any()  # EOS included, nothing after
        assert (tok[b, e + 1:] == pad).all()
    assert (tok[:, -1] == eos).any()  # the last column is some row's EOS


def test_scalar_head():
    m = tiny_gpt("scalar")
    idx, mask = left_pad([[1, 2, 3], [4]], pad=0)
    v = m(idx, mask=mask)
    # zero-initialised head: no preference before training
    assert v.shape == (2, 3) and (v == 0).all()
    v.sum().backward()
    assert m.score.weight.grad.abs().sum() > 0  # ...but it learns from the first step
    with torch.no_grad():
        m.score.weight.normal_()
    assert torch.allclose(m(idx, mask=mask)[1, -1:], m(torch.tensor([[4]]))[0], atol=1e-10, rtol=0)


def test_save_load_round_trip(tmp_path):
    for head in ("lm", "scalar"):
        m = tiny_gpt(head)
        path = str(tmp_path / head / "model.safetensors")
        save_model(m, path, {"stage": "sft", "step": 7})
        with safe_open(path, framework="pt") as f:
            keys = set(f.keys())
        # tied weight stored once
        assert "lm_head.weight" not in keys and "transformer.wte.weight" in keys
        m2, meta = load_model(path)
        assert meta == {"stage": "sft", "step": 7} and read_meta(path) == (m.config, meta)
        idx = torch.randint(0, 13, (2, 8))
        assert torch.equal(m2.double()(idx), m(idx))
        if head == "lm":
            assert m2.lm_head.weight is m2.transformer.wte.weight  # still tied after load
        assert not (tmp_path / head / "model.safetensors.tmp").exists()


def fake_hf_gpt2(V=11, C=16, L=2, n_pos=24, prefix="transformer."):
    """A GPT-2 state dict with Hugging Face's names and Conv1D (in, out) weight shapes."""
    g = torch.Generator().manual_seed(0)
    r = lambda *s: torch.randn(*s, generator=g) * 0.3
    sd = {"wte.weight": r(V, C), "wpe.weight": r(n_pos, C), "ln_f.weight": 1 + r(C),
          "ln_f.bias": r(C)}
    for i in range(L):
        h = f"h.{i}."
        sd |= {h + "ln_1.weight": 1 + r(C), h + "ln_1.bias": r(C), h + "ln_2.weight": 1 + r(C),
               h + "ln_2.bias": r(C),
               h + "attn.c_attn.weight": r(C, 3 * C), h + "attn.c_attn.bias": r(3 * C),
               h + "attn.c_proj.weight": r(C, C), h + "attn.c_proj.bias": r(C),
               h + "mlp.c_fc.weight": r(C, 4 * C), h + "mlp.c_fc.bias": r(4 * C),
               h + "mlp.c_proj.weight": r(4 * C, C), h + "mlp.c_proj.bias": r(C),
               h + "attn.bias": torch.ones(1, 1, n_pos, n_pos).tril(),
               h + "attn.masked_bias": torch.tensor(-1e4)}
    sd = {prefix + k: v for k, v in sd.items()}
    sd["lm_head.weight"] = sd[prefix + "wte.weight"].clone()
    return sd


def reference_gpt2(sd, idx, n_head):
    """GPT-2's forward written out with plain ops over the Hugging Face dict (x @ W for Conv1D)."""
    sd = {k.removeprefix("transformer."): v.double() for k, v in sd.items()}
    T = idx.shape[1]
    ln = lambda x, p: F.layer_norm(x, x.shape[-1:], sd[p + ".weight"], sd[p + ".bias"], eps=1e-5)
    gelu_new = lambda x: 0.5 * x * (1 + torch.tanh(math.sqrt(2 / math.pi)
                                                   * (x + 0.044715 * x ** 3)))
    x = sd["wte.weight"][idx] + sd["wpe.weight"][:T]
    L = sum(k.endswith("ln_1.weight") for k in sd)
    for i in range(L):
        p = f"h.{i}."
        q, k, v = (ln(x, p + "ln_1") @ sd[p + "attn.c_attn.weight"]
                   + sd[p + "attn.c_attn.bias"]).chunk(3, -1)
        q, k, v = (t.unflatten(-1, (n_head, -1)).transpose(1, 2) for t in (q, k, v))
        att = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
        att = att.masked_fill(torch.ones(T, T).tril() == 0, float("-inf")).softmax(-1)
        y = (att @ v).transpose(1, 2).flatten(2)
        x = x + y @ sd[p + "attn.c_proj.weight"] + sd[p + "attn.c_proj.bias"]
        hdn = gelu_new(ln(x, p + "ln_2") @ sd[p + "mlp.c_fc.weight"] + sd[p + "mlp.c_fc.bias"])
        x = x + hdn @ sd[p + "mlp.c_proj.weight"] + sd[p + "mlp.c_proj.bias"]
    return ln(x, "ln_f") @ sd["wte.weight"].T


def test_gpt2_import_export(tmp_path):
    for prefix in ("transformer.", ""):
        d = tmp_path / f"hf{prefix}"
        d.mkdir()
        sd = fake_hf_gpt2(prefix=prefix)
        save_file(sd, str(d / "model.safetensors"))
        (d / "config.json").write_text(json.dumps({"n_head": 4, "activation_function": "gelu_new"}))
        m = import_gpt2(str(d / "model.safetensors")).double()
        assert (m.config.n_head, m.config.n_layer, m.config.block_size,
                m.config.vocab_size) == (4, 2, 24, 11)
        idx = torch.randint(0, 11, (2, 9))
        assert torch.allclose(m(idx), reference_gpt2(sd, idx, n_head=4), atol=1e-10, rtol=0)
        export_gpt2(m.float(), word_tokenizer(tmp_path / "tok.json", "a b c"),
                    str(tmp_path / "out"))
        out = load_file(str(tmp_path / "out" / "model.safetensors"))
        want = {"transformer." + k.removeprefix("transformer."): v for k, v in sd.items()
                if not k.endswith((".attn.bias", ".attn.masked_bias")) and k != "lm_head.weight"}
        assert out.keys() == want.keys() and all(torch.equal(out[k], want[k]) for k in want)
        cfg = json.loads((tmp_path / "out" / "config.json").read_text())
        assert (cfg["model_type"] == "gpt2" and cfg["activation_function"] == "gelu_new"
                and cfg["n_head"] == 4)
        assert (cfg["n_positions"], cfg["tie_word_embeddings"]) == (24, True)
    # a shorter context keeps wpe's first rows
    m = import_gpt2(str(d / "model.safetensors"), block_size=10)
    assert torch.equal(m.transformer.wpe.weight, sd["wpe.weight"][:10])
    # room for the PAD our tokenizer adds
    m = import_gpt2(str(d / "model.safetensors"), vocab_size=12)
    assert m.config.vocab_size == 12 and torch.equal(m.transformer.wte.weight[:11],
                                                     sd["wte.weight"])
    assert (m.lm_head.weight is m.transformer.wte.weight
            and m(torch.tensor([[11, 3]])).shape == (1, 2, 12))


def word_tokenizer(path, words):
    """A tokenizer.json of whitespace-split words: EOS 0, PAD 1, then the words. Returns its
    path."""
    vocab = {data.EOS: 0, data.PAD: 1, **{w: i + 2 for i, w in enumerate(words.split())}}
    tk = Tokenizer(models.WordLevel(vocab, unk_token=data.EOS))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tk.add_special_tokens([data.EOS, data.PAD])
    tk.save(str(path))
    return str(path)


HONOURED = [{}, {"n_head": 4, "n_embd": 16, "n_layer": 2, "vocab_size": 11, "n_positions": 24},
            {"activation_function": "gelu_pytorch_tanh"}, {"reorder_and_upcast_attn": True},
            {"n_inner": None}, {"n_inner": 64}, {"layer_norm_epsilon": 1e-5},
            {"scale_attn_weights": True, "scale_attn_by_inverse_layer_idx": False},
            {"tie_word_embeddings": True, "add_cross_attention": False, "model_type": "gpt2"}]
REFUSED = [("layer_norm_epsilon", 1e-3), ("scale_attn_weights", False),
           ("scale_attn_by_inverse_layer_idx", True), ("n_positions", 32), ("n_inner", 32),
           ("tie_word_embeddings", False), ("activation_function", "gelu"),
           ("activation_function", "relu"), ("add_cross_attention", True),
           ("model_type", "gpt_neo"),
           ("n_embd", 32), ("n_layer", 3), ("vocab_size", 12)]


def test_gpt2_import_honours_or_refuses_every_config_option(tmp_path):
    sd = fake_hf_gpt2()
    save_file(sd, str(tmp_path / "model.safetensors"))
    path, idx = str(tmp_path / "model.safetensors"), torch.randint(0, 11, (2, 9))
    # honoured: the same logits as GPT-2's forward written out by hand (float64: only rounding)
    for opts in HONOURED:
        (tmp_path / "config.json").write_text(json.dumps({"n_head": 4, **opts}))
        m = import_gpt2(path).double()
        assert torch.allclose(m(idx), reference_gpt2(sd, idx, n_head=4), atol=1e-10, rtol=0), opts
    # refused: an error line naming the option and its value, never other logits
    for k, v in REFUSED:
        (tmp_path / "config.json").write_text(json.dumps({"n_head": 4, k: v}))
        with pytest.raises(SystemExit,
                           match=f"^error: {tmp_path}/config.json: {k}={json.dumps(v)} "):
            import_gpt2(path)
    (tmp_path / "config.json").write_text(json.dumps({"n_head": 4}))
    with pytest.raises(SystemExit, match="block_size 25 > the 24 positions"):
        import_gpt2(path, block_size=25)
    # the argument contradicts the file
    with pytest.raises(SystemExit, match="n_head=4 is refused"):
        import_gpt2(path, n_head=2)
    save_file({**sd, "lm_head.weight": sd["lm_head.weight"] + 1},
              str(tmp_path / "model.safetensors"))
    with pytest.raises(SystemExit, match="lm_head differs from wte"):
        import_gpt2(path)
    # no config.json: n_head is not guessed from the shapes; given, it imports exactly
    (tmp_path / "config.json").unlink()
    save_file(sd, str(tmp_path / "model.safetensors"))
    with pytest.raises(SystemExit, match="no config.json beside it, so n_head is unknown"):
        import_gpt2(path)
    m = import_gpt2(path, n_head=4).double()
    assert torch.allclose(m(idx), reference_gpt2(sd, idx, n_head=4), atol=1e-10, rtol=0)


def test_gpt2_import_refuses_another_architecture(tmp_path):
    """A Llama checkpoint (its config, its tensor names) is one error line naming what it is and
    what imports, with or without its config.json, never a KeyError."""
    g = torch.Generator().manual_seed(0)
    save_file({k: torch.randn(8, 4, generator=g) for k in
               ("model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight",
                "model.norm.weight", "lm_head.weight")}, str(tmp_path / "model.safetensors"))
    path = str(tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text(json.dumps(
        {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 4}))
    with pytest.raises(SystemExit, match=re.escape(
            f'error: {tmp_path}/config.json: model_type="llama" (LlamaForCausalLM) is refused: '
            f'only GPT-2 imports (model_type "gpt2", GPT2LMHeadModel)')):
        import_gpt2(path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))  # no architectures
    with pytest.raises(SystemExit, match='model_type="llama" is refused'):
        import_gpt2(path)
    # GPT-2's model_type with another head: its tensors would not load
    (tmp_path / "config.json").write_text(json.dumps(
        {"model_type": "gpt2", "architectures": ["GPT2ForSequenceClassification"]}))
    with pytest.raises(SystemExit,
                       match=r'model_type="gpt2" \(GPT2ForSequenceClassification\) is refused'):
        import_gpt2(path)
    (tmp_path / "config.json").unlink()
    with pytest.raises(SystemExit, match=re.escape(f"error: {path}: no wte.weight among its "
                                                   f"tensors (")) as e:
        import_gpt2(path, n_head=4)
    assert "model.embed_tokens.weight" in str(e.value) and "not a GPT-2 checkpoint" in str(e.value)


def test_export_folder_for_transformers(tmp_path):
    """The exported folder holds what transformers' from_pretrained reads, by its documented schema;
    a separate venv with transformers loaded it by hand (see the README)."""
    texts = ["the movie is great .", "i hated the plot .", "User: hi\nAssistant: hello"] * 20
    tok = data.train_tokenizer(texts, vocab_size=300)
    src = tmp_path / "sft"
    src.mkdir()
    data.save_tokenizer(tok, str(src / "tokenizer.json"))
    m = tiny_gpt(vocab_size=tok.vocab_size).float()
    save_model(m, str(src / "model.safetensors"), {"stage": "sft"})
    p = subprocess.run([sys.executable, os.path.join(HERE, "hf.py"), "export",
                        str(src / "model.safetensors"), str(tmp_path / "hf")],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    out = tmp_path / "hf"
    assert sorted(os.listdir(out)) == ["config.json", "generation_config.json", "model.safetensors",
                                       "special_tokens_map.json", "tokenizer.json",
                                       "tokenizer_config.json"]
    read = lambda name: json.loads((out / name).read_text())  # noqa: E731
    ids = dict(bos_token_id=tok.eos, eos_token_id=tok.eos, pad_token_id=tok.pad)
    cfg = read("config.json")
    assert cfg.items() >= {**ids, "model_type": "gpt2", "architectures": ["GPT2LMHeadModel"],
                           "vocab_size": tok.vocab_size, "n_positions": 32, "n_embd": 16,
                           "n_layer": 2, "n_head": 2, "activation_function": "gelu_new",
                           "layer_norm_epsilon": 1e-5, "tie_word_embeddings": True}.items()
    assert read("generation_config.json") == ids
    special = dict(bos_token=data.EOS, eos_token=data.EOS, pad_token=data.PAD)
    assert read("special_tokens_map.json") == special
    assert read("tokenizer_config.json") == {**special,
                                             "tokenizer_class": "PreTrainedTokenizerFast",
                                             "model_max_length": 32,
                                             "model_input_names": ["input_ids", "attention_mask"],
                                             "clean_up_tokenization_spaces": False,
                                             "chat_template": data.CHAT_TEMPLATE,
                                             "padding_side": "left"}  # for batched generate
    # the tokenizer puts the BOS first, as every sequence here starts; without it, our ids
    hf_tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    assert hf_tok.encode(" the movie").ids == data.encode_prompt(tok, " the movie")
    assert hf_tok.encode(" the movie", add_special_tokens=False).ids == tok.encode(" the movie")
    # the weights: importing the folder back gives the model's logits exactly
    idx = torch.randint(0, tok.vocab_size, (2, 9))
    assert torch.equal(import_gpt2(str(out / "model.safetensors"))(idx), m(idx))
    # a tokenizer without PAD (as GPT-2's) gets it as the next id, as data.Tok does
    tk = Tokenizer(models.WordLevel({data.EOS: 0, "the": 1, "movie": 2}, unk_token=data.EOS))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tk.add_special_tokens([data.EOS])
    tk.save(str(tmp_path / "nopad.json"))
    export_gpt2(tiny_gpt(vocab_size=4).float(), str(tmp_path / "nopad.json"), str(tmp_path / "hf2"))
    assert json.loads((tmp_path / "hf2" / "config.json").read_text())["pad_token_id"] == 3
    assert Tokenizer.from_file(str(tmp_path / "hf2" / "tokenizer.json")).token_to_id(data.PAD) == 3
    with pytest.raises(SystemExit, match="has 4 tokens, the model only 3"):
        export_gpt2(tiny_gpt(vocab_size=3).float(), str(tmp_path / "nopad.json"),
                    str(tmp_path / "x"))


def chat_template_renderer(template):
    """apply_chat_template(messages, tokenize=False, ...) as transformers renders a chat_template:
    a sandboxed jinja2 environment with trim_blocks and lstrip_blocks, raise_exception, and the
    special tokens by name; continue_final_message cuts the text after the last message."""
    jinja2 = pytest.importorskip("jinja2")
    from jinja2.sandbox import ImmutableSandboxedEnvironment
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)
    env.globals["raise_exception"] = raise_exception
    compiled = env.from_string(template)
    def apply(messages, add_generation_prompt=False, continue_final_message=False):
        text = compiled.render(messages=messages, add_generation_prompt=add_generation_prompt,
                               bos_token=data.EOS, eos_token=data.EOS, pad_token=data.PAD)
        if continue_final_message:
            last = messages[-1]["content"]
            text = text[:text.rindex(last) + len(last)]
        return text
    return apply


def trl_pair(apply, row):
    """TRL's maybe_extract_prompt then apply_chat_template (trl/data_utils.py) on a conversational
    preference row: an implicit prompt is the messages both responses begin with; the prompt gets
    the generation prompt after a user turn, continues a final assistant turn; each response is
    the rendered prompt + response past the common prefix of the rendered prompt and both."""
    if "prompt" not in row:
        k = next(i for i, (a, b) in enumerate(zip(row["chosen"], row["rejected"])) if a != b)
        row = dict(prompt=row["chosen"][:k], chosen=row["chosen"][k:],
                   rejected=row["rejected"][k:])
    last = row["prompt"][-1]["role"]
    assert last in ("user", "assistant"), "TRL refuses a prompt ending with a system turn"
    prompt = apply(row["prompt"], add_generation_prompt=last == "user",
                   continue_final_message=last == "assistant")
    full = {k: apply(row["prompt"] + row[k]) for k in ("chosen", "rejected")}
    prompt = os.path.commonprefix([prompt, *full.values()])
    return dict(prompt=prompt, **{k: v[len(prompt):] for k, v in full.items()})


def test_exported_chat_template_renders_the_one_template(tmp_path):
    """transformers' apply_chat_template with the exported chat_template gives data.py's text byte
    for byte: SFT text, prompts, and TRL's rendering of conversational pairs."""
    export_gpt2(tiny_gpt(vocab_size=4).float(), word_tokenizer(tmp_path / "tok.json", "a b"),
                str(tmp_path / "hf"))
    config = json.loads((tmp_path / "hf" / "tokenizer_config.json").read_text())
    apply = chat_template_renderer(config["chat_template"])
    odd = 'quotes \' " {{ not jinja }} {% raw %} <b>&amp;</b>\n two lines, été '
    convs = [msgs(("user", "Rain today?")),
             msgs(("system", "Be brief."), ("user", "Rain today?")),
             msgs(("user", "a"), ("assistant", "b"), ("user", odd)),
             msgs(("system", odd), ("user", "c"), ("assistant", "d"), ("user", "e")),
             msgs(("user", "Name a colour."), ("assistant", "Here is one:"))]  # to continue
    answers = [msgs(("assistant", "No.")), msgs(("assistant", odd)),
               msgs(("assistant", "x"), ("user", "y?"), ("assistant", "z"))]
    rows = [dict(prompt=c, chosen=answers[i % 3], rejected=answers[(i + 1) % 3])
            for i, c in enumerate(convs)]
    # implicit prompts, beside another field (TRL's extract_prompt, which ignores it)
    rows += [dict(chosen=c + answers[0], rejected=c + answers[2], score=1) for c in convs]
    write = lambda name, objs: (tmp_path / name).write_text(  # noqa: E731
        "".join(json.dumps(o) + "\n" for o in objs))
    write("t.jsonl", [{"messages": c + a} for c in convs for a in answers])
    assert data.read_texts(str(tmp_path / "t.jsonl")) == [
        apply(c + a) for c in convs for a in answers]
    write("p.jsonl", [{"prompt": c} for c in convs])
    assert data.read_prompts(str(tmp_path / "p.jsonl")) == [
        apply(c, add_generation_prompt=c[-1]["role"] == "user",
              continue_final_message=c[-1]["role"] == "assistant") for c in convs]
    write("pairs.jsonl", rows)
    assert data.read_pairs(str(tmp_path / "pairs.jsonl")) == [trl_pair(apply, r) for r in rows]
    # a role the template cannot render is an error, not a line without its role
    with pytest.raises(Exception, match="system, user and assistant"):
        apply(msgs(("tool", "42")))


def test_estimate_flops_matches_flop_counter():
    for head in ("lm", "scalar"):
        m = tiny_gpt(head).float().train()
        cfg, B, T = m.config, 3, 20
        idx = torch.randint(0, 13, (B, T))
        assert count_flops(lambda: m(idx))[1] == estimate_flops(cfg, B, T)  # exact
        # a training step: forward + backward
        step = lambda: m(idx).float().pow(2).mean().backward()  # noqa: E731
        assert count_flops(step)[1] == estimate_flops(cfg, B, T, backward=True)
        with flop_counter.FlopCounterMode(display=False) as fc:
            m(idx)
        attn = cfg.n_layer * 4 * B * T * T * cfg.n_embd
        # stock counter: attention counted if this torch knows the CPU kernel, 0 if not (torch 2.13)
        assert fc.get_total_flops() in (estimate_flops(cfg, B, T), estimate_flops(cfg, B, T) - attn)
        # the head only where an output is asked for (at): K positions, not B*T
        at = torch.rand(B, T, generator=torch.Generator().manual_seed(0)) < 0.3
        K = int(at.sum())
        assert count_flops(lambda: m(idx, at=at))[1] == estimate_flops(cfg, B, T, outputs=K)
        step = lambda: m(idx, at=at).float().pow(2).mean().backward()  # noqa: E731
        assert count_flops(step)[1] == estimate_flops(cfg, B, T, backward=True, outputs=K)
    m = tiny_gpt().float()  # generate: a prefill, the head at its last column; then 1-token steps
    out, counted = count_flops(lambda: generate(m, [[1, 2, 3], [4]], 6, eos_id=-1, pad_id=0))
    assert counted == generate_flops(m.config, 2, 3, out["tokens"].shape[1] - 3)


def test_model_flops_closed_form_and_never_above_the_executed():
    c = GPTConfig(block_size=32, vocab_size=50, n_layer=3, n_head=2, n_embd=16)
    C, L, V, T = 16, 3, 50, 10
    # one sequence of T tokens, the head at each: 2 FLOPs per matmul weight per token (a block's
    # 12·C² matrix weights, the head's C·V; PaLM's 2N) and causal attention, q·k and a·v, 4·C for
    # each query and each key at or before it
    assert model_flops(c, [T], T) == T * (L * 24 * C * C + 2 * C * V) + L * 4 * C * T * (T + 1) // 2
    assert model_flops(c, [T], T, backward=True) == 3 * model_flops(c, [T], T)  # PaLM's 6N
    assert model_flops(c, [T], 0) == model_flops(c, [T], T) - T * 2 * C * V  # no target, no head
    # unpadded, the head everywhere: what ran beyond it is attention's upper triangle, exactly
    assert estimate_flops(c, 1, T) - model_flops(c, [T], T) == L * 4 * C * T * (T - 1) // 2
    for bw in (False, True):  # a padded batch runs more than its real tokens need: MFU <= HFU
        assert model_flops(c, [3, 10, 7], 12, bw) < estimate_flops(c, 3, 10, bw, outputs=12)


def test_logprobs_only_where_a_target_exists_equal_the_full_logits():
    # sequence_logprobs runs the LM head and the log-softmax only at the K positions with a target;
    # the obvious path runs them on all B·T positions and gathers. In float64 the two differ only in
    # the shapes of the head's matmul and the softmax (summation order): ~1e-16, so 1e-12 is ample,
    # while a log-prob put at the wrong position moves by O(1).
    m = tiny_gpt()
    g = torch.Generator().manual_seed(1)
    idx, mask = left_pad([[1, 2, 3, 4, 5, 6, 7], [8, 9], [3, 3, 4, 1]], pad=0)
    targets = torch.randint(0, 13, idx.shape, generator=g)
    targets[torch.rand(idx.shape, generator=g) < 0.5] = -100  # targets at some positions only
    targets[1] = -100  # and a row with none
    for temp in (1.0, 0.7):
        logits = m(idx, mask=mask)
        lp, ent = sequence_logprobs(m, idx, targets, mask, temp, entropy=True)
        assert torch.allclose(lp, token_logprobs(logits, targets, temp), atol=1e-12, rtol=0)
        assert (lp[targets == -100] == 0).all() and (lp[targets != -100] < 0).all()
        q = F.log_softmax(logits / temp, -1)
        want = torch.where(targets != -100, -(q.exp() * q).sum(-1), 0.0)
        assert torch.allclose(ent, want, atol=1e-12, rtol=0)
    ps = list(m.parameters())  # and the gradients of the log-probs' sum, parameter by parameter
    full = torch.autograd.grad(token_logprobs(m(idx, mask=mask), targets).sum(), ps)
    at = torch.autograd.grad(sequence_logprobs(m, idx, targets, mask).sum(), ps)
    assert all(torch.allclose(a, b, atol=1e-12, rtol=0) for a, b in zip(full, at))


def test_peak_flops_measured_once_at_the_models_shapes_for_long_enough(monkeypatch):
    # A fake clock on which every matmul takes 1 ms: the peak is then the largest shape's 2·m·k·n
    # per ms, and the blocks must hold enough matmuls to last their share of the 0.1 s
    monkeypatch.setattr(meter, "PEAKS", {})
    shapes = model_matmul_shapes(GPTConfig(n_embd=32, vocab_size=64), 256, 100)
    seen, now, mm = [], [0.0], torch.mm

    def timed_mm(a, b, out):
        seen.append((*a.shape, b.shape[1]))
        now[0] += 1e-3
        return mm(a, b, out=out)
    monkeypatch.setattr(torch, "mm", timed_mm)
    monkeypatch.setattr(meter, "time", SimpleNamespace(perf_counter=lambda: now[0]))
    peak = meter.measure_peak_flops(torch.device("cpu"), shapes, seconds=0.1)
    # the fastest shape's FLOP/s (the fake clock adds up 1e-3 steps: rounding only)
    assert peak == pytest.approx(max(2 * m * k * n for m, k, n in shapes) / 1e-3, rel=1e-9)
    # each of the model's shapes, the MLP's and the head's among them, in 5 timed blocks of at
    # least 0.1 s / 5 / 5 shapes = 4 ms: >= 20 matmuls each (the warm-up comes on top)
    assert set(seen) == set(shapes) and (256, 32, 128) in seen and (100, 32, 64) in seen
    assert all(seen.count(s) >= 20 for s in shapes)
    n = len(seen)
    assert meter.measure_peak_flops(torch.device("cpu"), shapes) == peak  # once per process:
    assert len(seen) == n  # the second call times nothing


# ==================================================================================================
# the data: the task's closed forms (true reward, exact text probabilities, regimes), bad rows
# named by file:line, the truncation and batching rules (task.py, data.py)
# ==================================================================================================

TASK_FILES = ["pairs_train.jsonl", "pairs_val.jsonl", "prompts_test.jsonl", "prompts_train.jsonl",
              "prompts_val.jsonl", "sft_train.txt", "sft_val.txt", "task.json", "tokenizer.json"]

@pytest.fixture(scope="module")
def task(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("task") / "task")
    logs = []
    assert tasks.ensure_task(d, seed=0, log=logs.append) == d
    assert len(logs) == 1 and "built the task" in logs[0]
    return d

@pytest.fixture(scope="module")
def tok(task):
    return data.load_tokenizer(os.path.join(task, "tokenizer.json"))

def test_tokenizer_round_trip_and_specials(tmp_path):
    texts = ["the movie is great .", "i hated the plot .", "Ünïcode ✓,  two spaces\tand a tab\n"]
    tok = data.train_tokenizer(texts * 20, vocab_size=300)
    assert tok.pad != tok.eos and tok.vocab_size == tok.tk.get_vocab_size(with_added_tokens=True)
    for t in texts + ["unseen: xyz 123 {}", ""]:
        assert tok.decode(tok.encode(t)) == t  # byte-level: any string round-trips
    assert (tok.decode([tok.eos] + tok.encode("hi there") + [tok.eos, tok.pad, tok.pad])
            == "hi there")
    path = str(tmp_path / "tokenizer.json")
    data.save_tokenizer(tok, path)
    tok2 = data.load_tokenizer(path)
    assert (tok2.eos, tok2.pad, tok2.vocab_size) == (tok.eos, tok.pad, tok.vocab_size)
    assert tok2.encode(texts[2]) == tok.encode(texts[2])
    # A user tokenizer.json with EOS but no PAD (as GPT-2's) gets PAD as one more id.
    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer, tk.decoder = (pre_tokenizers.ByteLevel(add_prefix_space=False),
                                    decoders.ByteLevel())
    tk.train_from_iterator(
        texts * 20, trainers.BpeTrainer(vocab_size=280, special_tokens=[data.EOS],
                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    n = tk.get_vocab_size()
    tk.save(str(tmp_path / "user.json"))
    user = data.load_tokenizer(str(tmp_path / "user.json"))
    assert user.eos == tk.token_to_id(data.EOS) and user.pad == n and user.vocab_size == n + 1
    assert user.decode([user.eos] + user.encode("the plot") + [user.pad]) == "the plot"
    # Without EOS there is no BOS/EOS to use: an error that says so.
    tk = Tokenizer(models.BPE())
    tk.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=100))
    tk.save(str(tmp_path / "noeos.json"))
    with pytest.raises(SystemExit, match="noeos.json: .*endoftext"):
        data.load_tokenizer(str(tmp_path / "noeos.json"))
    (tmp_path / "garbage.json").write_text("not json")
    with pytest.raises(SystemExit, match="garbage.json: not a tokenizer.json"):
        data.load_tokenizer(str(tmp_path / "garbage.json"))

def test_require_task_skips_an_optional_input_left_empty_and_names_a_missing_one(tmp_path):
    d, said = init_distributed(), []
    tasks.require_task({"": ""}, d, said.append)  # --val_prompts "": nothing built, nothing said
    assert said == []
    with pytest.raises(SystemExit, match="does not exist"):  # --test_prompts "" is no such file
        tasks.require_task({"": "out/task/prompts_test.jsonl"}, d, said.append)
    with pytest.raises(SystemExit, match="nope.jsonl does not exist"):
        tasks.require_task({str(tmp_path / "nope.jsonl"): ""}, d, said.append)
    assert said == []


def test_build_task_deterministic_and_schema(task, tmp_path):
    again = str(tmp_path / "again")
    tasks.build_task(again, seed=0)
    assert sorted(os.listdir(task)) == sorted(os.listdir(again)) == TASK_FILES  # no temp dirs left
    for name in TASK_FILES:
        with open(os.path.join(task, name), "rb") as f, open(os.path.join(again, name), "rb") as g:
            assert f.read() == g.read(), name
    assert not [p for p in os.listdir(tmp_path) if p != "again"]
    logs = []  # present: not rebuilt; another seed in the same folder is an error
    assert tasks.ensure_task(task, seed=0, log=logs.append) == task and logs == []
    with pytest.raises(ValueError, match="seed"):
        tasks.ensure_task(task, seed=1)
    with open(os.path.join(task, "task.json")) as f:
        meta = json.load(f)
    assert meta["counts"] == tasks.SIZES and meta["seed"] == 0
    with open(os.path.join(task, "pairs_train.jsonl")) as f:
        assert all(list(json.loads(line)) == ["prompt", "chosen", "rejected"] for line in f)
    pairs = data.read_pairs(os.path.join(task, "pairs_train.jsonl"))
    assert len(pairs) == meta["counts"]["pairs_train"]
    for r in pairs:  # a prompt and either response make a text of the language
        assert (r["chosen"].startswith(" ") and r["rejected"].startswith(" ")
                and r["chosen"] != r["rejected"])
        assert text_ok(r["prompt"] + r["chosen"]) and text_ok(r["prompt"] + r["rejected"])
    # Bradley-Terry labels: noisy, but chosen usually has the higher hidden reward
    rc = [tasks.true_reward(r["prompt"], r["chosen"]) for r in pairs]
    rr = [tasks.true_reward(r["prompt"], r["rejected"]) for r in pairs]
    assert 0.7 < sum(a > b for a, b in zip(rc, rr)) / len(pairs) < 0.95
    held_out = {}
    for split in ("val", "test"):  # two held-out sets, disjoint: selection never sees a test prompt
        held_out[split] = data.read_prompts(os.path.join(task, f"prompts_{split}.jsonl"))
        assert len(held_out[split]) == meta["counts"][f"prompts_{split}"] == 200
        assert all(p.endswith(" .") and text_ok(f"{p} {p}") for p in held_out[split])
    assert not set(held_out["val"]) & set(held_out["test"])
    assert len(set(held_out["val"])) > 150  # redrawn, not emptied of variety
    texts = data.read_texts(os.path.join(task, "sft_val.txt"))
    assert len(texts) == meta["counts"]["sft_val"] and all(map(text_ok, texts))

def text_ok(t):
    return math.isfinite(tasks.text_logprob(t))

def test_task_floor(task, tok):
    with open(os.path.join(task, "task.json")) as f:
        meta = json.load(f)
    floor = meta["floor_nats_per_token"]
    assert meta["vocab_size"] == tok.vocab_size
    assert math.isfinite(floor) and 0 < floor < math.log(tok.vocab_size)
    # The floor is an entropy: no model beats it, e.g. a unigram model fitted on the val
    # texts themselves.
    counts = {}
    val = data.read_texts(os.path.join(task, "sft_val.txt"))
    for t in val:
        for i in tok.encode(t) + [tok.eos]:
            counts[i] = counts.get(i, 0) + 1
    n = sum(counts.values())
    assert floor < -sum(c * math.log(c / n) for c in counts.values()) / n

def test_true_reward_hand_examples():
    # the prompt does not count
    assert tasks.true_reward("it felt awful .", " the movie is great .") == 2.0
    assert tasks.true_reward("", " i hated the plot . it felt fine .") == -2.0 + 0.5
    assert tasks.true_reward("", " the cast was good and good . we saw it on monday .") == 2.0
    # junk earns the malformed-sentence penalty, not its words; so does no sentence at all
    assert tasks.true_reward("", "GREAT,superb!! xyz greatgreat <|endoftext|>") == -1.0
    assert tasks.true_reward("", "") == -1.0

def test_text_logprob_hand_worked():
    # "it felt {adj} ." then "we saw it on {day} .", then stop: templates 1/5 each, "great" is
    # positive (prob p) and one of 8, the day one of 5, stop after the 2nd sentence P_STOP; p
    # uniform on 5 values.
    mean_p = sum(tasks.P_VALUES) / 5
    want = (1 / 5) * (mean_p / 8) * (1 / 5) * (1 / 5) * 0.35
    assert math.isclose(tasks.text_logprob("it felt great . we saw it on monday ."), math.log(want))
    # 2 positive slots (great, loved) and 2 negative (awful, weak): E_p[p^2 (1-p)^2]; 3 sentences:
    # continue after the 2nd (1 - P_STOP), stop after the 3rd.
    m = sum(p ** 2 * (1 - p) ** 2 for p in tasks.P_VALUES) / 5
    want = ((1 / 5) * (1 / 8) * (1 / 8) * (1 / 8)   # "the {noun} was {adj} and {adj} ."
            * (1 / 5) * (1 / 3) * (1 / 8)           # "i {verb} the {noun} ."
            * (1 / 5) * (1 / 8)                     # "it felt {adj} ."
            * 0.65 * 0.35 * m)
    got = tasks.text_logprob("the movie was great and awful . i loved the plot . it felt weak .")
    assert math.isclose(got, math.log(want))
    for bad in ["the movie is great .", "the movie is great",
                "the movie is amazing . it felt good .",
                "the movie is great .  it felt good .", "it felt great . it felt good . ",
                "i felt good . it felt good ."]:
        assert tasks.text_logprob(bad) == -math.inf, bad

def sentences(templates):
    """Every sentence the given templates can make."""
    out = []
    for t in templates:
        slots = [tasks.NEUTRAL[w] if w in tasks.NEUTRAL else
                 sum(tasks.SENTIMENT[w], []) if w in tasks.SENTIMENT else [w] for w in t.split()]
        out += [" ".join(ws) for ws in itertools.product(*slots)]
    return out

def test_text_logprob_sums_to_one():
    # Summing the exact probability over whole sets of texts: any unnormalized factor (a slot's word
    # choice, the latent p, the templates, the length) shows up as a wrong total.
    everything, last = sentences(tasks.TEMPLATES), sentences(["it felt {adj} ."])
    assert len(everything) == len(set(everything)) == 8 * 16 + 8 * 16 * 16 + 6 * 8 + 16 + 5
    total = sum(math.exp(tasks.text_logprob(a + " " + b)) for a in everything for b in last)
    assert math.isclose(total, 0.35 * (1 / 5), rel_tol=1e-9)  # P(2 sentences) * P(2nd is "it felt")
    short = sentences(["it felt {adj} .", "we saw it on {day} ."])
    total = sum(math.exp(tasks.text_logprob(" ".join(s)))
                for s in itertools.product(short, repeat=3))
    assert math.isclose(total, 0.65 * 0.35 * (2 / 5) ** 3, rel_tol=1e-9)

# ---- regimes of the task

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


@pytest.fixture(scope="module")
def regimes(task, tmp_path_factory):
    """{regime: folder} for seed 0; the default is the module's `task`."""
    root = tmp_path_factory.mktemp("regimes")
    out = {"default": task}
    for regime in ("capped", "unseen", "shifted"):
        out[regime] = tasks.ensure_task(str(root / regime), seed=0, regime=regime,
                                        log=lambda *a: None)
    return out


def task_meta(folder):
    with open(os.path.join(folder, "task.json")) as f:
        return json.load(f)


def responses(folder, split="pairs_train"):
    return [(r["prompt"], r[k]) for r in data.read_pairs(os.path.join(folder, f"{split}.jsonl"))
            for k in ("chosen", "rejected")]


def test_default_regime_is_the_task_as_it_was(regimes):
    for name, want in DEFAULT_SHA256.items():
        with open(os.path.join(regimes["default"], name), "rb") as f:
            assert hashlib.sha256(f.read()).hexdigest() == want, name
    meta = task_meta(regimes["default"])
    want = ("default", list(tasks.P_VALUES), None)
    assert (meta["regime"], meta["p_values"], meta["cap"]) == want
    pool = data.read_pairs(f"{regimes['default']}/pairs_train.jsonl")
    assert meta["pool_best"] == tasks.pool_best(pool)


def test_capped_pool_holds_nothing_above_the_cap(regimes):
    cap, default, capped = tasks.CAP, regimes["default"], regimes["capped"]
    meta = task_meta(capped)
    assert (meta["regime"], meta["cap"], meta["pool_best"]) == ("capped", cap, cap)
    # the stated cap is the median true reward of the generator's responses (the default pool's)
    assert statistics.median(tasks.true_reward(p, y) for p, y in responses(default)) == cap
    for split in ("pairs_train", "pairs_val"):
        got = responses(capped, split)
        assert max(tasks.true_reward(p, y) for p, y in got) <= cap  # the pool never shows more
        assert all(text_ok(p + y) for p, y in got)  # the generator's responses, only fewer of them
        # the same prompts in the same order, and a pair that was under the cap anyway is unchanged:
        # only the responses above the cap were redrawn
        old = data.read_pairs(os.path.join(default, f"{split}.jsonl"))
        new = data.read_pairs(os.path.join(capped, f"{split}.jsonl"))
        assert [r["prompt"] for r in old] == [r["prompt"] for r in new]
        under = [o == n for o, n in zip(old, new)
                 if max(tasks.true_reward(o["prompt"], o[k])
                        for k in ("chosen", "rejected")) <= cap]
        assert len(under) > len(old) / 4 and all(under)
    # everything else is the default's, byte for byte: the same π_ref serves both regimes
    for name in TASK_FILES:
        if not name.startswith(("pairs", "task")):
            with open(os.path.join(default, name), "rb") as f:
                assert f.read() == open(os.path.join(capped, name), "rb").read(), name


def test_unseen_pool_holds_no_top_word_while_pi_refs_texts_do(regimes):
    default, unseen = regimes["default"], regimes["unseen"]
    assert tasks.TOP_WORDS == {"great", "superb", "loved"}  # the words of weight 2.0
    meta = task_meta(unseen)
    assert (meta["regime"], meta["cap"], meta["top_words"]) == ("unseen", None,
                                                               ["great", "loved", "superb"])
    pool = responses(unseen) + responses(unseen, "pairs_val")
    assert not any(tasks.has_top_word(y) for _, y in pool)  # the labels never show them
    assert meta["pool_top_word_rate"] == 0 and all(text_ok(p + y) for p, y in pool)
    assert all(pool[i] != pool[i + 1] for i in range(0, len(pool), 2))  # each pair's two differ
    # in the default pool they appear: more than 1 response in 10 was redrawn
    old = responses(default) + responses(default, "pairs_val")
    rate = tasks.top_word_rate([y for _, y in old])
    assert rate > 0.1 and rate == task_meta(default)["pool_top_word_rate"]
    # the prompts keep theirs: the rule is on responses, and the prompts are the default's
    assert [p for p, _ in pool] == [p for p, _ in old]
    assert any(tasks.has_top_word(p) for p, _ in old)
    # the texts, the prompts and the tokenizer are the default's, byte for byte: the same π_ref
    for name in TASK_FILES:
        if not name.startswith(("pairs", "task")):
            with open(os.path.join(default, name), "rb") as f:
                assert f.read() == open(os.path.join(unseen, name), "rb").read(), name
    # and π_ref's texts hold top words at the generator's rate. Closed form: a sentence lacks them
    # with probability q(p), its templates' mean of prod over slots (1 - p * top share), the share
    # 2 of 8 positive adjectives and 1 of 3 positive verbs; a text of n sentences q(p)^n
    q = lambda p: ((1 - p / 4) + (1 - p / 4) ** 2 + (1 - p / 3) + (1 - p / 4) + 1) / 5  # noqa: E731
    p_n = {n: (tasks.P_STOP if n < tasks.MAX_SENTENCES else 1) * (1 - tasks.P_STOP) ** (n - 2)
           for n in range(2, tasks.MAX_SENTENCES + 1)}
    want = 1 - statistics.mean(sum(w * q(p) ** n for n, w in p_n.items()) for p in tasks.P_VALUES)
    texts = data.read_texts(os.path.join(unseen, "sft_train.txt"))
    got = tasks.top_word_rate(texts)
    assert got == meta["sft_top_word_rate"] and round(want, 3) == 0.362
    # 4 standard errors of a share of 20,000 texts: fails by chance with probability < 1e-4
    assert abs(got - want) <= 4 * math.sqrt(want * (1 - want) / len(texts))


def test_a_redraw_touches_only_the_responses_its_rule_rejects(regimes):
    # unseen and capped redraw by rejection from a stream of their own: a response the rule keeps
    # is the default's, byte for byte, in the same pair (a pair whose two it keeps is unchanged,
    # label and all), and the other pairs come out as they would have without the redraws
    rules = {"unseen": lambda p, y: tasks.has_top_word(y),
             "capped": lambda p, y: tasks.true_reward(p, y) > tasks.CAP}
    for regime, rejected in rules.items():
        for split in ("pairs_train", "pairs_val"):
            old = data.read_pairs(os.path.join(regimes["default"], f"{split}.jsonl"))
            new = data.read_pairs(os.path.join(regimes[regime], f"{split}.jsonl"))
            assert len(old) == len(new) and [o["prompt"] for o in old] == [n["prompt"] for n in new]
            n_kept = n_same = 0
            for o, n in zip(old, new):
                kept = [o[k] for k in ("chosen", "rejected") if not rejected(o["prompt"], o[k])]
                n_kept += len(kept)
                assert set(kept) <= {n["chosen"], n["rejected"]}, (regime, o, n)
                if len(kept) == 2:
                    n_same += 1
                    assert o == n, (regime, o, n)
            assert n_kept > len(old) and n_same > len(old) / 4, regime


def test_top_word_rate_by_hand():
    # a share of texts holding at least one top word as a whole word, in any case: "greatly" and
    # "lovedthe" are other words; several top words in one text count it once
    texts = [" the movie is great .", " it felt greatly good .", " i lovedthe plot .",
             "GREAT,superb!! i LOVED it", " we saw it on monday .", ""]
    assert [tasks.has_top_word(t) for t in texts] == [True, False, False, True, False, False]
    assert tasks.top_word_rate(texts) == 2 / 6
    assert tasks.top_word_rate([" i loved the plot . it felt superb ."]) == 1.0
    # the top words are those of the highest weight, and every other word of the reward is not
    assert [w for w in tasks.WEIGHTS if tasks.has_top_word(w)] == ["great", "superb", "loved"]
    with pytest.raises(SystemExit, match="'unseeen' is not a regime of the task"):
        tasks.check_regime("unseeen")


def test_shifted_generator_puts_pi_refs_mode_below_the_default(regimes):
    meta = task_meta(regimes["shifted"])
    assert (meta["regime"], meta["p_values"]) == ("shifted", list(tasks.SHIFTED_P_VALUES))
    # π_ref imitates the generator's texts (sft.py gets within ~0.03 nats of its floor), so their
    # mean true reward is π_ref's. Closed form: a sentence's expected reward given the latent p is
    # (2p - 1) times the mean weight of its slots' words, 1.25 per adjective and 1.5 per verb, over
    # the templates' 4 adjectives and 1 verb in 5; times the expected number of sentences.
    e_n = sum(n * (tasks.P_STOP if 2 <= n < tasks.MAX_SENTENCES else 1)
              * (1 - tasks.P_STOP) ** (n - 2)
              for n in range(2, tasks.MAX_SENTENCES + 1))
    mean = {}
    for regime in ("default", "shifted"):
        pv = tasks.SHIFTED_P_VALUES if regime == "shifted" else tasks.P_VALUES
        want = (2 * sum(pv) / len(pv) - 1) * (4 * 1.25 + 1.5) / 5 * e_n
        r = [tasks.true_reward("", t) for t in data.read_texts(f"{regimes[regime]}/sft_val.txt")]
        mean[regime] = statistics.mean(r)
        # 4 standard errors of the mean of 1000 texts: fails by chance with probability < 1e-4
        assert abs(mean[regime] - want) <= 4 * statistics.stdev(r) / math.sqrt(len(r)), regime
    assert mean["shifted"] < mean["default"] - 2
    # the pairs come from that same generator: their responses are as negative as π_ref's
    pool = {k: statistics.mean(tasks.true_reward(p, y) for p, y in responses(regimes[k]))
            for k in ("default", "shifted")}
    assert pool["shifted"] < pool["default"] - 1
    # the floor in task.json is the shifted generator's entropy: its texts are in the language and
    # their exact probability is computed with the shifted p values
    texts = data.read_texts(f"{regimes['shifted']}/sft_val.txt")
    assert all(math.isfinite(tasks.text_logprob(t, tasks.SHIFTED_P_VALUES)) for t in texts)
    tok = data.load_tokenizer(f"{regimes['shifted']}/tokenizer.json")
    n_tok = sum(len(tok.encode(t)) + 1 for t in texts)
    floor = -sum(tasks.text_logprob(t, tasks.SHIFTED_P_VALUES) for t in texts) / n_tok
    assert meta["floor_nats_per_token"] == pytest.approx(floor, rel=1e-12)


def test_regimes_deterministic_and_a_bad_regime_is_a_clear_error(regimes, tmp_path):
    again = str(tmp_path / "again")
    tasks.build_task(again, seed=0, regime="capped")
    for name in TASK_FILES:
        with open(os.path.join(regimes["capped"], name), "rb") as f:
            assert f.read() == open(os.path.join(again, name), "rb").read(), name
    with pytest.raises(ValueError, match="regime capped, not seed 0 and regime shifted"):
        tasks.ensure_task(again, seed=0, regime="shifted")
    says = ("error: --regime 'nope' is not a regime of the task: choose one of default, capped, "
            "unseen, shifted")
    with pytest.raises(SystemExit, match=re.escape(says)):
        tasks.ensure_task(str(tmp_path / "nope"), regime="nope")
    assert not os.path.exists(tmp_path / "nope")
    p = subprocess.run([sys.executable, os.path.join(HERE, "task.py"), "--regime", "nope",
                        "--out_dir", str(tmp_path / "nope")], capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 1 and p.stderr.strip() == says and not os.path.exists(tmp_path / "nope")


def test_pool_best_and_the_fraction_beyond_it():
    rows = [{"prompt": "it felt great .", "chosen": " i loved the plot . it felt fine .",
             "rejected": " it felt bad ."},
            {"prompt": "x", "chosen": " it felt good .", "rejected": " it felt awful ."}]
    assert tasks.pool_best(rows) == 2.5  # loved + fine; the prompt's "great" does not count
    assert tasks.fraction_beyond([2.5, 3.0, -1.0, 4.0], 2.5) == 0.5  # strictly beyond: 3 and 4


GOOD = '{"prompt": "the plot is", "chosen": " good .", "rejected": " bad ."}'

def msgs(*turns):
    """[{"role", "content"}] from (role, content) pairs, as TRL's conversational rows."""
    return [{"role": r, "content": c} for r, c in turns]

U, A = msgs(("user", "hi")), msgs(("assistant", "hello"))

@pytest.mark.parametrize("bad, says", [
    ("not json", "not valid JSON"),
    ('["the plot", " good .", " bad ."]', "expected a JSON object, got an array"),
    ('{"prompt": "a", "chosen": " b"}', 'missing field "rejected"'),
    ('{"prompt": "a", "rejected": " b"}', 'missing field "chosen"'),
    ('{"prompt": null, "chosen": " b", "rejected": " c"}',
     'field "prompt" must be a string or a list of messages, got null'),
    ('{"prompt": "a", "chosen": 3, "rejected": " c"}',
     'field "chosen" must be a string or a list of messages, got a number'),
    ('{"prompt": "a", "chosen": " b", "rejected": ["c"]}',
     'rejected[0] is a string, not an object: the template renders'),
    ('{"prompt": "a", "chosen": "", "rejected": " c"}', 'field "chosen" is empty'),
    ('{"prompt": "a", "chosen": " c", "rejected": ""}', 'field "rejected" is empty'),
    ('{"prompt": "a", "chosen": " b", "rejected": " b"}', '"chosen" and "rejected" are identical'),
    ('{"chosen": "x b", "rejected": "x b"}', '"chosen" and "rejected" are identical'),
    ('{"chosen": "great plot", "rejected": "good plot"}', 'no "prompt" field'),  # no common space
    # ... or only at the start
    ('{"chosen": " yes", "rejected": " no"}', 'no "prompt" field'),
    # silent misreads before: a misspelled prompt became the responses' common first word " it"
    ('{"promt": "the plot", "chosen": " it felt good .", "rejected": " it felt bad ."}',
     'no "prompt" field but other fields (promt): a misspelled "prompt"?'),
    ('{"prompt": "a", "chosen": " b", "rejected": " c", "prompt": "d"}',
     'key "prompt" appears twice'),
    ('{"prompt": "a <|endoftext|> b", "chosen": " b", "rejected": " c"}',
     'field "prompt" contains <|endoftext|>, which the tokenizer would read as its special token'),
    ('{"prompt": "a", "chosen": " b<|pad|>", "rejected": " c"}', 'field "chosen" contains <|pad|>'),
    ('{"prompt": "a \\ud83d", "chosen": " b", "rejected": " c"}',
     'field "prompt" holds a lone surrogate escape'),
    # conversational rows (TRL's format) the template cannot render
    (json.dumps(dict(prompt=msgs(("tool", "x")), chosen=A, rejected=msgs(("assistant", "no")))),
     'prompt[0] has the role "tool": the template renders'),
    (json.dumps(dict(prompt=U, chosen=[{"role": "assistant", "content": "b", "name": "x"}],
                     rejected=A)), 'chosen[0] has the keys "role", "content", "name": the'),
    (json.dumps(dict(prompt=U, chosen=A, rejected=msgs(("assistant", 3)))),
     "rejected[0] has a content that is a number"),
    (json.dumps(dict(prompt=[], chosen=A, rejected=A)), 'field "prompt" must be a string or a list '
     'of messages, got an empty array'),
    (json.dumps(dict(prompt="hi", chosen=A, rejected=msgs(("assistant", "no")))),
     "mixes strings and lists of messages"),
    (json.dumps(dict(prompt=U, chosen=msgs(("user", "b")), rejected=A)),
     '"chosen" and "rejected" must each answer the prompt with an assistant message'),
    (json.dumps(dict(chosen=U + A, rejected=U + A + U + A)), "must each answer the prompt"),
    # implicit-prompt conversations may hold other fields, but not a bad message, nor no prompt
    (json.dumps(dict(chosen=U + msgs(("bot", "b")), rejected=U + A, score=1)),
     'chosen[1] has the role "bot"'),
    (json.dumps(dict(promt=U, chosen=A, rejected=msgs(("assistant", "no")))),
     'no "prompt" field, and the conversations share no first message'),
    # a prompt that ends with an assistant turn: the responses still answer as the assistant
    (json.dumps(dict(prompt=U + A, chosen=A, rejected=msgs(("user", "b")))),
     "must each answer the prompt"),
    (json.dumps(dict(chosen=U + A, rejected=msgs(("user", "yo")) + A)),
     'no "prompt" field, and the conversations share no first message'),
    (json.dumps(dict(prompt=U, chosen=msgs(("assistant", "<|endoftext|>")), rejected=A)),
     "chosen[0] contains <|endoftext|>"),
    ('{"prompt": [{"role": "user", "role": "assistant", "content": "x"}], "chosen": " b"}',
     'key "role" appears twice'),
    # data that parses but means nothing
    ('{"prompt": "a", "chosen": "  ", "rejected": " c"}', 'field "chosen" is only whitespace'),
    (json.dumps(dict(prompt=U, chosen=msgs(("assistant", "")), rejected=A)),
     'field "chosen" is only whitespace (an empty assistant message?)'),
    ('{"prompt": "a", "chosen": " b", "rejected": "b "}', 'differ only in white space'),
    # the problem named whole, where a message cut at 50 characters hid it
    (json.dumps(dict(prompt=msgs(("user", "x" * 60)) + [{"role": "user", "content": "y" * 60,
                                                         "Content": "z"}], chosen=A, rejected=A)),
     'prompt[1] has the keys "role", "content", "Content"'),
    ('{"prompt": "a", "chosen": " b", "rejected": " c"}\r{"prompt": "a", "chosen": " b"}',
     "a carriage return (\\r) inside a line: the file has old Mac line endings (CR only)?"),
])
def test_read_pairs_bad_rows_name_file_and_line(tmp_path, bad, says):
    path = tmp_path / "pairs.jsonl"
    # the blank line 2 is no row
    path.write_text(GOOD + "\n\n" + GOOD + "\n" + bad + "\n" + GOOD + "\n")
    with pytest.raises(data.DataError) as e:
        data.read_pairs(str(path))
    assert str(e.value).startswith(f"{path}:4: ") and says in str(e.value), str(e.value)

def test_read_files_other_errors(tmp_path):
    p = tmp_path / "bytes.jsonl"
    p.write_bytes(GOOD.encode() + b"\n" + b'{"prompt": "\xff"}\n')
    with pytest.raises(data.DataError, match=f"^{p}:2: not UTF-8"):
        data.read_pairs(str(p))
    for name, reader in [("e.jsonl", data.read_pairs), ("e.jsonl", data.read_prompts),
                         ("e.txt", data.read_texts)]:
        (tmp_path / name).write_text("\n  \n")
        with pytest.raises(data.DataError, match="empty"):
            reader(str(tmp_path / name))
    p = tmp_path / "prompts.jsonl"
    p.write_text('{"prompt": "it felt"}\n{"text": "it felt"}\n')
    with pytest.raises(data.DataError, match=f'^{p}:2: missing field "prompt"'):
        data.read_prompts(str(p))
    p = tmp_path / "prompts.txt"
    p.write_text("it felt\n\n the plot is \r\n")
    assert data.read_prompts(str(p)) == ["it felt", " the plot is "]

def test_plain_text_of_json_rows_and_one_foreign_row_are_named_by_line(tiny, tmp_path):
    p = tmp_path / "prompts.txt"  # JSONL under a .txt name: each row would be a prompt, braces in
    p.write_text("the plot is good .\n" + json.dumps({"prompt": "the plot is"}) + "\n")
    for read in (data.read_prompts, data.read_texts):
        says = f"{p}:2: the line is a JSON object, but a file whose name does not end in .jsonl"
        with pytest.raises(data.DataError, match=re.escape(says)):
            read(str(p))
    p.write_text("{curly} is a word here .\n")  # not a JSON object: plain text, as written
    assert data.read_prompts(str(p)) == ["{curly} is a word here ."]
    # the built-in task's pairs with two rows of other text: the first one's line is named
    lines = open(f"{tiny.task}/pairs_train.jsonl").read().splitlines()[:20]
    foreign = {"prompt": "hello world ?", "chosen": " hi", "rejected": " go"}
    lines[6] = lines[11] = json.dumps(foreign)
    (tmp_path / "pairs.jsonl").write_text("\n".join(lines) + "\n")
    cfg = precompute.Config(train_pairs=str(tmp_path / "pairs.jsonl"))
    says = "is not the built-in task's text (2 of 20 rows are not, the first at line 7), but --ref"
    with pytest.raises(SystemExit, match=re.escape(says)):
        precompute.check_own_inputs(cfg)


def test_full_texts_beside_a_prompt_in_every_row_are_refused_once_is_not(tmp_path):
    rows = [{"prompt": "the plot", "chosen": "the plot is good", "rejected": "the plot is bad"},
            {"prompt": "i loved it .", "chosen": " i loved it . it felt slow .",
             "rejected": " i loved it . the cast was fine ."}]
    path = tmp_path / "pairs.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(data.DataError, match=re.escape(f'{path}:1: in every row "chosen" and '
                                                       '"rejected" both begin with the prompt')):
        data.read_pairs(str(path))
    # a sentence may repeat its prompt (the task's generator does, 1 row in 4,000 in `capped`)
    path.write_text(json.dumps(rows[1]) + "\n" + GOOD + "\n")
    assert len(data.read_pairs(str(path))) == 2


def test_read_pairs_full_texts_variant(tmp_path):
    rows = [{"chosen": "Human: hi Assistant: hello there",
             "rejected": "Human: hi Assistant: go away"},
            # a shared first word stays
            {"chosen": "Q: x A: the cat .", "rejected": "Q: x A: the dog ."},
            {"chosen": "a\n\nHuman: b", "rejected": "a\n\nHuman: c d"},
            {"chosen": "the plot is good", "rejected": "the plot is good and long"},
            {"prompt": "p", "chosen": "x", "rejected": "y", "id": 7}]    # explicit prompt: as given
    path = tmp_path / "full.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert data.read_pairs(str(path)) == [
        dict(prompt="Human: hi Assistant:", chosen=" hello there", rejected=" go away"),
        dict(prompt="Q: x A: the", chosen=" cat .", rejected=" dog ."),
        dict(prompt="a\n\nHuman:", chosen=" b", rejected=" c d"),
        dict(prompt="the plot is", chosen=" good", rejected=" good and long"),
        dict(prompt="p", chosen="x", rejected="y")]

def test_read_files_directory_missing_and_bom(tmp_path):
    # a directory or a missing file is one error line naming it, for every reader (was a traceback)
    for reader in (data.read_pairs, data.read_prompts, data.read_texts):
        for path in (str(tmp_path), str(tmp_path / "nope.jsonl")):
            with pytest.raises(data.DataError, match=f"^{path}: cannot read it"):
                reader(path)
    # a UTF-8 BOM (Windows editors) is not part of the first row (was "not valid JSON")
    bom = b"\xef\xbb\xbf"
    (tmp_path / "p.jsonl").write_bytes(bom + (GOOD + "\n").encode() * 2)
    assert data.read_pairs(str(tmp_path / "p.jsonl")) == [
        dict(prompt="the plot is", chosen=" good .", rejected=" bad .")] * 2
    (tmp_path / "t.txt").write_bytes(bom + "it felt\nthe plot\n".encode())
    assert data.read_texts(str(tmp_path / "t.txt")) == ["it felt", "the plot"]
    (tmp_path / "q.jsonl").write_bytes(bom + b'{"prompt": "it felt"}\n')
    assert data.read_prompts(str(tmp_path / "q.jsonl")) == ["it felt"]
    # special tokens as text in plain text files too
    (tmp_path / "t.txt").write_text("it felt\nthe plot<|endoftext|>\n")
    with pytest.raises(data.DataError,
                       match=re.escape(f"{tmp_path}/t.txt:2: the line contains <|")):
        data.read_texts(str(tmp_path / "t.txt"))

def test_read_pairs_conversational_rows_use_the_one_template(tmp_path):
    sys_u = msgs(("system", "Be brief."), ("user", "Rain today?"))
    abc = msgs(("user", "a"), ("assistant", "b"), ("user", "c"))
    rows = [dict(prompt=sys_u, chosen=msgs(("assistant", "No.")),
                 rejected=msgs(("assistant", "Yes."))),
            # implicit prompt: the messages both begin with; a response may go on for more turns
            dict(chosen=sys_u + msgs(("assistant", "No."), ("user", "Sure?"),
                                     ("assistant", "Yes.")),
                 rejected=sys_u + msgs(("assistant", "Maybe."))),
            dict(chosen=abc + msgs(("assistant", "d")), rejected=abc + msgs(("assistant", "e"))),
            dict(prompt="User: hi\nAssistant:", chosen=" hello", rejected=" go away"),  # strings
            # a prompt that ends with an assistant turn gets no "\nAssistant:" of its own: as TRL
            # (continue_final_message), each response follows it as the next message
            dict(prompt=abc[:2], chosen=msgs(("assistant", "c")),
                 rejected=msgs(("assistant", "d"))),
            dict(chosen=abc[:2] + msgs(("assistant", "c")),
                 rejected=abc[:2] + msgs(("assistant", "d")))]
    (tmp_path / "c.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    x = "System: Be brief.\nUser: Rain today?\nAssistant:"
    assert data.read_pairs(str(tmp_path / "c.jsonl")) == [
        dict(prompt=x, chosen=" No.", rejected=" Yes."),
        dict(prompt=x, chosen=" No.\nUser: Sure?\nAssistant: Yes.", rejected=" Maybe."),
        dict(prompt="User: a\nAssistant: b\nUser: c\nAssistant:", chosen=" d", rejected=" e"),
        dict(prompt="User: hi\nAssistant:", chosen=" hello", rejected=" go away"),
        *[dict(prompt="User: a\nAssistant: b", chosen="\nAssistant: c",
               rejected="\nAssistant: d")] * 2]
    # the same template renders SFT text ({"messages"} rows) and prompts: a pair's prompt + chosen
    # is the SFT text of the whole conversation, token for token (the boundary is at a word start)
    (tmp_path / "t.jsonl").write_text(json.dumps({"messages": rows[1]["chosen"]}) + "\n" +
                                      json.dumps({"text": "one\ntext"}) + "\n")
    texts = data.read_texts(str(tmp_path / "t.jsonl"))
    assert texts == [x + " No.\nUser: Sure?\nAssistant: Yes.", "one\ntext"]
    tok = data.train_tokenizer(texts * 10, vocab_size=300)
    assert tok.encode(x) + tok.encode(" No.\nUser: Sure?\nAssistant: Yes.") == tok.encode(texts[0])
    (tmp_path / "p.jsonl").write_text(json.dumps({"prompt": sys_u}) + "\n" +
                                      json.dumps({"prompt": abc[:2]}) + "\n")
    assert data.read_prompts(str(tmp_path / "p.jsonl")) == [x, "User: a\nAssistant: b"]
    (tmp_path / "t.jsonl").write_text('{"text": "a"}\n{"txt": "b"}\n')
    with pytest.raises(data.DataError, match=f'^{tmp_path}/t.jsonl:2: missing field "text"'):
        data.read_texts(str(tmp_path / "t.jsonl"))

def test_read_pairs_implicit_conversations_ignore_other_fields(tmp_path):
    # as TRL's preference datasets with an implicit prompt (e.g. scores beside the conversations):
    # the prompt is the messages both begin with, other fields are ignored as TRL ignores them
    q, yes, no = msgs(("user", "Rain?")), msgs(("assistant", "No.")), msgs(("assistant", "Yes"))
    rows = [dict(chosen=q + yes, rejected=q + no, score_chosen=8.5, score_rejected=3.0, id="x"),
            dict(chosen=q + yes, rejected=q + no)]
    (tmp_path / "c.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert data.read_pairs(str(tmp_path / "c.jsonl")) == [
        dict(prompt="User: Rain?\nAssistant:", chosen=" No.", rejected=" Yes")] * 2

EXAMPLE = os.path.join(HERE, "examples", "dialogue_pairs.jsonl")

def test_own_data_on_the_example_file(tmp_path):
    # the shipped file: a few dozen hand-written rows in all four formats, read without an error
    with open(EXAMPLE) as f:
        raw = [json.loads(line) for line in f]
    assert len(raw) >= 30 and {tuple(sorted(r)) for r in raw} == {("chosen", "prompt", "rejected"),
                                                                  ("chosen", "rejected")}
    assert {type(r["chosen"]) for r in raw} == {str, list}
    rows = data.read_pairs(EXAMPLE)
    out = tmp_path / "own"
    p = subprocess.run([sys.executable, os.path.join(HERE, "data.py"), "own", EXAMPLE, "--out",
                        str(out), "--vocab_size", "512"],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    read = lambda name, key: [json.loads(line)[key] for line in open(out / name)]  # noqa: E731
    train = data.read_pairs(str(out / "pairs_train.jsonl"))
    val = data.read_pairs(str(out / "pairs_val.jsonl"))
    assert sorted(map(json.dumps, train + val)) == sorted(map(json.dumps, rows)) and len(val) == 4
    assert read("sft_train.jsonl", "text") == [r["prompt"] + r["chosen"] for r in train]
    assert read("sft_val.jsonl", "text") == [r["prompt"] + r["chosen"] for r in val]
    assert read("prompts_test.jsonl", "prompt") == [r["prompt"] for r in val]
    # the block printed is the longest pair with this tokenizer, BOS and EOS included: nothing cut
    tok = data.load_tokenizer(str(out / "tokenizer.json"))
    longest = max(len(data.encode_prompt(tok, r["prompt"]))
                  + max(len(data.encode_response(tok, r[k])) for k in ("chosen", "rejected"))
                  for r in rows)
    assert f"block_size {longest} (the longest pair is {longest} tokens" in p.stdout, p.stdout
    assert "0 of 36 prompts and 0 of 36 pairs' responses cut" in p.stdout
    st = data.tokenize_pairs(tok, rows, longest - 1, 8)[1]  # and one token less cuts something
    assert st["truncated_prompt"] + st["truncated_response"] >= 1
    # a smaller block: the counts are tokenize_pairs' own, and the chosen/rejected EOS losses apart
    logs = []
    assert data.own_data(EXAMPLE, str(out), vocab_size=512, block_size=48, log=logs.append) == 48
    ex, st = data.tokenize_pairs(tok, rows, 48, 24)
    lost = [sum(e[k][-1] != tok.eos for e in ex) for k in ("chosen", "rejected")]
    assert (f"{st['truncated_prompt']} of 36 prompts and {st['truncated_response']} of 36 pairs' "
            f"responses cut (EOS lost: {lost[0]} chosen, {lost[1]} rejected)") in logs[0]
    assert st["truncated_response"] > 0 and lost[0] != lost[1]  # chosen answers run longer here

def test_own_data_path_builds_its_own_cache_and_leaves_the_builtin_one(tmp_path, monkeypatch,
                                                                       capsys):
    """The README's own-data path as data.py own prints it (a tiny model and 2 steps added), run
    where a zero-argument run left the built-in task's cache: dpo.py builds the cache of your pairs
    in a folder of its own and leaves the built-in one as it was (bytes and mtime), a second run
    reuses it, and precompute.py alone on the same inputs writes to that same folder."""
    monkeypatch.chdir(tmp_path)
    logs = []
    block = data.own_data(EXAMPLE, "out/own", vocab_size=512, log=logs.append)
    sft_cmd, dpo_cmd = data.own_commands("out/own", block, 32)
    assert sft_cmd in logs[-1] and dpo_cmd in logs[-1]
    builtin = tmp_path / "out" / "ref_logps"
    builtin.mkdir(parents=True)
    for split in ("train", "val"):  # its fingerprint would not match these pairs: stale here
        precompute.save_ref_logps(str(builtin / f"{split}.safetensors"), torch.zeros(2, 3), {},
                                  {}, {})
    files = lambda folder: {f: (f.read_bytes(), f.stat().st_mtime_ns)  # noqa: E731
                            for f in folder.iterdir() if f.is_file()}
    before = files(builtin)
    small = {**TINY_MODEL, "block_size": block}
    sft.main(replace(plumbing.parse_config(sft.Config, sft_cmd.split()[2:]), **small, steps=2))
    dcfg = replace(plumbing.parse_config(dpo.Config, dpo_cmd.split()[2:]), steps=2, eval_k=1)
    pc = precompute.Config(ref_model=dcfg.ref_model, train_pairs=dcfg.train_pairs,
                           val_pairs=dcfg.val_pairs, max_len=dcfg.max_len,
                           max_prompt_len=dcfg.max_prompt_len)
    own = tmp_path / precompute.cache_dir(pc)
    assert re.fullmatch(r"out/ref_logps/pairs_train-[0-9a-f]{12}", precompute.cache_dir(pc))
    capsys.readouterr()
    dpo.main(dcfg)
    out = capsys.readouterr().out
    assert f"{precompute.cache_dir(pc)}/train.safetensors is missing: building it now" in out
    assert files(builtin) == before and sorted(f.name for f in files(own)) == [
        ".lock", "train.safetensors", "val.safetensors"]
    built = files(own)
    # the same inputs: the same cache, reused (one step is enough to have read it)
    dpo.main(replace(dcfg, out_dir="out/own/dpo2", stop_after=1))
    assert "is missing" not in capsys.readouterr().out and files(own) == built
    precompute.main(pc)  # what `python precompute.py --ref_model ... --train_pairs ...` runs
    assert files(builtin) == before and files(own).keys() == built.keys()
    assert all(files(own)[f][1] > built[f][1] for f in built if f.name != ".lock")  # rewritten
    # your pairs with the built-in π_ref (or val pairs, or prompts): the commands that make yours
    for cfg in (replace(dcfg, ref_model=dpo.Config.ref_model),
                replace(dcfg, test_prompts=dpo.Config.test_prompts),
                replace(pc, val_pairs=precompute.Config.val_pairs)):
        with pytest.raises(SystemExit, match=r"still the built-in task's .* python data\.py own "
                                             r"out/own/pairs_train\.jsonl --out out/own"):
            (dpo if isinstance(cfg, dpo.Config) else precompute).main(cfg)
    assert not os.path.exists("out/sft") and not os.path.exists("out/task")  # nothing built
    # pairs the task's generator writes (a regime's, e.g. out/task-capped) may use its π_ref
    rng = random.Random(0)
    (tmp_path / "capped.jsonl").write_text("".join(json.dumps(tasks.sample_pair(rng)) + "\n"
                                                   for _ in range(20)))
    precompute.check_own_inputs(precompute.Config(train_pairs="capped.jsonl"))


def test_tokenize_pairs_truncation_rule(tok):
    assert all(len(tok.encode(" " + w)) == 1
               for w in "the movie is great . i loved plot it felt".split())
    prompt, short = "the movie is great .", " i loved the plot ."   # 6 tokens with BOS, 6 with EOS
    long = " it felt great . it felt great . it felt great ."          # 13 with EOS
    rows = [dict(prompt=prompt, chosen=short, rejected=long)]
    x, ys, yl = (data.encode_prompt(tok, prompt), data.encode_response(tok, short),
                 data.encode_response(tok, long))
    assert (len(x), len(ys), len(yl)) == (6, 6, 13) and x[0] == tok.eos and yl[-1] == tok.eos
    ex, st = data.tokenize_pairs(tok, rows, max_len=19, max_prompt_len=4)    # 6 + 13 fits
    assert ex == [dict(index=0, prompt=x, chosen=ys, rejected=yl)]
    assert st == dict(rows=1, truncated_prompt=0, truncated_response=0, unusable=0,
                      chosen_lost_eos=0, rejected_lost_eos=0)
    # too long by 3: the prompt gives up 3 tokens (it may: max(16 - 13, 2) = 3 >= 2),
    # keeping its BOS
    ex, st = data.tokenize_pairs(tok, rows, max_len=16, max_prompt_len=2)
    assert (ex[0]["prompt"] == [tok.eos] + x[-2:] and ex[0]["rejected"] == yl
            and ex[0]["chosen"] == ys)
    assert st == dict(rows=1, truncated_prompt=1, truncated_response=0, unusable=0,
                      chosen_lost_eos=0, rejected_lost_eos=0)
    # max_prompt_len 5 stops the prompt at 5 tokens; the longer response is cut to
    # 16 - 5 = 11 (no EOS)
    ex, st = data.tokenize_pairs(tok, rows, max_len=16, max_prompt_len=5)
    assert (ex[0]["prompt"] == [tok.eos] + x[-4:] and ex[0]["rejected"] == yl[:11]
            and ex[0]["chosen"] == ys)
    assert st == dict(rows=1, truncated_prompt=1, truncated_response=1, unusable=0,
                      chosen_lost_eos=0, rejected_lost_eos=1)  # the longer one, cut, lost its EOS
    # a prompt already short enough is kept whole and the responses are cut
    ex, st = data.tokenize_pairs(tok, rows, max_len=12, max_prompt_len=8)
    assert ex[0]["prompt"] == x and ex[0]["rejected"] == yl[:6] and ex[0]["chosen"] == ys
    assert st == dict(rows=1, truncated_prompt=0, truncated_response=1, unusable=0,
                      chosen_lost_eos=0, rejected_lost_eos=1)
    # responses that differ only past the cut become identical: unusable, left out, counted; the
    # other rows keep their original index
    same = dict(prompt=prompt, chosen=long + " the plot is great .",
                rejected=long + " it felt fine .")
    ex, st = data.tokenize_pairs(tok, [rows[0], same, rows[0]], max_len=16, max_prompt_len=5)
    assert [e["index"] for e in ex] == [0, 2]
    assert st == dict(rows=3, truncated_prompt=3, truncated_response=3, unusable=1,
                      chosen_lost_eos=0, rejected_lost_eos=2)  # counted over the usable pairs
    with pytest.raises(AssertionError, match="max_prompt_len"):
        data.tokenize_pairs(tok, rows, max_len=8, max_prompt_len=8)

def test_one_prompt_truncation_rule_keeps_bos(tok, monkeypatch):
    ids = list(range(100, 110))  # a BOS (100) and 9 tokens
    assert data.truncate_prompt(ids, 4) == [100, 107, 108, 109]  # BOS and the last 3
    assert data.truncate_prompt(ids, 10) == ids and data.truncate_prompt(ids, 11) == ids
    # every stage that samples from a prompt hands the sampler this rule's ids: evaluate.py and
    # reward.py's offset keep block // 2 = 32 tokens (ppo.py: test_ppo_loop_wiring)
    long = " ".join(["the movie is great ."] * 8)
    x = data.encode_prompt(tok, long)
    assert len(x) > 32
    seen = []

    def spy(model, prompts, *a, **kw):
        seen.append(prompts)
        return generate(model, prompts, *a, **kw)
    for module in (evaluate, reward):
        monkeypatch.setattr(module, "generate", spy)
    lm = constant_gpt(tok.vocab_size, tok.eos)
    rm = GPT(GPTConfig(block_size=64, vocab_size=tok.vocab_size, n_layer=1, n_head=1, n_embd=4,
                       head="scalar")).eval()
    evaluate_policy(lm, lm, tok, [long, "it felt good ."], init_distributed(), k=1)
    reward.ref_scores(rm, lm, tok, [long, "it felt good ."], init_distributed(), seed=0)
    assert len(seen) == 3  # the policy's and π_ref's samples, and the offset's
    for prompts in seen:
        assert prompts == [data.truncate_prompt(x, 32), data.encode_prompt(tok, "it felt good .")]
        assert prompts[0][0] == tok.eos and prompts[0][1:] == x[-31:]


def test_ppo_and_online_dpo_say_how_many_prompts_they_cut(tiny, tiny_rm, tmp_path):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("the movie is great .\n" * 6 + " ".join(["the plot is bad ."] * 6) + "\n"
                       + "i loved it .\n")
    said = []
    cfg = tiny_ppo_config(tiny, str(tiny_rm / "model.safetensors"), tmp_path / "ppo", str(prompts),
                          prompts=str(prompts), max_prompt_len=12)
    ocfg = online_dpo.Config(out_dir=str(tmp_path / "online"), sft=cfg.sft, reward="true",
                             prompts=str(prompts), test_prompts=str(prompts), rollout_batch=8,
                             max_prompt_len=12)
    for stage, c in ((ppo, cfg), (online_dpo, ocfg)):
        _, _, _, ids, _ = stage.setup(c, CPU, said.append)
        assert [len(x) for x in ids].count(12) == 1 and max(map(len, ids)) == 12
    assert said.count(f"1 of 8 prompts of {prompts} are longer than --max_prompt_len 12 tokens: "
                      "each keeps its BOS and its last tokens") == 2


def test_tokenize_texts(tok):
    texts = ["it felt great . it felt good .", "it felt great . it felt good . it felt fine ."]
    ex, st = data.tokenize_texts(tok, texts, max_len=10)
    assert st == dict(rows=2, truncated=1)
    assert ex[0] == dict(index=0, prompt=[tok.eos], response=tok.encode(texts[0]) + [tok.eos])
    assert ex[1]["response"] == tok.encode(texts[1])[:9]

def test_collate_pairs_layout(tok):
    # cut mid-word
    rows = [dict(prompt="the movie is gre", chosen="at . it felt good .", rejected=" bad ."),
            dict(prompt="it felt good .", chosen=" i loved the plot . it felt great .",
                 rejected=" the end ."),
            dict(prompt="we saw it", chosen=" on monday .", rejected=" on friday . it felt dull .")]
    ex, _ = data.tokenize_pairs(tok, rows, max_len=64, max_prompt_len=8)
    b = data.collate_pairs(ex, tok.pad)
    ids, tg = b["input_ids"], b["targets"]
    T = max(len(e["prompt"]) + len(e[k]) for e in ex for k in ("chosen", "rejected"))
    assert ids.shape == tg.shape == (6, T) and ids.dtype == tg.dtype == torch.long
    assert b["index"].tolist() == [0, 1, 2] and b["index"].dtype == torch.long
    # [chosen; rejected]
    for i, (r, k) in enumerate((r, k) for k in ("chosen", "rejected") for r in rows):
        x, y = data.encode_prompt(tok, r["prompt"]), data.encode_response(tok, r[k])
        P, n = len(x), len(x) + len(y)
        assert ids[i, :P].tolist() == x and ids[i, P:n].tolist() == y    # the boundary is exact
        assert (ids[i, n:] == tok.pad).all()
        # position t predicts token t+1
        assert tg[i, P - 1:n - 1].tolist() == y
        assert (tg[i, :P - 1] == -100).all() and (tg[i, n - 1:] == -100).all()
    assert (tg[:, -1] == -100).all()
    hit = tg != -100
    assert (tg[:, :-1][hit[:, :-1]] == ids[:, 1:][hit[:, :-1]]).all()
    # tokenized apart: "gre" + "at" is not the " great" that tokenizing the joined text would give
    assert (data.encode_response(tok, "at . it felt good .")[0]
            != tok.encode("the movie is great .")[3])
    assert tok.decode(ids[0].tolist()) == rows[0]["prompt"] + rows[0]["chosen"]

def test_sharding_same_global_batches_any_world_size():
    n, B, seed = 103, 8, 5
    per_epoch = n // B  # 12 steps; the tail of 7 is dropped
    for step in range(3 * per_epoch):
        g = data.global_batch(n, B, step, seed)
        assert len(set(g)) == B and all(0 <= i < n for i in g)
        assert g == data.global_batch(n, B, step, seed)
        assert data.rank_slice(g, 0, 1) == g
        halves = [data.rank_slice(g, r, 2) for r in range(2)]
        assert halves[0] + halves[1] == g and not set(halves[0]) & set(halves[1])
        quarters = [data.rank_slice(g, r, 4) for r in range(4)]
        assert sum(quarters, []) == g and all(len(q) == 2 for q in quarters)
    epoch = sum((data.global_batch(n, B, s, seed) for s in range(per_epoch)), [])
    # an epoch sees each example once at most
    assert len(set(epoch)) == per_epoch * B
    # reshuffled
    assert data.global_batch(n, B, per_epoch, seed) != data.global_batch(n, B, 0, seed)
    with pytest.raises(AssertionError, match="divisible"):
        data.rank_slice(list(range(6)), 0, 4)
    with pytest.raises(AssertionError, match="larger"):
        data.global_batch(5, 8, 0, 0)

def test_length_sorted_batches_are_the_same_batches_with_less_padding():
    n, B, mb, seed = 103, 32, 8, 5  # 3 steps an epoch, 4 micro-batches a step
    lengths = torch.randint(5, 60, (n,), generator=torch.Generator().manual_seed(0)).tolist()
    def pad(bs):  # padded positions of the contiguous micro-batches
        return sum(mb * max(lengths[i] for i in g[k:k + mb]) for g in bs for k in range(0, B, mb))
    steps = range(9)
    by_length = [data.global_batch(n, B, s, seed, lengths) for s in steps]
    plain = [data.global_batch(n, B, s, seed) for s in steps]
    for g, p in zip(by_length, plain):
        assert sorted(g) == sorted(p) and g != p  # each step's examples: the uniform batch's own
        assert [lengths[i] for i in g] == sorted((lengths[i] for i in g), reverse=True)
    real = sum(lengths[i] for g in plain for i in g)
    # lengths uniform in 5..59: measured 0.56 of positions real in unsorted micro-batches, 0.81
    assert real / pad(by_length) > 0.75 > 0.65 > real / pad(plain)


# ==================================================================================================
# flags, batch split, lr schedule, checkpoints; SFT: two ranks equal one process and resumed
# equals uninterrupted (plumbing.py, checkpoint.py, sft.py)
# ==================================================================================================

def test_parse_config_flags_help_and_bad_values(capsys):
    cfg = plumbing.parse_config(sft.Config, ["--lr", "0.01", "--no-resume", "--n-layer", "3"])
    assert (cfg.lr == 0.01 and cfg.resume is False and cfg.n_layer == 3
            and cfg.steps == sft.Config.steps)
    with pytest.raises(SystemExit):
        plumbing.parse_config(sft.Config, ["--steps", "ten"])
    assert "invalid int value: 'ten'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        plumbing.parse_config(sft.Config, ["--help"])
    # help comes from the field's comment
    assert "peak AdamW learning rate" in capsys.readouterr().out


def outside(interval, is_int):
    """Values just outside `interval` ("[lo, hi)" and the like), and NaN for a float flag."""
    lo, hi = (float(b) for b in interval[1:-1].split(","))
    step = 1 if is_int else 1e-6 * max(1.0, abs(lo))
    bad = [] if is_int else [math.nan]
    if math.isfinite(lo):
        bad.append(lo - step if interval[0] == "[" else lo)
    if math.isfinite(hi):
        bad.append(hi + step if interval[-1] == "]" else hi)
    elif not is_int:
        bad.append(math.inf)
    return [int(v) if is_int else v for v in bad]


def test_every_numeric_flag_of_every_stage_is_checked_before_any_work(tmp_path, capsys):
    from study import compare, costs, figure, gpu, kv_cache, tune
    configs = [m.Config for m in (sft, reward, precompute, dpo, ppo, grpo, online_dpo, evaluate,
                                  compare, costs, figure, gpu, kv_cache, tune)]
    checked = 0
    for cls in configs:
        for f in dataclasses.fields(cls):
            if isinstance(f.default, bool) or not isinstance(f.default, (int, float)):
                continue
            interval = plumbing.FLAG_RANGES[f.name]  # every numeric flag has one
            assert plumbing.in_range(f.default, interval), (cls.__module__, f.name)
            for value in outside(interval, isinstance(f.default, int)):
                with pytest.raises(SystemExit) as e:
                    plumbing.parse_config(cls, [f"--{f.name}={value}"])
                assert f"--{f.name} " in str(e.value) and interval in str(e.value), e.value
                checked += 1
    assert checked > 150
    # a value a field's comment gives a meaning to ("0 = no curves", "0: plain DPO") is allowed
    documented = 0
    for cls in configs:
        for line in inspect.getsource(cls).splitlines():
            m = re.match(r"\s+(\w+): (?:int|float) = .*#.*[ (]0(?: =|:) ", line)
            if m:
                assert plumbing.in_range(0, plumbing.FLAG_RANGES[m.group(1)]), line
                documented += 1
    assert documented >= 7
    # the cases a review found crashing or saving π_ref silently, refused by the CLI before any
    # work: nothing is written, not even the output folder
    for script, args in (("dpo.py", ["--steps", "-3"]), ("sft.py", ["--batch_size", "0"]),
                         ("ppo.py", ["--temperature", "1e-12"])):
        out = tmp_path / "never"
        p = subprocess.run([sys.executable, os.path.join(HERE, script), *args, "--out_dir",
                            str(out)], capture_output=True, text=True, timeout=60, cwd=tmp_path)
        assert p.returncode != 0 and f"error: {args[0]} " in p.stderr, (script, args, p.stderr)
        assert "Traceback" not in p.stderr and not out.exists()
    # --help names the allowed values
    with pytest.raises(SystemExit):
        plumbing.parse_config(dpo.Config, ["--help"])
    assert "allowed: [0.001, inf)" in capsys.readouterr().out


def test_split_batch_derives_accumulation_or_says_why_not():
    assert plumbing.split_batch(64, 8, 2) == 4 and plumbing.split_batch(32, 32, 8) == 1
    with pytest.raises(SystemExit, match="not divisible by the 3 ranks"):
        plumbing.split_batch(64, 8, 3)
    with pytest.raises(SystemExit, match="not a multiple of --micro_batch_size 12"):
        plumbing.split_batch(64, 12, 2)


def test_lr_schedule_warmup_then_cosine():
    lrs = [plumbing.lr_at(s, 100, 1.0, 10, 0.1) for s in range(100)]
    assert lrs[0] == pytest.approx(0.1) and lrs[9] == pytest.approx(1.0)
    assert lrs[10] == pytest.approx(1.0) and all(a >= b for a, b in zip(lrs[10:], lrs[11:]))
    assert plumbing.lr_at(100, 100, 1.0, 10, 0.1) == pytest.approx(0.1)


def test_checkpoint_round_trip_and_a_crash_keeps_the_previous_one(tmp_path):
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
    net[1].weight = torch.nn.Parameter(net[1].weight)  # a plain module
    opt = torch.optim.AdamW(net.parameters(), lr=0.1)
    net(torch.randn(3, 4)).sum().backward()
    opt.step()
    checkpoint.save_checkpoint(str(tmp_path), 7,
                               {"model": net, "optim": opt, "gen": torch.arange(3)}, {"a": 1})
    net2 = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
    opt2 = torch.optim.AdamW(net2.parameters(), lr=0.1)
    step, state = checkpoint.load_checkpoint(str(tmp_path),
                                             {"model": net2, "optim": opt2, "gen": torch.zeros(3)},
                                             "cpu")
    assert step == 7 and state["a"] == 1 and torch.equal(state["tensors"]["gen"], torch.arange(3))
    for p, q in zip(net.parameters(), net2.parameters()):
        assert torch.equal(p, q)
    for s, t in zip(opt.state.values(), opt2.state.values()):
        assert all(torch.equal(torch.as_tensor(s[k]), torch.as_tensor(t[k])) for k in s)
    # a writer that died before renaming leaves only a .tmp: the checkpoint on record is unchanged
    (tmp_path / "step-0000008.safetensors.tmp").write_bytes(b"half")
    assert checkpoint.checkpoint_state(str(tmp_path))["step"] == 7


# ---- sft: world size 2 equals 1, resumed equals uninterrupted, torchrun smoke


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


def test_sft_two_ranks_equal_one_process_and_resume_equals_uninterrupted(tiny, tmp_path):
    one, two, resumed = tmp_path / "one", tmp_path / "two", tmp_path / "resumed"
    sft.main(sft.Config(**sft_args(tiny, one)))  # 1 rank x 4 micro-steps of 4
    run_torchrun("sft.py", as_flags(sft_args(tiny, two)))  # 2 ranks x 2 micro-steps of 4
    # Same global batch and token normalisation; only the order of fp32 sums differs (all-reduce,
    # accumulation). Compared where the math is tight: each step's loss and gradient norm before
    # the optimizer, and the val loss after the last update (it pins the final weights' function).
    # Not the weights themselves: Adam's lr·m/√v turns the rounding noise of a near-zero gradient
    # into a step of up to ~lr, on weights that, by that same token, barely move the outputs.
    a, b = (read_metrics(out) for out in (one, two))
    assert [r["step"] for r in a] == [r["step"] for r in b]
    for k in ("loss", "grad_norm", "val_loss"):  # measured: <= 2e-7 at 1 and 2 threads
        assert all(abs(x[k] - y[k]) <= 1e-5 for x, y in zip(a, b) if k in x), k
    w1 = saved_weights(one)
    sft.main(sft.Config(**sft_args(tiny, resumed, stop_after=3)))
    assert not os.path.exists(resumed / "model.safetensors")  # interrupted: no final model yet
    sft.main(sft.Config(**sft_args(tiny, resumed)))  # picks up at step 3
    w3 = saved_weights(resumed)
    for k in w1:  # the same operations in the same order: bit for bit
        assert torch.equal(w1[k], w3[k]), k
    with open(resumed / "metrics.jsonl") as f:
        steps = [json.loads(line)["step"] for line in f]
    # the resumed log keeps the first run's lines, none twice
    assert steps == sorted(set(steps)) and steps[0] == 1
    # and no extra line at the resumed run's first step: the uninterrupted run's steps exactly
    assert steps == [m["step"] for m in read_metrics(one)]


def test_sft_refuses_to_resume_a_different_config(tiny, tmp_path):
    sft.main(sft.Config(**sft_args(tiny, tmp_path, steps=4, stop_after=2)))
    with pytest.raises(SystemExit, match=r"another config \(lr 0.003 -> 0.001\)"):
        sft.main(sft.Config(**sft_args(tiny, tmp_path, steps=4, lr=0.001)))


def test_sft_init_from_takes_the_shape_from_config_json(tmp_path, capsys):
    # a 4-head GPT-2 folder: sft.py's --n_head (2 here) must not override, nor guess, its heads
    data.own_data(EXAMPLE, str(tmp_path / "own"), vocab_size=300, log=lambda *a: None)
    o = lambda name: str(tmp_path / "own" / name)  # noqa: E731
    tok, src = data.load_tokenizer(o("tokenizer.json")), tmp_path / "hf"
    export_gpt2(tiny_gpt(vocab_size=tok.vocab_size, block_size=96, n_head=4, n_embd=32).float(),
                o("tokenizer.json"), str(src))
    args = dict(out_dir=str(tmp_path / "sft"), train_text=o("sft_train.jsonl"),
                val_text=o("sft_val.jsonl"), tokenizer=o("tokenizer.json"),
                init_from=str(src / "model.safetensors"), **{**TINY_MODEL, "block_size": 96},
                steps=1, batch_size=16, micro_batch_size=16)
    assert args["n_head"] == 2
    sft.main(sft.Config(**args))
    assert "n_layer 2, n_head 4, n_embd 32 (its config.json" in capsys.readouterr().out
    assert load_model(str(tmp_path / "sft" / "model.safetensors"))[0].config.n_head == 4
    os.remove(src / "config.json")
    with pytest.raises(SystemExit, match="no config.json beside it, so its number of heads is "
                                         "unknown: copy the model's config.json next to it$"):
        sft.main(sft.Config(**{**args, "out_dir": str(tmp_path / "sft2")}))


def test_sft_explicit_missing_input_is_an_error_naming_it(tiny, tmp_path):
    with pytest.raises(SystemExit, match="nope.txt does not exist"):
        sft.main(sft.Config(**{**sft_args(tiny, tmp_path),
                               "train_text": str(tmp_path / "nope.txt")}))


# ==================================================================================================
# the DPO losses against hand values and their gradient against §4 of the paper; step 0 gives
# ln 2; cached equals live; two ranks equal one; the shared skeleton (precompute.py, dpo.py)
# ==================================================================================================

# Equivalent DPO runs differ only in the order of fp32 sums: a cache computed in batches of 64
# against live micro-batches of 8 (other padding), one rank against two. Their per-step losses,
# margins and gradient norms agree to <= 8e-7 (measured at 1 and 2 threads); the bugs these tests
# guard against (a misaligned cache row, a missing x world, a dropped micro-batch) move them by
# > 1e-3. Weights are not compared: Adam's lr·m/√v turns the rounding noise of a near-zero gradient
# into a step of up to ~lr (1.1e-4 measured), on weights that barely move the outputs. The val loss
# after the last update pins the final weights' function instead. Adam is blind to a gradient's
# scale, so the gradient's normalisation is checked through grad_norm.
DPO_TOL = 1e-5
DPO_METRICS = ["loss", "rewards/chosen", "rewards/rejected", "rewards/accuracies",
               "rewards/margins",
               "logps/chosen", "logps/rejected", "grad_norm", "lr", "tokens_per_sec", "mfu",
               "mfu_hardware"]


def dpo_pcfg(tiny, out="dpo-cache", pairs=None, ref_model=None):
    return precompute.Config(out_dir=str(tiny.root / out),
                             ref_model=ref_model or f"{tiny.sft}/model.safetensors",
                             train_pairs=pairs or str(tiny.root / "dpo-data/pairs_train.jsonl"),
                             val_pairs=pairs or str(tiny.root / "dpo-data/pairs_val.jsonl"))


@pytest.fixture(scope="module")
def dpo_cache(tiny):  # noqa: F811
    """A slice of the task (256 train pairs, 64 val pairs, 8 validation and 8 test prompts), so each
    run takes a second, and the tiny π_ref's log-prob cache of it, computed by one process."""
    own = tiny.root / "dpo-data"
    os.makedirs(own)
    for name, n in (("pairs_train.jsonl", 256), ("pairs_val.jsonl", 64), ("prompts_val.jsonl", 8),
                    ("prompts_test.jsonl", 8)):
        (own / name).write_text("".join(open(f"{tiny.task}/{name}").readlines()[:n]))
    precompute.main(dpo_pcfg(tiny))
    return str(tiny.root / "dpo-cache")


def dpo_cfg(tiny, name, **kw):  # noqa: F811
    base = dict(out_dir=str(tiny.root / name), ref_model=f"{tiny.sft}/model.safetensors",
                train_pairs=str(tiny.root / "dpo-data/pairs_train.jsonl"),
                val_pairs=str(tiny.root / "dpo-data/pairs_val.jsonl"),
                test_prompts=str(tiny.root / "dpo-data/prompts_test.jsonl"),
                ref_logps=str(tiny.root / "dpo-cache"),
                steps=3, batch_size=16, micro_batch_size=8, lr=1e-3, warmup=1, eval_every=1000,
                ckpt_every=1000, eval_k=1)
    return dpo.Config(**{**base, **kw})


def dpo_metrics(out_dir):
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def dpo_weights(out_dir):
    return load_file(os.path.join(out_dir, "model.safetensors"))


def dpo_max_diff(a, b):
    assert a.keys() == b.keys()
    return max((a[k].double() - b[k].double()).abs().max().item() for k in a)


# -----------------------------------------------------------------------------
# losses: closed forms, the analytic gradient of Sec. 4, gradcheck


def test_losses_match_hand_computed_values():
    # h = (−10 − −11) − (−12 − −11) = 2; β = 0.5: βh = 1, rewards ±0.5
    args = [torch.tensor([x]) for x in (-10.0, -12.0, -11.0, -11.0)]
    loss, r_c, r_r = dpo.dpo_loss(*args, beta=0.5)
    assert loss.item() == pytest.approx(math.log1p(math.exp(-1)), abs=1e-7)  # −log σ(1)
    assert (r_c.item(), r_r.item()) == (0.5, -0.5)
    smooth, _, _ = dpo.dpo_loss(*args, beta=0.5, label_smoothing=0.2)
    assert smooth.item() == pytest.approx(0.8 * math.log1p(math.exp(-1))
                                          + 0.2 * math.log1p(math.exp(1)), abs=1e-7)
    ipo, _, _ = dpo.dpo_loss(*args, beta=0.5, loss="ipo")  # (h − 1/(2β))² = (2 − 1)²
    assert ipo.item() == pytest.approx(1.0, abs=1e-7)
    ipo, _, _ = dpo.dpo_loss(*args, beta=0.25, loss="ipo")  # h = 1/(2β) is IPO's target: zero loss
    assert ipo.item() == pytest.approx(0.0, abs=1e-7)


def test_gradient_matches_the_papers_analytic_form():
    torch.manual_seed(0)
    B, beta, eps = 6, 0.3, 0.1
    pi_c, pi_r = ((-20 * torch.rand(B, dtype=torch.float64)).requires_grad_(),
                  (-20 * torch.rand(B, dtype=torch.float64)).requires_grad_())
    ref_c, ref_r = (-20 * torch.rand(B, dtype=torch.float64),
                    -20 * torch.rand(B, dtype=torch.float64))
    losses, r_c, r_r = dpo.dpo_loss(pi_c, pi_r, ref_c, ref_r, beta)
    g_c, g_r = torch.autograd.grad(losses.mean(), (pi_c, pi_r))
    # Sec. 4: β σ(r̂(x,y_l) − r̂(x,y_w)), for the mean over B
    w = beta * torch.sigmoid(r_r - r_c) / B
    torch.testing.assert_close(g_c, -w, rtol=1e-12, atol=1e-15)
    torch.testing.assert_close(g_r, w, rtol=1e-12, atol=1e-15)
    h = ((pi_c - ref_c) - (pi_r - ref_r)).detach()
    losses, _, _ = dpo.dpo_loss(pi_c, pi_r, ref_c, ref_r, beta, label_smoothing=eps)
    g_c, = torch.autograd.grad(losses.sum(), pi_c)
    torch.testing.assert_close(g_c, -beta * ((1 - eps) * torch.sigmoid(-beta * h)
                                             - eps * torch.sigmoid(beta * h)))
    losses, _, _ = dpo.dpo_loss(pi_c, pi_r, ref_c, ref_r, beta, loss="ipo")
    g_c, g_r = torch.autograd.grad(losses.sum(), (pi_c, pi_r))
    torch.testing.assert_close(g_c, 2 * (h - 1 / (2 * beta)))
    torch.testing.assert_close(g_r, -2 * (h - 1 / (2 * beta)))
    # RPO: + α·(−log π(y_w)/|y_w|): the chosen side's gradient gains −α/|y_w|, the rejected's none
    n = torch.randint(1, 30, (B,), generator=torch.Generator().manual_seed(1)).double()
    losses, _, _ = dpo.dpo_loss(pi_c, pi_r, ref_c, ref_r, beta, rpo_alpha=0.7, chosen_len=n)
    g_c, g_r = torch.autograd.grad(losses.sum(), (pi_c, pi_r))
    torch.testing.assert_close(g_c, -beta * torch.sigmoid(-beta * h) - 0.7 / n)
    torch.testing.assert_close(g_r, beta * torch.sigmoid(-beta * h))
    plain = dpo.dpo_loss(pi_c, pi_r, ref_c, ref_r, beta)[0]
    torch.testing.assert_close(losses, plain - 0.7 * pi_c / n)  # the value: DPO's plus α·NLL/token
    for kw in (dict(), dict(label_smoothing=eps), dict(loss="ipo"),
               dict(rpo_alpha=0.7, chosen_len=n)):
        assert torch.autograd.gradcheck(lambda a, b, c, d: dpo.dpo_loss(a, b, c, d, beta, **kw)[0],
                                        (pi_c, pi_r, ref_c.requires_grad_(),
                                         ref_r.requires_grad_()))
        ref_c, ref_r = ref_c.detach(), ref_r.detach()


def test_simpo_loss_matches_hand_computed_values():
    # log π(y_w) −10 over 5 tokens, log π(y_l) −12 over 4: means −2 and −3. β 2, γ 0.5:
    # β·(−2) − β·(−3) − γ = 1.5; the rewards are β times the means, −4 and −6
    pi_c, pi_r = torch.tensor([-10.0]), torch.tensor([-12.0])
    n_c, n_r = torch.tensor([5]), torch.tensor([4])
    loss, r_c, r_r = dpo.simpo_loss(pi_c, pi_r, n_c, n_r, beta=2.0, gamma=0.5)
    assert loss.item() == pytest.approx(math.log1p(math.exp(-1.5)), abs=1e-7)  # −log σ(1.5)
    assert (r_c.item(), r_r.item()) == (-4.0, -6.0)
    # γ = 2 meets the margin exactly: −log σ(0) = ln 2 (summed log-probs would give −log σ(2),
    # the lengths swapped −log σ(−2.2))
    loss, _, _ = dpo.simpo_loss(pi_c, pi_r, n_c, n_r, beta=2.0, gamma=2.0)
    assert loss.item() == pytest.approx(math.log(2), abs=1e-7)


def test_simpo_gradient_matches_the_analytic_form():
    # z = β(log π(y_w)/|y_w| − log π(y_l)/|y_l|) − γ, L = −log σ(z):
    # ∂L/∂log π(y_w) = −β σ(−z)/|y_w|, ∂L/∂log π(y_l) = +β σ(−z)/|y_l|
    torch.manual_seed(0)
    B, beta, gamma = 6, 2.5, 0.8
    pi_c, pi_r = ((-20 * torch.rand(B, dtype=torch.float64)).requires_grad_() for _ in range(2))
    n_c, n_r = (torch.randint(1, 30, (B,), generator=torch.Generator().manual_seed(k))
                for k in (1, 2))
    losses, _, _ = dpo.simpo_loss(pi_c, pi_r, n_c, n_r, beta, gamma)
    g_c, g_r = torch.autograd.grad(losses.sum(), (pi_c, pi_r))
    z = (beta * (pi_c / n_c - pi_r / n_r) - gamma).detach()
    torch.testing.assert_close(g_c, -beta * torch.sigmoid(-z) / n_c, rtol=1e-12, atol=1e-15)
    torch.testing.assert_close(g_r, beta * torch.sigmoid(-z) / n_r, rtol=1e-12, atol=1e-15)
    assert torch.autograd.gradcheck(lambda a, b: dpo.simpo_loss(a, b, n_c, n_r, beta, gamma)[0],
                                    (pi_c, pi_r))


# -----------------------------------------------------------------------------
# log-probs: one concatenated forward; only response tokens count


def test_concatenated_forward_equals_separate_forwards_and_counts_only_responses(  # noqa: F811
        tiny):
    model, _ = load_model(f"{tiny.sft}/model.safetensors")
    model = model.double().eval()  # fp64: the same math must agree to 1e-10
    tok = data.load_tokenizer(f"{tiny.sft}/tokenizer.json")
    ex, _ = data.tokenize_pairs(tok, data.read_pairs(f"{tiny.task}/pairs_val.jsonl")[:5], 64, 16)
    b = data.collate_pairs(ex, tok.pad)
    with torch.no_grad():
        both = pair_logps(model, b["input_ids"], b["targets"])  # (2B,)
        for half, key in ((both[:5], "chosen"), (both[5:], "rejected")):
            # its own, shorter padding
            x, y = data.collate([(e["prompt"], e[key]) for e in ex], tok.pad)
            torch.testing.assert_close(half, pair_logps(model, x, y), rtol=0, atol=1e-10)
            # the obvious way: one unpadded sequence, response tokens only
            for e, got in zip(ex, half):
                seq = torch.tensor([e["prompt"] + e[key]])
                logp = torch.log_softmax(model(seq)[0, len(e["prompt"]) - 1:-1], -1)
                want = logp.gather(-1, torch.tensor(e[key])[:, None]).sum()
                assert abs(got.item() - want.item()) < 1e-10


def test_grouped_micro_batches_with_targets_only_give_todays_loss_and_gradients(tiny):  # noqa: F811
    # Today's path, before length grouping and logits only at targets: the global batch as one
    # batch padded to its longest row, the LM head on every position (token_logprobs of the full
    # logits). dpo.py's path: the same 16 pairs, longest first, in 4 micro-batches each padded to
    # its own longest row, the head only at the targets, each micro-batch's summed loss over the
    # global batch. float64, so the two differ only in summation order (~1e-15; right padding is
    # invisible to the causal real tokens); a pair dropped or counted twice, a log-prob at the
    # wrong position or a wrong normalisation moves the loss by > 1e-3.
    model = load_model(f"{tiny.sft}/model.safetensors")[0].double().eval()
    tok = data.load_tokenizer(f"{tiny.sft}/tokenizer.json")
    ex, _ = data.tokenize_pairs(tok, data.read_pairs(f"{tiny.task}/pairs_train.jsonl")[:64], 64, 16)
    assert [e["index"] for e in ex] == list(range(64))
    batch = [ex[i] for i in data.global_batch(64, 16, 0, 0, [data.longest_row(e) for e in ex])]
    ref = -30 + torch.randn(2, 64, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    ps = list(model.parameters())

    def loss_and_grads(batches, logps):
        loss, positions = 0.0, 0
        for rows in batches:
            b = data.collate_pairs(rows, tok.pad)
            pi_c, pi_r = logps(b["input_ids"], b["targets"]).chunk(2)
            losses, _, _ = dpo.dpo_loss(pi_c, pi_r, *ref[:, b["index"]], beta=0.1)
            loss, positions = loss + losses.sum() / 16, positions + b["input_ids"].numel()
        return loss, torch.autograd.grad(loss, ps), positions

    full = lambda x, y: token_logprobs(model(x), y).sum(-1)  # noqa: E731
    today, g_today, n_today = loss_and_grads([batch[::-1]], full)  # any order: one batch
    ours, g_ours, n_ours = loss_and_grads([batch[i:i + 4] for i in range(0, 16, 4)],
                                          lambda x, y: pair_logps(model, x, y))
    assert abs(today.item() - ours.item()) < 1e-12
    assert all(torch.allclose(a, b, atol=1e-12, rtol=0) for a, b in zip(g_today, g_ours))
    assert n_ours < n_today  # and each micro-batch was cut to its own longest row (808 < 896)


def test_packed_batches_give_the_padded_logprobs_loss_and_gradients(tiny):  # noqa: F811
    # data.pack_pairs puts the same 2B sequences whole into rows of max_len with no padding
    # between them; GPT.forward(mask=seq) attends only within a sequence and restarts its
    # positions at 0, so each sequence's log-probs, the DPO loss and its gradients are the padded
    # batch's. float64: the two differ only in summation order (~1e-13); attention that crosses a
    # sequence boundary, positions that run on, or a sum over the wrong sequence move them by
    # > 1e-3.
    model = load_model(f"{tiny.sft}/model.safetensors")[0].double().eval()
    tok = data.load_tokenizer(f"{tiny.sft}/tokenizer.json")
    ex, _ = data.tokenize_pairs(tok, data.read_pairs(f"{tiny.task}/pairs_train.jsonl")[:16], 64, 16)
    ref = -30 + torch.randn(2, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    padded, packed = data.collate_pairs(ex, tok.pad), data.collate_pairs(ex, tok.pad, 64)
    assert padded["seq"] is None and packed["index"].tolist() == padded["index"].tolist()
    # the layout: sequence k of the packed batch is row k of the padded one, whole and contiguous
    x, y, s = packed["input_ids"], packed["targets"], packed["seq"]
    assert x.shape[1] <= 64 and x.numel() < padded["input_ids"].numel()
    assert (x != tok.pad).sum() == (padded["input_ids"] != tok.pad).sum() == (s >= 0).sum()
    assert sum((s[:, 1:] != s[:, :-1]).sum(1) + 1) <= 32 + len(x)  # each sequence one run
    for k in range(32):
        real = padded["input_ids"][k] != tok.pad
        assert x[s == k].tolist() == padded["input_ids"][k][real].tolist()
        assert y[s == k].tolist() == padded["targets"][k][real].tolist()
    assert ((s >= 0).sum(1) > 64 // 2).sum() >= len(x) - 1  # full rows: at most one half empty
    ps = list(model.parameters())

    def loss_and_grads(b):
        lp = pair_logps(model, b["input_ids"], b["targets"], b["seq"])
        losses, _, _ = dpo.dpo_loss(*lp.chunk(2), *ref, beta=0.1)
        return lp, losses.mean(), torch.autograd.grad(losses.mean(), ps)

    lp_pad, loss_pad, g_pad = loss_and_grads(padded)
    lp_pack, loss_pack, g_pack = loss_and_grads(packed)
    torch.testing.assert_close(lp_pack, lp_pad, atol=1e-10, rtol=0)
    assert abs(loss_pack.item() - loss_pad.item()) < 1e-12
    assert all(torch.allclose(a, b, atol=1e-12, rtol=0) for a, b in zip(g_pad, g_pack))
    # fp32, as the runs compute: the same to fp32 rounding of sums of about 30 nats
    model.float()
    with torch.no_grad():
        got = [pair_logps(model, b["input_ids"], b["targets"], b["seq"]) for b in (padded, packed)]
    torch.testing.assert_close(got[1], got[0], atol=1e-4, rtol=0)


def test_packed_reward_reads_each_sequence_at_its_own_last_token(tiny):  # noqa: F811
    # r_φ's reading of a packed batch (model.score_at_last with the sequence ids) is each
    # sequence's last token, as alone and as in a padded batch; reward.pair_scores gives the
    # same scores packed or padded
    torch.manual_seed(0)
    m = GPT(GPTConfig(block_size=32, vocab_size=50, n_layer=2, n_head=2, n_embd=16,
                      head="scalar")).eval()
    torch.nn.init.normal_(m.score.weight)  # the zero init would make every score 0
    ex = [dict(index=i, prompt=[1, 2 + i], chosen=[5 + i] * (3 + i), rejected=[9] * (8 - i))
          for i in range(4)]
    b = data.pack_pairs(ex, 49, 16)
    assert len(b["input_ids"]) < 8  # packed: rows hold more than one sequence
    with torch.no_grad():
        got = score_at_last(m(b["input_ids"], mask=b["seq"]), b["seq"])
        alone = [m(torch.tensor([e["prompt"] + e[k]]))[0, -1] for k in ("chosen", "rejected")
                 for e in ex]
    torch.testing.assert_close(got, torch.stack(alone), atol=1e-5, rtol=0)
    tok = data.load_tokenizer(f"{tiny.sft}/tokenizer.json")
    rm = load_model(f"{tiny.sft}/model.safetensors", head="scalar")[0].eval()
    torch.nn.init.normal_(rm.score.weight, generator=torch.Generator().manual_seed(0))
    val, _ = data.tokenize_pairs(tok, data.read_pairs(f"{tiny.task}/pairs_val.jsonl")[:24], 64, 16)
    cpu = torch.device("cpu")
    padded, packed = (reward.pair_scores(rm, val, tok.pad, 8, cpu, n) for n in (0, 64))
    for a, p in zip(padded, packed):
        torch.testing.assert_close(p, a, atol=1e-4, rtol=0)


# -----------------------------------------------------------------------------
# the training loop


def test_held_out_loss_is_the_configured_loss(tiny):
    tok = data.load_tokenizer(f"{tiny.sft}/tokenizer.json")
    val, _ = data.tokenize_pairs(tok, data.read_pairs(f"{tiny.task}/pairs_val.jsonl")[:12], 64, 16)
    ref = load_model(f"{tiny.sft}/model.safetensors", "cpu")[0].eval()
    policy = copy.deepcopy(ref)
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
    b = data.collate_pairs(val, tok.pad)
    with torch.no_grad():
        logps = [pair_logps(m, b["input_ids"], b["targets"]).chunk(2) for m in (policy, ref)]
    seen = {}
    for kw in (dict(loss="sigmoid"), dict(loss="ipo"), dict(loss="sigmoid", label_smoothing=0.2),
               dict(rpo_alpha=0.5)):
        cfg = replace(dpo.Config(), beta=0.3, micro_batch_size=5, **kw)  # 3 micro-batches
        want = dpo.dpo_loss(*logps[0], *logps[1], cfg.beta, cfg.loss, cfg.label_smoothing,
                            cfg.rpo_alpha, dpo.response_len(b["targets"])[0])[0]
        loss, _ = dpo.evaluate_pairs(policy, ref, None, val, cfg, init_distributed(), tok.pad)
        assert loss == pytest.approx(want.mean().item(), rel=1e-5), kw
        seen[str(kw)] = loss
    assert len({round(v, 4) for v in seen.values()}) == 4  # four losses, four numbers


def test_step_zero_policy_equals_reference(tiny, dpo_cache):  # noqa: F811
    # live: the same forward twice; ln 2 to fp32 rounding
    for ref, tol in (("live", 1e-7), ("cache", DPO_TOL)):
        cfg = dpo_cfg(tiny, f"dpo-step0-{ref}", ref=ref, steps=2, stop_after=1)
        dpo.main(cfg)
        m = dpo_metrics(cfg.out_dir)[0]
        assert set(DPO_METRICS) <= m.keys() and any(k.startswith("time/") for k in m)
        assert abs(m["loss"] - math.log(2)) <= tol
        if ref == "live":  # π_θ and π_ref: one function, one batch, so the rewards are exactly 0
            assert m["rewards/chosen"] == m["rewards/rejected"] == m["rewards/margins"] == 0.0
            assert m["rewards/accuracies"] == 0.0  # no pair is ordered yet (strict >, as TRL)
        assert (abs(m["rewards/chosen"]) <= tol and abs(m["rewards/rejected"]) <= tol
                and abs(m["rewards/margins"]) <= tol)


def test_rpo_step_zero_adds_alpha_times_the_chosen_nll_per_token(tiny, dpo_cache):  # noqa: F811
    # one batch of all 16 pairs, π = π_ref: the DPO part is ln 2, and the NLL is π_ref's own
    rows = open(tiny.root / "dpo-data/pairs_train.jsonl").readlines()[:16]
    (tiny.root / "dpo-rpo").mkdir()
    (tiny.root / "dpo-rpo/pairs.jsonl").write_text("".join(rows))
    cfg = dpo_cfg(tiny, "dpo-rpo/run", ref="live", steps=2, stop_after=1, rpo_alpha=0.7,
                  train_pairs=str(tiny.root / "dpo-rpo/pairs.jsonl"))
    dpo.main(cfg)
    examples, ref_c, _ = ref_pair_logps(tiny, cfg)
    nll = (-ref_c / torch.tensor([len(e["chosen"]) for e in examples])).mean().item()
    assert dpo_metrics(cfg.out_dir)[0]["loss"] == pytest.approx(math.log(2) + 0.7 * nll, rel=1e-6)


def ref_pair_logps(tiny, cfg):
    """cfg's train pairs as dpo.py tokenizes them, and π_ref's summed response log-probs of each:
    (examples, chosen (B,), rejected (B,)), from one padded batch."""
    tok = data.load_tokenizer(f"{tiny.sft}/tokenizer.json")
    examples, _ = data.tokenize_pairs(tok, data.read_pairs(cfg.train_pairs), cfg.max_len,
                                      cfg.max_prompt_len)
    b = data.collate_pairs(examples, tok.pad)
    with torch.no_grad():
        c, r = pair_logps(load_model(cfg.ref_model)[0].eval(), b["input_ids"],
                          b["targets"]).chunk(2)
    return examples, c, r


def test_simpo_step_zero_loss_is_the_closed_form(tiny, dpo_cache):  # noqa: F811
    # one batch of all 16 pairs, the policy at π_ref: the loss is the mean of
    # −log σ(β(log π_ref(y_w)/|y_w| − log π_ref(y_l)/|y_l|) − γ), with no log π_ref subtracted
    # (DPO's would be ln 2), and the rewards are β times the mean log-probs per token
    rows = open(tiny.root / "dpo-data/pairs_train.jsonl").readlines()[:16]
    (tiny.root / "simpo-step0").mkdir()
    (tiny.root / "simpo-step0/pairs.jsonl").write_text("".join(rows))
    beta, gamma = 2.0, 0.3
    cfg = dpo_cfg(tiny, "simpo-step0/run", loss="simpo", beta=beta, simpo_gamma=gamma, steps=2,
                  stop_after=1, train_pairs=str(tiny.root / "simpo-step0/pairs.jsonl"),
                  ref_logps=str(tiny.root / "simpo-step0/no-cache"))  # explicit, missing: unread
    dpo.main(cfg)
    examples, lp_c, lp_r = (x.double() if torch.is_tensor(x) else x
                            for x in ref_pair_logps(tiny, cfg))
    mean_c = lp_c / torch.tensor([len(e["chosen"]) for e in examples])
    mean_r = lp_r / torch.tensor([len(e["rejected"]) for e in examples])
    assert (mean_c != lp_c / torch.tensor([len(e["rejected"]) for e in examples])).any()
    z = beta * (mean_c - mean_r) - gamma
    m = dpo_metrics(cfg.out_dir)[0]
    assert m["loss"] == pytest.approx(torch.log1p(torch.exp(-z)).mean().item(), rel=1e-5)
    assert m["rewards/chosen"] == pytest.approx(beta * mean_c.mean().item(), rel=1e-5)
    assert m["rewards/margins"] == pytest.approx(beta * (mean_c - mean_r).mean().item(), abs=1e-5)
    assert m["rewards/accuracies"] == (mean_c > mean_r).double().mean().item()
    assert m["logps/chosen"] == pytest.approx(lp_c.mean().item(), rel=1e-5)  # summed, as DPO's
    assert not os.path.exists(cfg.ref_logps)


def test_simpo_run_builds_no_cache_and_holds_one_model(tiny, dpo_cache, tmp_path,  # noqa: F811
                                                       monkeypatch, capsys):
    # --ref_logps at its default (relative to the working folder), where DPO would build the cache
    # of these pairs: SimPO builds none and reads none, trains the policy alone, and loads π_ref
    # after training, for the evaluation's KL only
    monkeypatch.chdir(tmp_path)
    events = []
    spy = lambda name, f: lambda *a, **kw: (events.append(name), f(*a, **kw))[1]  # noqa: E731
    monkeypatch.setattr(dpo, "load_model", spy("load_model", dpo.load_model))
    monkeypatch.setattr(dpo, "evaluate_held_out", spy("evaluation", dpo.evaluate_held_out))
    monkeypatch.setattr(dpo, "anatomy", lambda models, T: (events.append(sorted(models)),
                                                           anatomy(models, T))[1])
    monkeypatch.setattr(dpo, "load_ref_logps", spy("cache read", dpo.load_ref_logps))
    cfg = dpo_cfg(tiny, "simpo-run", loss="simpo", beta=2.0, ref_logps=dpo.Config.ref_logps)
    dpo.main(cfg)
    assert not os.path.exists(tmp_path / "out")  # no cache built, nor any folder for one
    assert events == ["load_model", ["policy"], "load_model", "evaluation"]
    out = capsys.readouterr().out
    assert "reference: none (--loss simpo): no model, no cache built or read" in out
    assert "simpo loss, beta 2.0 | reference: none |" in out
    ev = json.load(open(os.path.join(cfg.out_dir, "eval.json")))
    assert (ev["loss"], ev["beta"], ev["simpo_gamma"]) == ("simpo", 2.0, 0.5)
    assert ev["kl"] > 0 and all(math.isfinite(m["loss"]) for m in dpo_metrics(cfg.out_dir))
    # the held-out loss and accuracy are SimPO's too, of the saved policy, by hand
    tok = data.load_tokenizer(f"{tiny.sft}/tokenizer.json")
    val, _ = data.tokenize_pairs(tok, data.read_pairs(cfg.val_pairs), cfg.max_len,
                                 cfg.max_prompt_len)
    b = data.collate_pairs(val, tok.pad)
    with torch.no_grad():
        lp_c, lp_r = pair_logps(load_model(f"{cfg.out_dir}/model.safetensors")[0].eval(),
                                b["input_ids"], b["targets"]).double().chunk(2)
    diff = (lp_c / torch.tensor([len(e["chosen"]) for e in val])
            - lp_r / torch.tensor([len(e["rejected"]) for e in val]))
    want = torch.log1p(torch.exp(-(2.0 * diff - 0.5))).mean().item()
    assert ev["val_loss"] == pytest.approx(want, rel=1e-4)
    assert ev["val_accuracy"] == pytest.approx((diff > 0).double().mean().item(), abs=1e-9)
    # a SimPO run's γ is part of its config: another γ does not resume it
    with pytest.raises(SystemExit, match=r"another config \(simpo_gamma 0.5 -> 1.0\)"):
        dpo.main(replace(cfg, simpo_gamma=1.0))
    # the reference-free loss takes no π_ref, and its γ means nothing to DPO's losses
    for bad, msg in (({"ref": "live"}, "--loss simpo has no π_ref"),
                     ({"rpo_alpha": 0.5}, "--rpo_alpha applies to DPO's losses"),
                     ({"loss": "sigmoid", "simpo_gamma": 1.0}, "--simpo_gamma applies to")):
        with pytest.raises(SystemExit, match=msg):
            dpo.main(replace(cfg, out_dir=str(tmp_path / "bad"), **bad))


def test_cached_equals_live(tiny, dpo_cache):  # noqa: F811
    runs = {}
    for ref in ("cache", "live"):
        cfg = dpo_cfg(tiny, f"dpo-{ref}", ref=ref)
        dpo.main(cfg)
        runs[ref] = cfg.out_dir
    a, b = dpo_metrics(runs["cache"]), dpo_metrics(runs["live"])
    assert [x["step"] for x in a] == [y["step"] for y in b] and "val_loss" in a[-1]
    for k in ("loss", "rewards/margins", "grad_norm", "val_loss", "val_accuracy"):
        assert all(abs(x[k] - y[k]) <= DPO_TOL for x, y in zip(a, b) if k in x), k
    with open(os.path.join(runs["cache"], "eval.json")) as f:
        ev = json.load(f)
    assert {"val_accuracy", "true_reward", "kl", "ref_true_reward", "ref_true_reward_std",
            "samples"} <= ev.keys()


def test_packed_run_equals_padded_and_either_reads_the_others_cache(tiny, dpo_cache):  # noqa: F811
    # the layout is not part of what the cache holds: a cache written packed (dpo_cache, the
    # default) and one written padded have one fingerprint, hold the same numbers to fp32 rounding,
    # and each is read by a run of the other layout, which logs the same steps
    padded_cache = str(tiny.root / "dpo-cache-padded")
    precompute.main(replace(dpo_pcfg(tiny), out_dir=padded_cache, pack=False))
    for split in ("train", "val"):
        files = [os.path.join(c, f"{split}.safetensors") for c in (dpo_cache, padded_cache)]
        fps = []
        for f in files:
            with safe_open(f, "pt") as h:
                fps.append(json.loads(h.metadata()["fingerprint"]))
        assert fps[0] == fps[1]
        a, b = (load_file(f) for f in files)
        assert dpo_max_diff(a, b) < 1e-4
    runs = {}
    for pack, cache in ((False, dpo_cache), (True, padded_cache)):
        cfg = dpo_cfg(tiny, f"dpo-pack-{pack}", pack=pack, ref_logps=cache)
        dpo.main(cfg)
        runs[pack] = dpo_metrics(cfg.out_dir)
    a, b = runs[False], runs[True]
    assert [x["step"] for x in a] == [y["step"] for y in b] and "val_loss" in a[-1]
    for k in ("loss", "rewards/margins", "grad_norm", "val_loss", "val_accuracy"):
        assert all(abs(x[k] - y[k]) <= DPO_TOL for x, y in zip(a, b) if k in x), k
    # the FLOPs the real tokens need do not depend on how they are laid out
    assert all(x["flops"] == pytest.approx(y["flops"], rel=1e-12) for x, y in zip(a, b))


def test_cache_rows_follow_their_index_when_rows_are_dropped(tiny, dpo_cache):  # noqa: F811
    own = tiny.root / "dpo-dropped"
    os.makedirs(own)
    # line 1 of each file: responses identical within max_len, unusable, left out, so that every
    # example's index (its row, the cache key) is its position in the examples plus 1
    long = " it felt fine ." * 20
    bad = {"prompt": "it felt good .", "chosen": long + " it felt great .",
           "rejected": long + " it felt dull ."}
    for name, n in (("pairs_train.jsonl", 32), ("pairs_val.jsonl", 16)):
        rows = open(tiny.root / "dpo-data" / name).readlines()[:n]
        (own / name).write_text(json.dumps(bad) + "\n" + "".join(rows))
    tok = data.load_tokenizer(f"{tiny.sft}/tokenizer.json")
    ex, st = data.tokenize_pairs(tok, data.read_pairs(str(own / "pairs_train.jsonl")), 64, 16)
    assert st["unusable"] == 1 and [e["index"] for e in ex] == list(range(1, 33))
    pc = precompute.Config(out_dir=str(own / "cache"), ref_model=f"{tiny.sft}/model.safetensors",
                           train_pairs=str(own / "pairs_train.jsonl"),
                           val_pairs=str(own / "pairs_val.jsonl"))
    precompute.main(pc)
    runs = {}
    for ref in ("cache", "live"):
        cfg = dpo_cfg(tiny, f"dpo-dropped/{ref}", ref=ref, train_pairs=pc.train_pairs,
                      val_pairs=pc.val_pairs, ref_logps=pc.out_dir, steps=2, eval_every=1)
        dpo.main(cfg)
        runs[ref] = dpo_metrics(cfg.out_dir)
    # step 1: π = π_ref, so each pair's cached log π_ref is its own log π: rewards 0, loss ln 2
    first = runs["cache"][0]
    assert abs(first["loss"] - math.log(2)) <= DPO_TOL and abs(first["rewards/margins"]) <= DPO_TOL
    for x, y in zip(runs["cache"], runs["live"]):  # train and val pairs, cached against live
        for k in ("loss", "rewards/margins", "grad_norm", "val_loss", "val_accuracy"):
            assert abs(x[k] - y[k]) <= DPO_TOL, k


def test_resumed_equals_uninterrupted(tiny, dpo_cache):  # noqa: F811
    full, part = dpo_cfg(tiny, "dpo-full", steps=4), dpo_cfg(tiny, "dpo-resumed", steps=4,
                                                             stop_after=2)
    dpo.main(full)
    dpo.main(part)
    assert not os.path.exists(os.path.join(part.out_dir, "model.safetensors"))
    dpo.main(part)  # resumes at step 2
    assert ([m["loss"] for m in dpo_metrics(full.out_dir)]
            == [m["loss"] for m in dpo_metrics(part.out_dir)])
    assert dpo_max_diff(dpo_weights(full.out_dir), dpo_weights(part.out_dir)) == 0.0


def test_non_finite_loss_stops_and_keeps_the_last_checkpoint(tiny, dpo_cache):  # noqa: F811
    # step 1 blows the weights up; step 2's loss is NaN
    cfg = dpo_cfg(tiny, "dpo-nan", lr=1e30, ckpt_every=1)
    with pytest.raises(SystemExit, match="non-finite loss.*step 2.*last good checkpoint is kept"):
        dpo.main(cfg)
    with open(os.path.join(cfg.out_dir, "ckpt", "latest.json")) as f:
        assert json.load(f)["step"] == 1


def test_cached_step_costs_the_analytic_fraction_of_a_live_step(  # noqa: F811
        tiny, dpo_cache, monkeypatch):
    monkeypatch.setattr(dpo, "measure_peak_flops", lambda *a: 1e9)  # its matmuls would be counted
    counted, logged = {}, {}
    for ref in ("cache", "live"):
        # one step, no evaluation
        cfg = dpo_cfg(tiny, f"dpo-flops-{ref}", ref=ref, steps=2, stop_after=1)
        counted[ref] = count_flops(lambda: dpo.main(cfg))[1]
        logged[ref] = dpo_metrics(cfg.out_dir)[0]
    # expected from the model's own sizes and the step's real batches: sorted by length, each
    # micro-batch packed into rows of max_len (the default), the LM head only at its K targets
    mcfg = load_model(cfg.ref_model)[0].config
    tok = data.load_tokenizer(f"{tiny.sft}/tokenizer.json")
    train, _ = data.tokenize_pairs(tok, data.read_pairs(cfg.train_pairs), cfg.max_len,
                                   cfg.max_prompt_len)
    lengths = [data.longest_row(e) for e in train]
    batch = data.global_batch(len(train), cfg.batch_size, 0, cfg.seed, lengths)
    bs = [data.collate_pairs([train[i] for i in batch[j:j + 8]], tok.pad, cfg.max_len)
          for j in (0, 8)]
    shapes = [(*b["input_ids"].shape, int((b["targets"] != -100).sum())) for b in bs]
    real = [torch.bincount(b["seq"][b["seq"] >= 0]) for b in bs]  # each sequence's tokens

    def hardware(bw):  # executed: the rows' shapes, the head at the K targets
        return sum(estimate_flops(mcfg, n, t, bw, outputs=k) for n, t, k in shapes)

    def needed(bw):  # by the real tokens
        return sum(model_flops(mcfg, r, k, bw) for r, (_, _, k) in zip(real, shapes))

    policy, reference = hardware(True), hardware(False)  # forward + backward; forward only
    # exact: same counting rules
    assert counted["cache"] == policy and counted["live"] == policy + reference
    ratio = counted["cache"] / counted["live"]
    # 3/(3+1) for matmuls; attention's 2.5x backward moves it slightly
    assert abs(ratio - 0.75) < 0.02
    # The logged utilisations over the patched peak of 1e9 FLOP/s, times the step's time, give back
    # their numerators: HFU the FLOPs that ran (as counted), MFU those the real tokens need. The
    # same floats multiplied back: only rounding differs (1e-9 relative is far above it).
    for ref, live in (("cache", 0), ("live", 1)):
        m, dt = logged[ref], logged[ref]["time/step"] / 1000
        assert m["mfu_hardware"] * 1e9 * dt == pytest.approx(counted[ref], rel=1e-9)
        assert m["mfu"] * 1e9 * dt == pytest.approx(needed(True) + live * needed(False), rel=1e-9)
        assert m["mfu"] < m["mfu_hardware"]  # padding, full attention, recomputed scores


# -----------------------------------------------------------------------------
# distributed (gloo on the CPU) and the cache's guarantees


def test_precompute_two_ranks_writes_the_same_cache(tiny, dpo_cache):  # noqa: F811
    out = str(tiny.root / "dpo-cache-2ranks")
    c = dpo_pcfg(tiny)
    run_torchrun("precompute.py",
                 ["--out_dir", out, "--ref_model", c.ref_model, "--train_pairs", c.train_pairs,
                  "--val_pairs", c.val_pairs])
    for split in ("train", "val"):
        one, two = (load_file(f"{dpo_cache}/{split}.safetensors"),
                    load_file(f"{out}/{split}.safetensors"))
        for k in ("chosen", "rejected"):  # same micro-batches on any world size: the same numbers
            torch.testing.assert_close(one[k], two[k], rtol=0, atol=DPO_TOL, equal_nan=True)
            assert torch.isfinite(one[k]).all()  # every row filled (the task has no unusable rows)


def test_stale_cache_is_refused(tiny, dpo_cache):  # noqa: F811
    own = tiny.root / "dpo-stale"
    os.makedirs(own)
    for f in ("model.safetensors", "tokenizer.json"):
        shutil.copyfile(f"{tiny.sft}/{f}", own / f)
    rows = open(f"{tiny.task}/pairs_val.jsonl").readlines()[:16]
    (own / "pairs.jsonl").write_text("".join(rows))
    c = dpo_pcfg(tiny, out="dpo-stale/cache", pairs=str(own / "pairs.jsonl"),
                 ref_model=str(own / "model.safetensors"))
    precompute.main(c)
    cfg = dpo_cfg(tiny, "dpo-stale/run", ref_model=c.ref_model, train_pairs=c.train_pairs,
                  val_pairs=c.val_pairs, ref_logps=c.out_dir, steps=1)
    spec = json.loads((own / "tokenizer.json").read_text())  # the same tokenizer, written compact:
    (own / "tokenizer.json").write_text(json.dumps(spec, separators=(",", ":")))  # not stale
    dpo.main(replace(cfg, out_dir=str(tiny.root / "dpo-stale" / "compact")))
    (own / "pairs.jsonl").write_text("".join(rows[:15] + rows[:1]))  # the data file changed
    with pytest.raises(SystemExit, match="stale.*the pairs file.*python precompute.py --out_dir"):
        dpo.main(cfg)
    (own / "pairs.jsonl").write_text("".join(rows))
    model, meta = load_model(c.ref_model)
    with torch.no_grad():
        model.transformer.ln_f.bias += 0.01
    save_model(model, c.ref_model, meta)  # the reference weights changed
    with pytest.raises(SystemExit, match="stale.*the reference weights"):
        dpo.main(cfg)
    # a cache from a version whose fingerprint had another field: said so, not "it changed"
    path = os.path.join(c.out_dir, "train.safetensors")
    with safe_open(path, "pt") as f:
        meta = f.metadata()
    fp = json.loads(meta["fingerprint"])
    fp["tokenizer_sha256"] = fp.pop("tokenizer_content_sha256")
    checkpoint.save_safetensors(load_file(path), path, {**meta, "fingerprint": json.dumps(fp)})
    with pytest.raises(SystemExit, match=re.escape("the tokenizer (not recorded: an older version "
                                                   "wrote this cache)")):
        dpo.main(cfg)


def dpo_flags(cfg):
    return [a for k, v in vars(cfg).items() if isinstance(v, (str, int, float))
            and not isinstance(v, bool) for a in (f"--{k}", str(v))]


def assert_dpo_runs_agree(a, b):
    """Two runs' logged steps, equal up to the order of fp32 sums (DPO_TOL)."""
    a, b = dpo_metrics(a), dpo_metrics(b)
    assert [x["step"] for x in a] == [y["step"] for y in b] and "val_loss" in a[-1]
    # not accuracy: ties at step 1; logps/chosen (~ -30) relative to its size
    for k in ("loss", "rewards/margins", "logps/chosen", "grad_norm", "val_loss"):
        assert all(abs(x[k] - y[k]) <= DPO_TOL * max(1, abs(x[k]))
                   for x, y in zip(a, b) if k in x), k


@pytest.fixture(scope="module")
def dpo_two_ranks(tiny, dpo_cache):  # noqa: F811
    """`torchrun --nproc_per_node=2 dpo.py`, 2 ranks x 2 micro-steps x 4; returns its config."""
    two = dpo_cfg(tiny, "dpo-2ranks", steps=2, micro_batch_size=4)
    p = run_torchrun("dpo.py", dpo_flags(two))  # also the smoke run: evaluation and outputs too
    assert "held-out pairs: accuracy" in p.stdout
    return two


def test_two_ranks_equal_one_process(tiny, dpo_two_ranks):  # noqa: F811
    one = dpo_cfg(tiny, "dpo-1rank", steps=2, micro_batch_size=16)  # 1 rank x 1 micro-step x 16
    dpo.main(one)  # the same global batch
    assert_dpo_runs_agree(one.out_dir, dpo_two_ranks.out_dir)


def free_port():
    try:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]
    except OSError as e:
        pytest.skip(f"no TCP port on localhost for torchrun's rendezvous ({e})")


def test_two_launches_equal_two_ranks_in_one(tiny, dpo_two_ranks):  # noqa: F811
    """The README's multi-machine commands, two launches of one rank each on this machine (on a free
    port), train as one launch of two ranks: the same logged steps, and the same weights up to
    fp32 rounding, not bitwise: each launch gives its rank every core (its LOCAL_WORLD_SIZE is 1),
    the one launch half of them each, and intra-op threads sum in another order (with the thread
    counts made equal, the weights were measured bitwise equal)."""
    readme = open(os.path.join(HERE, "README.md"), encoding="utf-8").read()
    cmds = [line.split() for line in readme.splitlines() if line.startswith("torchrun --nnodes=2")]
    assert len(cmds) == 2 and cmds[0] == cmds[1] + ["&"], cmds  # the first one in the background
    flags, port = cmds[1][1:-1], free_port()
    assert cmds[1][-1] == "dpo.py" and "--rdzv_endpoint=localhost:" in " ".join(flags)
    launch = [re.sub(r"=localhost:\d+$", f"=localhost:{port}", a) for a in flags]
    cfg = replace(dpo_two_ranks, out_dir=str(tiny.root / "dpo-2launches"))
    runs = run_whole([torchrun("dpo.py", dpo_flags(cfg), launch)] * 2, 300, torchrun_env(300))
    assert all(p.returncode == 0 for p in runs), [p.stderr[-3000:] for p in runs]
    assert "batch 16 pairs = 2 ranks x 2 accumulation x 4" in "".join(p.stdout for p in runs)
    assert_dpo_runs_agree(dpo_two_ranks.out_dir, cfg.out_dir)
    a, b = dpo_weights(dpo_two_ranks.out_dir), dpo_weights(cfg.out_dir)
    assert dpo_max_diff(a, b) <= 1e-4  # measured 4.8e-6; a step moves a weight by up to lr (1e-3)


def loop_headers(path):
    """A loop file's section (# ====) and phase (# --) headers up to their colon, as the README's
    diff command prints them."""
    return re.findall(r"# [=-]{2,} [^:\n]*", open(path, encoding="utf-8").read())


def test_loops_share_one_skeleton():
    d, p = loop_headers(dpo.__file__), loop_headers(ppo.__file__)
    o, g = loop_headers(online_dpo.__file__), loop_headers(grpo.__file__)
    # DPO ⊂ online DPO ⊂ GRPO ⊂ PPO: the smaller file's headers are the bigger one's in the same
    # order, some deleted (`x in rest` consumes)
    for small, big in ((d, p), (d, o), (o, p), (o, g), (g, p)):
        rest = iter(big)
        assert len(small) >= 12 and all(h in rest for h in small), (small, big)
    core = ["# -- batch", "# -- reference log-probs", "# -- policy forward", "# -- loss",
            "# -- update"]
    for heads in (d, p, o, g):  # the shared core, in this order, in all four
        assert [h for h in heads if h in core] == core
    # grpo.py deletes PPO's values and per-token rewards, and its docstring names both
    gone = [h for h in p if h not in g]
    assert gone == ["# -- values", "# -- per-token rewards with the KL penalty"]
    for h in gone:
        assert h.split(" ", 2)[2] in " ".join(grpo.__doc__.split()), h
    # online_dpo.py's docstring names, by name, what returns from PPO and what stays deleted
    for h in [h for h in o if h not in d] + [h for h in p if h not in o]:
        assert h.split(" ", 2)[2] in " ".join(online_dpo.__doc__.split()), h
    deleted = [h for h in p if h not in d]
    assert deleted, "PPO has phases DPO deletes"
    for h in deleted:  # dpo.py's docstring lists, by name, what it deletes
        assert h.split(" ", 2)[2] in " ".join(dpo.__doc__.split()), h
    # the README's command prints exactly these deletions, as additions on PPO's side
    readme = open(os.path.join(HERE, "README.md"), encoding="utf-8").read()
    cmd = next(line for line in readme.splitlines() if line.startswith("diff <("))
    out = subprocess.run(["bash", "-c", cmd], cwd=HERE, capture_output=True, text=True).stdout
    assert [line[2:] for line in out.splitlines() if line.startswith(">")] == deleted
    assert all(line.startswith(">") or line[0].isdigit() for line in out.splitlines())
    shown = readme.split(cmd + "\n```\n\n```\n", 1)[1].split("```")[0]  # the output README shows
    assert shown == out


# ==================================================================================================
# PPO's pieces against closed forms (GAE, clipped losses, KL estimators, Bradley–Terry); the
# first ratio is 1; two ranks equal one; resumed equals uninterrupted (reward.py, ppo.py)
# ==================================================================================================

def prefix_mask(lengths, N):
    return torch.arange(N)[None, :] < torch.tensor(lengths)[:, None]


# -----------------------------------------------------------------------------
# advantages


def test_gae_matches_double_loop():
    g = torch.Generator().manual_seed(0)
    B, N, gamma, lam = 4, 7, 0.9, 0.8
    mask = prefix_mask([7, 3, 1, 5], N)
    r, v = torch.randn(B, N, generator=g, dtype=torch.float64), torch.randn(B, N, generator=g,
                                                                            dtype=torch.float64)
    adv, ret = ppo.gae(r, v, mask, gamma, lam)
    for b in range(B):
        n = int(mask[b].sum())
        # the episode ends after token n-1
        V = lambda t: v[b, t].item() if t < n else 0.0  # noqa: E731
        for t in range(N):
            want = sum((gamma * lam) ** k * (r[b, t + k].item() + gamma * V(t + k + 1) - V(t + k))
                       for k in range(n - t)) if t < n else 0.0
            assert adv[b, t].item() == pytest.approx(want, abs=1e-12)
            assert ret[b, t].item() == pytest.approx(want + V(t) if t < n else 0.0, abs=1e-12)


def test_gae_with_gamma_lambda_one_is_reward_to_go():
    g = torch.Generator().manual_seed(1)
    mask = prefix_mask([5, 2, 6], 6)
    r, v = torch.randn(3, 6, generator=g, dtype=torch.float64), torch.randn(3, 6, generator=g,
                                                                            dtype=torch.float64)
    adv, _ = ppo.gae(r, v, mask, 1.0, 1.0)
    to_go = (r * mask).flip(1).cumsum(1).flip(1) * mask
    torch.testing.assert_close(adv + v * mask, to_go)


def test_masked_whiten_and_padding_contributes_nothing():
    g = torch.Generator().manual_seed(2)
    mask = prefix_mask([4, 1, 3], 5)
    x = torch.randn(3, 5, generator=g, dtype=torch.float64)
    w = ppo.masked_whiten(x, mask)
    real = x[mask]
    torch.testing.assert_close(w[mask],
                               (real - real.mean()) / (real.var(unbiased=True) + 1e-8) ** 0.5)
    assert (w[~mask] == 0).all()
    # garbage (even NaN-free huge numbers) in PAD positions changes nothing anywhere
    y = torch.where(mask, x, 1e6)
    torch.testing.assert_close(ppo.masked_whiten(y, mask), w)
    v = torch.randn(3, 5, generator=g, dtype=torch.float64)
    for a, b in zip(ppo.gae(x, v, mask, 1.0, 0.95),
                    ppo.gae(y, torch.where(mask, v, -1e6), mask, 1.0, 0.95)):
        torch.testing.assert_close(a, b)
    old = torch.randn(3, 5, generator=g, dtype=torch.float64)
    for f in (lambda u: ppo.ppo_policy_loss(u, old, x, mask, 0.2),
              lambda u: ppo.ppo_value_loss(u, old, x, mask, 0.2)):
        assert f(v)[0].item() == pytest.approx(f(torch.where(mask, v, 1e6))[0].item(), abs=1e-12)


# -----------------------------------------------------------------------------
# PPO losses


def test_clipped_policy_loss_value_and_gradient():
    eps = 0.2
    # (ratio, advantage): inside the band; above it with A>0 (clipped: no gradient); above it with
    # A<0 (not clipped: the pessimistic term is the unclipped one); below with A<0 (clipped); below
    # with A>0
    cases = [(1.1, 2.0), (1.5, 1.0), (1.5, -1.0), (0.5, -3.0), (0.5, 0.5)]
    ratio = torch.tensor([c[0] for c in cases], dtype=torch.float64)
    adv = torch.tensor([[c[1] for c in cases]], dtype=torch.float64)
    old = torch.full((1, 5), -1.3, dtype=torch.float64)
    logp = (old + ratio.log()[None]).requires_grad_(True)
    mask = torch.ones(1, 5, dtype=torch.bool)
    loss, clipfrac, approx_kl = ppo.ppo_policy_loss(logp, old, adv, mask, eps)
    clipped = [False, True, False, True, False]
    want = sum(-a * (min(max(r, 1 - eps), 1 + eps) if c else r)
               for (r, a), c in zip(cases, clipped)) / 5
    assert loss.item() == pytest.approx(want, abs=1e-12)
    assert clipfrac.item() == pytest.approx(2 / 5)
    assert approx_kl.item() == pytest.approx(sum((r - 1) - math.log(r) for r, _ in cases) / 5,
                                             abs=1e-12)
    loss.backward()
    # d(-A·ρ)/d log π = -A·ρ; zero where the ratio is clipped on the side the advantage pushes
    grad = [0.0 if c else -a * r / 5 for (r, a), c in zip(cases, clipped)]
    torch.testing.assert_close(logp.grad[0], torch.tensor(grad, dtype=torch.float64))


def test_clipped_value_loss_value_and_gradient():
    eps = 0.2
    old = torch.tensor([[0.0, 0.0, 0.0, 0.0]], dtype=torch.float64)
    ret = torch.tensor([[1.0, 1.0, -1.0, 0.05]], dtype=torch.float64)
    # moved 0.1 (in the band); moved 0.5 toward the return (clipped to 0.2: worse, so it counts,
    # gradient 0); moved 0.5 away from the return (the unclipped error is worse: it counts); moved
    # -0.5 past a close return
    v = torch.tensor([[0.1, 0.5, 0.5, -0.5]], dtype=torch.float64, requires_grad=True)
    mask = torch.ones(1, 4, dtype=torch.bool)
    loss, vf_clipfrac = ppo.ppo_value_loss(v, old, ret, mask, eps)
    vc = [0.1, 0.2, 0.2, -0.2]
    terms = [max((a - r) ** 2, (c - r) ** 2) for a, c, r in zip([0.1, 0.5, 0.5, -0.5], vc,
                                                                [1.0, 1.0, -1.0, 0.05])]
    assert loss.item() == pytest.approx(0.5 * sum(terms) / 4, abs=1e-12)
    assert vf_clipfrac.item() == pytest.approx(1 / 4)
    loss.backward()
    grad = [(0.1 - 1.0) / 4, 0.0, (0.5 + 1.0) / 4, (-0.5 - 0.05) / 4]
    torch.testing.assert_close(v.grad[0], torch.tensor(grad, dtype=torch.float64))


# -----------------------------------------------------------------------------
# KL estimators and the per-token reward


def test_kl_estimators_k1_unbiased_k3_nonnegative():
    g = torch.Generator().manual_seed(3)
    p, q = F.log_softmax(torch.randn(10, generator=g, dtype=torch.float64), 0), \
        F.log_softmax(torch.randn(10, generator=g, dtype=torch.float64), 0)
    exact = (p.exp() * (p - q)).sum().item()
    x = torch.multinomial(p.exp(), 400_000, replacement=True, generator=g)
    k1, k3 = ppo.kl_estimators(p[x], q[x])
    se = k1.std().item() / math.sqrt(len(x))
    assert abs(k1.mean().item() - exact) < 5 * se  # unbiased
    assert (k1 < 0).any()  # but negative on some tokens
    assert abs(k3.mean().item() - exact) < 5 * k3.std().item() / math.sqrt(len(x))
    a, b = torch.meshgrid(torch.linspace(-30, 0, 301, dtype=torch.float64),
                          torch.linspace(-30, 0, 301, dtype=torch.float64),
                          indexing="ij")
    assert (ppo.kl_estimators(a, b)[1] >= 0).all()


def test_per_token_reward_layout():
    mask = prefix_mask([3, 5, 1], 6)
    logp, ref = -torch.rand(3, 6, dtype=torch.float64), -torch.rand(3, 6, dtype=torch.float64)
    score = torch.tensor([2.0, -1.0, 0.5], dtype=torch.float64)
    r = ppo.per_token_rewards(logp, ref, score, mask, kl_coef=0.1)
    want = -0.1 * (logp - ref) * mask
    for b, n in enumerate([3, 5, 1]):
        want[b, n - 1] += score[b]  # the score sits on the last response token (the EOS)...
    torch.testing.assert_close(r, want)
    assert (r[~mask] == 0).all()  # ...and nothing is paid past it
    torch.testing.assert_close(ppo.per_token_rewards(logp, logp, score, mask, 0.1).sum(1), score)


def test_adaptive_kl_controller():
    # clipped at +0.2
    assert ppo.adaptive_kl_coef(0.1, 12.0, 6.0, 10000, 500) == pytest.approx(0.1 * (1 + 0.2 * 0.05))
    assert ppo.adaptive_kl_coef(0.1, 5.4, 6.0, 10000, 500) == pytest.approx(0.1 * (1 - 0.1 * 0.05))


# -----------------------------------------------------------------------------
# the reward model


def test_bradley_terry_loss_and_gradient():
    rc = torch.tensor([1.0, -0.5, 2.0], dtype=torch.float64, requires_grad=True)
    rr = torch.tensor([0.0, 0.5, 2.0], dtype=torch.float64, requires_grad=True)
    loss = reward.bt_loss(rc, rr)
    delta = [1.0, -1.0, 0.0]
    assert loss.item() == pytest.approx(sum(math.log(1 + math.exp(-x)) for x in delta) / 3,
                                        abs=1e-12)
    loss.backward()
    want = torch.tensor([-(1 - 1 / (1 + math.exp(-x))) / 3 for x in delta], dtype=torch.float64)
    torch.testing.assert_close(rc.grad, want)
    torch.testing.assert_close(rr.grad, -want)


def test_reward_read_at_last_token_independent_of_padding():
    torch.manual_seed(0)
    m = GPT(GPTConfig(block_size=32, vocab_size=50, n_layer=2, n_head=2, n_embd=16,
                      head="scalar")).eval()
    torch.nn.init.normal_(m.score.weight)  # the zero init would make every score 0
    pad, seqs = 49, [[1, 5, 6, 7], [1, 8, 9, 10, 11, 12, 13], [1, 3]]
    alone = [m(torch.tensor([s]))[0, -1].item() for s in seqs]
    # right padding, no mask (the training batches), with the real-token mask from the
    # collate targets
    ids, targets = data.collate([(s[:1], s[1:]) for s in seqs] + [([1], [2] * 20)], pad)
    right = score_at_last(m(ids), reward.pair_mask(targets))[:3]
    # left padding with a mask (generate's layout)
    L = 12
    lids = torch.tensor([[pad] * (L - len(s)) + s for s in seqs])
    lmask = torch.tensor([[False] * (L - len(s)) + [True] * len(s) for s in seqs])
    left = score_at_last(m(lids, mask=lmask), lmask)
    torch.testing.assert_close(right, torch.tensor(alone), atol=1e-5, rtol=0)
    torch.testing.assert_close(left, torch.tensor(alone), atol=1e-5, rtol=0)


def test_load_trunk_keeps_the_transformer(tmp_path):
    from model import save_model
    torch.manual_seed(0)
    lm = GPT(GPTConfig(block_size=16, vocab_size=20, n_layer=1, n_head=2, n_embd=8, dropout=0.1))
    save_model(lm, str(tmp_path / "m.safetensors"), {})
    rm, _ = load_model(str(tmp_path / "m.safetensors"), "cpu", head="scalar")
    assert rm.config.dropout == 0.0 and rm.config.head == "scalar"
    assert torch.equal(rm.transformer.h[0].mlp.c_fc.weight, lm.transformer.h[0].mlp.c_fc.weight)
    assert (rm.score.weight == 0).all()
    pol, _ = load_model(str(tmp_path / "m.safetensors"), "cpu", head="lm")
    assert pol.lm_head.weight is pol.transformer.wte.weight


# -----------------------------------------------------------------------------
# the weight broadcast, on two gloo ranks


def _broadcast_worker(rank, init_file, result_dir):
    torch.distributed.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                                         world_size=2)
    cfg = GPTConfig(block_size=24, vocab_size=40, n_layer=2, n_head=2, n_embd=16)
    torch.manual_seed(rank)  # the ranks' trainers differ: only rank 0's weights may arrive
    trainer = GPT(cfg)
    torch.manual_seed(100 + rank)
    rollout = GPT(cfg).eval()
    d = Dist(rank, rank, 2, torch.device("cpu"), rank == 0, False)
    n_bytes, seconds = ppo.broadcast_weights(trainer, rollout, d)
    torch.manual_seed(0)
    want = GPT(cfg)  # rank 0's trainer, rebuilt
    same = all(torch.equal(a, b) for a, b in zip(rollout.state_dict().values(),
                                                 want.state_dict().values()))
    tied = rollout.lm_head.weight is rollout.transformer.wte.weight
    outs = [generate(m, [[1, 2, 3], [1]], 12, eos_id=0, pad_id=39,
                     generator=torch.Generator().manual_seed(7))
            for m in (rollout, want)]
    sample_same = all(torch.equal(outs[0][k], outs[1][k]) for k in outs[0])
    n_params = sum(p.numel() for p in want.parameters())
    with open(os.path.join(result_dir, f"{rank}.json"), "w") as f:
        json.dump(dict(same=same, tied=tied, sample_same=sample_same, bytes=n_bytes,
                       want_bytes=4 * n_params, seconds=seconds), f)
    torch.distributed.barrier()  # as plumbing.teardown: no rank destroys the group under its peer
    torch.distributed.destroy_process_group()


def test_broadcast_weights_two_gloo_ranks(tmp_path):
    mp.spawn(_broadcast_worker, args=(str(tmp_path / "init"), str(tmp_path)), nprocs=2, join=True)
    for rank in range(2):
        with open(tmp_path / f"{rank}.json") as f:
            r = json.load(f)
        assert r["same"] and r["tied"] and r["sample_same"], r
        assert r["bytes"] == r["want_bytes"] and r["seconds"] >= 0


# -----------------------------------------------------------------------------
# smoke runs: reward.py and ppo.py on two gloo ranks; a resumed ppo run equals an uninterrupted one


def tiny_ppo_config(tiny, rm, out, test_prompts, **kw):
    base = dict(out_dir=str(out), sft=f"{tiny.sft}/model.safetensors", reward_model=rm,
                prompts=f"{tiny.task}/prompts_train.jsonl", test_prompts=test_prompts, iterations=3,
                rollout_batch=8, mini_batch=4, micro_batch_size=2, ppo_epochs=2, eval_k=1)
    return ppo.Config(**{**base, **kw})


def reward_args(tiny, out):
    return dict(out_dir=str(out), sft=f"{tiny.sft}/model.safetensors",
                train_pairs=f"{tiny.task}/pairs_train.jsonl",
                val_pairs=f"{tiny.task}/pairs_val.jsonl",
                prompts=f"{tiny.task}/prompts_train.jsonl",
                steps=4, batch_size=8, micro_batch_size=2, eval_every=4, offset_samples=16)


@pytest.fixture(scope="module")
def tiny_rm(tiny):
    """reward.py on two gloo ranks, a few steps on the tiny stack; returns its folder."""
    out = tiny.root / "ppo-test" / "reward"
    run_torchrun("reward.py", as_flags(reward_args(tiny, out)))
    return out


@pytest.fixture(scope="module")
def ppo_test_prompts(tiny):
    path = tiny.root / "ppo-test" / "test_prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt": p}) + "\n"
                            for p in data.read_prompts(f"{tiny.task}/prompts_test.jsonl")[:8]))
    return str(path)


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


def test_reward_two_ranks_equal_one_process(tiny, tiny_rm, tmp_path):
    reward.main(reward.Config(**reward_args(tiny, tmp_path)))  # 1 rank x 4 micro-steps of 2 pairs
    a, b = read_metrics(tmp_path), read_metrics(tiny_rm)  # tiny_rm: 2 ranks x 2 micro-steps of 2
    assert [x["step"] for x in a] == [y["step"] for y in b] == [1, 4]
    for k in ("loss", "accuracy", "margin", "grad_norm", "val_loss", "val_accuracy"):
        assert all(abs(x[k] - y[k]) <= TWO_RANK_TOL * max(1, abs(x[k])) for x, y in zip(a, b)
                   if k in x), k
    # the offset: r_φ on π_ref's completions, sampled alike on any world size
    ea, eb = (json.loads((p / "eval.json").read_text()) for p in (tmp_path, tiny_rm))
    for k in ("val_accuracy", "val_loss", "offset", "ref_score_std", "ref_true_reward_corr"):
        assert abs(ea[k] - eb[k]) <= TWO_RANK_TOL, k


def test_reward_packed_equals_padded(tiny, tmp_path):  # noqa: F811
    # reward.py packed (the default) and --no-pack: the same steps, held-out scores and model
    # FLOPs. Not the offset: the score bias cancels in r_c - r_r, so its gradient is rounding noise,
    # which AdamW turns into steps of ~lr (see TWO_RANK_TOL), and it differs by ~1e-4 either way.
    for pack in (True, False):
        reward.main(reward.Config(**{**reward_args(tiny, tmp_path / str(pack)), "pack": pack}))
    a, b = read_metrics(tmp_path / "True"), read_metrics(tmp_path / "False")
    assert [x["step"] for x in a] == [y["step"] for y in b] == [1, 4]
    for k in ("loss", "accuracy", "margin", "grad_norm", "val_loss", "val_accuracy", "flops"):
        assert all(abs(x[k] - y[k]) <= DPO_TOL * max(1, abs(x[k])) for x, y in zip(a, b)
                   if k in x), k


def test_reward_offset_makes_pi_refs_completions_score_zero_on_average(tiny, tiny_rm):
    # the folded offset, read back: r_φ on the same π_ref completions (the same samples on any
    # world size) now averages 0, and before the fold it averaged the saved offset
    args = reward_args(tiny, tiny_rm)
    r_phi = load_model(str(tiny_rm / "model.safetensors"), "cpu", head="scalar")[0].eval()
    ref = load_model(args["sft"], "cpu")[0].eval()
    tok = data.load_tokenizer(f"{tiny.sft}/tokenizer.json")
    prompts = data.read_prompts(args["prompts"])[:args["offset_samples"]]
    s = reward.ref_scores(r_phi, ref, tok, prompts, init_distributed(), reward.Config.seed)
    offset = json.loads((tiny_rm / "eval.json").read_text())["offset"]
    assert abs(offset) > 1e-3 and abs(s["r"] / s["n"]) <= 1e-5 * max(1, abs(offset))


def test_ppo_two_ranks_equal_one_process(tiny, tiny_rm, ppo_test_prompts):
    root, rm = tiny.root / "ppo-test", str(tiny_rm / "model.safetensors")
    # One iteration of 2 epochs over one minibatch (whose rows are then the same on any world
    # size): 1 process x 4 micro-steps of 2 rollouts, 2 ranks x 2. lr 3e-3: the second epoch
    # clips some ratios, so clipfrac and approx_kl are not 0 and their normalisation shows (at
    # 1e-3 no ratio left [0.8, 1.2]: approx_kl 5.4e-4, clipfrac 0).
    one = tiny_ppo_config(tiny, rm, root / "ppo1", ppo_test_prompts, iterations=1, mini_batch=8,
                          lr=3e-3)
    ppo.main(one)
    two = replace(one, out_dir=str(root / "ppo2"))
    run_torchrun("ppo.py", [f"--{k}={v}" for k, v in vars(two).items() if not isinstance(v, bool)])
    (a,), (b,) = read_metrics(one.out_dir), read_metrics(two.out_dir)
    # the same rollouts: each one's tokens come from its own row of uniforms, on any rank
    for k in ("response_len", "eos_rate", "true_reward"):
        assert a[k] == b[k], k
    assert 0 < a["eos_rate"] < 1 and a["clipfrac"] > 0 and a["approx_kl"] > 1e-4
    for k in ("score", "entropy", "kl", "loss/policy", "loss/value", "approx_kl", "clipfrac",
              "explained_variance", "grad_norm"):
        assert abs(a[k] - b[k]) <= TWO_RANK_TOL * max(1, abs(a[k])), k
    ea, eb = (json.loads(open(os.path.join(c.out_dir, "eval.json")).read()) for c in (one, two))
    assert set(eb["time_shares"]) == set(ppo.PHASES)
    # π_ref's side of the evaluation does not depend on the update: the same completions, exactly
    for k in ("ref_true_reward", "ref_eos_rate", "ref_response_len", "ref_true_reward_finished"):
        assert ea[k] == eb[k], k
    # the policy's KL after the update: a sum of ~45 tokens' log-ratios under weights that went
    # through two Adam steps (lr 1e-3) on each side; measured 5.6e-6 relative
    assert abs(ea["kl"] - eb["kl"]) <= 1e-4 * max(1, abs(ea["kl"]))


def test_ppo_resumed_equals_uninterrupted(tiny, tiny_rm, ppo_test_prompts):
    root, rm = tiny.root / "ppo-test", str(tiny_rm / "model.safetensors")
    # stopped after 2 iterations then resumed; also --reward true and adaptive KL
    for name, extra in [("full", {}), ("split", {"stop_after": 2})]:
        ppo.main(tiny_ppo_config(tiny, rm, root / name, ppo_test_prompts, reward="true",
                                 adaptive_kl=True, **extra))
    ppo.main(tiny_ppo_config(tiny, rm, root / "split", ppo_test_prompts, reward="true",
                             adaptive_kl=True))
    a, b = (load_file(str(root / n / "model.safetensors")) for n in ("full", "split"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    rows = [read_metrics(root / n) for n in ("full", "split")]
    assert [r["step"] for r in rows[0]] == [1, 2, 3]
    strip = lambda r: {k: v for k, v in r.items()  # noqa: E731
                       if not k.startswith(("time/", "share/", "tokens_per", "mfu"))}
    assert [strip(r) for r in rows[0]] == [strip(r) for r in rows[1]]


def test_ppo_loop_wiring(tiny, tiny_rm, tmp_path, monkeypatch):
    """Two real iterations in one process, each phase's output caught on its way into the next
    (spies that call the real functions) and checked against the obvious computation from the
    rollouts: the per-token rewards GAE sees (KL term, score, missing-EOS rule, temperature), GAE's
    γ and λ, the ratio on the first minibatch, the whitened advantages, the value clip."""
    tok = data.load_tokenizer(f"{tiny.sft}/tokenizer.json")
    long = " ".join(["the movie is great ."] * 8)  # over max_prompt_len: cut, BOS kept
    texts = data.read_prompts(f"{tiny.task}/prompts_train.jsonl")[:7] + [long]
    (tmp_path / "prompts.jsonl").write_text("".join(json.dumps({"prompt": t}) + "\n"
                                                    for t in texts))
    (tmp_path / "eval.jsonl").write_text("".join(json.dumps({"prompt": t}) + "\n"
                                                 for t in texts[:4]))
    rm = str(tiny_rm / "model.safetensors")
    cfg = tiny_ppo_config(tiny, rm, tmp_path / "ppo", str(tmp_path / "eval.jsonl"), iterations=2,
                          prompts=str(tmp_path / "prompts.jsonl"), lr=1e-3, temperature=0.7,
                          gamma=0.9, lam=0.8, kl_coef=0.1, missing_eos_score=-3.0, eval_k=2)
    seen = {"gen": [], "gae": [], "pg": [], "vf": []}

    def spy(name, f, keep):
        def g(*a, **kw):
            out = f(*a, **kw)
            seen[name].append(keep(a, kw, out))
            return out
        monkeypatch.setattr(ppo, f.__name__, g)
    spy("gen", ppo.generate, lambda a, kw, out: (copy.deepcopy(a[0]), a[1], kw, out))
    spy("gae", ppo.gae, lambda a, kw, out: a)
    spy("pg", ppo.ppo_policy_loss, lambda a, kw, out: (a[0].detach(), *a[1:4], *out[1:]))
    spy("vf", ppo.ppo_value_loss, lambda a, kw, out: (a[2][a[3]], a[4]))  # returns, clip
    ppo.main(cfg)
    ref = load_model(cfg.sft, "cpu", head="lm")[0].eval()
    r_phi = load_model(rm, "cpu", head="scalar")[0].eval()
    want_prompts = sorted(data.truncate_prompt(data.encode_prompt(tok, t), cfg.max_prompt_len)
                          for t in texts)
    calls = len(seen["pg"]) // cfg.iterations  # ppo_epochs x minibatches x micro-steps
    assert len(seen["gen"]) == len(seen["gae"]) == cfg.iterations and calls == 8
    for it, metrics in enumerate(read_metrics(cfg.out_dir)):
        engine, prompts, kw, out = seen["gen"][it]
        rewards, values, rmask, gamma, lam = seen["gae"][it]
        assert sorted(prompts) == want_prompts and kw["temperature"] == cfg.temperature
        assert (gamma, lam) == (cfg.gamma, cfg.lam)
        # the rewards, the obvious way: log-probs at temperature T from the rollout engine (the
        # policy's copy) and π_ref, r_φ at the last real token, the score on the last response
        # token, and missing_eos_score for a response that never emitted EOS
        P = max(map(len, prompts))
        tokens, mask, resp = out["tokens"], out["mask"], out["tokens"][:, P:]
        assert torch.equal(out["response_mask"][:, P:], rmask)
        targets = resp.masked_fill(~rmask, -100)
        with torch.no_grad():
            lp = token_logprobs(engine(tokens, mask=mask)[:, P - 1:-1], targets, cfg.temperature)
            lq = token_logprobs(ref(tokens, mask=mask)[:, P - 1:-1], targets, cfg.temperature)
            raw = score_at_last(r_phi(tokens, mask=mask), mask)
        ended = ((resp == tok.eos) & rmask).any(1)
        assert 0 < ended.sum() < len(ended)  # both sides of the missing-EOS rule
        want = torch.where(rmask, -cfg.kl_coef * (lp - lq), 0.0)
        last = rmask.long().cumsum(1).argmax(1)  # the first index of the maximum: the last True
        want[torch.arange(len(want)), last] += torch.where(ended, raw, cfg.missing_eos_score)
        # the same fp32 forwards on the same batch as the loop's: measured equal to 0
        torch.testing.assert_close(rewards, want, atol=1e-6, rtol=0)
        if it > 0:  # the policy moved: the KL term is there to see
            assert (lp - lq)[rmask].abs().max() > 1e-2
        # first minibatch: π = π_old, so ratio 1, nothing clipped. Measured exactly 0 here; the
        # same weights on 2 rows against 8 may round differently elsewhere (fp32: ~1e-7)
        mine = seen["pg"][it * calls:(it + 1) * calls]
        for logp, old, adv, m, clipfrac, approx_kl in mine[:2]:  # 2 micro-steps
            assert torch.where(m, logp - old, 0.0).abs().max() <= 1e-6
            assert clipfrac == 0 and approx_kl <= 1e-12
        # the first epoch (2 minibatches) covers every rollout once: advantages whitened over all
        adv = torch.cat([a[m] for _, _, a, m, *_ in mine[:4]]).double()
        assert abs(adv.mean()) <= 1e-6 and abs(adv.std() - 1) <= 1e-5
        assert metrics["logprob_gap"] <= 1e-6  # the trainer's log-probs at T: the engine's
        # the critic's targets: GAE's returns, raw advantages + values (not the whitened ones)
        got = torch.cat([ret for ret, _ in seen["vf"][it * calls:it * calls + 4]]).sort().values
        want = ppo.gae(rewards, values, rmask, gamma, lam)[1][rmask].sort().values
        torch.testing.assert_close(got, want, atol=1e-6, rtol=0)
    assert seen["vf"] and all(eps == cfg.cliprange_value for _, eps in seen["vf"])
    # the final evaluation scores by the loop's own missing_eos_score
    ev = json.loads((tmp_path / "ppo" / "eval.json").read_text())
    assert 0 < ev["eos_rate"] < 1
    finished = ev["eos_rate"] * ev["true_reward_finished"]
    assert ev["true_reward"] == pytest.approx(finished + (1 - ev["eos_rate"]) * -3.0, abs=1e-12)


def test_ppo_stops_on_non_finite(tiny, tiny_rm, tmp_path):
    prompts = tmp_path / "eval.jsonl"
    prompts.write_text(json.dumps({"prompt": "the movie is"}) + "\n")
    cfg = tiny_ppo_config(tiny, str(tiny_rm / "model.safetensors"), tmp_path / "ppo", str(prompts),
                          lr=1e30)
    with pytest.raises(SystemExit, match=r"non-finite grad_norm \(nan\) at iteration 1 .* "
                                         r"the last good checkpoint is kept: none"):
        ppo.main(cfg)
    assert not os.path.exists(tmp_path / "ppo" / "model.safetensors")


def test_ppo_first_ratio_is_one_and_any_micro_batching_gives_one_update(tiny, tiny_rm, tmp_path):
    # One epoch of one minibatch: the update's forward sees the weights that made the old
    # log-probs and values, so the PPO ratio is 1 and nothing is clipped, whatever the micro-batches
    # (sorted by response length, each cut to its own longest prompt and response, 4 of 2 rows
    # here). The old log-probs come from one forward over the whole rollout batch: only fp32
    # summation order differs (~1e-6 per token, so approx_kl ~ 1e-12); a column off by one in the
    # cut moves log-probs by O(1) and approx_kl far above 1e-8.
    # And the update does not depend on the micro-batching: one micro-batch of 8 (cut to the
    # minibatch's longest row) against 8 of one row (each cut to itself) give the same losses and
    # gradient norm, up to fp32 summation order (DPO_TOL, as DPO's equivalent runs); a token cut
    # off a row, or a padded one counted, moves them by > 1e-3.
    prompts = tmp_path / "eval.jsonl"
    prompts.write_text(json.dumps({"prompt": "the movie is"}) + "\n")
    runs, rm = [], str(tiny_rm / "model.safetensors")
    for micro in (2, 1, 8):
        cfg = tiny_ppo_config(tiny, rm, tmp_path / f"ppo{micro}", str(prompts))
        ppo.main(replace(cfg, iterations=1, mini_batch=8, ppo_epochs=1, micro_batch_size=micro))
        runs.append(read_metrics(cfg.out_dir)[0])
    m = runs[0]
    assert m["clipfrac"] == 0 and m["vf_clipfrac"] == 0 and m["approx_kl"] < 1e-8
    assert 0 < m["mfu"] < m["mfu_hardware"]
    for k in ("loss/policy", "loss/value", "grad_norm"):
        assert abs(runs[1][k] - runs[2][k]) <= DPO_TOL * max(1, abs(runs[1][k])), k


# ==================================================================================================
# GRPO: the group advantage, the k3 KL term and the loss against closed forms and an analytic
# gradient; the first ratio is 1; two ranks equal one; resumed equals uninterrupted (grpo.py)
# ==================================================================================================

def test_grpo_group_advantages_standardise_each_group_of_consecutive_rows():
    scores = torch.tensor([1.0, 2.0, 3.0, 6.0, 5.0, 5.0, 5.0, 5.0], dtype=torch.float64)
    # group 1: mean 3, unbiased std sqrt((4 + 1 + 0 + 9) / 3); group 2: all equal, so 0, not NaN
    std = math.sqrt(14 / 3)
    want = [-2 / (std + 1e-4), -1 / (std + 1e-4), 0.0, 3 / (std + 1e-4), 0.0, 0.0, 0.0, 0.0]
    got = grpo.group_advantages(scores, 4)
    assert got.tolist() == pytest.approx(want, abs=1e-12) and not got.isnan().any()
    # Dr. GRPO's: the mean subtracted, no std division
    assert grpo.group_advantages(scores, 4, scale=False).tolist() == [-2, -1, 0, 3, 0, 0, 0, 0]
    # random groups of 8: zero mean and unit (unbiased) std per group, up to ε / std
    g = torch.Generator().manual_seed(0)
    x = 3 + 5 * torch.randn(6 * 8, generator=g, dtype=torch.float64)
    a = grpo.group_advantages(x, 8).view(6, 8)
    assert a.mean(1).abs().max() < 1e-12
    assert (a.std(1) - 1).abs().max() < 1e-4  # std / (std + 1e-4) with std ~ 5
    with pytest.raises(SystemExit, match="--group_size must be at least 2"):
        grpo.group_advantages(scores, 1)


def test_grpo_loss_hand_worked():
    # two completions of lengths 1 and 2 (the second row's column 3 is padding). Row 0: ρ = 1.5
    # with A = +1, so the clip holds it at 1.2; π_ref/π = 2 on its token, k3 = 2 - ln 2 - 1. Row 1:
    # ρ = 1 on both tokens, A = -2; π_ref/π = 2 on its first token, 1 on its second (k3 = 0).
    mask = prefix_mask([1, 2], 3)
    logp = torch.tensor([[-1.0, 0.0, 0.0], [-2.0, -0.5, 0.0]], dtype=torch.float64)
    old = logp.clone()
    old[0, 0] = -1.0 - math.log(1.5)
    ref = logp.clone()
    ref[0, 0] += math.log(2)
    ref[1, 0] += math.log(2)
    adv = torch.tensor([1.0, -2.0], dtype=torch.float64)
    k3 = 1 - math.log(2)
    beta = 0.5
    row0 = -1.2 + beta * k3  # one token
    row1 = (2.0 + 2.0 + beta * (k3 + 0.0)) / 2  # the mean over its two tokens (Eq. 3's 1/|o_i|)
    loss, clipfrac, approx_kl, kl = grpo.grpo_loss(logp, old, ref, adv, mask, 0.2, beta, 2)
    assert loss.item() == pytest.approx((row0 + row1) / 2, abs=1e-12)
    assert clipfrac.item() == pytest.approx(1 / 3)  # one of three tokens held by the clip
    assert approx_kl.item() == pytest.approx((0.5 - math.log(1.5)) / 3, abs=1e-12)
    assert kl.item() == pytest.approx(2 * k3 / 3, abs=1e-12)
    # n is the global minibatch's count of completions, not this call's
    assert grpo.grpo_loss(logp, old, ref, adv, mask, 0.2, beta, 8)[0].item() == pytest.approx(
        (row0 + row1) / 8, abs=1e-12)


def test_grpo_loss_gradient_against_analytic():
    # d loss / d log π per token: (1/n)(1/|o_i|)·[-A·ρ where the unclipped branch is the max, else
    # 0, plus β·(1 - π_ref/π)] (k3 = r - log r - 1 with r = π_ref/π: dr/dlog π = -r)
    g = torch.Generator().manual_seed(1)
    B, N, n, beta, eps = 5, 7, 9, 0.3, 0.2
    mask = prefix_mask([7, 3, 1, 5, 6], N)
    logp = -torch.rand(B, N, generator=g, dtype=torch.float64)
    old = logp + 0.4 * torch.randn(B, N, generator=g, dtype=torch.float64)  # some ratios clipped
    ref = logp + 0.5 * torch.randn(B, N, generator=g, dtype=torch.float64)
    adv = torch.tensor([1.5, -0.7, 2.0, -1.1, 0.3], dtype=torch.float64)
    x = logp.clone().requires_grad_(True)
    grpo.grpo_loss(x, old, ref, adv, mask, eps, beta, n)[0].backward()
    ratio, r, A = (logp - old).exp(), (ref - logp).exp(), adv[:, None]
    unclipped = -A * ratio >= -A * ratio.clamp(1 - eps, 1 + eps)
    assert not unclipped[mask].all()  # the clipped branch is exercised
    per_token = torch.where(unclipped, -A * ratio, 0.0) + beta * (1 - r)
    want = torch.where(mask, per_token / mask.sum(1, keepdim=True) / n, 0.0)
    torch.testing.assert_close(x.grad, want, rtol=1e-10, atol=1e-12)


def test_grpo_kl_term_is_k3_of_kl_pi_to_ref_nonnegative_and_unbiased():
    # completions of one token sampled from π over 3 categories; with A = 0 and ρ = 1 the loss is
    # β times the mean k3, which must estimate KL(π‖π_ref) = 0.7 ln 14 + 0.2 ln(4/3) + 0.1 ln(1/8),
    # not KL(π_ref‖π) = 0.05 ln(1/14) + 0.15 ln(3/4) + 0.8 ln 8
    g = torch.Generator().manual_seed(4)
    p = torch.tensor([0.7, 0.2, 0.1], dtype=torch.float64).log()
    q = torch.tensor([0.05, 0.15, 0.8], dtype=torch.float64).log()
    forward = 0.7 * math.log(14) + 0.2 * math.log(4 / 3) + 0.1 * math.log(1 / 8)
    backward = 0.05 * math.log(1 / 14) + 0.15 * math.log(3 / 4) + 0.8 * math.log(8)
    x = torch.multinomial(p.exp(), 200_000, replacement=True, generator=g)
    M = len(x)
    mask = torch.ones(M, 1, dtype=torch.bool)
    lp, lq, zero = p[x][:, None], q[x][:, None], torch.zeros(M, dtype=torch.float64)
    loss, _, _, kl = grpo.grpo_loss(lp, lp, lq, zero, mask, 0.2, 1.0, M)
    k3 = (lq - lp).exp() - (lq - lp) - 1
    se = k3.std().item() / math.sqrt(M)
    assert abs(loss.item() - forward) < 5 * se and abs(kl.item() - forward) < 5 * se
    assert abs(forward - backward) > 20 * se
    # never negative, on a grid of log-prob pairs
    a, b = torch.meshgrid(torch.linspace(-30, 0, 121, dtype=torch.float64),
                          torch.linspace(-30, 0, 121, dtype=torch.float64), indexing="ij")
    m = torch.ones(a.numel(), 1, dtype=torch.bool)
    each = [grpo.grpo_loss(u.reshape(1, 1), u.reshape(1, 1), v.reshape(1, 1),
                           torch.zeros(1, dtype=torch.float64), m[:1], 0.2, 1.0, 1)[0]
            for u, v in zip(a.flatten()[::37], b.flatten()[::37])]
    assert all(v.item() >= 0 for v in each)


def test_grpo_oracle_scores_are_bradley_terry_wins_within_the_group():
    # one group of 3, hidden rewards 2, 0, 0. Pair (0,1): u 0.0 < σ(2), 0 wins; pair (0,2): u 0.99
    # > σ(2) = 0.88, 2 wins; pair (1,2): u 0.7 > σ(0) = 0.5, 2 wins. Wins 1, 0, 2 of 2 each.
    u = torch.zeros(1, 3, 3)
    u[0, 0, 1], u[0, 0, 2], u[0, 1, 2] = 0.0, 0.99, 0.7
    got = grpo.oracle_scores(torch.tensor([2.0, 0.0, 0.0]), u, 3)
    assert got.tolist() == [0.5, 0.0, 1.0]
    # each group reads its own draw, u 0.9 for both: σ(0 - 5) < 0.9, so the first group's second
    # wins; σ(5 - 0) = 0.993 > 0.9, so the second group's first wins
    u2 = torch.full((2, 2, 2), 0.9)
    assert grpo.oracle_scores(torch.tensor([0.0, 5.0, 5.0, 0.0]), u2, 2).tolist() == [
        0.0, 1.0, 1.0, 0.0]


def test_grpo_reward_service_scores_an_unfinished_completion_missing_eos_score(tiny):
    # three completions of one prompt, the second cut by the block (no EOS): the hidden reward
    # scores the finished ones, missing_eos_score (-1) replaces the unfinished one's
    tok = data.load_tokenizer(f"{tiny.sft}/tokenizer.json")
    texts = ["the movie was great ."]
    ys = [" the plot is good .", " i loved the music .", " the cast is bad ."]
    ids = [tok.encode(y) + [tok.eos] for y in ys]
    ids[1] = ids[1][:-1]  # no EOS
    N = max(map(len, ids))
    resp = torch.tensor([y + [tok.pad] * (N - len(y)) for y in ids])
    rmask = prefix_mask([len(y) for y in ids], N)
    ro = dict(resp=resp, rmask=rmask, tokens=resp, mask=rmask)
    cfg = grpo.Config(reward="true", rollout_batch=3, group_size=3)
    mine, has_eos, scores = grpo.score(None, ro, texts, [0, 0, 0], 0, tok, cfg, init_distributed())
    assert has_eos.tolist() == [True, False, True]
    want = [tasks.true_reward(texts[0], ys[0]), -1.0, tasks.true_reward(texts[0], ys[2])]
    assert mine.tolist() == pytest.approx(want) and scores.tolist() == pytest.approx(want)
    assert want[0] > 0 > want[2]  # the finished ones score their words, not the penalty


def tiny_grpo_config(tiny, rm, out, test_prompts, **kw):
    base = dict(out_dir=str(out), sft=f"{tiny.sft}/model.safetensors", reward_model=rm,
                prompts=f"{tiny.task}/prompts_train.jsonl", test_prompts=test_prompts, iterations=3,
                rollout_batch=8, group_size=4, mini_batch=4, micro_batch_size=2, ppo_epochs=2,
                eval_k=1)
    return grpo.Config(**{**base, **kw})


def test_grpo_first_ratio_is_one_and_any_micro_batching_gives_one_update(tiny, tiny_rm, tmp_path,
                                                                         monkeypatch):
    # ppo.py's test for GRPO: one epoch of one minibatch, so the update's forward sees the weights
    # that made the old log-probs: ratio 1, nothing clipped; and the micro-batching (4 of 2 rows,
    # 8 of 1, 1 of 8) changes neither the loss nor the gradient norm
    # And a group is group_size rows of one prompt, the groups of different prompts.
    prompts = tmp_path / "eval.jsonl"
    prompts.write_text(json.dumps({"prompt": "the movie is"}) + "\n")
    runs, rm, batches = [], str(tiny_rm / "model.safetensors"), []
    real_sample = grpo.sample
    monkeypatch.setattr(grpo, "sample", lambda *a: batches.append(list(a[2])) or real_sample(*a))
    for micro, scale in ((2, True), (1, True), (8, True), (2, False)):
        cfg = tiny_grpo_config(tiny, rm, tmp_path / f"grpo{micro}{scale}", str(prompts),
                               scale_rewards=scale)
        grpo.main(replace(cfg, iterations=1, mini_batch=8, ppo_epochs=1, micro_batch_size=micro))
        runs.append(read_metrics(cfg.out_dir)[0])
    b = batches[0]
    assert b[:4] == [b[0]] * 4 and b[4:] == [b[4]] * 4 and b[0] != b[4]
    m = runs[0]
    assert m["clipfrac"] == 0 and m["approx_kl"] < 1e-8 and m["adv_abs"] > 0.1
    # the same rollouts, advantages not divided by the groups' std: another size, not NaN
    assert runs[3]["true_reward"] == m["true_reward"] and math.isfinite(runs[3]["adv_abs"])
    assert abs(runs[3]["adv_abs"] - m["adv_abs"]) > 1e-3
    assert m["loss/kl"] < 1e-8  # π = π_ref before the first step: k3 is 0
    for k in ("loss/policy", "grad_norm"):
        assert abs(runs[1][k] - runs[2][k]) <= DPO_TOL * max(1, abs(runs[1][k])), k
    assert json.loads((tmp_path / "grpo2True" / "eval.json").read_text())["group_size"] == 4


def test_grpo_two_ranks_equal_one_process(tiny, tiny_rm, ppo_test_prompts, tmp_path):
    # 12 completions in groups of 4: rank 0 holds group 1 and half of group 2, so the group
    # baselines must read the other rank's scores. The oracle's draws compare within groups too.
    # One minibatch, 2 epochs, lr 3e-3: the second epoch clips, so the clip's normalisation shows.
    rm = str(tiny_rm / "model.safetensors")
    one = tiny_grpo_config(tiny, rm, tmp_path / "grpo1", ppo_test_prompts, iterations=1,
                           rollout_batch=12, mini_batch=12, reward="oracle", lr=3e-3)
    grpo.main(one)
    two = replace(one, out_dir=str(tmp_path / "grpo2"))
    run_torchrun("grpo.py", [f"--{k}={v}" for k, v in vars(two).items() if not isinstance(v, bool)])
    (a,), (b,) = read_metrics(one.out_dir), read_metrics(two.out_dir)
    for k in ("response_len", "eos_rate", "true_reward"):  # the same rollouts
        assert a[k] == b[k], k
    assert a["clipfrac"] > 0 and a["approx_kl"] > 1e-4
    assert a["score"] == pytest.approx(0.5)  # the oracle's: each pair of a group gives one win
    for k in ("score", "adv_abs", "entropy", "kl", "loss/policy", "loss/kl", "approx_kl",
              "clipfrac", "grad_norm"):
        assert abs(a[k] - b[k]) <= TWO_RANK_TOL * max(1, abs(a[k])), k
    eb = json.loads(open(os.path.join(two.out_dir, "eval.json")).read())
    assert set(eb["time_shares"]) == set(grpo.PHASES)


def test_grpo_resumed_equals_uninterrupted(tiny, tiny_rm, ppo_test_prompts, tmp_path):
    rm = str(tiny_rm / "model.safetensors")
    for name, extra in [("full", {}), ("split", {"stop_after": 2})]:
        grpo.main(tiny_grpo_config(tiny, rm, tmp_path / name, ppo_test_prompts, reward="true",
                                   **extra))
    grpo.main(tiny_grpo_config(tiny, rm, tmp_path / "split", ppo_test_prompts, reward="true"))
    a, b = (load_file(str(tmp_path / n / "model.safetensors")) for n in ("full", "split"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    rows = [read_metrics(tmp_path / n) for n in ("full", "split")]
    assert [r["step"] for r in rows[0]] == [1, 2, 3]
    strip = lambda r: {k: v for k, v in r.items()  # noqa: E731
                       if not k.startswith(("time/", "share/", "tokens_per", "mfu"))}
    assert [strip(r) for r in rows[0]] == [strip(r) for r in rows[1]]


def test_grpo_refuses_bad_values_before_any_work(tmp_path):
    for args, says in ((["--group_size", "1"], "error: --group_size 1 is outside its allowed "
                        "values [2, inf)"),
                       (["--reward", "bt"], "error: --reward must be 'model', 'true' or 'oracle', "
                        "not 'bt'"),
                       (["--rollout_batch", "30"], "error: --rollout_batch 30 is not a multiple "
                        "of --group_size 4")):
        out = tmp_path / "never"
        p = subprocess.run([sys.executable, os.path.join(HERE, "grpo.py"), *args, "--out_dir",
                            str(out)], capture_output=True, text=True, timeout=60, cwd=tmp_path)
        assert p.returncode != 0 and not out.exists(), p.stderr
        assert p.stderr.strip() == says, p.stderr


# ==================================================================================================
# online DPO: a round equals dpo.py's step on the same pairs; two ranks equal one process and
# resumed equals uninterrupted (online_dpo.py)
# ==================================================================================================

def test_label_pairs_higher_score_chosen_a_tie_says_nothing():
    a = torch.tensor([1.0, -1.0, 0.5, -1.0, 2.0])
    b = torch.tensor([0.0, 3.0, 0.5, -1.0, 2.0 + 1e-6])
    a_chosen, tied = online_dpo.label_pairs(a, b)
    assert a_chosen.tolist() == [True, False, False, False, False]
    assert tied.tolist() == [False, False, True, True, False]  # equal scores only, however close


def fake_generate(table):
    """A stand-in for model.generate that "samples" fixed completions: table maps a prompt's token
    ids (a tuple) to its two completions' ids; the loop asks for rows [chunk; chunk] and gets the
    first completions, then the second. generate's layout: left-padded prompt, response, pad."""
    def gen(model, prompts, max_new_tokens, eos_id, pad_id, temperature=1.0, uniforms=None):
        n = len(prompts) // 2
        ys = [table[tuple(p)][r >= n] for r, p in enumerate(prompts)]
        P, N = max(map(len, prompts)), max(map(len, ys))
        tokens = torch.full((len(prompts), P + N), pad_id)
        mask, resp = (torch.zeros(len(prompts), P + N, dtype=torch.bool) for _ in range(2))
        for r, (p, y) in enumerate(zip(prompts, ys)):
            tokens[r, P - len(p):P + len(y)] = torch.tensor(p + y)
            mask[r, P - len(p):P + len(y)], resp[r, P:P + len(y)] = True, True
        return dict(tokens=tokens, mask=mask, response_mask=resp,
                    logprobs=torch.zeros(tokens.shape))
    return gen


def test_online_round_equals_dpo_step_on_the_same_pairs(tiny, monkeypatch):  # noqa: F811
    # Online DPO whose rollout engine "samples" fixed completions, labelled by the true reward, is
    # dpo.py (live reference) on the pairs so labelled, minus the ties, round for step. 16 prompts:
    # 12 whose two completions differ in true reward, 3 whose completions tie (distinct texts), and
    # 1 whose completions differ but both lack EOS: the missing-EOS score makes it a tie too.
    root = tiny.root / "online-vs-dpo"
    os.makedirs(root)
    tok = data.load_tokenizer(f"{tiny.sft}/tokenizer.json")
    ordered, tied, seen = [], [], set()
    for r in data.read_pairs(f"{tiny.task}/pairs_train.jsonl"):
        rc, rr = (tasks.true_reward(r["prompt"], r[k]) for k in ("chosen", "rejected"))
        if r["prompt"] not in seen and rc > rr and len(ordered) < 13:
            ordered.append(r)
        elif r["prompt"] not in seen and rc == rr and len(tied) < 3:
            tied.append(r)
        seen.add(r["prompt"])
    unfinished = ordered.pop()
    rows = ordered[:6] + tied[:2] + [unfinished] + ordered[6:] + tied[2:]
    def write(path, rs):
        path.write_text("".join(json.dumps(r) + "\n" for r in rs))

    write(root / "pairs.jsonl", ordered)  # dpo.py: the pairs that carry a preference
    write(root / "prompts.jsonl", [{"prompt": r["prompt"]} for r in rows])
    write(root / "eval.jsonl", [{"prompt": r["prompt"]} for r in rows[:2]])
    # the chosen completion comes first for half of the prompts and second for the other half
    table = {tuple(data.encode_prompt(tok, r["prompt"])):
             tuple(data.encode_response(tok, r[k]) for k in ("chosen", "rejected")[::(-1) ** j])
             for j, r in enumerate(rows)}
    table[tuple(data.encode_prompt(tok, unfinished["prompt"]))] = tuple(  # cut before their EOS
        data.encode_response(tok, unfinished[k])[:-1] for k in ("chosen", "rejected"))
    monkeypatch.setattr(online_dpo, "generate", fake_generate(table))
    same = dict(lr=1e-3, warmup=1, beta=0.5)  # and dpo.py's defaults for the rest, both sides
    online_dpo.main(online_dpo.Config(
        out_dir=str(root / "online"), sft=f"{tiny.sft}/model.safetensors",
        prompts=str(root / "prompts.jsonl"), test_prompts=str(root / "eval.jsonl"), reward="true",
        iterations=3, stop_after=2, rollout_batch=16, micro_batch_size=8, **same))
    dpo.main(dpo.Config(out_dir=str(root / "dpo"), ref_model=f"{tiny.sft}/model.safetensors",
                        train_pairs=str(root / "pairs.jsonl"), val_pairs=str(root / "pairs.jsonl"),
                        test_prompts=str(root / "eval.jsonl"), ref="live", steps=3, stop_after=2,
                        batch_size=12, micro_batch_size=12, eval_every=1000, **same))
    a, b = dpo_metrics(root / "online"), dpo_metrics(root / "dpo")
    assert [x["step"] for x in a] == [y["step"] for y in b] == [1, 2]
    assert [x["ties"] for x in a] == [0.25, 0.25] and [x["eos_rate"] for x in a] == [30 / 32] * 2
    # The same pairs, another batch order and micro-batching (16 rows in 2 forwards, 4 weighted 0,
    # against 12 in 1): only the order of fp32 sums differs, as between DPO's equivalent runs
    # (DPO_TOL). Round 1's loss and gradient pin the labels, the reference and the normalisation;
    # round 2's loss pins the update.
    for k in ("loss", "rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies",
              "logps/chosen", "logps/rejected", "grad_norm", "lr"):
        assert all(abs(x[k] - y[k]) <= DPO_TOL * max(1, abs(x[k])) for x, y in zip(a, b)
                   if k in x), k
    assert a[0]["kl"] == 0.0 and a[1]["kl"] != 0.0  # π = π_ref exactly in round 1, not after


def test_online_dpo_trains_on_the_log_probs_it_sampled_from(tiny, monkeypatch, tmp_path):
    # Each round's completions come from the rollout engine; the loss scores them with the policy.
    # Both are one distribution only if the engine samples at the scoring temperature (1) and
    # holds the policy's weights: round 1 pins the temperature, round 2 the weight broadcast
    # (without it the engine is still π_ref while the policy has moved).
    sampled, scored = [], []

    def spy_generate(*a, **kw):
        out = generate(*a, **kw)
        sampled.append(torch.where(out["response_mask"], out["logprobs"], 0.0).sum(1))
        return out

    def spy_loss(pi_c, pi_r, ref_c, ref_r, *a, **kw):
        scored.append((torch.cat([pi_c, pi_r]).detach(), torch.cat([ref_c, ref_r])))
        return dpo.dpo_loss(pi_c, pi_r, ref_c, ref_r, *a, **kw)
    monkeypatch.setattr(online_dpo, "generate", spy_generate)
    monkeypatch.setattr(online_dpo, "dpo_loss", spy_loss)
    online_dpo.main(online_dpo.Config(
        out_dir=str(tmp_path / "online"), sft=f"{tiny.sft}/model.safetensors", reward="true",
        prompts=f"{tiny.task}/prompts_train.jsonl", iterations=3, stop_after=2, rollout_batch=8,
        micro_batch_size=4, lr=1e-2, warmup=0))  # stopped before the final evaluation
    assert len(sampled) == 2 and len(scored) == 4  # 2 rounds x 2 micro-batches of 4 pairs
    for r in range(2):
        pi, ref = (torch.cat([x[k] for x in scored[2 * r:2 * r + 2]]) for k in (0, 1))
        torch.testing.assert_close(pi.sort().values, sampled[r].sort().values, atol=1e-4,
                                   rtol=1e-5)
    assert (pi - ref).abs().max() > 1e-2  # round 2: the policy has moved off π_ref


def watch_rounds(monkeypatch):
    """Spies on online_dpo's rounds; returns the list each round appends to: the sampling's
    uniforms "U", the experience dict "ex", and (--reward oracle) the label draw's uniforms "u"."""
    rounds, real_experience = [], online_dpo.experience
    bradley_terry_labels = online_dpo.bradley_terry_labels

    def spy_generate(*a, uniforms=None, **kw):
        rounds.append({"U": uniforms})
        return generate(*a, uniforms=uniforms, **kw)

    def spy_labels(score_a, score_b, u, same):
        rounds[-1]["u"] = u
        return bradley_terry_labels(score_a, score_b, u, same)

    def spy_experience(*a, **kw):
        rounds[-1]["ex"] = real_experience(*a, **kw)
        return rounds[-1]["ex"]
    monkeypatch.setattr(online_dpo, "generate", spy_generate)
    monkeypatch.setattr(online_dpo, "bradley_terry_labels", spy_labels)
    monkeypatch.setattr(online_dpo, "experience", spy_experience)
    return rounds


@pytest.mark.parametrize("labeller", ["model", "oracle"])
def test_online_dpo_two_ranks_equal_one_process_and_resumed_equals_uninterrupted(
        tiny, tiny_rm, labeller, monkeypatch):  # noqa: F811
    root = tiny.root / f"online-test-{labeller}"
    os.makedirs(root)
    evals = open(f"{tiny.task}/prompts_test.jsonl").readlines()[:4]
    (root / "eval.jsonl").write_text("".join(evals))
    cfg = dict(sft=f"{tiny.sft}/model.safetensors", reward_model=str(tiny_rm / "model.safetensors"),
               prompts=f"{tiny.task}/prompts_train.jsonl", test_prompts=str(root / "eval.jsonl"),
               iterations=2, rollout_batch=8, micro_batch_size=2, eval_k=1,
               lr=1e-3, warmup=1, reward=labeller)
    # 1 rank, 4 micro-steps, its rounds watched: a pair ties (weight 0) exactly where its two
    # completions score alike (r_φ), or, under the oracle, only where they are identical (equal
    # scores are Bradley-Terry's coin flip); the label draw shares no uniform with the sampling
    rounds = watch_rounds(monkeypatch)
    online_dpo.main(online_dpo.Config(out_dir=str(root / "one"), **cfg))
    monkeypatch.undo()
    tok, a = data.load_tokenizer(f"{tiny.sft}/tokenizer.json"), dpo_metrics(root / "one")
    coin_flips = 0  # pairs of equal scores, distinct completions, not tied
    for r, m in zip(rounds, a, strict=True):
        ex, B = r["ex"], cfg["rollout_batch"]
        ys, s = ex["ys"], ex["score"].tolist()
        same = [y == z for y, z in zip(ys[:B], ys[B:])]
        equal = [x == y for x, y in zip(s[:B], s[B:])]
        tie = same if labeller == "oracle" else equal
        assert (ex["keep"] == 0).tolist() == tie and m["ties"] == sum(tie) / B
        coin_flips += sum(e and not t for e, t in zip(equal, tie))
        if labeller == "oracle":  # the hidden reward, an unfinished completion at its score
            missing = online_dpo.Config.missing_eos_score
            assert s == [tasks.true_reward(t, tok.decode(y)) if y[-1] == tok.eos else missing
                         for t, y in zip(ex["texts"] * 2, ys)]
            assert not set(r["u"].tolist()) & set(r["U"].flatten().tolist())
    # 2 ranks, 2 micro-steps; also the smoke run of the whole script
    flags = [f"--{k}={v}" for k, v in {**cfg, "out_dir": root / "two"}.items()]
    p = run_torchrun("online_dpo.py", flags)
    assert "true reward" in p.stdout and "back from PPO" in p.stdout
    a, b = dpo_metrics(root / "one"), dpo_metrics(root / "two")
    assert [x["step"] for x in a] == [y["step"] for y in b] == [1, 2]
    # The same samples (a completion's uniforms are its row of the global batch's) and r_φ scores:
    # the same labels; then only the order of fp32 sums differs (DPO_TOL, as dpo.py's 2-vs-1 test)
    for k in ("ties", "eos_rate", "response_len", "true_reward"):
        assert [x[k] for x in a] == [y[k] for y in b], k
    for k in ("loss", "rewards/margins", "score", "kl", "logps/chosen", "grad_norm"):
        assert all(abs(x[k] - y[k]) <= DPO_TOL * max(1, abs(x[k])) for x, y in zip(a, b)
                   if k in x), k
    # neither vacuous nor all ties: the labels matter (the oracle: some equal scores drawn)
    assert all(0 < x["ties"] < 1 for x in a) if labeller == "model" else coin_flips > 0
    # --fsdp on the same 2 ranks: policy, π_ref and r_φ sharded, the same rounds (the same
    # tolerance: sharding changes only the order of fp32 sums), the model saved whole
    p = run_torchrun("online_dpo.py",
                     [f"--{k}={v}" for k, v in {**cfg, "out_dir": root / "fsdp"}.items()]
                     + ["--fsdp"])
    assert "sharded (FSDP2)" in p.stdout  # the policy was sharded, not replicated
    c = dpo_metrics(root / "fsdp")
    for k in ("ties", "eos_rate", "response_len", "true_reward"):
        assert [x[k] for x in a] == [y[k] for y in c], k
    for k in ("loss", "rewards/margins", "score", "kl", "logps/chosen", "grad_norm"):
        assert all(abs(x[k] - y[k]) <= DPO_TOL * max(1, abs(x[k])) for x, y in zip(a, c)), k
    w1, w3 = dpo_weights(root / "one"), dpo_weights(root / "fsdp")
    assert w1.keys() == w3.keys() and all(w1[k].shape == w3[k].shape for k in w1)
    # stopped after a round, then resumed (the rollout engine gets the restored policy): the same
    # operations in the same order, bit for bit
    online_dpo.main(online_dpo.Config(out_dir=str(root / "split"), stop_after=1, **cfg))
    assert not os.path.exists(root / "split" / "model.safetensors")
    online_dpo.main(online_dpo.Config(out_dir=str(root / "split"), **cfg))
    w1, w2 = dpo_weights(root / "one"), dpo_weights(root / "split")
    assert w1.keys() == w2.keys() and all(torch.equal(w1[k], w2[k]) for k in w1)
    def strip(rows):  # all but the wall-clock numbers
        return [{k: v for k, v in r.items()
                 if not k.startswith(("time/", "share/", "tokens_per", "mfu"))} for r in rows]
    assert strip(a) == strip(dpo_metrics(root / "split"))


def test_oracle_labels_are_bradley_terry_draws_on_the_hidden_reward():
    # --reward oracle labels as task.sample_pair labelled the offline pool: a is chosen with
    # probability σ(r(a) - r(b)), as u < σ of the scores the other labellers see
    n, g = 20_000, torch.Generator().manual_seed(0)
    distinct = torch.zeros(n, dtype=torch.bool)
    for diff in (-3.0, -1.0, 0.0, 0.5, 2.5):
        a, b = torch.full((n,), diff, dtype=torch.float64), torch.zeros(n, dtype=torch.float64)
        u = torch.rand(n, generator=g, dtype=torch.float64)
        a_chosen, tied = online_dpo.bradley_terry_labels(a, b, u, distinct)
        p = 1 / (1 + math.exp(-diff))
        assert abs(a_chosen.double().mean() - p) <= 4 * math.sqrt(p * (1 - p) / n), diff
        assert a_chosen.tolist() == [x < p for x in u.tolist()] and not tied.any(), diff
    # strictly below: u = σ is b, as task.sample_pair swaps at u >= σ
    a, b = torch.tensor([0.5, 0.5]), torch.zeros(2)
    p = torch.sigmoid(a - b)
    u = torch.stack([p[0], torch.nextafter(p[1], torch.tensor(0.0))])
    assert online_dpo.bradley_terry_labels(a, b, u, distinct[:2])[0].tolist() == [False, True]
    # only identical completions tie, whatever the draw; equal scores of distinct ones do not
    same = torch.tensor([True, False])
    assert online_dpo.bradley_terry_labels(b, b, u, same)[1].tolist() == [True, False]
    # an unfinished completion scores missing_eos_score before the draw (ppo.py's rule): a
    # finished one with reward r beats it with probability σ(r - missing_eos_score)
    words = ["<eos>", *sorted(tasks.WEIGHTS)]
    tok = SimpleNamespace(eos=0, decode=lambda y: " ".join(words[i] for i in y if i))
    cfg = online_dpo.Config(missing_eos_score=-2.0)
    ys = [[1, 2, 0], [1, 2]]  # the same words, the second cut before its EOS
    r = tasks.true_reward("", " ".join(words[1:3]))
    scores, has_eos = online_dpo.score(None, None, ys, ["a prompt"], tok, cfg, CPU)
    assert scores.tolist() == [r, -2.0] and has_eos.tolist() == [True, False]
    u = torch.rand(n, generator=g)
    a_chosen, _ = online_dpo.bradley_terry_labels(scores[0].expand(n), scores[1].expand(n), u,
                                                  distinct)
    p = 1 / (1 + math.exp(-(r + 2.0)))
    assert abs(a_chosen.double().mean() - p) <= 4 * math.sqrt(p * (1 - p) / n)


def test_oracle_labels_are_the_same_on_any_world_size_and_tie_only_identical_completions():
    # online_dpo.label under --reward oracle: one uniform per global pair, rank r's pairs the r-th
    # slice, so 2 ranks label each pair as 1 rank does; a new round draws anew
    cfg = online_dpo.Config(reward="oracle", rollout_batch=64)
    R, g = cfg.rollout_batch, torch.Generator().manual_seed(0)
    scores = torch.randint(-2, 3, (2 * R,), generator=g).float()  # [a; b], ties among them
    ys = [[5, j] for j in range(R)] + [[5, j if j % 4 == 0 else -j] for j in range(R)]
    a_chosen, tied = online_dpo.label(scores, ys, 3, cfg, CPU)
    assert tied.tolist() == [j % 4 == 0 for j in range(R)]  # identical, not merely equal scores
    halves = []
    for r in range(2):
        mine = [*range(r * R // 2, (r + 1) * R // 2), *range(R + r * R // 2, R + (r + 1) * R // 2)]
        halves.append(online_dpo.label(scores[mine], [ys[i] for i in mine], 3, cfg,
                                       Dist(r, r, 2, torch.device("cpu"), r == 0, False)))
    assert torch.equal(torch.cat([h[0] for h in halves]), a_chosen)
    assert torch.equal(torch.cat([h[1] for h in halves]), tied)
    assert not torch.equal(online_dpo.label(scores, ys, 4, cfg, CPU)[0], a_chosen)


def test_online_dpo_refuses_an_unknown_labeller(tmp_path):
    # one line naming the allowed values, before any work: no output folder, no traceback
    out = tmp_path / "never"
    p = subprocess.run([sys.executable, os.path.join(HERE, "online_dpo.py"), "--reward", "bt",
                        "--out_dir", str(out)], capture_output=True, text=True, timeout=60,
                       cwd=tmp_path)
    assert p.returncode != 0 and not out.exists(), p.stderr
    assert p.stderr.strip() == "error: --reward must be 'model', 'true' or 'oracle', not 'bt'"


# ==================================================================================================
# iterative DPO: each round's cache equals a live reference on its pairs, the rounds chain their
# policies, two ranks sample what one process samples (iterative_dpo.py, dpo.py --init)
# ==================================================================================================

def iterative_cfg(tiny, name, **kw):
    base = dict(out_dir=str(tiny.root / name), sft=f"{tiny.sft}/model.safetensors",
                prompts=f"{tiny.task}/prompts_train.jsonl",
                val_pairs=str(tiny.root / "dpo-data/pairs_val.jsonl"),
                test_prompts=str(tiny.root / "dpo-data/prompts_test.jsonl"),
                rounds=2, pairs=32, steps=2, batch_size=16, micro_batch_size=16, eval_k=1,
                beta=0.1)
    return iterative_dpo.Config(**{**base, **kw})


def test_dpo_init_starts_the_policy_at_the_given_weights(tiny, dpo_cache):  # noqa: F811
    # at π_ref every step-1 margin is 0 (test_step_zero_policy_equals_reference); --init at a
    # trained policy A starts there, so the same first batch shows A's nonzero margins, and
    # --init at π_ref's own file is the run without --init
    a = dpo_cfg(tiny, "dpo-init-trained", steps=3, lr=1e-2)
    dpo.main(a)
    runs = {}
    for name, init in (("none", ""), ("ref", f"{tiny.sft}/model.safetensors"),
                       ("a", f"{a.out_dir}/model.safetensors")):
        runs[name] = dpo_cfg(tiny, f"dpo-init-{name}", init=init, steps=1)
        dpo.main(runs[name])
    m = {k: dpo_metrics(c.out_dir)[0] for k, c in runs.items()}
    assert m["none"]["rewards/margins"] == m["ref"]["rewards/margins"] == 0.0
    assert m["none"]["loss"] == m["ref"]["loss"]
    assert abs(m["a"]["rewards/margins"]) > 1e-3 and m["a"]["loss"] != m["none"]["loss"]
    with pytest.raises(SystemExit, match="--init .* does not exist"):
        dpo.main(replace(runs["a"], out_dir=str(tiny.root / "dpo-init-c"),
                         init="/nonexistent.safetensors"))


def test_iterative_rounds_cache_equals_live_and_chain_their_policies(tiny, dpo_cache):  # noqa
    cfg = iterative_cfg(tiny, "iterative-test")
    iterative_dpo.main(cfg)
    prompts = set(data.read_prompts(cfg.prompts))
    for r in range(cfg.rounds):
        folder, pairs_path, pc, dc = iterative_dpo.round_configs(cfg, r)
        pairs = data.read_pairs(pairs_path)
        # the round's budget in labels, every pair one of the task's prompts, two distinct texts
        assert len(pairs) == cfg.pairs
        assert all(p["prompt"] in prompts and p["chosen"].strip() != p["rejected"].strip()
                   and p["chosen"].strip() and p["rejected"].strip() for p in pairs)
        # its policy starts where the last round's ended; π_ref stays the reference
        assert dc.init == ("" if r == 0 else os.path.join(
            cfg.out_dir, f"round{r}", "dpo", "model.safetensors")) and dc.ref_model == cfg.sft
        # cached equals live: the same round trained against a live π_ref on the same pairs
        live = replace(dc, out_dir=f"{folder}/dpo-live", ref="live")
        dpo.main(live)
        a, b = dpo_metrics(dc.out_dir), dpo_metrics(live.out_dir)
        assert len(a) == len(b) == cfg.steps
        for k in ("loss", "rewards/margins", "grad_norm", "val_loss"):
            assert all(abs(x[k] - y[k]) <= DPO_TOL for x, y in zip(a, b) if k in x), k
    r2 = dpo_metrics(iterative_dpo.round_configs(cfg, 1)[3].out_dir)[0]
    assert abs(r2["rewards/margins"]) > 0  # round 2 starts off π_ref: round 1's policy
    ev = json.load(open(f"{cfg.out_dir}/eval.json"))
    assert (ev["labels"], ev["steps"], len(ev["rounds"])) == (64, 4, 2)
    assert dpo_weights(cfg.out_dir).keys() == dpo_weights(
        iterative_dpo.round_configs(cfg, 1)[3].out_dir).keys()
    assert all(torch.equal(x, y) for x, y in zip(
        dpo_weights(cfg.out_dir).values(),
        dpo_weights(iterative_dpo.round_configs(cfg, 1)[3].out_dir).values()))
    # a rerun with the same config skips both rounds (rounds.json), rewriting nothing
    stamp = lambda: (lambda st: (st.st_ino, st.st_mtime_ns))(  # noqa: E731  rewritten or not
        os.stat(f"{cfg.out_dir}/round2/pairs.jsonl"))
    before, written = open(f"{cfg.out_dir}/round2/pairs.jsonl").read(), stamp()
    state = json.load(open(f"{cfg.out_dir}/rounds.json"))
    iterative_dpo.main(cfg)
    assert open(f"{cfg.out_dir}/round2/pairs.jsonl").read() == before and stamp() == written
    assert json.load(open(f"{cfg.out_dir}/rounds.json"))["rounds"] == state["rounds"]
    nll = replace(cfg, rpo_alpha=1.0)
    assert iterative_dpo.round_configs(nll, 1)[3].rpo_alpha == 1.0


def test_iterative_two_ranks_sample_and_label_what_one_process_does(tiny, dpo_cache):  # noqa
    # the ranks run one thread each (torchrun_env): the one process too, so that the arithmetic
    # of each micro-batch, and with it every sampled token, is the same
    one, threads = iterative_cfg(tiny, "iterative-one", rounds=1), torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        iterative_dpo.main(one)
    finally:
        torch.set_num_threads(threads)
    two = replace(one, out_dir=str(tiny.root / "iterative-two"))
    args = [a for k, v in asdict(two).items() if not isinstance(v, bool)
            for a in (f"--{k}", str(v))]
    run_torchrun("iterative_dpo.py", args)
    assert open(f"{two.out_dir}/round1/pairs.jsonl").read() == \
        open(f"{one.out_dir}/round1/pairs.jsonl").read()
    a, b = dpo_metrics(f"{one.out_dir}/round1/dpo"), dpo_metrics(f"{two.out_dir}/round1/dpo")
    for k in ("loss", "rewards/margins", "grad_norm"):
        assert all(abs(x[k] - y[k]) <= DPO_TOL for x, y in zip(a, b)), k
    # a new seed samples other pairs
    other = replace(one, out_dir=str(tiny.root / "iterative-other"), seed=one.seed + 1)
    pairs, _ = iterative_dpo.sample_pairs(
        load_model(one.sft, "cpu")[0].eval(), data.load_tokenizer(f"{tiny.sft}/tokenizer.json"),
        data.read_prompts(one.prompts), 0, other, CPU)
    assert pairs != data.read_pairs(f"{one.out_dir}/round1/pairs.jsonl")


def test_iterative_labels_only_pairs_both_ended_nonempty_and_distinct(tiny, monkeypatch):  # noqa
    # a scripted sampler: completion a of batch b is SCRIPT[b][a // 2][a % 2] (text, ended); batch 0
    # has one pair of each kind, batch 1 four good ones, of which the round's budget keeps three
    SCRIPT = [[("good one", True), ("good two", True)], [("cut", False), ("ends", True)],
              [("  ", True), ("text", True)], [("same", True), (" same ", True)]], \
        [[(f"more {i}", True), (f"other {i}", True)] for i in range(4)]
    made = []
    monkeypatch.setattr(iterative_dpo, "generate", lambda policy, rows, *a, **k: [
        made.append(None) or len(made) - 1 for _ in rows])
    monkeypatch.setattr(iterative_dpo, "score_completions", lambda out, *a: (
        [SCRIPT[n // 8][n % 8 // 2][n % 2][0] for n in out],
        torch.tensor([SCRIPT[n // 8][n % 8 // 2][n % 2][1] for n in out]), None, None))
    cfg = iterative_cfg(tiny, "iterative-scripted", pairs=4, micro_batch_size=3)
    policy = SimpleNamespace(config=SimpleNamespace(block_size=64))
    tok = data.load_tokenizer(f"{tiny.sft}/tokenizer.json")
    pairs, counts = iterative_dpo.sample_pairs(policy, tok, ["p"] * 8, 0, cfg, CPU)
    assert counts == dict(labelled=4, sampled=8, unfinished=1, empty=1, identical=1)
    assert [{p["chosen"], p["rejected"]} for p in pairs] == [
        {"good one", "good two"}] + [{f"more {i}", f"other {i}"} for i in range(3)]
    # a policy that never ends gives up after MAX_BATCHES batches, saying what it skipped
    SCRIPT = [[("cut", False)] * 2] * 4 * iterative_dpo.MAX_BATCHES
    SCRIPT = [SCRIPT[i:i + 4] for i in range(0, len(SCRIPT), 4)]
    made.clear()
    with pytest.raises(SystemExit, match=f"{4 * iterative_dpo.MAX_BATCHES} prompts gave only 0 "
                       f"pairs .*'unfinished': {4 * iterative_dpo.MAX_BATCHES}"):
        iterative_dpo.sample_pairs(policy, tok, ["p"] * 8, 0, cfg, CPU)


# ==================================================================================================
# the evaluation: π_ref against itself gives KL 0 and win rate 1/2, one scoring rule for every
# model, the KL estimate against exact enumeration (evaluate.py)
# ==================================================================================================

def test_reference_against_itself_kl_zero_win_rate_half(tiny):  # noqa: F811
    tok = data.load_tokenizer(f"{tiny.sft}/tokenizer.json")
    ref, ref2 = (load_model(f"{tiny.sft}/model.safetensors")[0] for _ in range(2))
    res = evaluate_policy(ref, ref2, tok, data.read_prompts(f"{tiny.task}/prompts_test.jsonl"),
                          init_distributed(), k=2)
    n = res["n_completions"]
    assert n == 400
    # the same weights score the same tokens with the same function: exactly
    assert res["kl"] == 0.0
    # Each comparison scores 1, 1/2 or 0 and, both sides sampling the same model independently, has
    # mean exactly 1/2 for every prompt; its variance is at most 1/4, so the mean of n lies within 4
    # standard errors, 4·(1/2)/√n = 0.1, except with probability < 1e-4.
    assert abs(res["win_rate"] - 0.5) <= 4 * 0.5 / math.sqrt(n)


def test_beyond_pool_is_the_share_of_completions_above_the_pools_best(tiny):  # noqa: F811
    tok = data.load_tokenizer(f"{tiny.sft}/tokenizer.json")
    ref, ref2 = (load_model(f"{tiny.sft}/model.safetensors")[0] for _ in range(2))
    prompts = data.read_prompts(f"{tiny.task}/prompts_test.jsonl")[:40]
    path = f"{tiny.task}/prompts_test.jsonl"
    best = tasks.task_pool_best(path)  # the tiny task's folder holds task.json
    assert best == tasks.pool_best(data.read_pairs(f"{tiny.task}/pairs_train.jsonl"))
    assert tasks.task_pool_best(str(tiny.root / "elsewhere" / "p.jsonl")) is None
    # thresholds inside the rewards' range, so that the share is neither 0 nor 1 (the tiny π_ref
    # writes mostly junk, which the hidden reward charges per sentence: read its range first);
    # with k = 1 the samples hold every completion and its score: count them independently
    first = evaluate_policy(ref, ref2, tok, prompts, init_distributed(), k=1, n_samples=40)
    sides = [[s[f"{side}_reward"] for s in first["samples"]] for side in ("policy", "ref")]
    seen = sorted(set(sides[0] + sides[1]))
    inside = [t for t in ((a + b) / 2 for a, b in zip(seen, seen[1:]))
              if all(0 < tasks.fraction_beyond(r, t) < 1 for r in sides)]
    assert len(inside) >= 2, seen
    for t in (inside[0], inside[-1]):
        res = evaluate_policy(ref, ref2, tok, prompts, init_distributed(), k=1, n_samples=40,
                              pool_best=t)
        assert len(res["samples"]) == res["n_completions"] == 40
        for side in ("policy", "ref"):
            share = tasks.fraction_beyond([s[f"{side}_reward"] for s in res["samples"]], t)
            got = res["beyond_pool" if side == "policy" else "ref_beyond_pool"]
            assert 0 < share < 1 and got == pytest.approx(share, abs=1e-12), (t, side)
    assert "beyond_pool" not in evaluate_policy(ref, ref2, tok, prompts[:2], init_distributed(),
                                                k=1)


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


def test_evaluation_scores_every_model_by_one_rule(tiny):  # noqa: F811
    tok = data.load_tokenizer(f"{tiny.sft}/tokenizer.json")
    great = tok.encode(" great")
    assert len(great) == 1
    rambler = constant_gpt(tok.vocab_size, great[0])  # " great great ...": +2 a word, no EOS
    quitter = constant_gpt(tok.vocab_size, tok.eos)  # EOS at once: an empty, finished response
    prompts = ["it felt good .", "the movie is great . i loved the plot ."]
    N = 64 - len(data.encode_prompt(tok, prompts[1]))  # every completion's budget: the block's rest
    d = init_distributed()
    res = evaluate_policy(rambler, quitter, tok, prompts, d, k=2, missing_eos_score=-3.0)
    # the policy never ends: every completion scores missing_eos_score (its words would pay 2N)
    assert (res["true_reward"], res["true_reward_std"], res["eos_rate"]) == (-3.0, 0.0, 0.0)
    assert res["response_len"] == N and res["true_reward_finished"] is None
    # π_ref ends at once: finished, one token (the EOS), no sentence: the malformed penalty, -1,
    # after the one-sentence prompt; 0 after the two-sentence one, which is a text of its own
    assert (res["ref_true_reward"], res["ref_eos_rate"], res["ref_response_len"]) == (-0.5, 1, 1)
    assert res["ref_true_reward_finished"] == -0.5 and res["win_rate"] == 0.0  # -3 < -1, always
    # KL: every token is " great", N of them, log π(great) - log π_ref(great) each
    logits = lambda m: m.transformer.wte.weight[:, 0].detach()  # noqa: E731  (the constant logits)
    per_token = (F.log_softmax(logits(rambler), 0) - F.log_softmax(logits(quitter), 0))[great[0]]
    assert res["kl"] == pytest.approx(N * per_token.item(), rel=1e-12) and per_token > 30
    assert res["n_completions"] == 4 and res["samples"][0]["policy"] == " great" * N
    # the same model on both sides: every comparison a tie (-3 against -3), and a tie counts half
    res = evaluate_policy(rambler, copy.deepcopy(rambler), tok, prompts, d, k=2)
    assert res["win_rate"] == 0.5 and res["kl"] == 0.0
    assert res["true_reward"] == res["ref_true_reward"] == evaluate.MISSING_EOS_SCORE
    assert evaluate.MISSING_EOS_SCORE == ppo.Config.missing_eos_score  # DPO's eval = PPO's rule
    assert evaluate.summary(res).startswith("true reward -1.000")


def test_evaluation_on_user_prompts_omits_the_hidden_reward(tiny):  # noqa: F811
    tok = data.load_tokenizer(f"{tiny.sft}/tokenizer.json")
    assert tasks.task_prompts(["it felt good .", "the movie is great . i loved the plot ."])
    for user in (["Human: hi there. Assistant:"], ["it felt good"], ["it felt amazing ."]):
        assert not tasks.task_prompts(user + ["it felt good ."])
    quitter = constant_gpt(tok.vocab_size, tok.eos)
    user = ["Human: hi there. Assistant:"]
    res = evaluate_policy(quitter, quitter, tok, user, init_distributed(), k=2)
    hidden = {"true_reward", "true_reward_std", "ref_true_reward", "ref_true_reward_std",
              "win_rate", "true_reward_finished", "ref_true_reward_finished"}
    assert not hidden & res.keys() and "built-in task" in res["true_reward_omitted"]
    assert (res["kl"], res["eos_rate"], res["response_len"], res["ref_eos_rate"]) == (0, 1, 1, 1)
    assert not any("reward" in k for s in res["samples"] for k in s)
    lines = []  # what a stage prints about it
    evaluate.print_samples(res, lines.append)
    lines.append(evaluate.summary(res))
    assert "no true reward: the prompts are not the built-in task's" in lines[-1]


def all_completions(n, V, eos):
    """Every response generate can return with a budget of n tokens over a vocab of V: each ends
    at its first EOS or after n tokens."""
    done, grow = [], [[]]
    while grow:
        y = grow.pop()
        if (y and y[-1] == eos) or len(y) == n:
            done.append(y)
        else:
            grow += [y + [v] for v in range(V)]
    return done


def test_evaluation_kl_against_exact_enumeration():
    V, eos, pad, prompt = 4, 0, 3, [0, 1, 2]  # BOS = EOS = 0, as data.encode_prompt
    policy, ref = (tiny_gpt(seed=s, vocab_size=V, block_size=6) for s in (3, 4))
    with torch.no_grad():  # larger logits: two clearly different distributions (KL 1.39 nats)
        for m in (policy, ref):
            m.transformer.wte.weight.mul_(8)
    ys = all_completions(6 - len(prompt), V, eos)
    assert len(ys) == 1 + 3 + 9 + 27
    L = len(prompt) + max(map(len, ys))
    out = {"tokens": torch.tensor([prompt + y + [pad] * (L - len(prompt) - len(y)) for y in ys]),
           "mask": torch.tensor([[c < len(prompt) + len(y) for c in range(L)] for y in ys])}
    out["response_mask"] = out["mask"].clone()
    out["response_mask"][:, :len(prompt)] = False
    lp, lq = evaluate.completion_logps(policy, out), evaluate.completion_logps(ref, out)
    for m, got in ((policy, lp), (ref, lq)):  # the obvious way: each prefix alone, token by token
        want = [sum(F.log_softmax(m(torch.tensor([prompt + y[:t]]))[0, -1], -1)[y[t]].item()
                    for t in range(len(y))) for y in ys]
        torch.testing.assert_close(got, torch.tensor(want, dtype=got.dtype), atol=1e-10, rtol=0)
    assert lp.exp().sum().item() == pytest.approx(1.0, abs=1e-12)  # a distribution over completions
    exact = (lp.exp() * (lp - lq)).sum().item()
    sd = (lp.exp() * (lp - lq - exact) ** 2).sum().item() ** 0.5
    # the evaluation's estimate, a mean over n sampled completions, lies within 5 standard errors
    # of the exact KL (a seeded draw: probability of failing < 1e-6); the exact KL is far above 5
    # standard errors, so a flipped sign, or another function's log-probs, would show
    n = 4000
    fake = SimpleNamespace(eos=eos, pad=pad, encode=lambda s: [int(w) for w in s.split()],
                           decode=lambda ids: " ".join(map(str, ids)))
    res = evaluate_policy(policy, ref, fake, ["1 2"], init_distributed(), k=n, batch_size=n)
    assert exact > 20 * sd / n ** 0.5 and abs(res["kl"] - exact) <= 5 * sd / n ** 0.5


# ==================================================================================================
# bf16 and CUDA: the GPU path's numerics, simulated on the CPU and run on CUDA where there is one
# ==================================================================================================

def test_cuda_tests_in_a_child():
    """The suite pins itself to the CPU (top of this file); on a machine with CUDA the on_cuda tests
    run here, in a child pytest given the environment as it was."""
    if os.environ.get("TEST_CUDA") == "1":
        pytest.skip("this is the child")
    if torch.version.cuda is None:
        pytest.skip("a CPU build of torch: no CUDA to test")
    cmd = [sys.executable, "-m", "pytest", __file__, "-q", "-k", "on_cuda", "-p",
           "no:cacheprovider"]
    (p,) = run_whole([cmd], 1200, {**ENV_AS_GIVEN, "TEST_CUDA": "1"})
    assert p.returncode == 0, f"the on_cuda tests failed:\n{p.stdout[-6000:]}\n{p.stderr[-2000:]}"
    if " passed" not in p.stdout:
        pytest.skip(f"no GPU visible to the child: {p.stdout.strip().splitlines()[-1]}")


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (on a GPU "
                                "machine, test_cuda_tests_in_a_child runs it)")
ON = [pytest.param("cpu", id="on_cpu"), pytest.param("cuda", id="on_cuda", marks=needs_cuda)]


@pytest.fixture
def bf16(request, monkeypatch):
    """The device a bf16 test runs on: "cuda", where every stage chooses bf16 autocast itself, or
    "cpu" with plumbing.precision replaced, so that the stages take their CUDA path's numerics
    there (bf16 autocast, bf16 frozen models and rollout copy, "bf16" in the cache fingerprint)."""
    if request.param == "cpu":
        for mod in (plumbing, checkpoint, dpo, ppo, online_dpo, precompute):
            monkeypatch.setattr(mod, "precision", lambda device: "bf16")
    return request.param


# Per-response error of bf16 autocast against fp32 for the tiny π_ref, measured on the CPU over 512
# responses of the task: 0.0079 mean (max 0.051) with a bf16 LM head, 0.00034 (max 0.0019) with the
# head in fp32, the bf16 trunk's own. E bounds what any two bf16 computations of one response may
# differ by (another batch shape, another device's kernels): 5x the fp32-head maximum.
E = 0.01


def test_lm_head_runs_in_fp32_under_bf16_autocast(tiny):  # noqa: F811
    model = load_model(f"{tiny.sft}/model.safetensors")[0].eval()
    tok = data.load_tokenizer(f"{tiny.sft}/tokenizer.json")
    ex, _ = data.tokenize_pairs(tok, data.read_pairs(f"{tiny.task}/pairs_val.jsonl")[:64], 64, 16)
    b = data.collate_pairs(ex, tok.pad)
    hidden = {}
    model.transformer.ln_f.register_forward_hook(lambda m, args, out: hidden.setdefault("x", out))
    with torch.no_grad():
        fp32 = pair_logps(model, b["input_ids"], b["targets"]).double()
        hidden.clear()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = model(b["input_ids"])
            lp = token_logprobs(logits, b["targets"]).sum(-1).double()
    # exactly the fp32 matmul of the (bf16 trunk's) hidden state with the fp32 embedding
    assert logits.dtype == torch.float32
    assert torch.equal(logits, F.linear(hidden["x"].float(), model.transformer.wte.weight))
    err = (lp - fp32).abs()  # measured: 0.00033 mean, 0.0018 max; a bf16 head: 0.0088, 0.035
    assert err.mean() < 0.002 and err.max() < E, (err.mean(), err.max())


def test_frozen_bf16_model_is_bit_identical_under_autocast_at_about_half_the_bytes():
    cfg = dict(block_size=32, vocab_size=50, n_layer=2, n_head=2, n_embd=32)
    for head in ("lm", "scalar"):
        torch.manual_seed(0)
        model, x = GPT(GPTConfig(**cfg, head=head)).eval(), torch.randint(0, 50, (3, 20))
        frozen = freeze(load_state(GPT(GPTConfig(**cfg, head=head)), model), bf16=True)
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            assert torch.equal(model(x), frozen(x)), head  # autocast casts to those bf16 values
        assert not any(p.requires_grad for p in frozen.parameters()) and not frozen.training
    assert frozen.transformer.wte.weight.dtype == torch.float32  # embeddings, LayerNorms, heads
    rows = anatomy({"policy": model, "reference": frozen})
    assert [r["dtype"] for r in rows] == ["fp32", "bf16+fp32", ""]
    block_linears = sum(p.numel() for n, p in frozen.named_parameters()
                        if n.startswith("transformer.h.") and ".ln_" not in n)
    assert rows[1]["weights_bytes"] == rows[0]["weights_bytes"] - 2 * block_linears
    assert "bf16+fp32" in format_anatomy(rows, 32)


def load_state(into, model):
    into.load_state_dict(model.state_dict())
    return into


def test_cache_of_another_precision_is_refused(tiny, dpo_cache, monkeypatch):  # noqa: F811
    cfg = dpo_cfg(tiny, "dpo-precision", steps=1)
    with monkeypatch.context() as m:  # a bf16 run finds the fp32 cache
        for mod in (plumbing, checkpoint, dpo, ppo, online_dpo, precompute):
            m.setattr(mod, "precision", lambda device: "bf16")
        with pytest.raises(SystemExit, match=r"stale.*the precision \(fp32 -> bf16\)\. Rebuild"):
            dpo.main(cfg)
        pc = dpo_pcfg(tiny, out="dpo-precision-cache")
        precompute.main(pc)  # a bf16 cache ...
    with pytest.raises(SystemExit, match=r"stale.*the precision \(bf16 -> fp32\)\. Rebuild"):
        dpo.main(replace(cfg, ref_logps=pc.out_dir))  # ... which an fp32 run refuses


def test_compiled_ddp_module_skips_the_all_reduce_on_micro_steps(tmp_path):
    torch.distributed.init_process_group("gloo", init_method=f"file://{tmp_path}/init", rank=0,
                                         world_size=1)
    try:  # torch.compile only wraps here: it compiles at the first call, which never comes
        d = Dist(0, 0, 2, torch.device("cpu"), True, False)  # "two ranks": wrap adds DDP
        model = plumbing.wrap(tiny_gpt(), d, compile=True)
        ddp = model._orig_mod  # DDP inside, compiled outside: DDP's graph splits at its buckets
        assert isinstance(ddp, torch.nn.parallel.DistributedDataParallel)
        with plumbing.sync_grads(model, sync=False):
            assert not ddp.require_backward_grad_sync
        with plumbing.sync_grads(model, sync=True):
            assert ddp.require_backward_grad_sync
    finally:
        torch.distributed.destroy_process_group()


def test_compiled_run_times_its_first_step_as_compile(tiny, dpo_cache, monkeypatch):  # noqa: F811
    monkeypatch.setattr(torch, "compile", lambda m, **kw: m)  # the loop's bookkeeping, not inductor
    cfg = dpo_cfg(tiny, "dpo-compile", steps=3, stop_after=2, compile=True)
    dpo.main(cfg)
    first, second = dpo_metrics(cfg.out_dir)
    timed = ("time/step", "time/policy_forward", "tokens_per_sec", "mfu")
    assert first["time/compile"] > 0 and not any(k in first for k in timed) and "loss" in first
    assert all(k in second for k in timed) and "time/compile" not in second


def assert_within_bf16_bounds(x, y):
    """Two bf16 runs' metrics at one step, each response's log-prob computed within E of the
    other's: the loss within βE (β = 0.5), the margin within 2βE, and the grad norm within 2%: the
    gradient's per-pair weight β σ(−βh) moves by at most βE = 0.5% at step 1, more after updates."""
    assert abs(x["loss"] - y["loss"]) <= 0.5 * E, (x["loss"], y["loss"])
    assert abs(x["rewards/margins"] - y["rewards/margins"]) <= E
    assert abs(x["grad_norm"] - y["grad_norm"]) <= 0.02 * y["grad_norm"]


@pytest.mark.parametrize("bf16", ON, indirect=True)
def test_bf16_dpo_step_zero_cached_live_and_one_batch(tiny, dpo_cache, bf16):  # noqa: F811
    pc = dpo_pcfg(tiny, out=f"dpo-bf16-cache-{bf16}")
    precompute.main(pc)  # a bf16 cache, in precompute's micro-batches of 64 pairs
    runs = {}
    for name, kw in (("live", dict(ref="live")), ("cache", {}),  # micro-batches of 8
                     ("one-batch", dict(micro_batch_size=16, stop_after=1))):
        cfg = dpo_cfg(tiny, f"dpo-bf16-{name}-{bf16}", ref_logps=pc.out_dir, **kw)
        dpo.main(cfg)  # (live and cache: also the evaluation, against its own fp32 π_ref)
        runs[name] = dpo_metrics(cfg.out_dir)
    live, cache = runs["live"][0], runs["cache"][0]
    # live: the policy and the bf16 frozen π_ref on one batch: the same bf16 values through the
    # same kernels (on CUDA, SDPA may choose another kernel when grads are needed: within E there)
    if bf16 == "cpu":
        assert live["rewards/chosen"] == live["rewards/margins"] == 0.0
    assert abs(live["loss"] - math.log(2)) <= 0.5 * E and abs(live["rewards/margins"]) <= E
    # cached: the same responses in other batch shapes. With each log-ratio within E and β = 0.5,
    # the loss -log σ(βh) is within βE of ln 2 (slope 1/2, |h| <= 2E) and each reward within βE
    assert abs(cache["loss"] - math.log(2)) <= 0.5 * E and abs(cache["rewards/chosen"]) <= 0.5 * E
    for x, y in zip(runs["cache"], runs["live"]):  # every step
        assert_within_bf16_bounds(x, y)
    # what two ranks change under bf16 besides an fp32 all-reduce is each rank's batch shape: two
    # micro-steps of 8 pairs against one forward of 16 (in one process: one GPU suffices)
    assert_within_bf16_bounds(runs["one-batch"][0], cache)


@needs_cuda
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="two nccl ranks need two GPUs")
def test_bf16_two_ranks_equal_one_process_on_cuda(tiny, dpo_cache):  # noqa: F811
    pc = dpo_pcfg(tiny, out="dpo-bf16-cache-2ranks")
    precompute.main(pc)
    one = dpo_cfg(tiny, "dpo-bf16-1rank", steps=2, micro_batch_size=16, ref_logps=pc.out_dir)
    dpo.main(one)
    two = dpo_cfg(tiny, "dpo-bf16-2ranks", steps=2, micro_batch_size=4, ref_logps=pc.out_dir)
    run_torchrun("dpo.py", [a for k, v in vars(two).items() if isinstance(v, (str, int, float))
                            and not isinstance(v, bool) for a in (f"--{k}", str(v))])
    for x, y in zip(dpo_metrics(one.out_dir), dpo_metrics(two.out_dir)):  # the bounds above
        assert_within_bf16_bounds(x, y)


@pytest.mark.parametrize("bf16", ON, indirect=True)
def test_bf16_ppo_first_ratio_is_one(tiny, bf16, tmp_path):  # noqa: F811
    prompts = tmp_path / "eval.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n"
                               for p in data.read_prompts(f"{tiny.task}/prompts_test.jsonl")[:4]))
    sft_file = f"{tiny.sft}/model.safetensors"  # the critic's trunk (with --reward true, no r_φ)
    cfg = replace(tiny_ppo_config(tiny, sft_file, tmp_path / "ppo", str(prompts), reward="true"),
                  iterations=1, mini_batch=8, ppo_epochs=1)  # one minibatch: all ratios at θ_old
    ppo.main(cfg)  # also the bf16 evaluation, against its own fp32 π_ref
    m = dpo_metrics(cfg.out_dir)[0]
    # old log-probs: the trainer's forward over the whole batch; the update's: micro-batches of 2.
    # Per token within e = E/5 (5x the measured maximum per-token error, 0.00043, as E), so
    # approx_kl, the mean of (ρ-1) - log ρ ≈ Δ²/2, is at most e²/2 (measured on the CPU: 0)
    assert m["clipfrac"] == 0.0 and m["approx_kl"] <= (E / 5) ** 2 / 2, m
    # the rollout copy is bf16, as its broadcast says (2 bytes a parameter), and so it scores its
    # samples apart from the trainer: 0.00085 nats per token measured; at most 5x that
    n_params = sum(p.numel() for p in load_model(sft_file)[0].parameters())
    assert m["broadcast_MB"] * 2**20 == 2 * n_params and m["logprob_gap"] <= 5 * 0.00085, m

# ==================================================================================================
# reliability: non-finite and divergent runs, resume fingerprints, writable outputs,
# kills, truncation, hangs
# ==================================================================================================

CPU = Dist(0, 0, 1, torch.device("cpu"), True, False)  # one process


def own_ref(tiny, folder, edit=None):
    """A copy of the tiny π_ref (model.safetensors + tokenizer.json) in `folder`, its weights
    changed in place by edit(model) if given; returns the model file's path."""
    os.makedirs(folder, exist_ok=True)
    shutil.copyfile(f"{tiny.sft}/tokenizer.json", os.path.join(folder, "tokenizer.json"))
    model, meta = load_model(f"{tiny.sft}/model.safetensors")
    if edit is not None:
        with torch.no_grad():
            edit(model)
    save_model(model, os.path.join(folder, "model.safetensors"), meta)
    return os.path.join(folder, "model.safetensors")


def tiny_reward_config(tiny, out, **kw):
    return reward.Config(**{**dict(out_dir=str(out), sft=f"{tiny.sft}/model.safetensors",
                                   train_pairs=f"{tiny.root}/dpo-data/pairs_train.jsonl",
                                   val_pairs=f"{tiny.root}/dpo-data/pairs_val.jsonl",
                                   prompts=f"{tiny.task}/prompts_test.jsonl", steps=12,
                                   batch_size=8, micro_batch_size=8, eval_every=100,
                                   offset_samples=8), **kw})


def test_guards_stop_and_a_non_finite_checkpoint_is_never_written(tmp_path):
    ckpt = str(tmp_path)
    checkpoint.stop_if_diverged("loss", 69.0, 69.3, "100x the first", "step 2", ckpt, "")
    with pytest.raises(SystemExit, match=r"diverged: loss 70 at step 2 is above 69.3 \(100x the "
                                         r"first\).*last checkpoint is kept: none.*lower --lr"):
        checkpoint.stop_if_diverged("loss", 70.0, 69.3, "100x the first", "step 2", ckpt,
                                    "Try a lower --lr.")
    net = torch.nn.Linear(3, 2)
    checkpoint.save_checkpoint(ckpt, 1, {"model": net}, {})
    with torch.no_grad():
        net.bias[1] = float("inf")
    with pytest.raises(SystemExit, match=r"non-finite values in model/bias at step 2: not saved.*"
                                         r"kept: .* at step 1"):
        checkpoint.save_checkpoint(ckpt, 2, {"model": net}, {})
    assert checkpoint.checkpoint_state(ckpt)["step"] == 1
    assert sorted(os.listdir(ckpt)) == ["latest.json", "step-0000001.safetensors"]


def test_sft_and_reward_stop_before_a_non_finite_update(tiny, dpo_cache, tmp_path):  # noqa: F811
    # lr 1e30: step 1's update leaves finite but enormous weights, whose step-2 loss or gradient is
    # not finite. The guard stops before step 2's update: step 1's checkpoint stays, and no
    # non-finite tensor is written.
    with pytest.raises(SystemExit, match=r"non-finite loss \(nan\).* at step 2: stopped before "):
        sft.main(sft.Config(**{**sft_args(tiny, tmp_path / "sft", steps=4, lr=1e30),
                               "ckpt_every": 1}))
    with pytest.raises(SystemExit, match=r"non-finite .* at step 2: stopped before the update"):
        reward.main(tiny_reward_config(tiny, tmp_path / "reward", steps=4, lr=1e30, warmup=1,
                                       ckpt_every=1))
    for stage in ("sft", "reward"):
        assert checkpoint.checkpoint_state(str(tmp_path / stage / "ckpt"))["step"] == 1
        ckpt = load_file(str(tmp_path / stage / "ckpt" / "step-0000001.safetensors"))
        assert all(torch.isfinite(v).all() for v in ckpt.values())
        assert not os.path.exists(tmp_path / stage / "model.safetensors")


def test_a_non_finite_reference_is_named_as_the_cause(tiny, dpo_cache, tmp_path):  # noqa: F811
    pairs = str(tmp_path / "pairs.jsonl")
    shutil.copyfile(f"{tiny.task}/pairs_val.jsonl", pairs)
    nan = lambda m: m.transformer.h[0].mlp.c_fc.weight.fill_(float("nan"))  # noqa: E731
    nan_ref = own_ref(tiny, tmp_path / "nan", nan)
    pc = precompute.Config(out_dir=str(tmp_path / "cache"), ref_model=nan_ref, train_pairs=pairs,
                           val_pairs=pairs)
    says = "nan/model.safetensors holds non-finite weights .* retrain it"
    with pytest.raises(SystemExit, match=says):  # not "N examples have no reference log-probs"
        precompute.main(pc)
    with pytest.raises(SystemExit, match=says):  # not "Try a lower --lr"
        dpo.main(dpo_cfg(tiny, "unused", out_dir=str(tmp_path / "dpo"), ref_model=nan_ref,
                         train_pairs=pairs, val_pairs=pairs, ref="live"))
    with pytest.raises(SystemExit, match=says):  # how ppo.py loads π_ref and r_φ, reward.py π_ref
        load_model(nan_ref, "cpu", head="scalar")
    # finite weights whose logits overflow: the log-probs are named, not a missing cache row
    big = lambda m: m.transformer.ln_f.weight.fill_(1e38)  # noqa: E731
    pc = replace(pc, ref_model=own_ref(tiny, tmp_path / "big", big))
    with pytest.raises(SystemExit, match=r"π_ref gives non-finite log-probs for \d+ examples"):
        precompute.main(pc)


def test_a_reference_without_its_tokenizer_is_named(tiny, tmp_path):
    os.makedirs(tmp_path / "ref")
    shutil.copyfile(f"{tiny.sft}/model.safetensors", tmp_path / "ref" / "model.safetensors")
    pairs = f"{tiny.task}/pairs_val.jsonl"
    says = "ref/tokenizer.json does not exist: π_ref's tokenizer is read from the folder of --"
    with pytest.raises(SystemExit, match=says + "ref_model"):  # and so dpo.py
        precompute.main(precompute.Config(out_dir=str(tmp_path / "cache"), train_pairs=pairs,
                                          ref_model=str(tmp_path / "ref" / "model.safetensors"),
                                          val_pairs=pairs))
    with pytest.raises(SystemExit, match=says + "sft"):
        reward.main(tiny_reward_config(tiny, tmp_path / "reward", train_pairs=pairs,
                                       val_pairs=pairs,
                                       sft=str(tmp_path / "ref" / "model.safetensors")))


def test_a_reward_model_of_another_tokenizer_is_refused_and_a_reformatted_one_is_not(
        tiny, tiny_rm, ppo_test_prompts, tmp_path):
    os.makedirs(tmp_path / "rm")
    rm = str(tmp_path / "rm" / "model.safetensors")
    shutil.copyfile(tiny_rm / "model.safetensors", rm)
    spec = json.loads((tiny_rm / "tokenizer.json").read_text())
    (tmp_path / "rm" / "tokenizer.json").write_text(json.dumps(spec, separators=(",", ":")))
    cfg = tiny_ppo_config(tiny, rm, tmp_path / "ppo", ppo_test_prompts)
    ocfg = online_dpo.Config(out_dir=str(tmp_path / "online"), sft=cfg.sft, reward_model=rm,
                             prompts=cfg.prompts, test_prompts=ppo_test_prompts, rollout_batch=8)
    ppo.setup(cfg, CPU, print)  # the same tokenizer written compact: accepted
    online_dpo.setup(ocfg, CPU, print)
    vocab = spec["model"]["vocab"]
    a, b = sorted(vocab)[10:12]
    vocab[a], vocab[b] = vocab[b], vocab[a]  # two words trade ids: another tokenizer
    (tmp_path / "rm" / "tokenizer.json").write_text(json.dumps(spec))
    says = f"--reward_model {rm} was trained with another tokenizer"
    with pytest.raises(SystemExit, match=re.escape(says)):
        ppo.setup(cfg, CPU, print)
    with pytest.raises(SystemExit, match=re.escape(says)):
        online_dpo.setup(ocfg, CPU, print)
    online_dpo.setup(replace(ocfg, reward="true"), CPU, print)  # no r_φ read: no refusal
    os.remove(tmp_path / "rm" / "tokenizer.json")  # an r_φ from before reward.py wrote one
    with pytest.raises(SystemExit, match="rm/tokenizer.json does not exist: --reward_model"):
        ppo.setup(cfg, CPU, print)


def test_resume_refuses_a_checkpoint_of_other_inputs_and_names_them(tiny, tmp_path):
    ckpt, cfg, net = str(tmp_path), sft.Config(out_dir=str(tmp_path)), torch.nn.Linear(2, 2)
    a, b = tmp_path / "a.txt", tmp_path / "b.tokenizer.json"
    a.write_text("one\n"), shutil.copyfile(f"{tiny.task}/tokenizer.json", b)
    files = {"--train_text": str(a), "--tokenizer": str(b), "--init_from": ""}
    inputs = checkpoint.input_fingerprint(files, [[1, 2]])
    assert set(inputs) == {f"--train_text {a}", f"--tokenizer {b}", "token ids"}  # "": unused
    checkpoint.save_checkpoint(ckpt, 3, {"model": net}, {"config": asdict(cfg), "inputs": inputs})
    assert checkpoint.resume(ckpt, cfg, {"model": net}, "cpu", print, inputs)[0] == 3
    # the same tokenizer written compact: the same inputs
    b.write_text(json.dumps(json.loads(b.read_text()), separators=(",", ":")))
    assert checkpoint.input_fingerprint(files, [[1, 2]]) == inputs
    a.write_text("one, edited\n")  # the data file changed: named with its sha256, and what to do
    changed = checkpoint.input_fingerprint(files, [[1, 3]])
    with pytest.raises(SystemExit, match=rf"other inputs, changed since: --train_text {a} \(sha256 "
                                         r"[0-9a-f]{12} -> [0-9a-f]{12}\)\. Pass --no-resume .* "
                                         r"another --out_dir"):
        checkpoint.resume(ckpt, cfg, {"model": net}, "cpu", print, changed)
    # the same files, other token ids (the truncation code changed): the catch-all says so
    with pytest.raises(SystemExit, match=r"changed since: the token ids of the training data"):
        checkpoint.resume(ckpt, cfg, {"model": net}, "cpu", print,
                          {**inputs, "token ids": "0" * 64})
    no = replace(cfg, resume=False)
    assert checkpoint.resume(ckpt, no, {"model": net}, "cpu", print, changed) == (0, {})
    # an older version's
    checkpoint.save_checkpoint(ckpt, 4, {"model": net}, {"config": asdict(cfg)})
    with pytest.raises(SystemExit, match="records no fingerprint of its inputs"):
        checkpoint.resume(ckpt, cfg, {"model": net}, "cpu", print, inputs)
    # files damaged outside this code (its own writes are atomic): one error line, no traceback
    step = tmp_path / "step-0000004.safetensors"
    step.write_bytes(step.read_bytes()[:100])
    (tmp_path / "latest.json").write_text("{garbage")
    for damaged in ("latest.json", "step-0000004.safetensors"):
        with pytest.raises(SystemExit, match=r"holds a checkpoint that cannot be read \(.*\); pass "
                                             "--no-resume"):
            checkpoint.resume(ckpt, cfg, {"model": net}, "cpu", print, inputs)
        (tmp_path / "latest.json").write_text(json.dumps({"file": step.name, "step": 4}))
    checkpoint.save_checkpoint(ckpt, 5, {"model": net}, {})  # --no-resume writes over a damaged one
    assert sorted(os.listdir(ckpt))[-2:] == ["latest.json", "step-0000005.safetensors"]


def test_dpo_refuses_to_resume_after_its_inputs_changed(tiny, dpo_cache, tmp_path):  # noqa: F811
    # the issue's runs: stop after 1 step; retrain π_ref and rebuild the cache (then also shrink
    # the pairs file and rebuild), and run again: the checkpoint's policy started from the old ones
    ref = own_ref(tiny, tmp_path / "ref")
    rows = open(f"{tiny.root}/dpo-data/pairs_train.jsonl").readlines()[:64]
    (tmp_path / "pairs.jsonl").write_text("".join(rows))
    pc = precompute.Config(out_dir=str(tmp_path / "cache"), ref_model=ref,
                           train_pairs=str(tmp_path / "pairs.jsonl"),
                           val_pairs=str(tmp_path / "pairs.jsonl"))
    precompute.main(pc)
    cfg = dpo_cfg(tiny, "unused", out_dir=str(tmp_path / "dpo"), ref_model=ref,
                  train_pairs=pc.train_pairs, val_pairs=pc.val_pairs, ref_logps=pc.out_dir, steps=2,
                  stop_after=1)
    dpo.main(cfg)
    own_ref(tiny, tmp_path / "ref", lambda m: m.transformer.ln_f.bias.add_(0.01))  # "retrained"
    precompute.main(pc)
    with pytest.raises(SystemExit, match=r"other inputs, changed since: --ref_model .*ref/model."
                                         r"safetensors \(sha256 .*\)\. Pass --no-resume"):
        dpo.main(cfg)
    (tmp_path / "pairs.jsonl").write_text("".join(rows[:32]))  # the pairs file shrank
    precompute.main(pc)
    with pytest.raises(SystemExit, match=r"--ref_model .*; --train_pairs .*pairs.jsonl \(sha256"):
        dpo.main(cfg)
    dpo.main(replace(cfg, resume=False))  # what the message says to do
    assert [m["step"] for m in dpo_metrics(cfg.out_dir)] == [1]
    cache = tmp_path / "cache" / "train.safetensors"  # damaged outside this code
    cache.write_bytes(cache.read_bytes()[:100])
    with pytest.raises(SystemExit, match=r"train.safetensors cannot be read \(.*\); rebuild it "
                                         "with: python precompute.py --out_dir"):
        dpo.main(cfg)


def test_ppo_refuses_to_resume_after_its_prompts_changed(tiny, tiny_rm, tmp_path):  # noqa: F811
    lines = open(f"{tiny.task}/prompts_train.jsonl").readlines()[:32]
    (tmp_path / "prompts.jsonl").write_text("".join(lines))
    cfg = replace(tiny_ppo_config(tiny, str(tiny_rm / "model.safetensors"), tmp_path / "ppo",
                                  str(tmp_path / "prompts.jsonl"), stop_after=1),
                  prompts=str(tmp_path / "prompts.jsonl"))
    ppo.main(cfg)
    (tmp_path / "prompts.jsonl").write_text("".join(lines[:16]))
    with pytest.raises(SystemExit, match=r"changed since: --prompts .*prompts.jsonl \(sha256"):
        ppo.main(cfg)


def test_a_val_file_without_a_usable_pair_is_refused_before_training(tiny, dpo_cache,  # noqa: F811
                                                                     tmp_path):
    # every row's two responses differ only after 64 tokens: once cut, they are identical
    long = " the movie is good ." * 20
    row = json.dumps({"prompt": "i liked it .", "chosen": long + " yes", "rejected": long + " no"})
    (tmp_path / "val.jsonl").write_text((row + "\n") * 3)
    val, train = str(tmp_path / "val.jsonl"), f"{tiny.root}/dpo-data/pairs_train.jsonl"
    says = "val.jsonl has no usable pair: in each row chosen and rejected are identical once cut to"
    with pytest.raises(SystemExit, match=says):
        dpo.main(dpo_cfg(tiny, "unused", out_dir=str(tmp_path / "dpo"), val_pairs=val, ref="live"))
    with pytest.raises(SystemExit, match=says):
        reward.main(tiny_reward_config(tiny, tmp_path / "reward", val_pairs=val))
    for stage in ("dpo", "reward"):  # refused before the first step
        assert not os.path.exists(tmp_path / stage / "metrics.jsonl")
    with pytest.raises(SystemExit, match=says):
        precompute.main(precompute.Config(out_dir=str(tmp_path / "cache"), train_pairs=train,
                                          ref_model=f"{tiny.sft}/model.safetensors", val_pairs=val))


def test_the_metrics_rewrite_at_resume_is_atomic(tmp_path, monkeypatch):
    lines = "".join(json.dumps({"step": s, "loss": 1.0 / s}) + "\n" for s in (1, 2, 3))
    (tmp_path / "metrics.jsonl").write_text(lines)

    class Killed(Exception):
        pass

    def open_then_die(path, mode="r", **kw):  # a kill after open(path, "w"), before any write
        f = open(path, mode, **kw)
        if "w" in mode:
            f.close()
            raise Killed
        return f

    monkeypatch.setattr(plumbing, "open", open_then_die, raising=False)  # shadows the builtin
    with pytest.raises(Killed):
        plumbing.Logger(str(tmp_path), CPU).start(2)
    assert (tmp_path / "metrics.jsonl").read_text() == lines  # the history is intact
    monkeypatch.undo()
    plumbing.Logger(str(tmp_path), CPU).start(2)
    assert [json.loads(x)["step"] for x in open(tmp_path / "metrics.jsonl")] == [1, 2]


def test_a_second_run_into_one_folder_is_refused_and_a_killed_runs_lock_is_not(tmp_path):
    out = tmp_path / "dpo"
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time, checkpoint, plumbing; checkpoint.prepare_outputs("
         f"{{{str(out)!r}: '--out_dir'}}, plumbing.Dist(0, 0, 1, 'cpu', True, False), print); "
         "print('locked', flush=True); time.sleep(600)"],
        cwd=HERE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(SystemExit) as e:
            checkpoint.prepare_outputs({str(out): "--out_dir"}, CPU, print)
        assert (f"{out} is in use by another run (pid {holder.pid} on " in str(e.value)
                and "pick another --out_dir" in str(e.value))
        assert str(out.resolve()) not in plumbing.LOCKS
    finally:
        holder.kill()  # SIGKILL: no cleanup runs, the lock file stays behind
        holder.wait()
    assert (out / ".lock").exists()
    said, run = [], plumbing.Dist(0, 0, 1, torch.device("cpu"), True, False)
    checkpoint.prepare_outputs({str(out): "--out_dir"}, run, said.append)  # a resume goes on
    assert str(out.resolve()) in plumbing.LOCKS and not said
    checkpoint.prepare_outputs({str(out): "--out_dir"}, CPU, said.append)  # this process again
    assert f"pid {os.getpid()} on " in (out / ".lock").read_text()
    # the run's teardown unlocks its folder: another process may run there now (a torchrun resume
    # of a run this process stopped with --stop_after)
    plumbing.teardown(run)
    assert str(out.resolve()) not in plumbing.LOCKS
    p = subprocess.run([sys.executable, "-c", "import checkpoint, plumbing; checkpoint."
                        f"prepare_outputs({{{str(out)!r}: '--out_dir'}}, plumbing.Dist(0, 0, 1, "
                        "'cpu', True, False), print)"], cwd=HERE, capture_output=True, text=True)
    assert p.returncode == 0, p.stderr


def test_a_kill_during_a_checkpoint_write_leaks_nothing(tmp_path):
    ckpt = tmp_path / "ckpt"
    net = torch.nn.Linear(4, 4)
    checkpoint.save_checkpoint(str(ckpt), 1, {"model": net}, {})
    # Killed mid-write for real: a file-size limit of 64 KiB, and SIGXFSZ's default action (Python
    # ignores it), end the process inside the write of a 4 MiB tensor.
    code = ("import resource, signal, torch, checkpoint; signal.signal(signal.SIGXFSZ, "
            "signal.SIG_DFL); resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 16, 1 << 16)); "
            f"checkpoint.save_checkpoint({str(ckpt)!r}, 2, {{'w': torch.zeros(1 << 20)}}, {{}})")
    p = subprocess.run([sys.executable, "-c", code], cwd=HERE, capture_output=True)
    assert p.returncode == -25  # SIGXFSZ
    # what it leaves: our temp file (safetensors' save_file would leave its hidden .tmpXXXXXX)
    leaked = set(os.listdir(ckpt)) - {"latest.json", "step-0000001.safetensors"}
    assert leaked and all(checkpoint.STALE_TEMP.fullmatch(f) for f in leaked), leaked
    (ckpt / "notes.tmp").write_text("not ours")  # not a name we write: kept
    said = []
    checkpoint.prepare_outputs({str(ckpt): "--out_dir"}, CPU, said.append)
    assert sorted(os.listdir(ckpt)) == [".lock", "latest.json", "notes.tmp",
                                        "step-0000001.safetensors"]
    assert said == [f"removed temp files that a killed run left in {ckpt}: "
                    f"{', '.join(sorted(leaked))}"]
    assert checkpoint.checkpoint_state(str(ckpt))["step"] == 1  # the previous checkpoint, intact
    # a save cleans up too: a killed save's temp files go with the checkpoint it replaces
    (ckpt / ".tmpAb3dE9").write_bytes(b"x" * 100)
    (ckpt / "step-0000002.safetensors.tmp").write_bytes(b"x")
    checkpoint.save_checkpoint(str(ckpt), 3, {"model": net}, {})
    assert sorted(os.listdir(ckpt)) == [".lock", "latest.json", "notes.tmp",
                                        "step-0000003.safetensors"]


def test_a_full_disk_names_the_file_and_leaves_no_temp_file(tmp_path, capsys):
    if not os.path.exists("/dev/full"):
        pytest.skip("no /dev/full here (Linux's device whose every write fails with ENOSPC)")
    # path + ".tmp" made a link to /dev/full: the write fails as on a full disk, for real
    writes = {"text": lambda p: plumbing.atomic_write_text(p, "new"),
              "tensors": lambda p: checkpoint.save_safetensors({"w": torch.ones(4)}, p, {}),
              "copy": lambda p: checkpoint.atomic_copy(__file__, p)}
    for name, write in writes.items():
        path = tmp_path / name
        path.write_text("as it was")
        os.symlink("/dev/full", f"{path}.tmp")
        with pytest.raises(SystemExit) as e:
            write(str(path))
        assert str(e.value).startswith(f"error: cannot write {path}: no space left on the device;")
        assert path.read_text() == "as it was" and not os.path.lexists(f"{path}.tmp"), name
    # a torn last line of metrics.jsonl (a kill mid-write): dropped on resume, with a warning
    log = plumbing.Logger(str(tmp_path), CPU)
    rows = [json.dumps({"step": s, "loss": 1.0}) for s in (1, 2, 3)]
    (tmp_path / "metrics.jsonl").write_text("\n".join(rows) + "\n" + '{"step": 4, "lo')
    log.start(3)
    assert (tmp_path / "metrics.jsonl").read_text() == "\n".join(rows) + "\n"
    assert "warning: dropped the torn last line of" in capsys.readouterr().out
    (tmp_path / "metrics.jsonl").write_text(rows[0] + "\n{torn\n" + rows[1] + "\n")  # not the last
    with pytest.raises(SystemExit, match=r"metrics.jsonl:2: not a JSON line; only the last line"):
        log.start(3)


def test_outputs_that_cannot_be_written_are_refused_before_any_work(tiny, dpo_cache,  # noqa: F811
                                                                    tmp_path):
    (tmp_path / "a_file").write_text("in the way")
    in_the_way = str(tmp_path / "a_file")
    # refused before the inputs are even looked at (the missing train text would say so)
    cfg = {**sft_args(tiny, in_the_way), "train_text": str(tmp_path / "missing.txt")}
    with pytest.raises(SystemExit, match=f"{in_the_way} is a file, not a folder: move it away, or "
                                         "pick another --out_dir"):
        sft.main(sft.Config(**cfg))
    os.makedirs(tmp_path / "dpo")
    (tmp_path / "dpo" / "ckpt").write_text("in the way")  # found at the first checkpoint, before
    with pytest.raises(SystemExit, match="dpo/ckpt is a file, not a folder"):
        dpo.main(dpo_cfg(tiny, "unused", out_dir=str(tmp_path / "dpo")))
    assert sorted(os.listdir(tmp_path / "dpo")) == [".lock", "ckpt"]  # no step run, no metrics
    # a cache to be built into a file: refused before anything is built or trained
    with pytest.raises(SystemExit, match=f"{in_the_way} is a file, not a folder: move it away, or "
                                         "pick another --ref_logps"):
        dpo.main(dpo_cfg(tiny, "unused", out_dir=str(tmp_path / "dpo2"), ref_logps=in_the_way))
    # a folder under a file cannot be created
    with pytest.raises(SystemExit, match=r"cannot write in .*a_file/sub \(Not a directory\): pick "
                                         "another --out_dir"):
        precompute.main(dpo_pcfg(tiny, out=str(tmp_path / "a_file" / "sub")))


def test_finite_divergence_stops_every_trainer(tiny, dpo_cache, tiny_rm, tmp_path):  # noqa: F811
    # dpo.py --lr 30, as in the issue: the loss goes from log 2 to ~3e4 at step 2, all finite
    cfg = dpo_cfg(tiny, "dpo-diverged", lr=30.0)
    with pytest.raises(SystemExit, match=r"diverged: loss .* at step 2 is above 6.931 \(10x the "
                                         r"first step's 0.6931\)"):
        dpo.main(cfg)
    assert not os.path.exists(os.path.join(cfg.out_dir, "model.safetensors"))
    with pytest.raises(SystemExit, match=r"diverged: loss .* at step \d is above .* \(10x the "):
        sft.main(sft.Config(**sft_args(tiny, tmp_path / "sft", steps=6, lr=30.0)))
    with pytest.raises(SystemExit, match=r"diverged: loss .* at step \d is above 6.931 \(10x "):
        reward.main(tiny_reward_config(tiny, tmp_path / "reward", steps=6, lr=30.0, warmup=1))
    prompts = tmp_path / "eval.jsonl"
    prompts.write_text(json.dumps({"prompt": "the movie is"}) + "\n")
    cfg = tiny_ppo_config(tiny, str(tiny_rm / "model.safetensors"), tmp_path / "ppo", str(prompts),
                          lr=1.0)
    with pytest.raises(SystemExit, match=r"diverged: approx_kl .* at iteration 1 is above 1 \("):
        ppo.main(cfg)
    assert not os.path.exists(tmp_path / "ppo" / "ckpt" / "latest.json")
    # online DPO --lr 1e3: after one step π never ends, every pair ties, the loss is 0 from then on
    # and never crosses its bound
    cfg = online_dpo.Config(out_dir=str(tmp_path / "online"), sft=f"{tiny.sft}/model.safetensors",
                            reward="true", prompts=f"{tiny.task}/prompts_train.jsonl",
                            test_prompts=str(prompts), rollout_batch=8, micro_batch_size=4,
                            iterations=4, warmup=0, lr=1e3, eval_k=1)
    with pytest.raises(SystemExit, match=r"collapsed: every pair of round 2 tied \(the policy no "):
        online_dpo.main(cfg)
    assert not os.path.exists(tmp_path / "online" / "model.safetensors")


def test_truncation_counts_lost_eos_per_side_and_warns(tiny, dpo_cache, tmp_path,  # noqa: F811
                                                       capsys):
    tok = data.load_tokenizer(f"{tiny.sft}/tokenizer.json")
    long, short = " the movie is good ." * 10, " it felt odd ."
    rows = [dict(prompt="i liked it .", chosen=long, rejected=short),
            dict(prompt="i hated it .", chosen=short, rejected=long + " and bad .")]
    ex, st = data.tokenize_pairs(tok, rows, 32, 8)
    assert (st["chosen_lost_eos"], st["rejected_lost_eos"], st["truncated_response"]) == (1, 1, 2)
    assert [e[k][-1] == tok.eos for e in ex for k in ("chosen", "rejected")] == [0, 1, 1, 0]

    def stats(c, r, n=100, tp=0):
        return dict(rows=n, truncated_prompt=tp, truncated_response=max(c, r), unusable=0,
                    chosen_lost_eos=c, rejected_lost_eos=r)

    warn = lambda s: data.truncation_warning(s, "f", 64, "")  # noqa: E731
    assert warn(stats(4, 0)) == ""  # 4 of 100 cut, and 4 = 2·√4: within chance
    assert "cuts f unevenly: 0 of 100 prompts" in warn(stats(5, 0))  # 5 > 2·√5 = 4.47
    assert "cuts f heavily:" in warn(stats(3, 3, tp=6))  # 6 > 5% of 100
    w = data.truncation_warning(stats(49, 3, n=66, tp=61), "hh.jsonl", 64, "Fix it.")  # the issue's
    assert w.startswith("WARNING: truncation to 64 tokens cuts hh.jsonl heavily and unevenly: 61 "
                        "of 66 prompts and 49 of 66 pairs' responses cut; 49 chosen and 3 rejected "
                        "responses lost their EOS.") and w.endswith("Fix it.")
    # a stage says it, and what to do, before anything else can fail (here: too few pairs)
    (tmp_path / "hh.jsonl").write_text("".join(json.dumps(dict(rows[0], prompt=f"i liked {i} ."))
                                               + "\n" for i in range(8)))
    cfg = dpo_cfg(tiny, "unused", out_dir=str(tmp_path / "dpo"), ref="live", max_len=32,
                  max_prompt_len=8, train_pairs=str(tmp_path / "hh.jsonl"))
    with pytest.raises(SystemExit, match="fewer than --batch_size 16"):
        dpo.main(cfg)
    out = capsys.readouterr().out
    assert ("hh.jsonl heavily and unevenly: 0 of 8 prompts and 8 of 8 pairs' responses cut; 8 "
            "chosen and 0 rejected") in out and "Raise --max_len (up to π_ref's block_size)" in out


def test_checkpoint_and_cache_files_get_the_mode_of_the_json_beside_them(tmp_path):
    old = os.umask(0o027)
    try:
        checkpoint.save_checkpoint(str(tmp_path / "ckpt"), 1, {"model": torch.nn.Linear(2, 2)}, {})
        precompute.save_ref_logps(str(tmp_path / "train.safetensors"), torch.zeros(2, 3), {}, {},
                                  {})
        checkpoint.atomic_write_json(str(tmp_path / "eval.json"), {})
        save_model(GPT(GPTConfig(block_size=8, vocab_size=10, n_layer=1, n_head=1, n_embd=4)),
                   str(tmp_path / "model.safetensors"), {})
    finally:
        os.umask(old)
    mode = lambda p: os.stat(tmp_path / p).st_mode & 0o777  # noqa: E731
    assert mode("eval.json") == 0o640  # 0666 less the umask, as open() gives
    for p in ("ckpt/step-0000001.safetensors", "ckpt/latest.json", "train.safetensors",
              "model.safetensors"):
        assert mode(p) == 0o640, p  # safetensors alone would leave 0600


def test_too_little_data_says_how_much_there_is(tiny, dpo_cache, tmp_path):  # noqa: F811
    (tmp_path / "five.txt").write_text("the movie is good . it felt odd .\n" * 5)
    with pytest.raises(SystemExit, match="five.txt has 5 usable texts, fewer than --batch_size 16"):
        sft.main(sft.Config(**{**sft_args(tiny, tmp_path / "sft"),
                               "train_text": str(tmp_path / "five.txt")}))
    rows = open(f"{tiny.root}/dpo-data/pairs_train.jsonl").readlines()[:5]
    (tmp_path / "five.jsonl").write_text("".join(rows))
    five = str(tmp_path / "five.jsonl")
    with pytest.raises(SystemExit, match="five.jsonl has 5 usable pairs, fewer than --batch_size "
                                         "16"):
        dpo.main(dpo_cfg(tiny, "unused", out_dir=str(tmp_path / "dpo"), train_pairs=five,
                         ref="live"))
    with pytest.raises(SystemExit, match="five.jsonl has 5 usable pairs, fewer than --batch_size "
                                         "8"):
        reward.main(tiny_reward_config(tiny, tmp_path / "reward", train_pairs=five))


def test_reward_resumed_equals_uninterrupted(tiny, dpo_cache, tmp_path):  # noqa: F811
    reward.main(tiny_reward_config(tiny, tmp_path / "full"))
    reward.main(tiny_reward_config(tiny, tmp_path / "split", stop_after=5))
    reward.main(tiny_reward_config(tiny, tmp_path / "split"))  # resumes at step 5
    a, b = (load_file(str(tmp_path / n / "model.safetensors")) for n in ("full", "split"))
    assert all(torch.equal(a[k], b[k]) for k in a)  # the same operations in the same order
    steps = [[json.loads(x)["step"] for x in open(tmp_path / n / "metrics.jsonl")]
             for n in ("full", "split")]
    assert steps[0] == steps[1] == [1, 10, 12]  # no extra line at the resumed run's first step


# -----------------------------------------------------------------------------
# hangs: a hung run is killed whole, a rank left in a collective fails naming it, and teardown
# exits with a gloo work still running (run_whole, plumbing.init_distributed, plumbing.teardown)


def processes_naming(path):
    """The pids of the live processes whose command line holds `path` (pgrep -f, from /proc)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if str(path).encode() in f.read():
                    found.append(int(pid))
        except OSError:
            pass
    return found


def rank_script(path, body):
    """A script for torchrun's ranks: the repo importable, then `body`."""
    path.write_text(f"import sys\nsys.path.insert(0, {HERE!r})\n{body}")
    return str(path)


def test_a_hung_run_is_killed_whole(tmp_path):
    # two ranks that never end, in no collective: no timeout of theirs can end them
    script = rank_script(tmp_path / "sleep.py", f"import os, time\nopen(f'{tmp_path}/started."
                         "{os.environ[\"RANK\"]}', 'w').close()\ntime.sleep(600)\n")
    try:
        with pytest.raises(pytest.fail.Exception, match="still running after 20 s: killed"):
            run_torchrun(script, [], timeout=20)
        assert os.path.exists(tmp_path / "started.0") and os.path.exists(tmp_path / "started.1")
        assert not processes_naming(script)  # the launcher and both ranks are gone
    finally:  # a broken harness leaves them: not beyond this test
        for pid in processes_naming(script):
            os.kill(pid, signal.SIGKILL)


def test_a_rank_left_in_a_collective_fails_fast_naming_it(tmp_path):
    script = rank_script(tmp_path / "skip.py", "import plumbing\nd = plumbing.init_distributed()\n"
                         "if d.rank == 0:\n    plumbing.reduce_sums(d, n=1)  # rank 1 skips it\n"
                         "plumbing.teardown(d)\n")
    t0 = time.monotonic()  # 5 s to wait in a collective; the harness would kill the run at 120
    (p,) = run_whole([torchrun(script, [], ["--nproc_per_node=2", "--standalone"])], 120,
                     {**torchrun_env(120), "DIST_TIMEOUT_S": "5"})
    assert p.returncode != 0 and time.monotonic() - t0 < 60
    # each rank's traceback names the collective it waited in; the first to give up says why (the
    # other may see it leave before its own clock runs out: a race the machine's load decides)
    assert re.search(r"\[rank0\]:.*in all_reduce_sum\n.*dist\.all_reduce", p.stderr)
    assert re.search(r"\[rank1\]:.*in barrier", p.stderr)
    assert "Timed out waiting 5000ms" in p.stderr
    assert not processes_naming(script)


def test_teardown_exits_with_a_gloo_work_in_flight(tmp_path):
    """A DDP run's ranks leave main() while a gloo thread still holds a work and needs the GIL to
    free its tensor. Were the DDP module's Reducer to drop the group's last reference then, it
    would join gloo's threads with the GIL held and wait forever (a rank of tiny_rm's reward.py
    did, in 5 of 60 runs on 2 busy cores). Here the work is made to last: rank 1 joins it a second
    late, as teardown destroys the group, so that in the broken order every run hangs."""
    script = rank_script(tmp_path / "late.py", """import time
import torch
import torch.distributed as dist
import plumbing


def main():
    d = plumbing.init_distributed()
    model = plumbing.wrap(torch.nn.Linear(4, 4), d)  # DDP
    model(torch.ones(2, 4)).sum().backward()
    destroy = dist.destroy_process_group

    def destroy_with_a_late_work():
        time.sleep(d.rank)
        dist.all_reduce(torch.ones(3), async_op=True)  # neither the handle nor the tensor kept
        destroy()
    dist.destroy_process_group = destroy_with_a_late_work
    plumbing.teardown(d)


main()  # the DDP module is freed as main returns
print("exited", flush=True)
""")
    (p,) = run_whole([torchrun(script, [], ["--nproc_per_node=2", "--standalone"])], 90,
                     torchrun_env(90))
    assert p.returncode == 0 and p.stdout.count("exited") == 2, p.stderr[-3000:]


# ==================================================================================================
# --fsdp: FSDP2 (fully_shard) instead of DDP, through plumbing.wrap; two gloo ranks
# ==================================================================================================

def _fsdp_worker(rank, init_file, result_dir):
    torch.distributed.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                                         world_size=2)
    d = Dist(rank, rank, 2, torch.device("cpu"), rank == 0, False)
    ref, model = tiny_gpt(), tiny_gpt()  # float64, the same init: one process, and two shards
    plumbing.wrap(model, d, fsdp=True)
    x = torch.randint(0, 13, (4, 2, 8), generator=torch.Generator().manual_seed(1))
    nll = lambda m, xb: -sequence_logprobs(  # noqa: E731
        m, xb, F.pad(xb[:, 1:], (0, 1), value=-100)).sum()
    sum(nll(ref, xb) for xb in x).div(4).backward()  # one process: the 4 micro-batches' mean
    r = {"blocks_sharded": all(isinstance(m, plumbing.FSDPModule)  # each block its own unit
                               for m in (model, *model.transformer.h))}
    for m, i in enumerate((rank, 2 + rank)):  # this rank's 2 micro-batches; FSDP averages ranks
        with plumbing.sync_grads(model, m == 1):
            (nll(model, x[i]) * 2 / 4).backward()
        if m == 0:  # no reduce-scatter yet: the sharded grads are not there
            r["no_grads_before_sync"] = all(p.grad is None for p in model.parameters())
    names = dict(ref.named_parameters())
    diff = lambda: max((p.grad.full_tensor() - names[n].grad).abs().max().item()  # noqa: E731
                       for n, p in model.named_parameters())
    r["grad_diff"] = diff()
    norm_ref = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.01).item()
    r["norm_diff"] = abs(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.01).item() - norm_ref)
    r["clipped_grad_diff"] = diff()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    opt.step()
    torch.optim.AdamW(ref.parameters(), lr=1e-2).step()
    state = checkpoint.full_state(model)  # whole tensors, gathered on every rank here
    r["state_diff"] = max((v - ref.state_dict()[k]).abs().max().item() for k, v in state.items())
    r["state_keys"] = sorted(state) == sorted(dict(ref.named_parameters()))  # the tie once
    with torch.no_grad(), plumbing.gathered(model):  # rank 0 runs none, rank 1 two: no collective
        outs = [model(x[0, :, :5 + k]) - ref(x[0, :, :5 + k]) for k in range(2 * rank)]
    r["gathered_diff"] = max([o.abs().max().item() for o in outs], default=0.0)
    # a checkpoint written from the shards loads into one process and into a sharded model alike
    ckpt = os.path.join(result_dir, "ckpt")
    checkpoint.save_checkpoint(ckpt, 1, {"model": model, "optim": opt}, {}, write=rank == 0)
    torch.distributed.barrier()
    whole = {f"{n}/{k}": v for n, s in opt.state_dict()["state"].items() for k, v in s.items()}
    whole = {k: checkpoint.full_tensor(v) for k, v in whole.items()}
    for fsdp in (False, True):
        m2 = tiny_gpt(seed=5)
        if fsdp:
            plumbing.wrap(m2, d, fsdp=True)
        o2 = torch.optim.AdamW(m2.parameters(), lr=1e-2)
        checkpoint.load_checkpoint(ckpt, {"model": m2, "optim": o2}, "cpu")
        s2 = checkpoint.full_state(m2)
        got = {f"{n}/{k}": checkpoint.full_tensor(v) for n, s in o2.state_dict()["state"].items()
               for k, v in s.items()}
        r[f"load_{fsdp}"] = (all(torch.equal(state[k], s2[k]) for k in state)
                             and all(torch.equal(whole[k], got[k]) for k in whole))
        for q in m2.parameters():  # and Adam steps from it: its moments sharded as the weights
            q.grad = torch.zeros_like(q)
        o2.step()
    with open(os.path.join(result_dir, f"{rank}.json"), "w") as f:
        json.dump(r, f)
    torch.distributed.barrier()  # as plumbing.teardown: no rank destroys the group under its peer
    torch.distributed.destroy_process_group()


def test_fsdp_plumbing_on_two_gloo_ranks(tmp_path):
    """plumbing's FSDP half in float64, two shards against one process: sync_grads defers the
    reduce-scatter to the last micro-step and the gradients then equal the whole batch's; the
    clipped norm of the sharded grads is the unsharded norm; full_state gathers whole tensors;
    gathered runs unequal forwards; a checkpoint from the shards loads into one process and into
    shards (the per-rank bytes, DDP against FSDP, are tests/test_studies.py's). float64: only the
    order of sums differs (measured: grads 4e-16, weights after an Adam step 2.3e-15; 1e-12 leaves
    room)."""
    mp.spawn(_fsdp_worker, args=(str(tmp_path / "init"), str(tmp_path)), nprocs=2, join=True)
    for rank in range(2):
        with open(tmp_path / f"{rank}.json") as f:
            r = json.load(f)
        assert r["blocks_sharded"] and r["no_grads_before_sync"] and r["state_keys"], r
        for k in ("grad_diff", "norm_diff", "clipped_grad_diff", "state_diff", "gathered_diff"):
            assert r[k] <= 1e-12, (k, r)
        assert r["load_False"] and r["load_True"], r



def test_fsdp_sft_two_ranks_equal_one_process(tiny, tmp_path):
    one, two = tmp_path / "one", tmp_path / "two"
    sft.main(sft.Config(**sft_args(tiny, one)))  # 1 rank x 4 micro-steps of 4
    p = run_torchrun("sft.py", as_flags(sft_args(tiny, two, fsdp=True)))  # 2 shards x 2 micro-steps
    assert "sharded (FSDP2)" in p.stdout
    # as test_sft_two_ranks_...: only the order of fp32 sums differs (reduce-scatter, the norm's
    # sum over shards); measured <= 3e-7
    a, b = (read_metrics(out) for out in (one, two))
    assert [r["step"] for r in a] == [r["step"] for r in b]
    for k in ("loss", "grad_norm", "val_loss"):
        assert all(abs(x[k] - y[k]) <= 1e-5 for x, y in zip(a, b) if k in x), k
    w1, w2 = saved_weights(one), saved_weights(two)  # the same file, gathered whole
    assert {k: v.shape for k, v in w1.items()} == {k: v.shape for k, v in w2.items()}


def test_fsdp_dpo_two_ranks_equal_one_process_cached_and_live(tiny, dpo_cache):  # noqa: F811
    one = dpo_cfg(tiny, "fsdp-dpo-1rank", steps=2, micro_batch_size=16)
    dpo.main(one)
    a = dpo_metrics(one.out_dir)
    for ref in ("cache", "live"):  # 2 shards x 2 micro-steps x 4: the same global batch
        two = dpo_cfg(tiny, f"fsdp-dpo-2ranks-{ref}", steps=2, micro_batch_size=4, ref=ref)
        p = run_torchrun("dpo.py", as_flags({**asdict(two), "fsdp": True}))  # also the smoke run
        assert "held-out pairs: accuracy" in p.stdout and "sharded (FSDP2)" in p.stdout
        b = dpo_metrics(two.out_dir)
        assert [x["step"] for x in a] == [y["step"] for y in b] and "val_loss" in b[-1]
        # DPO_TOL's reasoning; measured <= 1.5e-6 relative (rewards/margins, live), 1e-6 cached
        for k in ("loss", "rewards/margins", "logps/chosen", "grad_norm", "val_loss"):
            assert all(abs(x[k] - y[k]) <= DPO_TOL * max(1, abs(x[k])) for x, y in zip(a, b)
                       if k in x), (ref, k)
        ea, eb = (json.load(open(os.path.join(c.out_dir, "eval.json"))) for c in (one, two))
        assert abs(ea["val_loss"] - eb["val_loss"]) <= DPO_TOL


def test_fsdp_precompute_two_ranks_writes_the_same_cache(tiny, dpo_cache):  # noqa: F811
    out, c = str(tiny.root / "fsdp-cache-2ranks"), dpo_pcfg(tiny)
    # the val split is one micro-batch: rank 1 reruns one to match rank 0's collectives
    p = run_torchrun("precompute.py", ["--out_dir", out, "--ref_model", c.ref_model,
                                       "--train_pairs", c.train_pairs, "--val_pairs", c.val_pairs,
                                       "--fsdp"])
    assert "π_ref sharded (FSDP2)" in p.stdout
    for split in ("train", "val"):
        one, two = (load_file(f"{p}/{split}.safetensors") for p in (dpo_cache, out))
        for k in ("chosen", "rejected"):
            torch.testing.assert_close(one[k], two[k], rtol=0, atol=DPO_TOL, equal_nan=True)
        with safe_open(f"{out}/{split}.safetensors", "pt") as f:  # --fsdp is not in it: dpo.py
            fp = json.loads(f.metadata()["fingerprint"])          # reads it with or without
        want = precompute.fingerprint(c, split, data.tokenize_pairs(
            data.load_tokenizer(tokenizer_beside(c.ref_model)),
            data.read_pairs(getattr(c, f"{split}_pairs")), c.max_len, c.max_prompt_len)[0],
            torch.device("cpu"))
        assert fp == want


def test_fsdp_resumes_a_one_process_checkpoint_and_back(tiny, dpo_cache):  # noqa: F811
    full = dpo_cfg(tiny, "fsdp-resume-full", steps=3, micro_batch_size=4)
    dpo.main(full)
    split = dpo_cfg(tiny, "fsdp-resume-split", steps=3, micro_batch_size=4, ckpt_every=1)
    dpo.main(replace(split, stop_after=1))  # one process, unsharded: a checkpoint at step 1
    p = run_torchrun("dpo.py", as_flags({**asdict(split), "fsdp": True, "stop_after": 1}))
    assert "resuming from" in p.stdout and "at step 1" in p.stdout  # sharded on 2 ranks: step 2
    dpo.main(split)  # back to one process, unsharded: step 3 from the gathered checkpoint
    a, b = dpo_metrics(full.out_dir), dpo_metrics(split.out_dir)
    assert [x["step"] for x in a] == [y["step"] for y in b] == [1, 2, 3]
    # step 2 ran on 2 ranks: DPO_TOL's reasoning (its sums in another order); steps 1 and 3 in
    # one process, 3 from weights and Adam state that went through the shards and back
    for k in ("loss", "rewards/margins", "logps/chosen", "grad_norm"):
        assert all(abs(x[k] - y[k]) <= DPO_TOL * max(1, abs(x[k])) for x, y in zip(a, b)
                   if k in x), k


def test_fsdp_reward_and_ppo_two_ranks_equal_one_process(tiny, tiny_rm, ppo_test_prompts, tmp_path):
    # reward.py: --fsdp on 2 ranks against tiny_rm, DDP on 2 ranks (itself equal to one process)
    p = run_torchrun("reward.py", as_flags({**reward_args(tiny, tmp_path / "rm"), "fsdp": True}))
    assert "sharded (FSDP2)" in p.stdout
    a, b = read_metrics(tiny_rm), read_metrics(tmp_path / "rm")
    for k in ("loss", "accuracy", "grad_norm", "val_loss", "val_accuracy"):
        assert all(abs(x[k] - y[k]) <= TWO_RANK_TOL * max(1, abs(x[k])) for x, y in zip(a, b)
                   if k in x), k
    ea, eb = (json.loads((p / "eval.json").read_text()) for p in (tiny_rm, tmp_path / "rm"))
    for k in ("val_accuracy", "offset", "ref_score_std"):  # the offset went into the shards
        assert abs(ea[k] - eb[k]) <= TWO_RANK_TOL, k
    assert abs(saved_weights(tiny_rm)["score.bias"]
               - saved_weights(tmp_path / "rm")["score.bias"]) <= TWO_RANK_TOL
    # ppo.py as test_ppo_two_ranks_equal_one_process, all four models sharded; the rollout copy
    # is refreshed from the gathered policy, so the iteration's rollouts would differ if it were not
    rm = str(tiny_rm / "model.safetensors")
    one = tiny_ppo_config(tiny, rm, tmp_path / "ppo1", ppo_test_prompts, iterations=2,
                          mini_batch=8, lr=1e-3)
    ppo.main(one)
    two = replace(one, out_dir=str(tmp_path / "ppo2"))
    p = run_torchrun("ppo.py", [f"--{k}={v}" for k, v in vars(two).items()
                                if not isinstance(v, bool)] + ["--fsdp"])
    assert "sharded (FSDP2)" in p.stdout
    a, b = read_metrics(one.out_dir), read_metrics(two.out_dir)
    assert [x["step"] for x in a] == [y["step"] for y in b] == [1, 2]
    for x, y in zip(a, b):
        for k in ("response_len", "eos_rate", "true_reward"):  # the same rollouts
            assert x[k] == y[k], k
        for k in ("score", "entropy", "kl", "loss/policy", "loss/value", "approx_kl", "clipfrac",
                  "explained_variance", "grad_norm"):
            assert abs(x[k] - y[k]) <= TWO_RANK_TOL * max(1, abs(x[k])), k
    ea, eb = (json.loads(open(os.path.join(c.out_dir, "eval.json")).read()) for c in (one, two))
    assert abs(ea["kl"] - eb["kl"]) <= 1e-4 * max(1, abs(ea["kl"]))  # as the DDP test's


# ==================================================================================================
# a mixture of policies: what backs a point on a method's frontier envelope (evaluate.py)
# ==================================================================================================

def favouring_gpt(token, V, nats, seed=3):
    """tiny_gpt(seed) whose next-token logits, at every position, are raised by `nats` for `token`:
    ln_f's bias gains b with wte·b = nats·e_token (wte has full row rank V <= n_embd)."""
    m = tiny_gpt(seed=seed, vocab_size=V, block_size=6)
    with torch.no_grad():
        m.transformer.wte.weight.mul_(8)  # larger logits, as test_evaluation_kl_against_exact_...
        m.transformer.ln_f.bias += torch.linalg.pinv(m.transformer.wte.weight) @ (
            nats * F.one_hot(torch.tensor(token), V).double())
    return m


def test_mixture_kl_against_exact_enumeration_below_the_chord():
    V, eos, pad, prompt, w = 4, 0, 3, [0, 1, 2], [0.3, 0.7]
    A, B = favouring_gpt(1, V, 4.0), favouring_gpt(2, V, 4.0)  # the same GPT, pulled two ways
    ref = favouring_gpt(0, V, 0.0, seed=4)
    ys = all_completions(6 - len(prompt), V, eos)
    L = len(prompt) + max(map(len, ys))
    out = {"tokens": torch.tensor([prompt + y + [pad] * (L - len(prompt) - len(y)) for y in ys]),
           "mask": torch.tensor([[c < len(prompt) + len(y) for c in range(L)] for y in ys])}
    out["response_mask"] = out["mask"].clone()
    out["response_mask"][:, :len(prompt)] = False
    la, lb, lq = (evaluate.completion_logps(m, out) for m in (A, B, ref))  # (40,) each, exact
    lm = evaluate.mixture_logp(torch.stack([la, lb]), w)
    # mix(y) = w_A A(y) + w_B B(y), in probability space: a distribution over the completions
    torch.testing.assert_close(lm.exp(), w[0] * la.exp() + w[1] * lb.exp(), atol=1e-14, rtol=0)
    assert lm.exp().sum().item() == pytest.approx(1.0, abs=1e-12)
    def kl(p, q):  # KL between two distributions over ys, given as log-probs
        return (p.exp() * (p - q)).sum().item()
    exact, chord = kl(lm, lq), w[0] * kl(la, lq) + w[1] * kl(lb, lq)
    # KL(mix‖ref) = Σ_i w_i [KL(π_i‖ref) − KL(π_i‖mix)], below the chord by Σ_i w_i KL(π_i‖mix)
    gap = w[0] * kl(la, lm) + w[1] * kl(lb, lm)
    assert exact == pytest.approx(chord - gap, abs=1e-12) and gap > 0.3  # measured 0.41 nats
    # evaluate_mixture's estimate, a mean over n completions, lies within 4 standard errors of
    # the exact KL; the chord lies 20 standard errors above it, so an estimate that scores a
    # completion only under the policy that sampled it (whose mean is the chord), or that drops
    # the log-weights (log mix + log(1/0.7) at least), fails
    sd = (lm.exp() * (lm - lq - exact) ** 2).sum().item() ** 0.5
    n = 4000
    se = sd / n ** 0.5
    fake = SimpleNamespace(eos=eos, pad=pad, encode=lambda s: [int(x) for x in s.split()],
                           decode=lambda ids: " ".join(map(str, ids)))
    res = evaluate.evaluate_mixture([A, B], w, ref, fake, ["1 2"], init_distributed(), k=n,
                                    batch_size=n)
    assert res["n_completions"] == n and res["weights"] == w
    assert chord - exact > 20 * se and abs(res["kl"] - exact) <= 4 * se, (res["kl"], exact, se)
    assert res["kl_std"] == pytest.approx(sd, rel=0.1)


def test_mixture_on_the_task_pays_the_weighted_reward_below_the_weighted_kl(tiny):  # noqa: F811
    tok = data.load_tokenizer(f"{tiny.sft}/tokenizer.json")
    ref = load_model(f"{tiny.sft}/model.safetensors")[0]
    quitter = constant_gpt(tok.vocab_size, tok.eos)  # B: EOS at once, reward 0, KL −log π_ref(EOS)
    prompts = data.read_prompts(f"{tiny.task}/prompts_test.jsonl")[:100]
    d, w, kw = init_distributed(), [0.3, 0.7], {"k": 2, "missing_eos_score": -3.0}
    a, b = (evaluate_policy(m, ref, tok, prompts, d, **kw) for m in (ref, quitter))  # A = π_ref
    aa, bb = (evaluate.evaluate_mixture([m, m], [0.5, 0.5], ref, tok, prompts, d, **kw)
              for m in (ref, quitter))
    # a policy mixed with itself is that policy: completion j of either is drawn from row j of
    # the same uniforms, so both see the same completions and score them by one rule
    assert (aa["true_reward"], aa["true_reward_std"]) == (a["true_reward"], a["true_reward_std"])
    # (the KL to fp32 rounding: the mixture batches its rows by policy, so its batches differ)
    assert abs(aa["kl"]) <= 1e-6 and bb["kl"] == pytest.approx(b["kl"], rel=1e-6)
    mix = evaluate.evaluate_mixture([ref, quitter], w, ref, tok, prompts, d, **kw)
    n = mix["n_completions"]
    assert n == a["n_completions"] == 200 and a["kl"] == 0.0
    # Reward: completion j of the mixture is completion j of the chosen policy's evaluation, so
    # the gap to the chord's reward is the choice's noise alone, (1/n) Σ_j (1[j chose A] − w_A)
    # (s_A(j) − s_B(j)), variance w_A w_B E[(s_A − s_B)²] / n <= w_A w_B ((σ_A + σ_B)² + (r_A −
    # r_B)²) / n. A mixture that always chose A (r_A) lies 11 of these s.e. away (measured).
    rA, rB, sA, sB = a["true_reward"], b["true_reward"], a["true_reward_std"], b["true_reward_std"]
    se = (w[0] * w[1] * ((sA + sB) ** 2 + (rA - rB) ** 2) / n) ** 0.5
    assert rB - rA > 1.0  # measured: 0 against −1.6
    assert abs(mix["true_reward"] - (w[0] * rA + w[1] * rB)) <= 4 * se, (mix, rA, rB, se)
    # KL, one-sided: at most the chord's, w_A·0 + w_B·KL(B‖π_ref), within 4 s.e. of the difference
    # of the two estimates (the s.d. of a difference is at most the sum of the two s.d.)
    se = (mix["kl_std"] + w[1] * bb["kl_std"]) / n ** 0.5
    assert mix["kl"] <= w[1] * b["kl"] + 4 * se, (mix["kl"], b["kl"], se)
