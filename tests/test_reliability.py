"""A run that goes wrong stops and says why, and what it leaves can be trusted: a non-finite or
divergent run stops before the bad update and keeps its last good checkpoint; a resume refuses a
checkpoint or a cache whose inputs changed, naming them; writes are atomic under a kill or a full
disk, one run to a folder; a hung run is killed whole, a rank left in a collective fails fast,
and a frozen rank ends the job in minutes, named.

    pytest tests/test_reliability.py
"""
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import asdict, replace

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

import checkpoint
import dpo
import grpo
import iterative_dpo
import online_dpo
import plumbing
import ppo
import precompute
import reward
import sft
from model import GPT, GPTConfig, load_model, save_model
from tests.helpers import (CPU, ROOT, dpo_cfg, dpo_metrics, dpo_pcfg, iterative_cfg, run_torchrun,
                           run_whole, sft_args, tiny_ppo_config, tiny_reward_config, torchrun,
                           torchrun_env)


# ==================================================================================================
# non-finite and divergent runs (checkpoint.py, every trainer)
# ==================================================================================================

def own_ref(tiny, folder, edit=None):
    """A copy of the tiny π_ref (model.safetensors + tokenizer.json) in `folder`, its weights
    changed in place by edit(model) if given; returns the model file's path."""
    os.makedirs(folder, exist_ok=True)
    shutil.copyfile(f"{tiny.sft}/tokenizer.json", os.path.join(folder, "tokenizer.json"))
    model, meta = load_model(f"{tiny.sft}/model.safetensors")
    if edit is not None:
        with torch.no_grad():
            edit(model)
    save_model(model, os.path.join(folder, "model.safetensors"), meta)
    return os.path.join(folder, "model.safetensors")


def test_guards_stop_and_a_non_finite_checkpoint_is_never_written(tmp_path):
    ckpt = str(tmp_path)
    checkpoint.stop_if_diverged("loss", 69.0, 69.3, "100x the first", "step 2", ckpt, "")
    with pytest.raises(SystemExit, match=r"diverged: loss 70 at step 2 is above 69.3 \(100x the "
                                         r"first\).*last checkpoint is kept: none.*lower --lr"):
        checkpoint.stop_if_diverged("loss", 70.0, 69.3, "100x the first", "step 2", ckpt,
                                    "Try a lower --lr.")
    net = torch.nn.Linear(3, 2)
    checkpoint.save_checkpoint(ckpt, 1, {"model": net}, {})
    with torch.no_grad():
        net.bias[1] = float("inf")
    with pytest.raises(SystemExit, match=r"non-finite values in model/bias at step 2: not saved.*"
                                         r"kept: .* at step 1"):
        checkpoint.save_checkpoint(ckpt, 2, {"model": net}, {})
    assert checkpoint.checkpoint_state(ckpt)["step"] == 1
    assert sorted(os.listdir(ckpt)) == ["latest.json", "step-0000001.safetensors"]


def test_sft_and_reward_stop_before_a_non_finite_update(tiny, dpo_cache, tmp_path):
    # lr 1e30: step 1's update leaves finite but enormous weights, whose step-2 loss or gradient is
    # not finite. The guard stops before step 2's update: step 1's checkpoint stays, and no
    # non-finite tensor is written.
    with pytest.raises(SystemExit, match=r"non-finite loss \(nan\).* at step 2: stopped before "):
        sft.main(sft.Config(**{**sft_args(tiny, tmp_path / "sft", steps=4, lr=1e30),
                               "ckpt_every": 1}))
    with pytest.raises(SystemExit, match=r"non-finite .* at step 2: stopped before the update"):
        reward.main(tiny_reward_config(tiny, tmp_path / "reward", steps=4, lr=1e30, warmup=1,
                                       ckpt_every=1))
    for stage in ("sft", "reward"):
        assert checkpoint.checkpoint_state(str(tmp_path / stage / "ckpt"))["step"] == 1
        ckpt = load_file(str(tmp_path / stage / "ckpt" / "step-0000001.safetensors"))
        assert all(torch.isfinite(v).all() for v in ckpt.values())
        assert not os.path.exists(tmp_path / stage / "model.safetensors")


def test_non_finite_loss_stops_and_keeps_the_last_checkpoint(tiny, dpo_cache):
    # step 1 blows the weights up; step 2's loss is NaN
    cfg = dpo_cfg(tiny, "dpo-nan", lr=1e30, ckpt_every=1)
    with pytest.raises(SystemExit, match="non-finite loss.*step 2.*last good checkpoint is kept"):
        dpo.main(cfg)
    with open(os.path.join(cfg.out_dir, "ckpt", "latest.json")) as f:
        assert json.load(f)["step"] == 1


def test_ppo_stops_on_non_finite(tiny, tiny_rm, tmp_path):
    prompts = tmp_path / "eval.jsonl"
    prompts.write_text(json.dumps({"prompt": "the movie is"}) + "\n")
    cfg = tiny_ppo_config(tiny, str(tiny_rm / "model.safetensors"), tmp_path / "ppo", str(prompts),
                          lr=1e30)
    with pytest.raises(SystemExit, match=r"non-finite grad_norm \(nan\) at iteration 1 .* "
                                         r"the last good checkpoint is kept: none"):
        ppo.main(cfg)
    assert not os.path.exists(tmp_path / "ppo" / "model.safetensors")


def test_a_non_finite_reference_is_named_as_the_cause(tiny, dpo_cache, tmp_path):
    pairs = str(tmp_path / "pairs.jsonl")
    shutil.copyfile(f"{tiny.task}/pairs_val.jsonl", pairs)
    nan = lambda m: m.transformer.h[0].mlp.c_fc.weight.fill_(float("nan"))  # noqa: E731
    nan_ref = own_ref(tiny, tmp_path / "nan", nan)
    pc = precompute.Config(out_dir=str(tmp_path / "cache"), ref_model=nan_ref, train_pairs=pairs,
                           val_pairs=pairs)
    says = "nan/model.safetensors holds non-finite weights .* retrain it"
    with pytest.raises(SystemExit, match=says):  # not "N examples have no reference log-probs"
        precompute.main(pc)
    with pytest.raises(SystemExit, match=says):  # not "Try a lower --lr"
        dpo.main(dpo_cfg(tiny, "unused", out_dir=str(tmp_path / "dpo"), ref_model=nan_ref,
                         train_pairs=pairs, val_pairs=pairs, ref="live"))
    with pytest.raises(SystemExit, match=says):  # how ppo.py loads π_ref and r_φ, reward.py π_ref
        load_model(nan_ref, "cpu", head="scalar")
    # finite weights whose logits overflow: the log-probs are named, not a missing cache row
    big = lambda m: m.transformer.ln_f.weight.fill_(1e38)  # noqa: E731
    pc = replace(pc, ref_model=own_ref(tiny, tmp_path / "big", big))
    with pytest.raises(SystemExit, match=r"π_ref gives non-finite log-probs for \d+ examples"):
        precompute.main(pc)


def test_finite_divergence_stops_every_trainer(tiny, dpo_cache, tiny_rm, tmp_path):
    # dpo.py --lr 30, as in the issue: the loss goes from log 2 to ~3e4 at step 2, all finite
    cfg = dpo_cfg(tiny, "dpo-diverged", lr=30.0)
    with pytest.raises(SystemExit, match=r"diverged: loss .* at step 2 is above 6.931 \(10x the "
                                         r"first step's 0.6931\)"):
        dpo.main(cfg)
    assert not os.path.exists(os.path.join(cfg.out_dir, "model.safetensors"))
    with pytest.raises(SystemExit, match=r"diverged: loss .* at step \d is above .* \(10x the "):
        sft.main(sft.Config(**sft_args(tiny, tmp_path / "sft", steps=6, lr=30.0)))
    with pytest.raises(SystemExit, match=r"diverged: loss .* at step \d is above 6.931 \(10x "):
        reward.main(tiny_reward_config(tiny, tmp_path / "reward", steps=6, lr=30.0, warmup=1))
    prompts = tmp_path / "eval.jsonl"
    prompts.write_text(json.dumps({"prompt": "the movie is"}) + "\n")
    cfg = tiny_ppo_config(tiny, str(tiny_rm / "model.safetensors"), tmp_path / "ppo", str(prompts),
                          lr=1.0)
    with pytest.raises(SystemExit, match=r"diverged: approx_kl .* at iteration 1 is above 1 \("):
        ppo.main(cfg)
    assert not os.path.exists(tmp_path / "ppo" / "ckpt" / "latest.json")
    # online DPO --lr 1e3: after one step π never ends, every pair ties, the loss is 0 from then on
    # and never crosses its bound
    cfg = online_dpo.Config(out_dir=str(tmp_path / "online"), sft=f"{tiny.sft}/model.safetensors",
                            reward="true", prompts=f"{tiny.task}/prompts_train.jsonl",
                            test_prompts=str(prompts), rollout_batch=8, micro_batch_size=4,
                            iterations=4, warmup=0, lr=1e3, eval_k=1)
    with pytest.raises(SystemExit, match=r"collapsed: every pair of round 2 tied \(the policy no "):
        online_dpo.main(cfg)
    assert not os.path.exists(tmp_path / "online" / "model.safetensors")


# ==================================================================================================
# resume: only from a checkpoint or a cache of the same inputs (checkpoint.py, precompute.py)
# ==================================================================================================

def test_checkpoint_round_trip_and_a_crash_keeps_the_previous_one(tmp_path):
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
    net[1].weight = torch.nn.Parameter(net[1].weight)  # a plain module
    opt = torch.optim.AdamW(net.parameters(), lr=0.1)
    net(torch.randn(3, 4)).sum().backward()
    opt.step()
    checkpoint.save_checkpoint(str(tmp_path), 7,
                               {"model": net, "optim": opt, "gen": torch.arange(3)}, {"a": 1})
    net2 = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
    opt2 = torch.optim.AdamW(net2.parameters(), lr=0.1)
    step, state = checkpoint.load_checkpoint(str(tmp_path),
                                             {"model": net2, "optim": opt2, "gen": torch.zeros(3)},
                                             "cpu")
    assert step == 7 and state["a"] == 1 and torch.equal(state["tensors"]["gen"], torch.arange(3))
    for p, q in zip(net.parameters(), net2.parameters()):
        assert torch.equal(p, q)
    for s, t in zip(opt.state.values(), opt2.state.values()):
        assert all(torch.equal(torch.as_tensor(s[k]), torch.as_tensor(t[k])) for k in s)
    # a writer that died before renaming leaves only a .tmp: the checkpoint on record is unchanged
    (tmp_path / "step-0000008.safetensors.tmp").write_bytes(b"half")
    assert checkpoint.checkpoint_state(str(tmp_path))["step"] == 7


def test_sft_refuses_to_resume_a_different_config(tiny, tmp_path):
    sft.main(sft.Config(**sft_args(tiny, tmp_path, steps=4, stop_after=2)))
    with pytest.raises(SystemExit, match=r"another config \(lr 0.003 -> 0.001\)"):
        sft.main(sft.Config(**sft_args(tiny, tmp_path, steps=4, lr=0.001)))


def test_resume_refuses_a_checkpoint_of_other_inputs_and_names_them(tiny, tmp_path):
    ckpt, cfg, net = str(tmp_path), sft.Config(out_dir=str(tmp_path)), torch.nn.Linear(2, 2)
    a, b = tmp_path / "a.txt", tmp_path / "b.tokenizer.json"
    a.write_text("one\n"), shutil.copyfile(f"{tiny.task}/tokenizer.json", b)
    files = {"--train_text": str(a), "--tokenizer": str(b), "--init_from": ""}
    inputs = checkpoint.input_fingerprint(files, [[1, 2]])
    assert set(inputs) == {f"--train_text {a}", f"--tokenizer {b}", "token ids"}  # "": unused
    checkpoint.save_checkpoint(ckpt, 3, {"model": net}, {"config": asdict(cfg), "inputs": inputs})
    assert checkpoint.resume(ckpt, cfg, {"model": net}, "cpu", print, inputs)[0] == 3
    # the same tokenizer written compact: the same inputs
    b.write_text(json.dumps(json.loads(b.read_text()), separators=(",", ":")))
    assert checkpoint.input_fingerprint(files, [[1, 2]]) == inputs
    a.write_text("one, edited\n")  # the data file changed: named with its sha256, and what to do
    changed = checkpoint.input_fingerprint(files, [[1, 3]])
    with pytest.raises(SystemExit, match=rf"other inputs, changed since: --train_text {a} \(sha256 "
                                         r"[0-9a-f]{12} -> [0-9a-f]{12}\)\. Pass --no-resume .* "
                                         r"another --out_dir"):
        checkpoint.resume(ckpt, cfg, {"model": net}, "cpu", print, changed)
    # the same files, other token ids (the truncation code changed): the catch-all says so
    with pytest.raises(SystemExit, match=r"changed since: the token ids of the training data"):
        checkpoint.resume(ckpt, cfg, {"model": net}, "cpu", print,
                          {**inputs, "token ids": "0" * 64})
    no = replace(cfg, resume=False)
    assert checkpoint.resume(ckpt, no, {"model": net}, "cpu", print, changed) == (0, {})
    # an older version's
    checkpoint.save_checkpoint(ckpt, 4, {"model": net}, {"config": asdict(cfg)})
    with pytest.raises(SystemExit, match="records no fingerprint of its inputs"):
        checkpoint.resume(ckpt, cfg, {"model": net}, "cpu", print, inputs)
    # files damaged outside this code (its own writes are atomic): one error line, no traceback
    step = tmp_path / "step-0000004.safetensors"
    step.write_bytes(step.read_bytes()[:100])
    (tmp_path / "latest.json").write_text("{garbage")
    for damaged in ("latest.json", "step-0000004.safetensors"):
        with pytest.raises(SystemExit, match=r"holds a checkpoint that cannot be read \(.*\); pass "
                                             "--no-resume"):
            checkpoint.resume(ckpt, cfg, {"model": net}, "cpu", print, inputs)
        (tmp_path / "latest.json").write_text(json.dumps({"file": step.name, "step": 4}))
    checkpoint.save_checkpoint(ckpt, 5, {"model": net}, {})  # --no-resume writes over a damaged one
    assert sorted(os.listdir(ckpt))[-2:] == ["latest.json", "step-0000005.safetensors"]


def test_dpo_refuses_to_resume_after_its_inputs_changed(tiny, dpo_cache, tmp_path):
    # the runs: stop after 1 step; retrain π_ref and rebuild the cache (then also shrink
    # the pairs file and rebuild), and run again: the checkpoint's policy started from the old ones
    ref = own_ref(tiny, tmp_path / "ref")
    rows = open(f"{tiny.root}/dpo-data/pairs_train.jsonl").readlines()[:64]
    (tmp_path / "pairs.jsonl").write_text("".join(rows))
    pc = precompute.Config(out_dir=str(tmp_path / "cache"), ref_model=ref,
                           train_pairs=str(tmp_path / "pairs.jsonl"),
                           val_pairs=str(tmp_path / "pairs.jsonl"))
    precompute.main(pc)
    cfg = dpo_cfg(tiny, "unused", out_dir=str(tmp_path / "dpo"), ref_model=ref,
                  train_pairs=pc.train_pairs, val_pairs=pc.val_pairs, ref_logps=pc.out_dir, steps=2,
                  stop_after=1)
    dpo.main(cfg)
    own_ref(tiny, tmp_path / "ref", lambda m: m.transformer.ln_f.bias.add_(0.01))  # "retrained"
    precompute.main(pc)
    with pytest.raises(SystemExit, match=r"other inputs, changed since: --ref_model .*ref/model."
                                         r"safetensors \(sha256 .*\)\. Pass --no-resume"):
        dpo.main(cfg)
    (tmp_path / "pairs.jsonl").write_text("".join(rows[:32]))  # the pairs file shrank
    precompute.main(pc)
    with pytest.raises(SystemExit, match=r"--ref_model .*; --train_pairs .*pairs.jsonl \(sha256"):
        dpo.main(cfg)
    dpo.main(replace(cfg, resume=False))  # what the message says to do
    assert [m["step"] for m in dpo_metrics(cfg.out_dir)] == [1]
    cache = tmp_path / "cache" / "train.safetensors"  # damaged outside this code
    cache.write_bytes(cache.read_bytes()[:100])
    with pytest.raises(SystemExit, match=r"train.safetensors cannot be read \(.*\); rebuild it "
                                         "with: python precompute.py --out_dir"):
        dpo.main(cfg)


def test_ppo_refuses_to_resume_after_its_prompts_changed(tiny, tiny_rm, tmp_path):
    lines = open(f"{tiny.task}/prompts_train.jsonl").readlines()[:32]
    (tmp_path / "prompts.jsonl").write_text("".join(lines))
    cfg = replace(tiny_ppo_config(tiny, str(tiny_rm / "model.safetensors"), tmp_path / "ppo",
                                  str(tmp_path / "prompts.jsonl"), stop_after=1),
                  prompts=str(tmp_path / "prompts.jsonl"))
    ppo.main(cfg)
    (tmp_path / "prompts.jsonl").write_text("".join(lines[:16]))
    with pytest.raises(SystemExit, match=r"changed since: --prompts .*prompts.jsonl \(sha256"):
        ppo.main(cfg)


def test_stale_cache_is_refused(tiny, dpo_cache):
    own = tiny.root / "dpo-stale"
    os.makedirs(own)
    for f in ("model.safetensors", "tokenizer.json"):
        shutil.copyfile(f"{tiny.sft}/{f}", own / f)
    rows = open(f"{tiny.task}/pairs_val.jsonl").readlines()[:16]
    (own / "pairs.jsonl").write_text("".join(rows))
    c = dpo_pcfg(tiny, out="dpo-stale/cache", pairs=str(own / "pairs.jsonl"),
                 ref_model=str(own / "model.safetensors"))
    precompute.main(c)
    cfg = dpo_cfg(tiny, "dpo-stale/run", ref_model=c.ref_model, train_pairs=c.train_pairs,
                  val_pairs=c.val_pairs, ref_logps=c.out_dir, steps=1)
    spec = json.loads((own / "tokenizer.json").read_text())  # the same tokenizer, written compact:
    (own / "tokenizer.json").write_text(json.dumps(spec, separators=(",", ":")))  # not stale
    dpo.main(replace(cfg, out_dir=str(tiny.root / "dpo-stale" / "compact")))
    (own / "pairs.jsonl").write_text("".join(rows[:15] + rows[:1]))  # the data file changed
    with pytest.raises(SystemExit, match="stale.*the pairs file.*python precompute.py --out_dir"):
        dpo.main(cfg)
    (own / "pairs.jsonl").write_text("".join(rows))
    model, meta = load_model(c.ref_model)
    with torch.no_grad():
        model.transformer.ln_f.bias += 0.01
    save_model(model, c.ref_model, meta)  # the reference weights changed
    with pytest.raises(SystemExit, match="stale.*the reference weights"):
        dpo.main(cfg)
    # a cache from a version whose fingerprint had another field: said so, not "it changed"
    path = os.path.join(c.out_dir, "train.safetensors")
    with safe_open(path, "pt") as f:
        meta = f.metadata()
    fp = json.loads(meta["fingerprint"])
    fp["tokenizer_sha256"] = fp.pop("tokenizer_content_sha256")
    checkpoint.save_safetensors(load_file(path), path, {**meta, "fingerprint": json.dumps(fp)})
    with pytest.raises(SystemExit, match=re.escape("the tokenizer (not recorded: an older version "
                                                   "wrote this cache)")):
        dpo.main(cfg)


# ==================================================================================================
# a refused resume changes nothing: the original command then finishes as if never interrupted
# (dpo.py, ppo.py, grpo.py, online_dpo.py, iterative_dpo.py)
# ==================================================================================================

def files_of(folder):
    """Every file under `folder` and its bytes, but the lock (it names the last process there)."""
    return {os.path.relpath(os.path.join(root, f), folder): open(os.path.join(root, f), "rb").read()
            for root, _, names in os.walk(folder) for f in names if f != ".lock"}


def refused_changes_nothing(main, cfg, says):
    """main(cfg), a changed config on a folder a run left, stops saying `says`, and leaves it so."""
    before = files_of(cfg.out_dir)
    with pytest.raises(SystemExit, match=says):
        main(cfg)
    assert files_of(cfg.out_dir) == before


def same_outputs(a, b):
    """Two runs' outputs bit for bit: the weights, and eval.json but for its wall-clock shares."""
    wa, wb = (load_file(os.path.join(x, "model.safetensors")) for x in (a, b))
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    ea, eb = ({k: v for k, v in json.loads(open(os.path.join(x, "eval.json")).read()).items()
               if k != "time_shares"} for x in (a, b))
    assert ea == eb


def four_test_prompts(tiny, tmp_path):
    path = tmp_path / "test_prompts.jsonl"
    path.write_text("".join(open(f"{tiny.task}/prompts_test.jsonl").readlines()[:4]))
    return str(path)


def test_dpo_refused_resume_changes_nothing(tiny, dpo_cache, tmp_path, monkeypatch):
    # --ref_logps at its default: the cache of other pairs is built when missing, here under
    # tmp_path/out/ref_logps; a refused run must not build one
    monkeypatch.chdir(tmp_path)
    rows = open(f"{tiny.root}/dpo-data/pairs_train.jsonl").readlines()
    (tmp_path / "a.jsonl").write_text("".join(rows[:32]))
    (tmp_path / "b.jsonl").write_text("".join(rows[32:64]))
    full = dpo_cfg(tiny, "unused", out_dir=str(tmp_path / "full"), ref_logps=dpo.Config.ref_logps,
                   train_pairs=str(tmp_path / "a.jsonl"), steps=2)
    part = replace(full, out_dir=str(tmp_path / "part"))
    dpo.main(full)
    dpo.main(replace(part, stop_after=1))
    caches = files_of("out/ref_logps")
    refused_changes_nothing(dpo.main, replace(part, lr=3e-3), r"another config \(lr 0.001 -> ")
    refused_changes_nothing(dpo.main, replace(part, train_pairs=str(tmp_path / "b.jsonl")),
                            r"another config \(train_pairs .*a.jsonl -> .*b.jsonl\)")
    assert files_of("out/ref_logps") == caches  # no cache built for b.jsonl
    dpo.main(part)
    same_outputs(full.out_dir, part.out_dir)


def test_ppo_refused_resume_changes_nothing(tiny, tiny_rm, ppo_test_prompts, tmp_path):
    rm = str(tiny_rm / "model.safetensors")
    full, part = (tiny_ppo_config(tiny, rm, tmp_path / n, ppo_test_prompts, reward="true",
                                  iterations=2) for n in ("full", "part"))
    ppo.main(full)
    ppo.main(replace(part, stop_after=1))
    refused_changes_nothing(ppo.main, replace(part, kl_coef=0.3), r"another config \(kl_coef ")
    ppo.main(part)
    same_outputs(full.out_dir, part.out_dir)


@pytest.mark.parametrize("stage, own, change, said", [
    (grpo, dict(group_size=4, mini_batch=4), dict(group_size=2), r"another config \(group_size"),
    (online_dpo, {}, dict(seed=7), r"another config \(seed 1337 ")], ids=["grpo", "online_dpo"])
def test_grpo_and_online_dpo_refused_resume_changes_nothing(stage, own, change, said, tiny,
                                                            tmp_path):
    test_prompts = four_test_prompts(tiny, tmp_path)
    full, part = (stage.Config(
        out_dir=str(tmp_path / n), sft=f"{tiny.sft}/model.safetensors", reward="true",
        reward_model="", prompts=f"{tiny.task}/prompts_train.jsonl", test_prompts=test_prompts,
        iterations=2, rollout_batch=8, micro_batch_size=4, eval_k=1, **own)
        for n in ("full", "part"))
    stage.main(full)
    stage.main(replace(part, stop_after=1))
    refused_changes_nothing(stage.main, replace(part, **change), said)
    stage.main(part)
    same_outputs(full.out_dir, part.out_dir)


def test_iterative_refused_resume_changes_nothing_and_more_rounds_reuse_the_done(
        tiny, dpo_cache, monkeypatch):
    full = iterative_cfg(tiny, "iterative-refused/full",
                         val_prompts=str(tiny.root / "dpo-data/prompts_val.jsonl"))
    part = replace(full, out_dir=str(tiny.root / "iterative-refused/part"), rounds=1)
    iterative_dpo.main(full)
    train = dpo.main

    def killed_after_a_step(c):  # the round's pairs, its cache and a checkpoint at step 1 left
        train(replace(c, stop_after=1))
        raise KeyboardInterrupt
    # 1 round, killed in it; then 2 rounds (only --rounds raised: round 1 done), killed in round 2.
    # After each kill another seed, or pairs of another size, is refused before a round's pairs
    # are sampled again, and the original command finishes as the uninterrupted run.
    for rounds in (1, 2):
        monkeypatch.setattr(dpo, "main", killed_after_a_step)
        with pytest.raises(KeyboardInterrupt):
            iterative_dpo.main(replace(part, rounds=rounds))
        monkeypatch.undo()
        assert checkpoint.checkpoint_state(f"{part.out_dir}/round{rounds}/dpo/ckpt")["step"] == 1
        for changed, says in ((dict(seed=7), "seed 1337 -> 7"), (dict(pairs=24), "pairs 32 -> 24")):
            refused_changes_nothing(iterative_dpo.main, replace(part, rounds=rounds, **changed),
                                    rf"rounds.json holds a run with another config \({says}\); "
                                    "pass --no-resume to start over, or another --out_dir")
        iterative_dpo.main(replace(part, rounds=rounds))
        if rounds == 1:
            one = json.load(open(f"{part.out_dir}/eval.json"))  # a 1-round run's, with its "val"
            assert "val" in one
            r1 = files_of(f"{part.out_dir}/round1")
    assert files_of(f"{part.out_dir}/round1") == r1  # round 1 not trained again
    same_outputs(full.out_dir, part.out_dir)
    for f in ("round1/pairs.jsonl", "round2/pairs.jsonl"):
        assert open(f"{full.out_dir}/{f}").read() == open(f"{part.out_dir}/{f}").read(), f
    # back to 1 round: round 1 again, evaluated on the validation prompts as the last round now
    # (it was not in the 2-round run), with the same weights and no step trained: the 1-round run
    steps = open(f"{full.out_dir}/round1/dpo/metrics.jsonl").read()
    iterative_dpo.main(replace(full, rounds=1))
    assert open(f"{full.out_dir}/round1/dpo/metrics.jsonl").read() == steps
    assert json.load(open(f"{full.out_dir}/eval.json")) == one
    # --no-resume starts over: the rounds of the run the folder held are removed, none left to be
    # taken for the new run's
    iterative_dpo.main(replace(part, rounds=1, seed=7, resume=False))
    assert not os.path.exists(f"{part.out_dir}/round2")
    assert json.load(open(f"{part.out_dir}/rounds.json"))["config"]["seed"] == 7


# ==================================================================================================
# writes: atomic under kills and full disks, one run to a folder (plumbing.py, checkpoint.py)
# ==================================================================================================

def test_the_metrics_rewrite_at_resume_is_atomic(tmp_path, monkeypatch):
    lines = "".join(json.dumps({"step": s, "loss": 1.0 / s}) + "\n" for s in (1, 2, 3))
    (tmp_path / "metrics.jsonl").write_text(lines)

    class Killed(Exception):
        pass

    def open_then_die(path, mode="r", **kw):  # a kill after open(path, "w"), before any write
        f = open(path, mode, **kw)
        if "w" in mode:
            f.close()
            raise Killed
        return f

    monkeypatch.setattr(plumbing, "open", open_then_die, raising=False)  # shadows the builtin
    with pytest.raises(Killed):
        plumbing.Logger(str(tmp_path), CPU).start(2)
    assert (tmp_path / "metrics.jsonl").read_text() == lines  # the history is intact
    monkeypatch.undo()
    plumbing.Logger(str(tmp_path), CPU).start(2)
    assert [json.loads(x)["step"] for x in open(tmp_path / "metrics.jsonl")] == [1, 2]


def test_a_second_run_into_one_folder_is_refused_and_a_killed_runs_lock_is_not(tmp_path):
    out = tmp_path / "dpo"
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time, checkpoint, plumbing; checkpoint.prepare_outputs("
         f"{{{str(out)!r}: '--out_dir'}}, plumbing.Dist(0, 0, 1, 'cpu', True, False), print); "
         "print('locked', flush=True); time.sleep(600)"],
        cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(SystemExit) as e:
            checkpoint.prepare_outputs({str(out): "--out_dir"}, CPU, print)
        assert (f"{out} is in use by another run (pid {holder.pid} on " in str(e.value)
                and "pick another --out_dir" in str(e.value))
        assert str(out.resolve()) not in plumbing.LOCKS
    finally:
        holder.kill()  # SIGKILL: no cleanup runs, the lock file stays behind
        holder.wait()
    assert (out / ".lock").exists()
    said, run = [], plumbing.Dist(0, 0, 1, torch.device("cpu"), True, False)
    checkpoint.prepare_outputs({str(out): "--out_dir"}, run, said.append)  # a resume goes on
    assert str(out.resolve()) in plumbing.LOCKS and not said
    checkpoint.prepare_outputs({str(out): "--out_dir"}, CPU, said.append)  # this process again
    assert f"pid {os.getpid()} on " in (out / ".lock").read_text()
    # the run's teardown unlocks its folder: another process may run there now (a torchrun resume
    # of a run this process stopped with --stop_after)
    plumbing.teardown(run)
    assert str(out.resolve()) not in plumbing.LOCKS
    p = subprocess.run([sys.executable, "-c", "import checkpoint, plumbing; checkpoint."
                        f"prepare_outputs({{{str(out)!r}: '--out_dir'}}, plumbing.Dist(0, 0, 1, "
                        "'cpu', True, False), print)"], cwd=ROOT, capture_output=True, text=True)
    assert p.returncode == 0, p.stderr


def test_a_kill_during_a_checkpoint_write_leaks_nothing(tmp_path):
    ckpt = tmp_path / "ckpt"
    net = torch.nn.Linear(4, 4)
    checkpoint.save_checkpoint(str(ckpt), 1, {"model": net}, {})
    # Killed mid-write for real: a file-size limit of 64 KiB, and SIGXFSZ's default action (Python
    # ignores it), end the process inside the write of a 4 MiB tensor.
    code = ("import resource, signal, torch, checkpoint; signal.signal(signal.SIGXFSZ, "
            "signal.SIG_DFL); resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 16, 1 << 16)); "
            f"checkpoint.save_checkpoint({str(ckpt)!r}, 2, {{'w': torch.zeros(1 << 20)}}, {{}})")
    p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True)
    assert p.returncode == -25  # SIGXFSZ
    # what it leaves: our temp file (safetensors' save_file would leave its hidden .tmpXXXXXX)
    leaked = set(os.listdir(ckpt)) - {"latest.json", "step-0000001.safetensors"}
    assert leaked and all(checkpoint.STALE_TEMP.fullmatch(f) for f in leaked), leaked
    (ckpt / "notes.tmp").write_text("not ours")  # not a name we write: kept
    said = []
    checkpoint.prepare_outputs({str(ckpt): "--out_dir"}, CPU, said.append)
    assert sorted(os.listdir(ckpt)) == [".lock", "latest.json", "notes.tmp",
                                        "step-0000001.safetensors"]
    assert said == [f"removed temp files that a killed run left in {ckpt}: "
                    f"{', '.join(sorted(leaked))}"]
    assert checkpoint.checkpoint_state(str(ckpt))["step"] == 1  # the previous checkpoint, intact
    # a save cleans up too: a killed save's temp files go with the checkpoint it replaces
    (ckpt / ".tmpAb3dE9").write_bytes(b"x" * 100)
    (ckpt / "step-0000002.safetensors.tmp").write_bytes(b"x")
    checkpoint.save_checkpoint(str(ckpt), 3, {"model": net}, {})
    assert sorted(os.listdir(ckpt)) == [".lock", "latest.json", "notes.tmp",
                                        "step-0000003.safetensors"]


def test_a_full_disk_names_the_file_and_leaves_no_temp_file(tmp_path, capsys):
    if not os.path.exists("/dev/full"):
        pytest.skip("no /dev/full here (Linux's device whose every write fails with ENOSPC)")
    # path + ".tmp" made a link to /dev/full: the write fails as on a full disk, for real
    writes = {"text": lambda p: plumbing.atomic_write_text(p, "new"),
              "tensors": lambda p: checkpoint.save_safetensors({"w": torch.ones(4)}, p, {}),
              "copy": lambda p: checkpoint.atomic_copy(__file__, p)}
    for name, write in writes.items():
        path = tmp_path / name
        path.write_text("as it was")
        os.symlink("/dev/full", f"{path}.tmp")
        with pytest.raises(SystemExit) as e:
            write(str(path))
        assert str(e.value).startswith(f"error: cannot write {path}: no space left on the device;")
        assert path.read_text() == "as it was" and not os.path.lexists(f"{path}.tmp"), name
    # a torn last line of metrics.jsonl (a kill mid-write): dropped on resume, with a warning
    log = plumbing.Logger(str(tmp_path), CPU)
    rows = [json.dumps({"step": s, "loss": 1.0}) for s in (1, 2, 3)]
    (tmp_path / "metrics.jsonl").write_text("\n".join(rows) + "\n" + '{"step": 4, "lo')
    log.start(3)
    assert (tmp_path / "metrics.jsonl").read_text() == "\n".join(rows) + "\n"
    assert "warning: dropped the torn last line of" in capsys.readouterr().out
    (tmp_path / "metrics.jsonl").write_text(rows[0] + "\n{torn\n" + rows[1] + "\n")  # not the last
    with pytest.raises(SystemExit, match=r"metrics.jsonl:2: not a JSON line; only the last line"):
        log.start(3)


def test_checkpoint_and_cache_files_get_the_mode_of_the_json_beside_them(tmp_path):
    old = os.umask(0o027)
    try:
        checkpoint.save_checkpoint(str(tmp_path / "ckpt"), 1, {"model": torch.nn.Linear(2, 2)}, {})
        precompute.save_ref_logps(str(tmp_path / "train.safetensors"), torch.zeros(2, 3), {}, {},
                                  {})
        checkpoint.atomic_write_json(str(tmp_path / "eval.json"), {})
        save_model(GPT(GPTConfig(block_size=8, vocab_size=10, n_layer=1, n_head=1, n_embd=4)),
                   str(tmp_path / "model.safetensors"), {})
    finally:
        os.umask(old)
    mode = lambda p: os.stat(tmp_path / p).st_mode & 0o777  # noqa: E731
    assert mode("eval.json") == 0o640  # 0666 less the umask, as open() gives
    for p in ("ckpt/step-0000001.safetensors", "ckpt/latest.json", "train.safetensors",
              "model.safetensors"):
        assert mode(p) == 0o640, p  # safetensors alone would leave 0600


# ==================================================================================================
# hangs: a hung run is killed whole, a rank left in a collective fails naming it, and teardown
# exits with a gloo work still running (run_whole, plumbing.init_distributed, plumbing.teardown)
# ==================================================================================================

def processes_naming(path):
    """The pids of the live processes whose command line holds `path` (pgrep -f, from /proc)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if str(path).encode() in f.read():
                    found.append(int(pid))
        except OSError:
            pass
    return found


def rank_script(path, body):
    """A script for torchrun's ranks: the repo importable, then `body`."""
    path.write_text(f"import sys\nsys.path.insert(0, {ROOT!r})\n{body}")
    return str(path)


def test_a_hung_run_is_killed_whole(tmp_path):
    # two ranks that never end, in no collective: no timeout of theirs can end them
    script = rank_script(tmp_path / "sleep.py", f"import os, time\nopen(f'{tmp_path}/started."
                         "{os.environ[\"RANK\"]}', 'w').close()\ntime.sleep(600)\n")
    try:
        with pytest.raises(pytest.fail.Exception, match="still running after 20 s: killed"):
            run_torchrun(script, [], timeout=20)
        assert os.path.exists(tmp_path / "started.0") and os.path.exists(tmp_path / "started.1")
        assert not processes_naming(script)  # the launcher and both ranks are gone
    finally:  # a broken harness leaves them: not beyond this test
        for pid in processes_naming(script):
            os.kill(pid, signal.SIGKILL)


def test_a_rank_left_in_a_collective_fails_fast_naming_it(tmp_path):
    script = rank_script(tmp_path / "skip.py", "import plumbing\nd = plumbing.init_distributed()\n"
                         "if d.rank == 0:\n    plumbing.reduce_sums(d, n=1)  # rank 1 skips it\n"
                         "plumbing.teardown(d)\n")
    t0 = time.monotonic()  # 5 s to wait in a collective; the harness would kill the run at 120
    (p,) = run_whole([torchrun(script, [], ["--nproc_per_node=2", "--standalone"])], 120,
                     {**torchrun_env(120), "DIST_TIMEOUT_S": "5"})
    assert p.returncode != 0 and time.monotonic() - t0 < 60
    # each rank's traceback names the collective it waited in; the first to give up says why (the
    # other may see it leave before its own clock runs out: a race the machine's load decides)
    assert re.search(r"\[rank0\]:.*in all_reduce_sum\n.*dist\.all_reduce", p.stderr)
    assert re.search(r"\[rank1\]:.*in barrier", p.stderr)
    assert "Timed out waiting 5000ms" in p.stderr
    # and no rank is blamed: both answered, each from its own collective
    assert "error: every rank answered, but rank " in p.stderr
    assert "stopped answering" not in p.stderr
    assert not processes_naming(script)


def test_a_frozen_rank_ends_the_job_and_is_named(tmp_path):
    # rank 1 frozen (SIGSTOP) while both ranks take collectives in turn: rank 0 waits its
    # DIST_TIMEOUT_S, then names rank 1, which never checked in (torchrun's summary blames rank 0,
    # the one that timed out, and SIGKILLs the frozen rank 30 s after its SIGTERM went unheard)
    script = rank_script(tmp_path / "turns.py", f"""import os, time
import plumbing
d = plumbing.init_distributed()
plumbing.reduce_sums(d, n=1)
open(f"{tmp_path}/pid.{{d.rank}}", "w").write(str(os.getpid()))
for _ in range(600):
    plumbing.reduce_sums(d, n=1)
    time.sleep(0.1)
print("rank", d.rank, "took every collective", flush=True)
plumbing.teardown(d)
""")

    def freeze_rank_1():
        while not (os.path.exists(tmp_path / "pid.0") and os.path.exists(tmp_path / "pid.1")):
            time.sleep(0.1)
        time.sleep(0.5)  # both ranks in the loop, a few collectives in
        os.kill(int((tmp_path / "pid.1").read_text()), signal.SIGSTOP)
    freezer = threading.Thread(target=freeze_rank_1, daemon=True)
    freezer.start()
    (p,) = run_whole([torchrun(script, [], ["--nproc_per_node=2", "--standalone"])], 150,
                     {**torchrun_env(150), "DIST_TIMEOUT_S": "5"})
    freezer.join(timeout=1)
    assert not freezer.is_alive() and p.returncode != 0 and "took every" not in p.stdout, p.stderr
    assert ("error: rank 1 stopped answering: rank 0 waited 5 s in a collective (DIST_TIMEOUT_S), "
            "and rank 1 did not report within 5 s more") in p.stderr, p.stderr[-3000:]
    assert not processes_naming(script)


def test_the_default_collective_timeout_is_five_minutes(tmp_path):
    # with DIST_TIMEOUT_S unset; torch's own would be 30 minutes under gloo
    script = rank_script(tmp_path / "timeout.py", """import torch
import torch.distributed as dist
import plumbing
d = plumbing.init_distributed()
gloo = dist.group.WORLD._get_backend(torch.device("cpu"))
print("timeout_s", gloo.options._timeout.total_seconds(), flush=True)
plumbing.teardown(d)
""")
    env = {k: v for k, v in torchrun_env(90).items() if k != "DIST_TIMEOUT_S"}
    (p,) = run_whole([torchrun(script, [], ["--nproc_per_node=1", "--standalone"])], 90, env)
    assert p.returncode == 0 and "timeout_s 300.0\n" in p.stdout, p.stdout + p.stderr[-3000:]


def test_teardown_exits_with_a_gloo_work_in_flight(tmp_path):
    """A DDP run's ranks leave main() while a gloo thread still holds a work and needs the GIL to
    free its tensor. Were the DDP module's Reducer to drop the group's last reference then, it
    would join gloo's threads with the GIL held and wait forever (a rank of tiny_rm's reward.py
    did, in 5 of 60 runs on 2 busy cores). Here the work is made to last: rank 1 joins it a second
    late, as teardown destroys the group, so that in the broken order every run hangs."""
    script = rank_script(tmp_path / "late.py", """import time
import torch
import torch.distributed as dist
import plumbing


def main():
    d = plumbing.init_distributed()
    model = plumbing.wrap(torch.nn.Linear(4, 4), d)  # DDP
    model(torch.ones(2, 4)).sum().backward()
    destroy = dist.destroy_process_group

    def destroy_with_a_late_work():
        time.sleep(d.rank)
        dist.all_reduce(torch.ones(3), async_op=True)  # neither the handle nor the tensor kept
        destroy()
    dist.destroy_process_group = destroy_with_a_late_work
    plumbing.teardown(d)


main()  # the DDP module is freed as main returns
print("exited", flush=True)
""")
    (p,) = run_whole([torchrun(script, [], ["--nproc_per_node=2", "--standalone"])], 90,
                     torchrun_env(90))
    assert p.returncode == 0 and p.stdout.count("exited") == 2, p.stderr[-3000:]
