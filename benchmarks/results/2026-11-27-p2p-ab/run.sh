#!/bin/bash
# The A/B behind this directory: the previous main (174ffab, checked out in $BASE) and the new tree
# ($NEW) taking turns, three rounds each, 2 ranks under MPICH's mpiexec on the 2-core VM.
set -u
BASE=${BASE:-/work/wt/base} NEW=${NEW:-/work/main} OUT=${OUT:-.}
for round in 1 2 3; do
  for tree in base new; do
    dir=$BASE; [ $tree = new ] && dir=$NEW
    mpiexec -n 2 python $dir/benchmarks/collective_bench.py --backends ring --sizes 4K,1M,25M \
      --csv $OUT/coll_${tree}_$round.csv
  done
done
for suffix in "" _b; do  # the all-reduce twice: 4K..100M, then 1M..100M again (the first set had a disturbed run)
  sizes=4K,64K,1M,25M,100M; [ -n "$suffix" ] && sizes=1M,25M,100M
  for round in 1 2 3; do
    for tree in base new; do
      dir=$BASE; [ $tree = new ] && dir=$NEW
      mpiexec -n 2 python $dir/benchmarks/allreduce_bench.py --backends ring --references none \
        --sizes $sizes --csv $OUT/allreduce/ar_${tree}_$round$suffix.csv
    done
  done
done
# Set c: 1M and 25M, six rounds each, taking turns (the machine had slipped into a state where the
# plain ring path ran 4x slower for both trees; ring+buf did not).
for round in 1 2 3 4 5 6; do
  for tree in base new; do
    dir=$BASE; [ $tree = new ] && dir=$NEW
    mpiexec -n 2 python $dir/benchmarks/allreduce_bench.py --backends ring --references none \
      --sizes 1M,25M --csv $OUT/allreduce/ar_${tree}_${round}_c.csv
  done
done
