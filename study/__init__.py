"""The studies, built on the stages: run each as `python -m study.NAME` from the repo root."""
