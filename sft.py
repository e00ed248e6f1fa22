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
from dataclasses import asdict, dataclass

import torch

import data
from checkpoint import (check_step, input_fingerprint, prepare_outputs, resume, save_checkpoint,
                        save_outputs)
from hf import import_gpt2
from meter import Meter, batch_flops, matmul_shapes, measure_peak_flops
from model import GPT, IGNORE, GPTConfig, sequence_logprobs
from plumbing import (Logger, adamw, autocast, check, gathered, init_distributed, lr_at,
                      parse_config, reduce_sums, set_lr, sharded, split_batch, sync_grads, teardown,
                      wrap)
from task import require_task


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


@torch.no_grad()
def val_loss(model, examples, cfg, d, pad):
    """Mean NLL per predicted token over all val texts, each rank taking every world-th text (in
    order of length: each micro-batch is padded only to its own longest)."""
    model.eval()
    nll = n = 0.0
    mine, micro_batch = (sorted(examples, key=data.longest_row)[d.rank::d.world],
                         cfg.micro_batch_size)
    with gathered(model):  # --fsdp: whole weights on every rank; ranks run unequal counts
        for i in range(0, len(mine), micro_batch):
            rows = mine[i:i + micro_batch]
            x, y = data.collate([(e["prompt"], e["response"]) for e in rows], pad)
            x, y = x.to(d.device), y.to(d.device)
            with autocast(d.device):
                logp = sequence_logprobs(model, x, y)
            nll, n = nll - logp.sum(), n + (y != IGNORE).sum()
    s = reduce_sums(d, nll=nll, n=n)
    model.train()
    return s["nll"] / s["n"]


def setup(cfg, d, log):
    """The task's text and tokenizer (built when the default paths are missing), tokenized."""
    require_task({cfg.train_text: Config.train_text, cfg.val_text: Config.val_text,
                  cfg.tokenizer: Config.tokenizer}, d, log)
    tok = data.load_tokenizer(cfg.tokenizer)
    train, stats = data.tokenize_texts(tok, data.read_texts(cfg.train_text), cfg.block_size)
    val, val_stats = data.tokenize_texts(tok, data.read_texts(cfg.val_text), cfg.block_size)
    log(f"data: {len(train)} train texts ({stats['truncated']} cut to {cfg.block_size} "
        f"tokens), {len(val)} val texts ({val_stats['truncated']} cut)")
    if stats["truncated"] > data.HEAVY_CUT * len(train):
        log(f"WARNING: {stats['truncated']} of {len(train)} texts of {cfg.train_text} are "
            f"cut to --block_size {cfg.block_size} tokens: π_ref learns no ending for them. "
            "Raise --block_size, or use a tokenizer made for your text (--tokenizer), which "
            "needs fewer tokens per text")
    check(len(train) >= cfg.batch_size, f"{cfg.train_text} has {len(train)} usable texts, fewer "
          f"than --batch_size {cfg.batch_size}")
    return tok, train, val, stats


def new_model(cfg, tok, log):
    """GPT-2's init from scratch (seeded), or a Hugging Face GPT-2 checkpoint (--init_from)."""
    torch.manual_seed(cfg.seed)  # the same init on every rank (DDP also broadcasts rank 0's)
    if not cfg.init_from:
        return GPT(GPTConfig(block_size=cfg.block_size, vocab_size=tok.vocab_size,
                             n_layer=cfg.n_layer, n_head=cfg.n_head, n_embd=cfg.n_embd,
                             dropout=cfg.dropout))
    # the shape is the file's and its config.json's (n_head: the tensors do not say it), not
    # --n_layer/--n_head/--n_embd, whose defaults would be a guess
    check(os.path.exists(os.path.join(os.path.dirname(cfg.init_from), "config.json")),
          f"{cfg.init_from}: no config.json beside it, so its number of heads is unknown: copy "
          "the model's config.json next to it")
    model = import_gpt2(cfg.init_from, block_size=cfg.block_size, vocab_size=tok.vocab_size)
    c = model.config
    log(f"init from {cfg.init_from}: n_layer {c.n_layer}, n_head {c.n_head}, n_embd "
        f"{c.n_embd} (its config.json; --n_layer, --n_head, --n_embd are not used)")
    check(c.vocab_size == tok.vocab_size, f"{cfg.init_from} has a vocabulary of {c.vocab_size}, "
          f"larger than the tokenizer's {tok.vocab_size}: the wrong tokenizer?")
    return model


def main(cfg):
    d = init_distributed()
    log = Logger(cfg.out_dir, d)
    ckpt_dir = os.path.join(cfg.out_dir, "ckpt")
    prepare_outputs({cfg.out_dir: "--out_dir", ckpt_dir: "--out_dir"}, d, log.print)
    tok, train, val, stats = setup(cfg, d, log.print)
    # what the weights are trained from: a resumed run checks it is the same
    inputs = input_fingerprint({"--train_text": cfg.train_text, "--tokenizer": cfg.tokenizer,
                                "--init_from": cfg.init_from}, train)
    lengths = [data.longest_row(e) for e in train]  # to sort each batch by length
    # Every token weighs the same in every step: the loss is the batch's summed NLL over a fixed
    # count, the mean tokens of a global batch over the data, not over the batch's own count: a
    # batch of short texts holds fewer tokens, and its own count would weigh each of them more.
    tokens_per_batch = cfg.batch_size * sum(len(e["response"]) for e in train) / len(train)

    # ---- model, optimizer, resume
    policy = new_model(cfg, tok, log.print).to(d.device)
    # DDP over the ranks (--fsdp: sharded in place, policy with it, so before the optimizer),
    # then torch.compile
    model = wrap(policy, d, cfg.compile, cfg.fsdp)
    opt = adamw(policy, cfg.lr, cfg.weight_decay)
    start, state = resume(ckpt_dir, cfg, {"model": policy, "optim": opt}, d.device, log.print,
                          inputs)
    first_loss = state.get("first_loss")  # the divergence guard's scale, kept across resumes
    log.start(start)  # metrics.jsonl keeps the steps up to `start`
    accum = split_batch(cfg.batch_size, cfg.micro_batch_size, d.world)
    micro_batch = cfg.batch_size // d.world // accum
    peak = measure_peak_flops(d.device, matmul_shapes(policy.config, micro_batch * cfg.block_size))
    log.print(f"model: {sum(p.numel() for p in policy.parameters()) / 1e6:.2f}M parameters | "
              f"batch {cfg.batch_size} = {d.world} ranks x {accum} accumulation x {micro_batch} | "
              f"device {d.device} | peak {peak / 1e9:.1f} GFLOP/s per rank (measured)"
              + (" | sharded (FSDP2)" if sharded(policy) else ""))

    # ---- training loop
    end = cfg.steps if not cfg.stop_after else min(cfg.steps, start + cfg.stop_after)
    meter = Meter(d, peak, compile=cfg.compile)
    for step in range(start, end):
        meter.start()
        lr = set_lr(opt, lr_at(step, cfg.steps, cfg.lr, cfg.warmup, cfg.min_lr_frac))
        batch = data.global_batch(len(train), cfg.batch_size, step, cfg.seed, lengths)
        n_tok = sum(len(train[i]["response"]) for i in batch)  # this batch's, for the metrics
        mine = data.rank_slice(batch, d.rank, d.world)
        for m in range(accum):
            rows = [train[i] for i in mine[m * micro_batch:(m + 1) * micro_batch]]
            x, y = data.collate([(e["prompt"], e["response"]) for e in rows], tok.pad)
            x, y = x.to(d.device), y.to(d.device)
            with sync_grads(model, m == accum - 1):  # all-reduce on the last micro-step only
                with autocast(d.device):
                    logp = sequence_logprobs(model, x, y)  # (B, T), 0 on prompt and padding
                # x world: DDP averages the ranks' gradients
                (-logp.sum() * d.world / tokens_per_batch).backward()
            meter.add(nll=-logp.sum().detach())
            meter.count(*batch_flops(policy.config, x, y, tok.pad, backward=True))
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip).item()
        loss = meter.reduce()["nll"] / n_tok  # the global batch's mean NLL per token
        first_loss = check_step(loss, grad_norm, first_loss, f"step {step + 1}", ckpt_dir,
                                "Try a lower --lr.")
        opt.step()
        opt.zero_grad(set_to_none=True)
        metrics = {"loss": loss, "grad_norm": grad_norm, "lr": lr, **meter.timing(n_tok)}
        if (step + 1) % cfg.eval_every == 0 or step + 1 == cfg.steps:
            metrics["val_loss"] = val_loss(model, val, cfg, d, tok.pad)
        if (step + 1) % 10 == 0 or "val_loss" in metrics or step == 0:
            log.log(step + 1, cfg.steps, metrics,
                    show=("loss", "val_loss", "grad_norm", "lr", "time/step"))
        if (step + 1) % cfg.ckpt_every == 0 or step + 1 == end:  # written by rank 0
            save_checkpoint(ckpt_dir, step + 1, {"model": policy, "optim": opt},
                            {"config": asdict(cfg), "inputs": inputs, "first_loss": first_loss},
                            write=d.is_main)
    if end < cfg.steps:
        log.print(f"stopped after {end - start} steps (--stop_after); run again to resume from "
                  f"step {end}")
        return teardown(d)

    # ---- outputs: π_ref and its evaluation
    final = val_loss(model, val, cfg, d, tok.pad)
    task_json = os.path.join(os.path.dirname(cfg.val_text), "task.json")
    floor = None
    if os.path.abspath(cfg.val_text) == os.path.abspath(Config.val_text) and \
            os.path.exists(task_json):
        with open(task_json) as f:
            floor = json.load(f).get("floor_nats_per_token")
    save_outputs(policy, cfg.out_dir, {"stage": "sft", "step": cfg.steps, "val_loss": final,
                                       "train_text": cfg.train_text},
                 {"val_loss": final, "floor_nats_per_token": floor,
                  "train_truncated": stats["truncated"], "steps": cfg.steps}, d, cfg.tokenizer)
    gap = f" (the generator's floor is {floor:.4f})" if floor is not None else ""
    log.print(f"val loss {final:.4f} nats/token{gap}; π_ref saved to "
              f"{cfg.out_dir}/model.safetensors")
    teardown(d)


if __name__ == "__main__":
    main(parse_config(Config, doc=__doc__))
