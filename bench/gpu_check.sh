#!/usr/bin/env bash
# The one-shot check of the CUDA path on a GPU machine (docs/design/testing.md, "On a
# CUDA GPU"): run from the repository root there, with the wheels of .whl
# carried along (gen/ is not needed: nothing here imports the gRPC stubs).
#
#   OUT=/some/dir bash bench/gpu_check.sh
#
# Writes to $OUT: env.txt (versions, the GPU, varlen_attn's signature),
# install.log, pytest.log (tests/gpu and the CPU-side varlen plumbing tests,
# every result with its figures), figures.jsonl (the tests' figures alone),
# steps.txt (bench/cuda_steps.py: step times, bfloat16). Expected to take 1 to
# 3 minutes on an H200 (not yet run on one), most of it imports, the CPU
# float32 reference and loading; pytest is stopped after PYTEST_TIMEOUT
# (240 s) and the timings after STEPS_TIMEOUT (120 s), so that the files come
# back whatever hangs. Exits with pytest's status. PY picks the interpreter
# (python3); SITE where the wheels go (/tmp/site); STEPS_ARGS
# bench/cuda_steps.py's arguments (a dry run on a machine without a GPU:
# STEPS_ARGS="--device cpu --reps 3").
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python3}
OUT=${OUT:-/tmp/gpu-check}
SITE=${SITE:-/tmp/site}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
export STORMSERVE_CACHE_DIR=${STORMSERVE_CACHE_DIR:-/tmp/stormserve-cache}
export STORMSERVE_GPU_FIGURES=$OUT/figures.jsonl
rm -f "$STORMSERVE_GPU_FIGURES"
started=$(date +%s)

# gguf, llguidance, googleapis-common-protos and protobuf, as requirements.txt pins them.
if compgen -G ".whl/*.whl" >/dev/null; then
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .whl/*.whl \
        >"$OUT/install.log" 2>&1 || { echo "wheel install failed:"; cat "$OUT/install.log"; }
fi
export PYTHONPATH=$SITE:gen:.

{
    echo "== $(date -u +%FT%TZ) $(uname -srm)"
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader 2>&1 || true
    $PY - <<'EOF'
import importlib, inspect, platform, sys
import torch
print("python", platform.python_version(), sys.executable)
print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available())
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    print("device", p.name, f"sm_{p.major}{p.minor}", f"{p.total_memory / 2**30:.0f} GiB")
    print("flash SDPA enabled", torch.backends.cuda.flash_sdp_enabled(),
          "tf32 matmul", torch.backends.cuda.matmul.allow_tf32)
try:
    from torch.nn.attention.varlen import varlen_attn
    print("varlen_attn", inspect.signature(varlen_attn))
except ImportError as exc:
    print("varlen_attn missing:", exc)
for name in ("transformers", "huggingface_hub", "tokenizers", "safetensors", "numpy", "grpc", "google.protobuf",
             "llguidance", "gguf", "pytest"):
    try:
        module = importlib.import_module(name)
        print(name, getattr(module, "__version__", "?"), module.__file__)
    except Exception as exc:  # noqa: BLE001
        print(name, "NOT IMPORTABLE:", type(exc).__name__, exc)
from tests.gpu.models import check_model
print("model", *check_model())
EOF
} 2>&1 | tee "$OUT/env.txt"

# No -x: the paged varlen tests fail on a torch without varlen_attn's paged
# arguments (2.11 has none of them), and the model runner's tests must run all the same.
timeout -k 10 "${PYTEST_TIMEOUT:-240}" $PY -m pytest -q -rA -p no:cacheprovider \
    tests/gpu tests/unit/worker/test_cuda_attention.py 2>&1 | tee "$OUT/pytest.log"
status=$?

timeout -k 10 "${STEPS_TIMEOUT:-120}" $PY -m bench.cuda_steps ${STEPS_ARGS:---device cuda --dtype bfloat16} 2>&1 \
    | tee "$OUT/steps.txt"
echo "== pytest exit $status; whole check $(( $(date +%s) - started )) s" | tee -a "$OUT/steps.txt"
exit $status
