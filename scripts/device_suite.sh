#!/usr/bin/env bash
# One device call, many steps: each step has its own time limit and log under $OUT, so a
# failing or slow step does not cost the others. Usage: bash scripts/device_suite.sh STEP...
# A call has 600 s in all: keep a step's limit under it, with the kit's install (~20 s) counted.
# Steps: the case labels below, each with a comment saying what it measures (`grep -n ')  #' scripts/device_suite.sh`);
# `auto` picks a call's worth by card. docs/benchmarks.md names the step behind every figure.
# (the fi steps install .devkit's wheels first, for flashinfer; its first use JIT-compiles ~60 s)
# .devkit: `bash ../shared/devkit/build.sh && bash scripts/devkit_extra.sh` (httptools for serve)
set -uo pipefail
export PYTHONPATH=.
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
step() {  # name, seconds, command...
  local name=$1 limit=$2; shift 2
  local t0=$(date +%s)
  # one log for the whole call: a run brings back only a few files
  timeout "$limit" "$@" 2>&1 | tr '\r' '\n' | grep --line-buffered -v "Capturing CUDA graphs" > "/tmp/$name.log"
  local rc=${PIPESTATUS[0]}
  { echo "== $name rc=$rc $(( $(date +%s) - t0 ))s"; cat "/tmp/$name.log"; } >> "$OUT/suite.log"
  echo "== $name rc=$rc $(( $(date +%s) - t0 ))s"; tail -n 25 "/tmp/$name.log"
}
B="python3 -m tandem.main bench --skip-tokenizer-init"
OFF="env TANDEM_DISABLE_SMALL_M_LINEAR=1 TANDEM_DISABLE_FUSED_GREEDY=1"  # A/B: cuBLAS + torch greedy sampling
kit() {  # once per machine; call it in a subshell: it sets PYTHONPATH
  source .devkit/install.sh || return 1
  local mark=/tmp/devkit-site/.extra-$(ls .devkit/extra 2>/dev/null | wc -l)  # a wheel added: installed again
  if [ -d .devkit/extra ] && [ ! -f $mark ]; then  # aiohttp: the bench's load generator; pybase64
    python3 -m pip install -q --no-index --no-deps --upgrade --target /tmp/devkit-site .devkit/extra/*.whl && touch $mark
  fi
  if [ -f .devkit/transformers.tar.xz ] && [ ! -f /tmp/devkit-site/.transformers ]; then  # ahead of the machine's 5.17 (devkit_extra.sh says why)
    rm -rf /tmp/devkit-site/transformers && tar -xJf .devkit/transformers.tar.xz -C /tmp/devkit-site \
      && python3 -m compileall -q -j 0 /tmp/devkit-site/transformers > /dev/null && touch /tmp/devkit-site/.transformers
  fi  # bytecode compiled here, as pip does at install: a fresh machine's start-up is timed after the install
}  # once per machine; call it in a subshell: it sets PYTHONPATH
card=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -n 1)
for s in "$@"; do case $s in
  auto)  # a call's worth by card: an H200 measures the issue's rows as the defaults stand (serve's ready first: a fresh machine), an H100 this tree's batch-1 ITL against ab/42b0ec8's (itlab)
    echo "card: $card" | tee -a "$OUT/suite.log"
    if [[ $card == *H200* ]]; then bash "$0" coldstart itl bench06q bench8q bench06q64 http06proc; else bash "$0" itlab; fi ;;
  itlab)  # batch-1 ITL of this tree against ab/$AB_REV's (scripts/tree_ab.sh prepare REV here; carry "ab"), alternating, 3 rounds
    step itlab 300 bash scripts/tree_ab.sh run "${AB_REV:-42b0ec8}" 3 -- python3 -m tandem.main bench --skip-tokenizer-init --preset qwen3-0.6b --num-prompts 1 --input-len 512 --output-len 256 --runs 3 --stream-mode stream ;;
  startab) ( kit || exit 1  # serve's start: does the core import transformers; the dry pass's walk (warm cache: compiling ahead forced vs off); then empty Triton caches
      step startab-imports 60 python3 -c "import sys, time; t = time.time(); import engine.core.process_main, engine.core.setup, engine.attention.triton; print('core chain', round(time.time() - t, 2), 's; transformers imported:', 'transformers' in sys.modules)"
      for v in 1 0 1 0; do step startab-ahead$v 60 env TANDEM_COMPILE_AHEAD=$v python3 scripts/serve_ready_probe.py --preset qwen3-8b --runs 1; done
      for w in 16 4 1; do step startab-empty-w$w 90 env TANDEM_COMPILE_WORKERS=$w TRITON_CACHE_DIR=$(mktemp -d) python3 scripts/serve_ready_probe.py --preset qwen3-8b --runs 1; done ) ;;  # does compiling scale with threads (or hold the GIL)?
  cublasinv) for ws in default :0:0 :4096:8; do  # is cuBLAS batch-invariant under some workspace setting (no split-K)? a lead for the det-cost row
      step cublasinv$ws 90 env $([[ $ws != default ]] && echo CUBLAS_WORKSPACE_CONFIG=$ws) python3 scripts/cublas_invariance_probe.py; done ;;
  replaygpu) step replaygpu 120 python3 -m pytest -q -rfE -p no:cacheprovider tests/gpu/test_top_p_replay_gpu.py ;;  # slime's top-p replay: KeptIds behind its event, overlap + graphs
  auto2)  # the second call: the det-cost row at bs 256, then (an H200) constrained decoding's
    if [[ $card == *H200* ]]; then bash "$0" detcost256 grammarproc; else bash "$0" detcost256; fi ;;
  auto3) bash "$0" grpot1 ;;
  grpofab) for v in 0 1; do  # the fused sampler on the issue's GRPO row (8B, T = 1, radix on), both sides in one call
      step grpofab-$v 140 env TANDEM_FUSED_SAMPLE=$v $B --preset qwen3-8b --workload grpo --num-prompts 32 --n 16 --input-len 1024 --output-len 256 --runs 3 --stream-mode final --temperature 1.0 --json "$OUT/grpo-t1-fused-$v.json"; done ;;
  coldstart) ( kit  # first on a fresh machine: serve's time to ready (cold, then warm); what the starts left in the page cache
      step coldstart 200 python3 scripts/serve_ready_probe.py --preset qwen3-8b --runs 2
      step pagecache 60 python3 scripts/page_cache_probe.py --top 45 ) ;;
  coldab) ( kit  # serve's time to ready with the packages evicted from the page cache and empty Triton / Inductor caches (the readahead A/B of 2026-12-07: engine/readahead.py, since removed)
      step coldab 120 env TRITON_CACHE_DIR=$(mktemp -d) TORCHINDUCTOR_CACHE_DIR=$(mktemp -d) python3 scripts/serve_ready_probe.py --preset qwen3-8b --runs 1 --evict ) ;;
  detprof) for f in --enable-deterministic-inference ""; do  # det-cost row at bs 256: one profiled run a mode, where the 7.7% goes
      step detprof$f 110 $B --preset qwen3-8b --num-prompts 256 --input-len 512 --output-len 256 --runs 1 --stream-mode final --profile 40 $f; done ;;
  detab) ( kit  # the matmul and attention sweeps at the det-cost row's shapes (its 3-stage attention A/B was dropped: no gain)
      step detab-mm 120 python3 scripts/bi_matmul_bench.py --ms 256,8192 --no-norms
      step detab-attnsweep 100 python3 scripts/gpu_attention_bench.py --bs 256 --ctx 768 --sweep ) ;;
  dettiles) ( kit  # det mode's taller prefill tiles (bits vs the 16-row tile, time), then the matmul tiles at decode's M = 256
      step dettiles-attn 150 python3 scripts/det_extend_tile_probe.py
      step dettiles-mm 380 python3 scripts/bi_matmul_bench.py --configs --shapes gate_up,qkv,lm_head --ms 256 --no-norms ) ;;
  detext) ( kit  # det mode's 32-row prefill tile: the det GPU tests, 8B trials in five modes, then the det-cost row with it (32) and without (16), and normal mode
      step detext-tests 170 python3 -m pytest -q -rfE -p no:cacheprovider tests/gpu/test_triton_attention_gpu.py tests/gpu/test_policy_parity_gpu.py tests/gpu/test_batch_invariant_gpu.py
      step detext-trials 130 python3 -m tandem.main determinism --preset qwen3-8b --dtype bfloat16 --skip-tokenizer-init --enable-deterministic-inference --chunked-prefill-size 1024 --mode all --trials 10 --max-new-tokens 16 --json "$OUT/determinism-8b-ext.json"
      for v in 32 16; do step detext-$v 100 env TANDEM_DET_EXTEND_ROWS=$v $B --preset qwen3-8b --num-prompts 256 --input-len 512 --output-len 256 --runs 3 --stream-mode final --enable-deterministic-inference --json "$OUT/detext-$v.json"; done
      step detext-normal 90 $B --preset qwen3-8b --num-prompts 256 --input-len 512 --output-len 256 --runs 3 --stream-mode final --json "$OUT/detext-normal.json" ) ;;
  detgreedy) ( kit  # det mode's greedy token + logprob in one read: its GPU tests, policy parity, 8B trials, then the det-cost row with it and without, and normal mode
      step detgreedy-tests 150 python3 -m pytest -q -rfE -p no:cacheprovider tests/gpu/test_batch_invariant_gpu.py tests/gpu/test_policy_parity_gpu.py -k "greedy or log_softmax or parity or policy"
      step detgreedy-trials 100 python3 -m tandem.main determinism --preset qwen3-8b --dtype bfloat16 --skip-tokenizer-init --enable-deterministic-inference --chunked-prefill-size 1024 --mode all --trials 10 --max-new-tokens 16 --json "$OUT/determinism-8b-greedy.json"
      for v in "" 1; do step detgreedy-off$v 80 env TANDEM_DISABLE_FUSED_GREEDY=$v $B --preset qwen3-8b --num-prompts 256 --input-len 512 --output-len 256 --runs 3 --stream-mode final --enable-deterministic-inference --json "$OUT/detgreedy-off$v.json"; done
      step detgreedy-normal 80 $B --preset qwen3-8b --num-prompts 256 --input-len 512 --output-len 256 --runs 3 --stream-mode final --json "$OUT/detgreedy-normal.json" ) ;;
  grpofprof) for v in 1 0; do  # the same row, one profiled run a side: where a loss goes
      step grpofprof-$v 110 env TANDEM_FUSED_SAMPLE=$v $B --preset qwen3-8b --workload grpo --num-prompts 32 --n 16 --input-len 1024 --output-len 256 --runs 1 --stream-mode final --temperature 1.0 --profile 20; done ;;
  t1tiny)  # t1last at its smallest: the tests, then each side of the A/B at 2 runs
    step t1tiny-tests 110 python3 -m pytest -q -x -rfE -p no:cacheprovider tests/gpu/test_gumbel_sample_gpu.py
    for v in 1 0; do step t1tiny-$v 55 env TANDEM_FUSED_SAMPLE=$v $B --preset qwen3-0.6b --num-prompts 256 --input-len 512 --output-len 256 --runs 2 --stream-mode final --temperature 1.0 --json "$OUT/t1-fused-$v.json"; done ;;
  t1last)  # the fused sampler's GPU tests and its A/B in one short call (the device budget's last minutes)
    step t1last-tests 150 python3 -m pytest -q -rfE -p no:cacheprovider tests/gpu/test_gumbel_sample_gpu.py
    for v in 1 0; do step t1last-$v 80 env TANDEM_FUSED_SAMPLE=$v $B --preset qwen3-0.6b --num-prompts 256 --input-len 512 --output-len 256 --runs 3 --stream-mode final --temperature 1.0 --json "$OUT/t1-fused-$v.json"; done ;;
  t1tests) step t1tests 200 python3 -m pytest -q -rfE -p no:cacheprovider tests/gpu/test_gumbel_sample_gpu.py tests/gpu/test_decode_kernels_gpu.py -k "gumbel or sample" ;;  # the fused sampling kernel bitwise, engines fused vs not
  t1ab2) for v in 0 1; do  # sampled decoding (T = 1), 0.6B, 256 x (512, 256): log_softmax + the noise kernel (0) vs gumbel_sample (1)
      step t1ab2-$v 100 env TANDEM_FUSED_SAMPLE=$v $B --preset qwen3-0.6b --num-prompts 256 --input-len 512 --output-len 256 --runs 3 --stream-mode final --temperature 1.0 --json "$OUT/t1-fused-$v.json"; done ;;
  grpot1) for f in "" --disable-radix-cache; do  # the issue's GRPO row as it is written: T = 1, radix cache on vs off
      step grpot1$f 120 $B --preset qwen3-8b --workload grpo --num-prompts 32 --n 16 --input-len 1024 --output-len 256 --runs 3 --stream-mode final --temperature 1.0 $f --json "$OUT/grpo-t1$f.json"; done ;;
  proft1) step proft1 90 $B --preset qwen3-0.6b --num-prompts 256 --input-len 512 --output-len 256 --runs 1 --stream-mode final --temperature 1.0 --profile 25 ;;
  detcost256) for f in "" --enable-deterministic-inference; do  # the issue's det-cost row at bs 256
      step detcost256$f 150 $B --preset qwen3-8b --num-prompts 256 --input-len 512 --output-len 256 --runs 3 --stream-mode final $f --json "$OUT/detcost256$f.json"; done ;;
  gpuall) ( kit && files=$(ls tests/gpu/test_*.py | grep -v -e flashinfer -e test_train_gpu)  # every GPU test but training; flashinfer's JIT-compiling ones last
    step gpuall 540 python3 -m pytest -q -p no:cacheprovider -rfE --durations=30 $files tests/weight_sync/test_nccl_gpu.py \
      tests/engine_client/test_engine_actor.py tests/gpu/test_flashinfer_attention_gpu.py ) ;;
  sync8q) ( kit && step sync8q 120 python3 -m tandem.main bench-sync --preset qwen3-8b --transport cuda-ipc --num-updates 7 --cuda-graph-max-bs 8 --json "$OUT/sync-8b-ipc.json" ) ;;
  allgpu) ( kit && step allgpu 420 python3 -m pytest -q -p no:cacheprovider --ignore=tests/gpu/test_train_gpu.py tests/gpu ) ;;
  memrel) ( kit && step memrel 90 python3 -m pytest -q -s -rfE -p no:cacheprovider tests/gpu/test_memory_saver_gpu.py -k release_frees ) ;;
  memorder) ( kit && step memorder 90 python3 -m pytest -q -s -rfE -p no:cacheprovider tests/gpu/test_core_process_gpu.py tests/gpu/test_memory_saver_gpu.py -k "killed_core or release_frees" ) ;;  # the memory test right after an engine process exits
  memsaver) ( kit && step memsaver 240 python3 -m pytest -q -s -rfE -p no:cacheprovider tests/gpu/test_memory_saver_gpu.py tests/gpu/test_colocate_gpu.py ) ;;
  probe) ( kit && step probe 200 python3 scripts/memory_cycles_probe.py --cycles 30 --json "$OUT/mem-probe.json" ) ;;
  grammargpu) ( kit && step grammargpu 150 python3 -m pytest -q -rfE -p no:cacheprovider tests/gpu/test_grammar_gpu.py ) ;;
  grammarbench) ( kit && step grammarbench 240 python3 scripts/grammar_bench.py --batch 64 --runs 3 --engine-args '{"grammar_backend": "thread"}' --json "$OUT/grammar-bench.json" ) ;;
  gatetests) ( kit && step gatetests 150 python3 -m pytest -q -rfE -p no:cacheprovider tests/gpu/test_stream_gate_gpu.py tests/gpu/test_grammar_gpu.py ) ;;
  grammargate) ( kit && step grammargate 400 python3 scripts/grammar_bench.py --batch 64 --runs ${RUNS:-5} --variants ${VARIANTS:-prefetch,nogate,prefetch2,nogate2} --engine-args '{"grammar_backend": "thread"}' --json "$OUT/grammar-gate.json" ) ;;
  grammarproc) ( kit && step grammarproc 300 python3 scripts/grammar_bench.py --batch 64 --runs ${RUNS:-5} --variants ${VARIANTS:-prefetch,prefetch2} --profile ${PROFILE:-0} --engine-args '{"grammar_backend": "process"}' --json "$OUT/grammar-proc.json" ) ;;
  hostprobe) ( kit && step hostprobe 150 python3 scripts/grammar_host_probe.py ) ;;
  grammarab) ( kit && step grammarab 420 python3 scripts/grammar_bench.py --batch 64 --runs 5 --variants prefetch,noprefetch,prefetch2 --engine-args '{"grammar_backend": "thread"}' --json "$OUT/grammar-ab.json" ) ;;
  train06*|train4b*)  # train06 | train06det | train4b | train4bdet (| train06keepdet: graphs kept; | train06z2det: ZeRO-2, not the recipe's 3, on one GPU; | train06lora[det]: LoRA RL, rank 16 on all linears): the qwen3_gpu recipe, 5 steps, peak device memory sampled
    ( kit; model=qwen3-0.6b; [[ $s == train4b* ]] && model=qwen3-4b; det=false; [[ $s == *det ]] && det=true
      nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -lms 250 > "$OUT/smi-$s.csv" & smi=$!
      lim=170; extra=(); [[ $s == train4b* ]] && lim=260 && extra=(--engine-args '{"mem_fraction_static": 0.25, "enable_memory_saver": true}')
      [[ $s == *keep* ]] && extra+=(--keep-cuda-graphs true)
      [[ $s == *z2* ]] && extra+=(--zero-stage 2)
      [[ -n ${MICRO:-} ]] && extra+=(--micro-batch-size $MICRO)
      [[ $s == *lora* ]] && extra+=(--lora-rank 16 --lora-alpha 32 --lora-target-modules all-linear --trainer torch)
      step "$s" $lim python3 -m tandem.main train --recipe qwen3_gpu --model $model --steps 5 --deterministic $det \
        --save-checkpoint false --wandb false --quiet --output-dir "$OUT/$s" "${extra[@]}"
      kill $smi; echo "peak device MiB: $(sort -n "$OUT/smi-$s.csv" | tail -1)" >> "$OUT/suite.log" ) ;;
  trainprof)  # the recipe's train phase: normal mode's trainer profiled, then ZeRO 2 / 3 with and without cuBLAS linears
    ( kit && step trainprof-z2prof 200 python3 scripts/train_step_profile.py --zero-stage 2 --normal-mode --steps 1 --profile  # timed out at 130 s with 3 steps
      step trainprof-z3 100 python3 scripts/train_step_profile.py --zero-stage 3
      step trainprof-z2fast 100 python3 scripts/train_step_profile.py --zero-stage 2 --normal-mode
      step trainprof-z2 100 python3 scripts/train_step_profile.py --zero-stage 2
      step trainprof-z3fast 100 python3 scripts/train_step_profile.py --zero-stage 3 --normal-mode ) ;;
  trainfast)  # the normal-mode trainer (flash varlen, torch ops under autograd): its tests, one profiled step, micro batch sizes, det mode
    ( kit && step trainattn 150 python3 -m pytest -q -rfE -p no:cacheprovider tests/gpu/test_trainer_kernels_gpu.py tests/gpu/test_policy_parity_gpu.py
      [[ -z ${NOPROF:-} ]] && step trainfast-prof 120 python3 scripts/train_step_profile.py --zero-stage 2 --normal-mode --micro-batch-size 32 --steps 1 --profile
      for m in ${MICROS:-16 32}; do step trainfast-m$m 90 python3 scripts/train_step_profile.py --zero-stage 2 --normal-mode --micro-batch-size $m; done
      [[ -n ${DET:-} ]] && step traindet-m16 120 python3 scripts/train_step_profile.py --zero-stage 2 --micro-batch-size 16 ) ;;
  serveready) ( kit && step serveready 300 python3 scripts/serve_ready_probe.py --preset qwen3-8b --runs 2 ) ;;  # first on a fresh machine: cold, then warm
  phaseprobe) ( kit && step phaseprobe 150 python3 scripts/colocate_phase_probe.py --cycles 5 ) ;;  # release / resume phases, graphs kept
  cycles) ( kit && step cycles 150 python3 -m pytest -q -s -x -rfE -p no:cacheprovider tests/gpu/test_memory_saver_gpu.py -k cycles ) ;;
  restgpu) ( kit && step restgpu 240 python3 -m pytest -q -rfE -p no:cacheprovider tests/gpu/test_core_process_gpu.py tests/gpu/test_colocate_gpu.py tests/gpu/test_server_gpu.py tests/engine/test_sampling.py tests/engine/test_atomic_updates.py ) ;;
  newgpu) ( kit && step newgpu 300 python3 -m pytest -q -rfE -p no:cacheprovider tests/gpu/test_weight_sync_gpu.py tests/gpu/test_memory_saver_gpu.py tests/gpu/test_core_process_gpu.py tests/gpu/test_colocate_gpu.py tests/gpu/test_server_gpu.py tests/engine/test_sampling.py tests/engine/test_atomic_updates.py ) ;;
  traingpu) ( kit && step traingpu 220 python3 -m pytest -q -s -p no:cacheprovider tests/gpu/test_train_gpu.py ) ;;
  sync8) ( kit && step sync8 120 python3 -m tandem.main bench-sync --preset qwen3-8b --transport cuda-ipc --num-updates 7 --cuda-graph-max-bs 8 --json "$OUT/sync-8b-ipc.json" \
           && step sync8long 150 python3 -m tandem.main bench-sync --preset qwen3-8b --transport cuda-ipc --num-updates 200 --cuda-graph-max-bs 8 --json "$OUT/sync-8b-ipc-200.json" \
           && step sync8inproc 90 python3 -m tandem.main bench-sync --preset qwen3-8b --transport inprocess --num-updates 7 --cuda-graph-max-bs 8 --json "$OUT/sync-8b-inproc.json" ) ;;
  http06*)  # http06 | http06proc: tandem serve (thread core | --core-process) driven by bench --url at 256 and 64 concurrent
    ( kit; flag=""; tag=thread; [[ $s == *proc ]] && flag="--core-process" && tag=proc
      python3 -m tandem.main tiny-model --out /tmp/q06 --preset qwen3-0.6b > /dev/null
      python3 -m tandem.main serve --model-path /tmp/q06 --load-format dummy --skip-tokenizer-init --port 30001 $flag > "/tmp/serve-$tag.log" 2>&1 &
      pid=$!; for i in $(seq 90); do curl -sf localhost:30001/health > /dev/null && break; sleep 1; done
      for n in 256 64; do step "http06-$tag-$n" 120 python3 -m tandem.main bench --url http://127.0.0.1:30001 --num-prompts $n --input-len 512 --output-len 256 --stream-mode final --runs 3 --json "$OUT/http06-$tag-$n.json"; done
      kill $pid; wait $pid; tail -5 "/tmp/serve-$tag.log" >> "$OUT/suite.log" ) ;;
  bench06q64) step bench06q64 70 $B --preset qwen3-0.6b --num-prompts 64 --input-len 512 --output-len 256 --runs 3 --stream-mode final --json "$OUT/bench-qwen3-0.6b-64.json" ;;
  httpsplit)  # HTTP's 64-concurrent gap split: in-process with the core on a thread, then in its own process (the pipe, no HTTP)
    step bench06q64 70 $B --preset qwen3-0.6b --num-prompts 64 --input-len 512 --output-len 256 --runs 3 --stream-mode final --json "$OUT/bench-qwen3-0.6b-64.json"
    step bench06q64proc 90 $B --preset qwen3-0.6b --num-prompts 64 --input-len 512 --output-len 256 --runs 3 --stream-mode final --core-process --json "$OUT/bench-qwen3-0.6b-64-proc.json" ;;
  gpudet) step gpudet 120 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_batch_invariant_gpu.py tests/gpu/test_policy_parity_gpu.py ;;
  wsync) step wsync 120 python3 -m pytest -q -s -p no:cacheprovider tests/gpu/test_weight_sync_gpu.py ;;
  hfgpu) step hfgpu 110 python3 -m pytest -q -rfE -p no:cacheprovider tests/gpu/test_hf_greedy_gpu.py ;;
  gputests) step gputests 260 python3 -m pytest -q -p no:cacheprovider tests/gpu ;;
  bimatmul) step bimatmul 90 python3 scripts/bi_matmul_bench.py ;;
  det8) step det8 150 python3 -m tandem.main determinism --preset qwen3-8b --dtype bfloat16 --skip-tokenizer-init --enable-deterministic-inference --chunked-prefill-size 1024 --mode all --trials 50 --max-new-tokens 16 --json "$OUT/determinism-qwen3-8b.json" ;;
  attnbench) step attnbench 120 python3 scripts/gpu_attention_bench.py ;;
  fusedbench) step fusedbench 60 python3 scripts/fused_kernels_bench.py --json "$OUT/fused-kernels.json" ;;
  fusedtests) step fusedtests 90 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_fused_kernels_gpu.py ;;
  moetests) step moetests 130 python3 -m pytest -q -p no:cacheprovider -rfE -x tests/gpu/test_fused_moe_gpu.py ;;
  moegpu) step moegputests 170 python3 -m pytest -q -p no:cacheprovider -rfE tests/gpu/test_fused_moe_gpu.py  # fused MoE: tests, then the bench
    step moebench 120 python3 scripts/fused_moe_bench.py --json "$OUT/fused-moe.json" ;;
  bench30) step bench30 330 $B --preset qwen3-30b-a3b --num-prompts 256 --input-len 512 --output-len 256 --runs 3 --roofline --compare-hf --hf-num-prompts 32 --hf-runs 1 --stream-mode final --json "$OUT/bench-30b.json" ;;
  bench30q) step bench30q 200 $B --preset qwen3-30b-a3b --num-prompts 256 --input-len 512 --output-len 256 --runs 3 --stream-mode final --json "$OUT/bench-30b-q.json" ;;
  loragpu) ( kit && step loragpu 240 python3 -m pytest -q -s -rfE -p no:cacheprovider tests/gpu/test_lora_gpu.py tests/gpu/test_routes_gpu.py tests/gpu/test_cuda_graph.py ) ;;
  routesprobe) ( kit && step routesprobe 230 python3 scripts/routes_cost_probe.py --preset qwen3-30b-a3b ) ;;
  bench30det) step bench30det 200 $B --preset qwen3-30b-a3b --num-prompts 256 --input-len 512 --output-len 256 --runs 3 --stream-mode final --enable-deterministic-inference --json "$OUT/bench-30b-det.json" ;;
  bench30re) step bench30re 200 $B --preset qwen3-30b-a3b --num-prompts 256 --input-len 512 --output-len 256 --runs 3 --stream-mode final --enable-return-routed-experts --json "$OUT/bench-30b-routes.json" ;;
  det30) step det30 240 python3 -m tandem.main determinism --preset qwen3-30b-a3b --dtype bfloat16 --skip-tokenizer-init --enable-deterministic-inference --chunked-prefill-size 1024 --mode all --trials 20 --max-new-tokens 16 --json "$OUT/determinism-30b.json" ;;
  sync30) ( kit && step sync30 240 python3 -m tandem.main bench-sync --preset qwen3-30b-a3b --transport cuda-ipc --num-updates 7 --cuda-graph-max-bs 8 --json "$OUT/sync-30b-ipc.json" ) ;;
  train30det)  # the qwen3_gpu recipe on Qwen3-30B-A3B's shape at 4 of 48 layers: routes measured against the trainer's
    ( kit; nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -lms 250 > "$OUT/smi-$s.csv" & smi=$!
      step "$s" 300 python3 -m tandem.main train --recipe qwen3_gpu --model qwen3-30b-a3b-4l --steps 3 --deterministic true \
        --routed-experts measure --save-checkpoint false --wandb false --quiet --output-dir "/tmp/$s"
      cp "/tmp/$s/metrics.jsonl" "$OUT/$s-metrics.jsonl"
      kill $smi; echo "peak device MiB: $(sort -n "$OUT/smi-$s.csv" | tail -1)" >> "$OUT/suite.log" ) ;;
  gpuover) step gpuover 80 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_overlap_gpu.py tests/gpu/test_cuda_graph.py ;;
  bench8q) step bench8q 90 $B --preset qwen3-8b --num-prompts 256 --input-len 512 --output-len 256 --runs 3 --roofline --stream-mode final --json "$OUT/bench-qwen3-8b-v2.json" ;;
  bench06q) step bench06q 70 $B --preset qwen3-0.6b --num-prompts 256 --input-len 512 --output-len 256 --runs 3 --roofline --stream-mode final --json "$OUT/bench-qwen3-0.6b-v2.json" ;;
  bench06) step bench06 150 $B --preset qwen3-0.6b --num-prompts 256 --input-len 512 --output-len 256 --runs 3 --compare-hf --hf-runs 1 --roofline --stream-mode final --json "$OUT/bench-qwen3-0.6b.json" ;;
  bench8) step bench8 200 $B --preset qwen3-8b --num-prompts 256 --input-len 512 --output-len 256 --runs 3 --compare-hf --hf-runs 1 --roofline --stream-mode final --json "$OUT/bench-qwen3-8b.json" ;;
  grpo8) step grpo8 100 $B --preset qwen3-8b --workload grpo --num-prompts 32 --n 16 --input-len 1024 --output-len 256 --runs 3 --stream-mode final --json "$OUT/grpo-8b.json" ;;
  grpo8nc) step grpo8nc 180 $B --preset qwen3-8b --workload grpo --num-prompts 32 --n 16 --input-len 1024 --output-len 256 --runs 3 --stream-mode final --disable-radix-cache --json "$OUT/grpo-8b-nocache.json" ;;
  grpo8nocasc) step grpo8nocasc 100 $B --preset qwen3-8b --workload grpo --num-prompts 32 --n 16 --input-len 1024 --output-len 256 --runs 3 --stream-mode final --disable-cascade-attn --json "$OUT/grpo-8b-nocascade.json" ;;
  gpufirst) ( kit && step gpufirst ${LIMIT:-480} python3 -m pytest -q -p no:cacheprovider -rfE --durations=15 tests/gpu/test_batch_invariant_gpu.py \
      tests/gpu/test_cascade_gpu.py tests/gpu/test_colocate_gpu.py tests/gpu/test_core_process_gpu.py tests/gpu/test_fused_kernels_gpu.py \
      tests/gpu/test_fused_moe_gpu.py tests/gpu/test_grammar_gpu.py tests/weight_sync/test_nccl_gpu.py tests/engine_client/test_engine_actor.py \
      tests/gpu/test_flashinfer_attention_gpu.py ) ;;  # gpufirst + gpurest = gpuall + cascade, in two calls
  gpurest) ( kit && step gpurest ${LIMIT:-360} python3 -m pytest -q -p no:cacheprovider -rfE --durations=15 tests/gpu/test_cuda_graph.py \
      tests/gpu/test_triton_attention_gpu.py tests/gpu/test_overlap_gpu.py tests/gpu/test_lora_gpu.py tests/gpu/test_memory_saver_gpu.py \
      tests/gpu/test_hf_greedy_gpu.py tests/gpu/test_policy_parity_gpu.py tests/gpu/test_stream_gate_gpu.py tests/gpu/test_sampler_warmup_gpu.py \
      tests/gpu/test_routes_gpu.py tests/gpu/test_weight_sync_gpu.py tests/gpu/test_server_gpu.py ) ;;  # the second half of gpuall (which outgrew one call on a cold machine)
  configprobe)  # what AutoConfig.from_pretrained imports in a fresh process (the core's `config` phase: 4.8 s on the H100's transformers)
    ( kit && python3 -m tandem.main tiny-model --out /tmp/q8cfg --preset qwen3-8b > /dev/null
      step configprobe 90 bash -c 'python3 -c "import transformers; print(\"transformers\", transformers.__version__)"
        python3 -X importtime -c "import sys, time, torch, transformers; from transformers import AutoConfig; print(\"MARK\", file=sys.stderr, flush=True); t = time.time(); AutoConfig.from_pretrained(\"/tmp/q8cfg\"); print(\"from_pretrained s\", time.time() - t)" 2> /tmp/imp.log
        sed -n "/^MARK/,\$p" /tmp/imp.log | sort -t"|" -k2 -n -r | head -40' ) ;;
  importprobe)  # the core process's imports (its "before engine" phase: 7.5 s warm on an H100, 2.9 s on a CPU host): each heavy module alone, then the chain
    ( kit && step importprobe 90 bash -c 'for m in torch triton transformers engine.core.engine_core; do python3 -c "import time; t = time.time(); import $m; print(\"$m\", round(time.time() - t, 2), \"s\")"; done
        python3 -X importtime -c "import engine.core.engine_core" 2> /tmp/imp2.log; sort -t"|" -k2 -n -r /tmp/imp2.log | head -40' ) ;;
  gpuother) ( kit && step gpuother ${LIMIT:-540} python3 -m pytest -q -p no:cacheprovider -rfE --durations=15 tests/gpu/test_decode_kernels_gpu.py \
      tests/gpu/test_trainer_kernels_gpu.py tests/gpu/test_train_gpu.py tests/gpu/test_opt_in_switches_gpu.py ) ;;  # the GPU files gpufirst + gpurest leave out
  cascadegpu) step cascadegpu 150 python3 -m pytest -q -s -rfE -p no:cacheprovider tests/gpu/test_cascade_gpu.py ;;
  grpo8once) step grpo8once 100 $B --preset qwen3-8b --workload grpo --num-prompts 32 --n 16 --input-len 1024 --output-len 256 --runs 1 --warmup-runs 0 --stream-mode final --json "$OUT/grpo-8b-once.json" ;;
  grpo8nconce) step grpo8nconce 110 $B --preset qwen3-8b --workload grpo --num-prompts 32 --n 16 --input-len 1024 --output-len 256 --runs 1 --warmup-runs 0 --stream-mode final --disable-radix-cache --json "$OUT/grpo-8b-nocache-once.json" ;;
  fitests) ( kit && step fitests 200 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_flashinfer_attention_gpu.py ) ;;
  bench06fi) ( kit && step bench06fi 130 $B --preset qwen3-0.6b --num-prompts 256 --input-len 512 --output-len 256 --runs 3 --roofline --stream-mode final --attention-backend flashinfer --json "$OUT/bench-qwen3-0.6b-fi.json" ) ;;
  lora8)  # issue 26's H200 points in one call: 256 x (512, 256) on the base, 1 adapter, 8 adapters mixed
    # (rank 16, all linears), then the adapter push by CUDA IPC from a spawned trainer; the ratios last
    # LORA_NS="0 1" LORA_PUSH=0: a subset
    ( kit; for n in ${LORA_NS:-0 1 8}; do
        step "lora8-$n" $(( n == 0 ? 100 : n == 1 ? 110 : 130 )) $B --preset qwen3-8b --num-prompts 256 --input-len 512 \
          --output-len 256 --runs 3 --stream-mode final --lora-adapters $n --lora-rank 16 --json "$OUT/lora8-$n.json"
      done
      [ "${LORA_PUSH:-1}" = 1 ] && step lora8push 90 python3 -m tandem.main bench-sync --preset qwen3-8b --transport cuda-ipc --trainer process \
        --lora-rank 16 --num-updates 20 --cuda-graph-max-bs 8 --json "$OUT/lora8-push.json"
      python3 scripts/summarize_lora.py $(ls "$OUT"/lora8-{0,1,8,push}.json 2>/dev/null) \
        | tee -a "$OUT/suite.log" ) ;;
  bench8fi) ( kit && step bench8fi 150 $B --preset qwen3-8b --num-prompts 256 --input-len 512 --output-len 256 --runs 3 --roofline --stream-mode final --attention-backend flashinfer --json "$OUT/bench-qwen3-8b-fi.json" ) ;;
  decodek) step decodek 260 python3 scripts/decode_kernels_bench.py
    step decodektests 120 python3 -m pytest -q -rfE -p no:cacheprovider tests/gpu/test_decode_kernels_gpu.py ;;  # small_m_linear, greedy_logprob
  itlold) step itlold 45 $OFF $B --preset qwen3-0.6b --num-prompts 1 --input-len 512 --output-len 256 --runs 3 --stream-mode stream --json "$OUT/itl-bs1-old.json" ;;
  bench06qold) step bench06qold 70 env TANDEM_DISABLE_FUSED_GREEDY=1 $B --preset qwen3-0.6b --num-prompts 256 --input-len 512 --output-len 256 --runs 3 --roofline --stream-mode final --json "$OUT/bench-qwen3-0.6b-old.json" ;;
  bs1final) step bs1final 45 $B --preset qwen3-0.6b --num-prompts 1 --input-len 512 --output-len 256 --runs 3 --stream-mode final --json "$OUT/bs1-final.json" ;;  # the step time without per-token messages
  bs1finalold) step bs1finalold 45 $OFF $B --preset qwen3-0.6b --num-prompts 1 --input-len 512 --output-len 256 --runs 3 --stream-mode final --json "$OUT/bs1-final-old.json" ;;
  decodegpu) step decodegpu 240 python3 -m pytest -q -rfE -p no:cacheprovider tests/gpu/test_decode_kernels_gpu.py tests/gpu/test_cuda_graph.py tests/gpu/test_overlap_gpu.py tests/gpu/test_hf_greedy_gpu.py tests/gpu/test_sampler_warmup_gpu.py ;;  # the tests the decode kernels touch
  stepprobe) step stepprobe 120 python3 scripts/step_time_probe.py --preset qwen3-0.6b --bs 1 --bs 256
    step stepprobeold 120 $OFF python3 scripts/step_time_probe.py --preset qwen3-0.6b --bs 1 --bs 256 ;;  # host vs device per decode step
  hostprof) step hostprof 150 python3 scripts/step_time_probe.py --preset qwen3-0.6b --bs 1 --bs 64 --host-profile 30 ;;  # where a host-bound step's time goes
  graphgpu) step graphgpu 200 python3 -m pytest -q -rfE -p no:cacheprovider tests/gpu/test_cuda_graph.py tests/gpu/test_cascade_gpu.py tests/gpu/test_triton_attention_gpu.py tests/gpu/test_overlap_gpu.py tests/gpu/test_decode_kernels_gpu.py ;;  # graphs, their plans and the decode kernels
  tableab) for v in 0 1; do  # the in-graph decode block table (0) vs launched from the host each step (1)
      step itl-table$v 45 env TANDEM_TABLE_OUTSIDE_GRAPH=$v $B --preset qwen3-0.6b --num-prompts 1 --input-len 512 --output-len 256 --runs 3 --stream-mode stream --json "$OUT/itl-table$v.json"
      step stepprobe-table$v 100 env TANDEM_TABLE_OUTSIDE_GRAPH=$v python3 scripts/step_time_probe.py --preset qwen3-0.6b --bs 1 --bs 256; done ;;
  epiab) for v in norm 1 0; do  # the small-M fused epilogue (norm: the default; 1: with the activation prologue) vs the launches one by one (0)
      step itl-epi$v 45 env TANDEM_SMALL_M_EPILOGUE=$v $B --preset qwen3-0.6b --num-prompts 1 --input-len 512 --output-len 256 --runs 3 --stream-mode stream --json "$OUT/itl-epi$v.json"
      step stepprobe-epi$v 100 env TANDEM_SMALL_M_EPILOGUE=$v python3 scripts/step_time_probe.py --preset qwen3-0.6b --bs 1 --bs 8; done ;;
  fuseab)  # the decode step at batch 1 under each layer fusion: epilogue + prologue, epilogue alone (the default), neither; then neither and no fused K/V store
    for v in "TANDEM_SMALL_M_EPILOGUE=1" "TANDEM_SMALL_M_EPILOGUE=norm" "TANDEM_SMALL_M_EPILOGUE=0" "TANDEM_DISABLE_FUSED_KV_STORE=1"; do
      step "stepprobe-$v" 80 env $v python3 scripts/step_time_probe.py --preset qwen3-0.6b --bs 1; done ;;
  fusetests)  # the layer fusions' GPU tests: the K/V store (on by default) bitwise and in HF's greedy tokens; the epilogues (opt-in) in the decode-kernel tests
    step fusetests-kv 120 python3 -m pytest -q -rfE -p no:cacheprovider tests/gpu/test_fused_kernels_gpu.py tests/gpu/test_hf_greedy_gpu.py -k "stores_kv or qk_norm_rope_bitwise or greedy"
    step fusetests-epi 150 env TANDEM_SMALL_M_EPILOGUE=1 python3 -m pytest -q -rfE -p no:cacheprovider tests/gpu/test_decode_kernels_gpu.py -k "epilogue or engine" ;;
  epibench) step epibench 120 python3 scripts/epilogue_bench.py ;;  # the fused epilogues vs the launches they replace, alone
  itl) step itl 45 $B --preset qwen3-0.6b --num-prompts 1 --input-len 512 --output-len 256 --runs 3 --stream-mode stream --json "$OUT/itl-bs1.json" ;;
  gumbelgpu) step gumbelgpu 200 python3 -m pytest -q -rfE -p no:cacheprovider tests/gpu/test_decode_kernels_gpu.py -k gumbel
    step gumbelwarm 120 env TANDEM_TRITON_GUMBEL=1 python3 -m pytest -q -s -rfE -p no:cacheprovider tests/gpu/test_sampler_warmup_gpu.py ;;  # the Triton noise kernel: tokens, warm-up
  readyab) for v in 0 1; do  # serve ready, 8B, torch.compile's sampler (0) vs the Triton kernel (1), both with empty compile caches
    step readyab-$v 280 env TANDEM_TRITON_GUMBEL=$v TRITON_CACHE_DIR=$(mktemp -d) TORCHINDUCTOR_CACHE_DIR=$(mktemp -d) python3 scripts/serve_ready_probe.py --preset qwen3-8b --runs 1; done ;;
  aheadab) ( kit && for v in 0 1; do  # serve ready, 8B, empty Triton cache: kernels compiled one by one in the captures (0) vs on a pool before them (1)
      step aheadab-$v 280 env TANDEM_COMPILE_AHEAD=$v TRITON_CACHE_DIR=$(mktemp -d) python3 scripts/serve_ready_probe.py --preset qwen3-8b --runs 1; done ) ;;
  readyall) ( kit && python3 -c "import torch, transformers, fastapi" && for v in ${READY_VARIANTS:-now}; do  # serve ready, 8B, empty compile caches then warm, per start-up lever:
      # now: the defaults;
      # the levers of 2026-12-06 (READY_VARIANTS="old g1 g1w1 g1w1a"): old: torch.compile's noise kernel, 2 warm-ups a
      # graph, no compile ahead; g1: the Triton noise kernel; w1: one warm-up; a: compiled ahead
      env=(TRITON_CACHE_DIR=$(mktemp -d) TORCHINDUCTOR_CACHE_DIR=$(mktemp -d) TANDEM_COMPILE_AHEAD=0 TANDEM_GRAPH_WARMUPS=2 TANDEM_TRITON_GUMBEL=0)
      [[ $v == now ]] && env=("${env[@]:0:2}")
      [[ $v == *g1* ]] && env+=(TANDEM_TRITON_GUMBEL=1); [[ $v == *w1* ]] && env+=(TANDEM_GRAPH_WARMUPS=1); [[ $v == *a ]] && env+=(TANDEM_COMPILE_AHEAD=1)
      step "readyall-$v" 200 env "${env[@]}" python3 scripts/serve_ready_probe.py --preset qwen3-8b --runs 2; done ) ;;
  tablegpu) step tablegpu 200 python3 -m pytest -q -rfE -p no:cacheprovider tests/engine/test_decode_table_triton.py tests/gpu/test_triton_attention_gpu.py tests/gpu/test_cuda_graph.py tests/gpu/test_cascade_gpu.py ;;  # the one-launch decode block table (default) on the device
  kerneltests) ( kit && step kerneltests 300 python3 -m pytest -q -rfE -p no:cacheprovider tests/gpu/test_decode_kernels_gpu.py tests/gpu/test_batch_invariant_gpu.py \
      tests/gpu/test_triton_attention_gpu.py tests/gpu/test_cuda_graph.py tests/gpu/test_hf_greedy_gpu.py tests/gpu/test_cascade_gpu.py \
      tests/gpu/test_overlap_gpu.py tests/gpu/test_policy_parity_gpu.py ) ;;  # the decode kernels, attention, graphs and det mode's matmul (gpurest2: the rest of gpurest)
  detgemv) ( kit  # TANDEM_DET_GEMV (the default since 2026-12-06, when this passed on an H100): its bitwise GPU tests, the policy-parity and HF-greedy tests and 20 determinism trials under it
    step detgemvtests 120 python3 -m pytest -q -rfE -p no:cacheprovider tests/gpu/test_batch_invariant_gpu.py -k "det_gemv or chain"
    step detgemvparity 180 env TANDEM_DET_GEMV=1 python3 -m pytest -q -rfE -p no:cacheprovider tests/gpu/test_policy_parity_gpu.py tests/gpu/test_hf_greedy_gpu.py
    step detgemvtrials 180 env TANDEM_DET_GEMV=1 python3 -m tandem.main determinism --preset qwen3-8b --dtype bfloat16 --skip-tokenizer-init --enable-deterministic-inference --chunked-prefill-size 1024 --mode all --trials 20 --max-new-tokens 16 --json "$OUT/determinism-detgemv.json" ) ;;
  detgemvab) for bs in 1 8; do  # 8B batch 1 / 8: normal, deterministic without and with TANDEM_DET_GEMV
      step detgemv-normal-bs$bs 60 $B --preset qwen3-8b --num-prompts $bs --input-len 512 --output-len 256 --runs 3 --stream-mode final --json "$OUT/detgemv-normal-bs$bs.json"
      for v in 0 1; do step detgemv-det$v-bs$bs 60 env TANDEM_DET_GEMV=$v $B --preset qwen3-8b --num-prompts $bs --input-len 512 --output-len 256 --runs 3 --stream-mode final --enable-deterministic-inference --json "$OUT/detgemv-det$v-bs$bs.json"; done; done ;;
  grammarprocab) ( kit && for tree in ab_base .; do  # the grammar process's ratio on the base tree (ab_base: copied in and carried by the caller) then this one; this one profiled
      (cd $tree && step grammarproc-$(basename $(pwd)) 200 python3 scripts/grammar_bench.py --batch 64 --runs ${RUNS:-3} --variants prefetch,prefetch2 $([ $tree = . ] && echo --profile ${PROFILE:-25}) --engine-args '{"grammar_backend": "process"}' --json "$OUT/grammar-proc-$(basename $(pwd)).json"); done ) ;;
  t1treeab) for tree in ab_base .; do  # sampled decoding (T = 1), 0.6B, 256 x (512, 256) on the base tree then this one
      (cd $tree && step t1-$(basename $(pwd)) 80 $B --preset qwen3-0.6b --num-prompts 256 --input-len 512 --output-len 256 --runs 3 --stream-mode final --temperature 1.0 --json "$OUT/t1-$(basename $(pwd)).json"); done ;;
  masktests) ( kit && step masktests 200 python3 -m pytest -q -rfE -p no:cacheprovider tests/gpu/test_decode_kernels_gpu.py -k "masked or greedy" tests/gpu/test_grammar_gpu.py ) ;;
  gpurest2) ( kit && step gpurest2 300 python3 -m pytest -q -p no:cacheprovider -rfE --durations=10 tests/gpu/test_lora_gpu.py \
      tests/gpu/test_memory_saver_gpu.py tests/gpu/test_stream_gate_gpu.py tests/gpu/test_sampler_warmup_gpu.py tests/gpu/test_routes_gpu.py \
      tests/gpu/test_weight_sync_gpu.py tests/gpu/test_server_gpu.py ) ;;  # gpurest less kerneltests' files
  pdlab) for v in 0 1 wide; do  # programmatic dependent launch for batches <= 8 (wide: qkv, gate_up on the small-M gemv too): the batch-1 step (graph alone) and streamed ITL
      step stepprobe-pdl$v 80 env TANDEM_PDL=$v python3 scripts/step_time_probe.py --preset qwen3-0.6b --bs 1 --bs 8
      step itl-pdl$v 45 env TANDEM_PDL=$v $B --preset qwen3-0.6b --num-prompts 1 --input-len 512 --output-len 256 --runs 3 --stream-mode stream --json "$OUT/itl-pdl$v.json"; done ;;
  pfab) for v in 0 1; do  # the small-M gemv's L2 prefetch before its PDL wait: off (0), on (1); 0.6B: the graph alone at bs 1 and 8, streamed ITL
      step stepprobe-pf$v 80 env TANDEM_GEMV_PREFETCH=$v python3 scripts/step_time_probe.py --preset qwen3-0.6b --bs 1 --bs 8
      step itl-pf$v 45 env TANDEM_GEMV_PREFETCH=$v $B --preset qwen3-0.6b --num-prompts 1 --input-len 512 --output-len 256 --runs 3 --stream-mode stream --json "$OUT/itl-pf$v.json"; done ;;
  pfab8) for v in 0 1; do  # the same, 8B: the graph alone at bs 1 (its gate_up's slices past the L2 budget: part of each)
      step stepprobe8-pf$v 120 env TANDEM_GEMV_PREFETCH=$v python3 scripts/step_time_probe.py --preset qwen3-8b --bs 1; done ;;
  pftests) step pftests 200 python3 -m pytest -q -rfE -p no:cacheprovider tests/gpu/test_decode_kernels_gpu.py tests/gpu/test_batch_invariant_gpu.py -k "engine_batch_one or small_m or chain or det_gemv" ;;  # the gemv (its prefetch on) bitwise, the bs-1 engine
  gemvk) step gemvk 150 python3 scripts/decode_kernels_bench.py --quick --ms 1,8,16,32 --reps 10 ;;  # the small-M gemv vs cuBLAS up to 32 rows
  logitstests) step logitstests 240 env TANDEM_GRAPH_LOGITS=model python3 -m pytest -q -rfE -p no:cacheprovider tests/gpu/test_cuda_graph.py tests/gpu/test_hf_greedy_gpu.py tests/gpu/test_overlap_gpu.py tests/gpu/test_sampler_warmup_gpu.py ;;  # the graphs' logits in the model's dtype
  phaseab) for v in 0 32; do  # cascade phase A's programs a kv head: one a block (0) vs 32 taking blocks in turn; 0.6B 256 (nothing shared), 8B GRPO (shared)
      step phaseab-06-$v 80 env TANDEM_PHASE_A_PROGRAMS=$v $B --preset qwen3-0.6b --num-prompts 256 --input-len 512 --output-len 256 --runs 3 --roofline --stream-mode final --json "$OUT/phaseab-06-$v.json"
      step phaseab-grpo-$v 100 env TANDEM_PHASE_A_PROGRAMS=$v $B --preset qwen3-8b --workload grpo --num-prompts 32 --n 16 --input-len 1024 --output-len 256 --runs 3 --stream-mode final --json "$OUT/phaseab-grpo-$v.json"; done ;;
  t1now) step t1now-06 90 $B --preset qwen3-0.6b --num-prompts 256 --input-len 512 --output-len 256 --runs 3 --stream-mode final --temperature 1.0 --json "$OUT/t1-06-now.json"  # sampled decoding: one log_softmax at T = 1 (ab_base in t1treeab for the tree before)
    step t1now-grpo 110 $B --preset qwen3-8b --workload grpo --num-prompts 32 --n 16 --input-len 1024 --output-len 256 --runs 3 --stream-mode final --temperature 1.0 --json "$OUT/t1-grpo-now.json" ;;
  qkk) for r in 1 2 4 8; do step qkk-$r 40 env TANDEM_QK_ROWS=$r python3 scripts/fused_kernels_bench.py --ops qk_norm_rope --inner 20 --reps 30; done ;;  # the q/k norm + rope kernel alone, heads a program
  ab06)  # 0.6B 256 x (512, 256): all three levers off, each alone, all on (qk rows 4, graph logits in bf16, phase A 32 programs)
    for v in "1 float32 0" "4 float32 0" "1 model 0" "1 float32 32" "4 model 32"; do set -- $v
      step "ab06-qk$1-$2-pa$3" 80 env TANDEM_QK_ROWS=$1 TANDEM_GRAPH_LOGITS=$2 TANDEM_PHASE_A_PROGRAMS=$3 $B --preset qwen3-0.6b --num-prompts 256 --input-len 512 --output-len 256 --runs 3 --roofline --stream-mode final --json "$OUT/ab06-qk$1-$2-pa$3.json"; done ;;
  qktests) step qktests 200 env TANDEM_QK_ROWS=4 python3 -m pytest -q -rfE -p no:cacheprovider tests/gpu/test_fused_kernels_gpu.py tests/gpu/test_hf_greedy_gpu.py ;;  # 4 heads a program: bitwise against the unfused path
  gemvtests) step gemvtests 240 python3 -m pytest -q -rfE -p no:cacheprovider tests/gpu/test_decode_kernels_gpu.py tests/gpu/test_batch_invariant_gpu.py -k "small_m or det_gemv or chain" ;;
  gemvab*)  # gemvab[16|32]: 8B at that batch (32 unless named), normal and deterministic, the gemv up to 8 rows vs 32 (the defaults: normal 8, deterministic 32)
    bs=${s#gemvab}; bs=${bs:-32}
    for v in 8 32; do
      step gemvab-normal-bs$bs-$v 100 env TANDEM_GEMV_MAX_M=$v $B --preset qwen3-8b --num-prompts $bs --input-len 512 --output-len 256 --runs 3 --stream-mode final --json "$OUT/gemvab-normal-bs$bs-$v.json"
      step gemvab-det-bs$bs-$v 100 env TANDEM_DET_GEMV_MAX_M=$v $B --preset qwen3-8b --num-prompts $bs --input-len 512 --output-len 256 --runs 3 --stream-mode final --enable-deterministic-inference --json "$OUT/gemvab-det-bs$bs-$v.json"; done ;;
  gemv06) for v in 8 32; do  # 0.6B at 32 rows, normal mode
      step gemv06-$v 80 env TANDEM_GEMV_MAX_M=$v $B --preset qwen3-0.6b --num-prompts 32 --input-len 512 --output-len 256 --runs 3 --stream-mode final --json "$OUT/gemv06-$v.json"; done ;;
  gemvdet) step gemvdet 200 env TANDEM_DET_GEMV_MAX_M=32 python3 -m tandem.main determinism --preset qwen3-8b --dtype bfloat16 --skip-tokenizer-init --enable-deterministic-inference --chunked-prefill-size 1024 --mode all --trials 10 --max-new-tokens 16 --json "$OUT/determinism-gemv32.json" ;;
  pdltests)  # PDL's GPU tests: bitwise against the plain engine; the kernels' own tests with PDL on; wide against cuBLAS's engine
    step pdltests-switch 540 python3 -m pytest -q -s -rfE -p no:cacheprovider tests/gpu/test_opt_in_switches_gpu.py
    step pdltests-kernels 200 env TANDEM_PDL=1 python3 -m pytest -q -rfE -p no:cacheprovider tests/gpu/test_decode_kernels_gpu.py tests/gpu/test_fused_kernels_gpu.py tests/gpu/test_triton_attention_gpu.py
    step pdltests-wide 150 env TANDEM_PDL=wide python3 -m pytest -q -rfE -p no:cacheprovider tests/gpu/test_decode_kernels_gpu.py -k "engine_batch_one or small_m" ;;
  t1ab) for v in 0 1; do  # sampled decoding (T = 1), 0.6B, 256 x (512, 256): torch.compile's noise kernel (0) vs Triton's (1)
    step t1ab-$v 90 env TANDEM_TRITON_GUMBEL=$v $B --preset qwen3-0.6b --num-prompts 256 --input-len 512 --output-len 256 --runs 3 --stream-mode final --temperature 1.0 --json "$OUT/t1-06-$v.json"; done ;;
  ladder) step ladder 240 python3 scripts/bi_matmul_bench.py --base-split0 --configs --no-norms --reps 15 ;;
  tiles) step tiles 240 python3 scripts/bi_matmul_bench.py --configs n64s6,k128s4,s6,m128w8nest4,m128w8nest3,m128n256w8nest,m256w8nest,m128n256w8s4,m256n128w8s3 --no-norms --reps 10 ;;
  smallm) step smallm 250 python3 scripts/bi_matmul_bench.py --configs m16,m16n64s6,sk512,sk512n64s6,sk512k128s4,sk512m16,sk256,sk1024 --shapes qkv,o,gate_up,down --ms 1,8,64 --no-norms --reps 10 ;;
  smallm2) step smallm2 200 python3 scripts/bi_matmul_bench.py --configs m16,m16n64s6,m16n64s8,m16n32s8,m32,m32n64s6,m32k128s4,n64s6,k128s4 --shapes qkv,o,gate_up,down --ms 1,8,16,32,64 --no-norms --reps 10 ;;
  smallm3) step smallm3 200 python3 scripts/bi_matmul_bench.py --configs m16,m16n64s6,m32,m32n64s6,m32k128s4,k128s4,n64s6 --shapes qkv,o,gate_up,down --ms 1,8,16,32,64,128,256 --no-norms --reps 10 ;;
  smallm4) step smallm4 200 python3 scripts/bi_matmul_bench.py --configs sk2048,sk2048m16,sk2048m16n64s6,sk2048m32,sk2048n64s6,sk0m16n32s8,sk0m16n32k128s6,sk0n32k128s6,sk0n32s8,sk0m32n32s8 --shapes qkv,o,down --ms 1,8,64,256 --no-norms --reps 10 ;;
  bigm4) step bigm4 90 python3 scripts/bi_matmul_bench.py --configs sk0wide,sk2048wide --shapes qkv,o,down --ms 4096 --no-norms --reps 10 ;;
  smallm5) step smallm5 200 python3 scripts/bi_matmul_bench.py --configs n64s6,k128s4,m16,m16n64s6,m32,m128w8nest4 --shapes qkv,o,gate_up,down --ms 16,32,48,96,128,256 --no-norms --reps 10 ;;
  bigm) step bigm 90 python3 scripts/bi_matmul_bench.py --configs sk512wide --shapes qkv,o,gate_up,down --ms 256,4096 --no-norms --reps 10 ;;
  attnsweep) step attnsweep 200 python3 scripts/gpu_attention_bench.py --sweep ;;
  prof8det) step prof8det 120 $B --preset qwen3-8b --num-prompts 256 --input-len 512 --output-len 256 --runs 1 --stream-mode final --enable-deterministic-inference --profile 30 ;;
  prof06) step prof06 90 $B --preset qwen3-0.6b --num-prompts 256 --input-len 512 --output-len 256 --runs 1 --stream-mode final --profile 25 ;;
  profitlold) step profitlold 60 $OFF $B --preset qwen3-0.6b --num-prompts 1 --input-len 512 --output-len 256 --runs 1 --stream-mode stream --profile 25 ;;
  profitl) step profitl 60 $B --preset qwen3-0.6b --num-prompts 1 --input-len 512 --output-len 256 --runs 1 --stream-mode stream --profile 25 ;;
  prof8_32) for f in "" --enable-deterministic-inference; do  # 8B at bs 32, normal then deterministic: the top kernels
      step prof8_32$f 90 $B --preset qwen3-8b --num-prompts 32 --input-len 512 --output-len 256 --runs 1 --stream-mode final --profile 30 $f; done ;;
  prof8) step prof8 100 $B --preset qwen3-8b --num-prompts 256 --input-len 512 --output-len 256 --runs 1 --stream-mode final --profile 25 ;;
  detcost*)  # detcost[-quick|-det]: det vs normal (-det: det runs only), Qwen3-8B shape, random 512/256, at bs 1, 32, 256
    runs=3; [[ $s == *quick ]] && runs=1; modes="normal det"; [[ $s == *det ]] && modes=det
    for bs in 1 32 256; do for mode in $modes; do
      flag=""; [[ $mode == det ]] && flag="--enable-deterministic-inference"
      step "detcost-$mode-bs$bs" 150 $B --preset qwen3-8b --num-prompts $bs --input-len 512 --output-len 256 --runs $runs --stream-mode final $flag --json "/tmp/detcost-$mode-bs$bs.json"
    done; done
    python3 scripts/summarize_bench.py /tmp/detcost-*.json > "$OUT/detcost.txt" ;;
  *) echo "unknown step $s" ;;
esac; done
