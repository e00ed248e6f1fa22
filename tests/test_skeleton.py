"""The four loops share one skeleton (dpo.py, online_dpo.py, grpo.py, ppo.py): the same phase
headers in the same order, each loop's docstring naming what it deletes from PPO, and the README's
diff command printing exactly those deletions.

    pytest tests/test_skeleton.py
"""
import os
import re
import subprocess


import dpo
import grpo
import online_dpo
import ppo
from tests.helpers import ROOT


# ==================================================================================================
# one skeleton, the same headers in the same order (dpo.py, online_dpo.py, grpo.py, ppo.py)
# ==================================================================================================

def loop_headers(path):
    """A loop file's section (# ====) and phase (# --) headers up to their colon, as the README's
    diff command prints them."""
    return re.findall(r"# [=-]{2,} [^:\n]*", open(path, encoding="utf-8").read())


def test_loops_share_one_skeleton():
    d, p = loop_headers(dpo.__file__), loop_headers(ppo.__file__)
    o, g = loop_headers(online_dpo.__file__), loop_headers(grpo.__file__)
    # DPO ⊂ online DPO ⊂ GRPO ⊂ PPO: the smaller file's headers are the bigger one's in the same
    # order, some deleted (`x in rest` consumes)
    for small, big in ((d, p), (d, o), (o, p), (o, g), (g, p)):
        rest = iter(big)
        assert len(small) >= 12 and all(h in rest for h in small), (small, big)
    core = ["# -- batch", "# -- reference log-probs", "# -- policy forward", "# -- loss",
            "# -- update"]
    for heads in (d, p, o, g):  # the shared core, in this order, in all four
        assert [h for h in heads if h in core] == core
    # grpo.py deletes PPO's values and per-token rewards, and its docstring names both
    gone = [h for h in p if h not in g]
    assert gone == ["# -- values", "# -- per-token rewards with the KL penalty"]
    for h in gone:
        assert h.split(" ", 2)[2] in " ".join(grpo.__doc__.split()), h
    # online_dpo.py's docstring names, by name, what returns from PPO and what stays deleted
    for h in [h for h in o if h not in d] + [h for h in p if h not in o]:
        assert h.split(" ", 2)[2] in " ".join(online_dpo.__doc__.split()), h
    deleted = [h for h in p if h not in d]
    assert deleted, "PPO has phases DPO deletes"
    for h in deleted:  # dpo.py's docstring lists, by name, what it deletes
        assert h.split(" ", 2)[2] in " ".join(dpo.__doc__.split()), h
    # the README's command prints exactly these deletions, as additions on PPO's side
    readme = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
    cmd = next(line for line in readme.splitlines() if line.startswith("diff <("))
    out = subprocess.run(["bash", "-c", cmd], cwd=ROOT, capture_output=True, text=True).stdout
    assert [line[2:] for line in out.splitlines() if line.startswith(">")] == deleted
    assert all(line.startswith(">") or line[0].isdigit() for line in out.splitlines())
    shown = readme.split(cmd + "\n```\n\n```\n", 1)[1].split("```")[0]  # the output README shows
    assert shown == out
