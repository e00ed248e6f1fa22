"""--fsdp: FSDP2 (fully_shard) instead of DDP, through plumbing.wrap, on two gloo ranks: plumbing's
sharded gradients, norms, state and checkpoints against one process in float64; sft.py, dpo.py
(cached and live), precompute.py, reward.py and ppo.py sharded against one process or DDP; a
checkpoint resumed sharded and back.

    pytest tests/test_fsdp.py
"""
import json
import os
from dataclasses import asdict, replace

import torch
import torch.multiprocessing as mp
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import load_file

import checkpoint
import data
import dpo
import plumbing
import ppo
import precompute
import sft
from checkpoint import tokenizer_beside
from model import sequence_logprobs
from plumbing import Dist
from tests.helpers import (DPO_TOL, TWO_RANK_TOL, as_flags, dpo_cfg, dpo_metrics, dpo_pcfg,
                           read_metrics, reward_args, run_torchrun, saved_weights, sft_args,
                           tiny_gpt, tiny_ppo_config)


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


def test_fsdp_dpo_two_ranks_equal_one_process_cached_and_live(tiny, dpo_cache):
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


def test_fsdp_precompute_two_ranks_writes_the_same_cache(tiny, dpo_cache):
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


def test_fsdp_resumes_a_one_process_checkpoint_and_back(tiny, dpo_cache):
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
