"""Stage 3, the PPO way: RLHF with PPO as InstructGPT (Ouyang et al. 2022) ran it, with the details its
public reproductions agree on (Ziegler et al. 2019's lm-human-preferences, TRL's PPOTrainer, and Huang
et al. 2023, "The N Implementation Details of RLHF with PPO", cited below as "N details").

    python ppo.py                          # one process; builds out/sft and out/reward first if missing
    torchrun --nproc_per_node=8 ppo.py     # DDP: each rank rolls out its share of the prompts
    python ppo.py --reward true            # PPO-GT: the hidden true reward instead of r_φ (DPO paper, sec. 6.1)
    python ppo.py --help                   # every flag, e.g. --prompts my_prompts.jsonl --kl_coef 0.1

One iteration: rollout engine -> reward service -> reference and critic -> per-token rewards -> GAE
advantages -> PPO epochs of clipped updates -> weight broadcast back to the rollout engine. dpo.py keeps
only the update. Writes out/ppo/: model.safetensors + tokenizer.json (the policy), metrics.jsonl,
eval.json (true reward and KL against π_ref on held-out prompts) and a resumable checkpoint in ckpt/.
"""
import copy
import os
import shutil
import time
from contextlib import nullcontext
from dataclasses import asdict, dataclass

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

import data
import reward
import sft
from evaluate import evaluate_policy, print_samples
from model import anatomy, format_anatomy, estimate_flops, generate, save_model, token_logprobs
from plumbing import (Logger, all_reduce_sum, atomic_write_json, autocast, barrier, check, checkpoint_state,
                      clock, init_distributed, lap, lr_at, measure_peak_flops, parse_config, require_stage,
                      resume, save_checkpoint, split_batch, teardown)

# ==== config


@dataclass
class Config:
    out_dir: str = "out/ppo"  # this stage's folder: policy, metrics, eval, checkpoint
    sft: str = "out/sft/model.safetensors"  # π_ref: the policy starts here and the KL is measured to it
    reward_model: str = "out/reward/model.safetensors"  # r_φ, the reward service; the critic starts from it
    prompts: str = "out/task/prompts_train.jsonl"  # rollout prompts: JSONL {"prompt"}, or a prompt per line
    eval_prompts: str = "out/task/prompts_eval.jsonl"  # held-out prompts for eval.json
    reward: str = "model"  # "model": r_φ scores; "true": the hidden true reward (the PPO-GT baseline)
    iterations: int = 15  # rounds of rollout + update
    rollout_batch: int = 64  # prompts rolled out per iteration, all ranks together (one completion each)
    mini_batch: int = 32  # rollouts per optimizer step, all ranks together
    micro_batch_size: int = 4  # rollouts per forward on one rank (4: 8 ranks still divide a minibatch)
    ppo_epochs: int = 4  # passes over each rollout batch (lm-human-preferences and TRL: 4)
    max_prompt_len: int = 32  # a longer prompt keeps its BOS and last tokens; the response fills the block
    temperature: float = 1.0  # sampling temperature T; every log-prob divides the logits by it (N details)
    kl_coef: float = 0.05  # β of the per-token KL penalty (the initial one with --adaptive_kl)
    adaptive_kl: bool = False  # steer β toward kl_target (Ziegler et al. 2019 sec. 2.2)
    kl_target: float = 6.0  # nats per response the adaptive controller aims at
    kl_horizon: int = 10000  # rollouts over which the controller closes the gap
    gamma: float = 1.0  # discount: 1, the reward is paid once at the end of the episode
    lam: float = 0.95  # GAE λ
    cliprange: float = 0.2  # ε of the clipped policy ratio
    cliprange_value: float = 0.2  # how far a value prediction may move from its rollout value
    vf_coef: float = 0.1  # weight of the value loss in the shared loss (TRL's default)
    missing_eos_score: float = -1.0  # the score of a response that never emitted EOS (lm-human-preferences)
    lr: float = 1e-4  # peak AdamW learning rate, policy and critic (3e-5 moves this small model too slowly)
    warmup: int = 0  # linear warmup iterations, then cosine decay
    min_lr_frac: float = 1.0  # cosine ends at this fraction of lr (1: constant)
    grad_clip: float = 1.0  # max global grad norm, policy and critic together
    eval_k: int = 4  # completions per held-out prompt in the final evaluation
    ckpt_every: int = 10  # iterations between checkpoints (and one at the end)
    seed: int = 1337  # prompt order, sampling, minibatch order
    resume: bool = True  # continue from out_dir/ckpt if it holds this same config
    stop_after: int = 0  # stop after this many iterations of this run, checkpointed (0 = run to the end)


# -----------------------------------------------------------------------------
# Pure functions: estimators, rewards, advantages, losses. Per-token tensors are (B,N) over the N response
# columns; mask (B,N) is True on sampled tokens up to and including EOS (a prefix of each row).


def msum(x, mask):
    """Sum over the masked entries. torch.where, not x * mask: a PAD entry holding inf would give NaN."""
    return torch.where(mask, x, 0.0).sum()


def kl_estimators(logp, ref_logp):
    """Per-token estimates of KL(π‖π_ref) from tokens sampled from π (Schulman 2020, "Approximating KL
    Divergence"), with r = π_ref/π: k1 = -log r, unbiased but negative on some tokens: the penalty in the
    reward and evaluate.py's kl; k3 = (r - 1) - log r, unbiased too and never negative."""
    log_r = ref_logp - logp
    return -log_r, log_r.exp() - 1 - log_r


def per_token_rewards(logp, ref_logp, score, mask, kl_coef):
    """InstructGPT's objective (Ouyang et al. 2022, eq. 2) spread over tokens, as lm-human-preferences
    and TRL do: -β·(log π - log π_ref) on every response token, plus the sequence's score (B,) on its
    last one. The KL is in the reward, not in the loss, so GAE credits it to the tokens that caused it."""
    r = torch.where(mask, -kl_coef * (logp - ref_logp), 0.0)
    last = reward.last_index(mask)
    return r.index_put((torch.arange(len(r), device=r.device), last), score.to(r.dtype), accumulate=True)


def gae(rewards, values, mask, gamma, lam):
    """Generalized advantage estimation (Schulman et al. 2016, eq. 16): δ_t = r_t + γV_{t+1} - V_t,
    A_t = δ_t + γλ A_{t+1}. The episode ends at the last masked token (V after it is 0). rewards, values
    (B,N) -> advantages (B,N) and returns = advantages + values, the critic's targets; 0 off the mask."""
    rewards, values = torch.where(mask, rewards, 0.0), torch.where(mask, values, 0.0)
    adv, last = torch.zeros_like(rewards), torch.zeros_like(rewards[:, 0])
    for t in reversed(range(rewards.shape[1])):
        next_v = values[:, t + 1] if t + 1 < rewards.shape[1] else 0.0
        last = rewards[:, t] + gamma * next_v - values[:, t] + gamma * lam * last
        adv[:, t] = last
    return torch.where(mask, adv, 0.0), torch.where(mask, adv + values, 0.0)


def masked_whiten(x, mask, d=None):
    """(x - mean) / std over the masked entries of the whole batch, all ranks' (with d): PPO's advantage
    normalisation (N details; TRL's masked_whiten with the unbiased variance). 0 off the mask."""
    s = torch.stack([msum(x, mask), msum(x * x, mask), mask.sum()]).double()
    s0, s1, n = (all_reduce_sum(s, d) if d is not None else s).tolist()
    mean = s0 / n
    var = (s1 / n - mean * mean) * n / max(n - 1, 1)
    return torch.where(mask, (x - mean) / (var + 1e-8) ** 0.5, 0.0)


def ppo_policy_loss(logp, old_logp, adv, mask, cliprange, n=None):
    """The clipped surrogate (Schulman et al. 2017, eq. 7) as a loss: max(-A·ρ, -A·clip(ρ, 1-ε, 1+ε)),
    ρ = π/π_old per token, summed over masked tokens and divided by n (default: their count; the loop
    passes the global minibatch's token count). Returns (loss, clipfrac, approx_kl), the last two with
    the same normalisation; approx_kl is k3 of KL(π_old‖π) (CleanRL's)."""
    n = mask.sum() if n is None else n
    log_ratio = logp - old_logp
    ratio = log_ratio.exp()
    pg = -adv * ratio
    pg_clipped = -adv * ratio.clamp(1 - cliprange, 1 + cliprange)
    loss = msum(torch.max(pg, pg_clipped), mask) / n
    clipfrac = msum((pg_clipped > pg).float(), mask) / n
    approx_kl = msum((ratio - 1) - log_ratio, mask) / n
    return loss, clipfrac.detach(), approx_kl.detach()


def ppo_value_loss(values, old_values, returns, mask, cliprange_value, n=None):
    """Clipped value loss (lm-human-preferences, TRL): 0.5·max((V - R)², (V_clip - R)²) with
    V_clip = V_old + clip(V - V_old, -ε, ε), summed over masked tokens / n. Returns (loss, clipfrac)."""
    n = mask.sum() if n is None else n
    v_clipped = old_values + (values - old_values).clamp(-cliprange_value, cliprange_value)
    l, l_clipped = (values - returns) ** 2, (v_clipped - returns) ** 2
    return 0.5 * msum(torch.max(l, l_clipped), mask) / n, msum((l_clipped > l).float(), mask).detach() / n


def adaptive_kl_coef(kl_coef, kl, target, horizon, n):
    """Ziegler et al. 2019 sec. 2.2: β <- β·(1 + clip(KL/target - 1, -0.2, 0.2)·n/horizon), n rollouts."""
    return kl_coef * (1 + float(np.clip(kl / target - 1, -0.2, 0.2)) * n / horizon)


class PolicyAndValue(torch.nn.Module):
    """Policy and critic as one module, so one DDP wrapper syncs both in one all-reduce (TRL's
    PolicyAndValueWrapper). They share no weights: Stiennon et al. 2020 keep the critic separate so
    that early value updates cannot damage the pretrained policy."""

    def __init__(self, policy, critic):
        super().__init__()
        self.policy, self.critic = policy, critic

    def forward(self, idx, mask):
        return self.policy(idx, mask=mask), self.critic(idx, mask=mask)


def broadcast_weights(trainer, rollout_copy, d):
    """Ship the trainer's weights to the rollout engine: rank 0 packs its parameters into one flat buffer
    in the engine's dtype (bf16 on CUDA: half the bytes), broadcasts it over the process group, and
    every rank unpacks it into its rollout copy. Returns (bytes per receiving rank, seconds).
    Here DDP already keeps every rank's trainer identical, so this traffic stands for the real thing:
    where the rollout engine is a separate inference server (vLLM in OpenRLHF or TRL), the trainer's
    rank 0 broadcasts into the engines' process group after every update, exactly like this."""
    t0 = time.perf_counter()
    dst = list(rollout_copy.parameters())  # parameters() yields a tied weight once, in the same order
    sizes = [p.numel() for p in dst]
    if d.rank == 0:
        flat = torch.cat([p.detach().reshape(-1).to(dst[0].dtype) for p in trainer.parameters()])
    else:
        flat = torch.empty(sum(sizes), dtype=dst[0].dtype, device=d.device)
    if d.world > 1:
        dist.broadcast(flat, src=0)
    with torch.no_grad():
        for p, chunk in zip(dst, flat.split(sizes)):
            p.copy_(chunk.view_as(p))
    return flat.numel() * flat.element_size(), clock(d) - t0


PHASES = ("rollout", "reward", "ref_critic", "rewards", "advantages", "update", "broadcast")


def main(cfg):
    # ==== setup: ranks, device, inputs (a missing earlier stage is built with its defaults)
    d = init_distributed()
    say = lambda *a: print(*a, flush=True) if d.is_main else None  # noqa: E731  rank 0 speaks
    check(cfg.reward in ("model", "true"), f"--reward must be 'model' or 'true', not {cfg.reward!r}")
    require_stage(cfg.sft, Config.sft, lambda: sft.main(sft.Config()), "python sft.py", d, say)
    require_stage(cfg.reward_model, Config.reward_model, lambda: reward.main(reward.Config()), "python reward.py",
                  d, say)
    for path, default in [(cfg.prompts, Config.prompts), (cfg.eval_prompts, Config.eval_prompts)]:
        require_stage(path, default, lambda: sft.build_task(d), "python -c 'import data; data.ensure_task()'",
                      d, say)
    tok = data.load_tokenizer(os.path.join(os.path.dirname(cfg.sft), "tokenizer.json"))
    texts = data.read_prompts(cfg.prompts)
    K = cfg.max_prompt_len
    prompts = [p if len(p) <= K else p[:1] + p[len(p) - K + 1:] for p in (data.encode_prompt(tok, t) for t in texts)]
    check(len(prompts) >= cfg.rollout_batch, f"{cfg.prompts} has {len(prompts)} prompts, fewer than "
          f"--rollout_batch {cfg.rollout_batch}")
    check(cfg.rollout_batch % cfg.mini_batch == 0, f"--rollout_batch {cfg.rollout_batch} is not a multiple of "
          f"--mini_batch {cfg.mini_batch}")
    accum = split_batch(cfg.mini_batch, cfg.micro_batch_size, d.world)
    n_mini, B = cfg.rollout_batch // cfg.mini_batch, cfg.rollout_batch // d.world  # B: rollouts on this rank

    # ==== models resident in the training job
    # InstructGPT's five: the policy and the critic train; π_ref, r_φ and the rollout engine's copy of the
    # policy only run forward. The critic starts from r_φ (Ouyang et al. 2022 sec. 3.5; Stiennon et al. 2020).
    policy, _ = reward.load_trunk(cfg.sft, "lm", d.device)
    ref = reward.load_trunk(cfg.sft, "lm", d.device)[0].eval().requires_grad_(False)
    critic, rm_meta = reward.load_trunk(cfg.reward_model, "scalar", d.device)
    rm = reward.load_trunk(cfg.reward_model, "scalar", d.device)[0].eval().requires_grad_(False) \
        if cfg.reward == "model" else None  # PPO-GT scores with a Python function: no reward model resident
    # The rollout engine: an inference copy of the policy, in bf16 on CUDA (as vLLM serves it), refreshed
    # by broadcast_weights after every update
    rollout = copy.deepcopy(policy).to(torch.bfloat16 if d.device.type == "cuda" else torch.float32)
    rollout.eval().requires_grad_(False)
    T = policy.config.block_size
    check(cfg.max_prompt_len < T, f"--max_prompt_len {cfg.max_prompt_len} leaves no room in the {T}-token block")
    pv = PolicyAndValue(policy, critic)
    model = DDP(pv, device_ids=[d.local_rank] if d.device.type == "cuda" else None) if d.world > 1 else pv

    # ==== anatomy: what the job holds and what a token costs
    resident = {"policy": policy, "critic": critic, "reference": ref, **({"reward": rm} if rm is not None else {}),
                "rollout": rollout}
    fwd = lambda m: estimate_flops(m.config, 1, T) / T  # noqa: E731
    train_step = lambda m: estimate_flops(m.config, 1, T, backward=True) / T  # noqa: E731
    phase_flops = {"rollout": fwd(policy), "reward": fwd(rm) if rm is not None else 0.0,
                   "ref_critic": 2 * fwd(policy) + fwd(critic),  # old log-probs, log π_ref, values
                   "update": cfg.ppo_epochs * (train_step(policy) + train_step(critic))}
    layout = anatomy(resident, T)
    say(format_anatomy(layout, T))
    say("FLOPs per rollout token by phase: " + " | ".join(f"{k} {v / 1e6:.2f}M" for k, v in phase_flops.items())
        + f" | iteration {sum(phase_flops.values()) / 1e6:.2f}M")

    # ==== optimizer, schedule, resume
    # One AdamW over policy and critic and one backward of loss/policy + vf_coef·loss/value per minibatch,
    # as TRL and lm-human-preferences: the weights are disjoint and Adam scales each parameter on its own,
    # so it is two optimizers sharing one schedule, one grad clip, one DDP all-reduce and one checkpoint.
    opt = torch.optim.AdamW(pv.parameters(), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=0.0)
    ckpt_dir = os.path.join(cfg.out_dir, "ckpt")
    start, state = resume(ckpt_dir, cfg, {"policy": policy, "critic": critic, "optim": opt}, d.device, say,
                          free=("resume", "stop_after", "eval_k"))
    kl_coef = state.get("kl_coef", cfg.kl_coef)
    if start:
        broadcast_weights(policy, rollout, d)  # the rollout engine resumes with the restored policy
    log = Logger(cfg.out_dir, d, resume_step=start)  # metrics.jsonl keeps the iterations up to `start`
    peak = measure_peak_flops(d.device)
    log.print(f"rollout {cfg.rollout_batch} = {d.world} ranks x {B} | {cfg.ppo_epochs} epochs x {n_mini} minibatches "
              f"of {cfg.mini_batch} = {d.world} ranks x {accum} accumulation x {cfg.mini_batch // d.world // accum} | reward: "
              f"{'r_φ ' + cfg.reward_model if rm is not None else 'the hidden true reward (PPO-GT)'} | device "
              f"{d.device} | peak {peak / 1e9:.1f} GFLOP/s per rank (measured)")

    # ==== training loop
    end = cfg.iterations if not cfg.stop_after else min(cfg.iterations, start + cfg.stop_after)
    shares = dict.fromkeys(PHASES, 0.0)
    for it in range(start, end):
        times = {"t": clock(d)}
        t_iter = times["t"]
        lr = lr_at(it, cfg.iterations, cfg.lr, cfg.warmup, cfg.min_lr_frac)
        for g in opt.param_groups:
            g["lr"] = lr

        # -- rollout engine: one completion per prompt from the inference copy, with the KV cache
        idx = data.rank_slice(data.global_batch(len(prompts), cfg.rollout_batch, it, cfg.seed), d.rank, d.world)
        gen = torch.Generator(device=d.device).manual_seed(cfg.seed + 1_000_003 * it + d.rank)  # differs per rank
        P = max(len(prompts[i]) for i in idx)
        out = generate(rollout, [prompts[i] for i in idx], T - P, tok.eos, tok.pad, temperature=cfg.temperature,
                       generator=gen)
        tokens, mask = out["tokens"], out["mask"]  # (B, L): left-padded prompt, response, pad
        resp, rmask = tokens[:, P:], out["response_mask"][:, P:]  # (B, N): the response columns
        targets = resp.masked_fill(~rmask, -100)
        lap(times, "rollout", d)

        # -- reward service: score each response, cut at its EOS (generate already pads after it)
        has_eos = ((resp == tok.eos) & rmask).any(1)
        replies = [tok.decode(y[m].tolist()) for y, m in zip(resp, rmask)] if rm is None else None
        with torch.no_grad(), autocast(d.device):
            raw = (reward.score_at_last(rm(tokens, mask=mask).float(), mask) if rm is not None else
                   torch.tensor([data.true_reward(texts[i], y) for i, y in zip(idx, replies)], device=d.device))
        # No EOS (the block ran out): the score is replaced by the fixed missing_eos_score, lm-human-preferences'
        # rule (N details). Replaced, not lowered (TRL subtracts missing_eos_penalty): r_φ never saw an unfinished
        # response, so its score there means nothing, and a sum-of-words reward would still pay for rambling on.
        # -1 sits below π_ref's average completion, which r_φ's offset put at 0.
        score = torch.where(has_eos, raw, cfg.missing_eos_score)
        lap(times, "reward", d)

        # -- reference and critic: log π_ref, V, and the old log-probs from the trainer's own forward
        with torch.no_grad(), autocast(d.device):
            # The logits at column c-1 predict token c; every log-prob divides them by T (N details)
            logits = policy(tokens, mask=mask)[:, P - 1:-1].float()  # (B, N, V)
            old_logp = token_logprobs(logits, targets, cfg.temperature)
            lp = F.log_softmax(logits / cfg.temperature, -1)
            entropy = -(lp.exp() * lp).sum(-1)  # (B, N) nats of the sampling distribution
            ref_logp = token_logprobs(ref(tokens, mask=mask)[:, P - 1:-1], targets, cfg.temperature)
            old_values = torch.where(rmask, critic(tokens, mask=mask)[:, P - 1:-1].float(), 0.0)  # V before each token
            del logits, lp
        # Not the rollout engine's log-probs: a bf16 engine (or vLLM's kernels) gives other numbers for the same
        # tokens, and PPO's ratio must start at exactly 1. The gap says how far apart they were.
        gap = torch.where(rmask, (old_logp - out["logprobs"][:, P:]).abs(), 0.0)
        lap(times, "ref_critic", d)

        # -- per-token rewards
        k1, k3 = kl_estimators(old_logp, ref_logp)
        rewards = per_token_rewards(old_logp, ref_logp, score, rmask, kl_coef)
        lap(times, "rewards", d)

        # -- advantages
        adv, returns = gae(rewards, old_values, rmask, cfg.gamma, cfg.lam)
        adv = masked_whiten(adv, rmask, d)  # over the global batch: the same numbers for any world size
        lap(times, "advantages", d)

        # -- update: ppo_epochs passes, each over n_mini shuffled minibatches, one optimizer step each
        gp = torch.Generator().manual_seed(cfg.seed + 1_000_003 * it)
        perms = [torch.randperm(B, generator=gp).to(d.device) for _ in range(cfg.ppo_epochs)]
        mb = B // n_mini  # this rank's rows per minibatch
        # Each loss is a mean over its global minibatch's response tokens, for any world size and accumulation:
        # count them over the ranks first (DDP then averages the ranks' gradients, hence the x world below).
        n_tok = all_reduce_sum(torch.stack([rmask[p[j * mb:(j + 1) * mb]].sum() for p in perms
                                            for j in range(n_mini)]).float(), d).view(cfg.ppo_epochs, n_mini)
        stats = torch.zeros(5, device=d.device)  # loss/policy, loss/value, clipfrac, approx_kl, vf_clipfrac
        for e, perm in enumerate(perms):
            for j in range(n_mini):
                rows = perm[j * mb:(j + 1) * mb]
                for m in range(accum):
                    r = rows[m * cfg.micro_batch_size:(m + 1) * cfg.micro_batch_size]
                    sync = d.world == 1 or m == accum - 1  # all-reduce the grads only on the last micro-step
                    with (nullcontext() if sync else model.no_sync()), autocast(d.device):
                        logits, values = model(tokens[r], mask[r])
                        logp = token_logprobs(logits[:, P - 1:-1], targets[r], cfg.temperature)
                        pg, clipfrac, approx_kl = ppo_policy_loss(logp, old_logp[r], adv[r], rmask[r],
                                                                  cfg.cliprange, n_tok[e, j])
                        vf, vf_clipfrac = ppo_value_loss(values[:, P - 1:-1].float(), old_values[r], returns[r],
                                                         rmask[r], cfg.cliprange_value, n_tok[e, j])
                        ((pg + cfg.vf_coef * vf) * d.world).backward()
                    stats += torch.stack([pg.detach(), vf.detach(), clipfrac, approx_kl, vf_clipfrac])
                grad_norm = torch.nn.utils.clip_grad_norm_(pv.parameters(), cfg.grad_clip)  # all-reduced: ranks agree
                if not torch.isfinite(grad_norm).item():
                    last = checkpoint_state(ckpt_dir)
                    kept = f"{ckpt_dir} at iteration {last['step']}" if last else "none (none was written yet)"
                    raise SystemExit(f"error: non-finite grad norm at iteration {it + 1} (epoch {e + 1}, minibatch "
                                     f"{j + 1}): stopped before the update; the last good checkpoint is kept: {kept}. "
                                     f"Try a lower --lr or a higher --kl_coef.")
                opt.step()
                opt.zero_grad(set_to_none=True)
        lap(times, "update", d)

        # -- weight broadcast: the rollout engine samples the next iteration from the new policy
        n_bytes, _ = broadcast_weights(policy, rollout, d)
        lap(times, "broadcast", d)

        # Metrics over the global batch. The hidden true reward is computed outside the timed phases: it is
        # for evaluation only, PPO never sees it (unless --reward true).
        dt = times.pop("t") - t_iter
        if replies is None:
            replies = [tok.decode(y[m].tolist()) for y, m in zip(resp, rmask)]
        true = torch.tensor([data.true_reward(texts[i], y) for i, y in zip(idx, replies)], device=d.device)
        res = torch.where(rmask, returns - old_values, 0.0)
        s = all_reduce_sum(torch.stack([
            torch.tensor(float(B), device=d.device), score.sum(), raw.sum(), true.sum(), k1.sum(), k3.sum(),
            msum(entropy, rmask), rmask.sum(), has_eos.sum(), gap.sum(), mask.sum(),
            returns.sum(), (returns ** 2).sum(), res.sum(), (res ** 2).sum()]).double(), d).tolist()
        n, n_t = s[0], s[7]
        stats = (all_reduce_sum(stats, d) / (d.world * cfg.ppo_epochs * n_mini)).tolist()
        var_ret, var_res = s[12] / n_t - (s[11] / n_t) ** 2, s[14] / n_t - (s[13] / n_t) ** 2
        flops = B * tokens.shape[1] * sum(phase_flops.values())  # this rank's, at the padded length
        metrics = {"score": s[1] / n, "true_reward": s[3] / n, "kl": s[4] / n, "kl_k3": s[5] / n, "kl_coef": kl_coef,
                   "entropy": s[6] / n_t, "approx_kl": stats[3], "clipfrac": stats[2], "vf_clipfrac": stats[4],
                   "explained_variance": 1 - var_res / max(var_ret, 1e-12), "loss/policy": stats[0],
                   "loss/value": stats[1], "grad_norm": grad_norm.item(), "lr": lr, "response_len": n_t / n,
                   "eos_rate": s[8] / n, "logprob_gap": s[9] / n_t, "broadcast_MB": n_bytes / 2**20,
                   "tokens_per_sec": s[10] / dt, "mfu": flops / dt / peak, "time/iteration": 1000 * dt, **times,
                   **{f"share/{k}": times[f"time/{k}"] / (1000 * dt) for k in PHASES}}
        log.log(it + 1, cfg.iterations, metrics)
        for k in PHASES:
            shares[k] += metrics[f"share/{k}"] / (end - start)
        if cfg.adaptive_kl:
            kl_coef = adaptive_kl_coef(kl_coef, s[4] / n, cfg.kl_target, cfg.kl_horizon, cfg.rollout_batch)
        if d.is_main and ((it + 1) % cfg.ckpt_every == 0 or it + 1 == end):
            save_checkpoint(ckpt_dir, it + 1, {"policy": policy, "critic": critic, "optim": opt},
                            {"config": asdict(cfg), "kl_coef": kl_coef})
    barrier(d)  # rank 0's checkpoint is on disk before any rank moves on
    if end < cfg.iterations:
        log.print(f"stopped after {end - start} iterations (--stop_after); run again to resume from {end}")
        return teardown(d)

    # ==== evaluation and outputs
    res = evaluate_policy(policy, ref, tok, data.read_prompts(cfg.eval_prompts), d, k=cfg.eval_k)  # seed 0, as dpo.py
    if d.is_main:
        if end > start:
            log.print("share of an iteration: " + " | ".join(f"{k} {v:.1%}" for k, v in shares.items()))
        save_model(policy, os.path.join(cfg.out_dir, "model.safetensors"),
                   {"stage": "ppo", "iterations": cfg.iterations, "sft": cfg.sft, "reward": cfg.reward})
        tok_path = os.path.join(os.path.dirname(cfg.sft), "tokenizer.json")
        shutil.copyfile(tok_path, os.path.join(cfg.out_dir, "tokenizer.json.tmp"))
        os.replace(os.path.join(cfg.out_dir, "tokenizer.json.tmp"), os.path.join(cfg.out_dir, "tokenizer.json"))
        atomic_write_json(os.path.join(cfg.out_dir, "eval.json"), {
            **res, "iterations": cfg.iterations, "reward": cfg.reward, "kl_coef": kl_coef,
            "reward_model_val_accuracy": rm_meta.get("val_accuracy"), "time_shares": shares, "anatomy": layout})
        print_samples(res, log.print)
        log.print(f"true reward {res['true_reward']:+.3f} ± {res['true_reward_std']:.3f} (π_ref "
                  f"{res['ref_true_reward']:+.3f} ± {res['ref_true_reward_std']:.3f}) | KL(π‖π_ref) "
                  f"{res['kl']:.3f} nats | win rate {res['win_rate']:.3f} | saved {cfg.out_dir}/model.safetensors")
    barrier(d)
    teardown(d)


if __name__ == "__main__":
    main(parse_config(Config, doc=__doc__))
