#!/usr/bin/env bash

#PBS -N ck-pbs-gpu-<id>
#PBS -q gpuq
#PBS -l select=1:ncpus=16:mem=128GB:ngpus=2
#PBS -l walltime=04:00:00
module load cuda/12.4
export CLUSTERKIT_WEB_TOKEN_FILE='<cluster-dir>/web-token'
export DASK_DISTRIBUTED__WORKER__LIFETIME__DURATION=13800s
export DASK_DISTRIBUTED__WORKER__LIFETIME__STAGGER=300s
export UCX_WARN_UNUSED_ENV_VARS=n
/opt/venv/bin/python -m dask_cuda.cli ucx://<scheduler-address>:8786 --name <worker-name> --nthreads 8 --memory-limit 64.00GiB --death-timeout 60 --resources GPU=1 --enable-tcp-over-ucx --enable-nvlink --enable-infiniband --preload clusterkit.webauth --interface ib0 --protocol ucx://
