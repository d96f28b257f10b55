"""Benchmark: the search corpus's BM25 index built once per node (envs.search.BM25Index.for_corpus) beside what every
rank paid before (its own in-memory index): build time, peak memory, disk, the load time of the saved index in a
fresh process, and query latency, on a synthetic wiki-18-style corpus (passages of --words words, Zipf-distributed
over a --vocab-word vocabulary; real text has a longer tail, so treat the figures as a lower bound).

    python bench/bm25_index.py --passages 200000 --ranks 8        # ~1 min; prints the table, extrapolates to 21M
"""
import argparse
import itertools
import json
import os
import random
import resource
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

LOAD = ("import resource, sys, time; from envs.search import BM25Index; r0 = resource.getrusage(resource.RUSAGE_SELF)"
        ".ru_maxrss; t = time.time(); i = BM25Index.for_corpus(sys.argv[1]); load = time.time() - t; t = time.time(); "
        "[i.search(f'w{k} w{k * 7} w{k * 31}', 3) for k in range(1, 201)]; q = (time.time() - t) / 200; "
        "print(load, q, (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - r0) / 1024)")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--passages", type=int, default=200_000)
    p.add_argument("--words", type=int, default=100, help="words per passage (wiki-18: 100)")
    p.add_argument("--vocab", type=int, default=100_000)
    p.add_argument("--ranks", type=int, default=8, help="ranks per node, for the before/after columns")
    a = p.parse_args(argv)
    work = tempfile.mkdtemp(prefix="bm25-bench-")
    corpus = os.path.join(work, "corpus.jsonl")
    rng = random.Random(0)
    cum = list(itertools.accumulate(1.0 / (i + 1) for i in range(a.vocab)))
    with open(corpus, "w") as f:
        for i in range(a.passages):
            words = rng.choices(range(a.vocab), cum_weights=cum, k=a.words)
            f.write(json.dumps({"id": str(i), "contents": f'"T{i}"\n' + " ".join(f"w{w}" for w in words)}) + "\n")
    os.environ["ACLARENA_CACHE"] = os.path.join(work, "cache")
    from envs.search import BM25Index
    r0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t = time.time()
    BM25Index.for_corpus(corpus)
    build = time.time() - t
    peak = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - r0) / 1024
    disk = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(os.environ["ACLARENA_CACHE"]) for f in fs)
    out = subprocess.run([sys.executable, "-c", LOAD, corpus], cwd=ROOT, capture_output=True, text=True, check=True)
    load, query, load_mb = map(float, out.stdout.split()[-3:])
    mb = os.path.getsize(corpus) / 2**20
    scale = 21_000_000 / a.passages
    print(f"corpus: {a.passages:,} passages, {mb:.0f} MiB; index on disk {disk / 2**20:.0f} MiB (with the passages)")
    print(f"| per node, {a.ranks} ranks | build s | peak memory GB | a rank's load s | query ms |")
    print("|---|---|---|---|---|")
    print(f"| before: every rank builds its own | {build:.1f} (each, at once) | {a.ranks * peak / 1024:.1f} | - | "
          f"{query * 1000:.2f} |")
    print(f"| for_corpus: local rank 0 builds, all load it mapped | {build:.1f} (once) | "
          f"{(peak + a.ranks * load_mb) / 1024:.1f} | {load:.2f} | {query * 1000:.2f} |")
    print(f"wiki-18 (21M passages), extrapolated linearly: build ~{build * scale / 60:.0f} min, peak ~{peak * scale / 1024:.0f} GB "
          f"once per node (before: that in each of {a.ranks} ranks)")


if __name__ == "__main__":
    main()
