#!/usr/bin/env bash

#SBATCH -J ck-slurm-gpus-per-task-<id>
#SBATCH -p gpu
#SBATCH -n 1
#SBATCH --cpus-per-task=8
#SBATCH --mem=64G
#SBATCH -t 04:00:00
#SBATCH --gpus-per-task=1
export DASK_DISTRIBUTED__WORKER__LIFETIME__DURATION=13800s
export DASK_DISTRIBUTED__WORKER__LIFETIME__STAGGER=300s
/opt/venv/bin/python -m dask_cuda.cli tcp://<scheduler-address>:8786 --name <worker-name> --nthreads 8 --memory-limit 64.00GiB --death-timeout 60 --resources GPU=1 --protocol tcp://
