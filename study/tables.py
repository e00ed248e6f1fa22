"""study.compare's tables: its statistics over seeds, and the markdown, CSV and plots it writes
from one row per run (compare.frontier's rows). Pure functions of those rows; the envelope and the
intervals they quote come from study/envelope.py.

    python -m study.compare     # writes them (out/compare/frontier.md, RESULTS.md's sections)
"""
import csv
import json
import math
import os

import torch

import task
from plumbing import atomic_write_text, fmt_duration
from study import envelope
from study.costs import table


def floats(s):
    return [float(v) for v in s.split(",") if v.strip()]


# -----------------------------------------------------------------------------
# Statistics over seeds: pure functions


def mean_se(xs):
    """Mean and standard error of the mean of xs: sample standard deviation (n − 1) / √n. The
    error is nan for a single value, and both are None if any value is missing (an eval.json
    written before that field existed)."""
    if any(x is None for x in xs):
        return None, None
    n, m = len(xs), sum(xs) / len(xs)
    return m, (sum((x - m) ** 2 for x in xs) / (n - 1) / n) ** 0.5 if n > 1 else math.nan


def pm(m, se, f="+.3f"):
    """'m ± se' for the tables; '–' for a missing value, no ± for an unknown error."""
    if m is None:
        return "–"
    return f"{m:{f}}" + (f" ± {se:.3f}" if se is not None and math.isfinite(se) else "")


# -----------------------------------------------------------------------------
# Tables


def write_csv(path, rows):
    with open(path + ".tmp", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    os.replace(path + ".tmp", path)


KL_COEF_METHODS = ("PPO", "PPO-GT", "GRPO")  # configured by a KL coefficient, not DPO's β
METHODS = ("SimPO", "DPO", "DPO+NLL", "iterative DPO+NLL", "online DPO", "GRPO", "PPO",
           "PPO-GT")  # the tables' order: iterative DPO as it ships, with its NLL term


J_METHODS = METHODS[1:]  # the methods with a KL coefficient β, J_β's


def setting(r):
    """A run's configuration, as the tables name it: 'β 0.3, lr 0.001', 'KL coef 0.1, lr 0.0001'."""
    if r["method"] == "π_ref":
        return ""
    s = f"KL coef {r['kl_coef']:g}" if r["method"] in KL_COEF_METHODS else f"β {r['beta']:g}"
    s += f", γ {r['simpo_gamma']:g}" if r["method"] == "SimPO" else ""
    return f"{s}, lr {r['lr']:g}"


def settings(rows):
    """The runs grouped by (method, configuration), in sweep order: {key: [row per seed]}."""
    groups = {}
    for r in rows:
        groups.setdefault((r["method"], setting(r)), []).append(r)
    return groups


def regime_title(regime, cfg):
    """'' for a sweep of the default regime alone; else the regime and its rule (task.REGIMES)."""
    if cfg.regimes.strip() == "default":
        return ""
    return f" (regime {regime}: {task.REGIMES[regime]})"


TRUNCATED_MAX = 0.05  # a setting whose test completions hit the budget more often is flagged


def verdicts(rs):
    """A configuration's two flags, from its seeds' rows: the share of test completions cut at the
    generation budget (no EOS: their KL and reward are lower bounds), and the budget rule, the
    seeds' validation-reward gain from the --check_at checkpoint to the end with its 95% t-interval
    (a positive interval: it still rose, so the budget, not the method, ended it)."""
    cut = 1 - mean_se([r["eos_rate"] for r in rs])[0]
    gains = [r["val_true_reward"] - r["check_val_true_reward"] for r in rs
             if r["check_val_true_reward"] is not None]
    gain = envelope.mean_interval(gains) if gains else (None, None, None)
    return dict(cut=cut, gain=gain, flagged=cut > TRUNCATED_MAX or (gain[1] or 0) > 0)


def envelope_configs(groups, method, eligible=True):
    """A method's configurations for study/envelope.py: {name: [per seed {val_kl, val_reward,
    test_kl, test_reward}]}, π_ref among them (any method can mix with it: KL 0); eligible: the
    flagged configurations left out, as matched-KL claims need."""
    point = lambda r: dict(val_kl=r["val_kl"], val_reward=r["val_true_reward"],  # noqa: E731
                           test_kl=r["kl"], test_reward=r["true_reward"])
    return {name: [point(r) for r in rs] for (m, name), rs in groups.items()
            if m == "π_ref" or m == method and not (eligible and verdicts(rs)["flagged"])}


def frontier_markdown(rows, cfg):
    """One regime's frontier table (rows: its runs, π_ref's first): every configuration."""
    groups = settings(rows)
    stat = lambda rs, k: mean_se([r[k] for r in rs])  # noqa: E731
    # None in rows written before evaluate.py reported them (and no r_φ score for DPO's runs)
    newer = lambda rs, k: mean_se([r.get(k) for r in rs])  # noqa: E731
    chosen = {m: envelope.select_on_val(envelope_configs(groups, m, False))[0]
              for m in {m for m, _ in groups}}
    beyond = any(r["beyond_pool"] is not None for r in rows)
    body = []
    for (method, name), rs in groups.items():
        v = verdicts(rs)
        gain = "–" if v["gain"][0] is None else (
            f"{v['gain'][0]:+.2f}" + (f" [{v['gain'][1]:+.2f}, {v['gain'][2]:+.2f}]"
                                      if v["gain"][1] is not None else ""))
        flags = [f for f, on in (("cut", v["cut"] > TRUNCATED_MAX),
                                 ("budget", (v["gain"][1] or 0) > 0)) if on]
        body.append([method, name, "–" if method == "π_ref" else len(rs),
                     pm(*stat(rs, "val_true_reward")), pm(*stat(rs, "kl"), ".3f"),
                     pm(*stat(rs, "true_reward")), pm(*stat(rs, "win_rate"), ".3f"),
                     pm(*stat(rs, "eos_rate"), ".3f"), pm(*newer(rs, "in_language"), ".3f"),
                     pm(*newer(rs, "reward_model_score")), pm(*stat(rs, "response_len"), ".1f"),
                     pm(*stat(rs, "true_reward_finished"))]
                    + ([pm(*stat(rs, "beyond_pool"), ".3f")] if beyond else [])
                    + [gain, " ".join(flags) or "–", "✓" if name in chosen[method] else "",
                       fmt_duration(sum(r["wall_s"] or 0 for r in rs) / len(rs))])
    ref = rows[0]
    md = table(["method", "configuration", "seeds", "val reward", "KL(π‖π_ref) nats",
                "true reward", "win rate vs π_ref", "EOS rate", "in language", "r_φ score",
                "response tokens", "reward if finished"] + (["beyond pool best"] if beyond else [])
               + [f"val gain after {cfg.check_at:g} of budget", "flags", "on val envelope",
                  "wall per run"], body)
    pool = (f"Beyond pool best: the share of completions whose true reward exceeds "
            f"{ref['pool_best']:+g}, the best of any response in the training pairs (behaviour "
            "the pairs never showed). " if beyond else "")
    return (f"## The frontier{regime_title(ref['regime'], cfg)}: true reward against "
            "KL(π‖π_ref), as Figure 2 of the DPO paper\n\n"
            f"{md}\n\n{pool}Every configuration trained once per seed ({cfg.seeds}: the stages' "
            "`seed`, data order and sampling; π_ref, r_φ and the reference cache shared) and "
            "scored twice by evaluate.py's one rule: on the validation prompts (val reward, the "
            "selection's input) and on the test prompts (every other column). Each cell: mean "
            "over the seeds ± standard error across seeds (n − 1 in the variance), so the ± holds "
            "training and evaluation noise together; frontier.csv keeps one row per seed. Each "
            f"policy sampled {cfg.eval_k} completions of every prompt ({ref['n_completions']} "
            "test completions, temperature 1). KL: their mean Σ_t log π − log π_ref, with the "
            "training log-prob function; true reward: the task's hidden reward; win rate: against "
            "π_ref's completions of the same prompts, ties half; EOS rate: the share of "
            "completions that ended, the rest cut at the generation budget, where their KL and "
            "reward are lower bounds; in language: the share that ended and are texts of the "
            "task's language, the only ones the true reward pays in full; r_φ score: the learned "
            "reward's mean score of them by the same rule (– where the run had no r_φ), the proxy "
            "PPO optimises, which rises where over-optimisation lowers the true reward; reward if "
            "finished: the mean true reward of those that ended. "
            f"Val gain: validation reward at the end minus at {cfg.check_at:g} of the "
            "budget, mean over seeds [95% t-interval]. Flags: cut, more than "
            f"{TRUNCATED_MAX:.0%} of test completions cut at the budget; budget, the val gain's "
            "interval lies above 0 (still rising when the budget ended it). Flagged "
            "configurations stay out of the matched-KL table. On val envelope: a vertex of the "
            "upper concave envelope of the method's validation means (π_ref included), the "
            "configurations the matched-KL table reads on test. The π_ref row is one evaluation "
            "of π_ref against a second copy of itself (its sampling s.e. is "
            f"{ref['true_reward_se']:.3f}). A run repeats exactly on the same CPU with the same "
            f"thread count ({torch.get_num_threads()} here). Wall time: training and evaluation, "
            f"mean per run; the {len(rows) - 1} runs took "
            f"{fmt_duration(sum(r['wall_s'] or 0 for r in rows[1:]))} in all, whichever "
            "invocation of the command trained each (a rerun skips finished runs, so the "
            "section's own wall time can be far shorter).")


# a cell read between two envelope vertices further apart (nats of KL) is marked "(chord)": the
# widest step of the default --match_kls grid (1,2,4,6,8), so a longer chord can hold a row of the
# grid with no vertex of the envelope within a step of it
CHORD_MAX = 2.0


def matched_kl_markdown(rows, cfg):
    """One regime's methods at --match_kls, each read off its envelope (study/envelope.py); a cell
    read off a chord longer than CHORD_MAX nats is marked "(chord)", and the note lists those
    chords per method."""
    groups = settings(rows)
    methods = [m for m in METHODS if any(k[0] == m for k in groups)]
    configs = {m: envelope_configs(groups, m) for m in methods}
    env = {m: envelope.select_on_val(configs[m])[1] for m in methods}
    versus = [m for m in ("DPO", "DPO+NLL", "online DPO", "GRPO") if m in methods] \
        if "PPO" in methods \
        else []
    body = []
    for x in floats(cfg.match_kls):
        cells = [f"{x:g}"]
        for m in methods:
            y, b = envelope.envelope_at(env[m], x), envelope.bracket(env[m], x)
            chord = b is not None and 0 < b[2] < 1 and b[1][0] - b[0][0] > CHORD_MAX
            cells.append("–" if y is None else f"{y:+.3f}" + (" (chord)" if chord else ""))
        for m in versus:
            r = envelope.matched_difference(configs[m], configs["PPO"], x)
            cells.append("–" if r["diff"] is None else f"{r['diff']:+.2f}" + (
                f" [{r['low']:+.2f}, {r['high']:+.2f}]" if r["low"] is not None else ""))
        body.append(cells)
    ends = "; ".join(f"{m} {env[m][0][0]:.2f} to {env[m][-1][0]:.2f}" for m in methods if env[m])
    gaps = {m: [(v0[0], v1[0]) for v0, v1 in zip(env[m], env[m][1:]) if v1[0] - v0[0] > CHORD_MAX]
            for m in methods}
    chords = "; ".join(f"{m} " + ", ".join(f"{x0:.2f} to {x1:.2f}" for x0, x1 in g)
                       for m, g in gaps.items() if g) or "none"
    md = table(["KL(π‖π_ref) nats"] + [f"{m} true reward" for m in methods]
               + [f"{m} − PPO [95% CI]" for m in versus], body)
    if all(c == "–" for cells in body for c in cells[1:]):  # no table of dashes
        md = f"No --match_kls value ({cfg.match_kls} nats) lies inside any envelope."
    return (f"## At matched KL{regime_title(rows[0]['regime'], cfg)}: true reward on each "
            f"method's envelope\n\n{md}\n\nA method's envelope: the upper concave hull of the "
            "test means of its configurations on the validation envelope (the frontier table's "
            "✓; flagged configurations left out), read linearly between its vertices. A mixture "
            "of two policies (one of them at random per prompt) attains their weighted reward at "
            "no more than their weighted KL, so every point of the envelope is attainable "
            "(evaluate.evaluate_mixture, tested). –: outside the envelope's measured range "
            f"({ends} nats). (chord): read between two vertices more than {CHORD_MAX:g} nats "
            "apart, a mixture of two configurations where no vertex of the envelope lies, so a "
            "lower bound of what the method attains there, not a run's measurement; such chords: "
            f"{chords} (nats). Differences: the selection made once on the validation "
            "means, each envelope at x is a weighted sum of one or two configurations' mean test "
            "rewards; 95% t-interval of that difference, se² = Σ w²·s²/n over the configurations' "
            "seeds (independent runs; π_ref, run once, adds no spread), degrees of freedom by "
            "Welch–Satterthwaite (study/envelope.py, matched_difference); a difference counts "
            "when its interval excludes 0.")


def j_beta_markdown(rows, cfg):
    """The objective DPO and PPO both claim to maximise, E[r] − β·KL, at each β they share."""
    groups, body = settings(rows), []
    beta_of = lambda m, rs: rs[0]["kl_coef" if m in KL_COEF_METHODS else "beta"]  # noqa: E731
    # SimPO's β scales its margin, not a KL: it has no J_β of its own
    for b in sorted({beta_of(m, rs) for (m, _), rs in groups.items() if m in J_METHODS}):
        cells, per_seed = [f"{b:g}"], {}
        for m in J_METHODS:
            at = [(name, rs) for (mm, name), rs in groups.items()
                  if mm == m and beta_of(m, rs) == b]
            if not at:
                cells.append("–")
                continue
            # among this method's configurations at β (its lrs), the one best on validation
            name, rs = max(at, key=lambda a: mean_se(
                [r["val_true_reward"] - b * r["val_kl"] for r in a[1]])[0])  # noqa: B023
            per_seed[m] = [r["true_reward"] - b * r["kl"] for r in rs]
            j = envelope.mean_interval(per_seed[m])
            cells.append(f"{j[0]:+.2f}" + (f" [{j[1]:+.2f}, {j[2]:+.2f}]" if j[1] is not None
                                            else "") + f" ({name.split(', ')[1]})")
        d = (envelope.welch_interval(per_seed["DPO"], per_seed["PPO"])
             if {"DPO", "PPO"} <= per_seed.keys() else (None, None, None))
        cells.append("–" if d[0] is None else f"{d[0]:+.2f}" + (
            f" [{d[1]:+.2f}, {d[2]:+.2f}]" if d[1] is not None else ""))
        body.append(cells)
    shared = [c for c in body if sum(x != "–" for x in c[1:]) >= 2]
    md = table(["β = KL coef", *J_METHODS, "DPO − PPO [95% Welch]"], shared or body)
    return (f"## The regularised objective{regime_title(rows[0]['regime'], cfg)}: "
            f"J_β = E[r] − β·KL(π‖π_ref)\n\n{md}\n\nThe objective both DPO (eq. 3 of "
            "Rafailov et al. 2023, which DPO's loss solves in closed form) and PPO with a KL "
            "coefficient β maximise, on the test prompts: per seed, true reward − β × KL, mean "
            "[95% t-interval across seeds]; at each β the method's configuration (lr) with the "
            "best mean J_β on validation; DPO − PPO: the difference of means with its 95% Welch "
            "interval. Rows: the β values at least two methods were run at.")


def curves_markdown(curves, cfg):
    body = [[r["method"], r["step"], f"{r['responses']:,}", f"{r['flops']:.3g}",
             f"{r['kl']:.3f}", pm(r["true_reward"], r["true_reward_se"]),
             pm(r["eos_rate"], None, ".3f"), pm(r.get("in_language"), None, ".3f"),
             pm(r.get("reward_model_score"), None), pm(r["response_len"], None, ".1f")]
            for r in curves]  # .get: rows written before evaluate.py reported the two
    md = table(["method", "step", "responses", "loop FLOPs", "KL(π‖π_ref) nats", "true reward",
                "EOS rate", "in language", "r_φ score", "response tokens"], body)
    runs = ", ".join(sorted({r["run"] for r in curves}))
    return (f"## Learning curves: one run of each method ({runs})\n\n{md}\n\nThe run trained "
            f"in {cfg.curve_points} chunks (`--stop_after`; the stages resume exactly, so this is "
            "the uninterrupted run) and its checkpoint evaluated after each by the same "
            "evaluation as the frontier; step 0 is π_ref, the last point the run's eval.json. One "
            "seed: ± is the evaluation's sampling error only (its completions counted as "
            "independent). Budget, in responses that carried a "
            "preference signal into training: DPO, 2 labelled responses per pair (2 × batch per "
            "step, repeats counted); PPO, 1 rollout scored by r_φ per prompt (rollout batch per "
            "iteration), on top of the labelled pairs r_φ was trained on once before. Loop FLOPs: "
            "the loop's model FLOPs as it counted them (meter.model_flops of its real tokens, "
            "padding not counted), cumulative; the one-time precompute (DPO) and r_φ's training "
            "(PPO) are in the cost tables, not here.")


def chosen_configs(rows):
    """Each method's configuration that validation picks for reward: the highest mean validation
    true reward among its unflagged configurations (among all, if every one is flagged).
    {method: (configuration, its rows)}, π_ref left out."""
    best = {}
    for (m, name), rs in settings(rows).items():
        if m == "π_ref":
            continue
        key = (not verdicts(rs)["flagged"], mean_se([r["val_true_reward"] for r in rs])[0])
        if m not in best or key > best[m][0]:
            best[m] = (key, name, rs)
    return {m: (name, rs) for m, (_, name, rs) in best.items()}


def samples_markdown(rows, samples):
    """What the numbers score: the evaluation's first completions (fixed test prompts, sampling
    seed 0) of each method at its chosen configuration, first seed; samples: {run: eval.json's
    samples}. Each with its true reward and whether it is a text of the task's language."""
    lines = []
    for m, (name, rs) in chosen_configs(rows).items():
        lines.append(f"**{m}** ({name}, {rs[0]['run']}):\n")
        for x in samples.get(rs[0]["run"], []):
            ok = x["policy_finished"] and task.in_language(x["prompt"], x["policy"])
            lines.append(f"- {x['prompt']} →{x['policy'] or ' (nothing)'}"
                         f"{'' if x['policy_finished'] else ' (no EOS)'} — "
                         f"{x['policy_reward']:+g}, {'in' if ok else 'not in'} the language")
        lines.append("")
    return ("## Samples: what the numbers score\n\n" + "\n".join(lines) + "\nEach method at the "
            "configuration with the best validation reward among its unflagged ones, its first "
            "seed's run, one completion of each of the first three test prompts (the evaluation's "
            "own samples, sampling seed 0), with its true reward.")


def write_tables(rows, curves, cfg):
    """frontier.csv, curves.csv, frontier.md and, if matplotlib is installed, frontier.png and
    curves.png; returns the markdown, and its parts for RESULTS.md: {"frontier": the frontier and
    matched-KL tables, "curves": the learning curves' (if any)}."""
    write_csv(f"{cfg.out_dir}/frontier.csv", rows)
    by_regime = {}
    for r in rows:
        by_regime.setdefault(r["regime"], []).append(r)
    parts = [f(rs, cfg) for rs in by_regime.values()
             for f in (frontier_markdown, matched_kl_markdown, j_beta_markdown)]
    read = lambda run: json.loads(open(os.path.join(cfg.out_dir, run, "eval.json")).read())  # noqa
    parts.append(samples_markdown(rows, {r["run"]: read(r["run"]).get("samples", [])
                                         for r in rows if r["method"] != "π_ref"}))
    rows = next(iter(by_regime.values()))  # the plot: the first regime's frontier
    sections = {"frontier": "\n\n".join(parts)}
    if curves:
        write_csv(f"{cfg.out_dir}/curves.csv", curves)
        parts.append(sections.setdefault("curves", curves_markdown(curves, cfg)))
    md = "\n\n".join(parts)
    atomic_write_text(f"{cfg.out_dir}/frontier.md", md + "\n")
    try:  # the plots are optional: nothing else needs matplotlib
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return md + "\n\n(no frontier.png, curves.png: matplotlib is not installed)", sections
    fig, ax = plt.subplots(figsize=(6, 4))
    groups = settings(rows)
    for method, marker in zip(METHODS, "PoDXv*s^"):
        pts = [(mean_se([r["kl"] for r in rs]), mean_se([r["true_reward"] for r in rs]))
               for (m, _), rs in groups.items() if m == method]
        if not pts:
            continue
        (x, xe), (y, ye) = zip(*[p[0] for p in pts]), zip(*[p[1] for p in pts])
        bars = ax.errorbar(x, y, xerr=xe, yerr=ye, fmt=marker, capsize=2, label=method)
        env = envelope.select_on_val(envelope_configs(groups, method))[1]
        ax.plot(*zip(*env), "-", color=bars[0].get_color())  # its envelope, chosen on validation
    ax.plot([rows[0]["kl"]], [rows[0]["true_reward"]], "k*", label="π_ref")
    ax.set(xlabel="KL(π‖π_ref), nats per completion", ylabel="true reward",
           title="test prompts: configurations ± s.e. over seeds, envelopes")
    ax.legend()
    fig.tight_layout()
    fig.savefig(f"{cfg.out_dir}/frontier.png", dpi=120)
    plt.close(fig)
    if curves:
        fig, axes = plt.subplots(2, 2, figsize=(10, 7))
        for col, xk in enumerate(("responses", "flops")):
            for row, yk in enumerate(("true_reward", "kl")):
                for run in sorted({r["run"] for r in curves}):
                    rs = [r for r in curves if r["run"] == run]
                    axes[row][col].plot([r[xk] for r in rs], [r[yk] for r in rs], "o-", label=run)
                axes[row][col].set(xlabel={"responses": "responses labelled (DPO) or scored (PPO)",
                                           "flops": "loop FLOPs"}[xk], ylabel=yk)
        axes[0][0].legend()
        fig.tight_layout()
        fig.savefig(f"{cfg.out_dir}/curves.png", dpi=120)
        plt.close(fig)
    return md, sections
