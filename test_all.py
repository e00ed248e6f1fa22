"""The test suite: closed forms, gradients against analytic forms, and equivalences (fast path vs
obvious path, cached vs live, world size 2 vs 1, resumed vs uninterrupted), plus smoke runs of every
script, `torchrun --nproc_per_node=2` on the CPU included.

    pytest test_all.py            # the whole suite
    pytest test_all.py -k dpo     # one area
"""
import csv
import itertools
import json
import math
import os
import re
import shutil
import subprocess
import sys
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch
import torch.multiprocessing as mp
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from torch.utils import flop_counter

import compare
import costs
import data
import dpo
import plumbing
import ppo
import precompute
import reward
import sft
from evaluate import evaluate_policy
from model import (GPT, GPTConfig, count_flops, estimate_flops, export_gpt2, generate, import_gpt2, load_model,
    new_kv_cache, read_meta, save_model, token_logprobs)
from plumbing import Dist, init_distributed


# ====================================================================================================
# shared fixtures
# ====================================================================================================

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


# ====================================================================================================
# model.py
# ====================================================================================================

def tiny_gpt(head="lm", seed=0, **kw):
    torch.manual_seed(seed)
    cfg = GPTConfig(**{**dict(block_size=32, vocab_size=13, n_layer=2, n_head=2, n_embd=16), **kw, "head": head})
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
    """softmax(q k^T / sqrt(d)) v written out: a fully masked row is NaN here, as in older SDPA kernels."""
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
    assert torch.isfinite(logits).all()  # left-pad queries see only themselves, never an all -inf row
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
        assert torch.allclose(batch["logprobs"][b, P:P + n], alone["logprobs"][0, len(p):], atol=1e-6, rtol=0)
        assert not batch["response_mask"][b, P + n:].any()


def test_generate_stops_at_eos():
    m = tiny_gpt(vocab_size=4)  # near-uniform logits over 4 tokens: EOS comes soon in every row
    eos, pad = 1, 3
    out = generate(m, [[2, 2], [0], [2, 0, 2]], 28, eos_id=eos, pad_id=pad,
                   generator=torch.Generator().manual_seed(0))
    tok, mask, resp = out["tokens"], out["mask"], out["response_mask"]
    P = 3
    assert tok.shape[1] < P + 28  # stopped early: every row ended
    assert torch.equal(mask[:, :P], torch.tensor([[0, 1, 1], [0, 0, 1], [1, 1, 1]], dtype=torch.bool))
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
    assert v.shape == (2, 3) and (v == 0).all()  # zero-initialised head: no preference before training
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
        assert "lm_head.weight" not in keys and "transformer.wte.weight" in keys  # tied weight stored once
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
    sd = {"wte.weight": r(V, C), "wpe.weight": r(n_pos, C), "ln_f.weight": 1 + r(C), "ln_f.bias": r(C)}
    for i in range(L):
        h = f"h.{i}."
        sd |= {h + "ln_1.weight": 1 + r(C), h + "ln_1.bias": r(C), h + "ln_2.weight": 1 + r(C), h + "ln_2.bias": r(C),
               h + "attn.c_attn.weight": r(C, 3 * C), h + "attn.c_attn.bias": r(3 * C),
               h + "attn.c_proj.weight": r(C, C), h + "attn.c_proj.bias": r(C),
               h + "mlp.c_fc.weight": r(C, 4 * C), h + "mlp.c_fc.bias": r(4 * C),
               h + "mlp.c_proj.weight": r(4 * C, C), h + "mlp.c_proj.bias": r(C),
               h + "attn.bias": torch.ones(1, 1, n_pos, n_pos).tril(), h + "attn.masked_bias": torch.tensor(-1e4)}
    sd = {prefix + k: v for k, v in sd.items()}
    sd["lm_head.weight"] = sd[prefix + "wte.weight"].clone()
    return sd


def reference_gpt2(sd, idx, n_head):
    """GPT-2's forward written out with plain ops over the Hugging Face dict (x @ W for Conv1D)."""
    sd = {k.removeprefix("transformer."): v.double() for k, v in sd.items()}
    T = idx.shape[1]
    ln = lambda x, p: F.layer_norm(x, x.shape[-1:], sd[p + ".weight"], sd[p + ".bias"], eps=1e-5)
    gelu_new = lambda x: 0.5 * x * (1 + torch.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x ** 3)))
    x = sd["wte.weight"][idx] + sd["wpe.weight"][:T]
    L = sum(k.endswith("ln_1.weight") for k in sd)
    for i in range(L):
        p = f"h.{i}."
        q, k, v = (ln(x, p + "ln_1") @ sd[p + "attn.c_attn.weight"] + sd[p + "attn.c_attn.bias"]).chunk(3, -1)
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
        assert (m.config.n_head, m.config.n_layer, m.config.block_size, m.config.vocab_size) == (4, 2, 24, 11)
        idx = torch.randint(0, 11, (2, 9))
        assert torch.allclose(m(idx), reference_gpt2(sd, idx, n_head=4), atol=1e-10, rtol=0)
        export_gpt2(m.float(), str(tmp_path / "out"))
        out = load_file(str(tmp_path / "out" / "model.safetensors"))
        want = {"transformer." + k.removeprefix("transformer."): v for k, v in sd.items()
                if not k.endswith((".attn.bias", ".attn.masked_bias")) and k != "lm_head.weight"}
        assert out.keys() == want.keys() and all(torch.equal(out[k], want[k]) for k in want)
        cfg = json.loads((tmp_path / "out" / "config.json").read_text())
        assert cfg["model_type"] == "gpt2" and cfg["activation_function"] == "gelu_new" and cfg["n_head"] == 4
        assert (cfg["n_positions"], cfg["n_ctx"], cfg["tie_word_embeddings"]) == (24, 24, True)
    m = import_gpt2(str(d / "model.safetensors"), block_size=10)  # a shorter context keeps wpe's first rows
    assert torch.equal(m.transformer.wpe.weight, sd["wpe.weight"][:10])
    m = import_gpt2(str(d / "model.safetensors"), vocab_size=12)  # room for the PAD our tokenizer adds
    assert m.config.vocab_size == 12 and torch.equal(m.transformer.wte.weight[:11], sd["wte.weight"])
    assert m.lm_head.weight is m.transformer.wte.weight and m(torch.tensor([[11, 3]])).shape == (1, 2, 12)


def test_estimate_flops_matches_flop_counter():
    for head in ("lm", "scalar"):
        m = tiny_gpt(head).float().train()
        cfg, B, T = m.config, 3, 20
        idx = torch.randint(0, 13, (B, T))
        assert count_flops(lambda: m(idx))[1] == estimate_flops(cfg, B, T)  # exact
        step = lambda: m(idx).float().pow(2).mean().backward()  # noqa: E731  a training step: forward + backward
        assert count_flops(step)[1] == estimate_flops(cfg, B, T, backward=True)
        with flop_counter.FlopCounterMode(display=False) as fc:
            m(idx)
        attn = cfg.n_layer * 4 * B * T * T * cfg.n_embd
        # stock counter: attention counted if this torch knows the CPU kernel, 0 if not (torch 2.13)
        assert fc.get_total_flops() in (estimate_flops(cfg, B, T), estimate_flops(cfg, B, T) - attn)


# ====================================================================================================
# data.py
# ====================================================================================================

TASK_FILES = ["pairs_train.jsonl", "pairs_val.jsonl", "prompts_eval.jsonl", "prompts_train.jsonl",
              "sft_train.txt", "sft_val.txt", "task.json", "tokenizer.json"]

@pytest.fixture(scope="module")
def task(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("task") / "task")
    logs = []
    assert data.ensure_task(d, seed=0, log=logs.append) == d
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
    assert tok.decode([tok.eos] + tok.encode("hi there") + [tok.eos, tok.pad, tok.pad]) == "hi there"
    path = str(tmp_path / "tokenizer.json")
    data.save_tokenizer(tok, path)
    tok2 = data.load_tokenizer(path)
    assert (tok2.eos, tok2.pad, tok2.vocab_size) == (tok.eos, tok.pad, tok.vocab_size)
    assert tok2.encode(texts[2]) == tok.encode(texts[2])
    # A user tokenizer.json with EOS but no PAD (as GPT-2's) gets PAD as one more id.
    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer, tk.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    tk.train_from_iterator(texts * 20, trainers.BpeTrainer(vocab_size=280, special_tokens=[data.EOS],
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
    with pytest.raises(ValueError, match="endoftext"):
        data.load_tokenizer(str(tmp_path / "noeos.json"))

def test_build_task_deterministic_and_schema(task, tmp_path):
    again = str(tmp_path / "again")
    data.build_task(again, seed=0)
    assert sorted(os.listdir(task)) == sorted(os.listdir(again)) == TASK_FILES  # no temp dirs left
    for name in TASK_FILES:
        with open(os.path.join(task, name), "rb") as f, open(os.path.join(again, name), "rb") as g:
            assert f.read() == g.read(), name
    assert not [p for p in os.listdir(tmp_path) if p != "again"]
    logs = []  # present: not rebuilt; another seed in the same folder is an error
    assert data.ensure_task(task, seed=0, log=logs.append) == task and logs == []
    with pytest.raises(ValueError, match="seed"):
        data.ensure_task(task, seed=1)
    with open(os.path.join(task, "task.json")) as f:
        meta = json.load(f)
    assert meta["counts"] == data.SIZES and meta["seed"] == 0
    with open(os.path.join(task, "pairs_train.jsonl")) as f:
        assert all(list(json.loads(line)) == ["prompt", "chosen", "rejected"] for line in f)
    pairs = data.read_pairs(os.path.join(task, "pairs_train.jsonl"))
    assert len(pairs) == meta["counts"]["pairs_train"]
    for r in pairs:  # a prompt and either response make a text of the language
        assert r["chosen"].startswith(" ") and r["rejected"].startswith(" ") and r["chosen"] != r["rejected"]
        assert text_ok(r["prompt"] + r["chosen"]) and text_ok(r["prompt"] + r["rejected"])
    # Bradley-Terry labels: noisy, but chosen usually has the higher hidden reward
    rc = [data.true_reward(r["prompt"], r["chosen"]) for r in pairs]
    rr = [data.true_reward(r["prompt"], r["rejected"]) for r in pairs]
    assert 0.7 < sum(a > b for a, b in zip(rc, rr)) / len(pairs) < 0.95
    prompts = data.read_prompts(os.path.join(task, "prompts_eval.jsonl"))
    assert len(prompts) == meta["counts"]["prompts_eval"] and all(p.endswith(" .") for p in prompts)
    texts = data.read_texts(os.path.join(task, "sft_val.txt"))
    assert len(texts) == meta["counts"]["sft_val"] and all(map(text_ok, texts))

def text_ok(t):
    return math.isfinite(data.text_logprob(t))

def test_task_floor(task, tok):
    with open(os.path.join(task, "task.json")) as f:
        meta = json.load(f)
    floor = meta["floor_nats_per_token"]
    assert meta["vocab_size"] == tok.vocab_size
    assert math.isfinite(floor) and 0 < floor < math.log(tok.vocab_size)
    # The floor is an entropy: no model beats it, e.g. a unigram model fitted on the val texts themselves.
    counts = {}
    val = data.read_texts(os.path.join(task, "sft_val.txt"))
    for t in val:
        for i in tok.encode(t) + [tok.eos]:
            counts[i] = counts.get(i, 0) + 1
    n = sum(counts.values())
    assert floor < -sum(c * math.log(c / n) for c in counts.values()) / n

def test_true_reward_hand_examples():
    assert data.true_reward("it felt awful .", " the movie is great .") == 2.0  # the prompt does not count
    assert data.true_reward("", " i hated the plot . it felt fine .") == -2.0 + 0.5
    assert data.true_reward("", " the cast was good and good . we saw it on monday .") == 2.0
    assert data.true_reward("", "GREAT,superb!! xyz greatgreat <|endoftext|>") == 4.0  # junk scores its words
    assert data.true_reward("", "") == 0.0

def test_text_logprob_hand_worked():
    # "it felt {adj} ." then "we saw it on {day} .", then stop: templates 1/5 each, "great" is positive
    # (prob p) and one of 8, the day one of 5, stop after the 2nd sentence P_STOP; p uniform on 5 values.
    mean_p = sum(data.P_VALUES) / 5
    want = (1 / 5) * (mean_p / 8) * (1 / 5) * (1 / 5) * 0.35
    assert math.isclose(data.text_logprob("it felt great . we saw it on monday ."), math.log(want))
    # 2 positive slots (great, loved) and 2 negative (awful, weak): E_p[p^2 (1-p)^2]; 3 sentences:
    # continue after the 2nd (1 - P_STOP), stop after the 3rd.
    m = sum(p ** 2 * (1 - p) ** 2 for p in data.P_VALUES) / 5
    want = ((1 / 5) * (1 / 8) * (1 / 8) * (1 / 8)   # "the {noun} was {adj} and {adj} ."
            * (1 / 5) * (1 / 3) * (1 / 8)           # "i {verb} the {noun} ."
            * (1 / 5) * (1 / 8)                     # "it felt {adj} ."
            * 0.65 * 0.35 * m)
    got = data.text_logprob("the movie was great and awful . i loved the plot . it felt weak .")
    assert math.isclose(got, math.log(want))
    for bad in ["the movie is great .", "the movie is great", "the movie is amazing . it felt good .",
                "the movie is great .  it felt good .", "it felt great . it felt good . ", "i felt good . it felt good ."]:
        assert data.text_logprob(bad) == -math.inf, bad

def sentences(templates):
    """Every sentence the given templates can make."""
    out = []
    for t in templates:
        slots = [data.NEUTRAL[w] if w in data.NEUTRAL else
                 sum(data.SENTIMENT[w], []) if w in data.SENTIMENT else [w] for w in t.split()]
        out += [" ".join(ws) for ws in itertools.product(*slots)]
    return out

def test_text_logprob_sums_to_one():
    # Summing the exact probability over whole sets of texts: any unnormalized factor (a slot's word
    # choice, the latent p, the templates, the length) shows up as a wrong total.
    everything, last = sentences(data.TEMPLATES), sentences(["it felt {adj} ."])
    assert len(everything) == len(set(everything)) == 8 * 16 + 8 * 16 * 16 + 6 * 8 + 16 + 5
    total = sum(math.exp(data.text_logprob(a + " " + b)) for a in everything for b in last)
    assert math.isclose(total, 0.35 * (1 / 5), rel_tol=1e-9)  # P(2 sentences) * P(2nd is "it felt")
    short = sentences(["it felt {adj} .", "we saw it on {day} ."])
    total = sum(math.exp(data.text_logprob(" ".join(s))) for s in itertools.product(short, repeat=3))
    assert math.isclose(total, 0.65 * 0.35 * (2 / 5) ** 3, rel_tol=1e-9)

GOOD = '{"prompt": "the plot is", "chosen": " good .", "rejected": " bad ."}'

@pytest.mark.parametrize("bad, says", [
    ("not json", "not valid JSON"),
    ('["the plot", " good .", " bad ."]', "expected a JSON object, got an array"),
    ('{"prompt": "a", "chosen": " b"}', 'missing field "rejected"'),
    ('{"prompt": "a", "rejected": " b"}', 'missing field "chosen"'),
    ('{"prompt": null, "chosen": " b", "rejected": " c"}', 'field "prompt" must be a string, got null'),
    ('{"prompt": "a", "chosen": 3, "rejected": " c"}', 'field "chosen" must be a string, got a number'),
    ('{"prompt": "a", "chosen": " b", "rejected": ["c"]}', 'field "rejected" must be a string, got an array'),
    ('{"prompt": "a", "chosen": "", "rejected": " c"}', 'field "chosen" is empty'),
    ('{"prompt": "a", "chosen": " c", "rejected": ""}', 'field "rejected" is empty'),
    ('{"prompt": "a", "chosen": " b", "rejected": " b"}', '"chosen" and "rejected" are identical'),
    ('{"chosen": "x b", "rejected": "x b"}', '"chosen" and "rejected" are identical'),
    ('{"chosen": "great plot", "rejected": "good plot"}', 'no "prompt" field'),  # common prefix has no space
    ('{"chosen": " yes", "rejected": " no"}', 'no "prompt" field'),             # ... or only at the start
])
def test_read_pairs_bad_rows_name_file_and_line(tmp_path, bad, says):
    path = tmp_path / "pairs.jsonl"
    path.write_text(GOOD + "\n\n" + GOOD + "\n" + bad + "\n" + GOOD + "\n")  # the blank line 2 is no row
    with pytest.raises(data.DataError) as e:
        data.read_pairs(str(path))
    assert str(e.value).startswith(f"{path}:4: ") and says in str(e.value), str(e.value)

def test_read_files_other_errors(tmp_path):
    p = tmp_path / "bytes.jsonl"
    p.write_bytes(GOOD.encode() + b"\n" + b'{"prompt": "\xff"}\n')
    with pytest.raises(data.DataError, match=f"^{p}:2: not UTF-8"):
        data.read_pairs(str(p))
    for name, reader in [("e.jsonl", data.read_pairs), ("e.jsonl", data.read_prompts), ("e.txt", data.read_texts)]:
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

def test_read_pairs_full_texts_variant(tmp_path):
    rows = [{"chosen": "Human: hi Assistant: hello there", "rejected": "Human: hi Assistant: go away"},
            {"chosen": "Q: x A: the cat .", "rejected": "Q: x A: the dog ."},   # a shared first word stays
            {"chosen": "a\n\nHuman: b", "rejected": "a\n\nHuman: c d"},
            {"chosen": "the plot is good", "rejected": "the plot is good and long", "id": 7},
            {"prompt": "p", "chosen": "x", "rejected": "y"}]                  # explicit prompt: as given
    path = tmp_path / "full.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert data.read_pairs(str(path)) == [
        dict(prompt="Human: hi Assistant:", chosen=" hello there", rejected=" go away"),
        dict(prompt="Q: x A: the", chosen=" cat .", rejected=" dog ."),
        dict(prompt="a\n\nHuman:", chosen=" b", rejected=" c d"),
        dict(prompt="the plot is", chosen=" good", rejected=" good and long"),
        dict(prompt="p", chosen="x", rejected="y")]

def test_tokenize_pairs_truncation_rule(tok):
    assert all(len(tok.encode(" " + w)) == 1 for w in "the movie is great . i loved plot it felt".split())
    prompt, short = "the movie is great .", " i loved the plot ."   # 6 tokens with BOS, 6 with EOS
    long = " it felt great . it felt great . it felt great ."          # 13 with EOS
    rows = [dict(prompt=prompt, chosen=short, rejected=long)]
    x, ys, yl = data.encode_prompt(tok, prompt), data.encode_response(tok, short), data.encode_response(tok, long)
    assert (len(x), len(ys), len(yl)) == (6, 6, 13) and x[0] == tok.eos and yl[-1] == tok.eos
    ex, st = data.tokenize_pairs(tok, rows, max_len=19, max_prompt_len=4)    # 6 + 13 fits
    assert ex == [dict(index=0, prompt=x, chosen=ys, rejected=yl)]
    assert st == dict(rows=1, truncated_prompt=0, truncated_response=0, unusable=0)
    # too long by 3: the prompt gives up 3 tokens (it may: max(16 - 13, 2) = 3 >= 2), keeping its BOS
    ex, st = data.tokenize_pairs(tok, rows, max_len=16, max_prompt_len=2)
    assert ex[0]["prompt"] == [tok.eos] + x[-2:] and ex[0]["rejected"] == yl and ex[0]["chosen"] == ys
    assert st == dict(rows=1, truncated_prompt=1, truncated_response=0, unusable=0)
    # max_prompt_len 5 stops the prompt at 5 tokens; the longer response is cut to 16 - 5 = 11 (no EOS)
    ex, st = data.tokenize_pairs(tok, rows, max_len=16, max_prompt_len=5)
    assert ex[0]["prompt"] == [tok.eos] + x[-4:] and ex[0]["rejected"] == yl[:11] and ex[0]["chosen"] == ys
    assert st == dict(rows=1, truncated_prompt=1, truncated_response=1, unusable=0)
    # a prompt already short enough is kept whole and the responses are cut
    ex, st = data.tokenize_pairs(tok, rows, max_len=12, max_prompt_len=8)
    assert ex[0]["prompt"] == x and ex[0]["rejected"] == yl[:6] and ex[0]["chosen"] == ys
    assert st == dict(rows=1, truncated_prompt=0, truncated_response=1, unusable=0)
    # responses that differ only past the cut become identical: unusable, left out, counted; the
    # other rows keep their original index
    same = dict(prompt=prompt, chosen=long + " the plot is great .", rejected=long + " it felt fine .")
    ex, st = data.tokenize_pairs(tok, [rows[0], same, rows[0]], max_len=16, max_prompt_len=5)
    assert [e["index"] for e in ex] == [0, 2]
    assert st == dict(rows=3, truncated_prompt=3, truncated_response=3, unusable=1)
    with pytest.raises(AssertionError, match="max_prompt_len"):
        data.tokenize_pairs(tok, rows, max_len=8, max_prompt_len=8)

def test_tokenize_texts(tok):
    texts = ["it felt great . it felt good .", "it felt great . it felt good . it felt fine ."]
    ex, st = data.tokenize_texts(tok, texts, max_len=10)
    assert st == dict(rows=2, truncated=1)
    assert ex[0] == dict(index=0, prompt=[tok.eos], response=tok.encode(texts[0]) + [tok.eos])
    assert ex[1]["response"] == tok.encode(texts[1])[:9]

def test_collate_pairs_layout(tok):
    rows = [dict(prompt="the movie is gre", chosen="at . it felt good .", rejected=" bad ."),  # cut mid-word
            dict(prompt="it felt good .", chosen=" i loved the plot . it felt great .", rejected=" the end ."),
            dict(prompt="we saw it", chosen=" on monday .", rejected=" on friday . it felt dull .")]
    ex, _ = data.tokenize_pairs(tok, rows, max_len=64, max_prompt_len=8)
    b = data.collate_pairs(ex, tok.pad)
    ids, tg = b["input_ids"], b["targets"]
    T = max(len(e["prompt"]) + len(e[k]) for e in ex for k in ("chosen", "rejected"))
    assert ids.shape == tg.shape == (6, T) and ids.dtype == tg.dtype == torch.long
    assert b["index"].tolist() == [0, 1, 2] and b["index"].dtype == torch.long
    for i, (r, k) in enumerate((r, k) for k in ("chosen", "rejected") for r in rows):  # [chosen; rejected]
        x, y = data.encode_prompt(tok, r["prompt"]), data.encode_response(tok, r[k])
        P, n = len(x), len(x) + len(y)
        assert ids[i, :P].tolist() == x and ids[i, P:n].tolist() == y    # the boundary is exact
        assert (ids[i, n:] == tok.pad).all()
        assert tg[i, P - 1:n - 1].tolist() == y                           # position t predicts token t+1
        assert (tg[i, :P - 1] == -100).all() and (tg[i, n - 1:] == -100).all()
    assert (tg[:, -1] == -100).all()
    hit = tg != -100
    assert (tg[:, :-1][hit[:, :-1]] == ids[:, 1:][hit[:, :-1]]).all()
    # tokenized apart: "gre" + "at" is not the " great" that tokenizing the joined text would give
    assert data.encode_response(tok, "at . it felt good .")[0] != tok.encode("the movie is great .")[3]
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
    assert len(set(epoch)) == per_epoch * B                      # an epoch sees each example once at most
    assert data.global_batch(n, B, per_epoch, seed) != data.global_batch(n, B, 0, seed)  # reshuffled
    with pytest.raises(AssertionError, match="divisible"):
        data.rank_slice(list(range(6)), 0, 4)
    with pytest.raises(AssertionError, match="larger"):
        data.global_batch(5, 8, 0, 0)


# ====================================================================================================
# plumbing.py and sft.py
# ====================================================================================================

def test_parse_config_flags_help_and_bad_values(capsys):
    cfg = plumbing.parse_config(sft.Config, ["--lr", "0.01", "--no-resume", "--n-layer", "3"])
    assert cfg.lr == 0.01 and cfg.resume is False and cfg.n_layer == 3 and cfg.steps == sft.Config.steps
    with pytest.raises(SystemExit):
        plumbing.parse_config(sft.Config, ["--steps", "ten"])
    assert "invalid int value: 'ten'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        plumbing.parse_config(sft.Config, ["--help"])
    assert "peak AdamW learning rate" in capsys.readouterr().out  # help comes from the field's comment


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
    plumbing.save_checkpoint(str(tmp_path), 7, {"model": net, "optim": opt, "gen": torch.arange(3)}, {"a": 1})
    net2 = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
    opt2 = torch.optim.AdamW(net2.parameters(), lr=0.1)
    step, state = plumbing.load_checkpoint(str(tmp_path), {"model": net2, "optim": opt2, "gen": torch.zeros(3)}, "cpu")
    assert step == 7 and state["a"] == 1 and torch.equal(state["tensors"]["gen"], torch.arange(3))
    for p, q in zip(net.parameters(), net2.parameters()):
        assert torch.equal(p, q)
    for s, t in zip(opt.state.values(), opt2.state.values()):
        assert all(torch.equal(torch.as_tensor(s[k]), torch.as_tensor(t[k])) for k in s)
    # a writer that died before renaming leaves only a .tmp: the checkpoint on record is unchanged
    (tmp_path / "step-0000008.safetensors.tmp").write_bytes(b"half")
    assert plumbing.checkpoint_state(str(tmp_path))["step"] == 7


# ---- sft: world size 2 equals 1, resumed equals uninterrupted, torchrun smoke


def sft_args(tiny, out, steps=8, **kw):
    cfg = dict(out_dir=str(out), train_text=f"{tiny.task}/sft_train.txt", val_text=f"{tiny.task}/sft_val.txt",
               tokenizer=f"{tiny.task}/tokenizer.json", **TINY_MODEL, steps=steps, batch_size=16,
               micro_batch_size=4, eval_every=steps, ckpt_every=100, warmup=2, **kw)
    return cfg


def as_flags(cfg):
    return [x for k, v in cfg.items() for x in ((f"--{k}" if v else f"--no-{k}",) if isinstance(v, bool)
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
    assert steps == sorted(set(steps)) and steps[0] == 1  # the resumed log keeps the first run's lines, none twice


def test_sft_refuses_to_resume_a_different_config(tiny, tmp_path):
    sft.main(sft.Config(**sft_args(tiny, tmp_path, steps=4, stop_after=2)))
    with pytest.raises(SystemExit, match=r"another config \(lr 0.003 -> 0.001\)"):
        sft.main(sft.Config(**sft_args(tiny, tmp_path, steps=4, lr=0.001)))


def test_sft_explicit_missing_input_is_an_error_naming_it(tiny, tmp_path):
    with pytest.raises(SystemExit, match="nope.txt does not exist"):
        sft.main(sft.Config(**{**sft_args(tiny, tmp_path), "train_text": str(tmp_path / "nope.txt")}))


# ====================================================================================================
# precompute.py and dpo.py
# ====================================================================================================

# Equivalent DPO runs differ only in the order of fp32 sums: a cache computed in batches of 64
# against live micro-batches of 8 (other padding), one rank against two. Their per-step losses,
# margins and gradient norms agree to <= 8e-7 (measured at 1 and 2 threads); the bugs these tests
# guard against (a misaligned cache row, a missing x world, a dropped micro-batch) move them by
# > 1e-3. Weights are not compared: Adam's lr·m/√v turns the rounding noise of a near-zero gradient
# into a step of up to ~lr (1.1e-4 measured), on weights that barely move the outputs. The val loss
# after the last update pins the final weights' function instead. Adam is blind to a gradient's
# scale, so the gradient's normalisation is checked through grad_norm.
DPO_TOL = 1e-5
DPO_METRICS = ["loss", "rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins",
               "logps/chosen", "logps/rejected", "grad_norm", "lr", "tokens_per_sec", "mfu"]


def dpo_pcfg(tiny, out="dpo-cache", pairs=None, ref_model=None):
    return precompute.Config(out_dir=str(tiny.root / out), ref_model=ref_model or f"{tiny.sft}/model.safetensors",
                             train_pairs=pairs or str(tiny.root / "dpo-data/pairs_train.jsonl"),
                             val_pairs=pairs or str(tiny.root / "dpo-data/pairs_val.jsonl"))


@pytest.fixture(scope="module")
def dpo_cache(tiny):  # noqa: F811
    """A slice of the task (256 train pairs, 64 val pairs, 8 held-out prompts), so each run takes a
    second, and the tiny π_ref's log-prob cache of it, computed by one process."""
    own = tiny.root / "dpo-data"
    os.makedirs(own)
    for name, n in (("pairs_train.jsonl", 256), ("pairs_val.jsonl", 64), ("prompts_eval.jsonl", 8)):
        (own / name).write_text("".join(open(f"{tiny.task}/{name}").readlines()[:n]))
    precompute.main(dpo_pcfg(tiny))
    return str(tiny.root / "dpo-cache")


def dpo_cfg(tiny, name, **kw):  # noqa: F811
    base = dict(out_dir=str(tiny.root / name), ref_model=f"{tiny.sft}/model.safetensors",
                train_pairs=str(tiny.root / "dpo-data/pairs_train.jsonl"), val_pairs=str(tiny.root / "dpo-data/pairs_val.jsonl"),
                eval_prompts=str(tiny.root / "dpo-data/prompts_eval.jsonl"), ref_logps=str(tiny.root / "dpo-cache"),
                steps=3, batch_size=16, micro_batch_size=8, lr=1e-3, warmup=1, eval_every=1000, ckpt_every=1000,
                eval_k=1)
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
    assert smooth.item() == pytest.approx(0.8 * math.log1p(math.exp(-1)) + 0.2 * math.log1p(math.exp(1)), abs=1e-7)
    ipo, _, _ = dpo.dpo_loss(*args, beta=0.5, loss="ipo")  # (h − 1/(2β))² = (2 − 1)²
    assert ipo.item() == pytest.approx(1.0, abs=1e-7)
    ipo, _, _ = dpo.dpo_loss(*args, beta=0.25, loss="ipo")  # h = 1/(2β) is IPO's target: zero loss
    assert ipo.item() == pytest.approx(0.0, abs=1e-7)


def test_gradient_matches_the_papers_analytic_form():
    torch.manual_seed(0)
    B, beta, eps = 6, 0.3, 0.1
    pi_c, pi_r = (-20 * torch.rand(B, dtype=torch.float64)).requires_grad_(), (-20 * torch.rand(B, dtype=torch.float64)).requires_grad_()
    ref_c, ref_r = -20 * torch.rand(B, dtype=torch.float64), -20 * torch.rand(B, dtype=torch.float64)
    losses, r_c, r_r = dpo.dpo_loss(pi_c, pi_r, ref_c, ref_r, beta)
    g_c, g_r = torch.autograd.grad(losses.mean(), (pi_c, pi_r))
    w = beta * torch.sigmoid(r_r - r_c) / B  # Sec. 4: β σ(r̂(x,y_l) − r̂(x,y_w)), for the mean over B
    torch.testing.assert_close(g_c, -w, rtol=1e-12, atol=1e-15)
    torch.testing.assert_close(g_r, w, rtol=1e-12, atol=1e-15)
    h = ((pi_c - ref_c) - (pi_r - ref_r)).detach()
    losses, _, _ = dpo.dpo_loss(pi_c, pi_r, ref_c, ref_r, beta, label_smoothing=eps)
    g_c, = torch.autograd.grad(losses.sum(), pi_c)
    torch.testing.assert_close(g_c, -beta * ((1 - eps) * torch.sigmoid(-beta * h) - eps * torch.sigmoid(beta * h)))
    losses, _, _ = dpo.dpo_loss(pi_c, pi_r, ref_c, ref_r, beta, loss="ipo")
    g_c, g_r = torch.autograd.grad(losses.sum(), (pi_c, pi_r))
    torch.testing.assert_close(g_c, 2 * (h - 1 / (2 * beta)))
    torch.testing.assert_close(g_r, -2 * (h - 1 / (2 * beta)))
    for kw in (dict(), dict(label_smoothing=eps), dict(loss="ipo")):
        assert torch.autograd.gradcheck(lambda a, b, c, d: dpo.dpo_loss(a, b, c, d, beta, **kw)[0],
                                        (pi_c, pi_r, ref_c.requires_grad_(), ref_r.requires_grad_()))
        ref_c, ref_r = ref_c.detach(), ref_r.detach()


# -----------------------------------------------------------------------------
# log-probs: one concatenated forward; only response tokens count


def test_concatenated_forward_equals_separate_forwards_and_counts_only_responses(tiny):  # noqa: F811
    model, _ = load_model(f"{tiny.sft}/model.safetensors")
    model = model.double().eval()  # fp64: the same math must agree to 1e-10
    tok = data.load_tokenizer(f"{tiny.sft}/tokenizer.json")
    ex, _ = data.tokenize_pairs(tok, data.read_pairs(f"{tiny.task}/pairs_val.jsonl")[:5], 64, 16)
    b = data.collate_pairs(ex, tok.pad)
    with torch.no_grad():
        both = precompute.pair_logps(model, b["input_ids"], b["targets"])  # (2B,)
        for half, key in ((both[:5], "chosen"), (both[5:], "rejected")):
            x, y = data.collate([(e["prompt"], e[key]) for e in ex], tok.pad)  # its own, shorter padding
            torch.testing.assert_close(half, precompute.pair_logps(model, x, y), rtol=0, atol=1e-10)
            for e, got in zip(ex, half):  # the obvious way: one unpadded sequence, response tokens only
                seq = torch.tensor([e["prompt"] + e[key]])
                logp = torch.log_softmax(model(seq)[0, len(e["prompt"]) - 1:-1], -1)
                want = logp.gather(-1, torch.tensor(e[key])[:, None]).sum()
                assert abs(got.item() - want.item()) < 1e-10


# -----------------------------------------------------------------------------
# the training loop


def test_step_zero_policy_equals_reference(tiny, dpo_cache):  # noqa: F811
    for ref, tol in (("live", 1e-7), ("cache", DPO_TOL)):  # live: the same forward twice; ln 2 to fp32 rounding
        cfg = dpo_cfg(tiny, f"dpo-step0-{ref}", ref=ref, steps=2, stop_after=1)
        dpo.main(cfg)
        m = dpo_metrics(cfg.out_dir)[0]
        assert set(DPO_METRICS) <= m.keys() and any(k.startswith("time/") for k in m)
        assert abs(m["loss"] - math.log(2)) <= tol
        if ref == "live":  # π_θ and π_ref: one function, one batch, so the rewards are exactly 0
            assert m["rewards/chosen"] == m["rewards/rejected"] == m["rewards/margins"] == 0.0
            assert m["rewards/accuracies"] == 0.0  # no pair is ordered yet (strict >, as TRL)
        assert abs(m["rewards/chosen"]) <= tol and abs(m["rewards/rejected"]) <= tol and abs(m["rewards/margins"]) <= tol


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
    assert {"val_accuracy", "true_reward", "kl", "ref_true_reward", "ref_true_reward_std", "samples"} <= ev.keys()


def test_resumed_equals_uninterrupted(tiny, dpo_cache):  # noqa: F811
    full, part = dpo_cfg(tiny, "dpo-full", steps=4), dpo_cfg(tiny, "dpo-resumed", steps=4, stop_after=2)
    dpo.main(full)
    dpo.main(part)
    assert not os.path.exists(os.path.join(part.out_dir, "model.safetensors"))
    dpo.main(part)  # resumes at step 2
    assert [m["loss"] for m in dpo_metrics(full.out_dir)] == [m["loss"] for m in dpo_metrics(part.out_dir)]
    assert dpo_max_diff(dpo_weights(full.out_dir), dpo_weights(part.out_dir)) == 0.0


def test_non_finite_loss_stops_and_keeps_the_last_checkpoint(tiny, dpo_cache):  # noqa: F811
    cfg = dpo_cfg(tiny, "dpo-nan", lr=1e30, ckpt_every=1)  # step 1 blows the weights up; step 2's loss is NaN
    with pytest.raises(SystemExit, match="non-finite loss.*step 2.*last good checkpoint is kept"):
        dpo.main(cfg)
    with open(os.path.join(cfg.out_dir, "ckpt", "latest.json")) as f:
        assert json.load(f)["step"] == 1


def test_cached_step_costs_the_analytic_fraction_of_a_live_step(tiny, dpo_cache, monkeypatch):  # noqa: F811
    monkeypatch.setattr(dpo, "measure_peak_flops", lambda device: 1e9)  # its matmuls would be counted
    counted = {}
    for ref in ("cache", "live"):
        cfg = dpo_cfg(tiny, f"dpo-flops-{ref}", ref=ref, steps=2, stop_after=1)  # one step, no evaluation
        counted[ref] = count_flops(lambda: dpo.main(cfg))[1]
    # expected from the model's own sizes and the step's real batch shapes
    mcfg = load_model(cfg.ref_model)[0].config
    tok = data.load_tokenizer(f"{tiny.sft}/tokenizer.json")
    train, _ = data.tokenize_pairs(tok, data.read_pairs(cfg.train_pairs), cfg.max_len, cfg.max_prompt_len)
    batch = data.global_batch(len(train), cfg.batch_size, 0, cfg.seed)
    shapes = [data.collate_pairs([train[i] for i in batch[j:j + 8]], tok.pad)["input_ids"].shape for j in (0, 8)]
    policy = sum(estimate_flops(mcfg, *s, backward=True) for s in shapes)  # forward + backward
    reference = sum(estimate_flops(mcfg, *s) for s in shapes)  # forward only
    assert counted["cache"] == policy and counted["live"] == policy + reference  # exact: same counting rules
    ratio = counted["cache"] / counted["live"]
    assert abs(ratio - 0.75) < 0.02  # 3/(3+1) for matmuls; attention's 2.5x backward moves it slightly


# -----------------------------------------------------------------------------
# distributed (gloo on the CPU) and the cache's guarantees


def test_precompute_two_ranks_writes_the_same_cache(tiny, dpo_cache):  # noqa: F811
    out = str(tiny.root / "dpo-cache-2ranks")
    c = dpo_pcfg(tiny)
    run_torchrun("precompute.py", ["--out_dir", out, "--ref_model", c.ref_model, "--train_pairs", c.train_pairs,
                                   "--val_pairs", c.val_pairs])
    for split in ("train", "val"):
        one, two = load_file(f"{dpo_cache}/{split}.safetensors"), load_file(f"{out}/{split}.safetensors")
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
    c = dpo_pcfg(tiny, out="dpo-stale/cache", pairs=str(own / "pairs.jsonl"), ref_model=str(own / "model.safetensors"))
    precompute.main(c)
    cfg = dpo_cfg(tiny, "dpo-stale/run", ref_model=c.ref_model, train_pairs=c.train_pairs, val_pairs=c.val_pairs,
               ref_logps=c.out_dir, steps=1)
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


def test_two_ranks_equal_one_process(tiny, dpo_cache):  # noqa: F811
    one = dpo_cfg(tiny, "dpo-1rank", steps=2, micro_batch_size=16)  # 1 rank x 1 micro-step x 16
    dpo.main(one)
    two = dpo_cfg(tiny, "dpo-2ranks", steps=2, micro_batch_size=4)  # 2 ranks x 2 micro-steps x 4: same global batch
    args = [a for k, v in vars(two).items() if isinstance(v, (str, int, float)) and not isinstance(v, bool)
            for a in (f"--{k}", str(v))]
    p = run_torchrun("dpo.py", args)  # also the smoke run: the whole script, evaluation and outputs
    assert "held-out pairs: accuracy" in p.stdout
    a, b = dpo_metrics(one.out_dir), dpo_metrics(two.out_dir)
    assert [x["step"] for x in a] == [y["step"] for y in b] and "val_loss" in a[-1]
    # not accuracy: ties at step 1; logps/chosen (~ -30) relative to its size
    for k in ("loss", "rewards/margins", "logps/chosen", "grad_norm", "val_loss"):
        assert all(abs(x[k] - y[k]) <= DPO_TOL * max(1, abs(x[k])) for x, y in zip(a, b) if k in x), k


def loop_headers(path):
    """A loop file's section (# ====) and phase (# --) headers up to their colon, as the README's
    diff command prints them."""
    return re.findall(r"# [=-]{2,} [^:\n]*", open(path, encoding="utf-8").read())


def test_loops_share_one_skeleton():
    d, p = loop_headers(dpo.__file__), loop_headers(ppo.__file__)
    rest = iter(p)  # DPO's headers are PPO's in the same order, some deleted: `x in rest` consumes
    assert len(d) >= 12 and all(h in rest for h in d), (d, p)
    core = ["# -- batch", "# -- reference log-probs", "# -- policy forward", "# -- loss", "# -- update"]
    for heads in (d, p):  # the shared core, in this order, in both
        assert [h for h in heads if h in core] == core
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


# ====================================================================================================
# reward.py and ppo.py
# ====================================================================================================

def prefix_mask(lengths, N):
    return torch.arange(N)[None, :] < torch.tensor(lengths)[:, None]


# -----------------------------------------------------------------------------
# advantages


def test_gae_matches_double_loop():
    g = torch.Generator().manual_seed(0)
    B, N, gamma, lam = 4, 7, 0.9, 0.8
    mask = prefix_mask([7, 3, 1, 5], N)
    r, v = torch.randn(B, N, generator=g, dtype=torch.float64), torch.randn(B, N, generator=g, dtype=torch.float64)
    adv, ret = ppo.gae(r, v, mask, gamma, lam)
    for b in range(B):
        n = int(mask[b].sum())
        V = lambda t: v[b, t].item() if t < n else 0.0  # noqa: E731  the episode ends after token n-1
        for t in range(N):
            want = sum((gamma * lam) ** k * (r[b, t + k].item() + gamma * V(t + k + 1) - V(t + k))
                       for k in range(n - t)) if t < n else 0.0
            assert adv[b, t].item() == pytest.approx(want, abs=1e-12)
            assert ret[b, t].item() == pytest.approx(want + V(t) if t < n else 0.0, abs=1e-12)


def test_gae_with_gamma_lambda_one_is_reward_to_go():
    g = torch.Generator().manual_seed(1)
    mask = prefix_mask([5, 2, 6], 6)
    r, v = torch.randn(3, 6, generator=g, dtype=torch.float64), torch.randn(3, 6, generator=g, dtype=torch.float64)
    adv, _ = ppo.gae(r, v, mask, 1.0, 1.0)
    to_go = (r * mask).flip(1).cumsum(1).flip(1) * mask
    torch.testing.assert_close(adv + v * mask, to_go)


def test_masked_whiten_and_padding_contributes_nothing():
    g = torch.Generator().manual_seed(2)
    mask = prefix_mask([4, 1, 3], 5)
    x = torch.randn(3, 5, generator=g, dtype=torch.float64)
    w = ppo.masked_whiten(x, mask)
    real = x[mask]
    torch.testing.assert_close(w[mask], (real - real.mean()) / (real.var(unbiased=True) + 1e-8) ** 0.5)
    assert (w[~mask] == 0).all()
    # garbage (even NaN-free huge numbers) in PAD positions changes nothing anywhere
    y = torch.where(mask, x, 1e6)
    torch.testing.assert_close(ppo.masked_whiten(y, mask), w)
    v = torch.randn(3, 5, generator=g, dtype=torch.float64)
    for a, b in zip(ppo.gae(x, v, mask, 1.0, 0.95), ppo.gae(y, torch.where(mask, v, -1e6), mask, 1.0, 0.95)):
        torch.testing.assert_close(a, b)
    old = torch.randn(3, 5, generator=g, dtype=torch.float64)
    for f in (lambda u: ppo.ppo_policy_loss(u, old, x, mask, 0.2), lambda u: ppo.ppo_value_loss(u, old, x, mask, 0.2)):
        assert f(v)[0].item() == pytest.approx(f(torch.where(mask, v, 1e6))[0].item(), abs=1e-12)


# -----------------------------------------------------------------------------
# PPO losses


def test_clipped_policy_loss_value_and_gradient():
    eps = 0.2
    # (ratio, advantage): inside the band; above it with A>0 (clipped: no gradient); above it with A<0
    # (not clipped: the pessimistic term is the unclipped one); below with A<0 (clipped); below with A>0
    cases = [(1.1, 2.0), (1.5, 1.0), (1.5, -1.0), (0.5, -3.0), (0.5, 0.5)]
    ratio = torch.tensor([c[0] for c in cases], dtype=torch.float64)
    adv = torch.tensor([[c[1] for c in cases]], dtype=torch.float64)
    old = torch.full((1, 5), -1.3, dtype=torch.float64)
    logp = (old + ratio.log()[None]).requires_grad_(True)
    mask = torch.ones(1, 5, dtype=torch.bool)
    loss, clipfrac, approx_kl = ppo.ppo_policy_loss(logp, old, adv, mask, eps)
    clipped = [False, True, False, True, False]
    want = sum(-a * (min(max(r, 1 - eps), 1 + eps) if c else r) for (r, a), c in zip(cases, clipped)) / 5
    assert loss.item() == pytest.approx(want, abs=1e-12)
    assert clipfrac.item() == pytest.approx(2 / 5)
    assert approx_kl.item() == pytest.approx(sum((r - 1) - math.log(r) for r, _ in cases) / 5, abs=1e-12)
    loss.backward()
    # d(-A·ρ)/d log π = -A·ρ; zero where the ratio is clipped on the side the advantage pushes
    grad = [0.0 if c else -a * r / 5 for (r, a), c in zip(cases, clipped)]
    torch.testing.assert_close(logp.grad[0], torch.tensor(grad, dtype=torch.float64))


def test_clipped_value_loss_value_and_gradient():
    eps = 0.2
    old = torch.tensor([[0.0, 0.0, 0.0, 0.0]], dtype=torch.float64)
    ret = torch.tensor([[1.0, 1.0, -1.0, 0.05]], dtype=torch.float64)
    # moved 0.1 (in the band); moved 0.5 toward the return (clipped to 0.2: worse, so it counts, gradient 0);
    # moved 0.5 away from the return (the unclipped error is worse: it counts); moved -0.5 past a close return
    v = torch.tensor([[0.1, 0.5, 0.5, -0.5]], dtype=torch.float64, requires_grad=True)
    mask = torch.ones(1, 4, dtype=torch.bool)
    loss, vf_clipfrac = ppo.ppo_value_loss(v, old, ret, mask, eps)
    vc = [0.1, 0.2, 0.2, -0.2]
    terms = [max((a - r) ** 2, (c - r) ** 2) for a, c, r in zip([0.1, 0.5, 0.5, -0.5], vc, [1.0, 1.0, -1.0, 0.05])]
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
    a, b = torch.meshgrid(torch.linspace(-30, 0, 301, dtype=torch.float64), torch.linspace(-30, 0, 301, dtype=torch.float64),
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
    assert ppo.adaptive_kl_coef(0.1, 12.0, 6.0, 10000, 500) == pytest.approx(0.1 * (1 + 0.2 * 0.05))  # clipped at +0.2
    assert ppo.adaptive_kl_coef(0.1, 5.4, 6.0, 10000, 500) == pytest.approx(0.1 * (1 - 0.1 * 0.05))


# -----------------------------------------------------------------------------
# the reward model


def test_bradley_terry_loss_and_gradient():
    rc = torch.tensor([1.0, -0.5, 2.0], dtype=torch.float64, requires_grad=True)
    rr = torch.tensor([0.0, 0.5, 2.0], dtype=torch.float64, requires_grad=True)
    loss = reward.bt_loss(rc, rr)
    delta = [1.0, -1.0, 0.0]
    assert loss.item() == pytest.approx(sum(math.log(1 + math.exp(-x)) for x in delta) / 3, abs=1e-12)
    loss.backward()
    want = torch.tensor([-(1 - 1 / (1 + math.exp(-x))) / 3 for x in delta], dtype=torch.float64)
    torch.testing.assert_close(rc.grad, want)
    torch.testing.assert_close(rr.grad, -want)


def test_reward_read_at_last_token_independent_of_padding():
    torch.manual_seed(0)
    m = GPT(GPTConfig(block_size=32, vocab_size=50, n_layer=2, n_head=2, n_embd=16, head="scalar")).eval()
    torch.nn.init.normal_(m.score.weight)  # the zero init would make every score 0
    pad, seqs = 49, [[1, 5, 6, 7], [1, 8, 9, 10, 11, 12, 13], [1, 3]]
    alone = [m(torch.tensor([s]))[0, -1].item() for s in seqs]
    # right padding, no mask (the training batches), with the real-token mask from the collate targets
    ids, targets = data.collate([(s[:1], s[1:]) for s in seqs] + [([1], [2] * 20)], pad)
    right = reward.score_at_last(m(ids), reward.pair_mask(targets))[:3]
    # left padding with a mask (generate's layout)
    L = 12
    lids = torch.tensor([[pad] * (L - len(s)) + s for s in seqs])
    lmask = torch.tensor([[False] * (L - len(s)) + [True] * len(s) for s in seqs])
    left = reward.score_at_last(m(lids, mask=lmask), lmask)
    torch.testing.assert_close(right, torch.tensor(alone), atol=1e-5, rtol=0)
    torch.testing.assert_close(left, torch.tensor(alone), atol=1e-5, rtol=0)


def test_load_trunk_keeps_the_transformer(tmp_path):
    from model import save_model
    torch.manual_seed(0)
    lm = GPT(GPTConfig(block_size=16, vocab_size=20, n_layer=1, n_head=2, n_embd=8, dropout=0.1))
    save_model(lm, str(tmp_path / "m.safetensors"), {})
    rm, _ = reward.load_trunk(str(tmp_path / "m.safetensors"), "scalar", "cpu")
    assert rm.config.dropout == 0.0 and rm.config.head == "scalar"
    assert torch.equal(rm.transformer.h[0].mlp.c_fc.weight, lm.transformer.h[0].mlp.c_fc.weight)
    assert (rm.score.weight == 0).all()
    pol, _ = reward.load_trunk(str(tmp_path / "m.safetensors"), "lm", "cpu")
    assert pol.lm_head.weight is pol.transformer.wte.weight


# -----------------------------------------------------------------------------
# the weight broadcast, on two gloo ranks


def _broadcast_worker(rank, init_file, result_dir):
    torch.distributed.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    cfg = GPTConfig(block_size=24, vocab_size=40, n_layer=2, n_head=2, n_embd=16)
    torch.manual_seed(rank)  # the ranks' trainers differ: only rank 0's weights may arrive
    trainer = GPT(cfg)
    torch.manual_seed(100 + rank)
    rollout = GPT(cfg).eval()
    d = Dist(rank, rank, 2, torch.device("cpu"), rank == 0, False)
    n_bytes, seconds = ppo.broadcast_weights(trainer, rollout, d)
    torch.manual_seed(0)
    want = GPT(cfg)  # rank 0's trainer, rebuilt
    same = all(torch.equal(a, b) for a, b in zip(rollout.state_dict().values(), want.state_dict().values()))
    tied = rollout.lm_head.weight is rollout.transformer.wte.weight
    outs = [generate(m, [[1, 2, 3], [1]], 12, eos_id=0, pad_id=39, generator=torch.Generator().manual_seed(7))
            for m in (rollout, want)]
    sample_same = all(torch.equal(outs[0][k], outs[1][k]) for k in outs[0])
    n_params = sum(p.numel() for p in want.parameters())
    with open(os.path.join(result_dir, f"{rank}.json"), "w") as f:
        json.dump(dict(same=same, tied=tied, sample_same=sample_same, bytes=n_bytes, want_bytes=4 * n_params,
                       seconds=seconds), f)
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


def tiny_ppo_config(tiny, rm, out, eval_prompts, **kw):
    return ppo.Config(out_dir=str(out), sft=f"{tiny.sft}/model.safetensors", reward_model=rm,
                      prompts=f"{tiny.task}/prompts_train.jsonl", eval_prompts=eval_prompts, iterations=3,
                      rollout_batch=8, mini_batch=4, micro_batch_size=2, ppo_epochs=2, eval_k=1, **kw)


@pytest.fixture(scope="module")
def tiny_rm(tiny):
    """reward.py on two gloo ranks, a few steps on the tiny stack; returns its folder."""
    out = tiny.root / "ppo-test" / "reward"
    run_torchrun("reward.py", [f"--out_dir={out}", f"--sft={tiny.sft}/model.safetensors",
                               f"--train_pairs={tiny.task}/pairs_train.jsonl", f"--val_pairs={tiny.task}/pairs_val.jsonl",
                               f"--prompts={tiny.task}/prompts_train.jsonl", "--steps=4", "--batch_size=8",
                               "--micro_batch_size=2", "--eval_every=4", "--offset_samples=16"])
    return out


def test_reward_two_ranks(tiny_rm):
    with open(tiny_rm / "eval.json") as f:
        ev = json.load(f)
    assert 0 <= ev["val_accuracy"] <= 1 and math.isfinite(ev["offset"])
    with open(tiny_rm / "metrics.jsonl") as f:
        assert [json.loads(line)["step"] for line in f] == [1, 4]


def test_ppo_two_ranks_and_resume(tiny, tiny_rm):
    root, rm = tiny.root / "ppo-test", str(tiny_rm / "model.safetensors")
    prompts = root / "eval_prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n"
                               for p in data.read_prompts(f"{tiny.task}/prompts_eval.jsonl")[:8]))
    cfg = tiny_ppo_config(tiny, rm, root / "ppo2", str(prompts))
    run_torchrun("ppo.py", [f"--{k}={v}" for k, v in vars(cfg).items() if not isinstance(v, bool)])
    with open(root / "ppo2" / "eval.json") as f:
        ev = json.load(f)
    assert math.isfinite(ev["true_reward"]) and math.isfinite(ev["kl"]) and set(ev["time_shares"]) == set(ppo.PHASES)
    with open(root / "ppo2" / "metrics.jsonl") as f:
        assert [json.loads(line)["step"] for line in f] == [1, 2, 3]
    # one process: uninterrupted, and stopped after 2 iterations then resumed; also --reward true and adaptive KL
    for name, extra in [("full", {}), ("split", {"stop_after": 2})]:
        ppo.main(tiny_ppo_config(tiny, rm, root / name, str(prompts), reward="true", adaptive_kl=True, **extra))
    ppo.main(tiny_ppo_config(tiny, rm, root / "split", str(prompts), reward="true", adaptive_kl=True))
    a, b = (load_file(str(root / n / "model.safetensors")) for n in ("full", "split"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    rows = [[json.loads(line) for line in open(root / n / "metrics.jsonl")] for n in ("full", "split")]
    strip = lambda r: {k: v for k, v in r.items() if not k.startswith(("time/", "share/", "tokens_per", "mfu"))}  # noqa: E731
    assert [strip(r) for r in rows[0]] == [strip(r) for r in rows[1]]


def test_ppo_stops_on_non_finite(tiny, tiny_rm, tmp_path):
    prompts = tmp_path / "eval.jsonl"
    prompts.write_text(json.dumps({"prompt": "the movie is"}) + "\n")
    cfg = tiny_ppo_config(tiny, str(tiny_rm / "model.safetensors"), tmp_path / "ppo", str(prompts), lr=1e30)
    with pytest.raises(SystemExit, match=r"non-finite grad_norm \(nan\) at iteration 1 .* the last good checkpoint is kept: none"):
        ppo.main(cfg)
    assert not os.path.exists(tmp_path / "ppo" / "model.safetensors")


# ====================================================================================================
# compare.py
# ====================================================================================================

def test_reference_against_itself_kl_zero_win_rate_half(tiny):  # noqa: F811
    tok = data.load_tokenizer(f"{tiny.sft}/tokenizer.json")
    ref, ref2 = (load_model(f"{tiny.sft}/model.safetensors")[0] for _ in range(2))
    res = evaluate_policy(ref, ref2, tok, data.read_prompts(f"{tiny.task}/prompts_eval.jsonl"), init_distributed(), k=2)
    n = res["n_completions"]
    assert n == 400
    assert res["kl"] == 0.0  # the same weights score the same tokens with the same function: exactly
    # Each comparison scores 1, 1/2 or 0 and, both sides sampling the same model independently, has mean
    # exactly 1/2 for every prompt; its variance is at most 1/4, so the mean of n lies within 4 standard
    # errors, 4·(1/2)/√n = 0.1, except with probability < 1e-4.
    assert abs(res["win_rate"] - 0.5) <= 4 * 0.5 / math.sqrt(n)


@pytest.mark.parametrize("bias", [True, False])
def test_analytic_bytes_match_the_tensors(bias):
    for head in ("lm", "scalar"):
        c = GPTConfig(block_size=24, vocab_size=40, n_layer=2, n_head=2, n_embd=16, bias=bias, head=head)
        torch.manual_seed(0)
        m = GPT(c)
        ps = list(m.parameters())  # a tied lm_head is wte: once
        assert costs.n_params(c) == (sum(p.numel() for p in ps), len(ps))
        w = sum(p.nbytes for p in ps)
        assert costs.state_bytes(c, False) == {"weights": w, "grads": 0, "optimizer": 0, "total": w}
        opt = torch.optim.AdamW(ps)
        m(torch.randint(0, 40, (2, 10))).float().pow(2).mean().backward()
        opt.step()  # AdamW allocates m, v and a step count per tensor
        got = {"weights": w, "grads": sum(p.grad.nbytes for p in ps),
               "optimizer": sum(t.nbytes for s in opt.state.values() for t in s.values())}
        assert costs.state_bytes(c, True) == {**got, "total": sum(got.values())}
        assert costs.state_bytes(c, False, w=2)["weights"] == sum(p.nbytes for p in GPT(c).to(torch.bfloat16).parameters())
    # mixed precision: 2 + 2 + 12 bytes per trained parameter (+ 4 per tensor), the optimizer's share split by ZeRO-1
    big = GPTConfig(block_size=512, vocab_size=32000, n_layer=32, n_head=32, n_embd=4096, bias=False)
    P, n = costs.n_params(big)
    assert 6.5e9 < P < 6.7e9
    assert costs.state_bytes(big, True, w=2)["total"] == 16 * P + 4 * n
    assert costs.state_bytes(big, True, w=2, world=8, shard="zero1")["total"] == 4 * P + (12 * P + 4 * n) / 8
    assert costs.state_bytes(big, False, w=2, world=8, shard="fsdp")["total"] == 2 * P / 8


def test_analytic_flops_and_bytes_match_one_measured_iteration(tiny):  # noqa: F811
    # r_φ and the critic: π_ref's trunk with a fresh scalar head (load_trunk), enough to count their work
    sft_file = f"{tiny.sft}/model.safetensors"
    cfg = compare.Config(task=tiny.task, sft=sft_file, reward_model=sft_file)
    c, flops, shapes, models = costs.measure_small(cfg, init_distributed(), B=8)
    for job in costs.JOBS:
        assert costs.iteration_flops(c, job, **shapes[job]) == flops[job], job  # exact: the same counting rules
    assert shapes["ppo"]["T"] > shapes["ppo"]["P"] + 1  # the rollout sampled several tokens (KV-cache steps counted)
    for name, head, trains in costs.JOBS["ppo"]:
        measured, w = models[name]
        assert costs.state_bytes(replace(c, head=head), trains, w=w) == measured, name


def test_mean_and_standard_error_across_seeds_by_hand():
    m, se = compare.mean_se([1.0, 2.0, 3.0, 6.0])
    # mean 3; sample variance (4 + 1 + 0 + 9) / 3 = 14/3; s.e. = √(14/3 / 4) = √(7/6)
    assert m == 3.0 and se == pytest.approx(math.sqrt(7 / 6), rel=1e-12)
    assert compare.mean_se([0.5])[0] == 0.5 and math.isnan(compare.mean_se([0.5])[1])
    assert compare.mean_se([1.0, None]) == (None, None)  # an eval.json without the field


def test_matched_kl_interpolation_by_hand():
    # settings of one method, each a list of its seeds' (kl, reward); given out of KL order
    c = [(5.0, 1.0), (5.0, 1.0)]  # mean (5, 1), no spread
    a = [(1.0, 0.0), (1.0, 1.0)]  # mean (1, 0.5); the reward alone spreads
    b = [(2.5, 2.0), (3.5, 2.0)]  # mean (3, 2); the KL alone spreads
    curve = [c, a, b]
    # x = 2: halfway from a to b, 0.5 + 0.5·1.5 = 1.25; slope 0.75. reward − 0.75·kl per seed: a
    # (-0.75, 0.25), s.e. |difference|/2 = 0.5; b (0.125, -0.625), s.e. 0.375. se² = 0.5²·0.5² +
    # 0.5²·0.375² = 0.09765625 = 0.3125²
    y, se = compare.at_kl(curve, 2.0)
    assert y == pytest.approx(1.25, abs=1e-12) and se == pytest.approx(0.3125, abs=1e-12)
    # x = 4: halfway from b to c, 1.5; slope -0.5: b's 2 + 0.5·kl = (3.25, 3.75), s.e. 0.25; c none
    y, se = compare.at_kl(curve, 4.0)
    assert y == pytest.approx(1.5, abs=1e-12) and se == pytest.approx(0.5 * 0.25, abs=1e-12)
    assert compare.at_kl(curve, 1.0)[0] == pytest.approx(0.5, abs=1e-12)  # the range's own ends
    assert compare.at_kl(curve, 5.0)[0] == pytest.approx(1.0, abs=1e-12)
    for x in (0.99, 5.01, 0.0):  # outside the measured range of mean KL [1, 5]: no number
        assert compare.at_kl(curve, x) is None
    assert compare.at_kl([a], 1.0) is None  # one setting: no curve to read


def test_learning_curve_chunks_equal_the_uninterrupted_run_and_end_at_its_eval(tiny, dpo_cache):  # noqa: F811
    d = init_distributed()
    c = dpo_cfg(tiny, "curve-chunks", steps=4, eval_k=2)
    points = compare.train_in_chunks(dpo, c, 2, d, resume=False)
    assert [p["step"] for p in points] == [2, 4]
    with open(tiny.root / "curve-chunks" / "eval.json") as f:
        ev = json.load(f)
    # the last point is the run's own final evaluation: the same policy, prompts, k and seed
    assert {k: ev[k] for k in points[-1] if k != "step"} == {k: v for k, v in points[-1].items() if k != "step"}
    assert points[0]["kl"] != points[1]["kl"]  # the first point saw the policy halfway
    dpo.main(dpo_cfg(tiny, "curve-whole", steps=4, eval_k=2))
    a, b = dpo_weights(tiny.root / "curve-chunks"), dpo_weights(tiny.root / "curve-whole")
    assert all(torch.equal(a[k], b[k]) for k in a)  # chunks and evaluations change nothing: bit for bit
    # killed after the last chunk's checkpoint, before its evaluations: resuming trains nothing more
    # and writes the run's eval.json and the last point again
    out = tiny.root / "curve-chunks"
    os.remove(out / "eval.json")
    (out / "curve.json").write_text(json.dumps(points[:1]))
    assert compare.train_in_chunks(dpo, c, 2, d, resume=True) == points
    assert json.loads((out / "eval.json").read_text()) == ev


def test_tiny_sweep_end_to_end_then_resumed_on_two_ranks(tiny):  # noqa: F811
    root = tiny.root / "compare-test"
    task = root / "task"  # a slice of the task, so every run takes a second or two
    os.makedirs(task)
    for name, n in (("pairs_train.jsonl", 256), ("pairs_val.jsonl", 64), ("prompts_train.jsonl", 256),
                    ("prompts_eval.jsonl", 16)):
        (task / name).write_text("".join(open(f"{tiny.task}/{name}").readlines()[:n]))
    sft_file = f"{tiny.sft}/model.safetensors"
    precompute.main(precompute.Config(out_dir=str(root / "ref_logps"), ref_model=sft_file,
                                      train_pairs=str(task / "pairs_train.jsonl"), val_pairs=str(task / "pairs_val.jsonl")))
    cfg = compare.Config(out_dir=str(root / "out"), task=str(task), sft=sft_file, reward_model=sft_file,
                         ref_logps=str(root / "ref_logps"), betas="0.1", kl_coefs="0.05", true_kl_coefs="",
                         seeds="1,1001", dpo_steps=2, ppo_iterations=2, eval_k=1, curve_beta=0.1,
                         curve_kl_coef=0.05, curve_points=2, match_kls="0.001", rounds=1, time_steps=2)
    compare.main(cfg)
    with open(root / "out" / "frontier.csv") as f:
        rows = list(csv.DictReader(f))
    assert [(r["run"], r["method"], r["seed"]) for r in rows] == [
        ("ref", "π_ref", ""), ("dpo-beta0.1-seed1", "DPO", "1"), ("dpo-beta0.1-seed1001", "DPO", "1001"),
        ("ppo-kl0.05-seed1", "PPO", "1"), ("ppo-kl0.05-seed1001", "PPO", "1001")]
    assert float(rows[0]["kl"]) == 0.0 and all(math.isfinite(float(r[k])) for r in rows for k in ("kl", "true_reward", "win_rate"))
    assert rows[1]["kl"] != rows[2]["kl"] and rows[3]["kl"] != rows[4]["kl"]  # the seeds trained differently
    md = (root / "out" / "frontier.md").read_text()
    for i in (1, 3):  # each setting's row: the mean over its two seeds ± the standard error across them
        m, se = compare.mean_se([float(rows[j]["true_reward"]) for j in (i, i + 1)])
        assert f"{m:+.3f} ± {se:.3f}" in md
    # each curve: step 0 is π_ref, its last point the first seed's eval.json (ppo.py's and dpo.py's)
    with open(root / "out" / "curves.csv") as f:
        curves = list(csv.DictReader(f))
    for run, row in (("dpo-beta0.1-seed1", rows[1]), ("ppo-kl0.05-seed1", rows[3])):
        c = [r for r in curves if r["run"] == run]
        assert [int(r["step"]) for r in c] == [0, 1, 2] and float(c[0]["kl"]) == 0.0
        assert c[-1]["kl"] == row["kl"] and c[-1]["true_reward"] == row["true_reward"]
        assert float(c[0]["flops"]) == 0 < float(c[1]["flops"]) < float(c[2]["flops"])
    assert [int(r["responses"]) for r in curves] == [0, 128, 256, 0, 64, 128]  # 2 x 64 pairs; 64 rollouts
    with open(root / "out" / "costs.json") as f:
        res = json.load(f)
    for job in costs.JOBS:
        r = res["jobs"][job]
        assert r["bytes_analytic"] == r["bytes_measured"] and r["flops_analytic"] == r["flops_counted"], job
    assert res["jobs"]["ppo"]["bytes_analytic"]["total"] > res["jobs"]["dpo_live"]["bytes_analytic"]["total"] \
        > res["jobs"]["dpo_cache"]["bytes_analytic"]["total"]
    summary = (root / "out" / "summary.md").read_text()
    assert "python compare.py --out_dir" in summary and "frontier" in summary and "7B" in summary
    # resumed on two ranks with one more β: the five finished runs are skipped, only β 0.3 trains
    args = [a for k, v in vars(replace(cfg, betas="0.1,0.3")).items() if not isinstance(v, bool) for a in (f"--{k}", str(v))]
    p = run_torchrun("compare.py", args + ["--no-costs"])
    assert p.stdout.count("eval.json exists with the same config and inputs: skipped") == 5
    assert "[4/7] dpo-beta0.3-seed1: dpo.main" in p.stdout
    with open(root / "out" / "frontier.csv") as f:
        assert [r["run"] for r in csv.DictReader(f)] == ["ref", "dpo-beta0.1-seed1", "dpo-beta0.1-seed1001",
                                                        "dpo-beta0.3-seed1", "dpo-beta0.3-seed1001",
                                                        "ppo-kl0.05-seed1", "ppo-kl0.05-seed1001"]
