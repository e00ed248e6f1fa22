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
import itertools
import os
from dataclasses import asdict, dataclass
from types import SimpleNamespace

import numpy as np
import torch
import torch.nn.functional as F

import data
import reward
import sft
from checkpoint import (input_fingerprint, prepare_outputs, require_reward_model,
                        require_same_tokenizer, resume, save_checkpoint, save_outputs,
                        stop_if_diverged, stop_if_not_finite, tokenizer_beside)
from evaluate import evaluate_held_out, print_samples, summary
from meter import (Meter, anatomy, estimate_flops, format_anatomy, generate_flops, matmul_shapes,
                   measure_peak_flops, model_flops)
from model import IGNORE, freeze, last_index, load_model, sequence_logprobs
from plumbing import (Logger, SEED_STRIDE, all_gather_rows, all_reduce_sum, autocast, barrier,
                      check, check_response_room, init_distributed, lr_at, parse_config,
                      precision, require_stage, set_lr, sharded, split_batch, sync_grads, teardown,
                      wrap)
from services import RewardService, RolloutEngine, WeightSync, replies
from task import require_task, require_task_prompts, true_reward

# ==== config


@dataclass
class Config:
    out_dir: str = "out/ppo"  # this stage's folder: policy, metrics, eval, checkpoint
    sft: str = "out/sft/model.safetensors"  # π_ref: the policy starts here, KL is to it
    reward_model: str = "out/reward/model.safetensors"  # r_φ, the reward service; critic's init
    prompts: str = "out/task/prompts_train.jsonl"  # rollout prompts: JSONL {"prompt"}, or lines
    test_prompts: str = "out/task/prompts_test.jsonl"  # held-out prompts for eval.json
    val_prompts: str = ""  # held-out prompts a study selects on, into eval.json's "val" ("": none)
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
    last = last_index(mask)
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


def forward_flops(ro, policy, critic, reward_model):
    """(executed, needed) FLOPs on this rank of an iteration's forwards before the update: the
    rollout (each real token but the last fed once, the head where a token is sampled), r_φ (a
    score per row), π_ref and π_old (the head at the K response positions) and the critic."""
    tokens, mask = ro["tokens"], ro["mask"]
    (B, L), P, c = tokens.shape, ro["P"], policy.config
    real, K = mask.sum(1), int(ro["rmask"].sum())
    hardware = (generate_flops(c, B, P, L - P) + 2 * estimate_flops(c, B, L, outputs=K)
                + estimate_flops(critic.config, B, L))
    model = (model_flops(c, real - 1, K) + 2 * model_flops(c, real, K)
             + model_flops(critic.config, real, K))
    if reward_model is not None:
        hardware += estimate_flops(reward_model.config, B, L)
        model += model_flops(reward_model.config, real, B)
    return hardware, model


def gather_rollouts(ex, keys, d):
    """Every rank's rollouts in one batch of R rows, rank r's as rows r*B..(r+1)*B-1 (its
    data.rank_slice of the global batch): update() draws its minibatches from it, so that minibatch
    j holds the same rollouts on any world size. generate pads each rank's rows to its own longest
    prompt P and response N; here they are padded further, prompt columns on the left and response
    columns on the right, to the longest of all ranks: the columns one process would have. keys:
    the tensors to gather, (B, P+N), (B, N) or (B,); their padding is masked (full: IGNORE)."""
    P, N = ex["P"], ex["tokens"].shape[1] - ex["P"]
    Pg, Ng = all_gather_rows(torch.tensor([[P, N]], device=d.device), d).max(0).values.tolist()
    out = {"P": Pg}
    for k in keys:
        t = ex[k]
        left = Pg - P if t.dim() == 2 and t.shape[1] == P + N else 0  # has prompt columns
        if t.dim() == 2:
            t = F.pad(t, (left, Ng - N), value=IGNORE if k == "full" else 0)
        out[k] = all_gather_rows(t, d)
    return out


def update_flops(models, n_t, lens, rows, width):
    """(executed, needed) FLOPs of one micro-batch's forward and backward through policy and
    critic: rows x width columns executed, lens real tokens each, n_t response tokens in all."""
    p, c = models.policy.config, models.critic.config
    return (estimate_flops(p, rows, width, True, outputs=n_t)
            + estimate_flops(c, rows, width, True),
            model_flops(p, lens, n_t, True) + model_flops(c, lens, n_t, True))


def iteration_metrics(s, steps, kl_coef):
    """The iteration's metrics from its sums over the global batch (Meter.reduce): per rollout,
    per response token, and per minibatch update (each update's sums are its global mean)."""
    n, n_t = s["n"], s["tokens"]
    var_ret = s["ret2"] / n_t - (s["ret"] / n_t) ** 2
    var_resid = s["resid2"] / n_t - (s["resid"] / n_t) ** 2
    return {"score": s["score"] / n, "true_reward": s["true"] / n, "kl": s["kl"] / n,
            "kl_k3": s["kl_k3"] / n, "kl_coef": kl_coef, "entropy": s["entropy"] / n_t,
            "approx_kl": s["approx_kl"] / steps, "clipfrac": s["clipfrac"] / steps,
            "vf_clipfrac": s["vf_clipfrac"] / steps,
            "explained_variance": 1 - var_resid / max(var_ret, 1e-12),
            "loss/policy": s["pg"] / steps, "loss/value": s["vf"] / steps}


# The divergence rule of PPO (the trainers of a loss bound the loss instead, checkpoint.DIVERGED):
# an iteration whose mean approx_kl, the k3 estimate of KL(π_old‖π) per token over its minibatches,
# is above this has left the trust region the clip keeps. Measured on the built-in task: 0.04 at
# --lr 1e-3, 0.27 at 1e-2 (still learning); 5.4 at 1e-1 and 283 at 1 (the policy collapsed).
MAX_APPROX_KL = 1.0

PHASES = ("batch", "rollout", "reward", "reference", "old_logprobs", "values", "rewards",
          "advantages", "policy_forward", "loss", "update", "broadcast")


# ==== setup: ranks, device, inputs (a missing earlier stage is built with its defaults)


def setup(cfg, d, log):
    """The prompts, tokenized and cut to max_prompt_len, π_ref's tokenizer and what the weights
    are trained from; a missing π_ref, r_φ or built-in task is built first."""
    check(cfg.reward in ("model", "true"),
          f"--reward must be 'model' or 'true', not {cfg.reward!r}")
    check(cfg.rollout_batch % cfg.mini_batch == 0, f"--rollout_batch {cfg.rollout_batch} is not "
          f"a multiple of --mini_batch {cfg.mini_batch}")
    prepare_outputs({cfg.out_dir: "--out_dir", os.path.join(cfg.out_dir, "ckpt"): "--out_dir"},
                    d, log)
    require_stage(cfg.sft, Config.sft, lambda: sft.main(sft.Config()), "python sft.py", d, log)
    require_stage(cfg.reward_model, Config.reward_model, lambda: reward.main(reward.Config()),
                  "python reward.py", d, log)
    require_task({cfg.prompts: Config.prompts, cfg.test_prompts: Config.test_prompts,
                  cfg.val_prompts: Config.val_prompts}, d, log)
    tok_path = tokenizer_beside(cfg.sft, "--sft")
    tok = data.load_tokenizer(tok_path)
    # the critic starts from it too: under --reward true (r_φ scores nothing) any trunk will do
    (require_reward_model if cfg.reward == "model" else require_same_tokenizer)(
        cfg.reward_model, "--reward_model", tok_path)
    texts = data.read_prompts(cfg.prompts)
    if cfg.reward == "true":
        require_task_prompts(texts, f"--prompts {cfg.prompts}", f"--reward {cfg.reward}'s scorer")
    prompts, cut = data.encode_prompts(tok, texts, cfg.max_prompt_len)
    if cut:
        log(f"{cut} of {len(prompts)} prompts of {cfg.prompts} are longer than --max_prompt_len "
            f"{cfg.max_prompt_len} tokens: each keeps its BOS and its last tokens")
    check(len(prompts) >= cfg.rollout_batch, f"{cfg.prompts} has {len(prompts)} prompts, fewer "
          f"than --rollout_batch {cfg.rollout_batch}")
    # what the weights are trained from: a resumed run checks it is the same
    inputs = input_fingerprint({"--sft": cfg.sft, "--reward_model": cfg.reward_model,
                                "tokenizer": tok_path, "--prompts": cfg.prompts}, prompts)
    return tok, tok_path, texts, prompts, inputs


# ==== models resident in the training job


def load_models(cfg, d, tok):
    """InstructGPT's five: the policy and the critic train; π_ref, r_φ and the rollout engine's copy
    of the policy only run forward (the services: services.py). The critic starts from r_φ (Ouyang
    et al. 2022 sec. 3.5). The frozen ones hold bf16 matmul weights under bf16 autocast
    (model.freeze: the same outputs) and are sharded too with --fsdp. Policy and critic train as
    one module (PolicyAndValue): DDP over the ranks (--fsdp: each sharded in place), then
    torch.compile."""
    bf16 = precision(d.device) == "bf16"
    policy = load_model(cfg.sft, d.device, head="lm")[0]
    ref = wrap(freeze(load_model(cfg.sft, d.device, head="lm")[0], bf16), d, fsdp=cfg.fsdp)
    critic, rm_meta = load_model(cfg.reward_model, d.device, head="scalar")
    reward_model = None  # PPO-GT scores with a Python function: no reward model resident
    if cfg.reward == "model":
        reward_model = wrap(freeze(load_model(cfg.reward_model, d.device, head="scalar")[0], bf16),
                            d, fsdp=cfg.fsdp)
    T = policy.config.block_size
    check_response_room(cfg.max_prompt_len, T)
    policy_and_value = PolicyAndValue(policy, critic)
    return SimpleNamespace(policy=policy, critic=critic, ref=ref, reward_model=reward_model,
                           rollout=RolloutEngine(policy, d),
                           reward=RewardService(reward_model, cfg.missing_eos_score, tok, d),
                           sync=WeightSync(d), policy_and_value=policy_and_value,
                           trainer=wrap(policy_and_value, d, cfg.compile, cfg.fsdp),
                           reward_model_val_accuracy=rm_meta.get("val_accuracy"))


def main(cfg):
    d = init_distributed()
    log = Logger(cfg.out_dir, d)
    tok, tok_path, texts, prompts, inputs = setup(cfg, d, log.print)
    ckpt_dir = os.path.join(cfg.out_dir, "ckpt")
    accum = split_batch(cfg.mini_batch, cfg.micro_batch_size, d.world)
    n_mini, B = cfg.rollout_batch // cfg.mini_batch, cfg.rollout_batch // d.world
    models = load_models(cfg, d, tok)
    policy, critic, rollout = models.policy, models.critic, models.rollout
    T = policy.config.block_size

    # ==== anatomy: what the job holds and what a token costs
    reward_model = models.reward_model
    resident = {"policy": policy, "critic": critic, "reference": models.ref,
                **({"reward": reward_model} if reward_model is not None else {}),
                "rollout": rollout.model}
    fwd = lambda m: estimate_flops(m.config, 1, T) / T  # noqa: E731
    train_step = lambda m: estimate_flops(m.config, 1, T, backward=True) / T  # noqa: E731
    phase_flops = {"rollout": fwd(policy),
                   "reward": fwd(reward_model) if reward_model is not None else 0.0,
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
    opt = torch.optim.AdamW(models.policy_and_value.parameters(), lr=cfg.lr, betas=(0.9, 0.95),
                            weight_decay=0.0)
    parts = {"policy": policy, "critic": critic, "optim": opt}
    start, state = resume(ckpt_dir, cfg, parts, d.device, log.print, inputs,
                          free=("resume", "stop_after", "eval_k", "compile", "fsdp"))
    kl_coef = state.get("kl_coef", cfg.kl_coef)
    if start:
        models.sync.push(policy, rollout)  # the rollout engine resumes with the restored policy
    log.start(start)  # metrics.jsonl keeps the iterations up to `start`
    peak = measure_peak_flops(d.device, matmul_shapes(policy.config, B * T))
    scorer = (f"r_φ {cfg.reward_model}" if reward_model is not None
              else "the hidden true reward (PPO-GT)")
    log.print(f"rollout {cfg.rollout_batch} = {d.world} ranks x {B} | {cfg.ppo_epochs} epochs x "
              f"{n_mini} minibatches of {cfg.mini_batch} = {d.world} ranks x {accum} accumulation "
              f"x {B // n_mini // accum} | reward: {scorer} | device {d.device} | peak "
              f"{peak / 1e9:.1f} GFLOP/s per rank (measured)"
              + (" | sharded (FSDP2)" if sharded(models.policy_and_value) else ""))

    # ==== training loop
    # Each iteration: rollouts scored and turned into advantages (experience), then ppo_epochs
    # passes of minibatch updates (update), then the new weights to the rollout engine and the
    # iteration's metrics (refresh). In that order below.
    end = cfg.iterations if not cfg.stop_after else min(cfg.iterations, start + cfg.stop_after)
    meter = Meter(d, peak, unit="iteration", phases=PHASES, compile=cfg.compile)
    for it in range(start, end):
        meter.start()
        lr = set_lr(opt, lr_at(it, cfg.iterations, cfg.lr, cfg.warmup, cfg.min_lr_frac))
        ex = experience(models, prompts, texts, it, kl_coef, cfg, d, tok, meter)
        grad_norm = update(models, opt, ex, it, accum, cfg, d, meter, ckpt_dir)
        metrics = refresh(models, ex, tok, cfg, d, meter, kl_coef,
                          {"grad_norm": grad_norm, "lr": lr})
        log.log(it + 1, cfg.iterations, metrics, show=("score", "true_reward", "kl", "entropy",
                                                       "clipfrac", "approx_kl", "response_len",
                                                       "time/iteration"))
        # a policy that left the clip's trust region has diverged: this iteration is not saved
        stop_if_diverged("approx_kl", metrics["approx_kl"], MAX_APPROX_KL, "nats per token, the "
                         "most an iteration may move the policy", f"iteration {it + 1}", ckpt_dir,
                         "Try a lower --lr.")
        if cfg.adaptive_kl:
            kl_coef = adaptive_kl_coef(kl_coef, metrics["kl"], cfg.kl_target, cfg.kl_horizon,
                                       cfg.rollout_batch)
        if (it + 1) % cfg.ckpt_every == 0 or it + 1 == end:  # written by rank 0
            save_checkpoint(ckpt_dir, it + 1, parts,
                            {"config": asdict(cfg), "inputs": inputs, "kl_coef": kl_coef},
                            write=d.is_main)
    barrier(d)  # rank 0's checkpoint is on disk before any rank moves on
    if end < cfg.iterations:
        log.print(f"stopped after {end - start} iterations (--stop_after); run again to resume "
                  f"from {end}")
        return teardown(d)
    finish(policy, tok, tok_path, cfg, d, log, meter, layout,
           {"kl_coef": kl_coef, "reward_model_val_accuracy": models.reward_model_val_accuracy})
    teardown(d)


def experience(models, prompts, texts, it, kl_coef, cfg, d, tok, meter):
    """An iteration's rollouts, scored, with their per-token rewards, returns and advantages."""
    policy, critic = models.policy, models.critic

    # -- batch: this rank's share of the iteration's global batch of prompts
    batch = data.global_batch(len(prompts), cfg.rollout_batch, it, cfg.seed)
    idx = data.rank_slice(batch, d.rank, d.world)
    meter.lap("batch")

    # -- rollout engine: one completion per prompt from the inference copy, with the KV cache
    ex = models.rollout.sample(prompts, batch, idx, it, cfg.seed, tok,
                               temperature=cfg.temperature)
    tokens, mask, rmask, full, P = ex["tokens"], ex["mask"], ex["rmask"], ex["full"], ex["P"]
    meter.lap("rollout")

    # -- reward service: score each response, cut at its EOS (generate pads after it)
    ex["score"], ex["has_eos"] = models.reward.score(ex, [texts[i] for i in idx])
    meter.lap("reward")

    # -- reference log-probs: log π_ref of the sampled tokens, from the resident π_ref
    # (the logits at column c-1 predict token c; every log-prob divides them by T, N details)
    with torch.no_grad(), autocast(d.device):
        ref_logp = sequence_logprobs(models.ref, tokens, full, mask, cfg.temperature)[:, P - 1:-1]
    meter.lap("reference")

    # -- old log-probs: the trainer's own forward. Not the rollout engine's log-probs: a bf16
    # engine (or vLLM's kernels) gives other numbers for the same tokens, and PPO's ratio must
    # start at exactly 1. The gap says how far apart they were.
    with torch.no_grad(), autocast(d.device):
        old_logp, entropy = (t[:, P - 1:-1] for t in sequence_logprobs(  # (B, N) each
            policy, tokens, full, mask, cfg.temperature, entropy=True))
    gap = torch.where(rmask, (old_logp - ex["logprobs"][:, P:]).abs(), 0.0)
    meter.lap("old_logprobs")

    # -- values: the critic's V before each response token, GAE's baseline
    with torch.no_grad(), autocast(d.device):
        old_values = torch.where(rmask, critic(tokens, mask=mask)[:, P - 1:-1].float(), 0.0)
    meter.lap("values")

    # -- per-token rewards with the KL penalty: -β·(log π_old - log π_ref) on every token, and
    # the score on the last
    k1, k3 = kl_estimators(old_logp, ref_logp)
    rewards = per_token_rewards(old_logp, ref_logp, ex["score"], rmask, kl_coef)
    meter.lap("rewards")

    # -- advantages: GAE, whitened over the global batch (the same numbers for any world size)
    adv, returns = gae(rewards, old_values, rmask, cfg.gamma, cfg.lam)
    adv = masked_whiten(adv, rmask, d)
    meter.lap("advantages")
    return {**ex, "texts": [texts[i] for i in idx], "old_logp": old_logp,
            "old_values": old_values, "adv": adv,
            "returns": returns, "k1": k1, "k3": k3, "entropy": entropy, "gap": gap}


def update(models, opt, ex, it, accum, cfg, d, meter, ckpt_dir):
    """ppo_epochs passes over the global batch's rollouts, each over n_mini shuffled minibatches:
    one optimizer step each. Every rank holds the whole batch (gather_rollouts), so minibatch j is
    the same rollouts on any world size, and each rank runs its share of it. Each loss is a mean
    over its global minibatch's response tokens, for any world size and accumulation (DDP then
    averages the ranks' gradients, hence the x world below). Returns the last step's grad norm."""
    g = gather_rollouts(ex, ("tokens", "mask", "full", "rmask", "old_logp", "adv", "old_values",
                             "returns"), d)
    P, tokens, mask, full, rmask = g["P"], g["tokens"], g["mask"], g["full"], g["rmask"]
    plen, rlen = mask[:, :P].sum(1), rmask.sum(1)  # (R,) prompt and response tokens
    R, n_mini = cfg.rollout_batch, cfg.rollout_batch // cfg.mini_batch
    micro_batch = cfg.mini_batch // d.world // accum  # a rank's rollouts per forward
    gp = torch.Generator().manual_seed(cfg.seed + SEED_STRIDE * it)
    perms = [torch.randperm(R, generator=gp).to(d.device) for _ in range(cfg.ppo_epochs)]
    for e, j in itertools.product(range(cfg.ppo_epochs), range(n_mini)):
        rows = perms[e][j * cfg.mini_batch:(j + 1) * cfg.mini_batch]
        n_tok = rmask[rows].sum().float()  # the global minibatch's response tokens
        # micro-batches of similar response lengths, each cut to its own longest prompt (left)
        # and response (right): the minibatch, and so its loss, is the same; padding is not.
        # Sorted before the ranks take their shares: the micro-batches are one process's
        rows = rows[rlen[rows].argsort(descending=True, stable=True)]
        rows = data.rank_slice(rows, d.rank, d.world)
        for m in range(accum):
            r = rows[m * micro_batch:(m + 1) * micro_batch]
            lo, n = P - int(plen[r].max()), int(rlen[r].max())  # its columns: lo .. P+n-1
            with sync_grads(models.trainer, m == accum - 1):  # all-reduce on the last micro-step
                # -- policy forward: policy and critic, one DDP module
                with autocast(d.device):
                    logp, values = models.trainer(tokens[r, lo:P + n], mask[r, lo:P + n],
                                                  full[r, lo:P + n], cfg.temperature)
                # (micro_batch, n): its response columns
                logp, values = logp[:, P - 1 - lo:-1], values[:, P - 1 - lo:-1].float()
                meter.lap("policy_forward")
                # -- loss: the clipped surrogate + vf_coef · the clipped value loss
                pg, clipfrac, approx_kl = ppo_policy_loss(
                    logp, g["old_logp"][r, :n], g["adv"][r, :n], rmask[r, :n], cfg.cliprange,
                    n_tok)
                vf, vf_clipfrac = ppo_value_loss(values, g["old_values"][r, :n],
                                                 g["returns"][r, :n], rmask[r, :n],
                                                 cfg.cliprange_value, n_tok)
                ((pg + cfg.vf_coef * vf) * d.world).backward()
                meter.lap("loss")  # the backward included
            meter.count(*update_flops(models, int(rlen[r].sum()), plen[r] + rlen[r], len(r),
                                      P + n - lo))
            meter.add(pg=pg.detach(), vf=vf.detach(), clipfrac=clipfrac, approx_kl=approx_kl,
                      vf_clipfrac=vf_clipfrac)
        # -- update
        grad_norm = torch.nn.utils.clip_grad_norm_(models.policy_and_value.parameters(),
                                                   cfg.grad_clip).item()
        stop_if_not_finite({"grad_norm": grad_norm}, f"iteration {it + 1} (epoch {e + 1}, "
                           f"minibatch {j + 1})", ckpt_dir,
                           "Try a lower --lr or a higher --kl_coef.")
        opt.step()
        opt.zero_grad(set_to_none=True)
        meter.lap("update")
    return grad_norm


def refresh(models, ex, tok, cfg, d, meter, kl_coef, metrics):
    """The new weights to the rollout engine, then the iteration's metrics, all ranks'."""
    # -- weight broadcast: the rollout engine samples the next iteration from the new policy
    n_bytes, _ = models.sync.push(models.policy, models.rollout)
    meter.lap("broadcast")

    # -- metrics and checkpoint: sums over the global batch. The hidden true reward is computed
    # outside the timed phases: for evaluation only, PPO never sees it (but with --reward true).
    true = [true_reward(t, y) for t, y in zip(ex["texts"], replies(tok, ex))]
    rmask, returns = ex["rmask"], ex["returns"]
    resid = torch.where(rmask, returns - ex["old_values"], 0.0)
    meter.count(*forward_flops(ex, models.policy, models.critic, models.reward_model))
    meter.add(n=len(rmask), score=ex["score"], true=sum(true), kl=ex["k1"], kl_k3=ex["k3"],
              entropy=msum(ex["entropy"], rmask), tokens=rmask.sum(), eos=ex["has_eos"],
              gap=ex["gap"], real=ex["mask"].sum(), ret=returns, ret2=returns.pow(2), resid=resid,
              resid2=resid.pow(2))
    s = meter.reduce()
    metrics = {**iteration_metrics(s, cfg.ppo_epochs * (cfg.rollout_batch // cfg.mini_batch),
                                   kl_coef), **metrics,
               "response_len": s["tokens"] / s["n"], "eos_rate": s["eos"] / s["n"],
               "logprob_gap": s["gap"] / s["tokens"], "broadcast_MB": n_bytes / 2**20,
               **meter.timing(s["real"])}
    return metrics


# ==== evaluation and outputs


def finish(policy, tok, tok_path, cfg, d, log, meter, layout, result):
    """Sample the held-out prompts from the policy and from π_ref's own fp32 copy (the frozen one
    may hold bf16 weights, which run only under autocast; sampling runs without), then save."""
    ref = load_model(cfg.sft, d.device, head="lm")[0]
    ev = evaluate_held_out(policy, ref, tok, cfg, d, missing_eos_score=cfg.missing_eos_score)
    shares = meter.shares(log.print, "an iteration")
    save_outputs(policy, cfg.out_dir, {"stage": "ppo", "iterations": cfg.iterations,
                                       "sft": cfg.sft, "reward": cfg.reward},
                 {**ev, "iterations": cfg.iterations, "reward": cfg.reward, **result,
                  "time_shares": shares, "anatomy": layout}, d, tok_path)
    print_samples(ev, log.print)
    log.print(f"{summary(ev)} | saved {cfg.out_dir}/model.safetensors")


if __name__ == "__main__":
    main(parse_config(Config, doc=__doc__))
