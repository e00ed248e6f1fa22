"""Everything a stage writes, and the refusals that keep it honest: output folders proved writable
before any work, atomic writes (a temp file, then a rename: never half a file), resumable
checkpoints in safetensors + JSON that any world size resumes, with or without --fsdp, fingerprints
of a run's inputs and of the reference log-prob cache, and the stale refusal that names what
changed. No pickle anywhere: tensors in safetensors, everything else in JSON.
"""
import dataclasses
import hashlib
import json
import math
import os
import re
import shutil
import tempfile

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save
from tokenizers import Tokenizer
from torch.distributed.tensor import DTensor, distribute_tensor

from plumbing import (atomic_write_text, barrier, check, lock_folder, main_decides, precision,
                      written)
from model import read_meta, save_model

# -----------------------------------------------------------------------------
# output folders and atomic writes


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
    root on a read-only mount); then the temp files a killed run left there are removed. The first
    folder, the run's own, is locked until the run's teardown (plumbing.lock_folder). Rank 0, the
    writer, looks and locks; every rank stops alike."""
    msg = None
    for n, (folder, flag) in enumerate(folders.items() if d.is_main else ()):
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
        msg = lock_folder(folder, flag, d) if n == 0 else None
        if msg:
            break
        remove_stale_temp_files(folder, log)
    if not main_decides(msg is None, d):
        raise SystemExit(f"error: {msg}" if d.is_main else 1)


def atomic_write_json(path, obj):
    atomic_write_text(path, json.dumps(obj, indent=1))


def atomic_copy(src, dst):
    """src's bytes to dst, through a temp file and a rename, as atomic_write_text."""
    with written(dst):
        shutil.copyfile(src, dst + ".tmp")
        os.replace(dst + ".tmp", dst)


# --fsdp: whole tensors from shards, and shards from whole tensors


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


def save_safetensors(tensors, path, metadata):
    """safetensors bytes to path + ".tmp", then renamed into place. Written by open(), as
    model.save_model does: the file gets the mode the umask gives (save_file's own temp file is
    0600), and a full disk is an OSError that `written` reports (save_file raises its own error
    type, which names its hidden temp file instead)."""
    with written(path):
        with open(path + ".tmp", "wb") as f:
            f.write(save(tensors, metadata=metadata))
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


def check_step(loss, grad_norm, first_loss, where, ckpt_dir, hint):
    """The guard of every trainer of a loss (sft, reward, dpo, online DPO), before its optimizer
    step: a non-finite loss or grad norm, or a loss above DIVERGED x the run's first one, stops the
    run before the update, keeping the last good checkpoint. where: "step 12", "round 3". Returns
    the first loss (this one, at a run's first step), which the checkpoint keeps across resumes."""
    stop_if_not_finite({"loss": loss, "grad_norm": grad_norm}, where, ckpt_dir, hint)
    first_loss = loss if first_loss is None else first_loss
    stop_if_diverged("loss", loss, DIVERGED * first_loss, f"{DIVERGED}x the first "
                     f"{where.split()[0]}'s {first_loss:.4g}", where, ckpt_dir, hint)
    return first_loss


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


def tokenizer_beside(model_path, flag="--ref_model"):
    """The tokenizer.json every stage keeps beside its model.safetensors; flag picked the model."""
    path = os.path.join(os.path.dirname(model_path), "tokenizer.json")
    check(os.path.exists(path), f"{path} does not exist: π_ref's tokenizer is read from the folder "
          f"of {flag}")
    return path


def require_same_tokenizer(model_path, flag, tok_path):
    """A model that reads the policy's token ids (r_φ) must have been trained on the same tokenizer
    as π_ref, or it reads them as other words; compared by content (tokenizer_sha256)."""
    theirs = os.path.join(os.path.dirname(model_path), "tokenizer.json")
    check(os.path.exists(theirs), f"{theirs} does not exist: {flag} {model_path} is checked to "
          "read π_ref's tokenizer by the tokenizer.json beside it, which reward.py writes there; "
          "run reward.py again")
    check(tokenizer_sha256(theirs) == tokenizer_sha256(tok_path),
          f"{flag} {model_path} was trained with another tokenizer ({theirs}) than π_ref's "
          f"({tok_path}): it would read the policy's token ids as other words. Train it from "
          f"this π_ref (python reward.py --sft ...), or pick the π_ref it was trained from")


def require_reward_model(path, flag, tok_path):
    """An r_φ (`flag` picks it) must be one: a file saved with a scalar head, as reward.py saves
    it (GPTConfig head "scalar", its score.weight and score.bias). A language model's file (sft.py
    or dpo.py output, head "lm") would load under a fresh scalar head, zero by design (model.GPT),
    so it would score every completion exactly 0. It must also read π_ref's token ids."""
    try:
        cfg, meta = read_meta(path)
    except (ValueError, SafetensorError) as e:
        raise SystemExit(f"error: {flag} {path} is not a model file of this project ({e})")
    check(cfg.head == "scalar", f"{flag} {path} is not a reward model: it is a language model "
          f"(head {cfg.head!r}, stage {meta.get('stage', '?')!r}), under which a fresh "
          "scalar head would start at zero and score every completion 0. Pass reward.py's "
          "model.safetensors (python reward.py writes out/reward/model.safetensors)")
    require_same_tokenizer(path, flag, tok_path)


def save_outputs(model, out_dir, meta, result, d, tokenizer=None):
    """A training stage's outputs (docs/DESIGN.md, "Contracts between stages"): model.safetensors
    with `meta` in its metadata, a copy of `tokenizer` beside it, and eval.json (`result`). Every
    rank calls it: under --fsdp the weights are gathered from the shards; rank 0 writes each file
    whole or not at all, and every rank returns once they are on disk (a later stage may read them
    next)."""
    weights = full_state(model, d.is_main)
    if d.is_main:
        with written(os.path.join(out_dir, "model.safetensors")):
            save_model(model, os.path.join(out_dir, "model.safetensors"), meta, weights)
        if tokenizer:
            atomic_copy(tokenizer, os.path.join(out_dir, "tokenizer.json"))
        atomic_write_json(os.path.join(out_dir, "eval.json"), result)
    barrier(d)


# -----------------------------------------------------------------------------
# fingerprints and resume


def sha256(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def tokenizer_sha256(path):
    """The sha256 of what a tokenizer.json means, not of its bytes: of the tokenizers library's
    own serialisation of it, so the same tokenizer written compact or indented is one tokenizer."""
    return hashlib.sha256(Tokenizer.from_file(path).to_str().encode()).hexdigest()


def input_fingerprint(files, examples):
    """What a run's weights are trained from, saved in its checkpoints for resume to check:
    {"<flag> <path>": sha256 of the file} for each of `files` ({flag: path}; "" = not used; a
    tokenizer's by tokenizer_sha256), and
    "token ids": the sha256 of the tokenized training examples (JSON-able), which also changes
    when the code of the tokenizer or of the truncation does (the reference cache's catch-all)."""
    fp = {f"{flag} {path}": (tokenizer_sha256 if "tokenizer" in flag else sha256)(path)
          for flag, path in files.items() if path}
    fp["token ids"] = hashlib.sha256(json.dumps(examples).encode()).hexdigest()
    return fp


def same_run(where, saved, cfg, inputs, free):
    """Stop unless `saved` (the state a run recorded in `where`: its "config" and its "inputs",
    from input_fingerprint) is a run of cfg's config (the fields in `free` may differ) and of the
    same `inputs`, naming what differs, rather than silently mixing two runs (a π_ref retrained, a
    data file edited since). Called before the run writes anything, so a refused run changes
    nothing of the one it would have continued."""
    ours = {k: v for k, v in dataclasses.asdict(cfg).items() if k not in free}
    old = saved["config"]
    diff = [f"{k} {old.get(k)} -> {v}" for k, v in ours.items() if old.get(k) != v]
    check(not diff, f"{where} holds a run with another config ({', '.join(diff)}); "
          f"pass --no-resume to start over, or another --out_dir")
    check("inputs" in saved, f"{where} records no fingerprint of its inputs (an older version "
          "wrote it); pass --no-resume to start over, or another --out_dir")
    old = saved["inputs"]
    changed = [k for k in {**old, **inputs} if old.get(k) != inputs.get(k)]
    # the token ids change with any data file or tokenizer: named only when nothing else says why
    changed = [k for k in changed if k != "token ids" or len(changed) == 1]
    sha = lambda fp, k: fp[k][:12] if k in fp else "none"  # noqa: E731
    changed = ["the token ids of the training data (tokenizer, truncation or data code)"
               if k == "token ids" else f"{k} (sha256 {sha(old, k)} -> {sha(inputs, k)})"
               for k in changed]
    check(not changed, f"{where} holds a run trained from other inputs, changed since: "
          f"{'; '.join(changed)}. Pass --no-resume to start over from these inputs, or another "
          "--out_dir (or put the old files back to resume)")


def damaged(ckpt_dir, e):
    # our writes are atomic, but a file damaged or edited outside this code is one error line too
    return SystemExit(f"error: {ckpt_dir} holds a checkpoint that cannot be read ({e}); pass "
                      "--no-resume to start over, or another --out_dir")


def resumable(ckpt_dir, cfg, inputs, free=("resume", "stop_after", "fsdp")):
    """The state of ckpt_dir's checkpoint when this run continues it (same_run stops a run of
    another config or other inputs); None with no checkpoint or with --no-resume. A stage that
    writes anything before it resumes (dpo.py building a missing cache) asks this first."""
    try:
        saved = checkpoint_state(ckpt_dir) if cfg.resume else None
    except Exception as e:
        raise damaged(ckpt_dir, e) from None
    if saved is not None:
        same_run(ckpt_dir, saved, cfg, inputs, free)
    return saved


def resume(ckpt_dir, cfg, parts, device, log, inputs,
           free=("resume", "stop_after", "fsdp")):
    """Continue from ckpt_dir when it holds a run of this same config and inputs (resumable):
    fills `parts` and returns (step, state). (0, {}) with no checkpoint or with --no-resume."""
    if resumable(ckpt_dir, cfg, inputs, free) is None:
        return 0, {}
    try:
        step, state = load_checkpoint(ckpt_dir, parts, device)
    except Exception as e:
        raise damaged(ckpt_dir, e) from None
    log(f"resuming from {ckpt_dir} at step {step}")
    return step, state


# -----------------------------------------------------------------------------
# the reference log-prob cache (precompute.py writes it, dpo.py reads it)

# What the numbers depend on beyond the files and the flags. Whoever changes the truncation rule in
# data.tokenize_pairs or the reduction below changes these strings, and every old cache becomes
# stale.
TRUNCATION = ("data.tokenize_pairs v1: prompt keeps BOS + its last tokens (>= max_prompt_len), "
              "responses their first")
REDUCTION = "sum over response tokens of model.token_logprobs (fp32 log-softmax, temperature 1)"
# the code that turns weights into log-probs
MODEL_CODE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "model.py")
CHANGED = {"ref_model_sha256": "the reference weights", "tokenizer_content_sha256": "the tokenizer",
           "pairs_sha256": "the pairs file", "max_len": "--max_len",
           "max_prompt_len": "--max_prompt_len", "truncation": "the truncation rule",
           "reduction": "the log-prob reduction",
           "tokens_sha256": "the token ids (tokenizer, truncation or data code)",
           "model_code_sha256": "model.py", "precision": "the precision",
           "device": "the device type"}
def fingerprint(cfg, split, examples, device):
    """Everything that determines the cached numbers of `split` ("train" or "val"): a list
    that names what changed, and two exact checks whatever the cause: the hash of the token
    ids fed to π_ref (examples from data.tokenize_pairs) and of the code that turns weights into
    log-probs. And the precision and device type the numbers were computed in: bf16 log-probs
    differ from fp32 ones by 0.001 nats per response (max 0.006), enough that a bf16 policy at
    step 0 would not equal π_ref (on the task: reward accuracy 0.42 at step 1 instead of 0)."""
    pairs = cfg.train_pairs if split == "train" else cfg.val_pairs
    ids = hashlib.sha256(json.dumps([[e["index"], e["prompt"], e["chosen"], e["rejected"]]
                                     for e in examples]).encode())
    return {"ref_model_sha256": sha256(cfg.ref_model),
            "tokenizer_content_sha256": tokenizer_sha256(tokenizer_beside(cfg.ref_model)),
            "pairs_sha256": sha256(pairs), "max_len": cfg.max_len,
            "max_prompt_len": cfg.max_prompt_len, "truncation": TRUNCATION, "reduction": REDUCTION,
            "tokens_sha256": ids.hexdigest(), "model_code_sha256": sha256(MODEL_CODE),
            "precision": precision(device), "device": device.type}


def save_ref_logps(path, logps, fp, stats, cost):
    """safetensors {"chosen": (N,), "rejected": (N,)} + JSON metadata; tmp file, then rename."""
    save_safetensors({"chosen": logps[0].contiguous(), "rejected": logps[1].contiguous()}, path,
                     {"fingerprint": json.dumps(fp), "stats": json.dumps(stats),
                      "cost": json.dumps(cost)})


def load_ref_logps(path, cfg, split, examples, device, rebuild):
    """(2, N) fp32 [chosen; rejected] from a cache file, after checking that it was computed from
    the inputs in cfg (a precompute Config), on this type of device in its precision, and covers
    every example; anything else stops the run and says what changed and how to rebuild."""
    try:  # written atomically here; damaged or edited outside this code: one error line
        with safe_open(path, "pt") as f:
            found = json.loads((f.metadata() or {}).get("fingerprint", "{}"))
        t = load_file(path)
    except Exception as e:
        raise SystemExit(f"error: {path} cannot be read ({e}); rebuild it with: "
                         f"{rebuild}") from None
    want = fingerprint(cfg, split, examples, device)
    short = lambda v: v[:12] if isinstance(v, str) and len(v) == 64 else v  # noqa: E731
    changed = [k for k, v in want.items() if found.get(k) != v]
    # the catch-all: only if nothing else says
    changed = [k for k in changed if k != "tokens_sha256" or len(changed) == 1]
    changed = [f"{CHANGED.get(k, k)} ({short(found[k])} -> {short(want[k])})" if k in found else
               f"{CHANGED.get(k, k)} (not recorded: an older version wrote this cache)"
               for k in changed]
    check(not changed, f"{path} is stale, computed for other inputs: {'; '.join(changed)}. "
          f"Rebuild it with: {rebuild}")
    logps = torch.stack([t["chosen"], t["rejected"]])
    left = [e["index"] for e in examples if not torch.isfinite(logps[:, e["index"]]).all()]
    check(not left, f"{path} has no values for {len(left)} examples (e.g. rows {left[:5]}); "
          f"rebuild: {rebuild}")
    return logps
