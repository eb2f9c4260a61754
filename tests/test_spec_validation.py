"""Validation reports every problem at once, at the field's own line; external inputs are checked before
anything is created; resources across nodes are refused or checked against the cluster's nodes."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from pipeline.cli import EXIT_INVALID, main
from pipeline.spec import ClusterCapacity, NodeCapacity, SpecError, load_spec

FIVE_PROBLEMS = """\
name: t
artifact_root: {root}
stages:
  a:
    uses: tests.stage_fixtures:SOURCE
    params: {{text: "A"}}
    resources:
      cpus: -1
      gpuz: 1
  b:
    uses: tokenizr
  ab:
    uses: tests.stage_fixtures:CONCAT
    needs: [a, b]
    params:
      colour: red
  n:
    uses: tests.stage_fixtures:COUNT
    needs: [zz]
"""


def write(tmp_path: Path, text: str, name: str = "spec.yaml") -> Path:
    p = tmp_path / name
    p.write_text(textwrap.dedent(text).format(root=tmp_path / "runs", tmp=tmp_path))
    return p


def problems(path: Path, **kw) -> list[str]:
    with pytest.raises(SpecError) as e:
        load_spec(path, **kw)
    return e.value.problems


def test_negative_cpus_and_four_other_errors_are_all_reported_each_at_its_own_line(tmp_path):
    got = problems(write(tmp_path, FIVE_PROBLEMS))
    assert len(got) == 5, "\n".join(got)
    expect = [
        ("spec.yaml:8:", "stage 'a', field resources.cpus: Input should be greater than or equal to 0 (got -1)"),
        ("spec.yaml:9:", "stage 'a', field resources.gpuz: Extra inputs are not permitted"),
        ("spec.yaml:11:", "stage 'b', field uses: unknown stage kind 'tokenizr'; did you mean 'tokenizer'?"),
        ("spec.yaml:16:", "stage 'ab', field params.colour: Extra inputs are not permitted"),
        ("spec.yaml:19:", "stage 'n', field needs: no stage named 'zz'"),
    ]
    for where, what in expect:
        assert any(p.split("/")[-1].startswith(where) and what in p for p in got), (where, what, got)


def test_a_param_error_points_at_the_param_and_a_list_item_at_its_item(tmp_path):
    spec = """\
    name: t
    artifact_root: {root}
    stages:
      a:
        uses: tests.stage_fixtures:SOURCE
        params:
          text: A
          repeat: many
      e:
        uses: tests.stage_fixtures:ENV_PROBE
        params:
          names:
            - OK
            - [not, a, string]
    """
    got = problems(write(tmp_path, spec))
    assert any("spec.yaml:8: stage 'a', field params.repeat" in p for p in got), got
    assert any("spec.yaml:14: stage 'e', field params.names.1" in p for p in got), got


def test_a_value_set_on_the_command_line_names_the_override_not_a_line(tmp_path):
    path = write(tmp_path, FIVE_PROBLEMS.replace("cpus: -1", "cpus: 1").replace("      gpuz: 1\n", ""))
    got = problems(path, overrides=["a.resources.cpus=-3", "a.repeat=x"])
    assert any("(--set a.resources.cpus=-3): stage 'a', field resources.cpus" in p for p in got), got
    assert any("(--set a.repeat=x): stage 'a', field params.repeat" in p for p in got), got


MISSING_INPUT = """\
name: t
artifact_root: {root}
stages:
  f:
    uses: tests.stage_fixtures:CHECKED_FILE_SOURCE
    params:
      path: {tmp}/nope.txt
  n:
    uses: tests.stage_fixtures:COUNT
    needs: [f]
"""


def test_a_missing_input_file_is_a_spec_error_at_its_param_line(tmp_path):
    got = problems(write(tmp_path, MISSING_INPUT))
    assert got == [f"{tmp_path}/spec.yaml:7: stage 'f', field params.path: input file "
                   f"'{tmp_path}/nope.txt' does not exist"]
    (tmp_path / "nope.txt").write_text("here now")
    assert load_spec(write(tmp_path, MISSING_INPUT)).stages["f"].params.path.endswith("nope.txt")
    # commands that only read a spec's settings skip the check
    (tmp_path / "nope.txt").unlink()
    assert load_spec(write(tmp_path, MISSING_INPUT), check_external=False)


def test_cli_with_a_missing_input_exits_2_and_creates_nothing(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("HYLIGHT_STATE_DIR", str(tmp_path / "state"))
    path = write(tmp_path, MISSING_INPUT)
    assert main(["validate", str(path)]) == EXIT_INVALID
    assert main(["run", str(path)]) == EXIT_INVALID
    err = capsys.readouterr().err
    assert f"spec.yaml:7: stage 'f', field params.path: input file '{tmp_path}/nope.txt' does not exist" in err
    # no artifact store, no MLflow database or run, no last-run record
    assert not (tmp_path / "runs").exists() and not (tmp_path / "state").exists()


def test_a_validation_hook_that_raises_is_reported_not_a_crash(tmp_path, monkeypatch):
    import dataclasses

    from tests import stage_fixtures

    def broken(params):
        raise PermissionError("cannot list /secret")

    monkeypatch.setattr(stage_fixtures, "CHECKED_FILE_SOURCE",
                        dataclasses.replace(stage_fixtures.CHECKED_FILE_SOURCE, validate_external=broken))
    got = problems(write(tmp_path, MISSING_INPUT))
    assert got == [f"{tmp_path}/spec.yaml:6: stage 'f', field params: PermissionError: cannot list /secret"]


NODES = """\
name: t
artifact_root: {root}
stages:
  w:
    uses: tests.stage_fixtures:{kind}
    resources:
      cpus: 4
      gpus: 2
      nodes: {nodes}
"""


def nodes_spec(tmp_path: Path, kind: str, nodes: int) -> Path:
    return write(tmp_path, NODES.replace("{kind}", kind).replace("{nodes}", str(nodes)))


def cluster(*nodes: tuple[float, float]) -> ClusterCapacity:
    ns = [NodeCapacity(cpus=c, gpus=g, memory_gb=64) for c, g in nodes]
    return ClusterCapacity(cpus=max(n.cpus for n in ns), gpus=max(n.gpus for n in ns), memory_gb=64,
                           where="the test cluster", nodes=ns)


def test_a_stage_larger_than_one_node_needs_a_kind_that_launches_workers(tmp_path):
    got = problems(nodes_spec(tmp_path, "SOURCE", 2))
    assert len(got) == 1 and "spec.yaml:9: stage 'w', field resources.nodes: asks for 2 nodes but kind " \
        "'test_source' runs in one process on one node" in got[0]
    assert load_spec(nodes_spec(tmp_path, "WORKERS", 2)).stages["w"].resources.nodes == 2


def test_a_multi_node_stage_needs_that_many_nodes_that_each_fit(tmp_path):
    path = nodes_spec(tmp_path, "WORKERS", 2)
    load_spec(path, capacity=cluster((8, 2), (4, 4)))
    got = problems(path, capacity=cluster((8, 2), (8, 1), (2, 8)))  # each fits one resource, not both
    assert got == [f"{path}:9: stage 'w', field resources.nodes: asks for 2 node(s) with cpus=4 gpus=2 each "
                   "but only 1 of the 3 live node(s) of the test cluster have that much"]
    got = problems(path, capacity=cluster((8, 1)))
    assert "field resources.gpus: asks for 2 per node but the largest node of the test cluster has 1" in got[0]


def test_a_single_node_stage_needs_one_node_with_all_of_it(tmp_path):
    path = nodes_spec(tmp_path, "SOURCE", 1)
    load_spec(path, capacity=cluster((4, 2)))
    got = problems(path, capacity=cluster((8, 0), (1, 8)))  # the largest of each, but never together
    assert got == [f"{path}:7: stage 'w', field resources.cpus: asks for 1 node(s) with cpus=4 gpus=2 each "
                   "but only 0 of the 2 live node(s) of the test cluster have that much"]
