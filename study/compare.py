"""PPO and DPO side by side: what leaves the cluster when DPO replaces PPO, in measured numbers.

    python -m study.compare                 # 3 seeds, curves, costs (19 min on 2 CPU cores)
    torchrun --nproc_per_node=8 -m study.compare   # the same, every run on 8 ranks (plain DDP)
    python -m study.compare --betas 0.03,0.1,0.3,1,3 --kl_coefs 0.01,0.1,1 --seeds 1,1001,2001,3001
    python -m study.compare --no-costs      # the frontier only (--no-frontier: the costs only)
    python -m study.compare --help          # every flag

1. The frontier (Figure 2 of Rafailov et al. 2023): DPO at several β, PPO at several KL coefficients
   with r_φ as its reward and, as the paper's PPO-GT, with the hidden true reward; all from the same
   π_ref, pairs, r_φ, reference cache and prompts. Every setting is trained once per seed of --seeds
   (the stages' `seed`: data order and sampling), each run by dpo.main / ppo.main in its own
   folder out/compare/<run>/ and scored by the one evaluation they share (evaluate_policy). A point
   of the frontier is the mean over seeds ± the standard error across seeds. A run whose eval.json
   exists with the same config and inputs is skipped, so an interrupted sweep resumes.
2. Matched KL: each method's mean curve (reward against KL, in order of KL) read at --match_kls by
   linear interpolation between the two settings that bracket the KL, with its standard error; no
   number outside a method's measured KL range.
3. Learning curves: the first seed's DPO run at --curve_beta and PPO run at --curve_kl_coef are
   trained in --curve_points chunks (the stages resume exactly, so this is the uninterrupted run,
   observed) and the checkpoint is evaluated after each: true reward and KL against the budget
   (responses labelled, for DPO, or scored, for PPO) and against the loop's cumulative FLOPs.
   Writes frontier.csv (one row per run: per seed), curves.csv, frontier.md (+ frontier.png and
   curves.png if matplotlib is installed).
4. The costs (study/costs.py) at π_ref's size and extrapolated to 7B: costs.md and costs.json.
   summary.md collects the tables under the command that made them, and the sections "frontier"
   and "costs" of --results (RESULTS.md) are replaced by them (study/results.py).
Missing earlier stages (task, sft, reward model, reference cache) are built once, with defaults.
"""
import csv
import json
import math
import os
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

import data
import dpo
import online_dpo
import ppo
import precompute
import reward
import sft
import task
from checkpoint import (atomic_write_json, checkpoint_state, load_checkpoint, sha256,
                        tokenizer_beside)
from plumbing import (atomic_write_text, barrier, check, fmt_duration, init_distributed,
                      main_decides, parse_config, require_stage, teardown)
from evaluate import evaluate_policy
from model import load_model
from study import costs
from study.costs import table
from study.results import flags, launcher, write_section
from task import require_task, task_pool_best


@dataclass
class Config:
    out_dir: str = "out/compare"  # tables, plots, and one folder per run of the sweep
    task: str = "out/task"  # pairs_{train,val}.jsonl, prompts_{train,eval}.jsonl; built if missing
    sft: str = "out/sft/model.safetensors"  # π_ref, shared by every run; built by sft.py if missing
    reward_model: str = "out/reward/model.safetensors"  # r_φ for PPO; built by reward.py if missing
    ref_logps: str = "out/ref_logps"  # DPO's cache of log π_ref; built by precompute.py if missing
    betas: str = "0.1,0.3,1,3"  # DPO runs: one per β, comma-separated
    kl_coefs: str = "0.03,0.1,0.3"  # PPO runs with r_φ: one per KL coefficient
    true_kl_coefs: str = "0.1"  # PPO-GT runs (--reward true): one per KL coefficient ("" = none)
    online_betas: str = ""  # online DPO runs (online_dpo.py, r_φ labels): one per β ("" = none)
    # task regimes (task.REGIMES), each a frontier of its own: its task beside --task (out/task:
    # out/task-capped, as task.task_dir), its π_ref (the default's when its texts are), r_φ, cache
    # and runs in out_dir/<regime>
    regimes: str = "default"  # comma-separated, of default, capped, shifted
    # training seeds, each setting once per seed: data order, sampling (π_ref, r_φ, cache shared).
    # Spaced apart: data.global_batch orders epoch e with seed + e, so seeds 1 apart share epochs
    seeds: str = "1337,2337,3337"
    dpo_steps: int = dpo.Config.steps  # optimizer steps of each DPO run
    ppo_iterations: int = ppo.Config.iterations  # iterations of each PPO run
    online_iterations: int = online_dpo.Config.iterations  # rounds of each online DPO run
    dpo_lr: float = dpo.Config.lr  # every DPO run's peak learning rate
    ppo_lr: float = ppo.Config.lr  # every PPO run's peak learning rate
    eval_k: int = dpo.Config.eval_k  # completions per held-out prompt, every run and π_ref alike
    match_kls: str = "1,2,4,6,8"  # KL values (nats) at which the methods are compared, interpolated
    curve_beta: float = 0.3  # DPO's learning curve: the first seed's run at this β (one of betas)
    curve_kl_coef: float = 0.1  # PPO's learning curve: its run at this KL coef (one of kl_coefs)
    curve_points: int = 5  # evaluations along each learning curve (0 = no curves)
    frontier: bool = True  # train the sweep, write frontier.* and curves.*
    costs: bool = True  # measure the costs, write costs.*
    rounds: int = 3  # interleaved timing rounds, each: PPO, DPO live, DPO cached, precompute
    time_steps: int = 4  # iterations (PPO) or steps (DPO) per timed run; the first warms up
    # RESULTS.md: its sections (study/results.py) get this command's tables ("": none)
    results: str = "RESULTS.md"
    # the frontier section's name; the learning curves' and the costs' are "curves" and "costs"
    # beside the default one, else <section>_curves and <section>_costs
    section: str = "frontier"


# -----------------------------------------------------------------------------
# Statistics over seeds: pure functions


def mean_se(xs):
    """Mean and standard error of the mean of xs: sample standard deviation (n − 1) / √n. The
    error is nan for a single value, and both are None if any value is missing (an eval.json
    written before that field existed)."""
    if any(x is None for x in xs):
        return None, None
    n, m = len(xs), sum(xs) / len(xs)
    return m, (sum((x - m) ** 2 for x in xs) / (n - 1) / n) ** 0.5 if n > 1 else math.nan


def at_kl(settings, x):
    """A method's true reward at KL x, read off its mean curve. settings: one list per setting (a β
    or a KL coefficient) of its seeds' (kl, reward). The mean curve joins the settings' mean points
    in order of KL; between the two that bracket x the reward is linear. Returns (reward, se), or
    None when x lies outside the measured KL range: no extrapolation.
    se by the delta method: when the bracketing point i, of weight w_i (1 − w and w), moves by
    (δx_i, δy_i), the value at x moves by w_i·(δy_i − s·δx_i), s the segment's slope. The two
    settings' runs are independent, so se² = Σ_i w_i² se²(y_i − s·x_i), each se across that
    setting's seeds: the KL's own spread, and its correlation with the reward, are carried."""
    pts = sorted(((mean_se([k for k, _ in s])[0], mean_se([r for _, r in s])[0], s)
                  for s in settings), key=lambda p: p[0])
    for (x0, y0, s0), (x1, y1, s1) in zip(pts, pts[1:]):
        if x0 <= x <= x1 and x0 < x1:
            w, slope = (x - x0) / (x1 - x0), (y1 - y0) / (x1 - x0)
            var = sum(wi ** 2 * mean_se([r - slope * k for k, r in s])[1] ** 2
                      for wi, s in ((1 - w, s0), (w, s1)))
            return y0 + w * (y1 - y0), var ** 0.5
    return None


def pm(m, se, f="+.3f"):
    """'m ± se' for the tables; '–' for a missing value, no ± for an unknown error."""
    if m is None:
        return "–"
    return f"{m:{f}}" + (f" ± {se:.3f}" if se is not None and math.isfinite(se) else "")


# -----------------------------------------------------------------------------
# The sweep


def floats(s):
    return [float(v) for v in s.split(",") if v.strip()]


def seed_list(cfg):
    return [int(s) for s in cfg.seeds.split(",") if s.strip()]


def regimes(cfg):
    """Each regime's inputs: its task, π_ref, r_φ and reference cache, and the prefix of its runs'
    names (folders under out_dir). The default regime's are the flags'; another regime's task is
    --task's name + -<regime>, and its π_ref the default's when its texts are (capped), else its
    own (shifted: the generator differs)."""
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
    """A regime's runs: (name, stage, its Config), every setting once per seed, all from the same
    π_ref, pairs, r_φ, cache and prompts."""
    t = lambda f: os.path.join(R["task"], f)  # noqa: E731
    seeds, p = seed_list(cfg), R["prefix"]
    o = lambda name: os.path.join(cfg.out_dir, p + name)  # noqa: E731
    runs = [(f"{p}dpo-beta{b:g}-seed{s}", dpo, dpo.Config(
        out_dir=o(f"dpo-beta{b:g}-seed{s}"), ref_model=R["sft"], train_pairs=t("pairs_train.jsonl"),
        val_pairs=t("pairs_val.jsonl"), eval_prompts=t("prompts_eval.jsonl"),
        ref_logps=R["ref_logps"], beta=b, steps=cfg.dpo_steps, lr=cfg.dpo_lr, eval_k=cfg.eval_k,
        seed=s))
        for b in floats(cfg.betas) for s in seeds]
    runs += [(f"{p}online-beta{b:g}-seed{s}", online_dpo, online_dpo.Config(
        out_dir=o(f"online-beta{b:g}-seed{s}"), sft=R["sft"], reward_model=R["reward_model"],
        prompts=t("prompts_train.jsonl"), eval_prompts=t("prompts_eval.jsonl"), beta=b,
        iterations=cfg.online_iterations, lr=cfg.dpo_lr, eval_k=cfg.eval_k, seed=s))
        for b in floats(cfg.online_betas) for s in seeds]
    for rw, coefs, tag in (("model", cfg.kl_coefs, "ppo"), ("true", cfg.true_kl_coefs, "ppo-true")):
        runs += [(f"{p}{tag}-kl{k:g}-seed{s}", ppo, ppo.Config(
            out_dir=o(f"{tag}-kl{k:g}-seed{s}"), sft=R["sft"], reward_model=R["reward_model"],
            prompts=t("prompts_train.jsonl"), eval_prompts=t("prompts_eval.jsonl"), reward=rw,
            kl_coef=k, iterations=cfg.ppo_iterations, lr=cfg.ppo_lr, eval_k=cfg.eval_k, seed=s))
            for k in floats(coefs) for s in seeds]
    return runs


def method_of(stage, c):
    return "π_ref" if stage is None else "DPO" if stage is dpo else \
        "online DPO" if stage is online_dpo else "PPO" if c.reward == "model" else "PPO-GT"


def is_curve(cfg, stage, c):
    """Whether this run is one of the two drawn as a learning curve (default regime only)."""
    return cfg.curve_points > 0 and stage in (dpo, ppo) and c.seed == seed_list(cfg)[0] and (
        os.path.dirname(c.out_dir) == os.path.normpath(cfg.out_dir)) and (
        c.beta == cfg.curve_beta if stage is dpo else
        c.reward == "model" and c.kl_coef == cfg.curve_kl_coef)


def evaluate_reference(R, cfg, d):
    """π_ref against a second copy of itself through the same evaluation: the frontier's origin (KL
    0; win rate 1/2 up to sampling error), and every learning curve's step 0."""
    tok = data.load_tokenizer(tokenizer_beside(R["sft"], "--sft"))
    ref, ref2 = load_model(R["sft"], d.device)[0], load_model(R["sft"], d.device)[0]
    path = os.path.join(R["task"], "prompts_eval.jsonl")
    res = evaluate_policy(ref, ref2, tok, data.read_prompts(path), d, k=cfg.eval_k,
                          pool_best=task_pool_best(path))
    check("true_reward" in res, f"{path}: no true reward; the frontier needs the built-in "
          "task's prompts, the only ones evaluate.py scores with its hidden reward")
    if d.is_main:
        atomic_write_json(os.path.join(cfg.out_dir, R["prefix"] + "ref", "eval.json"), res)


# -----------------------------------------------------------------------------
# Learning curves: a run trained in chunks, its checkpoint evaluated between them


def evaluate_checkpoint(stage, c, d):
    """The policy in c.out_dir/ckpt, by the evaluation the stage itself ends with (the same
    prompts, k and sampling seed), so the curve's last point is the run's eval.json."""
    ref_path = c.ref_model if stage is dpo else c.sft
    tok = data.load_tokenizer(tokenizer_beside(
        ref_path, "--ref_model" if stage is dpo else "--sft"))
    policy, ref = load_model(ref_path, d.device)[0], load_model(ref_path, d.device)[0]
    # the checkpoint names the policy "model" in dpo.py, "policy" in ppo.py (beside its critic)
    name = "model" if stage is dpo else "policy"
    load_checkpoint(os.path.join(c.out_dir, "ckpt"), {name: policy}, d.device)
    return evaluate_policy(policy, ref, tok, data.read_prompts(c.eval_prompts), d, k=c.eval_k,
                           pool_best=task_pool_best(c.eval_prompts))


def train_in_chunks(stage, c, points, d, resume):
    """Run stage.main(c) as `points` chunks of --stop_after steps (iterations), evaluating the
    checkpoint's policy after each. The stages resume exactly, so the model at the end is the
    uninterrupted run's. Returns [{"step", **evaluation}], also kept in c.out_dir/curve.json after
    every point, so an interrupted curve resumes (resume=True) where it stopped."""
    total = c.steps if stage is dpo else c.iterations
    ckpt, path = os.path.join(c.out_dir, "ckpt"), os.path.join(c.out_dir, "curve.json")
    done = json.loads(Path(path).read_text()) if resume and os.path.exists(path) else []
    for i in range(1, min(points, total) + 1):
        b = round(total * i / min(points, total))  # the chunk ends at step b
        if main_decides(any(p["step"] == b for p in done), d):
            continue
        s = (checkpoint_state(ckpt) or {"step": 0})["step"] if resume else 0
        check(s <= b, f"{ckpt} is at step {s}, past the curve's next point {b}: pass another "
              "--out_dir, or delete it")
        if s < b or b == total:  # the last chunk runs to the end: the stage's own eval.json
            stage.main(replace(c, stop_after=b - s, resume=resume))
        resume = True
        done.append({"step": b, **evaluate_checkpoint(stage, c, d)})
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
             "beyond_pool")


def ev_fields(ev):
    """The evaluation's numbers a table shows. eos_rate, response_len, true_reward_finished and
    beyond_pool are None where an older evaluate.py did not write them."""
    return {**{k: ev.get(k) for k in EV_FIELDS},
            "true_reward_se": ev["true_reward_std"] / ev["n_completions"] ** 0.5,  # sampling only
            "n_completions": ev["n_completions"], "pool_best": ev.get("pool_best"),
            **{f"ref_{k}": ev.get(f"ref_{k}") for k in EV_FIELDS[1:] if k != "win_rate"}}


def frontier(cfg, Rs, d, say):
    """Train every run of every regime in Rs not already done (the curve runs in chunks); then, on
    rank 0, one row per run from its eval.json, and the learning curves' rows."""
    check(cfg.curve_points == 0 or (cfg.curve_beta in floats(cfg.betas)
                                    and cfg.curve_kl_coef in floats(cfg.kl_coefs)),
          f"--curve_beta {cfg.curve_beta:g} must be one of --betas and --curve_kl_coef "
          f"{cfg.curve_kl_coef:g} one of --kl_coefs (or --curve_points 0)")
    check(len(seed_list(cfg)) == len(set(seed_list(cfg))) > 0,
          f"--seeds {cfg.seeds!r}: give one or more distinct seeds")
    sha = {p: sha256(p) for R in Rs for p in (R["sft"], R["reward_model"])}
    todo = []
    for R in Rs:
        prompts = os.path.join(R["task"], "prompts_eval.jsonl")
        todo += [(R["prefix"] + "ref", None, {"k": cfg.eval_k, "prompts": prompts}, R)]
        todo += [(*run, R) for run in sweep(cfg, R)]
    t0, trained, spent = time.time(), 0, 0.0
    for i, (name, stage, c, R) in enumerate(todo):
        # run.json: what the run was made from (its config, π_ref's and r_φ's sha256, whether it
        # is a learning curve) and whether it finished
        out = os.path.join(cfg.out_dir, name)
        uses_rm = stage in (ppo, online_dpo) and c.reward == "model"
        curve = is_curve(cfg, stage, c)
        rec = {"stage": stage.__name__ if stage else "evaluate",
               "config": asdict(c) if stage else c,
               "sft_sha256": sha[R["sft"]],
               **({"reward_model_sha256": sha[R["reward_model"]]} if uses_rm else {}),
               **({"curve_points": cfg.curve_points} if curve else {})}
        saved = json.loads(Path(out, "run.json").read_text()) if os.path.exists(f"{out}/run.json") \
            else {}
        if main_decides(saved.get("run") == rec and saved["finished"]
                        and os.path.exists(f"{out}/eval.json"), d):
            say(f"[{i + 1}/{len(todo)}] {name}: eval.json exists with the same config and inputs: "
                "skipped")
            continue
        # this run, interrupted: resume; anything else: start over
        resume = main_decides(saved.get("run") == rec, d)
        what = ("π_ref against itself" if stage is None else
                f"dpo.main, β {c.beta:g}, {c.steps} steps, seed {c.seed}" if stage is dpo else
                f"online_dpo.main, β {c.beta:g}, {c.iterations} rounds, seed {c.seed}"
                if stage is online_dpo else
                f"ppo.main, {'r_φ' if uses_rm else 'the true reward'}, KL coef {c.kl_coef:g}, "
                f"{c.iterations} iterations, seed {c.seed}")
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
        elif curve:
            train_in_chunks(stage, c, cfg.curve_points, d, resume)
        else:
            stage.main(replace(c, resume=resume))
        wall = time.time() - t1
        trained, spent = trained + (stage is not None), spent + wall * (stage is not None)
        if d.is_main:
            atomic_write_json(f"{out}/run.json", {"run": rec, "finished": True, "wall_s": wall})
        left = sum(1 for r in todo[i + 1:] if r[1] is not None)
        say(f"[{i + 1}/{len(todo)}] {name} done in {fmt_duration(wall)} | sweep "
            f"{fmt_duration(time.time() - t0)} so far"
            + (f", about {fmt_duration(spent / trained * left)} to go" if left and trained else ""))
    rows, curves = [], []
    read = lambda name, f: json.loads(Path(cfg.out_dir, name, f).read_text())  # noqa: E731
    for name, stage, c, R in todo if d.is_main else ():
        ev, run = read(name, "eval.json"), read(name, "run.json")
        rows.append(dict(run=name, regime=R["regime"], method=method_of(stage, c),
                         beta=c.beta if stage in (dpo, online_dpo) else "",
                         kl_coef=c.kl_coef if stage is ppo else "",
                         seed=c.seed if stage else "", **ev_fields(ev), wall_s=run.get("wall_s")))
        if is_curve(cfg, stage, c):
            curves += curve_rows(name, stage, c, read("ref", "eval.json"), read(name, "curve.json"))
    return rows, curves


# -----------------------------------------------------------------------------
# Tables


def write_csv(path, rows):
    with open(path + ".tmp", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    os.replace(path + ".tmp", path)


def settings(rows):
    """The runs grouped by (method, β or KL coef), in sweep order: {key: [row per seed]}."""
    groups = {}
    for r in rows:
        setting = r["beta"] if r["method"] in ("DPO", "online DPO") else r["kl_coef"]
        groups.setdefault((r["method"], setting), []).append(r)
    return groups


def regime_title(regime, cfg):
    """'' for a sweep of the default regime alone; else the regime and its rule (task.REGIMES)."""
    if cfg.regimes.strip() == "default":
        return ""
    return f" (regime {regime}: {task.REGIMES[regime]})"


def frontier_markdown(rows, cfg):
    """One regime's frontier table (rows: its runs, π_ref's first)."""
    groups = settings(rows)
    stat = lambda rs, k: mean_se([r[k] for r in rs])  # noqa: E731
    beyond = any(r["beyond_pool"] is not None for r in rows)
    body = []
    for (method, setting), rs in groups.items():
        seeds = "–" if method == "π_ref" else len(rs)
        body.append([method, setting, seeds, pm(*stat(rs, "kl"), ".3f"),
                     pm(*stat(rs, "true_reward")), pm(*stat(rs, "win_rate"), ".3f"),
                     pm(*stat(rs, "eos_rate"), ".3f"), pm(*stat(rs, "response_len"), ".1f"),
                     pm(*stat(rs, "true_reward_finished"))]
                    + ([pm(*stat(rs, "beyond_pool"), ".3f")] if beyond else [])
                    + [fmt_duration(sum(r["wall_s"] or 0 for r in rs) / len(rs))])
    ref = rows[0]
    md = table(["method", "β / KL coef", "seeds", "KL(π‖π_ref) nats", "true reward",
                "win rate vs π_ref", "EOS rate", "response tokens", "reward if finished"]
               + (["beyond pool best"] if beyond else []) + ["wall per run"], body)
    pool = (f"Beyond pool best: the share of completions whose true reward exceeds "
            f"{ref['pool_best']:+g}, the best of any response in the training pairs (behaviour "
            "the pairs never showed). " if beyond else "")
    return (f"## The frontier{regime_title(ref['regime'], cfg)}: true reward against "
            "KL(π‖π_ref), as Figure 2 of the DPO paper\n\n"
            f"{md}\n\n{pool}Every setting trained once per seed ({cfg.seeds}: the stages' `seed`, "
            "data order and sampling; π_ref, r_φ and the reference cache shared). Each cell: mean "
            "over the seeds ± standard error across seeds (n − 1 in the variance), so the ± holds "
            "training and evaluation noise together; frontier.csv keeps one row per seed. Each "
            f"policy sampled {cfg.eval_k} completions of every held-out prompt "
            f"({ref['n_completions']} in all, temperature 1), scored by evaluate.py's one rule. "
            "KL: their mean Σ_t log π − log π_ref, with the training log-prob function; true "
            "reward: the task's hidden reward; win rate: against π_ref's completions of the same "
            "prompts, ties half; EOS rate: the share of completions that ended; response tokens: "
            "their mean length; reward if finished: the mean true reward of those that ended (a "
            "gap to the true reward shows length gaming). The π_ref row is one evaluation of π_ref "
            "against a second copy of itself (no training seed; its sampling s.e. is "
            f"{ref['true_reward_se']:.3f}). Determinism: a run repeats exactly (the same numbers) "
            f"on the same CPU with the same thread count ({torch.get_num_threads()} here); another "
            "thread count or CPU changes the order of floating-point sums and, through sampling, "
            "the run: the spread across seeds is the scale of that difference. Wall time: "
            "training and evaluation, mean per run.")


def matched_kl_markdown(rows, cfg):
    """One regime's methods at --match_kls, each read off its mean curve (at_kl)."""
    groups = settings(rows)
    methods = [m for m in ("DPO", "online DPO", "PPO", "PPO-GT") if any(k[0] == m for k in groups)]
    curve = {m: [[(r["kl"], r["true_reward"]) for r in rs] for (g, _), rs in groups.items()
                 if g == m] for m in methods}
    body = []
    for x in floats(cfg.match_kls):
        got = {m: at_kl(curve[m], x) for m in methods}
        diff = "–"
        if got.get("DPO") and got.get("PPO"):
            diff = pm(got["DPO"][0] - got["PPO"][0], math.hypot(got["DPO"][1], got["PPO"][1]))
        body.append([f"{x:g}"] + [pm(*got[m]) if got[m] else "–" for m in methods] + [diff])
    kl = {m: [mean_se([k for k, _ in s])[0] for s in curve[m]] for m in methods}
    ranges = "; ".join(f"{m} {min(kl[m]):.2f} to {max(kl[m]):.2f}" for m in methods)
    md = table(["KL(π‖π_ref) nats"] + [f"{m} true reward" for m in methods] + ["DPO − PPO"], body)
    return (f"## At matched KL{regime_title(rows[0]['regime'], cfg)}: true reward read off each "
            f"method's frontier\n\n{md}\n\nEach "
            "method's mean curve (its settings' mean points over seeds, joined in order of KL) "
            "read linearly between the two settings that bracket the KL. ± is the standard error "
            "by the delta method: the bracketing settings' per-seed values of (reward − slope × "
            "KL), their standard error across seeds, weighted by the interpolation weights, so "
            "the KL's own spread counts. –: outside the method's measured range of mean KL "
            f"({ranges} nats), where nothing was measured. DPO − PPO: the difference, the errors "
            "added in quadrature (independent runs).")


def curves_markdown(curves, cfg):
    body = [[r["method"], r["step"], f"{r['responses']:,}", f"{r['flops']:.3g}",
             f"{r['kl']:.3f}", pm(r["true_reward"], r["true_reward_se"]),
             pm(r["eos_rate"], None, ".3f"),
             pm(r["response_len"], None, ".1f")] for r in curves]
    md = table(["method", "step", "responses", "loop FLOPs", "KL(π‖π_ref) nats", "true reward",
                "EOS rate", "response tokens"], body)
    runs = ", ".join(sorted({r["run"] for r in curves}))
    return (f"## Learning curves: one run of each method ({runs})\n\n{md}\n\nThe run trained "
            f"in {cfg.curve_points} chunks (`--stop_after`; the stages resume exactly, so this is "
            "the uninterrupted run) and its checkpoint evaluated after each by the same "
            "evaluation as the frontier; step 0 is π_ref, the last point the run's eval.json. One "
            "seed: ± is the evaluation's sampling error only (its completions counted as "
            "independent). Budget, in responses that carried a "
            "preference signal into training: DPO, 2 labelled responses per pair (2 × batch per "
            "step, repeats counted); PPO, 1 rollout scored by r_φ per prompt (rollout batch per "
            "iteration), on top of the labelled pairs r_φ was trained on once before. Loop FLOPs: "
            "the loop's model FLOPs as it counted them (meter.model_flops of its real tokens, "
            "padding not counted), cumulative; the one-time precompute (DPO) and r_φ's training "
            "(PPO) are in the cost tables, not here.")


def write_tables(rows, curves, cfg):
    """frontier.csv, curves.csv, frontier.md and, if matplotlib is installed, frontier.png and
    curves.png; returns the markdown, and its parts for RESULTS.md: {"frontier": the frontier and
    matched-KL tables, "curves": the learning curves' (if any)}."""
    write_csv(f"{cfg.out_dir}/frontier.csv", rows)
    by_regime = {}
    for r in rows:
        by_regime.setdefault(r["regime"], []).append(r)
    parts = [f(rs, cfg) for rs in by_regime.values()
             for f in (frontier_markdown, matched_kl_markdown)]
    rows = next(iter(by_regime.values()))  # the plot: the first regime's frontier
    sections = {"frontier": "\n\n".join(parts)}
    if curves:
        write_csv(f"{cfg.out_dir}/curves.csv", curves)
        parts.append(sections.setdefault("curves", curves_markdown(curves, cfg)))
    md = "\n\n".join(parts)
    atomic_write_text(f"{cfg.out_dir}/frontier.md", md + "\n")
    try:  # the plots are optional: nothing else needs matplotlib
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return md + "\n\n(no frontier.png, curves.png: matplotlib is not installed)", sections
    fig, ax = plt.subplots(figsize=(6, 4))
    for method, marker in zip(("π_ref", "DPO", "PPO", "PPO-GT"), "*os^"):
        pts = sorted((mean_se([r["kl"] for r in rs]), mean_se([r["true_reward"] for r in rs]))
                     for (m, _), rs in settings(rows).items() if m == method)
        if pts:  # a method's settings joined in order of KL: its frontier, ± across seeds
            (x, xe), (y, ye) = zip(*[p[0] for p in pts]), zip(*[p[1] for p in pts])
            ax.errorbar(x, y, xerr=xe, yerr=ye, fmt=marker + "-", capsize=2, label=method)
    ax.set(xlabel="KL(π‖π_ref), nats per completion", ylabel="true reward",
           title="held-out prompts, mean ± s.e. over seeds")
    ax.legend()
    fig.tight_layout()
    fig.savefig(f"{cfg.out_dir}/frontier.png", dpi=120)
    plt.close(fig)
    if curves:
        fig, axes = plt.subplots(2, 2, figsize=(10, 7))
        for col, xk in enumerate(("responses", "flops")):
            for row, yk in enumerate(("true_reward", "kl")):
                for run in sorted({r["run"] for r in curves}):
                    rs = [r for r in curves if r["run"] == run]
                    axes[row][col].plot([r[xk] for r in rs], [r[yk] for r in rs], "o-", label=run)
                axes[row][col].set(xlabel={"responses": "responses labelled (DPO) or scored (PPO)",
                                           "flops": "loop FLOPs"}[xk], ylabel=yk)
        axes[0][0].legend()
        fig.tight_layout()
        fig.savefig(f"{cfg.out_dir}/curves.png", dpi=120)
        plt.close(fig)
    return md, sections


def command(cfg, script="-m study.compare"):
    """script with the flags that differ from cfg's defaults: the command that reproduces the
    tables."""
    return " ".join([script] + flags(cfg))


def section_name(cfg, part):
    """RESULTS.md's section for part ("frontier", "curves" or "costs") of this command's tables."""
    if part == "frontier" or cfg.section == Config.section:
        return cfg.section if part == "frontier" else part
    return f"{cfg.section}_{part}"


def main(cfg):
    d = init_distributed()
    say = lambda *a: print(*a, flush=True) if d.is_main else None  # noqa: E731  rank 0 speaks
    check(cfg.time_steps >= 2,
          "--time_steps must be >= 2: the first step of a timed run warms up and is dropped")
    t0, t = time.time(), lambda f: os.path.join(cfg.task, f)
    Rs = regimes(cfg)
    # the earlier stages, shared by every run: built once, with their defaults, when missing
    require_task({t(f): os.path.join(Config.task, f) for f in (
        "pairs_train.jsonl", "pairs_val.jsonl", "prompts_train.jsonl", "prompts_eval.jsonl")},
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
    os.makedirs(cfg.out_dir, exist_ok=True)
    sections = {}  # RESULTS.md's: the tables this command made (not an earlier run's in out_dir)
    if cfg.frontier:
        for R in Rs:  # another regime's own task, π_ref, r_φ and cache
            build_regime(R, cfg, d, say)
        rows, curves = frontier(cfg, Rs, d, say)
        if d.is_main:
            md, parts = write_tables(rows, curves, cfg)
            sections.update(parts)
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
