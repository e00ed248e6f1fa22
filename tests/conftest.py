"""The study tests run from tests/, against the repo root's modules, on the CPU as test_all.py does:
CUDA_VISIBLE_DEVICES="" before torch is imported (unless TEST_CUDA=1), for this process and every
child it starts; and the repo root first on sys.path, so that `import data` and `from study import
compare` find the project; and test_all.py's fixtures (the tiny task and π_ref, its DPO cache)."""
import os
import sys

if os.environ.get("TEST_CUDA") != "1":
    os.environ["CUDA_VISIBLE_DEVICES"] = ""

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from test_all import dpo_cache, tiny  # noqa: E402,F401  (fixtures, found by name)
