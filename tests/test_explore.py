"""study/explore.py: four arms that differ one thing at a time, the support measures, and the rule
that reads each contrast as a difference, an equivalence within δ, or undetermined.

The promises: the arms are the runs the study says (one β, lr and step count; the replay reads its
own seed's online run; the batches and passes as stated); a pool's 99th percentile by hand; the
contrasts paired by seed; each outcome of the rule, equivalence included, on made-up numbers."""
import json
import math
import os

import pytest

import dpo
import online_dpo
import task
from study import compare, explore
from study.envelope import t_quantile


def pool(folder, n):
    os.makedirs(folder, exist_ok=True)
    with open(folder / "pairs_train.jsonl", "w") as f:
        f.writelines(json.dumps(dict(prompt=f"p{i}", chosen="a", rejected="b")) + "\n"
                     for i in range(n))


def test_the_four_arms_differ_one_thing_at_a_time(tmp_path):
    pool(tmp_path / "task", 400)
    cfg = explore.Config(out_dir=str(tmp_path / "x"), task=str(tmp_path / "task"),
                         regimes="default", seeds="1,2", steps=20, beta=0.3, lr=2e-3)
    cc = explore.explore_config(cfg, 400)
    runs = explore.arms(cc, compare.regimes(cc)[0])
    by = {}
    for name, stage, c in runs:
        arm = explore.arm_of(dict(run=name, method=compare.method_of(stage, c)))
        by.setdefault(arm, {})[c.seed] = (name, stage, c)
    assert sorted(by) == sorted(explore.ARMS[:4]) and all(len(v) == 2 for v in by.values())
    for seed in (1, 2):
        (_, _, off), (_, _, mat), (_, _, rep), (_, on_stage, on) = (
            by[a][seed] for a in explore.ARMS[:4])
        assert on_stage is online_dpo and on.reward == "oracle"
        # one β, lr and number of optimizer steps for every arm
        assert {off.beta, mat.beta, rep.beta, on.beta} == {0.3}
        assert {off.lr, mat.lr, rep.lr, on.lr} == {2e-3}
        assert off.steps == mat.steps == rep.steps == on.iterations == 20
        # offline DPO: the pool, its batch; online's batch: the pool, 20 a step, one pass
        assert off.batch_size == dpo.Config.batch_size and off.order == "shuffle"
        assert mat.batch_size == on.rollout_batch == 400 // 20 and mat.order == "shuffle"
        assert off.train_pairs == mat.train_pairs == str(tmp_path / "task/pairs_train.jsonl")
        # the replay: this seed's online run's pairs, its batches whole, in a seeded order
        assert rep.train_pairs == f"{on.out_dir}/pairs.jsonl" and rep.order == "steps"
        assert rep.batch_size == on.rollout_batch and rep.seed == on.seed == seed
        assert rep.ref_logps == dpo.Config.ref_logps  # its cache is built for its own pairs
        # the replay runs after the online run it reads
        names = [n for n, _, _ in runs]
        assert names.index(by["replay"][seed][0]) > names.index(by["online DPO (oracle)"][seed][0])
        assert len({c.out_dir for _, _, c in runs}) == len(runs)
    # nothing is selected on validation: no run spends an evaluation there
    assert {c.val_prompts for _, _, c in runs} == {""} and not cc.validate
    with pytest.raises(SystemExit, match="400 pairs do not split evenly into --steps 30"):
        explore.explore_config(explore.Config(steps=30), 400)


def test_the_pools_99th_percentile_by_hand(tmp_path):
    # 2 rows, 4 responses scoring −1, 1, 2, 4 ("it felt bad ." −1, "fine" ... by the task's
    # weights); numpy's linear interpolation: position 0.99 × 3 = 2.97, 2 + 0.97 × (4 − 2)
    rows = [dict(prompt="it felt good .", chosen=" it felt great . it felt great .",
                 rejected=" it felt bad ."),
            dict(prompt="it felt good .", chosen=" it felt great .", rejected=" it felt good .")]
    rewards = sorted(task.true_reward(r["prompt"], r[k]) for r in rows
                     for k in ("chosen", "rejected"))
    assert rewards == [-1.0, 1.0, 2.0, 4.0]
    assert task.pool_quantile(rows, 0.99) == pytest.approx(2 + 0.97 * 2)
    assert task.pool_quantile(rows, 1.0) == task.pool_best(rows) == 4.0
    folder = tmp_path / "t"
    folder.mkdir()
    (folder / "pairs_train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert task.task_pool_marks(str(folder / "prompts_test.jsonl")) == {}  # no task.json
    (folder / "task.json").write_text("{}")
    marks = task.task_pool_marks(str(folder / "prompts_test.jsonl"))
    assert marks["pool_p99"] == pytest.approx(3.94) and marks["pool_best"] == 4.0


def test_contrasts_are_paired_by_seed():
    a = {1: 3.0, 2: 5.0, 3: 4.0, 5: 0.0}
    b = {1: 1.0, 2: 2.0, 3: 2.0, 4: 9.0}  # seeds 4 and 5 have no partner: left out
    (m, lo, hi), seeds = explore.paired_interval(a, b)
    # differences 2, 3, 2: mean 7/3, s² = 1/3, half-width t(2)·√(1/9)
    assert seeds == [1, 2, 3] and m == pytest.approx(7 / 3)
    assert (hi - lo) / 2 == pytest.approx(4.302653 * math.sqrt(1 / 9), rel=1e-3)  # t(2): 4.3027


def test_the_rule_reaches_each_outcome():
    d = 0.5
    assert explore.rule((0.1, -0.2, 0.4), d) == "equivalent"  # holds 0, inside ±δ
    assert explore.rule((0.3, 0.1, 0.45), d) == "equivalent"  # excludes 0, still inside ±δ
    assert explore.rule((0.3, 0.1, 0.5), d) == "difference"  # touches δ: not inside
    assert explore.rule((-2.0, -3.0, -1.0), d) == "difference"
    assert explore.rule((0.2, -0.3, 0.7), d) == "undetermined"  # holds 0, wider than δ
    assert explore.rule((0.2, -0.6, 0.4), d) == "undetermined"
    assert explore.rule((0.2, None, None), d) == "undetermined"  # one seed: no interval


def test_the_rule_reads_an_interval_ending_at_0_as_holding_it():
    # a closed interval [0, 1.6] holds 0: it does not exclude it, and reaches past δ, so neither
    # a difference nor an equivalence; the same mirrored, and just past 0 it is a difference
    d = 0.5
    assert explore.rule((0.8, 0.0, 1.6), d) == "undetermined"
    assert explore.rule((-0.8, -1.6, 0.0), d) == "undetermined"
    assert explore.rule((0.8, 1e-9, 1.6), d) == "difference"
    assert explore.rule((-0.8, -1.6, -1e-9), d) == "difference"


def test_seeds_needed_by_hand():
    # mean 0.2 inside δ 0.5, sample sd 0.4: the half-width t(n − 1)·0.4/√n must fall below 0.3:
    # n = 9 gives 2.306·0.4/3 = 0.307, n = 10 gives 2.262·0.4/√10 = 0.286
    a = 0.4 / math.sqrt(2)
    assert explore.seeds_needed([0.2 - a, 0.2 + a], 0.5) == 10
    assert t_quantile(8) * 0.4 / 3 > 0.3 > t_quantile(9) * 0.4 / math.sqrt(10)
    # mean 1 beyond δ: the half-width must fall below 1 (to exclude 0)
    b = 1.0 / math.sqrt(2)
    n = explore.seeds_needed([1 - b, 1 + b], 0.5)
    assert t_quantile(n - 1) / math.sqrt(n) < 1 <= t_quantile(n - 2) / math.sqrt(n - 1)
    assert explore.seeds_needed([0.5, 0.5], 0.5) is None  # no spread
    # the mean on δ: no number of seeds makes it equivalent; enough exclude 0
    n = explore.seeds_needed([0.0, 1.0], 0.5)
    s = math.sqrt(0.5)
    assert t_quantile(n - 1) * s / math.sqrt(n) < 0.5 <= t_quantile(n - 2) * s / math.sqrt(n - 1)


def test_the_verdicts_say_exploration_only_from_the_data_contrast():
    on, da = explore.PRIMARY[0][:2], explore.PRIMARY[1][:2]

    def says(on_rule, on_m, da_rule, da_m):
        return explore.verdicts({"unseen": {on: (on_rule, on_m), da: (da_rule, da_m)}})[0]
    assert says("undetermined", 0.1, "difference", 2.0) == (
        "unseen: the data sampling found carries a gain; undetermined for on-policy training")
    assert says("equivalent", 0.1, "equivalent", -0.1) == (
        "unseen: not exploration: the data sampling found is worth no more than the pool's; "
        "on-policy training itself adds nothing")
    assert says("difference", 1.5, "undetermined", 0.3) == (
        "unseen: undetermined for the data; on-policy training itself adds")
    assert says("difference", -1.5, "difference", -0.8) == (
        "unseen: the data sampling found costs; on-policy training itself costs")
    # each contrast read on its own: one's equivalence says nothing of the other
    assert says("equivalent", 0.0, "undetermined", 0.3) == (
        "unseen: undetermined for the data; on-policy training itself adds nothing")
    assert says("difference", 2.0, "equivalent", 0.1) == (
        "unseen: not exploration: the data sampling found is worth no more than the pool's; "
        "on-policy training itself adds")


def test_the_verdicts_read_the_contrasts_named_by_their_arms_by_hand():
    # the arm pairs written out: on-policy training is online − replay, the data replay − online's
    # batch; the optimisation (online's batch − offline DPO) and the whole gap say no verdict
    on = ("online DPO (oracle)", "replay")
    da = ("replay", "DPO, online's batch")
    opt = ("DPO, online's batch", "DPO")
    whole = ("online DPO (oracle)", "DPO")
    assert [c[:2] for c in explore.CONTRASTS] == [on, da, opt, whole]
    outcome = {"unseen": {on: ("difference", 1.5), da: ("equivalent", 0.1),
                          opt: ("difference", -2.0), whole: ("undetermined", 0.4)},
               "default": {on: ("equivalent", 0.0), da: ("difference", 0.9),
                           opt: ("undetermined", 0.3), whole: ("difference", 3.0)}}
    assert explore.verdicts(outcome) == [
        "unseen: not exploration: the data sampling found is worth no more than the pool's; "
        "on-policy training itself adds",
        "default: the data sampling found carries a gain; on-policy training itself adds nothing"]


def test_j_is_the_reward_less_beta_times_the_kl_by_hand():
    assert explore.j_of({"true_reward": 1.5, "kl": 4.0}, 0.25) == 0.5  # 1.5 − 0.25 × 4
    assert explore.j_of({"true_reward": -1.0, "kl": 2.0}, 0.5) == -2.0  # −1 − 0.5 × 2


# made-up runs of the four arms at β 0.5, 3 seeds: (true reward, KL) per seed, so that
# J = r − 0.5·KL per seed is offline DPO 0, 0.2, −0.2; online's batch 1, 1, 1; replay 2, 2.2, 2.4;
# online DPO 2, 1.8, 2.2
FAKE_ARMS = {"dpo-beta0.5-lr0.001": ("DPO", [(1.0, 2.0), (1.2, 2.0), (0.8, 2.0)]),
             "dpo-batch20-beta0.5-lr0.001": ("DPO", [(1.5, 1.0)] * 3),
             "replay-beta0.5-lr0.001": ("DPO", [(3.0, 2.0), (3.2, 2.0), (3.4, 2.0)]),
             "online-oracle-batch20-beta0.5": ("online DPO (oracle)",
                                               [(4.0, 4.0), (4.0, 4.4), (4.0, 3.6)])}


def fake_eval(reward, kl):
    """An eval.json as evaluate.py writes it (the fields the tables read)."""
    return dict(kl=kl, true_reward=reward, true_reward_std=1.0, ref_true_reward=0.0,
                ref_true_reward_std=1.0, win_rate=0.5, eos_rate=1.0, response_len=10.0,
                true_reward_finished=reward, top_word_rate=0.25, in_language=0.75,
                reward_model_score=0.5, pool_best=6.0, beyond_pool=0.0, pool_p99=4.0,
                beyond_pool_p99=0.125, n_completions=8,
                samples=[dict(prompt="it felt good .", policy=" it felt great .",
                              policy_finished=True, ref=" it felt bad .", ref_finished=True,
                              policy_reward=2.0, ref_reward=-1.0)])


def test_tables_read_j_and_its_contrasts_from_run_records_by_hand(tmp_path):
    records = [("ref", "π_ref", "", fake_eval(0.0, 0.0))] + [
        (f"{name}-seed{s}", method, s, fake_eval(r, kl))
        for name, (method, runs) in FAKE_ARMS.items() for s, (r, kl) in zip((1, 2, 3), runs)]
    rows = []
    for name, method, seed, ev in records:  # written as study.compare's frontier leaves them
        (tmp_path / name).mkdir()
        (tmp_path / name / "eval.json").write_text(json.dumps(ev))
        (tmp_path / name / "run.json").write_text(json.dumps(
            {"run": {"stage": "dpo"}, "finished": True, "wall_s": 1.0}))
        read = json.loads((tmp_path / name / "eval.json").read_text())
        row = dict(run=name, regime="default", method=method, seed=seed,
                   **compare.ev_fields(read), budget="20 × 3")
        rows.append({**row, "arm": explore.arm_of(row)})
    cfg = explore.Config(out_dir=str(tmp_path), regimes="default", beta=0.5, delta=0.6)
    md, outcome = explore.tables(rows, cfg, {"default": dict(rule="everything shown",
                                                             pool_top=0.2, n_pool=60)})
    # per-seed differences of J: online − replay 0, −0.4, −0.2 (mean −0.2, s 0.2); replay −
    # online's batch 1, 1.2, 1.4 (1.2, s 0.2); online's batch − DPO 1, 0.8, 1.2 (1.0, s 0.2);
    # online − DPO 2, 1.6, 2.4 (2.0, s 0.4). Half-width t(2)·s/√3, t(2) = 4.303: 0.4969 for s 0.2
    # (−0.70 to 0.30 holds 0 and passes −δ = −0.6: undetermined), 0.9937 for s 0.4
    on, da = ("online DPO (oracle)", "replay"), ("replay", "DPO, online's batch")
    opt, whole = ("DPO, online's batch", "DPO"), ("online DPO (oracle)", "DPO")
    assert outcome.keys() == {"default"}
    got = outcome["default"]
    assert got.keys() == {on, da, opt, whole}
    for pair, (said, m) in ((on, ("undetermined", -0.2)), (da, ("difference", 1.2)),
                            (opt, ("difference", 1.0)), (whole, ("difference", 2.0))):
        assert got[pair][0] == said and got[pair][1] == pytest.approx(m, abs=1e-12), pair
    cells = {line.split("|")[1].strip(): [c.strip() for c in line.strip().strip("|").split("|")]
             for line in md.splitlines() if line.startswith("| ")}
    head = cells["arm"]
    assert head[4] == "J_0.5" and head[3] == "KL(π‖π_ref) nats"
    # each arm's J over its 3 seeds: mean ± 4.303 · s/√3
    for arm, kl, j in (("offline DPO", "2.00", "+0.00 [-0.50, +0.50]"),
                       ("DPO, online's batch", "1.00", "+1.00 [+1.00, +1.00]"),
                       ("replay of online's pairs", "2.00", "+2.20 [+1.70, +2.70]"),
                       ("online DPO (oracle)", "4.00", "+2.00 [+1.50, +2.50]")):
        assert (cells[arm][3], cells[arm][4]) == (kl, j), arm
    for contrast, j in (("online DPO (oracle) − replay of online's pairs", "-0.20 [-0.70, +0.30]"),
                        ("replay of online's pairs − DPO, online's batch", "+1.20 [+0.70, +1.70]"),
                        ("DPO, online's batch − offline DPO", "+1.00 [+0.50, +1.50]"),
                        ("online DPO (oracle) − offline DPO", "+2.00 [+1.01, +2.99]")):
        assert cells[contrast][2] == j, contrast
    assert md.splitlines()[-1] == ("**The rule says**: default: the data sampling found carries a "
                                   "gain; undetermined for on-policy training.")
