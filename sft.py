"""Stage 1: train the reference policy π_ref on the task's text (supervised fine-tuning).

    python sft.py                          # one process, CPU or one GPU, the built-in task
    torchrun --nproc_per_node=8 sft.py     # plain DDP over 8 ranks (nccl on GPUs, gloo on CPUs)
    torchrun --nproc_per_node=8 sft.py --fsdp   # FSDP2: each rank holds 1/8 of the model state
    python sft.py --help                   # every flag, e.g. --train_text my.txt --tokenizer t.json

Writes out/sft/: model.safetensors (π_ref, where DPO and PPO both start), tokenizer.json,
metrics.jsonl, eval.json (val loss beside the task's entropy floor) and a resumable checkpoint in
ckpt/.
"""
import json
import os
import time
from dataclasses import asdict, dataclass

import torch

import data
from model import (GPT, GPTConfig, estimate_flops, import_gpt2, matmul_shapes, model_flops,
                   save_model, sequence_logprobs)
from plumbing import (DIVERGED, Logger, adamw, atomic_copy, atomic_write_json, autocast, barrier,
                      check, compile_metrics, full_state, gathered, init_distributed,
                      input_fingerprint, lr_at, measure_peak_flops, parse_config, prepare_outputs,
                      reduce_sums, require_stage, resume, save_checkpoint, sharded, split_batch,
                      stop_if_diverged, stop_if_not_finite, sync_grads, teardown, wrap)


@dataclass
class Config:
    out_dir: str = "out/sft"  # this stage's folder: model, tokenizer, metrics, eval, checkpoint
    train_text: str = "out/task/sft_train.txt"  # one text per line; the task is built if missing
    val_text: str = "out/task/sft_val.txt"  # held-out texts for the val loss
    tokenizer: str = "out/task/tokenizer.json"  # any tokenizer.json (GPT-2's too); PAD added
    init_from: str = ""  # "" = GPT-2 init from scratch, or a Hugging Face GPT-2 model.safetensors
    block_size: int = 64  # longest sequence in tokens; longer texts are cut and counted
    n_layer: int = 4  # transformer blocks
    n_head: int = 4  # attention heads per block
    n_embd: int = 64  # residual stream width (64 reaches ~0.03 nats of the task's floor)
    dropout: float = 0.0  # off: the task has ample data, and it keeps ranks bit-comparable
    steps: int = 400  # optimizer steps
    batch_size: int = 32  # global batch in texts per step, all ranks together
    micro_batch_size: int = 32  # texts per forward on one rank; accumulation is derived from it
    lr: float = 3e-3  # peak AdamW learning rate
    warmup: int = 30  # linear warmup steps, then cosine decay
    min_lr_frac: float = 0.1  # cosine ends at this fraction of lr
    weight_decay: float = 0.1  # AdamW decay on matrices only (not biases, LayerNorms, positions)
    grad_clip: float = 1.0  # max global grad norm
    eval_every: int = 100  # steps between val-loss evaluations
    ckpt_every: int = 200  # steps between checkpoints (and one at the end)
    seed: int = 1337  # model init and data order
    compile: bool = False  # torch.compile the model (worth it on CUDA)
    fsdp: bool = False  # shard weights, grads and AdamW state over the ranks (FSDP2), not DDP
    resume: bool = True  # continue from out_dir/ckpt if it holds this same config
    stop_after: int = 0  # stop after this many steps of this run, checkpointed (0 = run to the end)


def build_task(d):
    """The earlier 'stage' of sft is the built-in task: rank 0 generates it, the others wait."""
    if d.is_main:
        data.ensure_task()
    if d.world > 1:
        torch.distributed.barrier()


@torch.no_grad()
@torch.no_grad()
def val_loss(model, examples, cfg, d, pad):
    """Mean NLL per predicted token over all val texts, each rank taking every world-th text (in
    order of length: each micro-batch is padded only to its own longest)."""
    model.eval()
    nll = n = 0.0
    mine, mb = sorted(examples, key=data.longest_row)[d.rank::d.world], cfg.micro_batch_size
    with gathered(model):  # --fsdp: whole weights on every rank; ranks run unequal counts
        for i in range(0, len(mine), mb):
            x, y = data.collate([(e["prompt"], e["response"]) for e in mine[i:i + mb]], pad)
            x, y = x.to(d.device), y.to(d.device)
            with autocast(d.device):
                logp = sequence_logprobs(model, x, y)
            nll, n = nll - logp.sum(), n + (y != -100).sum()
    s = reduce_sums(d, nll=nll, n=n)
    model.train()
    return s["nll"] / s["n"]


def main(cfg):
    d = init_distributed()
    log = Logger(cfg.out_dir, d)
    ckpt_dir = os.path.join(cfg.out_dir, "ckpt")
    prepare_outputs({cfg.out_dir: "--out_dir", ckpt_dir: "--out_dir"}, d, log.print)
    # ---- inputs: the task's text and tokenizer, built when the default paths are missing
    for path, default in [(cfg.train_text, Config.train_text), (cfg.val_text, Config.val_text),
                          (cfg.tokenizer, Config.tokenizer)]:
        require_stage(path, default, lambda: build_task(d), "python data.py", d, log.print)
    tok = data.load_tokenizer(cfg.tokenizer)
    train, stats = data.tokenize_texts(tok, data.read_texts(cfg.train_text), cfg.block_size)
    val, val_stats = data.tokenize_texts(tok, data.read_texts(cfg.val_text), cfg.block_size)
    log.print(f"data: {len(train)} train texts ({stats['truncated']} cut to {cfg.block_size} "
              f"tokens), {len(val)} val texts ({val_stats['truncated']} cut)")
    if stats["truncated"] > data.HEAVY_CUT * len(train):
        log.print(f"WARNING: {stats['truncated']} of {len(train)} texts of {cfg.train_text} are "
                  f"cut to --block_size {cfg.block_size} tokens: π_ref learns no ending for them. "
                  "Raise --block_size, or use a tokenizer made for your text (--tokenizer), which "
                  "needs fewer tokens per text")
    check(len(train) >= cfg.batch_size, f"{cfg.train_text} has {len(train)} usable texts, fewer "
          f"than --batch_size {cfg.batch_size}")
    # what the weights are trained from: a resumed run checks it is the same
    inputs = input_fingerprint({"--train_text": cfg.train_text, "--tokenizer": cfg.tokenizer,
                                "--init_from": cfg.init_from}, train)
    lengths = [data.longest_row(e) for e in train]  # to sort each batch by length
    # Every token weighs the same in every step: the loss is the batch's summed NLL over a fixed
    # count, the mean tokens of a global batch over the data, not over the batch's own count: a
    # batch of short texts holds fewer tokens, and its own count would weigh each of them more.
    tokens_per_batch = cfg.batch_size * sum(len(e["response"]) for e in train) / len(train)

    # ---- model, optimizer, resume
    torch.manual_seed(cfg.seed)  # the same init on every rank (DDP also broadcasts rank 0's)
    if cfg.init_from:
        # the shape is the file's and its config.json's (n_head: the tensors do not say it), not
        # --n_layer/--n_head/--n_embd, whose defaults would be a guess
        check(os.path.exists(os.path.join(os.path.dirname(cfg.init_from), "config.json")),
              f"{cfg.init_from}: no config.json beside it, so its number of heads is unknown: copy "
              "the model's config.json next to it")
        raw_model = import_gpt2(cfg.init_from, block_size=cfg.block_size,
                                vocab_size=tok.vocab_size)
        c = raw_model.config
        log.print(f"init from {cfg.init_from}: n_layer {c.n_layer}, n_head {c.n_head}, n_embd "
                  f"{c.n_embd} (its config.json; --n_layer, --n_head, --n_embd are not used)")
        check(raw_model.config.vocab_size == tok.vocab_size, f"{cfg.init_from} has a vocabulary "
              f"of {raw_model.config.vocab_size}, larger than the tokenizer's {tok.vocab_size}: "
              "the wrong tokenizer?")
    else:
        raw_model = GPT(GPTConfig(block_size=cfg.block_size, vocab_size=tok.vocab_size,
                                  n_layer=cfg.n_layer, n_head=cfg.n_head, n_embd=cfg.n_embd,
                                  dropout=cfg.dropout))
    raw_model.to(d.device)
    # DDP over the ranks (--fsdp: sharded in place, raw_model with it, so before the optimizer),
    # then torch.compile
    model = wrap(raw_model, d, cfg.compile, cfg.fsdp)
    opt = adamw(raw_model, cfg.lr, cfg.weight_decay)
    start, state = resume(ckpt_dir, cfg, {"model": raw_model, "optim": opt}, d.device, log.print,
                          inputs)
    first_loss = state.get("first_loss")  # the divergence guard's scale, kept across resumes
    log.start(start)  # metrics.jsonl keeps the steps up to `start`
    accum = split_batch(cfg.batch_size, cfg.micro_batch_size, d.world)
    mb = cfg.batch_size // d.world // accum
    peak = measure_peak_flops(d.device, matmul_shapes(raw_model.config, mb * cfg.block_size))
    log.print(f"model: {sum(p.numel() for p in raw_model.parameters()) / 1e6:.2f}M parameters | "
              f"batch {cfg.batch_size} = {d.world} ranks x {accum} accumulation x {mb} | device "
              f"{d.device} | peak {peak / 1e9:.1f} GFLOP/s per rank (measured)"
              + (" | sharded (FSDP2)" if sharded(raw_model) else ""))

    # ---- training loop
    end = cfg.steps if not cfg.stop_after else min(cfg.steps, start + cfg.stop_after)
    for step in range(start, end):
        t0 = time.perf_counter()
        lr = lr_at(step, cfg.steps, cfg.lr, cfg.warmup, cfg.min_lr_frac)
        for g in opt.param_groups:
            g["lr"] = lr
        batch = data.global_batch(len(train), cfg.batch_size, step, cfg.seed, lengths)
        n_tok = sum(len(train[i]["response"]) for i in batch)  # this batch's, for the metrics
        mine, nll = data.rank_slice(batch, d.rank, d.world), 0.0
        flops = {"model": 0.0, "hardware": 0.0}  # needed by the real tokens; executed
        for m in range(accum):
            rows = [train[i] for i in mine[m * mb:(m + 1) * mb]]
            x, y = data.collate([(e["prompt"], e["response"]) for e in rows], tok.pad)
            x, y = x.to(d.device), y.to(d.device)
            with sync_grads(model, m == accum - 1):  # all-reduce on the last micro-step only
                with autocast(d.device):
                    logp = sequence_logprobs(model, x, y)  # (B, T), 0 on prompt and padding
                # x world: DDP averages the ranks' gradients
                (-logp.sum() * d.world / tokens_per_batch).backward()
            nll -= logp.sum().detach()
            K = int((y != -100).sum())
            flops["hardware"] += estimate_flops(raw_model.config, *x.shape, backward=True,
                                                outputs=K)
            flops["model"] += model_flops(raw_model.config, (x != tok.pad).sum(1), K, backward=True)
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip).item()
        s = reduce_sums(d, nll=nll, flops_model=flops["model"], flops_hardware=flops["hardware"])
        loss = s["nll"] / n_tok  # the global batch's mean NLL per token
        stop_if_not_finite({"loss": loss, "grad_norm": grad_norm}, f"step {step + 1}", ckpt_dir,
                           "Try a lower --lr.")
        first_loss = loss if first_loss is None else first_loss
        stop_if_diverged("loss", loss, DIVERGED * first_loss, f"{DIVERGED}x the first step's "
                         f"{first_loss:.4g}", f"step {step + 1}", ckpt_dir, "Try a lower --lr.")
        opt.step()
        opt.zero_grad(set_to_none=True)
        dt = time.perf_counter() - t0
        metrics = {"loss": loss, "grad_norm": grad_norm, "lr": lr, "tokens_per_sec": n_tok / dt,
                   "mfu": s["flops_model"] / (d.world * peak * dt),
                   "mfu_hardware": s["flops_hardware"] / (d.world * peak * dt),
                   "time/step": 1000 * dt}
        if cfg.compile and step == start:  # this step compiled the model: its time is not a step's
            metrics = compile_metrics(metrics, dt)
        if (step + 1) % cfg.eval_every == 0 or step + 1 == cfg.steps:
            metrics["val_loss"] = val_loss(model, val, cfg, d, tok.pad)
        if (step + 1) % 10 == 0 or "val_loss" in metrics or step == 0:
            log.log(step + 1, cfg.steps, metrics,
                    show=("loss", "val_loss", "grad_norm", "lr", "time/step"))
        if (step + 1) % cfg.ckpt_every == 0 or step + 1 == end:  # written by rank 0
            save_checkpoint(ckpt_dir, step + 1, {"model": raw_model, "optim": opt},
                            {"config": asdict(cfg), "inputs": inputs, "first_loss": first_loss},
                            write=d.is_main)
    if end < cfg.steps:
        log.print(f"stopped after {end - start} steps (--stop_after); run again to resume from "
                  f"step {end}")
        return teardown(d)

    # ---- outputs: π_ref and its evaluation
    final = val_loss(model, val, cfg, d, tok.pad)
    weights = full_state(raw_model, d.is_main)  # --fsdp: gathered from the shards
    if d.is_main:
        task = os.path.join(os.path.dirname(cfg.val_text), "task.json")
        floor = None
        default_val = os.path.abspath(cfg.val_text) == os.path.abspath(Config.val_text)
        if default_val and os.path.exists(task):
            with open(task) as f:
                floor = json.load(f).get("floor_nats_per_token")
        save_model(raw_model, os.path.join(cfg.out_dir, "model.safetensors"),
                   {"stage": "sft", "step": cfg.steps, "val_loss": final,
                    "train_text": cfg.train_text}, weights)
        atomic_copy(cfg.tokenizer, os.path.join(cfg.out_dir, "tokenizer.json"))
        atomic_write_json(os.path.join(cfg.out_dir, "eval.json"),
                          {"val_loss": final, "floor_nats_per_token": floor,
                           "train_truncated": stats["truncated"], "steps": cfg.steps})
        gap = f" (the generator's floor is {floor:.4f})" if floor is not None else ""
        log.print(f"val loss {final:.4f} nats/token{gap}; π_ref saved to "
                  f"{cfg.out_dir}/model.safetensors")
    barrier(d)  # π_ref is on disk before any rank returns (a later stage may read it next)
    teardown(d)


if __name__ == "__main__":
    main(parse_config(Config, doc=__doc__))
