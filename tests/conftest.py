"""tests/*.py run from tests/, against the repo root's modules, on the CPU as test_all.py does: the
repo root first on sys.path, so that `import data`, `from study import compare` and `tests.helpers`
find the project; then tests/helpers.py, which sets CUDA_VISIBLE_DEVICES="" before torch is imported
(unless TEST_CUDA=1), for this process and every child it starts, and whose fixtures (the tiny task
and π_ref, its DPO cache, r_φ, test prompts) the tests here find by name."""
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from tests.helpers import dpo_cache, ppo_test_prompts, task, tiny, tiny_rm, tok  # noqa: E402,F401
