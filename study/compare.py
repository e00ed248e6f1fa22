"""PPO and DPO side by side: what leaves the cluster when DPO replaces PPO, in measured numbers.

    python -m study.compare                 # the full study's choices, 3 seeds, costs: 11 min
    torchrun --nproc_per_node=8 -m study.compare   # the same, every run on 8 ranks (plain DDP)
    python -m study.compare --betas 0.1,0.3,1,2 --nll_betas 1,2 --kl_coefs 0.01,0.03,0.1,0.3 \
        --true_kl_coefs 0.1 --online_betas 0.1 --grpo_kl_coefs 0.04,0.1,0.3 \
        --seeds 1337,2337,3337,4337 --no-costs --keep study/runs   # RESULTS.md's frontier
    python -m study.compare --no-costs      # the frontier only (--no-frontier: the costs only)
    python -m study.compare --help          # every flag

1. The frontier (Figure 2 of Rafailov et al. 2023): DPO (and DPO+NLL) at several β × lr, PPO at
   several KL coefficients with r_φ as its reward and, as the paper's PPO-GT, with the hidden true
   reward, online DPO at several β; all from the same π_ref, pairs, r_φ, reference cache and
   prompts. Every configuration is trained once per seed of --seeds (the stages' `seed`: data
   order and sampling), each run by its stage's main in its own folder out/compare/<run>/, scored
   by the one evaluation they share on the validation and the test prompts, and at --check_at of
   its budget on validation (the budget rule). A run whose run.json records the same config and
   inputs is skipped (same_run), so an interrupted sweep resumes.
2. Matched KL and J_β (study/tables.py, with study/envelope.py): each method's envelope, its
   configurations chosen on validation and read on test, compared at --match_kls with a Welch t
   interval over seeds; and E[r] − β·KL at each β the methods share.
3. Learning curves: the first seed's DPO run at --curve_beta and PPO run at --curve_kl_coef are
   trained in --curve_points chunks (the stages resume exactly, so this is the uninterrupted run,
   observed) and the checkpoint is evaluated after each: true reward and KL against the budget
   (responses labelled, for DPO, or scored, for PPO) and against the loop's cumulative FLOPs.
   Writes frontier.csv (one row per run: per seed), curves.csv, frontier.md (+ frontier.png and
   curves.png if matplotlib is installed).
4. The costs (study/costs.py) at π_ref's size and extrapolated to 7B: costs.md and costs.json.
   summary.md collects the tables under the command that made them, and the sections "frontier",
   "curves" and "costs" of --results (RESULTS.md) are replaced by them (study/results.py).
Missing earlier stages (task, sft, reward model, reference cache) are built once, with defaults.
"""
import json
import os
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from types import SimpleNamespace

import torch

import data
import dpo
import grpo
import iterative_dpo
import online_dpo
import ppo
import precompute
import reward
import sft
import task
from checkpoint import (atomic_copy, atomic_write_json, checkpoint_state, load_checkpoint, sha256,
                        tokenizer_beside)
from plumbing import (atomic_write_text, barrier, check, fmt_duration, init_distributed,
                      main_decides, parse_config, require_stage, teardown)
from evaluate import evaluate_held_out, evaluate_policy, load_reward_model
from model import load_model
from study import costs
from study.results import flags, launcher, write_section
from study.tables import floats, write_tables
from task import require_task, task_pool_marks


@dataclass
class Config:
    out_dir: str = "out/compare"  # tables, plots, and one folder per run of the sweep
    task: str = "out/task"  # pairs_{train,val}, prompts_{train,val,test} (.jsonl); built if absent
    sft: str = "out/sft/model.safetensors"  # π_ref, shared by every run; built by sft.py if missing
    reward_model: str = "out/reward/model.safetensors"  # r_φ for PPO; built by reward.py if missing
    ref_logps: str = "out/ref_logps"  # DPO's cache of log π_ref; built by precompute.py if missing
    # every configuration (β or KL coef × lr) of each method, trained once per seed; each run is
    # evaluated on prompts_val (what selection reads) and prompts_test (what the tables report)
    # the defaults: the configurations the full study (above) chose on validation, at 3 seeds
    betas: str = "0.1,0.3"  # DPO runs: one per β × --dpo_lrs, comma-separated
    dpo_lrs: str = "1e-3"  # DPO's (and DPO+NLL's) peak learning rates
    nll_betas: str = "1"  # DPO+NLL runs (dpo.py --rpo_alpha --nll_alpha): one per β × --dpo_lrs
    nll_alpha: float = 1.0  # their α: the NLL of the chosen response, length-normalised (RPO)
    simpo_betas: str = ""  # SimPO runs (dpo.py --loss simpo): one per β × --dpo_lrs ("" = none)
    simpo_gamma: float = dpo.Config.simpo_gamma  # their target margin γ
    # their peak learning rates ("": --dpo_lrs): SimPO's β scales a mean log-prob per token, so
    # DPO's lr need not suit it (its paper tunes lr per model)
    simpo_lrs: str = ""
    kl_coefs: str = "0.1,0.3"  # PPO runs with r_φ: one per KL coefficient × --ppo_lrs
    ppo_lrs: str = "1e-4"  # PPO's peak learning rates
    true_kl_coefs: str = ""  # PPO-GT runs (--reward true): one per KL coefficient ("" = none)
    # GRPO runs (grpo.py, r_φ's scores, --ppo_iterations of PPO's batch): one per KL coefficient
    # (the k3 term's β) × --ppo_lrs ("" = none)
    grpo_kl_coefs: str = ""
    online_betas: str = ""  # online DPO runs: one per β × --online_rewards ("" = none)
    online_rewards: str = "model"  # their labellers: model (r_φ's argmax), oracle (task's BT draws)
    online_lr: float = online_dpo.Config.lr  # online DPO's peak learning rate
    online_batch: int = online_dpo.Config.rollout_batch  # its pairs sampled and labelled per round
    # iterative DPO runs (iterative_dpo.py: oracle labels, --iterative_rounds rounds that split the
    # pool's size in pairs and --dpo_steps in steps): one per β × --dpo_lrs ("" = none)
    iterative_betas: str = ""
    iterative_nll_betas: str = ""  # the same with dpo.py's NLL term, --nll_alpha ("" = none)
    iterative_rounds: int = iterative_dpo.Config.rounds
    # task regimes (task.REGIMES), each a frontier of its own: its task beside --task (out/task:
    # out/task-capped, as task.task_dir), its π_ref (the default's when its texts are), r_φ, cache
    # and runs in out_dir/<regime>
    regimes: str = "default"  # comma-separated, of default, capped, unseen, shifted
    # training seeds, each setting once per seed: data order, sampling (π_ref, r_φ, cache shared).
    # Spaced apart: data.global_batch orders epoch e with seed + e, so seeds 1 apart share epochs
    seeds: str = "1337,2337,3337"
    dpo_steps: int = dpo.Config.steps  # optimizer steps of each DPO run
    # iterations of each PPO run: at ppo.py's 30 the budget rule below found KL coef 0.01 to 0.1
    # still rising on validation; at 60 none on r_φ was (PPO-GT still was)
    ppo_iterations: int = 60
    online_iterations: int = online_dpo.Config.iterations  # rounds of each online DPO run
    # the budget rule: each run's checkpoint at this fraction of its budget is scored on the
    # validation prompts; a setting whose validation reward still rose over the rest of the budget
    # (the seeds' gains, 95% t-interval above 0) hit its budget, and the tables say so
    check_at: float = 0.75
    # every run is scored on the validation prompts too, at the end and at --check_at (what the
    # selection and the budget rule read); a study that selects nothing can skip both
    validate: bool = True
    eval_k: int = dpo.Config.eval_k  # completions per held-out prompt, every run and π_ref alike
    match_kls: str = "1,2,4,6,8"  # KL values (nats) at which the methods' envelopes are compared
    curve_beta: float = 0.3  # DPO's learning curve: the first seed's run at this β (one of betas)
    curve_kl_coef: float = 0.1  # PPO's learning curve: its run at this KL coef (one of kl_coefs)
    curve_points: int = 4  # evaluations along each learning curve (0 = no curves)
    frontier: bool = True  # train the sweep, write frontier.* and curves.*
    costs: bool = True  # measure the costs, write costs.*
    rounds: int = 3  # interleaved timing rounds, each: every job's run once, the precompute
    time_steps: int = 4  # iterations (PPO) or steps (DPO) per timed run; the first warms up
    # iterative_dpo.py output folders (comma-separated, globs allowed) whose rounds.json give the
    # prompts each round sampled, for the costs' iterative DPO row ("": the nominal --pairs a round)
    iterative_runs: str = ""
    # a folder in the repository that keeps each finished run's records (run.json, eval.json,
    # curve.json) under <keep>/<out_dir's name>/<run>, and the π_ref and r_φ they were made from
    # under <keep>/inputs: committed, they let a sweep resume on another machine ("": none)
    keep: str = ""
    # RESULTS.md: its sections (study/results.py) get this command's tables ("": none)
    results: str = "RESULTS.md"
    # the frontier section's name; the learning curves' and the costs' are "curves" and "costs"
    # beside the default one, else <section>_curves and <section>_costs
    section: str = "frontier"


# -----------------------------------------------------------------------------
# The sweep


def seed_list(cfg):
    return [int(s) for s in cfg.seeds.split(",") if s.strip()]


def regimes(cfg):
    """Each regime's inputs: its task, π_ref, r_φ and reference cache, and the prefix of its runs'
    names (folders under out_dir). The default regime's are the flags'; another regime's task is
    --task's name + -<regime>, and its π_ref the default's when its texts are (capped, unseen),
    else its own (shifted: the generator differs)."""
    out = []
    for r in [r.strip() for r in cfg.regimes.split(",") if r.strip()]:
        task.check_regime(r)
        if r == "default":
            out.append(dict(regime=r, prefix="", task=cfg.task, sft=cfg.sft,
                            reward_model=cfg.reward_model, ref_logps=cfg.ref_logps))
            continue
        folder, base = f"{cfg.task.rstrip('/')}-{r}", os.path.join(cfg.out_dir, r)
        out.append(dict(regime=r, prefix=f"{r}/", task=folder, sft=None,
                        own_sft=f"{base}/sft/model.safetensors",
                        reward_model=f"{base}/reward/model.safetensors",
                        ref_logps=f"{base}/ref_logps"))
    check(out and len({R["regime"] for R in out}) == len(out),
          f"--regimes {cfg.regimes!r}: give one or more distinct regimes")
    return out


def build_regime(R, cfg, d, say):
    """A regime's earlier stages, each built when missing, with the stages' defaults but for its
    paths: the task, π_ref (unless its texts are the default's), r_φ on its pairs, the cache."""
    if R["regime"] == "default":
        return
    t = lambda f: os.path.join(R["task"], f)  # noqa: E731
    if d.is_main:
        task.ensure_task(R["task"], regime=R["regime"], log=say)
    barrier(d)
    same_text = sha256(t("sft_train.txt")) == sha256(os.path.join(cfg.task, "sft_train.txt"))
    R["sft"] = cfg.sft if same_text else R["own_sft"]
    stages = [(R["sft"], lambda: sft.main(sft.Config(
                  out_dir=os.path.dirname(R["sft"]), train_text=t("sft_train.txt"),
                  val_text=t("sft_val.txt"), tokenizer=t("tokenizer.json")))),
              (R["reward_model"], lambda: reward.main(reward.Config(
                  out_dir=os.path.dirname(R["reward_model"]), sft=R["sft"],
                  train_pairs=t("pairs_train.jsonl"), val_pairs=t("pairs_val.jsonl"),
                  prompts=t("prompts_train.jsonl")))),
              (f"{R['ref_logps']}/train.safetensors", lambda: precompute.main(precompute.Config(
                  out_dir=R["ref_logps"], ref_model=R["sft"], train_pairs=t("pairs_train.jsonl"),
                  val_pairs=t("pairs_val.jsonl"))))]
    for path, build in stages:
        if not main_decides(os.path.exists(path), d):
            say(f"[{R['regime']}] {path} is missing: building it")
            build()
            barrier(d)


def sweep(cfg, R):
    """A regime's runs: (name, stage, its Config), every configuration once per seed, all from the
    same π_ref, pairs, r_φ, cache and prompts, each scored on the validation and test prompts."""
    t = lambda f: os.path.join(R["task"], f)  # noqa: E731
    seeds, p = seed_list(cfg), R["prefix"]
    o = lambda name: os.path.join(cfg.out_dir, p + name)  # noqa: E731
    held_out = dict(val_prompts=t("prompts_val.jsonl") if cfg.validate else "",
                    test_prompts=t("prompts_test.jsonl"),
                    eval_k=cfg.eval_k)
    dpos = [(b, 0.0) for b in floats(cfg.betas)] + [(b, cfg.nll_alpha)
                                                    for b in floats(cfg.nll_betas)]
    runs = [(f"{p}{n}", dpo, dpo.Config(
        out_dir=o(n), ref_model=R["sft"], train_pairs=t("pairs_train.jsonl"),
        val_pairs=t("pairs_val.jsonl"), ref_logps=R["ref_logps"], beta=b, rpo_alpha=a,
        steps=cfg.dpo_steps, lr=lr, seed=s, reward_model=R["reward_model"], **held_out))
        for b, a in dpos for lr in floats(cfg.dpo_lrs) for s in seeds
        for n in [f"dpo-{f'nll{a:g}-' if a else ''}beta{b:g}-lr{lr:g}-seed{s}"]]
    runs += [(f"{p}{n}", dpo, dpo.Config(  # reference-free: no cache read, π_ref for the KL only
        out_dir=o(n), ref_model=R["sft"], train_pairs=t("pairs_train.jsonl"),
        val_pairs=t("pairs_val.jsonl"), loss="simpo", beta=b, simpo_gamma=cfg.simpo_gamma,
        steps=cfg.dpo_steps, lr=lr, seed=s, reward_model=R["reward_model"], **held_out))
        for b in floats(cfg.simpo_betas) for lr in floats(cfg.simpo_lrs or cfg.dpo_lrs)
        for s in seeds
        for n in [f"simpo-beta{b:g}-gamma{cfg.simpo_gamma:g}-lr{lr:g}-seed{s}"]]
    for rw in [w.strip() for w in cfg.online_rewards.split(",") if w.strip()]:
        check(rw in ("model", "oracle", "true"), f"--online_rewards {cfg.online_rewards!r}: "
              "each is model, oracle or true")
        tag = "online" + ("" if rw == "model" else f"-{rw}") + (
            "" if cfg.online_batch == online_dpo.Config.rollout_batch
            else f"-batch{cfg.online_batch}")
        runs += [(f"{p}{n}", online_dpo, online_dpo.Config(
            out_dir=o(n), sft=R["sft"], reward_model=R["reward_model"],
            prompts=t("prompts_train.jsonl"), reward=rw, beta=b, iterations=cfg.online_iterations,
            rollout_batch=cfg.online_batch, lr=cfg.online_lr, seed=s, **held_out))
            for b in floats(cfg.online_betas) for s in seeds for n in [f"{tag}-beta{b:g}-seed{s}"]]
    if floats(cfg.iterative_betas + "," + cfg.iterative_nll_betas):  # the pool's budgets, in rounds
        n_pool, k = len(data.read_pairs(t("pairs_train.jsonl"))), cfg.iterative_rounds
        check(cfg.dpo_steps % k == 0, f"--dpo_steps {cfg.dpo_steps} is not divisible by "
              f"--iterative_rounds {k}: each round gets the same share of the steps")
        check(n_pool % k == 0, f"the pool's {n_pool} pairs do not split evenly into "
              f"--iterative_rounds {k}: the label budget would not be the pool's")
        its = [(b, 0.0) for b in floats(cfg.iterative_betas)] + [
            (b, cfg.nll_alpha) for b in floats(cfg.iterative_nll_betas)]
        runs += [(f"{p}{n}", iterative_dpo, iterative_dpo.Config(
            out_dir=o(n), sft=R["sft"], prompts=t("prompts_train.jsonl"),
            val_pairs=t("pairs_val.jsonl"), rounds=k, pairs=n_pool // k,
            steps=cfg.dpo_steps // k, beta=b, rpo_alpha=a, lr=lr, seed=s, **held_out))
            for b, a in its for lr in floats(cfg.dpo_lrs) for s in seeds
            for n in [f"iterative-{f'nll{a:g}-' if a else ''}beta{b:g}-lr{lr:g}-seed{s}"]]
    for rw, coefs, tag in (("model", cfg.kl_coefs, "ppo"), ("true", cfg.true_kl_coefs, "ppo-true")):
        runs += [(f"{p}{n}", ppo, ppo.Config(
            out_dir=o(n), sft=R["sft"], reward_model=R["reward_model"],
            prompts=t("prompts_train.jsonl"), reward=rw, kl_coef=k, iterations=cfg.ppo_iterations,
            lr=lr, seed=s, **held_out))
            for k in floats(coefs) for lr in floats(cfg.ppo_lrs) for s in seeds
            for n in [f"{tag}-kl{k:g}-lr{lr:g}-seed{s}"]]
    runs += [(f"{p}{n}", grpo, grpo.Config(
        out_dir=o(n), sft=R["sft"], reward_model=R["reward_model"],
        prompts=t("prompts_train.jsonl"), kl_coef=k, iterations=cfg.ppo_iterations, lr=lr, seed=s,
        **held_out))
        for k in floats(cfg.grpo_kl_coefs) for lr in floats(cfg.ppo_lrs) for s in seeds
        for n in [f"grpo-kl{k:g}-lr{lr:g}-seed{s}"]]
    return runs


ONLINE = {"model": "online DPO", "oracle": "online DPO (oracle)", "true": "online DPO (argmax)"}


def method_of(stage, c):
    return "π_ref" if stage is None else ("SimPO" if c.loss == "simpo" else "DPO+NLL"
                                           if c.rpo_alpha else "DPO") if stage is dpo \
        else ("iterative DPO+NLL" if c.rpo_alpha else "iterative DPO") if stage is iterative_dpo \
        else ONLINE[c.reward] \
        if stage is online_dpo else "GRPO" if stage is grpo \
        else "PPO" if c.reward == "model" else "PPO-GT"


def is_curve(cfg, stage, c):
    """Whether this run is one of the two drawn as a learning curve (default regime only): the
    first seed's plain DPO run at --curve_beta and PPO run at --curve_kl_coef, each at its stage's
    default lr."""
    return cfg.curve_points > 0 and stage in (dpo, ppo) and c.seed == seed_list(cfg)[0] and (
        os.path.dirname(c.out_dir) == os.path.normpath(cfg.out_dir)) and (
        c.beta == cfg.curve_beta and not c.rpo_alpha and c.lr == dpo.Config.lr if stage is dpo
        else c.reward == "model" and c.kl_coef == cfg.curve_kl_coef and c.lr == ppo.Config.lr)


def evaluate_reference(R, cfg, d):
    """π_ref against a second copy of itself through the same evaluation, on the test prompts and
    the validation prompts: the frontier's origin (KL 0; win rate 1/2 up to sampling error), and
    every learning curve's step 0."""
    tok = data.load_tokenizer(tokenizer_beside(R["sft"], "--sft"))
    ref, ref2 = load_model(R["sft"], d.device)[0], load_model(R["sft"], d.device)[0]
    held_out = SimpleNamespace(test_prompts=os.path.join(R["task"], "prompts_test.jsonl"),
                               val_prompts=os.path.join(R["task"], "prompts_val.jsonl"),
                               eval_k=cfg.eval_k, reward_model=R["reward_model"])  # its r_φ score
    res = evaluate_held_out(ref, ref2, tok, held_out, d)
    check("true_reward" in res, f"{held_out.test_prompts}: no true reward; the frontier needs the "
          "built-in task's prompts, the only ones evaluate.py scores with its hidden reward")
    if d.is_main:
        atomic_write_json(os.path.join(cfg.out_dir, R["prefix"] + "ref", "eval.json"), res)


# -----------------------------------------------------------------------------
# Learning curves: a run trained in chunks, its checkpoint evaluated between them


def evaluate_checkpoint(stage, c, d, prompts=None):
    """The policy in c.out_dir/ckpt, by the evaluation the stage itself ends with (the same k and
    sampling seed), on `prompts` (default: the stage's test prompts), so the curve's last point is
    the run's eval.json."""
    ref_path = c.ref_model if stage is dpo else c.sft
    tok = data.load_tokenizer(tokenizer_beside(
        ref_path, "--ref_model" if stage is dpo else "--sft"))
    policy, ref = load_model(ref_path, d.device)[0], load_model(ref_path, d.device)[0]
    # the checkpoint names the policy "policy" in ppo.py (beside its critic) and grpo.py
    name = "policy" if stage in (ppo, grpo) else "model"
    load_checkpoint(os.path.join(c.out_dir, "ckpt"), {name: policy}, d.device)
    prompts = prompts or c.test_prompts
    return evaluate_policy(policy, ref, tok, data.read_prompts(prompts), d, k=c.eval_k,
                           reward_model=load_reward_model(getattr(c, "reward_model", ""), tok,
                                                          d.device), **task_pool_marks(prompts))


def train_in_chunks(stage, c, points, d, resume, test=True, val_at=None):
    """Run stage.main(c) as `points` chunks of --stop_after steps (iterations), evaluating the
    checkpoint's policy after each on the test prompts (test=False: not), and at step val_at on the
    validation prompts too, under "val". The stages resume exactly, so the model at the end is the
    uninterrupted run's. Returns [{"step", **evaluation}], the points evaluated, also kept in
    c.out_dir/curve.json after every point, so an interrupted curve resumes (resume=True) where it
    stopped."""
    total = c.steps if stage is dpo else c.iterations
    ckpt, path = os.path.join(c.out_dir, "ckpt"), os.path.join(c.out_dir, "curve.json")
    done = json.loads(Path(path).read_text()) if resume and os.path.exists(path) else []
    n = min(points, total)
    ends = sorted({round(total * i / n) for i in range(1, n + 1) if test}
                  | {val_at or total, total})
    for b in ends:  # the chunk ends at step b
        if main_decides(any(p["step"] == b for p in done), d):
            continue
        s = (checkpoint_state(ckpt) or {"step": 0})["step"] if resume else 0
        check(s <= b, f"{ckpt} is at step {s}, past the curve's next point {b}: pass another "
              "--out_dir, or delete it")
        if s < b or b == total:  # the last chunk runs to the end: the stage's own eval.json
            stage.main(replace(c, stop_after=b - s, resume=resume))
        resume = True
        point = {"step": b, **(evaluate_checkpoint(stage, c, d) if test else {})}
        if b == val_at:
            ev = evaluate_checkpoint(stage, c, d, c.val_prompts)
            point["val"] = {k: v for k, v in ev.items() if k != "samples"}
        if test or b == val_at:
            done.append(point)
        if d.is_main:
            atomic_write_json(path, done)
    return done


def loop_flops(c, n):
    """Cumulative FLOPs of the loop's first 0..n steps (DPO) or iterations (PPO): a list of n + 1,
    from the loop's own metrics.jsonl ("flops": the model FLOPs its real tokens needed, all ranks,
    padding not counted). One-time work (r_φ's training, the precompute) is not in it."""
    per = [json.loads(line)["flops"] for line in open(os.path.join(c.out_dir, "metrics.jsonl"))]
    return [sum(per[:i]) for i in range(n + 1)]


def budget_rows(stage, c, points):
    """Each evaluated point of a run ({"step", evaluation}) with the budget spent to reach it. The
    budget unit: responses that carried a preference signal into training: 2 labelled responses
    per DPO pair, 1 r_φ-scored rollout per PPO prompt; and the loop's cumulative FLOPs."""
    per_step = 2 * c.batch_size if stage is dpo else c.rollout_batch
    cum = loop_flops(c, points[-1]["step"])
    return [dict(step=p["step"], responses=p["step"] * per_step, flops=cum[p["step"]],
                 **ev_fields(p)) for p in points]


def curve_rows(name, stage, c, ref_ev, points):
    """Rows of curves.csv: step 0 (the policy is π_ref: its evaluation), then every point."""
    return [dict(run=name, method=method_of(stage, c), **r)
            for r in budget_rows(stage, c, [{"step": 0, **ref_ev}] + points)]


# -----------------------------------------------------------------------------
# Running the sweep


EV_FIELDS = ("kl", "true_reward", "win_rate", "eos_rate", "response_len", "true_reward_finished",
             "beyond_pool", "beyond_pool_p99", "top_word_rate", "in_language",
             "reward_model_score")


def ev_fields(ev):
    """The evaluation's numbers a table shows. eos_rate, response_len, true_reward_finished,
    beyond_pool, top_word_rate and in_language are None where an older evaluate.py did not write
    them; reward_model_score also where the run had no r_φ to read (DPO's)."""
    return {**{k: ev.get(k) for k in EV_FIELDS},
            "true_reward_se": ev["true_reward_std"] / ev["n_completions"] ** 0.5,  # sampling only
            "n_completions": ev["n_completions"], "pool_best": ev.get("pool_best"),
            "pool_p99": ev.get("pool_p99"),
            **{f"ref_{k}": ev.get(f"ref_{k}") for k in EV_FIELDS[1:] if k != "win_rate"}}


def same_run(saved, rec, stage):
    """Was the run recorded as `saved` made from what `rec` describes? A config field that `saved`
    lacks (the stage gained it since) counts as the same when `rec` holds the stage's default for
    it, which reproduces the old behaviour; so adding a flag retrains nothing."""
    if not saved or not stage:
        return saved == rec
    defaults, old = asdict(stage.Config()), dict(saved["config"])
    for k in rec["config"].keys() - old.keys():
        if k in defaults and rec["config"][k] == defaults[k]:
            old[k] = rec["config"][k]
    return {**saved, "config": old} == rec


# -----------------------------------------------------------------------------
# Kept runs: a sweep's records in the repository, so that another machine resumes it

RECORDS = ("run.json", "eval.json", "curve.json")  # what the tables read of a run (not weights)
CURVE_RECORDS = RECORDS + ("metrics.jsonl",)  # a learning curve's FLOPs come from its metrics
MODEL_FILES = ("model.safetensors", "tokenizer.json", "eval.json")  # a stage's model, as loaded


def kept(cfg, name):
    """Where --keep holds run `name`'s records, or None without --keep."""
    return os.path.join(cfg.keep, os.path.basename(os.path.normpath(cfg.out_dir)), name) \
        if cfg.keep else None


def copy_files(src, dst, names):
    os.makedirs(dst, exist_ok=True)
    for f in names:
        if os.path.exists(os.path.join(src, f)):
            atomic_copy(os.path.join(src, f), os.path.join(dst, f))


def keep_inputs(cfg, models, d, say, restore):
    """The shared models every kept run was made from ({name: model path}: π_ref, r_φ), in
    <keep>/inputs/<name>. restore=True (before the sweep builds them): a missing model is copied
    from there, since run.json pins each by sha256 and one trained again on another CPU differs in
    its last bits. restore=False (after): kept when the folder has none yet, and refused when it
    holds another, so that no table mixes runs of two π_refs."""
    if not cfg.keep:
        return
    other = []
    for name, path in models.items() if d.is_main else ():
        src, dst = os.path.join(cfg.keep, "inputs", name), os.path.dirname(path)
        there = os.path.join(src, "model.safetensors")
        if restore and os.path.exists(there) and not os.path.exists(path):
            say(f"{path} is missing: restored from {src}, the {name} of the kept runs")
            copy_files(src, dst, MODEL_FILES)
        elif not restore and not os.path.exists(there):
            copy_files(dst, src, MODEL_FILES)
        elif not restore and sha256(there) != sha256(path):
            other.append(f"{path} is not the {name} the runs kept in {cfg.keep} were made from "
                         f"({there}): move {dst} away and run again (it is restored from there), "
                         "or pass another --keep to start a sweep of its own")
    check(not main_decides(bool(other), d), other[0] if other else "rank 0 refused the inputs")


def frontier(cfg, Rs, d, say, runs_of=None):
    """Train every run of every regime in Rs not already done (the curve runs in chunks); then, on
    rank 0, one row per run from its eval.json, and the learning curves' rows. runs_of(cfg, R): a
    regime's runs, as sweep's (a study's own arms; default: sweep)."""
    check(cfg.curve_points == 0 or (cfg.curve_beta in floats(cfg.betas)
                                    and cfg.curve_kl_coef in floats(cfg.kl_coefs)),
          f"--curve_beta {cfg.curve_beta:g} must be one of --betas and --curve_kl_coef "
          f"{cfg.curve_kl_coef:g} one of --kl_coefs (or --curve_points 0)")
    check(len(seed_list(cfg)) == len(set(seed_list(cfg))) > 0,
          f"--seeds {cfg.seeds!r}: give one or more distinct seeds")
    sha = {p: sha256(p) for R in Rs for p in (R["sft"], R["reward_model"])}
    todo = []
    for R in Rs:
        prompts = [os.path.join(R["task"], f"prompts_{s}.jsonl") for s in ("val", "test")]
        todo += [(R["prefix"] + "ref", None, {"k": cfg.eval_k, "prompts": prompts}, R)]
        todo += [(*run, R) for run in (runs_of or sweep)(cfg, R)]
    t0, trained, spent = time.time(), 0, 0.0
    for i, (name, stage, c, R) in enumerate(todo):
        # run.json: what the run was made from (its config, π_ref's and r_φ's sha256, whether it
        # is a learning curve) and whether it finished
        out = os.path.join(cfg.out_dir, name)
        uses_rm = stage in (ppo, grpo, online_dpo) and c.reward == "model"
        curve = is_curve(cfg, stage, c)
        rec = {"stage": stage.__name__ if stage else "evaluate",
               "config": asdict(c) if stage else c,
               "sft_sha256": sha[R["sft"]],
               **({"reward_model_sha256": sha[R["reward_model"]]} if uses_rm else {}),
               **({"curve_points": cfg.curve_points} if curve else {})}
        keep = kept(cfg, name)
        if d.is_main and keep and os.path.exists(f"{keep}/run.json") and not (
                os.path.exists(f"{out}/run.json")):  # finished elsewhere: checked as any other
            copy_files(keep, out, CURVE_RECORDS)  # a record not kept is skipped
        saved = json.loads(Path(out, "run.json").read_text()) if os.path.exists(f"{out}/run.json") \
            else {}
        same = same_run(saved.get("run"), rec, stage)
        if main_decides(same and saved["finished"]
                        and os.path.exists(f"{out}/eval.json"), d):
            say(f"[{i + 1}/{len(todo)}] {name}: eval.json exists with the same config and inputs: "
                "skipped")
            continue
        # this run, interrupted: resume; anything else: start over
        resume = main_decides(same, d)
        what = ("π_ref against itself" if stage is None else
                f"dpo.main, β {c.beta:g}, {c.steps} steps, seed {c.seed}" if stage is dpo else
                f"online_dpo.main, {c.reward} labels, β {c.beta:g}, {c.iterations} rounds of "
                f"{c.rollout_batch} pairs, seed {c.seed}" if stage is online_dpo else
                f"iterative_dpo.main, β {c.beta:g}, {c.rounds} rounds of {c.pairs} pairs and "
                f"{c.steps} steps, seed {c.seed}" if stage is iterative_dpo else
                f"{stage.__name__}.main, {'r_φ' if uses_rm else 'the true reward'}, KL coef "
                f"{c.kl_coef:g}, "
                f"{c.iterations} iterations, seed {c.seed}")
        what += f", NLL α {c.rpo_alpha:g}" if stage in (dpo, iterative_dpo) and c.rpo_alpha else ""
        what += f", in {cfg.curve_points} chunks (learning curve)" if curve else ""
        resuming = resume and stage and checkpoint_state(f"{out}/ckpt")
        say(f"[{i + 1}/{len(todo)}] {name}: {what}" + (" (resuming)" if resuming else ""))
        if d.is_main:
            os.makedirs(out, exist_ok=True)
            atomic_write_json(f"{out}/run.json", {"run": rec, "finished": False})
        barrier(d)
        t1 = time.time()
        if stage is None:
            evaluate_reference(R, cfg, d)
        elif stage is iterative_dpo:  # resumes by round; no checkpoint for the budget rule
            stage.main(replace(c, resume=resume))
        else:  # the budget rule's checkpoint, scored on the validation prompts
            check_step = max(1, round(cfg.check_at * (c.steps if stage is dpo else c.iterations)))
            train_in_chunks(stage, c, cfg.curve_points if curve else 1, d, resume, test=curve,
                            val_at=check_step if cfg.validate else None)
        wall = time.time() - t1
        trained, spent = trained + (stage is not None), spent + wall * (stage is not None)
        if d.is_main:
            atomic_write_json(f"{out}/run.json", {"run": rec, "finished": True, "wall_s": wall})
            if keep:
                copy_files(out, keep, CURVE_RECORDS if curve else RECORDS)
        left = sum(1 for r in todo[i + 1:] if r[1] is not None)
        say(f"[{i + 1}/{len(todo)}] {name} done in {fmt_duration(wall)} | sweep "
            f"{fmt_duration(time.time() - t0)} so far"
            + (f", about {fmt_duration(spent / trained * left)} to go" if left and trained else ""))
    rows, curves, bare = [], [], []
    read = lambda name, f: json.loads(Path(cfg.out_dir, name, f).read_text())  # noqa: E731
    for name, stage, c, R in todo if d.is_main else ():
        ev, run = read(name, "eval.json"), read(name, "run.json")
        check_point = next((p["val"] for p in (read(name, "curve.json")
                                               if stage not in (None, iterative_dpo) else [])
                            if "val" in p), {})
        rows.append(dict(run=name, regime=R["regime"], method=method_of(stage, c),
                         beta=c.beta if stage in (dpo, online_dpo, iterative_dpo) else "",
                         simpo_gamma=c.simpo_gamma if stage is dpo and c.loss == "simpo" else "",
                         kl_coef=c.kl_coef if stage in (ppo, grpo) else "",
                         lr=c.lr if stage else "", seed=c.seed if stage else "", **ev_fields(ev),
                         **{f"val_{k}": ev.get("val", {}).get(k)
                            for k in ("kl", "true_reward", "eos_rate")},
                         check_val_true_reward=check_point.get("true_reward"),
                         wall_s=run.get("wall_s")))
        if is_curve(cfg, stage, c) and not os.path.exists(f"{c.out_dir}/metrics.jsonl"):
            bare.append(name)  # kept before its metrics were: its FLOPs are not on this machine
        elif is_curve(cfg, stage, c):
            curves += curve_rows(name, stage, c, read("ref", "eval.json"), read(name, "curve.json"))
    if bare:
        say(f"the learning curves' runs {', '.join(bare)} were restored from {cfg.keep} without "
            "their metrics.jsonl, whose FLOPs the curves read: no curves this time (the section "
            "stays as it was); a fresh --out_dir and --keep trains them again")
        curves = []
    return rows, curves


def command(cfg, script="-m study.compare"):
    """script with the flags that differ from cfg's defaults: the command that reproduces the
    tables."""
    return " ".join([script] + flags(cfg))


def section_name(cfg, part):
    """RESULTS.md's section for part ("frontier", "curves" or "costs") of this command's tables."""
    if part == "frontier" or cfg.section == Config.section:
        return cfg.section if part == "frontier" else part
    return f"{cfg.section}_{part}"


def prerequisites(cfg, d, say):
    """The earlier stages, shared by every run: built once, with their defaults, when missing."""
    t = lambda f: os.path.join(cfg.task, f)  # noqa: E731
    models = {"sft": cfg.sft, "reward": cfg.reward_model}
    keep_inputs(cfg, models, d, say, restore=True)
    barrier(d)
    require_task({t(f): os.path.join(Config.task, f) for f in (
        "pairs_train.jsonl", "pairs_val.jsonl", "prompts_train.jsonl", "prompts_val.jsonl",
        "prompts_test.jsonl")},
        d, say)
    require_stage(cfg.sft, Config.sft, lambda: (sft.main(sft.Config()), barrier(d)),
                  "python sft.py", d, say)
    require_stage(cfg.reward_model, Config.reward_model,
                  lambda: (reward.main(reward.Config()), barrier(d)), "python reward.py", d, say)
    pc = precompute.Config(out_dir=cfg.ref_logps, ref_model=cfg.sft,
                           train_pairs=t("pairs_train.jsonl"), val_pairs=t("pairs_val.jsonl"))
    for split in ("train", "val"):
        require_stage(f"{cfg.ref_logps}/{split}.safetensors",
                      f"{Config.ref_logps}/{split}.safetensors", lambda: precompute.main(pc),
                      precompute.command(pc), d, say)
    keep_inputs(cfg, models, d, say, restore=False)


def main(cfg):
    d = init_distributed()
    say = lambda *a: print(*a, flush=True) if d.is_main else None  # noqa: E731  rank 0 speaks
    check(cfg.time_steps >= 2,
          "--time_steps must be >= 2: the first step of a timed run warms up and is dropped")
    t0, Rs = time.time(), regimes(cfg)
    prerequisites(cfg, d, say)
    os.makedirs(cfg.out_dir, exist_ok=True)
    sections = {}  # RESULTS.md's: the tables this command made (not an earlier run's in out_dir)
    if cfg.frontier:
        for R in Rs:  # another regime's own task, π_ref, r_φ and cache
            build_regime(R, cfg, d, say)
        rows, curves = frontier(cfg, Rs, d, say)
        if d.is_main:
            md, parts = write_tables(rows, curves, cfg)
            sections.update(parts)
            if cfg.keep:  # the per-run rows beside the kept runs
                atomic_copy(f"{cfg.out_dir}/frontier.csv", kept(cfg, "frontier.csv"))
            say(md + f"\nwrote {cfg.out_dir}/frontier.csv, "
                + ("curves.csv " if curves else "") + "and frontier.md")
    if cfg.costs:
        res = costs.costs(cfg, d, say)
        if d.is_main:
            atomic_write_json(f"{cfg.out_dir}/costs.json", res)
            atomic_write_text(f"{cfg.out_dir}/costs.md", costs.costs_markdown(res, cfg) + "\n")
            say(costs.costs_markdown(res, cfg) + f"\nwrote {cfg.out_dir}/costs.md and costs.json")
            sections["costs"] = costs.costs_markdown(res, cfg)
    if d.is_main:
        parts = [Path(cfg.out_dir, n).read_text() for n in ("frontier.md", "costs.md")
                 if os.path.exists(f"{cfg.out_dir}/{n}")]
        cmd = launcher(d.world) + command(cfg)
        wall = time.time() - t0
        atomic_write_text(f"{cfg.out_dir}/summary.md",
                          f"# PPO against DPO, measured\n\nProduced by `{cmd}` in "
                          f"{fmt_duration(wall)} on {d.world} × {d.device} "
                          f"({torch.get_num_threads()} threads per rank).\n\n"
                          + "\n\n".join(parts))
        made = [section_name(cfg, part) for part in sections]
        for name, body in zip(made, sections.values()):
            write_section(cfg.results, name, body, cmd, wall, d.device, d.world)
        say(f"wrote {cfg.out_dir}/summary.md"
            + (f" and the sections {', '.join(made)} of {cfg.results}" if cfg.results and made
               else "") + f"; study.compare took {fmt_duration(wall)}")
    teardown(d)


if __name__ == "__main__":
    main(parse_config(Config, doc=__doc__))
