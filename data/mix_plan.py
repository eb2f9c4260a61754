"""The mixture planner of the ``mix`` stage: the document table and the plan (how many times each document is
trained on; its params are in :mod:`data.mix_params`). Pure functions of (table, params): no files, no stage context.

What the paper asks for (MiniMax-01 §4.1.1, §4.1.3.2) and how this module does it:

* **Quality score and buckets.** score = weighted mean of ``knowledge_depth`` and ``helpfulness``
  (``score_weights``, equal by default; both 0-5). Buckets are score ranges, each with a cap on
  repetition and a sampling weight. Defaults (:data:`data.mix_params.DEFAULT_BUCKETS`): low [0, 2) at most 2 epochs,
  mid [2, 3.5) at most 3, high [3.5, 5] at most 4. The caps for low and high are the paper's finding
  ("low-quality data suffer a substantial decrease in performance after training for more than two
  epochs, while high-quality data can be effectively trained for up to four epochs", §4.1.3.2); the
  mid bucket and the thresholds are ours. Caps above the paper's (the lowest-score bucket above 2, any
  bucket above 4) are a validation error unless ``allow_over_paper_caps: true``, and then the run warns
  and records them (MLflow tag ``mix.over_paper_caps``, metric, stats). Default weights equal the caps
  (2, 3, 4): with weights proportional to caps every bucket reaches its cap at the same budget, so a
  bigger budget scales the whole mixture instead of saturating one bucket first.

* **Uniform start, tilted toward quality, no category zeroed** (§4.1.1: "beginning with a uniform
  distribution across the base corpus, and then adjusting sampling weights to favor high-quality
  content while maintaining sufficient representation of diverse categories"). Every token starts
  equally likely (the *natural* share of a category is its share of the deduplicated tokens). A
  document's sampling rate is ``lambda * bucket weight * category weight * domain weight`` epochs,
  capped at its bucket's ``max_epochs``; ``lambda`` is solved so the rates spend the budget (water
  filling: capped documents stop growing, the rest share what is left). Each category then gets the
  larger of this tilted allocation and its floor, ``min_category_share`` x its natural share of the
  budget; a category that the floor lifts gets its own (larger) ``lambda``. The floor can only bind
  below a category's capacity (all its documents at cap); when it cannot be met it is reported.

* **Repetition and ``dup_count``.** The paper measures repetition by MinHash similarity and first
  deduplicates globally, then controls how often each remaining document is trained on. After dedup
  the near-duplicates of a kept document are gone from the training data, so the model sees that
  content exactly ``sample_count`` times: the epoch cap applies to ``sample_count``, and ``dup_count``
  (how many raw-crawl copies the document stands for) is reported, not counted (default
  ``count_duplicates_against_cap: false``). Set it to ``true`` when the removed copies are seen anyway
  (dedup was per shard, or raw data is mixed back in later): each copy then counts as one exposure,
  the cap on ``sample_count`` becomes ``max_epochs - (dup_count - 1)``, and a document whose copies
  already use the whole cap gets 0 with reason ``duplicates_exhaust_cap``.

* **Integer sample counts, exact budget.** A document with rate ``e`` gets ``floor(e)`` plus possibly
  one more. The extra ones are drawn by sequential Poisson sampling: priority ``u / frac(e)`` with
  ``u`` a hash of (seed, id), so a document is drawn with probability about ``frac(e)``. Draws are
  taken in priority order, first within each category up to its (rounded down) token target, then
  across categories up to the budget, and stop at the first document that does not fit. Token totals
  are exact integers: **0 <= token_budget - tokens < tokens of one document** (the one that did not
  fit), and never above the budget. Everything is a function of (input, params): reruns give the same
  bytes.

* **Budget beyond the caps.** The most a corpus can give is ``sum(tokens x cap)``. A larger budget is
  never met silently: ``on_budget_shortfall: fail`` raises :class:`BudgetShortfallError` naming the
  achievable tokens and every bucket's cap; ``shrink`` plans for the achievable budget, warns, logs
  ``budget_shrunk_to`` and writes it in the stats.

* **Ablation mode** (§4.1.3.2: "down-sample the documents to align the repetition frequency with the
  requirements of the final training schedule while adhering to the budget constraints of our
  ablation experiments"). The full schedule is planned for ``ablation.full_token_budget``; giving
  each document its full-run repetition ``r``. A subset of documents is then selected, in the order of
  a second id hash, first per category up to ``p`` x its full-schedule tokens, then globally up to the
  ablation budget (``p = ablation_token_budget / full_token_budget``). Selected documents keep their
  full repetition ``r``, the rest get 0 with reason ``ablation_subsample``: each document is in the
  small run with probability about ``p`` regardless of its repetition, and when in it, is repeated as
  often as in the full run. Both schedules are in the manifest (``sample_count``,
  ``full_sample_count``) and the stats.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from data.documents import unit_hash
from data.mix_params import BucketSpec, MixParams, ScoreWeights

# why a document got sample_count 0 (a document with sample_count > 0 has reason null)
ZERO_REASONS: dict[str, str] = {
    "budget": "its expected epochs were below 1 and it was not drawn, or the budget was spent first",
    "ablation_subsample": "not selected for the ablation run (§4.1.3.2 down-sampling); see full_sample_count",
    "duplicates_exhaust_cap": "count_duplicates_against_cap and its dup_count - 1 already reach max_epochs",
}



class BudgetShortfallError(ValueError):
    """token_budget exceeds what the corpus gives with every document at its epoch cap."""


# --- the document table -----------------------------------------------------------------------------
@dataclass
class DocumentTable:
    """What mix needs of each input document, as columns in input order."""

    ids: list[str]
    tokens: np.ndarray  # int64, incl. PACKING_TOKENS_PER_DOC
    knowledge_depth: np.ndarray  # float64
    helpfulness: np.ndarray  # float64
    category: np.ndarray  # int64 index into categories
    categories: list[str]  # sorted
    domain: np.ndarray  # int64 index into domains
    domains: list[str]  # sorted
    dup_count: np.ndarray  # int64 >= 1

    @classmethod
    def from_columns(cls, ids: list[str], tokens: Any, knowledge_depth: Any, helpfulness: Any,
                     categories: list[str], domains: list[str], dup_count: Any) -> DocumentTable:
        cat_names, cat_idx = np.unique(np.asarray(categories, dtype=object).astype(str), return_inverse=True)
        dom_names, dom_idx = np.unique(np.asarray(domains, dtype=object).astype(str), return_inverse=True)
        table = cls(
            ids=list(ids), tokens=np.asarray(tokens, dtype=np.int64),
            knowledge_depth=np.asarray(knowledge_depth, dtype=np.float64),
            helpfulness=np.asarray(helpfulness, dtype=np.float64),
            category=cat_idx.astype(np.int64).reshape(-1), categories=[str(c) for c in cat_names],
            domain=dom_idx.astype(np.int64).reshape(-1), domains=[str(d) for d in dom_names],
            dup_count=np.asarray(dup_count, dtype=np.int64))
        n = len(table.ids)
        if not all(len(col) == n for col in (table.tokens, table.knowledge_depth, table.helpfulness,
                                             table.category, table.domain, table.dup_count)):
            raise ValueError("DocumentTable columns differ in length")
        return table

    def __len__(self) -> int:
        return len(self.ids)


# --- planning ---------------------------------------------------------------------------------------
@dataclass
class BudgetOutcome:
    requested: int  # token_budget, or ablation.full_token_budget in ablation mode
    capacity: int  # sum(tokens x cap): the most the caps allow
    target: int  # what was planned for: requested, or capacity when shrunk
    achieved: int  # tokens of the full schedule
    shrunk_to: int | None  # set when on_budget_shortfall=shrink had to act
    lam: float  # the common rate multiplier of the tilt
    floor_tokens: list[float]  # per category: min_category_share x natural share x target (capped)
    floor_binding: list[bool]  # per category: the floor, not the tilt, set its allocation
    floor_unmet: list[bool]  # per category: its caps keep it below the floor


@dataclass
class AblationOutcome:
    full_token_budget: int  # after shrinking, if any
    ablation_token_budget: int  # requested (or the shrunk full budget if smaller)
    p: float  # ablation / full
    achieved: int


@dataclass
class MixturePlan:
    tokens_per_doc: np.ndarray  # int64, the table's token counts
    score: np.ndarray
    bucket: np.ndarray  # int64 index into params.buckets
    cap: np.ndarray  # int64: most times the document may be trained on
    expected_epochs: np.ndarray  # float64 continuous rate in the full schedule
    full_count: np.ndarray  # int64 sample counts of the full schedule
    count: np.ndarray  # int64 sample counts of this mixture (== full_count unless ablation)
    zero_reason: list[str | None]
    budget: BudgetOutcome
    ablation: AblationOutcome | None = None
    warnings: list[str] = field(default_factory=list)

    @property
    def tokens(self) -> int:
        """Tokens of this mixture (the ablation run's in ablation mode)."""
        return int((self.tokens_per_doc * self.count).sum())


def scores_of(table: DocumentTable, weights: ScoreWeights) -> np.ndarray:
    total = weights.knowledge_depth + weights.helpfulness
    return (weights.knowledge_depth * table.knowledge_depth + weights.helpfulness * table.helpfulness) / total


def buckets_of(scores: np.ndarray, buckets: list[BucketSpec]) -> np.ndarray:
    """Index of the last bucket whose min_score <= score."""
    bounds = np.array([b.min_score for b in buckets])
    return np.searchsorted(bounds, scores, side="right").astype(np.int64) - 1


def group_sum(groups: np.ndarray, values: np.ndarray, n: int) -> np.ndarray:
    out = np.zeros(n, dtype=values.dtype)
    np.add.at(out, groups, values)
    return out


def _largest_below(f: Callable[[float], float], target: float, lo: float, hi: float) -> float:
    """Largest x in [lo, hi] (to float precision) with f(x) <= target, for non-decreasing f, f(lo) <= target."""
    if f(hi) <= target:
        return hi
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        if not lo < mid < hi:
            break
        if f(mid) <= target:
            lo = mid
        else:
            hi = mid
    return lo


def _solve_rates(tokens: np.ndarray, cap: np.ndarray, weight: np.ndarray, category: np.ndarray, n_cat: int,
                 budget: float, floor_tokens: np.ndarray) -> tuple[np.ndarray, float, np.ndarray]:
    """Continuous epochs per document: min(cap, lambda_c x weight), spending ``budget`` tokens.

    lambda is common to all categories except those whose tilted allocation falls below their floor:
    those get the lambda_c >= lambda that gives them exactly their floor.
    """
    t = tokens.astype(np.float64)
    k = cap.astype(np.float64)
    active = k > 0
    if not active.any():
        return np.zeros_like(t), 0.0, np.zeros(n_cat, bool)

    def per_category(lam: float) -> np.ndarray:
        return np.bincount(category, weights=t * np.minimum(k, lam * weight), minlength=n_cat)

    lam_hi = float(np.max(k[active] / weight[active]))
    lam = _largest_below(lambda x: float(np.maximum(per_category(x), floor_tokens).sum()), budget, 0.0, lam_hi)
    floored = per_category(lam) < floor_tokens
    lam_c = np.full(n_cat, lam)
    for c in np.flatnonzero(floored):
        m = (category == c) & active
        tc, kc, wc = t[m], k[m], weight[m]
        lam_c[c] = _largest_below(lambda x, tc=tc, kc=kc, wc=wc: float((tc * np.minimum(kc, x * wc)).sum()),
                                  float(floor_tokens[c]), lam, float(np.max(kc / wc)))
    return np.minimum(k, lam_c[category] * weight), lam, floored


def _fill_in_order(order: np.ndarray, group: np.ndarray, cost: np.ndarray, group_room: np.ndarray,
                   total_room: int) -> np.ndarray:
    """Take documents in ``order`` (a priority order over candidates): first, per group, the longest prefix
    whose cost fits the group's room; then, over what is left, the longest prefix that fits the rest of
    ``total_room``. Stops at the first that does not fit, so the unspent room is less than its cost."""
    group_room = np.maximum(np.asarray(group_room, dtype=np.int64), 0)
    excess = int(group_room.sum()) - total_room
    while excess > 0:  # rounded float targets may sum a token above the total: take it from the largest
        g = int(np.argmax(group_room))
        cut = min(excess, int(group_room[g]))
        group_room[g] -= cut
        excess -= cut
    taken = np.zeros(len(cost), dtype=bool)
    grouped = group[order]
    for g in np.unique(grouped):
        idx = order[grouped == g]
        k = int(np.searchsorted(np.cumsum(cost[idx]), group_room[g], side="right"))
        taken[idx[:k]] = True
    rest = order[~taken[order]]
    room = total_room - int(cost[taken].sum())
    k = int(np.searchsorted(np.cumsum(cost[rest]), room, side="right"))
    taken[rest[:k]] = True
    return taken


def _hash_units(ids: list[str], seed: int, purpose: str) -> np.ndarray:
    return np.fromiter((unit_hash(seed, purpose, i) for i in ids), dtype=np.float64, count=len(ids))


def _integer_counts(rates: np.ndarray, cap: np.ndarray, tokens: np.ndarray, category: np.ndarray, n_cat: int,
                    budget: int, u: np.ndarray) -> np.ndarray:
    """floor(rate) per document plus one more for a sequential-Poisson draw of the fractions, filled in
    priority order per category up to its token target, then globally up to ``budget``."""
    count = np.minimum(np.floor(rates).astype(np.int64), cap)
    frac = rates - count
    # priority u/frac: below 1 with probability frac; documents at an integer rate come last (by u)
    key = np.where(frac > 0, u / np.where(frac > 0, frac, 1.0), np.inf)
    base_tokens = tokens * count
    if int(base_tokens.sum()) > budget:
        raise RuntimeError(f"mix: floor(rates) hold {int(base_tokens.sum())} > {budget} tokens (a bug in data/mix.py)")
    target_c = np.floor(np.bincount(category, weights=tokens * rates, minlength=n_cat)).astype(np.int64)
    room_c = target_c - group_sum(category, base_tokens, n_cat)
    while True:
        cand = np.flatnonzero(count < cap)
        room = budget - int((tokens * count).sum())
        if room <= 0 or cand.size == 0:
            break
        order = cand[np.lexsort((u[cand], key[cand]))]
        plus = _fill_in_order(order, category, np.where(count < cap, tokens, 0), room_c, room)
        count += plus
        if plus[cand].sum() < cand.size:
            break  # stopped at a document that did not fit: within one document of the budget
        # every candidate got its +1 and room is left (rates a hair under integers): another round
        room_c = np.zeros(n_cat, dtype=np.int64)
    return count


def plan_mixture(table: DocumentTable, params: MixParams) -> MixturePlan:
    """Sample counts for every document of ``table`` (no IO): the whole algorithm of the module docstring."""
    n = len(table)
    n_cat = len(table.categories)
    buckets = params.buckets
    score = scores_of(table, params.score_weights)
    bucket = buckets_of(score, buckets)
    tokens = table.tokens
    if n and int(tokens.min()) < 1:
        raise ValueError("mix: every document has at least 1 token (BOS/EOS included)")

    max_epochs = np.array([b.max_epochs for b in buckets], dtype=np.int64)[bucket]
    if params.count_duplicates_against_cap:
        cap = np.maximum(max_epochs - (table.dup_count - 1), 0)
    else:
        cap = max_epochs
    weight = (np.array([b.weight for b in buckets])[bucket]
              * np.array([params.category_weights.get(c, 1.0) for c in table.categories])[table.category]
              * np.array([params.domain_weights.get(d, 1.0) for d in table.domains])[table.domain])

    capacity = int((tokens * cap).sum())
    requested = params.ablation.full_token_budget if params.ablation.enabled else params.token_budget
    assert requested is not None  # MixParams guarantees one budget
    warnings: list[str] = []
    shrunk_to = None
    if requested > capacity:
        binding = _caps_summary(table, bucket, cap, buckets, params)
        if params.on_budget_shortfall == "fail":
            raise BudgetShortfallError(
                f"mix: the budget of {requested:,} tokens cannot be met within the epoch caps: at most "
                f"{capacity:,} tokens ({capacity / requested:.1%}) with every document at its cap. Binding "
                f"caps: {binding}. Lower the budget, raise max_epochs, add data, or set "
                "on_budget_shortfall: shrink")
        shrunk_to = capacity
        warnings.append(f"budget shrunk: {requested:,} tokens requested but the epoch caps allow at most "
                        f"{capacity:,} ({binding}); planned for budget_shrunk_to={capacity:,}")
    target = min(requested, capacity)

    natural = np.bincount(table.category, weights=tokens.astype(np.float64), minlength=n_cat)
    natural_share = natural / natural.sum() if n else natural
    cap_tokens = np.bincount(table.category, weights=(tokens * cap).astype(np.float64), minlength=n_cat)
    wanted_floor = params.min_category_share * natural_share * target
    floor_tokens = np.minimum(wanted_floor, cap_tokens)
    floor_unmet = wanted_floor > cap_tokens * (1 + 1e-12)
    for c in np.flatnonzero(floor_unmet):
        warnings.append(f"category {table.categories[c]!r} cannot reach its floor of {wanted_floor[c]:,.0f} "
                        f"tokens: all its documents at cap give {cap_tokens[c]:,.0f}")

    # a small margin below the target absorbs float rounding in the rate solve; the integer fill closes it
    solve_budget = target * (1 - 1e-9)
    rates, lam, floored = _solve_rates(tokens, cap, weight, table.category, n_cat, solve_budget,
                                       floor_tokens * (solve_budget / target if target else 0.0))
    u = _hash_units(table.ids, params.seed, "mix")
    full_count = _integer_counts(rates, cap, tokens, table.category, n_cat, target, u)
    achieved = int((tokens * full_count).sum())

    count, ablation = (_ablation_subsample(table, params, full_count, target, achieved, warnings)
                       if params.ablation.enabled else (full_count, None))
    reasons = _zero_reasons(count, cap, full_count)

    # the invariants the stage promises, checked on every run
    if np.any(full_count > cap) or np.any(count > full_count) or np.any(count < 0):
        raise RuntimeError("mix: a sample count exceeds its cap (a bug in data/mix.py)")
    max_doc = int(tokens.max()) if n else 0
    if not (0 <= target - achieved < max(max_doc, 1)):
        raise RuntimeError(f"mix: planned {achieved} tokens for a budget of {target} (a bug in data/mix.py)")

    return MixturePlan(tokens_per_doc=tokens, score=score, bucket=bucket, cap=cap, expected_epochs=rates, full_count=full_count,
                       count=count, zero_reason=reasons, ablation=ablation, warnings=warnings,
                       budget=BudgetOutcome(requested=requested, capacity=capacity, target=target,
                                            achieved=achieved, shrunk_to=shrunk_to, lam=lam,
                                            floor_tokens=[float(x) for x in floor_tokens],
                                            floor_binding=[bool(x) for x in floored],
                                            floor_unmet=[bool(x) for x in floor_unmet]))


def _ablation_subsample(table: DocumentTable, params: MixParams, full_count: np.ndarray, target: int, achieved: int,
                        warnings: list[str]) -> tuple[np.ndarray, AblationOutcome]:
    """§4.1.3.2's ablation mixture: whole documents selected in hash order (per category, then globally) up to the
    ablation budget, each keeping its full-schedule count, so a document's repetition, when present, is the full
    run's. Returns the ablation's counts and outcome; a lowered budget adds a warning."""
    tokens, n_cat = table.tokens, len(table.categories)
    requested_abl = params.ablation.ablation_token_budget or 0
    abl_budget = min(requested_abl, target)
    if abl_budget < requested_abl:
        warnings.append(f"ablation_token_budget lowered from {requested_abl:,} to the shrunk full budget "
                        f"{target:,}")
    p = min(abl_budget / achieved, 1.0) if achieved else 0.0
    full_tokens = tokens * full_count
    eligible = np.flatnonzero(full_count > 0)
    ua = _hash_units(table.ids, params.seed, "ablation")
    order = eligible[np.argsort(ua[eligible], kind="stable")]
    room_c = np.floor(p * group_sum(table.category, full_tokens, n_cat)).astype(np.int64)
    selected = _fill_in_order(order, table.category, full_tokens, room_c, abl_budget)
    count = np.where(selected, full_count, 0)
    abl_achieved = int((tokens * count).sum())
    largest = int(full_tokens.max()) if len(table) else 0
    if not 0 <= abl_budget - abl_achieved < max(largest, 1) and abl_achieved < achieved:
        raise RuntimeError(f"mix: ablation planned {abl_achieved} tokens for {abl_budget} (a bug in data/mix.py)")
    return count, AblationOutcome(full_token_budget=target, ablation_token_budget=abl_budget, p=p,
                                  achieved=abl_achieved)


def _zero_reasons(count: np.ndarray, cap: np.ndarray, full_count: np.ndarray) -> list[str | None]:
    """Why each document the plan leaves out is left out (None for the ones it samples)."""
    reasons: list[str | None] = [None] * len(count)
    for i in np.flatnonzero(count == 0):
        if cap[i] == 0:
            reasons[i] = "duplicates_exhaust_cap"
        elif full_count[i] == 0:
            reasons[i] = "budget"
        else:
            reasons[i] = "ablation_subsample"
    return reasons


def _caps_summary(table: DocumentTable, bucket: np.ndarray, cap: np.ndarray, buckets: list[BucketSpec],
                  params: MixParams) -> str:
    parts = []
    for b, spec in enumerate(buckets):
        m = bucket == b
        unique = int(table.tokens[m].sum())
        at_cap = int((table.tokens[m] * cap[m]).sum())
        parts.append(f"{spec.name} <= {spec.max_epochs} epochs x {unique:,} unique tokens = {at_cap:,}")
    if params.count_duplicates_against_cap:
        lost = int((table.tokens * (np.array([b.max_epochs for b in buckets])[bucket] - cap)).sum())
        parts.append(f"count_duplicates_against_cap removes {lost:,}")
    return "; ".join(parts)
