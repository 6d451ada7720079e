#!/usr/bin/env bash
# asv smoke run (CI): every benchmark once against the hotloop installed in the given
# interpreter. Fails if any benchmark fails, including the correctness checks in setup().
# Usage: bash asv_benchmarks/smoke.sh /path/to/python
set -euo pipefail
PY=${1:-python3}
cd "$(dirname "$0")/.."
"$PY" -m asv machine --yes --machine ci --config asv_benchmarks/asv.conf.json >/dev/null
out=$(mktemp)
"$PY" -m asv run --config asv_benchmarks/asv.conf.json --quick --show-stderr \
    -E "existing:$PY" --machine ci --set-commit-hash "$(git rev-parse HEAD)" 2>&1 | tee "$out"
# asv reports a failed benchmark as "failed" in its table; make that fatal too.
if grep -Eq '^\s*(\[[^]]*\]\s*)?.*\bfailed\b' "$out"; then
    echo "asv: a benchmark failed" >&2
    exit 1
fi
