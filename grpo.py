"""GRPO (Shao et al. 2024, "DeepSeekMath", sec. 4.1): PPO with the critic deleted.

    python grpo.py                        # one process; builds out/sft and out/reward if missing
    torchrun --nproc_per_node=8 grpo.py   # DDP: each rank rolls out its share of the completions
    torchrun --nproc_per_node=8 grpo.py --fsdp   # FSDP2: policy, π_ref and r_φ sharded 8 ways
    python grpo.py --reward true          # the hidden true reward scores instead of r_φ
    python grpo.py --reward oracle        # a completion's Bradley-Terry wins within its group
    python grpo.py --help                 # every flag, e.g. --group_size 8 --kl_coef 0.04

Read it beside ppo.py: the same skeleton, the same headers in the same order. For each prompt the
rollout engine samples a group of group_size completions; the reward service scores each; a
completion's advantage is its score standardised within its group, (r - mean) / (std + ε), the
same for every one of its tokens (sec. 4.1.2, outcome supervision). What leaves PPO's job:
  1. the critic: its values, its loss and its half of the optimizer. The group's mean score is the
     baseline the critic's values were, so nothing has to learn one;
  2. the per-token rewards with the KL penalty: the KL to π_ref is a term of the loss (Eq. 3),
     estimated per token by k3 (Eq. 4), not a reward for GAE to credit.
What changes: the advantages, the group's standardised score instead of GAE.
What stays: the rollout engine and the weight broadcast, the reward service, the resident π_ref, the
old log-probs and PPO's clipped surrogate, over ppo_epochs passes of minibatches as ppo.py.

TRL's GRPOTrainer differs by default: its KL coefficient is 0 (π_ref is not even loaded; the
paper's β is 0.04), it takes one step per batch of samples (num_iterations 1: the ratio is 1 and
the clip never acts), and its loss ("dapo") averages over all the batch's tokens, not over each
completion's tokens first (Eq. 3's 1/|o_i|). Dr. GRPO (Liu et al. 2025) drops both the std division
(--no-scale_rewards) and the 1/|o_i|, each of which weighs some completions more than others.
Writes out/grpo/: model.safetensors + tokenizer.json, metrics.jsonl, eval.json, ckpt/.
"""
import itertools
import os
from dataclasses import asdict, dataclass
from types import SimpleNamespace

import torch

import data
import reward
import sft
from checkpoint import (input_fingerprint, prepare_outputs, require_reward_model, resume,
                        save_checkpoint, save_outputs, stop_if_diverged, stop_if_not_finite,
                        tokenizer_beside)
from evaluate import evaluate_held_out, print_samples, summary
from meter import (Meter, anatomy, estimate_flops, format_anatomy, generate_flops, matmul_shapes,
                   measure_peak_flops, model_flops)
from model import freeze, load_model, sequence_logprobs
from plumbing import (Logger, SEED_STRIDE, autocast, barrier, check, check_response_room,
                      init_distributed, lr_at, parse_config, precision, require_stage, set_lr,
                      sharded, split_batch, sync_grads, teardown, wrap)
from ppo import MAX_APPROX_KL, gather_rollouts, kl_estimators, msum
from services import RewardService, RolloutEngine, WeightSync, replies
from task import require_task, require_task_prompts, true_reward

# ==== config


@dataclass
class Config:
    out_dir: str = "out/grpo"  # this stage's folder: policy, metrics, eval, checkpoint
    sft: str = "out/sft/model.safetensors"  # π_ref: the policy starts here, KL is to it
    reward_model: str = "out/reward/model.safetensors"  # r_φ, the reward service (--reward model)
    prompts: str = "out/task/prompts_train.jsonl"  # rollout prompts: JSONL {"prompt"}, or lines
    test_prompts: str = "out/task/prompts_test.jsonl"  # held-out prompts for eval.json
    val_prompts: str = ""  # held-out prompts a study selects on, into eval.json's "val" ("": none)
    reward: str = "model"  # "model" r_φ; "true" hidden reward; "oracle" BT wins in the group
    iterations: int = 30  # rounds of rollout + update (ppo.py's)
    rollout_batch: int = 64  # completions per iteration, all ranks (/ group_size prompts)
    # 4: ppo.py's 64 completions an iteration then cover 16 prompts (8 would cover 8, half the
    # prompts for a baseline of 7 others instead of 3); DeepSeekMath sampled 64, TRL samples 8
    group_size: int = 4  # completions per prompt, G; their mean score is the baseline (G >= 2)
    mini_batch: int = 32  # completions per optimizer step, all ranks together (ppo.py's)
    micro_batch_size: int = 16  # at most this many completions per forward on one rank
    ppo_epochs: int = 4  # passes over each rollout batch (ppo.py's; DeepSeekMath: 1)
    max_prompt_len: int = 32  # a longer prompt keeps BOS and its last tokens; the response fills
    temperature: float = 1.0  # sampling temperature T; every log-prob divides the logits by it
    kl_coef: float = 0.04  # β of the k3 KL(π‖π_ref) term in the loss (DeepSeekMath's 0.04)
    cliprange: float = 0.2  # ε of the clipped policy ratio
    scale_rewards: bool = True  # divide by the group's std (--no-scale_rewards: Dr. GRPO's)
    missing_eos_score: float = -1.0  # score of a response that never emitted EOS (ppo.py's)
    lr: float = 1e-4  # peak AdamW lr (ppo.py's)
    warmup: int = 0  # linear warmup iterations, then cosine decay
    min_lr_frac: float = 1.0  # cosine ends at this fraction of lr (1: constant)
    grad_clip: float = 1.0  # max global grad norm
    eval_k: int = 4  # completions per held-out prompt in the final evaluation
    ckpt_every: int = 10  # iterations between checkpoints (and one at the end)
    seed: int = 1337  # prompt order, sampling, minibatch order
    compile: bool = False  # torch.compile the policy (worth it on CUDA)
    fsdp: bool = False  # shard weights, grads and AdamW state over the ranks (FSDP2), not DDP
    resume: bool = True  # continue from out_dir/ckpt if it holds this same config
    stop_after: int = 0  # stop after this many iterations, checkpointed (0 = run to the end)


# ==== losses and estimators: pure functions
# Per-token tensors are (B, N) over the N response columns; mask (B, N) is True on sampled tokens up
# to and including EOS (a prefix of each row). msum and kl_estimators are ppo.py's.

# ε of the standardisation, as TRL's: a group whose scores are all equal (std 0) gets advantage 0
# (its completions say nothing about which is better), not a division by zero
ADV_EPS = 1e-4


def group_advantages(scores, group_size, scale=True):
    """Sec. 4.1.2 of Shao et al. 2024 (outcome supervision): scores (R,), consecutive groups of
    group_size completions of one prompt -> advantages (R,), Â_i = (r_i - mean(r)) / (std(r) + ε)
    over the group (the unbiased std, as TRL's); scale=False keeps r_i - mean(r) (Dr. GRPO)."""
    check(group_size >= 2, f"--group_size must be at least 2 (a group of {group_size} has no "
          "baseline but itself: every advantage would be 0)")
    r = scores.view(-1, group_size)
    adv = r - r.mean(1, keepdim=True)
    if scale:
        adv = adv / (r.std(1, keepdim=True) + ADV_EPS)
    return adv.flatten()


def grpo_loss(logp, old_logp, ref_logp, adv, mask, cliprange, kl_coef, n):
    """Eq. 3 of Shao et al. 2024 as a loss, per token: -min(ρ·A, clip(ρ, 1-ε, 1+ε)·A) + β·k3 with
    ρ = π/π_old and k3 = π_ref/π - log(π_ref/π) - 1 (Eq. 4), the unbiased, never negative estimate
    of KL(π‖π_ref) on tokens sampled from π. adv (B,) is the completion's, on each of its tokens.
    Averaged over each completion's tokens (1/|o_i|), summed over completions and divided by n,
    the global minibatch's count of completions. Returns (loss, clipfrac, approx_kl, kl), the last
    three per token of the minibatch, approx_kl k3 of KL(π_old‖π) as ppo.py's."""
    lens = mask.sum(1).clamp(min=1)  # (B,)
    log_ratio = logp - old_logp
    ratio = log_ratio.exp()
    A = adv[:, None]
    pg, pg_clipped = -A * ratio, -A * ratio.clamp(1 - cliprange, 1 + cliprange)
    kl = kl_estimators(logp, ref_logp)[1]  # k3, (B, N)
    per_seq = torch.where(mask, torch.max(pg, pg_clipped) + kl_coef * kl, 0.0).sum(1) / lens
    n_tok = mask.sum()
    clipfrac = msum((pg_clipped > pg).float(), mask) / n_tok
    approx_kl = msum((ratio - 1) - log_ratio, mask) / n_tok
    kl_mean = msum(kl, mask) / n_tok
    return per_seq.sum() / n, clipfrac.detach(), approx_kl.detach(), kl_mean.detach()


# ==== helpers the loop calls: the services are services.py's


def forward_flops(ro, policy, reward_model):
    """(executed, needed) FLOPs on this rank of an iteration's forwards before the update: the
    rollout (each real token but the last fed once, the head where a token is sampled), r_φ (a
    score per row), π_ref and π_old (the head at the K response positions)."""
    tokens, mask = ro["tokens"], ro["mask"]
    (B, L), P, c = tokens.shape, ro["P"], policy.config
    real, K = mask.sum(1), int(ro["rmask"].sum())
    hardware = generate_flops(c, B, P, L - P) + 2 * estimate_flops(c, B, L, outputs=K)
    model = model_flops(c, real - 1, K) + 2 * model_flops(c, real, K)
    if reward_model is not None:
        hardware += estimate_flops(reward_model.config, B, L)
        model += model_flops(reward_model.config, real, B)
    return hardware, model


PHASES = ("batch", "rollout", "reward", "reference", "old_logprobs", "advantages",
          "policy_forward", "loss", "update", "broadcast")


# ==== setup: ranks, device, inputs (a missing earlier stage is built with its defaults)


def setup(cfg, d, log):
    """The prompts, tokenized and cut to max_prompt_len, π_ref's tokenizer and what the weights
    are trained from; a missing π_ref, r_φ (--reward model) or built-in task is built first."""
    check(cfg.reward in ("model", "true", "oracle"),
          f"--reward must be 'model', 'true' or 'oracle', not {cfg.reward!r}")
    check(cfg.group_size >= 2, f"--group_size must be at least 2, not {cfg.group_size}: a "
          "group's mean is the baseline, and a completion alone is its own")
    check(cfg.rollout_batch % cfg.group_size == 0, f"--rollout_batch {cfg.rollout_batch} is not "
          f"a multiple of --group_size {cfg.group_size}")
    check(cfg.rollout_batch % cfg.mini_batch == 0, f"--rollout_batch {cfg.rollout_batch} is not "
          f"a multiple of --mini_batch {cfg.mini_batch}")
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
    n_prompts = cfg.rollout_batch // cfg.group_size
    check(len(prompts) >= n_prompts, f"{cfg.prompts} has {len(prompts)} prompts, fewer than "
          f"--rollout_batch / --group_size = {n_prompts}")
    # what the weights are trained from: a resumed run checks it is the same
    inputs = input_fingerprint({"--sft": cfg.sft, "tokenizer": tok_path, "--prompts": cfg.prompts,
                                "--reward_model": cfg.reward_model if cfg.reward == "model"
                                else ""}, prompts)
    return tok, tok_path, texts, prompts, inputs


# ==== models resident in the training job


def load_models(cfg, d, tok):
    """Four of PPO's five: the policy trains; π_ref, r_φ (--reward model) and the rollout engine's
    copy of the policy only run forward. No critic. The frozen ones hold bf16 matmul weights under
    bf16 autocast (model.freeze) and are sharded too with --fsdp; the policy is wrapped for DDP
    (--fsdp: sharded in place), then torch.compile."""
    bf16 = precision(d.device) == "bf16"
    policy = load_model(cfg.sft, d.device, head="lm")[0]
    ref = wrap(freeze(load_model(cfg.sft, d.device, head="lm")[0], bf16), d, fsdp=cfg.fsdp)
    reward_model = None  # --reward true or oracle: a Python function scores, no r_φ resident
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
    accum = split_batch(cfg.mini_batch, cfg.micro_batch_size, d.world)
    n_mini, B = cfg.rollout_batch // cfg.mini_batch, cfg.rollout_batch // d.world
    models = load_models(cfg, d, tok)
    policy, rollout, reward_model = models.policy, models.rollout, models.reward_model
    T = policy.config.block_size

    # ==== anatomy: what the job holds and what a token costs
    resident = {"policy": policy, "reference": models.ref,
                **({"reward": reward_model} if reward_model is not None else {}),
                "rollout": rollout.model}
    fwd = lambda m: estimate_flops(m.config, 1, T) / T  # noqa: E731
    train_step = lambda m: estimate_flops(m.config, 1, T, backward=True) / T  # noqa: E731
    phase_flops = {"rollout": fwd(policy),
                   "reward": fwd(reward_model) if reward_model is not None else 0.0,
                   "reference": 2 * fwd(policy),  # log π_ref and log π_old
                   "update": cfg.ppo_epochs * train_step(policy)}
    layout = anatomy(resident, T)
    log.print(format_anatomy(layout, T))
    log.print("FLOPs per rollout token by phase: "
              + " | ".join(f"{k} {v / 1e6:.2f}M" for k, v in phase_flops.items())
              + f" | iteration {sum(phase_flops.values()) / 1e6:.2f}M")

    # ==== optimizer, schedule, resume
    opt = torch.optim.AdamW(policy.parameters(), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=0.0)
    parts = {"policy": policy, "optim": opt}
    start, _ = resume(ckpt_dir, cfg, parts, d.device, log.print, inputs,
                      free=("resume", "stop_after", "eval_k", "compile", "fsdp"))
    if start:
        models.sync.push(policy, rollout)  # the rollout engine resumes with the restored policy
    log.start(start)  # metrics.jsonl keeps the iterations up to `start`
    peak = measure_peak_flops(d.device, matmul_shapes(policy.config, B * T))
    scorer = {"model": f"r_φ {cfg.reward_model}", "true": "the hidden true reward",
              "oracle": "Bradley-Terry wins within the group on the hidden reward"}[cfg.reward]
    log.print(f"rollout {cfg.rollout_batch} = {cfg.rollout_batch // cfg.group_size} prompts x "
              f"{cfg.group_size} completions = {d.world} ranks x {B} | {cfg.ppo_epochs} epochs x "
              f"{n_mini} minibatches of {cfg.mini_batch} = {d.world} ranks x {accum} accumulation "
              f"x {B // n_mini // accum} | reward: {scorer} | device {d.device} | peak "
              f"{peak / 1e9:.1f} GFLOP/s per rank (measured)"
              + (" | sharded (FSDP2)" if sharded(models.trainer) else ""))

    # ==== training loop
    # Each iteration: groups of rollouts scored and turned into advantages (experience), then
    # ppo_epochs passes of minibatch updates (update), then the new weights to the rollout engine
    # and the iteration's metrics (refresh). In that order below.
    end = cfg.iterations if not cfg.stop_after else min(cfg.iterations, start + cfg.stop_after)
    meter = Meter(d, peak, unit="iteration", phases=PHASES, compile=cfg.compile)
    for it in range(start, end):
        meter.start()
        lr = set_lr(opt, lr_at(it, cfg.iterations, cfg.lr, cfg.warmup, cfg.min_lr_frac))
        ex = experience(models, prompts, texts, it, cfg, d, tok, meter)
        grad_norm = update(models, opt, ex, it, accum, cfg, d, meter, ckpt_dir)
        metrics = refresh(models, ex, tok, cfg, d, meter, {"grad_norm": grad_norm, "lr": lr})
        log.log(it + 1, cfg.iterations, metrics, show=("score", "true_reward", "kl", "entropy",
                                                       "clipfrac", "approx_kl", "response_len",
                                                       "time/iteration"))
        # a policy that left the clip's trust region has diverged: ppo.py's rule and bound
        stop_if_diverged("approx_kl", metrics["approx_kl"], MAX_APPROX_KL, "nats per token, the "
                         "most an iteration may move the policy", f"iteration {it + 1}", ckpt_dir,
                         "Try a lower --lr.")
        if (it + 1) % cfg.ckpt_every == 0 or it + 1 == end:  # written by rank 0
            save_checkpoint(ckpt_dir, it + 1, parts, {"config": asdict(cfg), "inputs": inputs},
                            write=d.is_main)
    barrier(d)  # rank 0's checkpoint is on disk before any rank moves on
    if end < cfg.iterations:
        log.print(f"stopped after {end - start} iterations (--stop_after); run again to resume "
                  f"from {end}")
        return teardown(d)
    finish(policy, tok, tok_path, cfg, d, log, meter, layout)
    teardown(d)


def experience(models, prompts, texts, it, cfg, d, tok, meter):
    """An iteration's groups of rollouts, scored, with their old and reference log-probs and the
    group advantages."""
    # -- batch: this rank's share of the iteration's global batch, each prompt group_size times in
    # a row (a group is consecutive rows; ranks may split one, the scores are all-reduced)
    batch = data.global_batch(len(prompts), cfg.rollout_batch // cfg.group_size, it, cfg.seed)
    batch = [i for i in batch for _ in range(cfg.group_size)]  # (R,) prompt indices
    idx = data.rank_slice(batch, d.rank, d.world)
    meter.lap("batch")

    # -- rollout engine: each completion from the inference copy, with the KV cache; the
    # completions of a prompt draw different rows of uniforms, so a group holds different samples
    ex = models.rollout.sample(prompts, batch, idx, it, cfg.seed, tok,
                               temperature=cfg.temperature)
    tokens, mask, rmask, full, P = ex["tokens"], ex["mask"], ex["rmask"], ex["full"], ex["P"]
    meter.lap("rollout")

    # -- reward service: score each response, cut at its EOS (generate pads after it)
    ex["score"], ex["has_eos"], scores = models.reward.score_groups(ex, [texts[i] for i in idx],
                                                                    it, cfg)
    meter.lap("reward")

    # -- reference log-probs: log π_ref of the sampled tokens, for the loss's KL term
    with torch.no_grad(), autocast(d.device):
        ref_logp = sequence_logprobs(models.ref, tokens, full, mask, cfg.temperature)[:, P - 1:-1]
    meter.lap("reference")

    # -- old log-probs: the trainer's own forward (ppo.py's reason: the ratio starts at exactly 1)
    with torch.no_grad(), autocast(d.device):
        old_logp, entropy = (t[:, P - 1:-1] for t in sequence_logprobs(  # (B, N) each
            models.policy, tokens, full, mask, cfg.temperature, entropy=True))
    gap = torch.where(rmask, (old_logp - ex["logprobs"][:, P:]).abs(), 0.0)
    meter.lap("old_logprobs")

    # -- advantages: each completion's score standardised within its group, over the global
    # batch's scores (the same numbers on any world size); no critic, no GAE, no whitening
    B = len(idx)
    adv = group_advantages(scores, cfg.group_size, cfg.scale_rewards)[d.rank * B:(d.rank + 1) * B]
    meter.lap("advantages")
    return {**ex, "texts": [texts[i] for i in idx], "old_logp": old_logp, "ref_logp": ref_logp,
            "adv": adv, "entropy": entropy, "gap": gap,
            "k1": kl_estimators(old_logp, ref_logp)[0]}


def update(models, opt, ex, it, accum, cfg, d, meter, ckpt_dir):
    """ppo_epochs passes over the global batch's completions, each over n_mini shuffled
    minibatches: one optimizer step each (ppo.py's loop: every rank holds the whole batch, so
    minibatch j is the same completions on any world size, each rank running its share). Each loss
    is a mean over its global minibatch's completions (mini_batch of them, on any world size; DDP
    then averages the ranks' gradients, hence the x world below). Returns the last step's grad
    norm."""
    g = gather_rollouts(ex, ("tokens", "mask", "full", "rmask", "old_logp", "ref_logp", "adv"), d)
    P, tokens, mask, full, rmask = g["P"], g["tokens"], g["mask"], g["full"], g["rmask"]
    plen, rlen = mask[:, :P].sum(1), rmask.sum(1)  # (R,) prompt and response tokens
    R, n_mini = cfg.rollout_batch, cfg.rollout_batch // cfg.mini_batch
    micro_batch = cfg.mini_batch // d.world // accum  # a rank's completions per forward
    gp = torch.Generator().manual_seed(cfg.seed + SEED_STRIDE * it)
    perms = [torch.randperm(R, generator=gp).to(d.device) for _ in range(cfg.ppo_epochs)]
    for e, j in itertools.product(range(cfg.ppo_epochs), range(n_mini)):
        rows = perms[e][j * cfg.mini_batch:(j + 1) * cfg.mini_batch]
        rows = rows[rlen[rows].argsort(descending=True, stable=True)]  # ppo.py's micro-batches
        rows = data.rank_slice(rows, d.rank, d.world)  # cut after the sort, as ppo.py
        for m in range(accum):
            r = rows[m * micro_batch:(m + 1) * micro_batch]
            lo, n = P - int(plen[r].max()), int(rlen[r].max())  # its columns: lo .. P+n-1
            with sync_grads(models.trainer, m == accum - 1):  # all-reduce on the last micro-step
                # -- policy forward
                with autocast(d.device):
                    logp = sequence_logprobs(models.trainer, tokens[r, lo:P + n], full[r, lo:P + n],
                                             mask[r, lo:P + n], cfg.temperature)
                logp = logp[:, P - 1 - lo:-1]  # (micro_batch, n): its response columns
                meter.lap("policy_forward")
                # -- loss: the clipped surrogate with the group advantage + β·k3 (Eq. 3)
                loss, clipfrac, approx_kl, kl = grpo_loss(
                    logp, g["old_logp"][r, :n], g["ref_logp"][r, :n], g["adv"][r],
                    rmask[r, :n], cfg.cliprange, cfg.kl_coef, cfg.mini_batch)
                (loss * d.world).backward()
                meter.lap("loss")  # the backward included
            p = models.policy.config
            meter.count(estimate_flops(p, len(r), P + n - lo, True, outputs=int(rlen[r].sum())),
                        model_flops(p, plen[r] + rlen[r], int(rlen[r].sum()), True))
            # per-token metrics weighted by their micro-batch's tokens, divided once in refresh
            w = rmask[r].sum()
            meter.add(pg=loss.detach(), clipfrac=clipfrac * w, approx_kl=approx_kl * w,
                      kl_loss=kl * w, update_tokens=w)
        # -- update
        grad_norm = torch.nn.utils.clip_grad_norm_(models.policy.parameters(),
                                                   cfg.grad_clip).item()
        stop_if_not_finite({"grad_norm": grad_norm}, f"iteration {it + 1} (epoch {e + 1}, "
                           f"minibatch {j + 1})", ckpt_dir,
                           "Try a lower --lr or a higher --kl_coef.")
        opt.step()
        opt.zero_grad(set_to_none=True)
        meter.lap("update")
    return grad_norm


def refresh(models, ex, tok, cfg, d, meter, metrics):
    """The new weights to the rollout engine, then the iteration's metrics, all ranks'."""
    # -- weight broadcast: the rollout engine samples the next iteration from the new policy
    n_bytes, _ = models.sync.push(models.policy, models.rollout)
    meter.lap("broadcast")

    # -- metrics and checkpoint: sums over the global batch. The hidden true reward is computed
    # outside the timed phases: for evaluation only (unless --reward true or oracle).
    true = [true_reward(t, y) for t, y in zip(ex["texts"], replies(tok, ex))]
    rmask = ex["rmask"]
    meter.count(*forward_flops(ex, models.policy, models.reward_model))
    meter.add(n=len(rmask), score=ex["score"], true=sum(true), kl=ex["k1"],
              entropy=msum(ex["entropy"], rmask), tokens=rmask.sum(), eos=ex["has_eos"],
              gap=ex["gap"], real=ex["mask"].sum(), adv_abs=ex["adv"].abs())
    s = meter.reduce()
    n, n_t, u = s["n"], s["tokens"], s["update_tokens"]
    steps = cfg.ppo_epochs * (cfg.rollout_batch // cfg.mini_batch)
    return {"score": s["score"] / n, "true_reward": s["true"] / n, "kl": s["kl"] / n,
            "entropy": s["entropy"] / n_t, "adv_abs": s["adv_abs"] / n,
            "approx_kl": s["approx_kl"] / u, "clipfrac": s["clipfrac"] / u,
            "loss/policy": s["pg"] / steps, "loss/kl": s["kl_loss"] / u, **metrics,
            "response_len": n_t / n, "eos_rate": s["eos"] / n, "logprob_gap": s["gap"] / n_t,
            "broadcast_MB": n_bytes / 2**20, **meter.timing(s["real"])}


# ==== evaluation and outputs


def finish(policy, tok, tok_path, cfg, d, log, meter, layout):
    """Sample the held-out prompts from the policy and from π_ref's own fp32 copy, then save."""
    ref = load_model(cfg.sft, d.device, head="lm")[0]
    ev = evaluate_held_out(policy, ref, tok, cfg, d, missing_eos_score=cfg.missing_eos_score)
    shares = meter.shares(log.print, "an iteration")
    save_outputs(policy, cfg.out_dir, {"stage": "grpo", "iterations": cfg.iterations,
                                       "sft": cfg.sft, "reward": cfg.reward},
                 {**ev, "iterations": cfg.iterations, "reward": cfg.reward,
                  "group_size": cfg.group_size, "time_shares": shares, "anatomy": layout},
                 d, tok_path)
    print_samples(ev, log.print)
    log.print(f"{summary(ev)} | saved {cfg.out_dir}/model.safetensors")


if __name__ == "__main__":
    main(parse_config(Config, doc=__doc__))
