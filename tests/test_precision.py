"""bf16, CUDA and torch.compile: the GPU path's numerics, simulated on the CPU and run on CUDA where
there is one (the LM head in fp32, frozen bf16 models, a cache of another precision refused, bf16
runs within bounds of each other); a compiled DDP module skips the all-reduce on micro-steps.

    pytest tests/test_precision.py
"""
import json
import math
import os
import sys
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

import checkpoint
import data
import dpo
import online_dpo
import plumbing
import ppo
import precompute
import services
from meter import anatomy, format_anatomy
from model import GPT, GPTConfig, freeze, load_model, pair_logps, token_logprobs
from plumbing import Dist
from tests.helpers import (ENV_AS_GIVEN, dpo_cfg, dpo_metrics, dpo_pcfg, run_torchrun, run_whole,
                           tiny_gpt, tiny_ppo_config)


# ==================================================================================================
# bf16 and CUDA: the GPU path's numerics, simulated on the CPU and run on CUDA where there is one
# ==================================================================================================

def test_cuda_tests_in_a_child():
    """The suite pins itself to the CPU (top of tests/helpers.py); on a machine with CUDA this
    file's on_cuda tests run here, in a child pytest given the environment as it was."""
    if os.environ.get("TEST_CUDA") == "1":
        pytest.skip("this is the child")
    if torch.version.cuda is None:
        pytest.skip("a CPU build of torch: no CUDA to test")
    cmd = [sys.executable, "-m", "pytest", __file__, "-q", "-k", "on_cuda", "-p",
           "no:cacheprovider"]
    (p,) = run_whole([cmd], 1200, {**ENV_AS_GIVEN, "TEST_CUDA": "1"})
    assert p.returncode == 0, f"the on_cuda tests failed:\n{p.stdout[-6000:]}\n{p.stderr[-2000:]}"
    if " passed" not in p.stdout:
        pytest.skip(f"no GPU visible to the child: {p.stdout.strip().splitlines()[-1]}")


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (on a GPU "
                                "machine, test_cuda_tests_in_a_child runs it)")
ON = [pytest.param("cpu", id="on_cpu"), pytest.param("cuda", id="on_cuda", marks=needs_cuda)]


@pytest.fixture
def bf16(request, monkeypatch):
    """The device a bf16 test runs on: "cuda", where every stage chooses bf16 autocast itself, or
    "cpu" with plumbing.precision replaced, so that the stages take their CUDA path's numerics
    there (bf16 autocast, bf16 frozen models and rollout copy, "bf16" in the cache fingerprint)."""
    if request.param == "cpu":
        for mod in (plumbing, checkpoint, dpo, ppo, online_dpo, precompute, services):
            monkeypatch.setattr(mod, "precision", lambda device: "bf16")
    return request.param


# Per-response error of bf16 autocast against fp32 for the tiny π_ref, measured on the CPU over 512
# responses of the task: 0.0079 mean (max 0.051) with a bf16 LM head, 0.00034 (max 0.0019) with the
# head in fp32, the bf16 trunk's own. E bounds what any two bf16 computations of one response may
# differ by (another batch shape, another device's kernels): 5x the fp32-head maximum.
E = 0.01


def test_lm_head_runs_in_fp32_under_bf16_autocast(tiny):
    model = load_model(f"{tiny.sft}/model.safetensors")[0].eval()
    tok = data.load_tokenizer(f"{tiny.sft}/tokenizer.json")
    ex, _ = data.tokenize_pairs(tok, data.read_pairs(f"{tiny.task}/pairs_val.jsonl")[:64], 64, 16)
    b = data.collate_pairs(ex, tok.pad)
    hidden = {}
    model.transformer.ln_f.register_forward_hook(lambda m, args, out: hidden.setdefault("x", out))
    with torch.no_grad():
        fp32 = pair_logps(model, b["input_ids"], b["targets"]).double()
        hidden.clear()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = model(b["input_ids"])
            lp = token_logprobs(logits, b["targets"]).sum(-1).double()
    # exactly the fp32 matmul of the (bf16 trunk's) hidden state with the fp32 embedding
    assert logits.dtype == torch.float32
    assert torch.equal(logits, F.linear(hidden["x"].float(), model.transformer.wte.weight))
    err = (lp - fp32).abs()  # measured: 0.00033 mean, 0.0018 max; a bf16 head: 0.0088, 0.035
    assert err.mean() < 0.002 and err.max() < E, (err.mean(), err.max())


def test_frozen_bf16_model_is_bit_identical_under_autocast_at_about_half_the_bytes():
    cfg = dict(block_size=32, vocab_size=50, n_layer=2, n_head=2, n_embd=32)
    for head in ("lm", "scalar"):
        torch.manual_seed(0)
        model, x = GPT(GPTConfig(**cfg, head=head)).eval(), torch.randint(0, 50, (3, 20))
        frozen = freeze(load_state(GPT(GPTConfig(**cfg, head=head)), model), bf16=True)
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            assert torch.equal(model(x), frozen(x)), head  # autocast casts to those bf16 values
        assert not any(p.requires_grad for p in frozen.parameters()) and not frozen.training
    assert frozen.transformer.wte.weight.dtype == torch.float32  # embeddings, LayerNorms, heads
    rows = anatomy({"policy": model, "reference": frozen})
    assert [r["dtype"] for r in rows] == ["fp32", "bf16+fp32", ""]
    block_linears = sum(p.numel() for n, p in frozen.named_parameters()
                        if n.startswith("transformer.h.") and ".ln_" not in n)
    assert rows[1]["weights_bytes"] == rows[0]["weights_bytes"] - 2 * block_linears
    assert "bf16+fp32" in format_anatomy(rows, 32)


def load_state(into, model):
    into.load_state_dict(model.state_dict())
    return into


def test_cache_of_another_precision_is_refused(tiny, dpo_cache, monkeypatch):
    cfg = dpo_cfg(tiny, "dpo-precision", steps=1)
    with monkeypatch.context() as m:  # a bf16 run finds the fp32 cache
        for mod in (plumbing, checkpoint, dpo, ppo, online_dpo, precompute, services):
            m.setattr(mod, "precision", lambda device: "bf16")
        with pytest.raises(SystemExit, match=r"stale.*the precision \(fp32 -> bf16\)\. Rebuild"):
            dpo.main(cfg)
        pc = dpo_pcfg(tiny, out="dpo-precision-cache")
        precompute.main(pc)  # a bf16 cache ...
    with pytest.raises(SystemExit, match=r"stale.*the precision \(bf16 -> fp32\)\. Rebuild"):
        dpo.main(replace(cfg, ref_logps=pc.out_dir))  # ... which an fp32 run refuses


def test_compiled_ddp_module_skips_the_all_reduce_on_micro_steps(tmp_path):
    torch.distributed.init_process_group("gloo", init_method=f"file://{tmp_path}/init", rank=0,
                                         world_size=1)
    try:  # torch.compile only wraps here: it compiles at the first call, which never comes
        d = Dist(0, 0, 2, torch.device("cpu"), True, False)  # "two ranks": wrap adds DDP
        model = plumbing.wrap(tiny_gpt(), d, compile=True)
        ddp = model._orig_mod  # DDP inside, compiled outside: DDP's graph splits at its buckets
        assert isinstance(ddp, torch.nn.parallel.DistributedDataParallel)
        with plumbing.sync_grads(model, sync=False):
            assert not ddp.require_backward_grad_sync
        with plumbing.sync_grads(model, sync=True):
            assert ddp.require_backward_grad_sync
    finally:
        torch.distributed.destroy_process_group()


def test_compiled_run_times_its_first_step_as_compile(tiny, dpo_cache, monkeypatch):
    monkeypatch.setattr(torch, "compile", lambda m, **kw: m)  # the loop's bookkeeping, not inductor
    cfg = dpo_cfg(tiny, "dpo-compile", steps=3, stop_after=2, compile=True)
    dpo.main(cfg)
    first, second = dpo_metrics(cfg.out_dir)
    timed = ("time/step", "time/policy_forward", "tokens_per_sec", "mfu")
    assert first["time/compile"] > 0 and not any(k in first for k in timed) and "loss" in first
    assert all(k in second for k in timed) and "time/compile" not in second


def assert_within_bf16_bounds(x, y):
    """Two bf16 runs' metrics at one step, each response's log-prob computed within E of the
    other's: the loss within βE (β = 0.5), the margin within 2βE, and the grad norm within 2%: the
    gradient's per-pair weight β σ(−βh) moves by at most βE = 0.5% at step 1, more after updates."""
    assert abs(x["loss"] - y["loss"]) <= 0.5 * E, (x["loss"], y["loss"])
    assert abs(x["rewards/margins"] - y["rewards/margins"]) <= E
    assert abs(x["grad_norm"] - y["grad_norm"]) <= 0.02 * y["grad_norm"]


@pytest.mark.parametrize("bf16", ON, indirect=True)
def test_bf16_dpo_step_zero_cached_live_and_one_batch(tiny, dpo_cache, bf16):
    pc = dpo_pcfg(tiny, out=f"dpo-bf16-cache-{bf16}")
    precompute.main(pc)  # a bf16 cache, in precompute's micro-batches of 64 pairs
    runs = {}
    for name, kw in (("live", dict(ref="live")), ("cache", {}),  # micro-batches of 8
                     ("one-batch", dict(micro_batch_size=16, stop_after=1))):
        cfg = dpo_cfg(tiny, f"dpo-bf16-{name}-{bf16}", ref_logps=pc.out_dir, **kw)
        dpo.main(cfg)  # (live and cache: also the evaluation, against its own fp32 π_ref)
        runs[name] = dpo_metrics(cfg.out_dir)
    live, cache = runs["live"][0], runs["cache"][0]
    # live: the policy and the bf16 frozen π_ref on one batch: the same bf16 values through the
    # same kernels (on CUDA, SDPA may choose another kernel when grads are needed: within E there)
    if bf16 == "cpu":
        assert live["rewards/chosen"] == live["rewards/margins"] == 0.0
    assert abs(live["loss"] - math.log(2)) <= 0.5 * E and abs(live["rewards/margins"]) <= E
    # cached: the same responses in other batch shapes. With each log-ratio within E and β = 0.5,
    # the loss -log σ(βh) is within βE of ln 2 (slope 1/2, |h| <= 2E) and each reward within βE
    assert abs(cache["loss"] - math.log(2)) <= 0.5 * E and abs(cache["rewards/chosen"]) <= 0.5 * E
    for x, y in zip(runs["cache"], runs["live"]):  # every step
        assert_within_bf16_bounds(x, y)
    # what two ranks change under bf16 besides an fp32 all-reduce is each rank's batch shape: two
    # micro-steps of 8 pairs against one forward of 16 (in one process: one GPU suffices)
    assert_within_bf16_bounds(runs["one-batch"][0], cache)


@needs_cuda
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="two nccl ranks need two GPUs")
def test_bf16_two_ranks_equal_one_process_on_cuda(tiny, dpo_cache):
    pc = dpo_pcfg(tiny, out="dpo-bf16-cache-2ranks")
    precompute.main(pc)
    one = dpo_cfg(tiny, "dpo-bf16-1rank", steps=2, micro_batch_size=16, ref_logps=pc.out_dir)
    dpo.main(one)
    two = dpo_cfg(tiny, "dpo-bf16-2ranks", steps=2, micro_batch_size=4, ref_logps=pc.out_dir)
    run_torchrun("dpo.py", [a for k, v in vars(two).items() if isinstance(v, (str, int, float))
                            and not isinstance(v, bool) for a in (f"--{k}", str(v))])
    for x, y in zip(dpo_metrics(one.out_dir), dpo_metrics(two.out_dir)):  # the bounds above
        assert_within_bf16_bounds(x, y)


@pytest.mark.parametrize("bf16", ON, indirect=True)
def test_bf16_ppo_first_ratio_is_one(tiny, bf16, tmp_path):
    prompts = tmp_path / "eval.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n"
                               for p in data.read_prompts(f"{tiny.task}/prompts_test.jsonl")[:4]))
    sft_file = f"{tiny.sft}/model.safetensors"  # the critic's trunk (with --reward true, no r_φ)
    cfg = replace(tiny_ppo_config(tiny, sft_file, tmp_path / "ppo", str(prompts), reward="true"),
                  iterations=1, mini_batch=8, ppo_epochs=1)  # one minibatch: all ratios at θ_old
    ppo.main(cfg)  # also the bf16 evaluation, against its own fp32 π_ref
    m = dpo_metrics(cfg.out_dir)[0]
    # old log-probs: the trainer's forward over the whole batch; the update's: micro-batches of 2.
    # Per token within e = E/5 (5x the measured maximum per-token error, 0.00043, as E), so
    # approx_kl, the mean of (ρ-1) - log ρ ≈ Δ²/2, is at most e²/2 (measured on the CPU: 0)
    assert m["clipfrac"] == 0.0 and m["approx_kl"] <= (E / 5) ** 2 / 2, m
    # the rollout copy is bf16, as its broadcast says (2 bytes a parameter), and so it scores its
    # samples apart from the trainer: 0.00085 nats per token measured; at most 5x that
    n_params = sum(p.numel() for p in load_model(sft_file)[0].parameters())
    assert m["broadcast_MB"] * 2**20 == 2 * n_params and m["logprob_gap"] <= 5 * 0.00085, m
