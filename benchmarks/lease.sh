#!/usr/bin/env bash
# The prepared commands of a short GPU lease (docs/accelerator.md), run on the lent machine from the repository root
# with `.whl` carried (ml-collections and llguidance, which its image lacks) and $OUT set:
#   bash benchmarks/lease.sh 1 COMMIT   # ~7 min: kernels against float32, ceilings, sweep, decode and train traced,
#                                       # decode at 256 rows (sampling and greedy), the train variants (Qwen3-0.6B)
#   bash benchmarks/lease.sh 2 COMMIT   # ~4 min: Qwen3-1.7B's train step; the decode step with XLA's Triton GEMMs
#                                       # on and off
#   bash benchmarks/lease.sh smoke      # both, at toy sizes on this CPU (~3 min): what a lease would meet
# COMMIT: `git rev-parse --short HEAD` where the tree was sent from (the lent copy's git metadata may differ).
set -o pipefail
stage=$1
export AREALJAX_COMMIT=${2:-$(git rev-parse --short HEAD 2>/dev/null)} PYTHONUNBUFFERED=1
py=python3
if [ "$stage" = smoke ]; then
  py=python
  OUT=${OUT:-$(mktemp -d)}
  smoke=--smoke
else
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}.
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv 2>/dev/null

# the first variant is also the train stage's (traced); the others each change one thing, the last all of them
variants=pallas:save_dots,pallas:save_dots:logits_chunk=0,pallas:save_dots:block_q=128
variants+=,pallas:save_dots:group_heads=1,pallas:save_dots:logits_chunk=0:block_q=128:group_heads=1
# rows:block_pages:num_warps:num_stages:splits:mma:prefetch around the H200's fastest (1 page, 1 warp, 1 stage)
sweep="256:1,2:1,2:1:1,2,4:1,0:0,1;64:1:1:1:0,4:1,0:0,1"
rows=256 large=qwen3-1.7b
if [ -n "$smoke" ]; then  # the smoke size's model, rows and blocks
  variants=pallas:none,pallas:none:logits_chunk=0:block_q=32:group_heads=1
  sweep="16:1:1:1:1,2:1,0:0,1" rows=16 large=tiny
fi

one() {
  timeout 480 $py benchmarks/accelerator.py $smoke --parts=kernels --profile --out="$OUT/one" --decode-rows=$rows \
    --stages=environment,ceilings,sweep,decode,train,trace,decode_full,train_attention \
    --sweep="$sweep" --train-variants="$variants" 2>&1 | grep -v "^paged_sweep" | tee "$OUT/one/log.txt"
  rm -f "$OUT"/one/kernels.md "$OUT"/one/accelerator-*.md  # in profile.md and the .json: 8 files come back at most
}

two() {
  mkdir -p "$OUT/two"
  timeout 150 $py benchmarks/accelerator.py $smoke --profile --out="$OUT/two/q17" --models=$large \
    --stages=ceilings,train,train_attention --train-repeats=3 \
    --train-variants=pallas:save_dots,pallas:save_dots:logits_chunk=0:block_q=128:group_heads=1 \
    2>&1 | tee "$OUT/two/q17.log"
  for gemm in true false; do
    XLA_FLAGS="--xla_gpu_enable_triton_gemm=$gemm" timeout 75 $py benchmarks/accelerator.py $smoke --profile \
      --out="$OUT/two/gemm_$gemm" --stages=sweep,decode_full --sweep="$rows:1:1:1:0" 2>&1 | grep -v "^paged_sweep" \
      | tee "$OUT/two/gemm_$gemm.log"
  done
  rm -f "$OUT"/two/*/hlo.tar.gz "$OUT"/two/gemm_*/profile.md  # 8 files come back at most
}

mkdir -p "$OUT/one"
case $stage in
  1) one ;;
  2) two ;;
  smoke) one; two ;;
  *) echo "usage: bash benchmarks/lease.sh 1|2|smoke [COMMIT]" >&2; exit 2 ;;
esac
