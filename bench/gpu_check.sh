#!/usr/bin/env bash
# The one-shot check of the CUDA path on a lent GPU machine (an H100 or H200;
# docs/design/testing.md, "On a CUDA GPU"): the GPU tests, decode-step times
# with CUDA graphs on and off beside transformers' compiled static-cache
# generate() on the same model and GPU, and the whole chain at 1 and 32
# streams. Made for one run under a 420 s limit; not yet run on a GPU, estimated
# at 4 to 5 minutes (most of it the tests, torch.compile and starting the chain).
#
# 1. Here, once (needs pip's registry and `make setup`; writes .whl/, which it adds
#    to .git/info/exclude, and gen/):
#
#      bash bench/gpu_check.sh prepare
#
#    .whl/: the requirements.txt pins that the machine's image (KINDS.md of the
#    device tool) lacks or holds at other versions, CPython 3.12 wheels for x86-64,
#    28.4 MiB in all:
#      transformers==5.23.0     12.7 MiB  the image has 5.17: the runner, the tests and
#      regex==2026.11.19         0.8 MiB  the HF baseline run the pinned version (whose
#                                         static-cache API bench/hf_compiled.py uses);
#                                         transformers checks regex's version at import
#      grpcio==1.85.1            7.0 MiB  the stubs in gen/ refuse an older grpcio
#      protobuf==7.36.2          0.3 MiB  ... or protobuf (they need 7.35.1 or later)
#      googleapis-common-protos==1.76.0, grpcio-health-checking==1.85.1,
#      grpcio-reflection==1.85.1 0.3 MiB  every service's errors and health
#      llguidance==1.9.1         2.9 MiB  the worker's sequence types
#      fastapi==0.163.2, starlette==1.10.0, uvicorn==0.54.0, httptools==0.9.0,
#      fastapi-offline==1.7.7 (Swagger's files), pydantic==2.14.3, pydantic-core==2.50.4,
#      annotated-types==0.8.0, typing-inspection==0.4.5, typing-extensions==4.16.0,
#      opentelemetry-api==1.45.2
#                                4.4 MiB  the HTTP edge, and what every service imports
#    .whl/tokenizer/ (3.4 MiB): the bundled model's tokenizer files, which the chain
#    serves the stand-in model with (the model's GGUF file, 94 MiB, stays here).
#    gen/ (0.4 MiB): the gRPC stubs `make protos` generates, carried rather than built
#    there (that would take grpcio-tools and the googleapis protos along as well).
#    With the repository (3.6 MiB) a call carries about 36 of its 64 MiB.
#
# 2. On the machine, through the device tool:
#
#      run(command="bash bench/gpu_check.sh", carry=[".whl", "gen"], timeout_s=420)
#
# Writes to $OUT (7 files): env.txt (the wheels' install, versions, the GPU, the
# model), pytest.log (tests/gpu and the CPU-side Triton kernel tests, every result
# with its figures), figures.jsonl (the tests' figures alone), steps.txt
# (bench.cuda_steps with STORMSERVE_GRAPHS=auto, then =off: bfloat16 prefill, decode
# and drafted steps, 16- and 256-token blocks), hf.txt (bench.hf_compiled:
# transformers' compiled static-cache decode step at batch 1 and 32), chain.txt
# (bench.serve --start-chain: the chain on the GPU, 1 and 32 streams through the
# HTTP edge, and the end of each service's log), and summary.txt: the goal figures
# (a decode step of at most 1.5 ms at 1 sequence and 2.0 ms at 32) beside HF
# compiled's from the same run, as ratios, the chain's tok/s, TTFT and ITL, the
# tests' result and each part's status and seconds. Each part runs under its own
# `timeout`: its cap, and never past CHECK_BUDGET_S (390 s) from the start, so a
# hang costs only that part's figures. Exits with pytest's status.
#
# A dry run without a GPU (all but the kernels and the graphs; the GPU tests skip):
#   STORMSERVE_GPU_CHECK_MODEL=standin DEVICE=cpu DTYPE=float32 PY=.venv/bin/python \
#   STEPS_ARGS="--device cpu --dtype float32 --reps 3 --block-sizes 256" \
#   HF_ARGS="--device cpu --dtype float32 --batches 1,2 --prompt-len 16 --new-tokens 4 --reps 2 --no-compile" \
#   SERVE_ARGS="--concurrency 1:2,4:4 --input-len 32 --output-len 8" OUT=/tmp/gpuout bash bench/gpu_check.sh
# Other knobs: PY (python3), SITE (/tmp/site: where the wheels go), the caps in
# seconds PYTEST_TIMEOUT (150), STEPS_TIMEOUT (80, each graphs setting),
# HF_TIMEOUT (150), CHAIN_TIMEOUT (120), and CHECK_BUDGET_S.
set -uo pipefail
cd "$(dirname "$0")/.."

WHEELS="transformers==5.23.0 regex==2026.11.19 grpcio==1.85.1 protobuf==7.36.2 grpcio-health-checking==1.85.1
grpcio-reflection==1.85.1 googleapis-common-protos==1.76.0 fastapi==0.163.2 fastapi-offline==1.7.7 starlette==1.10.0
uvicorn==0.54.0 httptools==0.9.0 pydantic==2.14.3 pydantic-core==2.50.4 annotated-types==0.8.0
typing-inspection==0.4.5 typing-extensions==4.16.0 opentelemetry-api==1.45.2 llguidance==1.9.1"

if [ "${1:-}" = prepare ]; then
    PY=${PY:-.venv/bin/python}
    grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >>.git/info/exclude
    rm -rf .whl && mkdir -p .whl/tokenizer
    for wheel in $WHEELS; do
        $PY -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
            --platform manylinux_2_35_x86_64 --platform manylinux_2_34_x86_64 --platform manylinux_2_31_x86_64 \
            --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
            --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl "$wheel" || exit 1
    done
    PYTHONPATH=gen:. $PY -c "
from transformers import AutoTokenizer
from services.common.model_files import default_model_path, resolve_model
AutoTokenizer.from_pretrained(resolve_model(default_model_path())).save_pretrained('.whl/tokenizer')" || exit 1
    make protos descriptors >/dev/null || exit 1
    du -sh .whl gen
    ls -s --block-size=K .whl
    exit 0
fi

PY=${PY:-python3}
OUT=${OUT:-/tmp/gpu-check}
SITE=${SITE:-/tmp/site}
DEVICE=${DEVICE:-cuda}
DTYPE=${DTYPE:-bfloat16}
STEPS_ARGS=${STEPS_ARGS:---device $DEVICE --dtype $DTYPE}
HF_ARGS=${HF_ARGS:---device $DEVICE --dtype $DTYPE --batches 1,32}
SERVE_ARGS=${SERVE_ARGS:---concurrency 1:8,32:32 --input-len 200 --output-len 128}
BUDGET=${CHECK_BUDGET_S:-390}
WORK=$(mktemp -d /tmp/gpu-check-work.XXXX)
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
export STORMSERVE_CACHE_DIR=${STORMSERVE_CACHE_DIR:-/tmp/stormserve-cache}
export STORMSERVE_GPU_FIGURES=$OUT/figures.jsonl
rm -f "$STORMSERVE_GPU_FIGURES"
started=$(date +%s)

# part NAME CAP_S COMMAND...: COMMAND under `timeout`, for CAP_S or what is left
# of the budget; its status and seconds go to $WORK/parts (124: timed out).
part() {
    local name=$1 cap=$2 left status begun
    shift 2
    left=$(( BUDGET - ($(date +%s) - started) ))
    (( left < cap )) && cap=$left
    if (( cap < 5 )); then
        echo "== $name: skipped, the budget is spent"
        printf '%s\tskipped\t0\n' "$name" >>"$WORK/parts"
        return 0
    fi
    echo "== $name (at most $cap s)"
    begun=$(date +%s)
    timeout -k 10 "$cap" "$@"
    status=$?
    printf '%s\t%s\t%s\n' "$name" "$status" "$(( $(date +%s) - begun ))" >>"$WORK/parts"
    return $status
}

if ! compgen -G ".whl/*.whl" >/dev/null; then
    echo "no wheels in .whl/: nothing installed" >"$WORK/install.log"
elif ! $PY -c 'import sys; sys.exit(sys.version_info[:2] != (3, 12))'; then
    echo "the wheels of .whl/ are CPython 3.12's and $PY is not: nothing installed" >"$WORK/install.log"
else
    part install 60 $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target "$SITE" .whl/*.whl >"$WORK/install.log" 2>&1 || echo "wheel install failed" >>"$WORK/install.log"
fi
export PYTHONPATH=$SITE:gen:.

{
    echo "== $(date -u +%FT%TZ) $(uname -srm)"
    cat "$WORK/install.log" 2>/dev/null
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader 2>&1 || true
    ls gen/stormserve >/dev/null 2>&1 || echo "gen/ is missing: carry it (bash bench/gpu_check.sh prepare makes it)"
    part env 90 $PY - <<'EOF'
import importlib, platform, sys
import torch
print("python", platform.python_version(), sys.executable)
print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available())
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    print("device", p.name, f"sm_{p.major}{p.minor}", f"{p.total_memory / 2**30:.0f} GiB")
    print("flash SDPA enabled", torch.backends.cuda.flash_sdp_enabled(),
          "tf32 matmul", torch.backends.cuda.matmul.allow_tf32)
for name in ("transformers", "huggingface_hub", "tokenizers", "safetensors", "numpy", "triton", "grpc",
             "google.protobuf", "fastapi", "uvicorn", "pydantic", "llguidance", "pytest", "pytest_timeout"):
    try:
        module = importlib.import_module(name)
        print(name, getattr(module, "__version__", "?"), module.__file__)
    except Exception as exc:  # noqa: BLE001
        print(name, "NOT IMPORTABLE:", type(exc).__name__, exc)
from tests.gpu.models import check_model
print("model", *check_model())
EOF
} 2>&1 | tee "$OUT/env.txt"

# No -x: one failing test must not hide the others' results. Beside tests/gpu, the
# CPU-side tests of the Triton kernels (the interpreter, and builds for sm_80 and
# sm_90 by this machine's Triton).
tests=(tests/gpu)
for extra in tests/unit/worker/test_triton_attention.py; do [ -f "$extra" ] && tests+=("$extra"); done
per_test=()
$PY -c "import pytest_timeout" 2>/dev/null && per_test=(--timeout "${PYTEST_TEST_TIMEOUT:-90}")
part pytest "${PYTEST_TIMEOUT:-150}" $PY -m pytest -q -rA -p no:cacheprovider "${per_test[@]}" "${tests[@]}" 2>&1 \
    | tee "$OUT/pytest.log"
status=${PIPESTATUS[0]}

# Graphs on (auto: where the platform and the attention kernel allow) and off, each in its own process.
for graphs in auto off; do
    STORMSERVE_GRAPHS=$graphs part "steps-graphs-$graphs" "${STEPS_TIMEOUT:-80}" \
        $PY -m bench.cuda_steps $STEPS_ARGS 2>&1
done | tee "$OUT/steps.txt"

part hf "${HF_TIMEOUT:-150}" $PY -m bench.hf_compiled $HF_ARGS 2>&1 | tee "$OUT/hf.txt"

# The chain serves the check's model; a stand-in has no tokenizer of its own, so it
# gets the bundled model's, carried in .whl/tokenizer.
{
    model=$(timeout 60 $PY -m tests.gpu.models | cut -f1)
    if [ -n "$model" ] && [ ! -f "$model/tokenizer.json" ]; then
        if [ -f .whl/tokenizer/tokenizer.json ]; then
            mkdir -p "$WORK/model" && ln -sf "$model"/* "$WORK/model/" && cp .whl/tokenizer/* "$WORK/model/"
            model=$WORK/model
        else
            echo "no tokenizer for $model: .whl/tokenizer is missing (bash bench/gpu_check.sh prepare)"
            model=
        fi
    fi
    if [ -n "$model" ]; then
        part chain "${CHAIN_TIMEOUT:-120}" $PY -m bench.serve --start-chain --label gpu-check \
            --chain-env STORMSERVE_MODEL_PATH="$model" --chain-env STORMSERVE_DEVICE="$DEVICE" \
            --chain-env STORMSERVE_DTYPE="$DTYPE" --chain-env STORMSERVE_KV_CACHE_MIB=1024 \
            --chain-env STORMSERVE_DRAIN_TIMEOUT_S=2 \
            --chain-timeout 100 --chain-log-dir "$WORK/chain-logs" --out "$WORK/chain.json" $SERVE_ARGS 2>&1
        [ -f "$WORK/chain.json" ] && cat "$WORK/chain.json"
        for log in "$WORK"/chain-logs/*.log; do
            echo "== the last lines of $log"
            grep -v " stormserve.access: " "$log" | tail -n 25
        done
    fi
} 2>&1 | tee "$OUT/chain.txt"

echo "== pytest exit $status; whole check $(( $(date +%s) - started )) s" >>"$WORK/parts"
timeout 30 $PY - "$OUT" "$WORK" <<'EOF' 2>&1 | tee "$OUT/summary.txt"
"""The goal figures beside HF compiled's, from the files this run wrote."""
import json
import re
import sys
from pathlib import Path

out, work = Path(sys.argv[1]), Path(sys.argv[2])
GOALS_MS = {1: 1.5, 32: 2.0}


def json_lines(path):
    lines = []
    for text in path.read_text(errors="replace").splitlines() if path.exists() else []:
        if text.startswith("{"):
            try:
                lines.append(json.loads(text))
            except ValueError:
                pass
    return lines


def ms(figures):
    return f"{figures['median_ms']:.2f} / {figures['p90_ms']:.2f}" if figures else "–"


steps = {}  # (graphs setting, block size) -> line
for line in json_lines(out / "steps.txt"):
    steps[(line.get("graphs", {}).get("setting", "?"), line.get("block_size"))] = line
hf = {line.get("batch"): line for line in json_lines(out / "hf.txt")}
print("# GPU check summary")
print(next((l.split(None, 1)[1] for l in (out / "env.txt").read_text().splitlines() if l.startswith("device ")),
           "device: unknown (env.txt)") if (out / "env.txt").exists() else "")
print("\nDecode step, ms (median / p90; a step is one token of every sequence). HF: transformers'"
      " generate(), static cache, torch.compile reduce-overhead.\n")
print("auto / HF: graphs auto's median over HF compiled's (below 1: faster than HF).\n")
print("| sequences | block | graphs auto | graphs off | HF compiled | goal | auto: goal met | auto / HF |")
print("|---|---|---|---|---|---|---|---|")
for block in sorted({b for _, b in steps if b is not None}):
    auto, off = steps.get(("auto", block), {}), steps.get(("off", block), {})
    for batch in (1, 8, 32):
        a, o = auto.get(f"decode_{batch}x1"), off.get(f"decode_{batch}x1")
        h = hf.get(batch, {}).get("decode_step")
        goal = GOALS_MS.get(batch)
        met = ("yes" if a["median_ms"] <= goal else "NO") if a and goal else "–"
        ratio = f"{a['median_ms'] / h['median_ms']:.2f}" if a and h else "–"
        graphs = auto.get("graphs", {}).get("replayed_batch_sizes")
        label = f"{block} ({auto.get('attention', '?')}, graphs {'captured' if graphs else 'NOT captured'})"
        goal_text = f"≤ {goal} ms" if goal else "–"
        print(f"| {batch} | {label} | {ms(a)} | {ms(o)} | {ms(h)} | {goal_text} | {met} | {ratio} |")
if not steps:
    print("\nNo step figures (steps.txt says why).")
for name, lines in (("steps", steps.values()), ("hf", hf.values())):
    for line in lines:
        if "error" in line:
            print(f"\n{name} error ({line.get('block_size') or line.get('batch')}): {line['error']}")
for line in hf.values():
    if line.get("compiled_while_timed") or line.get("cudagraph_skips") or line.get("fullgraph_error"):
        print(f"\nHF batch {line.get('batch')}: recompiled while timed {line.get('compiled_while_timed')}, "
              f"CUDA graph skips {line.get('cudagraph_skips')}, fullgraph error {line.get('fullgraph_error')}")

chain = work / "chain.json"
if chain.exists():
    print("\nThe chain through the HTTP edge (bench.serve; TTFT and ITL median / p90):\n")
    print("| streams | requests | errors | output tok/s | TTFT ms | ITL ms | tokens per step |")
    print("|---|---|---|---|---|---|---|")
    for level in json.loads(chain.read_text())["levels"]:
        ttft, itl = level["ttft_s"], level["itl_s"]
        print(f"| {level['concurrency']} | {level['requests']} | {level['num_errors']} | "
              f"{level['output_tok_per_s']:.0f} | {ttft['p50'] * 1e3:.1f} / {ttft['p90'] * 1e3:.1f} | "
              f"{itl['p50'] * 1e3:.2f} / {itl['p90'] * 1e3:.2f} | "
              f"{level.get('speculation', {}).get('tokens_per_step', 0):.1f} |")
else:
    print("\nThe chain: no figures (chain.txt says why)")

pytest_log = out / "pytest.log"
results = [l.strip("= ") for l in (pytest_log.read_text().splitlines() if pytest_log.exists() else [])
           if re.search(r"\d+ (passed|failed|skipped|errors?)\b.* in [\d.]+s", l)]
print("\npytest:", results[-1] if results else "no result (pytest.log)")
print("\nParts (status 124: timed out; seconds):")
for text in (work / "parts").read_text().splitlines():
    print("  " + text.replace("\t", "  "))
EOF
exit $status
