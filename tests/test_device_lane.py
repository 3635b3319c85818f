"""The device lane's summary (scripts/device_summary.py) from real junit XML: a pytest run of a few made-up tests
(one passes, one fails, one errors, two skip for one reason) read back as the lane's counts, the skips by reason and
the failures by name; an interrupted lane is marked; lanes in parts keep the lane order."""

from __future__ import annotations

import importlib.util
import pathlib
import subprocess
import sys

REPO = pathlib.Path(__file__).resolve().parents[1]
SAMPLE = '''
import pytest

@pytest.fixture
def broken():
    raise RuntimeError("fixture broke")

def test_passes():
    assert True

def test_fails():
    assert 1 == 2, "one is not two"

def test_errors(broken):
    pass

@pytest.mark.parametrize("n", [1, 2])
def test_skips(n):
    pytest.skip("no chip here")
'''


def _summary_module():
    spec = importlib.util.spec_from_file_location("device_summary", REPO / "scripts" / "device_summary.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_summary_counts_each_lane_and_names_skips_and_failures(tmp_path):
    (tmp_path / "test_sample.py").write_text(SAMPLE)
    subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-o", "addopts=", "-q",
                    f"--junitxml={tmp_path / 'out' / 'host.xml'}", str(tmp_path / "test_sample.py")],
                   cwd=tmp_path, capture_output=True, timeout=120)
    (tmp_path / "out" / "chip-2of3.xml").write_bytes((tmp_path / "out" / "host.xml").read_bytes())  # a part
    text = _summary_module().summary(tmp_path / "out")
    lines = text.splitlines()
    assert lines[2] == "| chip-2of3 | 1 | 1 | 1 | 2 |" and lines[3] == "| host | 1 | 1 | 1 | 2 |"  # chip before host
    assert lines[4] == "| all | 2 | 2 | 2 | 4 |"
    assert "- 2 x (host) no chip here" in text and "- 2 x (chip-2of3) no chip here" in text
    assert "(host, failed) test_sample::test_fails: AssertionError: one is not two" in text
    assert "(host, error) test_sample::test_errors: failed on setup with \"RuntimeError: fixture broke\"" in text


def test_an_interrupted_lane_is_marked_and_a_missing_one_said(tmp_path):
    (tmp_path / "chip.xml").write_text(
        '<testsuites><testsuite><testcase classname="t" name="test_a"/><testcase classname="" name="">'
        '</testcase></testsuite></testsuites>')
    text = _summary_module().summary(tmp_path)
    assert "| chip (interrupted: not every test ran) | 1 | 0 | 0 | 0 |" in text
    assert _summary_module().summary(tmp_path / "nothing").startswith("no lane results")


def test_a_lane_goes_on_without_the_tests_that_passed_before(tmp_path):
    """`device_summary.py --passed XML` deselects exactly the tests that passed (a parametrized one included) in a
    later pytest run (`@file` arguments, as device_check.sh's SKIP_PASSED hands them over); the failed, erroring
    and skipped ones run again."""
    tests = tmp_path / "tests"
    tests.mkdir()
    (tests / "test_sample.py").write_text(SAMPLE + "\n@pytest.mark.parametrize('k', ['a', 'b'])\n"
                                                   "def test_passes_too(k):\n    assert k\n")
    run = lambda *args: subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-o", "addopts=",
                                        "-q", "-rA", *args], cwd=tmp_path, capture_output=True, text=True,
                                       timeout=120)
    run(f"--junitxml={tmp_path / 'first.xml'}", "tests/test_sample.py")
    args = _summary_module().passed_deselections([tmp_path / "first.xml", tmp_path / "missing.xml"], tmp_path)
    assert args == ["--deselect", "tests/test_sample.py::test_passes",
                    "--deselect", "tests/test_sample.py::test_passes_too[a]",
                    "--deselect", "tests/test_sample.py::test_passes_too[b]"]
    (tmp_path / "skip.txt").write_text("\n".join(args) + "\n")
    again = run("@skip.txt", "tests/test_sample.py")
    assert "3 deselected" in again.stdout and "PASSED" not in again.stdout, again.stdout[-2000:]
    assert "FAILED tests/test_sample.py::test_fails" in again.stdout
