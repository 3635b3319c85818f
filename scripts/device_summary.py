"""The device lane's summary (scripts/device_check.sh): from each lane's junit XML in a folder, a Markdown table of
passed / failed / errors / skipped per lane, the skips grouped by reason, and each failure or error with the first
line of its message.

    python scripts/device_summary.py OUT      (prints the Markdown; device_check.sh writes it to OUT/summary.md)
    python scripts/device_summary.py --passed A.xml [B.xml ...]
                                              (prints `--deselect NODEID` for each test that passed in them: a lane
                                              cut short in one session goes on in the next without repeating them)
"""

from __future__ import annotations

import collections
import pathlib
import sys
import xml.etree.ElementTree as ET

LANES = ("chip", "host", "e2e")  # their order in the table; a chip lane in parts is chip-1of3, ...


def lane_results(path: pathlib.Path) -> dict[str, list]:
    """{"passed", "failed", "error", "skipped": [(test id, message)], "interrupted": one entry when the run was
    cut short} of one junit XML file."""
    out: dict[str, list] = {"passed": [], "failed": [], "error": [], "skipped": [], "interrupted": []}
    for case in ET.parse(path).getroot().iter("testcase"):
        if not case.get("name"):  # the entry pytest writes for a run interrupted (SIGINT at LANE_TIMEOUT)
            out["interrupted"].append(("", []))
            continue
        test = f"{case.get('classname', '')}::{case.get('name', '')}"
        for kind, tag in (("failed", "failure"), ("error", "error"), ("skipped", "skipped")):
            node = case.find(tag)
            if node is not None:
                out[kind].append((test, (node.get("message") or node.text or "").strip().splitlines()[:1]))
                break
        else:
            out["passed"].append((test, []))
    return out


def summary(folder: pathlib.Path) -> str:
    """The Markdown summary of the lanes whose XML is in `folder`."""
    found = sorted(((path.stem, path) for path in folder.glob("*.xml")),
                   key=lambda lp: (next((i for i, lane in enumerate(LANES) if lp[0].startswith(lane)), 9), lp[0]))
    if not found:
        return f"no lane results (chip.xml, host.xml, e2e.xml) in {folder}\n"
    lines = ["| lane | passed | failed | errors | skipped |", "|---|---:|---:|---:|---:|"]
    totals = collections.Counter()
    results = {}
    for lane, path in found:
        try:
            r = results[lane] = lane_results(path)
        except ET.ParseError as err:
            lines.append(f"| {lane} | (unreadable: {err}) | | | |")
            continue
        counts = {k: len(v) for k, v in r.items()}
        totals.update(counts)
        name = f"{lane} (interrupted: not every test ran)" if counts["interrupted"] else lane
        lines.append(f"| {name} | {counts['passed']} | {counts['failed']} | {counts['error']} | {counts['skipped']} |")
    lines.append(f"| all | {totals['passed']} | {totals['failed']} | {totals['error']} | {totals['skipped']} |")
    reasons = collections.Counter(
        (lane, msg[0] if msg else "") for lane, r in results.items() for _, msg in r["skipped"])
    if reasons:
        lines += ["", "Skips by reason:", ""]
        lines += [f"- {n} x ({lane}) {reason}" for (lane, reason), n in reasons.most_common()]
    bad = [(lane, kind, test, msg) for lane, r in results.items() for kind in ("failed", "error")
           for test, msg in r[kind]]
    if bad:
        lines += ["", "Failures and errors:", ""]
        lines += [f"- ({lane}, {kind}) {test}: {msg[0][:300] if msg else ''}" for lane, kind, test, msg in bad]
    return "\n".join(lines) + "\n"


def node_id(classname: str, name: str, root: pathlib.Path) -> str | None:
    """pytest's node id of a junit test case ("tests.model_worker.test_x" [".TestClass"], "test_y[p]" ->
    "tests/model_worker/test_x.py[::TestClass]::test_y[p]"), or None when no module file under `root` matches."""
    parts = classname.split(".")
    for i in range(len(parts), 0, -1):
        path = root.joinpath(*parts[:i]).with_suffix(".py")
        if path.is_file():
            return "::".join([path.relative_to(root).as_posix(), *parts[i:], name])
    return None


def passed_deselections(paths: list[pathlib.Path], root: pathlib.Path) -> list[str]:
    """`--deselect NODEID` arguments for the tests that passed in the junit XML files `paths` (unreadable files
    are skipped)."""
    args: list[str] = []
    for path in paths:
        try:
            cases = ET.parse(path).getroot().iter("testcase")
        except (ET.ParseError, OSError):
            continue
        for case in cases:
            if case.get("name") and not any(case.find(t) is not None for t in ("failure", "error", "skipped")):
                node = node_id(case.get("classname", ""), case.get("name", ""), root)
                if node is not None and node not in args:
                    args += ["--deselect", node]
    return args


if __name__ == "__main__":
    if sys.argv[1:2] == ["--passed"]:
        print("\n".join(passed_deselections([pathlib.Path(p) for p in sys.argv[2:]], pathlib.Path.cwd())))
    else:
        print(summary(pathlib.Path(sys.argv[1] if len(sys.argv) > 1 else ".device/results")), end="")
