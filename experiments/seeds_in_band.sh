#!/bin/bash
# The main job for 3 seeds, each plainly and with 8 host devices (other numerics), then every
# budget's deployed counts and their ratio to the target (issue 20's table). About 20 minutes
# on 2 cores. Usage: experiments/seeds_in_band.sh [workdir root] (default runs/seeds).
set -euo pipefail
root=${1:-runs/seeds}
mkdir -p "$root"
for seed in 0 1 2; do
  for devices in 1 8; do
    dir="$root/seed$seed-dev$devices"
    if [ "$devices" = 8 ]; then
      XLA_FLAGS=--xla_force_host_platform_device_count=8 python -m elastic_jax.train \
          --config.seed=$seed --workdir="$dir" > "$dir.log" 2>&1 || { tail "$dir.log"; exit 1; }
    else
      python -m elastic_jax.train --config.seed=$seed --workdir="$dir" > "$dir.log" 2>&1 \
          || { tail "$dir.log"; exit 1; }
    fi
    echo "== seed $seed, $devices host device(s)"
    grep -E "^budget .* argmax" "$dir.log"
    grep -E "^\| (full|medium|small) " "$dir.log"
  done
done
