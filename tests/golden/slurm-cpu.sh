#!/usr/bin/env bash

#SBATCH -J ck-slurm-cpu-<id>
#SBATCH -e /shared/logs/dask/ck-slurm-cpu-<id>-%J.err
#SBATCH -o /shared/logs/dask/ck-slurm-cpu-<id>-%J.out
#SBATCH -p batch
#SBATCH -A proj42
#SBATCH -n 1
#SBATCH --cpus-per-task=8
#SBATCH --mem=32G
#SBATCH -t 02:00:00
#SBATCH --exclusive
module load python/3.11
export OMP_NUM_THREADS=4
/opt/venv/bin/python -m distributed.cli.dask_worker tcp://<scheduler-address>:8786 --name <worker-name> --nthreads 4 --memory-limit 16.00GiB --nworkers 2 --nanny --death-timeout 60 --local-directory /scratch/$USER --lifetime 6600s --lifetime-stagger 300s --interface ib0 --protocol tcp://
