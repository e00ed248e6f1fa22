"""Padded against packed batches: the positions each layout runs per real token, and the wall time
of a cached DPO step in each beside TRL's DPOTrainer step, measured side by side.

    python -m study.packing                                   # our two layouts
    python -m study.packing --trl_python /path/venv/bin/python   # and TRL's step, run by a Python
                                          # that has trl (pip install trl in a venv of its own)

Positions per real token: over one epoch of dpo.py's micro-batches (at its default sizes), the
precompute's batches and one epoch of reward.py's, each built padded (data.collate_pairs) and packed
(data.pack_pairs); no model runs. Wall time: dpo.py --ref cache on the built-in task, --pack and
--no-pack, and TRL's step at the same sizes (study/trl_step.py: padded, and padding_free where TRL
keeps it), in interleaved rounds so that a busy machine slows each alike; ratios are taken within
a round, then the median over rounds. Writes the section "packing" of RESULTS.md.
"""
import json
import os
import statistics
import subprocess
import time
from dataclasses import dataclass

import data
import dpo
from checkpoint import tokenizer_beside
from hf import export_gpt2
from model import load_model, pair_logps
from plumbing import init_distributed, parse_config
from study.costs import dpo_batches, layout_table, layouts, table
from study.results import flags, write_section


@dataclass
class Config:
    out_dir: str = "out/packing"  # the timed runs and TRL's model folder
    task: str = "out/task"  # the built-in task's folder
    sft: str = "out/sft/model.safetensors"  # π_ref
    rounds: int = 3  # interleaved rounds of timing
    time_steps: int = 8  # steps timed in each run, after one that warms up
    trl_python: str = ""  # a Python with trl installed ("": TRL is not timed)
    results: str = "RESULTS.md"  # its section "packing" gets the tables ("": none)


def our_step(cfg, pack):
    """Median ms of dpo.py's cached step, --pack or --no-pack, cfg.time_steps after a warm-up, and
    its median utilisation by real tokens (the "mfu" dpo.py logs: the model FLOPs of its real
    tokens per second over meter.measure_peak_flops)."""
    t = lambda f: os.path.join(cfg.task, f)  # noqa: E731
    out = os.path.join(cfg.out_dir, f"dpo-pack-{pack}")
    dpo.main(dpo.Config(out_dir=out, ref_model=cfg.sft, train_pairs=t("pairs_train.jsonl"),
                        val_pairs=t("pairs_val.jsonl"), test_prompts=t("prompts_test.jsonl"),
                        pack=pack, steps=cfg.time_steps + 2, stop_after=cfg.time_steps + 1,
                        eval_every=10 ** 6, resume=False))
    with open(os.path.join(out, "metrics.jsonl")) as f:
        steps = [json.loads(line) for line in f][1:]
    return (statistics.median(s["time/step"] for s in steps),
            {"mfu": statistics.median(s["mfu"] for s in steps)})


def trl_step(cfg, padding_free):
    """Median ms of TRL's step (study/trl_step.py under cfg.trl_python), cfg.time_steps after a
    warm-up, and its report (its version, whether it kept padding_free, the positions and real
    tokens it ran)."""
    out = os.path.join(cfg.out_dir, f"trl-{padding_free}.json")
    subprocess.run([cfg.trl_python, "-m", "study.trl_step", os.path.join(cfg.out_dir, "hf"),
                    os.path.join(cfg.task, "pairs_train.jsonl"), out, str(cfg.time_steps + 1)]
                   + ["--padding_free"] * padding_free, check=True)
    with open(out) as f:
        r = json.load(f)
    return statistics.median(r["step_ms"][1:]), r


def alternated(cfg, steps=16):
    """Packed over padded wall time of the policy's forward and backward on the same micro-batches
    (dpo.py's first `steps` steps, each built in both layouts), alternated batch by batch in this
    process, which goes first alternating too: the median of the per-batch ratios, which a load
    that moves between jobs leaves alone."""
    tok, D = data.load_tokenizer(tokenizer_beside(cfg.sft, "--sft")), dpo.Config
    train, _ = data.tokenize_pairs(tok, data.read_pairs(f"{cfg.task}/pairs_train.jsonl"),
                                   D.max_len, D.max_prompt_len)
    policy, ratios = load_model(cfg.sft)[0].eval(), []
    for i, batch in enumerate(dpo_batches(train, D.batch_size, D.micro_batch_size, D.seed, steps)):
        ms = {}
        for n in (0, D.max_len)[::1 if i % 2 else -1]:
            t0 = time.perf_counter()
            b = data.collate_pairs(batch, tok.pad, n)
            pair_logps(policy, b["input_ids"], b["targets"], b["seq"]).sum().backward()
            ms[n] = time.perf_counter() - t0
        ratios.append(ms[D.max_len] / ms[0])
    return statistics.median(ratios)


def main(cfg):
    t0 = time.time()
    lay, alt = layouts(cfg.task, cfg.sft), alternated(cfg)
    jobs = {"dpo.py, packed (the default)": lambda: our_step(cfg, True),
            "dpo.py, padded (--no-pack)": lambda: our_step(cfg, False)}
    if cfg.trl_python:
        export_gpt2(load_model(cfg.sft)[0], tokenizer_beside(cfg.sft, "--sft"),
                    os.path.join(cfg.out_dir, "hf"))
        jobs["TRL, padded"] = lambda: trl_step(cfg, False)
        jobs["TRL, padding_free"] = lambda: trl_step(cfg, True)
    rounds, reports = [], {}
    for r in range(cfg.rounds):
        rounds.append({})
        for name, run in jobs.items():
            print(f"[packing] round {r + 1}/{cfg.rounds}: {name}")
            rounds[-1][name], reports[name] = run()
        if reports.get("TRL, padding_free") and not reports["TRL, padding_free"]["padding_free"]:
            jobs.pop("TRL, padding_free", None)  # TRL fell back to padding: the same step again
    md = markdown(cfg, lay, rounds, reports, alt)
    print(md)
    cmd = " ".join(["python -m study.packing"] + flags(cfg))
    if write_section(cfg.results, "packing", md, cmd, time.time() - t0,
                     str(init_distributed().device)):
        print(f"wrote the section packing of {cfg.results}")


def markdown(cfg, lay, rounds, reports, alt):
    base = "TRL, padded" if "TRL, padded" in rounds[0] else "dpo.py, padded (--no-pack)"
    med = lambda name, f: statistics.median(f(r) for r in rounds if name in r)  # noqa: E731
    trl = reports.get("TRL, padded")
    ours, wall = lay["dpo.py, one epoch"], []
    for name in rounds[0]:
        rep = reports.get(name)
        per = (rep["positions"] / rep["tokens"] if "positions" in rep
               else ours["packed" if "packed" in name else "padded"] / ours["tokens"])
        ms = [r[name] for r in rounds if name in r]
        wall.append([name, f"{med(name, lambda r: r[name]):,.0f}",
                     f"{min(ms):,.0f}–{max(ms):,.0f}",
                     f"{med(name, lambda r: r[name] / r[base]):.2f}×", f"{per:.3f}",
                     f"{rep['mfu']:.0%}" if "mfu" in rep else "–"])
    notes = []
    if trl:
        notes.append(f"TRL {trl['trl']} (its DPOTrainer, fp32 on the CPU, SDPA attention, the "
                     "reference log-probs precomputed, 64 pairs in 2 micro-batches of 32, "
                     "max_length 64, as dpo.py's defaults) pads each micro-batch of random pairs "
                     "to its longest row.")
        pf = reports.get("TRL, padding_free")
        if pf and not pf["padding_free"]:
            notes.append(f"TRL {pf['trl']}'s DPOTrainer does not run padding_free: it warns and "
                         "falls back to padding (its DPOConfig: \"temporarily unavailable\"), so "
                         "its row is TRL's padded step again, timed once.")
    else:
        notes.append("TRL was not timed (no --trl_python).")
    return "\n".join([
        layout_table(lay), "",
        f"### A cached DPO step, wall time (median of {len(rounds)} interleaved rounds, "
        f"{cfg.time_steps} steps each after a warm-up)", "",
        table(["step", "ms per step", "rounds' range", f"÷ {base} (in-round)",
               "positions per real token", "utilisation by real tokens"], wall), "",
        " ".join(notes + [
            "dpo.py's positions per real token are over one epoch of its micro-batches (above); "
            "TRL's over the training micro-batches its timed run built. The machine is shared: "
            "the range over rounds shows how far its load moved each row, and the ratios are "
            "taken within a round, where it moves the jobs alike only as far as it stays put. "
            "Alternated micro-batch by micro-batch in one process (study.packing.alternated), "
            f"the policy's forward and backward took {alt:.2f}× the padded time packed (median "
            "over 32 micro-batches). Utilisation by real tokens: the model FLOPs of the step's "
            "real tokens per second over this CPU's measured matmul peak at the model's shapes "
            "(meter.measure_peak_flops), as dpo.py logs it (\"mfu\", the median of the last "
            "round's timed steps); TRL logs no such number."])])


if __name__ == "__main__":
    main(parse_config(Config, doc=__doc__))
