"""The grammar host's limits, measured: how many cores really run in parallel (a pure-Python loop on
1-16 processes at once), xgrammar's accept and mask-fill cost for 64 matchers of bench structured's
schema mix in one process (BatchGrammarMatcher on 1, 8, 16 threads), and the per-step wall time when
the 64 matchers are split over K worker processes (tokens sent over pipes, masks written to shared
memory). No GPU needed.

    python benchmarks/grammar_host_bench.py --tokenizer smollm2-135m-instruct --out host.json
"""
import json, os, random, sys, time, multiprocessing as mp
import numpy as np

def spin(n):
    t0 = time.perf_counter(); x = 0
    for i in range(n): x += i * i
    return time.perf_counter() - t0

def scaling():
    out = {}
    base = spin(3_000_000)
    for n in (1, 2, 4, 8, 12, 16):
        with mp.get_context("fork").Pool(n) as p:
            p.map(spin, [10] * n)
            t0 = time.perf_counter(); p.map(spin, [3_000_000] * n); out[n] = time.perf_counter() - t0
    return base, out

def setup(tokdir, V=151936):
    import xgrammar as xgr

    from tokenmill.bench.structured import SCHEMA_MIX
    from tokenmill.loader.load import load_tokenizer
    tok = load_tokenizer(tokdir)
    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=V)
    comp = xgr.GrammarCompiler(info, max_threads=2, cache_enabled=False)
    gs = [comp.compile_json_schema(json.dumps(s), any_whitespace=False) for s in SCHEMA_MIX]
    return xgr, tok, gs

def pick(mask_row, rv, rng):
    ar = np.arange(rv)
    bits = (mask_row.view(np.uint32)[ar // 32] >> (ar % 32)) & 1
    al = np.flatnonzero(bits)
    return int(al[rng.randrange(len(al))]) if len(al) else 0

def inproc(tokdir, threads, B=64, steps=60):
    xgr, tok, gs = setup(tokdir)
    rng = random.Random(0); rv = len(tok)
    ms = [xgr.GrammarMatcher(gs[i % len(gs)]) for i in range(B)]
    mask = xgr.allocate_token_bitmask(B, 151936); bm = xgr.BatchGrammarMatcher(threads)
    tf, ta = [], []
    for s in range(steps):
        t0 = time.perf_counter(); bm.batch_fill_next_token_bitmask(ms, mask); tf.append(time.perf_counter() - t0)
        m_np = mask.numpy(); toks = [pick(m_np[j], rv, rng) for j in range(B)]
        t0 = time.perf_counter()
        for m, t in zip(ms, toks):
            m.accept_token(t); m.is_terminated()
        ta.append(time.perf_counter() - t0)
    return {"fill_ms": 1e3 * float(np.median(tf[5:])), "accept_ms": 1e3 * float(np.median(ta[5:]))}

def worker(conn, tokdir, idxs, shm_name, B, W):
    from multiprocessing import shared_memory
    os.environ["OMP_NUM_THREADS"] = "1"
    xgr, tok, gs = setup(tokdir)
    import torch
    shm = shared_memory.SharedMemory(name=shm_name)
    arr = np.ndarray((B, W), np.int32, buffer=shm.buf)
    t = torch.from_numpy(arr)
    ms = {i: xgr.GrammarMatcher(gs[i % len(gs)]) for i in idxs}
    conn.send("ready")
    while True:
        msg = conn.recv()
        if msg is None: break
        for i, tk in zip(idxs, msg):
            if tk >= 0: ms[i].accept_token(tk)
        for i in idxs: ms[i].fill_next_token_bitmask(t, i)
        conn.send(1)
    shm.close()

def multiproc(tokdir, K, B=64, steps=60):
    from multiprocessing import shared_memory
    W = -(-151936 // 32)
    shm = shared_memory.SharedMemory(create=True, size=B * W * 4)
    arr = np.ndarray((B, W), np.int32, buffer=shm.buf)
    ctx = mp.get_context("spawn")
    parts = [list(range(k, B, K)) for k in range(K)]
    conns, procs = [], []
    for k in range(K):
        a, b = ctx.Pipe()
        p = ctx.Process(target=worker, args=(b, tokdir, parts[k], shm.name, B, W), daemon=True); p.start()
        conns.append(a); procs.append(p)
    for c in conns: c.recv()
    from tokenmill.loader.load import load_tokenizer
    rv = len(load_tokenizer(tokdir)); rng = random.Random(0)
    toks = [-1] * B; ts = []
    for s in range(steps):
        t0 = time.perf_counter()
        for k, c in enumerate(conns): c.send([toks[i] for i in parts[k]])
        for c in conns: c.recv()
        ts.append(time.perf_counter() - t0)
        toks = [pick(arr[j], rv, rng) for j in range(B)]
    for c in conns: c.send(None)
    for p in procs: p.join()
    shm.close(); shm.unlink()
    return 1e3 * float(np.median(ts[5:]))

def main():
    import argparse
    p = argparse.ArgumentParser()
    p.add_argument("--tokenizer", default="smollm2-135m-instruct")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    tokdir = args.tokenizer
    res = {}
    for f in ("/sys/fs/cgroup/cpu.max", "/sys/fs/cgroup/cpuset.cpus.effective"):
        try:
            res[f] = open(f).read().strip()
        except OSError as e:
            res[f] = repr(e)
    res["nproc"] = os.cpu_count(); res["affinity"] = len(os.sched_getaffinity(0))
    base, sc = scaling(); res["spin_single_s"] = base; res["spin_parallel_s"] = sc
    for th in (1, 8, 16):
        res[f"inproc_{th}_threads"] = inproc(tokdir, th)
    for K in (4, 8, 12):
        res[f"multiproc_{K}_step_ms"] = multiproc(tokdir, K)
    print(json.dumps(res, indent=1))
    if args.out:
        json.dump(res, open(args.out, "w"), indent=1)


if __name__ == "__main__":
    main()
