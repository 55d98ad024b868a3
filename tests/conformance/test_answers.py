"""The oracle's answers cache (answers.py): an unchanged item is read, not asked again; a change to
the item, the oracle script, the release's vLLM files or the oracle's venv asks again exactly what
it must; an entry that does not verify is asked again and replaced; writes are whole or absent.
Run with a stand-in oracle on this Python (it counts what it is asked), no vLLM needed."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.conformance import answers as cache
from tests.conformance import coverage

ORACLE = """
import argparse, json, os, sys
ap = argparse.ArgumentParser()
ap.add_argument("--input")
ap.add_argument("--output")
args = ap.parse_args()
items = json.load(open(args.input))["specs"]
with open(os.environ["ASKED"], "a") as asked:
    asked.writelines(item["name"] + "\\n" for item in items)
version = os.path.basename(os.environ["PYTHONPATH"])
results = [{"name": item["name"], "double": 2 * item["x"]} for item in items]
json.dump({"vllm_version": version, "results": results}, open(args.output, "w"))
"""


@pytest.fixture
def oracle(tmp_path, monkeypatch):
    """A stand-in oracle folder (venv on this Python, one release's vLLM file) and script."""
    root = tmp_path / "oracle"
    (root / "venv" / "bin").mkdir(parents=True)
    (root / "venv" / "bin" / "python").symlink_to(sys.executable)
    (root / "venv" / ".oracle-venv-ok").write_text("reqs-1\n")
    (root / "venv" / "pyvenv.cfg").write_text("version = 3.11\n")
    (root / "src" / "9.9.9" / "vllm").mkdir(parents=True)
    (root / "src" / "9.9.9" / "vllm" / "__init__.py").write_text("__version__ = '9.9.9'\n")
    script = tmp_path / "oracle.py"
    script.write_text(ORACLE)
    monkeypatch.setenv("ASKED", str(tmp_path / "asked"))
    monkeypatch.setattr(coverage, "_ANSWERS", coverage.Counter())  # not this run's conformance answers
    cache.release_identity.cache_clear()
    yield root, script
    cache.release_identity.cache_clear()


def _ask(oracle, items):
    root, script = oracle
    asked = Path(os.environ["ASKED"])
    before = asked.read_text().splitlines() if asked.exists() else []
    got = cache.answers(script, "9.9.9", items, list_key="specs", oracle_dir=root, timeout=60)
    now = asked.read_text().splitlines() if asked.exists() else []
    return got, now[len(before) :]


ITEMS = [{"name": "a", "x": 1}, {"name": "b", "x": 2}, {"name": "c", "x": 3}]


def test_an_unchanged_item_is_read_and_a_changed_one_asked_again(oracle):
    got, asked = _ask(oracle, ITEMS)
    assert asked == ["a", "b", "c"] and got["b"] == {"name": "b", "double": 4}
    again, asked = _ask(oracle, ITEMS)
    assert asked == [] and again == got
    changed, asked = _ask(oracle, [ITEMS[0], {"name": "b", "x": 5}, ITEMS[2]])
    assert asked == ["b"] and changed["b"]["double"] == 10 and changed["a"] == got["a"]


@pytest.mark.parametrize("change", ["oracle script", "vLLM file", "new vLLM file", "venv"])
def test_a_change_to_what_answers_are_computed_from_asks_every_item_again(oracle, change):
    root, script = oracle
    _ask(oracle, ITEMS)
    if change == "oracle script":
        script.write_text(ORACLE + "# changed\n")
    elif change == "vLLM file":
        (root / "src" / "9.9.9" / "vllm" / "__init__.py").write_text("__version__ = '9.9.9'  # patched\n")
    elif change == "new vLLM file":
        (root / "src" / "9.9.9" / "vllm" / "config.py").write_text("")
    else:
        (root / "venv" / ".oracle-venv-ok").write_text("reqs-2\n")
    cache.release_identity.cache_clear()  # a new test run
    _, asked = _ask(oracle, ITEMS)
    assert asked == ["a", "b", "c"]


def _entries(root: Path) -> list[Path]:
    return sorted((root / "answers" / "9.9.9").iterdir())


@pytest.mark.parametrize("damage", ["truncated", "result edited", "hash edited", "other key", "not json", "empty"])
def test_an_entry_that_does_not_verify_is_asked_again_and_replaced(oracle, damage):
    root, _ = oracle
    got, _ = _ask(oracle, ITEMS[:1])
    (entry,) = [p for p in _entries(root) if p.name != ".lock"]
    data = entry.read_bytes()
    if damage == "truncated":
        entry.write_bytes(data[:-7])
    elif damage == "result edited":
        entry.write_bytes(data.replace(b'"double":2', b'"double":3'))
    elif damage == "hash edited":
        doc = json.loads(data)
        doc["result_sha256"] = "0" * 64
        entry.write_text(json.dumps(doc))
    elif damage == "other key":
        doc = json.loads(data)
        doc["key"] = "f" * 64
        entry.write_text(json.dumps(doc))
    elif damage == "not json":
        entry.write_bytes(b"\xff\xfe")
    else:
        entry.write_bytes(b"")
    assert entry.read_bytes() != data
    again, asked = _ask(oracle, ITEMS[:1])
    assert asked == ["a"] and again == got
    assert entry.read_bytes() == data  # replaced by the verified answer


def test_entries_are_0644_and_no_temporary_file_is_left(oracle):
    root, _ = oracle
    _ask(oracle, ITEMS)
    entries = [p for p in _entries(root) if p.name != ".lock"]
    assert len(entries) == 3 and all(p.suffix == ".json" and not p.name.startswith(".") for p in entries)
    assert {oct(p.stat().st_mode & 0o777) for p in entries} == {"0o644"}


def test_a_failed_write_leaves_nothing(tmp_path, monkeypatch):
    def fail(*args):
        raise OSError("disk full")

    monkeypatch.setattr(cache.os, "replace", fail)
    with pytest.raises(OSError, match="disk full"):
        cache.write_answer(tmp_path / "k.json", "k", {"name": "a"})
    assert list(tmp_path.iterdir()) == []


RESULT = {"name": "spec@0.33.0", "descriptors": [["FULL", 8, 8, 1, None, 0]], "dispatch": [[1, 2], "eager"]}


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_a_damaged_entry_is_never_read_as_another_answer(tmp_path_factory, data):
    """Any bytes in place of an entry, or a valid entry with bytes changed, cut or added: the
    reader answers None or exactly the answer written, and never raises."""
    folder = tmp_path_factory.mktemp("entry")
    path = folder / "k.json"
    cache.write_answer(path, "k" * 64, RESULT)
    valid = path.read_bytes()
    raw = data.draw(
        st.one_of(
            st.binary(max_size=300),
            st.tuples(st.integers(0, len(valid) - 1), st.integers(0, 255)).map(
                lambda edit: valid[: edit[0]] + bytes([edit[1]]) + valid[edit[0] + 1 :]
            ),
            st.integers(0, len(valid)).map(lambda cut: valid[:cut]),
            st.tuples(st.integers(0, len(valid)), st.binary(min_size=1, max_size=8)).map(
                lambda ins: valid[: ins[0]] + ins[1] + valid[ins[0] :]
            ),
        )
    )
    path.write_bytes(raw)
    assert cache.read_answer(path, "k" * 64) in (None, RESULT)
