"""The cost ladder's last rungs (study/costs.py): SimPO's job, the policy alone with no cache and
cached DPO's FLOPs, and iterative DPO's row at the prompts its rounds sampled, as run. Closed forms
written out by hand, one iteration of each job counted and the timed runs of one round, on the tiny
π_ref (tests/helpers.py's fixture); the wall table's time per example, from made-up timings.

    pytest tests/test_costs_ladder.py
"""
import json
import os
from dataclasses import asdict

import pytest

import dpo
import grpo
import iterative_dpo
import online_dpo
import ppo
import precompute
from model import GPTConfig
from plumbing import init_distributed
from study import compare, costs


def test_simpo_holds_the_policy_alone_and_no_cache():
    assert costs.JOBS["simpo"] == [("policy", "lm", True)]
    assert costs.LABEL["simpo"] == "SimPO (no π_ref)"
    # the ladder, PPO down to SimPO (LABEL's last key is the precompute)
    assert list(costs.JOBS) == ["ppo", "grpo", "online_dpo", "iterative_dpo", "dpo_live",
                                "dpo_cache", "simpo"]
    assert list(costs.LABEL)[:-1] == list(costs.JOBS)
    # 2 fp32 a pair for cached DPO's pool; nothing for SimPO
    assert costs.cache_bytes("dpo_cache", 4500, 500) == 8 * 4500
    assert costs.cache_bytes("simpo", 4500, 500) == 0
    # at 7B: one trained model in bf16 with an fp32 master copy and Adam's m and v, 16 bytes a
    # parameter and 4 a tensor (AdamW's step counts), under DDP on every GPU
    big = costs.at_7b()
    P, n = costs.n_params(GPTConfig(block_size=512, vocab_size=32000, n_layer=32, n_head=32,
                                    n_embd=4096, bias=False))
    assert big["jobs"]["simpo"]["bytes_per_gpu"]["ddp"] == 16 * P + 4 * n


def test_simpo_flops_are_the_cached_dpo_step_by_hand():
    c = GPTConfig(block_size=24, vocab_size=40, n_layer=2, n_head=2, n_embd=16)
    B, T, K = 3, 10, 17  # pairs, columns, response tokens (where the LM head runs)
    C, L, V, N = 16, 2, 40, 2 * 3 * 10  # width, layers, vocabulary, positions of [chosen; rejected]
    # forward: 2 FLOPs a weight of the 12·C² a layer at every position, the head at K, two
    # attention bmm of 2·T·T·C each row; backward: 2x the matmuls, 2.5x attention (scores
    # recomputed)
    mm = L * 2 * N * 12 * C * C + 2 * K * C * V
    attn = L * 2 * 2 * (2 * B) * T * T * C
    step = 3 * mm + 7 * attn // 2
    assert step == 2_545_920  # 3 · 759,040 + 3.5 · 76,800
    assert costs.iteration_flops(c, "simpo", B, T, K) == {"policy": step, "reference": 0}
    assert costs.iteration_flops(c, "simpo", B, T, K) == costs.iteration_flops(c, "dpo_cache",
                                                                              B, T, K)
    # and at 7B a token costs what cached DPO's does
    big = costs.at_7b()["jobs"]
    assert big["simpo"]["flops_per_token"] == big["dpo_cache"]["flops_per_token"]


def rounds_json(folder, sampled, **config):
    os.makedirs(folder)
    cfg = {"pairs": 1000, "steps": 50, "batch_size": 64, **config}
    rounds = [{"round": i + 1, "labelled": cfg["pairs"], "sampled": s}
              for i, s in enumerate(sampled)]
    (folder / "rounds.json").write_text(json.dumps({"config": cfg, "rounds": rounds}))


def test_iterative_sampling_share_scales_with_the_prompts_its_rounds_sampled(tmp_path):
    # no runs: the nominal round, 1,000 prompts for 1,000 pairs
    assert costs.iterative_sampled("") == {"sampled": 1000, "runs": [], "rounds": 0}
    rounds_json(tmp_path / "iter-a", [2000])
    rounds_json(tmp_path / "iter-b", [4000])
    want = {"sampled": 3000, "rounds": 2,
            "runs": [str(tmp_path / "iter-a/rounds.json"), str(tmp_path / "iter-b/rounds.json")]}
    assert costs.iterative_sampled(f"{tmp_path}/iter-a, {tmp_path}/iter-b") == want
    assert costs.iterative_sampled(f"{tmp_path}/iter-*") == want  # a glob
    # the mean is over rounds: 2000, 4000 and a run of two rounds, 1000 and 5000
    rounds_json(tmp_path / "iter-c", [1000, 5000])
    assert costs.iterative_sampled(f"{tmp_path}/iter-*")["sampled"] == 3000
    assert costs.iterative_sampled(f"{tmp_path}/iter-c")["rounds"] == 2
    # FLOPs: the sampling's share is 3000 / (50 · 64) against 1000 / (50 · 64), three times the
    # nominal; the precompute (the round's 1,000 pairs) and the step are unchanged
    c = GPTConfig(block_size=24, vocab_size=40, n_layer=2, n_head=2, n_embd=16)
    shape = dict(B=3, T=14, K=20, P=5, L=16, share=1000 / 3200)
    nominal = costs.iteration_flops(c, "iterative_dpo", **shape, sampling=1000 / 3200)
    as_run = costs.iteration_flops(c, "iterative_dpo", **shape, sampling=3000 / 3200)
    assert costs.round_share(3000) == 0.9375 and costs.ITERATIVE_SHARE == 0.3125
    assert as_run["rollout"] == pytest.approx(3 * nominal["rollout"]) and nominal["rollout"] > 0
    assert (as_run["precompute"], as_run["policy"]) == (nominal["precompute"], nominal["policy"])
    # wall: 3000 / 50 = 60 prompts a step at online DPO's rollout time per prompt, 1000 / 50 = 20
    # pairs at the precompute's time per pair, and the cached step
    r = {"online_dpo": {"phases": {"rollout": 32.0 * online_dpo.Config.rollout_batch}},
         "precompute": {"ms": 4500.0}, "dpo_cache": {"ms": 100.0}}
    assert costs.iterative_step(r, 3000, 4500) == {
        "ms": 60 * 32 + 20 + 100, "phases": {"sampling": 60 * 32, "precompute": 20, "step": 100}}
    assert costs.iterative_step(r, 1000, 4500)["phases"]["sampling"] == 20 * 32
    # at 7B the sampling share scales the rollout phase alone: as run costs more per token
    big = costs.at_7b(sampled=3000)["jobs"]["iterative_dpo"]["flops_per_token"]
    assert big > costs.at_7b()["jobs"]["iterative_dpo"]["flops_per_token"]


def test_iterative_runs_of_another_round_or_none_are_refused(tmp_path):
    with pytest.raises(SystemExit, match="no rounds.json in"):
        costs.iterative_sampled(str(tmp_path / "missing"))
    rounds_json(tmp_path / "big", [4000], pairs=2000)
    with pytest.raises(SystemExit, match="the cost row is iterative_dpo.py's default round"):
        costs.iterative_sampled(str(tmp_path / "big"))
    rounds_json(tmp_path / "unfinished", [])
    with pytest.raises(SystemExit, match="no finished round"):
        costs.iterative_sampled(str(tmp_path / "unfinished"))


def test_counted_flops_of_simpo_and_of_iterative_dpo_as_run(tiny):
    # r_φ and the critic: π_ref's trunk with a fresh scalar head, enough to count their work
    sft_file = f"{tiny.sft}/model.safetensors"
    cfg = compare.Config(task=tiny.task, sft=sft_file, reward_model=sft_file)
    c, flops, shapes, units, models = costs.measure_small(cfg, init_distributed(), B=8,
                                                          sampled=3000)
    # SimPO: cached DPO's batch and step, counted by torch's FlopCounterMode, no reference
    assert flops["simpo"] == flops["dpo_cache"] and flops["simpo"]["reference"] == 0
    assert units["simpo"] == units["dpo_cache"] and shapes["simpo"] == shapes["dpo_cache"]
    # iterative DPO as run: 3000 / (50 · 64) of online DPO's counted rollout, 1000 / (50 · 64) of
    # its π_ref forward, and the analytic function agrees at these shares
    it, on = flops["iterative_dpo"], flops["online_dpo"]
    assert (it["rollout"], it["precompute"]) == (0.9375 * on["rollout"], 0.3125 * on["reference"])
    for job in ("simpo", "iterative_dpo"):
        assert costs.iteration_flops(c, job, **shapes[job]) == flops[job], job


def test_simpo_is_timed_as_its_own_dpo_run(tiny, tiny_rm):
    # a slice of the task, so each timed run takes a second
    root, sft_file = tiny.root / "costs-ladder", f"{tiny.sft}/model.safetensors"
    os.makedirs(root / "task")
    for name, n in (("pairs_train.jsonl", 256), ("pairs_val.jsonl", 64),
                    ("prompts_train.jsonl", 256), ("prompts_test.jsonl", 16)):
        (root / "task" / name).write_text("".join(open(f"{tiny.task}/{name}").readlines()[:n]))
    precompute.main(precompute.Config(out_dir=str(root / "ref_logps"), ref_model=sft_file,
                                      train_pairs=str(root / "task/pairs_train.jsonl"),
                                      val_pairs=str(root / "task/pairs_val.jsonl")))
    cfg = compare.Config(out_dir=str(root / "out"), task=str(root / "task"), sft=sft_file,
                         reward_model=str(tiny_rm / "model.safetensors"),
                         ref_logps=str(root / "ref_logps"), rounds=1,
                         time_steps=2)
    rounds = costs.timed_runs(cfg, init_distributed(), lambda s: None)
    assert list(rounds[0]) == ["ppo", "grpo", "online_dpo", "dpo_live", "dpo_cache", "simpo",
                               "precompute"]
    assert rounds[0]["simpo"]["ms"] > 0 and rounds[0]["simpo"]["phases"]["policy_forward"] > 0
    # its first step: cached DPO's batch and policy (the same log-probs), SimPO's loss: at π = π_ref
    # DPO's rewards are 0 and its loss log 2; SimPO's rewards are β/|y| · log π, below 0
    first = {job: json.loads(open(root / f"out/timing/{job}/metrics.jsonl").readline())
             for job in ("dpo_cache", "simpo")}
    dpo_step, simpo_step = first["dpo_cache"], first["simpo"]
    assert simpo_step["logps/chosen"] == dpo_step["logps/chosen"]
    assert dpo_step["rewards/chosen"] == 0 and dpo_step["loss"] == pytest.approx(0.6931, abs=1e-4)
    assert simpo_step["rewards/chosen"] < 0 and simpo_step["loss"] != dpo_step["loss"]


def test_wall_per_example_divides_by_the_examples_it_names_by_hand():
    # the loops' defaults the rows name: GRPO's 64 completions are 16 prompts × 4, and its example
    # is a completion (a rollout), as PPO's; the DPO loops' a pair
    assert (grpo.Config.rollout_batch, grpo.Config.group_size) == (64, 4)
    assert ppo.Config.rollout_batch == online_dpo.Config.rollout_batch == 64
    assert dpo.Config.batch_size == iterative_dpo.Config.batch_size == 64
    ms = {"ppo": 960.0, "grpo": 832.0, "online_dpo": 640.0, "iterative_dpo": 320.0,
          "dpo_live": 192.0, "dpo_cache": 128.0, "simpo": 160.0, "precompute": 4500.0}
    one = {"weights": 1, "grads": 1, "adam": 1, "total": 3}  # bytes: not what is read here
    fl = {"step": 10 ** 6}
    jobs = {job: dict(models={k: {"trainable": tr} for k, _, tr in held}, bytes_analytic=one,
                      bytes_measured=one, cache_bytes=0, peak_bytes=None, flops_analytic=fl,
                      flops_counted=fl, units=dict(positions=100, tokens=80, examples=8))
            for job, held in costs.JOBS.items()}
    jobs["precompute"] = {}
    for job, t in ms.items():
        jobs[job]["time"] = dict(ms=t, per_dpo_cached=t / 128, tokens_per_sec=0, mfu=0,
                                 mfu_hardware=0, phases={})
    cost = dict(ms=1.0, per_dpo_cached=1.0, flops_per_dpo_cached=1.0, flops_per_dpo_cached_7b=1.0)
    res = dict(model=asdict(GPTConfig()), params=1, device="cpu", world=1, threads=1,
               n_pairs=4500, jobs=jobs, payback_steps=1.0, layouts={},
               payback_flops=dict(epoch_steps=1, precompute_train=1, precompute_val=1,
                                  live_per_step=1, live_per_eval=1, eval_every=1, steps=1,
                                  evals=1),
               iterative=dict(rounds=0, runs=[], sampled=1000, nominal=cost), at_7b=costs.at_7b())
    md = costs.costs_markdown(res, compare.Config(rounds=3, time_steps=4))
    wall = md.split("### Wall time of the real loops")[1].split("\n\n")[1].splitlines()[2:]
    got = [[c.strip() for c in line.strip("|").split("|")][:4] for line in wall]
    assert got == [["PPO", "960", "64 rollouts", "15.00"],
                   ["GRPO", "832", "64 rollouts", "13.00"],  # 832 / 64, not / 16 prompts
                   ["online DPO", "640", "64 pairs", "10.00"],
                   ["iterative DPO", "320", "64 pairs", "5.00"],
                   ["DPO, live π_ref", "192", "64 pairs", "3.00"],
                   ["DPO, cached log π_ref", "128", "64 pairs", "2.00"],
                   ["SimPO (no π_ref)", "160", "64 pairs", "2.50"],
                   ["precompute (once)", "4,500", "4500 pairs (train + val)", "1.00"]]
