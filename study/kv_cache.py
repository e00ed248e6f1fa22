"""The rollout engine's speed-up: KV-cache generation against recomputing the whole prefix.

    python -m study.kv_cache    # a few seconds on a CPU; prints one line, and writes it to the
                                # section "kv_cache" of RESULTS.md (--results "": not)

64 new tokens with the KV cache (model.generate: one token through the model per step) against the
obvious loop that re-runs the whole prefix each step, on a fresh 4-layer GPT (time does not depend
on what the weights know). Greedy, so both must produce the same tokens; timed interleaved, best of
5 each, on this machine.
"""
import time
from dataclasses import dataclass

import torch

from model import GPT, GPTConfig, generate
from plumbing import parse_config
from study.results import flags, write_section


@dataclass
class Config:
    results: str = "RESULTS.md"  # its section "kv_cache" gets the line ("": none)


def kv_cache_benchmark():
    """Checks the cached tokens equal the recomputed ones, then prints the two best times; returns
    the printed line."""
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
    line = (f"64 new tokens, batch 16, prompt 16, {n / 1e6:.2f}M params, "
            f"{torch.get_num_threads()} threads: KV cache {1000 * best['kv_cache']:.0f} ms | "
            f"recompute {1000 * best['recompute']:.0f} ms | "
            f"{best['recompute'] / best['kv_cache']:.1f}x faster with the cache")
    print(line)
    return line


def main(cfg):
    t0 = time.time()
    line = kv_cache_benchmark()
    text = line + " (greedy, the same tokens both ways; best of 5 interleaved timings each)"
    command = " ".join(["python -m study.kv_cache"] + flags(cfg))
    if write_section(cfg.results, "kv_cache", text, command, time.time() - t0, "cpu"):
        print(f"wrote the section kv_cache of {cfg.results}")


if __name__ == "__main__":
    main(parse_config(Config, doc=__doc__))
