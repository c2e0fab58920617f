#!/usr/bin/env bash
# scripts/gpu_check.sh: the GPU check of kvhandoff, sized for a lent machine (one H200, well
# under 8 minutes). Writes its results under $OUT when set, else ./gpu_check_out.
#
#   scripts/gpu_check.sh            # from the repository root; PY=path/to/python to override
#
# Needs a CUDA build of torch in the Python it runs (PY, default .venv/bin/python, else
# python3). With a CPU-only torch it stops at once with exit 2 and says so.
# GPU_CHECK_DEVICE=cpu runs the same steps on CPU (the gpu tests then skip): a dry run of this
# script on a machine without a GPU, nothing more.
#
# What it covers (caps add up to under 8 minutes; a healthy run takes far less):
#   1. `pytest -m gpu tests` (cap 180 s): every test marked `gpu` (they skip with "no CUDA
#      device" elsewhere): tests/unit/gpu/test_devsum_cuda.py (the device checksum on CUDA
#      equals the numpy reference and the CPU value; both sides of a span plan agree after
#      device copies; memory_kind of CUDA tensors / array interfaces; the doctor's two-process
#      CUDA IPC probe) and tests/unit/gpu/test_gpu_lane_cuda.py (the CUDA IPC lane pieces of
#      transfer/transports/_cuda_ipc.py between two processes: sub-block export, one open per
#      block, span copies cut differently on both sides, device checksums equal; BufferSet on
#      CUDA tensors and array interfaces; tcp's refusal of CUDA buffers; the event waiter on a
#      real CUDA event behind a long kernel) and tests/unit/gpu/test_shm_cuda_handoff.py (two
#      agents in two processes with CUDA buffers over shm's CUDA IPC lane: a whole room
#      one-sided with devsum on both sides, byte-exact; the writer survives a decode that
#      dies mid-room) and tests/integrations/vllm/test_vllm_gpu_probe.py (the vLLM connector's
#      layout probe against vLLM's own FLASH_ATTN, FLASHINFER, TRITON_ATTN layers, HND and NHD
#      pages, FLASHMLA, and vLLM 0.33's dense MLA picks FLASH_ATTN_MLA, FLASHINFER_MLA,
#      CUTLASS_MLA, TRITON_MLA, bfloat16 and per-tensor fp8 caches (fp8, fp8_e5m2) where the
#      backend takes them: each must log "layout verified against <backend>") and
#      tests/unit/gpu/test_lanes_cuda.py (the lane choice SGLang and vLLM share, on real CUDA
#      pages: the default settings start an agent, shm CUDA IPC + nixl; host-only lanes take
#      host staging, or are refused with host_staging=off) and
#      tests/unit/gpu/test_staging_cuda.py (host staging: two agents over tcp with CUDA pages,
#      each layer copied through pinned host slabs on both sides, byte-exact, devsum) and
#      tests/unit/gpu/test_head_slices_copy.py (SGLang's dense pools between attention TP
#      sizes: head slices of token-major pages copied by the CUDA IPC lane's copy_spans on the
#      device, each decode rank's pages exactly its heads, 1 -> 2 and 2 -> 1).
#   1b. the host staging test again on its own (cap 25 s), its result in pytest-staging.xml:
#      the fallback for hosts without GPUDirect RDMA.
#   2. `python -m kvhandoff.bench.devsum --device cuda` (cap 2 x 30 s): devsum against a
#      contiguous device copy and a page gather copy of the same page set, page-granular
#      (16-token pages of 656 B) and token-granular (132 B) sets.
#   3. `kvhandoff bench --device cuda` (cap 90 s, 4k tokens, 3 reps): the page set on the GPU:
#      contiguous copy (ceiling), gather/scatter limit baseline, the CUDA IPC lane's copy engine
#      (copy_spans, one process), devsum; verified byte-exact; JSON in bench_device.json.
#   4. `kvhandoff demo --device cuda --json` (cap 60 s, 4k tokens): layers marked ready with
#      CUDA events through the event waiter, copied by copy_spans, device checksums both sides,
#      byte-exact check; JSON in demo_device.json.
#   5. `kvhandoff doctor --json` (cap 60 s) on the node.
#
# What it does NOT cover (docs/GPU.md): the agent-to-agent GPU handoff over shm is checked
# (pytest) but not timed; nixl's VRAM registration is registered once (test_lanes_cuda.py) but
# no room moves over it; the sparse MLA backends (FLASH_ATTN_MLA_SPARSE, _FA4,
# FLASHINFER_MLA_SPARSE) are not probed (no DSA model layers in the probe process); SGLang's
# system DP needs no GPU (CPU tests); devsum uses torch
# ops (several passes per chunk), not a fused kernel. When this script was written nothing in it
# had run on a GPU: its first run on a lent machine is the first GPU check.
set -uo pipefail

cd "$(dirname "$0")/.."
PY=${PY:-}
if [[ -z "$PY" ]]; then
  if [[ -x .venv/bin/python ]]; then PY=.venv/bin/python; else PY=python3; fi
fi
DEV=${GPU_CHECK_DEVICE:-cuda}
R=${OUT:-./gpu_check_out}
mkdir -p "$R"
LOG="$R/gpu_check.log"
: >"$LOG"
say() { echo "$*" | tee -a "$LOG"; }
T0=$(date +%s)

say "== gpu_check $(date -u +%FT%TZ) on $(hostname)"
command -v nvidia-smi >/dev/null && nvidia-smi -L 2>&1 | tee -a "$LOG"
if ! "$PY" - "$DEV" <<'EOF' 2>&1 | tee -a "$LOG"; then
import sys
import torch
print(f"torch {torch.__version__} cuda {torch.version.cuda} available "
      f"{torch.cuda.is_available()}")
if not torch.cuda.is_available() and sys.argv[1] != "cpu":
    print("no CUDA device visible to torch (CPU-only build or no GPU): install a CUDA torch")
    sys.exit(2)
for i in range(torch.cuda.device_count()):
    print(f"cuda:{i} {torch.cuda.get_device_name(i)}")
EOF
  say "gpu_check: stopped (exit 2): torch sees no CUDA device"
  exit 2
fi

rc=0
say "== 1. pytest -m gpu (cap 180 s)"
timeout 180 "$PY" -m pytest -q -m gpu tests -rs -p no:cacheprovider \
  --junitxml "$R/pytest-gpu.xml" 2>&1 | tee "$R/pytest-gpu.txt" | tail -25 | tee -a "$LOG"
prc=${PIPESTATUS[0]}
say "pytest -m gpu exit $prc"
[[ $prc -ne 0 ]] && rc=1

say "== 1b. host staging over tcp with CUDA pages (cap 25 s)"
timeout 25 "$PY" -m pytest -q -m gpu tests/unit/gpu/test_staging_cuda.py -rs \
  -p no:cacheprovider --junitxml "$R/pytest-staging.xml" 2>&1 | tee "$R/pytest-staging.txt" \
  | tail -8 | tee -a "$LOG"
src=${PIPESTATUS[0]}
say "host staging test exit $src"
[[ $src -ne 0 ]] && rc=1

say "== 2. devsum vs device copy on $DEV (cap 2 x 30 s)"
if [[ "$DEV" == cpu ]]; then BIG=32 SMALL=8 REP=3; else BIG=256 SMALL=64 REP=10; fi
for args in "--mib $BIG --page-tokens 16 --token-bytes 656" \
            "--mib $SMALL --page-tokens 1 --token-bytes 132"; do
  # shellcheck disable=SC2086
  timeout 30 "$PY" -m kvhandoff.bench.devsum --device "$DEV" --repeat "$REP" $args 2>&1 \
    | tee -a "$R/devsum_bench.txt" | tee -a "$LOG"
  brc=${PIPESTATUS[0]}
  [[ $brc -ne 0 ]] && { say "devsum bench ($args) exit $brc"; rc=1; }
done

if [[ "$DEV" == cpu ]]; then
  say "== 3-4. skipped on the cpu dry run: bench/demo --device need CUDA (their CPU path is"
  say "   tested in tests/unit/gpu/test_gpu_cpu_cli.py)"
else
  say "== 3. kvhandoff bench --device $DEV (cap 90 s)"
  timeout 90 "$PY" -m kvhandoff.cli bench --device "$DEV" --context 4096 --prefix 1024 \
    --reps 3 --warmup 1 --out "$R/bench_device.json" 2>"$R/bench_device.stderr" \
    | tee "$R/bench_device.txt" | tee -a "$LOG"
  brc=${PIPESTATUS[0]}
  say "bench --device exit $brc"
  [[ $brc -ne 0 ]] && { tail -20 "$R/bench_device.stderr" | tee -a "$LOG"; rc=1; }

  say "== 4. kvhandoff demo --device $DEV --json (cap 60 s)"
  timeout 60 "$PY" -m kvhandoff.cli demo --device "$DEV" --context 4096 --prefix 1024 \
    --json >"$R/demo_device.json" 2>"$R/demo_device.stderr"
  drc=$?
  say "demo --device exit $drc"
  [[ $drc -ne 0 ]] && { tail -20 "$R/demo_device.stderr" | tee -a "$LOG"; rc=1; }
  "$PY" - "$R/demo_device.json" <<'EOF' 2>&1 | tee -a "$LOG"
import json, sys
try:
    r = json.load(open(sys.argv[1]))
except Exception as e:
    print(f"demo_device.json unreadable: {e}")
    sys.exit(0)
keys = ("ok", "byte_exact", "checksums_verified", "bytes", "handoff_window_s", "tail_s",
        "failure")
print("  " + ", ".join(f"{k}={r.get(k)}" for k in keys))
EOF
fi

say "== 5. kvhandoff doctor --json (cap 60 s)"
timeout 60 "$PY" -m kvhandoff.cli doctor --json >"$R/doctor.json" 2>"$R/doctor.stderr"
drc=$?
say "doctor exit $drc (1 = a blocking problem on this node; see doctor.json)"
"$PY" - "$R/doctor.json" <<'EOF' 2>&1 | tee -a "$LOG"
import json, sys
try:
    rep = json.load(open(sys.argv[1]))
except Exception as e:
    print(f"doctor.json unreadable: {e}")
    sys.exit(0)
for c in rep["checks"]:
    print(f"  {c['name']:<22} {c['status']:<5} {c['summary'][:150]}")
EOF

say "== done in $(( $(date +%s) - T0 )) s, exit $rc; results in $R"
exit $rc
