"""What a step costs, counted (meter.py): FLOPs against torch's FlopCounterMode and against the
closed form (PaLM's 6N, attention's triangle), the peak measured once at the model's own shapes, and
a cached DPO step's analytic fraction of a live one, with the MFU and HFU its log reports.

    pytest tests/test_flops.py
"""
from types import SimpleNamespace

import pytest
import torch
from torch.utils import flop_counter

import data
import dpo
import meter
from meter import count_flops, estimate_flops, generate_flops, model_flops
from meter import matmul_shapes as model_matmul_shapes
from model import GPTConfig, generate, load_model
from tests.helpers import dpo_cfg, dpo_metrics, tiny_gpt


# ==================================================================================================
# FLOP counts, the peak, MFU (meter.py, dpo.py)
# ==================================================================================================

def test_estimate_flops_matches_flop_counter():
    for head in ("lm", "scalar"):
        m = tiny_gpt(head).float().train()
        cfg, B, T = m.config, 3, 20
        idx = torch.randint(0, 13, (B, T))
        assert count_flops(lambda: m(idx))[1] == estimate_flops(cfg, B, T)  # exact
        # a training step: forward + backward
        step = lambda: m(idx).float().pow(2).mean().backward()  # noqa: E731
        assert count_flops(step)[1] == estimate_flops(cfg, B, T, backward=True)
        with flop_counter.FlopCounterMode(display=False) as fc:
            m(idx)
        attn = cfg.n_layer * 4 * B * T * T * cfg.n_embd
        # stock counter: attention counted if this torch knows the CPU kernel, 0 if not (torch 2.13)
        assert fc.get_total_flops() in (estimate_flops(cfg, B, T), estimate_flops(cfg, B, T) - attn)
        # the head only where an output is asked for (at): K positions, not B*T
        at = torch.rand(B, T, generator=torch.Generator().manual_seed(0)) < 0.3
        K = int(at.sum())
        assert count_flops(lambda: m(idx, at=at))[1] == estimate_flops(cfg, B, T, outputs=K)
        step = lambda: m(idx, at=at).float().pow(2).mean().backward()  # noqa: E731
        assert count_flops(step)[1] == estimate_flops(cfg, B, T, backward=True, outputs=K)
    m = tiny_gpt().float()  # generate: a prefill, the head at its last column; then 1-token steps
    out, counted = count_flops(lambda: generate(m, [[1, 2, 3], [4]], 6, eos_id=-1, pad_id=0))
    assert counted == generate_flops(m.config, 2, 3, out["tokens"].shape[1] - 3)


def test_model_flops_closed_form_and_never_above_the_executed():
    c = GPTConfig(block_size=32, vocab_size=50, n_layer=3, n_head=2, n_embd=16)
    C, L, V, T = 16, 3, 50, 10
    # one sequence of T tokens, the head at each: 2 FLOPs per matmul weight per token (a block's
    # 12·C² matrix weights, the head's C·V; PaLM's 2N) and causal attention, q·k and a·v, 4·C for
    # each query and each key at or before it
    assert model_flops(c, [T], T) == T * (L * 24 * C * C + 2 * C * V) + L * 4 * C * T * (T + 1) // 2
    assert model_flops(c, [T], T, backward=True) == 3 * model_flops(c, [T], T)  # PaLM's 6N
    assert model_flops(c, [T], 0) == model_flops(c, [T], T) - T * 2 * C * V  # no target, no head
    # unpadded, the head everywhere: what ran beyond it is attention's upper triangle, exactly
    assert estimate_flops(c, 1, T) - model_flops(c, [T], T) == L * 4 * C * T * (T - 1) // 2
    for bw in (False, True):  # a padded batch runs more than its real tokens need: MFU <= HFU
        assert model_flops(c, [3, 10, 7], 12, bw) < estimate_flops(c, 3, 10, bw, outputs=12)


def test_peak_flops_measured_once_at_the_models_shapes_for_long_enough(monkeypatch):
    # A fake clock on which every matmul takes 1 ms: the peak is then the largest shape's 2·m·k·n
    # per ms, and the blocks must hold enough matmuls to last their share of the 0.1 s
    monkeypatch.setattr(meter, "PEAKS", {})
    shapes = model_matmul_shapes(GPTConfig(n_embd=32, vocab_size=64), 256, 100)
    seen, now, mm = [], [0.0], torch.mm

    def timed_mm(a, b, out):
        seen.append((*a.shape, b.shape[1]))
        now[0] += 1e-3
        return mm(a, b, out=out)
    monkeypatch.setattr(torch, "mm", timed_mm)
    monkeypatch.setattr(meter, "time", SimpleNamespace(perf_counter=lambda: now[0]))
    peak = meter.measure_peak_flops(torch.device("cpu"), shapes, seconds=0.1)
    # the fastest shape's FLOP/s (the fake clock adds up 1e-3 steps: rounding only)
    assert peak == pytest.approx(max(2 * m * k * n for m, k, n in shapes) / 1e-3, rel=1e-9)
    # each of the model's shapes, the MLP's and the head's among them, in 5 timed blocks of at
    # least 0.1 s / 5 / 5 shapes = 4 ms: >= 20 matmuls each (the warm-up comes on top)
    assert set(seen) == set(shapes) and (256, 32, 128) in seen and (100, 32, 64) in seen
    assert all(seen.count(s) >= 20 for s in shapes)
    n = len(seen)
    assert meter.measure_peak_flops(torch.device("cpu"), shapes) == peak  # once per process:
    assert len(seen) == n  # the second call times nothing


def test_cached_step_costs_the_analytic_fraction_of_a_live_step(
        tiny, dpo_cache, monkeypatch):
    monkeypatch.setattr(dpo, "measure_peak_flops", lambda *a: 1e9)  # its matmuls would be counted
    counted, logged = {}, {}
    for ref in ("cache", "live"):
        # one step, no evaluation
        cfg = dpo_cfg(tiny, f"dpo-flops-{ref}", ref=ref, steps=2, stop_after=1)
        counted[ref] = count_flops(lambda: dpo.main(cfg))[1]
        logged[ref] = dpo_metrics(cfg.out_dir)[0]
    # expected from the model's own sizes and the step's real batches: sorted by length, each
    # micro-batch packed into rows of max_len (the default), the LM head only at its K targets
    mcfg = load_model(cfg.ref_model)[0].config
    tok = data.load_tokenizer(f"{tiny.sft}/tokenizer.json")
    train, _ = data.tokenize_pairs(tok, data.read_pairs(cfg.train_pairs), cfg.max_len,
                                   cfg.max_prompt_len)
    lengths = [data.longest_row(e) for e in train]
    batch = data.global_batch(len(train), cfg.batch_size, 0, cfg.seed, lengths)
    bs = [data.collate_pairs([train[i] for i in batch[j:j + 8]], tok.pad, cfg.max_len)
          for j in (0, 8)]
    shapes = [(*b["input_ids"].shape, int((b["targets"] != -100).sum())) for b in bs]
    real = [torch.bincount(b["seq"][b["seq"] >= 0]) for b in bs]  # each sequence's tokens

    def hardware(bw):  # executed: the rows' shapes, the head at the K targets
        return sum(estimate_flops(mcfg, n, t, bw, outputs=k) for n, t, k in shapes)

    def needed(bw):  # by the real tokens
        return sum(model_flops(mcfg, r, k, bw) for r, (_, _, k) in zip(real, shapes))

    policy, reference = hardware(True), hardware(False)  # forward + backward; forward only
    # exact: same counting rules
    assert counted["cache"] == policy and counted["live"] == policy + reference
    ratio = counted["cache"] / counted["live"]
    # 3/(3+1) for matmuls; attention's 2.5x backward moves it slightly
    assert abs(ratio - 0.75) < 0.02
    # The logged utilisations over the patched peak of 1e9 FLOP/s, times the step's time, give back
    # their numerators: HFU the FLOPs that ran (as counted), MFU those the real tokens need. The
    # same floats multiplied back: only rounding differs (1e-9 relative is far above it).
    for ref, live in (("cache", 0), ("live", 1)):
        m, dt = logged[ref], logged[ref]["time/step"] / 1000
        assert m["mfu_hardware"] * 1e9 * dt == pytest.approx(counted[ref], rel=1e-9)
        assert m["mfu"] * 1e9 * dt == pytest.approx(needed(True) + live * needed(False), rel=1e-9)
        assert m["mfu"] < m["mfu_hardware"]  # padding, full attention, recomputed scores
