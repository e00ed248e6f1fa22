"""RLHF with PPO, as InstructGPT (Ouyang et al. 2022) ran it: the job DPO replaces.

    python ppo.py                         # one process; builds out/sft and out/reward if missing
    torchrun --nproc_per_node=8 ppo.py    # DDP: each rank rolls out its share of the prompts
    torchrun --nproc_per_node=8 ppo.py --fsdp   # FSDP2: all four models sharded 8 ways
    python ppo.py --reward true           # PPO-GT: the hidden true reward instead of r_φ (DPO §6.1)
    python ppo.py --help                  # every flag, e.g. --prompts my.jsonl --kl_coef 0.1

With the details its public reproductions agree on (Ziegler et al. 2019's lm-human-preferences,
TRL's PPOTrainer, and Huang et al. 2023, "The N Implementation Details of RLHF with PPO", cited
below as "N details"). One iteration: batch of prompts -> rollout engine -> reward service ->
reference log-probs -> old log-probs and values -> per-token rewards with the KL penalty -> GAE
advantages -> PPO epochs of policy forward, clipped loss and update -> weight broadcast back to the
rollout engine. Read it beside dpo.py, which keeps the batch, the reference log-probs (from a
file), the policy forward, a loss and the update. Writes out/ppo/: model.safetensors +
tokenizer.json (the policy), metrics.jsonl, eval.json (true reward and KL against π_ref on held-out
prompts) and a resumable checkpoint in ckpt/.
"""
import copy
import itertools
import os
import time
from dataclasses import asdict, dataclass

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

import data
import reward
import sft
from evaluate import evaluate_policy, print_samples, summary, task_pool_best
from model import (anatomy, estimate_flops, format_anatomy, freeze, generate, generate_flops,
                   matmul_shapes, model_flops, save_model, sequence_logprobs)
from plumbing import (Logger, all_reduce_sum, atomic_copy, atomic_write_json, autocast, barrier,
                      check, clock, compile_metrics, full_state, gathered, init_distributed,
                      input_fingerprint, lap, lr_at, measure_peak_flops, parse_config, precision,
                      prepare_outputs, reduce_sums, require_stage, resume, save_checkpoint, sharded,
                      split_batch, stop_if_diverged, stop_if_not_finite, sync_grads, teardown, wrap)

# ==== config


@dataclass
class Config:
    out_dir: str = "out/ppo"  # this stage's folder: policy, metrics, eval, checkpoint
    sft: str = "out/sft/model.safetensors"  # π_ref: the policy starts here, KL is to it
    reward_model: str = "out/reward/model.safetensors"  # r_φ, the reward service; critic's init
    prompts: str = "out/task/prompts_train.jsonl"  # rollout prompts: JSONL {"prompt"}, or lines
    eval_prompts: str = "out/task/prompts_eval.jsonl"  # held-out prompts for eval.json
    reward: str = "model"  # "model": r_φ scores; "true": the hidden true reward (PPO-GT baseline)
    iterations: int = 30  # rounds of rollout + update (tune.py: true reward flattens at 30-35)
    rollout_batch: int = 64  # prompts rolled out per iteration, all ranks (one completion each)
    mini_batch: int = 32  # rollouts per optimizer step, all ranks together
    micro_batch_size: int = 16  # at most this many rollouts per forward on one rank (8 ranks: 4)
    ppo_epochs: int = 4  # passes over each rollout batch (lm-human-preferences and TRL: 4)
    max_prompt_len: int = 32  # a longer prompt keeps BOS and its last tokens; the response fills
    temperature: float = 1.0  # sampling temperature T; every log-prob divides the logits by it
    kl_coef: float = 0.05  # β of the per-token KL penalty (the initial one with --adaptive_kl)
    adaptive_kl: bool = False  # steer β toward kl_target (Ziegler et al. 2019 sec. 2.2)
    kl_target: float = 6.0  # nats per response the adaptive controller aims at
    kl_horizon: int = 10000  # rollouts over which the controller closes the gap
    gamma: float = 1.0  # discount: 1, the reward is paid once at the end of the episode
    lam: float = 0.95  # GAE λ
    cliprange: float = 0.2  # ε of the clipped policy ratio
    cliprange_value: float = 0.2  # how far a value prediction may move from its rollout value
    vf_coef: float = 0.1  # weight of the value loss in the shared loss (TRL's default)
    missing_eos_score: float = -1.0  # score of a response that never emitted EOS (N details)
    lr: float = 1e-4  # peak AdamW lr, policy and critic (tune.py: 3e-5 too slow, 3e-4 lower)
    warmup: int = 0  # linear warmup iterations, then cosine decay
    min_lr_frac: float = 1.0  # cosine ends at this fraction of lr (1: constant)
    grad_clip: float = 1.0  # max global grad norm, policy and critic together
    eval_k: int = 4  # completions per held-out prompt in the final evaluation
    ckpt_every: int = 10  # iterations between checkpoints (and one at the end)
    seed: int = 1337  # prompt order, sampling, minibatch order
    compile: bool = False  # torch.compile the trainer, policy and critic (worth it on CUDA)
    fsdp: bool = False  # shard weights, grads and AdamW state over the ranks (FSDP2), not DDP
    resume: bool = True  # continue from out_dir/ckpt if it holds this same config
    stop_after: int = 0  # stop after this many iterations, checkpointed (0 = run to the end)


# ==== losses and estimators: pure functions
# Per-token tensors are (B, N) over the N response columns; mask (B, N) is True on sampled tokens up
# to and including EOS (a prefix of each row).


def msum(x, mask):
    """Sum over the masked entries. torch.where, not x * mask: a PAD entry holding inf gives NaN."""
    return torch.where(mask, x, 0.0).sum()


def kl_estimators(logp, ref_logp):
    """Per-token estimates of KL(π‖π_ref) from tokens sampled from π (Schulman 2020, "Approximating
    KL Divergence"), with r = π_ref/π: k1 = -log r, unbiased but negative on some tokens: the
    penalty in the reward and evaluate.py's kl; k3 = (r - 1) - log r, unbiased too, never
    negative."""
    log_r = ref_logp - logp
    return -log_r, log_r.exp() - 1 - log_r


def per_token_rewards(logp, ref_logp, score, mask, kl_coef):
    """InstructGPT's objective (Ouyang et al. 2022, eq. 2) spread over tokens, as
    lm-human-preferences and TRL do: the KL penalty -β·(log π - log π_ref) on every response token,
    plus the sequence's score (B,) on its last one. The KL is in the reward, not in the loss, so GAE
    credits it to the tokens that caused it."""
    r = torch.where(mask, -kl_coef * (logp - ref_logp), 0.0)
    last = reward.last_index(mask)
    rows = torch.arange(len(r), device=r.device)
    return r.index_put((rows, last), score.to(r.dtype), accumulate=True)


def gae(rewards, values, mask, gamma, lam):
    """Generalized advantage estimation (Schulman et al. 2016, eq. 16): δ_t = r_t + γV_{t+1} - V_t,
    A_t = δ_t + γλ A_{t+1}. The episode ends at the last masked token (V after it is 0). rewards,
    values (B,N) -> advantages (B,N) and returns = advantages + values, the critic's targets; 0 off
    the mask."""
    rewards, values = torch.where(mask, rewards, 0.0), torch.where(mask, values, 0.0)
    adv, last = torch.zeros_like(rewards), torch.zeros_like(rewards[:, 0])
    for t in reversed(range(rewards.shape[1])):
        next_v = values[:, t + 1] if t + 1 < rewards.shape[1] else 0.0
        last = rewards[:, t] + gamma * next_v - values[:, t] + gamma * lam * last
        adv[:, t] = last
    return torch.where(mask, adv, 0.0), torch.where(mask, adv + values, 0.0)


def masked_whiten(x, mask, d=None):
    """(x - mean) / std over the masked entries of the whole batch, all ranks' (with d): PPO's
    advantage normalisation (N details; TRL's masked_whiten, unbiased variance). 0 off the mask."""
    s = torch.stack([msum(x, mask), msum(x * x, mask), mask.sum()]).double()
    s0, s1, n = (all_reduce_sum(s, d) if d is not None else s).tolist()
    mean = s0 / n
    var = (s1 / n - mean * mean) * n / max(n - 1, 1)
    return torch.where(mask, (x - mean) / (var + 1e-8) ** 0.5, 0.0)


def ppo_policy_loss(logp, old_logp, adv, mask, cliprange, n=None):
    """The clipped surrogate (Schulman et al. 2017, eq. 7) as a loss: max(-A·ρ, -A·clip(ρ, 1-ε,
    1+ε)), ρ = π/π_old per token, summed over masked tokens and divided by n (default: their count;
    the loop passes the global minibatch's token count). Returns (loss, clipfrac, approx_kl), the
    last two with the same normalisation; approx_kl is k3 of KL(π_old‖π) (CleanRL's)."""
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
    V_clip = V_old + clip(V - V_old, -ε, ε), summed over masked tokens / n. Returns (loss,
    clipfrac)."""
    n = mask.sum() if n is None else n
    v_clipped = old_values + (values - old_values).clamp(-cliprange_value, cliprange_value)
    sq, sq_clipped = (values - returns) ** 2, (v_clipped - returns) ** 2
    clipfrac = msum((sq_clipped > sq).float(), mask).detach() / n
    return 0.5 * msum(torch.max(sq, sq_clipped), mask) / n, clipfrac


def adaptive_kl_coef(kl_coef, kl, target, horizon, n):
    """Ziegler et al. 2019 sec. 2.2: β <- β·(1 + clip(KL/target - 1, -0.2, 0.2)·n/horizon), n
    rollouts."""
    return kl_coef * (1 + float(np.clip(kl / target - 1, -0.2, 0.2)) * n / horizon)


# ==== helpers the loop calls


class PolicyAndValue(torch.nn.Module):
    """Policy and critic as one module, so one DDP wrapper syncs both in one all-reduce (TRL's
    PolicyAndValueWrapper). They share no weights: Stiennon et al. 2020 keep the critic separate so
    that early value updates cannot damage the pretrained policy."""

    def __init__(self, policy, critic):
        super().__init__()
        self.policy, self.critic = policy, critic

    def forward(self, idx, mask, targets, temperature):
        """Per-token log-probs of the targets (B,T) (model.sequence_logprobs: the LM head only where
        a target exists) and values (B,T)."""
        return (sequence_logprobs(self.policy, idx, targets, mask, temperature),
                self.critic(idx, mask=mask))


def broadcast_weights(trainer, rollout_copy, d):
    """Ship the trainer's weights to the rollout engine: rank 0 packs its parameters into one flat
    buffer in the engine's dtype (bf16 on CUDA: half the bytes), broadcasts it over the process
    group, and every rank unpacks it into its rollout copy. Returns (bytes per receiving rank,
    seconds). Here DDP already keeps every rank's trainer identical, so this traffic stands for the
    real thing: where the rollout engine is a separate inference server (vLLM in OpenRLHF or TRL),
    the trainer's rank 0 broadcasts into the engines' process group after every update like this.
    With --fsdp, rank 0 holds 1/world of the trainer: every rank first all-gathers its whole
    weights (gathered), block by block, then the same broadcast follows. That gather is the
    sharding's price for a refresh: 4 bytes per policy parameter (fp32) per rank, (world - 1) /
    world of it received from the others, every iteration, on top of the broadcast's (2 bytes per
    parameter in bf16); at 7B on 8 ranks, 24.5 GiB per rank gathered, 12.2 GiB broadcast. It also
    holds the whole fp32 policy on each rank while it lasts."""
    t0 = time.perf_counter()
    dst = list(rollout_copy.parameters())  # parameters() yields a tied weight once, in one order
    sizes = [p.numel() for p in dst]
    with gathered(trainer):
        if d.rank == 0:
            flat = torch.cat([p.detach().reshape(-1).to(dst[0].dtype)
                              for p in trainer.parameters()])
        else:
            flat = torch.empty(sum(sizes), dtype=dst[0].dtype, device=d.device)
    if d.world > 1:
        dist.broadcast(flat, src=0)
    with torch.no_grad():
        for p, chunk in zip(dst, flat.split(sizes)):
            p.copy_(chunk.view_as(p))
    return flat.numel() * flat.element_size(), clock(d) - t0


# ppo.py's divergence rule (sft, reward and dpo bound their loss instead, plumbing.DIVERGED): an
# iteration whose mean approx_kl, the k3 estimate of KL(π_old‖π) per token over its minibatches, is
# above this has left the trust region the clip keeps. Measured on the built-in task: 0.04 at
# --lr 1e-3, 0.27 at 1e-2 (still learning); 5.4 at 1e-1 and 283 at 1 (the policy collapsed).
MAX_APPROX_KL = 1.0

PHASES = ("batch", "rollout", "reward", "reference", "values", "rewards", "advantages",
          "policy_forward", "loss", "update", "broadcast")


def main(cfg):
    # ==== setup: ranks, device, inputs (a missing earlier stage is built with its defaults)
    d = init_distributed()
    log = Logger(cfg.out_dir, d)
    check(cfg.reward in ("model", "true"),
          f"--reward must be 'model' or 'true', not {cfg.reward!r}")
    ckpt_dir = os.path.join(cfg.out_dir, "ckpt")
    prepare_outputs({cfg.out_dir: "--out_dir", ckpt_dir: "--out_dir"}, d, log.print)
    require_stage(cfg.sft, Config.sft, lambda: sft.main(sft.Config()), "python sft.py", d,
                  log.print)
    require_stage(cfg.reward_model, Config.reward_model, lambda: reward.main(reward.Config()),
                  "python reward.py", d, log.print)
    for path, default in [(cfg.prompts, Config.prompts), (cfg.eval_prompts, Config.eval_prompts)]:
        require_stage(path, default, lambda: sft.build_task(d), "python data.py", d, log.print)
    tok_path = os.path.join(os.path.dirname(cfg.sft), "tokenizer.json")
    check(os.path.exists(tok_path), f"{tok_path} does not exist: π_ref's tokenizer is read from "
          "the folder of --sft")
    tok = data.load_tokenizer(tok_path)
    texts = data.read_prompts(cfg.prompts)
    prompts = [data.truncate_prompt(data.encode_prompt(tok, t), cfg.max_prompt_len) for t in texts]
    check(len(prompts) >= cfg.rollout_batch, f"{cfg.prompts} has {len(prompts)} prompts, fewer "
          f"than --rollout_batch {cfg.rollout_batch}")
    check(cfg.rollout_batch % cfg.mini_batch == 0, f"--rollout_batch {cfg.rollout_batch} is not "
          f"a multiple of --mini_batch {cfg.mini_batch}")
    # what the weights are trained from: a resumed run checks it is the same
    inputs = input_fingerprint({"--sft": cfg.sft, "--reward_model": cfg.reward_model,
                                "tokenizer": tok_path, "--prompts": cfg.prompts}, prompts)
    accum = split_batch(cfg.mini_batch, cfg.micro_batch_size, d.world)
    n_mini, B = cfg.rollout_batch // cfg.mini_batch, cfg.rollout_batch // d.world
    mb = B // n_mini  # this rank's rollouts per minibatch
    micro = mb // accum  # and per forward

    # ==== models resident in the training job
    # InstructGPT's five: the policy and the critic train; π_ref, r_φ and the rollout engine's copy
    # of the policy only run forward. The critic starts from r_φ (Ouyang et al. 2022 sec. 3.5).
    # The frozen ones hold bf16 matmul weights under bf16 autocast (model.freeze: the same outputs).
    bf16 = precision(d.device) == "bf16"
    policy, _ = reward.load_trunk(cfg.sft, "lm", d.device)
    ref = freeze(reward.load_trunk(cfg.sft, "lm", d.device)[0], bf16)
    ref = wrap(ref, d, fsdp=cfg.fsdp)  # the frozen models are sharded too with --fsdp
    critic, rm_meta = reward.load_trunk(cfg.reward_model, "scalar", d.device)
    rm = None  # PPO-GT scores with a Python function: no reward model resident
    if cfg.reward == "model":
        rm = wrap(freeze(reward.load_trunk(cfg.reward_model, "scalar", d.device)[0], bf16), d,
                  fsdp=cfg.fsdp)
    # The rollout engine: an inference copy of the policy, all bf16 under bf16 autocast (as vLLM
    # serves it), refreshed by broadcast_weights after every iteration's updates
    rollout = copy.deepcopy(policy).to(torch.bfloat16 if bf16 else torch.float32)
    rollout.eval().requires_grad_(False)
    T = policy.config.block_size
    check(cfg.max_prompt_len < T,
          f"--max_prompt_len {cfg.max_prompt_len} leaves no room in the {T}-token block")
    pv = PolicyAndValue(policy, critic)
    # DDP over the ranks (--fsdp: policy and critic each sharded in place), then torch.compile
    model = wrap(pv, d, cfg.compile, cfg.fsdp)

    # ==== anatomy: what the job holds and what a token costs
    resident = {"policy": policy, "critic": critic, "reference": ref,
                **({"reward": rm} if rm is not None else {}), "rollout": rollout}
    fwd = lambda m: estimate_flops(m.config, 1, T) / T  # noqa: E731
    train_step = lambda m: estimate_flops(m.config, 1, T, backward=True) / T  # noqa: E731
    phase_flops = {"rollout": fwd(policy), "reward": fwd(rm) if rm is not None else 0.0,
                   "ref_critic": 2 * fwd(policy) + fwd(critic),  # log π_ref, log π_old, values
                   "update": cfg.ppo_epochs * (train_step(policy) + train_step(critic))}
    layout = anatomy(resident, T)
    log.print(format_anatomy(layout, T))
    log.print("FLOPs per rollout token by phase: "
              + " | ".join(f"{k} {v / 1e6:.2f}M" for k, v in phase_flops.items())
              + f" | iteration {sum(phase_flops.values()) / 1e6:.2f}M")

    # ==== optimizer, schedule, resume
    # One AdamW over policy and critic and one backward of loss/policy + vf_coef·loss/value per
    # minibatch, as TRL and lm-human-preferences: the weights are disjoint and Adam scales each
    # parameter on its own, so it is two optimizers sharing one schedule, one grad clip, one DDP
    # all-reduce and one checkpoint.
    opt = torch.optim.AdamW(pv.parameters(), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=0.0)
    start, state = resume(ckpt_dir, cfg, {"policy": policy, "critic": critic, "optim": opt},
                          d.device, log.print, inputs,
                          free=("resume", "stop_after", "eval_k", "compile", "fsdp"))
    kl_coef = state.get("kl_coef", cfg.kl_coef)
    if start:
        broadcast_weights(policy, rollout, d)  # the rollout engine resumes with the restored policy
    log.start(start)  # metrics.jsonl keeps the iterations up to `start`
    peak = measure_peak_flops(d.device, matmul_shapes(policy.config, B * T))
    scorer = f"r_φ {cfg.reward_model}" if rm is not None else "the hidden true reward (PPO-GT)"
    log.print(f"rollout {cfg.rollout_batch} = {d.world} ranks x {B} | {cfg.ppo_epochs} epochs x "
              f"{n_mini} minibatches of {cfg.mini_batch} = {d.world} ranks x {accum} accumulation "
              f"x {micro} | reward: {scorer} | device {d.device} | peak {peak / 1e9:.1f} GFLOP/s "
              f"per rank (measured)" + (" | sharded (FSDP2)" if sharded(pv) else ""))

    # ==== training loop
    end = cfg.iterations if not cfg.stop_after else min(cfg.iterations, start + cfg.stop_after)
    shares = dict.fromkeys(PHASES, 0.0)
    timed = end - start - (1 if cfg.compile else 0)  # a compiled run's first iteration compiles
    for it in range(start, end):
        times = {"t": clock(d)}
        t_iter = times["t"]
        lr = lr_at(it, cfg.iterations, cfg.lr, cfg.warmup, cfg.min_lr_frac)
        for g in opt.param_groups:
            g["lr"] = lr

        # -- batch: this rank's share of the iteration's global batch of prompts
        batch = data.global_batch(len(prompts), cfg.rollout_batch, it, cfg.seed)
        idx = data.rank_slice(batch, d.rank, d.world)
        lap(times, "batch", d)

        # -- rollout engine: one completion per prompt from the inference copy, with the KV cache.
        # Rollout j of the global batch draws its tokens from row j of uniforms seeded by (seed,
        # iteration), within the global batch's budget: the same rollouts on any world size.
        rng = torch.Generator().manual_seed(cfg.seed + 1_000_003 * it + 1)  # +1: not gp's stream
        n_new = T - max(len(prompts[i]) for i in batch)
        U = torch.rand(cfg.rollout_batch, n_new, generator=rng)[d.rank * B:(d.rank + 1) * B]
        P = max(len(prompts[i]) for i in idx)  # generate left-pads this rank's prompts to P
        out = generate(rollout, [prompts[i] for i in idx], n_new, tok.eos, tok.pad,
                       temperature=cfg.temperature, uniforms=U.to(d.device))
        tokens, mask = out["tokens"], out["mask"]  # (B, L): left-padded prompt, response, pad
        resp, rmask = tokens[:, P:], out["response_mask"][:, P:]  # (B, N): the response columns
        targets = resp.masked_fill(~rmask, -100)
        full = F.pad(targets, (P - 1, 1), value=-100)  # (B, L): column c-1 predicts the token at c
        plen, rlen = mask[:, :P].sum(1), rmask.sum(1)  # (B,) prompt and response tokens
        lap(times, "rollout", d)

        # -- reward service: score each response, cut at its EOS (generate pads after it)
        has_eos = ((resp == tok.eos) & rmask).any(1)
        decode = lambda: [tok.decode(y[m].tolist()) for y, m in zip(resp, rmask)]  # noqa: E731
        replies = None
        if rm is not None:
            with torch.no_grad(), autocast(d.device):
                raw = reward.score_at_last(rm(tokens, mask=mask).float(), mask)
        else:
            replies = decode()
            raw = torch.tensor([data.true_reward(texts[i], y) for i, y in zip(idx, replies)],
                               device=d.device)
        # No EOS (the block ran out): the score is replaced by the fixed missing_eos_score,
        # lm-human-preferences' rule (N details). Replaced, not lowered (TRL subtracts its
        # missing_eos_penalty): r_φ never saw an unfinished response, so its score there means
        # nothing, and a sum-of-words reward would still pay for rambling on. -1 sits below
        # π_ref's average completion, which r_φ's offset put at 0.
        score = torch.where(has_eos, raw, cfg.missing_eos_score)
        lap(times, "reward", d)

        # -- reference log-probs: log π_ref of the sampled tokens, from the resident π_ref
        # (the logits at column c-1 predict token c; every log-prob divides them by T, N details)
        with torch.no_grad(), autocast(d.device):
            ref_logp = sequence_logprobs(ref, tokens, full, mask, cfg.temperature)[:, P - 1:-1]
        lap(times, "reference", d)

        # -- old log-probs and values: the trainer's own forward, and the critic's V before each
        # token. Not the rollout engine's log-probs: a bf16 engine (or vLLM's kernels) gives other
        # numbers for the same tokens, and PPO's ratio must start at exactly 1. The gap says how
        # far apart they were.
        with torch.no_grad(), autocast(d.device):
            old_logp, entropy = (t[:, P - 1:-1] for t in sequence_logprobs(  # (B, N) each
                policy, tokens, full, mask, cfg.temperature, entropy=True))
            old_values = torch.where(rmask, critic(tokens, mask=mask)[:, P - 1:-1].float(), 0.0)
        gap = torch.where(rmask, (old_logp - out["logprobs"][:, P:]).abs(), 0.0)
        lap(times, "values", d)

        # -- per-token rewards with the KL penalty: -β·(log π_old - log π_ref) on every token, and
        # the score on the last
        k1, k3 = kl_estimators(old_logp, ref_logp)
        rewards = per_token_rewards(old_logp, ref_logp, score, rmask, kl_coef)
        lap(times, "rewards", d)

        # -- advantages: GAE, whitened over the global batch (the same numbers for any world size)
        adv, returns = gae(rewards, old_values, rmask, cfg.gamma, cfg.lam)
        adv = masked_whiten(adv, rmask, d)
        lap(times, "advantages", d)

        # ppo_epochs passes, each over n_mini shuffled minibatches: one optimizer step each. Each
        # loss is a mean over its global minibatch's response tokens, for any world size and
        # accumulation: count them over the ranks first (DDP then averages the ranks' gradients,
        # hence the x world below).
        gp = torch.Generator().manual_seed(cfg.seed + 1_000_003 * it)
        perms = [torch.randperm(B, generator=gp).to(d.device) for _ in range(cfg.ppo_epochs)]
        n_tok = torch.stack([rmask[p[j * mb:(j + 1) * mb]].sum() for p in perms
                             for j in range(n_mini)]).float()
        n_tok = all_reduce_sum(n_tok, d).view(cfg.ppo_epochs, n_mini)
        sums = dict.fromkeys(["pg", "vf", "clipfrac", "approx_kl", "vf_clipfrac"], 0.0)
        flops = {"model": 0.0, "hardware": 0.0}  # the update's; the other phases' are added below
        for e, j in itertools.product(range(cfg.ppo_epochs), range(n_mini)):
            rows = perms[e][j * mb:(j + 1) * mb]
            # micro-batches of similar response lengths, each cut to its own longest prompt (left)
            # and response (right): the minibatch, and so its loss, is the same; padding is not
            rows = rows[rlen[rows].argsort(descending=True, stable=True)]
            for m in range(accum):
                r = rows[m * micro:(m + 1) * micro]
                lo, n = P - int(plen[r].max()), int(rlen[r].max())  # its columns: lo .. P+n-1
                with sync_grads(model, m == accum - 1):  # all-reduce on the last micro-step only
                    # -- policy forward: policy and critic, one DDP module
                    with autocast(d.device):
                        logp, values = model(tokens[r, lo:P + n], mask[r, lo:P + n],
                                             full[r, lo:P + n], cfg.temperature)
                    # (micro, n): its response columns
                    logp, values = logp[:, P - 1 - lo:-1], values[:, P - 1 - lo:-1].float()
                    lap(times, "policy_forward", d)
                    # -- loss: the clipped surrogate + vf_coef · the clipped value loss
                    pg, clipfrac, approx_kl = ppo_policy_loss(logp, old_logp[r, :n], adv[r, :n],
                                                              rmask[r, :n], cfg.cliprange,
                                                              n_tok[e, j])
                    vf, vf_clipfrac = ppo_value_loss(values, old_values[r, :n], returns[r, :n],
                                                     rmask[r, :n], cfg.cliprange_value,
                                                     n_tok[e, j])
                    ((pg + cfg.vf_coef * vf) * d.world).backward()
                    lap(times, "loss", d)  # the backward included
                # FLOPs of forward + backward (True) of policy and critic: executed, needed
                n_t, lens, w = int(rlen[r].sum()), plen[r] + rlen[r], P + n - lo
                flops["hardware"] += (estimate_flops(policy.config, len(r), w, True, outputs=n_t)
                                      + estimate_flops(critic.config, len(r), w, True))
                flops["model"] += (model_flops(policy.config, lens, n_t, True)
                                   + model_flops(critic.config, lens, n_t, True))
                for k, v in (("pg", pg.detach()), ("vf", vf.detach()), ("clipfrac", clipfrac),
                             ("approx_kl", approx_kl), ("vf_clipfrac", vf_clipfrac)):
                    sums[k] += v
            # -- update
            grad_norm = torch.nn.utils.clip_grad_norm_(pv.parameters(), cfg.grad_clip).item()
            stop_if_not_finite({"grad_norm": grad_norm}, f"iteration {it + 1} (epoch {e + 1}, "
                               f"minibatch {j + 1})", ckpt_dir,
                               "Try a lower --lr or a higher --kl_coef.")
            opt.step()
            opt.zero_grad(set_to_none=True)
            lap(times, "update", d)

        # -- weight broadcast: the rollout engine samples the next iteration from the new policy
        n_bytes, _ = broadcast_weights(policy, rollout, d)
        lap(times, "broadcast", d)

        # -- metrics and checkpoint: sums over the global batch. The hidden true reward is computed
        # outside the timed phases: for evaluation only, PPO never sees it (but with --reward true).
        dt = times.pop("t") - t_iter
        true = [data.true_reward(texts[i], y) for i, y in zip(idx, replies or decode())]
        resid = torch.where(rmask, returns - old_values, 0.0)
        # FLOPs on this rank, executed (padding included) and needed by the real tokens: the
        # rollout (each real token but the last fed once, the head where a token is sampled), r_φ
        # (a score per row), π_ref and π_old (the head at the K response positions), the critic,
        # and the update (counted above)
        real, K, L, c = mask.sum(1), int(rmask.sum()), tokens.shape[1], policy.config
        flops["hardware"] += (generate_flops(c, B, P, L - P)
                              + 2 * estimate_flops(c, B, L, outputs=K)
                              + estimate_flops(critic.config, B, L)
                              + (estimate_flops(rm.config, B, L) if rm is not None else 0))
        flops["model"] += (model_flops(c, real - 1, K) + 2 * model_flops(c, real, K)
                           + model_flops(critic.config, real, K)
                           + (model_flops(rm.config, real, B) if rm is not None else 0))
        upd = reduce_sums(d, **sums)  # each sum: one global minibatch's mean per minibatch
        s = reduce_sums(d, n=B, score=score.sum(), true=sum(true), kl=k1.sum(), kl_k3=k3.sum(),
                        entropy=msum(entropy, rmask), tokens=rmask.sum(), eos=has_eos.sum(),
                        gap=gap.sum(), real=mask.sum(), ret=returns.sum(),
                        ret2=returns.pow(2).sum(), resid=resid.sum(), resid2=resid.pow(2).sum(),
                        flops_model=flops["model"], flops_hardware=flops["hardware"])
        n, n_t, steps = s["n"], s["tokens"], cfg.ppo_epochs * n_mini
        var_ret = s["ret2"] / n_t - (s["ret"] / n_t) ** 2
        var_resid = s["resid2"] / n_t - (s["resid"] / n_t) ** 2
        metrics = {"score": s["score"] / n, "true_reward": s["true"] / n, "kl": s["kl"] / n,
                   "kl_k3": s["kl_k3"] / n, "kl_coef": kl_coef, "entropy": s["entropy"] / n_t,
                   "approx_kl": upd["approx_kl"] / steps, "clipfrac": upd["clipfrac"] / steps,
                   "vf_clipfrac": upd["vf_clipfrac"] / steps,
                   "explained_variance": 1 - var_resid / max(var_ret, 1e-12),
                   "loss/policy": upd["pg"] / steps, "loss/value": upd["vf"] / steps,
                   "grad_norm": grad_norm, "lr": lr, "response_len": n_t / n,
                   "eos_rate": s["eos"] / n, "logprob_gap": s["gap"] / n_t,
                   "broadcast_MB": n_bytes / 2**20, "tokens_per_sec": s["real"] / dt,
                   "flops": s["flops_model"],  # this step's model FLOPs, all ranks
                   "mfu": s["flops_model"] / (d.world * peak * dt),
                   "mfu_hardware": s["flops_hardware"] / (d.world * peak * dt),
                   "time/iteration": 1000 * dt, **times,
                   **{f"share/{k}": times[f"time/{k}"] / (1000 * dt) for k in PHASES}}
        if cfg.compile and it == start:  # this iteration compiled the trainer: not a timing
            metrics = compile_metrics(metrics, dt)
        log.log(it + 1, cfg.iterations, metrics, show=("score", "true_reward", "kl", "entropy",
                                                       "clipfrac", "approx_kl", "response_len",
                                                       "time/iteration"))
        # a policy that left the clip's trust region has diverged: this iteration is not saved
        stop_if_diverged("approx_kl", metrics["approx_kl"], MAX_APPROX_KL, "nats per token, the "
                         "most an iteration may move the policy", f"iteration {it + 1}", ckpt_dir,
                         "Try a lower --lr.")
        for k in PHASES:  # the mean over the timed iterations
            shares[k] += metrics.get(f"share/{k}", 0.0) / max(timed, 1)
        if cfg.adaptive_kl:
            kl_coef = adaptive_kl_coef(kl_coef, metrics["kl"], cfg.kl_target, cfg.kl_horizon,
                                       cfg.rollout_batch)
        if (it + 1) % cfg.ckpt_every == 0 or it + 1 == end:  # written by rank 0
            save_checkpoint(ckpt_dir, it + 1, {"policy": policy, "critic": critic, "optim": opt},
                            {"config": asdict(cfg), "inputs": inputs, "kl_coef": kl_coef},
                            write=d.is_main)
    barrier(d)  # rank 0's checkpoint is on disk before any rank moves on
    if end < cfg.iterations:
        log.print(f"stopped after {end - start} iterations (--stop_after); run again to resume "
                  f"from {end}")
        return teardown(d)

    # ==== evaluation and outputs
    # against π_ref's own fp32 copy: the frozen one may hold bf16 weights, which run only under
    # autocast, and sampling runs without
    ref = reward.load_trunk(cfg.sft, "lm", d.device)[0]
    with gathered(policy):  # --fsdp: whole weights for sampling
        ev = evaluate_policy(policy, ref, tok, data.read_prompts(cfg.eval_prompts), d,
                             k=cfg.eval_k, missing_eos_score=cfg.missing_eos_score,
                             pool_best=task_pool_best(cfg.eval_prompts))
    weights = full_state(policy, d.is_main)  # --fsdp: gathered from the shards
    if d.is_main:
        if timed > 0:
            log.print("share of an iteration: "
                      + " | ".join(f"{k} {v:.1%}" for k, v in shares.items()))
        save_model(policy, os.path.join(cfg.out_dir, "model.safetensors"),
                   {"stage": "ppo", "iterations": cfg.iterations, "sft": cfg.sft,
                    "reward": cfg.reward}, weights)
        atomic_copy(tok_path, os.path.join(cfg.out_dir, "tokenizer.json"))
        atomic_write_json(os.path.join(cfg.out_dir, "eval.json"), {
            **ev, "iterations": cfg.iterations, "reward": cfg.reward, "kl_coef": kl_coef,
            "reward_model_val_accuracy": rm_meta.get("val_accuracy"), "time_shares": shares,
            "anatomy": layout})
        print_samples(ev, log.print)
        log.print(f"{summary(ev)} | saved {cfg.out_dir}/model.safetensors")
    barrier(d)
    teardown(d)


if __name__ == "__main__":
    main(parse_config(Config, doc=__doc__))
