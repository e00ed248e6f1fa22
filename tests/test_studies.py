"""The studies' tests (study/: compare, costs, tune, gpu, eos), moved out of test_all.py: the
statistics over seeds, the cost model against measured tensors and counted FLOPs, the tuning grid, a
tiny sweep end to end (and resumed under torchrun), the per-rank bytes under DDP and FSDP, the GPU
command on a CPU, RESULTS.md's sections, the KV-cache benchmark, the EOS study and the figure. The
fixtures and helpers they need are tests/helpers.py's.

    pytest tests/test_studies.py
"""
import contextlib
import csv
import io
import json
import math
import os
import shutil
import sys
from dataclasses import asdict, replace
from types import SimpleNamespace

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

import data
import dpo
import grpo
import ppo
import precompute
import task as tasks  # the built-in task (as test_all.py names it)
from meter import estimate_flops
from model import GPT, GPTConfig, load_model
from plumbing import init_distributed
from study import compare, costs, envelope, eos, figure, gpu, results, tables, tune
from tests.helpers import dpo_cfg, dpo_weights, run_torchrun  # fixtures come through conftest.py

# ==================================================================================================
# study/compare.py, study/tune.py
# ==================================================================================================

def test_compare_regimes_paths_and_a_bad_regime(tmp_path):
    cfg = compare.Config(out_dir=str(tmp_path / "cmp"), task=str(tmp_path / "task"),
                         sft=str(tmp_path / "sft/model.safetensors"),
                         regimes="default,capped,unseen,shifted")
    d, c, u, s = compare.regimes(cfg)
    assert (d["task"], d["sft"], d["prefix"]) == (cfg.task, cfg.sft, "")
    assert c["task"] == f"{cfg.task}-capped" and c["prefix"] == "capped/"
    assert c["reward_model"] == f"{cfg.out_dir}/capped/reward/model.safetensors"
    assert u["task"] == f"{cfg.task}-unseen" and u["prefix"] == "unseen/"
    # build_regime builds each task and keeps the default π_ref where the texts are the default's
    # (unseen), not where the generator differs (shifted); the later stages, present, are not built
    tasks.build_task(cfg.task, seed=0)
    for path in [cfg.sft] + [p for R in (u, s) for p in (R["own_sft"], R["reward_model"],
                                                        f"{R['ref_logps']}/train.safetensors")]:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        open(path, "w").close()
    said, one = [], SimpleNamespace(is_main=True, world=1, device="cpu")
    for R in (u, s):
        compare.build_regime(R, cfg, one, said.append)
    assert (u["sft"], s["sft"]) == (cfg.sft, s["own_sft"])
    assert len(said) == 2 and not [m for m in said if "missing" in m]
    with pytest.raises(SystemExit, match="not a regime"):
        compare.regimes(replace(cfg, regimes="default,greedy"))
    with pytest.raises(SystemExit, match="distinct"):
        compare.regimes(replace(cfg, regimes="capped,capped"))


def test_tune_varies_one_factor_at_a_time_at_one_budget_in_rollouts(tmp_path):
    """tune.py's PPO grid: each run differs from ppo.py's defaults in its one tuned field (the
    default setting once, not once per factor), and every run scores the same number of rollouts;
    DPO's grid is lr × length at one β."""
    cfg = tune.Config(out_dir=str(tmp_path), seeds="1,2", ppo_lrs="3e-5,1e-4",
                      ppo_epochs="2,4", rollout_batches="64,128", ppo_rollouts=1280)
    runs = tune.runs(cfg)
    # tuning reads the validation prompts only: the test prompts stay for what is reported
    assert {c.test_prompts for _, _, c in runs} == {"out/task/prompts_val.jsonl"}
    base, tuned = ppo.Config(), ("lr", "ppo_epochs", "rollout_batch")
    ppos = [c for _, stage, c in runs if stage is ppo]
    moved = sorted(tuple(f for f in tuned if getattr(c, f) != getattr(base, f)) for c in ppos)
    assert base.lr == 1e-4 and base.ppo_epochs == 4 and base.rollout_batch == 64
    assert moved == [(), (), ("lr",), ("lr",), ("ppo_epochs",), ("ppo_epochs",),
                     ("rollout_batch",), ("rollout_batch",)]
    assert all(c.iterations * c.rollout_batch == 1280 and c.kl_coef == cfg.kl_coef for c in ppos)
    dpos = [c for _, stage, c in runs if stage is dpo]
    assert sorted((c.lr, c.steps, c.seed) for c in dpos) == sorted(
        (lr, n, s) for lr in (1e-4, 3e-4, 1e-3) for n in (100, 200, 300) for s in (1, 2))
    assert all(c.beta == cfg.beta for c in dpos)
    # DPO's evaluation reads r_φ too, so its rows carry r_φ's score beside PPO's
    assert {c.reward_model for c in dpos} == {"out/reward/model.safetensors"}
    names = [name for name, _, c in runs]
    assert len(set(names)) == len(names) and all(
        c.out_dir == f"{tmp_path}/{name}" for name, _, c in runs)
    with pytest.raises(SystemExit, match="not a multiple of rollout batch 128"):
        tune.runs(replace(cfg, ppo_rollouts=1216))


def test_mean_and_standard_error_across_seeds_by_hand():
    m, se = tables.mean_se([1.0, 2.0, 3.0, 6.0])
    # mean 3; sample variance (4 + 1 + 0 + 9) / 3 = 14/3; s.e. = √(14/3 / 4) = √(7/6)
    assert m == 3.0 and se == pytest.approx(math.sqrt(7 / 6), rel=1e-12)
    assert tables.mean_se([0.5])[0] == 0.5 and math.isnan(tables.mean_se([0.5])[1])
    assert tables.mean_se([1.0, None]) == (None, None)  # an eval.json without the field


def frontier_row(method, config, seed, kl, reward, val_reward, check=None, eos=1.0, val_kl=None):
    """One run's row of frontier.csv, as compare.frontier writes it, from hand values."""
    beta, lr = config
    return dict(run=f"{method}-{config}-{seed}", regime="default", method=method,
                beta=beta if not method.startswith("PPO") else "",
                kl_coef=beta if method.startswith("PPO") else "", lr=lr, seed=seed, kl=kl,
                true_reward=reward, win_rate=0.5, eos_rate=eos, response_len=10.0,
                true_reward_finished=reward, beyond_pool=None, true_reward_se=0.1,
                n_completions=800, pool_best=None, val_kl=kl if val_kl is None else val_kl,
                val_true_reward=val_reward, val_eos_rate=eos, check_val_true_reward=check,
                wall_s=1.0)


def test_frontier_tables_select_on_validation_and_flag_by_hand():
    ref = dict(frontier_row("π_ref", ("", ""), "", 0.0, 0.0, 0.0), beta="", kl_coef="", lr="")
    rows = [ref]
    for seed, e in ((1, -0.1), (2, 0.1)):  # two seeds each, spread ±0.1 about the means
        rows += [frontier_row("DPO", (0.1, 1e-3), seed, 2.0, 2.0 + e, 2.0 + e, check=2.0 + e),
                 # better on test, but dominated on validation: never chosen
                 frontier_row("DPO", (0.1, 3e-4), seed, 2.0, 5.0 + e, 1.0 + e, check=1.0 + e),
                 frontier_row("PPO", (0.1, 1e-4), seed, 2.0, 1.0 + e, 1.0 + e, check=1.0 + e),
                 # cut: 10% of its completions hit the budget
                 frontier_row("PPO", (0.3, 1e-4), seed, 1.0, 3.0 + e, 3.0 + e, check=3.0 + e,
                              eos=0.9),
                 # budget: validation reward rose by 1 (± 0.02) over the last quarter
                 frontier_row("PPO", (1.0, 1e-4), seed, 0.5, 2.5 + e, 2.5 + e,
                              check=1.5 + e + 0.02 * seed)]
    cfg = compare.Config(match_kls="1,2", check_at=0.75)
    md = tables.frontier_markdown(rows, cfg)
    line = lambda key: next(x for x in md.splitlines() if key in x)  # noqa: E731
    assert line("| DPO | β 0.1, lr 0.001 |").split("|")[-3].strip() == "✓"
    assert line("| DPO | β 0.1, lr 0.0003 |").split("|")[-3].strip() == ""
    assert "| cut |" in line("KL coef 0.3, lr 0.0001")
    assert "| budget |" in line("KL coef 1, lr 0.0001")
    assert "| – |" in line("KL coef 0.1, lr 0.0001")  # neither flag
    # matched KL: DPO's envelope runs from π_ref (0, 0) to its chosen (2, 2): at 1 nat +1, at 2
    # +2; PPO's, its flagged settings left out, from (0, 0) to (2, 1): +0.5 and +1
    mk = tables.matched_kl_markdown(rows, cfg)
    assert "| 1 | +1.000 | +0.500 | +0.50 [" in mk and "| 2 | +2.000 | +1.000 | +1.00 [" in mk
    # J_β at 0.1: DPO's lr chosen on validation (1e-3: 2 − 0.1·2 = 1.8), not its better test one
    jb = tables.j_beta_markdown(rows, cfg)
    assert "| 0.1 | +1.80 [" in jb and "(lr 0.001)" in jb and "+4.80" not in jb
    # DPO − PPO: 1.8 − (1.0 − 0.1·2 = 0.8) = +1.00, each side spread ±0.1 over its 2 seeds
    welch = [f"{v:+.2f}" for v in envelope.welch_interval([1.7, 1.9], [0.7, 0.9])]
    assert f"| +1.00 [{welch[1]}, {welch[2]}] |" in jb


def test_matched_kl_marks_cells_read_off_a_long_chord_by_hand():
    ref = dict(frontier_row("π_ref", ("", ""), "", 0.0, 0.0, 0.0), beta="", kl_coef="", lr="")
    rows = [ref]
    for seed, e in ((1, -0.1), (2, 0.1)):
        # DPO's envelope: (0, 0) to (5, 5), one chord of 5 nats; PPO's: (0, 0), (1, 2), (3, 3),
        # (6, 3.5), chords of 1, 2 (not more than CHORD_MAX = 2: no mark) and 3 nats
        rows += [frontier_row("DPO", (0.1, 1e-3), seed, 5.0, 5.0 + e, 5.0 + e),
                 frontier_row("PPO", (0.1, 1e-4), seed, 1.0, 2.0 + e, 2.0 + e),
                 frontier_row("PPO", (0.03, 1e-4), seed, 3.0, 3.0 + e, 3.0 + e),
                 frontier_row("PPO", (0.01, 1e-4), seed, 6.0, 3.5 + e, 3.5 + e)]
    mk = tables.matched_kl_markdown(rows, compare.Config(match_kls="0.5,2,4,5,6"))
    row = lambda x: next(r for r in mk.splitlines() if r.startswith(f"| {x} |"))  # noqa: E731
    assert row(0.5).startswith("| 0.5 | +0.500 (chord) | +1.000 | ")
    assert row(2).startswith("| 2 | +2.000 (chord) | +2.500 | ")
    # PPO at 4: a third of the way from (3, 3) to (6, 3.5)
    assert row(4).startswith("| 4 | +4.000 (chord) | +3.167 (chord) | ")
    assert row(5).startswith("| 5 | +5.000 | +3.333 (chord) | ")  # DPO at its vertex: no mark
    assert row(6).startswith("| 6 | – | +3.500 | ")
    assert "such chords: DPO 0.00 to 5.00; PPO 3.00 to 6.00 (nats)." in mk


def test_samples_show_each_methods_chosen_configuration_first_seed_by_hand():
    ref = dict(frontier_row("π_ref", ("", ""), "", 0.0, 0.0, 0.0), beta="", kl_coef="", lr="")
    rows = [ref]
    for seed in (1, 2):
        rows += [frontier_row("DPO", (0.1, 1e-3), seed, 2.0, 2.0, 2.0, check=2.0),
                 frontier_row("DPO", (0.3, 1e-3), seed, 2.0, 9.0, 1.0, check=1.0),  # lower val
                 # the best on validation, but cut: passed over for the unflagged one
                 frontier_row("PPO", (0.1, 1e-4), seed, 2.0, 5.0, 5.0, check=5.0, eos=0.5),
                 frontier_row("PPO", (0.3, 1e-4), seed, 2.0, 1.0, 1.0, check=1.0)]
    assert {m: name for m, (name, _) in tables.chosen_configs(rows).items()} == {
        "DPO": "β 0.1, lr 0.001", "PPO": "KL coef 0.3, lr 0.0001"}
    good, salad = " the plot is good .", " great great great"
    samples = {"DPO-(0.1, 0.001)-1": [dict(prompt="the movie is bad .", policy=good,
                                           policy_finished=True, policy_reward=1.0)],
               "DPO-(0.1, 0.001)-2": [dict(prompt="x", policy="never shown",
                                           policy_finished=True, policy_reward=0.0)],
               "PPO-(0.3, 0.0001)-1": [dict(prompt="i liked it .", policy=salad,
                                            policy_finished=False, policy_reward=-1.0)]}
    md = tables.samples_markdown(rows, samples)
    assert "**DPO** (β 0.1, lr 0.001, DPO-(0.1, 0.001)-1)" in md and "never shown" not in md
    assert "- the movie is bad . → the plot is good . — +1, in the language" in md
    assert "- i liked it . → great great great (no EOS) — -1, not in the language" in md
    assert "**PPO** (KL coef 0.3, lr 0.0001" in md


def test_a_run_recorded_before_a_field_existed_is_the_same_run_at_its_default():
    c = dpo.Config(out_dir="o", beta=0.3)
    rec = {"stage": "dpo", "config": asdict(c), "sft_sha256": "ab"}
    older = {**rec, "config": {k: v for k, v in rec["config"].items() if k != "rpo_alpha"}}
    assert compare.same_run(rec, rec, dpo) and compare.same_run(older, rec, dpo)
    # the new field away from its default: another run; any other difference too
    assert not compare.same_run(older, {**rec, "config": asdict(replace(c, rpo_alpha=1.0))}, dpo)
    assert not compare.same_run(rec, {**rec, "config": asdict(replace(c, beta=0.1))}, dpo)
    assert not compare.same_run(older, {**rec, "sft_sha256": "cd"}, dpo)
    assert not compare.same_run(None, rec, dpo) and not compare.same_run({}, rec, dpo)


def test_learning_curve_chunks_equal_the_uninterrupted_run_and_end_at_its_eval(  # noqa: F811
        tiny, dpo_cache):
    d = init_distributed()
    c = dpo_cfg(tiny, "curve-chunks", steps=4, eval_k=2,
                val_prompts=str(tiny.root / "dpo-data/prompts_val.jsonl"))
    points = compare.train_in_chunks(dpo, c, 2, d, resume=False, val_at=2)
    assert [p["step"] for p in points] == [2, 4]
    with open(tiny.root / "curve-chunks" / "eval.json") as f:
        ev = json.load(f)
    # the budget rule's point: the step-2 checkpoint on the validation prompts; and the stage's
    # own evaluation scores the validation prompts too, under "val", as a study selects by
    val_end = compare.evaluate_checkpoint(dpo, c, d, c.val_prompts)
    assert ev["val"] == {k: v for k, v in val_end.items() if k != "samples"}
    assert ev["val"]["kl"] != ev["kl"] and "val" in points[0] and "val" not in points[1]
    assert points[0]["val"]["kl"] != ev["val"]["kl"]
    # the last point is the run's own final evaluation: the same policy, prompts, k and seed
    assert ({k: ev[k] for k in points[-1] if k != "step"}
            == {k: v for k, v in points[-1].items() if k != "step"})
    # without test evaluations, the chunks stop only where something is scored, and at the end
    c2 = replace(c, out_dir=str(tiny.root / "curve-val-only"))
    only = compare.train_in_chunks(dpo, c2, 1, d, resume=False, test=False, val_at=3)
    assert [p["step"] for p in only] == [3] and list(only[0]) == ["step", "val"]
    assert points[0]["kl"] != points[1]["kl"]  # the first point saw the policy halfway
    dpo.main(dpo_cfg(tiny, "curve-whole", steps=4, eval_k=2))
    a, b = dpo_weights(tiny.root / "curve-chunks"), dpo_weights(tiny.root / "curve-whole")
    # chunks and evaluations change nothing: bit for bit
    assert all(torch.equal(a[k], b[k]) for k in a)
    # killed after the last chunk's checkpoint, before its evaluations: resuming trains nothing more
    # and writes the run's eval.json and the last point again
    out = tiny.root / "curve-chunks"
    os.remove(out / "eval.json")
    (out / "curve.json").write_text(json.dumps(points[:1]))
    assert compare.train_in_chunks(dpo, c, 2, d, resume=True) == points
    assert json.loads((out / "eval.json").read_text()) == ev


def test_tiny_sweep_end_to_end_then_resumed_on_two_ranks(tiny, tiny_rm):  # noqa: F811
    root = tiny.root / "compare-test"
    task = root / "task"  # a slice of the task, so every run takes a second or two
    os.makedirs(task)
    for name, n in (("pairs_train.jsonl", 256), ("pairs_val.jsonl", 64),
                    ("prompts_train.jsonl", 256), ("prompts_val.jsonl", 16),
                    ("prompts_test.jsonl", 16)):
        (task / name).write_text("".join(open(f"{tiny.task}/{name}").readlines()[:n]))
    sft_file = f"{tiny.sft}/model.safetensors"
    precompute.main(precompute.Config(out_dir=str(root / "ref_logps"), ref_model=sft_file,
                                      train_pairs=str(task / "pairs_train.jsonl"),
                                      val_pairs=str(task / "pairs_val.jsonl")))
    cfg = compare.Config(out_dir=str(root / "out"), task=str(task), sft=sft_file,
                         reward_model=str(tiny_rm / "model.safetensors"),
                         ref_logps=str(root / "ref_logps"), betas="0.1",
                         dpo_lrs="1e-3", nll_betas="", kl_coefs="0.05", ppo_lrs="1e-4",
                         true_kl_coefs="", online_betas="", grpo_kl_coefs="0.05",
                         simpo_betas="2",
                         seeds="1,1001", dpo_steps=2, ppo_iterations=2, eval_k=1, curve_beta=0.1,
                         curve_kl_coef=0.05, curve_points=2, match_kls="0.001", rounds=1,
                         time_steps=2, results=str(root / "RESULTS.md"))
    compare.main(cfg)
    with open(root / "out" / "frontier.csv") as f:
        rows = list(csv.DictReader(f))
    assert [(r["run"], r["method"], r["seed"]) for r in rows] == [
        ("ref", "π_ref", ""), ("dpo-beta0.1-lr0.001-seed1", "DPO", "1"),
        ("dpo-beta0.1-lr0.001-seed1001", "DPO", "1001"),
        ("simpo-beta2-gamma0.5-lr0.001-seed1", "SimPO", "1"),
        ("simpo-beta2-gamma0.5-lr0.001-seed1001", "SimPO", "1001"),
        ("ppo-kl0.05-lr0.0001-seed1", "PPO", "1"), ("ppo-kl0.05-lr0.0001-seed1001", "PPO", "1001"),
        ("grpo-kl0.05-lr0.0001-seed1", "GRPO", "1"),
        ("grpo-kl0.05-lr0.0001-seed1001", "GRPO", "1001")]
    assert [(r["beta"], r["simpo_gamma"]) for r in rows[1:5]] == [("0.1", "")] * 2 + [
        ("2.0", "0.5")] * 2
    assert all(r["kl_coef"] == "0.05" and r["beta"] == "" for r in rows[5:])
    assert "| SimPO | β 2, γ 0.5, lr 0.001 | 2 |" in (root / "out" / "frontier.md").read_text()
    # SimPO read no cache and measured its KL to π_ref at evaluation: a real number, not 0
    assert float(rows[3]["kl"]) != 0.0
    # its β scales a margin, not a KL: no J_β row of its own
    jb = (root / "out" / "frontier.md").read_text().split("J_β = E[r]")[1].split("\n\n")[1]
    labels = [line.split("|")[1].strip() for line in jb.splitlines()[2:]]
    assert "SimPO" not in jb.splitlines()[0] and "0.05" in labels and "2" not in labels
    assert float(rows[0]["kl"]) == 0.0 and all(math.isfinite(float(r[k])) for r in rows
                                               for k in ("kl", "true_reward", "win_rate"))
    # every row carries r_φ's score, π_ref's and DPO's too (scored at evaluation only)
    assert all(math.isfinite(float(r["reward_model_score"])) for r in rows)
    # the seeds trained differently
    assert rows[1]["kl"] != rows[2]["kl"] and rows[5]["kl"] != rows[6]["kl"] != rows[7]["kl"]
    md = (root / "out" / "frontier.md").read_text()
    # each setting's row: the mean over its two seeds ± the standard error across them
    for i in (1, 3, 5, 7):
        m, se = tables.mean_se([float(rows[j]["true_reward"]) for j in (i, i + 1)])
        assert f"{m:+.3f} ± {se:.3f}" in md
    # each curve: step 0 is π_ref, its last point the first seed's eval.json (ppo.py's and dpo.py's)
    with open(root / "out" / "curves.csv") as f:
        curves = list(csv.DictReader(f))
    for run, row in (("dpo-beta0.1-lr0.001-seed1", rows[1]),
                     ("ppo-kl0.05-lr0.0001-seed1", rows[5])):
        c = [r for r in curves if r["run"] == run]
        assert [int(r["step"]) for r in c] == [0, 1, 2] and float(c[0]["kl"]) == 0.0
        assert c[-1]["kl"] == row["kl"] and c[-1]["true_reward"] == row["true_reward"]
        assert float(c[0]["flops"]) == 0 < float(c[1]["flops"]) < float(c[2]["flops"])
    # 2 x 64 pairs; 64 rollouts
    assert [int(r["responses"]) for r in curves] == [0, 128, 256, 0, 64, 128]
    # every point scored by r_φ too, the checkpoints between the ends included
    assert all(math.isfinite(float(r["reward_model_score"])) for r in curves)
    with open(root / "out" / "costs.json") as f:
        res = json.load(f)
    for job in costs.JOBS:
        r = res["jobs"][job]
        assert (r["bytes_analytic"] == r["bytes_measured"]
                and r["flops_analytic"] == r["flops_counted"]), job
    held = {job: res["jobs"][job]["bytes_analytic"]["total"] for job in costs.JOBS}
    assert held["ppo"] > held["grpo"] == held["online_dpo"] > held["dpo_live"] > held["dpo_cache"]
    # GRPO's wall time is grpo.py's own run: its phases, no critic's
    assert set(res["jobs"]["grpo"]["time"]["phases"]) == set(grpo.PHASES)
    # iterative DPO's wall per step, composed in each round: the cached step, and 20 pairs at
    # online DPO's rollout time per pair and the precompute's time per pair
    n_pairs = res["n_pairs"]
    for r in res["rounds"]:
        ph = r["iterative_dpo"]["phases"]
        assert ph["step"] == r["dpo_cache"]["ms"]
        assert ph["sampling"] == pytest.approx(20 * r["online_dpo"]["phases"]["rollout"] / 64)
        assert ph["precompute"] == pytest.approx(20 * r["precompute"]["ms"] / n_pairs)
        assert r["iterative_dpo"]["ms"] == pytest.approx(sum(ph.values()))
    summary = (root / "out" / "summary.md").read_text()
    assert ("python -m study.compare --out_dir" in summary and "frontier" in summary
            and "7B" in summary)
    # RESULTS.md: one section per table, each under the command that made it
    written = (root / "RESULTS.md").read_text()
    for name in ("frontier", "curves", "costs"):
        section = written.split(f"<!-- begin {name} -->\n")[1].split(f"<!-- end {name} -->")[0]
        assert section.startswith("- Command: `python -m study.compare --out_dir "), name
    assert "#### The frontier" in written and "#### Learning curves" in written and "7B" in written
    costs_before = written.split("<!-- begin costs -->")[1]
    # resumed on two ranks with one more β: the nine finished runs are skipped, only β 0.3 trains
    args = [a for k, v in vars(replace(cfg, betas="0.1,0.3")).items() if not isinstance(v, bool)
            for a in (f"--{k}", str(v))]
    p = run_torchrun("-m study.compare", args + ["--no-costs"])
    assert p.stdout.count("eval.json exists with the same config and inputs: skipped") == 9
    assert "[4/11] dpo-beta0.3-lr0.001-seed1: dpo.main" in p.stdout
    with open(root / "out" / "frontier.csv") as f:
        assert [r["run"] for r in csv.DictReader(f)] == [
            "ref", "dpo-beta0.1-lr0.001-seed1", "dpo-beta0.1-lr0.001-seed1001",
            "dpo-beta0.3-lr0.001-seed1", "dpo-beta0.3-lr0.001-seed1001",
            "simpo-beta2-gamma0.5-lr0.001-seed1", "simpo-beta2-gamma0.5-lr0.001-seed1001",
            "ppo-kl0.05-lr0.0001-seed1", "ppo-kl0.05-lr0.0001-seed1001",
            "grpo-kl0.05-lr0.0001-seed1", "grpo-kl0.05-lr0.0001-seed1001"]
    # the frontier's and the curves' sections rewritten by the torchrun command, the costs' kept
    written = (root / "RESULTS.md").read_text()
    assert written.count("<!-- begin frontier -->") == written.count("<!-- end costs -->") == 1
    assert "- Command: `torchrun --nproc_per_node=2 -m study.compare --out_dir " in written
    assert "| DPO | β 0.3, lr 0.001 | 2 |" in written.split("<!-- begin frontier -->")[1].split(
        "<!-- end frontier -->")[0]
    assert written.split("<!-- begin costs -->")[1] == costs_before


def test_kept_runs_resume_a_sweep_on_another_machine_and_refuse_another_pi_ref(tiny):  # noqa: F811
    # machine A trains the sweep with --keep; machine B (the same paths, but no out/ at all: a fresh
    # clone) restores π_ref from the kept inputs and skips every kept run, writing the same rows;
    # a π_ref that differs from the kept one is refused before any run
    root = tiny.root / "keep-test"
    task, m, keep = root / "task", root / "m", root / "kept"
    os.makedirs(task)
    for name, n in (("pairs_train.jsonl", 64), ("pairs_val.jsonl", 16),
                    ("prompts_train.jsonl", 64), ("prompts_val.jsonl", 8),
                    ("prompts_test.jsonl", 8)):
        (task / name).write_text("".join(open(f"{tiny.task}/{name}").readlines()[:n]))
    cfg = compare.Config(
        out_dir=str(m / "compare"), task=str(task), sft=str(m / "sft/model.safetensors"),
        reward_model=str(m / "sft/model.safetensors"), ref_logps=str(m / "ref_logps"),
        betas="0.1", nll_betas="", kl_coefs="", seeds="1", dpo_steps=2, eval_k=1,
        curve_points=0, match_kls="0.001", costs=False, results="", keep=str(keep))
    shutil.copytree(tiny.sft, m / "sft", ignore=shutil.ignore_patterns("ckpt"))
    precompute.main(precompute.Config(out_dir=cfg.ref_logps, ref_model=cfg.sft,
                                      train_pairs=str(task / "pairs_train.jsonl"),
                                      val_pairs=str(task / "pairs_val.jsonl")))
    compare.main(cfg)  # machine A
    for r in ("ref", "dpo-beta0.1-lr0.001-seed1"):
        assert all((keep / "compare" / r / f).exists() for f in ("run.json", "eval.json")), r
    assert not list(keep.glob("compare/*/ckpt")) and not list(keep.glob("compare/*/*.safetensors"))
    sft_bytes = (m / "sft/model.safetensors").read_bytes()
    assert (keep / "inputs/sft/model.safetensors").read_bytes() == sft_bytes
    rows = (m / "compare/frontier.csv").read_text()
    assert (keep / "compare/frontier.csv").read_text() == rows
    for folder in ("sft", "compare"):  # machine B: no π_ref, no runs, only the kept folder (and
        shutil.rmtree(m / folder)        # the cache, which an explicit --ref_logps does not build)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        compare.main(cfg)
    assert out.getvalue().count("eval.json exists with the same config and inputs: skipped") == 2
    assert "is missing: restored from" in out.getvalue()
    assert (m / "sft/model.safetensors").read_bytes() == sft_bytes
    assert (m / "compare/frontier.csv").read_text() == rows
    # machine C: a π_ref of its own, not the kept one: refused, the kept folder untouched
    shutil.rmtree(m / "sft")
    shutil.copytree(tiny.sft, m / "sft", ignore=shutil.ignore_patterns("ckpt"))
    path = str(m / "sft/model.safetensors")
    with safe_open(path, "pt") as f:
        meta = f.metadata()
    w = load_file(path)
    k = next(iter(w))
    w[k] = w[k] + 1e-3
    save_file(w, path, metadata=meta)
    before = {p: p.read_bytes() for p in keep.rglob("*") if p.is_file()}
    with pytest.raises(SystemExit, match="is not the sft the runs kept in"):
        compare.main(cfg)
    assert {p: p.read_bytes() for p in keep.rglob("*") if p.is_file()} == before


# ==================================================================================================
# study/costs.py
# ==================================================================================================

@pytest.mark.parametrize("bias", [True, False])
def test_analytic_bytes_match_the_tensors(bias):
    for head in ("lm", "scalar"):
        c = GPTConfig(block_size=24, vocab_size=40, n_layer=2, n_head=2, n_embd=16, bias=bias,
                      head=head)
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
        assert (costs.state_bytes(c, False, w=2)["weights"]
                == sum(p.nbytes for p in GPT(c).to(torch.bfloat16).parameters()))
    # mixed precision: 2 + 2 + 12 bytes per trained parameter (+ 4 per tensor), the
    # optimizer's share split by ZeRO-1
    big = GPTConfig(block_size=512, vocab_size=32000, n_layer=32, n_head=32, n_embd=4096,
                    bias=False)
    P, n = costs.n_params(big)
    assert 6.5e9 < P < 6.7e9
    assert costs.state_bytes(big, True, w=2)["total"] == 16 * P + 4 * n
    assert (costs.state_bytes(big, True, w=2, world=8, shard="zero1")["total"]
            == 4 * P + (12 * P + 4 * n) / 8)
    assert costs.state_bytes(big, False, w=2, world=8, shard="fsdp")["total"] == 2 * P / 8


def test_analytic_flops_and_bytes_match_one_measured_iteration(tiny):  # noqa: F811
    # r_φ and the critic: π_ref's trunk with a fresh scalar head (load_model's head=), enough to
    # count their work
    sft_file = f"{tiny.sft}/model.safetensors"
    cfg = compare.Config(task=tiny.task, sft=sft_file, reward_model=sft_file)
    c, flops, shapes, units, models = costs.measure_small(cfg, init_distributed(), B=8)
    for job in costs.JOBS:
        # exact: the same counting rules
        assert costs.iteration_flops(c, job, **shapes[job]) == flops[job], job
    # the rollout sampled several tokens (KV-cache steps counted)
    assert shapes["ppo"]["T"] > shapes["ppo"]["P"] + 1
    # online DPO's round: KV-cache steps sampled, and every phase did work (a dropped term shows)
    assert shapes["online_dpo"]["L"] > shapes["online_dpo"]["P"] + 1
    assert all(v > 0 for v in flops["online_dpo"].values())
    # iterative DPO's step: online DPO's pairs through the policy, and 1000 / (50 × 64) of the
    # round's sampling and precompute (online DPO's rollout and π_ref forward on them)
    it, on, a = flops["iterative_dpo"], flops["online_dpo"], costs.ITERATIVE_SHARE
    assert a == 0.3125 and it["policy"] == on["policy"]
    assert (it["rollout"], it["precompute"]) == (a * on["rollout"], a * on["reference"])
    # GRPO's iteration: groups of 4 completions of a prompt, several tokens sampled, and at its
    # shapes PPO's FLOPs less the critic's: a forward, and ppo_epochs of forward and backward
    g, s = shapes["grpo"], replace(c, head="scalar")
    assert g["B"] == 8 and g["T"] > g["P"] + 1 and g["epochs"] == grpo.Config.ppo_epochs
    p = costs.iteration_flops(c, "ppo", **g)
    assert flops["grpo"] == {
        "rollout": p["rollout"], "reward": p["reward"],
        "ref_old": p["ref_critic"] - estimate_flops(s, g["B"], g["T"]),
        "update": p["update"] - g["epochs"] * estimate_flops(s, g["B"], g["T"], backward=True)}
    # at 7B its training job holds what cached DPO's does; a token costs more than cached DPO's
    # (the round's sampling) and less than online DPO's (a share of it, no r_φ, no live π_ref)
    big = costs.at_7b()["jobs"]
    assert big["iterative_dpo"]["bytes_per_gpu"] == big["dpo_cache"]["bytes_per_gpu"]
    assert (big["dpo_cache"]["flops_per_token"] < big["iterative_dpo"]["flops_per_token"]
            < big["online_dpo"]["flops_per_token"])
    # and GRPO at 7B holds online DPO's four models, PPO's five but the critic, whose state and
    # work (per token of a 512-token rollout) are all that it saves
    critic = GPTConfig(block_size=512, vocab_size=32000, n_layer=32, n_head=32, n_embd=4096,
                       bias=False, head="scalar")
    assert big["grpo"]["bytes_per_gpu"] == big["online_dpo"]["bytes_per_gpu"]
    for sh, v in big["ppo"]["bytes_per_gpu"].items():
        assert v - big["grpo"]["bytes_per_gpu"][sh] == pytest.approx(
            costs.state_bytes(critic, True, 2, 8, sh)["total"])
    assert (big["ppo"]["flops_per_token"] - big["grpo"]["flops_per_token"]) * 512 == pytest.approx(
        estimate_flops(critic, 1, 512) + 4 * estimate_flops(critic, 1, 512, backward=True))
    for job in costs.JOBS:
        for name, head, trains in costs.JOBS[job]:
            measured, w = models[name]
            assert costs.state_bytes(replace(c, head=head), trains, w=w) == measured, (job, name)


def test_rank_state_ddp_against_fsdp_on_two_gloo_ranks(tiny, tmp_path):
    """`torchrun --nproc_per_node=2 -m study.costs --sft π_ref`: costs.rank_state's bytes each
    rank holds of a GPT of π_ref's shape (the assertions of tests/test_fsdp.py's
    test_fsdp_plumbing_on_two_gloo_ranks on it), and its table in the section "fsdp" of
    --results."""
    sft_path = f"{tiny.sft}/model.safetensors"
    p = run_torchrun("-m study.costs", ["--sft", sft_path, "--results", str(tmp_path / "R.md")])
    res = json.loads(p.stdout.strip().splitlines()[-1])  # its last line: rank_state's result
    # costs.rank_state, the bytes each rank holds, measured: FSDP's two ranks hold together exactly
    # DDP's one copy of weights and grads (a tensor of odd rows splits one row unevenly), each
    # rank Adam's two moments of its own shard, and AdamW's step counts (4 bytes a tensor) whole
    # on every rank
    ddp, fsdp = res["ddp"]["ranks"], res["fsdp"]["ranks"]
    c = load_model(sft_path)[0].config
    n = costs.n_params(c)[1]
    assert ddp[0] == ddp[1] == {k: int(v) for k, v in res["ddp"]["analytic"].items()}
    for k in ("weights", "grads"):
        assert fsdp[0][k] + fsdp[1][k] == ddp[0][k], k
        assert abs(fsdp[0][k] - res["fsdp"]["analytic"][k]) <= 64 * 4 * 4, k  # a row or so
    for r in fsdp:
        assert r["optimizer"] == 2 * r["weights"] + 4 * n
    text = (tmp_path / "R.md").read_text()
    assert text.startswith("<!-- begin fsdp -->\n- Command: `torchrun --nproc_per_node=2 -m "
                           "study.costs --sft ")
    assert f"| fsdp | 1 | {fsdp[1]['weights']:,} | {fsdp[1]['grads']:,} |" in text
    assert f"vocabulary {c.vocab_size}, {costs.n_params(c)[0]:,} parameters" in text


# ==================================================================================================
# study/gpu.py
# ==================================================================================================

def test_gpu_command_on_a_cpu_says_it_needs_cuda(tmp_path):
    with pytest.raises(SystemExit, match="^error: gpu.py needs a CUDA GPU"):
        gpu.main(gpu.Config(out_dir=str(tmp_path / "gpu")))
    assert not os.path.exists(tmp_path / "gpu")  # nothing was written


# ==================================================================================================
# study/results.py (new with the move: RESULTS.md's sections)
# ==================================================================================================

def test_results_section_replaced_in_place_appended_when_new_and_bad_markers_refused(tmp_path):
    path = str(tmp_path / "RESULTS.md")
    results.write_section(path, "a", "## Table\n\n| x |\n|---|\n| 1 |", "python -m study.x", 61,
                          "cpu")
    first = open(path).read()
    assert first.startswith("<!-- begin a -->\n- Command: `python -m study.x`\n- Date: ")
    assert "- Wall time: 1m01s\n" in first and f"torch {torch.__version__}" in first
    assert first.endswith("\n#### Table\n\n| x |\n|---|\n| 1 |\n<!-- end a -->\n")
    with open(path, "w") as f:  # text a person wrote around the section stays as it is
        f.write("# Results\n\nby hand\n\n" + first + "\nafter\n")
    results.write_section(path, "a", "| x |\n|---|\n| 2 |", "python -m study.x", 1, "cpu")
    results.write_section(path, "b", "| y |", "python -m study.y", 1, "cpu", world=2)
    text = open(path).read()
    assert text.startswith("# Results\n\nby hand\n\n<!-- begin a -->\n")
    assert "| 2 |\n<!-- end a -->\n\nafter\n\n<!-- begin b -->\n" in text and "| 1 |" not in text
    assert text.endswith("| y |\n<!-- end b -->\n") and "2 × cpu" in text
    assert not results.write_section("", "a", "| z |", "c", 1, "cpu")  # --results "": nothing
    with open(path, "a") as f:
        f.write("<!-- begin a -->\n")
    with pytest.raises(SystemExit, match="nothing was written"):
        results.write_section(path, "a", "| z |", "c", 1, "cpu")
    # section b twice, each whole: which one to replace is not ours to guess
    twice = text + "\n" + text[text.index("<!-- begin b -->"):]
    with open(path, "w") as f:
        f.write(twice)
    with pytest.raises(SystemExit, match="found 2 and 2.*nothing was written"):
        results.write_section(path, "b", "| w |", "c", 1, "cpu")
    assert open(path).read() == twice


# ==================================================================================================
# study/kv_cache.py
# ==================================================================================================

def test_kv_cache_benchmark_checks_its_tokens_and_writes_its_line(tmp_path):
    from study import kv_cache
    kv_cache.main(kv_cache.Config(results=str(tmp_path / "RESULTS.md")))
    text = (tmp_path / "RESULTS.md").read_text()
    assert text.startswith("<!-- begin kv_cache -->\n- Command: `python -m study.kv_cache")
    assert "64 new tokens, batch 16, prompt 16," in text and "faster with the cache" in text


def test_eos_study_reads_each_run_and_its_eos_logprob_by_hand(tiny, dpo_cache, tmp_path):
    base = dpo_cfg(tiny, "unused", steps=2, eval_k=1)
    cfg = eos.Config(betas="1", alphas="0,1", seeds="1,2", out_dir=str(tmp_path / "eos"),
                     results=str(tmp_path / "RESULTS.md"), reward_model=str(tmp_path / "none"))
    eos.main(cfg, base)
    text = (tmp_path / "RESULTS.md").read_text()
    rows = [line for line in text.splitlines() if line.startswith("| 1 |")]
    assert len(rows) == 2 and rows[0].startswith("| 1 | 0 |") and rows[1].startswith("| 1 | 1 |")
    # the in-language share beside the reward: the two seeds' mean (no r_φ here: "–")
    evs = [json.loads((tmp_path / "eos" / f"beta1-alpha0-seed{s}" / "eval.json").read_text())
           for s in (1, 2)]
    m = (evs[0]["in_language"] + evs[1]["in_language"]) / 2
    assert rows[0].split(" | ")[5].startswith(f"{m:.2f} ± ") and rows[0].split(" | ")[6] == "–"
    assert "| in language | r_φ score |" in text
    assert sorted(os.listdir(tmp_path / "eos")) == [f"beta1-alpha{a}-seed{s}" for a in (0, 1)
                                                   for s in (1, 2)]
    # log π(EOS) at the end of each chosen response, against one row at a time, by hand
    tok = data.load_tokenizer(f"{tiny.sft}/tokenizer.json")
    got, n = eos.eos_logprob(base.ref_model, base.val_pairs, tok, base)
    model = load_model(base.ref_model)[0].eval()
    examples, _ = data.tokenize_pairs(tok, data.read_pairs(base.val_pairs), base.max_len,
                                      base.max_prompt_len)
    want = []
    for e in examples:
        if e["chosen"][-1] != tok.eos:
            continue  # cut before its EOS
        ids = torch.tensor([e["prompt"] + e["chosen"]])
        with torch.no_grad():
            logits = model(ids)[0, -2]  # the position that predicts the last token, EOS
        want.append(torch.log_softmax(logits.float(), -1)[tok.eos].item())
    assert n == len(want) > 0 and got == pytest.approx(sum(want) / n, abs=1e-4)
    before = (tmp_path / "eos" / "beta1-alpha0-seed1" / "eval.json").stat().st_mtime_ns
    eos.main(cfg, base)  # finished runs are read, not run again
    assert (tmp_path / "eos" / "beta1-alpha0-seed1" / "eval.json").stat().st_mtime_ns == before


# ==================================================================================================
# study/figure.py
# ==================================================================================================

def test_figure_reads_the_frontier_tables_and_needs_matplotlib_only_to_draw(tmp_path, monkeypatch):
    table = ("| method | configuration | seeds | KL(π‖π_ref) nats | true reward "
             "| on val envelope |\n"
             "|---|---|---|---|---|---|\n"
             "| π_ref |  | – | 0.000 | -0.012 | ✓ |\n"
             "| {m} | β 0.3, lr 0.001 | 3 | 12.508 ± 0.597 | +11.789 ± 0.164 | ✓ |\n"
             "| PPO | KL coef 0.1, lr 0.0001 | 3 | 5.546 ± 0.085 | +7.712 ± 0.111 |  |\n\n"
             "| KL(π‖π_ref) nats | DPO true reward |\n|---|---|\n| 4 | +2.320 |\n")
    path = tmp_path / "RESULTS.md"
    path.write_text(f"<!-- begin a -->\n{table.format(m='DPO')}<!-- end a -->\n\n"
                    f"<!-- begin b -->\n{table.format(m='DPO-b')}<!-- end b -->\n")
    pts = figure.read_points(str(path), ["a", "b"])
    # π_ref and PPO repeat in b and are read once; the matched-KL table is not a frontier table
    assert [(p["method"], p["section"], p["chosen"]) for p in pts] == [
        ("π_ref", "a", True), ("DPO", "a", True), ("PPO", "a", False), ("DPO-b", "b", True)]
    assert (pts[0]["kl"], pts[0]["reward"], pts[0]["reward_se"]) == (0.0, -0.012, 0.0)
    assert (pts[1]["kl"], pts[1]["kl_se"], pts[1]["reward"], pts[1]["reward_se"]) == (
        12.508, 0.597, 11.789, 0.164)
    assert pts[2]["setting"] == "KL coef 0.1, lr 0.0001"
    with pytest.raises(SystemExit, match="has no section 'c'"):
        figure.read_points(str(path), ["a", "c"])
    out = tmp_path / "fig" / "frontier.png"
    cfg = figure.Config(results=str(path), sections="a,b", out=str(out))
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as on a machine without it
    with pytest.raises(SystemExit, match="needs matplotlib .*nothing was written"):
        figure.main(cfg)
    assert not out.exists()


def test_figure_reads_the_runs_on_r_phi_from_the_kept_rows(tmp_path):
    path = tmp_path / "frontier.csv"
    path.write_text("run,method,kl,true_reward,reward_model_score\n"
                    "ref,π_ref,0.0,-0.01,0.02\n"
                    "dpo-a,DPO,3.5,2.0,1.0\n"  # not on r_φ: not drawn
                    "ppo-a,PPO,8.25,3.5,6.75\n"
                    "grpo-a,GRPO,4.0,-1.0,2.5\n"
                    "online-a,online DPO,2.0,1.5,None\n")  # no r_φ score recorded: skipped
    assert figure.read_proxy_runs(str(path)) == [
        {"method": "PPO", "kl": 8.25, "true": 3.5, "proxy": 6.75},
        {"method": "GRPO", "kl": 4.0, "true": -1.0, "proxy": 2.5}]
    assert figure.read_proxy_runs(str(tmp_path / "none.csv")) == [] == figure.read_proxy_runs("")


# ==================================================================================================
# study/envelope.py's contrast intervals (study/explore.py's own tests: tests/test_explore.py)
# ==================================================================================================

def test_contrast_intervals_two_groups_are_welch_and_four_by_hand():
    xs, ys = [1.0, 2.0, 3.0, 6.0], [0.0, 1.0, 1.0, 2.0]
    assert envelope.contrast_interval([(1, xs), (-1, ys)]) == envelope.welch_interval(xs, ys)
    # four groups: means 3, 1, 2, 6 and s²/n = (14/3)/4, 2/2, 3/3, 4/4 = 7/6, 1, 1, 1
    a, b, c, e = [1.0, 2.0, 3.0, 6.0], [0.0, 2.0], [1.0, 1.0, 4.0], [5.0, 5.0, 5.0, 9.0]
    d, lo, hi = envelope.contrast_interval([(1, a), (-1, b), (-1, c), (1, e)])
    assert d == pytest.approx(3 - 1 - 2 + 6)
    # se² = 7/6 + 3 = 25/6; ν = (25/6)² / ((7/6)²/3 + 1/1 + 1/2 + 1/3) = 1875/247 ≈ 7.59
    half = (hi - lo) / 2
    assert half == pytest.approx(envelope.t_quantile(1875 / 247) * math.sqrt(25 / 6))
    assert 2.306 < half / math.sqrt(25 / 6) < 2.365  # t's 97.5% point between 8 and 7 d.o.f.
    assert envelope.contrast_interval([(1, a), (-1, [2.0])]) == (1.0, None, None)
    assert envelope.contrast_interval([(1, [2.0, 2.0]), (-1, [1.0, 1.0])]) == (1.0, 1.0, 1.0)
