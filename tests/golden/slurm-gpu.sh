#!/usr/bin/env bash

#SBATCH -J ck-slurm-gpu-<id>
#SBATCH -p gpu
#SBATCH -A proj42
#SBATCH -n 1
#SBATCH --cpus-per-task=16
#SBATCH --mem=128G
#SBATCH -t 1-00:00:00
#SBATCH --gres=gpu:2
module load cuda/12.4
export DASK_DISTRIBUTED__WORKER__LIFETIME__DURATION=85800s
export DASK_DISTRIBUTED__WORKER__LIFETIME__STAGGER=300s
/opt/venv/bin/python -m dask_cuda.cli tcp://<scheduler-address>:8786 --name <worker-name> --nthreads 8 --memory-limit 64.00GiB --death-timeout 60 --resources GPU=1 --interface ib0 --protocol tcp://
