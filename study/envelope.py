"""The statistics the quality verdict is read with: what a method attains at a KL, how sure we are.

    pytest tests/test_envelope.py           # the tests: hulls, selection, t-intervals

Pure functions of numbers, no torch. A method is trained at several configurations (DPO β × lr, PPO
KL coefficient), each once per training seed; every run is evaluated on validation and on test
prompts. A method's configs: {name: [one dict per seed with val_kl, val_reward, test_kl,
test_reward]}, KL(π‖π_ref) in nats, the hidden true reward in its own units.
- Mixing two policies (one of them at random per prompt) attains their weighted reward at no more
  than their weighted KL, KL being convex in π; so what a method attains is the upper concave
  envelope of the points it reached, read only between its measured ends.
- Selection reads validation only (which configurations are the envelope's vertices), reported
  numbers read test only (the envelope of those configurations' test means).
- Intervals are 95% and Student t: across seeds for a mean, Welch for a difference of means,
  Welch–Satterthwaite for a weighted sum of independent configurations' means (a matched-KL
  difference). A difference counts when its 95% interval excludes 0. Not a percentile bootstrap:
  over 4 seeds it treats the 4 values as the population and is about half as wide as t(3)'s.
"""
import itertools
import math
from statistics import fmean, variance

# Student t's 0.975 quantile for df 1..30 (two-sided 95%); the normal's beyond
T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228,
        2.201, 2.179, 2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086,
        2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042)
Z975 = 1.960


def upper_envelope(points):
    """The vertices, in order of KL, of the least concave function on or above every point (kl,
    reward), over [min kl, max kl]; [] for no points. Andrew's monotone chain, upper half: a point
    on or below the chord of its neighbours is no vertex (a mixture does as well), and the last
    point stays even when its reward is lower (nothing measured lies further right)."""
    best = {}
    for kl, r in points:  # at one KL only the higher reward is attainable by mixing
        best[kl] = max(r, best.get(kl, r))
    hull = []
    for p in sorted(best.items()):
        # pop while the last vertex lies on or below the chord from its predecessor to p
        while len(hull) >= 2 and ((hull[-1][0] - hull[-2][0]) * (p[1] - hull[-2][1])
                                  - (hull[-1][1] - hull[-2][1]) * (p[0] - hull[-2][0])) >= 0:
            hull.pop()
        hull.append(p)
    return hull


def bracket(vertices, x):
    """(v0, v1, w): the two vertices whose segment holds KL x, and x's share of the way from v0 to
    v1, so the envelope at x is (1 − w)·y0 + w·y1 (0 < w < 1: read off the chord, where no vertex
    lies); (v, v, 0) for a single vertex at x; None outside [first kl, last kl]."""
    if not vertices or not vertices[0][0] <= x <= vertices[-1][0]:
        return None
    for v0, v1 in itertools.pairwise(vertices):
        if x <= v1[0]:
            return v0, v1, (x - v0[0]) / (v1[0] - v0[0])
    return vertices[-1], vertices[-1], 0.0  # a single vertex, and x is its kl


def envelope_at(vertices, x):
    """The envelope's value at KL x, linear between the two vertices that bracket x; None outside
    [first kl, last kl]: no extrapolation, a number only where the method has measured points."""
    b = bracket(vertices, x)
    return None if b is None else b[0][1] + b[2] * (b[1][1] - b[0][1])


def mean_point(runs, split):
    """(mean kl, mean reward) over a configuration's seeds on split ("val" or "test")."""
    return fmean(r[f"{split}_kl"] for r in runs), fmean(r[f"{split}_reward"] for r in runs)


def select_on_val(configs):
    """(selected, envelope). selected: the names of the configurations whose validation means are
    vertices of the validation envelope, in order of their validation KL; envelope: the upper
    envelope of those configurations' test means. A configuration dominated on validation is never
    chosen, however well it does on test: the test prompts only report."""
    val = {name: mean_point(runs, "val") for name, runs in configs.items()}
    vertices = set(upper_envelope(val.values()))
    selected = sorted((name for name, p in val.items() if p in vertices), key=lambda n: val[n])
    return selected, upper_envelope([mean_point(configs[n], "test") for n in selected])


def envelope_weights(configs, x):
    """{name: weight}: the test envelope of configs at KL x, after selection on validation, as a
    weighted sum Σ weight·(mean test reward) of the configurations at the vertices that bracket x
    (weights > 0, summing to 1; one configuration at a vertex); None outside the envelope."""
    selected, env = select_on_val(configs)
    b = bracket(env, x)
    if b is None:
        return None
    name = {mean_point(configs[n], "test"): n for n in selected}  # each vertex's configuration
    weights = {}
    for v, w in ((b[0], 1 - b[2]), (b[1], b[2])):
        if w > 0:
            weights[name[v]] = weights.get(name[v], 0.0) + w
    return weights


def matched_difference(a, b, x):
    """Method a's test envelope minus method b's at KL x, each after selection on validation, with
    its 95% t-interval. a, b: configs. Returns {"diff", "low", "high"}, all None where either
    envelope does not reach x; low and high None where no configuration it reads has two seeds.

    The selection is made once, on the validation means; at x each envelope is then a weighted sum
    of one or two configurations' mean test rewards (envelope_weights), so the difference is
    Σ wᵢ·mean(rᵢ) over independent groups of seeds (a's weights +, b's −; each configuration's
    seeds are runs of their own) and its interval is contrast_interval's: ± t(ν)·se with
    se² = Σ wᵢ²·sᵢ²/nᵢ and ν by Welch–Satterthwaite. A configuration run once (π_ref: untrained,
    no training seed moves it) adds its value and no spread. The interval is conditional on the
    selection and on the vertices' mean KLs (the weights): it holds the spread of the rewards it
    averages, not the chance that other seeds would choose other vertices. (A percentile bootstrap
    that redid the selection per replicate would hold that too, but over 4 seeds it is about half
    as wide as t(3)'s interval: it treats the 4 values as the population.)"""
    wa, wb = envelope_weights(a, x), envelope_weights(b, x)
    if wa is None or wb is None:
        return {"diff": None, "low": None, "high": None}
    terms = [(w, a[n]) for n, w in wa.items()] + [(-w, b[n]) for n, w in wb.items()]
    rewards = [(w, [r["test_reward"] for r in runs]) for w, runs in terms]
    fixed = sum(w * xs[0] for w, xs in rewards if len(xs) == 1)
    spread = [(w, xs) for w, xs in rewards if len(xs) > 1]
    if not spread:
        return {"diff": fixed, "low": None, "high": None}
    d, low, high = contrast_interval(spread)
    return {"diff": fixed + d, "low": fixed + low, "high": fixed + high}


def t_quantile(df, p=0.975):
    """Student t's p-quantile at df degrees of freedom (df ≥ 1, not necessarily an integer, as
    Welch's): T975 at integer df, linear in 1/df between the bracketing entries, the last ones
    being df 30 and df ∞ (the normal's 1.960), as printed tables are meant to be read (t is close
    to linear in 1/df). Only p = 0.975, the two-sided 95% interval, is tabulated."""
    if p != 0.975:
        raise ValueError(f"t_quantile has a table for p = 0.975 only (two-sided 95%), not {p}")
    if not df >= 1:
        raise ValueError(f"t_quantile needs df >= 1, got {df}")
    if df >= len(T975):
        lo, hi, t_lo, t_hi = len(T975), math.inf, T975[-1], Z975
    else:
        lo = math.floor(df)
        hi, t_lo, t_hi = lo + 1, T975[lo - 1], T975[lo]
    w = (1 / lo - 1 / df) / (1 / lo - 1 / hi)
    return t_lo + w * (t_hi - t_lo)


def mean_interval(xs):
    """(mean, low, high): the mean over seeds and its 95% t-interval, mean ± t(n − 1)·s/√n with s
    the sample standard deviation (n − 1); (mean, None, None) for one seed: no spread to read."""
    n, m = len(xs), fmean(xs)
    if n < 2:
        return m, None, None
    h = t_quantile(n - 1) * math.sqrt(variance(xs) / n)
    return m, m - h, m + h


def welch_interval(xs, ys):
    """(d, low, high): d = mean(xs) − mean(ys) and its 95% Welch interval (contrast_interval of
    the two): the two sets of seeds may differ in number and spread. (d, None, None) when either
    side has one seed; (d, d, d) when neither spreads."""
    return contrast_interval([(1, xs), (-1, ys)])


def contrast_interval(groups):
    """(d, low, high): d = Σ w·mean(xs) over independent groups [(w, xs)] of seeds, and its 95%
    interval d ± t(ν)·se, se² = Σ w²·s²/n and ν by Welch–Satterthwaite, (Σ w²s²/n)² /
    Σ (w²s²/n)²/(n − 1). Two groups (+1, xs), (−1, ys): Welch's interval; four of weight ±1: a
    difference in differences, (a − b) − (c − e); weights between: points read off chords."""
    d = sum(w * fmean(xs) for w, xs in groups)
    if any(len(xs) < 2 for _, xs in groups):
        return d, None, None
    v = [w * w * variance(xs) / len(xs) for w, xs in groups]
    if sum(v) == 0:
        return d, d, d
    df = sum(v) ** 2 / sum(vi ** 2 / (len(xs) - 1) for vi, (_, xs) in zip(v, groups))
    h = t_quantile(df) * math.sqrt(sum(v))
    return d, d - h, d + h


def j_beta(rows, beta):
    """(mean, low, high) over seeds of J_β = E[r] − β·KL(π‖π_ref) on test prompts, the regularised
    objective DPO and PPO both claim to maximise (Rafailov et al. 2023, Eq. 3); rows: one dict per
    seed with test_reward and test_kl. Read at one β it ranks methods with no KL matching."""
    return mean_interval([r["test_reward"] - beta * r["test_kl"] for r in rows])
