#!/usr/bin/env bash
# One command on two trees of the repo, alternating on the same machine: the A/B of a change whose
# effect is smaller than the spread between machines (H100s differed by 10-20% in one day).
#   here:   bash scripts/tree_ab.sh prepare REV      # REV's files into ab/REV (git-ignored; carry "ab")
#   device: bash scripts/tree_ab.sh run REV ROUNDS -- COMMAND...   # COMMAND in . and ab/REV, ROUNDS times
# e.g. bash scripts/tree_ab.sh run 42b0ec8 2 -- python3 -m tandem.main bench --skip-tokenizer-init \
#        --preset qwen3-0.6b --num-prompts 1 --input-len 512 --output-len 256 --runs 3 --stream-mode stream
set -uo pipefail
mode=${1:?prepare or run}; rev=${2:?a git revision}
case $mode in
  prepare) git rev-parse --verify -q "$rev^{commit}" > /dev/null || { echo "$rev is not a commit here" >&2; exit 2; }
    rm -rf "ab/$rev" && mkdir -p "ab/$rev" && git archive "$rev" | tar -x -C "ab/$rev" && echo "ab/$rev ready: carry \"ab\"" ;;
  run) rounds=${3:?rounds}; shift 3; [[ ${1:-} == -- ]] && shift
    [ -d "ab/$rev" ] || { echo "ab/$rev is missing: run 'prepare $rev' on the machine that has git, and carry ab"; exit 2; }
    for i in $(seq "$rounds"); do
      for tree in . "ab/$rev"; do  # this tree first in every round: an order effect shows as a trend
        log=$(cd "$tree" && PYTHONPATH=".:${PYTHONPATH:-}" "$@" 2>&1); rc=$?
        out=$(grep -E "output tok/s|ITL median|roofline output|ready in" <<< "$log" | tr -s ' ' | tr '\n' ';')
        echo "round $i ${tree/#./this tree} (rc $rc): $out"
        [ "$rc" = 0 ] || tail -n 5 <<< "$log"
      done
    done ;;
  *) echo "usage: tree_ab.sh prepare REV | run REV ROUNDS -- COMMAND..." >&2; exit 2 ;;
esac
