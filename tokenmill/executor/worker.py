"""A tensor-parallel worker process: `python -m tokenmill.executor.worker`, started by rank 0
(executor/tensor_parallel.py) with its rank, the world size, rank 0's store address and rank 0's pid
in the environment. A fresh interpreter: the user's main module is never imported here."""

import logging
import os


def main() -> int:
    from tokenmill.executor.tensor_parallel import (ENV_PARENT, ENV_RANK, ENV_STORE, ENV_WORLD,
                                                    run_spawned_worker)

    logging.basicConfig(level=logging.WARNING)
    env = os.environ
    return run_spawned_worker(env[ENV_STORE], int(env[ENV_RANK]), int(env[ENV_WORLD]), int(env[ENV_PARENT]))


if __name__ == "__main__":
    os._exit(main())  # skip interpreter teardown (CUDA and Triton's native state), as the engine process does
