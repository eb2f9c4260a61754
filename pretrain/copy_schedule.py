"""The copy curriculum's schedule in rows (``pretrain``'s ``copy_share``, ``copy_until_tokens``, ``copy_keep_share``):
plain arithmetic, light to import, so the stage's params check it when a spec loads and the packing uses the same
numbers (``pretrain/retrieval_rows.add_copy_rows``, ``pretrain/packed_data.CurriculumLoader``)."""

from __future__ import annotations

import math


def copy_rows_for(train_tokens: int, seq_len: int, share: float, until_tokens: int) -> int:
    """Copy rows the curriculum reads: ``share`` of the rows of its first ``until_tokens`` training tokens (each
    copy row is read once; :class:`pretrain.packed_data.CurriculumLoader`)."""
    if not 0.0 <= share <= 1.0:
        raise ValueError(f"copy_share={share}: use a share in [0, 1]")
    slots = min(until_tokens, train_tokens) // seq_len
    return int(slots * share)


def curriculum_rows_for(rows: int, share: float) -> int:
    """The slots over which ``rows`` copy rows are read at ``share`` (the window :func:`add_copy_rows` records)."""
    return int(math.ceil(rows / share))


def copy_keep_rows_for(train_tokens: int, seq_len: int, keep_share: float, curriculum_rows: int) -> tuple[int, int]:
    """(copy rows, slots) of ``copy_keep_share``: ``keep_share`` of the rows a run of ``train_tokens`` reads after
    the window's ``curriculum_rows`` slots; (0, 0) where that makes no row."""
    if not 0.0 <= keep_share < 1.0:
        raise ValueError(f"copy_keep_share={keep_share}: use a share in [0, 1)")
    slots = max(train_tokens // seq_len - curriculum_rows, 0)
    rows = int(slots * keep_share)
    return (rows, slots) if rows else (0, 0)
