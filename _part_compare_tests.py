"""Tests of compare.py (merged into test_all.py by the lead): the shared evaluation's zero point, the
analytic bytes and FLOPs against the tensors and torch's counter, and a tiny sweep end to end
(one process, then resumed on two gloo ranks)."""
import csv
import json
import math
import os
from dataclasses import replace

import pytest
import torch

import compare
import data
import precompute
from _part_fixtures import run_torchrun, tiny  # noqa: F401  (tiny is a fixture)
from evaluate import evaluate_policy
from model import GPT, GPTConfig, load_model
from plumbing import init_distributed


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
        assert compare.n_params(c) == (sum(p.numel() for p in ps), len(ps))
        w = sum(p.nbytes for p in ps)
        assert compare.state_bytes(c, False) == {"weights": w, "grads": 0, "optimizer": 0, "total": w}
        opt = torch.optim.AdamW(ps)
        m(torch.randint(0, 40, (2, 10))).float().pow(2).mean().backward()
        opt.step()  # AdamW allocates m, v and a step count per tensor
        got = {"weights": w, "grads": sum(p.grad.nbytes for p in ps),
               "optimizer": sum(t.nbytes for s in opt.state.values() for t in s.values())}
        assert compare.state_bytes(c, True) == {**got, "total": sum(got.values())}
        assert compare.state_bytes(c, False, w=2)["weights"] == sum(p.nbytes for p in GPT(c).to(torch.bfloat16).parameters())
    # mixed precision: 2 + 2 + 12 bytes per trained parameter (+ 4 per tensor), the optimizer's share split by ZeRO-1
    big = GPTConfig(block_size=512, vocab_size=32000, n_layer=32, n_head=32, n_embd=4096, bias=False)
    P, n = compare.n_params(big)
    assert 6.5e9 < P < 6.7e9
    assert compare.state_bytes(big, True, w=2)["total"] == 16 * P + 4 * n
    assert compare.state_bytes(big, True, w=2, world=8, shard="zero1")["total"] == 4 * P + (12 * P + 4 * n) / 8
    assert compare.state_bytes(big, False, w=2, world=8, shard="fsdp")["total"] == 2 * P / 8


def test_analytic_flops_and_bytes_match_one_measured_iteration(tiny):  # noqa: F811
    # r_φ and the critic: π_ref's trunk with a fresh scalar head (load_trunk), enough to count their work
    sft_file = f"{tiny.sft}/model.safetensors"
    cfg = compare.Config(task=tiny.task, sft=sft_file, reward_model=sft_file)
    c, flops, shapes, models = compare.measure_small(cfg, init_distributed(), B=8)
    for job in compare.JOBS:
        assert compare.iteration_flops(c, job, **shapes[job]) == flops[job], job  # exact: the same counting rules
    assert shapes["ppo"]["T"] > shapes["ppo"]["P"] + 1  # the rollout sampled several tokens (KV-cache steps counted)
    for name, head, trains in compare.JOBS["ppo"]:
        measured, w = models[name]
        assert compare.state_bytes(replace(c, head=head), trains, w=w) == measured, name


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
                         dpo_steps=2, ppo_iterations=1, eval_k=1, rounds=1, time_steps=2)
    compare.main(cfg)
    with open(root / "out" / "frontier.csv") as f:
        rows = list(csv.DictReader(f))
    assert [(r["run"], r["method"]) for r in rows] == [("ref", "π_ref"), ("dpo-beta0.1", "DPO"), ("ppo-kl0.05", "PPO")]
    assert float(rows[0]["kl"]) == 0.0 and all(math.isfinite(float(r[k])) for r in rows for k in ("kl", "true_reward", "win_rate"))
    with open(root / "out" / "costs.json") as f:
        costs = json.load(f)
    for job in compare.JOBS:
        r = costs["jobs"][job]
        assert r["bytes_analytic"] == r["bytes_measured"] and r["flops_analytic"] == r["flops_counted"], job
    assert costs["jobs"]["ppo"]["bytes_analytic"]["total"] > costs["jobs"]["dpo_live"]["bytes_analytic"]["total"] \
        > costs["jobs"]["dpo_cache"]["bytes_analytic"]["total"]
    summary = (root / "out" / "summary.md").read_text()
    assert "python compare.py --out_dir" in summary and "frontier" in summary and "7B" in summary
    # resumed on two ranks with one more β: the three finished runs are skipped, only dpo-beta0.3 trains
    args = [a for k, v in vars(replace(cfg, betas="0.1,0.3")).items() if not isinstance(v, bool) for a in (f"--{k}", str(v))]
    p = run_torchrun("compare.py", args + ["--no-costs"])
    assert p.stdout.count("eval.json exists with the same config and inputs: skipped") == 3
    assert "[3/4] dpo-beta0.3: dpo.main" in p.stdout
    with open(root / "out" / "frontier.csv") as f:
        assert [r["run"] for r in csv.DictReader(f)] == ["ref", "dpo-beta0.1", "dpo-beta0.3", "ppo-kl0.05"]
