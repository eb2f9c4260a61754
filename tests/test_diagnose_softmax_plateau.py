"""bench/diagnose_softmax_plateau.py's copy window (``--copy-steps``): the rows it trains on before the text are the
copy curriculum's task, one sample a row, with the loss on the repeat alone (the tenth lease's CPU diagnosis in
BENCHMARKS.md reads its numbers from these rows)."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
import diagnose_softmax_plateau as diag  # noqa: E402  (bench/ is scripts, not a package)

from pretrain.packed_data import IGNORE_INDEX  # noqa: E402


def test_copy_rows_put_the_loss_on_the_repeat_of_their_own_span():
    L, vocab, mark = 64, 500, np.array([7, 9])
    b = diag.copy_batch(3, L, vocab, np.random.default_rng(0), mark)
    assert b.input_ids.shape == b.labels.shape == b.position_ids.shape == (1, 3 * L)
    assert b.cu_seqlens.tolist() == [0, L, 2 * L, 3 * L] and b.position_ids[0, :L].tolist() == list(range(L))
    for r in range(3):
        ids, labels = b.input_ids[0, r * L:(r + 1) * L].numpy(), b.labels[0, r * L:(r + 1) * L].numpy()
        target = np.flatnonzero(labels != IGNORE_INDEX)
        span = target.size
        assert span == (L - 2 - mark.size) // 2 and np.all(np.diff(target) == 1)
        assert (labels[target] == ids[target]).all()
        assert (ids[target] == ids[target[0] - mark.size - span:target[0] - mark.size]).all()  # the first copy
        assert (ids[target[0] - mark.size:target[0]] == mark).all() and ids[0] == 0 and ids[-1] == 1
        assert ids[1:-1].min() >= 3 and ids.max() < vocab  # ordinary ids only
    assert b.tokens == 3 * span


def test_a_unigram_drawn_window_follows_the_weights():
    L, vocab = 256, 20
    w = np.zeros(vocab - 3)
    w[:2] = [0.75, 0.25]  # ids 3 and 4 only
    b = diag.copy_batch(8, L, vocab, np.random.default_rng(1), np.array([19]), weights=w)
    drawn = b.labels[b.labels != IGNORE_INDEX].numpy()
    assert set(drawn.tolist()) <= {3, 4} and 0.65 < (drawn == 3).mean() < 0.85


def test_joined_batches_keep_each_documents_bounds_positions_and_labels():
    """--copy-keep joins copy rows after a step's text rows: one packed sequence whose second part's documents start
    where the first's end."""
    L, vocab, mark = 32, 200, np.array([7])
    a = diag.copy_batch(2, L, vocab, np.random.default_rng(0), mark)
    b = diag.copy_batch(1, L, vocab, np.random.default_rng(1), mark)
    j = diag.join(a, b)
    assert j.cu_seqlens.tolist() == [0, L, 2 * L, 3 * L] and j.input_ids.shape == (1, 3 * L)
    assert j.position_ids[0, 2 * L:].tolist() == list(range(L)) and j.tokens == a.tokens + b.tokens
    assert (j.labels[0, 2 * L:] == b.labels[0]).all() and (j.input_ids[0, :2 * L] == a.input_ids[0]).all()
