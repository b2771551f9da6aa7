# Sourced by the GPU check scripts: the wheels the GPU machine lacks, and `part NAME CMD...`, which
# runs CMD (if NAME is in $PARTS) with a time limit of $T seconds into $OUT/NAME.log and appends
# "NAME rc=... Ns" to $OUT/status.txt. Set OUT, PY and PARTS first.
mkdir -p "$OUT"
if compgen -G ".whl/*.whl" > /dev/null; then  # what the GPU machine lacks (xgrammar, gguf, ...)
    SITE=$(mktemp -d)
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$SITE" .whl/*.whl \
        && export PYTHONPATH="${PYTHONPATH:-}:$SITE"
fi
B=("$PY" -m tokenmill.entrypoints.cli bench)
part() {
    local name=$1; shift
    [[ " $PARTS " == *" $name "* ]] || return 0
    local t0=$(date +%s)
    timeout "${T:-170}" "$@" > "$OUT/$name.log" 2>&1
    echo "$name rc=$? $(( $(date +%s) - t0 ))s" | tee -a "$OUT/status.txt"
}
