"""Regenerates tests/data/conformance/cel_library.json: every expression of the CEL library
tests of k8s.io/apiserver (pkg/cel/library: quantity, semver, format, lists, cost tests;
the release in go.mod), with the answer of the real CEL environment (this directory's
oracle, op "value"). Run from the repository root:

    (cd hack/allocator-oracle && go build -o /tmp/allocator-oracle .)
    python3 hack/allocator-oracle/cel_cases.py /tmp/allocator-oracle

Only the expressions and the oracle's answers are kept (facts), not upstream's code.
"""

import json
import re
import subprocess
import sys
from pathlib import Path

FILES = ["quantity_test.go", "semver_test.go", "format_test.go", "lists_test.go", "cost_test.go",
         "regex_test.go", "ip_test.go", "cidr_test.go"]
_GO_STRING = r'(`[^`]*`|"(?:[^"\\]|\\.)*")'


def go_string(token: str) -> str:
    return token[1:-1] if token.startswith("`") else json.loads(token)


def main(oracle: str) -> None:
    version = re.search(r"k8s.io/apiserver (v\S+)", Path("hack/allocator-oracle/go.mod").read_text()).group(1)
    gomodcache = subprocess.run(["go", "env", "GOMODCACHE"], capture_output=True, text=True).stdout.strip()
    library = Path(gomodcache) / f"k8s.io/apiserver@{version}/pkg/cel/library"
    cases, seen = [], set()
    for name in FILES:
        path = library / name
        if not path.exists():
            continue
        text = path.read_text()
        for match in re.finditer(r"\bexpr(?:ession)?:\s*" + _GO_STRING, text):
            expression = go_string(match.group(1))
            if expression in seen or "%" in expression and "fmt.Sprintf" in text[match.start() - 80:match.start()]:
                continue
            seen.add(expression)
            cases.append({"source": f"k8s.io/apiserver@{version} pkg/cel/library/{name}", "expression": expression})
    requests = "".join(json.dumps({"op": "value", "expression": c["expression"]}) + "\n" for c in cases)
    answers = subprocess.run([oracle], input=requests, capture_output=True, text=True, check=True).stdout.splitlines()
    for case, line in zip(cases, answers):
        answer = json.loads(line)
        if "value" in answer:
            case["value"] = answer["value"]["v"]
        else:
            case["error"] = answer.get("compileError") or answer.get("error")
    out = Path("tests/data/conformance/cel_library.json")
    out.write_text(json.dumps(cases, indent=1) + "\n")
    print(f"{len(cases)} cases -> {out}")


if __name__ == "__main__":
    main(sys.argv[1])
