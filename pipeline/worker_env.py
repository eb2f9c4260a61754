"""The environment of stage workers: what a stage's Ray task (pipeline/runner.py) and the workers a stage
starts itself (shard tasks, pipeline/shards.py; Ray Train ranks) get from the process `hylight run` was started
in, and the defaults each fills in where the user set nothing."""

from __future__ import annotations

import os
from collections.abc import Mapping

# Variables a stage's worker gets from the environment `hylight run` was started in. Ray starts workers
# with the raylet's environment, not the driver's, so whatever a user sets for a run (NCCL_DEBUG,
# TRITON_CACHE_DIR, HF_HOME, ...) has to be carried over explicitly.
FORWARDED_ENV_PREFIXES = ("HF_", "TRANSFORMERS_", "HYLIGHT_", "NCCL_", "CUDA_", "TORCH_", "TRITON_", "DS_",
                          "OMP_", "PYTORCH_", "NVSHMEM_")
# Chosen per task or per launch, never copied from the driver: Ray sets each task's GPUs, a launcher its
# rendezvous; the runner sets OMP_NUM_THREADS from the stage's cpus.
NOT_FORWARDED = frozenset({"CUDA_VISIBLE_DEVICES", "MASTER_ADDR", "MASTER_PORT", "OMP_NUM_THREADS"})

# names apply_env_defaults() filled in (not chosen by the user): each node decides those for itself
_DEFAULTED: set[str] = set()


def apply_env_defaults(gpus: float | None = None, user_set: Mapping[str, str] | None = None) -> None:
    """Process-wide defaults where the user set nothing. On the driver (``gpus`` None) DeepSpeed's
    accelerator follows this machine; on a stage worker it follows the GPUs the task holds, whatever the
    worker inherited, unless the user's own value was forwarded (``user_set``, the task's env)."""
    defaults = {
        "OMP_NUM_THREADS": "1",  # torch threads thrash on small CPU boxes (ENV-NOTES); stages raise it
        "TOKENIZERS_PARALLELISM": "false",
        "HF_HUB_OFFLINE": "1",
        "DS_ACCELERATOR": "cuda" if (os.path.exists("/dev/nvidia0") if gpus is None else gpus > 0) else "cpu",
    }
    for k, v in defaults.items():
        if k not in os.environ:
            os.environ[k] = v
            _DEFAULTED.add(k)
    if gpus is not None and "DS_ACCELERATOR" not in (user_set or {}):
        os.environ["DS_ACCELERATOR"] = defaults["DS_ACCELERATOR"]
        _DEFAULTED.add("DS_ACCELERATOR")  # this task's choice: workers it launches choose their own


def forwarded_env(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The variables of ``environ`` (default: this process, less the defaults it filled in itself) that
    stage workers receive. Workers a stage starts itself get them through :func:`launched_worker_env`."""
    skip = NOT_FORWARDED | (_DEFAULTED if environ is None else frozenset())
    environ = os.environ if environ is None else environ
    return {k: v for k, v in environ.items() if k.startswith(FORWARDED_ENV_PREFIXES) and k not in skip}


THREAD_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "RAYON_NUM_THREADS")


def launched_worker_env(cpus: float, gpus: float) -> dict[str, str]:
    """The environment for workers a stage starts itself (Ray Train: ``runtime_env={"env_vars": ...}``), each
    with ``cpus`` CPUs and ``gpus`` GPUs: the forwarded variables (NCCL_, CUDA_, TRITON_, ...), thread counts
    from ``cpus``, and ``DS_ACCELERATOR`` from ``gpus`` unless the user set it. Called from the stage's
    process, which holds no GPU itself when it launches workers: its own DS_ACCELERATOR and
    CUDA_VISIBLE_DEVICES are not the workers'."""
    env = forwarded_env()
    env.update(dict.fromkeys(THREAD_VARS, str(max(1, int(cpus)))))
    env.setdefault("DS_ACCELERATOR", "cuda" if gpus > 0 else "cpu")
    return env
