#!/usr/bin/env bash
# Pin the image's runtime dependencies (pyproject [project.dependencies], transitively)
# into requirements.lock, resolved by pip for the current Python.
set -euo pipefail
cd "$(dirname "$0")/.."
report=$(mktemp)
trap 'rm -f "$report"' EXIT
python3 -m pip install --dry-run --ignore-installed --quiet --report "$report" .
python3 - "$report" <<'PY'
import json, sys
report = json.load(open(sys.argv[1]))
pins = sorted(f'{i["metadata"]["name"]}=={i["metadata"]["version"]}'
              for i in report["install"] if i["metadata"]["name"] != "dra-accel-driver")
with open("requirements.lock", "w") as f:
    f.write("# Runtime dependencies of the container image, pinned exactly (pip install --no-deps).\n")
    f.write("# Regenerate: hack/lock-requirements.sh\n")
    f.write("\n".join(pins) + "\n")
print(f"requirements.lock: {len(pins)} packages")
PY
