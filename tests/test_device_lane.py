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
