#!/usr/bin/env bash
# Carries upstream's structured-allocator test scenarios over as data
# (tests/data/upstream_allocator_scenarios.json): runs upstream's shared allocator tests of
# k8s.io/dynamic-resource-allocation (the release hack/allocator-oracle/go.mod pins) with
# record_test.go.in beside them, which writes each scenario's inputs and the allocator's
# answer; only scenarios whose upstream assertions passed are kept (extract.py).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/../../.." && pwd)
version=$(awk '$1 == "k8s.io/dynamic-resource-allocation" {print $2; exit}' "$here/../go.mod")
module=$(go env GOMODCACHE)/k8s.io/dynamic-resource-allocation@$version
[ -d "$module" ] || (cd "$here/.." && go mod download k8s.io/dynamic-resource-allocation)
scratch=$(mktemp -d /tmp/dra-upstream-scenarios.XXXXXX)
trap 'chmod -R u+w "$scratch"; rm -rf "$scratch"' EXIT
cp -r "$module" "$scratch/module"
chmod -R u+w "$scratch/module"
cp "$here/record_test.go.in" "$scratch/module/structured/internal/experimental/zz_record_test.go"
mkdir "$scratch/out"
(cd "$scratch/module" && RECORD_DIR="$scratch/out" GOFLAGS=-mod=mod go test -tags record -count=1 \
  -run '^TestRecordScenarios$' -json ./structured/internal/experimental/ > "$scratch/test.json") || true
python3 "$here/extract.py" "$scratch/test.json" "$scratch/out" "$version" \
  > "$repo/tests/data/upstream_allocator_scenarios.json"
echo "wrote $repo/tests/data/upstream_allocator_scenarios.json" >&2
