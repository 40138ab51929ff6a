#!/usr/bin/env bash
# paged bench on two versions of the sources, alternately, each run with an empty Triton cache:
#   bash scripts/bench_ab.sh OTHER_DIR ROUNDS [paged bench options...]
# OTHER_DIR holds another version's core/, conformance/, bench/ and plugins/, e.g. main's:
#   git archive main core conformance bench plugins | tar -x -C /tmp/main
# Its runs put its src/ folders first on PYTHONPATH, so one environment where this checkout is
# installed (editable, scripts/gpu/gpu_install.sh) runs both. Rounds alternate other, this, other,
# this...; an empty Triton cache per run means each tunes its own configs, as a new process on a
# new machine would (the spread between rounds of one version is the noise to compare against).
# Writes $OUT/ab-{other,this}-N.{txt,json} and prints ms per row, one column per run.
# Example: bash scripts/bench_ab.sh /tmp/main 2 --backend triton-unified --cases sweep --no-baselines
set -uo pipefail
other=$(cd "$1" && pwd); rounds=$2; shift 2
OUT=${OUT:-/tmp/paged-out}; mkdir -p "$OUT"
other_path=$(printf '%s:' "$other"/core/src "$other"/conformance/src "$other"/bench/src "$other"/plugins/*/src)
for n in $(seq 1 "$rounds"); do
  for version in other this; do
    cache=$(mktemp -d)
    if [ "$version" = other ]; then path=$other_path${PYTHONPATH:-}; else path=${PYTHONPATH:-}; fi
    PYTHONPATH=$path TRITON_CACHE_DIR=$cache python3 -c \
      "import paged_triton_unified as m; print('$version', m.__file__)" >&2
    PYTHONPATH=$path TRITON_CACHE_DIR=$cache paged bench --json "$OUT/ab-$version-$n.json" "$@" \
      > "$OUT/ab-$version-$n.txt" 2> "$OUT/ab-$version-$n.err"
    echo "$version round $n: rc=$?" >&2
    rm -rf "$cache"
  done
done
python3 - "$OUT" "$rounds" <<'EOF'
import json, pathlib, sys
out, rounds = pathlib.Path(sys.argv[1]), int(sys.argv[2])
runs = [f"{v}-{n}" for n in range(1, rounds + 1) for v in ("other", "this")]
table = {}
for run in runs:
    path = out / f"ab-{run}.json"
    if not path.exists():
        continue
    for r in json.loads(path.read_text())["rows"]:
        key = (r["case"], r["shape"], r["label"])
        table.setdefault(key, {})[run] = (r["ms"], r.get("host_us")) if r["status"] == "ok" else (None, None)
print(f"{'case':14s} {'shape':14s} {'backend':24s} " + " ".join(f"{r:>16s}" for r in runs) + "   (ms / host us)")
for (case, shape, backend), cells in table.items():
    def cell(run):
        ms, host = cells.get(run, (None, None))
        return f"{ms:8.4f}/{host:6.1f}" if ms is not None and host is not None else (
            f"{ms:8.4f}/     -" if ms is not None else f"{'-':>15s}")
    print(f"{case:14s} {shape:14s} {backend:24s} " + " ".join(f"{cell(r):>16s}" for r in runs))
EOF
