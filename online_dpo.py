"""Online DPO: DPO's loss on pairs the policy samples now and the reward service labels.

    python online_dpo.py                        # one process; builds sft and reward if missing
    torchrun --nproc_per_node=8 online_dpo.py   # DDP: each rank samples its share of the prompts
    torchrun --nproc_per_node=8 online_dpo.py --fsdp   # FSDP2: policy, π_ref and r_φ sharded
    python online_dpo.py --reward true          # the hidden true reward labels the pairs
    python online_dpo.py --reward oracle        # Bradley-Terry draws on it, as the offline pairs
    python online_dpo.py --help                 # every flag, e.g. --prompts my.jsonl --beta 0.1

Online DPO (Guo et al. 2024, "Direct Language Model Alignment from Online AI Feedback", label the
fresh pairs with an LLM annotator; a trained reward model labels them here, as in Dong et al. 2024,
"RLHF Workflow", and TRL's OnlineDPOTrainer with a reward_model): each round, sample two
completions per prompt from the current policy, let r_φ pick the better one, and take a step of
DPO's loss (Eq. 7 of Rafailov et al. 2023) on these fresh pairs, the reference still π_ref. Read it
between dpo.py and ppo.py: its headers are DPO's plus three of PPO's phases, and PPO's minus three.
What returns from PPO's job:
  1. the rollout engine, its inference copy of the policy, and the weight broadcast that refreshes
     it after every update: the pairs are sampled during training, from the policy being trained;
  2. the reward service (r_φ from reward.py, or --reward true / oracle): it labels the samples;
  3. the live reference model: log π_ref of samples that did not exist before this round cannot be
     precomputed, so π_ref is resident again and runs forward every round (the reference log-probs).
What stays deleted: the critic (PPO's old log-probs and values), the per-token rewards with the KL
penalty, and the advantages (GAE): the loss is still DPO's closed form, the β·KL constraint inside
it. Writes out/online_dpo/: model.safetensors (+ tokenizer.json), metrics.jsonl, eval.json, ckpt/,
and pairs.jsonl: every labelled pair each round stepped on, in order, as token ids. dpo.py replays
it (--train_pairs out/online_dpo/pairs.jsonl --order file --batch_size <rollout_batch>): the same
steps on the same pairs, the same weights to fp32 rounding (bit for bit with --no-pack --ref live
on one process, where no pair tied: a tie is in this job's micro-batches, not in the file);
--order steps takes them in another order, so the policy that trains on a pair is no longer the
one that sampled it.
"""
import os
from dataclasses import asdict, dataclass
from types import SimpleNamespace

import torch
import torch.distributed as dist

import data
import reward
import sft
from checkpoint import (check_step, input_fingerprint, last_checkpoint, prepare_outputs,
                        require_reward_model, resume, save_checkpoint, save_outputs,
                        tokenizer_beside)
from dpo import dpo_loss
from evaluate import evaluate_held_out, print_samples, summary
from meter import (Meter, anatomy, batch_flops, estimate_flops, format_anatomy, generate_flops,
                   matmul_shapes, measure_peak_flops, model_flops)
from model import freeze, load_model, pair_logps
from plumbing import (Logger, SEED_STRIDE, adamw, autocast, barrier, check, check_response_room,
                      init_distributed, lr_at, parse_config, precision, reduce_sums, require_stage,
                      set_lr, sharded, split_batch, sync_grads, teardown, wrap)
from services import RewardService, RolloutEngine, WeightSync
from task import bradley_terry, require_task, require_task_prompts, true_reward

# ==== config


@dataclass
class Config:
    out_dir: str = "out/online_dpo"  # this stage's folder: policy, tokenizer, metrics, eval, ckpt
    sft: str = "out/sft/model.safetensors"  # π_ref: the policy starts here, the reference stays
    reward_model: str = "out/reward/model.safetensors"  # r_φ, the reward service (built if missing)
    prompts: str = "out/task/prompts_train.jsonl"  # rollout prompts: JSONL {"prompt"}, or lines
    test_prompts: str = "out/task/prompts_test.jsonl"  # held-out prompts for eval.json
    val_prompts: str = ""  # held-out prompts a study selects on, into eval.json's "val" ("": none)
    reward: str = "model"  # labeller: "model" r_φ; "true" hidden reward; "oracle" BT draws on it
    beta: float = 0.5  # the KL(π‖π_ref) constraint, as dpo.py's
    iterations: int = 200  # rounds of rollout + one DPO step on its pairs (dpo.py's 200 steps)
    rollout_batch: int = 64  # prompts per round, all ranks: 64 pairs, dpo.py's batch
    micro_batch_size: int = 32  # pairs per forward on one rank (2x rows); accumulation is derived
    max_prompt_len: int = 32  # a longer prompt keeps BOS and its last tokens (ppo.py's rule)
    missing_eos_score: float = -1.0  # score of a completion that never emitted EOS (ppo.py's)
    lr: float = 1e-3  # peak AdamW learning rate (dpo.py's)
    warmup: int = 10  # linear warmup rounds, then cosine decay
    min_lr_frac: float = 0.1  # cosine ends at this fraction of lr
    weight_decay: float = 0.0  # AdamW decay on matrices; 0 as dpo.py: KL regularises
    grad_clip: float = 10.0  # max global grad norm (dpo.py's)
    eval_k: int = 4  # completions per held-out prompt from each model in the final evaluation
    ckpt_every: int = 50  # rounds between checkpoints (and one at the end)
    seed: int = 1337  # prompt order and sampling
    resume: bool = True  # continue from out_dir/ckpt if it holds this same config
    stop_after: int = 0  # stop after this many rounds, checkpointed (0 = run to the end)
    compile: bool = False  # torch.compile the policy (worth it on CUDA)
    fsdp: bool = False  # shard weights, grads and AdamW state over the ranks (FSDP2), not DDP


# ==== losses and estimators: pure functions
# The loss is dpo.py's dpo_loss, imported unchanged. What is new is where a pair's label comes from.


def label_pairs(score_a, score_b):
    """The reward service's verdict on two completions a, b of each prompt: scores (B,) ->
    (a_chosen (B,) bool, tied (B,) bool). Chosen is the higher score. A tie (equal scores:
    identical completions, equal sums of word weights, or both unfinished) says nothing about which
    is better, so its pair gets weight 0 in the loss. TRL's online DPO calls a tie for the first
    completion instead (first >= second), which trains on a coin flip."""
    return score_a > score_b, score_a == score_b


def bradley_terry_labels(score_a, score_b, u, same):
    """The labeller of the built-in task's offline pairs, task.bradley_terry, on fresh pairs: a is
    chosen with probability σ(r(a) - r(b)), drawn with the uniform u. Scores, uniforms (B,) float;
    same (B,) bool, the two completions identical -> (a_chosen (B,) bool, tied (B,) bool). Equal
    scores are a coin flip, as Bradley-Terry says and as the offline pool labels them; only
    identical completions carry no preference, so only they tie (weight 0 in the loss)."""
    a_chosen = [bradley_terry(*v) for v in zip(u.tolist(), score_a.tolist(), score_b.tolist())]
    return torch.tensor(a_chosen, dtype=torch.bool, device=score_a.device), same


# ==== helpers the loop calls: dpo_loss from dpo.py, pair_logps from model.py, the services
# from services.py


def label(scores, ys, it, cfg, d):
    """The verdict on this rank's B pairs, scores (2B,) as [a; b] -> (a_chosen, tied) (B,) each.
    --reward oracle draws pair j's label from entry j of uniforms seeded by (seed, round), one per
    global pair, on a stream of its own (+2: the sampling's is +1), sliced as sample() slices its
    rows: the same labels on any world size. Otherwise the higher score wins (label_pairs)."""
    B = len(scores) // 2
    if cfg.reward != "oracle":
        return label_pairs(scores[:B], scores[B:])
    rng = torch.Generator().manual_seed(cfg.seed + SEED_STRIDE * it + 2)
    u = torch.rand(cfg.rollout_batch, generator=rng)[d.rank * B:(d.rank + 1) * B]
    same = torch.tensor([a == b for a, b in zip(ys[:B], ys[B:])], device=d.device)
    return bradley_terry_labels(scores[:B], scores[B:], u.to(d.device), same)


def stepped_pairs(ex, it, tok, d):
    """The rows of pairs.jsonl for round it: its untied pairs, all ranks', in the global batch's
    order, as the token ids the step read (a completion that never ended has no EOS; a sample need
    not be its text's encoding), with their texts to read. A tie weighed 0: it is no pair."""
    mine = [dict(step=it + 1, prompt=tok.decode(p["prompt"]), chosen=tok.decode(p["chosen"]),
                 rejected=tok.decode(p["rejected"]), prompt_ids=p["prompt"],
                 chosen_ids=p["chosen"], rejected_ids=p["rejected"])
            for p, keep in zip(ex["pairs"], ex["keep"].tolist()) if keep]
    if d.world > 1:  # rank r holds the global batch's r-th share: gathered in rank order
        parts = [None] * d.world
        dist.all_gather_object(parts, mine)
        mine = [row for part in parts for row in part]
    return mine


def sampling_flops(out, policy, reward_model):
    """(executed, needed) FLOPs on this rank of the rollout (each real token but the last fed once,
    the head where a token is sampled) and of r_φ (a score per row)."""
    tokens, mask, rmask = out["tokens"], out["mask"], out["response_mask"]
    (rows, L), P, c = tokens.shape, out["P"], policy.config
    real, K = mask.sum(1), int(rmask.sum())
    hardware, model = generate_flops(c, rows, P, L - P), model_flops(c, real - 1, K)
    if reward_model is not None:
        hardware += estimate_flops(reward_model.config, rows, L)
        model += model_flops(reward_model.config, real, rows)
    return hardware, model


# The collapse rule of online DPO, beside dpo.py's loss bound (checkpoint.DIVERGED): a round in
# which every pair ties stops the run. A collapsed policy hides from the loss bound: at --lr 1e3
# one step made π repeat one word to the end of the block ("script script ..."), so both
# completions of every prompt lack EOS and score alike, every pair is a tie, the loss is 0 from
# then on and no later round can train; it was saved with exit code 0 at KL 499 nats. A policy
# that collapses either stops ending (unfinished completions tie at missing_eos_score) or becomes
# deterministic (identical completions tie), so the rule catches both. Measured on the built-in task
# at β 0.1: at most 9% of a round's pairs tie (0.35% over the 200 rounds). Under --reward oracle
# two unfinished completions are a coin flip, not a tie: there the rule catches only a policy that
# became deterministic.
# The rule needs rounds of enough pairs: at that worst measured tie rate, a healthy round of n
# pairs ties all of them by chance with probability up to 0.09^n: 7e-5 at n = 4 (1.3% in 200
# rounds), 4e-9 at MIN_ROUND_PAIRS; a round of one pair would stop the run at its first tie.
MIN_ROUND_PAIRS = 8

PHASES = ("batch", "rollout", "reward", "reference", "policy_forward", "loss", "update",
          "broadcast")


# ==== setup: ranks, device, inputs (a missing earlier stage is built with its defaults)


def setup(cfg, d, log):
    """The prompts, tokenized and cut to max_prompt_len, π_ref's tokenizer and what the weights
    are trained from; a missing π_ref, r_φ or built-in task is built first."""
    check(cfg.reward in ("model", "true", "oracle"),
          f"--reward must be 'model', 'true' or 'oracle', not {cfg.reward!r}")
    check(cfg.beta > 0, f"--beta must be > 0, got {cfg.beta}")
    check(cfg.rollout_batch >= MIN_ROUND_PAIRS, f"--rollout_batch {cfg.rollout_batch} is fewer "
          f"than {MIN_ROUND_PAIRS} pairs a round: a round whose pairs all tie stops the run as "
          f"collapsed, and {cfg.rollout_batch} healthy pairs can all tie by chance (up to 9% of a "
          f"round's pairs do); pass --rollout_batch {MIN_ROUND_PAIRS} or more")
    prepare_outputs({cfg.out_dir: "--out_dir", os.path.join(cfg.out_dir, "ckpt"): "--out_dir"},
                    d, log)
    require_stage(cfg.sft, Config.sft, lambda: sft.main(sft.Config()), "python sft.py", d, log)
    if cfg.reward == "model":
        require_stage(cfg.reward_model, Config.reward_model, lambda: reward.main(reward.Config()),
                      "python reward.py", d, log)
    require_task({cfg.prompts: Config.prompts, cfg.test_prompts: Config.test_prompts,
                  cfg.val_prompts: Config.val_prompts}, d, log)
    tok_path = tokenizer_beside(cfg.sft, "--sft")
    tok = data.load_tokenizer(tok_path)
    if cfg.reward == "model":
        require_reward_model(cfg.reward_model, "--reward_model", tok_path)
    texts = data.read_prompts(cfg.prompts)
    if cfg.reward != "model":
        require_task_prompts(texts, f"--prompts {cfg.prompts}", f"--reward {cfg.reward}'s scorer")
    prompts, cut = data.encode_prompts(tok, texts, cfg.max_prompt_len)
    if cut:
        log(f"{cut} of {len(prompts)} prompts of {cfg.prompts} are longer than --max_prompt_len "
            f"{cfg.max_prompt_len} tokens: each keeps its BOS and its last tokens")
    check(len(prompts) >= cfg.rollout_batch, f"{cfg.prompts} has {len(prompts)} prompts, fewer "
          f"than --rollout_batch {cfg.rollout_batch}")
    # what the weights are trained from: a resumed run checks it is the same
    inputs = input_fingerprint({"--sft": cfg.sft, "tokenizer": tok_path, "--prompts": cfg.prompts,
                                **({"--reward_model": cfg.reward_model} if cfg.reward == "model"
                                   else {})}, prompts)
    return tok, tok_path, texts, prompts, inputs


# ==== models resident in the training job


def load_models(cfg, d, tok):
    """Four of PPO's five: the policy trains; π_ref, r_φ and the rollout engine's copy of the
    policy run forward only. The critic stays gone. Dropout off (model.load_model), so the policy's
    log π equals log π_ref exactly in round 1, as in dpo.py. The frozen ones hold bf16 matmul
    weights under bf16 autocast (model.freeze: the same outputs) and are sharded too with --fsdp;
    the policy trains under DDP (--fsdp: sharded in place), then torch.compile."""
    bf16 = precision(d.device) == "bf16"
    policy = load_model(cfg.sft, d.device, head="lm")[0]
    ref = wrap(freeze(load_model(cfg.sft, d.device, head="lm")[0], bf16), d, fsdp=cfg.fsdp)
    reward_model = None  # --reward true or oracle: a Python function labels, no r_φ resident
    if cfg.reward == "model":
        reward_model = wrap(freeze(load_model(cfg.reward_model, d.device, head="scalar")[0], bf16),
                            d, fsdp=cfg.fsdp)
    T = policy.config.block_size
    check_response_room(cfg.max_prompt_len, T)
    return SimpleNamespace(policy=policy, ref=ref, reward_model=reward_model,
                           rollout=RolloutEngine(policy, d),
                           reward=RewardService(reward_model, cfg.missing_eos_score, tok, d),
                           sync=WeightSync(d), trainer=wrap(policy, d, cfg.compile, cfg.fsdp))


def main(cfg):
    d = init_distributed()
    log = Logger(cfg.out_dir, d)
    tok, tok_path, texts, prompts, inputs = setup(cfg, d, log.print)
    ckpt_dir = os.path.join(cfg.out_dir, "ckpt")
    accum = split_batch(cfg.rollout_batch, cfg.micro_batch_size, d.world)
    B = cfg.rollout_batch // d.world  # this rank's prompts, and so its pairs
    models = load_models(cfg, d, tok)
    policy, reward_model = models.policy, models.reward_model
    T = policy.config.block_size

    # ==== anatomy: what the job holds and what a token costs
    resident = {"policy": policy, "reference": models.ref,
                **({"reward": reward_model} if reward_model is not None else {}),
                "rollout": models.rollout.model}
    layout = anatomy(resident, T)
    log.print(format_anatomy(layout, T))
    log.print("back from PPO: rollout engine, reward service, live reference, weight broadcast | "
              "still gone: critic, per-token KL rewards, GAE, value loss")
    fwd = lambda m: estimate_flops(m.config, 1, T) / T  # noqa: E731
    phase_flops = {"rollout": fwd(policy),
                   "reward": fwd(reward_model) if reward_model is not None else 0.0,
                   "reference": fwd(models.ref),
                   "update": estimate_flops(policy.config, 1, T, backward=True) / T}
    log.print("FLOPs per sampled token by phase: "
              + " | ".join(f"{k} {v / 1e6:.2f}M" for k, v in phase_flops.items())
              + f" | round {sum(phase_flops.values()) / 1e6:.2f}M")

    # ==== optimizer, schedule, resume
    opt = adamw(policy, cfg.lr, cfg.weight_decay)
    start, state = resume(ckpt_dir, cfg, {"model": policy, "optim": opt}, d.device, log.print,
                          inputs, free=("resume", "stop_after", "eval_k", "compile", "fsdp"))
    first_loss = state.get("first_loss")  # the divergence guard's scale: the loss at π = π_ref
    if start:
        models.sync.push(policy, models.rollout)  # the rollout engine resumes with the policy
    log.start(start)  # metrics.jsonl keeps the rounds up to `start`
    stepped = Logger(cfg.out_dir, d, "pairs.jsonl")  # the pairs of the rounds up to `start`, too
    stepped.start(start)
    micro_batch = B // accum  # pairs per forward on this rank
    peak = measure_peak_flops(d.device, matmul_shapes(policy.config, 2 * micro_batch * T))
    scorer = {"model": f"r_φ {cfg.reward_model}", "true": "the hidden true reward (argmax)",
              "oracle": "Bradley-Terry draws on the hidden true reward"}[cfg.reward]
    log.print(f"beta {cfg.beta} | rollout {cfg.rollout_batch} prompts x 2 completions = "
              f"{d.world} ranks x {B} x 2 | batch {cfg.rollout_batch} pairs = {d.world} ranks x "
              f"{accum} accumulation x {micro_batch} | reward: {scorer} | device {d.device} | "
              f"peak {peak / 1e9:.1f} GFLOP/s per rank (measured)"
              + (" | sharded (FSDP2)" if sharded(policy) else ""))

    # ==== training loop
    # Each round: fresh pairs sampled, labelled and scored by π_ref (experience), one DPO step on
    # them (update), then the new weights to the rollout engine and the round's metrics (refresh).
    end = cfg.iterations if not cfg.stop_after else min(cfg.iterations, start + cfg.stop_after)
    meter = Meter(d, peak, unit="iteration", phases=PHASES, compile=cfg.compile)
    for it in range(start, end):
        meter.start()
        lr = set_lr(opt, lr_at(it, cfg.iterations, cfg.lr, cfg.warmup, cfg.min_lr_frac))
        ex = experience(models, prompts, texts, it, accum, cfg, d, tok, meter)
        grad_norm, first_loss = update(models, opt, ex, it, first_loss, cfg, d, meter, ckpt_dir,
                                       tok.pad)
        metrics = refresh(models, ex, tok, cfg, d, meter, {"grad_norm": grad_norm, "lr": lr})
        log.log(it + 1, cfg.iterations, metrics, show=("loss", "rewards/accuracies", "score",
                                                       "true_reward", "kl", "ties",
                                                       "time/iteration"))
        stepped.write(stepped_pairs(ex, it, tok, d))
        if (it + 1) % cfg.ckpt_every == 0 or it + 1 == end:  # written by rank 0
            save_checkpoint(ckpt_dir, it + 1, {"model": policy, "optim": opt},
                            {"config": asdict(cfg), "inputs": inputs, "first_loss": first_loss},
                            write=d.is_main)
    barrier(d)  # rank 0's checkpoint is on disk before any rank moves on
    if end < cfg.iterations:
        log.print(f"stopped after {end - start} rounds (--stop_after); run again to resume from "
                  f"round {end}")
        return teardown(d)
    finish(policy, tok, tok_path, cfg, d, log, meter, layout)
    teardown(d)


def experience(models, prompts, texts, it, accum, cfg, d, tok, meter):
    """A round's pairs: two samples per prompt, labelled by the reward service, with log π_ref."""
    # -- batch: this rank's share of the round's global batch of prompts
    batch = data.global_batch(len(prompts), cfg.rollout_batch, it, cfg.seed)
    idx = data.rank_slice(batch, d.rank, d.world)
    meter.lap("batch")

    # -- rollout engine: two completions per prompt from the inference copy, with the KV cache
    out = models.rollout.sample(prompts, batch, idx, it, cfg.seed, tok, per_prompt=2)
    B = len(idx)
    meter.lap("rollout")

    # -- reward service: score each completion, cut at its EOS (generate pads after it); the
    # higher score is chosen (--reward oracle: Bradley-Terry's draw), a tie weighs 0 in the loss.
    # An unfinished completion scores missing_eos_score: it loses to a finished one scored above
    # that, and two unfinished ones tie (the oracle: a coin flip)
    ys = [t[m].tolist() for t, m in zip(out["tokens"], out["response_mask"])]  # (2B,) token ids
    mine = [texts[i] for i in idx]
    scores, has_eos = models.reward.score(out, mine * 2)
    a_chosen, tied = label(scores, ys, it, cfg, d)
    pairs = [dict(index=j, prompt=prompts[i], chosen=a if w else b, rejected=b if w else a)
             for j, (i, a, b, w) in enumerate(zip(idx, ys[:B], ys[B:], a_chosen.tolist()))]
    meter.lap("reward")

    # -- reference log-probs: log π_ref of the new samples, from the resident π_ref. They did
    # not exist before this round: no precompute could have cached them
    meter.count(*sampling_flops(out, models.policy, models.reward_model))
    micro_batch = B // accum
    batches = [data.collate_pairs(pairs[m * micro_batch:(m + 1) * micro_batch], tok.pad)
               for m in range(accum)]
    ref_lp = []
    for b in batches:
        x, y = b["input_ids"].to(d.device), b["targets"].to(d.device)
        with torch.no_grad(), autocast(d.device):  # frozen: no activations kept
            ref_lp.append(pair_logps(models.ref, x, y).view(2, -1))  # (2, micro_batch)
        meter.count(*batch_flops(models.ref.config, x, y, tok.pad))
    meter.lap("reference")
    return {"out": out, "ys": ys, "texts": mine, "score": scores, "has_eos": has_eos,
            "keep": (~tied).float(), "pairs": pairs, "batches": batches, "ref_lp": ref_lp}


def update(models, opt, ex, it, first_loss, cfg, d, meter, ckpt_dir, pad):
    """One DPO step (Eq. 7) on the round's pairs. The loss is a mean over the global batch's
    untied pairs: count them over the ranks first. Returns (grad norm, the first round's loss)."""
    keep, batches, accum = ex["keep"], ex["batches"], len(ex["batches"])
    n_keep = reduce_sums(d, n=keep.sum())["n"]
    if not n_keep:  # the collapse rule, above
        raise SystemExit(f"error: the run collapsed: every pair of round {it + 1} tied (the policy "
                         "no longer ends its completions, or samples one completion only), so no "
                         "round can train it again; stopped, and not saved; the last checkpoint "
                         f"is kept: {last_checkpoint(ckpt_dir)}. Try a lower --lr.")
    micro_batch = len(keep) // accum
    for m, b in enumerate(batches):
        x, y = b["input_ids"].to(d.device), b["targets"].to(d.device)
        w = keep[m * micro_batch:(m + 1) * micro_batch]
        with sync_grads(models.trainer, m == accum - 1):  # all-reduce on the last micro-step only
            # -- policy forward: one forward over [chosen; rejected] scores both halves
            with autocast(d.device):
                pi_c, pi_r = pair_logps(models.trainer, x, y).chunk(2)  # (micro_batch,) each
            meter.lap("policy_forward")
            # -- loss: Eq. 7 on the labelled pairs, a tie weighted 0. Summed and divided by the
            # untied pairs of the global batch, x world as DDP averages over ranks
            ref_c, ref_r = ex["ref_lp"][m]
            losses, r_c, r_r = dpo_loss(pi_c, pi_r, ref_c, ref_r, cfg.beta)
            ((losses * w).sum() * d.world / max(n_keep, 1)).backward()
            meter.lap("loss")  # the backward included
        meter.count(*batch_flops(models.policy.config, x, y, pad, backward=True))
        # kl: every completion, tied or not, was sampled from π before this update, so the mean
        # of log π/π_ref over them estimates KL(π‖π_ref) (ppo.py's kl, summed k1)
        meter.add(loss=losses.detach() * w, r_chosen=r_c * w, r_rejected=r_r * w,
                  correct=(r_c > r_r).float() * w, logp_chosen=pi_c.detach() * w,
                  logp_rejected=pi_r.detach() * w, kl=((pi_c - ref_c) + (pi_r - ref_r)).detach(),
                  tokens=(x != pad).float())
    # -- update
    grad_norm = torch.nn.utils.clip_grad_norm_(models.trainer.parameters(), cfg.grad_clip).item()
    s = meter.reduce()
    ex["n_keep"] = n_keep
    first_loss = check_step(s["loss"] / max(n_keep, 1), grad_norm, first_loss, f"round {it + 1}",
                            ckpt_dir, "Try a lower --lr or --beta.")
    opt.step()
    opt.zero_grad(set_to_none=True)
    meter.lap("update")
    return grad_norm, first_loss


def refresh(models, ex, tok, cfg, d, meter, metrics):
    """The new weights to the rollout engine, then the round's metrics, all ranks': DPO's over the
    untied pairs, the samples' over all 2B."""
    # -- weight broadcast: the rollout engine samples the next round from the new policy
    n_bytes, _ = models.sync.push(models.policy, models.rollout)
    meter.lap("broadcast")

    # -- metrics and checkpoint: the hidden true reward is computed outside the timed phases, for
    # monitoring only
    out, s, n = ex["out"], meter.total, max(ex["n_keep"], 1)
    true = [true_reward(t, tok.decode(y)) for t, y in zip(ex["texts"] * 2, ex["ys"])]
    t = reduce_sums(d, n=len(ex["ys"]), score=ex["score"].sum(), true=sum(true),
                    eos=ex["has_eos"].sum(), tokens=out["response_mask"].sum(),
                    real=out["mask"].sum())
    n_s = t["n"]
    return {"loss": s["loss"] / n, "rewards/chosen": s["r_chosen"] / n,
            "rewards/rejected": s["r_rejected"] / n, "rewards/accuracies": s["correct"] / n,
            "rewards/margins": (s["r_chosen"] - s["r_rejected"]) / n,
            "logps/chosen": s["logp_chosen"] / n, "logps/rejected": s["logp_rejected"] / n,
            "score": t["score"] / n_s, "true_reward": t["true"] / n_s, "kl": s["kl"] / n_s,
            "ties": 1 - ex["n_keep"] / cfg.rollout_batch, "eos_rate": t["eos"] / n_s,
            "response_len": t["tokens"] / n_s, **metrics, "broadcast_MB": n_bytes / 2**20,
            **meter.timing(t["real"])}


# ==== evaluation and outputs


def finish(policy, tok, tok_path, cfg, d, log, meter, layout):
    """Sample the held-out prompts from the policy and from π_ref's own fp32 copy (the frozen one
    may hold bf16 weights, which run only under autocast; sampling runs without), then save."""
    ref = load_model(cfg.sft, d.device, head="lm")[0]
    ev = evaluate_held_out(policy, ref, tok, cfg, d, missing_eos_score=cfg.missing_eos_score)
    shares = meter.shares(log.print, "a round")
    save_outputs(policy, cfg.out_dir, {"stage": "online_dpo", "iterations": cfg.iterations,
                                       "sft": cfg.sft, "reward": cfg.reward, "beta": cfg.beta},
                 {**ev, "iterations": cfg.iterations, "reward": cfg.reward, "beta": cfg.beta,
                  "time_shares": shares, "anatomy": layout}, d, tok_path)
    print_samples(ev, log.print)
    log.print(f"{summary(ev)} | saved {cfg.out_dir}/model.safetensors")


if __name__ == "__main__":
    main(parse_config(Config, doc=__doc__))
