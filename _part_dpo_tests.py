# Tests of precompute.py and dpo.py (to be merged into test_all.py): closed forms for the losses and
# their gradients, then equivalences on the shared tiny task: concatenated vs separate forwards,
# cached vs live reference, 2 ranks vs 1, resumed vs uninterrupted, and the FLOPs a cache saves.
import json
import math
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file
from torch.utils import flop_counter

import data
import dpo
import precompute
from _part_fixtures import run_torchrun, tiny  # noqa: F401 (tiny is a fixture)
from model import estimate_flops, load_model, save_model

DPO_TOL = 1e-5  # fp32 numbers computed in differently padded batches agree to ~1e-6; a bug is >> 1e-3
# Weights after a few AdamW steps of lr 1e-3: Adam's step lr·m/(√v + ε) turns the fp32 noise of a
# near-zero gradient into up to a few % of lr. Adam is blind to a gradient's scale, so the gradient's
# normalisation is checked through grad_norm (to DPO_TOL) instead.
DPO_WEIGHT_TOL = 1e-4
DPO_METRICS = ["loss", "rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins",
               "logps/chosen", "logps/rejected", "grad_norm", "lr", "tokens_per_sec", "mfu"]


def dpo_pcfg(tiny, out="dpo-cache", pairs=None, ref_model=None):
    return precompute.Config(out_dir=str(tiny.root / out), ref_model=ref_model or f"{tiny.sft}/model.safetensors",
                             train_pairs=pairs or str(tiny.root / "dpo-data/pairs_train.jsonl"),
                             val_pairs=pairs or str(tiny.root / "dpo-data/pairs_val.jsonl"))


@pytest.fixture(scope="module")
def dpo_cache(tiny):  # noqa: F811
    """A slice of the task (256 train pairs, 64 val pairs, 8 held-out prompts), so each run takes a
    second, and the tiny π_ref's log-prob cache of it, computed by one process."""
    own = tiny.root / "dpo-data"
    os.makedirs(own)
    for name, n in (("pairs_train.jsonl", 256), ("pairs_val.jsonl", 64), ("prompts_eval.jsonl", 8)):
        (own / name).write_text("".join(open(f"{tiny.task}/{name}").readlines()[:n]))
    precompute.main(dpo_pcfg(tiny))
    return str(tiny.root / "dpo-cache")


def dpo_cfg(tiny, name, **kw):  # noqa: F811
    base = dict(out_dir=str(tiny.root / name), ref_model=f"{tiny.sft}/model.safetensors",
                train_pairs=str(tiny.root / "dpo-data/pairs_train.jsonl"), val_pairs=str(tiny.root / "dpo-data/pairs_val.jsonl"),
                eval_prompts=str(tiny.root / "dpo-data/prompts_eval.jsonl"), ref_logps=str(tiny.root / "dpo-cache"),
                steps=3, batch_size=16, micro_batch_size=8, lr=1e-3, warmup=1, eval_every=1000, ckpt_every=1000,
                eval_k=1)
    return dpo.Config(**{**base, **kw})


def dpo_metrics(out_dir):
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def dpo_weights(out_dir):
    return load_file(os.path.join(out_dir, "model.safetensors"))


def dpo_max_diff(a, b):
    assert a.keys() == b.keys()
    return max((a[k].double() - b[k].double()).abs().max().item() for k in a)


# -----------------------------------------------------------------------------
# losses: closed forms, the analytic gradient of Sec. 4, gradcheck


def test_losses_match_hand_computed_values():
    # h = (−10 − −11) − (−12 − −11) = 2; β = 0.5: βh = 1, rewards ±0.5
    args = [torch.tensor([x]) for x in (-10.0, -12.0, -11.0, -11.0)]
    loss, r_c, r_r = dpo.dpo_loss(*args, beta=0.5)
    assert loss.item() == pytest.approx(math.log1p(math.exp(-1)), abs=1e-7)  # −log σ(1)
    assert (r_c.item(), r_r.item()) == (0.5, -0.5)
    smooth, _, _ = dpo.dpo_loss(*args, beta=0.5, label_smoothing=0.2)
    assert smooth.item() == pytest.approx(0.8 * math.log1p(math.exp(-1)) + 0.2 * math.log1p(math.exp(1)), abs=1e-7)
    ipo, _, _ = dpo.dpo_loss(*args, beta=0.5, loss="ipo")  # (h − 1/(2β))² = (2 − 1)²
    assert ipo.item() == pytest.approx(1.0, abs=1e-7)
    ipo, _, _ = dpo.dpo_loss(*args, beta=0.25, loss="ipo")  # h = 1/(2β) is IPO's target: zero loss
    assert ipo.item() == pytest.approx(0.0, abs=1e-7)


def test_gradient_matches_the_papers_analytic_form():
    torch.manual_seed(0)
    B, beta, eps = 6, 0.3, 0.1
    pi_c, pi_r = (-20 * torch.rand(B, dtype=torch.float64)).requires_grad_(), (-20 * torch.rand(B, dtype=torch.float64)).requires_grad_()
    ref_c, ref_r = -20 * torch.rand(B, dtype=torch.float64), -20 * torch.rand(B, dtype=torch.float64)
    losses, r_c, r_r = dpo.dpo_loss(pi_c, pi_r, ref_c, ref_r, beta)
    g_c, g_r = torch.autograd.grad(losses.mean(), (pi_c, pi_r))
    w = beta * torch.sigmoid(r_r - r_c) / B  # Sec. 4: β σ(r̂(x,y_l) − r̂(x,y_w)), for the mean over B
    torch.testing.assert_close(g_c, -w, rtol=1e-12, atol=1e-15)
    torch.testing.assert_close(g_r, w, rtol=1e-12, atol=1e-15)
    h = ((pi_c - ref_c) - (pi_r - ref_r)).detach()
    losses, _, _ = dpo.dpo_loss(pi_c, pi_r, ref_c, ref_r, beta, label_smoothing=eps)
    g_c, = torch.autograd.grad(losses.sum(), pi_c)
    torch.testing.assert_close(g_c, -beta * ((1 - eps) * torch.sigmoid(-beta * h) - eps * torch.sigmoid(beta * h)))
    losses, _, _ = dpo.dpo_loss(pi_c, pi_r, ref_c, ref_r, beta, loss="ipo")
    g_c, g_r = torch.autograd.grad(losses.sum(), (pi_c, pi_r))
    torch.testing.assert_close(g_c, 2 * (h - 1 / (2 * beta)))
    torch.testing.assert_close(g_r, -2 * (h - 1 / (2 * beta)))
    for kw in (dict(), dict(label_smoothing=eps), dict(loss="ipo")):
        assert torch.autograd.gradcheck(lambda a, b, c, d: dpo.dpo_loss(a, b, c, d, beta, **kw)[0],
                                        (pi_c, pi_r, ref_c.requires_grad_(), ref_r.requires_grad_()))
        ref_c, ref_r = ref_c.detach(), ref_r.detach()


# -----------------------------------------------------------------------------
# log-probs: one concatenated forward; only response tokens count


def test_concatenated_forward_equals_separate_forwards_and_counts_only_responses(tiny):  # noqa: F811
    model, _ = load_model(f"{tiny.sft}/model.safetensors")
    model = model.double().eval()  # fp64: the same math must agree to 1e-10
    tok = data.load_tokenizer(f"{tiny.sft}/tokenizer.json")
    ex, _ = data.tokenize_pairs(tok, data.read_pairs(f"{tiny.task}/pairs_val.jsonl")[:5], 64, 16)
    b = data.collate_pairs(ex, tok.pad)
    with torch.no_grad():
        both = precompute.pair_logps(model, b["input_ids"], b["targets"])  # (2B,)
        for half, key in ((both[:5], "chosen"), (both[5:], "rejected")):
            x, y = data.collate([(e["prompt"], e[key]) for e in ex], tok.pad)  # its own, shorter padding
            torch.testing.assert_close(half, precompute.pair_logps(model, x, y), rtol=0, atol=1e-10)
            for e, got in zip(ex, half):  # the obvious way: one unpadded sequence, response tokens only
                seq = torch.tensor([e["prompt"] + e[key]])
                logp = torch.log_softmax(model(seq)[0, len(e["prompt"]) - 1:-1], -1)
                want = logp.gather(-1, torch.tensor(e[key])[:, None]).sum()
                assert abs(got.item() - want.item()) < 1e-10


# -----------------------------------------------------------------------------
# the training loop


def test_step_zero_policy_equals_reference(tiny, dpo_cache):  # noqa: F811
    for ref, tol in (("live", 1e-7), ("cache", DPO_TOL)):  # live: the same forward twice; ln 2 to fp32 rounding
        cfg = dpo_cfg(tiny, f"dpo-step0-{ref}", ref=ref, steps=2, stop_after=1)
        dpo.main(cfg)
        m = dpo_metrics(cfg.out_dir)[0]
        assert set(DPO_METRICS) <= m.keys() and any(k.startswith("time/") for k in m)
        assert abs(m["loss"] - math.log(2)) <= tol
        if ref == "live":  # π_θ and π_ref: one function, one batch, so the rewards are exactly 0
            assert m["rewards/chosen"] == m["rewards/rejected"] == m["rewards/margins"] == 0.0
            assert m["rewards/accuracies"] == 0.0  # no pair is ordered yet (strict >, as TRL)
        assert abs(m["rewards/chosen"]) <= tol and abs(m["rewards/rejected"]) <= tol and abs(m["rewards/margins"]) <= tol


def test_cached_equals_live(tiny, dpo_cache):  # noqa: F811
    runs = {}
    for ref in ("cache", "live"):
        cfg = dpo_cfg(tiny, f"dpo-{ref}", ref=ref)
        dpo.main(cfg)
        runs[ref] = cfg.out_dir
    a, b = dpo_metrics(runs["cache"]), dpo_metrics(runs["live"])
    for k in ("loss", "rewards/margins", "grad_norm", "val_loss", "val_accuracy"):
        assert all(abs(x[k] - y[k]) <= DPO_TOL for x, y in zip(a, b) if k in x), k
    assert dpo_max_diff(dpo_weights(runs["cache"]), dpo_weights(runs["live"])) <= DPO_WEIGHT_TOL
    with open(os.path.join(runs["cache"], "eval.json")) as f:
        ev = json.load(f)
    assert {"val_accuracy", "true_reward", "kl", "ref_true_reward", "ref_true_reward_std", "samples"} <= ev.keys()


def test_resumed_equals_uninterrupted(tiny, dpo_cache):  # noqa: F811
    full, part = dpo_cfg(tiny, "dpo-full", steps=4), dpo_cfg(tiny, "dpo-resumed", steps=4, stop_after=2)
    dpo.main(full)
    dpo.main(part)
    assert not os.path.exists(os.path.join(part.out_dir, "model.safetensors"))
    dpo.main(part)  # resumes at step 2
    assert [m["loss"] for m in dpo_metrics(full.out_dir)] == [m["loss"] for m in dpo_metrics(part.out_dir)]
    assert dpo_max_diff(dpo_weights(full.out_dir), dpo_weights(part.out_dir)) == 0.0


def test_non_finite_loss_stops_and_keeps_the_last_checkpoint(tiny, dpo_cache):  # noqa: F811
    cfg = dpo_cfg(tiny, "dpo-nan", lr=1e30, ckpt_every=1)  # step 1 blows the weights up; step 2's loss is NaN
    with pytest.raises(SystemExit, match="non-finite loss.*step 2.*last good checkpoint is kept"):
        dpo.main(cfg)
    with open(os.path.join(cfg.out_dir, "ckpt", "latest.json")) as f:
        assert json.load(f)["step"] == 1


# FlopCounterMode does not know torch 2.13's CPU flash-attention kernels: count them with torch's own
# formulas, as the model tests do, so the count is comparable with model.estimate_flops exactly.
dpo_aten = torch.ops.aten
DPO_CPU_SDPA = {dpo_aten._scaled_dot_product_flash_attention_for_cpu:
            lambda q, k, v, *a, **kw: flop_counter.sdpa_flop_count(q, k, v),
            dpo_aten._scaled_dot_product_flash_attention_for_cpu_backward:
            lambda g, q, k, v, *a, **kw: flop_counter.sdpa_backward_flop_count(g, q, k, v)}


def test_cached_step_costs_the_analytic_fraction_of_a_live_step(tiny, dpo_cache, monkeypatch):  # noqa: F811
    monkeypatch.setattr(dpo, "measure_peak_flops", lambda device: 1e9)  # its matmuls would be counted
    counted = {}
    for ref in ("cache", "live"):
        cfg = dpo_cfg(tiny, f"dpo-flops-{ref}", ref=ref, steps=2, stop_after=1)  # one step, no evaluation
        with flop_counter.FlopCounterMode(display=False, custom_mapping=DPO_CPU_SDPA) as fc:
            dpo.main(cfg)
        counted[ref] = fc.get_total_flops()
    # expected from the model's own sizes and the step's real batch shapes
    mcfg = load_model(cfg.ref_model)[0].config
    tok = data.load_tokenizer(f"{tiny.sft}/tokenizer.json")
    train, _ = data.tokenize_pairs(tok, data.read_pairs(cfg.train_pairs), cfg.max_len, cfg.max_prompt_len)
    batch = data.global_batch(len(train), cfg.batch_size, 0, cfg.seed)
    shapes = [data.collate_pairs([train[i] for i in batch[j:j + 8]], tok.pad)["input_ids"].shape for j in (0, 8)]
    policy = sum(estimate_flops(mcfg, *s, backward=True) for s in shapes)  # forward + backward
    reference = sum(estimate_flops(mcfg, *s) for s in shapes)  # forward only
    assert counted["cache"] == policy and counted["live"] == policy + reference  # exact: same counting rules
    ratio = counted["cache"] / counted["live"]
    assert abs(ratio - 0.75) < 0.02  # 3/(3+1) for matmuls; attention's 2.5x backward moves it slightly


# -----------------------------------------------------------------------------
# distributed (gloo on the CPU) and the cache's guarantees


def test_precompute_two_ranks_writes_the_same_cache(tiny, dpo_cache):  # noqa: F811
    out = str(tiny.root / "dpo-cache-2ranks")
    c = dpo_pcfg(tiny)
    run_torchrun("precompute.py", ["--out_dir", out, "--ref_model", c.ref_model, "--train_pairs", c.train_pairs,
                                   "--val_pairs", c.val_pairs])
    for split in ("train", "val"):
        one, two = load_file(f"{dpo_cache}/{split}.safetensors"), load_file(f"{out}/{split}.safetensors")
        for k in ("chosen", "rejected"):  # same micro-batches on any world size: the same numbers
            torch.testing.assert_close(one[k], two[k], rtol=0, atol=DPO_TOL, equal_nan=True)
            assert torch.isfinite(one[k]).all()  # every row filled (the task has no unusable rows)


def test_stale_cache_is_refused(tiny, dpo_cache):  # noqa: F811
    own = tiny.root / "dpo-stale"
    os.makedirs(own)
    for f in ("model.safetensors", "tokenizer.json"):
        shutil.copyfile(f"{tiny.sft}/{f}", own / f)
    rows = open(f"{tiny.task}/pairs_val.jsonl").readlines()[:16]
    (own / "pairs.jsonl").write_text("".join(rows))
    c = dpo_pcfg(tiny, out="dpo-stale/cache", pairs=str(own / "pairs.jsonl"), ref_model=str(own / "model.safetensors"))
    precompute.main(c)
    cfg = dpo_cfg(tiny, "dpo-stale/run", ref_model=c.ref_model, train_pairs=c.train_pairs, val_pairs=c.val_pairs,
               ref_logps=c.out_dir, steps=1)
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


def test_two_ranks_equal_one_process(tiny, dpo_cache):  # noqa: F811
    one = dpo_cfg(tiny, "dpo-1rank", steps=2, micro_batch_size=16)  # 1 rank x 1 micro-step x 16
    dpo.main(one)
    two = dpo_cfg(tiny, "dpo-2ranks", steps=2, micro_batch_size=4)  # 2 ranks x 2 micro-steps x 4: same global batch
    args = [a for k, v in vars(two).items() if isinstance(v, (str, int, float)) and not isinstance(v, bool)
            for a in (f"--{k}", str(v))]
    p = run_torchrun("dpo.py", args)  # also the smoke run: the whole script, evaluation and outputs
    assert "held-out pairs: accuracy" in p.stdout
    a, b = dpo_metrics(one.out_dir), dpo_metrics(two.out_dir)
    for k in ("loss", "rewards/margins", "logps/chosen", "grad_norm", "val_loss"):  # not accuracy: ties at step 1
        assert all(abs(x[k] - y[k]) <= DPO_TOL * max(1, abs(x[k])) for x, y in zip(a, b) if k in x), k
    assert dpo_max_diff(dpo_weights(one.out_dir), dpo_weights(two.out_dir)) <= DPO_WEIGHT_TOL


def test_dpo_follows_the_shared_skeleton():
    heads = [line.strip() for line in open(dpo.__file__) if line.strip().startswith("# ==== ")]
    assert heads == ["# ==== config", "# ==== setup: ranks, device, inputs (a missing earlier stage is built with its defaults)",
                     "# ==== models resident in the training job", "# ==== anatomy: what the job holds and what a token costs",
                     "# ==== optimizer, schedule, resume", "# ==== training loop", "# ==== evaluation and outputs"]
