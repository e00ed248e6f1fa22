"""Align π_ref to the preference pairs with DPO: one forward over [chosen; rejected], one loss.

    python dpo.py                         # one process; builds sft and the cache if missing
    torchrun --nproc_per_node=8 dpo.py    # plain DDP over 8 ranks (nccl on GPUs, gloo on CPUs)
    torchrun --nproc_per_node=8 dpo.py --fsdp   # FSDP2: each rank holds 1/8 of the model state
    python dpo.py --ref live              # run π_ref every step instead of reading the cache
    python dpo.py --loss ipo --beta 0.1   # IPO; --label_smoothing 0.1 for conservative DPO (cDPO)
    python dpo.py --loss simpo --beta 2   # SimPO: no π_ref in the job, so no cache either
    python dpo.py --help                  # every flag

Direct Preference Optimization (Rafailov et al. 2023) fits the policy to the pairs with Eq. 7,
    L = −log σ(β·h),   h = log π(y_w|x)/π_ref(y_w|x) − log π(y_l|x)/π_ref(y_l|x),
the Bradley–Terry likelihood of the labels when the reward is β·log π/π_ref. Read it beside
ppo.py: the two files share their sections and loop headers, and DPO deletes from PPO's job
  1. the reward model and its training (reward.py), and the reward service that scores rollouts:
     the pairs are the signal;
  2. the rollout engine, its inference copy of the policy, and the weight broadcast that refreshes
     it: nothing is sampled during training;
  3. the critic (PPO's old log-probs and values), the per-token rewards with the KL penalty, and
     the advantages (GAE): the loss is a closed form in log-probs of fixed responses, and the β·KL
     constraint is inside it (Sec. 4);
  4. the live reference model: log π_ref(y|x) of the fixed pairs never changes, so precompute.py
     computes it once and this job reads a file (`--ref live` keeps π_ref resident to show it).
What DPO adds is that one-time precompute. SimPO (Meng et al. 2024, `--loss simpo`) deletes
  5. the precompute file and the KL anchor: its implicit reward is the policy's own mean log-prob
     per token, with no π_ref in it, so no cache is built or read and the job holds one model, the
     policy (which still starts from π_ref, --ref_model). Nothing in the loss holds the policy
     near π_ref; the final evaluation loads π_ref, as every method's does, to measure the KL.
Writes out/dpo/: model.safetensors (+ tokenizer.json), metrics.jsonl, eval.json, ckpt/.
"""

import math
import os
from dataclasses import asdict, dataclass

import numpy as np
import torch
import torch.nn.functional as F

import data
import precompute
import sft
from checkpoint import (check_step, input_fingerprint, load_ref_logps, prepare_outputs,
                        require_same_tokenizer, resumable, resume, save_checkpoint, save_outputs,
                        tokenizer_beside)
from evaluate import evaluate_held_out, print_samples, summary
from meter import Meter, anatomy, batch_flops, format_anatomy, matmul_shapes, measure_peak_flops
from model import IGNORE, freeze, load_model, pair_logps
from plumbing import (Logger, adamw, autocast, barrier, check, gathered, init_distributed, lr_at,
                      parse_config, precision, reduce_sums, require_stage, set_lr, sharded,
                      split_batch, sync_grads, teardown, wrap)
from task import require_task

# ==== config


@dataclass
class Config:
    out_dir: str = "out/dpo"  # this stage's folder: policy, tokenizer, metrics, eval, checkpoint
    ref_model: str = "out/sft/model.safetensors"  # π_ref, where the policy starts; built if missing
    init: str = ""  # start the policy here instead ("": π_ref); iterative DPO's later rounds do
    train_pairs: str = "out/task/pairs_train.jsonl"  # JSONL {"prompt","chosen","rejected"}
    val_pairs: str = "out/task/pairs_val.jsonl"  # held-out pairs for the val loss and accuracy
    test_prompts: str = "out/task/prompts_test.jsonl"  # held-out prompts: true reward and KL
    val_prompts: str = ""  # held-out prompts a study selects on, into eval.json's "val" ("": none)
    reward_model: str = ""  # r_φ, read by the evaluation only: eval.json's reward_model_score
    ref_logps: str = "out/ref_logps"  # the log π_ref cache (yours: a subfolder); built if missing
    # "cache": read log π_ref from ref_logps; "live": run π_ref every step (what precompute removes)
    ref: str = "cache"
    # IPO's h is of summed log-probs, as the DPO repo; TRL's "ipo" averages them per token first.
    # SimPO's β scales a mean log-prob per token, not a log-ratio: pass --beta 2 (the default is
    # DPO's); its γ, a margin in those units (β/|y|·log π), defaults to TRL's and torchtune's 0.5
    loss: str = "sigmoid"  # "sigmoid": DPO, Eq. 7; "ipo": Azar 2023, Eq. 17; "simpo": no π_ref
    beta: float = 0.5  # DPO's KL(π‖π_ref) constraint; IPO's τ; SimPO's β (its paper: 2 to 2.5)
    simpo_gamma: float = 0.5  # SimPO's target reward margin γ (its paper: 0.3 to 1.6); simpo only
    label_smoothing: float = 0.0  # ε: chance a label is flipped: cDPO (Mitchell 2023), not rDPO
    rpo_alpha: float = 0.0  # α of an NLL term on the chosen response (RPO); 0: plain DPO, taught
    max_len: int = 64  # tokens of prompt + response; the cache's fingerprint checks it
    max_prompt_len: int = 16  # a truncated prompt keeps at least this many tokens
    # pack each micro-batch's sequences into rows of max_len (data.pack_pairs), not pad them
    pack: bool = True  # the same numbers to fp32 rounding; faster where padding is waste
    steps: int = 200  # optimizer steps: 3.2 epochs of the task's 4,000 pairs (tune.py: flat there)
    batch_size: int = 64  # global batch in pairs per step, all ranks together
    # "shuffle": epochs of seeded permutations of the pairs. "file": one pass in the file's order, a
    # step per row "step" (online_dpo.py's pairs.jsonl: its steps, replayed) or per batch_size
    # rows. "steps": those same batches, each whole, in an order drawn from --seed
    order: str = "shuffle"
    micro_batch_size: int = 32  # pairs per forward on one rank (2x rows); accumulation is derived
    lr: float = 1e-3  # peak AdamW learning rate (tune.py: best of 1e-4, 3e-4, 1e-3 at β 0.3)
    warmup: int = 10  # linear warmup steps (the DPO paper warms up too), then cosine decay
    min_lr_frac: float = 0.1  # cosine ends at this fraction of lr
    weight_decay: float = 0.0  # AdamW decay on matrices; 0 as the DPO paper: KL regularises
    grad_clip: float = 10.0  # max global grad norm (the DPO paper's value)
    eval_every: int = 25  # steps between held-out loss / accuracy evaluations
    ckpt_every: int = 50  # steps between checkpoints (and one at the end)
    eval_k: int = 4  # completions per held-out prompt from each model in the final evaluation
    seed: int = 1337  # data order
    compile: bool = False  # torch.compile the policy (worth it on CUDA)
    fsdp: bool = False  # shard weights, grads and AdamW state over the ranks (FSDP2), not DDP
    resume: bool = True  # continue from out_dir/ckpt if it holds this same config
    stop_after: int = 0  # stop after this many steps of this run, checkpointed (0 = run to the end)


# ==== losses and estimators: pure functions


def dpo_loss(pi_chosen, pi_rejected, ref_chosen, ref_rejected, beta, loss="sigmoid",
             label_smoothing=0.0, rpo_alpha=0.0, chosen_len=None):
    """Per-pair losses of DPO and its variants. All inputs (B,) summed response log-probs log π(y|x)
    of the chosen y_w and the rejected y_l. Returns losses (B,) and the implicit rewards
    r̂(x,y) = β log π(y|x)/π_ref(y|x) (Sec. 5 of Rafailov et al. 2023) of chosen and rejected,
    (B,) detached.
        h = log π(y_w)/π_ref(y_w) − log π(y_l)/π_ref(y_l)      the log-ratio difference
      sigmoid: −log σ(βh)                        Eq. 7 of Rafailov et al. 2023
               −(1−ε) log σ(βh) − ε log σ(−βh)   with label_smoothing ε: conservative DPO, cDPO
                                                 (Mitchell 2023, "A note on DPO with noisy
                                                 preferences"): the expected loss when each label
                                                 is flipped with probability ε, as the DPO repo's
                                                 label_smoothing. Not TRL's "robust" (rDPO,
                                                 Chowdhury et al. 2024), which divides the
                                                 difference of the two terms by 1−2ε; TRL's
                                                 "sigmoid" has no smoothing.
      ipo:     (h − 1/(2β))²                     Eq. 17 of Azar et al. 2023 (β is its τ), h from
                                                 summed log-probs as the DPO repo. TRL's "ipo"
                                                 divides each response's log-ratio by its length
                                                 first, so h is per token there: for responses of
                                                 about n tokens, TRL's β is about n times the β
                                                 that asks for the same margin here
    The gradient of the sigmoid loss (Sec. 4) is
        −β σ(r̂(x,y_l) − r̂(x,y_w)) [∇log π(y_w) − ∇log π(y_l)]:
    a pair weighs more the more the implicit reward misorders it. Nothing in it stops both
    log-probs from falling together while h grows, and the mass they lose can go to tokens neither
    response holds (likelihood displacement, Razin et al. 2024), EOS among the first here.
      + α · (−log π(y_w|x) / |y_w|)   with rpo_alpha α and chosen_len |y_w| (tokens, EOS included):
                                       the length-normalised NLL of the chosen response, as Pang
                                       et al. 2024 (iterative RPO; TRL's rpo_alpha averages over
                                       the batch's chosen tokens instead): it holds log π(y_w) up"""
    h = (pi_chosen - ref_chosen) - (pi_rejected - ref_rejected)
    if loss == "ipo":
        losses = (h - 1 / (2 * beta)) ** 2  # regresses h onto 1/(2β) instead of pushing it to +∞
    else:
        losses = (-(1 - label_smoothing) * F.logsigmoid(beta * h)
                  - label_smoothing * F.logsigmoid(-beta * h))
    if rpo_alpha:
        losses = losses - rpo_alpha * pi_chosen / chosen_len
    r_chosen = beta * (pi_chosen - ref_chosen).detach()
    r_rejected = beta * (pi_rejected - ref_rejected).detach()
    return losses, r_chosen, r_rejected


def simpo_loss(pi_chosen, pi_rejected, chosen_len, rejected_len, beta, gamma):
    """SimPO's per-pair losses, Eq. 6 of Meng et al. 2024, with no π_ref. pi_* (B,) summed response
    log-probs log π(y|x) of chosen y_w and rejected y_l, *_len (B,) their tokens |y| (EOS
    included). Returns losses (B,) and SimPO's rewards r(x,y) = β/|y| · log π(y|x) (Eq. 4) of
    chosen and rejected, (B,) detached, as TRL's CPOTrainer logs them under loss_type="simpo".
        L = −log σ(β/|y_w| · log π(y_w|x) − β/|y_l| · log π(y_l|x) − γ)
    The reward is the mean log-prob per token, the quantity sampling ranks by, so a longer
    response is not rewarded for its length; γ is a target margin the reward difference must
    pass (Bradley–Terry with a margin, Eq. 5). Its gradient is
        −σ(γ − r(x,y_w) + r(x,y_l)) · β [∇log π(y_w)/|y_w| − ∇log π(y_l)/|y_l|]:
    DPO's form, with no log π_ref in the weight, so nothing ties π to π_ref (the KL anchor)."""
    r_chosen, r_rejected = beta * pi_chosen / chosen_len, beta * pi_rejected / rejected_len
    losses = -F.logsigmoid(r_chosen - r_rejected - gamma)
    return losses, r_chosen.detach(), r_rejected.detach()

# ==== helpers the loop calls


def response_len(targets, seq=None):
    """Tokens of each response (EOS included) in a [chosen; rejected] batch, padded (a sequence per
    row) or packed (seq: each position's sequence id, as pair_logps reads it): (2, B), chosen's
    row first."""
    keep = targets != IGNORE
    n = keep.sum(1) if seq is None else torch.bincount(seq[keep], minlength=int(seq.max()) + 1)
    return n.view(2, -1)


def step_batch(step, lengths, file_steps, cfg):
    """The step's global batch (indices of the train pairs, whose longest_row is `lengths`):
    data.global_batch's draw from epochs of seeded permutations, longest first, which lets each
    micro-batch pad to its own longest row and leaves the loss and gradient the unsorted batch's
    up to fp32 rounding; or (--order file or steps) file_steps[step], the file's batch in the
    file's order, the order online DPO's micro-batches took its pairs in, so that a replay does
    its very arithmetic (on one process, --no-pack --ref live: its weights, bit for bit)."""
    if file_steps is None:
        return data.global_batch(len(lengths), cfg.batch_size, step, cfg.seed, lengths)
    return list(file_steps[step])


def replay_steps(rows, train, cfg, world):
    """--order file or steps: the global batches of one pass over the train pairs (data.read_pairs'
    rows, the usable ones `train`), a list of positions in train per step: the file's steps
    (data.file_batches), in its order or (steps) in the order --seed draws; refused when there are
    fewer than --steps of them, or when world ranks cannot share one evenly."""
    stepped = any("step" in r for r in rows)  # all rows or none (file_batches)
    check(stepped or len(rows) >= cfg.batch_size, f"--batch_size {cfg.batch_size} is more "
          f"than the {len(rows)} rows of {cfg.train_pairs}, which have no \"step\": --order "
          f"{cfg.order} takes a step per --batch_size rows, so not one step fits")
    steps = data.file_batches(rows, train, cfg.batch_size, cfg.train_pairs)
    if cfg.order == "steps":
        steps = [steps[i] for i in np.random.default_rng(cfg.seed).permutation(len(steps))]
    check(cfg.steps <= len(steps), f"--steps {cfg.steps} is more than the {len(steps)} batches "
          f"of one pass over {cfg.train_pairs} (--order {cfg.order})")
    uneven = next((b for b in steps if len(b) % world), None)
    if uneven is not None:  # online DPO's steps keep their untied pairs: any number of them
        i = train[uneven[0]]["index"]
        what, why = ((f"the step of \"step\" {rows[i]['step']}", "online DPO writes the pairs "
                      "of a step that did not tie, any number of them") if stepped else
                     ("the batch of --batch_size rows from here", "its unusable rows left out"))
        sizes = math.gcd(*map(len, steps))
        check(False, f"{cfg.train_pairs}:{data.row_lines(cfg.train_pairs)[i]}: {what} holds "
              f"{len(uneven)} pairs ({why}), which {world} ranks cannot share evenly: replay it "
              f"on one process (python dpo.py, not torchrun)"
              + (f", or on a number of ranks that divides {sizes}, every step's size"
                 if sizes > 1 else ""))
    return steps


def micro_batches(mine, accum):
    """This rank's share cut into at most accum contiguous micro-batches, none empty: accum of
    micro_batch_size from a full batch; fewer from a file's smaller step."""
    per = -(-len(mine) // accum)
    return [mine[i:i + per] for i in range(0, len(mine), per)]


def pair_loss(pi_c, pi_r, ref_lp, y, s, cfg):
    """The configured loss of a micro-batch (losses and the implicit rewards of chosen and
    rejected, (B,) each): dpo_loss from ref_lp, log π_ref (2, B); or simpo_loss, whose ref_lp is
    None."""
    n_c, n_r = response_len(y, s)
    if cfg.loss == "simpo":
        return simpo_loss(pi_c, pi_r, n_c, n_r, cfg.beta, cfg.simpo_gamma)
    return dpo_loss(pi_c, pi_r, *ref_lp, cfg.beta, cfg.loss, cfg.label_smoothing, cfg.rpo_alpha,
                    n_c)


@torch.no_grad()
def evaluate_pairs(policy, ref, ref_logps, examples, cfg, d, pad):
    """Held-out DPO loss and reward accuracy over every val pair, ranks taking every world-th
    micro-batch. log π_ref comes from the cache (ref_logps, (2, N)), or from ref (--ref live);
    --loss simpo reads none (both None).
    Packed; or (--no-pack) in order of length, so each micro-batch is padded only to its own
    longest row (packing fills rows best from a mix of lengths, as precompute_ref_logps)."""
    loss = correct = n = 0.0
    micro_batch = cfg.micro_batch_size
    examples = examples if cfg.pack else sorted(examples, key=data.longest_row)
    # --fsdp: whole weights on every rank for this pass, whose ranks run unequal numbers of
    # forwards (a forward of a sharded model is a collective)
    with gathered(policy, ref):
        for i in range(d.rank * micro_batch, len(examples), d.world * micro_batch):
            b = data.collate_pairs(examples[i:i + micro_batch], pad, cfg.pack * cfg.max_len)
            x, y, s = data.batch_to(b, d.device)
            with autocast(d.device):
                pi_c, pi_r = pair_logps(policy, x, y, s).chunk(2)
                ref_lp = (pair_logps(ref, x, y, s).view(2, -1) if ref is not None
                          else None if ref_logps is None else ref_logps[:, b["index"]].to(d.device))
            losses, r_c, r_r = pair_loss(pi_c, pi_r, ref_lp, y, s, cfg)
            loss, correct, n = loss + losses.sum(), correct + (r_c > r_r).sum(), n + len(losses)
    s = reduce_sums(d, loss=loss, correct=correct, n=n)
    return s["loss"] / s["n"], s["correct"] / s["n"]


# the metrics a step's log line shows (metrics.jsonl holds them all)
SHOWN = ("loss", "rewards/accuracies", "rewards/margins", "grad_norm", "lr", "val_loss",
         "val_accuracy", "time/step")


# ==== setup: ranks, device, inputs (a missing earlier stage is built with its defaults)


def resume_free(cfg):
    """The flags a resumed run may change. Cached and live are the same run, so either may resume
    the other; γ is SimPO's alone; the validation prompts are read by the last evaluation only
    (iterative_dpo.py's last round)."""
    return (("resume", "stop_after", "ref", "compile", "fsdp", "pack", "reward_model",
             "val_prompts") + ("simpo_gamma",) * (cfg.loss != "simpo"))


def setup(cfg, d, log):
    """The pairs, tokenized, π_ref's tokenizer, what the weights are trained from, and (the
    default) precompute.py's cache of log π_ref, built when missing; none under --loss simpo."""
    check(cfg.ref in ("cache", "live"), f"--ref must be cache or live, got {cfg.ref!r}")
    check(cfg.loss in ("sigmoid", "ipo", "simpo"),
          f"--loss must be sigmoid, ipo or simpo, got {cfg.loss!r}")
    simpo = cfg.loss == "simpo"
    check(not simpo or cfg.ref == "cache", "--loss simpo has no π_ref: --ref live would run one "
          "for nothing")
    check(not simpo or cfg.rpo_alpha == 0, "--rpo_alpha applies to DPO's losses, not to simpo")
    check(simpo or cfg.simpo_gamma == Config.simpo_gamma, "--simpo_gamma applies to --loss simpo")
    check(cfg.loss == "sigmoid" or cfg.label_smoothing == 0,
          "--label_smoothing applies to the sigmoid loss only")
    check(0 <= cfg.label_smoothing < 0.5 and cfg.beta > 0,
          "need beta > 0 and 0 <= label_smoothing < 0.5")
    check(cfg.order in ("shuffle", "file", "steps"),
          f"--order must be shuffle, file or steps, got {cfg.order!r}")
    # the cache for these inputs: yours get a folder of their own, and your pairs need your π_ref
    # (SimPO's too, whose policy starts from it, though its loss has no log π_ref to cache)
    pc = precompute.plan(precompute.Config(
        out_dir=cfg.ref_logps, ref_model=cfg.ref_model, train_pairs=cfg.train_pairs,
        val_pairs=cfg.val_pairs, max_len=cfg.max_len, max_prompt_len=cfg.max_prompt_len,
        pack=cfg.pack),
        [("--test_prompts", cfg.test_prompts, Config.test_prompts)])
    use_cache = cfg.ref == "cache" and not simpo
    # outputs first: a bad folder stops the run now, not after hours (the cache's if it is built)
    caches = [os.path.join(pc.out_dir, f"{split}.safetensors") for split in ("train", "val")]
    build_cache = use_cache and not all(map(os.path.exists, caches))
    prepare_outputs({cfg.out_dir: "--out_dir", os.path.join(cfg.out_dir, "ckpt"): "--out_dir",
                     **({pc.out_dir: "--ref_logps"} if build_cache else {})}, d, log)
    require_stage(cfg.ref_model, Config.ref_model, lambda: sft.main(sft.Config()),
                  "python sft.py", d, log)
    tok_path = tokenizer_beside(cfg.ref_model)
    require_task({cfg.train_pairs: Config.train_pairs, cfg.val_pairs: Config.val_pairs,
                  cfg.test_prompts: Config.test_prompts,
                  cfg.val_prompts: Config.val_prompts}, d, log)
    if cfg.init:  # a policy of this π_ref's tokenizer (written beside it by dpo.py)
        check(os.path.exists(cfg.init), f"--init {cfg.init} does not exist")
        require_same_tokenizer(cfg.init, "--init", tok_path)
    tok = data.load_tokenizer(tok_path)
    # SimPO's γ is a target for β·(mean log-prob per token of y_w − that of y_l) (Eq. 6), so γ/β
    # is a gap in nats per token. ln V is the gap between certainty (0 nats per token) and a
    # uniform guess over the vocabulary (−ln V): a larger target asks the policy to push rejected
    # tokens below chance, σ(γ − margin) stays near 1 for every pair, and γ then only adds to the
    # loss (at γ 1e30 it reads 1e30 every step, which the guard, scaled to the first loss, passes).
    gap = cfg.beta * math.log(tok.vocab_size)
    check(not simpo or cfg.simpo_gamma <= gap, f"--simpo_gamma {cfg.simpo_gamma:g} is above "
          f"--beta {cfg.beta:g} x ln V = {gap:.3f} (V = {tok.vocab_size}, π_ref's vocabulary): the "
          "margin γ/β is in nats per token, and beyond ln V (certainty over a uniform guess) no "
          f"pair can be asked to reach it; pass a γ in [0, {gap:.3f}] (SimPO's paper: 0.3 to 1.6 "
          "at β 2 to 2.5)")
    rows = data.read_pairs(cfg.train_pairs)
    train, stats = data.tokenize_pairs(tok, rows, cfg.max_len, cfg.max_prompt_len, cfg.train_pairs)
    val, _ = data.tokenize_pairs(tok, data.read_pairs(cfg.val_pairs), cfg.max_len,
                                 cfg.max_prompt_len)
    log(f"data: {len(train)} train pairs ({stats['truncated_prompt']} prompts and "
        f"{stats['truncated_response']} responses truncated to {cfg.max_len} tokens, "
        f"{stats['unusable']} unusable), {len(val)} val pairs")
    warn = data.truncation_warning(stats, cfg.train_pairs, cfg.max_len)
    if warn:
        log(warn)
    check(cfg.order != "shuffle" or len(train) >= cfg.batch_size, f"{cfg.train_pairs} has "
          f"{len(train)} usable pairs, fewer than --batch_size {cfg.batch_size}")
    check(len(val) > 0, f"{cfg.val_pairs} has no usable pair: in each row chosen and rejected are "
          f"identical once cut to --max_len {cfg.max_len} tokens")
    file_steps = None  # --order shuffle: data.global_batch draws each step's batch
    if cfg.order != "shuffle":  # one pass: the file's batches, in its order or in a seeded one
        file_steps = replay_steps(rows, train, cfg, d.world)
    # what the weights are trained from (the reference cache is checked against the same files)
    inputs = input_fingerprint({"--ref_model": cfg.ref_model, "tokenizer": tok_path,
                                "--train_pairs": cfg.train_pairs, "--init": cfg.init}, train)
    # a resume of another run is refused now, before a missing cache is built for it
    resumable(os.path.join(cfg.out_dir, "ckpt"), cfg, inputs, resume_free(cfg))
    ref_logps = (None, None)
    if use_cache:  # the reference's only trace in this job: two fp32 numbers per pair
        # with --ref_logps at its default, the cache (the built-in task's, or your pairs' own) is
        # built when missing; an explicit folder must hold it
        auto = precompute.same(cfg.ref_logps, Config.ref_logps)
        for path in caches:
            require_stage(path, path if auto else Config.ref_logps,
                          lambda: (precompute.main(pc), barrier(d)), precompute.command(pc), d, log)
        ref_logps = tuple(load_ref_logps(path, pc, split, examples, d.device,
                                         precompute.command(pc))
                          for path, split, examples in zip(caches, ("train", "val"), (train, val)))
    return tok, tok_path, train, val, inputs, ref_logps, pc.out_dir, file_steps


# ==== models resident in the training job


def load_models(cfg, d):
    """The policy starts as π_ref (Sec. 4: π_θ = π_ref at step 0), or at --init. Eval mode for
    good: no dropout (as TRL's disable_dropout), so log π is deterministic, equals log π_ref
    exactly at step 0, and the cached and the live reference see the same function. With --ref
    live, what precompute removes: a second, frozen copy run forward every step (sharded too with
    --fsdp). --loss simpo: the policy alone. The policy trains under DDP (--fsdp: sharded in
    place), then torch.compile."""
    policy = load_model(cfg.init or cfg.ref_model, d.device)[0].eval()
    check(cfg.max_len <= policy.config.block_size,
          f"--max_len {cfg.max_len} > block_size {policy.config.block_size}")
    ref = None
    if cfg.ref == "live":
        ref = freeze(load_model(cfg.ref_model, d.device)[0], precision(d.device) == "bf16")
        ref = wrap(ref, d, fsdp=cfg.fsdp)
    return policy, ref, wrap(policy, d, cfg.compile, cfg.fsdp)


def main(cfg):
    d = init_distributed()
    log = Logger(cfg.out_dir, d)
    tok, tok_path, train, val, inputs, (ref_train, ref_val), cache, file_steps = setup(
        cfg, d, log.print)
    ckpt_dir = os.path.join(cfg.out_dir, "ckpt")
    lengths = [data.longest_row(e) for e in train]  # to sort each shuffled batch by length

    policy, ref, model = load_models(cfg, d)  # model: what the loop calls (DDP, FSDP, compile)

    # ==== anatomy: what the job holds and what a token costs
    resident = {"policy": policy, **({"reference": ref} if ref is not None else {})}
    log.print(format_anatomy(anatomy(resident, cfg.max_len), cfg.max_len))
    if ref_train is not None:
        mib = (ref_train.numel() + ref_val.numel()) * 4 / 2**20
        log.print(f"reference: no model, a cache of {mib:.3f} MiB (2 fp32 per pair) read from "
                  f"{cache}")
    elif ref is None:
        log.print("reference: none (--loss simpo): no model, no cache built or read")

    # ==== optimizer, schedule, resume
    opt = adamw(policy, cfg.lr, cfg.weight_decay)
    start, state = resume(ckpt_dir, cfg, {"model": policy, "optim": opt}, d.device, log.print,
                          inputs, free=resume_free(cfg))
    first_loss = state.get("first_loss")  # the divergence guard's scale: the loss at π = π_ref
    log.start(start)  # metrics.jsonl keeps the steps up to `start`
    accum = split_batch(cfg.batch_size, cfg.micro_batch_size, d.world)
    micro_batch = cfg.batch_size // d.world // accum  # pairs per forward on this rank
    rows = 2 * micro_batch * cfg.max_len  # positions of one forward: [chosen; rejected]
    peak = measure_peak_flops(d.device, matmul_shapes(policy.config, rows))
    log.print(f"{cfg.loss} loss, beta {cfg.beta} | reference: "
              f"{'none' if cfg.loss == 'simpo' else cfg.ref} | batch "
              f"{cfg.batch_size} pairs = {d.world} ranks x {accum} accumulation x {micro_batch} | "
              f"device {d.device} | peak {peak / 1e9:.1f} GFLOP/s per rank (measured)"
              + (" | sharded (FSDP2)" if sharded(policy) else ""))

    # ==== training loop
    end = cfg.steps if not cfg.stop_after else min(cfg.steps, start + cfg.stop_after)
    meter = Meter(d, peak, compile=cfg.compile)
    for step in range(start, end):
        meter.start()
        lr = set_lr(opt, lr_at(step, cfg.steps, cfg.lr, cfg.warmup, cfg.min_lr_frac))

        # -- batch: this rank's share of the step's global batch of n pairs (step_batch), cut into
        # micro-batches of pairs, each packed into rows of max_len (--no-pack: padded to its own
        # longest row)
        mine = step_batch(step, lengths, file_steps, cfg)
        n, mine = len(mine), data.rank_slice(mine, d.rank, d.world)
        batches = [data.collate_pairs([train[i] for i in rows], tok.pad, cfg.pack * cfg.max_len)
                   for rows in micro_batches(mine, accum)]
        meter.lap("batch")

        # -- reference log-probs: a lookup in precompute.py's cache, no model and no FLOPs (--ref
        # live: π_ref's forward every step, what the cache removes; --loss simpo: none at all)
        ref_lp = []
        for b in batches:
            if ref is None:  # (2, micro_batch)
                ref_lp.append(None if ref_train is None else ref_train[:, b["index"]].to(d.device))
                continue
            x, y, s = data.batch_to(b, d.device)
            with torch.no_grad(), autocast(d.device):  # frozen: no activations kept
                ref_lp.append(pair_logps(ref, x, y, s).view(2, -1))
            meter.count(*batch_flops(ref.config, x, y, tok.pad, seq=s))
        meter.lap("reference")

        for m, b in enumerate(batches):
            x, y, s = data.batch_to(b, d.device)
            with sync_grads(model, m == len(batches) - 1):  # all-reduce on the last micro-step
                # -- policy forward: one forward over [chosen; rejected] scores both halves
                with autocast(d.device):
                    pi_c, pi_r = pair_logps(model, x, y, s).chunk(2)  # (micro_batch,) each
                meter.lap("policy_forward")
                # -- loss: Eq. 7, the β·KL constraint inside it (SimPO: Eq. 6, none). Summed over
                # the micro-batch and divided by the global batch, x world as DDP averages over
                # ranks: the gradient is the global batch's mean for any world and accumulation.
                losses, r_c, r_r = pair_loss(pi_c, pi_r, ref_lp[m], y, s, cfg)
                (losses.sum() * d.world / n).backward()
                meter.lap("loss")  # the backward included
            meter.count(*batch_flops(policy.config, x, y, tok.pad, backward=True, seq=s))
            meter.add(loss=losses.detach(), r_chosen=r_c, r_rejected=r_r,
                      correct=(r_c > r_r).float(), logp_chosen=pi_c.detach(),
                      logp_rejected=pi_r.detach(), tokens=(x != tok.pad).float())

        # -- update
        # (--fsdp: the grads are DTensor shards; the norm is all-reduced over them, the same one)
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip).item()
        s = meter.reduce()  # sums over the global batch of n pairs: means below
        first_loss = check_step(s["loss"] / n, grad_norm, first_loss, f"step {step + 1}", ckpt_dir,
                                "Try a lower --lr or --beta.")
        opt.step()
        opt.zero_grad(set_to_none=True)
        meter.lap("update")

        # -- metrics and checkpoint
        metrics = {"loss": s["loss"] / n, "rewards/chosen": s["r_chosen"] / n,
                   "rewards/rejected": s["r_rejected"] / n, "rewards/accuracies": s["correct"] / n,
                   "rewards/margins": (s["r_chosen"] - s["r_rejected"]) / n,
                   "logps/chosen": s["logp_chosen"] / n, "logps/rejected": s["logp_rejected"] / n,
                   "grad_norm": grad_norm, "lr": lr, **meter.timing(s["tokens"])}
        if (step + 1) % cfg.eval_every == 0 or step + 1 == cfg.steps:
            metrics["val_loss"], metrics["val_accuracy"] = evaluate_pairs(
                policy, ref, ref_val, val, cfg, d, tok.pad)
        log.log(step + 1, cfg.steps, metrics, show=SHOWN)
        if (step + 1) % cfg.ckpt_every == 0 or step + 1 == end:  # written by rank 0
            save_checkpoint(ckpt_dir, step + 1, {"model": policy, "optim": opt},
                            {"config": asdict(cfg), "inputs": inputs, "first_loss": first_loss},
                            write=d.is_main)
    barrier(d)  # rank 0's checkpoint is on disk before any rank moves on
    if end < cfg.steps:
        log.print(f"stopped after {end - start} steps (--stop_after); run again to resume from "
                  f"step {end}")
        return teardown(d)

    finish(policy, ref, ref_val, val, tok, tok_path, cfg, d, log)
    teardown(d)

# ==== evaluation and outputs


def finish(policy, ref, ref_val, val, tok, tok_path, cfg, d, log):
    """The held-out pairs' loss and accuracy, then samples on the held-out prompts. Sampling needs
    π_ref itself (its completions, and log π_ref of the policy's for the KL): this loads it, for
    evaluation only, as every method's evaluation does; the training loop never did in the default
    mode nor under --loss simpo (and --ref live's frozen copy may hold bf16 weights, which run only
    under autocast; sampling runs without)."""
    val_loss, val_acc = evaluate_pairs(policy, ref, ref_val, val, cfg, d, tok.pad)
    ev = evaluate_held_out(policy, load_model(cfg.ref_model, d.device)[0], tok, cfg, d)
    gamma = {"simpo_gamma": cfg.simpo_gamma} if cfg.loss == "simpo" else {}
    save_outputs(policy, cfg.out_dir, {"stage": "dpo", "step": cfg.steps,
                                       "ref_model": cfg.ref_model, "loss": cfg.loss,
                                       "beta": cfg.beta, **gamma},
                 {"val_accuracy": val_acc, "val_loss": val_loss, **ev, "steps": cfg.steps,
                  "loss": cfg.loss, "beta": cfg.beta, **gamma}, d, tok_path)
    print_samples(ev, log.print)
    log.print(f"held-out pairs: accuracy {val_acc:.3f}, loss {val_loss:.4f} | {summary(ev)} | "
              f"saved {cfg.out_dir}/model.safetensors")


if __name__ == "__main__":
    main(parse_config(Config, doc=__doc__))
