#!/usr/bin/env bash
# Runs every Go fuzz target of the module, one after the other, for
# FUZZTIME each (default 60s) or FUZZEXECS executions each, and prints a
# table of executions and findings. FUZZTARGETS narrows the run to the
# named targets. A crasher is written by Go under the package's
# testdata/fuzz/<Target>/; commit it as a seed once fixed.
#
#   FUZZTIME=10m scripts/fuzz.sh            # every target
#   FUZZTIME=30s scripts/fuzz.sh ./core/... # targets under a pattern
#   FUZZEXECS=10000000 FUZZTARGETS="FuzzRelay FuzzDecodeDump" scripts/fuzz.sh
set -uo pipefail
cd "$(dirname "$0")/.."

fuzztime="${FUZZTIME:-60s}"
if [ -n "${FUZZEXECS:-}" ]; then
	fuzztime="${FUZZEXECS}x"
fi
wanted=" ${FUZZTARGETS:-} "
patterns=("${@:-./...}")
log_dir="$(mktemp -d)"
summary=()
status=0

for pkg in $(go list "${patterns[@]}"); do
	targets=$(go test -list '^Fuzz' "$pkg" 2>/dev/null | grep '^Fuzz' || true)
	for target in $targets; do
		if [ "$wanted" != "  " ] && [[ "$wanted" != *" $target "* ]]; then
			continue
		fi
		log="$log_dir/$(echo "$pkg" | tr / _)_$target.log"
		echo "== $pkg $target ($fuzztime)" >&2
		if go test -run '^$' -fuzz "^${target}\$" -fuzztime "$fuzztime" "$pkg" >"$log" 2>&1; then
			result=ok
		else
			result=FAILED
			status=1
			tail -n 30 "$log" >&2
		fi
		# The last progress line carries the total, e.g. "execs: 1234567".
		execs=$(grep -o 'execs: [0-9]*' "$log" | tail -n 1 | awk '{print $2}')
		# A run of few executions ends before Go's first progress line.
		if [ -z "$execs" ] && [ "$result" = ok ]; then
			execs="${FUZZEXECS:-}"
		fi
		summary+=("$(printf '%-45s %-22s %12s %s' "$pkg" "$target" "${execs:-?}" "$result")")
	done
done

printf '\n%-45s %-22s %12s %s\n' package target executions result
printf '%s\n' "${summary[@]}"
echo "logs: $log_dir" >&2
exit $status
