"""The decode engine's time to first token for prompts whose KV blocks a prefill engine wrote (both in
one process on the CPU, the embedded model, SharedStorageConnector through /dev/shm), and the
consumer's load seconds: what a load costs beside the little left to compute.

    python benchmarks/cpu_pd_load.py [--prompt-len 1200] [--repeat 5] [--io-threads 4]
"""

import argparse
import json
import logging
import os
import shutil
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tokenmill.config import EngineConfig, KVTransferConfig  # noqa: E402
from tokenmill.engine.llm_engine import LLMEngine  # noqa: E402
from tokenmill.entrypoints.llm import LLM  # noqa: E402
from tokenmill.loader import load_model  # noqa: E402
from tokenmill.sampling_params import SamplingParams  # noqa: E402

logger = logging.getLogger("cpu_pd_load")


def engine(loaded, role: str, path: str, io_threads: int) -> LLM:
    kv = KVTransferConfig("SharedStorageConnector", role, {"path": path, "io_threads": io_threads})
    return LLM.from_engine(LLMEngine(config=EngineConfig(num_kv_blocks=512, kv_transfer_config=kv), loaded=loaded))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompt-len", type=int, default=1200)
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--io-threads", type=int, default=4)
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    root = "/dev/shm" if os.path.isdir("/dev/shm") else None
    path = tempfile.mkdtemp(prefix="tokenmill-pd-bench-", dir=root)
    try:
        loaded = load_model(None, dtype="float32", device="cpu")
        producer = engine(loaded, "kv_producer", path, args.io_threads)
        consumer = engine(loaded, "kv_consumer", path, args.io_threads)
        one = SamplingParams(temperature=0, max_tokens=1)
        ttft = []
        for r in range(args.repeat):
            prompt = [1000 + r] + [(7 * i + r) % 20000 + 5 for i in range(args.prompt_len)]  # new blocks each run
            producer.generate([prompt], one, use_tqdm=False)
            started = time.perf_counter()
            out = consumer.generate([prompt], one, use_tqdm=False)[0]
            ttft.append((time.perf_counter() - started) * 1e3)
            assert out.metrics.num_cached_prompt_tokens > 0, "nothing was loaded"
        moved = consumer.engine.snapshot().kv_transfer
        result = {"prompt_tokens": args.prompt_len + 1, "io_threads": args.io_threads, "ttft_ms": ttft,
                  "ttft_ms_median": statistics.median(ttft), "blocks_loaded": moved.blocks_loaded,
                  "bytes_loaded": moved.bytes_loaded, "load_ms_mean": 1e3 * moved.load_seconds / args.repeat}
        logger.info("%s", json.dumps(result))
    finally:
        shutil.rmtree(path, ignore_errors=True)


if __name__ == "__main__":
    main()
