#!/usr/bin/env bash
# Final A/B: the round's base (c2d86fa, /work/wt/baseline) against main, taking turns, 3 runs each.
set -u
export OMP_NUM_THREADS=1
OUT=/work/ab/out; mkdir -p $OUT
for i in 1 2 3; do
  for tree in baseline main; do
    if [[ $tree == baseline ]]; then D=/work/wt/baseline; EXTRA=""; else D=/work/main; EXTRA="--debug off"; fi
    cd $D
    echo "== $(date +%T) ddp $tree $i"; timeout 900 .venv/bin/python benchmarks/ddp_step_bench.py --spawn 2 --backends ring,gloo --baselines none,ddp-null,torch-ddp --hooks none --steps 12 $EXTRA --csv $OUT/ddp-$tree-$i.csv > $OUT/ddp-$tree-$i.log 2>&1; echo rc=$?
    echo "== $(date +%T) allreduce $tree $i"; timeout 600 .venv/bin/mpiexec -n 2 .venv/bin/python benchmarks/allreduce_bench.py --backends ring,gloo,mpi --sizes 4K,1M,25M,100M --buffers both --csv $OUT/ar-$tree-$i.csv > $OUT/ar-$tree-$i.log 2>&1; echo rc=$?
  done
  cd /work/main
  echo "== $(date +%T) collective $i"; timeout 600 .venv/bin/mpiexec -n 2 .venv/bin/python benchmarks/collective_bench.py --backends ring --sizes 4K,1M,25M --csv $OUT/coll-$i.csv > $OUT/coll-$i.log 2>&1; echo rc=$?
  echo "== $(date +%T) torch adapter $i"; timeout 900 .venv/bin/python benchmarks/torch_backend_bench.py --spawn 2 --csv $OUT/tb-$i.csv > $OUT/tb-$i.log 2>&1; echo rc=$?
  echo "== $(date +%T) torch adapter 1 rank $i"; timeout 300 .venv/bin/python benchmarks/torch_backend_bench.py --spawn 1 --skip-ddp --iters 2000 --csv $OUT/tb1-$i.csv > $OUT/tb1-$i.log 2>&1; echo rc=$?
done
echo "== $(date +%T) done"
