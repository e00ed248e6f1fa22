"""Tests of reward.py and ppo.py (merged into test_all.py by the lead): closed forms against naive loops
and hand computations, the weight broadcast on two gloo ranks, and smoke runs of both scripts."""
import json
import math
import os

import pytest
import torch
import torch.multiprocessing as mp
import torch.nn.functional as F
from safetensors.torch import load_file

import data
import ppo
import reward
from _part_fixtures import run_torchrun, tiny  # noqa: F401  (tiny is a fixture)
from model import GPT, GPTConfig, generate
from plumbing import Dist


def prefix_mask(lengths, N):
    return torch.arange(N)[None, :] < torch.tensor(lengths)[:, None]


# -----------------------------------------------------------------------------
# advantages


def test_gae_matches_double_loop():
    g = torch.Generator().manual_seed(0)
    B, N, gamma, lam = 4, 7, 0.9, 0.8
    mask = prefix_mask([7, 3, 1, 5], N)
    r, v = torch.randn(B, N, generator=g, dtype=torch.float64), torch.randn(B, N, generator=g, dtype=torch.float64)
    adv, ret = ppo.gae(r, v, mask, gamma, lam)
    for b in range(B):
        n = int(mask[b].sum())
        V = lambda t: v[b, t].item() if t < n else 0.0  # noqa: E731  the episode ends after token n-1
        for t in range(N):
            want = sum((gamma * lam) ** k * (r[b, t + k].item() + gamma * V(t + k + 1) - V(t + k))
                       for k in range(n - t)) if t < n else 0.0
            assert adv[b, t].item() == pytest.approx(want, abs=1e-12)
            assert ret[b, t].item() == pytest.approx(want + V(t) if t < n else 0.0, abs=1e-12)


def test_gae_with_gamma_lambda_one_is_reward_to_go():
    g = torch.Generator().manual_seed(1)
    mask = prefix_mask([5, 2, 6], 6)
    r, v = torch.randn(3, 6, generator=g, dtype=torch.float64), torch.randn(3, 6, generator=g, dtype=torch.float64)
    adv, _ = ppo.gae(r, v, mask, 1.0, 1.0)
    to_go = (r * mask).flip(1).cumsum(1).flip(1) * mask
    torch.testing.assert_close(adv + v * mask, to_go)


def test_masked_whiten_and_padding_contributes_nothing():
    g = torch.Generator().manual_seed(2)
    mask = prefix_mask([4, 1, 3], 5)
    x = torch.randn(3, 5, generator=g, dtype=torch.float64)
    w = ppo.masked_whiten(x, mask)
    real = x[mask]
    torch.testing.assert_close(w[mask], (real - real.mean()) / (real.var(unbiased=True) + 1e-8) ** 0.5)
    assert (w[~mask] == 0).all()
    # garbage (even NaN-free huge numbers) in PAD positions changes nothing anywhere
    y = torch.where(mask, x, 1e6)
    torch.testing.assert_close(ppo.masked_whiten(y, mask), w)
    v = torch.randn(3, 5, generator=g, dtype=torch.float64)
    for a, b in zip(ppo.gae(x, v, mask, 1.0, 0.95), ppo.gae(y, torch.where(mask, v, -1e6), mask, 1.0, 0.95)):
        torch.testing.assert_close(a, b)
    old = torch.randn(3, 5, generator=g, dtype=torch.float64)
    for f in (lambda u: ppo.ppo_policy_loss(u, old, x, mask, 0.2), lambda u: ppo.ppo_value_loss(u, old, x, mask, 0.2)):
        assert f(v)[0].item() == pytest.approx(f(torch.where(mask, v, 1e6))[0].item(), abs=1e-12)


# -----------------------------------------------------------------------------
# PPO losses


def test_clipped_policy_loss_value_and_gradient():
    eps = 0.2
    # (ratio, advantage): inside the band; above it with A>0 (clipped: no gradient); above it with A<0
    # (not clipped: the pessimistic term is the unclipped one); below with A<0 (clipped); below with A>0
    cases = [(1.1, 2.0), (1.5, 1.0), (1.5, -1.0), (0.5, -3.0), (0.5, 0.5)]
    ratio = torch.tensor([c[0] for c in cases], dtype=torch.float64)
    adv = torch.tensor([[c[1] for c in cases]], dtype=torch.float64)
    old = torch.full((1, 5), -1.3, dtype=torch.float64)
    logp = (old + ratio.log()[None]).requires_grad_(True)
    mask = torch.ones(1, 5, dtype=torch.bool)
    loss, clipfrac, approx_kl = ppo.ppo_policy_loss(logp, old, adv, mask, eps)
    clipped = [False, True, False, True, False]
    want = sum(-a * (min(max(r, 1 - eps), 1 + eps) if c else r) for (r, a), c in zip(cases, clipped)) / 5
    assert loss.item() == pytest.approx(want, abs=1e-12)
    assert clipfrac.item() == pytest.approx(2 / 5)
    assert approx_kl.item() == pytest.approx(sum((r - 1) - math.log(r) for r, _ in cases) / 5, abs=1e-12)
    loss.backward()
    # d(-A·ρ)/d log π = -A·ρ; zero where the ratio is clipped on the side the advantage pushes
    grad = [0.0 if c else -a * r / 5 for (r, a), c in zip(cases, clipped)]
    torch.testing.assert_close(logp.grad[0], torch.tensor(grad, dtype=torch.float64))


def test_clipped_value_loss_value_and_gradient():
    eps = 0.2
    old = torch.tensor([[0.0, 0.0, 0.0, 0.0]], dtype=torch.float64)
    ret = torch.tensor([[1.0, 1.0, -1.0, 0.05]], dtype=torch.float64)
    # moved 0.1 (in the band); moved 0.5 toward the return (clipped to 0.2: worse, so it counts, gradient 0);
    # moved 0.5 away from the return (the unclipped error is worse: it counts); moved -0.5 past a close return
    v = torch.tensor([[0.1, 0.5, 0.5, -0.5]], dtype=torch.float64, requires_grad=True)
    mask = torch.ones(1, 4, dtype=torch.bool)
    loss, vf_clipfrac = ppo.ppo_value_loss(v, old, ret, mask, eps)
    vc = [0.1, 0.2, 0.2, -0.2]
    terms = [max((a - r) ** 2, (c - r) ** 2) for a, c, r in zip([0.1, 0.5, 0.5, -0.5], vc, [1.0, 1.0, -1.0, 0.05])]
    assert loss.item() == pytest.approx(0.5 * sum(terms) / 4, abs=1e-12)
    assert vf_clipfrac.item() == pytest.approx(1 / 4)
    loss.backward()
    grad = [(0.1 - 1.0) / 4, 0.0, (0.5 + 1.0) / 4, (-0.5 - 0.05) / 4]
    torch.testing.assert_close(v.grad[0], torch.tensor(grad, dtype=torch.float64))


# -----------------------------------------------------------------------------
# KL estimators and the per-token reward


def test_kl_estimators_k1_unbiased_k3_nonnegative():
    g = torch.Generator().manual_seed(3)
    p, q = F.log_softmax(torch.randn(10, generator=g, dtype=torch.float64), 0), \
        F.log_softmax(torch.randn(10, generator=g, dtype=torch.float64), 0)
    exact = (p.exp() * (p - q)).sum().item()
    x = torch.multinomial(p.exp(), 400_000, replacement=True, generator=g)
    k1, k3 = ppo.kl_estimators(p[x], q[x])
    se = k1.std().item() / math.sqrt(len(x))
    assert abs(k1.mean().item() - exact) < 5 * se  # unbiased
    assert (k1 < 0).any()  # but negative on some tokens
    assert abs(k3.mean().item() - exact) < 5 * k3.std().item() / math.sqrt(len(x))
    a, b = torch.meshgrid(torch.linspace(-30, 0, 301, dtype=torch.float64), torch.linspace(-30, 0, 301, dtype=torch.float64),
                          indexing="ij")
    assert (ppo.kl_estimators(a, b)[1] >= 0).all()


def test_per_token_reward_layout():
    mask = prefix_mask([3, 5, 1], 6)
    logp, ref = -torch.rand(3, 6, dtype=torch.float64), -torch.rand(3, 6, dtype=torch.float64)
    score = torch.tensor([2.0, -1.0, 0.5], dtype=torch.float64)
    r = ppo.per_token_rewards(logp, ref, score, mask, kl_coef=0.1)
    want = -0.1 * (logp - ref) * mask
    for b, n in enumerate([3, 5, 1]):
        want[b, n - 1] += score[b]  # the score sits on the last response token (the EOS)...
    torch.testing.assert_close(r, want)
    assert (r[~mask] == 0).all()  # ...and nothing is paid past it
    torch.testing.assert_close(ppo.per_token_rewards(logp, logp, score, mask, 0.1).sum(1), score)


def test_adaptive_kl_controller():
    assert ppo.adaptive_kl_coef(0.1, 12.0, 6.0, 10000, 500) == pytest.approx(0.1 * (1 + 0.2 * 0.05))  # clipped at +0.2
    assert ppo.adaptive_kl_coef(0.1, 5.4, 6.0, 10000, 500) == pytest.approx(0.1 * (1 - 0.1 * 0.05))


# -----------------------------------------------------------------------------
# the reward model


def test_bradley_terry_loss_and_gradient():
    rc = torch.tensor([1.0, -0.5, 2.0], dtype=torch.float64, requires_grad=True)
    rr = torch.tensor([0.0, 0.5, 2.0], dtype=torch.float64, requires_grad=True)
    loss = reward.bt_loss(rc, rr)
    delta = [1.0, -1.0, 0.0]
    assert loss.item() == pytest.approx(sum(math.log(1 + math.exp(-x)) for x in delta) / 3, abs=1e-12)
    loss.backward()
    want = torch.tensor([-(1 - 1 / (1 + math.exp(-x))) / 3 for x in delta], dtype=torch.float64)
    torch.testing.assert_close(rc.grad, want)
    torch.testing.assert_close(rr.grad, -want)


def test_reward_read_at_last_token_independent_of_padding():
    torch.manual_seed(0)
    m = GPT(GPTConfig(block_size=32, vocab_size=50, n_layer=2, n_head=2, n_embd=16, head="scalar")).eval()
    torch.nn.init.normal_(m.score.weight)  # the zero init would make every score 0
    pad, seqs = 49, [[1, 5, 6, 7], [1, 8, 9, 10, 11, 12, 13], [1, 3]]
    alone = [m(torch.tensor([s]))[0, -1].item() for s in seqs]
    # right padding, no mask (the training batches), with the real-token mask from the collate targets
    ids, targets = data.collate([(s[:1], s[1:]) for s in seqs] + [([1], [2] * 20)], pad)
    right = reward.score_at_last(m(ids), reward.pair_mask(targets))[:3]
    # left padding with a mask (generate's layout)
    L = 12
    lids = torch.tensor([[pad] * (L - len(s)) + s for s in seqs])
    lmask = torch.tensor([[False] * (L - len(s)) + [True] * len(s) for s in seqs])
    left = reward.score_at_last(m(lids, mask=lmask), lmask)
    torch.testing.assert_close(right, torch.tensor(alone), atol=1e-5, rtol=0)
    torch.testing.assert_close(left, torch.tensor(alone), atol=1e-5, rtol=0)


def test_load_trunk_keeps_the_transformer(tmp_path):
    from model import save_model
    torch.manual_seed(0)
    lm = GPT(GPTConfig(block_size=16, vocab_size=20, n_layer=1, n_head=2, n_embd=8, dropout=0.1))
    save_model(lm, str(tmp_path / "m.safetensors"), {})
    rm, _ = reward.load_trunk(str(tmp_path / "m.safetensors"), "scalar", "cpu")
    assert rm.config.dropout == 0.0 and rm.config.head == "scalar"
    assert torch.equal(rm.transformer.h[0].mlp.c_fc.weight, lm.transformer.h[0].mlp.c_fc.weight)
    assert (rm.score.weight == 0).all()
    pol, _ = reward.load_trunk(str(tmp_path / "m.safetensors"), "lm", "cpu")
    assert pol.lm_head.weight is pol.transformer.wte.weight


# -----------------------------------------------------------------------------
# the weight broadcast, on two gloo ranks


def _broadcast_worker(rank, init_file, result_dir):
    torch.distributed.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    cfg = GPTConfig(block_size=24, vocab_size=40, n_layer=2, n_head=2, n_embd=16)
    torch.manual_seed(rank)  # the ranks' trainers differ: only rank 0's weights may arrive
    trainer = GPT(cfg)
    torch.manual_seed(100 + rank)
    rollout = GPT(cfg).eval()
    d = Dist(rank, rank, 2, torch.device("cpu"), rank == 0, False)
    n_bytes, seconds = ppo.broadcast_weights(trainer, rollout, d)
    torch.manual_seed(0)
    want = GPT(cfg)  # rank 0's trainer, rebuilt
    same = all(torch.equal(a, b) for a, b in zip(rollout.state_dict().values(), want.state_dict().values()))
    tied = rollout.lm_head.weight is rollout.transformer.wte.weight
    outs = [generate(m, [[1, 2, 3], [1]], 12, eos_id=0, pad_id=39, generator=torch.Generator().manual_seed(7))
            for m in (rollout, want)]
    sample_same = all(torch.equal(outs[0][k], outs[1][k]) for k in outs[0])
    n_params = sum(p.numel() for p in want.parameters())
    with open(os.path.join(result_dir, f"{rank}.json"), "w") as f:
        json.dump(dict(same=same, tied=tied, sample_same=sample_same, bytes=n_bytes, want_bytes=4 * n_params,
                       seconds=seconds), f)
    torch.distributed.destroy_process_group()


def test_broadcast_weights_two_gloo_ranks(tmp_path):
    mp.spawn(_broadcast_worker, args=(str(tmp_path / "init"), str(tmp_path)), nprocs=2, join=True)
    for rank in range(2):
        with open(tmp_path / f"{rank}.json") as f:
            r = json.load(f)
        assert r["same"] and r["tied"] and r["sample_same"], r
        assert r["bytes"] == r["want_bytes"] and r["seconds"] >= 0


# -----------------------------------------------------------------------------
# smoke runs: reward.py and ppo.py on two gloo ranks; a resumed ppo run equals an uninterrupted one


def tiny_ppo_config(tiny, rm, out, eval_prompts, **kw):
    return ppo.Config(out_dir=str(out), sft=f"{tiny.sft}/model.safetensors", reward_model=rm,
                      prompts=f"{tiny.task}/prompts_train.jsonl", eval_prompts=eval_prompts, iterations=3,
                      rollout_batch=8, mini_batch=4, micro_batch_size=2, ppo_epochs=2, eval_k=1, **kw)


@pytest.fixture(scope="module")
def tiny_rm(tiny):
    """reward.py on two gloo ranks, a few steps on the tiny stack; returns its folder."""
    out = tiny.root / "ppo-test" / "reward"
    run_torchrun("reward.py", [f"--out_dir={out}", f"--sft={tiny.sft}/model.safetensors",
                               f"--train_pairs={tiny.task}/pairs_train.jsonl", f"--val_pairs={tiny.task}/pairs_val.jsonl",
                               f"--prompts={tiny.task}/prompts_train.jsonl", "--steps=4", "--batch_size=8",
                               "--micro_batch_size=2", "--eval_every=4", "--offset_samples=16"])
    return out


def test_reward_two_ranks(tiny_rm):
    with open(tiny_rm / "eval.json") as f:
        ev = json.load(f)
    assert 0 <= ev["val_accuracy"] <= 1 and math.isfinite(ev["offset"])
    with open(tiny_rm / "metrics.jsonl") as f:
        assert [json.loads(line)["step"] for line in f] == [1, 4]


def test_ppo_two_ranks_and_resume(tiny, tiny_rm):
    root, rm = tiny.root / "ppo-test", str(tiny_rm / "model.safetensors")
    prompts = root / "eval_prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n"
                               for p in data.read_prompts(f"{tiny.task}/prompts_eval.jsonl")[:8]))
    cfg = tiny_ppo_config(tiny, rm, root / "ppo2", str(prompts))
    run_torchrun("ppo.py", [f"--{k}={v}" for k, v in vars(cfg).items() if not isinstance(v, bool)])
    with open(root / "ppo2" / "eval.json") as f:
        ev = json.load(f)
    assert math.isfinite(ev["true_reward"]) and math.isfinite(ev["kl"]) and set(ev["time_shares"]) == set(ppo.PHASES)
    with open(root / "ppo2" / "metrics.jsonl") as f:
        assert [json.loads(line)["step"] for line in f] == [1, 2, 3]
    # one process: uninterrupted, and stopped after 2 iterations then resumed; also --reward true and adaptive KL
    for name, extra in [("full", {}), ("split", {"stop_after": 2})]:
        ppo.main(tiny_ppo_config(tiny, rm, root / name, str(prompts), reward="true", adaptive_kl=True, **extra))
    ppo.main(tiny_ppo_config(tiny, rm, root / "split", str(prompts), reward="true", adaptive_kl=True))
    a, b = (load_file(str(root / n / "model.safetensors")) for n in ("full", "split"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    rows = [[json.loads(line) for line in open(root / n / "metrics.jsonl")] for n in ("full", "split")]
    strip = lambda r: {k: v for k, v in r.items() if not k.startswith(("time/", "share/", "tokens_per", "mfu"))}  # noqa: E731
    assert [strip(r) for r in rows[0]] == [strip(r) for r in rows[1]]


def test_ppo_stops_on_non_finite(tiny, tiny_rm, tmp_path):
    prompts = tmp_path / "eval.jsonl"
    prompts.write_text(json.dumps({"prompt": "the movie is"}) + "\n")
    cfg = tiny_ppo_config(tiny, str(tiny_rm / "model.safetensors"), tmp_path / "ppo", str(prompts), lr=1e30)
    with pytest.raises(SystemExit, match="non-finite grad norm at iteration 1 .* the last good checkpoint is kept: none"):
        ppo.main(cfg)
    assert not os.path.exists(tmp_path / "ppo" / "model.safetensors")
