"""What makes a sequence-parallel layout impossible, checked by the params of ``pretrain`` and ``long_context``
(pretrain/stage.py, pretrain/long_context.py) and again by every rank (pretrain/train.py). No torch here: stage
params are validated without it."""

from __future__ import annotations

MIN_TOKENS_PER_SEQUENCE_RANK = 16  # the smallest chunk of the Triton lightning kernel


def sequence_parallel_problems(sequence_parallel: int, *, seq_lens: dict[str, int], expert_parallel_size: int,
                               compile_: bool) -> list[str]:
    """What is wrong with splitting rows over ``sequence_parallel`` ranks (nothing: []). ``seq_lens``: the row
    lengths, by the field that sets each. Checked by the params of pretrain and long_context, and by every rank
    (``pretrain/train.py``)."""
    sp = sequence_parallel
    if sp == 1:
        return []
    problems = []
    for field_, n in seq_lens.items():
        if n % sp:
            problems.append(f"{field_}={n} is not divisible by sequence_parallel={sp}: each rank of a group holds an "
                            f"equal slice of every row; make it a multiple of {sp}")
        elif n // sp < MIN_TOKENS_PER_SEQUENCE_RANK:
            problems.append(f"{field_}={n} over sequence_parallel={sp} leaves {n // sp} tokens per rank, fewer than "
                            f"{MIN_TOKENS_PER_SEQUENCE_RANK} (one chunk of the lightning kernel); sequence parallelism "
                            "is for rows too long for one GPU: lower sequence_parallel")
    if expert_parallel_size > 1:
        problems.append(f"sequence_parallel={sp} with expert_parallel_size={expert_parallel_size}: the two are not "
                        "supported together (the expert all-to-all groups would cut across the sequence-parallel "
                        "groups, untested); use one of them")
    if compile_:
        problems.append(f"compile: true with sequence_parallel={sp} is not supported: the sequence-parallel attention "
                        "and MoE wrappers run collectives that the compiled layers have not been tested to trace; set "
                        "compile: false")
    return problems
