#!/usr/bin/env bash
# Where the image server's time goes under load (GPU machine; python -m benchmarks.suite mmspy): starts mm_serve on the
# LLaVA-NeXT-7B shape and, once requests flow, records 10 s of py-spy on the server's frontend process (--gil:
# what holds its GIL, per thread), the engine core and the load-generating client, plus a `top` snapshot.
# Writes $OUT/front.txt, engine.txt, client.txt (py-spy raw: collapsed stacks with sample counts), mm.txt, top.txt.
# Needs py-spy (scripts/device_wheels.sh fetches it into .whl; found in bin/ of a PYTHONPATH folder, or SPY=path).
# MODEL_DIR: the LLaVA-NeXT-7B-shaped folder (written if absent); N: --image-render-processes.
set -u
if [ -z "${SPY:-}" ]; then
  for d in ${PYTHONPATH//:/ }; do [ -x "$d/bin/py-spy" ] && SPY=$d/bin/py-spy && break; done
fi
SPY=${SPY:-py-spy}
M=${MODEL_DIR:?set MODEL_DIR to the model folder}; python3 -m benchmarks.mm_serve --write-model $M > /dev/null
N=${N:-8}
python3 -m benchmarks.mm_serve --model-dir $M --server-log "$OUT/k.log" --num-requests 320 \
  --server-args "--load-format dummy --max-model-len 4096 --image-render-processes $N" > "$OUT/mm.txt" 2>&1 &
B=$!
for i in $(seq 300); do grep -q "POST /v1/chat" "$OUT/k.log" 2> /dev/null && break; sleep 0.5; done
FP=$(grep -o "Started server process \[[0-9]*\]" "$OUT/k.log" | grep -o "[0-9]*")
EP=$(grep -o "engine core 0 ready (pid [0-9]*" "$OUT/k.log" | grep -o "[0-9]*$")
echo "frontend $FP engine $EP client $B"; sleep 4
$SPY record -p "$FP" -r 200 -d 10 --format raw -o "$OUT/front.txt" --threads --gil --nonblocking > /dev/null 2>&1 &
$SPY record -p "$EP" -r 200 -d 10 --format raw -o "$OUT/engine.txt" --nonblocking > /dev/null 2>&1 &
$SPY record -p "$B" -r 200 -d 10 --format raw -o "$OUT/client.txt" --nonblocking > /dev/null 2>&1 &
sleep 3; top -b -n 1 -w 200 | head -30 > "$OUT/top.txt"
wait $B; tail -14 "$OUT/mm.txt"
