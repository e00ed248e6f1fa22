"""The measurement the loops carry, out of their way: FLOPs, bytes, the device's peak, and a meter
that times a step's phases and turns its FLOPs into MFU, so that each loop logs in a line or two.

FLOPs come two ways: "hardware", what the kernels execute (estimate_flops: padding, full T x T
attention, recomputed scores, checked against torch's FlopCounterMode by count_flops), and "model",
what the real tokens need (model_flops: the numerator of MFU). Utilisation divides them by the
matmul throughput measured on this device at the model's own shapes (measure_peak_flops).
"""
import time

import torch
from torch.utils import flop_counter

from model import IGNORE
from plumbing import clock, reduce_sums

# -----------------------------------------------------------------------------
# FLOPs


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

def batch_flops(config, x, y, pad, backward=False, seq=None):
    """(executed, needed) FLOPs of a forward (backward=True: and its backward) over a collate()
    batch: input_ids x (B,T), targets y; the head runs at the positions with a target, the real
    tokens are x's non-pad ones. seq: a packed batch's sequence ids (data.pack_pairs), whose
    sequences, not rows, are what causal attention needs; its kernels still run T x T per row."""
    K = int((y != IGNORE).sum())
    lengths = (x != pad).sum(1) if seq is None else torch.bincount(seq[seq >= 0])
    return (estimate_flops(config, *x.shape, backward=backward, outputs=K),
            model_flops(config, lengths, K, backward=backward))


# -----------------------------------------------------------------------------
# what a resident model costs a training job (the loops print it at start; the studies tabulate it)


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


PEAKS = {}  # (device, shapes) -> FLOP/s: measure_peak_flops times each once per process


def measure_peak_flops(device, shapes, seconds=0.1):
    """The device's matmul throughput at the model's own shapes, FLOP/s: the denominator of MFU and
    HFU. shapes: (m, k, n) of the model's matmuls (model.matmul_shapes). Each shape is timed in 5
    blocks of repeated matmuls, seconds / 5 / len(shapes) or more each (CUDA events on a GPU), after
    a warm-up that also sizes the blocks; the peak is the fastest block of the fastest shape. The
    fastest, not the median: another process can only slow a block down, never speed it up, so the
    fastest block is the closest to what the device does (timeit's rule), and a peak measured too
    low is what lets a utilisation pass 1. A step runs these same matmuls and slower work besides,
    so its FLOPs per second stay below the peak: utilisation <= 1. Measured once per process and
    shapes; the tensors are freed before it returns (and CUDA's cache emptied), so a peak-memory
    count started after it never sees them. Measured, not read from a spec sheet."""
    key = (str(device), tuple(shapes))
    if key in PEAKS:
        return PEAKS[key]
    cuda = device.type == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32  # what autocast multiplies in

    def timed(f, reps):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(reps):
                f()
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / 1000
        t = time.perf_counter()
        for _ in range(reps):
            f()
        return time.perf_counter() - t

    def throughput(m, k, n):  # FLOP/s of one shape; its tensors are freed on return
        a, b = (torch.randn(r, c, device=device, dtype=dtype) for r, c in ((m, k), (k, n)))
        out = torch.empty(m, n, device=device, dtype=dtype)
        f = lambda: torch.mm(a, b, out=out)  # noqa: E731
        reps = 1
        while timed(f, reps) < block:  # warm-up, doubling until a block lasts long enough
            reps *= 2
        return 2 * m * k * n * reps / min(timed(f, reps) for _ in range(5))

    block = seconds / 5 / len(shapes)
    best = max(throughput(*s) for s in shapes)
    if cuda:
        torch.cuda.empty_cache()
    PEAKS[key] = best
    return best


def compile_metrics(metrics, dt):
    """The metrics of a compiled run's first step, which compiled the forward and the backward
    (tens of seconds on a GPU): its wall time is the compiler's, so its step time, phase times,
    throughput and MFU are replaced by time/compile (ms), and no reported step time includes it."""
    timed = ("time/", "share/", "tokens_per_sec", "mfu")
    return {**{k: v for k, v in metrics.items() if not k.startswith(timed)},
            "time/compile": 1000 * dt}


# -----------------------------------------------------------------------------
# the meter


class Meter:
    """What a loop measures besides its algorithm, so that a step logs in a line or two. Per step:
    start(), then lap(phase) at the end of each phase (its wall time, ms), count(...) for each
    forward or backward (FLOPs executed and needed), add(**sums) for the metrics summed over the
    step, reduce() once to sum them (and the FLOPs) over the ranks, and timing(tokens): the step's
    time, throughput, FLOPs and utilisation over the measured peak, each phase's share of the step
    when `phases` are named. The first step of a compiled run compiled the model: its timing is
    time/compile alone (compile_metrics). unit names the step's time: time/step, time/iteration."""

    def __init__(self, d, peak, unit="step", phases=(), compile=False):
        self.d, self.peak, self.unit, self.phases, self.compile = d, peak, unit, phases, compile
        self.first, self.timed, self.share_sums = True, 0, dict.fromkeys(phases, 0.0)

    def start(self):
        self.t0 = self.t = clock(self.d)
        self.times, self.sums = {}, {}
        self.flops = {"model": 0.0, "hardware": 0.0}

    def lap(self, phase):
        now = clock(self.d)
        self.times[f"time/{phase}"] = self.times.get(f"time/{phase}", 0.0) + 1000 * (now - self.t)
        self.t = now

    def count(self, hardware, model):
        """FLOPs of one forward or backward on this rank: (executed, needed), as batch_flops."""
        self.flops["hardware"] += hardware
        self.flops["model"] += model

    def add(self, **sums):
        """Accumulate this rank's sums (a tensor is summed first, so (B,) values add their rows)."""
        for k, v in sums.items():
            self.sums[k] = self.sums.get(k, 0.0) + (v.sum() if torch.is_tensor(v) else v)

    def reduce(self):
        """The step's sums over all ranks, as floats (plumbing.reduce_sums), the FLOPs included."""
        self.total = reduce_sums(self.d, **self.sums, flops_model=self.flops["model"],
                                 flops_hardware=self.flops["hardware"])
        return self.total

    def timing(self, tokens):
        """The step's timing metrics, tokens its real tokens on all ranks. The step ends at its
        last lap (or now, for a loop that times no phases)."""
        dt = (self.t if self.times else clock(self.d)) - self.t0
        s, world_peak = self.total, self.d.world * self.peak * dt
        m = {"tokens_per_sec": tokens / dt,
             "flops": s["flops_model"],  # this step's model FLOPs, all ranks
             "mfu": s["flops_model"] / world_peak, "mfu_hardware": s["flops_hardware"] / world_peak,
             f"time/{self.unit}": 1000 * dt, **self.times,
             **{f"share/{k}": self.times[f"time/{k}"] / (1000 * dt) for k in self.phases}}
        first, self.first = self.first, False
        if self.compile and first:
            return compile_metrics(m, dt)
        self.timed += 1
        for k in self.phases:
            self.share_sums[k] += m[f"share/{k}"]
        return m

    def shares(self, log=None, step="a step"):
        """Each phase's mean share of a timed step over this run (a compiled run's first step
        compiled, untimed); printed through log as "share of {step}: ..." once a step was timed."""
        shares = {k: v / max(self.timed, 1) for k, v in self.share_sums.items()}
        if log is not None and self.timed:
            log(f"share of {step}: " + " | ".join(f"{k} {v:.1%}" for k, v in shares.items()))
        return shares
