import json
import os

import pytest
import torch
from safetensors.torch import load_file

import plumbing
import sft
from _part_fixtures import TINY_MODEL, run_torchrun, tiny  # noqa: F401


# ---- plumbing


def test_parse_config_flags_help_and_bad_values(capsys):
    cfg = plumbing.parse_config(sft.Config, ["--lr", "0.01", "--no-resume", "--n-layer", "3"])
    assert cfg.lr == 0.01 and cfg.resume is False and cfg.n_layer == 3 and cfg.steps == sft.Config.steps
    with pytest.raises(SystemExit):
        plumbing.parse_config(sft.Config, ["--steps", "ten"])
    assert "invalid int value: 'ten'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        plumbing.parse_config(sft.Config, ["--help"])
    assert "peak AdamW learning rate" in capsys.readouterr().out  # help comes from the field's comment


def test_split_batch_derives_accumulation_or_says_why_not():
    assert plumbing.split_batch(64, 8, 2) == 4 and plumbing.split_batch(32, 32, 8) == 1
    with pytest.raises(SystemExit, match="not divisible by the 3 ranks"):
        plumbing.split_batch(64, 8, 3)
    with pytest.raises(SystemExit, match="not a multiple of --micro_batch_size 12"):
        plumbing.split_batch(64, 12, 2)


def test_lr_schedule_warmup_then_cosine():
    lrs = [plumbing.lr_at(s, 100, 1.0, 10, 0.1) for s in range(100)]
    assert lrs[0] == pytest.approx(0.1) and lrs[9] == pytest.approx(1.0)
    assert lrs[10] == pytest.approx(1.0) and all(a >= b for a, b in zip(lrs[10:], lrs[11:]))
    assert plumbing.lr_at(100, 100, 1.0, 10, 0.1) == pytest.approx(0.1)


def test_checkpoint_round_trip_and_a_crash_keeps_the_previous_one(tmp_path):
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
    net[1].weight = torch.nn.Parameter(net[1].weight)  # a plain module
    opt = torch.optim.AdamW(net.parameters(), lr=0.1)
    net(torch.randn(3, 4)).sum().backward()
    opt.step()
    plumbing.save_checkpoint(str(tmp_path), 7, {"model": net, "optim": opt, "gen": torch.arange(3)}, {"a": 1})
    net2 = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
    opt2 = torch.optim.AdamW(net2.parameters(), lr=0.1)
    step, state = plumbing.load_checkpoint(str(tmp_path), {"model": net2, "optim": opt2, "gen": torch.zeros(3)}, "cpu")
    assert step == 7 and state["a"] == 1 and torch.equal(state["tensors"]["gen"], torch.arange(3))
    for p, q in zip(net.parameters(), net2.parameters()):
        assert torch.equal(p, q)
    for s, t in zip(opt.state.values(), opt2.state.values()):
        assert all(torch.equal(torch.as_tensor(s[k]), torch.as_tensor(t[k])) for k in s)
    # a writer that died before renaming leaves only a .tmp: the checkpoint on record is unchanged
    (tmp_path / "step-0000008.safetensors.tmp").write_bytes(b"half")
    assert plumbing.checkpoint_state(str(tmp_path))["step"] == 7


# ---- sft: world size 2 equals 1, resumed equals uninterrupted, torchrun smoke


def sft_args(tiny, out, steps=8, **kw):
    cfg = dict(out_dir=str(out), train_text=f"{tiny.task}/sft_train.txt", val_text=f"{tiny.task}/sft_val.txt",
               tokenizer=f"{tiny.task}/tokenizer.json", **TINY_MODEL, steps=steps, batch_size=16,
               micro_batch_size=4, eval_every=steps, ckpt_every=100, warmup=2, **kw)
    return cfg


def as_flags(cfg):
    return [x for k, v in cfg.items() for x in ((f"--{k}" if v else f"--no-{k}",) if isinstance(v, bool)
                                                 else (f"--{k}", str(v)))]


def saved_weights(out):
    return load_file(os.path.join(out, "model.safetensors"))


def test_sft_two_ranks_equal_one_process_and_resume_equals_uninterrupted(tiny, tmp_path):
    one, two, resumed = tmp_path / "one", tmp_path / "two", tmp_path / "resumed"
    sft.main(sft.Config(**sft_args(tiny, one)))  # 1 rank x 4 micro-steps of 4
    run_torchrun("sft.py", as_flags(sft_args(tiny, two)))  # 2 ranks x 2 micro-steps of 4
    w1, w2 = saved_weights(one), saved_weights(two)
    # Same global batch and token normalisation; only the order of float sums differs (all-reduce,
    # accumulation), so after 8 AdamW steps the weights agree to ~1e-6; 1e-4 leaves margin.
    assert w1.keys() == w2.keys()
    for k in w1:
        torch.testing.assert_close(w1[k], w2[k], rtol=0, atol=1e-4)
    sft.main(sft.Config(**sft_args(tiny, resumed, stop_after=3)))
    assert not os.path.exists(resumed / "model.safetensors")  # interrupted: no final model yet
    sft.main(sft.Config(**sft_args(tiny, resumed)))  # picks up at step 3
    w3 = saved_weights(resumed)
    for k in w1:  # the same operations in the same order: bit for bit
        assert torch.equal(w1[k], w3[k]), k
    with open(resumed / "metrics.jsonl") as f:
        steps = [json.loads(line)["step"] for line in f]
    assert steps == sorted(set(steps)) and steps[0] == 1  # the resumed log keeps the first run's lines, none twice


def test_sft_refuses_to_resume_a_different_config(tiny, tmp_path):
    sft.main(sft.Config(**sft_args(tiny, tmp_path, steps=4, stop_after=2)))
    with pytest.raises(SystemExit, match=r"another config \(lr 0.003 -> 0.001\)"):
        sft.main(sft.Config(**sft_args(tiny, tmp_path, steps=4, lr=0.001)))


def test_sft_explicit_missing_input_is_an_error_naming_it(tiny, tmp_path):
    with pytest.raises(SystemExit, match="nope.txt does not exist"):
        sft.main(sft.Config(**{**sft_args(tiny, tmp_path), "train_text": str(tmp_path / "nope.txt")}))
