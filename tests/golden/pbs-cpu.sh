#!/usr/bin/env bash

#PBS -N ck-pbs-cpu-<id>
#PBS -q workq
#PBS -A proj42
#PBS -l select=1:ncpus=8:mem=32GB
#PBS -l walltime=30:00:00
#PBS -e /shared/logs/dask/
#PBS -o /shared/logs/dask/
#PBS -j oe
module load python/3.11
export CLUSTERKIT_WEB_TOKEN_FILE='<cluster-dir>/web-token'
/opt/venv/bin/python -m distributed.cli.dask_worker tls://<scheduler-address>:8786 --name <worker-name> --nthreads 2 --memory-limit 8.00GiB --nworkers 4 --nanny --death-timeout 60 --lifetime 107400s --lifetime-stagger 300s --preload clusterkit.webauth --interface ib0 --protocol tls:// --tls-ca-file <cluster-dir>/ca.pem --tls-cert <cluster-dir>/worker-cert.pem --tls-key <cluster-dir>/worker-key.pem
