#!/usr/bin/env bash
# The one command a GPU session runs: every GPU check of this repository, in steps that each fit
# one device command (10 minutes), with every output copied to $OUT.
#
# Steps (any number, in order: `bash benchmarks/gpu_all.sh STEP [STEP...]`):
#   fp16          benchmarks/gpu_decode.py --phase serve-fp16: random Llama-3-8B built on the GPU
#                 (unless the work dir already has it), served fp16 through `serve`
#   int4          --phase serve-int4: `quantize --method rtn --bits 4 --groupsize 128 --device cuda`
#                 (building first on a bare machine), served, then the fp16 vs int4 ratio table
#   decode-all    fp16 then int4 in one command (only when the model is already built: ~10 min)
#   tests         pytest: the CUDA tests (see select_cuda_tests below)
#   kernels       benchmarks/kernels_cuda.py, then benchmarks/attention_cuda.py, then kernel-choice
#   kernels-quick the first two with --quick, then kernel-choice
#   step-profile  benchmarks/gpu_step_profile.py on the quick step's fp16 model (built if missing), batches 1, 8
#                 and 64: each decode step's host wall against the device's own time (CUDA events), with launch
#                 ahead and without (engine/causal_lm.py), then the kernels a graph step launches, by device time
#                 (what the fused small kernels of kernels/fused_pointwise.py cut)
#   kernel-choice benchmarks/kernel_choice.py: what warmup's kernel timing chooses per decode batch size
#                 (triton-gemm or tinygemm) on the 1B shapes, the step time of each choice, and a second
#                 start that reads the choices from the kernel cache instead of timing
#   quick         one call of at most 9 minutes on a bare machine (the first call of a session):
#                 the CUDA tests that matter most (tests-quick, 150 s), a Llama-3.2-1B-shaped model
#                 built on the card, quantized to int4 and served fp16 then int4 (decode-quick, 200 s),
#                 then step-profile (60 s), kernels-quick (45 s each, kernel-choice 40 s if time is left); TGS_COMMAND_LIMIT_S
#                 defaults to 470 for it
#   tests-quick   the first of those alone (TGS_QUICK_TESTS: the test files or node ids to run instead)
#   decode-quick  the second alone (TGS_GPU_QUICK_ARGS replaces its gpu_decode.py flags;
#                 TGS_GPU_QUICK_DTYPE=bfloat16 serves both models in bfloat16, where warmup times the int4
#                 layers' two kernels: the servers' "kernels for" lines are copied into its log)
#   report        the ratio table from whatever results the work dir holds
#   prepare-wheels  NOT on the device: downloads the wheels the device lacks into .whl/ (below)
#
# 1. Before asking for the device (here, on the CPU machine, with network):
#      bash benchmarks/gpu_all.sh prepare-wheels
#    It runs, for NAME in loguru protobuf grpcio grpcio-health-checking grpcio-reflection typer click,
#    at the version installed in .venv (the versions the test suite passed with):
#      python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
#        -d .whl NAME==VERSION
#    Why these: the device (Python 3.12, torch, triton, transformers, tokenizers, safetensors, numpy,
#    typer, prometheus_client, pytest, hypothesis) has no loguru, grpcio-health-checking or
#    grpcio-reflection; our generated stubs need protobuf >= 7.35.1 and grpcio >= 1.85.1, which its
#    image does not promise (grpcio is carried although the device has one: its version is not
#    recorded, and a too-old one fails at import); typer and click are pinned to the tested pair.
#    .whl/ is git-ignored, so every device call names it in carry (about 8 MB).
#
# 2. Device commands, most important first; issue each right after the previous one returns (the
#    machine stays warm only 30 s, and the work dir in /tmp with the 16 GB model goes with it):
#      run(command="bash benchmarks/gpu_all.sh fp16",    carry=[".whl"], timeout_s=600)
#      run(command="bash benchmarks/gpu_all.sh int4",    carry=[".whl"], timeout_s=600)
#      run(command="bash benchmarks/gpu_all.sh tests",   carry=[".whl"], timeout_s=600)
#      run(command="bash benchmarks/gpu_all.sh kernels", carry=[".whl"], timeout_s=600)
#    With only one session's 15 minutes of device time, run the quick step instead, once:
#      run(command="bash benchmarks/gpu_all.sh quick",   carry=[".whl"], timeout_s=520)
#    Each command stops its steps by ~590 s (TGS_COMMAND_LIMIT_S) so that $OUT still comes back.
#    On a bare machine `int4` rebuilds the model first (the build is seeded: the same weights).
#
# 3. Afterwards, here (the report needs no GPU), with the files each call brought back:
#      python benchmarks/gpu_decode.py --phase report --out /tmp/gpu-report \
#        --inputs FILES_AT_FP16/gpu_decode_fp16.json FILES_AT_INT4/gpu_decode_int4.json
#    and copy the table (GPU name and date in it) into BENCHMARKS.md.
#
# Environment: TGS_GPU_DECODE_ARGS (extra gpu_decode.py flags, e.g. "--batches 1,8 --prefill-reps 1"
# when time is short), TGS_GPU_WORK (work dir, default /tmp/tgs-gpu-decode), TGS_COMMAND_LIMIT_S
# (default 590), TGS_WHEELS (a wheel folder), TGS_ALLOW_NO_GPU=1 (a CPU dry run of this script with
# TGS_GPU_DECODE_ARGS="--device cpu --dtype float32 --layers 2 --hidden 128 ..."; see gpu_decode.py).
#
# $OUT gets at most 8 files per command: gpu_all_<step>.log per step, and from the decode steps
# gpu_decode_<model>.json, server_<model>.log, gpu_decode_summary.json, gpu_decode_table.md.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
REPO=$PWD
START=$SECONDS
DEFAULT_LIMIT=590
[[ " $* " == *" quick "* ]] && DEFAULT_LIMIT=470
LIMIT=${TGS_COMMAND_LIMIT_S:-$DEFAULT_LIMIT}
WORK=${TGS_GPU_WORK:-/tmp/tgs-gpu-decode}
# typer >= 0.20 needs pydantic, which the device's image lacks; llguidance (grammars) and a jinja2
# new enough for our chat templates are carried too; attrs (jsonschema's) is on the image.
WHEEL_NAMES=(loguru protobuf grpcio grpcio-health-checking grpcio-reflection typer click llguidance jinja2
    pydantic pydantic-core annotated-types typing-inspection typing-extensions
    jsonschema jsonschema-specifications referencing rpds-py  # these four: tests/test_grammar.py
    starlette uvicorn gguf)  # the router's HTTP APIs and GGUF reading (their own needs are on the image)
# Llama-3.2-1B's shape (untied head): builds on the card in seconds, quantizes in well under a minute.
QUICK_DECODE_ARGS="--hidden 2048 --layers 16 --heads 32 --kv-heads 8 --intermediate 8192 --vocab 128256
    --batches 1,8 --prefill-lengths 512,2048 --prefill-reps 1 --prompt-tokens 128 --new-tokens 64
    --cuda-graphs 1,2,4,8 --startup-timeout-s 150 --max-shard-mb 1024 --dtype ${TGS_GPU_QUICK_DTYPE:-float16}"
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}

prepare_wheels() {
    local py=$PY
    [ -x .venv/bin/python ] && py=.venv/bin/python
    mkdir -p .whl
    local name version
    for name in "${WHEEL_NAMES[@]}"; do
        version=$("$py" -c "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))" "$name") || {
            echo "prepare-wheels: $name is not installed in $py; install the project's venv first" >&2; return 1; }
        rm -f .whl/"${name//-/_}"-*.whl
        "$py" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
            --platform manylinux_2_34_x86_64 --platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64 \
            --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
            -d .whl "$name==$version" || { echo "prepare-wheels: no wheel for $name==$version" >&2; return 1; }
    done
    ls -la .whl
    du -sh .whl
}

left() { echo $((LIMIT - (SECONDS - START))); }

# Makes text_generation_server importable without installing anything: its three portions
# (server/, quantizers/, kernels/) go on PYTHONPATH, as the editable install's .pth puts them
# on sys.path (an install would need a build backend a bare image may lack, and writes outside /tmp).
setup() {
    mkdir -p "${OUT:=$REPO/gpu-out}"
    export OUT
    local wheels=""
    for d in ${TGS_WHEELS:-} .whl shared/wheels; do
        if compgen -G "$d/*.whl" >/dev/null; then wheels=$d; break; fi
    done
    if [ -n "$wheels" ]; then
        "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
            "$wheels"/*.whl || { echo "setup: installing the wheels of $wheels failed" >&2; return 1; }
        export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
    else
        echo "setup: no wheels in .whl/ or shared/wheels (carry .whl): relying on what the machine has" >&2
    fi
    export PYTHONPATH=$REPO/server:$REPO/quantizers:$REPO/kernels${PYTHONPATH:+:$PYTHONPATH}
    # Fails in seconds, naming what is missing, rather than minutes into a step.
    "$PY" - <<'EOF' || return 1
import importlib, importlib.metadata as md, os, sys
missing = []
for module, dist in [("loguru", "loguru"), ("grpc_health.v1", "grpcio-health-checking"),
                     ("grpc_reflection.v1alpha", "grpcio-reflection"), ("typer", "typer"),
                     ("prometheus_client", "prometheus-client"), ("tokenizers", "tokenizers"),
                     ("safetensors", "safetensors"), ("triton", "triton"),
                     ("starlette", "starlette"), ("uvicorn", "uvicorn"), ("gguf", "gguf")]:
    try:
        importlib.import_module(module)
    except Exception as exc:
        missing.append(f"{dist} ({exc})")
try:
    import text_generation_server.pb.text_generation.v1.text_generation_pb2_grpc  # noqa: F401
    import text_generation_server.pb.generate.v3.generate_pb2_grpc  # noqa: F401
except Exception as exc:
    missing.append(f"our gRPC stubs ({exc}): carry the protobuf and grpcio wheels")
import torch
if missing:
    sys.exit("setup: missing " + "; ".join(missing) + " (bash benchmarks/gpu_all.sh prepare-wheels, carry .whl)")
versions = {d: md.version(d) for d in ("torch", "triton", "grpcio", "protobuf", "transformers")}
gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "NO CUDA DEVICE"
import text_generation_server.about
print(f"setup: {gpu}; python {sys.version.split()[0]}; " + ", ".join(f"{k} {v}" for k, v in versions.items())
      + f"; text_generation_server from {text_generation_server.about.__file__}")
if not torch.cuda.is_available() and os.environ.get("TGS_ALLOW_NO_GPU") != "1":
    sys.exit("setup: torch sees no CUDA device")
EOF
}

# A decode step's server runs in its own session; if the step was killed, stop what it left.
stop_left_server() {
    local pidfile=$WORK/server.pgid
    if [ -f "$pidfile" ]; then
        kill -KILL -- "-$(cat "$pidfile")" 2>/dev/null && echo "stopped a server left by the step" >&2
        rm -f "$pidfile"
    fi
}

# run_step NAME WANT_SECONDS COMMAND...: under timeout (what is left of the command's limit, at
# most WANT_SECONDS), output to the console and $OUT/gpu_all_NAME.log.
run_step() {
    local name=$1 want=$2
    shift 2
    local budget
    budget=$(($(left) - 5))
    ((budget > want)) && budget=$want
    if ((budget < 30)); then
        echo "== $name: skipped, only ${budget} s left of this command" | tee -a "$OUT/gpu_all_$name.log"
        return 1
    fi
    echo "== $name (timeout ${budget} s): $*" | tee -a "$OUT/gpu_all_$name.log"
    local started=$SECONDS rc
    timeout --signal="${RUN_STEP_SIGNAL:-TERM}" --kill-after=20 "$budget" "$@" 2>&1 | tee -a "$OUT/gpu_all_$name.log"
    rc=${PIPESTATUS[0]}
    stop_left_server
    echo "== $name: exit $rc after $((SECONDS - started)) s$([ "$rc" = 124 ] && echo ' (TIMED OUT)')" |
        tee -a "$OUT/gpu_all_$name.log"
    return "$rc"
}

# There is no `cuda` marker in pyproject.toml; the CUDA tests are the items carrying a skipif mark
# whose reason names CUDA or a GPU (a module-level pytestmark counts), plus items whose id names
# cuda (test_sampling.py's cuda parameter, the test_cuda_* functions). On 2026-11-24 that selects
# 63 of 2497 tests on a CPU machine, from test_triton_kernels.py, test_paged_attention.py,
# test_cuda_graphs.py, test_warmup_memory.py, test_fp8.py, test_marlin.py, test_exl2.py,
# test_attention_backends.py, test_kernels.py, test_serve_flags.py and test_bitsandbytes.py (no
# bitsandbytes on the device: its tests skip); a test that calls pytest.skip() in its body
# without a mark is missed. If a `cuda` marker is registered, `-m cuda` is used instead.
select_cuda_tests() {
    mkdir -p /tmp/tgs-pytest
    cat >/tmp/tgs-pytest/tgs_cuda_select.py <<'EOF'
import re

GPU = re.compile(r"cuda|gpu", re.IGNORECASE)


def _wants_gpu(item) -> bool:
    for mark in item.iter_markers("skipif"):
        if GPU.search(str(mark.kwargs.get("reason", ""))):
            return True
    return "cuda" in item.nodeid.split("::", 1)[-1].lower()


def pytest_collection_modifyitems(config, items):
    keep = [item for item in items if _wants_gpu(item)]
    config.hook.pytest_deselected(items=[item for item in items if item not in keep])
    items[:] = keep
EOF
}

step_tests() {
    local selection=(-p tgs_cuda_select)
    if "$PY" -m pytest --markers 2>/dev/null | grep -q '^@pytest.mark.cuda:'; then
        selection=(-m cuda)
    else
        select_cuda_tests
    fi
    PYTHONPATH=/tmp/tgs-pytest:$PYTHONPATH run_step tests 560 "$PY" -m pytest tests "${selection[@]}" -q -rfEs \
        --continue-on-collection-errors -p no:cacheprovider --junitxml "$OUT/pytest_cuda.xml"
}

# The files whose CUDA tests come first when time is short: the kernels every CUDA model runs
# (Triton, paged attention, graphs, warmup's memory), then the quantized formats, then serving.
QUICK_TEST_FILES=(test_fused_pointwise test_triton_kernels test_kernel_tuning test_paged_attention test_cuda_graphs test_warmup_memory
    test_attention_backends test_kernels test_fused_moe test_moe test_fp8 test_fp8_activations test_marlin
    test_exl2 test_grammar test_serve_flags)

step_tests_quick() {
    select_cuda_tests
    local files=() f
    if [ -n "${TGS_QUICK_TESTS:-}" ]; then
        read -r -a files <<<"$TGS_QUICK_TESTS"  # test files or node ids, in the order to run them
    else
        for f in "${QUICK_TEST_FILES[@]}"; do
            [ -f "tests/$f.py" ] && files+=("tests/$f.py")
        done
    fi
    # SIGINT when time is up: pytest then still prints the failures so far and writes its XML.
    # shellcheck disable=SC2046  # --timeout only where pytest-timeout is installed
    RUN_STEP_SIGNAL=INT PYTHONPATH=/tmp/tgs-pytest:$PYTHONPATH run_step tests_quick "${TGS_QUICK_TESTS_S:-150}" "$PY" -m pytest "${files[@]}" \
        -p tgs_cuda_select -v --tb=short -rfEs --durations=15 -p no:cacheprovider --continue-on-collection-errors \
        --junitxml "$OUT/pytest_cuda_quick.xml" $("$PY" -c 'import pytest_timeout' 2>/dev/null && echo --timeout=40)
}

decode_quick() {
    local rc
    # shellcheck disable=SC2086  # flag lists
    run_step decode_quick 200 "$PY" benchmarks/gpu_decode.py --phase all --work-dir "${WORK}-quick" --out "$OUT" \
        ${TGS_GPU_QUICK_ARGS:-$QUICK_DECODE_ARGS}
    rc=$?
    show_kernel_choices decode_quick
    return $rc
}

# The servers' warmup lines on the kernels each layer shape runs per decode batch size (kernels/tuning.py),
# copied into the step's log: none when no layer has two kernels (float16 activations: tinygemm needs bfloat16).
show_kernel_choices() {
    local found
    found=$(grep -h -e "kernels for " -e "kernel tuning " "$OUT"/server_*.log 2>/dev/null)
    echo "== kernel choices at warmup: ${found:+$'\n'}${found:-none logged (no layer had two kernels)}" |
        tee -a "$OUT/gpu_all_$1.log"
}

step_profile() {
    run_step step_profile "$1" "$PY" benchmarks/gpu_step_profile.py --work-dir "${WORK}-quick/fp16" --out "$OUT" \
        --no-eager --batches 1,8,64
}

kernel_choice() {
    run_step kernel_choice "$1" "$PY" benchmarks/kernel_choice.py
}

decode() {  # decode NAME PHASE
    # shellcheck disable=SC2086  # TGS_GPU_DECODE_ARGS is a list of flags
    run_step "$1" 580 "$PY" benchmarks/gpu_decode.py --phase "$2" --work-dir "$WORK" --out "$OUT" \
        ${TGS_GPU_DECODE_ARGS:-}
}

# Only 8 files come back from $OUT: past that, everything goes into one archive as well, and only the
# step logs and the decode table stay beside it.
bundle_out() {
    local count
    count=$(find "$OUT" -maxdepth 1 -type f | wc -l)
    ((count <= 8)) && return 0
    (cd "$OUT" && tar czf gpu_all_outputs.tgz --exclude gpu_all_outputs.tgz ./*) || return 1
    find "$OUT" -maxdepth 1 -type f ! -name 'gpu_all_*' ! -name gpu_decode_table.md -delete
    echo "bundle_out: $count files in \$OUT: all in gpu_all_outputs.tgz, step logs and the table beside it"
}

main() {
    if [ $# -eq 0 ]; then
        sed -n '2,/^set -uo/p' "${BASH_SOURCE[0]}" | sed '$d'
        return 2
    fi
    if [ "$1" = prepare-wheels ]; then
        prepare_wheels
        return
    fi
    local step
    for step in "$@"; do
        case $step in
            fp16 | int4 | decode-all | report | tests | kernels | kernels-quick | kernel-choice | quick | tests-quick | \
                decode-quick | step-profile) ;;
            *)
                echo "unknown step '$step' (quick, tests-quick, decode-quick, step-profile, fp16, int4, decode-all, tests, kernels," \
                    "kernels-quick, kernel-choice, report;" \
                    "prepare-wheels alone, off the device)" >&2
                return 2
                ;;
        esac
    done
    setup || return 3
    local status=0
    for step in "$@"; do
        case $step in
            fp16) decode fp16 serve-fp16 || status=1 ;;
            int4) decode int4 serve-int4 || status=1 ;;
            decode-all) decode fp16 serve-fp16 && decode int4 serve-int4 || status=1 ;;
            report) run_step report 60 "$PY" benchmarks/gpu_decode.py --phase report --work-dir "$WORK" \
                --out "$OUT" || status=1 ;;
            tests) step_tests || status=1 ;;
            kernels)
                run_step kernels_cuda 280 "$PY" benchmarks/kernels_cuda.py || status=1
                run_step attention_cuda 280 "$PY" benchmarks/attention_cuda.py || status=1
                kernel_choice 120 || status=1
                ;;
            kernels-quick)
                run_step kernels_cuda 200 "$PY" benchmarks/kernels_cuda.py --quick || status=1
                run_step attention_cuda 200 "$PY" benchmarks/attention_cuda.py --quick || status=1
                kernel_choice 120 || status=1
                ;;
            kernel-choice) kernel_choice 300 || status=1 ;;
            tests-quick) step_tests_quick || status=1 ;;
            decode-quick) decode_quick || status=1 ;;
            step-profile) step_profile 120 || status=1 ;;
            quick)
                step_tests_quick || status=1
                decode_quick || status=1
                step_profile 60 || status=1
                run_step kernels_cuda 45 "$PY" benchmarks/kernels_cuda.py --quick || status=1
                run_step attention_cuda 45 "$PY" benchmarks/attention_cuda.py --quick || status=1
                kernel_choice 40 || status=1
                ;;
        esac
    done
    bundle_out
    echo "gpu_all: steps $* done in $((SECONDS - START)) s, exit $status; outputs in $OUT:"
    ls -la "$OUT"
    return $status
}

main "$@"
