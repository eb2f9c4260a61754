"""Evaluation: the ``eval`` stage (``evaluation/eval.py``) that scores a checkpoint of any training stage, and the
``compare`` stage (``evaluation/compare.py``) that puts evaluated variants side by side. Beside the eval stage:
``heldout.py`` (the pretrain stage's held-out documents it measures on), ``scorer.py`` (the checkpoint's model as the
stage asks it) and ``report.py`` (summary metrics, plots and strict JSON of both stages).

Layering: ``tasks.py`` (the eval sets, built from held-out text; no model) and ``metrics.py`` (scoring and statistical
power) import nothing of the project above ``pipeline``, so pretraining's in-training probe (``pretrain/probe.py``)
uses the eval stage's very tasks; ``eval.py`` and ``compare.py`` sit above ``posttrain`` (the pass rate runs the
policy's generation and the sandboxed checkers). ``tests/test_layering.py`` holds both rules.
"""
