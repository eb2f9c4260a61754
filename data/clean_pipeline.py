"""Stage ``clean``'s algorithm: the enabled steps as datatrove blocks, planned per domain (:class:`Pipeline`), and
one shard's work (:func:`clean_shard`): every document through its domain's steps, kept ones written, each drop
counted under its reason with a person-readable detail (:func:`describe_drop`)."""

from __future__ import annotations

import re
import time
from collections import Counter, defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from datatrove.data import Document
from datatrove.pipeline.filters.base_filter import get_filter_result

from data.clean_filters import RegexWordTokenizer, build_block
from data.clean_params import FORMATTERS, STEPS, CleanParams, lid_model_path
from data.documents import LANGUAGE, LANGUAGE_SCORE, DocumentWriter, iter_document_range
from pipeline.stage import StageParams, track


@dataclass
class Step:
    name: str
    block: Any  # a datatrove BaseFormatter or BaseFilter
    params: StageParams


class Pipeline:
    """The enabled steps, in :data:`STEPS` order, as datatrove blocks, built once per domain.

    Domains without overrides share the global blocks; all share one word tokenizer (so datatrove's
    tokenization cache serves Gopher repetition and quality on the same text) and one fastText model.
    """

    def __init__(self, params: CleanParams) -> None:
        self.params = params
        self.words: Any = RegexWordTokenizer() if params.word_tokenizer == "regex" else "en"  # en: spaCy
        self.names = [s for s in STEPS if getattr(params, s).enabled]
        self.lid_path = lid_model_path(params.language) if "language" in self.names else None
        self._global = [self._step(name, None) for name in self.names]
        self._by_domain: dict[str, list[tuple[str, Step | None]]] = {}

    def _step(self, name: str, domain: str | None) -> Step:
        p = self.params.step_params(name, domain)
        return Step(name, build_block(name, p, self.words, self.lid_path), p)

    def plan(self, domain: str) -> list[tuple[str, Step | None]]:
        """Each enabled step with the block a document of ``domain`` goes through, None where skipped."""
        if domain not in self._by_domain:
            skip = set(self.params.skipped(domain))
            overridden = self.params.overrides(domain)
            self._by_domain[domain] = [
                (s.name, None if s.name in skip else self._step(s.name, domain) if s.name in overridden else s)
                for s in self._global]
        return self._by_domain[domain]


# --- why a document was dropped -------------------------------------------------------------------

# datatrove reason -> what it means, with the threshold that applied ({name} = a param of that step)
REASON_DETAILS: dict[str, str] = {
    "length.too_short": "fewer than min_chars={min_chars} characters",
    "length.too_long": "more than max_chars={max_chars} characters",
    "gopher_repetition.empty": "empty text",
    "gopher_repetition.dup_para_frac": "more than {dup_para_frac} of paragraphs repeat an earlier one",
    "gopher_repetition.dup_para_char_frac": "more than {dup_para_char_frac} of characters in repeated paragraphs",
    "gopher_repetition.dup_line_frac": "more than {dup_line_frac} of lines repeat an earlier one",
    "gopher_repetition.dup_line_char_frac": "more than {dup_line_char_frac} of characters in repeated lines",
    "gopher_quality.gopher_short_doc": "fewer than min_doc_words={min_doc_words} non-punctuation words",
    "gopher_quality.gopher_long_doc": "more than max_doc_words={max_doc_words} non-punctuation words",
    "gopher_quality.gopher_below_avg_threshold": "mean word length below {min_avg_word_length}",
    "gopher_quality.gopher_above_avg_threshold": "mean word length above {max_avg_word_length}",
    "gopher_quality.gopher_too_many_hashes": "more than {max_symbol_word_ratio} '#' per word",
    "gopher_quality.gopher_too_many_ellipsis": "more than {max_symbol_word_ratio} '...' per word",
    "gopher_quality.gopher_too_many_bullets": "more than {max_bullet_lines_ratio} of lines start with a bullet",
    "gopher_quality.gopher_too_many_end_ellipsis": "more than {max_ellipsis_lines_ratio} of lines end with '...'",
    "gopher_quality.gopher_below_alpha_threshold": "fewer than {min_alpha_words_ratio} of words have a letter",
    "gopher_quality.gopher_enough_stop_words": "fewer than min_stop_words={min_stop_words} stop words",
    "c4_quality.lorem_ipsum": "contains 'lorem ipsum'",
    "c4_quality.curly_bracket": "a kept line contains '{{'",
    "c4_quality.too_few_sentences": "fewer than {min_num_sentences} sentences left after line filtering",
    "fineweb_quality.empty": "no non-blank line",
    "fineweb_quality.line_punct_ratio": "fewer than {line_punct_thr} of lines end in terminal punctuation",
    "fineweb_quality.short_line_ratio": "more than {short_line_thr} of lines have <= {short_line_length} chars",
    "fineweb_quality.char_dup_ratio": "more than {char_duplicates_ratio} of characters in duplicated lines",
    "fineweb_quality.list_ratio": "more than {new_line_ratio} newlines per word",
}
_NGRAM_REASON = re.compile(r"gopher_repetition\.(?:top_(\d+)_gram|duplicated_(\d+)_n_grams)")


def describe_drop(reason: str, step: Step, doc: Document) -> str:
    """A person-readable detail for a dropped document."""
    values = step.params.model_dump()
    if step.name == "language":
        return (f"predicted {doc.metadata.get(LANGUAGE)} ({doc.metadata.get(LANGUAGE_SCORE, 0.0):.3f}); none "
                f"of {', '.join(values['languages'])} scored above threshold={values['threshold']}")
    if (m := _NGRAM_REASON.fullmatch(reason)) is not None:
        top, dup = m.groups()
        if top:
            return f"the most frequent {top}-gram covers more than {values['top_n_grams'][int(top)]} of characters"
        return f"repeated {dup}-grams cover more than {values['dup_n_grams'][int(dup)]} of characters"
    template = REASON_DETAILS.get(reason)
    detail = template.format(**values) if template else ""
    if step.name == "length":
        detail += f" ({len(doc.text)})"
    return detail



@dataclass
class StepTally:
    applied: int = 0  # documents this step ran on
    skipped: int = 0  # documents that reached it but whose domain skips it
    dropped: int = 0
    modified: int = 0  # documents whose text it changed (and that it did not drop)
    seconds: float = 0.0


@dataclass
class DomainTally:
    docs: int = 0
    kept: int = 0
    chars_in: int = 0
    chars_kept: int = 0
    bytes_in: int = 0  # UTF-8, for MB/s
    dropped: Counter[str] = field(default_factory=Counter)  # step -> count


@dataclass
class CleanShard:
    """One shard's work (plain data: it travels to a Ray task): documents [start, stop) of the input."""

    params: dict[str, Any]
    docs_path: str
    start: int
    stop: int
    file_counts: list[int]
    out_dir: str  # the shard's kept documents go to <out_dir>/documents/ (DocumentWriter's layout)


@dataclass
class CleanTally:
    """What a shard counted; shards add up (:meth:`add`) in input order."""

    tallies: dict[str, StepTally]
    domains: dict[str, DomainTally] = field(default_factory=lambda: defaultdict(DomainTally))
    reasons: Counter[str] = field(default_factory=Counter)
    samples: dict[str, list[dict[str, Any]]] = field(default_factory=lambda: defaultdict(list))
    written: int = 0

    def add(self, other: CleanTally, sample_cap: int) -> None:
        for name, t in other.tallies.items():
            mine = self.tallies[name]
            mine.applied += t.applied
            mine.skipped += t.skipped
            mine.dropped += t.dropped
            mine.modified += t.modified
            mine.seconds += t.seconds
        for name, d in other.domains.items():
            mine_d = self.domains[name]
            mine_d.docs += d.docs
            mine_d.kept += d.kept
            mine_d.chars_in += d.chars_in
            mine_d.chars_kept += d.chars_kept
            mine_d.bytes_in += d.bytes_in
            mine_d.dropped.update(d.dropped)
        self.reasons.update(other.reasons)
        for reason, docs in other.samples.items():  # the first in input order: earlier shards first
            self.samples[reason] += docs[: sample_cap - len(self.samples[reason])]
        self.written += other.written


def clean_shard(shard: CleanShard, progress: Callable[[str], None]) -> CleanTally:
    """Clean documents [start, stop): kept ones to the shard's directory, drops counted (a Ray task's body)."""
    params = CleanParams.model_validate(shard.params)
    pipeline = Pipeline(params)
    out = CleanTally({name: StepTally() for name in pipeline.names})
    tallies, domains, reasons, samples = out.tallies, out.domains, out.reasons, out.samples

    def clean(record: dict[str, Any]) -> tuple[Document, str | None, Step | None]:
        """Runs one document through its domain's steps: (doc, drop reason or None, the dropping step)."""
        doc = Document(text=record["text"], id=record["id"], metadata={})
        for name, step in pipeline.plan(record["domain"]):
            tally = tallies[name]
            if step is None:
                tally.skipped += 1
                continue
            tally.applied += 1
            before = doc.text
            t0 = time.perf_counter()
            try:
                if name in FORMATTERS:
                    doc.text = step.block.format(doc.text)
                    keep, why = True, None
                else:
                    keep, why = get_filter_result(step.block.filter(doc))
            except Exception as e:  # a datatrove block failing on one document: say which
                raise RuntimeError(f"clean: step {name} failed on document {record['id']!r} "
                                   f"(domain {record['domain']!r}): {type(e).__name__}: {e}") from e
            tally.seconds += time.perf_counter() - t0
            if not keep:
                tally.dropped += 1
                return doc, f"{name}.{why or 'dropped'}", step
            if doc.text != before:
                tally.modified += 1
        return doc, None, None

    records = iter_document_range(shard.docs_path, shard.start, shard.stop, shard.file_counts)
    with DocumentWriter(shard.out_dir) as writer:
        for record in track(records, progress, total=shard.stop - shard.start, what="documents"):
            domain = domains[record["domain"]]
            domain.docs += 1
            domain.chars_in += len(record["text"])
            domain.bytes_in += len(record["text"].encode("utf-8"))
            doc, reason, step = clean(record)
            if reason is None:
                domain.kept += 1
                domain.chars_kept += len(doc.text)
                metadata = dict(record["metadata"])
                if LANGUAGE in doc.metadata:
                    metadata[LANGUAGE] = doc.metadata[LANGUAGE]
                    metadata[LANGUAGE_SCORE] = round(float(doc.metadata[LANGUAGE_SCORE]), 4)
                writer.write({"id": record["id"], "text": doc.text, "source": record["source"],
                              "domain": record["domain"], "metadata": metadata})
                continue
            assert step is not None
            reasons[reason] += 1
            domain.dropped[step.name] += 1
            if len(samples.get(reason, ())) < params.sample_dropped:
                samples[reason].append({
                    "id": record["id"], "domain": record["domain"], "source": record["source"],
                    "reason": reason, "detail": describe_drop(reason, step, doc),
                    "text": doc.text, "metadata": record["metadata"]})
        out.written = writer.count
    return out
