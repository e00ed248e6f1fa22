"""Exploration: what offline DPO gives up by learning from a fixed pool, one step at a time.

    python -m study.explore --keep study/runs       # 2 regimes × 4 arms × 12 seeds, resumable
    python -m study.explore --regimes unseen --results ''   # one regime: two can run side by side
    python -m study.explore --help                  # every flag

The question: online DPO beats offline DPO on this task; is the gain the data sampling finds (the
exploration a fixed pool cannot do), or on-policy training itself, or only that the two loops
optimise differently? Four arms, each a dpo_loss step per optimizer step, the same β, lr and
200 steps, from the same π_ref, each differing from the next in one thing:
- offline DPO: dpo.py on the pool, 64 pairs a step, 3.2 passes (the loop's defaults);
- offline DPO, online's batch: the same pool, 20 pairs a step, one pass (online DPO's batch and
  passes): what changes is only the optimisation;
- replay: dpo.py on the pairs online DPO stepped on (online_dpo.py's pairs.jsonl, --order steps):
  the same batches, each as online DPO took it, one pass, in a seeded order, so the policy that
  trains on a batch is not the one that sampled it; what changes is only the data (the pairs the
  sampling found, labelled as online labels them, against the pool's);
- online DPO (oracle): online_dpo.py, 200 rounds of 20 fresh pairs, labelled by Bradley-Terry
  draws on the hidden reward (the pool's labeller), one step each: what changes is only that the
  policy being trained sampled each batch just before its step. In the file's own order the
  replay is this run again, step for step (tests/test_replay.py).
So online − replay is on-policy training itself, replay − online's batch is the data, online's
batch − offline DPO the optimisation, and the three add up to online − offline DPO.
Two regimes of the built-in task (task.REGIMES): default, whose pool shows everything, and unseen,
whose pool holds no response with a top word (great, superb, loved), while π_ref still emits them.
Support is measured for every arm: the share of test completions above the pool's best response
and above its 99th percentile, the top-word rate, the in-language rate. The rule that reads the
contrasts (rule(), verdicts()) is written in RESULTS.md above the section this writes, with δ,
before any run. The runs are study.compare's (its folders under --out_dir, its resume and --keep).
Writes out/explore/explore.md and explore.csv, and replaces the section "exploration" of --results.
"""
import json
import math
import os
import time
from dataclasses import dataclass, replace
from pathlib import Path
from statistics import fmean, stdev

import torch

import data
import dpo
import online_dpo
from plumbing import (atomic_write_text, check, fmt_duration, init_distributed, parse_config,
                      teardown)
from study import compare
from study.envelope import mean_interval, t_quantile
from study.results import flags, launcher, write_section
from study.tables import write_csv


@dataclass
class Config:
    out_dir: str = "out/explore"  # one folder per run (regime unseen's under unseen/), the tables
    task: str = "out/task"  # the default regime's; unseen's: out/task-unseen, built if absent
    sft: str = "out/sft/model.safetensors"  # π_ref for both regimes (their texts are the same)
    reward_model: str = "out/reward/model.safetensors"  # the default regime's r_φ (evaluation)
    ref_logps: str = "out/ref_logps"  # the default regime's cache of log π_ref on its pool
    regimes: str = "default,unseen"  # the pool that shows everything, and the one hiding top words
    # each arm once per seed, paired across arms by seed; 12: the rule's δ needs them (RESULTS.md)
    seeds: str = "1337,2337,3337,4337,5337,6337,7337,8337,9337,10337,11337,12337"
    # every arm's β: DPO's choice on validation in the frontier study (at 0.1 offline DPO's runs
    # split in two, KL 10 to 26 nats, so a contrast would read which mode a seed fell in)
    beta: float = 0.3
    lr: float = 1e-3  # every arm's: dpo.py's and online_dpo.py's
    steps: int = dpo.Config.steps  # every arm's optimizer steps (online DPO's rounds)
    delta: float = 0.5  # the equivalence margin of J_β, written in RESULTS.md before the runs
    eval_k: int = dpo.Config.eval_k  # completions per test prompt
    keep: str = ""  # study.compare's --keep: the runs' records kept in the repository
    results: str = "RESULTS.md"  # its section --section gets the tables ("": none)
    section: str = "exploration"


ARMS = ("DPO", "DPO, online's batch", "replay", "online DPO (oracle)")
NAMES = {"DPO": "offline DPO", "replay": "replay of online's pairs"}
# the contrasts, each arm − arm, paired by seed: what changes between them
CONTRASTS = (("online DPO (oracle)", "replay", "on-policy training itself"),
             ("replay", "DPO, online's batch", "the data sampling found"),
             ("DPO, online's batch", "DPO", "the optimisation (batch, passes)"),
             ("online DPO (oracle)", "DPO", "all of it"))
PRIMARY = CONTRASTS[:2]


def explore_config(cfg, n_pool):
    """study.compare's Config for offline DPO and online DPO (oracle) at one β and lr, no curves,
    no costs; arms() adds the other two. n_pool: the pool's pairs, of which online DPO gets
    n_pool // steps a round: dpo.py's labels over its steps."""
    check(n_pool % cfg.steps == 0, f"the pool's {n_pool} pairs do not split evenly into --steps "
          f"{cfg.steps} rounds of online DPO: the label budgets would differ")
    b = f"{cfg.beta:g}"
    return compare.Config(
        out_dir=cfg.out_dir, task=cfg.task, sft=cfg.sft, reward_model=cfg.reward_model,
        ref_logps=cfg.ref_logps, betas=b, dpo_lrs=f"{cfg.lr:g}", nll_betas="", kl_coefs="",
        true_kl_coefs="", online_betas=b, online_rewards="oracle", online_lr=cfg.lr,
        online_batch=n_pool // cfg.steps,
        regimes=cfg.regimes, seeds=cfg.seeds, dpo_steps=cfg.steps, online_iterations=cfg.steps,
        eval_k=cfg.eval_k, curve_points=0, costs=False, keep=cfg.keep, results="",
        validate=False)  # nothing is selected: every arm's settings are fixed above


def arms(cc, R):
    """A regime's runs: study.compare's sweep, then per seed the two arms that sit between
    offline and online DPO. The replay reads its online run's pairs.jsonl, so it comes after."""
    runs = compare.sweep(cc, R)
    online = {c.seed: c for _, stage, c in runs if stage is online_dpo}
    extra = []
    for name, stage, c in runs:
        if stage is not dpo:
            continue
        o, tail = os.path.dirname(c.out_dir), name.split("/")[-1].replace("dpo-", "", 1)
        extra.append((name.replace("dpo-", f"dpo-batch{cc.online_batch}-", 1), dpo, replace(
            c, out_dir=f"{o}/dpo-batch{cc.online_batch}-{tail}", batch_size=cc.online_batch)))
        src = online[c.seed]
        extra.append((name.replace("dpo-", "replay-", 1), dpo, replace(
            c, out_dir=f"{o}/replay-{tail}", batch_size=cc.online_batch,
            train_pairs=f"{src.out_dir}/pairs.jsonl", order="steps", steps=src.iterations,
            ref_logps=dpo.Config.ref_logps)))  # its pairs' own cache, built by dpo.py
    # seed by seed, each seed's four arms together, so that an interrupted sweep leaves whole
    # seeds for the paired contrasts (each arm's replay still after its online run)
    order = {s: i for i, s in enumerate(compare.seed_list(cc))}
    return sorted(runs + extra, key=lambda run: order[run[2].seed])


def arm_of(row):
    """The arm a study.compare row belongs to, by its run's name."""
    name = row["run"].split("/")[-1]
    return ("replay" if name.startswith("replay-") else "DPO, online's batch"
            if name.startswith("dpo-batch") else row["method"])


# -----------------------------------------------------------------------------
# The rule


def paired_interval(a, b):
    """(mean, low, high) of a − b over the seeds both have, paired by seed ({seed: value} each):
    the 95% t-interval of the per-seed differences; the seeds of the pair."""
    seeds = sorted(a.keys() & b.keys())
    return mean_interval([a[s] - b[s] for s in seeds]), seeds


def rule(iv, delta):
    """RESULTS.md's rule for one contrast, the 95% interval (mean, low, high) of a difference:
    "equivalent" when it lies inside ±delta (whether or not it holds 0), else "difference" when it
    excludes 0, else "undetermined"."""
    m, lo, hi = iv
    if lo is None:
        return "undetermined"
    if -delta < lo and hi < delta:
        return "equivalent"
    return "difference" if lo > 0 or hi < 0 else "undetermined"


def seeds_needed(diffs, delta):
    """About how many seeds an undetermined contrast would need, from its per-seed differences
    (their mean and spread taken as they are): the n at which the t half-width falls below the
    distance left to what decides it, to 0 when the mean lies at or beyond ±delta (a difference),
    to ±delta when inside (an equivalence). None when the differences do not spread."""
    m, s = fmean(diffs), stdev(diffs) if len(diffs) > 1 else 0.0
    room = abs(m) if abs(m) >= delta else delta - abs(m)
    if not s:
        return None
    n = 2
    while t_quantile(n - 1) * s / math.sqrt(n) >= room and n < 10_000:
        n += 1
    return n


def verdicts(outcome):
    """The sentences RESULTS.md's rule says, from outcome[regime][(a, b)] = (rule(), mean):
    "exploration" only from the data contrast, "not exploration" only from its equivalence."""
    out = []
    for reg, oc in outcome.items():
        (on, m_on), (da, m_da) = oc[PRIMARY[0][:2]], oc[PRIMARY[1][:2]]
        data_says = ("the data sampling found carries a gain" if da == "difference" and m_da > 0
                     else "the data sampling found costs" if da == "difference"
                     else "not exploration: the data sampling found is worth no more than the "
                     "pool's" if da == "equivalent" else "undetermined for the data")
        pol_says = ("on-policy training itself adds" if on == "difference" and m_on > 0
                    else "on-policy training itself costs" if on == "difference"
                    else "on-policy training itself adds nothing" if on == "equivalent"
                    else "undetermined for on-policy training")
        out.append(f"{reg}: {data_says}; {pol_says}")
    return out


# -----------------------------------------------------------------------------
# The tables


def f_iv(iv, f="+.2f"):
    m, lo, hi = iv
    return f"{m:{f}}" + ("" if lo is None else f" [{lo:{f}}, {hi:{f}}]")


def j_of(r, beta):
    return r["true_reward"] - beta * r["kl"]


def sample_of(cfg, row):
    """The first sample of the run's test evaluation: the policy's completion and its score."""
    ev = json.loads(Path(cfg.out_dir, row["run"], "eval.json").read_text())
    s = ev["samples"][0]
    return f"{s.get('policy_reward', float('nan')):+.1f} {s['policy']!r}"


def tables(rows, cfg, meta):
    """The markdown: per regime the arms with their support, then the contrasts under the rule;
    returns (markdown, outcome)."""
    J = lambda r: j_of(r, cfg.beta)  # noqa: E731
    by = lambda reg, arm: [r for r in rows if r["regime"] == reg and r["arm"] == arm]  # noqa
    regs = [r for r in cfg.regimes.split(",") if any(x["regime"] == r for x in rows)]
    out, outcome = [], {}
    for reg in regs:
        ref, m = by(reg, "π_ref")[0], meta[reg]
        out.append(f"#### Regime {reg}: {m['rule']}\n\nThe pool ({m['n_pool']:,} pairs, "
                   f"{2 * m['n_pool']:,} responses): best response {ref['pool_best']:+.1f}, 99th "
                   f"percentile {ref['pool_p99']:+.1f}, {m['pool_top']:.1%} hold a top word. "
                   f"π_ref on the test prompts: true reward {ref['true_reward']:+.2f}, "
                   f"{ref['in_language']:.1%} in the task's language, top-word rate "
                   f"{ref['top_word_rate']:.1%}, {ref['beyond_pool']:.1%} above the pool's best, "
                   f"{ref['beyond_pool_p99']:.1%} above its 99th percentile.\n")
        out.append(f"| arm | pairs a step × steps | true reward | KL(π‖π_ref) nats | "
                   f"J_{cfg.beta:g} | in language | r_φ score | top-word rate | above pool's "
                   "best | above its p99 | EOS rate | a sample (first seed, first test prompt) |\n"
                   "|---|---|---|---|---|---|---|---|---|---|---|---|")
        for arm in ARMS:
            rs = by(reg, arm)
            if not rs:
                continue
            mean = lambda k: fmean(r[k] for r in rs)  # noqa: E731
            out.append(
                f"| {NAMES.get(arm, arm)} | {rs[0]['budget']} | "
                f"{f_iv(mean_interval([r['true_reward'] for r in rs]))} | {mean('kl'):.2f} | "
                f"{f_iv(mean_interval([J(r) for r in rs]))} | {mean('in_language'):.1%} | "
                f"{mean('reward_model_score'):+.2f} | "
                f"{mean('top_word_rate'):.1%} | {mean('beyond_pool'):.1%} | "
                f"{mean('beyond_pool_p99'):.1%} | {mean('eos_rate'):.1%} | "
                f"{sample_of(cfg, rs[0])} |")
        out.append(f"\n#### Regime {reg}: the contrasts of J_{cfg.beta:g}, paired by seed\n\n"
                   f"| contrast | what changes | J_{cfg.beta:g} difference [95% t] | true reward "
                   f"difference | seeds | the rule (δ {cfg.delta:g}) |\n|---|---|---|---|---|---|")
        outcome[reg] = {}
        for a, b, what in CONTRASTS:
            A, B = ({r["seed"]: r for r in by(reg, x)} for x in (a, b))
            if not A or not B:
                continue
            iv, seeds = paired_interval({s: J(r) for s, r in A.items()},
                                        {s: J(r) for s, r in B.items()})
            tr, _ = paired_interval({s: r["true_reward"] for s, r in A.items()},
                                    {s: r["true_reward"] for s, r in B.items()})
            said = rule(iv, cfg.delta)
            outcome[reg][(a, b)] = (said, iv[0])
            more = seeds_needed([J(A[s]) - J(B[s]) for s in seeds], cfg.delta) \
                if said == "undetermined" and len(seeds) > 1 else None
            out.append(f"| {NAMES.get(a, a)} − {NAMES.get(b, b)} | {what} | {f_iv(iv)} | "
                       f"{f_iv(tr)} | {len(seeds)} | **{said}**"
                       + (f" (about {more} seeds would decide it)" if more else "") + " |")
        out.append("")
    if all(len(outcome.get(r, {})) >= 2 for r in regs):
        out.append("**The rule says**: " + "; ".join(
            verdicts({r: outcome[r] for r in regs})) + ".")
    return "\n".join(out), outcome


def budget(stage, c, n_pool):
    """Pairs a step × steps, and where the pairs come from."""
    if stage is dpo:
        return (f"{c.batch_size} × {c.steps}, " + (
            "online's pairs, its batches reordered" if c.order == "steps" else
            f"the pool, {c.batch_size * c.steps / n_pool:.1f} passes"))
    if stage is online_dpo:
        return f"{c.rollout_batch} × {c.iterations}, fresh each round"
    return ""


def main(cfg):
    d = init_distributed()
    say = lambda *a: print(*a, flush=True) if d.is_main else None  # noqa: E731  rank 0 speaks
    t0 = time.time()
    check(cfg.results == "" or cfg.regimes == Config.regimes,
          f"--regimes {cfg.regimes!r} writes no section of {cfg.results}: the rule reads both "
          "regimes; give --results '' (the runs are kept and the full command skips them)")
    compare.prerequisites(compare.Config(task=cfg.task, sft=cfg.sft, reward_model=cfg.reward_model,
                                         ref_logps=cfg.ref_logps, keep=cfg.keep), d, say)
    n_pool = len(data.read_pairs(os.path.join(cfg.task, "pairs_train.jsonl")))
    cc = explore_config(cfg, n_pool)
    Rs = compare.regimes(cc)
    for R in Rs:
        compare.build_regime(R, cc, d, say)
    rows, _ = compare.frontier(cc, Rs, d, say, runs_of=arms)
    if d.is_main:
        runs = {name: (stage, c) for R in Rs for name, stage, c in arms(cc, R)}
        for r in rows:
            r["arm"] = arm_of(r)
            r["budget"] = budget(*runs[r["run"]], n_pool) if r["run"] in runs else ""
        meta = {}
        for R in Rs:
            tj = json.loads(Path(R["task"], "task.json").read_text())
            meta[R["regime"]] = dict(rule=tj["regime_rule"], pool_top=tj["pool_top_word_rate"],
                                     n_pool=n_pool)
        md, _ = tables(rows, cfg, meta)
        wall = sum(r["wall_s"] or 0 for r in rows)
        md += (f"\n\nEach cell: mean over {len(compare.seed_list(cc))} seeds ({cfg.seeds}) "
               "[95% t-interval]; on the test prompts, "
               f"{cfg.eval_k} completions each. J_{cfg.beta:g}: true reward − {cfg.beta:g} × KL, "
               "per seed. Contrasts: the mean of the per-seed differences and its 95% t-interval "
               "(paired by seed). In language: the completion ended and is a text of the task's "
               "language. r_φ score: the regime's reward model's mean score of the completions "
               "(the proxy no arm here trains on). Top-word rate: the share of completions "
               "holding great, superb or loved. The runs took "
               f"{fmt_duration(wall)} of training and evaluation in all, whichever invocation "
               "trained each.")
        os.makedirs(cfg.out_dir, exist_ok=True)
        write_csv(f"{cfg.out_dir}/explore.csv", rows)
        atomic_write_text(f"{cfg.out_dir}/explore.md", md + "\n")
        say(md + f"\nwrote {cfg.out_dir}/explore.md and explore.csv")
        cmd = launcher(d.world) + " ".join(["-m study.explore"] + flags(cfg))
        if write_section(cfg.results, cfg.section, md, cmd, max(time.time() - t0, wall),
                         d.device, d.world):
            say(f"wrote the section {cfg.section} of {cfg.results}")
    say(f"study.explore took {fmt_duration(time.time() - t0)} ({torch.get_num_threads()} "
        "threads)")
    teardown(d)


if __name__ == "__main__":
    main(parse_config(Config, doc=__doc__))
