"""Why DPO at β 1 and 2 stops ending its completions, and what an NLL term on the chosen response
does about it.

    python -m study.eos      # 2 β x 2 α x 3 seeds of dpo.py on the built-in task: about 15 min on
                             # 2 CPU cores; resumable run by run; writes the section "eos" of
                             # RESULTS.md (--results "": not)

Each run is `python dpo.py --beta B --rpo_alpha A --seed S` (defaults otherwise: lr 1e-3, 200 steps;
the seed orders the data). Read per run: evaluate.py's EOS rate, length (tokens) and true reward on
the held-out prompts; dpo.py's logps/chosen and logps/rejected (the batch's mean summed log-prob)
at the first and the last step; and after training, on the val pairs, the mean log π(EOS) at the
end of each chosen response that ends (EOS kept), under π and under π_ref. Likelihood displacement
(Razin et al. 2024) shows as both log-probs falling while the margin grows, the probability mass
going to tokens neither response holds, and EOS is one of them. The NLL term (`--rpo_alpha`, Pang
et al. 2024) holds log π(y_w) up, EOS included.
"""
import json
import math
import os
import statistics
import time
from dataclasses import dataclass, replace

import torch

import data
import dpo
from checkpoint import tokenizer_beside
from model import IGNORE, last_index, load_model, sequence_logprobs
from plumbing import parse_config
from study.results import flags, write_section


@dataclass
class Config:
    betas: str = "1,2"  # the β where DPO lost EOS (README's figure)
    alphas: str = "0,1"  # rpo_alpha: 0 is plain DPO; 1 is Pang et al.'s α
    seeds: str = "1337,1338,1339"  # dpo.py's --seed (data order), 3 per point
    out_dir: str = "out/study-eos"  # a run per subfolder; a finished one is read, not rerun
    # r_φ, read by each run's evaluation only (its score beside the true reward); missing: none
    reward_model: str = "out/reward/model.safetensors"
    results: str = "RESULTS.md"  # its section "eos" gets the table ("": none)


@torch.no_grad()
def eos_logprob(model_path, pairs_path, tok, cfg):
    """Mean log π(EOS | x, y_w without its EOS) over the chosen responses of pairs_path that keep
    their EOS after truncation, and how many there were."""
    model = load_model(model_path)[0].eval()
    examples, _ = data.tokenize_pairs(tok, data.read_pairs(pairs_path), cfg.max_len,
                                      cfg.max_prompt_len)
    total, n = 0.0, 0
    for i in range(0, len(examples), 64):
        b = data.collate_pairs(examples[i:i + 64], tok.pad)
        y = b["targets"][:len(b["targets"]) // 2]  # the chosen rows
        lp = sequence_logprobs(model, b["input_ids"], b["targets"])[:len(y)]
        last = last_index(y != IGNORE)  # each chosen row's last target: EOS, if it kept it
        rows = torch.arange(len(y))
        ends = y[rows, last] == tok.eos
        total, n = total + lp[rows, last][ends].sum().item(), n + int(ends.sum())
    return total / n, n


def run(beta, alpha, seed, cfg, base):
    """One dpo.py run (base, dpo.py's defaults unless a test passes its own, with these three
    flags), or its finished folder; returns its row of numbers."""
    out = os.path.join(cfg.out_dir, f"beta{beta:g}-alpha{alpha:g}-seed{seed}")
    dcfg = replace(base, out_dir=out, beta=beta, rpo_alpha=alpha, seed=seed,
                   reward_model=cfg.reward_model if os.path.exists(cfg.reward_model) else "")
    if not os.path.exists(os.path.join(out, "eval.json")):
        dpo.main(dcfg)
    with open(os.path.join(out, "eval.json")) as f:
        ev = json.load(f)
    with open(os.path.join(out, "metrics.jsonl")) as f:
        steps = [json.loads(line) for line in f]
    tok = data.load_tokenizer(os.path.join(out, "tokenizer.json"))
    eos, n = eos_logprob(os.path.join(out, "model.safetensors"), dcfg.val_pairs, tok, dcfg)
    return {"eos_rate": ev["eos_rate"], "length": ev["response_len"],
            "true_reward": ev["true_reward"], "kl": ev["kl"], "in_language": ev["in_language"],
            "rm": ev.get("reward_model_score"),
            "chosen_first": steps[0]["logps/chosen"], "chosen_last": steps[-1]["logps/chosen"],
            "rejected_first": steps[0]["logps/rejected"],
            "rejected_last": steps[-1]["logps/rejected"], "eos": eos, "eos_n": n}


def mean_se(xs):
    m = statistics.fmean(xs)
    return m, (statistics.stdev(xs) / math.sqrt(len(xs)) if len(xs) > 1 else 0.0)


def fmt(xs, digits=2):
    m, se = mean_se(xs)
    return f"{m:.{digits}f} ± {se:.{digits}f}"


def main(cfg, base=dpo.Config()):
    t0 = time.time()
    seeds = [int(s) for s in cfg.seeds.split(",")]
    rows = ["| β | rpo_alpha | EOS rate | length (tokens) | true reward | in language | r_φ "
            "score | KL (nats) | logps/chosen, step 1 → last | logps/rejected, step 1 → last | "
            "log π(EOS) |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for beta in map(float, cfg.betas.split(",")):
        for alpha in map(float, cfg.alphas.split(",")):
            r = [run(beta, alpha, s, cfg, base) for s in seeds]
            col = lambda k: [x[k] for x in r]  # noqa: E731
            rows.append(f"| {beta:g} | {alpha:g} | {fmt(col('eos_rate'))} | "
                        f"{fmt(col('length'), 1)} | {fmt(col('true_reward'))} | "
                        f"{fmt(col('in_language'))} | "
                        + (fmt(col("rm")) if None not in col("rm") else "–") + " | "
                        f"{fmt(col('kl'), 1)} | {fmt(col('chosen_first'), 1)} → "
                        f"{fmt(col('chosen_last'), 1)} | {fmt(col('rejected_first'), 1)} → "
                        f"{fmt(col('rejected_last'), 1)} | {fmt(col('eos'))} |")
            print(rows[-1], flush=True)
    tok = data.load_tokenizer(tokenizer_beside(base.ref_model))  # built by the first run if missing
    ref_eos, n_ref = eos_logprob(base.ref_model, base.val_pairs, tok, base)
    text = "\n".join(
        rows + ["", f"Mean ± standard error over {len(seeds)} seeds (dpo.py's --seed: data order; "
                f"π_ref and the task fixed), lr 1e-3, 200 steps. EOS rate, length, true reward and "
                f"KL: evaluate.py on the held-out prompts (a completion without EOS scores −1 and "
                f"is cut at the block); in language: the share of completions that ended and are "
                f"texts of the task's language; r_φ score: the reward model's mean score of them "
                f"(–: no r_φ). logps: the training batch's mean summed log-prob of the "
                f"chosen and the rejected responses, at step 1 (π = π_ref) and at the last step. "
                f"log π(EOS): the mean log-prob of EOS at the end of the {r[0]['eos_n']} chosen "
                f"val responses that keep it; π_ref gives {ref_eos:.2f} over {n_ref}."])
    print(text)
    command = " ".join(["python -m study.eos"] + flags(cfg))
    if write_section(cfg.results, "eos", text, command, time.time() - t0, "cpu"):
        print(f"wrote the section eos of {cfg.results}")


if __name__ == "__main__":
    main(parse_config(Config, doc=__doc__))
