"""Params of stage ``ingest`` (:mod:`data.ingest`): what to read, which fields hold what, and the limits."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from pipeline.stage import StageParams


class IngestParams(StageParams):
    paths: list[str] = Field(default_factory=list, description=(
        "Files, directories (read recursively, known extensions only) or globs (** allowed). Relative "
        "paths resolve against the working directory; ~ is expanded."))
    sample_corpus: bool = Field(True, description="Also read the shipped corpus data/sample_corpus/*.jsonl.gz.")
    format: Literal["auto", "jsonl", "parquet"] = Field("auto", description=(
        "auto: by extension (.jsonl[.gz|.zst], .json.gz, .ndjson[.gz]; .parquet). Otherwise every matched "
        "file is read in this format."))
    text_key: str = Field("text", description="Field holding the document text.")
    id_key: str = Field("id", description="Field holding the id (else <file stem>/<line>).")
    domain_key: str = Field("domain", description="Field holding the domain (else default_domain).")
    source_key: str = Field("source", description="Field holding the source (else <file>:<line>).")
    default_domain: str = Field("unknown", description="Domain of records without a domain field.")
    limit: int | None = Field(None, description="Read at most this many records per file (quick runs).")
    min_chars: int = Field(1, description="Records with shorter text are quarantined as too_short.")
    max_record_bytes: int = Field(64 << 20, description=(
        "A JSONL line (or Parquet row as JSON) longer than this is quarantined as too_long. Ingesting a line "
        "of N bytes takes about 4N of memory; skipping a longer one about max_record_bytes."))

    @field_validator("paths")
    @classmethod
    def _paths_not_blank(cls, paths: list[str]) -> list[str]:
        for i, p in enumerate(paths):
            if not p.strip():
                raise ValueError(f"paths[{i}] is empty; give a file, directory or glob")
        return paths

    @field_validator("text_key", "id_key", "domain_key", "source_key", "default_domain")
    @classmethod
    def _not_empty(cls, value: str) -> str:
        if not value:
            raise ValueError("must be a non-empty string")
        return value

    @field_validator("limit")
    @classmethod
    def _limit_positive(cls, limit: int | None) -> int | None:
        if limit is not None and limit < 1:
            raise ValueError(f"limit must be >= 1 records per file, or null for no limit (got {limit})")
        return limit

    @field_validator("min_chars")
    @classmethod
    def _min_chars_positive(cls, min_chars: int) -> int:
        if min_chars < 1:
            raise ValueError(f"min_chars must be >= 1 (empty text is always quarantined; got {min_chars})")
        return min_chars

    @field_validator("max_record_bytes")
    @classmethod
    def _max_record_bytes_sane(cls, n: int) -> int:
        if n < 1024:
            raise ValueError(f"max_record_bytes must be >= 1024 (got {n})")
        return n

    @model_validator(mode="after")
    def _has_inputs_and_distinct_keys(self) -> IngestParams:
        if not self.sample_corpus and not self.paths:
            raise ValueError("ingest has no inputs: set paths (files, directories or globs) "
                             "or sample_corpus: true")
        keys = {"text_key": self.text_key, "id_key": self.id_key, "domain_key": self.domain_key,
                "source_key": self.source_key}
        seen: dict[str, str] = {}
        for name, key in keys.items():
            if key in seen:
                raise ValueError(f"{name} and {seen[key]} are both {key!r}; each field needs its own key")
            seen[key] = name
        if "metadata" in seen:
            raise ValueError(f"{seen['metadata']} is 'metadata', which is reserved for the metadata object")
        return self
