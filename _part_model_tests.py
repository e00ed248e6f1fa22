# Tests of model.py (to be merged into test_all.py). Tiny configs; float64 where an equivalence
# should hold to rounding, so a tolerance of 1e-10 separates "same math" from "a bug".
import json
import math

import pytest
import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch.utils import flop_counter

from model import (GPT, GPTConfig, estimate_flops, export_gpt2, generate, import_gpt2, load_model,
                   new_kv_cache, read_meta, save_model, token_logprobs)


def tiny_gpt(head="lm", seed=0, **kw):
    torch.manual_seed(seed)
    cfg = GPTConfig(**{**dict(block_size=32, vocab_size=13, n_layer=2, n_head=2, n_embd=16), **kw, "head": head})
    return GPT(cfg).double().eval()


def left_pad(rows, pad):
    P = max(map(len, rows))
    idx = torch.tensor([[pad] * (P - len(r)) + r for r in rows])
    mask = torch.tensor([[False] * (P - len(r)) + [True] * len(r) for r in rows])
    return idx, mask


def test_causality():
    m = tiny_gpt()
    idx = torch.randint(0, 13, (3, 10))
    idx2 = idx.clone()
    idx2[:, 6] = (idx[:, 6] + 1) % 13
    for mask in (None, torch.ones(3, 10, dtype=torch.bool)):  # the is_causal path and the mask path
        a, b = m(idx, mask=mask), m(idx2, mask=mask)
        assert torch.allclose(a[:, :6], b[:, :6], atol=1e-12, rtol=0)
        assert not torch.allclose(a[:, 6:], b[:, 6:])


def naive_sdpa(q, k, v, attn_mask=None, is_causal=False, dropout_p=0.0):
    """softmax(q k^T / sqrt(d)) v written out: a fully masked row is NaN here, as in older SDPA kernels."""
    if is_causal:
        attn_mask = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool).tril()
    s = (q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])).masked_fill(~attn_mask, float("-inf"))
    return s.softmax(-1) @ v


def test_left_padding_invariance_and_no_nan(monkeypatch):
    m = tiny_gpt()
    rows = [[1, 2, 3, 4, 5, 6], [7, 8], [9, 10, 11, 12]]
    idx, mask = left_pad(rows, pad=0)
    targets = torch.where(mask, idx, -100).roll(-1, dims=1)
    targets[:, -1] = -100
    targets[~mask] = -100  # a pad does not predict the first prompt token
    logits = m(idx, mask=mask)
    assert torch.isfinite(logits).all()  # left-pad queries see only themselves, never an all -inf row
    lp = token_logprobs(logits, targets)
    # explicit position ids give the same numbers as the default derived from the mask
    pos = (mask.long().cumsum(1) - 1).clamp(min=0)
    assert torch.allclose(m(idx, mask=mask, pos=pos), logits, atol=0, rtol=0)
    for b, r in enumerate(rows):
        x = torch.tensor([r])
        alone = token_logprobs(m(x), torch.tensor([r[1:] + [-100]]))
        assert torch.allclose(lp[b, -len(r):], alone[0], atol=1e-10, rtol=0)
        assert (lp[b, :-len(r)] == 0).all()
    # the attention written out (NaN on a fully masked row) agrees with SDPA, pads included: no NaN
    monkeypatch.setattr(F, "scaled_dot_product_attention", naive_sdpa)
    assert torch.allclose(m(idx, mask=mask), logits, atol=1e-10, rtol=0)


def test_gpt2_init():
    m = tiny_gpt(n_layer=8, n_embd=64)
    for name, p in m.named_parameters():
        if name.endswith("c_proj.weight"):  # residual projections: 0.02 / sqrt(2 * n_layer) = 0.005
            assert p.std().item() == pytest.approx(0.02 / math.sqrt(16), rel=0.05)
        elif name.endswith(("c_attn.weight", "c_fc.weight", "wte.weight", "wpe.weight")):
            assert p.std().item() == pytest.approx(0.02, rel=0.05)
        elif name.endswith(".bias"):
            assert (p == 0).all()


def test_token_logprobs_matches_naive_gather():
    torch.manual_seed(0)
    logits = torch.randn(2, 5, 7, dtype=torch.bfloat16)
    targets = torch.randint(0, 7, (2, 5))
    targets[0, 1] = targets[1, 4] = -100
    for temp in (1.0, 0.7):
        lp = token_logprobs(logits, targets, temperature=temp)
        assert lp.dtype == torch.float32
        ref = torch.log_softmax(logits.float() / temp, -1)
        for b in range(2):
            for t in range(5):
                want = 0.0 if targets[b, t] == -100 else ref[b, t, targets[b, t]].item()
                assert lp[b, t].item() == pytest.approx(want, abs=1e-6)
    assert lp[0, 1].item() == 0.0 and lp[1, 4].item() == 0.0  # exactly zero, not just small


def test_kv_cache_steps_equal_full_forward():
    m = tiny_gpt()
    idx, mask = left_pad([[1, 2, 3, 4, 5], [6, 7], [8, 9, 10]], pad=0)
    full = m(idx, mask=mask)
    cache = new_kv_cache(m, 3, 5, "cpu", torch.float64)
    steps = [m(idx[:, :2], mask=mask[:, :2], kv_cache=cache)]  # prefill 2, then one token at a time
    steps += [m(idx[:, t:t + 1], mask=mask[:, :t + 1], kv_cache=cache) for t in range(2, 5)]
    assert torch.allclose(torch.cat(steps, 1)[mask], full[mask], atol=1e-10, rtol=0)


def test_generate_logprobs_equal_full_forward():
    m = tiny_gpt()
    prompts = [[1, 2, 3, 4, 5], [6], [7, 8, 9]]
    m.train()  # generate must switch to eval itself and switch back
    out = generate(m, prompts, 12, eos_id=0, pad_id=12, temperature=0.8, top_k=5,
                   generator=torch.Generator().manual_seed(1))
    assert m.training
    tok, mask, resp = out["tokens"], out["mask"], out["response_mask"]
    targets = torch.where(resp[:, 1:], tok[:, 1:], -100)
    lp = token_logprobs(m.eval()(tok, mask=mask)[:, :-1], targets, temperature=0.8)
    # generate stores logprobs in fp32: its rounding (~2e-7 at |lp| ~ 3) sets the tolerance
    assert torch.allclose(lp.float(), out["logprobs"][:, 1:], atol=1e-6, rtol=0)
    assert (out["logprobs"][~resp] == 0).all() and (out["logprobs"][resp] < 0).all()
    again = generate(m, prompts, 12, eos_id=0, pad_id=12, temperature=0.8, top_k=5,
                     generator=torch.Generator().manual_seed(1))
    assert torch.equal(again["tokens"], tok)  # a seeded generator reproduces the samples


def test_batched_generation_equals_alone():
    # top_k=1 is greedy: no sampling noise, and in float64 an argmax cannot flip on rounding, so the
    # tokens must be identical and the log-probs equal up to their fp32 storage (1e-6)
    m = tiny_gpt()
    prompts = [[1, 2, 3, 4, 5, 6], [7], [8, 9, 10]]
    kw = dict(eos_id=0, pad_id=12, top_k=1)
    batch = generate(m, prompts, 10, **kw)
    P = 6
    for b, p in enumerate(prompts):
        alone = generate(m, [p], 10, **kw)
        n = alone["tokens"].shape[1] - len(p)
        assert torch.equal(batch["tokens"][b, P:P + n], alone["tokens"][0, len(p):])
        assert torch.allclose(batch["logprobs"][b, P:P + n], alone["logprobs"][0, len(p):], atol=1e-6, rtol=0)
        assert not batch["response_mask"][b, P + n:].any()


def test_generate_stops_at_eos():
    m = tiny_gpt(vocab_size=4)  # near-uniform logits over 4 tokens: EOS comes soon in every row
    eos, pad = 1, 3
    out = generate(m, [[2, 2], [0], [2, 0, 2]], 28, eos_id=eos, pad_id=pad,
                   generator=torch.Generator().manual_seed(0))
    tok, mask, resp = out["tokens"], out["mask"], out["response_mask"]
    P = 3
    assert tok.shape[1] < P + 28  # stopped early: every row ended
    assert torch.equal(mask[:, :P], torch.tensor([[0, 1, 1], [0, 0, 1], [1, 1, 1]], dtype=torch.bool))
    assert not resp[:, :P].any() and torch.equal(mask[:, P:], resp[:, P:])
    for b in range(3):
        ends = (tok[b, P:] == eos).nonzero()
        e = P + int(ends[0])  # first EOS
        assert resp[b, P:e + 1].all() and not resp[b, e + 1:].any()  # EOS included, nothing after
        assert (tok[b, e + 1:] == pad).all()
    assert (tok[:, -1] == eos).any()  # the last column is some row's EOS


def test_scalar_head():
    m = tiny_gpt("scalar")
    idx, mask = left_pad([[1, 2, 3], [4]], pad=0)
    v = m(idx, mask=mask)
    assert v.shape == (2, 3) and (v == 0).all()  # zero-initialised head: no preference before training
    v.sum().backward()
    assert m.score.weight.grad.abs().sum() > 0  # ...but it learns from the first step
    with torch.no_grad():
        m.score.weight.normal_()
    assert torch.allclose(m(idx, mask=mask)[1, -1:], m(torch.tensor([[4]]))[0], atol=1e-10, rtol=0)


def test_save_load_round_trip(tmp_path):
    for head in ("lm", "scalar"):
        m = tiny_gpt(head)
        path = str(tmp_path / head / "model.safetensors")
        save_model(m, path, {"stage": "sft", "step": 7})
        with safe_open(path, framework="pt") as f:
            keys = set(f.keys())
        assert "lm_head.weight" not in keys and "transformer.wte.weight" in keys  # tied weight stored once
        m2, meta = load_model(path)
        assert meta == {"stage": "sft", "step": 7} and read_meta(path) == (m.config, meta)
        idx = torch.randint(0, 13, (2, 8))
        assert torch.equal(m2.double()(idx), m(idx))
        if head == "lm":
            assert m2.lm_head.weight is m2.transformer.wte.weight  # still tied after load
        assert not (tmp_path / head / "model.safetensors.tmp").exists()


def fake_hf_gpt2(V=11, C=16, L=2, n_pos=24, prefix="transformer."):
    """A GPT-2 state dict with Hugging Face's names and Conv1D (in, out) weight shapes."""
    g = torch.Generator().manual_seed(0)
    r = lambda *s: torch.randn(*s, generator=g) * 0.3
    sd = {"wte.weight": r(V, C), "wpe.weight": r(n_pos, C), "ln_f.weight": 1 + r(C), "ln_f.bias": r(C)}
    for i in range(L):
        h = f"h.{i}."
        sd |= {h + "ln_1.weight": 1 + r(C), h + "ln_1.bias": r(C), h + "ln_2.weight": 1 + r(C), h + "ln_2.bias": r(C),
               h + "attn.c_attn.weight": r(C, 3 * C), h + "attn.c_attn.bias": r(3 * C),
               h + "attn.c_proj.weight": r(C, C), h + "attn.c_proj.bias": r(C),
               h + "mlp.c_fc.weight": r(C, 4 * C), h + "mlp.c_fc.bias": r(4 * C),
               h + "mlp.c_proj.weight": r(4 * C, C), h + "mlp.c_proj.bias": r(C),
               h + "attn.bias": torch.ones(1, 1, n_pos, n_pos).tril(), h + "attn.masked_bias": torch.tensor(-1e4)}
    sd = {prefix + k: v for k, v in sd.items()}
    sd["lm_head.weight"] = sd[prefix + "wte.weight"].clone()
    return sd


def reference_gpt2(sd, idx, n_head):
    """GPT-2's forward written out with plain ops over the Hugging Face dict (x @ W for Conv1D)."""
    sd = {k.removeprefix("transformer."): v.double() for k, v in sd.items()}
    T = idx.shape[1]
    ln = lambda x, p: F.layer_norm(x, x.shape[-1:], sd[p + ".weight"], sd[p + ".bias"], eps=1e-5)
    gelu_new = lambda x: 0.5 * x * (1 + torch.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x ** 3)))
    x = sd["wte.weight"][idx] + sd["wpe.weight"][:T]
    L = sum(k.endswith("ln_1.weight") for k in sd)
    for i in range(L):
        p = f"h.{i}."
        q, k, v = (ln(x, p + "ln_1") @ sd[p + "attn.c_attn.weight"] + sd[p + "attn.c_attn.bias"]).chunk(3, -1)
        q, k, v = (t.unflatten(-1, (n_head, -1)).transpose(1, 2) for t in (q, k, v))
        att = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
        att = att.masked_fill(torch.ones(T, T).tril() == 0, float("-inf")).softmax(-1)
        y = (att @ v).transpose(1, 2).flatten(2)
        x = x + y @ sd[p + "attn.c_proj.weight"] + sd[p + "attn.c_proj.bias"]
        hdn = gelu_new(ln(x, p + "ln_2") @ sd[p + "mlp.c_fc.weight"] + sd[p + "mlp.c_fc.bias"])
        x = x + hdn @ sd[p + "mlp.c_proj.weight"] + sd[p + "mlp.c_proj.bias"]
    return ln(x, "ln_f") @ sd["wte.weight"].T


def test_gpt2_import_export(tmp_path):
    for prefix in ("transformer.", ""):
        d = tmp_path / f"hf{prefix}"
        d.mkdir()
        sd = fake_hf_gpt2(prefix=prefix)
        save_file(sd, str(d / "model.safetensors"))
        (d / "config.json").write_text(json.dumps({"n_head": 4, "activation_function": "gelu_new"}))
        m = import_gpt2(str(d / "model.safetensors")).double()
        assert (m.config.n_head, m.config.n_layer, m.config.block_size, m.config.vocab_size) == (4, 2, 24, 11)
        idx = torch.randint(0, 11, (2, 9))
        assert torch.allclose(m(idx), reference_gpt2(sd, idx, n_head=4), atol=1e-10, rtol=0)
        export_gpt2(m.float(), str(tmp_path / "out"))
        out = load_file(str(tmp_path / "out" / "model.safetensors"))
        want = {"transformer." + k.removeprefix("transformer."): v for k, v in sd.items()
                if not k.endswith((".attn.bias", ".attn.masked_bias")) and k != "lm_head.weight"}
        assert out.keys() == want.keys() and all(torch.equal(out[k], want[k]) for k in want)
        cfg = json.loads((tmp_path / "out" / "config.json").read_text())
        assert cfg["model_type"] == "gpt2" and cfg["activation_function"] == "gelu_new" and cfg["n_head"] == 4
        assert (cfg["n_positions"], cfg["n_ctx"], cfg["tie_word_embeddings"]) == (24, 24, True)
    m = import_gpt2(str(d / "model.safetensors"), block_size=10)  # a shorter context keeps wpe's first rows
    assert torch.equal(m.transformer.wpe.weight, sd["wpe.weight"][:10])
    m = import_gpt2(str(d / "model.safetensors"), vocab_size=12)  # room for the PAD our tokenizer adds
    assert m.config.vocab_size == 12 and torch.equal(m.transformer.wte.weight[:11], sd["wte.weight"])
    assert m.lm_head.weight is m.transformer.wte.weight and m(torch.tensor([[11, 3]])).shape == (1, 2, 12)


# On CPU, SDPA runs aten._scaled_dot_product_flash_attention_for_cpu (+ _backward), which torch 2.13's
# FlopCounterMode has no formula for (it records 0). Its arguments start (q, k, v) and (grad_out, q, k, v)
# like the CUDA flash kernels', so we count them with torch's own formulas for those.
aten = torch.ops.aten
CPU_SDPA = {aten._scaled_dot_product_flash_attention_for_cpu:
            lambda q, k, v, *a, **kw: flop_counter.sdpa_flop_count(q, k, v),
            aten._scaled_dot_product_flash_attention_for_cpu_backward:
            lambda g, q, k, v, *a, **kw: flop_counter.sdpa_backward_flop_count(g, q, k, v)}


def test_estimate_flops_matches_flop_counter():
    for head in ("lm", "scalar"):
        m = tiny_gpt(head).float().train()
        cfg, B, T = m.config, 3, 20
        idx = torch.randint(0, 13, (B, T))
        with flop_counter.FlopCounterMode(display=False, custom_mapping=CPU_SDPA) as fc:
            m(idx)
        assert fc.get_total_flops() == estimate_flops(cfg, B, T)  # exact
        with flop_counter.FlopCounterMode(display=False, custom_mapping=CPU_SDPA) as fc:
            m(idx).float().pow(2).mean().backward()  # a training step: forward + backward
        assert fc.get_total_flops() == estimate_flops(cfg, B, T, backward=True)
        with flop_counter.FlopCounterMode(display=False) as fc:
            m(idx)
        attn = cfg.n_layer * 4 * B * T * T * cfg.n_embd
        # stock counter: attention counted if this torch knows the CPU kernel, 0 if not (torch 2.13)
        assert fc.get_total_flops() in (estimate_flops(cfg, B, T), estimate_flops(cfg, B, T) - attn)
