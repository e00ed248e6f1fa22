"""The gradient and loss checks: each loss against hand-computed values, autograd against the
analytic gradient (float64, gradcheck), and the equivalences, a fast path against the obvious one:
the KV cache against the full forward, packed against padded batches, the cached reference against
the live one, two ranks against one process, a resumed run against an uninterrupted one.

    pytest test_all.py            # these checks, in sections named by what they check
    pytest test_all.py -k dpo     # one area
    pytest                        # everything: these and tests/*.py, a file for each promise (bad
                                  # input, reliability, the task, your data, the evaluation, bf16
                                  # and CUDA, FSDP, Hugging Face export, FLOPs, the studies)
"""
import copy
import json
import math
import os
import re
import socket
from dataclasses import asdict, replace
from types import SimpleNamespace

from tests import helpers  # first: it pins the suite to the CPU before torch is imported
from tests.helpers import (CPU, DPO_TOL, ROOT, TWO_RANK_TOL, as_flags, dpo_cfg, dpo_metrics,
                           dpo_pcfg, dpo_weights, iterative_cfg, read_metrics, reward_args,
                           run_torchrun, run_whole, saved_weights, sft_args, tiny_gpt,
                           tiny_ppo_config, tiny_reward_config, torchrun, torchrun_env)

import pytest
import torch
import torch.multiprocessing as mp
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import load_file

import data
import dpo
import grpo
import iterative_dpo
import online_dpo
import plumbing
import ppo
import precompute
import reward
import services
import sft
import task as tasks  # the built-in task (`task` is a fixture's name in the suite)
from meter import anatomy
from model import (GPT, GPTConfig, generate, load_model, new_kv_cache, pair_logps, read_meta,
                   save_model, score_at_last, sequence_logprobs, token_logprobs)
from plumbing import Dist, init_distributed

# the tiny stack's fixtures (tests/helpers.py), found by name: a test names one as an argument
tiny, dpo_cache, tiny_rm, ppo_test_prompts = (helpers.tiny, helpers.dpo_cache, helpers.tiny_rm,
                                              helpers.ppo_test_prompts)


# ==================================================================================================
# the model: causal, padding-invariant, log-probs and KV-cache generation equal to the full
# forward, save/load round trips (model.py)
# ==================================================================================================

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


# ==================================================================================================
# batches: the same global batches on any world size, and sorted by length the same batches
# with less padding (data.py)
# ==================================================================================================

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
# the lr schedule; SFT: two ranks equal one process and resumed equals uninterrupted
# (plumbing.py, sft.py)
# ==================================================================================================

def test_lr_schedule_warmup_then_cosine():
    lrs = [plumbing.lr_at(s, 100, 1.0, 10, 0.1) for s in range(100)]
    assert lrs[0] == pytest.approx(0.1) and lrs[9] == pytest.approx(1.0)
    assert lrs[10] == pytest.approx(1.0) and all(a >= b for a, b in zip(lrs[10:], lrs[11:]))
    assert plumbing.lr_at(100, 100, 1.0, 10, 0.1) == pytest.approx(0.1)


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


# ==================================================================================================
# the DPO losses against hand values and their gradient against §4 of the paper; step 0 gives
# ln 2; cached equals live; packed equals padded; two ranks equal one (precompute.py, dpo.py)
# ==================================================================================================

DPO_METRICS = ["loss", "rewards/chosen", "rewards/rejected", "rewards/accuracies",
               "rewards/margins",
               "logps/chosen", "logps/rejected", "grad_norm", "lr", "tokens_per_sec", "mfu",
               "mfu_hardware"]


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


def test_concatenated_forward_equals_separate_forwards_and_counts_only_responses(
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


def test_grouped_micro_batches_with_targets_only_give_todays_loss_and_gradients(tiny):
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


def test_packed_batches_give_the_padded_logprobs_loss_and_gradients(tiny):
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


def test_packed_reward_reads_each_sequence_at_its_own_last_token(tiny):
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


def test_step_zero_policy_equals_reference(tiny, dpo_cache):
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


def test_rpo_step_zero_adds_alpha_times_the_chosen_nll_per_token(tiny, dpo_cache):
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


def test_simpo_step_zero_loss_is_the_closed_form(tiny, dpo_cache):
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


def test_simpo_run_builds_no_cache_and_holds_one_model(tiny, dpo_cache, tmp_path,
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


def test_cached_equals_live(tiny, dpo_cache):
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


def test_packed_run_equals_padded_and_either_reads_the_others_cache(tiny, dpo_cache):
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


def test_cache_rows_follow_their_index_when_rows_are_dropped(tiny, dpo_cache):
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


def test_resumed_equals_uninterrupted(tiny, dpo_cache):
    full, part = dpo_cfg(tiny, "dpo-full", steps=4), dpo_cfg(tiny, "dpo-resumed", steps=4,
                                                             stop_after=2)
    dpo.main(full)
    dpo.main(part)
    assert not os.path.exists(os.path.join(part.out_dir, "model.safetensors"))
    dpo.main(part)  # resumes at step 2
    assert ([m["loss"] for m in dpo_metrics(full.out_dir)]
            == [m["loss"] for m in dpo_metrics(part.out_dir)])
    assert dpo_max_diff(dpo_weights(full.out_dir), dpo_weights(part.out_dir)) == 0.0


# -----------------------------------------------------------------------------
# distributed (gloo on the CPU)


def test_precompute_two_ranks_writes_the_same_cache(tiny, dpo_cache):
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
def dpo_two_ranks(tiny, dpo_cache):
    """`torchrun --nproc_per_node=2 dpo.py`, 2 ranks x 2 micro-steps x 4; returns its config."""
    two = dpo_cfg(tiny, "dpo-2ranks", steps=2, micro_batch_size=4)
    p = run_torchrun("dpo.py", dpo_flags(two))  # also the smoke run: evaluation and outputs too
    assert "held-out pairs: accuracy" in p.stdout
    return two


def test_two_ranks_equal_one_process(tiny, dpo_two_ranks):
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


def test_two_launches_equal_two_ranks_in_one(tiny, dpo_two_ranks):
    """The README's multi-machine commands, two launches of one rank each on this machine (on a free
    port), train as one launch of two ranks: the same logged steps, and the same weights up to
    fp32 rounding, not bitwise: each launch gives its rank every core (its LOCAL_WORLD_SIZE is 1),
    the one launch half of them each, and intra-op threads sum in another order (with the thread
    counts made equal, the weights were measured bitwise equal)."""
    readme = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
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
    d = Dist(rank, rank, 2, torch.device("cpu"), rank == 0, False)
    engine = services.RolloutEngine(GPT(cfg), d)
    rollout = engine.model
    n_bytes, seconds = services.WeightSync(d).push(trainer, engine)
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
# reward.py and ppo.py: two gloo ranks equal one process; resumed equals uninterrupted; the
# loop's wiring against the obvious computation


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


def test_reward_packed_equals_padded(tiny, tmp_path):
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


def test_reward_resumed_equals_uninterrupted(tiny, dpo_cache, tmp_path):
    reward.main(tiny_reward_config(tiny, tmp_path / "full"))
    reward.main(tiny_reward_config(tiny, tmp_path / "split", stop_after=5))
    reward.main(tiny_reward_config(tiny, tmp_path / "split"))  # resumes at step 5
    a, b = (load_file(str(tmp_path / n / "model.safetensors")) for n in ("full", "split"))
    assert all(torch.equal(a[k], b[k]) for k in a)  # the same operations in the same order
    steps = [[json.loads(x)["step"] for x in open(tmp_path / n / "metrics.jsonl")]
             for n in ("full", "split")]
    assert steps[0] == steps[1] == [1, 10, 12]  # no extra line at the resumed run's first step


def test_ppo_two_ranks_equal_one_process(tiny, tiny_rm, ppo_test_prompts):
    root, rm = tiny.root / "ppo-test", str(tiny_rm / "model.safetensors")
    # Two iterations of 2 epochs over 2 minibatches of 4 rollouts: 1 process x 4 micro-steps of 1,
    # 2 ranks x 2. Minibatch j must be the same 4 rollouts on any world size, though each rank
    # rolled out only half of the 8. lr 3e-3: the second epoch clips some ratios, so clipfrac
    # and approx_kl are not 0 and their normalisation shows (at 1e-3 no ratio left [0.8, 1.2]).
    one = tiny_ppo_config(tiny, rm, root / "ppo1", ppo_test_prompts, iterations=2, mini_batch=4,
                          micro_batch_size=1, lr=3e-3)
    ppo.main(one)
    two = replace(one, out_dir=str(root / "ppo2"))
    run_torchrun("ppo.py", [f"--{k}={v}" for k, v in vars(two).items() if not isinstance(v, bool)])
    rows_one, rows_two = read_metrics(one.out_dir), read_metrics(two.out_dir)
    assert [a["step"] for a in rows_one] == [b["step"] for b in rows_two] == [1, 2]
    for a, b in zip(rows_one, rows_two):
        # the same rollouts: each one's tokens come from its own row of uniforms, on any rank
        for k in ("response_len", "eos_rate", "true_reward"):
            assert a[k] == b[k], k
        assert 0 < a["eos_rate"] < 1 and a["clipfrac"] > 0 and a["approx_kl"] > 1e-4
        for k in ("score", "entropy", "kl", "loss/policy", "loss/value", "approx_kl", "clipfrac",
                  "explained_variance", "grad_norm"):
            assert abs(a[k] - b[k]) <= TWO_RANK_TOL * max(1, abs(a[k])), (a["step"], k)
    ea, eb = (json.loads(open(os.path.join(c.out_dir, "eval.json")).read()) for c in (one, two))
    assert set(eb["time_shares"]) == set(ppo.PHASES)
    # π_ref's side of the evaluation does not depend on the update: the same completions, exactly
    for k in ("ref_true_reward", "ref_eos_rate", "ref_response_len", "ref_true_reward_finished"):
        assert ea[k] == eb[k], k
    # the policy's KL after the update: a sum of ~45 tokens' log-ratios under weights that went
    # through eight Adam steps (lr 3e-3) on each side; measured 1.3e-6 relative
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

    def spy(name, f, keep, module=ppo):
        def g(*a, **kw):
            out = f(*a, **kw)
            seen[name].append(keep(a, kw, out))
            return out
        monkeypatch.setattr(module, f.__name__, g)
    spy("gen", services.generate, lambda a, kw, out: (copy.deepcopy(a[0]), a[1], kw, out), services)
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
    got = services.oracle_scores(torch.tensor([2.0, 0.0, 0.0]), u, 3)
    assert got.tolist() == [0.5, 0.0, 1.0]
    # each group reads its own draw, u 0.9 for both: σ(0 - 5) < 0.9, so the first group's second
    # wins; σ(5 - 0) = 0.993 > 0.9, so the second group's first wins
    u2 = torch.full((2, 2, 2), 0.9)
    assert services.oracle_scores(torch.tensor([0.0, 5.0, 5.0, 0.0]), u2, 2).tolist() == [
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
    service = services.RewardService(None, cfg.missing_eos_score, tok, init_distributed())
    mine, has_eos, scores = service.score_groups(ro, texts * 3, 0, cfg)
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
    real_sample = services.RolloutEngine.sample
    monkeypatch.setattr(services.RolloutEngine, "sample",
                        lambda *a, **kw: batches.append(list(a[2])) or real_sample(*a, **kw))
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
    # Two iterations of 2 epochs over 3 minibatches of 4 (1 process x 4 micro-steps of 1, 2 ranks
    # x 2): minibatch j must be the same completions on any world size, though each rank sampled
    # only its 6. lr 3e-3: the second epoch clips, so the clip's normalisation shows.
    rm = str(tiny_rm / "model.safetensors")
    one = tiny_grpo_config(tiny, rm, tmp_path / "grpo1", ppo_test_prompts, iterations=2,
                           rollout_batch=12, mini_batch=4, micro_batch_size=1, reward="oracle",
                           lr=3e-3)
    grpo.main(one)
    two = replace(one, out_dir=str(tmp_path / "grpo2"))
    run_torchrun("grpo.py", [f"--{k}={v}" for k, v in vars(two).items() if not isinstance(v, bool)])
    rows_one, rows_two = read_metrics(one.out_dir), read_metrics(two.out_dir)
    assert [a["step"] for a in rows_one] == [b["step"] for b in rows_two] == [1, 2]
    for a, b in zip(rows_one, rows_two):
        for k in ("response_len", "eos_rate", "true_reward"):  # the same rollouts
            assert a[k] == b[k], k
        assert a["clipfrac"] > 0 and a["approx_kl"] > 1e-4
        assert a["score"] == pytest.approx(0.5)  # the oracle's: each pair of a group, one win
        for k in ("score", "adv_abs", "entropy", "kl", "loss/policy", "loss/kl", "approx_kl",
                  "clipfrac", "grad_norm"):
            assert abs(a[k] - b[k]) <= TWO_RANK_TOL * max(1, abs(a[k])), (a["step"], k)
    eb = json.loads(open(os.path.join(two.out_dir, "eval.json")).read())
    assert set(eb["time_shares"]) == set(grpo.PHASES)


def test_grpo_default_loss_has_its_kl_term_and_the_oracle_draws_its_own_uniforms(
        tiny, tmp_path, monkeypatch):
    # Two iterations with kl_coef left at its default, watched. Every loss the update takes is the
    # clipped surrogate plus β times the mean k3, with DeepSeekMath's β = 0.04 (Shao et al. 2024,
    # sec. 4.2), and that term is not 0 once the policy has moved off π_ref (lr 3e-3). --reward
    # oracle: the Bradley-Terry labels' uniforms share no value with the sampling's, a stream of
    # their own, not the tokens' uniforms read again.
    losses, draws = [], []
    real_loss, real_oracle = grpo.grpo_loss, services.oracle_scores
    real_generate = services.generate

    def spy_loss(*a):
        out = real_loss(*a)
        losses.append(([x.detach() if torch.is_tensor(x) else x for x in a], out[0].detach()))
        return out

    def spy_generate(*a, uniforms=None, **kw):
        draws.append({"U": uniforms})
        return real_generate(*a, uniforms=uniforms, **kw)

    def spy_oracle(true, u, group_size):
        draws[-1]["u"] = u
        return real_oracle(true, u, group_size)
    monkeypatch.setattr(grpo, "grpo_loss", spy_loss)
    monkeypatch.setattr(services, "generate", spy_generate)
    monkeypatch.setattr(services, "oracle_scores", spy_oracle)
    grpo.main(tiny_grpo_config(tiny, "", tmp_path / "grpo", f"{tiny.task}/prompts_test.jsonl",
                               reward="oracle", lr=3e-3, iterations=3, stop_after=2))  # no eval
    assert len(draws) == 2 and len(losses) == 2 * 2 * 2 * 2  # iterations, epochs, minibatches,
    for d in draws:  # micro-steps
        assert d["u"].numel() == 2 * 4 * 4 and d["U"].numel() > d["u"].numel()
        assert not set(d["u"].flatten().tolist()) & set(d["U"].flatten().tolist())
    terms = []
    for (logp, old, ref, adv, mask, eps, _, n), loss in losses:
        log_r = torch.where(mask, ref - logp, 0.0)
        k3 = torch.where(mask, log_r.exp() - log_r - 1, 0.0)  # (π_ref/π) - log(π_ref/π) - 1
        term = 0.04 * (k3.sum(1) / mask.sum(1)).sum() / n
        surrogate = real_loss(logp, old, ref, adv, mask, eps, 0.0, n)[0]
        torch.testing.assert_close(loss, surrogate + term, rtol=1e-5, atol=1e-8)
        terms.append(term.item())
    # π is π_ref until the first step (k3 0), then every loss carries the term
    assert max(terms[:2]) < 1e-8 and min(terms[2:]) > 1e-5


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


def test_online_round_equals_dpo_step_on_the_same_pairs(tiny, monkeypatch):
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
    monkeypatch.setattr(services, "generate", fake_generate(table))
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
    monkeypatch.setattr(services, "generate", spy_generate)
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
    monkeypatch.setattr(services, "generate", spy_generate)
    monkeypatch.setattr(online_dpo, "bradley_terry_labels", spy_labels)
    monkeypatch.setattr(online_dpo, "experience", spy_experience)
    return rounds


@pytest.mark.parametrize("labeller", ["model", "oracle"])
def test_online_dpo_two_ranks_equal_one_process_and_resumed_equals_uninterrupted(
        tiny, tiny_rm, labeller, monkeypatch):
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
    r = tasks.true_reward("", " ".join(words[1:3]))
    # the same words, the second cut before its EOS (masked off)
    ro = dict(resp=torch.tensor([[1, 2, 0], [1, 2, 0]]),
              rmask=torch.tensor([[True, True, True], [True, True, False]]))
    scores, has_eos = services.RewardService(None, cfg.missing_eos_score, tok, CPU).score(
        ro, ["a prompt"] * 2)
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


# ==================================================================================================
# iterative DPO: each round's cache equals a live reference on its pairs, the rounds chain their
# policies, two ranks sample what one process samples (iterative_dpo.py, dpo.py --init)
# ==================================================================================================

def test_dpo_init_starts_the_policy_at_the_given_weights(tiny, dpo_cache):
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
