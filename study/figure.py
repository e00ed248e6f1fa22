"""The frontier as a picture: true reward against KL(π‖π_ref) for every configuration in
RESULTS.md's frontier table, each method's envelope drawn through those chosen on validation; and
beside it, each run that optimised the learned reward r_φ (PPO, GRPO, online DPO), its r_φ score
and its true reward against its KL: where the two part, the policy is over-optimising the proxy.

    pip install matplotlib          # the only study that needs it
    python -m study.figure          # reads RESULTS.md, writes docs/frontier.png

It reads the table `python -m study.compare` wrote (the sections named by --sections) and the
per-run rows it kept (--rows, frontier.csv of `study.compare --keep`), so the figure shows measured
test numbers, nothing else. The envelope is
what a method can attain: a mixture of two trained policies (one picked at random per prompt) gets
their weighted mean reward at no more than their weighted mean KL (KL is convex), so every point
under the upper concave hull of its chosen configurations, π_ref at the origin included, is within
its reach (study/envelope.py; the chosen ones: the table's "on val envelope" ✓).
"""
import csv
import os
import re
from dataclasses import dataclass

from plumbing import check, parse_config
from study.envelope import upper_envelope


@dataclass
class Config:
    results: str = "RESULTS.md"  # the file whose frontier tables are drawn
    sections: str = "frontier"  # its sections to read, comma-separated
    out: str = "docs/frontier.png"  # the figure written
    rows: str = "study/runs/compare/frontier.csv"  # one row per run, for the r_φ panel ("": none)


PROXY_METHODS = ("PPO", "GRPO", "online DPO")  # the methods that optimise r_φ's scores
FAR_KL = 50.0  # nats: a point past it is named at the plot's edge, not drawn to scale


def mean_se(cell):
    """'+11.789 ± 0.164' -> (11.789, 0.164); '-0.012' -> (-0.012, 0.0)."""
    parts = [float(x) for x in cell.replace("+", "").split("±")]
    return parts[0], (parts[1] if len(parts) > 1 else 0.0)


def read_points(path, sections):
    """Each row of the frontier table (the one whose header starts `| method |`) in each section
    of `path`: {"method", "setting", "section", "kl", "kl_se", "reward", "reward_se", "chosen"}
    (chosen: a ✓ under "on val envelope"). A row that repeats one already read is read once."""
    check(os.path.exists(path), f"{path} does not exist")
    text = open(path, encoding="utf-8").read()
    points, seen = [], set()
    for name in sections:
        m = re.search(rf"<!-- begin {re.escape(name)} -->\n(.*?)<!-- end {re.escape(name)} -->",
                      text, re.S)
        check(m, f"{path} has no section {name!r}")
        lines = m.group(1).split("\n")
        head = next((i for i, line in enumerate(lines) if line.startswith("| method |")), None)
        check(head is not None, f"{path}, section {name!r}: no table with a `| method |` header")
        cols = [c.strip() for c in lines[head].strip("|").split("|")]
        kl, reward = cols.index("KL(π‖π_ref) nats"), cols.index("true reward")
        chosen = cols.index("on val envelope") if "on val envelope" in cols else None
        for line in lines[head + 2:]:
            if not line.startswith("|"):
                break
            row = [c.strip() for c in line.strip("|").split("|")]
            key = (row[0], row[1], row[kl], row[reward])
            if key in seen:
                continue
            seen.add(key)
            (x, x_se), (y, y_se) = mean_se(row[kl]), mean_se(row[reward])
            points.append({"method": row[0], "setting": row[1], "section": name, "kl": x,
                           "kl_se": x_se, "reward": y, "reward_se": y_se,
                           "chosen": chosen is None or row[chosen] == "✓"})
    return points


def read_proxy_runs(path):
    """The runs of frontier.csv that optimised r_φ (PROXY_METHODS), each {"method", "kl", "true",
    "proxy"}: its test KL, true reward and r_φ score; [] without the file or the column."""
    if not path or not os.path.exists(path):
        return []
    with open(path, newline="", encoding="utf-8") as f:
        return [{"method": r["method"], "kl": float(r["kl"]), "true": float(r["true_reward"]),
                 "proxy": float(r["reward_model_score"])}
                for r in csv.DictReader(f) if r["method"] in PROXY_METHODS
                and r.get("reward_model_score") not in (None, "", "None")]


def draw(points, out, runs=()):
    """The figure: each method's points with their standard errors over seeds (both axes), its
    envelope through its chosen ones, π_ref at the origin. Written to out + '.tmp', renamed."""
    try:
        import matplotlib
    except ImportError:
        raise SystemExit("error: the figure needs matplotlib (pip install matplotlib); "
                         "nothing was written")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    ref = next(p for p in points if p["method"] == "π_ref")
    fig, axes = plt.subplots(1, 2 if runs else 1, figsize=(13 if runs else 7.5, 5), squeeze=False)
    ax = axes[0][0]
    groups = {}
    for p in points:
        if p["method"] != "π_ref":
            groups.setdefault(p["method"], []).append(p)
    for label, ps in groups.items():
        env = upper_envelope([(ref["kl"], ref["reward"])]
                             + [(p["kl"], p["reward"]) for p in ps if p["chosen"]])
        line, = ax.plot(*zip(*env), "--", lw=1)
        ax.errorbar([p["kl"] for p in ps], [p["reward"] for p in ps],
                    xerr=[p["kl_se"] for p in ps], yerr=[p["reward_se"] for p in ps], fmt="o",
                    ms=5, capsize=2, color=line.get_color(), label=label)
        for p in ps:
            ax.annotate(p["setting"].replace(", ", "\n"), (p["kl"], p["reward"]),
                        textcoords="offset points",
                        xytext=(4, 4), fontsize=7, color=line.get_color())
    ax.plot([ref["kl"]], [ref["reward"]], "ks", label="π_ref")
    # a collapsed run far out on KL would squeeze every other point: named at the edge instead
    near = [p["kl"] for p in points if p["kl"] <= FAR_KL]
    if len(near) < len(points):
        right = 1.15 * max(near)
        ax.set_xlim(-0.02 * right, right)
        for p in points:
            if p["kl"] > FAR_KL:
                ax.annotate(f"{p['method']} ({p['setting']}) at KL {p['kl']:.0f} →",
                            (right, p["reward"]), ha="right", va="bottom", fontsize=7)
    ax.set_xlabel("KL(π‖π_ref), nats per completion")
    ax.set_ylabel("true reward (the task's hidden reward)")
    ax.set_title("Test prompts, mean ± s.e. over seeds; dashed: the envelope of the "
                 "configurations chosen on validation", fontsize=8)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="center right")
    if runs:
        proxy_panel(axes[0][1], runs)
    fig.tight_layout()
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    fig.savefig(out + ".tmp", dpi=110, format=os.path.splitext(out)[1][1:] or "png")
    plt.close(fig)
    os.replace(out + ".tmp", out)


def proxy_panel(ax, runs):
    """Each run on r_φ twice at its KL: r_φ's score (filled) and the true reward (open), a line
    between them; the gap that opens with KL is what the proxy pays for and the task does not."""
    for method, color in zip(PROXY_METHODS, ("tab:red", "tab:purple", "tab:green")):
        rs = [r for r in runs if r["method"] == method]
        if not rs:
            continue
        for r in rs:
            ax.plot([r["kl"], r["kl"]], [r["proxy"], r["true"]], "-", lw=0.5, color=color)
        ax.plot([r["kl"] for r in rs], [r["proxy"] for r in rs], "o", color=color, ms=4,
                label=f"{method}: r_φ score")
        ax.plot([r["kl"] for r in rs], [r["true"] for r in rs], "o", mfc="none", color=color,
                ms=5, label=f"{method}: true reward")
    ax.set_xlabel("KL(π‖π_ref), nats per completion")
    ax.set_ylabel("score")
    ax.set_title("Runs on r_φ, each a point: the proxy and the hidden reward", fontsize=8)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="upper left")


def main(cfg):
    points = read_points(cfg.results, cfg.sections.split(","))
    check(any(p["method"] == "π_ref" for p in points), f"{cfg.results}: no π_ref row to anchor on")
    runs = read_proxy_runs(cfg.rows)
    draw(points, cfg.out, runs)
    print(f"wrote {cfg.out}: {len(points)} points from the sections {cfg.sections} of "
          f"{cfg.results}" + (f", {len(runs)} runs on r_φ from {cfg.rows}" if runs else ""))


if __name__ == "__main__":
    main(parse_config(Config, doc=__doc__))
