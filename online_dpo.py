"""Online DPO: DPO's loss on pairs the policy samples now and the reward service labels.

    python online_dpo.py                        # one process; builds sft and reward if missing
    torchrun --nproc_per_node=8 online_dpo.py   # DDP: each rank samples its share of the prompts
    torchrun --nproc_per_node=8 online_dpo.py --fsdp   # FSDP2: policy, π_ref and r_φ sharded
    python online_dpo.py --reward true          # the hidden true reward labels the pairs
    python online_dpo.py --help                 # every flag, e.g. --prompts my.jsonl --beta 0.1

Online DPO (Guo et al. 2024, "Direct Language Model Alignment from Online AI Feedback"; TRL's
OnlineDPOTrainer): each round, sample two completions per prompt from the current policy, let the
reward model pick the better one, and take a step of DPO's loss (Eq. 7 of Rafailov et al. 2023) on
these fresh pairs, the reference still π_ref. Read it between dpo.py and ppo.py: its headers are
DPO's plus three of PPO's phases, and PPO's minus three. What returns from PPO's job:
  1. the rollout engine, its inference copy of the policy, and the weight broadcast that refreshes
     it after every update: the pairs are sampled during training, from the policy being trained;
  2. the reward service (r_φ from reward.py, or --reward true): it labels the samples;
  3. the live reference model: log π_ref of samples that did not exist before this round cannot be
     precomputed, so π_ref is resident again and runs forward every round (the reference log-probs).
What stays deleted: the critic (PPO's old log-probs and values), the per-token rewards with the KL
penalty, and the advantages (GAE): the loss is still DPO's closed form, the β·KL constraint inside
it. Writes out/online_dpo/: model.safetensors (+ tokenizer.json), metrics.jsonl, eval.json, ckpt/.
"""
import copy
import os
from dataclasses import asdict, dataclass

import torch

import data
import precompute
import reward
import sft
from dpo import dpo_loss
from evaluate import evaluate_policy, print_samples, summary, task_pool_best
from model import (anatomy, estimate_flops, format_anatomy, freeze, generate, generate_flops,
                   matmul_shapes, model_flops, save_model)
from plumbing import (DIVERGED, Logger, adamw, atomic_copy, atomic_write_json, autocast, barrier,
                      check, clock, compile_metrics, full_state, gathered, init_distributed,
                      input_fingerprint, lap, lr_at, measure_peak_flops, parse_config, precision,
                      prepare_outputs, reduce_sums, require_stage, resume, save_checkpoint, sharded,
                      split_batch, stop_if_diverged, stop_if_not_finite, sync_grads, teardown, wrap)
from ppo import broadcast_weights

# ==== config


@dataclass
class Config:
    out_dir: str = "out/online_dpo"  # this stage's folder: policy, tokenizer, metrics, eval, ckpt
    sft: str = "out/sft/model.safetensors"  # π_ref: the policy starts here, the reference stays
    reward_model: str = "out/reward/model.safetensors"  # r_φ, the reward service (built if missing)
    prompts: str = "out/task/prompts_train.jsonl"  # rollout prompts: JSONL {"prompt"}, or lines
    eval_prompts: str = "out/task/prompts_eval.jsonl"  # held-out prompts for eval.json
    reward: str = "model"  # "model": r_φ labels the pairs; "true": the hidden true reward does
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


# ==== helpers the loop calls: dpo_loss, precompute.pair_logps and ppo.broadcast_weights, imported


PHASES = ("batch", "rollout", "reward", "reference", "policy_forward", "loss", "update",
          "broadcast")


def main(cfg):
    # ==== setup: ranks, device, inputs (a missing earlier stage is built with its defaults)
    d = init_distributed()
    log = Logger(cfg.out_dir, d)
    check(cfg.reward in ("model", "true"),
          f"--reward must be 'model' or 'true', not {cfg.reward!r}")
    check(cfg.beta > 0, f"--beta must be > 0, got {cfg.beta}")
    ckpt_dir = os.path.join(cfg.out_dir, "ckpt")
    prepare_outputs({cfg.out_dir: "--out_dir", ckpt_dir: "--out_dir"}, d, log.print)
    require_stage(cfg.sft, Config.sft, lambda: sft.main(sft.Config()), "python sft.py", d,
                  log.print)
    if cfg.reward == "model":
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
    # what the weights are trained from: a resumed run checks it is the same
    inputs = input_fingerprint({"--sft": cfg.sft, "tokenizer": tok_path, "--prompts": cfg.prompts,
                                **({"--reward_model": cfg.reward_model} if cfg.reward == "model"
                                   else {})}, prompts)
    accum = split_batch(cfg.rollout_batch, cfg.micro_batch_size, d.world)
    B = cfg.rollout_batch // d.world  # this rank's prompts, and so its pairs
    mb = B // accum  # pairs per forward on this rank

    # ==== models resident in the training job
    # Four of PPO's five: the policy trains; π_ref, r_φ and the rollout engine's copy of the policy
    # run forward only. The critic stays gone. Dropout off (load_trunk), so the policy's log π
    # equals log π_ref exactly in round 1, as in dpo.py. The frozen ones hold bf16 matmul weights
    # under bf16 autocast (model.freeze: the same outputs).
    bf16 = precision(d.device) == "bf16"
    raw_model, _ = reward.load_trunk(cfg.sft, "lm", d.device)
    # the frozen models are sharded too with --fsdp
    ref = wrap(freeze(reward.load_trunk(cfg.sft, "lm", d.device)[0], bf16), d, fsdp=cfg.fsdp)
    rm = None  # --reward true labels with a Python function: no reward model resident
    if cfg.reward == "model":
        rm = wrap(freeze(reward.load_trunk(cfg.reward_model, "scalar", d.device)[0], bf16), d,
                  fsdp=cfg.fsdp)
    # The rollout engine: an inference copy of the policy, all bf16 under bf16 autocast (as vLLM
    # serves it), refreshed by broadcast_weights after every update
    rollout = copy.deepcopy(raw_model).to(torch.bfloat16 if bf16 else torch.float32)
    rollout.eval().requires_grad_(False)
    T = raw_model.config.block_size
    check(cfg.max_prompt_len < T,
          f"--max_prompt_len {cfg.max_prompt_len} leaves no room in the {T}-token block")
    # DDP over the ranks (--fsdp: sharded in place, raw_model with it), then torch.compile
    model = wrap(raw_model, d, cfg.compile, cfg.fsdp)

    # ==== anatomy: what the job holds and what a token costs
    resident = {"policy": raw_model, "reference": ref, **({"reward": rm} if rm is not None else {}),
                "rollout": rollout}
    layout = anatomy(resident, T)
    log.print(format_anatomy(layout, T))
    log.print("back from PPO: rollout engine, reward service, live reference, weight broadcast | "
              "still gone: critic, per-token KL rewards, GAE, value loss")
    fwd = lambda m: estimate_flops(m.config, 1, T) / T  # noqa: E731
    phase_flops = {"rollout": fwd(raw_model), "reward": fwd(rm) if rm is not None else 0.0,
                   "reference": fwd(ref),
                   "update": estimate_flops(raw_model.config, 1, T, backward=True) / T}
    log.print("FLOPs per sampled token by phase: "
              + " | ".join(f"{k} {v / 1e6:.2f}M" for k, v in phase_flops.items())
              + f" | round {sum(phase_flops.values()) / 1e6:.2f}M")

    # ==== optimizer, schedule, resume
    opt = adamw(raw_model, cfg.lr, cfg.weight_decay)
    start, state = resume(ckpt_dir, cfg, {"model": raw_model, "optim": opt}, d.device, log.print,
                          inputs, free=("resume", "stop_after", "eval_k", "compile", "fsdp"))
    first_loss = state.get("first_loss")  # the divergence guard's scale: the loss at π = π_ref
    if start:
        broadcast_weights(raw_model, rollout, d)  # the rollout engine resumes with the policy
    log.start(start)  # metrics.jsonl keeps the rounds up to `start`
    peak = measure_peak_flops(d.device, matmul_shapes(raw_model.config, 2 * mb * T))
    scorer = f"r_φ {cfg.reward_model}" if rm is not None else "the hidden true reward"
    log.print(f"beta {cfg.beta} | rollout {cfg.rollout_batch} prompts x 2 completions = "
              f"{d.world} ranks x {B} x 2 | batch {cfg.rollout_batch} pairs = {d.world} ranks x "
              f"{accum} accumulation x {mb} | reward: {scorer} | device {d.device} | peak "
              f"{peak / 1e9:.1f} GFLOP/s per rank (measured)"
              + (" | sharded (FSDP2)" if sharded(raw_model) else ""))

    # ==== training loop
    end = cfg.iterations if not cfg.stop_after else min(cfg.iterations, start + cfg.stop_after)
    shares = dict.fromkeys(PHASES, 0.0)
    timed = end - start - (1 if cfg.compile else 0)  # a compiled run's first round compiles
    for it in range(start, end):
        times = {"t": clock(d)}
        t_iter = times["t"]
        lr = lr_at(it, cfg.iterations, cfg.lr, cfg.warmup, cfg.min_lr_frac)
        for g in opt.param_groups:
            g["lr"] = lr

        # -- batch: this rank's share of the round's global batch of prompts
        batch = data.global_batch(len(prompts), cfg.rollout_batch, it, cfg.seed)
        idx = data.rank_slice(batch, d.rank, d.world)
        lap(times, "batch", d)

        # -- rollout engine: two completions per prompt from the inference copy, with the KV cache,
        # rows [this rank's prompts; the same again]. Completion a of global prompt j draws its
        # tokens from row j of uniforms seeded by (seed, round), completion b from row R + j,
        # within the global batch's budget (ppo.py's rule): the same samples on any world size.
        R = cfg.rollout_batch
        rng = torch.Generator().manual_seed(cfg.seed + 1_000_003 * it + 1)
        n_new = T - max(len(prompts[i]) for i in batch)
        U = torch.rand(2, R, n_new, generator=rng)[:, d.rank * B:(d.rank + 1) * B].flatten(0, 1)
        mine = [prompts[i] for i in idx]
        out = generate(rollout, mine + mine, n_new, tok.eos, tok.pad, uniforms=U.to(d.device))
        tokens, mask, rmask = out["tokens"], out["mask"], out["response_mask"]  # (2B, L)
        P = max(map(len, mine))  # generate left-pads the prompts to P
        lap(times, "rollout", d)

        # -- reward service: score each completion, cut at its EOS (generate pads after it)
        ys = [t[m].tolist() for t, m in zip(tokens, rmask)]  # (2B,) completions' token ids
        if rm is not None:
            with torch.no_grad(), autocast(d.device):
                raw = reward.score_at_last(rm(tokens, mask=mask).float(), mask)
        else:
            raw = torch.tensor([data.true_reward(texts[i], tok.decode(y))
                                for i, y in zip(idx * 2, ys)], device=d.device)
        has_eos = torch.tensor([y[-1] == tok.eos for y in ys], device=d.device)  # (2B,)
        # No EOS (the block ran out): the score is replaced by missing_eos_score, ppo.py's rule
        # (lm-human-preferences'), so an unfinished completion loses to a finished one that r_φ
        # scores above -1, and two unfinished ones tie
        score = torch.where(has_eos, raw.float(), cfg.missing_eos_score)
        a_chosen, tied = label_pairs(score[:B], score[B:])
        pairs = [dict(index=j, prompt=prompts[i], chosen=a if w else b, rejected=b if w else a)
                 for j, (i, a, b, w) in enumerate(zip(idx, ys[:B], ys[B:], a_chosen.tolist()))]
        keep = (~tied).float()  # (B,) a pair's weight in the loss
        lap(times, "reward", d)

        # -- reference log-probs: log π_ref of the new samples, from the resident π_ref. They did
        # not exist before this round: no precompute could have cached them
        # FLOPs: executed ("hardware", padding included) and needed by the real tokens ("model")
        real, K, L, c = mask.sum(1), int(rmask.sum()), tokens.shape[1], raw_model.config
        flops = {"hardware": generate_flops(c, 2 * B, P, L - P)
                 + (estimate_flops(rm.config, 2 * B, L) if rm is not None else 0),
                 "model": model_flops(c, real - 1, K)
                 + (model_flops(rm.config, real, 2 * B) if rm is not None else 0)}
        batches = [data.collate_pairs(pairs[m * mb:(m + 1) * mb], tok.pad) for m in range(accum)]
        ref_lp = []
        for b in batches:
            x, y = b["input_ids"].to(d.device), b["targets"].to(d.device)
            with torch.no_grad(), autocast(d.device):  # frozen: no activations kept
                ref_lp.append(precompute.pair_logps(ref, x, y).view(2, -1))  # (2, mb)
            K = int((y != -100).sum())  # positions with a target: the head runs only there
            flops["hardware"] += estimate_flops(ref.config, *x.shape, outputs=K)
            flops["model"] += model_flops(ref.config, (x != tok.pad).sum(1), K)
        lap(times, "reference", d)

        # The loss is a mean over the global batch's untied pairs: count them over the ranks first
        n_keep = reduce_sums(d, n=keep.sum())["n"]
        sums = dict.fromkeys(["loss", "r_chosen", "r_rejected", "correct", "logp_chosen",
                              "logp_rejected", "kl", "tokens"], 0.0)
        for m, b in enumerate(batches):
            x, y = b["input_ids"].to(d.device), b["targets"].to(d.device)
            w = keep[m * mb:(m + 1) * mb]
            with sync_grads(model, m == accum - 1):  # all-reduce on the last micro-step only
                # -- policy forward: one forward over [chosen; rejected] scores both halves
                with autocast(d.device):
                    pi_c, pi_r = precompute.pair_logps(model, x, y).chunk(2)  # (mb,), (mb,)
                lap(times, "policy_forward", d)
                # -- loss: Eq. 7 on the labelled pairs, a tie weighted 0. Summed and divided by the
                # untied pairs of the global batch, x world as DDP averages over ranks
                ref_c, ref_r = ref_lp[m]
                losses, r_c, r_r = dpo_loss(pi_c, pi_r, ref_c, ref_r, cfg.beta)
                ((losses * w).sum() * d.world / max(n_keep, 1)).backward()
                lap(times, "loss", d)  # the backward included
            K = int((y != -100).sum())
            flops["hardware"] += estimate_flops(c, *x.shape, backward=True, outputs=K)
            flops["model"] += model_flops(c, (x != tok.pad).sum(1), K, backward=True)
            # kl: every completion, tied or not, was sampled from π before this update, so the
            # mean of log π/π_ref over them estimates KL(π‖π_ref) (ppo.py's kl, summed k1)
            kl = ((pi_c - ref_c) + (pi_r - ref_r)).detach()
            for k, v in (("loss", losses.detach() * w), ("r_chosen", r_c * w),
                         ("r_rejected", r_r * w), ("correct", (r_c > r_r).float() * w),
                         ("logp_chosen", pi_c.detach() * w), ("logp_rejected", pi_r.detach() * w),
                         ("kl", kl), ("tokens", (x != tok.pad).float())):
                sums[k] += v.sum()

        # -- update
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip).item()
        s = reduce_sums(d, **sums)
        n = max(n_keep, 1)
        stop_if_not_finite({"loss": s["loss"], "grad_norm": grad_norm}, f"round {it + 1}",
                           ckpt_dir, "Try a lower --lr or --beta.")
        loss = s["loss"] / n
        first_loss = loss if first_loss is None else first_loss  # ln 2 at π = π_ref
        stop_if_diverged("loss", loss, DIVERGED * first_loss, f"{DIVERGED}x the first round's "
                         f"{first_loss:.4g}", f"round {it + 1}", ckpt_dir,
                         "Try a lower --lr or --beta.")
        opt.step()
        opt.zero_grad(set_to_none=True)
        lap(times, "update", d)

        # -- weight broadcast: the rollout engine samples the next round from the new policy
        n_bytes, _ = broadcast_weights(raw_model, rollout, d)
        lap(times, "broadcast", d)

        # -- metrics and checkpoint: DPO's over the untied pairs, the samples' over all 2B. The
        # hidden true reward is computed outside the timed phases: for monitoring only
        dt = times.pop("t") - t_iter
        true = [data.true_reward(texts[i], tok.decode(y)) for i, y in zip(idx * 2, ys)]
        t = reduce_sums(d, n=2 * B, score=score.sum(), true=sum(true), eos=has_eos.sum(),
                        tokens=rmask.sum(), real=mask.sum(), flops_model=flops["model"],
                        flops_hardware=flops["hardware"])
        n_s = t["n"]
        metrics = {"loss": loss, "rewards/chosen": s["r_chosen"] / n,
                   "rewards/rejected": s["r_rejected"] / n, "rewards/accuracies": s["correct"] / n,
                   "rewards/margins": (s["r_chosen"] - s["r_rejected"]) / n,
                   "logps/chosen": s["logp_chosen"] / n, "logps/rejected": s["logp_rejected"] / n,
                   "score": t["score"] / n_s, "true_reward": t["true"] / n_s, "kl": s["kl"] / n_s,
                   "ties": 1 - n_keep / cfg.rollout_batch, "eos_rate": t["eos"] / n_s,
                   "response_len": t["tokens"] / n_s, "grad_norm": grad_norm, "lr": lr,
                   "broadcast_MB": n_bytes / 2**20, "tokens_per_sec": t["real"] / dt,
                   "flops": t["flops_model"],  # this step's model FLOPs, all ranks
                   "mfu": t["flops_model"] / (d.world * peak * dt),
                   "mfu_hardware": t["flops_hardware"] / (d.world * peak * dt),
                   "time/iteration": 1000 * dt, **times,
                   **{f"share/{k}": times[f"time/{k}"] / (1000 * dt) for k in PHASES}}
        if cfg.compile and it == start:  # this round compiled the policy: not a timing
            metrics = compile_metrics(metrics, dt)
        log.log(it + 1, cfg.iterations, metrics, show=("loss", "rewards/accuracies", "score",
                                                       "true_reward", "kl", "ties",
                                                       "time/iteration"))
        for k in PHASES:  # the mean over the timed rounds
            shares[k] += metrics.get(f"share/{k}", 0.0) / max(timed, 1)
        if (it + 1) % cfg.ckpt_every == 0 or it + 1 == end:  # written by rank 0
            save_checkpoint(ckpt_dir, it + 1, {"model": raw_model, "optim": opt},
                            {"config": asdict(cfg), "inputs": inputs, "first_loss": first_loss},
                            write=d.is_main)
    barrier(d)  # rank 0's checkpoint is on disk before any rank moves on
    if end < cfg.iterations:
        log.print(f"stopped after {end - start} rounds (--stop_after); run again to resume from "
                  f"round {end}")
        return teardown(d)

    # ==== evaluation and outputs
    # against π_ref's own fp32 copy: the frozen one may hold bf16 weights, which run only under
    # autocast, and sampling runs without
    ref = reward.load_trunk(cfg.sft, "lm", d.device)[0]
    with gathered(raw_model):  # --fsdp: whole weights for sampling
        ev = evaluate_policy(raw_model, ref, tok, data.read_prompts(cfg.eval_prompts), d,
                             k=cfg.eval_k, missing_eos_score=cfg.missing_eos_score,
                             pool_best=task_pool_best(cfg.eval_prompts))
    weights = full_state(raw_model, d.is_main)  # --fsdp: gathered from the shards
    if d.is_main:
        if timed > 0:
            log.print("share of a round: " + " | ".join(f"{k} {v:.1%}" for k, v in shares.items()))
        save_model(raw_model, os.path.join(cfg.out_dir, "model.safetensors"),
                   {"stage": "online_dpo", "iterations": cfg.iterations, "sft": cfg.sft,
                    "reward": cfg.reward, "beta": cfg.beta}, weights)
        atomic_copy(tok_path, os.path.join(cfg.out_dir, "tokenizer.json"))
        atomic_write_json(os.path.join(cfg.out_dir, "eval.json"), {
            **ev, "iterations": cfg.iterations, "reward": cfg.reward, "beta": cfg.beta,
            "time_shares": shares, "anatomy": layout})
        print_samples(ev, log.print)
        log.print(f"{summary(ev)} | saved {cfg.out_dir}/model.safetensors")
    barrier(d)
    teardown(d)


if __name__ == "__main__":
    main(parse_config(Config, doc=__doc__))
