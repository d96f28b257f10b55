"""Run by tests/test_eval_parallel.py: `python tests/eval_slow_worker.py evaluate.py-flags...` is evaluate.py with every
JSON it saves logged to $ACL_TEST_SAVES (one path a line), the --devices worker $ACL_TEST_SLOW (ACL_EVAL_WORKER) taking
3 s longer for each save, and the worker $ACL_TEST_FAIL failing at its first checkpoint. The launcher starts its
workers as the script it was started as (sys.argv[0]), so the workers run this file too."""
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import evaluate  # noqa: E402

real_save, real_eval = evaluate.save_results, evaluate.evaluate_ckpt
worker = os.environ.get("ACL_EVAL_WORKER")


def save(path, results):
    if worker is not None and worker == os.environ.get("ACL_TEST_SLOW"):
        time.sleep(3)
    with open(os.environ["ACL_TEST_SAVES"], "a") as f:
        f.write(path + "\n")
    return real_save(path, results)


def evaluate_ckpt(path, *args, **kwargs):
    if worker is not None and worker == os.environ.get("ACL_TEST_FAIL"):
        raise RuntimeError(f"worker {worker} fails on {path} (test)")
    return real_eval(path, *args, **kwargs)


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    evaluate.save_results, evaluate.evaluate_ckpt = save, evaluate_ckpt
    evaluate.main()
