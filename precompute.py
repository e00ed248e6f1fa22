"""DPO's one-time pass: run π_ref once over the preference pairs and cache its log-probs.

    python precompute.py                       # one process: out/ref_logps/{train,val}.safetensors
    torchrun --nproc_per_node=8 precompute.py  # the pairs sharded over 8 ranks: the same files
    torchrun --nproc_per_node=8 precompute.py --fsdp   # π_ref sharded too: 1/8 of it per rank
    python precompute.py --help                # e.g. --ref_model my/model.safetensors --max_len 128
    python precompute.py --ref_model R --train_pairs my.jsonl --val_pairs my_val.jsonl
                                               # your pairs: a folder of their own (cache_dir)

DPO's loss (Eq. 7 of Rafailov et al. 2023) needs log π_ref(y|x) for every chosen and rejected
response. π_ref is frozen and the pairs are fixed, so these numbers never change during training:
computing them once here takes the reference model out of the training job (TRL's
`precompute_ref_log_probs`). Each file holds, keyed by the pair's row in its JSONL file, the summed
response log-probs (fp32) of chosen and rejected, computed exactly as dpo.py computes its policy's
(model.pair_logps on data.collate_pairs batches), and in its metadata a fingerprint of
everything that determines them, so that dpo.py can refuse a stale cache. The cost of the pass
(tokens, wall time, FLOPs) is printed and kept.
"""
import dataclasses
import hashlib
import json
import os
import time
from dataclasses import dataclass

import torch

import data
import sft
import task
from checkpoint import fingerprint, prepare_outputs, save_ref_logps, sha256, tokenizer_beside
from meter import batch_flops
from model import freeze, load_model, pair_logps
from plumbing import (Logger, all_reduce_sum, autocast, barrier, check, init_distributed,
                      parse_config, precision, require_stage, sharded, teardown, wrap)


@dataclass
class Config:
    out_dir: str = "out/ref_logps"  # {train,val}.safetensors here; your pairs: a subfolder of it
    ref_model: str = "out/sft/model.safetensors"  # π_ref (+ tokenizer.json); built if missing
    train_pairs: str = "out/task/pairs_train.jsonl"  # JSONL {"prompt","chosen","rejected"}
    val_pairs: str = "out/task/pairs_val.jsonl"  # held-out pairs: dpo.py's val loss and accuracy
    max_len: int = 64  # tokens of prompt + response, BOS and EOS included; longer pairs are cut
    max_prompt_len: int = 16  # a cut prompt keeps at least this many tokens (data.tokenize_pairs)
    micro_batch_size: int = 64  # pairs per forward (2x rows: [chosen; rejected])
    pack: bool = True  # pack sequences into rows of max_len (data.pack_pairs); the same cache
    fsdp: bool = False  # shard π_ref's weights over the ranks (FSDP2); the same cache either way


def same(path, default):
    return os.path.normpath(path) == os.path.normpath(default)


def check_own_inputs(cfg, more=()):
    """Your text needs your π_ref: the built-in one's tokenizer and weights were made for the
    built-in task's synthetic language. With --train_pairs a file of other text and --ref_model
    (or --val_pairs, or `more`: (flag, path, default) triples) left at the built-in task's, the run
    would train on text its π_ref cannot model, and validate on another task: stop, and say how to
    make them from the file (data.py own prints the commands that follow it). Pairs the task's
    generator writes (a regime's, e.g. out/task-capped) may use the built-in π_ref."""
    if same(cfg.train_pairs, Config.train_pairs) or not os.path.exists(cfg.train_pairs):
        return  # the built-in task, or a missing file, which require_stage names
    prompts = [r["prompt"] for r in data.read_pairs(cfg.train_pairs)]
    if task.task_prompts(prompts):
        return  # the task's generator writes these prompts: a regime's pairs
    foreign = [n for n, p in zip(data.row_lines(cfg.train_pairs), prompts)
               if not task.task_prompts([p])]
    left = [flag for flag, path, default in [("--ref_model", cfg.ref_model, Config.ref_model),
                                             ("--val_pairs", cfg.val_pairs, Config.val_pairs),
                                             *more] if same(path, default)]
    check(not left, f"--train_pairs {cfg.train_pairs} is not the built-in task's text "
          f"({len(foreign)} of {len(prompts)} rows are not, the first at line {foreign[0]}), but "
          f"{', '.join(left)} {'is' if len(left) == 1 else 'are'} still the built-in task's (its "
          "π_ref's tokenizer and weights know only its synthetic language). Make yours from your "
          f"file: python data.py own {cfg.train_pairs} --out out/own, which prints the sft.py and "
          "dpo.py commands that follow")


def plan(cfg, more=()):
    """cfg with out_dir the folder its cache lives in (cache_dir), after check_own_inputs: what
    precompute.py, and dpo.py building or reading its cache, both start from."""
    check_own_inputs(cfg, more)
    return dataclasses.replace(cfg, out_dir=cache_dir(cfg))


def cache_dir(cfg):
    """The cache's folder. The built-in task's pairs (or an explicit --out_dir) keep cfg.out_dir;
    other pairs with the default --out_dir get a folder of their own, out/ref_logps/<train file's
    stem>-<12 hex digits of a hash of π_ref, its tokenizer, both pair files and the lengths>. So a
    user's file never overwrites the built-in task's cache (nor finds it stale), two files never
    share one, and changed inputs find their cache missing, which dpo.py builds, not stale."""
    if (same(cfg.train_pairs, Config.train_pairs) and same(cfg.val_pairs, Config.val_pairs)
            or not same(cfg.out_dir, Config.out_dir)):
        return cfg.out_dir
    files = [cfg.ref_model, tokenizer_beside(cfg.ref_model), cfg.train_pairs,
             cfg.val_pairs]
    for path in files:  # named as require_stage would name them
        check(os.path.exists(path), f"{path} does not exist" + (
            ": π_ref's tokenizer is read from the folder of --ref_model" if path == files[1]
            else " (it was passed explicitly, so it is not built)"))
    key = json.dumps([sha256(p) for p in files] + [cfg.max_len, cfg.max_prompt_len])
    stem = os.path.splitext(os.path.basename(cfg.train_pairs))[0]
    return os.path.join(cfg.out_dir, f"{stem}-{hashlib.sha256(key.encode()).hexdigest()[:12]}")


def command(cfg):
    """The command line that (re)builds the cache for cfg: only the flags that differ from the
    defaults."""
    flags = [f"--{f.name} {getattr(cfg, f.name)}" for f in dataclasses.fields(cfg)
             if getattr(cfg, f.name) != f.default]
    return " ".join(["python precompute.py"] + flags)


@torch.no_grad()
def precompute_ref_logps(model, examples, n_rows, micro_batch_size, pad, d, pack_len=0):
    """π_ref's summed log-probs of every example, sharded over ranks. Returns (2, n_rows) fp32,
    rows [chosen; rejected], keyed by example["index"]; NaN on rows tokenize_pairs left out; and
    the cost. Each rank takes whole micro-batches (batch i goes to rank i % world), so the batches,
    and hence the numbers, are the same for any world size. A DistributedSampler would instead pad
    the last shard by repeating rows, which a sum over ranks would count twice: here the shards are
    uneven and a per-row count proves each index was filled exactly once. The examples are batched
    in order of length (a fixed order, so still the same batches on any world size): each batch is
    padded only to its own longest row; or (pack_len) in their order, packed into rows of pack_len
    tokens."""
    model.eval()
    acc = torch.zeros(3, n_rows, device=d.device)  # chosen, rejected, times filled
    # real tokens, positions, FLOPs executed (padding included), FLOPs the real tokens need
    cost = torch.zeros(4, dtype=torch.float64, device=d.device)
    # padded, in order of length: each batch pads to its own longest row; packed, in the file's
    # order: first-fit fills rows best from a mix of lengths (on the task: 1.03 positions per real
    # token, against 1.15 from batches of one length)
    examples = examples if pack_len else sorted(examples, key=data.longest_row)
    batches = [examples[i:i + micro_batch_size]
               for i in range(0, len(examples), micro_batch_size)]
    mine = batches[d.rank::d.world]
    # --fsdp: a sharded model's forward is a collective (each block's weights are all-gathered), so
    # every rank runs as many forwards: one short of batches reruns its last and drops the result
    turns = -(-len(batches) // d.world) if sharded(model) else len(mine)
    for j in range(turns):
        rows = mine[min(j, len(mine) - 1)] if mine else batches[0]
        b = data.collate_pairs(rows, pad, pack_len)
        x, y, s = data.batch_to(b, d.device)
        idx = b["index"].to(d.device)
        with autocast(d.device):  # the same precision dpo.py's training forward uses
            logp = pair_logps(model, x, y, s).float()  # (2B,)
        if j >= len(mine):
            continue
        B = len(rows)
        acc[0, idx], acc[1, idx], acc[2, idx] = logp[:B], logp[B:], acc[2, idx] + 1
        cost += torch.tensor([(x != pad).sum().item(), x.numel(),
                              *batch_flops(model.config, x, y, pad, seq=s)],
                             dtype=torch.float64, device=d.device)
    # one collective each: a value + 0 from the others is exact
    all_reduce_sum(acc, d), all_reduce_sum(cost, d)
    filled = acc[2].cpu()
    check(filled.max() <= 1, f"{int((filled > 1).sum())} rows were computed twice (a sharding bug)")
    # NaN = not filled: any left at an example's index is an error
    out = torch.full((2, n_rows), float("nan"))
    out[:, filled == 1] = acc[:2, filled == 1].cpu()
    left = [e["index"] for e in examples if filled[e["index"]] != 1]
    check(not left, f"{len(left)} examples have no reference log-probs (e.g. rows {left[:5]})")
    bad = [e["index"] for e in examples if not torch.isfinite(out[:, e["index"]]).all()]
    check(not bad, f"π_ref gives non-finite log-probs for {len(bad)} examples (e.g. rows "
          f"{bad[:5]}): its weights overflow, as those of a run that diverged do; retrain it, "
          "e.g. with a lower --lr")
    return out, dict(tokens=int(cost[0]), positions=int(cost[1]), flops=int(cost[2]),
                     model_flops=int(cost[3]))


def main(cfg):
    d = init_distributed()
    cfg = plan(cfg)  # your pairs: a folder of their own
    log = Logger(cfg.out_dir, d).print
    prepare_outputs({cfg.out_dir: "--out_dir"}, d, log)  # before any work
    # π_ref and the pairs; with the default paths, missing ones are built (sft.py, the task)
    require_stage(cfg.ref_model, Config.ref_model, lambda: sft.main(sft.Config()),
                  "python sft.py", d, log)
    task.require_task({cfg.train_pairs: Config.train_pairs, cfg.val_pairs: Config.val_pairs}, d,
                      log)
    tok = data.load_tokenizer(tokenizer_beside(cfg.ref_model))
    model = freeze(load_model(cfg.ref_model, d.device)[0], precision(d.device) == "bf16")
    model = wrap(model, d, fsdp=cfg.fsdp)  # sharded with --fsdp (frozen: no DDP otherwise)
    check(cfg.max_len <= model.config.block_size,
          f"--max_len {cfg.max_len} > π_ref's block_size {model.config.block_size}")
    splits = []  # both files read and checked before either cache file is written
    for split, pairs in (("train", cfg.train_pairs), ("val", cfg.val_pairs)):
        rows = data.read_pairs(pairs)
        examples, stats = data.tokenize_pairs(tok, rows, cfg.max_len, cfg.max_prompt_len, pairs)
        check(examples, f"{pairs} has no usable pair: in each row chosen and rejected are "
              f"identical once cut to --max_len {cfg.max_len} tokens")
        splits.append((split, rows, examples, stats))
    for split, rows, examples, stats in splits:
        pairs = cfg.train_pairs if split == "train" else cfg.val_pairs
        warn = data.truncation_warning(stats, pairs, cfg.max_len)
        if warn:
            log(warn)
        t0 = time.perf_counter()
        logps, cost = precompute_ref_logps(model, examples, len(rows), cfg.micro_batch_size,
                                           tok.pad, d, cfg.pack * cfg.max_len)
        cost.update(wall_s=time.perf_counter() - t0, world=d.world, device=str(d.device))
        path = os.path.join(cfg.out_dir, f"{split}.safetensors")
        if d.is_main:
            save_ref_logps(path, logps, fingerprint(cfg, split, examples, d.device), stats, cost)
        log(f"{path}: {len(examples)} pairs of {len(rows)} rows ({stats['truncated_prompt']} "
            f"prompts and {stats['truncated_response']} responses truncated, "
            f"{stats['unusable']} unusable) | {cost['tokens']} tokens ({cost['positions']} "
            f"positions with padding) | {cost['flops'] / 1e9:.2f} GFLOP | "
            f"{cost['wall_s']:.2f} s on {d.world} rank(s)"
            + (" | π_ref sharded (FSDP2)" if sharded(model) else ""))
    barrier(d)  # the files are on disk before any rank returns (dpo.py reads them next)
    teardown(d)


if __name__ == "__main__":
    main(parse_config(Config, doc=__doc__))
