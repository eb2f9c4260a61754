"""Stage ``prompts``: the post-training prompt collection (report §5.1), split into pools for SFT, DPO and RL
(artifact type ``prompts``).

Sources, in this order (the order decides which copy of a duplicate is kept: user prompts first):

1. **user** prompts: every JSONL file in ``user_files``, one object a line with a non-empty string ``prompt`` and
   optional ``id``, ``task_type``, ``domain``, ``difficulty``, ``response`` (strings; a ``response`` is a real
   answer the reward model's preference pairs use as chosen) and ``checker`` + ``reference`` (a verifiable prompt,
   checked like the generated ones). Files are checked at spec validation with ``file:line``
   errors; a line that became bad after validation is dropped as ``invalid_record``.
2. **verifiable** prompts from :mod:`posttrain.verifiable` (arithmetic, string, retrieval from corpus passages,
   Python functions with hidden tests), ``verifiable`` counts per task type, with exact checkers.
3. **open-ended** prompts drawn from the corpus (the optional ``documents`` input): an excerpt of a document under
   one of :data:`OPEN_ENDED_TEMPLATES` (summarize, explain, title, continue, rewrite, questions).
4. **long-context retrieval** prompts (``long_retrieval``, off by default): a code planted in a window of
   ``long_retrieval_words`` words over the open-ended prompts' documents, windows consecutive and non-overlapping
   (:func:`posttrain.verifiable.long_retrieval_records`); our stand-in for Table 7 stage II's long-context SFT data.
   They go to ``sft`` alone (not ``dpo``), last, so every other pool and near-duplicate verdict stays as without them.

Tags (§5.1: task type, knowledge domain, difficulty): generated prompts carry the generator's own tags (exact);
open-ended prompts take the template's task type, the document's domain mapped by :data:`DOMAIN_OF` and a
difficulty from the excerpt length; user prompts keep the tags they give, and the missing ones come from
:func:`heuristic_tags` — keyword and length rules, NOT a classifier (``tag_source`` in each record says which).

Filtering: prompts that are empty (``empty``), longer than ``max_prompt_chars`` (``too_long``), or exact or near
duplicates of a prompt kept before them (``duplicate``: exact on whitespace-collapsed casefolded text, else
datasketch MinHash-LSH over word ``n_grams`` shingles with the exact Jaccard checked against
``jaccard_threshold``; the dropped record names the kept one). The text compared is the prompt without the
generators' fixed answer-format instruction, so two arithmetic prompts are not near duplicates by sharing it.

Pools (deterministic, a hash of (seed, group) per prompt): verifiable prompts go to ``eval`` with probability
``eval_fraction``, the rest to ``rl`` with probability ``rl_fraction`` and else to ``sft``; non-verifiable prompts
go to ``sft`` (or ``rl`` when ``rl_verifiable_only`` is off). §5.4.2 trains online RL on prompts SFT never saw: the
``sft``, ``rl`` and ``eval`` pools are disjoint, and a group (a code template's function, a retrieval passage's
document) never spans two of them. §5.4.1 found SFT-trained prompts as good as unseen ones for DPO and used them:
``dpo`` is a deterministic ``dpo_fraction`` of the ``sft`` pool.

Output: ``pools/{sft,dpo,rl,eval}.jsonl`` (one prompt record a line, written under a temporary name and renamed),
``dropped.jsonl`` (every dropped input: id, source, reason, detail, kept_id), ``prompts_report.json`` (counts per
source, reason, pool and tag; the accounting ``inputs == kept + dropped`` is checked before writing) and
``plots/tags.png``.
"""

from __future__ import annotations

import hashlib
import heapq
import json
import re
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from pydantic import Field, field_validator, model_validator

from data.documents import ANY_DOCUMENTS, iter_documents, unit_hash
from data.minhash import jaccard, ngram_hashes
from pipeline.artifacts import write_jsonl_atomic, write_text_atomic
from pipeline.stage import InputSpec, StageContext, StageKind, StageParams, file_fingerprint, metric_key
from pipeline.user_jsonl import jsonl_file_problems
from posttrain.prompt_records import TAG_FIELDS, heuristic_tags, iter_user_file, record_problem
from posttrain.verifiable import (
    ANSWER_INSTRUCTION,
    CHECKERS,
    CODE_INSTRUCTION,
    DIFFICULTIES,
    LONG_ID_PREFIX,
    TASK_TYPES,
    generate_verifiable,
    long_retrieval_records,
)

PROMPTS_TYPE = "prompts"
POOLS = ("sft", "dpo", "rl", "eval")
POOLS_DIR = "pools"
REPORT_FILE = "prompts_report.json"
DROPPED_FILE = "dropped.jsonl"
DROP_REASONS = {
    "duplicate": "same or nearly the same text (Jaccard >= jaccard_threshold) as a prompt kept before it",
    "empty": "no text",
    "too_long": "more than max_prompt_chars characters",
    "invalid_record": "a user JSONL line that is not a valid prompt record (changed since spec validation)",
}
OPEN_ENDED_TEMPLATES: dict[str, str] = {
    "summarization": "Summarize the following text in three sentences.\n\n{excerpt}",
    "explanation": "Explain to a newcomer what the following text is about and why it matters.\n\n{excerpt}",
    "title": "Suggest a short, informative title for the following text.\n\n{excerpt}",
    "continuation": "Continue the following text in the same style for one more paragraph.\n\n{excerpt}",
    "rewrite": "Rewrite the following text so that it is clearer and shorter.\n\n{excerpt}",
    "question_generation": "Write three questions that the following text answers.\n\n{excerpt}",
}
# the corpus's document domains -> §5.1's knowledge domains
DOMAIN_OF = {"code": "programming", "legal": "legal", "manual": "technical", "prose": "creative-writing",
             "misc": "general-knowledge"}


class PromptsParams(StageParams):
    seed: int = Field(0, description="Seed of the generators, the excerpts and the pool split.")
    verifiable: dict[str, int] = Field(
        default_factory=lambda: {"arithmetic": 120, "string": 120, "retrieval": 60, "code": 60},
        description=f"Verifiable prompts generated per task type ({', '.join(TASK_TYPES)}); retrieval passages "
                    "come from the documents input.")
    code_tests: int = Field(5, ge=1, description="Hidden test cases per generated code prompt.")
    long_retrieval: int = Field(0, ge=0, description=(
        "Long-context retrieval prompts (our stand-in for Table 7 stage II's long-context SFT data): a code planted "
        "in a window of long_retrieval_words words over the open-ended prompts' documents (fewer when they run out). "
        "All go to the sft pool and none to dpo, so DPO, RL and the eval pool are unchanged (the reward model builds no "
        "pair from them); an sft stage picks them by their difficulty tag, long (its difficulties param). 0: none."))
    long_retrieval_words: int = Field(4000, ge=50, description=(
        "Words of a long retrieval prompt's passage (the sample corpus has ~7 bytes a word and the recipe's 32K "
        "tokenizer ~4.4 bytes a token: ~1.6 tokens a word). A document gives a window up to this many of its words (its excerpt reads at most 4 times the longest excerpt_words)."))
    open_ended: int = Field(200, ge=0, description="Open-ended prompts drawn from the documents input.")
    excerpt_words: list[int] = Field(default_factory=lambda: [60, 150, 300], description=(
        "Excerpt lengths (words) of open-ended prompts, one per difficulty easy/medium/hard."))
    user_files: list[str] = Field(default_factory=list, description=(
        "JSONL files of user prompts (.jsonl or .jsonl.gz): {\"prompt\": str} a line, optional id, task_type, "
        "domain, difficulty, response (a real answer: chosen of reward-model pairs), checker + reference."))
    max_prompt_chars: int = Field(8000, ge=1, description="Longer prompts are dropped (too_long).")
    n_grams: int = Field(3, ge=1, description="Word shingle size of the near-duplicate check.")
    num_perm: int = Field(128, ge=16, description="Permutations of the datasketch MinHash.")
    jaccard_threshold: float = Field(0.8, gt=0, le=1, description=(
        "Exact shingle Jaccard with a kept prompt at or above which a prompt is a near duplicate "
        "(MinHash-LSH finds candidates at this threshold, the exact Jaccard decides)."))
    eval_fraction: float = Field(0.15, ge=0, lt=1, description="Share of verifiable prompt groups held out in eval.")
    rl_fraction: float = Field(0.4, ge=0, le=1, description="Share of the remaining groups given to rl (rest: sft).")
    rl_verifiable_only: bool = Field(True, description=(
        "RL rewards come from the exact checkers: non-verifiable prompts go to sft only."))
    dpo_fraction: float = Field(0.5, ge=0, le=1, description="Share of the sft pool also listed in dpo (§5.4.1).")

    @field_validator("verifiable")
    @classmethod
    def _known_types(cls, v: dict[str, int]) -> dict[str, int]:
        bad = sorted(set(v) - set(TASK_TYPES))
        if bad:
            raise ValueError(f"unknown verifiable task types {bad}; known: {', '.join(TASK_TYPES)}")
        if any(n < 0 for n in v.values()):
            raise ValueError(f"verifiable counts must be >= 0, got {v}")
        return v

    @model_validator(mode="after")
    def _long_fits(self) -> PromptsParams:
        if self.long_retrieval and self.long_retrieval_words * 6 > self.max_prompt_chars:
            raise ValueError(f"long_retrieval_words={self.long_retrieval_words} makes prompts of ~"
                             f"{self.long_retrieval_words * 6:,} characters or more (the sample corpus averages ~7 "
                             f"a word), over max_prompt_chars={self.max_prompt_chars:,}: most would be dropped as "
                             "too_long; raise max_prompt_chars")
        return self

    @model_validator(mode="after")
    def _excerpts(self) -> PromptsParams:
        if len(self.excerpt_words) != len(DIFFICULTIES) or any(n < 10 for n in self.excerpt_words):
            raise ValueError(f"excerpt_words={self.excerpt_words}: give {len(DIFFICULTIES)} lengths (easy, medium, "
                             "hard), each >= 10 words")
        return self


def validate_external(params: PromptsParams) -> list[tuple[str, str]]:
    """At spec validation: every user file exists and each line is a prompt record (first 5 problems a file), and
    no id is given twice (across all the files)."""
    problems = jsonl_file_problems(params.user_files, "user_files", "prompt file", record_problem)
    if problems:
        return problems
    index = {path: i for i, path in enumerate(params.user_files)}
    for rec, where, problem in _user_prompts(params):  # every line is a record now: what is left are duplicates
        if rec is None:
            problems.append((f"user_files.{index[where.rsplit(':', 1)[0]]}", f"{where}: {problem}"))
            if len(problems) >= 5:
                break
    return problems


def fingerprint(params: PromptsParams) -> list[dict[str, Any]]:
    return [file_fingerprint(p) for p in params.user_files]


# --- the sources --------------------------------------------------------------------------------------------------
def _user_prompts(params: PromptsParams) -> Iterator[tuple[dict[str, Any] | None, str, str]]:
    """(record or None, id, problem) for every line of every user file."""
    seen: dict[str, str] = {}
    for path in params.user_files:
        for line_no, obj, problem in iter_user_file(path):
            where = f"{path}:{line_no}"
            if not problem and obj.get("id") is not None:
                if obj["id"] in seen:
                    problem = f"duplicate id {obj['id']!r} (first at {seen[obj['id']]})"
                else:
                    seen[obj["id"]] = where
            if problem:
                yield None, where, problem
                continue
            given = {k: obj[k] for k in TAG_FIELDS if k in obj}
            tags = heuristic_tags(obj["prompt"]) | given
            rec = {"id": obj.get("id") or f"user/{Path(path).name}/{line_no}", "prompt": obj["prompt"], **tags,
                   "source": "user", "tag_source": "given" if len(given) == len(TAG_FIELDS)
                   else "heuristic" if not given else "given+heuristic", "origin": f"{Path(path).name}:{line_no}"}
            if "checker" in obj:
                rec |= {"checker": obj["checker"], "reference": obj["reference"]}
            if obj.get("response", "").strip():  # a real answer: chosen of a reward-model pair
                rec["response"] = obj["response"]
            yield rec, where, ""


def _sample_documents(docs_path: Path | None, k: int, seed: int, max_words: int) -> list[tuple[str, str, str]]:
    """The ``k`` documents with the smallest hash of (seed, id) among those of at least 40 words, as (id, domain,
    text cut to ``max_words`` words): a uniform, order-free sample in bounded memory."""
    if docs_path is None or k == 0:
        return []
    heap: list[tuple[float, str, str, str]] = []  # max-heap on the hash via negation
    for rec in iter_documents(docs_path):
        u = unit_hash(seed, "prompts/doc", rec["id"])
        if len(heap) == k and -heap[0][0] <= u:
            continue
        words = rec["text"].split()
        if len(words) < 40:
            continue
        item = (-u, rec["id"], rec.get("domain") or "unknown", " ".join(words[:max_words]))
        heapq.heappush(heap, item) if len(heap) < k else heapq.heapreplace(heap, item)
    return [(i, d, t) for _, i, d, t in sorted(heap, key=lambda x: -x[0])]


def open_ended_prompts(docs: list[tuple[str, str, str]], n: int, params: PromptsParams) -> list[dict[str, Any]]:
    out = []
    names = sorted(OPEN_ENDED_TEMPLATES)
    for k, (doc_id, domain, text) in enumerate(docs[:n]):
        difficulty = DIFFICULTIES[k % len(DIFFICULTIES)]
        want = params.excerpt_words[k % len(DIFFICULTIES)]
        words = text.split()
        start = int(unit_hash(params.seed, "prompts/offset", doc_id) * max(1, len(words) - want))
        excerpt = " ".join(words[start:start + want])
        task = names[int(unit_hash(params.seed, "prompts/template", doc_id) * len(names))]
        out.append({"id": f"open/{doc_id}", "prompt": OPEN_ENDED_TEMPLATES[task].format(excerpt=excerpt),
                    "task_type": task, "domain": DOMAIN_OF.get(domain, domain), "difficulty": difficulty,
                    "source": "corpus", "tag_source": "template+length", "origin": doc_id})
    return out


# --- dedup --------------------------------------------------------------------------------------------------------
def dedup_text(rec: dict[str, Any]) -> str:
    """What duplicates are judged on: the prompt without the generators' fixed answer-format instruction."""
    text = rec["prompt"]
    for fixed in (ANSWER_INSTRUCTION, CODE_INSTRUCTION):
        text = text.replace(fixed, " ")
    return text


_TOKEN = re.compile(r"\w+|[^\w\s]")


def token_hashes(text: str) -> np.ndarray:
    """64-bit hashes of the words and punctuation marks of ``text``. Unlike the corpus dedup's simplified text,
    digits are kept: ``Compute 75 - 93`` and ``Compute 31 - 15`` are different prompts."""
    return np.array([int.from_bytes(hashlib.blake2b(t.encode(), digest_size=8).digest(), "little")
                     for t in _TOKEN.findall(text)], dtype=np.uint64)


class NearDuplicateIndex:
    """Kept prompts in a datasketch MinHashLSH; a new prompt is a duplicate of the first kept candidate whose
    exact shingle Jaccard reaches the threshold (exact duplicates by hash first)."""

    def __init__(self, params: PromptsParams) -> None:
        from datasketch import MinHash, MinHashLSH  # heavy: datasketch

        self.p = params
        self.minhash_cls = MinHash
        # LSH tuned below the threshold (like the corpus dedup's S-curve, data/dedup.py) so that pairs AT the
        # threshold are candidates with high probability; the exact Jaccard then decides
        self.lsh = MinHashLSH(threshold=max(0.05, params.jaccard_threshold - 0.2), num_perm=params.num_perm)
        self.exact: dict[bytes, str] = {}
        self.shingles: dict[str, np.ndarray] = {}

    def find_or_add(self, rec_id: str, text: str) -> tuple[str, str, float] | None:
        """(kept id, 'exact' or 'near', Jaccard) if ``text`` duplicates a kept prompt, else None (and it is kept)."""
        norm = " ".join(text.split()).casefold()
        key = hashlib.blake2b(norm.encode(), digest_size=16).digest()
        if key in self.exact:
            return self.exact[key], "exact", 1.0
        words = token_hashes(norm)
        sh = np.unique(ngram_hashes(words, min(self.p.n_grams, max(1, len(words)))))
        m = None
        if len(sh):
            m = self.minhash_cls(num_perm=self.p.num_perm, seed=self.p.seed, scheme="affine64", hashfunc=int)
            m.update_batch(sh.tolist())
            for cand in sorted(self.lsh.query(m)):
                j = jaccard(sh, self.shingles[cand])
                if j >= self.p.jaccard_threshold:
                    return cand, "near", round(j, 4)
        self.exact[key] = rec_id
        if m is not None:
            self.lsh.insert(rec_id, m)
            self.shingles[rec_id] = sh
        return None


# --- pools --------------------------------------------------------------------------------------------------------
def split_group(rec: dict[str, Any]) -> str:
    """Prompts of one group land in one pool: a code template's function, a retrieval passage's document."""
    if rec.get("task_type") == "code" and isinstance(rec.get("reference"), dict):
        return f"code/{rec['reference'].get('function')}"
    if "passage_source" in rec:
        return f"doc/{rec['passage_source']['id']}"
    return f"id/{rec['id']}"


def is_long(rec: dict[str, Any]) -> bool:
    """A generated long-context retrieval prompt (``long_retrieval``): sft pool only. Keyed on the generator's id,
    so a user prompt tagged ``long`` is pooled like any other."""
    return rec.get("source") == "verifiable" and str(rec.get("id", "")).startswith(LONG_ID_PREFIX)


def assign_pool(rec: dict[str, Any], params: PromptsParams) -> str:
    if is_long(rec):
        return "sft"
    group = split_group(rec)
    verifiable = rec.get("checker") in CHECKERS
    if verifiable and unit_hash(params.seed, "prompts/eval", group) < params.eval_fraction:
        return "eval"
    if (verifiable or not params.rl_verifiable_only) and \
            unit_hash(params.seed, "prompts/rl", group) < params.rl_fraction:
        return "rl"
    return "sft"


def read_pool(prompts_dir: Path, pool: str, stage: str) -> list[dict[str, Any]]:
    """The records of one pool (``sft``, ``dpo``, ``rl``, ``eval``) of a prompts artifact, in their file order."""
    path = Path(prompts_dir) / POOLS_DIR / f"{pool}.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"{stage}: the prompts artifact {prompts_dir} has no {POOLS_DIR}/{pool}.jsonl; is the "
                                "'prompts' input a prompts stage's output?")
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def _tag_table(pools: dict[str, list[dict[str, Any]]]) -> dict[str, dict[str, dict[str, int]]]:
    return {pool: {t: dict(sorted(Counter(str(r.get(t)) for r in rows).items())) for t in TAG_FIELDS}
            for pool, rows in pools.items()}


def _plot(ctx: StageContext, tags: dict[str, dict[str, dict[str, int]]]) -> None:
    import matplotlib  # heavy: matplotlib (a plot at the end of a run)

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # heavy: matplotlib

    fig, axes = plt.subplots(1, len(TAG_FIELDS), figsize=(15, 4.5))
    for ax, field in zip(axes, TAG_FIELDS, strict=True):
        values = sorted({v for p in tags.values() for v in p[field]})
        bottom = np.zeros(len(POOLS))
        for v in values:
            counts = np.array([tags[p][field].get(v, 0) for p in POOLS])
            ax.bar(POOLS, counts, bottom=bottom, label=v)
            bottom += counts
        ax.set_title(field)
        ax.set_ylabel("prompts")
        ax.legend(fontsize=7)
    ctx.log_figure(fig, "tags.png")


# --- the stage ----------------------------------------------------------------------------------------------------
def collect_prompts(params: PromptsParams, passages: list[tuple[str, str, str]], open_docs: list[tuple[str, str, str]],
                    long_records: Sequence[dict[str, Any]] = ()
                    ) -> tuple[Counter, list[dict[str, Any]], list[dict[str, Any]]]:
    """(inputs by source, kept records, dropped rows): the user, verifiable and open-ended prompts in that order,
    each kept or dropped (empty, too long, a duplicate of one kept before it, an invalid user line)."""
    generated = generate_verifiable(params.seed, params.verifiable, passages, params.code_tests)
    for rec in generated:
        rec["tag_source"] = "generator"
    inputs = Counter()
    dropped: list[dict[str, Any]] = []
    kept: list[dict[str, Any]] = []
    index = NearDuplicateIndex(params)

    def consider(rec: dict[str, Any]) -> None:
        inputs[rec["source"]] += 1
        text = rec["prompt"]
        if not text.strip():
            dropped.append({"id": rec["id"], "source": rec["source"], "reason": "empty"})
        elif len(text) > params.max_prompt_chars:
            dropped.append({"id": rec["id"], "source": rec["source"], "reason": "too_long",
                            "detail": f"{len(text)} chars"})
        else:
            dup = index.find_or_add(rec["id"], dedup_text(rec))
            if dup:
                dropped.append({"id": rec["id"], "source": rec["source"], "reason": "duplicate", "kept_id": dup[0],
                                "detail": f"{dup[1]} (Jaccard {dup[2]})"})
            else:
                kept.append(rec)

    for rec, where, problem in _user_prompts(params):
        if rec is None:
            inputs["user"] += 1
            dropped.append({"id": where, "source": "user", "reason": "invalid_record", "detail": problem})
        else:
            consider(rec)
    for rec in generated:
        consider(rec)
    for rec in open_ended_prompts(open_docs, params.open_ended, params):
        consider(rec)
    # last, so that no earlier prompt's near-duplicate verdict changes when they are asked for
    for rec in long_records:
        rec["tag_source"] = "generator"
        consider(rec)
    return inputs, kept, dropped


def split_pools(kept: list[dict[str, Any]], params: PromptsParams) -> dict[str, list[dict[str, Any]]]:
    """The kept records by pool (:func:`assign_pool`); ``dpo`` a seeded ``dpo_fraction`` of ``sft``."""
    pools: dict[str, list[dict[str, Any]]] = {p: [] for p in POOLS}
    for rec in kept:
        pools[assign_pool(rec, params)].append(rec)
    pools["dpo"] = [r for r in pools["sft"]
                    if not is_long(r) and unit_hash(params.seed, "prompts/dpo", r["id"]) < params.dpo_fraction]
    return pools


def run(params: PromptsParams, ctx: StageContext) -> None:
    start = time.monotonic()
    docs_art = ctx.inputs.get("documents")
    docs_path = docs_art.path if docs_art is not None and not isinstance(docs_art, list) else None
    n_retrieval = params.verifiable.get("retrieval", 0)
    if docs_path is None and (n_retrieval or params.open_ended):
        ctx.progress("WARNING: no documents input: no retrieval or open-ended prompts")
    cut = max(params.excerpt_words) * 4
    # one pass over the documents; the long windows read the open-ended documents further than their excerpts do
    sample = _sample_documents(docs_path, n_retrieval + params.open_ended, params.seed,
                               max(cut, params.long_retrieval_words) if params.long_retrieval else cut)
    long_records = long_retrieval_records(params.seed, params.long_retrieval, sample[n_retrieval:],
                                          params.long_retrieval_words) if params.long_retrieval else []
    sample = [(i, d, " ".join(t.split()[:cut])) for i, d, t in sample]  # what the excerpts and passages read
    passages, open_docs = sample[:n_retrieval], sample[n_retrieval:]  # disjoint documents
    inputs, kept, dropped = collect_prompts(params, passages, open_docs, long_records)
    pools = split_pools(kept, params)
    if params.long_retrieval:
        made = sum(is_long(r) for r in pools["sft"])
        ctx.progress(f"long retrieval: {len(long_records)} of {params.long_retrieval} prompts of "
                     f"{params.long_retrieval_words:,} words made from the {len(open_docs)} open-ended prompts' "
                     f"documents" + (" (they ran out)" if len(long_records) < params.long_retrieval else "")
                     + f"; {made} kept" + (f", {len(long_records) - made} dropped (too_long or duplicate: "
                                           "dropped.jsonl)" if made < len(long_records) else ""))
    n_in, n_kept = sum(inputs.values()), len(kept)
    partition = len(pools["sft"]) + len(pools["rl"]) + len(pools["eval"])
    if n_in != n_kept + len(dropped) or partition != n_kept:
        raise RuntimeError(f"prompts: accounting broken: {n_in} inputs, {n_kept} kept, {len(dropped)} dropped, "
                           f"{partition} in sft + rl + eval (a bug: report it)")

    out = ctx.out_dir / POOLS_DIR
    out.mkdir(exist_ok=True)
    for pool, rows in pools.items():
        write_jsonl_atomic(out / f"{pool}.jsonl", [r | {"pool": pool} for r in rows])
        ctx.set_rows(pool, len(rows))
    write_jsonl_atomic(ctx.out_dir / DROPPED_FILE, dropped)
    tags = _tag_table(pools)
    reasons = Counter(d["reason"] for d in dropped)
    summary = {"prompts_in": n_in, "prompts_kept": n_kept, "prompts_dropped": len(dropped)}
    summary |= {f"prompts_in.{s}": n for s, n in sorted(inputs.items())}
    summary |= {f"dropped.{r}": reasons.get(r, 0) for r in DROP_REASONS}
    summary |= {f"pool.{p}": len(rows) for p, rows in pools.items()}
    summary |= {f"pool.{p}.verifiable": sum(r.get("checker") in CHECKERS for r in rows) for p, rows in pools.items()}
    summary["pool.sft.long_retrieval"] = sum(is_long(r) for r in pools["sft"])
    for pool in POOLS:
        for v, n in tags[pool]["task_type"].items():
            summary[f"tags.{pool}.task_type.{metric_key(v)}"] = n
    ctx.log_summary(summary)
    _plot(ctx, tags)
    report = {"params": params.model_dump(), "inputs": dict(inputs), "kept": n_kept,
              "dropped": {r: reasons.get(r, 0) for r in DROP_REASONS}, "drop_reasons": DROP_REASONS,
              "pools": {p: len(rows) for p, rows in pools.items()}, "tags": tags,
              "accounting": {"inputs": n_in, "kept": n_kept, "dropped": len(dropped),
                             "sft+rl+eval": partition, "dpo_subset_of_sft": True},
              "documents_sampled": {"retrieval": len(passages), "open_ended": len(open_docs)},
              "seconds": round(time.monotonic() - start, 2)}
    write_text_atomic(ctx.out_dir / REPORT_FILE, json.dumps(report, indent=2, sort_keys=True) + "\n")
    ctx.log_artifact(ctx.out_dir / REPORT_FILE, "prompts")
    ctx.progress(f"{n_in} prompts in, {n_kept} kept ({dict(reasons)} dropped): " +
                 ", ".join(f"{p} {len(r)}" for p, r in pools.items()))


STAGE = StageKind(
    # run records (StageKind.records): hashed and verified, not part of the digest; no stage reads them
    records=("prompts_report.json", "plots/*"),
    name="prompts",
    params=PromptsParams,
    run=run,
    produces=PROMPTS_TYPE,
    inputs={"documents": InputSpec(ANY_DOCUMENTS, required=False,
                                   doc="corpus documents for retrieval passages and open-ended prompts")},
    fingerprint=fingerprint,
    validate_external=validate_external,
    doc="§5.1 prompt collection: user JSONL prompts, verifiable prompts with exact checkers (arithmetic, string, "
        "retrieval from corpus passages, Python functions with sandboxed hidden tests) and open-ended prompts from "
        "the corpus; tagged (task type, domain, difficulty), exact and MinHash-LSH near-duplicates removed, split "
        "into sft / dpo (a subset of sft, §5.4.1) / rl (never sft, §5.4.2) / eval (held-out verifiable) pools.",
)
