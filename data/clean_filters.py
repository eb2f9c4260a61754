"""The datatrove blocks ``clean`` runs, and what it adds to them: a fast spaCy-like word tokenizer, a
length filter, C4 that can decide without editing, and fastText language ID from a local file.

:func:`build_block` makes the datatrove block of one step from that step's params (data/clean.py).
"""

from __future__ import annotations

import functools
import re
from pathlib import Path
from typing import Any

from datatrove.data import Document
from datatrove.pipeline.filters import (
    C4QualityFilter,
    FineWebQualityFilter,
    GopherQualityFilter,
    GopherRepetitionFilter,
    LanguageFilter,
)
from datatrove.pipeline.filters.base_filter import BaseFilter
from datatrove.pipeline.formatters import FTFYFormatter
from datatrove.utils.lid import FT176LID
from datatrove.utils.text import TERMINAL_PUNCTUATION
from datatrove.utils.word_tokenizers import WhitespaceTokenizer, strip_strings


class RegexWordTokenizer(WhitespaceTokenizer):
    """datatrove's regex sentence splitter with a regex word split close to spaCy's blank English.

    Words: spaCy's tokenizer rules for English, as one regex: URLs; words that may hold inner punctuation
    (``1.2.12``, ``self.x``, ``bpo-4690``) split at spaCy's infixes (``well - known``, ``ctx = Load``);
    contractions split (``do n't``, ``it 's``); runs of ``-``, ``~``, ``.`` as one token, any other
    punctuation character alone. On the sample corpus the token multisets differ from spaCy's by ~6%.

    Sentences: datatrove's own regex, run only up to the last sentence end. Every match ends at one, and
    the lazy pattern tries every start position of a tail without one (quadratic): the same sentences
    (checked on the 224k lines of the sample corpus), ~5x faster for C4's per-line counting.
    """

    _WORD = re.compile(r"""
        https?://\S*[^\s.,;:!?)\]"'>]                        # URL, less trailing punctuation
      | (?i:n't|'(?:s|re|ve|ll|d|m))(?!\w)                   # English contraction suffixes
      | \w(?:(?>                                              # a word: starts and ends with a word character
            [^\s\-:<>=/,.+*^']                                #   inner characters that never split it
          | '(?!(?i:s|re|ve|ll|d|m|t)(?!\w))                 #   ' unless a contraction follows
          | [:<>=/](?:(?<![^\W_].)|(?![^\W\d_]))             #   spaCy's infixes: [:<>=/] between alnum and letter,
          | ,(?:(?<![^\W\d_],)|(?![^\W\d_]))                 #   , between letters,
          | \.(?:(?<![a-z]\.)|(?![A-Z]))                      #   . between lower and upper case,
          | [+*^](?:(?<!\d.)|(?!\d))                          #   + * ^ between digits,
          | -(?:(?<![^\W_]-)|(?![^\W_])|(?<=[^\W\d_]-)(?=\d))  #   - between alnum and letter, digit and digit
          )*(?!(?i:n't)(?!\w))\w)?                             # (?>: one way to match each character,
                                                              #  no exponential backtracking on runs like ----)
      | -+ | ~+ | \.+                                         # runs of - ~ . stay one token
      | [^\w\s]                                              # any other punctuation character
    """, re.VERBOSE)
    _ENDS = re.escape("".join(sorted(TERMINAL_PUNCTUATION))) + "\n"  # what datatrove's regex ends on
    _LAST_END = re.compile(f"[{_ENDS}](?=[^{_ENDS}]*\\Z)")

    def word_tokenize(self, text: str) -> list[str]:
        return self._WORD.findall(text)

    def sent_tokenize(self, text: str) -> list[str]:
        last = self._LAST_END.search(text)
        if last is None:
            return []
        # +1: a closing quote after the last end belongs to the sentence
        return strip_strings(self._sent_regex.findall(text[: last.end() + 1]))


class LengthFilter(BaseFilter):
    """Drops documents shorter than ``min_chars`` or longer than ``max_chars`` characters."""

    name = "📏 Length"

    def __init__(self, min_chars: int, max_chars: int | None) -> None:
        super().__init__()
        self.min_chars = min_chars
        self.max_chars = max_chars

    def filter(self, doc: Document) -> bool | tuple[bool, str]:
        if len(doc.text) < self.min_chars:
            return False, "too_short"
        if self.max_chars is not None and len(doc.text) > self.max_chars:
            return False, "too_long"
        return True


class C4Filter(C4QualityFilter):
    """datatrove's C4QualityFilter, optionally keeping the text of the documents it keeps unedited."""

    def __init__(self, remove_lines: bool, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.remove_lines = remove_lines

    def filter(self, doc: Document) -> bool | tuple[bool, str]:
        text = doc.text
        result = super().filter(doc)
        if not self.remove_lines:
            doc.text = text
        return result


class LocalFT176LID(FT176LID):
    """datatrove's fastText lid.176 model, loaded from a local file instead of downloaded."""

    def __init__(self, languages: list[str] | None, model_path: Path) -> None:
        super().__init__(languages)
        self.model_path = model_path

    @property
    def model(self) -> Any:
        if self._model is None:
            self._model = _fasttext_model(self.model_path)
        return self._model


class OfflineLanguageFilter(LanguageFilter):
    """datatrove's LanguageFilter on a local lid.176 file; drops with reason ``other_language``."""

    def __init__(self, languages: list[str], threshold: float, model_path: Path) -> None:
        super().__init__(languages=languages, language_threshold=threshold)
        self.model = LocalFT176LID(languages, model_path)

    def filter(self, doc: Document) -> bool | tuple[bool, str]:
        return True if super().filter(doc) else (False, "other_language")


@functools.lru_cache(maxsize=4)
def _fasttext_model(path: Path) -> Any:
    from fasttext.FastText import _FastText  # what datatrove's FastTextLID loads, minus the download

    return _FastText(str(path))


def build_block(step: str, p: Any, words: Any, lid_path: Path | None) -> Any:
    """The datatrove block of ``step`` with params ``p``."""
    if step == "ftfy":
        return FTFYFormatter(unescape_html=p.unescape_html, normalization=p.normalization)
    if step == "length":
        return LengthFilter(p.min_chars, p.max_chars)
    if step == "language":
        assert lid_path is not None
        return OfflineLanguageFilter(p.languages, p.threshold, lid_path)
    if step == "gopher_repetition":
        return GopherRepetitionFilter(
            dup_line_frac=p.dup_line_frac, dup_para_frac=p.dup_para_frac,
            dup_line_char_frac=p.dup_line_char_frac, dup_para_char_frac=p.dup_para_char_frac,
            top_n_grams=tuple(sorted(p.top_n_grams.items())), dup_n_grams=tuple(sorted(p.dup_n_grams.items())),
            language=words)
    if step == "gopher_quality":
        return GopherQualityFilter(
            min_doc_words=p.min_doc_words, max_doc_words=p.max_doc_words,
            min_avg_word_length=p.min_avg_word_length, max_avg_word_length=p.max_avg_word_length,
            max_symbol_word_ratio=p.max_symbol_word_ratio, max_bullet_lines_ratio=p.max_bullet_lines_ratio,
            max_ellipsis_lines_ratio=p.max_ellipsis_lines_ratio,
            max_non_alpha_words_ratio=p.min_alpha_words_ratio, min_stop_words=p.min_stop_words,
            stop_words=p.stop_words, language=words)
    if step == "c4_quality":
        return C4Filter(
            remove_lines=p.remove_lines, filter_no_terminal_punct=p.filter_no_terminal_punct, min_num_sentences=p.min_num_sentences,
            min_words_per_line=p.min_words_per_line, max_word_length=p.max_word_length,
            remove_citations=p.remove_citations, filter_lorem_ipsum=p.filter_lorem_ipsum,
            filter_javascript=p.filter_javascript, filter_curly_bracket=p.filter_curly_bracket,
            filter_policy=p.filter_policy, language=words)
    if step == "fineweb_quality":
        return FineWebQualityFilter(
            line_punct_thr=p.line_punct_thr, line_punct_exclude_zero=p.line_punct_exclude_zero,
            short_line_thr=p.short_line_thr, short_line_length=p.short_line_length,
            char_duplicates_ratio=p.char_duplicates_ratio, new_line_ratio=p.new_line_ratio, language=words)
    raise ValueError(f"unknown step {step!r}")
