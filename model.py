"""The GPT every stage trains, scores and samples from: GPT-2's architecture at any size.

Smallest pieces first: config -> attention -> MLP -> block -> GPT (LM or scalar head) -> per-token
log-probs (the one function training, the reference cache and evaluation share) -> the scalar head's
reading -> KV-cache generation (the rollout engine) -> safetensors save/load. The forward math is
GPT-2's exactly (Radford et al. 2019), so weights imported from Hugging Face (hf.py) give Hugging
Face's logits. Imports nothing from the project.
"""
import json
import math
import os
from dataclasses import asdict, dataclass, replace

import torch
import torch.nn as nn
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import load_file, save

# the target of a position that is not scored (prompt, padding, the last column), as PyTorch's
# cross_entropy ignore_index: every log-prob there is exactly 0
IGNORE = -100


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
        cache) + T. Or mask (B,T) long, a packed batch (data.pack_pairs): the sequence each position
        belongs to, each sequence contiguous in its row (-1 on the padding at a row's end). pos
        (B,T) long position ids; default: from the mask (real tokens before, so left padding does
        not shift positions; a packed sequence starts at 0), or 0..T-1 without one. kv_cache: from
        new_kv_cache; needs a bool mask. Returns logits (B,T,V) for head "lm", values (B,T) for
        head "scalar". With at (B,T) bool, only the K positions where it is True, in row-major
        order: (K,V) or (K,)."""
        B, T = idx.shape
        assert kv_cache is None or mask is not None, \
            "a KV cache needs the mask of everything it holds"
        S = T if mask is None else mask.shape[1]
        start = S - T  # tokens already in the cache
        assert S <= self.config.block_size, \
            f"sequence of {S} tokens > block_size {self.config.block_size}"
        packed = mask is not None and mask.dtype != torch.bool
        assert kv_cache is None or not packed, "a KV cache needs a bool mask, not a packed one"
        t = torch.arange(T, device=idx.device)
        if pos is None and packed:  # each sequence from 0: its offset from its own first token
            first = torch.ones_like(mask, dtype=torch.bool)
            first[:, 1:] = mask[:, 1:] != mask[:, :-1]
            pos = t - torch.where(first, t, 0).cummax(1).values
        if pos is None:
            pos = (t.expand(B, T) if mask is None
                   else (mask.long().cumsum(1) - 1).clamp(min=0)[:, start:])
        attn_mask = None
        if packed:  # block-diagonal causal: a query sees the keys of its own sequence up to itself
            # (padding is a sequence of its own, so no row of the mask is empty)
            same = mask[:, None, :, None] == mask[:, None, None, :]  # (B,1,T,T)
            attn_mask = same & (t[None, :] <= t[:, None])
        elif mask is not None:
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
    """The per-token log-prob of given logits: logits (...,V), targets (...) long, IGNORE: not
    scored.
    Returns (...): log softmax(logits / temperature) at the targets, in fp32 (fp64 stays fp64, for
    gradient checks), exactly 0.0 where targets == IGNORE. Stages call it via sequence_logprobs."""
    # bf16 log-softmax loses ~3 significant digits, enough to bias the PPO ratio and DPO's margins
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    logp = F.log_softmax(logits / temperature, dim=-1)
    keep = targets != IGNORE
    lp = logp.gather(-1, torch.where(keep, targets, 0).unsqueeze(-1)).squeeze(-1)
    return torch.where(keep, lp, 0.0)


def sequence_logprobs(model, idx, targets, mask=None, temperature=1.0, entropy=False):
    """THE per-token log-probs of a batch, used by every stage (training, precompute, evaluation,
    PPO's trainer and reference), so cached and live numbers agree. idx (B,T) long; targets (B,T)
    long, the token each position predicts, IGNORE where none is scored (prompt, padding, last
    column); mask as in GPT.forward. Returns (B,T), 0.0 where targets == IGNORE; a response's
    log-prob is its row's sum. entropy=True: also the entropy (B,T) of softmax(logits /
    temperature) there, in nats (PPO logs it). The LM head and the log-softmax run only at the K
    positions with a target: (K,V) logits, never (B,T,V). The result equals
    token_logprobs(model(idx), targets) up to fp rounding."""
    keep = targets != IGNORE
    logits = model(idx, mask=mask, at=keep)  # (K,V)
    lp = token_logprobs(logits, targets[keep], temperature)  # (K,)
    spread = lambda v: v.new_zeros(keep.shape).masked_scatter(keep, v)  # noqa: E731  (K,) -> (B,T)
    if not entropy:
        return spread(lp)
    logq = F.log_softmax(logits.to(lp.dtype) / temperature, dim=-1)
    return spread(lp), spread(-(logq.exp() * logq).sum(-1))


def pair_logps(model, input_ids, targets, seq=None):
    """Each sequence's summed response log-prob (2B,) fp32, from one forward over a [chosen;
    rejected] batch: prompt and padding have target IGNORE, so they add exactly 0 (the LM head does
    not even run there). seq None: a padded batch (data.collate_pairs), a sequence per row. seq
    (R,L) long: a packed one (data.pack_pairs), the sequence id of each position, 0..2B-1 in the
    order of a padded batch's rows, so the result is the same (to fp32 rounding). The policy, the
    live π_ref and the reference cache all go through here."""
    lp = sequence_logprobs(model, input_ids, targets, mask=seq)
    if seq is None:
        return lp.sum(-1)
    keep = targets != IGNORE  # a packed row's padding (seq -1) has no target
    return lp.new_zeros(int(seq.max()) + 1).index_add(0, seq[keep], lp[keep])


def last_index(mask):
    """(B,T) bool -> (B,) long, the column of each row's last True (every row has one)."""
    cols = torch.arange(mask.shape[1], device=mask.device)
    return torch.where(mask, cols, -1).amax(1)


def score_at_last(values, mask):
    """A scalar head's reading of each sequence: its output (B,T) at the last real token, mask
    (B,T) True on real tokens: (B,). Or mask (R,L) long, a packed batch's sequence ids (as in
    GPT.forward): at each sequence's own last token, (number of sequences,). Read after the EOS was
    seen, so the whole response is scored (Stiennon et al. 2020 read the same place); causal
    attention makes it blind to later padding, and the packed mask to the sequences after it."""
    if mask.dtype == torch.bool:
        return values.gather(1, last_index(mask)[:, None]).squeeze(1)
    seq, flat = mask.flatten(), torch.arange(mask.numel(), device=mask.device)
    keep = seq >= 0
    last = flat.new_zeros(int(seq.max()) + 1).scatter_reduce(0, seq[keep], flat[keep], "amax")
    return values.flatten()[last]


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



def save_model(model, path, meta, state=None):
    """safetensors with metadata {"config": GPTConfig json, "meta": json of provenance (stage,
    step...)}. The tied lm_head is stored once (as wte). Written to path + ".tmp", then renamed:
    never half a file. state: the weights to write, if not model.state_dict() (a sharded model's,
    gathered whole by checkpoint.full_state)."""
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


def load_model(path, device="cpu", head=None):
    """(GPT, meta dict) from a save_model file, lm_head tied to wte again. head ("lm" or "scalar"):
    the file's by default; another one keeps the transformer and starts a fresh head (π_ref's trunk
    under r_φ's zero head, r_φ's under the critic's...). Dropout is off, as lm-human-preferences
    and TRL run every loaded model: with dropout the same tokens get other log-probs in the rollout
    and in the update, and the PPO ratio is noise. A file with NaN or inf weights (saved by a run
    that diverged) is named as the cause here, not found later as a NaN loss."""
    cfg, meta = read_meta(path)
    model = GPT(replace(cfg, head=head or cfg.head, dropout=0.0))
    sd = {k: v for k, v in load_file(path).items()
          if k.startswith("transformer.") or model.config.head == cfg.head}
    if model.config.head == "lm":
        # load_state_dict copies in place: the tie survives
        sd["lm_head.weight"] = sd["transformer.wte.weight"]
    missing, unexpected = model.load_state_dict(sd, strict=False)
    fresh = {"score.weight", "score.bias"} if model.config.head != cfg.head else set()
    if unexpected or not set(missing) <= fresh:
        raise SystemExit(f"error: {path}: not a GPT save_model file (missing {missing[:2]}, "
                         f"unexpected {unexpected[:2]})")
    bad = [k for k, v in model.state_dict().items()
           if v.is_floating_point() and not v.isfinite().all()]
    if bad:
        raise SystemExit(f"error: {path} holds non-finite weights (NaN or inf in {len(bad)} "
                         f"tensors, e.g. {bad[:1]}): the run that saved it diverged; retrain it, "
                         "e.g. with a lower --lr")
    return model.to(device), meta
