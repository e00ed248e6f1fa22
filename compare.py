"""PPO and DPO side by side: what leaves the cluster when DPO replaces PPO, in measured numbers.

    python compare.py                          # the frontier sweep, then the costs (~10 min on 2 CPU cores)
    torchrun --nproc_per_node=8 compare.py     # the same, every run on 8 ranks (plain DDP, as the stages)
    python compare.py --betas 0.01,0.03,0.1,0.3,1,3 --kl_coefs 0.005,0.02,0.05,0.2,0.5 --dpo_steps 300
    python compare.py --no-costs               # the frontier only (--no-frontier: the costs only)
    python compare.py --help                   # every flag

1. The frontier (Figure 2 of Rafailov et al. 2023): DPO at several β, PPO at several KL coefficients with r_φ
   as its reward and, as the paper's PPO-GT, with the hidden true reward; all from the same π_ref, pairs and
   prompts, each run by dpo.main / ppo.main in its own folder out/compare/<run>/ and scored by the evaluation
   both share (evaluate.evaluate_policy): true reward, KL(π‖π_ref), win rate against π_ref. A run whose
   eval.json exists with the same config and inputs is skipped, so an interrupted sweep resumes.
   Writes frontier.csv, frontier.md (+ frontier.png if matplotlib is installed).
2. The costs at π_ref's size: the models each job holds and their bytes, the FLOPs of each phase, the wall
   time of the real loops (in interleaved rounds: a busy machine slows every job alike, so the ratios hold),
   the one-time precompute and its payback; then the same analytic functions, checked here against the
   tensors' bytes and torch's FLOP counter, for a Llama-2-7B-sized GPT on 8 GPUs. Writes costs.md and
   costs.json; summary.md collects both under the command that made them.
Missing earlier stages (task, sft, reward model, reference cache) are built once with their defaults.
"""
import csv
import json
import os
import shlex
import time
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path

import torch

import costs
import data
import dpo
import ppo
import precompute
import reward
import sft
from costs import table
from evaluate import evaluate_policy
from model import load_model
from plumbing import (atomic_write_json, barrier, check, checkpoint_state, fmt_duration, init_distributed, main_decides,
                      parse_config, require_stage, teardown)


@dataclass
class Config:
    out_dir: str = "out/compare"  # tables, plot, and one folder per run of the sweep
    task: str = "out/task"  # pairs_{train,val}.jsonl, prompts_{train,eval}.jsonl; built if missing
    sft: str = "out/sft/model.safetensors"  # π_ref, shared by every run; built by sft.py if missing
    reward_model: str = "out/reward/model.safetensors"  # r_φ for PPO; built by reward.py if missing
    ref_logps: str = "out/ref_logps"  # DPO's cache of log π_ref; built by precompute.py if missing
    betas: str = "0.03,0.1,0.3,1,3"  # DPO runs: one per β, comma-separated
    kl_coefs: str = "0.01,0.03,0.1,0.3,1"  # PPO runs with r_φ: one per KL coefficient
    true_kl_coefs: str = "0.01,0.3"  # PPO-GT runs (--reward true): one per KL coefficient ("" = none)
    dpo_steps: int = dpo.Config.steps  # optimizer steps of each DPO run
    ppo_iterations: int = ppo.Config.iterations  # iterations of each PPO run
    eval_k: int = dpo.Config.eval_k  # completions per held-out prompt, every run and π_ref alike
    frontier: bool = True  # train the sweep, write frontier.*
    costs: bool = True  # measure the costs, write costs.*
    rounds: int = 3  # interleaved timing rounds, each: PPO, DPO live, DPO cached, precompute
    time_steps: int = 4  # iterations (PPO) or steps (DPO) per timed run; the first warms up, not counted


# -----------------------------------------------------------------------------
# The frontier


def sweep(cfg):
    """The runs: (name, stage, its Config), all from the same π_ref, pairs and prompts."""
    t, o = (lambda f: os.path.join(cfg.task, f)), (lambda name: os.path.join(cfg.out_dir, name))
    floats = lambda s: [float(v) for v in s.split(",") if v.strip()]  # noqa: E731
    runs = [(f"dpo-beta{b:g}", dpo, dpo.Config(
        out_dir=o(f"dpo-beta{b:g}"), ref_model=cfg.sft, train_pairs=t("pairs_train.jsonl"), val_pairs=t("pairs_val.jsonl"),
        eval_prompts=t("prompts_eval.jsonl"), ref_logps=cfg.ref_logps, beta=b, steps=cfg.dpo_steps, eval_k=cfg.eval_k))
        for b in floats(cfg.betas)]
    for rw, coefs, tag in (("model", cfg.kl_coefs, "ppo"), ("true", cfg.true_kl_coefs, "ppo-true")):
        runs += [(f"{tag}-kl{k:g}", ppo, ppo.Config(
            out_dir=o(f"{tag}-kl{k:g}"), sft=cfg.sft, reward_model=cfg.reward_model, prompts=t("prompts_train.jsonl"),
            eval_prompts=t("prompts_eval.jsonl"), reward=rw, kl_coef=k, iterations=cfg.ppo_iterations, eval_k=cfg.eval_k))
            for k in floats(coefs)]
    return runs


def evaluate_reference(cfg, d):
    """π_ref against a second copy of itself through the same evaluation, with DPO's seed: the frontier's
    origin (KL 0; win rate 1/2 up to sampling error)."""
    tok = data.load_tokenizer(precompute.tokenizer_path(cfg.sft))
    ref, ref2 = load_model(cfg.sft, d.device)[0], load_model(cfg.sft, d.device)[0]
    res = evaluate_policy(ref, ref2, tok, data.read_prompts(os.path.join(cfg.task, "prompts_eval.jsonl")), d, k=cfg.eval_k)
    if d.is_main:
        atomic_write_json(os.path.join(cfg.out_dir, "ref", "eval.json"), res)


def frontier(cfg, d, say):
    """Train every run not already done; then, on rank 0, one row per run from its eval.json."""
    sha = {p: precompute.sha256(p) for p in (cfg.sft, cfg.reward_model)}
    todo = [("ref", None, {"k": cfg.eval_k, "prompts": os.path.join(cfg.task, "prompts_eval.jsonl")})] + sweep(cfg)
    t0, trained, spent = time.time(), 0, 0.0
    for i, (name, stage, c) in enumerate(todo):
        # run.json: what the run was made from (its config, π_ref's and r_φ's sha256) and whether it finished
        out, uses_rm = os.path.join(cfg.out_dir, name), stage is ppo and c.reward == "model"
        rec = {"stage": stage.__name__ if stage else "evaluate", "config": asdict(c) if stage else c,
               "sft_sha256": sha[cfg.sft], **({"reward_model_sha256": sha[cfg.reward_model]} if uses_rm else {})}
        saved = json.loads(Path(out, "run.json").read_text()) if os.path.exists(f"{out}/run.json") else {}
        if main_decides(saved.get("run") == rec and saved["finished"] and os.path.exists(f"{out}/eval.json"), d):
            say(f"[{i + 1}/{len(todo)}] {name}: eval.json exists with the same config and inputs: skipped")
            continue
        resume = main_decides(saved.get("run") == rec, d)  # this run, interrupted: resume; anything else: start over
        what = ("π_ref against itself" if stage is None else f"dpo.main, β {c.beta:g}, {c.steps} steps" if stage is dpo else
                f"ppo.main, {'r_φ' if uses_rm else 'the true reward'}, KL coef {c.kl_coef:g}, {c.iterations} iterations")
        say(f"[{i + 1}/{len(todo)}] {name}: {what}" + (" (resuming)" if resume and checkpoint_state(f"{out}/ckpt") else ""))
        if d.is_main:
            os.makedirs(out, exist_ok=True)
            atomic_write_json(f"{out}/run.json", {"run": rec, "finished": False})
        barrier(d)
        t1 = time.time()
        evaluate_reference(cfg, d) if stage is None else stage.main(replace(c, resume=resume))
        wall = time.time() - t1
        trained, spent = trained + (stage is not None), spent + wall * (stage is not None)
        if d.is_main:
            atomic_write_json(f"{out}/run.json", {"run": rec, "finished": True, "wall_s": wall})
        left = sum(1 for r in todo[i + 1:] if r[1] is not None)
        say(f"[{i + 1}/{len(todo)}] {name} done in {fmt_duration(wall)} | sweep {fmt_duration(time.time() - t0)} so far"
            + (f", about {fmt_duration(spent / trained * left)} to go" if left and trained else ""))
    rows = []
    for name, stage, c in todo if d.is_main else ():
        ev, run = (json.loads(Path(cfg.out_dir, name, f).read_text()) for f in ("eval.json", "run.json"))
        method = "π_ref" if stage is None else "DPO" if stage is dpo else "PPO" if c.reward == "model" else "PPO-GT"
        rows.append(dict(run=name, method=method, beta=c.beta if stage is dpo else "", kl_coef=c.kl_coef if stage is ppo else "",
                         kl=ev["kl"], true_reward=ev["true_reward"], win_rate=ev["win_rate"],
                         true_reward_se=ev["true_reward_std"] / ev["n_completions"] ** 0.5,  # standard error of the mean
                         ref_true_reward=ev["ref_true_reward"], n_completions=ev["n_completions"], wall_s=run.get("wall_s")))
    return rows


def write_frontier(rows, cfg):
    """frontier.csv, frontier.md and, if matplotlib is installed, frontier.png; returns the markdown."""
    with open(f"{cfg.out_dir}/frontier.csv.tmp", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    os.replace(f"{cfg.out_dir}/frontier.csv.tmp", f"{cfg.out_dir}/frontier.csv")
    md = table(["run", "method", "β / KL coef", "KL(π‖π_ref) nats", "true reward ± s.e.", "win rate vs π_ref", "wall time"],
               [[r["run"], r["method"], r["beta"] if r["method"] == "DPO" else r["kl_coef"], f"{r['kl']:.3f}",
                 f"{r['true_reward']:+.3f} ± {r['true_reward_se']:.3f}", f"{r['win_rate']:.3f}",
                 fmt_duration(r["wall_s"]) if r["wall_s"] is not None else "–"] for r in rows])
    md = (f"## The frontier: true reward against KL(π‖π_ref), as Figure 2 of the DPO paper\n\n{md}\n\nEach policy sampled "
          f"{cfg.eval_k} completions of every held-out prompt ({rows[0]['n_completions']} in all, temperature 1). KL: their "
          "mean Σ_t log π − log π_ref, with the training log-prob function; true reward: the task's hidden reward, mean ± "
          "standard error; win rate: against π_ref's completions of the same prompts, ties half. The π_ref row is π_ref "
          "against a second copy of itself. Wall time: training and evaluation of the run.")
    with open(f"{cfg.out_dir}/frontier.md", "w") as f:
        f.write(md + "\n")
    try:  # the plot is optional: nothing else needs matplotlib
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return md + "\n\n(no frontier.png: matplotlib is not installed)"
    fig, ax = plt.subplots(figsize=(6, 4))
    for method, marker in (("π_ref", "*"), ("DPO", "o"), ("PPO", "s"), ("PPO-GT", "^")):
        rs = sorted((r for r in rows if r["method"] == method), key=lambda r: r["kl"])
        if rs:  # a method's runs joined in order of KL: its frontier
            ax.errorbar([r["kl"] for r in rs], [r["true_reward"] for r in rs], yerr=[r["true_reward_se"] for r in rs],
                        fmt=marker + "-", capsize=2, label=method)
    ax.set(xlabel="KL(π‖π_ref), nats per completion", ylabel="true reward", title="true reward against KL, held-out prompts")
    ax.legend()
    fig.tight_layout()
    fig.savefig(f"{cfg.out_dir}/frontier.png", dpi=120)
    plt.close(fig)
    return md


def command(cfg):
    """compare.py with the flags that differ from the defaults: the command that reproduces the tables."""
    flag = lambda f, v: (f"--{'' if v else 'no-'}{f.name}" if isinstance(v, bool)  # noqa: E731
                         else f"--{f.name} {shlex.quote(str(v))}")
    return " ".join(["compare.py"] + [flag(f, getattr(cfg, f.name)) for f in fields(cfg) if getattr(cfg, f.name) != f.default])


def main(cfg):
    d = init_distributed()
    say = lambda *a: print(*a, flush=True) if d.is_main else None  # noqa: E731  rank 0 speaks
    check(cfg.time_steps >= 2, "--time_steps must be >= 2: the first step of a timed run warms up and is dropped")
    t0, t = time.time(), lambda f: os.path.join(cfg.task, f)
    # the earlier stages, shared by every run: built once, with their defaults, when missing
    for f in ("pairs_train.jsonl", "pairs_val.jsonl", "prompts_train.jsonl", "prompts_eval.jsonl"):
        require_stage(t(f), os.path.join(Config.task, f), lambda: sft.build_task(d), "python data.py", d, say)
    require_stage(cfg.sft, Config.sft, lambda: (sft.main(sft.Config()), barrier(d)), "python sft.py", d, say)
    require_stage(cfg.reward_model, Config.reward_model, lambda: (reward.main(reward.Config()), barrier(d)),
                  "python reward.py", d, say)
    pc = precompute.Config(out_dir=cfg.ref_logps, ref_model=cfg.sft, train_pairs=t("pairs_train.jsonl"),
                           val_pairs=t("pairs_val.jsonl"))
    for split in ("train", "val"):
        require_stage(f"{cfg.ref_logps}/{split}.safetensors", f"{Config.ref_logps}/{split}.safetensors",
                      lambda: precompute.main(pc), precompute.command(pc), d, say)
    os.makedirs(cfg.out_dir, exist_ok=True)
    if cfg.frontier:
        rows = frontier(cfg, d, say)
        if d.is_main:
            say(write_frontier(rows, cfg) + f"\nwrote {cfg.out_dir}/frontier.csv and frontier.md")
    if cfg.costs:
        res = costs.costs(cfg, d, say)
        if d.is_main:
            atomic_write_json(f"{cfg.out_dir}/costs.json", res)
            with open(f"{cfg.out_dir}/costs.md", "w") as f:
                f.write(costs.costs_markdown(res, cfg) + "\n")
            say(costs.costs_markdown(res, cfg) + f"\nwrote {cfg.out_dir}/costs.md and costs.json")
    if d.is_main:
        parts = [Path(cfg.out_dir, n).read_text() for n in ("frontier.md", "costs.md") if os.path.exists(f"{cfg.out_dir}/{n}")]
        cmd = (f"torchrun --nproc_per_node={d.world} " if d.world > 1 else "python ") + command(cfg)
        with open(f"{cfg.out_dir}/summary.md", "w") as f:
            f.write(f"# PPO against DPO, measured\n\nProduced by `{cmd}` in {fmt_duration(time.time() - t0)} on "
                    f"{d.world} × {d.device} ({torch.get_num_threads()} threads per rank).\n\n" + "\n\n".join(parts))
        say(f"wrote {cfg.out_dir}/summary.md; compare.py took {fmt_duration(time.time() - t0)}")
    teardown(d)


if __name__ == "__main__":
    main(parse_config(Config, doc=__doc__))
