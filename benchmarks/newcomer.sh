#!/usr/bin/env bash
# A newcomer's first hour, timed: a fresh clone, the README's set-up line, its quick start as written, one model of
# each kind (the click models of the quick start; Caser on next-item sequences), a report, an export, and a run
# killed partway then resumed (from its newest checkpoint: 40 or 60, as the background write of 60 got on). Each step's seconds go to a table and WORK/times.tsv (docs/performance.md quotes them).
#
#     bash benchmarks/newcomer.sh [WORK_DIR]        (default: a new temporary directory; pip needs the package
#                                                    index, or its cache, or PIP_FIND_LINKS with the wheels)
#
# The clone is of this checkout's committed HEAD (what a user gets from the branch). Stops at the first step that
# fails, printing the end of its log.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
WORK=${1:-$(mktemp -d -t newcomer.XXXXXX)}
mkdir -p "$WORK/logs"
WORK=$(cd "$WORK" && pwd)
TIMES="$WORK/times.tsv"
: > "$TIMES"

step() {  # step NAME COMMAND...: run from the clone, output in logs/NAME.log, seconds in the table
    local name=$1 start end
    shift
    start=$(date +%s%N)
    if ! (cd "$WORK/bagpipe" && "$@") > "$WORK/logs/$name.log" 2>&1; then
        echo "FAILED: $name ($*); the end of $WORK/logs/$name.log:" >&2
        tail -n 30 "$WORK/logs/$name.log" >&2
        exit 1
    fi
    end=$(date +%s%N)
    printf '%-22s %7.1f s\n' "$name" "$(( (end - start) / 1000000 ))e-3" | tee -a "$TIMES"
}

killed_at_60() {  # a run that a fault kills at iteration 60 (SIGKILL: nothing of it cleans up), as a crash would
    if BAGPIPE_FAULTS="reference@iteration 60:kill" bagpipe train --data data --run-dir runs/killed \
        --iterations 150 --checkpoint-every 20; then
        echo "the run was not killed" && return 1
    fi
}

echo "work dir: $WORK"
rm -rf "$WORK/bagpipe"
git clone -q "$ROOT" "$WORK/bagpipe"
install_line=$(grep -m1 -o 'make \.venv/bin/bagpipe[^`]*' "$WORK/bagpipe/README.md")
step setup bash -c "${install_line%% && source*}"  # the README's install line (a script's PATH does `source`)
export PATH="$WORK/bagpipe/.venv/bin:$PATH"
python3 - "$WORK/bagpipe/README.md" > "$WORK/quick_start.txt" <<'PY'
import sys  # the README's first code block: the quick start, one command a line, comments dropped
block = open(sys.argv[1]).read().split("```\n", 2)[1]
print("\n".join(line.split("#")[0].strip() for line in block.splitlines() if line.strip()))
PY
n=0
while read -r command; do
    n=$((n + 1))
    step "quick-start-$n" bash -c "$command" < /dev/null
done < "$WORK/quick_start.txt"
grep -q "eval AUC" "$WORK/logs/quick-start-2.log"
step synth-sequences bagpipe synth --kind sequences --out seq
step caser bagpipe train --data seq --model caser --run-dir runs/caser
grep -q "eval HR@10" "$WORK/logs/caser.log"
python3 - "$WORK/bagpipe/runs/caser/summary.json" <<'PY'
import json, sys  # the model a default Caser run delivers (model/: the one best on validation) beats both baselines
summary = json.load(open(sys.argv[1]))
delivered = summary["best_metrics"] if summary.get("keep_best") and summary.get("best_metrics") else summary
hr, baselines = delivered["eval_hr10"], {name: summary[f"eval_{name}_hr10"] for name in ("popular", "cooccurrence")}
print(f"Caser's delivered model: HR@10 {hr:.4f}; baselines {baselines}")
sys.exit(0 if all(hr > value for value in baselines.values()) else "Caser at its defaults does not beat the baselines")
PY
step report bagpipe report runs/caser runs/dlrm
step export bagpipe export --run-dir runs/dlrm --out dlrm.pt
step killed killed_at_60  # (its checkpoint of iteration 60 may still be being written when it dies)
step resume bagpipe train --run-dir runs/killed --resume
grep -Eq "resumed at iteration (40|60)" "$WORK/logs/resume.log"
awk '{ total += $2 } END { printf "%-22s %7.1f s\n", "total", total }' "$TIMES" | tee -a "$TIMES"
