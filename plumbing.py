"""The plumbing every stage repeats, so that the stages themselves show only their algorithm.

Distributed setup and teardown, config dataclass -> command-line flags, rank-0 logging to stdout
and metrics.jsonl, the micro-step and non-finite guards every trainer shares, atomic writes,
resumable checkpoints in safetensors + JSON, the learning-rate schedule, and the measured matmul
peak used for MFU. Imports nothing from the project.
"""
import argparse
import contextlib
import dataclasses
import hashlib
import inspect
import json
import math
import os
import re
import shutil
import tempfile
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.nn.parallel import DistributedDataParallel as DDP

# -----------------------------------------------------------------------------
# distributed


@dataclass
class Dist:
    rank: int  # global rank, 0 in a single process
    local_rank: int  # rank on this machine: picks the GPU
    world: int  # number of processes
    device: torch.device
    is_main: bool  # rank 0: the only rank that prints and writes
    created: bool  # True if this call created the process group (and so must destroy it)


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
    if created:  # device_id binds nccl's communicator to this rank's GPU now, not at first use
        dist.init_process_group(backend="nccl" if cuda else "gloo",
                                device_id=device if cuda else None)
    return Dist(rank, local_rank, dist.get_world_size(), device, rank == 0, created)


def teardown(d):
    """Every rank gets here before any destroys the group: under gloo, a rank whose peer destroyed
    it first can abort at exit ("terminate called without an active exception", 1 run in 6 of
    `torchrun --nproc_per_node=2 costs.py` without this barrier, 0 in 8 with it)."""
    if d.created:
        dist.barrier()
        dist.destroy_process_group()


def barrier(d):
    if d.world > 1:
        dist.barrier()


def all_reduce_sum(t, d):
    """Sum a tensor over ranks in place (a no-op in one process) and return it."""
    if d.world > 1:
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t


def reduce_sums(d, **sums):
    """Named sums over ranks, in one all-reduce: reduce_sums(d, loss=..., n=...) ->
    {"loss": float, "n": float}. Each value is this rank's sum (a tensor or a number), in fp64, so
    counts stay exact."""
    t = torch.stack([torch.as_tensor(v, dtype=torch.float64, device=d.device).detach().reshape(())
                     for v in sums.values()])
    return dict(zip(sums, all_reduce_sum(t, d).tolist()))


def wrap(model, d, compile=False, fsdp=False):
    """The module the loop calls: DDP over the ranks (the model itself in one process), then, with
    compile, torch.compile of that DDP module, in PyTorch's recommended order: DDP's graph is then
    split at its gradient buckets, so each bucket's all-reduce overlaps the rest of the backward
    (DDP around a compiled module all-reduces only after it). dynamic=True: batches are padded to
    their longest row, so T changes from batch to batch; one compile with symbolic shapes, not one
    per length. Keep the unwrapped model for generation, scoring and saving.
    fsdp=True (--fsdp): FSDP2 instead of DDP. Each GPT inside `model` (itself, or PPO's policy and
    critic) is sharded in place: each transformer block, then the GPT (embeddings, final LayerNorm,
    head), so a rank holds 1/world of the parameters, grads and AdamW state, and a forward or
    backward all-gathers one block's weights at a time (ZeRO-3). The loop's text is the same; what
    differs is behind sync_grads, gathered, full_state and the checkpoint functions. A frozen model
    (π_ref, r_φ: no trainable parameter) is sharded alike under fsdp, and left as it is otherwise
    (DDP has no gradient to reduce). A GPT's blocks and itself are the units, not the caller's
    wrapper: PPO runs its policy and critic alone too, and FSDP2 wants its root to run first."""
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
    once, on the last micro-step (sync=True). FSDP's way is a switch on each sharded module: with
    it off, the backward keeps whole gradients and skips the reduce-scatter. A no-op for an
    unwrapped model."""
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
    and runs forwards without collectives: for the passes whose ranks run unequal numbers of
    forwards (evaluation, sampling, the rollout copy's refresh), where FSDP's per-forward
    all-gathers would pair up wrongly. Forward only: a change to the weights inside it is lost.
    Costs the whole parameters per rank while it lasts. A no-op for unsharded models (None
    skipped)."""
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


def full_tensor(t, keep=True):
    """t whole on the CPU (None where keep is False): a DTensor (a shard under --fsdp) is
    all-gathered first, so every rank calls it; one tensor at a time, so a rank never holds more
    than one whole tensor beyond its shards."""
    if isinstance(t, DTensor):
        t = t.full_tensor()
    return t.detach().contiguous().cpu() if keep else None


def full_state(module, keep=True):
    """The module's state_dict without aliases, whole tensors on the CPU, where keep is True ({}
    elsewhere). Every rank calls it: under --fsdp each tensor is gathered from the shards. Tied
    weights (lm_head = wte) are stored once; load_state_dict with strict=False refills the alias
    through the shared Parameter."""
    names = {n for n, _ in [*module.named_parameters(), *module.named_buffers()]}  # no aliases
    out = {k: full_tensor(v, keep) for k, v in module.state_dict().items() if k in names}
    return out if keep else {}


def shard_like(full, like):
    """A whole tensor read from a file, as `like` holds it: this rank's shard of it where `like` is
    a DTensor (--fsdp; each rank takes its own rows, no communication), else the tensor itself. So
    a checkpoint resumes under any world size, with or without --fsdp."""
    if not isinstance(like, DTensor):
        return full
    return distribute_tensor(full.to(like.device), like.device_mesh, like.placements,
                             src_data_rank=None)


def main_decides(flag, d):
    """Rank 0's boolean, on every rank. Used before collective work that depends on the file system
    (is a stage's output there?): ranks that looked at different moments must not disagree."""
    t = torch.tensor([int(bool(flag))], device=d.device)
    if d.world > 1:
        dist.broadcast(t, src=0)
    return bool(t.item())


def require_stage(path, default, build, command, d, log):
    """DESIGN.md's contract: with the default path a missing input is built by the earlier stage
    with its defaults (and the log says so); with an explicit path a missing input is an error
    naming it."""
    if main_decides(os.path.exists(path), d):
        return
    if os.path.normpath(path) != os.path.normpath(default):
        raise SystemExit(f"error: {path} does not exist "
                         "(it was passed explicitly, so it is not built)")
    log(f"{path} is missing: building it now, as `{command}` would")
    build()


# -----------------------------------------------------------------------------
# config dataclass -> argparse


def parse_config(cls, argv=None, doc=None):
    """One flag per field (`--beta 0.1`, `--compile/--no-compile`); --help shows each field's
    trailing comment, read from the dataclass source, so the comment and the help can't drift."""
    src = inspect.getsource(cls)
    helps = dict(re.findall(r"^\s+(\w+)\s*:[^=\n]*=[^#\n]*#\s*(.*)$", src, re.M))
    p = argparse.ArgumentParser(description=doc,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    for f in dataclasses.fields(cls):
        names = [f"--{f.name}"] + ([f"--{f.name.replace('_', '-')}"] if "_" in f.name else [])
        h = f"{helps.get(f.name, '')} (default: {f.default})"
        if isinstance(f.default, bool):
            p.add_argument(*names, dest=f.name, action=argparse.BooleanOptionalAction,
                           default=f.default, help=h)
        else:
            p.add_argument(*names, dest=f.name, type=type(f.default), default=f.default, help=h,
                           metavar="")
    return cls(**vars(p.parse_args(argv)))


def check(ok, msg):
    """A user's mistake ends the run with one clear line, not a traceback."""
    if not ok:
        raise SystemExit(f"error: {msg}")


def split_batch(batch_size, micro_batch_size, world):
    """Global batch = world x accumulation steps x micro-batch; returns the accumulation steps.
    micro_batch_size is an upper bound (a rank with fewer rows runs them in one forward), so the
    same defaults work on 1 or 8 ranks. Derived and checked, never rewritten; the caller prints
    it."""
    check(batch_size % world == 0,
          f"--batch_size {batch_size} is not divisible by the {world} ranks")
    per_rank = batch_size // world
    check(per_rank % min(micro_batch_size, per_rank) == 0,
          f"--batch_size {batch_size} over {world} ranks is {per_rank} rows per rank, "
          f"not a multiple of --micro_batch_size {micro_batch_size}")
    return per_rank // min(micro_batch_size, per_rank)


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
    a reader watches goes to stdout (nanoGPT's habit), under the same names."""

    def __init__(self, out_dir, d):
        self.is_main, self.path = d.is_main, os.path.join(out_dir, "metrics.jsonl")
        self.t0, self.step0 = time.time(), 0

    def print(self, *args):
        if self.is_main:
            print(*args, flush=True)

    def start(self, step):
        """Open metrics.jsonl for a run that starts at `step` (0, or where a checkpoint resumes).
        A resumed run keeps the lines up to its checkpoint and drops the later ones, so no step
        appears twice; the file is rewritten through a temp file, so a kill here cannot empty it."""
        self.t0, self.step0 = time.time(), step
        if not self.is_main:
            return
        os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
        kept = []
        if step > 0 and os.path.exists(self.path):
            with open(self.path) as f:
                kept = [line for line in f if json.loads(line).get("step", 0) <= step]
        atomic_write_text(self.path, "".join(kept))

    def log(self, step, total, metrics, show):
        """Append {"step", **metrics} to metrics.jsonl; print the step, the `show` keys present
        and the time left."""
        if not self.is_main:
            return
        with open(self.path, "a") as f:
            f.write(json.dumps({"step": step, **metrics}) + "\n")
        eta = (time.time() - self.t0) / max(step - self.step0, 1) * (total - step)
        parts = [f"{k} {metrics[k]:.4g}" for k in show if k in metrics]
        print(" | ".join([f"step {step}/{total}", *parts, f"eta {fmt_duration(eta)}"]), flush=True)


# -----------------------------------------------------------------------------
# outputs: writable before any work, atomic writes, checkpoints

# What a killed writer leaves behind: our temp files (NAME.safetensors.tmp, NAME.json.tmp,
# metrics.jsonl.tmp) and safetensors' own: save_file writes through a hidden temp file beside its
# target (".tmp" + 6 characters, from Rust's tempfile crate), as big as the file, then renames it.
STALE_TEMP = re.compile(r".+\.(safetensors|json|jsonl)\.tmp|\.tmp[A-Za-z0-9]{6}")


def remove_stale_temp_files(folder, log):
    """Delete the temp files a killed run left in `folder` and name them. Called before this run
    writes there; only rank 0 writes, so no live writer's file is taken."""
    stale = sorted(f for f in os.listdir(folder) if STALE_TEMP.fullmatch(f))
    for f in stale:
        os.remove(os.path.join(folder, f))
    if stale:
        log(f"removed temp files that a killed run left in {folder}: {', '.join(stale)}")


def prepare_outputs(folders, d, log):
    """Before any work, so that a bad folder fails the run now and not at its first checkpoint:
    each of `folders` ({path: the flag that picks it}, e.g. {"out/dpo/ckpt": "--out_dir"}) is
    created if missing and proved writable by creating a file in it (os.access would say yes to
    root on a read-only mount); then the temp files a killed run left there are removed. Rank 0,
    the writer, looks; every rank stops alike."""
    msg = None
    for folder, flag in folders.items() if d.is_main else ():
        if os.path.exists(folder) and not os.path.isdir(folder):
            msg = f"{folder} is a file, not a folder: move it away, or pick another {flag}"
            break
        try:
            os.makedirs(folder, exist_ok=True)
            with tempfile.TemporaryFile(dir=folder):
                pass
        except OSError as e:
            msg = (f"cannot write in {folder} ({e.strerror}): pick another {flag}, or make it a "
                   "writable folder")
            break
        remove_stale_temp_files(folder, log)
    if not main_decides(msg is None, d):
        raise SystemExit(f"error: {msg}" if d.is_main else 1)


def atomic_write_text(path, text):
    """Write to a temp file, then rename: a crash never leaves a half-written file behind."""
    with open(path + ".tmp", "w", encoding="utf-8") as f:
        f.write(text)
    os.replace(path + ".tmp", path)


def atomic_write_json(path, obj):
    atomic_write_text(path, json.dumps(obj, indent=1))


def atomic_copy(src, dst):
    """src's bytes to dst, through a temp file and a rename, as atomic_write_text."""
    shutil.copyfile(src, dst + ".tmp")
    os.replace(dst + ".tmp", dst)


def file_mode():
    """The mode open() gives a new file: 0666 less the umask."""
    umask = os.umask(0)
    os.umask(umask)
    return 0o666 & ~umask


def save_safetensors(tensors, path, metadata):
    """safetensors' save_file to path + ".tmp", then renamed into place, with the mode open() would
    give it, as the JSON beside it: save_file's own temp file is created 0600 and keeps that
    mode."""
    save_file(tensors, path + ".tmp", metadata=metadata)
    os.chmod(path + ".tmp", file_mode())
    os.replace(path + ".tmp", path)


def save_checkpoint(ckpt_dir, step, parts, state, write=True):
    """One safetensors file per checkpoint holding every module and optimizer in `parts`
    ({"model": raw_model, "optim": optimizer, ...}; a plain tensor is stored as is), plus JSON
    `state` (config, counters). Every rank calls it; the ranks where write is False (all but rank
    0) only help gather the --fsdp shards: whole tensors, the same file as without --fsdp, so a run
    resumes on any world size, sharded or not. latest.json is renamed into place last, so a crash
    at any moment leaves the previous checkpoint intact and pointed to; older files, and the temp
    files of a killed save, are deleted only after that. A non-finite tensor is never saved: the
    run stops and keeps the checkpoint it had."""
    tensors, meta = {}, {"step": step, "state": state, "optim": {}}
    for name, obj in parts.items():
        if isinstance(obj, torch.optim.Optimizer):
            sd = obj.state_dict()
            for i, s in sd["state"].items():
                for k, v in s.items():
                    tensors[f"{name}/{i}/{k}"] = full_tensor(torch.as_tensor(v), write)
            meta["optim"][name] = sd["param_groups"]
        elif isinstance(obj, torch.Tensor):
            tensors[f"{name}"] = full_tensor(obj, write)
        else:
            tensors.update({f"{name}/{k}": v for k, v in full_state(obj, write).items()})
    if not write:
        return
    os.makedirs(ckpt_dir, exist_ok=True)
    bad = [k for k, v in tensors.items() if v.is_floating_point() and not v.isfinite().all()]
    if bad:
        raise SystemExit(f"error: non-finite values in {', '.join(bad[:3])} at step {step}: not "
                         f"saved; the last good checkpoint is kept: {last_checkpoint(ckpt_dir)}")
    fname = f"step-{step:07d}.safetensors"
    save_safetensors(tensors, os.path.join(ckpt_dir, fname), {"json": json.dumps(meta)})
    atomic_write_json(os.path.join(ckpt_dir, "latest.json"), {"file": fname, "step": step})
    for old in os.listdir(ckpt_dir):
        if old != fname and (old.startswith("step-") or STALE_TEMP.fullmatch(old)):
            os.remove(os.path.join(ckpt_dir, old))


def checkpoint_state(ckpt_dir):
    """The JSON state saved with the latest checkpoint, its "step" added; None if there is none."""
    latest = os.path.join(ckpt_dir, "latest.json")
    if not os.path.exists(latest):
        return None
    with open(latest) as f:
        fname = json.load(f)["file"]
    with safe_open(os.path.join(ckpt_dir, fname), "pt") as f:
        meta = json.loads(f.metadata()["json"])
    return {**meta["state"], "step": meta["step"]}


def check_finite_weights(module, path):
    """A model file with NaN or inf weights (saved by a run that diverged) is named as the cause
    when it is loaded, rather than found later as NaN log-probs or a NaN loss."""
    bad = [k for k, v in module.state_dict().items()
           if v.is_floating_point() and not v.isfinite().all()]
    check(not bad, f"{path} holds non-finite weights (NaN or inf in {len(bad)} tensors, e.g. "
          f"{bad[:1]}): the run that saved it diverged; retrain it, e.g. with a lower --lr")


def last_checkpoint(ckpt_dir):
    """Where the last checkpoint is, said when a run stops."""
    try:
        last = checkpoint_state(ckpt_dir)
    except Exception as e:  # damaged outside this code (see resume)
        return f"{ckpt_dir}, which cannot be read ({e})"
    return f"{ckpt_dir} at step {last['step']}" if last else "none (no checkpoint was written yet)"


def stop_if_not_finite(values, where, ckpt_dir, hint):
    """The guard every trainer runs before its optimizer step: if any of `values` ({name: float},
    all-reduced, so every rank decides alike) is NaN or inf, stop before the update, so that no
    non-finite tensor is ever stepped into or saved, and name the last good checkpoint."""
    bad = {k: v for k, v in values.items() if not math.isfinite(v)}
    if not bad:
        return
    what = ", ".join(f"{k} ({v})" for k, v in bad.items())
    raise SystemExit(f"error: non-finite {what} at {where}: stopped before the update; the last "
                     f"good checkpoint is kept: {last_checkpoint(ckpt_dir)}. {hint}")


# A finite divergence (dpo.py --lr 30: loss 0.69, then 3.7e3 at step 2) is stopped like a NaN. The
# rule for the trainers of a loss (sft, reward, dpo): a step's training loss above DIVERGED x the
# loss of the run's first step, the model before any update: sft's near-uniform guess (about ln V),
# log 2 for reward and DPO (r_φ = 0, π = π_ref). Updates that make the model's own batches 10x
# worse than no training at all have left any stable regime. Measured on the built-in task, tiny
# model: dpo --lr 1e-2 (33x the default) peaks at 6.7x and trains well; sft --lr 3 reached 28x and
# finished with a val loss of 35 nats/token (guessing uniformly: 6.2), saved without a word at 100x;
# a spike of 18x at dpo --lr 3e-2 came back down (this rule stops it: lower the lr); --lr 30 is
# stopped at step 2 or 3 (dpo 5400x, reward 340x, sft 240x). ppo.py bounds approx_kl instead (its
# losses start near 0).
DIVERGED = 10


def stop_if_diverged(name, value, limit, rule, where, ckpt_dir, hint):
    """The divergence guard: `value` (all-reduced, so every rank decides alike) above `limit`
    (set by `rule`, said in the message) stops the run as a NaN would, before it is saved."""
    if value <= limit:
        return
    raise SystemExit(f"error: the run diverged: {name} {value:.4g} at {where} is above {limit:.4g} "
                     f"({rule}); stopped, and not saved; the last checkpoint is kept: "
                     f"{last_checkpoint(ckpt_dir)}. {hint}")


def load_checkpoint(ckpt_dir, parts, device):
    """Fill `parts` (same names as at save) from the latest checkpoint; returns (step, state).
    Plain tensors in `parts` are replaced: read them back from the returned dict's "tensors"."""
    with open(os.path.join(ckpt_dir, "latest.json")) as f:
        fname = json.load(f)["file"]
    path = os.path.join(ckpt_dir, fname)
    tensors = load_file(path, device="cpu")
    with safe_open(path, "pt") as f:
        meta = json.loads(f.metadata()["json"])
    loose = {}
    for name, obj in parts.items():
        sub = {k[len(name) + 1:]: v for k, v in tensors.items() if k.startswith(name + "/")}
        if isinstance(obj, torch.optim.Optimizer):
            state, params = {}, [p for g in obj.param_groups for p in g["params"]]
            for k, v in sub.items():
                i, key = k.split("/")
                v = v.float() if key == "step" else shard_like(v, params[int(i)])
                state.setdefault(int(i), {})[key] = v
            obj.load_state_dict({"state": state, "param_groups": meta["optim"][name]})
        elif isinstance(obj, torch.Tensor):
            loose[name] = tensors[name]
        else:
            like = obj.state_dict()
            sub = {k: shard_like(v, like[k]) if k in like else v for k, v in sub.items()}
            missing, unexpected = obj.load_state_dict(sub, strict=False)
            aliases = {k for k, v in obj.state_dict().items() if k not in sub}
            check(not unexpected and set(missing) <= aliases,
                  f"{path}: {name} does not match the model "
                  f"(missing {missing[:3]}, unexpected {unexpected[:3]})")
            obj.to(device)
    return meta["step"], {**meta["state"], "tensors": loose}


# -----------------------------------------------------------------------------
# optimisation helpers


def lr_at(step, total, lr, warmup, min_lr_frac=0.1):
    """Linear warmup, then cosine decay to min_lr_frac * lr (min_lr_frac=1: constant after it)."""
    if step < warmup:
        return lr * (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    cosine = 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))
    return lr * (min_lr_frac + (1 - min_lr_frac) * cosine)


def precision(device):
    """The forwards' precision on this device: "bf16" (under bf16 autocast) on CUDA, "fp32" on the
    CPU. The one rule that autocast, the frozen models' dtype and the reference cache's fingerprint
    follow (the tests replace it to run the bf16 path on a CPU)."""
    return "bf16" if device.type == "cuda" else "fp32"


def autocast(device):
    """bf16 autocast where precision(device) says so (matmuls in bf16, reductions and the LM head in
    fp32); plain fp32 otherwise. Forward only: backward() runs outside it, in the dtypes the forward
    chose."""
    if precision(device) == "bf16":
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


PEAKS = {}  # (device, shapes) -> FLOP/s: measure_peak_flops times each once per process


def measure_peak_flops(device, shapes, seconds=0.1):
    """The device's matmul throughput at the model's own shapes, FLOP/s: the denominator of MFU and
    HFU. shapes: (m, k, n) of the model's matmuls (model.matmul_shapes). Each shape is timed in 5
    blocks of repeated matmuls, seconds / 5 / len(shapes) or more each (CUDA events on a GPU), after
    a warm-up that also sizes the blocks; the peak is the fastest block of the fastest shape. The
    fastest, not the median: another process can only slow a block down, never speed it up, so the
    fastest block is the closest to what the device does (timeit's rule), and a peak measured too
    low is what lets a utilisation pass 1. A step runs these same matmuls and slower work besides,
    so its FLOPs per second stay below the peak: utilisation <= 1. Measured once per process and
    shapes; the tensors are freed before it returns (and CUDA's cache emptied), so a peak-memory
    count started after it never sees them. Measured, not read from a spec sheet."""
    key = (str(device), tuple(shapes))
    if key in PEAKS:
        return PEAKS[key]
    cuda = device.type == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32  # what autocast multiplies in

    def timed(f, reps):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(reps):
                f()
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / 1000
        t = time.perf_counter()
        for _ in range(reps):
            f()
        return time.perf_counter() - t

    def throughput(m, k, n):  # FLOP/s of one shape; its tensors are freed on return
        a, b = (torch.randn(r, c, device=device, dtype=dtype) for r, c in ((m, k), (k, n)))
        out = torch.empty(m, n, device=device, dtype=dtype)
        f = lambda: torch.mm(a, b, out=out)  # noqa: E731
        reps = 1
        while timed(f, reps) < block:  # warm-up, doubling until a block lasts long enough
            reps *= 2
        return 2 * m * k * n * reps / min(timed(f, reps) for _ in range(5))

    block = seconds / 5 / len(shapes)
    best = max(throughput(*s) for s in shapes)
    if cuda:
        torch.cuda.empty_cache()
    PEAKS[key] = best
    return best


def compile_metrics(metrics, dt):
    """The metrics of a compiled run's first step, which compiled the forward and the backward
    (tens of seconds on a GPU): its wall time is the compiler's, so its step time, phase times,
    throughput and MFU are replaced by time/compile (ms), and no reported step time includes it."""
    timed = ("time/", "share/", "tokens_per_sec", "mfu")
    return {**{k: v for k, v in metrics.items() if not k.startswith(timed)},
            "time/compile": 1000 * dt}


def clock(d):
    """Wall time; on CUDA it first waits for the queued kernels, so each phase is charged its own
    time."""
    if d.device.type == "cuda":
        torch.cuda.synchronize(d.device)
    return time.perf_counter()


def lap(times, phase, d):
    """Charge the time since the previous lap to times["time/" + phase] (ms); times["t"] is that
    lap."""
    now = clock(d)
    times[f"time/{phase}"] = times.get(f"time/{phase}", 0.0) + 1000 * (now - times["t"])
    times["t"] = now


def adamw(model, lr, weight_decay):
    """AdamW with weight decay on the weight matrices only, not on biases, LayerNorm gains or the
    position table (GPT-2 / nanoGPT). fused: one kernel for all tensors instead of a loop of small
    ones."""
    wpe = model.transformer.wpe.weight
    decay = [p for p in model.parameters() if p.dim() >= 2 and p is not wpe]
    rest = [p for p in model.parameters() if not any(p is q for q in decay)]
    groups = [{"params": decay, "weight_decay": weight_decay},
              {"params": rest, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95), fused=True)


def sha256(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def input_fingerprint(files, examples):
    """What a run's weights are trained from, saved in its checkpoints for resume to check:
    {"<flag> <path>": sha256 of the file} for each of `files` ({flag: path}; "" = not used), and
    "token ids": the sha256 of the tokenized training examples (JSON-able), which also changes
    when the code of the tokenizer or of the truncation does (the reference cache's catch-all)."""
    fp = {f"{flag} {path}": sha256(path) for flag, path in files.items() if path}
    fp["token ids"] = hashlib.sha256(json.dumps(examples).encode()).hexdigest()
    return fp


def resume(ckpt_dir, cfg, parts, device, log, inputs,
           free=("resume", "stop_after", "fsdp")):
    """Continue from ckpt_dir when it holds a run of this same config (the fields in `free` may
    differ) and of the same inputs (`inputs`, from input_fingerprint, which the stage saves in each
    checkpoint's state as "inputs"): fills `parts` and returns (step, state). Anything else stops
    the run and names what differs, rather than silently mixing two runs (a π_ref retrained, a data
    file edited since the checkpoint). (0, {}) with no checkpoint or with --no-resume."""
    # our writes are atomic, but a file damaged or edited outside this code is one error line too
    damaged = (f"{ckpt_dir} holds a checkpoint that cannot be read ({{}}); pass --no-resume to "
               "start over, or another --out_dir")
    try:
        saved = checkpoint_state(ckpt_dir) if cfg.resume else None
    except Exception as e:
        raise SystemExit("error: " + damaged.format(e)) from None
    if saved is None:
        return 0, {}
    ours = {k: v for k, v in dataclasses.asdict(cfg).items() if k not in free}
    old = saved["config"]
    diff = [f"{k} {old.get(k)} -> {v}" for k, v in ours.items() if old.get(k) != v]
    check(not diff, f"{ckpt_dir} holds a run with another config ({', '.join(diff)}); "
          f"pass --no-resume to start over, or another --out_dir")
    check("inputs" in saved, f"{ckpt_dir} records no fingerprint of its inputs (an older version "
          "wrote it); pass --no-resume to start over, or another --out_dir")
    old = saved["inputs"]
    changed = [k for k in {**old, **inputs} if old.get(k) != inputs.get(k)]
    # the token ids change with any data file or tokenizer: named only when nothing else says why
    changed = [k for k in changed if k != "token ids" or len(changed) == 1]
    sha = lambda fp, k: fp[k][:12] if k in fp else "none"  # noqa: E731
    changed = ["the token ids of the training data (tokenizer, truncation or data code)"
               if k == "token ids" else f"{k} (sha256 {sha(old, k)} -> {sha(inputs, k)})"
               for k in changed]
    check(not changed, f"{ckpt_dir} holds a run trained from other inputs, changed since: "
          f"{'; '.join(changed)}. Pass --no-resume to start over from these inputs, or another "
          "--out_dir (or put the old files back to resume)")
    try:
        step, state = load_checkpoint(ckpt_dir, parts, device)
    except Exception as e:
        raise SystemExit("error: " + damaged.format(e)) from None
    log(f"resuming from {ckpt_dir} at step {step}")
    return step, state
