"""Stage 2 of the PPO way: the reward model r_φ, learned from the preference pairs (Ouyang et al.
2022, sec. 3.5).

    python reward.py                          # one process; builds out/sft if missing
    torchrun --nproc_per_node=8 reward.py     # plain DDP over 8 ranks (nccl on GPUs, gloo on CPUs)
    torchrun --nproc_per_node=8 reward.py --fsdp   # FSDP2: each rank holds 1/8 of the model state
    python reward.py --help                   # every flag, e.g. --train_pairs my_pairs.jsonl

r_φ is π_ref's transformer with a scalar head, read at the last token of prompt + response (the EOS
of a finished response), trained with the Bradley-Terry loss -log σ(r(x,y_w) - r(x,y_l)) on the same
pairs DPO trains on. Then it is shifted so that π_ref's own completions of train prompts score 0 on
average, the "reward normalization" of lm-human-preferences (Ziegler et al. 2019), which also
rescales to std 1; we keep the scale the pairs taught, so r_φ stays in the units of the
Bradley-Terry logit. Writes out/reward/: model.safetensors (the offset in its metadata),
tokenizer.json (π_ref's: its readers check it is theirs), metrics.jsonl, eval.json (val_accuracy
on held-out pairs) and a resumable checkpoint in ckpt/. ppo.py reads it as its reward service and
initializes its critic from it.
"""
import os
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F

import data
import sft
import task
from checkpoint import (check_step, input_fingerprint, prepare_outputs, resume, save_checkpoint,
                        save_outputs, tokenizer_beside)
from meter import Meter, estimate_flops, matmul_shapes, measure_peak_flops, model_flops
from model import IGNORE, generate, load_model, score_at_last
from plumbing import (Logger, adamw, autocast, barrier, check, gathered, init_distributed, lr_at,
                      parse_config, reduce_sums, require_stage, set_lr, sharded, split_batch,
                      sync_grads, teardown, wrap)


@dataclass
class Config:
    out_dir: str = "out/reward"  # this stage's folder: model, metrics, eval, checkpoint
    sft: str = "out/sft/model.safetensors"  # π_ref: r_φ starts from its transformer and tokenizer
    train_pairs: str = "out/task/pairs_train.jsonl"  # preference JSONL: DPO's pairs
    val_pairs: str = "out/task/pairs_val.jsonl"  # held-out pairs for val_accuracy
    prompts: str = "out/task/prompts_train.jsonl"  # π_ref completes some of these to set the offset
    max_prompt_len: int = 32  # a pair longer than the block keeps at least this many prompt tokens
    # optimizer steps: about 2 epochs of the built-in task (InstructGPT trains 1; r_φ overfits fast)
    steps: int = 120
    batch_size: int = 64  # global batch in pairs per step, all ranks together
    micro_batch_size: int = 32  # pairs per forward on one rank ([chosen; rejected] = 2x the rows)
    # peak AdamW learning rate: π_ref's own; 1e-4 barely moves the zero-init head in 120 steps
    lr: float = 3e-3
    warmup: int = 10  # linear warmup steps, then cosine decay
    min_lr_frac: float = 0.1  # cosine ends at this fraction of lr
    weight_decay: float = 0.0  # AdamW decay on matrices
    grad_clip: float = 1.0  # max global grad norm
    eval_every: int = 40  # steps between val evaluations
    ckpt_every: int = 100  # steps between checkpoints (and one at the end)
    offset_samples: int = 512  # π_ref completions scored to find the offset
    seed: int = 1337  # data order and sampling
    pack: bool = True  # pack sequences into rows of block_size (data.pack_pairs), not pad them
    fsdp: bool = False  # shard weights, grads and AdamW state over the ranks (FSDP2), not DDP
    resume: bool = True  # continue from out_dir/ckpt if it holds this same config
    stop_after: int = 0  # stop after this many steps of this run, checkpointed (0 = run to the end)


# -----------------------------------------------------------------------------
# The loss and where the reward is read (model.score_at_last: at the last real token)


def bt_loss(r_chosen, r_rejected):
    """Bradley-Terry negative log-likelihood, eq. 1 of Ouyang et al. 2022 (eq. 2 of the DPO paper):
    -log σ(r(x,y_w) - r(x,y_l)), mean over the batch. r_chosen, r_rejected (B,) -> scalar.
    Only the difference is learned: r_φ + c fits as well, hence the offset chosen after training."""
    return -F.logsigmoid(r_chosen - r_rejected).mean()


def pair_mask(targets, seq=None):
    """The mask score_at_last reads a pair batch's sequences with. A packed batch (seq): its
    sequence ids, so each is read at its own last token. A right-padded one: the real tokens (N,T)
    from its targets: token t is a response token when targets[t-1] != IGNORE (position t-1 predicts
    it); the prompt comes first."""
    if seq is not None:
        return seq
    m = torch.zeros_like(targets, dtype=torch.bool)
    m[:, 1:] = targets[:, :-1] != IGNORE
    return m


# -----------------------------------------------------------------------------
# evaluation


@torch.no_grad()
def pair_scores(model, examples, pad, micro_batch_size, device, pack_len=0):
    """r_φ on both sides of every example: two (n,) tensors, chosen and rejected."""
    rc, rr = [], []
    for i in range(0, len(examples), micro_batch_size):
        b = data.collate_pairs(examples[i:i + micro_batch_size], pad, pack_len)
        x, y, s = data.batch_to(b, device)
        with autocast(device):  # right-padded (s None): no mask needed (causal)
            r = score_at_last(model(x, mask=s).float(), pair_mask(y, s))
        rc.append(r[:len(r) // 2]), rr.append(r[len(r) // 2:])
    return torch.cat(rc), torch.cat(rr)


def val_metrics(model, examples, pad, cfg, d):
    """Held-out accuracy (ties count half) and loss, sharded over ranks; packed, or (--no-pack) in
    order of length, so each micro-batch is padded only to its own longest row."""
    model.eval()
    # packed: in their order (a mix of lengths fills rows best, as precompute_ref_logps)
    mine = (examples if cfg.pack else sorted(examples, key=data.longest_row))[d.rank::d.world]
    with gathered(model):  # --fsdp: whole weights on every rank; ranks run unequal counts
        # --pack: rows as long as the longest pair (any length that fits them gives these numbers)
        rc, rr = pair_scores(model, mine, pad, cfg.micro_batch_size, d.device,
                             cfg.pack * max(map(data.longest_row, mine), default=0))
    s = reduce_sums(d, correct=((rc > rr).float() + 0.5 * (rc == rr).float()).sum(),
                    loss=-F.logsigmoid(rc - rr).sum(), n=len(rc))
    model.train()
    return s["correct"] / s["n"], s["loss"] / s["n"]


@torch.no_grad()
def ref_scores(reward_model, ref, tok, prompts, d, seed, batch_size=64):
    """Sample one completion per prompt from π_ref (temperature 1, the KV-cache sampler PPO's
    rollout engine uses), sharded over ranks, and score it with r_φ. Returns global sums {n, r, r2,
    t, t2, rt} of r_φ's score r and the hidden true reward t (their correlation: what r_φ learned
    of the truth). Prompt j samples from row j of uniforms drawn for all prompts, with one token
    budget for all: the same completions, hence the same offset, on any world size."""
    block, s = ref.config.block_size, dict.fromkeys(["n", "r", "r2", "t", "t2", "rt"], 0.0)
    ids = [data.truncate_prompt(data.encode_prompt(tok, p), block // 2) for p in prompts]
    n_new = block - max(map(len, ids))
    U = torch.rand(len(prompts), n_new, generator=torch.Generator().manual_seed(seed))
    mine = list(range(d.rank, len(prompts), d.world))
    for i in range(0, len(mine), batch_size):
        j = mine[i:i + batch_size]
        out = generate(ref, [ids[a] for a in j], n_new, tok.eos, tok.pad,
                       uniforms=U[j].to(d.device))
        with autocast(d.device):
            values = reward_model(out["tokens"], mask=out["mask"]).float()
            r = score_at_last(values, out["mask"]).double()
        t = torch.tensor([task.true_reward(prompts[a], tok.decode(y[m].tolist())) for a, y, m in
                          zip(j, out["tokens"], out["response_mask"])],
                         dtype=torch.float64, device=d.device)
        for k, v in (("n", len(r)), ("r", r.sum()), ("r2", (r * r).sum()), ("t", t.sum()),
                     ("t2", (t * t).sum()), ("rt", (r * t).sum())):
            s[k] += v
    return reduce_sums(d, **s)


def setup(cfg, d, log, block):
    """π_ref's tokenizer and the pairs (built when the default paths are missing), tokenized."""
    task.require_task({cfg.train_pairs: Config.train_pairs, cfg.val_pairs: Config.val_pairs,
                       cfg.prompts: Config.prompts}, d, log)
    tok_path = tokenizer_beside(cfg.sft, "--sft")
    tok = data.load_tokenizer(tok_path)
    check(2 <= cfg.max_prompt_len < block,
          f"--max_prompt_len {cfg.max_prompt_len} must be in [2, {block})")
    train, stats = data.tokenize_pairs(tok, data.read_pairs(cfg.train_pairs), block,
                                       cfg.max_prompt_len)
    val, _ = data.tokenize_pairs(tok, data.read_pairs(cfg.val_pairs), block, cfg.max_prompt_len)
    log(f"data: {len(train)} train pairs ({stats['truncated_prompt']} prompts and "
        f"{stats['truncated_response']} responses cut to {block} tokens, "
        f"{stats['unusable']} unusable), {len(val)} val pairs")
    warn = data.truncation_warning(stats, cfg.train_pairs, block, "Retrain π_ref (sft.py) with a "
                                   "larger --block_size and a tokenizer made for your text "
                                   "(--tokenizer); --max_prompt_len sets how much prompt a long "
                                   "pair keeps.")
    if warn:
        log(warn)
    check(len(train) >= cfg.batch_size, f"{cfg.train_pairs} has {len(train)} usable pairs, "
          f"fewer than --batch_size {cfg.batch_size}")
    check(len(val) > 0, f"{cfg.val_pairs} has no usable pair: in each row chosen and rejected are "
          f"identical once cut to {block} tokens")
    return tok, tok_path, train, val


def offset_and_outputs(cfg, reward_model, val, tok, d, log):
    """Held-out accuracy, then the offset that makes π_ref's completions score 0 on average,
    folded into the head; saves r_φ, its eval.json and its tokenizer (π_ref's)."""
    val_acc, val_loss = val_metrics(reward_model, val, tok.pad, cfg, d)
    # the best any reward can do on these noisy (Bradley-Terry) labels: the true reward's accuracy
    rows = data.read_pairs(cfg.val_pairs)
    true = [(task.true_reward(r["prompt"], r["chosen"]),
             task.true_reward(r["prompt"], r["rejected"])) for r in rows]
    oracle = sum(1.0 if a > b else 0.5 if a == b else 0.0 for a, b in true) / len(rows)
    ref, _ = load_model(cfg.sft, d.device)
    prompts = data.read_prompts(cfg.prompts)[:cfg.offset_samples]
    reward_model.eval()
    with gathered(reward_model):  # --fsdp: whole weights for scoring
        s = ref_scores(reward_model, ref, tok, prompts, d, cfg.seed)
    mean = lambda k: s[k] / s["n"]  # noqa: E731
    offset, std = mean("r"), max(mean("r2") - mean("r") ** 2, 0.0) ** 0.5
    t_std = max(mean("t2") - mean("t") ** 2, 0.0) ** 0.5
    corr = (mean("rt") - mean("r") * mean("t")) / max(std * t_std, 1e-12)
    with torch.no_grad():  # folded into the head, so every reader (PPO, its critic) gets it
        reward_model.score.bias -= offset  # (--fsdp: into the shards, outside gathered)
    result = {"val_accuracy": val_acc, "val_loss": val_loss, "oracle_val_accuracy": oracle,
              "offset": offset, "ref_score_std": std, "ref_true_reward_corr": corr,
              "steps": cfg.steps}
    save_outputs(reward_model, cfg.out_dir, {"stage": "reward", "sft": cfg.sft,
                                             "train_pairs": cfg.train_pairs, **result}, result, d,
                 tokenizer_beside(cfg.sft, "--sft"))  # its reader checks it is π_ref's
    log(f"val accuracy {val_acc:.3f} (the true reward gets {oracle:.3f} of these noisy "
        f"labels) | π_ref's completions scored {offset:+.3f} ± {std:.3f} before the "
        f"offset, now 0 | correlation with the true reward {corr:.3f}; r_φ saved to "
        f"{cfg.out_dir}/model.safetensors")


def main(cfg):
    d = init_distributed()
    log = Logger(cfg.out_dir, d)
    ckpt_dir = os.path.join(cfg.out_dir, "ckpt")
    prepare_outputs({cfg.out_dir: "--out_dir", ckpt_dir: "--out_dir"}, d, log.print)
    # ---- inputs: π_ref and the task's pairs, built when the default paths are missing
    require_stage(cfg.sft, Config.sft, lambda: sft.main(sft.Config()), "python sft.py", d,
                  log.print)
    reward_model, _ = load_model(cfg.sft, d.device, head="scalar")  # π_ref's trunk, a zero head
    block = reward_model.config.block_size
    tok, tok_path, train, val = setup(cfg, d, log.print, block)
    # what the weights are trained from: a resumed run checks it is the same
    inputs = input_fingerprint({"--sft": cfg.sft, "tokenizer": tok_path,
                                "--train_pairs": cfg.train_pairs}, train)
    lengths = [data.longest_row(e) for e in train]  # to sort each batch by length

    # ---- model, optimizer, resume
    # DDP over the ranks (--fsdp: sharded in place, reward_model with it, so before the optimizer)
    model = wrap(reward_model, d, fsdp=cfg.fsdp)
    opt = adamw(reward_model, cfg.lr, cfg.weight_decay)
    start, state = resume(ckpt_dir, cfg, {"model": reward_model, "optim": opt}, d.device,
                          log.print, inputs, free=("resume", "stop_after", "fsdp", "pack"))
    first_loss = state.get("first_loss")  # the divergence guard's scale, kept across resumes
    log.start(start)  # metrics.jsonl keeps the steps up to `start`
    accum = split_batch(cfg.batch_size, cfg.micro_batch_size, d.world)
    micro_batch = cfg.batch_size // d.world // accum
    peak = measure_peak_flops(d.device, matmul_shapes(reward_model.config, 2 * micro_batch * block))
    log.print(f"model: {sum(p.numel() for p in reward_model.parameters()) / 1e6:.2f}M parameters "
              f"| batch {cfg.batch_size} pairs = {d.world} ranks x {accum} accumulation x "
              f"{micro_batch} "
              f"| device {d.device}" + (" | sharded (FSDP2)" if sharded(reward_model) else ""))

    # ---- training loop
    end = cfg.steps if not cfg.stop_after else min(cfg.steps, start + cfg.stop_after)
    meter = Meter(d, peak)
    for step in range(start, end):
        meter.start()
        lr = set_lr(opt, lr_at(step, cfg.steps, cfg.lr, cfg.warmup, cfg.min_lr_frac))
        # sorted by length: each micro-batch packed into rows of block_size (data.pack_pairs),
        # or (--no-pack) padded to its own longest row (data.global_batch)
        mine = data.global_batch(len(train), cfg.batch_size, step, cfg.seed, lengths)
        mine = data.rank_slice(mine, d.rank, d.world)
        for m in range(accum):
            rows = mine[m * micro_batch:(m + 1) * micro_batch]
            b = data.collate_pairs([train[i] for i in rows], tok.pad, cfg.pack * block)
            x, y, seq = data.batch_to(b, d.device)
            with sync_grads(model, m == accum - 1):  # all-reduce on the last micro-step only
                with autocast(d.device):  # (2B,): [chosen; rejected]
                    r = score_at_last(model(x, mask=seq).float(), pair_mask(y, seq))
                rc, rr = r.chunk(2)
                loss = bt_loss(rc, rr)
                # bt_loss is a mean over this micro-batch: rescale it to a mean over the global
                # batch (x world: DDP averages over ranks)
                (loss * len(rc) * d.world / cfg.batch_size).backward()
            # real tokens of each sequence
            real = (x != tok.pad).sum(1) if seq is None else torch.bincount(seq[seq >= 0])
            meter.add(loss=loss.detach() * len(rc), correct=(rc > rr).float(),
                      margin=(rc - rr).detach(), tokens=real)
            # forward + backward; the head needs one position per sequence, but runs at all
            meter.count(estimate_flops(reward_model.config, *x.shape, True),
                        model_flops(reward_model.config, real, len(real), True))
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip).item()
        tot = meter.reduce()
        s = {k: tot[k] / cfg.batch_size for k in ("loss", "correct", "margin")}  # means per pair
        first_loss = check_step(s["loss"], grad_norm, first_loss, f"step {step + 1}", ckpt_dir,
                                "Try a lower --lr.")
        opt.step()
        opt.zero_grad(set_to_none=True)
        metrics = {"loss": s["loss"], "accuracy": s["correct"], "margin": s["margin"],
                   "grad_norm": grad_norm, "lr": lr, **meter.timing(tot["tokens"])}
        if (step + 1) % cfg.eval_every == 0 or step + 1 == cfg.steps:
            metrics["val_accuracy"], metrics["val_loss"] = val_metrics(model, val, tok.pad, cfg, d)
        if (step + 1) % 10 == 0 or "val_loss" in metrics or step == 0:
            log.log(step + 1, cfg.steps, metrics, show=("loss", "accuracy", "val_loss",
                                                        "val_accuracy", "grad_norm", "time/step"))
        if (step + 1) % cfg.ckpt_every == 0 or step + 1 == end:  # written by rank 0
            save_checkpoint(ckpt_dir, step + 1, {"model": reward_model, "optim": opt},
                            {"config": asdict(cfg), "inputs": inputs, "first_loss": first_loss},
                            write=d.is_main)
    barrier(d)  # rank 0's checkpoint is on disk before any rank moves on
    if end < cfg.steps:
        log.print(f"stopped after {end - start} steps (--stop_after); run again to resume from "
                  f"step {end}")
        return teardown(d)

    # ---- outputs: held-out accuracy, the offset, the model
    offset_and_outputs(cfg, reward_model, val, tok, d, log.print)
    teardown(d)


if __name__ == "__main__":
    main(parse_config(Config, doc=__doc__))
