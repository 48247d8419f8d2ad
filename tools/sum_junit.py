"""Sum the JUnit XML files of every pytest run under a folder into one closing line."""

import pathlib
import sys
import xml.etree.ElementTree as ET


def main(folder: str) -> int:
    passed = failed = skipped = 0
    names: list[str] = []  # the failed tests, run by run
    files = sorted(pathlib.Path(folder).rglob("*.xml"))
    for path in files:
        root = ET.parse(path).getroot()
        for suite in root.iter("testsuite"):
            tests = int(suite.get("tests", 0))
            bad = int(suite.get("failures", 0)) + int(suite.get("errors", 0))
            skip = int(suite.get("skipped", 0))
            passed += tests - bad - skip
            failed += bad
            skipped += skip
        for case in root.iter("testcase"):
            if case.find("failure") is not None or case.find("error") is not None:
                names.append(f"{path.parent.name}/{path.stem}: {case.get('classname')}::{case.get('name')}")
    print(f"{len(files)} pytest runs")
    print(f"{passed} passed, {failed} failed, {skipped} skipped")
    for name in names[:20]:
        print(f"failed: {name}")
    return 1 if failed or not files else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
