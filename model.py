"""The GPT every stage trains, scores and samples from: GPT-2's architecture at any size.

Smallest pieces first: config -> attention -> MLP -> block -> GPT (LM or scalar head) -> per-token
log-probs -> KV-cache generation (PPO's rollout engine) -> FLOPs -> safetensors save/load -> GPT-2
weight import/export. The forward math is GPT-2's exactly (Radford et al. 2019), so weights imported
from Hugging Face give Hugging Face's logits. Imports nothing from the project.
Its tests: pytest test_all.py -k "not dpo and not ppo"

    python model.py     # benchmark: KV-cache generation against recomputing the whole prefix
    python model.py export out/dpo/model.safetensors hf/dpo    # any stage's model, as a folder
                        # that transformers' from_pretrained loads as it is
"""
import json
import math
import os
from dataclasses import asdict, dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import load_file, save
from tokenizers import Tokenizer, processors
from torch.utils import flop_counter


@dataclass
class GPTConfig:
    block_size: int = 64    # longest sequence, tokens (prompt + response); rows of wpe
    vocab_size: int = 512   # tokens in the vocabulary, EOS and PAD included
    n_layer: int = 4        # transformer blocks
    n_head: int = 4         # attention heads; n_embd must divide by it
    n_embd: int = 128       # width of the residual stream
    dropout: float = 0.0    # embeddings, attention, residuals (0 for RL: log-probs must be exact)
    bias: bool = True       # biases in Linear and LayerNorm, as GPT-2
    head: str = "lm"        # "lm": logits over the vocab (tied to wte); "scalar": one per position


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        assert cfg.n_embd % cfg.n_head == 0, \
            f"n_embd {cfg.n_embd} must divide by n_head {cfg.n_head}"
        self.n_head, self.dropout = cfg.n_head, cfg.dropout
        # q, k, v in one matmul
        self.c_attn = nn.Linear(cfg.n_embd, 3 * cfg.n_embd, bias=cfg.bias)
        self.c_proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.resid_dropout = nn.Dropout(cfg.dropout)

    def forward(self, x, attn_mask=None, cache=None, start=0):
        """x (B,T,C). attn_mask (B,1,T,S) bool, True where a query may look; None: plain causal.
        cache: this layer's (k, v), each (B,H,L,hd); x's keys and values are written at
        start..start+T-1 and attention reads 0..start+T-1 (S = start + T)."""
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)
        # (B,H,T,hd)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        if cache is not None:
            ck, cv = cache
            ck[:, :, start:start + T], cv[:, :, start:start + T] = k, v
            k, v = ck[:, :, :start + T], cv[:, :, :start + T]
        # softmax(q k^T / sqrt(hd)) v, fused; is_causal is the fast path for unpadded (or
        # right-padded) batches
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask,
                                           is_causal=attn_mask is None,
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
        # GPT-2 uses the tanh approximation of GELU ("gelu_new"); exact erf GELU would shift
        # imported logits
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
            # tied in/out embedding, as GPT-2 (Press & Wolf 2017)
            self.lm_head.weight = self.transformer.wte.weight
        else:
            self.score = nn.Linear(cfg.n_embd, 1)
        self.apply(self._init_weights)
        for name, p in self.named_parameters():
            # GPT-2 sec. 2.3: scale residual projections by 1/sqrt(N), N = 2 residual branches per
            # block, so the residual stream's variance does not grow with depth
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * cfg.n_layer))
        if cfg.head == "scalar":
            # A zero head makes every value exactly 0 at the start: the reward model prefers
            # neither response (Bradley-Terry loss log 2) and the critic predicts no return, so
            # early updates are not spent undoing a random offset. One output unit has no symmetry
            # to break, and the head's own gradient (the features) is non-zero, so it learns from
            # the first step.
            nn.init.zeros_(self.score.weight)

    def _init_weights(self, m):
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, mean=0.0, std=0.02)  # GPT-2's init
        if isinstance(m, nn.Linear) and m.bias is not None:
            nn.init.zeros_(m.bias)

    def forward(self, idx, mask=None, pos=None, kv_cache=None, at=None):
        """idx (B,T) long. mask (B,S) bool, True on real tokens; S = T, or (tokens already in the
        cache) + T. pos (B,T) long position ids; default: from the mask (real tokens before, so left
        padding does not shift positions), or 0..T-1 without one. kv_cache: from new_kv_cache; needs
        a mask. Returns logits (B,T,V) for head "lm", values (B,T) for head "scalar". With at (B,T)
        bool,
        only the K positions where it is True, in row-major order: (K,V) or (K,)."""
        B, T = idx.shape
        assert kv_cache is None or mask is not None, \
            "a KV cache needs the mask of everything it holds"
        S = T if mask is None else mask.shape[1]
        start = S - T  # tokens already in the cache
        assert S <= self.config.block_size, \
            f"sequence of {S} tokens > block_size {self.config.block_size}"
        if pos is None:
            pos = (torch.arange(T, device=idx.device).expand(B, T) if mask is None
                   else (mask.long().cumsum(1) - 1).clamp(min=0)[:, start:])
        attn_mask = None
        if mask is not None:
            i = torch.arange(start, S, device=idx.device)[:, None]  # (T,1) query positions
            j = torch.arange(S, device=idx.device)[None, :]         # (1,S) key positions
            # causal and real, OR itself: a left-pad query has no real key to its left, and a row of
            # all -inf is softmax 0/0 = NaN in some SDPA kernels and versions (torch 2.13 on CPU
            # returns 0; we do not rely on it). Real queries see themselves anyway, so they are
            # unchanged.
            attn_mask = ((j <= i) & mask[:, None, None, :]) | (j == i)  # (B,1,T,S)
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))
        for n, block in enumerate(self.transformer.h):
            x = block(x, attn_mask, None if kv_cache is None else kv_cache[n], start)
        if at is not None:  # the head only where an output is wanted (a target exists): an LM
            x = x[at]       # head costs 2·C·V per position, and (B,T,V) logits the peak memory
        x = self.transformer.ln_f(x)
        if self.config.head == "scalar":
            return self.score(x).squeeze(-1)
        # The LM head in fp32 even under bf16 autocast, so that token_logprobs' fp32 log-softmax
        # gets fp32 logits: on the task's π_ref, bf16 logits (8 significant bits) put 0.027 nats
        # (max 0.12) of error on a response's summed log-prob, fp32 ones 0.0011 (max 0.006), the
        # bf16 trunk's own. fp64 stays fp64 (the gradient checks).
        dt = torch.promote_types(x.dtype, torch.float32)
        with torch.autocast(x.device.type, enabled=False):
            return F.linear(x.to(dt), self.lm_head.weight.to(dt))


def freeze(model, bf16=False):
    """A model that only runs forward in a training job (π_ref, r_φ): eval mode (no dropout), no
    grads, and with bf16 (for a job under bf16 autocast) the blocks' Linear weights and biases
    stored in bf16: the very values autocast casts them to at every call, so its outputs under
    autocast are bit for bit the fp32 model's while its bytes are about half (at 7B: 12.5 of 24.5
    GiB). Embeddings, LayerNorms and the tied fp32 head stay fp32. With bf16 it must run under
    autocast (a plain fp32 call would mix dtypes): the evaluation at a job's end loads its own."""
    model.eval().requires_grad_(False)
    for m in model.transformer.h.modules() if bf16 else ():
        if isinstance(m, nn.Linear):
            m.to(torch.bfloat16)
    return model


def token_logprobs(logits, targets, temperature=1.0):
    """The per-token log-prob of given logits: logits (...,V), targets (...) long, -100 = ignore.
    Returns (...): log softmax(logits / temperature) at the targets, in fp32 (fp64 stays fp64, for
    gradient checks), exactly 0.0 where targets == -100. Stages call it via sequence_logprobs."""
    # bf16 log-softmax loses ~3 significant digits, enough to bias the PPO ratio and DPO's margins
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    logp = F.log_softmax(logits / temperature, dim=-1)
    keep = targets != -100
    lp = logp.gather(-1, torch.where(keep, targets, 0).unsqueeze(-1)).squeeze(-1)
    return torch.where(keep, lp, 0.0)


def sequence_logprobs(model, idx, targets, mask=None, temperature=1.0, entropy=False):
    """THE per-token log-probs of a batch, used by every stage (training, precompute, evaluation,
    PPO's trainer and reference), so cached and live numbers agree. idx (B,T) long; targets (B,T)
    long, the token each position predicts, -100 where none is scored (prompt, padding, last
    column); mask as in GPT.forward. Returns (B,T), 0.0 where targets == -100; a response's
    log-prob is its row's sum. entropy=True: also the entropy (B,T) of softmax(logits /
    temperature) there, in nats (PPO logs it). The LM head and the log-softmax run only at the K
    positions with a target: (K,V) logits, never (B,T,V). The result equals
    token_logprobs(model(idx), targets) up to fp rounding."""
    keep = targets != -100
    logits = model(idx, mask=mask, at=keep)  # (K,V)
    lp = token_logprobs(logits, targets[keep], temperature)  # (K,)
    spread = lambda v: v.new_zeros(keep.shape).masked_scatter(keep, v)  # noqa: E731  (K,) -> (B,T)
    if not entropy:
        return spread(lp)
    logq = F.log_softmax(logits.to(lp.dtype) / temperature, dim=-1)
    return spread(lp), spread(-(logq.exp() * logq).sum(-1))


def new_kv_cache(model, B, max_len, device, dtype):
    """One preallocated (k, v) pair per layer, each (B, n_head, max_len, head_dim), filled by
    forward. Left empty: attention only reads slots an earlier call wrote (pads' too, masked), never
    the rest."""
    c = model.config
    shape = (B, c.n_head, max_len, c.n_embd // c.n_head)
    return [(torch.empty(shape, device=device, dtype=dtype),
             torch.empty(shape, device=device, dtype=dtype)) for _ in range(c.n_layer)]


@torch.no_grad()
def generate(model, prompts, max_new_tokens, eos_id, pad_id, temperature=1.0, top_k=None,
             generator=None, uniforms=None):
    """prompts: list of B lists of token ids, of any lengths >= 1. Left-pads them to P = max
    length, then samples from softmax(logits / temperature) (top_k: only the k likeliest) with a KV
    cache, in eval mode (no dropout); the model's train/eval mode is restored after. Each row stops
    at its own EOS (kept, then pad_id); stops early when all rows have ended. A token is drawn by
    inverse CDF: the first whose cumulative probability exceeds u, u ~ U[0,1), one number per row
    and step: uniforms[b, i] for row b's i-th new token when given ((B, >= max_new_tokens), e.g.
    rows of one tensor drawn for a whole global batch, so a row's sample does not depend on which
    rank or batch it is in), else drawn from `generator` step by step.
    Returns dict, all (B, P+N), N <= max_new_tokens:
      tokens long          left-padded prompt, response, then pad_id
      mask bool            True on real tokens (prompt and response, EOS included)
      response_mask bool   True on sampled tokens up to and including EOS
      logprobs fp32        log-prob of each sampled token under softmax(logits / temperature), no
                           top-k filtering in this number (token_logprobs on forward(tokens,
                           mask=mask) gives the same); 0 elsewhere"""
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
        # prefill: the whole prompt at once, the head at its last column only (which predicts)
        last = (torch.arange(P, device=p0.device) == P - 1).expand(B, P)
        logits = model(tokens[:, :P], mask=mask[:, :P], kv_cache=cache, at=last)  # (B,V)
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
    return dict(tokens=tokens[:, :t], mask=mask[:, :t], response_mask=response_mask[:, :t],
                logprobs=logprobs[:, :t])


def estimate_flops(config, B, T, backward=False, outputs=None):
    """Analytic FLOPs of one forward over a (B,T) batch, or of forward + backward (a training step)
    with backward=True, counted as torch.utils.flop_counter.FlopCounterMode counts them: a matmul is
    2*m*n*k and its backward 2x that; fused scaled_dot_product_attention is 2 bmm forward (q k^T,
    att v) and 5 bmm backward (scores recomputed), over the full T x T (no causal discount);
    nothing else counts. outputs: positions the head runs at (GPT.forward's `at`); default all B*T.
    Found with torch 2.13: on CPU, SDPA runs _scaled_dot_product_flash_attention_for_cpu, which
    FlopCounterMode does not know (it records 0 for attention); CUDA's flash/efficient kernels are
    counted as here. With dropout > 0 in training, SDPA falls back to plain bmms (backward 4 bmm,
    not 5). These are the hardware FLOPs: padding, and the recomputed scores, included."""
    C, L, N = config.n_embd, config.n_layer, B * T
    head = config.vocab_size if config.head == "lm" else 1
    K = N if outputs is None else outputs
    # c_attn, attn c_proj, c_fc, mlp c_proj; the head
    mm = L * 2 * N * C * (3 * C + C + 4 * C + 4 * C) + 2 * K * C * head
    attn = L * 2 * (2 * B * T * T * C)  # per layer 2 bmm of 2*T*T*hd for each of B*H heads
    # backward: +2x matmuls, +2.5x attention
    return mm + attn if not backward else 3 * mm + (7 * attn) // 2


def generate_flops(config, B, P, N):
    """Hardware FLOPs of generate() writing N columns after a P-token prompt: a prefill forward
    over (B, P) with the head at its last column only, then N - 1 one-token forwards (the last
    sampled token is never fed back), the one at column S attending to S keys."""
    attn = lambda T, S: 4 * B * T * S * config.n_embd * config.n_layer  # noqa: E731  q·kᵀ, att·v
    step = lambda S: estimate_flops(config, B, 1) - attn(1, 1) + attn(1, S)  # noqa: E731
    return estimate_flops(config, B, P, outputs=B) + sum(step(S) for S in range(P + 1, P + N))


def model_flops(config, lengths, outputs, backward=False):
    """The FLOPs the real tokens need, whatever the implementation: the numerator of MFU (model
    FLOPs utilisation, Chowdhery et al. 2022, PaLM, app. B). lengths: the real tokens of each
    sequence; outputs: how many positions need the head (those with a target). 2 FLOPs per matmul
    weight per real token (24·C² a layer), the head only at `outputs`, causal attention (4·C per
    layer for each query and each key at or before it: the least a causal model needs);
    backward=True: x3, the forward and a backward of twice its cost, no recomputation. Never more
    than estimate_flops of the same work (which counts padding, full T x T attention, recomputed
    scores, the head everywhere): MFU <= HFU."""
    C, L = config.n_embd, config.n_layer
    head = config.vocab_size if config.head == "lm" else 1
    n = torch.as_tensor(lengths, dtype=torch.float64)
    f = L * (24 * C * C * n.sum() + 4 * C * (n * (n + 1) / 2).sum()) + 2 * C * head * outputs
    return float(3 * f if backward else f)


def matmul_shapes(config, positions, outputs=None):
    """The (m, k, n) of the model's matmuls in a forward over `positions` tokens with the head at
    `outputs` of them (default all): where plumbing.measure_peak_flops times the device."""
    C, V = config.n_embd, config.vocab_size if config.head == "lm" else 1
    mm = [(positions, C, 3 * C), (positions, C, C), (positions, C, 4 * C), (positions, 4 * C, C),
          (positions if outputs is None else outputs, C, V)]
    return sorted(set(mm))


# torch 2.13's FlopCounterMode has no formula for the CPU flash-attention kernels SDPA dispatches to
# (it counts them 0). Their arguments start (q, k, v) and (grad_out, q, k, v) like the CUDA flash
# kernels', so torch's own formulas for those count them, and the count can be compared with
# estimate_flops exactly.
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


def save_model(model, path, meta, state=None):
    """safetensors with metadata {"config": GPTConfig json, "meta": json of provenance (stage,
    step...)}. The tied lm_head is stored once (as wte). Written to path + ".tmp", then renamed:
    never half a file. state: the weights to write, if not model.state_dict() (a sharded model's,
    gathered whole by plumbing.full_state)."""
    state = model.state_dict() if state is None else state
    sd = {k: v.detach().contiguous().cpu() for k, v in state.items() if k != "lm_head.weight"}
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    blob = save(sd, metadata={"config": json.dumps(asdict(model.config)), "meta": json.dumps(meta)})
    with open(path + ".tmp", "wb") as f:  # open(): the mode the umask gives (save_file's is 0600)
        f.write(blob)
    os.replace(path + ".tmp", path)


def read_meta(path):
    """(GPTConfig, meta dict) from a save_model file's metadata, without reading the tensors."""
    with safe_open(path, framework="pt") as f:
        md = f.metadata() or {}
    if "config" not in md:
        raise ValueError(f"{path}: no GPTConfig in its metadata (a Hugging Face GPT-2 file? use "
                         f"import_gpt2)")
    return GPTConfig(**json.loads(md["config"])), json.loads(md["meta"])


def load_model(path, device="cpu"):
    """(GPT, meta dict) from a save_model file, lm_head tied to wte again."""
    cfg, meta = read_meta(path)
    model = GPT(cfg)
    sd = load_file(path)
    if cfg.head == "lm":
        # load_state_dict copies in place: the tie survives
        sd["lm_head.weight"] = sd["transformer.wte.weight"]
    model.load_state_dict(sd)
    return model.to(device), meta


# -----------------------------------------------------------------------------
# Hugging Face GPT-2: import its weights; export ours as a folder that transformers loads as it is

# Hugging Face's GPT-2 stores these as Conv1D, whose weight is (in, out): nn.Linear's transposed
CONV1D = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")
EOS, PAD = "<|endoftext|>", "<|pad|>"  # data.py's two special tokens, by name


def _check(ok, msg):
    """plumbing.check's twin (model.py imports nothing from the project): one error line."""
    if not ok:
        raise SystemExit(f"error: {msg}")


def import_gpt2(path, block_size=None, vocab_size=None, n_head=None):
    """GPT from a Hugging Face GPT-2 model.safetensors (keys with or without "transformer.") and the
    config.json beside it; without one, n_head must be given (the shapes give the rest).
    block_size < n_positions keeps the first rows of the position table. vocab_size > the file's
    appends embedding rows (GPT-2 has no PAD; our tokenizer adds it as 50257). Every GPT2Config
    option that changes the function is honoured, or refused with its name and value."""
    sd = {k.removeprefix("transformer."): v for k, v in load_file(path).items()}
    # attn.bias / attn.masked_bias are the causal-mask buffers of older transformers, not weights
    sd = {k: v for k, v in sd.items()
          if k.split(".")[-2:] not in (["attn", "bias"], ["attn", "masked_bias"])}
    src = os.path.join(os.path.dirname(path), "config.json")
    if os.path.exists(src):
        with open(src) as f:
            hf = json.load(f)
    else:
        _check(n_head, f"{path}: no config.json beside it, so n_head is unknown: copy the model's "
                       f"config.json there (or pass n_head)")
        hf, src = {}, path
    V, C = sd["wte.weight"].shape
    n_pos, L = sd["wpe.weight"].shape[0], sum(k.endswith(".ln_1.weight") for k in sd)
    H = n_head or hf.get("n_head", 12)  # 12: GPT2Config's default
    # Per option, the values this GPT computes, the first one GPT2Config's default (or what the
    # tensors say). Any other value would import without complaint and give other logits.
    honoured = dict(model_type=["gpt2"], vocab_size=[V], n_embd=[C], n_layer=[L], n_head=[H],
                    n_positions=[n_pos], n_inner=[None, 4 * C],
                    # gelu_pytorch_tanh is gelu_new's formula (tanh GELU) in one torch kernel
                    activation_function=["gelu_new", "gelu_pytorch_tanh"],
                    layer_norm_epsilon=[1e-5], scale_attn_weights=[True],
                    # it only upcasts attention scores to fp32 under fp16: the same function
                    reorder_and_upcast_attn=[False, True], scale_attn_by_inverse_layer_idx=[False],
                    tie_word_embeddings=[True], add_cross_attention=[False])
    for k, ok in honoured.items():
        v = hf.get(k, ok[0])
        _check(v in ok, f"{src}: {k}={json.dumps(v)} is refused: the imported GPT would compute "
                        f"{k}={' or '.join(map(json.dumps, ok))}")
    lm = sd.pop("lm_head.weight", None)
    _check(lm is None or torch.equal(lm, sd["wte.weight"]),
           f"{path}: lm_head differs from wte: an untied output embedding is not supported")
    block_size = block_size or n_pos
    _check(block_size <= n_pos, f"block_size {block_size} > the {n_pos} positions {path} learned")
    cfg = GPTConfig(block_size=block_size, vocab_size=V, n_embd=C, n_head=H, n_layer=L,
                    bias="h.0.attn.c_attn.bias" in sd)
    sd["wpe.weight"] = sd["wpe.weight"][:block_size]
    if vocab_size and vocab_size > V:  # new rows: GPT-2's init; PAD is only read, never predicted
        extra = torch.randn(vocab_size - V, C, dtype=sd["wte.weight"].dtype) * 0.02
        sd["wte.weight"], cfg.vocab_size = torch.cat([sd["wte.weight"], extra]), vocab_size
    sd = {"transformer." + k: v.t() if k.endswith(CONV1D) else v for k, v in sd.items()}
    sd["lm_head.weight"] = sd["transformer.wte.weight"]
    model = GPT(cfg)
    model.load_state_dict(sd)
    return model


def export_gpt2(model, tokenizer_json, out_dir):
    """Writes out_dir, a folder that transformers' AutoModelForCausalLM.from_pretrained and
    AutoTokenizer.from_pretrained load as they are (each file from its documented schema):
      model.safetensors       GPT-2's layout: Conv1D weights, lm_head tied (stored once)
      config.json             GPT2Config with bos/eos/pad ids (without them transformers assumes
                              50256, past a small vocabulary, and generate never stops at EOS)
      generation_config.json  the same three ids, which generate reads
      tokenizer.json          tokenizer_json, PAD added if absent (as data.Tok does), EOS put first
                              as the BOS every sequence here starts with: tokenizer(" the movie")
                              gives data.encode_prompt's ids
      tokenizer_config.json   EOS (also BOS) and PAD by name, no clean-up of spaces in decode (it
      special_tokens_map.json would turn " ." into "."), no token_type_ids (transformers 4.x
                              returns them by default, and GPT-2 adds them to the input)"""
    c = model.config
    _check(c.head == "lm" and c.bias, "the GPT-2 layout needs the LM head and biases")
    tk = Tokenizer.from_file(tokenizer_json)
    if tk.token_to_id(PAD) is None:
        tk.add_special_tokens([PAD])
    eos, pad, n = tk.token_to_id(EOS), tk.token_to_id(PAD), tk.get_vocab_size()
    _check(eos is not None, f"{tokenizer_json} has no {EOS} token")
    _check(n <= c.vocab_size, f"{tokenizer_json} has {n} tokens, the model only {c.vocab_size}")
    tk.post_processor = processors.TemplateProcessing(single=f"{EOS} $A", pair=f"{EOS} $A $B",
                                                      special_tokens=[(EOS, eos)])
    sd = {k: (v.t() if k.endswith(CONV1D) else v).detach().contiguous().cpu()
          for k, v in model.state_dict().items() if k != "lm_head.weight"}
    ids = dict(bos_token_id=eos, eos_token_id=eos, pad_token_id=pad)
    config = dict(architectures=["GPT2LMHeadModel"], model_type="gpt2", vocab_size=c.vocab_size,
                  n_positions=c.block_size, n_embd=c.n_embd, n_layer=c.n_layer, n_head=c.n_head,
                  n_inner=None, activation_function="gelu_new", layer_norm_epsilon=1e-5,
                  scale_attn_weights=True, scale_attn_by_inverse_layer_idx=False,
                  reorder_and_upcast_attn=False, tie_word_embeddings=True,
                  resid_pdrop=c.dropout, embd_pdrop=c.dropout, attn_pdrop=c.dropout, **ids)
    special = dict(bos_token=EOS, eos_token=EOS, pad_token=PAD)
    # model_input_names: no token_type_ids, which GPT-2 would add to the input as wte rows
    tok_config = dict(tokenizer_class="PreTrainedTokenizerFast", model_max_length=c.block_size,
                      model_input_names=["input_ids", "attention_mask"],
                      clean_up_tokenization_spaces=False, **special)
    files = {"model.safetensors": save(sd, metadata={"format": "pt"}),  # transformers checks it
             "tokenizer.json": tk.to_str(pretty=True).encode()}
    for name, obj in [("config.json", config), ("generation_config.json", ids),
                      ("tokenizer_config.json", tok_config), ("special_tokens_map.json", special)]:
        files[name] = json.dumps(obj, indent=2).encode()
    os.makedirs(out_dir, exist_ok=True)
    for name, content in files.items():  # each file whole or not at all: a temp file, renamed
        with open(os.path.join(out_dir, name + ".tmp"), "wb") as f:
            f.write(content)
        os.replace(os.path.join(out_dir, name + ".tmp"), os.path.join(out_dir, name))


# -----------------------------------------------------------------------------
# what a resident model costs a training job (dpo.py and ppo.py print it at start; compare.py
# tabulates it)


DTYPES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float64: "fp64"}


def anatomy(models, T=None):
    """What each resident model costs the job. models: {name: nn.Module (a GPT)}; one with
    trainable parameters is trained with AdamW (fp32 weights, grads and two moments), a frozen one
    is only held and run forward. T: the sequence length the FLOPs per token are counted at
    (attention grows with T; default: each model's block_size). Returns one dict per model, then a
    "total" row: the loop's FLOPs per token and the job's bytes. Activations are not counted: they
    scale with the batch.
    FLOPs per token: of a token with a target (the head runs there), and of one without (a prompt
    token, which only conditions: the head is skipped, see sequence_logprobs)."""
    rows = []
    for name, m in models.items():
        params = list(m.parameters())  # a tied lm_head is the same Parameter as wte: counted once
        trainable, t = any(p.requires_grad for p in params), T or m.config.block_size
        w = sum(p.numel() * p.element_size() for p in params)
        count = {}  # the dtypes it holds, most parameters first: "fp32", or "bf16+fp32" (freeze)
        for p in params:
            k = DTYPES.get(p.dtype, str(p.dtype))
            count[k] = count.get(k, 0) + p.numel()
        dtype = "+".join(sorted(count, key=count.get, reverse=True))
        r = dict(model=name, state="trainable" if trainable else "frozen", dtype=dtype,
                 params=sum(p.numel() for p in params), weights_bytes=w,
                 grads_bytes=w if trainable else 0, adamw_bytes=2 * w if trainable else 0,
                 # forward + backward, or forward
                 flops_per_token=estimate_flops(m.config, 1, t, backward=trainable) / t,
                 flops_per_context_token=estimate_flops(m.config, 1, t, trainable, outputs=0) / t)
        rows.append({**r, "total_bytes": r["weights_bytes"] + r["grads_bytes"] + r["adamw_bytes"]})
    rows.append({k: "total" if k == "model" else "" if k in ("state", "dtype")
                 else sum(r[k] for r in rows) for k in rows[0]})
    return rows


def format_anatomy(rows, T):
    cols = ("weights_bytes", "grads_bytes", "adamw_bytes", "total_bytes")
    lines = [f"{'resident':<10} {'state':<9} {'dtype':<9} {'params':>9} {'weights':>8} "
             f"{'grads':>8} {'AdamW':>8} {'total':>8}   FLOPs/token at T={T}: with a target / "
             "without"]
    for r in rows:
        mib = " ".join(f"{r[k] / 2**20:>8.2f}" for k in cols)
        flops = f"{r['flops_per_token'] / 1e6:.2f} M / {r['flops_per_context_token'] / 1e6:.2f} M"
        lines.append(f"{r['model']:<10} {r['state']:<9} {r['dtype']:<9} {r['params']:>9,} {mib}   "
                     f"{flops}")
    return "\n".join(lines + ["(bytes in MiB, each tensor in its dtype; activations not counted)"])


def kv_cache_benchmark():
    """The rollout engine's speed-up: 64 new tokens with the KV cache (one token through the model
    per step) against the obvious loop that re-runs the whole prefix each step. Greedy, so both must
    produce the same tokens; timed interleaved, best of 5 each, on this machine."""
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
    n = sum(p.numel() for p in m.parameters())
    print(f"64 new tokens, batch 16, prompt 16, {n / 1e6:.2f}M params, "
          f"{torch.get_num_threads()} threads: KV cache {1000 * best['kv_cache']:.0f} ms | "
          f"recompute {1000 * best['recompute']:.0f} ms | "
          f"{best['recompute'] / best['kv_cache']:.1f}x faster with the cache")


if __name__ == "__main__":
    import sys
    if sys.argv[1:2] != ["export"]:
        kv_cache_benchmark()
        sys.exit()
    _check(len(sys.argv) == 4, "usage: python model.py export SRC.safetensors OUT_DIR")
    src, out = sys.argv[2:]
    tok = os.path.join(os.path.dirname(src), "tokenizer.json")  # every stage keeps one beside it
    _check(os.path.isfile(src) and os.path.isfile(tok), f"{src} and {tok} must both exist")
    export_gpt2(load_model(src)[0], tok, out)
    with open(os.path.join(out, "config.json")) as f:
        ids = {k: v for k, v in json.load(f).items() if k.endswith("token_id")}
    print(f"{out}: {' '.join(sorted(os.listdir(out)))} | {ids}")
