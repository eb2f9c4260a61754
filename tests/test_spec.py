"""Spec validation: every error kind is caught before anything runs, with file, stage and field."""

from __future__ import annotations

import re
import textwrap
from pathlib import Path

import pytest
import yaml

from pipeline.cli import EXIT_INVALID, main
from pipeline.spec import ClusterCapacity, SpecError, load_spec

GOOD = """\
name: t
artifact_root: {root}
stages:
  a:
    uses: tests.stage_fixtures:SOURCE
    params: {{text: "A"}}
  b:
    uses: tests.stage_fixtures:SOURCE
  ab:
    uses: tests.stage_fixtures:CONCAT
    needs: [a, b]
  n:
    uses: tests.stage_fixtures:COUNT
    needs: [ab]
"""


def write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "spec.yaml"
    p.write_text(textwrap.dedent(text).format(root=tmp_path / "runs"))
    return p


def problems(tmp_path: Path, text: str, **kw) -> str:
    with pytest.raises(SpecError) as e:
        load_spec(write(tmp_path, text), **kw)
    return str(e.value)


def test_good_spec_resolves_order_roles_and_defaults(tmp_path):
    spec = load_spec(write(tmp_path, GOOD))
    assert list(spec.stages) == ["a", "b", "ab", "n"]
    assert spec.stages["ab"].inputs == {"texts": ["a", "b"]}
    assert spec.stages["n"].inputs == {"text": ["ab"]}
    assert spec.stages["b"].params.text == "hello"  # default from the params model
    assert spec.stages["a"].resources.cpus == 1
    assert spec.downstream_of("a") == ["a", "ab", "n"]
    assert spec.upstream_of("ab") == ["a", "b", "ab"]


def test_unknown_stage_kind_names_file_line_stage_and_suggests(tmp_path):
    msg = problems(tmp_path, GOOD.replace("uses: tests.stage_fixtures:COUNT", "uses: tokenizr"))
    assert "spec.yaml:13" in msg and "stage 'n', field uses" in msg and "did you mean 'tokenizer'" in msg


def test_unknown_and_mistyped_params(tmp_path):
    bad = GOOD.replace('params: {{text: "A"}}', 'params: {{text: "A", colour: red, repeat: many}}')
    msg = problems(tmp_path, bad)
    assert "stage 'a', field params.colour: Extra inputs are not permitted" in msg
    assert "stage 'a', field params.repeat" in msg and "'many'" in msg


def test_dependency_cycle(tmp_path):
    bad = GOOD.replace("uses: tests.stage_fixtures:SOURCE\n    params", "uses: tests.stage_fixtures:CONCAT\n    needs: [n]\n    params")
    bad = bad.replace('params: {{text: "A"}}', "")
    msg = problems(tmp_path, bad)
    assert "dependency cycle" in msg and "a -> n -> ab -> a" in msg


def test_missing_needs_target_and_self_need(tmp_path):
    msg = problems(tmp_path, GOOD.replace("needs: [ab]", "needs: [abc]"))
    assert "stage 'n', field needs: no stage named 'abc'" in msg
    msg = problems(tmp_path, GOOD.replace("needs: [ab]", "needs: [ab, n]"))
    assert "stage 'n', field needs: a stage cannot need itself" in msg


def test_duplicate_stage_names(tmp_path):
    msg = problems(tmp_path, GOOD + "  a:\n    uses: tests.stage_fixtures:SOURCE\n")
    assert "duplicate key 'a'" in msg and "spec.yaml:15" in msg


def test_merge_keys_share_params_and_a_stages_own_keys_win_while_duplicates_are_still_refused(tmp_path):
    merged = GOOD.replace('params: {{text: "A"}}', 'params: &base {{text: "A"}}').replace(
        "  b:\n    uses: tests.stage_fixtures:SOURCE\n",
        "  b:\n    uses: tests.stage_fixtures:SOURCE\n    params: {{<<: *base}}\n"
        "  c:\n    uses: tests.stage_fixtures:SOURCE\n    params:\n      <<: *base\n      text: C\n")
    spec = load_spec(write(tmp_path, merged))
    assert [spec.stages[n].params.text for n in "abc"] == ["A", "A", "C"]
    msg = problems(tmp_path, merged.replace("      text: C\n", "      text: C\n      text: D\n"))
    assert "duplicate key 'text'" in msg


def test_input_type_mismatch(tmp_path):
    msg = problems(tmp_path, GOOD.replace("needs: [ab]", "needs: [ab]\n  m:\n    uses: tests.stage_fixtures:COUNT\n    needs: [n]"))
    assert "stage 'm'" in msg and "input 'text' needs a stage producing 'text'" in msg


def test_resources_no_node_can_satisfy(tmp_path):
    bad = GOOD.replace("uses: tests.stage_fixtures:COUNT", "uses: tests.stage_fixtures:COUNT\n    resources: {{gpus: 8, cpus: 64}}")
    msg = problems(tmp_path, bad, capacity=ClusterCapacity(cpus=2, gpus=0, memory_gb=24))
    assert "stage 'n', field resources.gpus: asks for 8 but the largest node of this machine has 0" in msg
    assert "resources.cpus: asks for 64" in msg


def test_all_problems_reported_at_once(tmp_path):
    bad = GOOD.replace("needs: [ab]", "needs: [zz]").replace("uses: tests.stage_fixtures:CONCAT", "uses: nope")
    msg = problems(tmp_path, bad)
    assert "'zz'" in msg and "'nope'" in msg


def test_overrides_apply_and_are_validated(tmp_path):
    path = write(tmp_path, GOOD)
    spec = load_spec(path, overrides=["a.text=Z", "b.repeat=3", "n.resources.cpus=2"])
    assert spec.stages["a"].params.text == "Z" and spec.stages["b"].params.repeat == 3
    assert spec.stages["n"].resources.cpus == 2
    with pytest.raises(SpecError, match="no stage named 'q'"):
        load_spec(path, overrides=["q.text=1"])
    with pytest.raises(SpecError, match="params.repeat"):
        load_spec(path, overrides=["b.repeat=lots"])


def test_retries_default_to_the_specs_own_and_a_stages_wins_out_of_the_cache_key(tmp_path):
    from pipeline.orchestrator import stage_cache_key

    path = write(tmp_path, GOOD.replace("name: t\n", "name: t\nretries: 2\n").replace(
        "    needs: [a, b]\n", "    needs: [a, b]\n    retries: 0\n"))
    spec = load_spec(path)
    assert {n: s.retries for n, s in spec.stages.items()} == {"a": 2, "b": 2, "ab": 0, "n": 2}
    assert load_spec(write(tmp_path, GOOD)).stages["a"].retries == 0  # none said: no retry
    spec = load_spec(path, overrides=["ab.retries=1", "retries=0"])
    assert spec.stages["ab"].retries == 1 and spec.stages["a"].retries == 0
    assert yaml.safe_load(yaml.safe_dump(spec.resolved()))["stages"]["ab"]["retries"] == 1
    for bad in ("ab.retries=-1", "ab.retries=11", "retries=lots", "retries=true", "ab.retries=1.5"):
        with pytest.raises(SpecError, match="retries"):
            load_spec(path, overrides=[bad])
    # a retry makes the same artifact: the count is not in the cache key
    again = load_spec(path, overrides=["a.retries=5"])
    assert stage_cache_key(again.stages["a"], {})[0] == stage_cache_key(load_spec(path).stages["a"], {})[0]


def test_cli_invalid_spec_exits_2_and_starts_nothing(tmp_path, capsys):
    path = write(tmp_path, GOOD.replace("needs: [ab]", "needs: [abc]"))
    assert main(["validate", str(path)]) == EXIT_INVALID
    assert main(["run", str(path)]) == EXIT_INVALID
    err = capsys.readouterr().err
    assert "invalid spec" in err and "spec.yaml" in err and "stage 'n'" in err
    assert not (tmp_path / "runs").exists()  # nothing started, nothing written


def test_cli_run_refuses_a_json_report_path_it_could_not_write_before_anything_runs(tmp_path, capsys):
    path = write(tmp_path, GOOD)
    (tmp_path / "adir").mkdir()
    for target, why in [(tmp_path / "missing" / "report.json", "does not exist"),
                        (tmp_path / "adir", "is a directory")]:
        assert main(["run", str(path), "--json", str(target)]) == EXIT_INVALID
        err = capsys.readouterr().err
        assert f"--json {target}" in err and why in err
    assert not (tmp_path / "runs").exists()  # nothing started, nothing written


def test_cli_validate_ok(tmp_path, capsys):
    assert main(["validate", str(write(tmp_path, GOOD))]) == 0
    assert "OK" in capsys.readouterr().out


def test_cli_validate_skip_resources_checks_a_gpu_spec_on_a_machine_without_gpus(tmp_path, capsys, monkeypatch):
    """The GPU spec fails on a machine without GPUs for its resources alone; --skip-resources passes it and lists
    what it skipped, and still reports every other problem."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # this machine: no GPU, whatever it has
    gpu = Path(__file__).parent.parent / "dags" / "gpu-recipe.yaml"
    assert main(["validate", str(gpu)]) == EXIT_INVALID
    err = capsys.readouterr().err
    assert "resources.gpus" in err and "--skip-resources" in err
    assert main(["validate", "--skip-resources", str(gpu)]) == 0
    out = capsys.readouterr().out
    assert "OK" in out and "resources: not checked (--skip-resources)" in out
    assert "stage 'pretrain', field resources.gpus: asks for 1" in out
    bad = tmp_path / "bad.yaml"
    text = gpu.read_text()
    bad.write_text(re.sub(r"retrieval_share: [0-9.]+", "retrieval_share: 2", text, count=1))
    assert bad.read_text() != text  # the spec still has the param this check breaks
    assert main(["validate", "--skip-resources", str(bad)]) == EXIT_INVALID
    err = capsys.readouterr().err
    assert "retrieval_share" in err and "resources.gpus" not in err


def test_shipped_specs_validate_and_their_resolved_form_loads_back(tmp_path):
    specs = sorted(Path(__file__).parent.parent.glob("dags/*.yaml"))
    assert "tiny.yaml" in [s.name for s in specs], f"dags/tiny.yaml not found (glob found {specs})"
    for spec in specs:
        loaded = load_spec(spec)
        assert loaded.stages, f"{spec} declares no stage"
        # the resolved spec a run logs loads back to the same spec
        resolved = Path(tmp_path) / f"resolved-{spec.name}"
        resolved.write_text(yaml.safe_dump(loaded.resolved(), sort_keys=False))
        assert load_spec(resolved).resolved() == loaded.resolved(), spec


def test_stage_reference_doc_is_current():
    from pipeline.registry import describe_markdown

    doc = Path(__file__).parent.parent / "docs" / "stages.md"
    assert doc.read_text() == describe_markdown() + "\n", "regenerate: hylight stages --markdown > docs/stages.md"


def test_params_flatten_to_valid_mlflow_names():
    from pipeline.tracking import flatten

    flat = flatten({"params": {"a": {"b": 1}, "map": {"*/x/*": "y"}, "l": [1, 2]}})
    assert flat == {"params.a.b": "1", "params.map": '{"*/x/*": "y"}', "params.l": "[1, 2]"}


def test_plan_selects_and_forces_per_cli_semantics(tmp_path):
    import io

    from pipeline.orchestrator import Orchestrator, RunOptions

    spec = load_spec(write(tmp_path, GOOD))

    def plan(**kw):
        order, forced = Orchestrator(spec, RunOptions(**kw), out=io.StringIO()).plan()
        return order, forced

    assert plan() == (["a", "b", "ab", "n"], set())
    assert plan(stages=["ab"]) == (["a", "b", "ab"], {"ab"})  # --stage: it and what it needs
    assert plan(stages=["ab"], downstream=True) == (["a", "b", "ab", "n"], {"ab", "n"})
    assert plan(from_stage="ab") == (["a", "b", "ab", "n"], {"ab", "n"})  # --from: the whole DAG
    assert plan(stages=["a"]) == (["a"], {"a"})


def test_cache_key_changes_with_params_inputs_and_code():
    from pipeline.artifacts import cache_key

    base, _ = cache_key("k", "code1", {"x": 1}, {"in": ["d1"]})
    assert base == cache_key("k", "code1", {"x": 1}, {"in": ["d1"]})[0]
    others = {cache_key("k", "code2", {"x": 1}, {"in": ["d1"]})[0], cache_key("k", "code1", {"x": 2}, {"in": ["d1"]})[0],
              cache_key("k", "code1", {"x": 1}, {"in": ["d2"]})[0], cache_key("j", "code1", {"x": 1}, {"in": ["d1"]})[0]}
    assert base not in others and len(others) == 4


def test_code_digest_covers_the_project_modules_a_stage_imports(monkeypatch):
    import inspect

    from pipeline import registry

    mix = registry.resolve("mix")
    assert {"data.mix", "data.tokenizer", "data.documents", "pipeline.stage"} <= set(registry.code_modules(mix))
    before = registry.code_digest(mix)
    ingest = registry.resolve("ingest")
    ingest_before = registry.code_digest(ingest)
    real = inspect.getsource

    def edited(obj):  # simulate an edit of a module mix imports, not of mix itself
        src = real(obj)
        return src + "\n# edited\n" if getattr(obj, "__name__", "") == "data.documents" else src

    monkeypatch.setattr(registry.inspect, "getsource", edited)
    assert registry.code_digest(mix) != before
    assert registry.code_digest(ingest) != ingest_before  # every stage importing the edited module
