#!/bin/bash
# The A/B behind this directory: main before the change (d5a69c1, checked out in $BASE) and the new
# tree ($NEW) taking turns, three rounds each, 2 ranks under MPICH's mpiexec on the 2-core VM.
set -u
BASE=${BASE:-/work/wt/base} NEW=${NEW:-/work/main} OUT=${OUT:-.}
for round in 1 2 3; do
  for tree in base new; do
    dir=$BASE; [ $tree = new ] && dir=$NEW
    mpiexec -n 2 python $dir/benchmarks/collective_bench.py --backends ring --sizes 4K,1M,25M \
      --csv $OUT/coll_${tree}_$round.csv
  done
done
for round in 1 2 3; do
  for tree in base new; do
    dir=$BASE; [ $tree = new ] && dir=$NEW
    mpiexec -n 2 python $dir/benchmarks/allreduce_bench.py --backends ring --references none \
      --sizes 4K,64K,1M,25M --csv $OUT/allreduce/ar_${tree}_$round.csv
  done
done
