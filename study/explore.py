"""Exploration: what DPO gives up by learning from a fixed pool, measured by one experiment.

    python -m study.explore                     # 2 regimes × 6 arms × 4 seeds, every missing stage
    python -m study.explore --regimes unseen    # one regime: two such commands can run side by side
    python -m study.explore --help              # every flag

The question: does offline DPO lose reward because its pairs never show what π_ref could find?
Two regimes of the built-in task (task.REGIMES):
- unseen: the pair pool holds no response with a top word (great, superb, loved, the hidden reward's
  heaviest), while π_ref, trained on the full texts, still emits them. Only a method that samples
  its own responses can show its labeller those words.
- default: the control. The pool shows everything, so an exploration gap should vanish here.
Six arms, each trained from the same π_ref on both regimes at --seeds, at one β (each DPO arm's β
and PPO's KL coefficient: the regularised objective J_β = E[r] − β·KL is the same for all of them)
and at the learning rate the frontier study chose on validation prompts:
- offline DPO: dpo.py on the pool (4,000 pairs, 200 steps of 64);
- iterative DPO: iterative_dpo.py, the pool's size in fresh pairs over 4 rounds, each round's
  steps a quarter of dpo.py's;
- online DPO (oracle), online DPO (r_φ): online_dpo.py, one DPO step per round of fresh pairs, as
  many rounds as dpo.py's steps, the pool's size in labels over them (4,000 / 200 = 20 a round);
- PPO (r_φ), PPO-GT (the hidden reward): ppo.py, the upper bound, whose budgets are scalar rewards,
  not labels, and are reported beside the others.
One labeller: every arm's labels but the r_φ arms' are task.bradley_terry's draws on the hidden
reward, the rule that labelled the pool. One label budget and one step budget for the four DPO arms,
by construction (explore_config). The runs are study.compare's (its sweep, its folders under
--out_dir, its resume), scored on the test prompts. The decision rule is written in RESULTS.md
above the section this writes, before any of these numbers were seen; verdict() applies it.
Writes out/explore/explore.md and explore.csv, and replaces the section "exploration" of --results.
"""
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from statistics import fmean

import torch

import data
import dpo
import iterative_dpo
import online_dpo
from plumbing import (atomic_write_text, check, fmt_duration, init_distributed, parse_config,
                      teardown)
from study import compare, envelope
from study.envelope import mean_interval
from study.results import flags, launcher, write_section
from study.tables import write_csv


@dataclass
class Config:
    out_dir: str = "out/explore"  # one folder per run (regime unseen's under unseen/), the tables
    task: str = "out/task"  # the default regime's; unseen's: out/task-unseen, built if absent
    sft: str = "out/sft/model.safetensors"  # π_ref for both regimes (their texts are the same)
    reward_model: str = "out/reward/model.safetensors"  # the default regime's r_φ
    ref_logps: str = "out/ref_logps"  # the default regime's cache of log π_ref on its pool
    regimes: str = "default,unseen"  # the control and the regime whose pool hides the top words
    seeds: str = "1337,2337,3337,4337"  # each arm once per seed
    # β of every DPO arm and PPO's KL coefficient; the frontier study's J_β table compares at 0.1
    beta: float = 0.1
    dpo_lr: float = 1e-3  # offline and iterative DPO's: the frontier study's choice on validation
    online_lr: float = 1e-3  # online DPO's: online_dpo.py's, the frontier's choice on validation
    ppo_lr: float = 1e-4  # PPO's and PPO-GT's: the frontier's choice on validation
    dpo_steps: int = dpo.Config.steps  # every DPO arm's optimizer steps
    rounds: int = iterative_dpo.Config.rounds  # iterative DPO's rounds: labels and steps split
    ppo_iterations: int = compare.Config.ppo_iterations  # PPO's: as the frontier study's
    eval_k: int = dpo.Config.eval_k  # completions per test prompt
    # a seventh row, added after the runs, outside the rule: iterative DPO with dpo.py's NLL term
    # on the chosen response (RPO's α), the remedy for the EOS it lost (0: no such row)
    nll_alpha: float = 1.0
    results: str = "RESULTS.md"  # its section --section gets the tables ("": none)
    section: str = "exploration"


ARMS = ("DPO", "iterative DPO", "online DPO (oracle)", "online DPO", "PPO", "PPO-GT",
        "iterative DPO+NLL")
NAMES = {"DPO": "offline DPO", "online DPO": "online DPO (r_φ)", "PPO": "PPO (r_φ)",
         "PPO-GT": "PPO-GT (hidden reward)", "iterative DPO+NLL": "iterative DPO + NLL"}
EXPLORERS = ("iterative DPO", "online DPO (oracle)")  # the arms the decision rule reads


def explore_config(cfg, n_pool):
    """study.compare's Config for the six arms: one β, one lr per method, no curves, no costs.
    n_pool: the pool's labelled pairs. The online arms get n_pool // dpo_steps pairs a round over
    dpo_steps rounds: dpo.py's labels and steps, as iterative DPO gets over its rounds."""
    check(n_pool % cfg.dpo_steps == 0, f"the pool's {n_pool} pairs do not split evenly into "
          f"--dpo_steps {cfg.dpo_steps} rounds of online DPO: the label budgets would differ")
    b = f"{cfg.beta:g}"
    return compare.Config(
        out_dir=cfg.out_dir, task=cfg.task, sft=cfg.sft, reward_model=cfg.reward_model,
        ref_logps=cfg.ref_logps, betas=b, dpo_lrs=f"{cfg.dpo_lr:g}", nll_betas="", kl_coefs=b,
        ppo_lrs=f"{cfg.ppo_lr:g}", true_kl_coefs=b, online_betas=b, online_rewards="model,oracle",
        online_lr=cfg.online_lr, online_batch=n_pool // cfg.dpo_steps, iterative_betas=b,
        iterative_nll_betas=b if cfg.nll_alpha else "", nll_alpha=cfg.nll_alpha,
        iterative_rounds=cfg.rounds, regimes=cfg.regimes, seeds=cfg.seeds,
        dpo_steps=cfg.dpo_steps, ppo_iterations=cfg.ppo_iterations,
        online_iterations=cfg.dpo_steps, eval_k=cfg.eval_k, curve_points=0, costs=False,
        results="", section=cfg.section)


def budgets(stage, c, n_pool):
    """(labels, optimizer steps) of one run: unique labelled pairs for the DPO arms; for PPO the
    scalar rewards it was scored by (r_φ's own training pool of n_pool pairs said beside)."""
    if stage is dpo:
        return f"{n_pool:,} pairs", c.steps
    if stage is iterative_dpo:
        return f"{c.rounds} × {c.pairs:,} pairs", c.rounds * c.steps
    if stage is online_dpo:
        return f"{c.iterations} × {c.rollout_batch} pairs", c.iterations
    rewards = f"{c.iterations * c.rollout_batch:,} rewards"
    return (rewards + (f" (r_φ: {n_pool:,} pairs)" if c.reward == "model" else "")), (
        c.iterations * c.ppo_epochs * c.rollout_batch // c.mini_batch)


# -----------------------------------------------------------------------------
# The contrasts


def counts(iv):
    """+1 when the interval lies above 0, −1 below, 0 when it holds 0 (or there is none)."""
    _, lo, hi = iv
    return 0 if lo is None else 1 if lo > 0 else -1 if hi < 0 else 0


def verdict(diffs, dids):
    """The decision rule of RESULTS.md's section Exploration, applied. diffs[regime][arm] and
    dids[arm]: contrast intervals of J_β, arm − offline DPO, for the arms in EXPLORERS."""
    u = {a: counts(diffs["unseen"][a]) for a in EXPLORERS}
    dft = {a: counts(diffs["default"][a]) for a in EXPLORERS}
    did = {a: counts(dids[a]) for a in EXPLORERS}
    if all(u[a] > 0 and did[a] > 0 for a in EXPLORERS):
        return ("exploration: in the unseen regime both iterative and online DPO (oracle) beat "
                "offline DPO, and by more than in the default regime")
    if any(u[a] > 0 and dft[a] > 0 and did[a] == 0 for a in EXPLORERS):
        return ("not exploration: fresh on-policy pairs beat offline DPO in both regimes alike "
                "(the difference in differences holds 0), so the gain is not from reaching what "
                "the pool hides")
    if all(v == 0 for x in (u, dft, did) for v in x.values()):
        return "no measurable gain: no arm − offline DPO contrast excludes 0 in either regime"
    return ("mixed: " + "; ".join(
        f"{a}: unseen {'+0−'[1 - u[a]]}, default {'+0−'[1 - dft[a]]}, DiD {'+0−'[1 - did[a]]}"
        for a in EXPLORERS) + " (+: above 0, −: below, 0: holds 0)")


# -----------------------------------------------------------------------------
# The tables


def f_iv(iv, f="+.2f"):
    m, lo, hi = iv
    return f"{m:{f}}" + ("" if lo is None else f" [{lo:{f}}, {hi:{f}}]")


def tables(rows, cfg, meta):
    """The markdown: per regime one row per arm, then the contrasts and the verdict."""
    J = lambda rs: [r["true_reward"] - cfg.beta * r["kl"] for r in rs]  # noqa: E731
    by = lambda reg, arm: [r for r in rows if r["regime"] == reg and r["method"] == arm]  # noqa
    regs = [r for r in ("default", "unseen") if any(x["regime"] == r for x in rows)]
    out, diffs = [], {}
    for reg in regs:
        ref = by(reg, "π_ref")[0]
        m = meta[reg]
        out.append(f"#### Regime {reg}: {m['rule']}\n\nThe pool's responses: "
                   f"{m['pool_top']:.1%} hold a top word; π_ref's test completions: "
                   f"{ref['top_word_rate']:.1%} (true reward {ref['true_reward']:+.2f}).\n")
        out.append(f"| arm | labels | optimizer steps | true reward | KL(π‖π_ref) nats | "
                   f"J_{cfg.beta:g} | top-word rate | EOS rate | J_{cfg.beta:g} − offline DPO |\n"
                   "|---|---|---|---|---|---|---|---|---|")
        diffs[reg] = {}
        for arm in ARMS:
            rs = by(reg, arm)
            if not rs:
                continue
            diffs[reg][arm] = c = envelope.contrast_interval([(1, J(rs)), (-1, J(by(reg, "DPO")))])
            out.append(
                f"| {NAMES.get(arm, arm)} | {rs[0]['labels']} | {rs[0]['steps']} | "
                f"{f_iv(mean_interval([r['true_reward'] for r in rs]))} | "
                f"{fmean(r['kl'] for r in rs):.2f} | {f_iv(mean_interval(J(rs)))} | "
                f"{fmean(r['top_word_rate'] for r in rs):.1%} | "
                f"{fmean(r['eos_rate'] for r in rs):.1%} | "
                + ("–" if arm == "DPO" else f_iv(c)) + " |")
        out.append("")
    text = "\n".join(out)
    if regs != ["default", "unseen"]:
        return text, None
    dids = {a: envelope.contrast_interval([(1, J(by("unseen", a))), (-1, J(by("unseen", "DPO"))),
                                  (-1, J(by("default", a))), (1, J(by("default", "DPO")))])
            for a in ARMS[1:]}
    lines = [f"#### J_{cfg.beta:g}, arm − offline DPO, and the difference in differences\n",
             "| arm | default | unseen | unseen − default |", "|---|---|---|---|"]
    lines += [f"| {NAMES.get(a, a)} | {f_iv(diffs['default'][a])} | {f_iv(diffs['unseen'][a])} | "
              f"{f_iv(dids[a])} |" for a in ARMS[1:]]
    v = verdict(diffs, dids)
    lines.append(f"\n**The rule's verdict: {v}.**")
    return text + "\n" + "\n".join(lines), v


def by_round(rows, cfg):
    """Iterative DPO round by round, mean over the seeds of the default regime's runs (the arm
    never reads the pool, so unseen's are the same runs but for the val pairs): what each round
    sampled and skipped, how often its chosen response is the longer, the policy's log-prob of
    the chosen responses at the round's first and last step, and its evaluation after it."""
    out = ["#### Iterative DPO, round by round (regime default)\n",
           "| arm | round | prompts sampled | pairs skipped: a completion did not end | chosen "
           "longer than rejected | logps/chosen, first → last step | EOS rate | KL(π‖π_ref) "
           "nats | true reward |", "|---|---|---|---|---|---|---|---|---|"]
    for arm in ("iterative DPO", "iterative DPO+NLL"):
        runs = [os.path.join(cfg.out_dir, r["run"]) for r in rows
                if r["regime"] == "default" and r["method"] == arm]
        if not runs:
            continue
        per = [json.loads(Path(f, "rounds.json").read_text())["rounds"] for f in runs]
        for k in range(len(per[0])):
            m = lambda key: fmean(p[k][key] for p in per)  # noqa: E731
            longer, first, last = [], [], []
            for f in runs:
                pairs = data.read_pairs(os.path.join(f, f"round{k + 1}", "pairs.jsonl"))
                longer.append(fmean(len(p["chosen"].split()) > len(p["rejected"].split())
                                    for p in pairs))
                steps = [json.loads(line) for line in Path(
                    f, f"round{k + 1}", "dpo", "metrics.jsonl").read_text().splitlines()]
                steps = [s for s in steps if "logps/chosen" in s]
                first.append(steps[0]["logps/chosen"])
                last.append(steps[-1]["logps/chosen"])
            out.append(f"| {NAMES.get(arm, arm)} | {k + 1} | {m('sampled'):,.0f} | "
                       f"{m('unfinished'):,.0f} | {fmean(longer):.1%} | {fmean(first):.1f} → "
                       f"{fmean(last):.1f} | {m('eos_rate'):.1%} | {m('kl'):.2f} | "
                       f"{m('true_reward'):+.2f} |")
    return "\n".join(out) if len(out) > 3 else ""


def main(cfg):
    d = init_distributed()
    say = lambda *a: print(*a, flush=True) if d.is_main else None  # noqa: E731  rank 0 speaks
    t0 = time.time()
    check(cfg.results == "" or cfg.regimes == Config.regimes,
          f"--regimes {cfg.regimes!r} writes no section of {cfg.results}: the verdict needs both "
          "regimes; give --results '' (the runs are kept and the full command skips them)")
    compare.prerequisites(compare.Config(task=cfg.task, sft=cfg.sft, reward_model=cfg.reward_model,
                                         ref_logps=cfg.ref_logps), d, say)
    n_pool = len(data.read_pairs(os.path.join(cfg.task, "pairs_train.jsonl")))
    cc = explore_config(cfg, n_pool)
    Rs = compare.regimes(cc)
    for R in Rs:
        compare.build_regime(R, cc, d, say)
    rows, _ = compare.frontier(cc, Rs, d, say)
    if d.is_main:
        runs = {name: (stage, c) for R in Rs for name, stage, c in compare.sweep(cc, R)}
        for r in rows:
            r["labels"], r["steps"] = budgets(*runs[r["run"]], n_pool) if r["run"] in runs \
                else ("", "")
        meta = {}
        for R in Rs:
            tj = json.loads(Path(R["task"], "task.json").read_text())
            meta[R["regime"]] = dict(rule=tj["regime_rule"], pool_top=tj["pool_top_word_rate"])
        md, v = tables(rows, cfg, meta)
        rounds = by_round(rows, cfg)
        md += "\n\n" + rounds if rounds else ""
        wall = sum(r["wall_s"] or 0 for r in rows)
        md += (f"\n\nEach cell: mean over {len(compare.seed_list(cc))} seeds ({cfg.seeds}), "
               "[95% t-interval]; contrasts: difference of means, 95% Welch-Satterthwaite "
               f"interval; on the test prompts, {cfg.eval_k} completions each. J_{cfg.beta:g}: "
               f"true reward − {cfg.beta:g} × KL per seed. Top-word rate: the share of "
               "completions holding great, superb or loved. Labels: unique labelled pairs (the "
               "DPO arms) or scalar rewards (PPO); the runs took "
               f"{fmt_duration(wall)} of training and evaluation in all, whichever invocation "
               "trained each.")
        os.makedirs(cfg.out_dir, exist_ok=True)
        write_csv(f"{cfg.out_dir}/explore.csv", rows)
        atomic_write_text(f"{cfg.out_dir}/explore.md", md + "\n")
        say(md + f"\nwrote {cfg.out_dir}/explore.md and explore.csv")
        cmd = launcher(d.world) + " ".join(["-m study.explore"] + flags(cfg))
        # the wall time: this command's, or its runs' own where earlier invocations made them
        if write_section(cfg.results, cfg.section, md, cmd, max(time.time() - t0, wall),
                         d.device, d.world):
            say(f"wrote the section {cfg.section} of {cfg.results}")
    say(f"study.explore took {fmt_duration(time.time() - t0)} ({torch.get_num_threads()} "
        "threads)")
    teardown(d)


if __name__ == "__main__":
    main(parse_config(Config, doc=__doc__))
