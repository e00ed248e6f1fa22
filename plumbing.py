"""The plumbing every stage repeats, so that the stages show only their algorithm: distributed
setup and teardown (DDP, or FSDP2 with --fsdp), the config dataclass as command-line flags, rank-0
logging to stdout and metrics.jsonl, atomic writes, building a missing earlier stage, the
learning-rate schedule, the precision rule, and the weight broadcast to a rollout engine.
"""
import argparse
import atexit
import contextlib
import dataclasses
import gc
import errno
import fcntl
import inspect
import json
import math
import os
import re
import socket
import sys
import time
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.nn.parallel import DistributedDataParallel as DDP


# One sampling stream per (seed, iteration): seed + SEED_STRIDE * iteration (+ a small offset per
# purpose). A prime far above any seed a run uses, so no two (seed, iteration) pairs share a stream.
SEED_STRIDE = 1_000_003

# -----------------------------------------------------------------------------
# distributed

# How long a rank waits in a collective (or for the store) before it fails, unless DIST_TIMEOUT_S
# (seconds) says otherwise. A rank that stopped answering (a frozen process, a dead host) holds
# every other rank at its next collective; torch's default wait is 30 minutes under gloo (10 under
# nccl). 5 minutes ends such a job in minutes and is still far above the longest wait a healthy
# run has between two collectives. Those are rank 0's work alone while the others wait at a
# barrier: building the missing task (task.require_task, 2 s measured), a checkpoint or a stage's
# outputs written (the largest model here, GPT-2 small with AdamW state, is 1.5 GB: seconds), a
# study's tables; and the skew of ranks doing the same work (sampling their share in evaluation,
# torch.compile's first compile), a fraction of that work. Missing stages built on the way (sft.py,
# reward.py, precompute.py) run on every rank, with collectives of their own.
DIST_TIMEOUT_S = 300


@dataclass
class Dist:
    rank: int  # global rank, 0 in a single process
    local_rank: int  # rank on this machine: picks the GPU
    world: int  # number of processes
    device: torch.device
    is_main: bool  # rank 0: the only rank that prints and writes
    created: bool  # True if this call created the process group (and so must destroy it)
    locks: list = field(default_factory=list)  # the folders this run locked (lock_folder)


def init_distributed():
    """Plain torchrun or a single process. Idempotent: a stage that builds a missing earlier stage
    calls that stage's main(), which finds the process group already there and reuses it."""
    if "RANK" not in os.environ:  # `python x.py`: one process, no process group
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return Dist(0, 0, 1, device, True, False)
    rank, local_rank = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
    cuda = torch.cuda.is_available()
    device = torch.device(f"cuda:{local_rank}" if cuda else "cpu")
    if cuda:
        torch.cuda.set_device(device)
    else:  # N ranks on one CPU share its cores; oversubscribed threads run many times slower
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_world))
    created = not dist.is_initialized()
    timeout = float(os.environ.get("DIST_TIMEOUT_S") or DIST_TIMEOUT_S)
    if created:  # device_id binds nccl's communicator to this rank's GPU now, not at first use
        dist.init_process_group(backend="nccl" if cuda else "gloo",
                                device_id=device if cuda else None,
                                timeout=timedelta(seconds=timeout))
        sys.excepthook = name_silent_ranks(sys.excepthook, rank, dist.get_world_size(), timeout)
    return Dist(rank, local_rank, dist.get_world_size(), device, rank == 0, created)


def name_silent_ranks(hook, rank, world, timeout):
    """sys.excepthook for a rank whose collective timed out: after `hook` (torch's, which prints the
    traceback), one line naming the ranks that stopped answering. gloo's error names no peer, and
    torchrun reports the rank that timed out as the root cause, not the one it waited for. A rank
    that fails, whatever the error, checks in at the store (the launcher's, which outlives a frozen
    rank); one that timed out waits for the others, which entered the same collective, give or
    take their skew (or saw it close): a rank that does not check in within `grace` stopped."""
    grace = min(timeout, 30.0)

    def hook_and_name(kind, exc, tb):
        hook(kind, exc, tb)
        try:
            store = dist.distributed_c10d._get_default_store()
            store.set_timeout(timedelta(seconds=grace))
            store.set(f"failed/{rank}", "1")  # this rank still answers
            if not (isinstance(exc, RuntimeError) and "timed out" in str(exc).lower()):
                return
            end, silent = time.monotonic() + grace, list(range(world))
            while silent and time.monotonic() < end:
                silent = [r for r in silent if not store.check([f"failed/{r}"])]
                time.sleep(0.2)
        except Exception:  # the store gone too: the traceback above is all there is
            return
        waits = f"rank {rank} waited {timeout:g} s in a collective (DIST_TIMEOUT_S)"
        if silent:
            who = ", ".join(map(str, silent))
            msg = (f"rank{'s' * (len(silent) > 1)} {who} stopped answering: {waits}, and rank "
                   f"{who} did not report within {grace:g} s more (frozen, stopped by a signal, "
                   "or stuck outside any collective). Look at what stopped it; a wait this long "
                   "that is legitimate needs a larger DIST_TIMEOUT_S")
        else:
            msg = (f"every rank answered, but {waits}: they wait in different collectives, so "
                   "one rank skipped a collective the others took (each must take part in every "
                   "collective, in the same order), or a wait this long is legitimate: set "
                   "DIST_TIMEOUT_S larger")
        print(f"error: {msg}", file=sys.stderr, flush=True)
    return hook_and_name


# The groups that teardown ended, held until the interpreter exits (atexit runs while Python still
# runs threads). Whoever drops a group's last reference joins its gloo worker threads. A DDP
# module's Reducer holds one and drops it with the GIL held: were it the last (the module is freed
# as main() returns, after teardown), a worker thread still freeing a tensor would wait for the GIL
# forever, and the rank with it. This list's reference, dropped from Python, lets the GIL go first.
# An FSDP module is cyclic garbage (its hooks refer to it): collected first, while the list still
# holds the group, it is freed now rather than by the interpreter's teardown, where a rank aborted
# ("terminate called without an active exception") in about 1 of 6 loaded two-rank runs.
ENDED_GROUPS = []


@atexit.register
def _release_ended_groups():
    gc.collect()
    ENDED_GROUPS.clear()


def teardown(d):
    """Every rank gets here before any destroys the group: under gloo, a rank whose peer destroyed
    it first can abort at exit ("terminate called without an active exception"). The group is
    then unregistered, and released at exit (ENDED_GROUPS). The run's output folder is unlocked."""
    for real in d.locks:
        LOCKS.pop(real).close()
    d.locks.clear()
    if d.created:
        dist.barrier()
        ENDED_GROUPS.append(dist.group.WORLD)
        dist.destroy_process_group()


def barrier(d):
    if d.world > 1:
        dist.barrier()


def all_reduce_sum(t, d):
    """Sum a tensor over ranks in place (a no-op in one process) and return it."""
    if d.world > 1:
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t


def all_gather_rows(t, d):
    """Every rank's t (the same shape on each), concatenated along dim 0 in rank order: rank r's
    rows follow rank r-1's, as data.rank_slice cut the global batch. t itself in one process."""
    if d.world == 1:
        return t
    parts = [torch.empty_like(t) for _ in range(d.world)]
    dist.all_gather(parts, t.contiguous())
    return torch.cat(parts)


def reduce_sums(d, **sums):
    """Named sums over ranks in one all-reduce, in fp64 so that counts stay exact: each value is
    this rank's sum (tensor or number); reduce_sums(d, loss=..., n=...) -> {"loss": .., "n": ..}."""
    t = torch.stack([torch.as_tensor(v, dtype=torch.float64, device=d.device).detach().reshape(())
                     for v in sums.values()])
    return dict(zip(sums, all_reduce_sum(t, d).tolist()))


def wrap(model, d, compile=False, fsdp=False):
    """The module the loop calls: DDP over the ranks (the model itself in one process), then, with
    compile, torch.compile of the DDP module, PyTorch's recommended order (DDP's graph is split at
    its gradient buckets, so each all-reduce overlaps the backward); dynamic=True, as batches are
    padded to their own longest row. Keep the unwrapped model for sampling, scoring and saving.
    fsdp=True: FSDP2 instead. Each GPT inside `model` (PPO's policy and critic each) is sharded in
    place, each block and then the GPT, so a rank holds 1/world of the parameters, grads and AdamW
    state and a pass all-gathers one block at a time (ZeRO-3); the loop's text is the same. A
    frozen model (π_ref, r_φ) is sharded alike under fsdp and left as it is otherwise (DDP has no
    gradient to reduce)."""
    if fsdp:
        check(dist.is_initialized(), "--fsdp shards over the ranks of a process group: run it with "
              "torchrun (torchrun --nproc_per_node=1 for one process)")
        for gpt in [m for m in model.modules() if hasattr(m, "transformer")]:
            for block in gpt.transformer.h:
                fully_shard(block)
            fully_shard(gpt)
    elif d.world > 1 and any(p.requires_grad for p in model.parameters()):
        model = DDP(model, device_ids=[d.local_rank] if d.device.type == "cuda" else None)
    return torch.compile(model, dynamic=True) if compile else model


def sync_grads(model, sync):
    """The context of one micro-step, forward and backward inside it. With sync=False, DDP skips its
    gradient all-reduce (no_sync): the micro-batches' gradients add up on each rank and are reduced
    once, on the last micro-step (sync=True). FSDP's way is a switch on each sharded module: off,
    the backward keeps whole gradients and skips the reduce-scatter."""
    sharded = [m for m in model.modules() if isinstance(m, FSDPModule)]
    for m in sharded:
        m.set_requires_gradient_sync(sync, recurse=False)
    ddp = getattr(model, "_orig_mod", model)  # torch.compile's wrapper holds the DDP module
    if sync or not isinstance(ddp, DDP):
        return contextlib.nullcontext()
    return ddp.no_sync()


def sharded(model):
    """Is any part of the model sharded by wrap's fsdp?"""
    return any(isinstance(m, FSDPModule) for m in model.modules())


@contextlib.contextmanager
def gathered(*models):
    """--fsdp: inside it, each sharded model holds its whole weights on every rank, as under DDP,
    and runs forwards without collectives: for passes whose ranks run unequal numbers of forwards
    (evaluation, sampling, the rollout copy's refresh). Forward only: a change to the weights
    inside it is lost. A no-op for unsharded models (None skipped)."""
    units = [m for model in models if model is not None for m in model.modules()
             if isinstance(m, FSDPModule)]
    for m in units:
        m.unshard()
        m.set_reshard_after_forward(False, recurse=False)
    try:
        yield
    finally:
        for m in units:
            m.set_reshard_after_forward(True, recurse=False)
            m.reshard()


def main_decides(flag, d):
    """Rank 0's boolean, on every rank. Used before collective work that depends on the file system
    (is a stage's output there?): ranks that looked at different moments must not disagree."""
    t = torch.tensor([int(bool(flag))], device=d.device)
    if d.world > 1:
        dist.broadcast(t, src=0)
    return bool(t.item())


def require_stage(path, default, build, command, d, log):
    """docs/DESIGN.md, "Contracts between stages": with the default path a missing input is built by
    the earlier stage with its defaults (and the log says so); with an explicit path a missing input
    is an error naming it."""
    if main_decides(os.path.exists(path), d):
        return
    check(os.path.normpath(path) == os.path.normpath(default),
          f"{path} does not exist (it was passed explicitly, so it is not built)")
    log(f"{path} is missing: building it now, as `{command}` would")
    build()


# -----------------------------------------------------------------------------
# config dataclass -> argparse


# The values every numeric flag may take, by name, for every stage and study: parse_config refuses
# any other before work starts, naming the flag, the value and the interval ("[" includes a bound,
# "(" excludes it; NaN is in none). A numeric field missing here is a programming error, so no flag
# goes unchecked. Where a bound is not the obvious one, the reason:
#   beta ≥ 0.001: the DPO gradient is about β/2 · ∇h, and below ~1e-6 it falls under AdamW's ε
#     (1e-8), so the policy never moves (--beta 1e-30 saved π_ref unchanged); the DPO paper's
#     range is 0.1 to 0.5.
#   temperature ≥ 0.1: the gradient of log softmax(z/T) at a sampled token whose logit leads by Δz
#     carries exp(−Δz/T)/T, which underflows as T → 0 (--temperature 1e-12 saved π_ref unchanged).
#   label_smoothing < 0.5: at 0.5 a label says nothing, above it the labels are flipped.
#   simpo_gamma ≥ 0: SimPO's target margin (its paper: 0.3 to 1.6); a negative one would count a
#     pair the policy ranks the wrong way, by less than |γ|, as learned. Its upper bound, β·ln V,
#     needs π_ref's vocabulary: dpo.setup checks it.
#   max_len ≥ 3: BOS, one prompt token and one response token.
AT_LEAST_1 = "[1, inf)"
FLAG_RANGES = {
    **dict.fromkeys(("steps", "iterations", "batch_size", "micro_batch_size", "rollout_batch",
                     "mini_batch", "ppo_epochs", "eval_every", "ckpt_every", "eval_k", "k",
                     "offset_samples", "kl_horizon", "n_layer", "n_head", "n_embd",
                     "max_prompt_len", "dpo_steps", "ppo_iterations", "online_iterations",
                     "rounds", "time_steps", "pairs", "ppo_rollouts", "points", "online_batch",
                     "iterative_rounds"),
                    AT_LEAST_1),
    **dict.fromkeys(("warmup", "stop_after", "seed", "curve_points"), "[0, inf)"),
    **dict.fromkeys(("block_size", "block", "max_len"), "[3, inf)"),
    **dict.fromkeys(("lr", "dpo_lr", "ppo_lr", "online_lr", "nll_alpha", "grad_clip", "kl_target",
                     "cliprange", "cliprange_value", "vf_coef"), "(0, inf)"),
    **dict.fromkeys(("beta", "curve_beta"), "[0.001, inf)"),
    **dict.fromkeys(("weight_decay", "kl_coef", "curve_kl_coef", "rpo_alpha", "simpo_gamma"),
                    "[0, inf)"),
    **dict.fromkeys(("min_lr_frac", "gamma", "lam"), "[0, 1]"),
    "dropout": "[0, 1)", "check_at": "(0, 1)", "label_smoothing": "[0, 0.5)",
    "delta": "(0, inf)",  # study/explore.py's equivalence margin: a width, so above 0
    "temperature": "[0.1, inf)",
    "group_size": "[2, inf)",  # a group's mean is its baseline: one completion alone has none
    "missing_eos_score": "(-inf, inf)",
}


def in_range(value, interval):
    """Is value in interval, written "[lo, hi)" and the like? NaN is in no interval."""
    lo, hi = (float(b) for b in interval[1:-1].split(","))
    above = value >= lo if interval[0] == "[" else value > lo
    below = value <= hi if interval[-1] == "]" else value < hi
    return above and below


def parse_config(cls, argv=None, doc=None):
    """One flag per field (`--beta 0.1`, `--compile/--no-compile`); --help shows each field's
    trailing comment, read from the dataclass source, so the comment and the help can't drift, and
    a numeric field's allowed values (FLAG_RANGES), which are checked here."""
    src = inspect.getsource(cls)
    helps = dict(re.findall(r"^\s+(\w+)\s*:[^=\n]*=[^#\n]*#\s*(.*)$", src, re.M))
    p = argparse.ArgumentParser(description=doc,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    numeric = [f.name for f in dataclasses.fields(cls)
               if isinstance(f.default, (int, float)) and not isinstance(f.default, bool)]
    for name in numeric:
        assert name in FLAG_RANGES, f"--{name} has no allowed range in plumbing.FLAG_RANGES"
    for f in dataclasses.fields(cls):
        names = [f"--{f.name}"] + ([f"--{f.name.replace('_', '-')}"] if "_" in f.name else [])
        h = f"{helps.get(f.name, '')} (default: {f.default}"
        h += f"; allowed: {FLAG_RANGES[f.name]})" if f.name in numeric else ")"
        if isinstance(f.default, bool):
            p.add_argument(*names, dest=f.name, action=argparse.BooleanOptionalAction,
                           default=f.default, help=h)
        else:
            p.add_argument(*names, dest=f.name, type=type(f.default), default=f.default, help=h,
                           metavar="")
    cfg = cls(**vars(p.parse_args(argv)))
    for name in numeric:
        value = getattr(cfg, name)
        check(in_range(value, FLAG_RANGES[name]),
              f"--{name} {value} is outside its allowed values {FLAG_RANGES[name]}")
    return cfg


def check(ok, msg):
    """A user's mistake ends the run with one clear line, not a traceback."""
    if not ok:
        raise SystemExit(f"error: {msg}")


def split_batch(batch_size, micro_batch_size, world):
    """Global batch = world x accumulation steps x micro-batch; returns the accumulation steps.
    micro_batch_size is an upper bound (a rank with fewer rows runs them in one forward), so the
    same defaults work on 1 or 8 ranks. Derived and checked, never rewritten."""
    check(batch_size % world == 0,
          f"--batch_size {batch_size} is not divisible by the {world} ranks")
    per_rank = batch_size // world
    check(per_rank % min(micro_batch_size, per_rank) == 0,
          f"--batch_size {batch_size} over {world} ranks is {per_rank} rows per rank, "
          f"not a multiple of --micro_batch_size {micro_batch_size}")
    return per_rank // min(micro_batch_size, per_rank)


# The fewest tokens that π_ref's block must leave a sampled response past a prompt of
# --max_prompt_len (ppo.py, grpo.py and online_dpo.py sample into what the prompt leaves): a
# response is some words and its EOS. A floor, not a setting: with 8, a third of the built-in
# task's pool responses fit with their EOS (the shortest are 5 tokens with it); with 1, every
# completion is one token cut before its end, and the loop trains on those.
MIN_RESPONSE_TOKENS = 8


def check_response_room(max_prompt_len, block_size):
    room = block_size - max_prompt_len
    check(room >= MIN_RESPONSE_TOKENS, f"--max_prompt_len {max_prompt_len} leaves {room} tokens of "
          f"π_ref's {block_size}-token block for the response, fewer than {MIN_RESPONSE_TOKENS} "
          "(plumbing.MIN_RESPONSE_TOKENS: room for some words and their EOS): pass "
          f"--max_prompt_len {block_size - MIN_RESPONSE_TOKENS} or less")


# The folders this process holds locked, by real path, each by the run (its Dist) that took it and
# until that run's teardown. A run of this same process may take one again (a test resuming after
# a refusal, a study running stage after stage): the lock keeps other processes out.
LOCKS = {}


def lock_folder(folder, flag, d):
    """An exclusive lock on folder/.lock until teardown(d), so that two runs never write one folder
    (their checkpoints and metrics would interleave); the holder's pid, host and command are
    written into it for the refusal to name. flock, not the file's existence: the kernel drops the
    lock when its process dies, so a killed run's lock file never blocks its resume. Returns the
    refusal, or None."""
    real = os.path.realpath(folder)
    if real in LOCKS:
        return None
    f = open(os.path.join(folder, ".lock"), "a+")
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.seek(0)
        holder = f.read().strip() or "a process that has not said who it is yet"
        f.close()
        return (f"{folder} is in use by another run ({holder}): wait for it to end, or pick "
                f"another {flag}")
    f.truncate(0)
    f.write(f"pid {os.getpid()} on {socket.gethostname()}, started "
            f"{time.strftime('%Y-%m-%d %H:%M:%S')}: {' '.join(sys.argv)}\n")
    f.flush()
    LOCKS[real] = f
    d.locks.append(real)
    return None


@contextlib.contextmanager
def written(path):
    """Around a write of path through path + ".tmp": an OSError (a full disk, a quota, a mount gone
    read-only) removes the temp file and stops the run with the path and the reason, not a
    traceback; the file as it was before stays."""
    try:
        yield
    except OSError as e:
        with contextlib.suppress(OSError):
            os.remove(path + ".tmp")
        full = e.errno in (errno.ENOSPC, errno.EDQUOT)
        raise SystemExit(f"error: cannot write {path}: "
                         f"{'no space left on the device' if full else e.strerror}; nothing was "
                         "left half-written. Free space (or pick another folder) and run again: a "
                         "run resumes from its last checkpoint") from None


def atomic_write_text(path, text):
    """path holds text, or what it held before: written to path + ".tmp", then renamed."""
    with written(path):
        with open(path + ".tmp", "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(path + ".tmp", path)  # readers see the old file or the new one, never half


# -----------------------------------------------------------------------------
# logging


def fmt_duration(s):
    s = int(round(s))
    if s >= 3600:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 60}m{s % 60:02d}s" if s >= 60 else f"{s}s"


class Logger:
    """Rank 0 prints; other ranks stay silent. Every stage speaks through log.print, and logs each
    step with log.log: all its numbers go to metrics.jsonl, a short ` | `-separated line of the few
    a reader watches goes to stdout (nanoGPT's habit), under the same names. name: another JSONL
    of rows keyed by step, kept and written the same way (online_dpo.py's pairs.jsonl)."""

    def __init__(self, out_dir, d, name="metrics.jsonl"):
        self.is_main, self.path = d.is_main, os.path.join(out_dir, name)
        self.t0, self.step0 = time.time(), 0

    def print(self, *args):
        if self.is_main:
            print(*args, flush=True)

    def start(self, step):
        """Open metrics.jsonl for a run that starts at `step` (0, or a checkpoint's): the lines up
        to it are kept and later ones dropped (no step twice), rewritten through a temp file."""
        self.t0, self.step0 = time.time(), step
        if not self.is_main:
            return
        os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
        kept = []
        if step > 0 and os.path.exists(self.path):
            with open(self.path) as f:
                lines = f.readlines()
            for n, line in enumerate(lines, 1):
                try:
                    row = json.loads(line)
                except json.JSONDecodeError:
                    # a kill (or a full disk) mid-write tears the last line only
                    check(n == len(lines), f"{self.path}:{n}: not a JSON line; only the last line "
                          "may be torn (by a kill mid-write): mend or remove this one")
                    print(f"warning: dropped the torn last line of {self.path} (line {n}, "
                          f"{len(line)} characters, written by a run that was stopped mid-write)",
                          flush=True)
                    continue
                if row.get("step", 0) <= step:
                    kept.append(line)
        atomic_write_text(self.path, "".join(kept))

    def write(self, rows):
        """Append rows (dicts with a "step") to the file, rank 0's."""
        if not self.is_main:
            return
        with written(self.path), open(self.path, "a") as f:  # torn by a kill: start() drops it
            f.write("".join(json.dumps(r) + "\n" for r in rows))

    def log(self, step, total, metrics, show):
        """Append {"step", **metrics} to metrics.jsonl; print the step, the `show` keys present
        and the time left."""
        self.write([{"step": step, **metrics}])
        if not self.is_main:
            return
        eta = (time.time() - self.t0) / max(step - self.step0, 1) * (total - step)
        parts = [f"{k} {metrics[k]:.4g}" for k in show if k in metrics]
        print(" | ".join([f"step {step}/{total}", *parts, f"eta {fmt_duration(eta)}"]), flush=True)


# -----------------------------------------------------------------------------
# optimisation helpers


def lr_at(step, total, lr, warmup, min_lr_frac=0.1):
    """Linear warmup, then cosine decay to min_lr_frac * lr (min_lr_frac=1: constant after it)."""
    if step < warmup:
        return lr * (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    cosine = 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))
    return lr * (min_lr_frac + (1 - min_lr_frac) * cosine)


def set_lr(opt, lr):
    """Every param group's learning rate to lr (the schedule's value this step); returns it."""
    for g in opt.param_groups:
        g["lr"] = lr
    return lr


def precision(device):
    """The forwards' precision on this device: "bf16" (under bf16 autocast) on CUDA, "fp32" on the
    CPU. The one rule that autocast, the frozen models' dtype and the reference cache's fingerprint
    follow (the tests replace it to run the bf16 path on a CPU)."""
    return "bf16" if device.type == "cuda" else "fp32"


def autocast(device):
    """bf16 autocast where precision(device) says so (matmuls in bf16, reductions and the LM head in
    fp32); plain fp32 otherwise. Forward only: backward() runs in the dtypes the forward chose."""
    if precision(device) == "bf16":
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def adamw(model, lr, weight_decay):
    """AdamW with weight decay on the weight matrices only, not on biases, LayerNorm gains or the
    position table (GPT-2 / nanoGPT); fused: one kernel for all tensors."""
    wpe = model.transformer.wpe.weight
    decay = [p for p in model.parameters() if p.dim() >= 2 and p is not wpe]
    rest = [p for p in model.parameters() if not any(p is q for q in decay)]
    groups = [{"params": decay, "weight_decay": weight_decay},
              {"params": rest, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95), fused=True)


def clock(d):
    """Wall time, after the queued CUDA kernels: each phase is charged its own time."""
    if d.device.type == "cuda":
        torch.cuda.synchronize(d.device)
    return time.perf_counter()

