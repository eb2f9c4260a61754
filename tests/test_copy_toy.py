"""bench/copy_toy.py's rows (issue 33): spans of varying length, each pair its own document, so that copying needs an
induction head and not a fixed look-back."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import copy_toy  # noqa: E402


def _pairs(ids: np.ndarray, labels: np.ndarray, cuts: list[int]) -> list[int]:
    """Check every span pair of one row; return their spans."""
    spans = []
    for a, b in zip(cuts[:-1], cuts[1:], strict=True):
        span = (b - a) // 2
        assert b - a == 2 * span
        assert (ids[a:a + span] == ids[a + span:b]).all()  # the repeat is the span
        assert (labels[a + span + 1:b] == ids[a + span + 1:b]).all()  # targets: the repeat after its first id
        assert (labels[a:a + span + 1] == -100).all()
        spans.append(span)
    return spans


def test_varying_spans_are_pairs_each_its_own_document() -> None:
    args = copy_toy.parse_args(["--vocab", "64", "--span", "24", "--span-min", "8", "--seq-len", "200", "--packed"])
    data = copy_toy.CopyRows(args)
    x, y = data.batch(6, step=1)
    packed = data.packed(6)
    cu = packed["cu_seqlens"].tolist()
    pos = packed["position_ids"][0].numpy()
    spans = []
    for b in range(6):
        cuts = data.cuts[b]
        spans += _pairs(x[b].numpy(), y[b].numpy(), cuts)
        assert 200 - cuts[-1] < 2 * 24  # the row ends when a drawn pair no longer fits
        for c in cuts:  # every pair starts a document, its positions from 0
            assert b * 200 + c in cu and pos[b * 200 + c] == 0
    assert all(8 <= s <= 24 for s in spans) and len(set(spans)) > 3  # lengths vary: no fixed look-back copies them
    assert (y[:, 1:][y[:, 1:] != -100] >= copy_toy.RESERVED).all()


def test_fixed_steps_and_the_default_keep_one_span() -> None:
    args = copy_toy.parse_args(["--vocab", "64", "--span", "16", "--span-min", "4", "--fixed-steps", "5",
                                "--seq-len", "129"])
    data = copy_toy.CopyRows(args)
    x, y = data.batch(2, step=5)  # inside the fixed window
    assert {s for b in range(2) for s in _pairs(x[b].numpy(), y[b].numpy(), data.cuts[b])} == {16}
    x, y = data.batch(2, step=6)
    assert len({s for b in range(2) for s in _pairs(x[b].numpy(), y[b].numpy(), data.cuts[b])}) > 1
    fixed = copy_toy.CopyRows(copy_toy.parse_args(["--vocab", "64", "--span", "16", "--seq-len", "129"]))
    x, y = fixed.batch(2, step=1)
    assert fixed.cuts[0] == [1, 33, 65, 97, 129]
    assert _pairs(x[0].numpy(), y[0].numpy(), fixed.cuts[0]) == [16] * 4


@pytest.mark.parametrize("flags", [["--span-min", "8"], ["--span-min", "8", "--packed"]])
def test_a_few_steps_train_on_varying_spans(flags: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    copy_toy.main(["--vocab", "64", "--d", "32", "--layers", "2", "--span", "16", "--seq-len", "65", "--rows", "2",
                   "--steps", "2", *flags])
    out = capsys.readouterr().out.strip().splitlines()[-1]
    assert '"step": 2' in out and '"ln_v": 4.09' in out  # ln(64 - 4 reserved ids)


def test_eval_span_scores_other_spans_without_changing_training(capsys: pytest.CaptureFixture[str]) -> None:
    import json

    base = ["--vocab", "64", "--d", "32", "--layers", "2", "--span", "8", "--span-min", "4", "--seq-len", "65",
            "--rows", "2", "--steps", "2", "--packed"]
    copy_toy.main(base)
    plain = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    copy_toy.main([*base, "--eval-span", "16", "32"])
    both = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert both["loss"] == plain["loss"] and both["copy_accuracy"] == plain["copy_accuracy"]
    assert 0.0 <= both["eval_copy_accuracy"] <= 1.0 and "eval_copy_accuracy" not in plain


def test_copy_rows_builds_the_stage_layout_with_varying_spans() -> None:
    import copy_rows

    rows = copy_rows.Rows(copy_rows.parse_args([]))  # the stage's layout: BOS, R, 5-id marker, R, EOS
    b = rows.batch()
    ids, labels = b["input_ids"][0].numpy(), b["labels"][0].numpy()
    cu = b["cu_seqlens"].tolist()
    assert cu[-1] == 8 * 256 and all(p == 0 for p in b["position_ids"][0].numpy()[cu[:-1]])
    spans = set()
    for a, e in zip(cu[:-1], cu[1:], strict=True):
        doc, lab = ids[a:e], labels[a:e]
        assert doc[0] == 0 and doc[-1] == 1  # BOS ... EOS
        m = int(np.flatnonzero(doc == 4)[0])  # the marker 4..8
        assert (doc[m:m + 5] == np.arange(4, 9)).all()
        r2 = doc[m + 5:-1]
        assert (doc[m - r2.size:m] == r2).all()  # the repeat is the span before the marker
        assert (lab[m + 5:-1] == doc[m + 5:-1]).all() and (lab[:m + 5] == -100).all()  # targets: the repeat
        assert lab[-1] == -100  # not the EOS (data.retrieval.copy_sample's rows)
        spans.add(r2.size)
    assert min(spans) >= 16 and len(spans) > 3


def test_copy_rows_can_make_the_eos_a_target_as_the_stage_did() -> None:
    import copy_rows

    b = copy_rows.Rows(copy_rows.parse_args(["--eos-target", "1"])).batch()
    ids, labels, cu = b["input_ids"][0].numpy(), b["labels"][0].numpy(), b["cu_seqlens"].tolist()
    ends = np.asarray(cu[1:]) - 1
    assert (ids[ends] == 1).all() and (labels[ends] == 1).all()  # every sample ends with EOS, now a target


def test_copy_rows_marks_the_targets_data_retrieval_copy_sample_marks() -> None:
    """With the defaults, bench/copy_rows.py's samples have copy_sample's layout and targets (its own draws)."""
    import copy_rows

    from data.retrieval import copy_sample

    rows = copy_rows.Rows(copy_rows.parse_args([]))
    for n in (41, 42, 103):  # odd and even rest after [BOS], the marker and [EOS]
        tokens, no_loss = rows.sample(n)
        ref = copy_sample(rows.pool, n, np.random.default_rng(0), bos=0, eos=1, mark=rows.mark)
        assert tokens.size == ref.tokens.size and (no_loss == ref.no_loss).all()
        span = ref.meta["span_tokens"]
        m = n - 1 - span - rows.mark.size  # where copy_sample puts the marker
        assert tokens[0] == ref.tokens[0] == 0 and tokens[-1] == ref.tokens[-1] == 1
        assert (tokens[m:m + rows.mark.size] == rows.mark).all() and (ref.tokens[m:m + rows.mark.size] == rows.mark).all()
        assert (tokens[m - span:m] == tokens[n - 1 - span:n - 1]).all()  # the repeat is the span
