"""Iterative DPO: offline DPO in rounds, each on fresh pairs that the last round's policy sampled.

    python iterative_dpo.py                        # 4 rounds of 1,000 pairs; builds sft if missing
    torchrun --nproc_per_node=8 iterative_dpo.py   # each rank samples its share; dpo.py on DDP
    python iterative_dpo.py --help                 # every flag, e.g. --rounds 2 --pairs 2000

The middle ground between dpo.py and online_dpo.py (the rounds of Xiong et al. 2024, "Iterative
Preference Learning from Human Feedback", and of Dong et al. 2024, "RLHF Workflow"). Each round:
  1. sample: two completions of each of its prompts from the current policy (π_ref in round 1);
  2. label: the hidden reward's Bradley-Terry draw (task.bradley_terry), the labeller of the
     offline pool, standing in for a round of human labels;
  3. precompute: precompute.py's cache of log π_ref on the round's pairs, once per round;
  4. train: dpo.py, unchanged, on the round's pairs: the policy starts where the last round ended
     (--init), the reference is still π_ref, and its NLL term (--rpo_alpha 1) keeps EOS.
What it buys back from online DPO: pairs from the policy being trained, at most a round old.
What it keeps from offline DPO: the training job is dpo.py's, one model and a file. Sampling runs
between rounds, as a batch job, so there is no rollout engine beside the trainer, no reward service
and no weight broadcast after every step. The label budget is --rounds × --pairs (4 × 1,000: the
offline pool's 4,000), and so is the step budget (4 × 50 steps: dpo.py's 200).
Writes out/iterative_dpo/: round<k>/ (pairs.jsonl, ref_logps/, dpo/ with that round's policy),
model.safetensors (+ tokenizer.json, the last round's), eval.json (its evaluation and the rounds').
"""
import json
import os
import re
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.distributed as dist

import data
import dpo
import precompute
import sft
import task
from checkpoint import (atomic_copy, atomic_write_json, input_fingerprint, prepare_outputs,
                        same_run, tokenizer_beside)
from evaluate import score_completions
from model import generate, load_model
from plumbing import (SEED_STRIDE, Logger, atomic_write_text, barrier, check, init_distributed,
                      parse_config, require_stage, teardown)

# ==== config


@dataclass
class Config:
    out_dir: str = "out/iterative_dpo"  # this stage's folder: one folder per round, the policy
    sft: str = "out/sft/model.safetensors"  # π_ref: round 1 samples from it; the reference always
    prompts: str = "out/task/prompts_train.jsonl"  # the rounds' prompts: the built-in task's
    val_pairs: str = "out/task/pairs_val.jsonl"  # held-out pairs for dpo.py's val loss, accuracy
    test_prompts: str = "out/task/prompts_test.jsonl"  # held-out prompts for eval.json
    val_prompts: str = ""  # held-out prompts a study selects on, into eval.json's "val" ("": none)
    rounds: int = 4  # sample, label, precompute, train: the label budget is rounds × pairs
    pairs: int = 1000  # labelled pairs per round: 4 × 1,000 is the offline pool's 4,000
    steps: int = 50  # dpo.py steps per round: 3.2 epochs of its pairs, as dpo.py's of the pool
    beta: float = 0.5  # the KL(π‖π_ref) constraint, as dpo.py's
    # dpo.py's NLL term on the chosen response (RPO), every round: it keeps up the chosen
    # responses' EOS, so later rounds' policies still end the completions a pair needs
    rpo_alpha: float = 1.0
    lr: float = 1e-3  # each round's peak learning rate, warmup and cosine (dpo.py's)
    batch_size: int = 64  # pairs per step (dpo.py's)
    micro_batch_size: int = 64  # completions sampled per forward on one rank
    eval_k: int = 4  # completions per held-out prompt in each round's evaluation
    seed: int = 1337  # the rounds' prompt order, sampling, labels and data order
    # skip the rounds out_dir holds for this same config, whatever their --rounds; --no-resume:
    # remove them and start over
    resume: bool = True


# ==== the sampler and the labeller

# Batches of cfg.pairs prompts a round may sample before it gives up. A policy that ends only a
# fraction e of its completions keeps about e² of its pairs: 16 batches cover e down to 1/4.
MAX_BATCHES = 16
# Round r's random streams, each seeded seed + SEED_STRIDE·r + its offset: the prompt order, the
# labels, and batch b's token uniforms at TOKEN_SEEDS[b], the first batch's beside the labels' and
# the later ones past them, so that no two streams share a seed (a batch whose tokens drew the
# labels' uniforms would tie its completions to their labels). All far below SEED_STRIDE.
ORDER_SEED, LABEL_SEED = 0, 2
TOKEN_SEEDS = (1, *range(LABEL_SEED + 1, LABEL_SEED + MAX_BATCHES))


def sample_pairs(policy, tok, prompts, r, cfg, d):
    """Round r's cfg.pairs labelled pairs {"prompt", "chosen", "rejected"} from `policy`, and the
    counts of what was not labelled. The prompts, in an order seeded by (seed, round), are taken
    cfg.pairs at a time, two completions each; completion j of a batch draws its tokens from row j
    of uniforms seeded by (seed, round, batch), and micro-batch k of the rows runs on rank
    k mod world, so any world size samples the same rows in the same micro-batches: the same pairs
    wherever the arithmetic is the same (one thread per rank against one thread). A pair goes to
    the labeller only if both completions ended (EOS), hold some text and differ, as every pair of
    the offline pool does: a cut one would be re-read as ending (data.py adds the EOS), and an
    empty one is refused as data."""
    base = cfg.seed + SEED_STRIDE * r  # round r's streams: base + their offsets
    order = torch.randperm(len(prompts), generator=torch.Generator().manual_seed(
        base + ORDER_SEED)).tolist()
    kept, skipped, b = [], dict(unfinished=0, empty=0, identical=0), 0
    while len(kept) < cfg.pairs:
        check(b < MAX_BATCHES, f"round {r + 1}: {MAX_BATCHES * cfg.pairs} prompts gave only "
              f"{len(kept)} pairs whose completions both ended, hold text and differ (pairs "
              f"skipped: {skipped})" + ("; the policy has stopped ending its completions, "
                                        "which --rpo_alpha 1 prevents" if skipped["unfinished"]
                                        > len(kept) else ""))
        batch = [prompts[order[(b * cfg.pairs + i) % len(order)]] for i in range(cfg.pairs)]
        rows = [data.truncate_prompt(data.encode_prompt(tok, p), policy.config.block_size // 2)
                for p in batch for _ in range(2)]
        n_new = policy.config.block_size - max(map(len, rows))
        U = torch.rand(len(rows), n_new, generator=torch.Generator().manual_seed(
            base + TOKEN_SEEDS[b]))
        mb, out = cfg.micro_batch_size, []
        for j in [list(range(i, min(i + mb, len(rows)))) for i in range(0, len(rows), mb)][
                d.rank::d.world]:  # whole micro-batches to each rank: the same rows on any world
            o = generate(policy, [rows[a] for a in j], n_new, tok.eos, tok.pad,
                         uniforms=U[j].to(d.device))
            texts, ended, _, _ = score_completions(o, [batch[a // 2] for a in j], tok, True, 0.0)
            out += [(a, y, bool(e)) for a, y, e in zip(j, texts, ended)]
        if d.world > 1:  # every rank gets every completion, in the batch's order
            parts = [None] * d.world
            dist.all_gather_object(parts, out)
            out = [row for part in parts for row in part]
        done = dict((a, (y, e)) for a, y, e in out)
        for i, prompt in enumerate(batch):
            (ya, ea), (yb, eb) = done[2 * i], done[2 * i + 1]
            why = ("unfinished" if not (ea and eb) else "empty" if not (ya.strip() and yb.strip())
                   else "identical" if ya.strip() == yb.strip() else None)
            if why:
                skipped[why] += 1
            else:
                kept.append((prompt, ya, yb))
        b += 1
    kept = kept[:cfg.pairs]
    u = torch.rand(len(kept), generator=torch.Generator().manual_seed(
        base + LABEL_SEED)).tolist()
    pairs = []
    for (prompt, ya, yb), ui in zip(kept, u):
        r_a, r_b = task.true_reward(prompt, ya), task.true_reward(prompt, yb)
        a_chosen = task.bradley_terry(ui, r_a, r_b)
        pairs.append(dict(prompt=prompt, chosen=ya if a_chosen else yb,
                          rejected=yb if a_chosen else ya))
    return pairs, dict(labelled=len(pairs), sampled=b * cfg.pairs, **skipped)


# ==== the rounds


def round_configs(cfg, r):
    """Round r's folder, and the precompute.py and dpo.py configs of its cache and its training."""
    folder = os.path.join(cfg.out_dir, f"round{r + 1}")
    pairs = os.path.join(folder, "pairs.jsonl")
    pc = precompute.Config(out_dir=os.path.join(folder, "ref_logps"), ref_model=cfg.sft,
                           train_pairs=pairs, val_pairs=cfg.val_pairs)
    init = "" if r == 0 else os.path.join(cfg.out_dir, f"round{r}", "dpo", "model.safetensors")
    dc = dpo.Config(out_dir=os.path.join(folder, "dpo"), ref_model=cfg.sft, init=init,
                    train_pairs=pairs, val_pairs=cfg.val_pairs, ref_logps=pc.out_dir,
                    test_prompts=cfg.test_prompts,
                    val_prompts=cfg.val_prompts if r == cfg.rounds - 1 else "",
                    beta=cfg.beta, rpo_alpha=cfg.rpo_alpha, steps=cfg.steps,
                    batch_size=cfg.batch_size, lr=cfg.lr, eval_k=cfg.eval_k, seed=cfg.seed,
                    resume=cfg.resume)
    return folder, pairs, pc, dc


def resume_rounds(cfg, state_path, me, inputs, d, log):
    """The rounds this run finds done: rounds.json's (state_path: the config `me`, its `inputs`,
    each finished round's counts), decided before the run writes anything, so that a refused run
    leaves out_dir as it was. A run of the same config and inputs goes on after its last finished
    round, whatever its --rounds (a round's training does not depend on how many follow it); any
    other, or a round folder no rounds.json accounts for, is refused, naming what differs. A new
    run (or --no-resume) records its config first, so a round it leaves half done is known as its
    own; --no-resume removes the rounds out_dir held, so none is later taken for this run's."""
    held = sorted(f for f in os.listdir(cfg.out_dir) if re.fullmatch(r"round\d+", f))
    if cfg.resume and os.path.exists(state_path):
        try:  # written atomically here; damaged or edited outside this code: one error line
            state = json.loads(Path(state_path).read_text())
        except (OSError, ValueError) as e:
            raise SystemExit(f"error: {state_path} cannot be read ({e}); pass --no-resume to "
                             "start over, or another --out_dir") from None
        same_run(state_path, state, cfg, inputs, free=("resume", "rounds"))
        return state["rounds"]
    check(not (cfg.resume and held), f"{cfg.out_dir} holds round folders ({', '.join(held)}) but "
          "no rounds.json saying which config ran them (an older version's run): pass "
          "--no-resume to start over, or another --out_dir")
    barrier(d)  # every rank has read out_dir before rank 0 changes it
    if d.is_main:
        if os.path.exists(state_path):  # first, so that a kill below leaves rounds no record owns
            os.remove(state_path)
        for f in held:
            shutil.rmtree(os.path.join(cfg.out_dir, f))
        if held:
            log(f"--no-resume: removed {', '.join(held)} of the run {cfg.out_dir} held")
        atomic_write_json(state_path, {"config": me, "inputs": inputs, "rounds": []})
    barrier(d)
    return []


def main(cfg):
    d = init_distributed()
    log = Logger(cfg.out_dir, d).print
    prepare_outputs({cfg.out_dir: "--out_dir"}, d, log)
    require_stage(cfg.sft, Config.sft, lambda: sft.main(sft.Config()), "python sft.py", d, log)
    task.require_task({cfg.prompts: Config.prompts, cfg.val_pairs: Config.val_pairs,
                       cfg.test_prompts: Config.test_prompts,
                       cfg.val_prompts: Config.val_prompts}, d, log)
    prompts = data.read_prompts(cfg.prompts)
    task.require_task_prompts(prompts, cfg.prompts, "the labeller")
    tok = data.load_tokenizer(tokenizer_beside(cfg.sft))
    # what the rounds are trained from: π_ref, its tokenizer and the prompts (rounds.json keeps it)
    inputs = input_fingerprint({"--sft": cfg.sft, "tokenizer": tokenizer_beside(cfg.sft),
                                "--prompts": cfg.prompts}, prompts)
    state_path, me = os.path.join(cfg.out_dir, "rounds.json"), asdict(cfg) | {"resume": None}
    rounds = resume_rounds(cfg, state_path, me, inputs, d, log)
    for r in range(cfg.rounds):
        folder, pairs_path, pc, dc = round_configs(cfg, r)
        if r < len(rounds):
            log(f"round {r + 1}/{cfg.rounds}: done ({folder})")
            # the last round is the one evaluated on --val_prompts: one that was not the last of
            # the run that trained it is evaluated now (dpo.py resumes it at its last step)
            if r == cfg.rounds - 1 and cfg.val_prompts and "val" not in json.loads(
                    Path(dc.out_dir, "eval.json").read_text()):
                dpo.main(dc)
            continue
        # -- sample and label: a batch job between rounds, from the policy the last round saved
        policy = load_model(dc.init or cfg.sft, d.device)[0].eval()
        pairs, counts = sample_pairs(policy, tok, prompts, r, cfg, d)
        del policy
        if d.is_main:
            os.makedirs(folder, exist_ok=True)
            atomic_write_text(pairs_path, "".join(json.dumps(p) + "\n" for p in pairs))
        barrier(d)
        chosen = [p["chosen"] for p in pairs]
        log(f"round {r + 1}/{cfg.rounds}: {counts['labelled']} pairs labelled of "
            f"{counts['sampled']} prompts sampled (skipped: {counts['unfinished']} with a "
            f"completion that did not end, {counts['empty']} with an empty one, "
            f"{counts['identical']} identical) | top words in "
            f"{task.top_word_rate(chosen):.1%} of chosen responses")
        # -- precompute: log π_ref of the round's pairs, once; then offline DPO on them
        precompute.main(pc)
        dpo.main(dc)
        ev = json.loads(Path(dc.out_dir, "eval.json").read_text())
        rounds.append(dict(round=r + 1, **counts, chosen_top_word_rate=task.top_word_rate(chosen),
                           **{k: ev.get(k) for k in ("true_reward", "kl", "eos_rate",
                                                     "top_word_rate")}))
        if d.is_main:
            atomic_write_json(state_path, {"config": me, "inputs": inputs, "rounds": rounds})
        barrier(d)
    rounds = rounds[:cfg.rounds]  # a run of more rounds left more: this one ends at --rounds

    # ==== outputs: the last round's policy and evaluation, with the rounds' counts
    last = round_configs(cfg, cfg.rounds - 1)[3].out_dir
    if d.is_main:
        for f in ("model.safetensors", "tokenizer.json"):
            atomic_copy(os.path.join(last, f), os.path.join(cfg.out_dir, f))
        ev = json.loads(Path(last, "eval.json").read_text())
        atomic_write_json(os.path.join(cfg.out_dir, "eval.json"),
                          {**ev, "labels": sum(x["labelled"] for x in rounds),
                           "steps": cfg.rounds * cfg.steps, "rounds": rounds})
    log(f"iterative DPO: {cfg.rounds} rounds, {sum(x['labelled'] for x in rounds)} labels, "
        f"{cfg.rounds * cfg.steps} steps | " + " | ".join(
            f"round {x['round']}: true reward {x['true_reward']:+.3f}, KL {x['kl']:.2f}"
            for x in rounds) + f" | saved {cfg.out_dir}/model.safetensors")
    barrier(d)
    teardown(d)


if __name__ == "__main__":
    main(parse_config(Config, doc=__doc__))
