"""The GPT every stage trains, scores and samples from: GPT-2's architecture at any size.

Smallest pieces first: config -> attention -> MLP -> block -> GPT (LM or scalar head) -> per-token
log-probs -> KV-cache generation (PPO's rollout engine) -> FLOPs -> safetensors save/load -> GPT-2
weight import/export. The forward math is GPT-2's exactly (Radford et al. 2019), so weights imported
from Hugging Face give Hugging Face's logits. Imports nothing from the project.
Its tests: pytest test_all.py -k "not dpo and not ppo"
Benchmark:  python model.py    # KV-cache generation against recomputing the whole prefix, side by side
"""
import json
import math
import os
from dataclasses import asdict, dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch.utils import flop_counter


@dataclass
class GPTConfig:
    block_size: int = 64    # longest sequence, tokens (prompt + response); rows of the position table
    vocab_size: int = 512   # tokens in the vocabulary, EOS and PAD included
    n_layer: int = 4        # transformer blocks
    n_head: int = 4         # attention heads; n_embd must divide by it
    n_embd: int = 128       # width of the residual stream
    dropout: float = 0.0    # on embeddings, attention probs, residual branches (0 for RL: log-probs must be exact)
    bias: bool = True       # biases in Linear and LayerNorm, as GPT-2
    head: str = "lm"        # "lm": logits over the vocab (tied to wte); "scalar": one value per position


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        assert cfg.n_embd % cfg.n_head == 0, f"n_embd {cfg.n_embd} must divide by n_head {cfg.n_head}"
        self.n_head, self.dropout = cfg.n_head, cfg.dropout
        self.c_attn = nn.Linear(cfg.n_embd, 3 * cfg.n_embd, bias=cfg.bias)  # q, k, v in one matmul
        self.c_proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.resid_dropout = nn.Dropout(cfg.dropout)

    def forward(self, x, attn_mask=None, cache=None, start=0):
        """x (B,T,C). attn_mask (B,1,T,S) bool, True where a query may look; None: plain causal.
        cache: this layer's (k, v), each (B,H,L,hd); x's keys and values are written at start..start+T-1
        and attention reads 0..start+T-1 (S = start + T)."""
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))  # (B,H,T,hd)
        if cache is not None:
            ck, cv = cache
            ck[:, :, start:start + T], cv[:, :, start:start + T] = k, v
            k, v = ck[:, :, :start + T], cv[:, :, :start + T]
        # softmax(q k^T / sqrt(hd)) v, fused; is_causal is the fast path for unpadded (or right-padded) batches
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=attn_mask is None,
                                           dropout_p=self.dropout if self.training else 0.0)
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.c_fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd, bias=cfg.bias)
        self.c_proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x):
        # GPT-2 uses the tanh approximation of GELU ("gelu_new"); exact erf GELU would shift imported logits
        return self.dropout(self.c_proj(F.gelu(self.c_fc(x), approximate="tanh")))


class Block(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd, eps=1e-5, bias=cfg.bias)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd, eps=1e-5, bias=cfg.bias)
        self.mlp = MLP(cfg)

    def forward(self, x, attn_mask=None, cache=None, start=0):
        # pre-LayerNorm (GPT-2 sec. 2.3): the residual stream itself is never normalised
        x = x + self.attn(self.ln_1(x), attn_mask, cache, start)
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        assert cfg.head in ("lm", "scalar"), f"head must be 'lm' or 'scalar', got {cfg.head!r}"
        self.config = cfg
        # module names are Hugging Face GPT-2's, so import/export is a rename and a Conv1D transpose
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(cfg.vocab_size, cfg.n_embd),
            wpe=nn.Embedding(cfg.block_size, cfg.n_embd),  # learned absolute positions
            drop=nn.Dropout(cfg.dropout),
            h=nn.ModuleList([Block(cfg) for _ in range(cfg.n_layer)]),
            ln_f=nn.LayerNorm(cfg.n_embd, eps=1e-5, bias=cfg.bias),
        ))
        if cfg.head == "lm":
            self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
            self.lm_head.weight = self.transformer.wte.weight  # tied in/out embedding, as GPT-2 (Press & Wolf 2017)
        else:
            self.score = nn.Linear(cfg.n_embd, 1)
        self.apply(self._init_weights)
        for name, p in self.named_parameters():
            # GPT-2 sec. 2.3: scale residual projections by 1/sqrt(N), N = 2 residual branches per block,
            # so the residual stream's variance does not grow with depth
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * cfg.n_layer))
        if cfg.head == "scalar":
            # A zero head makes every value exactly 0 at the start: the reward model prefers neither
            # response (Bradley-Terry loss log 2) and the critic predicts no return, so early updates are
            # not spent undoing a random offset. One output unit has no symmetry to break, and the
            # head's own gradient (the features) is non-zero, so it learns from the first step.
            nn.init.zeros_(self.score.weight)

    def _init_weights(self, m):
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, mean=0.0, std=0.02)  # GPT-2's init
        if isinstance(m, nn.Linear) and m.bias is not None:
            nn.init.zeros_(m.bias)

    def forward(self, idx, mask=None, pos=None, kv_cache=None):
        """idx (B,T) long. mask (B,S) bool, True on real tokens; S = T, or (tokens already in the cache) + T.
        pos (B,T) long position ids; default: from the mask (real tokens before, so left padding does not
        shift positions), or 0..T-1 without one. kv_cache: from new_kv_cache; needs a mask.
        Returns logits (B,T,V) for head "lm", values (B,T) for head "scalar"."""
        B, T = idx.shape
        assert kv_cache is None or mask is not None, "a KV cache needs the mask of everything it holds"
        S = T if mask is None else mask.shape[1]
        start = S - T  # tokens already in the cache
        assert S <= self.config.block_size, f"sequence of {S} tokens > block_size {self.config.block_size}"
        if pos is None:
            pos = (torch.arange(T, device=idx.device).expand(B, T) if mask is None
                   else (mask.long().cumsum(1) - 1).clamp(min=0)[:, start:])
        attn_mask = None
        if mask is not None:
            i = torch.arange(start, S, device=idx.device)[:, None]  # (T,1) query positions
            j = torch.arange(S, device=idx.device)[None, :]         # (1,S) key positions
            # causal and real, OR itself: a left-pad query has no real key to its left, and a row of all
            # -inf is softmax 0/0 = NaN in some SDPA kernels and versions (torch 2.13 on CPU returns 0;
            # we do not rely on it). Real queries see themselves anyway, so they are unchanged.
            attn_mask = ((j <= i) & mask[:, None, None, :]) | (j == i)  # (B,1,T,S)
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))
        for n, block in enumerate(self.transformer.h):
            x = block(x, attn_mask, None if kv_cache is None else kv_cache[n], start)
        x = self.transformer.ln_f(x)
        return self.lm_head(x) if self.config.head == "lm" else self.score(x).squeeze(-1)


def token_logprobs(logits, targets, temperature=1.0):
    """THE per-token log-prob used by every stage, so cached and live numbers agree.
    logits (B,T,V), targets (B,T) long, -100 = ignore. Returns (B,T): log softmax(logits / temperature)
    at the targets, in fp32 (fp64 stays fp64, for gradient checks), exactly 0.0 where targets == -100.
    A response's log-prob is token_logprobs(...).sum(-1)."""
    # bf16 log-softmax loses ~3 significant digits, enough to bias the PPO ratio and DPO's margins
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    logp = F.log_softmax(logits / temperature, dim=-1)
    keep = targets != -100
    lp = logp.gather(-1, torch.where(keep, targets, 0).unsqueeze(-1)).squeeze(-1)
    return torch.where(keep, lp, 0.0)


def new_kv_cache(model, B, max_len, device, dtype):
    """One preallocated (k, v) pair per layer, each (B, n_head, max_len, head_dim), filled by forward.
    Left empty: attention only reads slots an earlier call wrote (pads' too, masked), never the rest."""
    c = model.config
    shape = (B, c.n_head, max_len, c.n_embd // c.n_head)
    return [(torch.empty(shape, device=device, dtype=dtype), torch.empty(shape, device=device, dtype=dtype))
            for _ in range(c.n_layer)]


@torch.no_grad()
def generate(model, prompts, max_new_tokens, eos_id, pad_id, temperature=1.0, top_k=None,
             generator=None, uniforms=None):
    """prompts: list of B lists of token ids, of any lengths >= 1. Left-pads them to P = max length, then
    samples from softmax(logits / temperature) (top_k: only the k likeliest) with a KV cache, in eval
    mode (no dropout); the model's train/eval mode is restored after. Each row stops at its own EOS
    (kept, then pad_id); stops early when all rows have ended. A token is drawn by inverse CDF: the
    first whose cumulative probability exceeds u, u ~ U[0,1), one number per row and step:
    uniforms[b, i] for row b's i-th new token when given ((B, >= max_new_tokens), e.g. rows of one
    tensor drawn for a whole global batch, so a row's sample does not depend on which rank or batch
    it is in), else drawn from `generator` step by step.
    Returns dict, all (B, P+N), N <= max_new_tokens:
      tokens long          left-padded prompt, response, then pad_id
      mask bool            True on real tokens (prompt and response, EOS included)
      response_mask bool   True on sampled tokens up to and including EOS
      logprobs fp32        log-prob of each sampled token under softmax(logits / temperature), no top-k
                           filtering in this number (token_logprobs on forward(tokens, mask=mask) gives
                           the same); 0 elsewhere"""
    assert model.config.head == "lm", "generate needs the LM head"
    assert min(map(len, prompts)) > 0, "every prompt needs at least one token (e.g. EOS as BOS)"
    assert temperature > 0, "temperature must be > 0 (top_k=1 is greedy)"
    B, P = len(prompts), max(map(len, prompts))
    assert P + max_new_tokens <= model.config.block_size, \
        f"prompt {P} + max_new_tokens {max_new_tokens} > block_size {model.config.block_size}"
    p0 = next(model.parameters())
    L = P + max_new_tokens
    tokens = torch.full((B, L), pad_id, dtype=torch.long, device=p0.device)
    mask = torch.zeros(B, L, dtype=torch.bool, device=p0.device)
    for b, p in enumerate(prompts):
        tokens[b, P - len(p):P] = torch.tensor(p, dtype=torch.long)
        mask[b, P - len(p):P] = True
    logprobs = torch.zeros(B, L, device=p0.device)
    done = torch.zeros(B, dtype=torch.bool, device=p0.device)
    cache = new_kv_cache(model, B, L, p0.device, p0.dtype)
    was_training = model.training
    model.eval()
    try:
        logits = model(tokens[:, :P], mask=mask[:, :P], kv_cache=cache)[:, -1]  # prefill: the whole prompt at once
        t = P
        while t < L and not done.all():
            x = logits.float() / temperature
            if top_k is not None:
                kth = torch.topk(x, min(top_k, x.shape[-1])).values[:, -1:]
                x = x.masked_fill(x < kth, float("-inf"))
            u = (uniforms[:, t - P] if uniforms is not None
                 else torch.rand(B, device=p0.device, generator=generator))
            # in fp64, u·total < total: the token found has probability > 0 (never a top-k cut one)
            cdf = F.softmax(x, dim=-1).double().cumsum(-1)
            v = (u.double() * cdf[:, -1]).unsqueeze(1)
            nxt = torch.searchsorted(cdf, v, right=True).squeeze(1)
            nxt = torch.where(done, pad_id, nxt)  # an ended row gets pad, masked out
            tokens[:, t], mask[:, t] = nxt, ~done
            lp = token_logprobs(logits[:, None], nxt[:, None], temperature)[:, 0]
            logprobs[:, t] = torch.where(done, 0.0, lp)
            done |= nxt == eos_id
            t += 1
            if t < L and not done.all():  # one token in, one step of the cache
                logits = model(tokens[:, t - 1:t], mask=mask[:, :t], kv_cache=cache)[:, -1]
    finally:
        model.train(was_training)
    response_mask = mask.clone()
    response_mask[:, :P] = False
    return dict(tokens=tokens[:, :t], mask=mask[:, :t], response_mask=response_mask[:, :t], logprobs=logprobs[:, :t])


def estimate_flops(config, B, T, backward=False):
    """Analytic FLOPs of one forward over a (B,T) batch, or of forward + backward (a training step) with
    backward=True, counted as torch.utils.flop_counter.FlopCounterMode counts them: a matmul is 2*m*n*k
    and its backward 2x that; fused scaled_dot_product_attention is 2 bmm forward (q k^T, att v) and
    5 bmm backward (scores recomputed), over the full T x T (no causal discount); nothing else counts.
    Found with torch 2.13: on CPU, SDPA runs _scaled_dot_product_flash_attention_for_cpu, which
    FlopCounterMode does not know (it records 0 for attention); CUDA's flash/efficient kernels are
    counted as here. With dropout > 0 in training, SDPA falls back to plain bmms (backward 4 bmm, not 5)."""
    C, L, N = config.n_embd, config.n_layer, B * T
    head = config.vocab_size if config.head == "lm" else 1
    mm = L * 2 * N * C * (3 * C + C + 4 * C + 4 * C) + 2 * N * C * head  # c_attn, attn c_proj, c_fc, mlp c_proj; head
    attn = L * 2 * (2 * B * T * T * C)  # per layer 2 bmm of 2*T*T*hd for each of B*H heads
    return mm + attn if not backward else 3 * mm + (7 * attn) // 2  # +2x matmuls, +2.5x attention


# torch 2.13's FlopCounterMode has no formula for the CPU flash-attention kernels SDPA dispatches to (it
# counts them 0). Their arguments start (q, k, v) and (grad_out, q, k, v) like the CUDA flash kernels', so
# torch's own formulas for those count them, and the count can be compared with estimate_flops exactly.
CPU_SDPA_FLOPS = {
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu:
        lambda q, k, v, *a, **kw: flop_counter.sdpa_flop_count(q, k, v),
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward:
        lambda g, q, k, v, *a, **kw: flop_counter.sdpa_backward_flop_count(g, q, k, v)}


def count_flops(fn):
    """(fn(), the FLOPs torch's FlopCounterMode counted while it ran, CPU attention included)."""
    with flop_counter.FlopCounterMode(display=False, custom_mapping=CPU_SDPA_FLOPS) as fc:
        out = fn()
    return out, fc.get_total_flops()


def save_model(model, path, meta):
    """safetensors with metadata {"config": GPTConfig json, "meta": json of provenance (stage, step...)}.
    The tied lm_head is stored once (as wte). Written to path + ".tmp", then renamed: never half a file."""
    sd = {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items() if k != "lm_head.weight"}
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    save_file(sd, path + ".tmp", metadata={"config": json.dumps(asdict(model.config)), "meta": json.dumps(meta)})
    os.replace(path + ".tmp", path)


def read_meta(path):
    """(GPTConfig, meta dict) from a save_model file's metadata, without reading the tensors."""
    with safe_open(path, framework="pt") as f:
        md = f.metadata() or {}
    if "config" not in md:
        raise ValueError(f"{path}: no GPTConfig in its metadata (a Hugging Face GPT-2 file? use import_gpt2)")
    return GPTConfig(**json.loads(md["config"])), json.loads(md["meta"])


def load_model(path, device="cpu"):
    """(GPT, meta dict) from a save_model file, lm_head tied to wte again."""
    cfg, meta = read_meta(path)
    model = GPT(cfg)
    sd = load_file(path)
    if cfg.head == "lm":
        sd["lm_head.weight"] = sd["transformer.wte.weight"]  # load_state_dict copies in place: the tie survives
    model.load_state_dict(sd)
    return model.to(device), meta


# Hugging Face's GPT-2 stores these as Conv1D, whose weight is (in, out): the transpose of nn.Linear's
CONV1D = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")


def import_gpt2(path, block_size=None, vocab_size=None):
    """GPT from a Hugging Face GPT-2 model.safetensors (keys with or without "transformer."). The config
    comes from the shapes; n_head from the config.json beside it, else n_embd // 64 (the head size of all
    four released GPT-2s). block_size < n_positions keeps the first rows of the position table.
    vocab_size > GPT-2's 50257 appends embedding rows (GPT-2 has no PAD; our tokenizer adds it as 50257)."""
    sd = {k.removeprefix("transformer."): v for k, v in load_file(path).items()}
    # attn.bias / attn.masked_bias are the causal-mask buffers of older transformers, not weights
    sd = {k: v for k, v in sd.items() if k.split(".")[-2:] not in (["attn", "bias"], ["attn", "masked_bias"])}
    lm = sd.pop("lm_head.weight", None)
    assert lm is None or torch.equal(lm, sd["wte.weight"]), "lm_head differs from wte: not a tied GPT-2"
    hf_path = os.path.join(os.path.dirname(path), "config.json")
    hf = json.load(open(hf_path)) if os.path.exists(hf_path) else {}
    assert hf.get("activation_function", "gelu_new") == "gelu_new", f"{hf_path}: only gelu_new is GPT-2's"
    V, C = sd["wte.weight"].shape
    n_pos = sd["wpe.weight"].shape[0]
    block_size = block_size or n_pos
    assert block_size <= n_pos, f"block_size {block_size} > the {n_pos} positions GPT-2 learned"
    cfg = GPTConfig(block_size=block_size, vocab_size=V, n_embd=C, n_head=hf.get("n_head", C // 64),
                    n_layer=sum(k.endswith(".ln_1.weight") for k in sd), bias="h.0.attn.c_attn.bias" in sd)
    sd["wpe.weight"] = sd["wpe.weight"][:block_size]
    if vocab_size and vocab_size > V:  # new rows get GPT-2's init; PAD is only ever read, never predicted
        extra = torch.randn(vocab_size - V, C, dtype=sd["wte.weight"].dtype) * 0.02
        sd["wte.weight"], cfg.vocab_size = torch.cat([sd["wte.weight"], extra]), vocab_size
    sd = {"transformer." + k: v.t() if k.endswith(CONV1D) else v for k, v in sd.items()}
    sd["lm_head.weight"] = sd["transformer.wte.weight"]
    model = GPT(cfg)
    model.load_state_dict(sd)
    return model


def export_gpt2(model, out_dir):
    """out_dir/model.safetensors in Hugging Face's layout (Conv1D weights, lm_head tied so stored once)
    and out_dir/config.json, loadable by transformers' GPT2LMHeadModel.from_pretrained(out_dir)."""
    c = model.config
    assert c.head == "lm" and c.bias, "the GPT-2 layout needs the LM head and biases"
    sd = {k: (v.t() if k.endswith(CONV1D) else v).detach().contiguous().cpu()
          for k, v in model.state_dict().items() if k != "lm_head.weight"}
    hf = dict(architectures=["GPT2LMHeadModel"], model_type="gpt2", vocab_size=c.vocab_size, n_positions=c.block_size,
              n_ctx=c.block_size, n_embd=c.n_embd, n_layer=c.n_layer, n_head=c.n_head, activation_function="gelu_new",
              layer_norm_epsilon=1e-5, tie_word_embeddings=True, resid_pdrop=c.dropout, embd_pdrop=c.dropout,
              attn_pdrop=c.dropout)
    os.makedirs(out_dir, exist_ok=True)
    out = os.path.join(out_dir, "model.safetensors")
    save_file(sd, out + ".tmp", metadata={"format": "pt"})  # transformers checks this "format" entry
    os.replace(out + ".tmp", out)
    with open(os.path.join(out_dir, "config.json.tmp"), "w") as f:
        json.dump(hf, f, indent=2)
    os.replace(os.path.join(out_dir, "config.json.tmp"), os.path.join(out_dir, "config.json"))


# -----------------------------------------------------------------------------
# what a resident model costs a training job (dpo.py and ppo.py print it at start; compare.py tabulates it)


def anatomy(models, T=None):
    """What each resident model costs the job. models: {name: nn.Module (a GPT)}; one with trainable
    parameters is trained with AdamW (fp32 weights, grads and two moments), a frozen one is only held
    and run forward. T: the sequence length the FLOPs per token are counted at (attention grows with T;
    default: each model's block_size). Returns one dict per model, then a "total" row: the loop's
    FLOPs per token and the job's bytes. Activations are not counted: they scale with the batch."""
    rows = []
    for name, m in models.items():
        params = list(m.parameters())  # a tied lm_head is the same Parameter as wte: counted once
        trainable, t = any(p.requires_grad for p in params), T or m.config.block_size
        w = sum(p.numel() * p.element_size() for p in params)
        r = dict(model=name, state="trainable" if trainable else "frozen", params=sum(p.numel() for p in params),
                 weights_bytes=w, grads_bytes=w if trainable else 0, adamw_bytes=2 * w if trainable else 0,
                 flops_per_token=estimate_flops(m.config, 1, t, backward=trainable) / t)  # fwd+bwd, or fwd
        rows.append({**r, "total_bytes": r["weights_bytes"] + r["grads_bytes"] + r["adamw_bytes"]})
    rows.append({k: "total" if k == "model" else "" if k == "state" else sum(r[k] for r in rows) for k in rows[0]})
    return rows


def format_anatomy(rows, T):
    cols = ("weights_bytes", "grads_bytes", "adamw_bytes", "total_bytes")
    lines = [f"{'resident':<10} {'state':<9} {'params':>9} {'weights':>8} {'grads':>8} {'AdamW':>8} {'total':>8} "
             f"  FLOPs/token at T={T}"]
    for r in rows:
        mib = " ".join(f"{r[k] / 2**20:>8.2f}" for k in cols)
        lines.append(f"{r['model']:<10} {r['state']:<9} {r['params']:>9,} {mib}   {r['flops_per_token'] / 1e6:.2f} M")
    return "\n".join(lines + ["(bytes in MiB, fp32; activations not counted)"])


if __name__ == "__main__":
    # The rollout engine's speed-up: 64 new tokens with the KV cache (one token through the model per
    # step) against the obvious loop that re-runs the whole prefix each step. Greedy, so both must
    # produce the same tokens; timed interleaved, best of 5 each, on this machine.
    import time
    torch.manual_seed(0)
    m = GPT(GPTConfig(block_size=128, vocab_size=512, n_layer=4, n_head=4, n_embd=128)).eval()
    prompts = torch.randint(2, 512, (16, 16))

    @torch.no_grad()
    def recompute(n=64):
        x = prompts
        for _ in range(n):
            x = torch.cat([x, m(x)[:, -1].argmax(-1, keepdim=True)], 1)
        return x

    def cached(n=64):
        return generate(m, prompts.tolist(), n, eos_id=-1, pad_id=0, top_k=1)["tokens"]

    assert torch.equal(cached(), recompute()), "the KV cache changed the greedy tokens"
    best = {"kv_cache": float("inf"), "recompute": float("inf")}
    for _ in range(5):
        for name, f in (("kv_cache", cached), ("recompute", recompute)):
            t = time.perf_counter()
            f()
            best[name] = min(best[name], time.perf_counter() - t)
    print(f"64 new tokens, batch 16, prompt 16, {sum(p.numel() for p in m.parameters()) / 1e6:.2f}M params, "
          f"{torch.get_num_threads()} threads: KV cache {1000 * best['kv_cache']:.0f} ms | recompute "
          f"{1000 * best['recompute']:.0f} ms | {best['recompute'] / best['kv_cache']:.1f}x faster with the cache")
