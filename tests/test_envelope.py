"""study/envelope.py's tests: hulls and their values by hand, selection on validation against a
configuration that is best on test only, the matched-KL difference and its t-interval by hand and
its coverage over simulated seeds, the t table against the t density integrated, and the intervals
by hand.

    pytest tests/test_envelope.py
"""
import itertools
import math
import random

import pytest

from study import envelope
from study.envelope import (
    bracket,
    envelope_at,
    envelope_weights,
    j_beta,
    matched_difference,
    mean_interval,
    select_on_val,
    t_quantile,
    upper_envelope,
    welch_interval,
)

# ==================================================================================================
# the envelope
# ==================================================================================================

def test_upper_envelope_by_hand():
    assert upper_envelope([]) == [] and upper_envelope([(1.0, 2.0)]) == [(1.0, 2.0)]
    # (1, 0.5) lies below the chord from (0, 0) to (2, 2): a mixture of the two does better
    assert upper_envelope([(2, 2), (1, 0.5), (0, 0)]) == [(0, 0), (2, 2)]
    # on the chord: attained by mixing, no vertex; just above it: a vertex
    assert upper_envelope([(0, 0), (1, 1), (2, 2)]) == [(0, 0), (2, 2)]
    assert upper_envelope([(0, 0), (1, 1.01), (2, 2)]) == [(0, 0), (1, 1.01), (2, 2)]
    # the point of largest KL stays though its reward is lower: the envelope spans the measured KLs
    assert upper_envelope([(0, 0), (1, 2), (3, 1)]) == [(0, 0), (1, 2), (3, 1)]
    # one chord that covers three points below it: each is popped in turn
    assert upper_envelope([(0, 0), (1, 1), (2, 1.8), (3, 2.4), (4, 4)]) == [(0, 0), (4, 4)]
    # two points at one KL: the higher reward, whatever the order
    assert upper_envelope([(1, 3), (0, 0), (1, 1)]) == [(0, 0), (1, 3)]
    assert upper_envelope([(1, 1), (1, 3)]) == [(1, 3)]


def test_upper_envelope_is_concave_above_every_point_and_made_of_them():
    rng = random.Random(0)
    for _ in range(200):
        pts = [(rng.choice((0.5, 1.0, 2.0, 3.0, 5.0, 8.0)), rng.gauss(0, 1))
               for _ in range(rng.randint(1, 12))]
        hull = upper_envelope(pts)
        assert set(hull) <= set(pts)
        assert (hull[0][0], hull[-1][0]) == (min(p[0] for p in pts), max(p[0] for p in pts))
        slopes = [(y1 - y0) / (x1 - x0) for (x0, y0), (x1, y1) in itertools.pairwise(hull)]
        assert all(s0 > s1 for s0, s1 in itertools.pairwise(slopes))  # strictly: none collinear
        assert all(envelope_at(hull, x) >= y - 1e-12 for x, y in pts)


def test_envelope_at_vertices_between_and_outside():
    v = [(1.0, 2.0), (3.0, 4.0), (5.0, 4.5)]
    assert [envelope_at(v, x) for x in (1.0, 3.0, 5.0)] == [2.0, 4.0, 4.5]
    # a quarter of the way along each segment
    assert envelope_at(v, 1.5) == pytest.approx(2.5) and envelope_at(v, 3.5) == pytest.approx(4.125)
    assert envelope_at(v, 0.999) is None and envelope_at(v, 5.001) is None
    assert envelope_at([(2.0, 1.0)], 2.0) == 1.0 and envelope_at([(2.0, 1.0)], 2.1) is None
    assert envelope_at([], 0.0) is None


def test_bracket_by_hand():
    v = [(1.0, 2.0), (3.0, 4.0), (5.0, 4.5)]
    # a quarter of the way from the first vertex to the second; at a vertex, the end of a segment
    assert bracket(v, 1.5) == ((1.0, 2.0), (3.0, 4.0), 0.25)
    assert bracket(v, 4.5) == ((3.0, 4.0), (5.0, 4.5), 0.75)
    assert bracket(v, 1.0) == ((1.0, 2.0), (3.0, 4.0), 0.0)
    assert bracket(v, 3.0) == ((1.0, 2.0), (3.0, 4.0), 1.0)
    assert bracket([(2.0, 1.0)], 2.0) == ((2.0, 1.0), (2.0, 1.0), 0.0)
    assert bracket(v, 0.5) is None and bracket(v, 5.5) is None and bracket([], 0.0) is None


# ==================================================================================================
# selection on validation, and the bootstrap over seeds
# ==================================================================================================

def seeds(val, test):
    """Two seeds of one configuration whose means are val = (kl, reward) and test: ±0.5 apart."""
    return [{"val_kl": val[0] + d, "val_reward": val[1] + d,
             "test_kl": test[0] + d, "test_reward": test[1] + d} for d in (-0.5, 0.5)]


def test_select_on_val_chooses_on_validation_and_reports_test():
    configs = {"high": seeds((3, 3), (3, 2.5)),
               # best on test by far, but below the chord from low to top on validation
               "mid": seeds((1.5, 1.25), (1.5, 9.0)),
               "low": seeds((1, 1), (1, 1)),
               # a vertex on validation; on test below the chord from low to high (1.75 at 2)
               "top": seeds((2, 2.5), (2, 1.5))}
    selected, env = select_on_val(configs)
    assert selected == ["low", "top", "high"]  # in order of validation KL
    assert env == [(1.0, 1.0), (3.0, 2.5)]
    assert select_on_val({}) == ([], [])


def method(shift, kls, n, spread, seed):
    """A method's configs: one per KL in kls, n seeds each, reward √kl + shift, every number with
    Gaussian noise of sd spread, drawn apart for validation and test."""
    rng = random.Random(seed)
    mean = {"kl": lambda k: k, "reward": lambda k: math.sqrt(k) + shift}
    return {f"kl{k}": [{f"{s}_{m}": mean[m](k) + rng.gauss(0, spread)
                        for s in ("val", "test") for m in ("kl", "reward")} for _ in range(n)]
            for k in kls}


def run(kl, reward):
    """One seed at the same KL on validation and test, its reward on test only."""
    return {"val_kl": kl, "val_reward": 0.0, "test_kl": kl, "test_reward": reward}


def test_envelope_weights_by_hand():
    # val means: lo (0, 0), hi (2, 0), both vertices; test means lo (0, 0.5), hi (2, 0)
    a = {"lo": [run(0.0, 0.0), run(0.0, 1.0)], "hi": [run(2.0, 0.0)]}
    assert envelope_weights(a, 0.5) == {"lo": 0.75, "hi": 0.25}
    assert envelope_weights(a, 2.0) == {"hi": 1.0} and envelope_weights(a, 0.0) == {"lo": 1.0}
    assert envelope_weights(a, 2.5) is None


def test_matched_difference_by_hand():
    # a: "lo" at KL 0 with test rewards 0 and 1, "hi" at KL 2 with reward 1; b: 0 everywhere. At
    # x = 1 the difference is half lo's mean plus half hi's: 0.25 + 0.5 = 0.75. Every other
    # configuration ran once (adds its value, no spread), so the interval is lo's alone: weight
    # 1/2, s² = 1/2, n = 2, so se² = (1/4)(1/2)/2 = 1/16, se = 1/4, ν = 1: t(1) = 12.706,
    # half-width 3.1765
    a = {"lo": [run(0.0, 0.0), run(0.0, 1.0)], "hi": [run(2.0, 1.0)]}
    b = {"lo": [run(0.0, 0.0)], "hi": [run(2.0, 0.0)]}
    r = matched_difference(a, b, 1.0)
    assert r == pytest.approx({"diff": 0.75, "low": 0.75 - 3.1765, "high": 0.75 + 3.1765},
                              abs=1e-12)
    assert matched_difference(b, a, 1.0) == pytest.approx(
        {"diff": -0.75, "low": -0.75 - 3.1765, "high": -0.75 + 3.1765}, abs=1e-12)
    # nothing ran twice: a difference, no interval
    assert matched_difference(b, b, 1.0) == {"diff": 0.0, "low": None, "high": None}


def test_matched_difference_reads_four_configurations_off_two_chords_by_hand():
    a = {"p": [run(1, 1.0), run(1, 2.0), run(1, 3.0)], "q": [run(3, 2.0), run(3, 4.0), run(3, 6.0)]}
    b = {"r": [run(0, 0.0), run(0, 1.0)],
         "s": [run(4, 2.0), run(4, 4.0), run(4, 3.0), run(4, 7.0)]}
    # at x = 1.5, a reads p (1, 2) and q (3, 4) at w = 1/4: 3/4·2 + 1/4·4 = 2.5; b reads r (0, 0.5)
    # and s (4, 4) at w = 3/8: 5/8·0.5 + 3/8·4 = 1.8125; d = 0.6875.
    # w²·s²/n: p (9/16)(1/3) = 3/16, q (1/16)(4/3) = 1/12, r (25/64)(1/4) = 25/256,
    # s (9/64)(7/6) = 21/128; se² = 409/768, se = 0.729762.
    # ν = (409/768)² / ((3/16)²/2 + (1/12)²/2 + (25/256)²/1 + (21/128)²/3) = 167281/23333 = 7.169;
    # t between df 7 and 8 at (1/7 − 1/ν)/(1/7 − 1/8) = 0.188904: 2.365 − 0.059·that = 2.353855;
    # half-width 2.353855 · 0.729762 = 1.717753
    r = matched_difference(a, b, 1.5)
    assert r["diff"] == pytest.approx(0.6875, abs=1e-12)
    assert (r["low"], r["high"]) == pytest.approx((0.6875 - 1.717753, 0.6875 + 1.717753), abs=1e-6)


def test_matched_difference_covers_the_true_difference_95_times_in_100():
    # 4 seeds a configuration, each its own spread: the t-interval covers the true difference at
    # x = 1.5, 3/4·1 + 1/4·3 − (3/4·0 + 1/4·2) = 1, in 95% of 2,000 draws (± 1% of chance); a
    # percentile bootstrap over the 4 seeds, or the normal's 1.96 for t, covers far fewer
    rng = random.Random(0)
    mu, sd = {1: (1.0, 0.0), 3: (3.0, 2.0)}, {1: (1.0, 0.5), 3: (2.0, 3.0)}
    hits = 0
    for _ in range(2000):
        a, b = ({f"kl{k}": [run(k, rng.gauss(mu[k][i], sd[k][i])) for _ in range(4)]
                 for k in (1, 3)} for i in (0, 1))
        r = matched_difference(a, b, 1.5)
        hits += r["low"] <= 1.0 <= r["high"]
    assert 0.935 < hits / 2000 < 0.975


def test_matched_difference_is_the_envelopes_difference_within_its_interval():
    kls = (1, 2, 3, 4, 5)
    a, b = method(0.5, kls, 3, 0.1, seed=1), method(0.0, kls, 3, 0.1, seed=2)
    r = matched_difference(a, b, 3.3)
    d = envelope_at(select_on_val(a)[1], 3.3) - envelope_at(select_on_val(b)[1], 3.3)
    assert r["diff"] == pytest.approx(d, abs=1e-12) and r["low"] < r["diff"] < r["high"]
    assert 0.2 < r["diff"] < 0.8


def test_matched_difference_at_a_vertex_is_welchs_interval_by_hand():
    # the same three seeds' offsets from each configuration's (k, √k + shift), once and nine times;
    # at x = 3, a vertex, each side reads configuration 3 alone: Welch's interval of its rewards
    offsets = [(-0.2, 0.1), (0.0, -0.2), (0.2, 0.1)]

    def repeated(shift, m):
        return {k: [{f"{s}_{q}": v for s in ("val", "test")
                     for q, v in (("kl", k + dk), ("reward", math.sqrt(k) + shift + dr))}
                    for dk, dr in offsets * m] for k in (1, 2, 3, 4, 5)}

    def half(m):
        r = matched_difference(repeated(0.5, m), repeated(0.0, m), 3.0)
        assert r["diff"] == pytest.approx(0.5, abs=1e-12)
        return (r["high"] - r["low"]) / 2
    # once: s² = (0.01 + 0.04 + 0.01)/2 = 0.03 each side, se² = 2·0.03/3 = 0.02, ν = 4:
    # 2.776·√0.02 = 0.392586
    assert half(1) == pytest.approx(0.392586, abs=1e-6)
    # nine times: s² = 0.54/26, se² = 2·s²/27 = 1/650, ν = 52: t = 2.042 − (1 − 30/52)·0.082 =
    # 2.007308, half-width 2.007308·√(1/650) = 0.078733
    assert half(9) == pytest.approx(0.078733, abs=1e-6)


def test_matched_difference_is_defined_only_where_both_envelopes_reach():
    a = method(0.5, (1, 2, 3, 4, 5, 6), 3, 0.1, seed=5)
    b = method(0.0, (1, 2, 3, 4), 3, 0.1, seed=6)
    edge = select_on_val(b)[1][-1][0]  # b's largest test KL
    r = matched_difference(a, b, edge)
    assert r["diff"] is not None and r["low"] < r["diff"] < r["high"]
    assert matched_difference(a, b, edge + 1e-9) == {"diff": None, "low": None, "high": None}
    assert matched_difference(a, b, 0.5) == {"diff": None, "low": None, "high": None}


# ==================================================================================================
# t intervals
# ==================================================================================================

def t_cdf(q, df, n=4000):
    """Student t's CDF at q ≥ 0: 1/2 plus its density integrated from 0 by Simpson's rule."""
    c = math.exp(math.lgamma((df + 1) / 2) - math.lgamma(df / 2)) / math.sqrt(df * math.pi)
    f = [c * (1 + (i * q / n) ** 2 / df) ** (-(df + 1) / 2) for i in range(n + 1)]
    return 0.5 + q / n / 3 * (f[0] + f[-1] + sum((4 if i % 2 else 2) * f[i] for i in range(1, n)))


def test_t_quantile_table_is_the_t_distribution_to_three_decimals():
    assert len(envelope.T975) == 30
    for df, t in enumerate(envelope.T975, start=1):
        assert t_quantile(df) == t
        assert t_cdf(t - 0.0005, df) < 0.975 < t_cdf(t + 0.0005, df), df  # rounded to 3 places


def test_t_quantile_known_values_interpolation_and_refusals():
    assert [t_quantile(df) for df in (1, 4, 10, 30)] == [12.706, 2.776, 2.228, 2.042]
    assert t_quantile(math.inf) == 1.960 and t_quantile(1e9) == pytest.approx(1.960, abs=1e-6)
    # linear in 1/df: 2.5 is 0.6 of the way from 1/2 to 1/3, 4.303 − 0.6·1.121 = 3.6304; 60 is half
    # way from 1/30 to 0, 2.042 − 0.5·0.082 = 2.001 (the exact quantile is 2.000)
    assert t_quantile(2.5) == pytest.approx(3.6304, abs=1e-12)
    assert t_quantile(60) == pytest.approx(2.001, abs=1e-12)
    ts = [t_quantile(1 + i / 4) for i in range(400)]
    assert all(t0 > t1 for t0, t1 in itertools.pairwise(ts))
    with pytest.raises(ValueError, match="0.975 only"):
        t_quantile(5, p=0.95)
    with pytest.raises(ValueError, match="df >= 1"):
        t_quantile(0.5)


def test_mean_interval_by_hand():
    # mean 3; sample variance (4 + 1 + 0 + 9)/3 = 14/3; se √(14/3/4) = √(7/6) = 1.080123;
    # t(3) = 3.182: half-width 3.436953
    m, lo, hi = mean_interval([1.0, 2.0, 3.0, 6.0])
    assert m == 3.0 and (lo, hi) == pytest.approx((3 - 3.436953, 3 + 3.436953), abs=1e-6)
    assert mean_interval([0.5]) == (0.5, None, None)


def test_mean_interval_from_two_seeds_by_hand():
    # two seeds: one degree of freedom, t(1) = 12.706; mean 2, s² = ((−1)² + 1²)/1 = 2,
    # se √(2/2) = 1: half-width 12.706
    m, lo, hi = mean_interval([1.0, 3.0])
    assert m == 2.0 and (lo, hi) == pytest.approx((2 - 12.706, 2 + 12.706), abs=1e-9)


def test_welch_interval_by_hand():
    xs, ys = [1.0, 2.0, 3.0, 6.0], [0.0, 1.0, 2.0]
    # means 3 and 1: d = 2. s_x²/n_x = (14/3)/4 = 7/6, s_y²/n_y = 1/3; se² = 3/2, se = 1.224745.
    # ν = (3/2)² / ((7/6)²/3 + (1/3)²/2) = 2.25 / (55/108) = 243/55 = 4.418182; t between df 4
    # and 5 at w = (1/4 − 55/243)/(1/4 − 1/5) = 0.473251: 2.776 − 0.205·w = 2.678984;
    # half-width 2.678984·1.224745 = 3.281071
    d, lo, hi = welch_interval(xs, ys)
    assert d == 2.0 and (lo, hi) == pytest.approx((2 - 3.281071, 2 + 3.281071), abs=1e-6)
    assert welch_interval(ys, xs) == pytest.approx((-2.0, -hi, -lo), abs=1e-12)
    assert welch_interval(xs, [1.0]) == (2.0, None, None)
    assert welch_interval([1.0, 1.0], [0.5, 0.5]) == (0.5, 0.5, 0.5)


def test_j_beta_by_hand():
    # β = 0.25: J = 1 − 0.5, 2 − 1, 0.5 − 0.25 = 0.5, 1, 0.25 per seed; mean 7/12 = 0.583333;
    # deviations −1/12, 5/12, −4/12: variance 42/144/2 = 21/144, se √(21/144/3) = √7/12 = 0.220479;
    # t(2) = 4.303: half-width 0.948722. The val_ fields are there to be ignored
    rows = [{"test_reward": r, "test_kl": kl, "val_reward": 9.0, "val_kl": 0.0}
            for r, kl in ((1.0, 2.0), (2.0, 4.0), (0.5, 1.0))]
    assert j_beta(rows, 0.25) == pytest.approx((0.583333, 0.583333 - 0.948722,
                                                0.583333 + 0.948722), abs=1e-6)
