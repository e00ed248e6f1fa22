"""Tuning each method before the frontier: the settings study.compare's defaults come from.

    python -m study.tune               # DPO's lr and length, PPO's lr, epochs, batch: 24 min
    python -m study.tune --seeds 1337  # one seed: half the time
    python -m study.tune --help        # every flag

Each method is tuned at the frontier setting its learning curve uses (DPO β --beta, PPO with r_φ at
KL coef --kl_coef), one factor at a time around its current default, every setting once per seed,
all from the same π_ref, pairs, r_φ and reference cache. What it measures is where each method's
true reward stops rising with budget, and which setting gets there first:
- DPO: a run per lr and per length in optimizer steps (--dpo_steps); separate runs, not one run
  observed in chunks, because the cosine schedule depends on the run's length.
- PPO: a run per setting of lr, PPO epochs and rollout batch, each given the same budget in scored
  rollouts (--ppo_rollouts) and observed in --points chunks (its lr is constant, so a chunk is the
  shorter run, exactly).
Every policy is scored by the frontier's evaluation (evaluate_policy): true reward and KL on the
validation prompts (prompts_val.jsonl: tuning never reads the test prompts the frontier reports on).
Writes out/tune/tune.md (the tables, the tuning budget each method was given)
and tune.csv (one row per run and point: per seed), and replaces the section "tune" of --results
(RESULTS.md) by the tables. A run already finished is skipped.
"""
import json
import os
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import dpo
import ppo
from checkpoint import atomic_write_json
from plumbing import (atomic_write_text, check, fmt_duration, init_distributed, main_decides,
                      parse_config, teardown)
from study import compare
from study.compare import budget_rows, seed_list, train_in_chunks
from study.costs import table
from study.tables import floats, mean_se, pm, write_csv
from study.results import launcher, write_section


@dataclass
class Config:
    out_dir: str = "out/tune"  # tables, and one folder per run
    seeds: str = "1337,2337"  # every setting once per seed
    beta: float = 0.3  # DPO's β while tuning (study.compare's --curve_beta)
    dpo_lrs: str = "1e-4,3e-4,1e-3"  # DPO peak learning rates
    dpo_steps: str = "100,200,300"  # DPO run lengths, steps of 64 pairs (the task's epoch: 62)
    kl_coef: float = 0.1  # PPO's KL coefficient while tuning (study.compare's --curve_kl_coef)
    ppo_lrs: str = "3e-5,1e-4,3e-4"  # PPO peak learning rates, at the default epochs and batch
    ppo_epochs: str = "2,4"  # PPO epochs per rollout batch, at the default lr and batch
    rollout_batches: str = "64,128"  # prompts per iteration, at the default lr and epochs
    ppo_rollouts: int = 2560  # every PPO run's budget: rollouts scored by r_φ
    points: int = 8  # evaluations along each PPO run
    results: str = "RESULTS.md"  # its section "tune" gets the tables ("": none)


# every tuning run is scored on the validation prompts, in the place of the test prompts
VAL = "out/task/prompts_val.jsonl"


def runs(cfg):
    """(name, stage, Config): DPO's lr × length grid; PPO one factor at a time around ppo.Config's
    defaults, each setting's iterations = --ppo_rollouts / its rollout batch."""
    out, seeds = [], seed_list(cfg)
    for lr in floats(cfg.dpo_lrs):
        for n in [int(v) for v in floats(cfg.dpo_steps)]:
            out += [(f"dpo-lr{lr:g}-steps{n}-seed{s}", dpo, dpo.Config(
                out_dir=f"{cfg.out_dir}/dpo-lr{lr:g}-steps{n}-seed{s}", beta=cfg.beta, lr=lr,
                steps=n, seed=s, test_prompts=VAL, reward_model=ppo.Config.reward_model))
                for s in seeds]
    base = ppo.Config(test_prompts=VAL)
    grid = [("lr", lr) for lr in floats(cfg.ppo_lrs)] + \
        [("ppo_epochs", int(e)) for e in floats(cfg.ppo_epochs) if e != base.ppo_epochs] + \
        [("rollout_batch", int(b)) for b in floats(cfg.rollout_batches) if b != base.rollout_batch]
    for field, v in grid:
        c = replace(base, kl_coef=cfg.kl_coef, **{field: v})
        check(cfg.ppo_rollouts % c.rollout_batch == 0,
              f"--ppo_rollouts {cfg.ppo_rollouts} is not a multiple of rollout batch "
              f"{c.rollout_batch}")
        tag = f"ppo-{field}{v:g}"
        out += [(f"{tag}-seed{s}", ppo, replace(
            c, out_dir=f"{cfg.out_dir}/{tag}-seed{s}",
            iterations=cfg.ppo_rollouts // c.rollout_batch, seed=s)) for s in seeds]
    return out


def train(stage, c, cfg, d):
    """One run (resumed if interrupted): its points [{"step", "responses", "flops", evaluation}];
    DPO's one point is the run's end, PPO's are --points chunks."""
    if stage is dpo:
        stage.main(replace(c, resume=True))
        points = [{"step": c.steps, **json.loads(Path(c.out_dir, "eval.json").read_text())}]
    else:
        points = train_in_chunks(stage, c, cfg.points, d, True)
    return budget_rows(stage, c, points)


def setting_of(name):
    return name.rsplit("-seed", 1)[0]


def markdown(rows, cfg, walls):
    """Per method: each setting's points, mean ± s.e. over seeds; then the budget spent tuning."""
    groups = {}
    for r in rows:
        groups.setdefault((r["setting"], r["step"]), []).append(r)
    body = {"dpo": [], "ppo": []}
    for (setting, step), rs in groups.items():
        body[setting.split("-")[0]].append(
            [setting, step, f"{rs[0]['responses']:,}",
             f"{mean_se([r['flops'] for r in rs])[0]:.3g}",
             pm(*mean_se([r["kl"] for r in rs]), ".2f"),
             pm(*mean_se([r["true_reward"] for r in rs]), "+.2f"),
             pm(*mean_se([r["eos_rate"] for r in rs]), ".3f"),
             pm(*mean_se([r["in_language"] for r in rs]), ".3f"),
             pm(*mean_se([r["reward_model_score"] for r in rs]), "+.2f"),
             pm(*mean_se([r["response_len"] for r in rs]), ".1f"), len(rs)])
    head = ["setting", "step", "responses", "loop FLOPs", "KL(π‖π_ref) nats", "true reward",
            "EOS rate", "in language", "r_φ score", "response tokens", "seeds"]
    spent = []
    for m in ("dpo", "ppo"):  # each run's last point holds its whole budget
        ends = [r for r in rows if r["run"].startswith(m) and r["last"]]
        spent.append(f"{m.upper()}: {len(ends)} runs, {sum(r['responses'] for r in ends):,} "
                     f"responses, {sum(r['flops'] for r in ends):.3g} loop FLOPs, "
                     f"{fmt_duration(sum(walls[r['run']] for r in ends))} of training and "
                     "evaluation")
    budget = "; ".join(spent)
    return (f"## DPO (β {cfg.beta:g}): lr × length in steps, separate runs\n\n"
            f"{table(head, body['dpo'])}\n\n"
            f"## PPO (r_φ, KL coef {cfg.kl_coef:g}): one factor at a time around ppo.py's "
            f"defaults, {cfg.ppo_rollouts:,} scored rollouts each\n\n{table(head, body['ppo'])}\n\n"
            f"Each cell: mean ± standard error over the seeds ({cfg.seeds}), scored by the "
            "frontier's evaluation (true reward and KL on the validation prompts). Responses: DPO, "
            "2 labelled per pair; PPO, 1 scored rollout per prompt. Loop FLOPs: the training "
            f"loop's model FLOPs, cumulative. Tuning budget: {budget}.")


def main(cfg):
    d = init_distributed()
    say = lambda *a: print(*a, flush=True) if d.is_main else None  # noqa: E731
    todo, rows, walls, t0 = runs(cfg), [], {}, time.time()
    for i, (name, stage, c) in enumerate(todo):
        done = f"{c.out_dir}/tune.json"  # the run's points and config, once it has finished
        rec = main_decides(os.path.exists(done), d) and json.loads(Path(done).read_text())
        if not rec or not compare.same_run({"config": rec["config"]}, {"config": asdict(c)},
                                           stage):
            say(f"[{i + 1}/{len(todo)}] {name}")
            t1 = time.time()
            points = train(stage, c, cfg, d)
            rec = {"config": asdict(c), "points": points, "wall_s": time.time() - t1}
            if d.is_main:
                atomic_write_json(done, rec)
            say(f"[{i + 1}/{len(todo)}] {name} done in {fmt_duration(rec['wall_s'])}, "
                f"study.tune {fmt_duration(time.time() - t0)} so far")
        walls[name] = rec["wall_s"]
        rows += [dict(run=name, setting=setting_of(name), seed=c.seed, last=p is rec["points"][-1],
                      **p) for p in rec["points"]]
    if d.is_main:
        write_csv(f"{cfg.out_dir}/tune.csv", rows)
        md = markdown(rows, cfg, walls)
        atomic_write_text(f"{cfg.out_dir}/tune.md", f"# Tuning, measured\n\nProduced by "
                          f"`python {compare.command(cfg, '-m study.tune')}`.\n\n"
                          f"{md}\n")
        wrote = write_section(cfg.results, "tune", md,
                              launcher(d.world) + compare.command(cfg, "-m study.tune"),
                              time.time() - t0, d.device, d.world)
        say(md + f"\nwrote {cfg.out_dir}/tune.md and tune.csv"
            + (f", and the section tune of {cfg.results}" if wrote else ""))
    teardown(d)


if __name__ == "__main__":
    main(parse_config(Config, doc=__doc__))
