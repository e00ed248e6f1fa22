"""Align π_ref to the preference pairs with DPO: one forward over [chosen; rejected], one loss, one update.

    python dpo.py                            # one process, CPU or one GPU; builds sft and the cache if missing
    torchrun --nproc_per_node=8 dpo.py       # plain DDP over 8 ranks (nccl on GPUs, gloo on CPUs)
    python dpo.py --ref live                 # run π_ref every step instead of reading precompute.py's cache
    python dpo.py --loss ipo --beta 0.1      # IPO; --label_smoothing 0.1 for conservative DPO
    python dpo.py --help                     # every flag

Direct Preference Optimization (Rafailov et al. 2023) fits the policy to the pairs with the loss of Eq. 7,
    L = −log σ(β·h),   h = log π(y_w|x)/π_ref(y_w|x) − log π(y_l|x)/π_ref(y_l|x),
the Bradley–Terry likelihood of the labels when the reward is β·log π/π_ref. Against ppo.py the job loses
the rollout engine, the reward service, the critic and the weight broadcast; π_ref is needed only through
log π_ref(y|x) of the fixed pairs, which precompute.py computes once, so by default no reference model is
resident here. Writes out/dpo/: model.safetensors (+ tokenizer.json), metrics.jsonl, eval.json, ckpt/.
"""
import math
import os
import shutil
from contextlib import nullcontext
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

import data
import precompute
import sft
from evaluate import evaluate_policy, print_samples
from model import anatomy, format_anatomy, estimate_flops, load_model, save_model
from plumbing import (Logger, adamw, all_reduce_sum, atomic_write_json, autocast, barrier, check,
                      checkpoint_state, clock, init_distributed, lap, lr_at, measure_peak_flops, parse_config,
                      require_stage, resume, save_checkpoint, split_batch, teardown)

# ==== config


@dataclass
class Config:
    out_dir: str = "out/dpo"  # this stage's folder: policy, tokenizer, metrics, eval, checkpoint
    ref_model: str = "out/sft/model.safetensors"  # π_ref, where the policy starts; built by sft.py if missing
    train_pairs: str = "out/task/pairs_train.jsonl"  # preference JSONL {"prompt","chosen","rejected"}
    val_pairs: str = "out/task/pairs_val.jsonl"  # held-out pairs for the val loss and accuracy
    eval_prompts: str = "out/task/prompts_eval.jsonl"  # held-out prompts for true reward and KL at the end
    ref_logps: str = "out/ref_logps"  # precompute.py's cache of log π_ref; built if missing
    ref: str = "cache"  # "cache": read log π_ref from ref_logps; "live": run π_ref every step (what precompute removes)
    loss: str = "sigmoid"  # "sigmoid": DPO, Eq. 7; "ipo": Azar et al. 2023, Eq. 17
    beta: float = 0.5  # strength of the KL(π‖π_ref) constraint; the implicit reward is β log π/π_ref
    label_smoothing: float = 0.0  # ε: the chance a label is flipped (conservative DPO); sigmoid loss only
    max_len: int = 64  # tokens of prompt + response; must match the cache (its fingerprint checks it)
    max_prompt_len: int = 16  # a truncated prompt keeps at least this many tokens
    steps: int = 100  # optimizer steps
    batch_size: int = 64  # global batch in pairs per step, all ranks together
    micro_batch_size: int = 32  # pairs per forward on one rank (2x rows); accumulation is derived from it
    lr: float = 3e-4  # peak AdamW learning rate (tuned on the built-in task)
    warmup: int = 10  # linear warmup steps (the DPO paper warms up too), then cosine decay
    min_lr_frac: float = 0.1  # cosine ends at this fraction of lr
    weight_decay: float = 0.0  # AdamW decay on matrices; 0 as the DPO paper: the KL term already regularises
    grad_clip: float = 10.0  # max global grad norm (the DPO paper's value)
    eval_every: int = 25  # steps between held-out loss / accuracy evaluations
    ckpt_every: int = 50  # steps between checkpoints (and one at the end)
    eval_k: int = 4  # completions per held-out prompt from each model in the final evaluation
    seed: int = 1337  # data order
    compile: bool = False  # torch.compile the policy (worth it on CUDA)
    resume: bool = True  # continue from out_dir/ckpt if it holds this same config
    stop_after: int = 0  # stop after this many steps of this run, checkpointed (0 = run to the end)


def dpo_loss(pi_chosen, pi_rejected, ref_chosen, ref_rejected, beta, loss="sigmoid", label_smoothing=0.0):
    """Per-pair losses of DPO and its variants. All inputs (B,) summed response log-probs log π(y|x) of
    the chosen y_w and the rejected y_l. Returns losses (B,) and the implicit rewards
    r̂(x,y) = β log π(y|x)/π_ref(y|x) (Sec. 5 of Rafailov et al. 2023) of chosen and rejected, (B,) detached.
        h = log π(y_w)/π_ref(y_w) − log π(y_l)/π_ref(y_l)      the log-ratio difference
      sigmoid: −log σ(βh)                      Eq. 7 of Rafailov et al. 2023
               −(1−ε) log σ(βh) − ε log σ(−βh)   with label_smoothing ε: conservative DPO (Mitchell 2023),
                                                 the expected loss when each label is flipped with prob. ε
      ipo:     (h − 1/(2β))²                   Eq. 17 of Azar et al. 2023, on summed log-probs as the DPO
                                                 repo (TRL's "ipo" first averages them over tokens)
    The gradient of the sigmoid loss (Sec. 4): −β σ(r̂(x,y_l) − r̂(x,y_w)) [∇log π(y_w) − ∇log π(y_l)], a
    pair weighs more the more the implicit reward misorders it."""
    h = (pi_chosen - ref_chosen) - (pi_rejected - ref_rejected)
    if loss == "ipo":
        losses = (h - 1 / (2 * beta)) ** 2  # regresses h onto 1/(2β) instead of pushing it to +∞
    else:
        losses = -(1 - label_smoothing) * F.logsigmoid(beta * h) - label_smoothing * F.logsigmoid(-beta * h)
    return losses, beta * (pi_chosen - ref_chosen).detach(), beta * (pi_rejected - ref_rejected).detach()


@torch.no_grad()
def evaluate_pairs(model, ref_model, ref_logps, examples, cfg, d, pad):
    """Held-out DPO loss and reward accuracy over every val pair, ranks taking every world-th micro-batch.
    The reference log-probs come from the cache (ref_logps, (2, N)), or from ref_model in live mode."""
    sums = torch.zeros(3, device=d.device)  # loss, correctly ordered pairs, pairs
    mb = cfg.micro_batch_size
    for i in range(d.rank * mb, len(examples), d.world * mb):
        b = data.collate_pairs(examples[i:i + mb], pad)
        x, y = b["input_ids"].to(d.device), b["targets"].to(d.device)
        with autocast(d.device):
            pi_c, pi_r = precompute.pair_logps(model, x, y).chunk(2)
            ref_c, ref_r = (ref_logps[:, b["index"]].to(d.device) if ref_model is None
                            else precompute.pair_logps(ref_model, x, y).chunk(2))
        losses, r_c, r_r = dpo_loss(pi_c, pi_r, ref_c, ref_r, cfg.beta, cfg.loss, cfg.label_smoothing)
        sums += torch.stack([losses.sum(), (r_c > r_r).float().sum(), torch.tensor(float(len(losses)), device=d.device)])
    loss, correct, n = all_reduce_sum(sums, d).tolist()
    return loss / n, correct / n


def main(cfg):
    # ==== setup: ranks, device, inputs (a missing earlier stage is built with its defaults)
    d = init_distributed()
    say = lambda *a: print(*a, flush=True) if d.is_main else None  # rank 0 speaks
    check(cfg.ref in ("cache", "live"), f"--ref must be cache or live, got {cfg.ref!r}")
    check(cfg.loss in ("sigmoid", "ipo"), f"--loss must be sigmoid or ipo, got {cfg.loss!r}")
    check(cfg.loss == "sigmoid" or cfg.label_smoothing == 0, "--label_smoothing applies to the sigmoid loss only")
    check(0 <= cfg.label_smoothing < 0.5 and cfg.beta > 0, "need beta > 0 and 0 <= label_smoothing < 0.5")
    pc = precompute.Config(out_dir=cfg.ref_logps, ref_model=cfg.ref_model, train_pairs=cfg.train_pairs,
                           val_pairs=cfg.val_pairs, max_len=cfg.max_len, max_prompt_len=cfg.max_prompt_len)
    precompute.require_inputs(pc, d, say)  # π_ref (sft.py) and the pairs (the built-in task)
    require_stage(cfg.eval_prompts, Config.eval_prompts, lambda: sft.build_task(d), "python data.py", d, say)
    tok = data.load_tokenizer(precompute.tokenizer_path(cfg.ref_model))
    train, stats = data.tokenize_pairs(tok, data.read_pairs(cfg.train_pairs), cfg.max_len, cfg.max_prompt_len)
    val, _ = data.tokenize_pairs(tok, data.read_pairs(cfg.val_pairs), cfg.max_len, cfg.max_prompt_len)
    say(f"data: {len(train)} train pairs ({stats['truncated_prompt']} prompts and {stats['truncated_response']} "
              f"responses truncated to {cfg.max_len} tokens, {stats['unusable']} unusable), {len(val)} val pairs")
    check(len(train) >= cfg.batch_size, f"{cfg.train_pairs} has {len(train)} usable pairs, fewer than --batch_size")
    ref_train = ref_val = None
    if cfg.ref == "cache":  # the reference's only trace in this job: two fp32 numbers per pair
        for split in ("train", "val"):
            path = os.path.join(cfg.ref_logps, f"{split}.safetensors")
            require_stage(path, os.path.join(Config.ref_logps, f"{split}.safetensors"),
                          lambda: (precompute.main(pc), barrier(d)), precompute.command(pc), d, say)
        ref_train = precompute.load_ref_logps(os.path.join(cfg.ref_logps, "train.safetensors"), pc, "train", train)
        ref_val = precompute.load_ref_logps(os.path.join(cfg.ref_logps, "val.safetensors"), pc, "val", val)

    # ==== models resident in the training job
    raw_model, _ = load_model(cfg.ref_model, d.device)  # the policy starts as π_ref (Sec. 4: π_θ = π_ref at step 0)
    check(cfg.max_len <= raw_model.config.block_size, f"--max_len {cfg.max_len} > block_size {raw_model.config.block_size}")
    # Eval mode for good: no dropout (as TRL's disable_dropout), so log π is deterministic, equals
    # log π_ref exactly at step 0, and the cached and live references see the same function.
    raw_model.eval()
    ref_model = None
    if cfg.ref == "live":  # what precompute removes: a second, frozen copy run forward every step
        ref_model = load_model(cfg.ref_model, d.device)[0].eval().requires_grad_(False)
    model = torch.compile(raw_model) if cfg.compile else raw_model
    if d.world > 1:
        model = DDP(model, device_ids=[d.local_rank] if d.device.type == "cuda" else None)

    # ==== anatomy: what the job holds and what a token costs
    resident = {"policy": raw_model, **({"reference": ref_model} if ref_model is not None else {})}
    say(format_anatomy(anatomy(resident, cfg.max_len), cfg.max_len))
    if ref_train is not None:
        say(f"reference: no model, a cache of {(ref_train.numel() + ref_val.numel()) * 4 / 2**20:.3f} MiB "
                  f"(2 fp32 per pair) read from {cfg.ref_logps}")

    # ==== optimizer, schedule, resume
    opt = adamw(raw_model, cfg.lr, cfg.weight_decay)
    ckpt_dir = os.path.join(cfg.out_dir, "ckpt")
    start, _ = resume(ckpt_dir, cfg, {"model": raw_model, "optim": opt}, d.device, say,
                      free=("resume", "stop_after", "ref", "compile"))  # cached and live: the same run
    log = Logger(cfg.out_dir, d, resume_step=start)  # metrics.jsonl keeps the steps up to `start`
    accum = split_batch(cfg.batch_size, cfg.micro_batch_size, d.world)
    mb = cfg.batch_size // d.world // accum  # pairs per forward on this rank
    peak = measure_peak_flops(d.device)
    say(f"{cfg.loss} loss, beta {cfg.beta} | reference: {cfg.ref} | batch {cfg.batch_size} pairs = {d.world} ranks "
              f"x {accum} accumulation x {mb} | device {d.device} | peak {peak / 1e9:.1f} GFLOP/s per rank (measured)")

    # ==== training loop
    end = cfg.steps if not cfg.stop_after else min(cfg.steps, start + cfg.stop_after)
    for step in range(start, end):
        times = {"t": clock(d)}
        t_step = times["t"]
        lr = lr_at(step, cfg.steps, cfg.lr, cfg.warmup, cfg.min_lr_frac)
        for g in opt.param_groups:
            g["lr"] = lr
        mine = data.rank_slice(data.global_batch(len(train), cfg.batch_size, step, cfg.seed), d.rank, d.world)
        sums = torch.zeros(8, device=d.device)  # loss, r̂_w, r̂_l, accuracy, margin, logp_w, logp_l, tokens
        flops = 0
        for m in range(accum):
            # -- batch
            b = data.collate_pairs([train[i] for i in mine[m * mb:(m + 1) * mb]], tok.pad)
            x, y = b["input_ids"].to(d.device), b["targets"].to(d.device)  # (2B, T): [chosen; rejected]
            lap(times, "batch", d)
            sync = d.world == 1 or m == accum - 1  # all-reduce the grads only on the last micro-step
            with (nullcontext() if sync else model.no_sync()), autocast(d.device):
                # -- policy forward
                pi_c, pi_r = precompute.pair_logps(model, x, y).chunk(2)  # (B,), (B,): one forward, both halves
                lap(times, "policy_forward", d)
                # -- reference log-probs
                if ref_model is None:
                    ref_c, ref_r = ref_train[:, b["index"]].to(d.device)  # a lookup: no model, no FLOPs
                else:
                    with torch.no_grad():  # π_ref is frozen: forward only, no activations kept
                        ref_c, ref_r = precompute.pair_logps(ref_model, x, y).chunk(2)
                    flops += estimate_flops(ref_model.config, *x.shape)
                lap(times, "reference", d)
                # -- loss
                losses, r_c, r_r = dpo_loss(pi_c, pi_r, ref_c, ref_r, cfg.beta, cfg.loss, cfg.label_smoothing)
                # Sum over this micro-batch / the global batch size, x world because DDP averages over
                # ranks: the gradient is the mean over the global batch for any world size and accumulation.
                (losses.sum() * d.world / cfg.batch_size).backward()
                flops += estimate_flops(raw_model.config, *x.shape, backward=True)
                lap(times, "loss", d)  # the backward included
            sums += torch.stack([losses.sum().detach(), r_c.sum(), r_r.sum(), (r_c > r_r).float().sum(),
                                 (r_c - r_r).sum(), pi_c.sum().detach(), pi_r.sum().detach(),
                                 (x != tok.pad).sum().float()])
        # -- update
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        sums = all_reduce_sum(sums, d) / cfg.batch_size  # metrics: means over the global batch, as the loss
        loss = sums[0].item()
        if not (math.isfinite(loss) and math.isfinite(grad_norm.item())):  # same on every rank: all-reduced
            last = checkpoint_state(ckpt_dir)
            kept = f"{ckpt_dir} at step {last['step']}" if last else "none (no checkpoint was written yet)"
            raise SystemExit(f"error: non-finite loss ({loss}) or grad norm ({grad_norm.item()}) at step {step + 1}: "
                             f"stopped before the update; the last good checkpoint is kept: {kept}. "
                             f"Try a lower --lr or --beta.")
        opt.step()
        opt.zero_grad(set_to_none=True)
        lap(times, "update", d)
        dt = times.pop("t") - t_step
        metrics = {"loss": loss, "rewards/chosen": sums[1].item(), "rewards/rejected": sums[2].item(),
                   "rewards/accuracies": sums[3].item(), "rewards/margins": sums[4].item(),
                   "logps/chosen": sums[5].item(), "logps/rejected": sums[6].item(), "grad_norm": grad_norm.item(),
                   "lr": lr, "tokens_per_sec": sums[7].item() * cfg.batch_size / dt, "mfu": flops / dt / peak,
                   "time/step": 1000 * dt, **times}
        if (step + 1) % cfg.eval_every == 0 or step + 1 == cfg.steps:
            metrics["val_loss"], metrics["val_accuracy"] = evaluate_pairs(raw_model, ref_model, ref_val, val, cfg, d, tok.pad)
        log.log(step + 1, cfg.steps, metrics)
        if d.is_main and ((step + 1) % cfg.ckpt_every == 0 or step + 1 == end):
            save_checkpoint(ckpt_dir, step + 1, {"model": raw_model, "optim": opt}, {"config": asdict(cfg)})
    barrier(d)  # rank 0's checkpoint is on disk before any rank moves on
    if end < cfg.steps:
        say(f"stopped after {end - start} steps (--stop_after); run again to resume from step {end}")
        return teardown(d)

    # ==== evaluation and outputs
    val_loss, val_acc = evaluate_pairs(raw_model, ref_model, ref_val, val, cfg, d, tok.pad)
    # Sampling needs π_ref itself (its completions, and log π_ref of the policy's for the KL): the
    # evaluation loads it; the training loop above never did in the default mode.
    ref_eval = ref_model if ref_model is not None else load_model(cfg.ref_model, d.device)[0].eval()
    res = evaluate_policy(raw_model, ref_eval, tok, data.read_prompts(cfg.eval_prompts), d, k=cfg.eval_k)
    if d.is_main:
        save_model(raw_model, os.path.join(cfg.out_dir, "model.safetensors"),
                   {"stage": "dpo", "step": cfg.steps, "ref_model": cfg.ref_model, "loss": cfg.loss, "beta": cfg.beta})
        shutil.copyfile(precompute.tokenizer_path(cfg.ref_model), os.path.join(cfg.out_dir, "tokenizer.json.tmp"))
        os.replace(os.path.join(cfg.out_dir, "tokenizer.json.tmp"), os.path.join(cfg.out_dir, "tokenizer.json"))
        atomic_write_json(os.path.join(cfg.out_dir, "eval.json"), {"val_accuracy": val_acc, "val_loss": val_loss, **res,
                          "steps": cfg.steps, "loss": cfg.loss, "beta": cfg.beta})
        print_samples(res, say)
        say(f"held-out pairs: accuracy {val_acc:.3f}, loss {val_loss:.4f} | true reward {res['true_reward']:+.3f} "
                  f"± {res['true_reward_std']:.3f} (π_ref {res['ref_true_reward']:+.3f} ± {res['ref_true_reward_std']:.3f}) "
                  f"| KL(π‖π_ref) {res['kl']:.3f} nats | win rate {res['win_rate']:.3f} | saved {cfg.out_dir}/model.safetensors")
    barrier(d)
    teardown(d)


if __name__ == "__main__":
    main(parse_config(Config, doc=__doc__))
