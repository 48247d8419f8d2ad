"""Sum the JUnit XML files of every pytest run under a folder into one closing line."""

import pathlib
import sys
import xml.etree.ElementTree as ET


def main(folder: str) -> int:
    passed = failed = skipped = 0
    files = sorted(pathlib.Path(folder).rglob("*.xml"))
    for path in files:
        for suite in ET.parse(path).getroot().iter("testsuite"):
            tests = int(suite.get("tests", 0))
            bad = int(suite.get("failures", 0)) + int(suite.get("errors", 0))
            skip = int(suite.get("skipped", 0))
            passed += tests - bad - skip
            failed += bad
            skipped += skip
    print(f"{len(files)} pytest runs")
    print(f"{passed} passed, {failed} failed, {skipped} skipped")
    return 1 if failed or not files else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
