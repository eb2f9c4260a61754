"""Artifact integrity: lookups re-hash, corrupt artifacts are quarantined and rebuilt, commits are durable,
cache keys do not depend on where the checkout lives, `hylight verify`, and a full disk during a write.

No Ray here: stages run in-process through the runner (pipeline.runner.execute_stage), artifacts are written
by the real ArtifactStore. The orchestrator's side (a corrupt artifact is rebuilt in a real run, `hylight
verify SPEC`) is in tests/test_orchestrator.py.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline import cli
from pipeline.artifacts import QUARANTINE_DIR, ArtifactStore, ArtifactWriteError, check_artifact, publish_dir
from pipeline.runner import StageTask, execute_stage
from pipeline.stage import CHECKOUT_ROOT, MANIFEST_NAME, file_fingerprint

REPO = Path(__file__).resolve().parent.parent
KEY = "ab" * 32


def _commit(store: ArtifactStore, files: dict[str, bytes], kind: str = "test_source", key: str = KEY):
    tmp = store.begin(kind, key)
    for name, data in files.items():
        (tmp / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp / name).write_bytes(data)
    return store.commit(tmp, type_="text", schema_version=1, kind=kind, key=key, meta={"stage": "a"})


def _flip_one_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


# --- lookup re-hashes -----------------------------------------------------------------------------
def test_same_size_corruption_is_a_miss_reported_and_quarantined_not_deleted(tmp_path):
    store = ArtifactStore(tmp_path)
    art = _commit(store, {"text.txt": b"hello world" * 100, "sub/other.bin": b"\x00" * 10})
    assert store.lookup("test_source", KEY).digest == art.digest  # intact: a hit
    _flip_one_byte(art.path / "text.txt")
    assert (art.path / "text.txt").stat().st_size == 1100  # same size: the old size check accepted this

    said: list[str] = []
    assert store.lookup("test_source", KEY, on_reject=said.append) is None
    assert not art.path.exists()  # a miss: the stage reruns and commits afresh
    [msg] = said
    assert "failed verification (changed: text.txt)" in msg and "the stage will be rebuilt" in msg
    [moved] = (tmp_path / QUARANTINE_DIR / "test_source").iterdir()
    assert f"moved to {moved}" in msg
    # kept for inspection, byte for byte, and the reason is logged on disk
    assert (moved / "text.txt").read_bytes() != b"hello world" * 100
    assert (moved / "sub/other.bin").read_bytes() == b"\x00" * 10
    [entry] = [json.loads(line) for line in (tmp_path / QUARANTINE_DIR / "quarantine.log").read_text().splitlines()]
    assert entry["changed"] == ["text.txt"] and entry["to"] == str(moved) and entry["cache_key"] == KEY
    # the next lookup is a plain miss; the rebuilt artifact is a hit
    said.clear()
    assert store.lookup("test_source", KEY, on_reject=said.append) is None and said == []
    rebuilt = _commit(store, {"text.txt": b"hello world" * 100, "sub/other.bin": b"\x00" * 10})
    assert store.lookup("test_source", KEY).digest == rebuilt.digest == art.digest


@pytest.mark.parametrize("damage, expect", [
    (lambda p: (p / "text.txt").unlink(), "missing: text.txt"),
    (lambda p: (p / "stray.txt").write_text("?"), "extra: stray.txt"),
    (lambda p: (p / "text.txt").write_bytes(b"short"), "changed: text.txt"),
    (lambda p: (p / MANIFEST_NAME).write_text((p / MANIFEST_NAME).read_text()[:40]), "manifest.json unreadable"),
    (lambda p: (p / MANIFEST_NAME).unlink(), "no manifest.json"),
], ids=["file deleted", "file added", "size changed", "manifest truncated", "manifest deleted"])
def test_every_kind_of_damage_is_a_miss_naming_what_changed(tmp_path, damage, expect):
    store = ArtifactStore(tmp_path)
    art = _commit(store, {"text.txt": b"abc" * 50, "sub/manifest.json": b"{}"})
    damage(art.path)
    said: list[str] = []
    assert store.lookup("test_source", KEY, on_reject=said.append) is None
    assert len(said) == 1 and expect in said[0]
    assert not art.path.exists() and len(list((tmp_path / QUARANTINE_DIR / "test_source").iterdir())) == 1


def _edit_manifest(path: Path, edit) -> None:  # noqa: ANN001
    m = json.loads((path / MANIFEST_NAME).read_text())
    edit(m)
    (path / MANIFEST_NAME).write_text(json.dumps(m, indent=2))


def _bump_digest(m: dict) -> None:
    m["digest"] = ("0" if m["digest"][0] != "0" else "1") + m["digest"][1:]


@pytest.mark.parametrize("edit, expect", [
    (_bump_digest, "edited after its commit"),
    (lambda m: m.update(summary={"loss": 0.1}), "edited after its commit"),
    (lambda m: m.update(rows=999), "edited after its commit"),
    (lambda m: (_bump_digest(m), m.update(manifest_sha256=__import__("pipeline.artifacts").artifacts.manifest_seal(m))),
     "is not its file list's"),
], ids=["digest", "summary", "rows", "digest with the seal recomputed"])
def test_an_edited_manifest_field_is_a_miss_and_fails_verify(tmp_path, capsys, edit, expect):
    """A one-character edit of the digest (or of the summary, or the row count) in manifest.json: the lookup refuses
    the artifact (the stage reruns, not a cache hit under a key built from the wrong digest) and `hylight verify`
    fails; the digest is also recomputed from the file list, so resealing an edited digest does not pass either."""
    store = ArtifactStore(tmp_path)
    art = _commit(store, {"text.txt": b"abc" * 50})
    assert check_artifact(art.path).ok
    _edit_manifest(art.path, edit)
    check = check_artifact(art.path)
    assert not check.ok and expect in check.describe()
    assert cli.main(["verify", "--root", str(tmp_path)]) != 0
    capsys.readouterr()
    said: list[str] = []
    assert store.lookup("test_source", KEY, on_reject=said.append) is None
    assert len(said) == 1 and expect in said[0]


def test_a_nested_file_named_manifest_json_is_part_of_the_artifact(tmp_path):
    store = ArtifactStore(tmp_path)
    art = _commit(store, {"model/manifest.json": b'{"a": 1}', "text.txt": b"t"})
    assert sorted(f["path"] for f in art.manifest["files"]) == ["model/manifest.json", "text.txt"]
    (art.path / "model/manifest.json").write_bytes(b'{"a": 2}')
    assert check_artifact(art.path).changed == ("model/manifest.json",)


def test_records_are_hashed_and_verified_but_left_out_of_the_digest(tmp_path):
    """A report that differs between two runs (its wall-clock fields) does not change the artifact's identity; the
    payload does; and a damaged record still fails the lookup's re-hash."""
    def commit(root: str, payload: bytes, report: bytes):
        store = ArtifactStore(tmp_path / root)
        tmp = store.begin("test_source", KEY)
        (tmp / "data.bin").write_bytes(payload)
        (tmp / "logs").mkdir()
        (tmp / "logs" / "report.json").write_bytes(report)
        (tmp / "plot.png").write_bytes(b"png" + report)
        art = store.commit(tmp, type_="text", schema_version=1, kind="test_source", key=KEY, meta={},
                           records=("logs/*.json", "*.png"))
        return store, art

    _, a = commit("a", b"weights", b'{"seconds": 1.5}')
    _, b = commit("b", b"weights", b'{"seconds": 2.25}')
    store, c = commit("c", b"weights!", b'{"seconds": 1.5}')
    assert a.digest == b.digest != c.digest
    flags = {f["path"]: f.get("record", False) for f in a.manifest["files"]}
    assert flags == {"data.bin": False, "logs/report.json": True, "plot.png": True}
    assert all(len(f["sha256"]) == 64 for f in a.manifest["files"])
    _flip_one_byte(c.path / "logs" / "report.json")
    said: list[str] = []
    assert store.lookup("test_source", KEY, on_reject=said.append) is None
    assert "changed: logs/report.json" in said[0]


def test_jsonl_gz_bytes_do_not_depend_on_the_file_name_or_time(tmp_path):
    """The gzip header holds neither the write time nor the file name: a file written under a temporary name and
    renamed (long_context's sample index) has the bytes of one written in place."""
    import time

    from data.documents import write_jsonl_gz

    rows = [{"i": i, "text": "x" * i} for i in range(50)]
    write_jsonl_gz(tmp_path / "a.jsonl.gz", rows)
    time.sleep(1.1)
    write_jsonl_gz(tmp_path / ".b.jsonl.gz.tmp-12345", rows)
    (tmp_path / ".b.jsonl.gz.tmp-12345").rename(tmp_path / "b.jsonl.gz")
    assert (tmp_path / "a.jsonl.gz").read_bytes() == (tmp_path / "b.jsonl.gz").read_bytes()


def test_dry_run_lookup_reports_but_leaves_the_artifact_in_place(tmp_path):
    store = ArtifactStore(tmp_path)
    art = _commit(store, {"text.txt": b"abcdef"})
    _flip_one_byte(art.path / "text.txt")
    said: list[str] = []
    assert store.lookup("test_source", KEY, on_reject=said.append, quarantine=False) is None
    assert "left in place" in said[0] and art.path.exists() and not (tmp_path / QUARANTINE_DIR).exists()


# --- durable commit -------------------------------------------------------------------------------
def test_commit_fsyncs_every_data_file_and_directory_before_the_manifest(tmp_path, monkeypatch):
    synced: list[str] = []
    real_fsync = os.fsync

    def recording_fsync(fd: int) -> None:
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", recording_fsync)
    store = ArtifactStore(tmp_path)
    tmp = store.begin("test_source", KEY)
    for name in ("a.txt", "d1/b.txt", "d1/d2/c.txt"):
        (tmp / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp / name).write_text(name)
    art = store.commit(tmp, type_="text", schema_version=1, kind="test_source", key=KEY, meta={})

    manifest_at = next(i for i, p in enumerate(synced) if Path(p).name.startswith(f".{MANIFEST_NAME}."))
    before = set(synced[:manifest_at])
    data = {str(tmp / n) for n in ("a.txt", "d1/b.txt", "d1/d2/c.txt")}
    dirs = {str(tmp), str(tmp / "d1"), str(tmp / "d1/d2")}
    assert data <= before and dirs <= before  # data and the directories naming it, then the manifest
    after = synced[manifest_at + 1:]
    assert str(tmp) in after  # the manifest's rename inside the temp dir
    assert after[-1] == str(art.path.parent)  # the rename into the store, last
    assert store.lookup("test_source", KEY) is not None


# --- cache keys do not depend on where the checkout lives -----------------------------------------
KEY_SCRIPT = """\
import json, sys
from pathlib import Path
import pipeline
assert Path(pipeline.__file__).resolve().is_relative_to(Path.cwd().resolve()), pipeline.__file__
from pipeline.orchestrator import stage_cache_key
from pipeline.spec import load_spec
from pipeline.stage import Artifact

def keys():
    spec = load_spec("spec.yaml", check_external=False)
    ups = {n: Artifact(Path("."), {"digest": "digest-of-" + n}) for n in spec.stages}
    return {n: stage_cache_key(st, ups)[0] for n, st in spec.stages.items()}

out = {"before": keys()}
if sys.argv[1:] == ["edit"]:
    ref = Path("data/quality_refs/helpfulness.txt")
    ref.write_text(ref.read_text() + "one more reference line\\n")
    out["after_ref_edit"] = keys()
print(json.dumps(out))
"""

KEY_SPEC = """\
name: keys
artifact_root: runs
stages:
  ingest:
    uses: ingest
    params: {{sample_corpus: true, paths: ["{external}"]}}
  quality:
    uses: quality
    needs: [ingest]
"""


@pytest.mark.slow
def test_cache_keys_are_the_same_in_two_checkouts_and_follow_file_content(tmp_path):
    external = tmp_path / "elsewhere" / "user.jsonl"
    external.parent.mkdir()
    external.write_text('{"text": "a user document of some length"}\n')
    keys = {}
    for name in ("one/hylight", "two/deeper/checkout"):
        co = tmp_path / name
        for pkg in ("pipeline", "data"):
            shutil.copytree(REPO / pkg, co / pkg, ignore=shutil.ignore_patterns("__pycache__"))
        (co / "spec.yaml").write_text(KEY_SPEC.format(external=external))
        edit = ["edit"] if name.startswith("two") else []
        out = subprocess.run([sys.executable, "-c", KEY_SCRIPT, *edit], cwd=co, capture_output=True, text=True,
                             env={**os.environ, "PYTHONPATH": "", "OMP_NUM_THREADS": "1"}, timeout=120)
        assert out.returncode == 0, out.stderr[-2000:]
        keys[name] = json.loads(out.stdout)
    one, two = keys["one/hylight"], keys["two/deeper/checkout"]
    assert one["before"] == two["before"]  # the same key wherever the checkout lives
    edited = two["after_ref_edit"]
    assert edited["quality"] != two["before"]["quality"]  # a reference passage changed: quality reruns
    assert edited["ingest"] == two["before"]["ingest"]


def test_file_fingerprint_names_checkout_files_by_relative_path_and_outside_files_by_name(tmp_path):
    ref = CHECKOUT_ROOT / "data" / "quality_refs" / "helpfulness.txt"
    fp = file_fingerprint(ref)
    assert fp["path"] == "data/quality_refs/helpfulness.txt" and "name" not in fp and len(fp["sha256"]) == 64
    a, b = tmp_path / "x" / "user.jsonl", tmp_path / "y" / "z" / "user.jsonl"
    for p in (a, b):
        p.parent.mkdir(parents=True)
        p.write_text("same content\n")
    assert file_fingerprint(a) == file_fingerprint(b)  # another directory, same name and content
    assert file_fingerprint(a) == {"name": "user.jsonl", "sha256": hashlib.sha256(b"same content\n").hexdigest()}
    b.write_text("other content\n")
    assert file_fingerprint(a) != file_fingerprint(b)
    big = file_fingerprint(a, hash_below_bytes=4)  # above the hashing limit: size + mtime, still no directory
    assert set(big) == {"name", "size", "mtime_ns"}


# --- hylight verify -------------------------------------------------------------------------------
def test_verify_without_spec_checks_every_artifact_under_the_root(tmp_path, capsys):
    store = ArtifactStore(tmp_path)
    good = _commit(store, {"text.txt": b"fine"}, key="11" * 32)
    bad = _commit(store, {"text.txt": b"bytes", "more.txt": b"m"}, key="22" * 32)
    assert cli.main(["verify", "--root", str(tmp_path)]) == 0
    assert "2 ok" in capsys.readouterr().out
    _flip_one_byte(bad.path / "text.txt")
    (bad.path / "more.txt").unlink()
    out_json = tmp_path / "verify.json"
    assert cli.main(["verify", "--root", str(tmp_path), "--json", str(out_json)]) == 1
    out = capsys.readouterr().out
    lines = {line.split()[2]: line for line in out.splitlines() if line.startswith(("ok ", "CHANGED "))}
    assert lines[str(good.path.relative_to(tmp_path))].startswith("ok ")
    assert "changed: text.txt; missing: more.txt" in lines[str(bad.path.relative_to(tmp_path))]
    assert "1 changed, 1 ok" in out
    report = {Path(a["path"]).name: a for a in json.loads(out_json.read_text())["artifacts"]}
    assert report[bad.path.name]["check"]["changed"] == ["text.txt"]
    assert report[bad.path.name]["check"]["missing"] == ["more.txt"]
    assert bad.path.exists()  # verify only reads


# --- a full disk during an artifact write ---------------------------------------------------------
def _task(root: Path, key: str, **params) -> StageTask:
    return StageTask(stage="blob", uses="tests.stage_fixtures:WRITER", params=params, resources={"cpus": 1},
                     inputs={}, root=str(root), key=key, key_material={}, cwd=str(REPO))


def _assert_nothing_accepted(root: Path, key: str) -> None:
    store = ArtifactStore(root)
    assert store.lookup("test_writer", key) is None
    assert not store.path_for("test_writer", key).exists()
    assert not [p for p in store.tmp.iterdir() if p.name.startswith("test_writer__")]  # cleaned, not left


FSIZE_SCRIPT = """\
import json, resource, signal, sys
from pathlib import Path
from tests.test_integrity import _task
from pipeline.runner import execute_stage

signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG instead of killing us
resource.setrlimit(resource.RLIMIT_FSIZE, (256 << 10, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
try:
    execute_stage(_task(Path(sys.argv[1]), sys.argv[2], size_bytes=1 << 20))
except Exception as e:
    print(json.dumps({"type": type(e).__name__, "errno": getattr(e, "errno", None), "message": str(e)}))
"""


@pytest.mark.slow
def test_file_size_limit_during_a_stage_write_leaves_no_artifact_and_says_so(tmp_path):
    key = "cd" * 32
    out = subprocess.run([sys.executable, "-c", FSIZE_SCRIPT, str(tmp_path), key], cwd=REPO, capture_output=True,
                         text=True, env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    err = json.loads(out.stdout)
    assert err["type"] == "ArtifactWriteError" and err["errno"] == errno.EFBIG
    msg = err["message"]
    assert "stage 'blob' could not write its artifact" in msg and "EFBIG" in msg
    assert "/big.bin" in msg and "RLIMIT_FSIZE" in msg and "262144 bytes" in msg
    assert "Nothing was committed" in msg
    _assert_nothing_accepted(tmp_path, key)


@pytest.fixture
def tiny_disk(tmp_path):
    """A real 1 MiB filesystem (tmpfs) to fill; needs root (CAP_SYS_ADMIN) to mount."""
    mnt = tmp_path / "disk"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root/CAP_SYS_ADMIN): {r.stderr.strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", str(mnt)], check=True)


@pytest.mark.parametrize("where", ["stage output", "manifest"])
def test_full_disk_during_an_artifact_write_leaves_no_artifact_and_says_so(tiny_disk, where):
    key = "ef" * 32
    params = {"size_bytes": 4 << 20} if where == "stage output" else {"size_bytes": 100 << 10, "fill_disk": True}
    with pytest.raises(ArtifactWriteError) as info:
        execute_stage(_task(tiny_disk, key, **params))
    e = info.value
    assert e.errno == errno.ENOSPC
    msg = str(e)
    assert "stage 'blob' could not write its artifact: no space left on device (ENOSPC)" in msg
    assert f"the filesystem holding {tiny_disk} has 0 bytes free" in msg
    if where == "stage output":
        assert "(the file it wrote last: " in msg and "/big.bin)" in msg
    else:  # the data fitted; writing the manifest (the last step of a commit) did not
        assert f"while writing {tiny_disk}/.tmp/test_writer__" in msg and msg.split(";")[0].endswith(
            f"/{MANIFEST_NAME}")
    _assert_nothing_accepted(tiny_disk, key)
    assert shutil.disk_usage(tiny_disk).used < (64 << 10)  # the partial output is gone, space is back
    # with space again, the same stage commits and is a hit
    execute_stage(_task(tiny_disk, key, size_bytes=10 << 10))
    assert ArtifactStore(tiny_disk).lookup("test_writer", key) is not None


def test_errors_that_are_not_a_full_disk_pass_through_unchanged(tmp_path):
    key = "34" * 32
    with pytest.raises(FileNotFoundError):  # not wrapped: the stage's own error reaches the user as it was
        execute_stage(_task(tmp_path, key, file="no/such/dir/x.bin"))
    _assert_nothing_accepted(tmp_path, key)


def test_a_report_write_that_fails_keeps_the_old_report_whole_and_names_it(tmp_path, monkeypatch):
    """Stage reports go through write_text_atomic (fsynced temp file, then rename): a failure at the fsync (a full
    disk shows up there on many filesystems) leaves the previous report as it was, no temp file, and the path named."""
    from pipeline import artifacts

    report = tmp_path / "report.json"
    artifacts.write_text_atomic(report, '{"old": 1}\n')
    assert report.read_text() == '{"old": 1}\n' and os.listdir(tmp_path) == ["report.json"]

    def full(fd):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(artifacts.os, "fsync", full)
    with pytest.raises(OSError, match="report.json"):
        artifacts.write_text_atomic(report, '{"new": 2}\n')
    assert report.read_text() == '{"old": 1}\n' and os.listdir(tmp_path) == ["report.json"]


def test_publish_dir_replaces_a_previous_attempt_whole(tmp_path: Path) -> None:
    """publish_dir moves the finished directory in one rename: the old contents are gone, nothing is left beside it,
    and with replace=False an existing destination is refused and left as it was."""
    dest = tmp_path / "model"
    dest.mkdir()
    (dest / "stale.bin").write_bytes(b"old")
    tmp = tmp_path / ".model.tmp"
    (tmp / "sub").mkdir(parents=True)
    (tmp / "weights.bin").write_bytes(b"new")
    (tmp / "sub" / "config.json").write_text("{}")
    publish_dir(tmp, dest)
    assert sorted(p.relative_to(dest).as_posix() for p in dest.rglob("*")) == ["sub", "sub/config.json", "weights.bin"]
    assert (dest / "weights.bin").read_bytes() == b"new"
    assert not tmp.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["model"]
    other = tmp_path / ".other.tmp"
    other.mkdir()
    (other / "x").write_text("x")
    with pytest.raises(FileExistsError):
        publish_dir(other, dest, replace=False)
    assert (dest / "weights.bin").read_bytes() == b"new" and (other / "x").exists()
